//! Conversation-valued columns besides the prompt (DPO's `chosen` / `rejected`): read as
//! `Value::Messages` from JSONL and from Parquet's `list<struct<role, content>>`.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use std::io::Cursor;
use std::sync::Arc;

use common::*;
use grpo_data::{Dataset, Message, Value};

const ROWS: &str = r#"{"prompt": [{"role": "user", "content": "Hi?"}], "chosen": [{"role": "assistant", "content": "Hello!"}], "rejected": [{"role": "assistant", "content": "Go away."}], "tags": ["a", "b"]}
{"prompt": [{"role": "user", "content": "2+2?"}], "chosen": [{"role": "assistant", "content": "4"}], "rejected": [{"role": "assistant", "content": "5"}], "tags": []}
"#;

fn check(d: &Dataset) {
    let rows = read_all(d);
    assert_eq!(rows.len(), 2);
    let msg = |c: &str| {
        vec![Message {
            role: "assistant".into(),
            content: c.into(),
        }]
    };
    assert_eq!(rows[0].get("chosen"), Some(&Value::Messages(msg("Hello!"))));
    assert_eq!(rows[1].get("rejected"), Some(&Value::Messages(msg("5"))));
    assert_eq!(rows[1].get_text("chosen").as_deref(), Some("4"));
    // Lists of strings stay lists of strings.
    assert_eq!(
        rows[0].get("tags"),
        Some(&Value::StrList(vec!["a".into(), "b".into()]))
    );
}

#[test]
fn jsonl_message_columns() {
    let dir = tmp();
    let p = dir.path().join("c.jsonl");
    std::fs::write(&p, ROWS).unwrap();
    check(&Dataset::open(&[p.to_string_lossy()], &opts(8)).unwrap());
}

#[test]
fn parquet_message_columns() {
    let dir = tmp();
    // The same rows through Arrow's JSON reader (schema inferred: list<struct<content, role>>).
    let (schema, _) =
        grpo_data::arrow::json::reader::infer_json_schema(Cursor::new(ROWS), None).unwrap();
    let schema = Arc::new(schema);
    let reader = grpo_data::arrow::json::ReaderBuilder::new(schema.clone())
        .build(Cursor::new(ROWS))
        .unwrap();
    let batches: Vec<_> = reader.map(|b| Ok(b.unwrap())).collect();
    let p = dir.path().join("c.parquet");
    grpo_data::write_batches(&p, None, schema, batches).unwrap();
    check(&Dataset::open(&[p.to_string_lossy()], &opts(8)).unwrap());
}
