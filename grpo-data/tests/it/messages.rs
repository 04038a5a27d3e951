//! Conversation-valued columns besides the prompt (DPO's `chosen` / `rejected`): read as
//! `Value::Messages` from JSONL and from Parquet's `list<struct<role, content>>`.
#![allow(clippy::unwrap_used, missing_docs)]

use crate::common;

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
    let msg = |c: &str| vec![Message::new("assistant", c)];
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
    let p = dir.path().join("c.parquet");
    parquet_of(ROWS, &p);
    check(&Dataset::open(&[p.to_string_lossy()], &opts(8)).unwrap());
}

/// Tool-calling conversations (TRL's SFT format): an assistant turn with `tool_calls` and no
/// content, a `tool` turn with its `name`, and a `tools` column; every key a chat template
/// reads survives, from JSONL and from Parquet (nested structs), the same.
const TOOL_ROWS: &str = r#"{"messages": [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": null, "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}, {"role": "tool", "content": "sunny", "name": "get_weather"}, {"role": "assistant", "content": "It is sunny."}], "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]}
"#;

fn check_tools(d: &Dataset) {
    let rows = read_all(d);
    let grpo_data::Prompt::Conversation(m) = &rows[0].prompt else {
        panic!("a conversation");
    };
    assert_eq!(m.len(), 4);
    assert_eq!(
        (m[1].role.as_str(), m[1].content.as_str()),
        ("assistant", "")
    );
    let call = &m[1].extra["tool_calls"][0]["function"];
    assert_eq!(call["name"], "get_weather");
    assert_eq!(call["arguments"]["city"], "Paris");
    assert_eq!(m[2].extra["name"], "get_weather");
    assert!(
        m[0].extra.is_empty() && m[3].extra.is_empty(),
        "no null keys: {m:?}"
    );
    let tools: serde_json::Value =
        serde_json::from_str(&rows[0].get_text("tools").unwrap()).unwrap();
    assert_eq!(tools[0]["function"]["name"], "get_weather");
}

#[test]
fn tool_calling_conversations_keep_their_keys() {
    let dir = tmp();
    let p = dir.path().join("t.jsonl");
    std::fs::write(&p, TOOL_ROWS).unwrap();
    let o = grpo_data::OpenOptions {
        prompt_field: "messages".into(),
        ..opts(8)
    };
    check_tools(&Dataset::open(&[p.to_string_lossy()], &o).unwrap());
    let q = dir.path().join("t.parquet");
    parquet_of(TOOL_ROWS, &q);
    check_tools(&Dataset::open(&[q.to_string_lossy()], &o).unwrap());
}

/// JSON lines written as Parquet through Arrow's JSON reader (the schema inferred).
fn parquet_of(rows: &str, path: &std::path::Path) {
    let (schema, _) =
        grpo_data::arrow::json::reader::infer_json_schema(Cursor::new(rows), None).unwrap();
    let schema = Arc::new(schema);
    let reader = grpo_data::arrow::json::ReaderBuilder::new(schema.clone())
        .build(Cursor::new(rows))
        .unwrap();
    let batches: Vec<_> = reader.map(|b| Ok(b.unwrap())).collect();
    grpo_data::write_batches(path, None, schema, batches).unwrap();
}

#[test]
fn empty_conversations_are_placeholder_rows_of_one_empty_user_message() {
    let d = Dataset::empty_conversations("prompt", 3).unwrap();
    assert_eq!(d.len(), 3);
    assert!(d.conversation_prompts());
    let rows = read_all(&d);
    assert_eq!(rows.len(), 3);
    for r in &rows {
        assert_eq!(
            r.prompt,
            grpo_data::Prompt::Conversation(vec![Message::new("user", "")])
        );
    }
    // Another prompt column name is kept.
    assert_eq!(
        Dataset::empty_conversations("question", 1)
            .unwrap()
            .prompt_field(),
        "question"
    );
}
