//! Judge configs: one judge, and ensembles of judges.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::error::{Result, RewardError};

/// How the score is read from the judge's reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ScoreParse {
    /// A JSON object `{"score": x, "explanation": "..."}` (the first `{...}` in the reply when
    /// the reply has text around it).
    #[default]
    Json,
    /// The first capture group (or the group named `score`) of `score_regex`.
    Regex,
}

/// Whether a JSON-schema `response_format` is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ResponseFormatMode {
    /// Send the schema (json parsing only); if the server rejects it (HTTP 400, 404, 415, 422),
    /// resend without it and stop sending it for this judge.
    #[default]
    Auto,
    /// Always send the schema.
    JsonSchema,
    /// Never send a `response_format`.
    None,
}

/// One LLM judge over an OpenAI-compatible chat-completions endpoint (`type = "judge"`).
///
/// Only `base_url`, `model` and `template` are required. The API key is read from the
/// environment variable NAMED by `api_key_env` when the judge is built; it is never stored in
/// this struct, printed, logged or saved.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JudgeConfig {
    /// Name in logs, errors and info (`judge` when absent).
    #[serde(default = "default_judge_name")]
    pub name: String,
    /// The API root, e.g. `https://api.openai.com/v1` or `http://127.0.0.1:8000/v1`.
    pub base_url: String,
    /// The model name sent in each request.
    pub model: String,
    /// NAME of the environment variable that holds the API key (e.g. `OPENAI_API_KEY`); absent
    /// → no key (local servers).
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// The user message: a minijinja template over `prompt`, `completion`, `messages`,
    /// `completion_tokens` and `fields` (the sample's other columns, e.g. `fields.answer`).
    pub template: String,
    /// An optional system message, a template over the same variables.
    #[serde(default)]
    pub system_template: Option<String>,
    /// `json` (default) or `regex`.
    #[serde(default)]
    pub score_parse: ScoreParse,
    /// JSON key of the score. Default `score`.
    #[serde(default = "default_score_key")]
    pub score_key: String,
    /// JSON key of the explanation, kept as info. Default `explanation`.
    #[serde(default = "default_explanation_key")]
    pub explanation_key: String,
    /// The regex for `score_parse = "regex"`: group 1 or the group named `score` is the number.
    #[serde(default)]
    pub score_regex: Option<String>,
    /// Lowest score the judge gives (its scale). Default 0.
    #[serde(default)]
    pub score_min: f64,
    /// Highest score the judge gives. Default 1 (use 10 for a 0–10 rubric).
    #[serde(default = "one")]
    pub score_max: f64,
    /// The reward range the judge's scale is mapped onto, linearly. Default `[0, 1]`.
    #[serde(default = "unit_range")]
    pub output_range: [f32; 2],
    /// `auto` (default), `json_schema` or `none`.
    #[serde(default)]
    pub response_format: ResponseFormatMode,
    /// Sampling temperature. Default 0.
    #[serde(default)]
    pub temperature: f32,
    /// Nucleus sampling; absent → server default.
    #[serde(default)]
    pub top_p: Option<f32>,
    /// `max_tokens` of the reply. Default 512.
    #[serde(default = "default_max_tokens")]
    pub max_tokens: u32,
    /// Sampling seed; absent → not sent.
    #[serde(default)]
    pub seed: Option<i64>,
    /// Per-request timeout in seconds. Default 60.
    #[serde(default = "default_timeout")]
    pub timeout_secs: f64,
    /// Retries after the first attempt (408, 409, 429, 5xx, connection errors, timeouts).
    /// Default 5. See [`JudgeConfig::retry_policy`].
    #[serde(default = "default_max_retries")]
    pub max_retries: u32,
    /// `d` of the first retry in ms, doubled each retry up to `max_backoff_ms`; each wait is a
    /// uniformly random time between `d/2` and `d` (equal jitter). Default 500.
    #[serde(default = "default_initial_backoff")]
    pub initial_backoff_ms: u64,
    /// The cap of `d` in ms. A server's `Retry-After` (delta-seconds or an HTTP date) or
    /// `retry-after-ms` replaces the computed wait, even above this cap, up to 10 min
    /// ([`crate::http::MAX_RETRY_AFTER`]). Default 30000.
    #[serde(default = "default_max_backoff")]
    pub max_backoff_ms: u64,
    /// Request rate limit; absent → none.
    #[serde(default)]
    pub requests_per_minute: Option<u32>,
    /// Token rate limit (estimated prompt tokens + `max_tokens` per request); absent → none.
    #[serde(default)]
    pub tokens_per_minute: Option<u32>,
    /// Requests allowed at once above the steady rate. Default: one second's worth of
    /// `requests_per_minute` (at least 1).
    #[serde(default)]
    pub burst: Option<u32>,
    /// Requests in flight at most. Default 16.
    #[serde(default = "default_max_concurrent")]
    pub max_concurrent: usize,
    /// SQLite file caching replies across runs; absent → no cache.
    #[serde(default)]
    pub cache_path: Option<PathBuf>,
    /// The judge counts as down after this many requests in a row failed past their retries
    /// (HTTP errors, connection errors, timeouts; unreadable replies do not count): the batch
    /// then fails with [`crate::RewardError::JudgeDown`], which stops a training run (after a
    /// checkpoint) instead of training on unscored batches. 0 = never. Default 32.
    #[serde(default = "default_max_consecutive_failures")]
    pub max_consecutive_failures: u32,
}

fn default_judge_name() -> String {
    "judge".into()
}
fn default_score_key() -> String {
    "score".into()
}
fn default_explanation_key() -> String {
    "explanation".into()
}
fn one() -> f64 {
    1.0
}
fn unit_range() -> [f32; 2] {
    [0.0, 1.0]
}
fn default_max_tokens() -> u32 {
    512
}
fn default_timeout() -> f64 {
    60.0
}
fn default_max_retries() -> u32 {
    5
}
fn default_initial_backoff() -> u64 {
    500
}
fn default_max_backoff() -> u64 {
    30_000
}
fn default_max_concurrent() -> usize {
    16
}
fn default_max_consecutive_failures() -> u32 {
    32
}

impl JudgeConfig {
    /// A config with the defaults and the three required values.
    pub fn new(
        base_url: impl Into<String>,
        model: impl Into<String>,
        template: impl Into<String>,
    ) -> Self {
        Self {
            name: default_judge_name(),
            base_url: base_url.into(),
            model: model.into(),
            api_key_env: None,
            template: template.into(),
            system_template: None,
            score_parse: ScoreParse::Json,
            score_key: default_score_key(),
            explanation_key: default_explanation_key(),
            score_regex: None,
            score_min: 0.0,
            score_max: 1.0,
            output_range: unit_range(),
            response_format: ResponseFormatMode::Auto,
            temperature: 0.0,
            top_p: None,
            max_tokens: default_max_tokens(),
            seed: None,
            timeout_secs: default_timeout(),
            max_retries: default_max_retries(),
            initial_backoff_ms: default_initial_backoff(),
            max_backoff_ms: default_max_backoff(),
            requests_per_minute: None,
            tokens_per_minute: None,
            burst: None,
            max_concurrent: default_max_concurrent(),
            cache_path: None,
            max_consecutive_failures: default_max_consecutive_failures(),
        }
    }

    /// Checks every value; the error names the field, prefixed by `prefix` (e.g. `rewards[1].`).
    pub fn validate_at(&self, prefix: &str) -> Result<()> {
        let bad =
            |field: &str, msg: String| Err(RewardError::config(format!("{prefix}{field}"), msg));
        if self.name.trim().is_empty() {
            return bad("name", "must not be empty".into());
        }
        if !(self.base_url.starts_with("http://") || self.base_url.starts_with("https://")) {
            return bad(
                "base_url",
                format!(
                    "must start with http:// or https://, got `{}`",
                    self.base_url
                ),
            );
        }
        if self.model.trim().is_empty() {
            return bad("model", "must not be empty".into());
        }
        if let Some(var) = &self.api_key_env
            && (var.is_empty() || var.contains(char::is_whitespace) || var.len() > 128)
        {
            return bad(
                "api_key_env",
                "must be the NAME of an environment variable (e.g. OPENAI_API_KEY), not the key"
                    .into(),
            );
        }
        if self.template.trim().is_empty() {
            return bad("template", "must not be empty".into());
        }
        if self.score_parse == ScoreParse::Regex && self.score_regex.is_none() {
            return bad(
                "score_regex",
                "is required when score_parse = \"regex\"".into(),
            );
        }
        if let Some(re) = &self.score_regex
            && let Err(e) = regex::Regex::new(re)
        {
            return bad("score_regex", e.to_string());
        }
        if self.score_parse == ScoreParse::Json && self.score_key.is_empty() {
            return bad("score_key", "must not be empty".into());
        }
        if !(self.score_min.is_finite()
            && self.score_max.is_finite()
            && self.score_max > self.score_min)
        {
            return bad(
                "score_max",
                format!(
                    "must be finite and > score_min ({}), got {}",
                    self.score_min, self.score_max
                ),
            );
        }
        if !self.output_range.iter().all(|v| v.is_finite()) {
            return bad("output_range", "must be two finite numbers".into());
        }
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad(
                "temperature",
                format!("must be ≥ 0, got {}", self.temperature),
            );
        }
        if let Some(p) = self.top_p
            && !(p > 0.0 && p <= 1.0)
        {
            return bad("top_p", format!("must be in (0, 1], got {p}"));
        }
        if self.max_tokens == 0 {
            return bad("max_tokens", "must be > 0".into());
        }
        if !(self.timeout_secs.is_finite() && self.timeout_secs > 0.0) {
            return bad(
                "timeout_secs",
                format!("must be > 0, got {}", self.timeout_secs),
            );
        }
        if self.max_retries > 100 {
            return bad(
                "max_retries",
                format!("must be ≤ 100, got {}", self.max_retries),
            );
        }
        if self.initial_backoff_ms > self.max_backoff_ms {
            return bad("initial_backoff_ms", "must be ≤ max_backoff_ms".into());
        }
        if self.requests_per_minute == Some(0) {
            return bad(
                "requests_per_minute",
                "must be > 0 (omit it for no limit)".into(),
            );
        }
        if self.tokens_per_minute == Some(0) {
            return bad(
                "tokens_per_minute",
                "must be > 0 (omit it for no limit)".into(),
            );
        }
        if self.burst == Some(0) {
            return bad("burst", "must be > 0".into());
        }
        if self.max_concurrent == 0 {
            return bad("max_concurrent", "must be > 0".into());
        }
        Ok(())
    }

    /// The retry policy of `max_retries`, `initial_backoff_ms` and `max_backoff_ms` (the one
    /// grpo-rollout's `remote` client uses too): before retry `k`, a uniformly random wait
    /// between `d/2` and `d`, `d = min(initial_backoff_ms · 2^k, max_backoff_ms)`, or the
    /// server's `Retry-After` instead.
    pub fn retry_policy(&self) -> crate::http::RetryPolicy {
        crate::http::RetryPolicy::new(
            self.max_retries,
            std::time::Duration::from_millis(self.initial_backoff_ms),
            std::time::Duration::from_millis(self.max_backoff_ms),
        )
    }

    /// [`JudgeConfig::validate_at`] with no prefix.
    pub fn validate(&self) -> Result<()> {
        self.validate_at("")
    }
}

/// How an ensemble combines its judges.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum EnsembleMode {
    /// Weighted mean of the judges that answered (ArGen-style weighted judges).
    #[default]
    Weighted,
    /// Cheap judges first; when their scores' standard deviation exceeds `escalation_std`,
    /// the `strong` judge decides (RIM-style escalation).
    Escalate,
}

/// A judge in an ensemble, with its weight.
///
/// Deserialized by hand (not with `#[serde(flatten)]`, which would silently accept unknown
/// keys): `weight` is taken out and the rest must be a valid [`JudgeConfig`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WeightedJudge {
    /// Weight in `weighted` mode (ignored by `escalate`). Default 1.
    pub weight: f32,
    /// The judge.
    #[serde(flatten)]
    pub judge: JudgeConfig,
}

impl<'de> Deserialize<'de> for WeightedJudge {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        let mut map = serde_json::Map::<String, serde_json::Value>::deserialize(d)?;
        let weight = match map.remove("weight") {
            None => 1.0,
            Some(v) => serde_json::from_value::<f32>(v)
                .map_err(|e| D::Error::custom(format!("`weight`: {e}")))?,
        };
        let judge =
            JudgeConfig::deserialize(serde_json::Value::Object(map)).map_err(D::Error::custom)?;
        Ok(Self { weight, judge })
    }
}

/// Several judges as one reward (`type = "judge_ensemble"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnsembleConfig {
    /// `weighted` (default) or `escalate`.
    #[serde(default)]
    pub mode: EnsembleMode,
    /// The judges (the cheap ones in `escalate` mode).
    pub judges: Vec<WeightedJudge>,
    /// The stronger judge asked on disagreement (`escalate` mode only).
    #[serde(default)]
    pub strong: Option<JudgeConfig>,
    /// Population standard deviation of the cheap judges' scores (in the output range) above
    /// which the strong judge is asked. Default 0.25.
    #[serde(default = "default_escalation_std")]
    pub escalation_std: f32,
}

fn default_escalation_std() -> f32 {
    0.25
}

impl EnsembleConfig {
    /// Checks the ensemble and each judge; the error names the field.
    pub fn validate_at(&self, prefix: &str) -> Result<()> {
        if self.judges.is_empty() {
            return Err(RewardError::config(
                format!("{prefix}judges"),
                "needs at least one judge",
            ));
        }
        for (i, j) in self.judges.iter().enumerate() {
            let p = format!("{prefix}judges[{i}].");
            j.judge.validate_at(&p)?;
            if !(j.weight.is_finite() && j.weight >= 0.0) {
                return Err(RewardError::config(
                    format!("{p}weight"),
                    "must be a finite number ≥ 0",
                ));
            }
        }
        match (self.mode, &self.strong) {
            (EnsembleMode::Escalate, None) => {
                return Err(RewardError::config(
                    format!("{prefix}strong"),
                    "is required when mode = \"escalate\"",
                ));
            }
            (_, Some(s)) => s.validate_at(&format!("{prefix}strong."))?,
            _ => {}
        }
        if self.mode == EnsembleMode::Weighted && self.judges.iter().all(|j| j.weight == 0.0) {
            return Err(RewardError::config(
                format!("{prefix}judges"),
                "all weights are 0",
            ));
        }
        if !(self.escalation_std.is_finite() && self.escalation_std >= 0.0) {
            return Err(RewardError::config(
                format!("{prefix}escalation_std"),
                "must be ≥ 0",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_keys_in_an_ensemble_judge_are_refused() {
        let ok: WeightedJudge = serde_json::from_value(serde_json::json!({
            "name": "a", "base_url": "http://x/v1", "model": "m", "template": "{{ completion }}",
            "weight": 2.0
        }))
        .unwrap();
        assert_eq!(ok.weight, 2.0);
        let e = serde_json::from_value::<WeightedJudge>(serde_json::json!({
            "name": "a", "base_url": "http://x/v1", "model": "m", "template": "t",
            "temprature": 0.3
        }))
        .unwrap_err()
        .to_string();
        assert!(e.contains("temprature"), "{e}");
    }
}
