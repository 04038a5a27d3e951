//! Rows → [`Sample`]s: from Arrow record batches (Parquet, IPC, CSV) and from JSON lines.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, AsArray, BooleanArray, Float64Array, GenericListArray, Int64Array,
    OffsetSizeTrait, RecordBatch, StringArray, UInt64Array,
};
use arrow::compute::cast;
use arrow::datatypes::{DataType, Field, UInt64Type};

use crate::error::{DataError, Location, Result};
use crate::sample::{Message, Prompt, Sample, Value};

/// How a prompt column is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PromptKind {
    Text,
    Conversation,
}

fn is_string(dt: &DataType) -> bool {
    match dt {
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => true,
        DataType::Dictionary(_, v) => is_string(v),
        _ => false,
    }
}

/// Which rows numbering a file uses in messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Numbering {
    Rows,
    Csv,
}

impl Numbering {
    pub(crate) fn at(self, row: u64) -> Location {
        match self {
            Numbering::Rows => Location::Row(row),
            Numbering::Csv => Location::CsvRow { row, line: row + 2 },
        }
    }
}

/// Check the Arrow type of the prompt column.
pub(crate) fn prompt_kind(path: &Path, column: &str, dt: &DataType) -> Result<PromptKind> {
    let wrong = || DataError::WrongPromptType {
        path: path.to_path_buf(),
        column: column.to_string(),
        at: Location::Schema,
        found: dt.to_string(),
    };
    if is_string(dt) {
        return Ok(PromptKind::Text);
    }
    let item = match dt {
        DataType::List(f) | DataType::LargeList(f) => f,
        _ => return Err(wrong()),
    };
    let DataType::Struct(fields) = item.data_type() else {
        return Err(wrong());
    };
    for name in ["role", "content"] {
        match fields.find(name) {
            None => {
                return Err(DataError::ConversationEntry {
                    path: path.to_path_buf(),
                    column: column.to_string(),
                    at: Location::Schema,
                    message: 0,
                    missing: if name == "role" { "role" } else { "content" },
                });
            }
            Some((_, f)) if !is_string(f.data_type()) => return Err(wrong()),
            Some(_) => {}
        }
    }
    Ok(PromptKind::Conversation)
}

/// Interns column names so that samples share them.
#[derive(Debug, Default)]
pub(crate) struct Names(HashMap<String, Arc<str>>);

impl Names {
    pub(crate) fn get(&mut self, name: &str) -> Arc<str> {
        if let Some(n) = self.0.get(name) {
            return n.clone();
        }
        let n: Arc<str> = Arc::from(name);
        self.0.insert(name.to_string(), n.clone());
        n
    }
}

enum Col {
    Null,
    Bool(BooleanArray),
    Int(Int64Array),
    UInt(UInt64Array),
    Float(Float64Array),
    Str(StringArray),
    StrList(GenericListArray<i32>),
    /// A list of `{role, content, ...}` structs: (list, role, content, each message's other
    /// fields).
    #[allow(clippy::type_complexity)]
    Messages(
        Box<(
            GenericListArray<i32>,
            StringArray,
            StringArray,
            Vec<serde_json::Map<String, serde_json::Value>>,
        )>,
    ),
    /// Nested values (lists, structs, maps) as JSON text, per row (`None` for null).
    Json(Vec<Option<String>>),
    Display(ArrayRef),
}

/// A nested column's rows as JSON text (e.g. a `tools` column of tool schemas).
fn json_rows(a: &ArrayRef) -> std::result::Result<Vec<Option<String>>, arrow::error::ArrowError> {
    let field = Field::new("v", a.data_type().clone(), true);
    let schema = Arc::new(arrow::datatypes::Schema::new(vec![field]));
    let batch = RecordBatch::try_new(schema, vec![a.clone()])?;
    let mut buf = Vec::new();
    let mut w = arrow::json::LineDelimitedWriter::new(&mut buf);
    w.write(&batch)?;
    w.finish()?;
    drop(w);
    String::from_utf8_lossy(&buf)
        .lines()
        .map(|l| match serde_json::from_str::<serde_json::Value>(l) {
            Ok(serde_json::Value::Object(mut m)) => Ok(m.remove("v").map(|v| v.to_string())),
            _ => Err(arrow::error::ArrowError::JsonError(format!(
                "nested value: {l}"
            ))),
        })
        .collect()
}

impl Col {
    fn new(a: &ArrayRef) -> std::result::Result<Col, arrow::error::ArrowError> {
        use DataType as D;
        Ok(match a.data_type() {
            D::Null => Col::Null,
            D::Boolean => Col::Bool(a.as_boolean().clone()),
            D::Int8 | D::Int16 | D::Int32 | D::Int64 | D::UInt8 | D::UInt16 | D::UInt32 => {
                Col::Int(cast(a, &D::Int64)?.as_primitive().clone())
            }
            D::UInt64 => Col::UInt(a.as_primitive::<UInt64Type>().clone()),
            D::Float16 | D::Float32 | D::Float64 => {
                Col::Float(cast(a, &D::Float64)?.as_primitive().clone())
            }
            dt if is_string(dt) => Col::Str(cast(a, &D::Utf8)?.as_string::<i32>().clone()),
            D::List(f) | D::LargeList(f) if is_string(f.data_type()) => {
                let to = D::List(Arc::new(Field::new_list_field(D::Utf8, true)));
                Col::StrList(cast(a, &to)?.as_list::<i32>().clone())
            }
            D::List(f) | D::LargeList(f) if is_message_struct(f.data_type()) => {
                let to = D::List(Arc::new(Field::new_list_field(f.data_type().clone(), true)));
                let list = cast(a, &to)?.as_list::<i32>().clone();
                let values = list.values().as_struct().clone();
                let text =
                    |name: &str| -> std::result::Result<StringArray, arrow::error::ArrowError> {
                        let col = values.column_by_name(name).ok_or_else(|| {
                            arrow::error::ArrowError::SchemaError(format!(
                                "no `{name}` in message struct"
                            ))
                        })?;
                        Ok(cast(col, &D::Utf8)?.as_string::<i32>().clone())
                    };
                let (role, content) = (text("role")?, text("content")?);
                let extras = struct_extras(&values)?;
                Col::Messages(Box::new((list, role, content, extras)))
            }
            D::List(_) | D::LargeList(_) | D::Struct(_) | D::Map(_, _) => Col::Json(json_rows(a)?),
            _ => Col::Display(a.clone()),
        })
    }

    fn value(&self, i: usize) -> Value {
        match self {
            Col::Null => Value::Null,
            Col::Bool(a) if a.is_valid(i) => Value::Bool(a.value(i)),
            Col::Int(a) if a.is_valid(i) => Value::Int(a.value(i)),
            Col::UInt(a) if a.is_valid(i) => {
                let v = a.value(i);
                i64::try_from(v).map_or(Value::Float(v as f64), Value::Int)
            }
            Col::Float(a) if a.is_valid(i) => Value::Float(a.value(i)),
            Col::Str(a) if a.is_valid(i) => Value::Str(a.value(i).to_string()),
            Col::StrList(a) if a.is_valid(i) => {
                let offs = a.value_offsets();
                let vals = a.values().as_string::<i32>();
                let (s, e) = (offs[i] as usize, offs[i + 1] as usize);
                Value::StrList(
                    (s..e)
                        .map(|j| {
                            if vals.is_valid(j) {
                                vals.value(j).to_string()
                            } else {
                                String::new()
                            }
                        })
                        .collect(),
                )
            }
            Col::Messages(m) if m.0.is_valid(i) => {
                let (list, role, content, extras) = &**m;
                let offs = list.value_offsets();
                let (s, e) = (offs[i] as usize, offs[i + 1] as usize);
                Value::Messages(
                    (s..e)
                        .map(|j| Message {
                            role: if role.is_valid(j) {
                                role.value(j).to_string()
                            } else {
                                String::new()
                            },
                            content: if content.is_valid(j) {
                                content.value(j).to_string()
                            } else {
                                String::new()
                            },
                            extra: extras[j].clone(),
                        })
                        .collect(),
                )
            }
            Col::Json(rows) => match &rows[i] {
                Some(text) => Value::Str(text.clone()),
                None => Value::Null,
            },
            Col::Display(a) if a.is_valid(i) => {
                match arrow::util::display::array_value_to_string(a, i) {
                    Ok(s) => Value::Str(s),
                    Err(_) => Value::Null,
                }
            }
            _ => Value::Null,
        }
    }
}

/// Where a batch sits, for sample indices and messages.
pub(crate) struct BatchCtx<'a> {
    pub path: &'a Path,
    pub prompt_field: &'a str,
    pub kind: PromptKind,
    pub numbering: Numbering,
    /// Row in its file of the batch's first row.
    pub file_row: u64,
    /// Dataset index of the batch's first row.
    pub global: u64,
}

/// Convert every row of `batch`. The outer error is an Arrow failure for the whole batch; the
/// inner ones are per row (null prompt, ...), so that `inspect` can list them all.
pub(crate) fn batch_rows(
    batch: &RecordBatch,
    ctx: &BatchCtx<'_>,
    names: &mut Names,
) -> Result<Vec<Result<Sample>>> {
    let arrow_err = |source| DataError::Arrow {
        path: ctx.path.to_path_buf(),
        at: ctx.numbering.at(ctx.file_row),
        source,
    };
    let schema = batch.schema();
    let Some((pidx, pfield)) = schema.column_with_name(ctx.prompt_field) else {
        return Err(DataError::NoPromptColumn {
            path: ctx.path.to_path_buf(),
            column: ctx.prompt_field.to_string(),
            found: schema.fields().iter().map(|f| f.name().clone()).collect(),
        });
    };
    let kind = prompt_kind(ctx.path, ctx.prompt_field, pfield.data_type())?;
    debug_assert_eq!(kind, ctx.kind);
    let mut others = Vec::new();
    for (i, f) in schema.fields().iter().enumerate() {
        if i != pidx {
            others.push((
                names.get(f.name()),
                Col::new(batch.column(i)).map_err(arrow_err)?,
            ));
        }
    }
    let n = batch.num_rows();
    let pcol = batch.column(pidx);
    let mut prompts: Vec<Result<Prompt>> = Vec::with_capacity(n);
    match kind {
        PromptKind::Text => {
            let arr = cast(pcol, &DataType::Utf8).map_err(arrow_err)?;
            let arr = arr.as_string::<i32>();
            for i in 0..n {
                let at = ctx.numbering.at(ctx.file_row + i as u64);
                prompts.push(if arr.is_null(i) {
                    Err(null_prompt(ctx, at))
                } else if arr.value(i).trim().is_empty() {
                    Err(empty_prompt(ctx, at))
                } else {
                    Ok(Prompt::Text(arr.value(i).to_string()))
                });
            }
        }
        PromptKind::Conversation => match pcol.data_type() {
            DataType::List(_) => conversations(pcol.as_list::<i32>(), ctx, &mut prompts),
            _ => conversations(pcol.as_list::<i64>(), ctx, &mut prompts),
        }
        .map_err(arrow_err)?,
    }
    Ok(prompts
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            p.map(|prompt| Sample {
                index: ctx.global + i as u64,
                prompt,
                columns: others
                    .iter()
                    .map(|(k, c)| (k.clone(), c.value(i)))
                    .collect(),
            })
        })
        .collect())
}

fn null_prompt(ctx: &BatchCtx<'_>, at: Location) -> DataError {
    DataError::NullPrompt {
        path: ctx.path.to_path_buf(),
        column: ctx.prompt_field.to_string(),
        at,
    }
}

fn empty_prompt(ctx: &BatchCtx<'_>, at: Location) -> DataError {
    DataError::EmptyPrompt {
        path: ctx.path.to_path_buf(),
        column: ctx.prompt_field.to_string(),
        at,
    }
}

fn conversations<O: OffsetSizeTrait>(
    list: &GenericListArray<O>,
    ctx: &BatchCtx<'_>,
    out: &mut Vec<Result<Prompt>>,
) -> std::result::Result<(), arrow::error::ArrowError> {
    let values = list.values().as_struct();
    let field = |name: &str| -> std::result::Result<StringArray, arrow::error::ArrowError> {
        let col = values.column_by_name(name).ok_or_else(|| {
            arrow::error::ArrowError::SchemaError(format!("no `{name}` in conversation struct"))
        })?;
        Ok(cast(col, &DataType::Utf8)?.as_string::<i32>().clone())
    };
    let role = field("role")?;
    let content = field("content")?;
    let extras = struct_extras(values)?;
    let offs = list.value_offsets();
    for i in 0..list.len() {
        let at = ctx.numbering.at(ctx.file_row + i as u64);
        if list.is_null(i) {
            out.push(Err(null_prompt(ctx, at)));
            continue;
        }
        let (s, e) = (offs[i].as_usize(), offs[i + 1].as_usize());
        if s == e {
            out.push(Err(empty_prompt(ctx, at)));
            continue;
        }
        let mut msgs = Vec::with_capacity(e - s);
        let mut err = None;
        for (j, extra) in extras.iter().enumerate().take(e).skip(s) {
            let missing = if values.is_null(j) || role.is_null(j) {
                Some("role")
            } else if content.is_null(j) && !calls_tools(extra) {
                Some("content")
            } else {
                None
            };
            if let Some(missing) = missing {
                err = Some(DataError::ConversationEntry {
                    path: ctx.path.to_path_buf(),
                    column: ctx.prompt_field.to_string(),
                    at,
                    message: j - s,
                    missing,
                });
                break;
            }
            msgs.push(Message {
                role: role.value(j).to_string(),
                content: match content.is_null(j) {
                    true => String::new(),
                    false => content.value(j).to_string(),
                },
                extra: extra.clone(),
            });
        }
        out.push(match err {
            Some(e) => Err(e),
            None => Ok(Prompt::Conversation(msgs)),
        });
    }
    Ok(())
}

/// Each row of a message struct array: its fields other than `role` and `content`, as JSON
/// (null fields left out, as a file that lacks them would have them).
fn struct_extras(
    values: &arrow::array::StructArray,
) -> std::result::Result<Vec<serde_json::Map<String, serde_json::Value>>, arrow::error::ArrowError>
{
    let (fields, columns): (Vec<_>, Vec<_>) = values
        .fields()
        .iter()
        .zip(values.columns())
        .filter(|(f, _)| f.name() != "role" && f.name() != "content")
        .map(|(f, c)| (f.clone(), c.clone()))
        .unzip();
    if fields.is_empty() {
        return Ok(vec![serde_json::Map::new(); values.len()]);
    }
    let schema = Arc::new(arrow::datatypes::Schema::new(fields));
    let batch = RecordBatch::try_new(schema, columns)?;
    let mut buf = Vec::new();
    let mut w = arrow::json::LineDelimitedWriter::new(&mut buf);
    w.write(&batch)?;
    w.finish()?;
    drop(w);
    let text = String::from_utf8_lossy(&buf);
    text.lines()
        .map(|l| match serde_json::from_str::<serde_json::Value>(l) {
            Ok(serde_json::Value::Object(m)) => Ok(m),
            _ => Err(arrow::error::ArrowError::JsonError(format!(
                "message fields: {l}"
            ))),
        })
        .collect()
}

/// A message that calls tools may have no text (`content` null).
fn calls_tools(extra: &serde_json::Map<String, serde_json::Value>) -> bool {
    extra
        .get("tool_calls")
        .is_some_and(|v| v.as_array().is_some_and(|a| !a.is_empty()))
}

fn json_type(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "bool",
        serde_json::Value::Number(_) => "number",
        serde_json::Value::String(_) => "string",
        serde_json::Value::Array(_) => "array",
        serde_json::Value::Object(_) => "object",
    }
}

/// `{"role": "...", "content": "..."}` (other keys allowed; `content` null or absent in a
/// turn that calls tools).
fn is_message(v: &serde_json::Value) -> bool {
    let text = v.get("content").is_some_and(serde_json::Value::is_string);
    let calls = v.as_object().is_some_and(calls_tools)
        && v.get("content").is_none_or(serde_json::Value::is_null);
    v.get("role").is_some_and(serde_json::Value::is_string) && (text || calls)
}

/// A JSON message object (see [`is_message`]) as a [`Message`].
fn json_message(mut m: serde_json::Map<String, serde_json::Value>) -> Message {
    let mut text = |k: &str| match m.remove(k) {
        Some(serde_json::Value::String(s)) => s,
        _ => String::new(),
    };
    let (role, content) = (text("role"), text("content"));
    m.retain(|_, v| !v.is_null());
    Message {
        role,
        content,
        extra: m,
    }
}

/// A struct type with `role` and `content` fields (a chat message).
fn is_message_struct(dt: &DataType) -> bool {
    match dt {
        DataType::Struct(fields) => ["role", "content"]
            .iter()
            .all(|n| fields.iter().any(|f| f.name() == n)),
        _ => false,
    }
}

fn json_value(v: serde_json::Value) -> Value {
    use serde_json::Value as J;
    match v {
        J::Null => Value::Null,
        J::Bool(b) => Value::Bool(b),
        J::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) => Value::Int(i),
            (None, Some(f)) => Value::Float(f),
            _ => Value::Str(n.to_string()),
        },
        J::String(s) => Value::Str(s),
        J::Array(items) if !items.is_empty() && items.iter().all(is_message) => Value::Messages(
            items
                .into_iter()
                .map(|i| match i {
                    J::Object(m) => json_message(m),
                    _ => Message::new("", ""),
                })
                .collect(),
        ),
        J::Array(items) if items.iter().all(|i| i.is_string()) => Value::StrList(
            items
                .into_iter()
                .map(|i| match i {
                    J::String(s) => s,
                    _ => String::new(),
                })
                .collect(),
        ),
        other => Value::Str(other.to_string()),
    }
}

/// Parse one JSONL line (1-based `line`) into a sample with dataset index `global`.
pub(crate) fn json_line(
    path: &Path,
    line: u64,
    text: &str,
    prompt_field: &str,
    global: u64,
    names: &mut Names,
) -> Result<Sample> {
    let malformed = |message: String| DataError::MalformedJson {
        path: path.to_path_buf(),
        line,
        message,
    };
    let v: serde_json::Value = serde_json::from_str(text).map_err(|e| malformed(e.to_string()))?;
    let serde_json::Value::Object(map) = v else {
        return Err(malformed(format!(
            "expected a JSON object, found {}",
            json_type(&v)
        )));
    };
    let at = Location::Line(line);
    let err_ctx = |kind: fn(std::path::PathBuf, String, Location) -> DataError| {
        kind(path.to_path_buf(), prompt_field.to_string(), at)
    };
    let mut prompt = None;
    let mut columns = Vec::with_capacity(map.len());
    for (k, v) in map {
        if k == prompt_field {
            prompt = Some(v);
        } else {
            columns.push((names.get(&k), json_value(v)));
        }
    }
    let wrong = |found: String| DataError::WrongPromptType {
        path: path.to_path_buf(),
        column: prompt_field.to_string(),
        at,
        found,
    };
    let prompt = match prompt {
        None | Some(serde_json::Value::Null) => {
            return Err(err_ctx(|path, column, at| DataError::NullPrompt {
                path,
                column,
                at,
            }));
        }
        Some(serde_json::Value::String(s)) => {
            if s.trim().is_empty() {
                return Err(err_ctx(|path, column, at| DataError::EmptyPrompt {
                    path,
                    column,
                    at,
                }));
            }
            Prompt::Text(s)
        }
        Some(serde_json::Value::Array(items)) => {
            if items.is_empty() {
                return Err(err_ctx(|path, column, at| DataError::EmptyPrompt {
                    path,
                    column,
                    at,
                }));
            }
            let mut msgs = Vec::with_capacity(items.len());
            for (j, item) in items.into_iter().enumerate() {
                let serde_json::Value::Object(mut m) = item else {
                    return Err(wrong(format!(
                        "list with a {} at message {j}",
                        json_type(&item)
                    )));
                };
                let tool_call = calls_tools(&m);
                let mut take = |name: &'static str| match m.remove(name) {
                    None | Some(serde_json::Value::Null) if name == "content" && tool_call => {
                        Ok(String::new())
                    }
                    None | Some(serde_json::Value::Null) => Err(DataError::ConversationEntry {
                        path: path.to_path_buf(),
                        column: prompt_field.to_string(),
                        at,
                        message: j,
                        missing: name,
                    }),
                    Some(serde_json::Value::String(s)) => Ok(s),
                    Some(other) => Err(wrong(format!(
                        "conversation whose message {j} has a {} `{name}`",
                        json_type(&other)
                    ))),
                };
                let role = take("role")?;
                let content = take("content")?;
                m.retain(|_, v| !v.is_null());
                msgs.push(Message {
                    role,
                    content,
                    extra: m,
                });
            }
            Prompt::Conversation(msgs)
        }
        Some(other) => return Err(wrong(json_type(&other).to_string())),
    };
    Ok(Sample {
        index: global,
        prompt,
        columns,
    })
}
