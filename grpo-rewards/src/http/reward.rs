//! `type = "http"`: a reward model behind an HTTP service. Each step's batch is POSTed as JSON
//! with the fields a TRL reward function receives; the service answers `{"rewards": [...]}`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use reqwest::header::{AUTHORIZATION, CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::sync::Semaphore;

use super::retry::{FailedAttempt, RetryPolicy, retry_after, retry_after_ms, retryable_status};
use super::snippet;
use crate::error::{Result, RewardError};
use crate::reward::{AsyncReward, BoxFuture};
use crate::types::{RewardInput, RewardOutput};

/// The keys of the request body that are not dataset columns (a column with one of these
/// names is left out of the body).
pub const RESERVED_KEYS: [&str; 4] = ["prompts", "completions", "completion_ids", "trainer_state"];

/// A reward model behind an HTTP service (`type = "http"`).
///
/// Each step's batch (or each slice of `batch_size` samples) is POSTed to `url` as one JSON
/// object with TRL's reward-function arguments: `prompts`, `completions`, `completion_ids`,
/// `trainer_state` (`{"global_step": N}`) and one list per dataset column. Conversational
/// samples send their prompt as a message list and their completion as
/// `[{"role": "assistant", "content": ...}]`, as TRL passes them. The service answers
/// `{"rewards": [...]}`: one number or `null` (unscorable) per sample, in order.
///
/// ```toml
/// [[rewards]]
/// type = "http"
/// url = "http://127.0.0.1:8000/score"
/// api_key_env = "RM_API_KEY"
/// batch_size = 32
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpRewardConfig {
    /// Where batches are POSTed (`http://` or `https://`).
    pub url: String,
    /// NAME of the environment variable holding a bearer token, sent as
    /// `Authorization: Bearer <token>`; absent → no `Authorization` header. The token is read
    /// when the reward is built and never stored in the config, logged or put in an error.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// Extra static headers sent with every request (written in config dumps as they are: put
    /// secrets in `api_key_env`).
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Seconds one attempt may take (connecting, sending, the answer). Default 60.
    #[serde(default = "default_timeout")]
    pub timeout: f64,
    /// Retries after the first attempt of a request (connection errors, timeouts, HTTP 408, 409,
    /// 429 and 5xx), with [`RetryPolicy`]. Default 3.
    #[serde(default = "default_max_retries")]
    pub max_retries: u32,
    /// `d` of the first retry in ms, doubled each retry up to `max_backoff_ms`; each wait is a
    /// uniformly random time between `d/2` and `d`. A `Retry-After` (delta-seconds or an HTTP
    /// date) replaces the computed wait. Default 500.
    #[serde(default = "default_initial_backoff")]
    pub initial_backoff_ms: u64,
    /// The cap of `d` in ms. Default 30000.
    #[serde(default = "default_max_backoff")]
    pub max_backoff_ms: u64,
    /// Samples per request at most (a step's batch is split); absent → the whole batch in one.
    #[serde(default)]
    pub batch_size: Option<usize>,
    /// Requests in flight at once at most (over every batch being scored). Default 4.
    #[serde(default = "default_max_concurrent")]
    pub max_concurrent: usize,
}

fn default_timeout() -> f64 {
    60.0
}
fn default_max_retries() -> u32 {
    3
}
fn default_initial_backoff() -> u64 {
    500
}
fn default_max_backoff() -> u64 {
    30_000
}
fn default_max_concurrent() -> usize {
    4
}

impl HttpRewardConfig {
    /// A config for `url` with the defaults.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            api_key_env: None,
            headers: BTreeMap::new(),
            timeout: default_timeout(),
            max_retries: default_max_retries(),
            initial_backoff_ms: default_initial_backoff(),
            max_backoff_ms: default_max_backoff(),
            batch_size: None,
            max_concurrent: default_max_concurrent(),
        }
    }

    /// The retry policy of every request: `max_retries`, `initial_backoff_ms`, `max_backoff_ms`.
    pub fn retry_policy(&self) -> RetryPolicy {
        RetryPolicy::new(
            self.max_retries,
            Duration::from_millis(self.initial_backoff_ms),
            Duration::from_millis(self.max_backoff_ms),
        )
    }

    /// Checks the values that need no environment; errors name the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, msg: &str| Err(RewardError::config(field, msg));
        match reqwest::Url::parse(&self.url) {
            Ok(u) if matches!(u.scheme(), "http" | "https") => {}
            _ => {
                return Err(RewardError::config(
                    "url",
                    format!(
                        "must be an http:// or https:// URL, got `{}`",
                        shown_url(&self.url)
                    ),
                ));
            }
        }
        if let Some(var) = &self.api_key_env
            && (var.is_empty() || var.contains(char::is_whitespace) || var.len() > 128)
        {
            return bad(
                "api_key_env",
                "must be the NAME of an environment variable (e.g. RM_API_KEY), not the key",
            );
        }
        for (name, value) in &self.headers {
            let field = format!("headers.{name}");
            let Ok(h) = HeaderName::from_bytes(name.as_bytes()) else {
                return Err(RewardError::config(
                    field,
                    "is not a valid HTTP header name",
                ));
            };
            if HeaderValue::from_str(value).is_err() {
                return Err(RewardError::config(
                    field,
                    "is not a valid HTTP header value (no newlines or control characters)",
                ));
            }
            if h == AUTHORIZATION && self.api_key_env.is_some() {
                return Err(RewardError::config(
                    field,
                    "conflicts with api_key_env, which sends `Authorization: Bearer <token>`; keep one",
                ));
            }
        }
        if !(self.timeout.is_finite() && self.timeout > 0.0) {
            return bad("timeout", "must be a positive number of seconds");
        }
        if self.batch_size == Some(0) {
            return bad(
                "batch_size",
                "must be at least 1 (leave it out to send the whole batch)",
            );
        }
        if self.max_concurrent == 0 {
            return bad("max_concurrent", "must be at least 1");
        }
        Ok(())
    }
}

/// `url` without a password (`https://user:***@host/...`), for messages.
fn shown_url(url: &str) -> String {
    match reqwest::Url::parse(url) {
        Ok(mut u) if matches!(u.scheme(), "http" | "https") => {
            if u.password().is_some() {
                let _ = u.set_password(Some("***"));
                u.to_string()
            } else {
                url.to_owned()
            }
        }
        // Not a URL we send to: cut at an `@`, so that `user:secret@` is never echoed.
        _ => match url.rfind('@') {
            Some(at) => format!("…{}", &url[at..]),
            None => url.to_owned(),
        },
    }
}

/// A reward model behind an HTTP service: see [`HttpRewardConfig`].
///
/// An [`AsyncReward`]: the slices of a batch are sent concurrently (at most `max_concurrent`
/// requests in flight, over every batch being scored), each retried with
/// [`HttpRewardConfig::retry_policy`]. A request that still fails after its retries, a 4xx
/// that is not retryable, or an answer that is not one number or `null` per sample fails the
/// batch with an error naming the reward and the URL (never the token): a training run then
/// stops with a checkpoint instead of training on unscored batches.
///
/// Counters per batch: `rewards/{name}/requests` (HTTP attempts), `rewards/{name}/retries`,
/// `rewards/{name}/timeouts` (attempts past `timeout`) and `rewards/{name}/unscored` (samples
/// the service answered `null` for).
pub struct HttpReward {
    name: String,
    config: HttpRewardConfig,
    url: String,
    client: reqwest::Client,
    headers: HeaderMap,
    /// The token, only to scrub it from echoed bodies.
    key: Option<String>,
    semaphore: Semaphore,
    warned_reserved: AtomicBool,
}

impl std::fmt::Debug for HttpReward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the token: only the variable's name; the static headers by name.
        f.debug_struct("HttpReward")
            .field("name", &self.name)
            .field("url", &self.url)
            .field("api_key_env", &self.config.api_key_env)
            .field("headers", &self.config.headers.keys().collect::<Vec<_>>())
            .field("timeout", &self.config.timeout)
            .field("max_retries", &self.config.max_retries)
            .field("batch_size", &self.config.batch_size)
            .field("max_concurrent", &self.config.max_concurrent)
            .finish_non_exhaustive()
    }
}

/// Counts of one batch.
#[derive(Default)]
struct Counts {
    requests: AtomicU32,
    retries: AtomicU32,
    timeouts: AtomicU32,
}

#[derive(Deserialize)]
struct Answer {
    rewards: Vec<Value>,
}

impl HttpReward {
    /// Builds the reward `name` (its name in metrics and errors): validates `config`, reads the
    /// token from `api_key_env` and prepares the headers.
    pub fn new(name: impl Into<String>, config: &HttpRewardConfig) -> Result<Self> {
        config.validate()?;
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        for (name, value) in &config.headers {
            // Checked by `validate`.
            if let (Ok(n), Ok(v)) = (
                HeaderName::from_bytes(name.as_bytes()),
                HeaderValue::from_str(value),
            ) {
                headers.insert(n, v);
            }
        }
        let key = match &config.api_key_env {
            Some(var) => {
                let key = std::env::var(var).map_err(|_| {
                    RewardError::config(
                        "api_key_env",
                        format!("environment variable `{var}` is not set"),
                    )
                })?;
                if key.trim().is_empty() {
                    return Err(RewardError::config(
                        "api_key_env",
                        format!("environment variable `{var}` is empty"),
                    ));
                }
                let mut v = HeaderValue::from_str(&format!("Bearer {key}")).map_err(|_| {
                    RewardError::config(
                        "api_key_env",
                        format!(
                            "environment variable `{var}` holds characters an HTTP header cannot carry"
                        ),
                    )
                })?;
                v.set_sensitive(true);
                headers.insert(AUTHORIZATION, v);
                Some(key)
            }
            None => None,
        };
        let client = reqwest::Client::builder()
            .build()
            .map_err(|e| RewardError::Runtime {
                message: format!("cannot start the HTTP client: {e}"),
            })?;
        Ok(Self {
            name: name.into(),
            url: shown_url(&config.url),
            config: config.clone(),
            client,
            headers,
            key,
            semaphore: Semaphore::new(config.max_concurrent),
            warned_reserved: AtomicBool::new(false),
        })
    }

    /// The reward's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The config (which holds the token's variable name, never the token).
    pub fn config(&self) -> &HttpRewardConfig {
        &self.config
    }

    /// The JSON body of one request for `chunk`: TRL's reward-function arguments, plus one
    /// list per name of `columns` (`null` where a sample lacks the column).
    pub fn request_body(&self, chunk: &[RewardInput], columns: &BTreeSet<&str>) -> Value {
        let mut body = serde_json::Map::new();
        for &c in columns {
            if RESERVED_KEYS.contains(&c) {
                if !self.warned_reserved.swap(true, Ordering::Relaxed) {
                    tracing::warn!(reward = %self.name, column = c, "a dataset column has the name of a request field and is not sent");
                }
                continue;
            }
            let values = chunk
                .iter()
                .map(|x| x.fields.get(c).map_or(Value::Null, |v| v.to_json()))
                .collect();
            body.insert(c.to_owned(), Value::Array(values));
        }
        let prompts = chunk
            .iter()
            .map(|x| match &x.prompt_messages {
                Some(m) => json!(m),
                None => json!(x.prompt),
            })
            .collect();
        let completions = chunk
            .iter()
            .map(|x| match &x.prompt_messages {
                Some(_) => json!([{"role": "assistant", "content": x.completion}]),
                None => json!(x.completion),
            })
            .collect();
        let ids = chunk.iter().map(|x| json!(x.completion_ids)).collect();
        let step = chunk.first().map_or(0, |x| x.global_step);
        body.insert("prompts".into(), Value::Array(prompts));
        body.insert("completions".into(), Value::Array(completions));
        body.insert("completion_ids".into(), Value::Array(ids));
        body.insert("trainer_state".into(), json!({"global_step": step}));
        Value::Object(body)
    }

    /// `text` with the token replaced (a server may echo the request's headers).
    fn scrub(&self, text: &str) -> String {
        match &self.key {
            Some(k) if !k.is_empty() => text.replace(k.as_str(), "<api_key_env>"),
            _ => text.to_owned(),
        }
    }

    fn error(&self, message: impl Into<String>) -> RewardError {
        RewardError::Service {
            reward: self.name.clone(),
            url: self.url.clone(),
            message: message.into(),
        }
    }

    /// One attempt: the answer's body when the status is 2xx.
    async fn attempt(
        &self,
        body: &[u8],
        counts: &Counts,
    ) -> std::result::Result<Vec<u8>, FailedAttempt> {
        let permit = self.semaphore.acquire().await.map_err(|_| FailedAttempt {
            message: "the reward was shut down".into(),
            status: None,
            retryable: false,
            retry_after: None,
        })?;
        counts.requests.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(reward = %self.name, url = %self.url, bytes = body.len(), "reward request");
        let send = async {
            let response = self
                .client
                .post(&self.config.url)
                .headers(self.headers.clone())
                .body(body.to_vec())
                .send()
                .await
                .map_err(|e| self.transport(e))?;
            let status = response.status();
            if status.is_success() {
                return response
                    .bytes()
                    .await
                    .map(|b| b.to_vec())
                    .map_err(|e| self.transport(e));
            }
            let h = response.headers();
            let header = |name: &str| h.get(name).and_then(|v| v.to_str().ok());
            let wait = header("retry-after-ms")
                .and_then(retry_after_ms)
                .or_else(|| header("retry-after").and_then(retry_after));
            let text = response.text().await.unwrap_or_default();
            let text = self.scrub(&text);
            let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
            Err(FailedAttempt {
                message: format!("HTTP {}: {}", status.as_u16(), snippet(first.trim())),
                status: Some(status.as_u16()),
                retryable: retryable_status(status.as_u16()),
                retry_after: wait,
            })
        };
        let outcome =
            tokio::time::timeout(Duration::from_secs_f64(self.config.timeout), send).await;
        drop(permit);
        outcome.unwrap_or_else(|_| {
            counts.timeouts.fetch_add(1, Ordering::Relaxed);
            Err(FailedAttempt {
                message: format!("no answer within {} s (timeout)", self.config.timeout),
                status: None,
                retryable: true,
                retry_after: None,
            })
        })
    }

    /// A request that got no HTTP answer: the error and its causes, without the URL (the
    /// message names it once).
    fn transport(&self, e: reqwest::Error) -> FailedAttempt {
        let message = super::error_chain(&e.without_url());
        FailedAttempt {
            message: self.scrub(&message),
            status: None,
            retryable: true,
            retry_after: None,
        }
    }

    /// Scores `chunk`, the samples `start..start + chunk.len()` of the batch.
    async fn score_chunk(
        &self,
        start: usize,
        chunk: &[RewardInput],
        columns: &BTreeSet<&str>,
        counts: &Counts,
    ) -> Result<Vec<Option<f32>>> {
        let body = serde_json::to_vec(&self.request_body(chunk, columns))
            .map_err(|e| self.error(format!("cannot write the request body: {e}")))?;
        let retries = AtomicU32::new(0);
        let answer = self
            .config
            .retry_policy()
            .retry(
                || self.attempt(&body, counts),
                |f: &FailedAttempt, wait| {
                    let n = retries.fetch_add(1, Ordering::Relaxed) + 1;
                    counts.retries.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(reward = %self.name, url = %self.url, error = %f.message, retry = n, wait_ms = wait.as_millis() as u64, "reward request failed; retrying");
                },
            )
            .await
            .map_err(|f| {
                let n = retries.load(Ordering::Relaxed);
                if n > 0 {
                    let retries = if n == 1 { "retry" } else { "retries" };
                    self.error(format!(
                        "{} (gave up after {n} {retries}; max_retries)",
                        f.message
                    ))
                } else {
                    self.error(f.message)
                }
            })?;
        self.parse(start, chunk.len(), &answer)
    }

    /// The rewards of an answer for the samples `start..start + n`.
    fn parse(&self, start: usize, n: usize, body: &[u8]) -> Result<Vec<Option<f32>>> {
        let samples = format!("samples {start}..{}", start + n);
        let answer: Answer = serde_json::from_slice(body).map_err(|e| {
            let text = self.scrub(&String::from_utf8_lossy(body));
            self.error(format!(
                "the answer for {samples} is not {{\"rewards\": [...]}} ({e}): {}",
                snippet(text.trim())
            ))
        })?;
        if answer.rewards.len() != n {
            return Err(self.error(format!(
                "answered {} rewards for the {n} {samples}; want one number or null per sample",
                answer.rewards.len()
            )));
        }
        answer
            .rewards
            .iter()
            .enumerate()
            .map(|(j, v)| match v {
                Value::Null => Ok(None),
                Value::Number(x) => match x.as_f64().map(|x| x as f32) {
                    Some(r) if r.is_finite() => Ok(Some(r)),
                    _ => Err(self.sample_error(start + j, v)),
                },
                _ => Err(self.sample_error(start + j, v)),
            })
            .collect()
    }

    fn sample_error(&self, index: usize, v: &Value) -> RewardError {
        RewardError::Sample {
            reward: self.name.clone(),
            index,
            message: format!(
                "{} answered {} as its reward, not a number (within f32) or null",
                self.url,
                snippet(&self.scrub(&v.to_string()))
            ),
        }
    }

    /// Scores a batch (see the type's doc).
    pub async fn score_batch(&self, batch: &[RewardInput]) -> Result<RewardOutput> {
        let columns: BTreeSet<&str> = batch
            .iter()
            .flat_map(|x| x.fields.keys().map(String::as_str))
            .collect();
        let size = self.config.batch_size.unwrap_or(batch.len()).max(1);
        let counts = Counts::default();
        let parts = futures_util::future::try_join_all(
            batch
                .chunks(size)
                .enumerate()
                .map(|(k, chunk)| self.score_chunk(k * size, chunk, &columns, &counts)),
        )
        .await?;
        let scores: Vec<Option<f32>> = parts.concat();
        let mut counters = BTreeMap::new();
        let mut count = |what: &str, v: u32| {
            counters.insert(format!("rewards/{}/{what}", self.name), f64::from(v));
        };
        count("requests", counts.requests.load(Ordering::Relaxed));
        count("retries", counts.retries.load(Ordering::Relaxed));
        count("timeouts", counts.timeouts.load(Ordering::Relaxed));
        let unscored = scores.iter().filter(|s| s.is_none()).count();
        count("unscored", u32::try_from(unscored).unwrap_or(u32::MAX));
        Ok(RewardOutput {
            scores,
            info: Vec::new(),
            counters,
        })
    }
}

impl AsyncReward for HttpReward {
    fn score_async<'a>(&'a self, batch: &'a [RewardInput]) -> BoxFuture<'a, Result<RewardOutput>> {
        Box::pin(self.score_batch(batch))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_the_field() {
        let field = |c: &HttpRewardConfig| match c.validate() {
            Err(RewardError::Config { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        let ok = HttpRewardConfig::new("http://127.0.0.1:9/score");
        assert!(ok.validate().is_ok());
        let mut c = ok.clone();
        c.url = "ftp://x/score".into();
        assert_eq!(field(&c), "url");
        c.url = "127.0.0.1:9".into();
        assert_eq!(field(&c), "url");
        let mut c = ok.clone();
        c.timeout = 0.0;
        assert_eq!(field(&c), "timeout");
        let mut c = ok.clone();
        c.batch_size = Some(0);
        assert_eq!(field(&c), "batch_size");
        let mut c = ok.clone();
        c.max_concurrent = 0;
        assert_eq!(field(&c), "max_concurrent");
        let mut c = ok.clone();
        c.headers.insert("X Bad".into(), "v".into());
        assert_eq!(field(&c), "headers.X Bad");
        let mut c = ok.clone();
        c.headers.insert("X-Team".into(), "a\nb".into());
        assert_eq!(field(&c), "headers.X-Team");
        let mut c = ok.clone();
        c.api_key_env = Some("RM_KEY".into());
        c.headers.insert("authorization".into(), "Bearer x".into());
        assert_eq!(field(&c), "headers.authorization");
        let mut c = ok.clone();
        c.api_key_env = Some("Bearer sk-123".into());
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("api_key_env") && !e.contains("sk-123"), "{e}");
    }

    #[test]
    fn passwords_in_urls_are_not_shown() {
        assert_eq!(
            shown_url("https://u:secret@h.example/score"),
            "https://u:***@h.example/score"
        );
        assert_eq!(shown_url("http://h:1/s?x=1"), "http://h:1/s?x=1");
        assert!(!shown_url("u:secret@nowhere").contains("secret"));
    }

    #[test]
    fn request_body_is_trl_shaped() {
        let r = HttpReward::new("rm", &HttpRewardConfig::new("http://127.0.0.1:9/")).unwrap();
        let batch = [
            RewardInput::new("p0", "c0")
                .with_ids(vec![1, 2])
                .with_field("answer", "4")
                .at_step(7),
            RewardInput::new("p1", "c1")
                .with_field("id", 3i64)
                .with_field("prompts", "shadowed")
                .at_step(7),
        ];
        let cols = batch
            .iter()
            .flat_map(|x| x.fields.keys().map(String::as_str))
            .collect();
        let b = r.request_body(&batch, &cols);
        assert_eq!(
            b,
            json!({
                "prompts": ["p0", "p1"],
                "completions": ["c0", "c1"],
                "completion_ids": [[1, 2], []],
                "trainer_state": {"global_step": 7},
                "answer": ["4", null],
                "id": [null, 3],
            })
        );
        let conv = [RewardInput::new("rendered", "c")
            .with_messages(vec![crate::types::Message::new("user", "hi")])];
        let b = r.request_body(&conv, &BTreeSet::new());
        assert_eq!(b["prompts"], json!([[{"role": "user", "content": "hi"}]]));
        assert_eq!(
            b["completions"],
            json!([[{"role": "assistant", "content": "c"}]])
        );
    }
}
