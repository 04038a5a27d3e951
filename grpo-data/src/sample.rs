//! What the stream yields: [`Sample`] = a [`Prompt`] plus the row's other columns as [`Value`]s.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// One message of a conversation prompt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The message text (empty for an assistant turn that only calls tools).
    pub content: String,
    /// The message's other keys as the file has them (`tool_calls`, `tool_call_id`, `name`,
    /// `reasoning_content`, ...): chat templates see them, as transformers' do.
    #[serde(flatten, default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl Message {
    /// A message with a role and a text, no other keys.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            extra: serde_json::Map::new(),
        }
    }
}

/// The prompt of a sample: plain text, or a conversation for a chat template.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// A plain string prompt.
    Text(String),
    /// A list of `{role, content}` messages.
    Conversation(Vec<Message>),
}

impl Prompt {
    /// The text of a plain prompt, or the contents of a conversation joined by newlines (for
    /// display and for rewards that look at the question; the generator applies a chat template).
    pub fn text(&self) -> String {
        match self {
            Prompt::Text(t) => t.clone(),
            Prompt::Conversation(m) => m
                .iter()
                .map(|m| m.content.as_str())
                .collect::<Vec<_>>()
                .join("\n"),
        }
    }
}

/// A typed cell of a non-prompt column.
///
/// Arrow types map as: strings (any width, dictionary-encoded) → `Str`; signed and unsigned
/// integers → `Int` (a `u64` above `i64::MAX` → `Float`); floats → `Float`; booleans → `Bool`;
/// lists of strings → `StrList` (a null item becomes `""`); nulls → `Null`; anything else
/// (structs, dates, decimals, lists of numbers) → `Str` holding Arrow's display form.
/// JSONL values map the same way, with other arrays and objects → `Str` holding their JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Value {
    /// A missing value.
    Null,
    /// A boolean.
    Bool(bool),
    /// An integer.
    Int(i64),
    /// A float.
    Float(f64),
    /// A string.
    Str(String),
    /// A list of strings.
    StrList(Vec<String>),
    /// A conversation: a list of `{role, content}` (e.g. DPO's `chosen` / `rejected` in
    /// conversational datasets).
    Messages(Vec<Message>),
}

impl Value {
    /// The value as text: strings as they are, numbers and booleans printed, lists joined by
    /// newlines, `None` for null. What a reward comparing an `answer` usually wants, whatever
    /// type the file stored it in (`"42"` in JSONL, `42` in a CSV inferred as integer).
    pub fn as_text(&self) -> Option<String> {
        match self {
            Value::Null => None,
            Value::Bool(b) => Some(b.to_string()),
            Value::Int(i) => Some(i.to_string()),
            Value::Float(x) => Some(x.to_string()),
            Value::Str(s) => Some(s.clone()),
            Value::StrList(l) => Some(l.join("\n")),
            Value::Messages(m) => Some(
                m.iter()
                    .map(|m| m.content.as_str())
                    .collect::<Vec<_>>()
                    .join("\n"),
            ),
        }
    }

    /// The string, if this is a `Str`.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// Is it null?
    pub fn is_null(&self) -> bool {
        matches!(self, Value::Null)
    }
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Null => write!(f, "null"),
            Value::Str(s) => write!(f, "{s:?}"),
            Value::StrList(l) => write!(f, "{l:?}"),
            Value::Messages(m) => {
                let turns: Vec<String> = m
                    .iter()
                    .map(|m| format!("{}: {:?}", m.role, m.content))
                    .collect();
                write!(f, "[{}]", turns.join(", "))
            }
            other => write!(f, "{}", other.as_text().unwrap_or_default()),
        }
    }
}

/// One row of the dataset: its prompt and every other column by name.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// The row's index in the whole dataset (shards concatenated in sorted path order), stable
    /// across epochs and shuffles: a sample's identity.
    pub index: u64,
    /// The prompt column.
    pub prompt: Prompt,
    /// The other columns, in file order (JSONL: key order). Names are shared between samples.
    pub columns: Vec<(Arc<str>, Value)>,
}

impl Sample {
    /// The value of column `name`, if the row has it.
    pub fn get(&self, name: &str) -> Option<&Value> {
        self.columns
            .iter()
            .find(|(k, _)| k.as_ref() == name)
            .map(|(_, v)| v)
    }

    /// The value of column `name` as text ([`Value::as_text`]); `None` when absent or null.
    pub fn get_text(&self, name: &str) -> Option<String> {
        self.get(name).and_then(Value::as_text)
    }
}
