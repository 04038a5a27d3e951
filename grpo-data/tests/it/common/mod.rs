//! Test helpers: small record batches of every column type, written in any format.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use grpo_data::arrow::array::{
    ArrayRef, BooleanArray, Float64Array, Int64Array, ListBuilder, RecordBatch, StringArray,
    StringBuilder, StructArray,
};
use grpo_data::arrow::buffer::OffsetBuffer;
use grpo_data::arrow::datatypes::{DataType, Field, Fields, Schema, SchemaRef};
use grpo_data::{Dataset, Message, OpenOptions, Prompt, Sample, Value};

trait Pipe: Sized {
    fn pipe<T>(self, f: impl FnOnce(Self) -> T) -> T {
        f(self)
    }
}
impl<T> Pipe for T {}

pub fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

/// Rows `start..start+n` of a table with every supported column type.
pub fn typed_batch(start: u64, n: usize, with_list: bool) -> RecordBatch {
    let ids: Vec<u64> = (start..start + n as u64).collect();
    let mut fields = vec![
        Field::new("prompt", DataType::Utf8, true),
        Field::new("answer", DataType::Utf8, true),
        Field::new("n", DataType::Int64, true),
        Field::new("score", DataType::Float64, true),
        Field::new("flag", DataType::Boolean, true),
    ];
    let mut cols: Vec<ArrayRef> = vec![
        Arc::new(StringArray::from_iter_values(
            ids.iter().map(|i| format!("question {i}?")),
        )),
        Arc::new(StringArray::from(
            ids.iter()
                .map(|i| (i % 5 != 3).then(|| format!("ans {i}")))
                .collect::<Vec<_>>(),
        )),
        Arc::new(Int64Array::from_iter_values(
            ids.iter().map(|&i| i as i64 * 3 - 7),
        )),
        Arc::new(Float64Array::from_iter_values(
            ids.iter().map(|&i| i as f64 + 0.5),
        )),
        Arc::new(BooleanArray::from_iter(
            ids.iter().map(|i| Some(i % 2 == 0)),
        )),
    ];
    if with_list {
        fields.push(Field::new(
            "tags",
            DataType::List(Arc::new(Field::new_list_field(DataType::Utf8, true))),
            true,
        ));
        let mut b = ListBuilder::new(StringBuilder::new());
        for i in &ids {
            for k in 0..(i % 3) {
                b.values().append_value(format!("t{k}"));
            }
            b.append(true);
        }
        cols.push(Arc::new(b.finish()));
    }
    RecordBatch::try_new(Arc::new(Schema::new(fields)), cols).expect("batch")
}

/// What `typed_batch` rows must read back as.
pub fn typed_expected(start: u64, n: usize, with_list: bool) -> Vec<Sample> {
    (start..start + n as u64)
        .map(|i| {
            let mut columns: Vec<(Arc<str>, Value)> = vec![
                (
                    "answer".into(),
                    if i % 5 != 3 {
                        Value::Str(format!("ans {i}"))
                    } else {
                        Value::Null
                    },
                ),
                ("n".into(), Value::Int(i as i64 * 3 - 7)),
                ("score".into(), Value::Float(i as f64 + 0.5)),
                ("flag".into(), Value::Bool(i % 2 == 0)),
            ];
            if with_list {
                columns.push((
                    "tags".into(),
                    Value::StrList((0..(i % 3)).map(|k| format!("t{k}")).collect()),
                ));
            }
            Sample {
                index: i,
                prompt: Prompt::Text(format!("question {i}?")),
                columns,
            }
        })
        .collect::<Vec<_>>()
        .pipe(norm)
}

/// A batch whose prompt is a conversation (list of {role, content}).
pub fn conversation_batch(n: usize) -> RecordBatch {
    let mut role = Vec::new();
    let mut content = Vec::new();
    let mut offsets = vec![0i32];
    for i in 0..n {
        role.push("system".to_string());
        content.push("Be brief.".to_string());
        role.push("user".to_string());
        content.push(format!("What is {i} + 1?"));
        offsets.push(offsets.last().copied().unwrap_or(0) + 2);
    }
    let fields = Fields::from(vec![
        Field::new("role", DataType::Utf8, true),
        Field::new("content", DataType::Utf8, true),
    ]);
    let structs = StructArray::new(
        fields.clone(),
        vec![
            Arc::new(StringArray::from(role)) as ArrayRef,
            Arc::new(StringArray::from(content)) as ArrayRef,
        ],
        None,
    );
    let item = Arc::new(Field::new_list_field(DataType::Struct(fields), true));
    let list = grpo_data::arrow::array::ListArray::new(
        item.clone(),
        OffsetBuffer::new(offsets.into()),
        Arc::new(structs),
        None,
    );
    let schema = Arc::new(Schema::new(vec![
        Field::new("prompt", DataType::List(item), true),
        Field::new("answer", DataType::Utf8, true),
    ]));
    RecordBatch::try_new(
        schema,
        vec![
            Arc::new(list),
            Arc::new(StringArray::from_iter_values(
                (0..n).map(|i| (i + 1).to_string()),
            )),
        ],
    )
    .expect("batch")
}

pub fn conversation_expected(n: usize) -> Vec<Sample> {
    (0..n)
        .map(|i| Sample {
            index: i as u64,
            prompt: Prompt::Conversation(vec![
                Message::new("system", "Be brief."),
                Message::new("user", format!("What is {i} + 1?")),
            ]),
            columns: vec![("answer".into(), Value::Str((i + 1).to_string()))],
        })
        .collect()
}

pub fn write(path: &Path, batches: Vec<RecordBatch>) -> PathBuf {
    let schema: SchemaRef = batches[0].schema();
    grpo_data::write_batches(path, None, schema, batches.into_iter().map(Ok)).expect("write");
    path.to_path_buf()
}

pub fn open(path: &Path) -> grpo_data::Result<Dataset> {
    Dataset::open(&[path.to_string_lossy()], &OpenOptions::default())
}

pub fn opts(chunk_rows: usize) -> OpenOptions {
    OpenOptions {
        chunk_rows,
        ..Default::default()
    }
}

/// Every sample, columns sorted by name (JSONL objects come back in key order).
pub fn read_all(d: &Dataset) -> Vec<Sample> {
    norm(d.head(usize::MAX >> 1).expect("read"))
}

pub fn norm(mut v: Vec<Sample>) -> Vec<Sample> {
    for s in &mut v {
        s.columns.sort_by(|a, b| a.0.cmp(&b.0));
    }
    v
}

pub fn write_text(path: &Path, text: &str) -> PathBuf {
    std::fs::write(path, text).expect("write");
    path.to_path_buf()
}
