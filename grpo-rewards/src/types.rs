//! What a reward reads (one [`RewardInput`] per completion) and what it returns ([`RewardOutput`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// A value of one of the sample's other columns (the answer, a rubric, an id...).
///
/// Deserialises untagged, so `"42"`, `42`, `4.2`, `true`, `["a", "b"]` and `null` all work in
/// JSON, TOML and YAML.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(untagged)]
pub enum FieldValue {
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
    /// No value.
    #[default]
    Null,
}

impl FieldValue {
    /// The value as text, as it would be compared with a completion (`Null` → `None`).
    pub fn as_text(&self) -> Option<String> {
        match self {
            FieldValue::Bool(b) => Some(b.to_string()),
            FieldValue::Int(i) => Some(i.to_string()),
            FieldValue::Float(f) => Some(f.to_string()),
            FieldValue::Str(s) => Some(s.clone()),
            FieldValue::StrList(v) => Some(v.join("\n")),
            FieldValue::Null => None,
        }
    }

    /// The value as a JSON value (for templates and info).
    pub fn to_json(&self) -> serde_json::Value {
        match self {
            FieldValue::Bool(b) => serde_json::Value::Bool(*b),
            FieldValue::Int(i) => serde_json::Value::from(*i),
            FieldValue::Float(f) => serde_json::Value::from(*f),
            FieldValue::Str(s) => serde_json::Value::String(s.clone()),
            FieldValue::StrList(v) => serde_json::Value::from(v.clone()),
            FieldValue::Null => serde_json::Value::Null,
        }
    }
}

impl From<&str> for FieldValue {
    fn from(s: &str) -> Self {
        FieldValue::Str(s.to_owned())
    }
}
impl From<String> for FieldValue {
    fn from(s: String) -> Self {
        FieldValue::Str(s)
    }
}
impl From<i64> for FieldValue {
    fn from(v: i64) -> Self {
        FieldValue::Int(v)
    }
}
impl From<f64> for FieldValue {
    fn from(v: f64) -> Self {
        FieldValue::Float(v)
    }
}
impl From<bool> for FieldValue {
    fn from(v: bool) -> Self {
        FieldValue::Bool(v)
    }
}

/// One chat message (`role` is `system`, `user` or `assistant`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant` (or `tool`).
    pub role: String,
    /// The text.
    pub content: String,
}

impl Message {
    /// A message with `role` and `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// One completion to score, with its prompt and the sample's other fields.
///
/// Built by the scorer stage from a data sample and a generated completion.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RewardInput {
    /// The prompt as the policy saw it (after the chat template when conversational).
    pub prompt: String,
    /// The prompt's messages when the sample is conversational, else `None`.
    pub prompt_messages: Option<Vec<Message>>,
    /// The generated completion's text (of a multi-turn episode: the whole transcript after
    /// the prompt, chat markup included).
    pub completion: String,
    /// A multi-turn episode's messages after the prompt (assistant turns and the
    /// environment's observations, in order), else `None`. Python rewards get these as their
    /// `completions` (TRL's multi-turn convention), and `accuracy` reads the last assistant
    /// message ([`RewardInput::final_text`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_messages: Option<Vec<Message>>,
    /// Number of completion tokens (for length rewards).
    pub completion_tokens: usize,
    /// The completion's token ids (TRL's `completion_ids`), when the caller has them.
    #[serde(default)]
    pub completion_ids: Vec<u32>,
    /// The sample's other columns by name (`answer`, `solution`, ...).
    pub fields: BTreeMap<String, FieldValue>,
    /// Training steps done when the completion was scored (TRL's
    /// `trainer_state.global_step`).
    #[serde(default)]
    pub global_step: usize,
    /// The episode's environment instance in the Python worker (grpo-rollout's
    /// `environment_factory` classes): Python rewards get it in TRL's `environments` argument.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub environment_instance: Option<String>,
}

impl RewardInput {
    /// A plain-text input with no fields; `completion_tokens` is set to 0.
    pub fn new(prompt: impl Into<String>, completion: impl Into<String>) -> Self {
        Self {
            prompt: prompt.into(),
            completion: completion.into(),
            ..Self::default()
        }
    }

    /// Sets the episode's environment instance (TRL's `environments` argument of Python
    /// rewards).
    pub fn with_environment_instance(mut self, id: impl Into<String>) -> Self {
        self.environment_instance = Some(id.into());
        self
    }

    /// Sets a multi-turn episode's messages after the prompt.
    pub fn with_completion_messages(mut self, messages: Vec<Message>) -> Self {
        self.completion_messages = Some(messages);
        self
    }

    /// The model's final answer: the last assistant message of an episode (empty when it has
    /// none), else the completion.
    pub fn final_text(&self) -> &str {
        match &self.completion_messages {
            Some(m) => m
                .iter()
                .rev()
                .find(|m| m.role == "assistant")
                .map_or("", |m| m.content.as_str()),
            None => &self.completion,
        }
    }

    /// Sets the completion's token count.
    pub fn with_tokens(mut self, completion_tokens: usize) -> Self {
        self.completion_tokens = completion_tokens;
        self
    }

    /// Sets the completion's token ids (and their count).
    pub fn with_ids(mut self, ids: Vec<u32>) -> Self {
        self.completion_tokens = ids.len();
        self.completion_ids = ids;
        self
    }

    /// Sets the training step (`trainer_state.global_step`).
    pub fn at_step(mut self, global_step: usize) -> Self {
        self.global_step = global_step;
        self
    }

    /// Adds a field.
    pub fn with_field(mut self, name: impl Into<String>, value: impl Into<FieldValue>) -> Self {
        self.fields.insert(name.into(), value.into());
        self
    }

    /// Sets the prompt messages.
    pub fn with_messages(mut self, messages: Vec<Message>) -> Self {
        self.prompt_messages = Some(messages);
        self
    }

    /// The field `name`, if present and not null.
    pub fn field(&self, name: &str) -> Option<&FieldValue> {
        self.fields.get(name).filter(|v| **v != FieldValue::Null)
    }
}

/// What a reward returns for a batch: one score per completion plus optional info.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RewardOutput {
    /// One score per completion; `None` means "no opinion" (left out of the weighted sum).
    pub scores: Vec<Option<f32>>,
    /// Per-completion details (a judge's explanation, per-judge scores), `None` when there are
    /// none. Either empty or as long as `scores`.
    pub info: Vec<Option<serde_json::Value>>,
    /// Counters for this batch (e.g. `judge/failures`, `judge/cache_hits`), summed over rewards.
    pub counters: BTreeMap<String, f64>,
}

impl RewardOutput {
    /// Scores without info.
    pub fn from_scores(scores: Vec<Option<f32>>) -> Self {
        Self {
            scores,
            ..Self::default()
        }
    }
}

impl From<Vec<Option<f32>>> for RewardOutput {
    fn from(scores: Vec<Option<f32>>) -> Self {
        Self::from_scores(scores)
    }
}

impl From<Vec<f32>> for RewardOutput {
    fn from(scores: Vec<f32>) -> Self {
        Self::from_scores(scores.into_iter().map(Some).collect())
    }
}
