//! Every error is one line naming the file and the column and row (or line) to fix.

use crate::common;

use std::sync::Arc;

use common::*;
use grpo_data::arrow::array::{ArrayRef, Int64Array, RecordBatch, StringArray};
use grpo_data::arrow::datatypes::{DataType, Field, Schema};
use grpo_data::{DataError, Dataset, Location, OpenOptions, SampleStream, StreamConfig};

fn one_line(e: &DataError) -> String {
    let s = e.to_string();
    assert!(!s.contains('\n'), "multi-line error: {s}");
    s
}

fn read_err(d: &Dataset) -> DataError {
    let mut s = SampleStream::new(
        d.clone(),
        StreamConfig {
            shuffle: false,
            ..Default::default()
        },
    )
    .expect("stream");
    loop {
        match s.next_sample() {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("no error"),
            Err(e) => return e,
        }
    }
}

#[test]
fn missing_file() {
    let dir = tmp();
    let p = dir.path().join("nope.parquet");
    let e = open(&p).expect_err("missing");
    assert!(matches!(e, DataError::NotFound { .. }));
    assert!(one_line(&e).contains("nope.parquet: no such file"));
    let e = Dataset::open(
        &[format!("{}/*.jsonl", dir.path().display())],
        &OpenOptions::default(),
    )
    .expect_err("empty glob");
    assert!(matches!(e, DataError::NotFound { .. }), "{e}");
}

#[test]
fn unknown_extension() {
    let dir = tmp();
    let p = write_text(&dir.path().join("data.txt"), "hello");
    let e = open(&p).expect_err("txt");
    assert!(matches!(e, DataError::UnknownExtension { ref ext, .. } if ext == ".txt"));
    let msg = one_line(&e);
    assert!(
        msg.contains("data.txt: unknown data format `.txt`"),
        "{msg}"
    );
}

#[test]
fn no_prompt_column_lists_columns_in_every_format() {
    for name in ["t.parquet", "t.arrow", "t.jsonl", "t.csv"] {
        let dir = tmp();
        let p = write(&dir.path().join(name), vec![typed_batch(0, 3, false)]);
        let o = OpenOptions {
            prompt_field: "question".into(),
            ..Default::default()
        };
        let e = Dataset::open(&[p.to_string_lossy()], &o).expect_err("no prompt");
        let msg = one_line(&e);
        assert!(matches!(e, DataError::NoPromptColumn { ref column, .. } if column == "question"));
        assert!(
            msg.contains(name) && msg.contains("no prompt column `question`"),
            "{msg}"
        );
        assert!(
            msg.contains("prompt") && msg.contains("answer") && msg.contains("score"),
            "{msg}"
        );
    }
}

#[test]
fn prompt_column_of_wrong_type() {
    let dir = tmp();
    let schema = Arc::new(Schema::new(vec![Field::new(
        "prompt",
        DataType::Int64,
        false,
    )]));
    let b = RecordBatch::try_new(
        schema,
        vec![Arc::new(Int64Array::from(vec![1, 2])) as ArrayRef],
    )
    .expect("batch");
    let p = write(&dir.path().join("w.parquet"), vec![b]);
    let e = open(&p).expect_err("int prompt");
    let msg = one_line(&e);
    assert!(
        matches!(e, DataError::WrongPromptType { at: Location::Schema, ref found, .. } if found == "Int64"),
        "{msg}"
    );
    assert!(
        msg.contains("prompt column `prompt`") && msg.contains("Int64"),
        "{msg}"
    );

    let p = write_text(
        &dir.path().join("w.jsonl"),
        "{\"prompt\": \"ok\"}\n{\"prompt\": 5}\n",
    );
    let e = read_err(&open(&p).expect("open"));
    assert!(
        matches!(
            e,
            DataError::WrongPromptType {
                at: Location::Line(2),
                ..
            }
        ),
        "{e}"
    );
    assert!(one_line(&e).contains("w.jsonl: prompt column `prompt` at line 2 has type number"));
}

#[test]
fn null_or_empty_prompt_at_row() {
    let dir = tmp();
    let schema = Arc::new(Schema::new(vec![Field::new(
        "prompt",
        DataType::Utf8,
        true,
    )]));
    let b = RecordBatch::try_new(
        schema,
        vec![Arc::new(StringArray::from(vec![
            Some("a"),
            Some("b"),
            None,
            Some(" "),
        ])) as ArrayRef],
    )
    .expect("batch");
    let p = write(&dir.path().join("n.parquet"), vec![b.clone()]);
    let d = open(&p).expect("open");
    let e = read_err(&d);
    assert!(
        matches!(
            e,
            DataError::NullPrompt {
                at: Location::Row(2),
                ..
            }
        ),
        "{e}"
    );
    assert!(one_line(&e).contains("n.parquet: null prompt in column `prompt` at row 2"));
    // validate lists both problems.
    let r = d.validate(10).expect("validate");
    assert_eq!((r.rows, r.bad_rows), (4, 2));
    assert!(
        r.issues[1].contains("empty prompt in column `prompt` at row 3"),
        "{:?}",
        r.issues
    );

    let p = write(&dir.path().join("n.csv"), vec![b]);
    let r = open(&p).expect("open csv").validate(10).expect("validate");
    assert_eq!(r.bad_rows, 2, "{:?}", r.issues);
    assert!(r.issues[0].contains("at row 2 (line 4)"), "{:?}", r.issues);

    let p = write_text(
        &dir.path().join("n.jsonl"),
        "{\"prompt\": \"a\"}\n{\"prompt\": \"\"}\n{\"answer\": \"1\"}\n",
    );
    let r = open(&p).expect("open").validate(10).expect("validate");
    assert!(
        r.issues[0].contains("empty prompt in column `prompt` at line 2"),
        "{:?}",
        r.issues
    );
    assert!(
        r.issues[1].contains("null prompt in column `prompt` at line 3"),
        "{:?}",
        r.issues
    );
}

#[test]
fn malformed_json_at_line() {
    let dir = tmp();
    let p = write_text(
        &dir.path().join("m.jsonl"),
        "{\"prompt\": \"a\"}\n{\"prompt\": \"b\",}\n",
    );
    // Within the first lines, opening already fails.
    let e = open(&p).expect_err("bad json");
    assert!(matches!(e, DataError::MalformedJson { line: 2, .. }), "{e}");
    assert!(one_line(&e).contains("m.jsonl: malformed JSON at line 2"));
    // Further down, reading fails at that line.
    let mut text: String = (0..150)
        .map(|i| format!("{{\"prompt\": \"q{i}\"}}\n"))
        .collect();
    text.push_str("[1, 2]\n");
    let p = write_text(&dir.path().join("m2.jsonl"), &text);
    let e = read_err(&open(&p).expect("open"));
    assert!(
        matches!(e, DataError::MalformedJson { line: 151, .. }),
        "{e}"
    );
    assert!(one_line(&e).contains("line 151: expected a JSON object, found array"));
}

#[test]
fn conversation_entry_without_role_or_content() {
    let dir = tmp();
    let p = write_text(
        &dir.path().join("c.jsonl"),
        concat!(
            "{\"prompt\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n",
            "{\"prompt\": [{\"role\": \"system\", \"content\": \"x\"}, {\"role\": \"user\"}]}\n",
            "{\"prompt\": [{\"content\": \"hi\"}]}\n",
        ),
    );
    let r = open(&p).expect("open").validate(10).expect("validate");
    assert_eq!(r.bad_rows, 2);
    assert!(
        r.issues[0].contains(
            "c.jsonl: conversation in column `prompt` at line 2, message 1: no `content`"
        ),
        "{:?}",
        r.issues
    );
    assert!(
        r.issues[1].contains("at line 3, message 0: no `role`"),
        "{:?}",
        r.issues
    );

    // Arrow: a struct type without `content` is refused at open.
    let fields = vec![Field::new("role", DataType::Utf8, true)];
    let item = Arc::new(Field::new_list_field(
        DataType::Struct(fields.clone().into()),
        true,
    ));
    let schema = Arc::new(Schema::new(vec![Field::new(
        "prompt",
        DataType::List(item),
        true,
    )]));
    let b = RecordBatch::new_empty(schema);
    let p = write(&dir.path().join("c.parquet"), vec![b]);
    let e = open(&p).expect_err("no content field");
    assert!(
        matches!(
            e,
            DataError::ConversationEntry {
                at: Location::Schema,
                missing: "content",
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn conversation_null_role_in_arrow_at_row() {
    let dir = tmp();
    let mut b = conversation_batch(3);
    // Null out the role of message 1 of row 1 (values index 3).
    let list = b
        .column(0)
        .as_any()
        .downcast_ref::<grpo_data::arrow::array::ListArray>()
        .expect("list")
        .clone();
    let st = list
        .values()
        .as_any()
        .downcast_ref::<grpo_data::arrow::array::StructArray>()
        .expect("struct")
        .clone();
    let role = StringArray::from(vec![
        Some("system"),
        Some("user"),
        Some("system"),
        None,
        Some("system"),
        Some("user"),
    ]);
    let st = grpo_data::arrow::array::StructArray::new(
        st.fields().clone(),
        vec![Arc::new(role) as ArrayRef, st.column(1).clone()],
        None,
    );
    let (field, offsets, _, nulls) = list.into_parts();
    let list = grpo_data::arrow::array::ListArray::new(field, offsets, Arc::new(st), nulls);
    b = RecordBatch::try_new(b.schema(), vec![Arc::new(list), b.column(1).clone()]).expect("batch");
    let p = write(&dir.path().join("c.parquet"), vec![b]);
    let e = read_err(&open(&p).expect("open"));
    assert!(
        matches!(
            e,
            DataError::ConversationEntry {
                at: Location::Row(1),
                message: 1,
                missing: "role",
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn empty_dataset() {
    let dir = tmp();
    let p = write_text(&dir.path().join("e.jsonl"), "\n\n");
    let e = open(&p).expect_err("empty");
    assert!(matches!(e, DataError::EmptyDataset { .. }), "{e}");
    assert!(one_line(&e).contains("e.jsonl: empty dataset"));
    let p = write(
        &dir.path().join("e.parquet"),
        vec![RecordBatch::new_empty(typed_batch(0, 1, false).schema())],
    );
    let e = open(&p).expect_err("empty parquet");
    assert!(matches!(e, DataError::EmptyDataset { .. }), "{e}");
}

#[test]
fn bad_options() {
    let dir = tmp();
    let p = write(
        &dir.path().join("t.parquet"),
        vec![typed_batch(0, 5, false)],
    );
    let d = open(&p).expect("open");
    for cfg in [
        StreamConfig {
            batch_size: 0,
            ..Default::default()
        },
        StreamConfig {
            epochs: Some(0),
            ..Default::default()
        },
        StreamConfig {
            shuffle_window: 0,
            ..Default::default()
        },
    ] {
        assert!(matches!(
            SampleStream::new(d.clone(), cfg),
            Err(DataError::InvalidConfig(_))
        ));
    }
    assert!(matches!(
        d.split_eval(1.5, 0),
        Err(DataError::InvalidConfig(_))
    ));
    assert!(matches!(d.take(Some(0)), Err(DataError::InvalidConfig(_))));
}
