//! LLM judges over OpenAI-compatible chat completions: one [`Judge`], and [`JudgeEnsemble`]
//! (weighted judges, or cheap judges with escalation to a strong one).

mod cache;
mod config;
mod ensemble;
mod parse;

use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use async_openai::Client;
use async_openai::config::OpenAIConfig;
use async_openai::error::OpenAIError;
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use serde::Deserialize;
use serde_json::json;
use tokio::sync::Semaphore;

pub use cache::JudgeCache;
pub use config::{
    EnsembleConfig, EnsembleMode, JudgeConfig, ResponseFormatMode, ScoreParse, WeightedJudge,
};
pub use ensemble::JudgeEnsemble;
pub use parse::{ParsedScore, ScoreReader};

use crate::error::{Result, RewardError};
use crate::http::{HttpFailure, RetryDecision, retryable_status};
use crate::reward::{AsyncReward, BoxFuture};
use crate::types::{RewardInput, RewardOutput};

/// Running totals of one judge (all batches since it was built).
#[derive(Debug, Default)]
pub struct JudgeStats {
    requests: AtomicU64,
    retries: AtomicU64,
    failures: AtomicU64,
    cache_hits: AtomicU64,
    cache_misses: AtomicU64,
    schema_fallbacks: AtomicU64,
    in_flight: AtomicU64,
    peak_in_flight: AtomicU64,
}

/// A copy of [`JudgeStats`] at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct JudgeStatsSnapshot {
    /// HTTP attempts sent.
    pub requests: u64,
    /// Attempts that were retries.
    pub retries: u64,
    /// Samples that got no score (after retries, or unparseable replies).
    pub failures: u64,
    /// Samples answered from the cache.
    pub cache_hits: u64,
    /// Samples not in the cache (sent to the server).
    pub cache_misses: u64,
    /// Times the server refused the JSON-schema `response_format` and the judge fell back.
    pub schema_fallbacks: u64,
    /// Most requests seen in flight at once.
    pub peak_in_flight: u64,
}

impl JudgeStats {
    /// The current totals.
    pub fn snapshot(&self) -> JudgeStatsSnapshot {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        JudgeStatsSnapshot {
            requests: l(&self.requests),
            retries: l(&self.retries),
            failures: l(&self.failures),
            cache_hits: l(&self.cache_hits),
            cache_misses: l(&self.cache_misses),
            schema_fallbacks: l(&self.schema_fallbacks),
            peak_in_flight: l(&self.peak_in_flight),
        }
    }
}

/// One judge's verdict on one completion.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Verdict {
    /// The score mapped onto `output_range`; `None` when the judge failed.
    pub score: Option<f32>,
    /// The score on the judge's own scale.
    pub raw: Option<f64>,
    /// The judge's explanation.
    pub explanation: Option<String>,
    /// Answered from the cache.
    pub cached: bool,
    /// Why there is no score.
    pub error: Option<String>,
    /// Retries spent on this completion.
    pub retries: u32,
}

impl Verdict {
    /// The verdict as info JSON.
    pub fn to_json(&self) -> serde_json::Value {
        let mut m = serde_json::Map::new();
        m.insert("score".into(), json!(self.score));
        if let Some(r) = self.raw {
            m.insert("raw_score".into(), json!(r));
        }
        if let Some(e) = &self.explanation {
            m.insert("explanation".into(), json!(e));
        }
        if let Some(e) = &self.error {
            m.insert("error".into(), json!(e));
        }
        m.insert("cached".into(), json!(self.cached));
        serde_json::Value::Object(m)
    }
}

#[derive(Deserialize)]
struct ChatReply {
    choices: Vec<ChatChoice>,
}

#[derive(Deserialize)]
struct ChatChoice {
    message: ChatMessage,
}

#[derive(Deserialize)]
struct ChatMessage {
    #[serde(default)]
    content: Option<String>,
}

enum Failure {
    Retry(RewardError, Option<Duration>),
    SchemaRejected(RewardError),
    Fatal(RewardError),
}

impl Failure {
    fn into_error(self) -> RewardError {
        match self {
            Failure::Retry(e, _) | Failure::SchemaRejected(e) | Failure::Fatal(e) => e,
        }
    }

    fn error(&self) -> &RewardError {
        match self {
            Failure::Retry(e, _) | Failure::SchemaRejected(e) | Failure::Fatal(e) => e,
        }
    }
}

impl RetryDecision for Failure {
    fn retryable(&self) -> bool {
        matches!(self, Failure::Retry(..))
    }

    fn retry_after(&self) -> Option<Duration> {
        match self {
            Failure::Retry(_, after) => *after,
            _ => None,
        }
    }
}

/// An LLM judge: renders its template per completion, asks the server (through the cache,
/// the rate limits and the concurrency cap, with retries), and reads a score.
///
/// Retries follow [`JudgeConfig::retry_policy`] ([`crate::http::RetryPolicy`]: exponential
/// backoff with equal jitter, or the server's `Retry-After`). As an [`AsyncReward`] it scores a
/// batch concurrently; a completion whose request fails after `max_retries` gets `None` and is
/// counted in `judge/failures`. After
/// `max_consecutive_failures` such requests in a row the judge is down and the batch fails with
/// [`RewardError::JudgeDown`].
pub struct Judge {
    config: JudgeConfig,
    env: minijinja::Environment<'static>,
    reader: ScoreReader,
    client: Client<OpenAIConfig>,
    cache: Option<Arc<JudgeCache>>,
    semaphore: Semaphore,
    rpm: Option<DefaultDirectRateLimiter>,
    tpm: Option<(DefaultDirectRateLimiter, u32)>,
    send_schema: AtomicBool,
    stats: JudgeStats,
    /// Requests in a row that failed past their retries (reset by any answer).
    consecutive_failures: AtomicU32,
}

impl std::fmt::Debug for Judge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key: only the variable's name.
        f.debug_struct("Judge")
            .field("name", &self.config.name)
            .field("base_url", &self.config.base_url)
            .field("model", &self.config.model)
            .field("api_key_env", &self.config.api_key_env)
            .field(
                "cache",
                &self.cache.as_ref().map(|c| c.path().to_path_buf()),
            )
            .field("stats", &self.stats.snapshot())
            .finish_non_exhaustive()
    }
}

impl Judge {
    /// Builds a judge: validates the config, reads the key from `api_key_env`, compiles the
    /// templates and opens the cache.
    pub fn new(config: JudgeConfig) -> Result<Self> {
        Self::build(config, None)
    }

    /// Like [`Judge::new`] but with a cache shared with other judges (overrides `cache_path`).
    pub fn with_cache(config: JudgeConfig, cache: Arc<JudgeCache>) -> Result<Self> {
        Self::build(config, Some(cache))
    }

    fn build(config: JudgeConfig, cache: Option<Arc<JudgeCache>>) -> Result<Self> {
        config.validate()?;
        let name = config.name.clone();
        let key = match &config.api_key_env {
            Some(var) => std::env::var(var).map_err(|_| RewardError::MissingApiKey {
                judge: name.clone(),
                var: var.clone(),
            })?,
            None => String::new(),
        };
        let mut env = minijinja::Environment::new();
        env.set_undefined_behavior(minijinja::UndefinedBehavior::Strict);
        let terr = |e: minijinja::Error| RewardError::Template {
            judge: name.clone(),
            message: template_message(&e),
        };
        env.add_template_owned("template", config.template.clone())
            .map_err(terr)?;
        if let Some(s) = &config.system_template {
            env.add_template_owned("system_template", s.clone())
                .map_err(terr)?;
        }
        // A misspelt variable would fail every sample at render time: refuse it now.
        for which in ["template", "system_template"] {
            let Ok(t) = env.get_template(which) else {
                continue;
            };
            let mut unknown: Vec<String> = t
                .undeclared_variables(false)
                .into_iter()
                .filter(|v| !TEMPLATE_VARIABLES.contains(&v.as_str()))
                .filter(|v| env.globals().all(|(g, _)| g != v))
                .collect();
            unknown.sort();
            if let Some(v) = unknown.first() {
                return Err(RewardError::Template {
                    judge: name.clone(),
                    message: format!(
                        "`{which}` uses `{v}`, which is not a template variable (known: {})",
                        TEMPLATE_VARIABLES.join(", ")
                    ),
                });
            }
        }
        let reader = ScoreReader {
            parse: config.score_parse,
            score_key: config.score_key.clone(),
            explanation_key: config.explanation_key.clone(),
            regex: match &config.score_regex {
                Some(r) => Some(
                    regex::Regex::new(r)
                        .map_err(|e| RewardError::config("score_regex", e.to_string()))?,
                ),
                None => None,
            },
            min: config.score_min,
            max: config.score_max,
            range: config.output_range,
        };
        let client = crate::http::openai_client(&config.base_url, &key);
        let cache = match (cache, &config.cache_path) {
            (Some(c), _) => Some(c),
            (None, Some(p)) => Some(Arc::new(JudgeCache::open(p)?)),
            (None, None) => None,
        };
        let nz = |v: u32| NonZeroU32::new(v.max(1)).unwrap_or(NonZeroU32::MIN);
        let rpm = config.requests_per_minute.map(|r| {
            let burst = config.burst.unwrap_or((r / 60).max(1));
            RateLimiter::direct(Quota::per_minute(nz(r)).allow_burst(nz(burst)))
        });
        let tpm = config.tokens_per_minute.map(|t| {
            // A second's worth of tokens, but never less than one request's estimate.
            let burst = (t / 60).max(config.max_tokens + 256).min(t);
            (
                RateLimiter::direct(Quota::per_minute(nz(t)).allow_burst(nz(burst))),
                burst,
            )
        });
        let send_schema = config.score_parse == ScoreParse::Json
            && config.response_format != ResponseFormatMode::None;
        Ok(Self {
            semaphore: Semaphore::new(config.max_concurrent),
            consecutive_failures: AtomicU32::new(0),
            config,
            env,
            reader,
            client,
            cache,
            rpm,
            tpm,
            send_schema: AtomicBool::new(send_schema),
            stats: JudgeStats::default(),
        })
    }

    /// The judge's name.
    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// The config (which holds no key).
    pub fn config(&self) -> &JudgeConfig {
        &self.config
    }

    /// Running totals.
    pub fn stats(&self) -> JudgeStatsSnapshot {
        self.stats.snapshot()
    }

    /// The cache, when there is one.
    pub fn cache(&self) -> Option<&Arc<JudgeCache>> {
        self.cache.as_ref()
    }

    /// The chat messages the judge sends for `input` (the rendered templates).
    pub fn render(&self, input: &RewardInput) -> Result<Vec<crate::types::Message>> {
        let fields: serde_json::Map<String, serde_json::Value> = input
            .fields
            .iter()
            .map(|(k, v)| (k.clone(), v.to_json()))
            .collect();
        let ctx = minijinja::Value::from(minijinja::value::Serde(json!({
            "prompt": input.prompt,
            "completion": input.completion,
            "completion_tokens": input.completion_tokens,
            "messages": input.prompt_messages.clone().unwrap_or_default(),
            "fields": fields,
        })));
        let render = |name: &str| -> Result<String> {
            self.env
                .get_template(name)
                .and_then(|t| t.render(&ctx))
                .map_err(|e| RewardError::Template {
                    judge: self.config.name.clone(),
                    message: template_message(&e),
                })
        };
        let mut msgs = Vec::with_capacity(2);
        if self.config.system_template.is_some() {
            msgs.push(crate::types::Message::new(
                "system",
                render("system_template")?,
            ));
        }
        msgs.push(crate::types::Message::new("user", render("template")?));
        Ok(msgs)
    }

    fn cache_key(&self, messages: &[crate::types::Message]) -> String {
        let c = &self.config;
        JudgeCache::key(&json!({
            "v": 1,
            "base_url": c.base_url.trim_end_matches('/'),
            "model": c.model,
            "template": c.template,
            "system_template": c.system_template,
            "messages": messages,
            "temperature": c.temperature,
            "top_p": c.top_p,
            "max_tokens": c.max_tokens,
            "seed": c.seed,
            "score_parse": c.score_parse,
        }))
    }

    fn classify(&self, e: OpenAIError, schema_sent: bool) -> Failure {
        let judge = self.config.name.clone();
        let http = |f: &HttpFailure| RewardError::Http {
            judge: judge.clone(),
            status: f.status,
            message: parse::snippet(&f.body),
        };
        match e {
            OpenAIError::Boxed(b) => match b.downcast::<HttpFailure>() {
                Ok(f) => {
                    let s = f.status;
                    if retryable_status(s) {
                        Failure::Retry(http(&f), f.retry_after)
                    } else if schema_sent
                        && self.config.response_format == ResponseFormatMode::Auto
                        && matches!(s, 400 | 404 | 415 | 422)
                    {
                        Failure::SchemaRejected(http(&f))
                    } else {
                        Failure::Fatal(http(&f))
                    }
                }
                Err(other) => Failure::Retry(
                    RewardError::Transport {
                        judge,
                        message: other.to_string(),
                    },
                    None,
                ),
            },
            OpenAIError::Reqwest(e) => Failure::Retry(
                RewardError::Transport {
                    judge,
                    message: e.to_string(),
                },
                None,
            ),
            OpenAIError::ApiError(a) => {
                let s = a.status_code.as_u16();
                let err = RewardError::Http {
                    judge,
                    status: s,
                    message: parse::snippet(&a.api_error.message),
                };
                if retryable_status(s) {
                    Failure::Retry(err, None)
                } else {
                    Failure::Fatal(err)
                }
            }
            OpenAIError::JSONDeserialize(e, body) => Failure::Fatal(RewardError::Parse {
                judge,
                message: format!(
                    "the body is not a chat completion ({e}): {}",
                    parse::snippet(&body)
                ),
            }),
            other => Failure::Fatal(RewardError::Transport {
                judge,
                message: other.to_string(),
            }),
        }
    }

    /// Sends `messages` (with retries) and returns the reply text and the retries spent.
    async fn request(&self, messages: &[crate::types::Message]) -> (Result<String>, u32) {
        let c = &self.config;
        let est_tokens = messages
            .iter()
            .map(|m| m.content.len() as u32 / 4 + 4)
            .sum::<u32>()
            + c.max_tokens;
        let retries = AtomicU32::new(0);
        let reply = c
            .retry_policy()
            .retry(
                || self.attempt(messages, est_tokens, retries.load(Ordering::Relaxed) + 1),
                |failure: &Failure, wait| {
                    let n = retries.fetch_add(1, Ordering::Relaxed) + 1;
                    self.stats.retries.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(judge = %c.name, error = %failure.error(), retry = n, wait_ms = wait.as_millis() as u64, "judge request failed; retrying");
                },
            )
            .await;
        (
            reply.map_err(Failure::into_error),
            retries.load(Ordering::Relaxed),
        )
    }

    /// One attempt (resent at once without the JSON schema when the server refuses it).
    async fn attempt(
        &self,
        messages: &[crate::types::Message],
        est_tokens: u32,
        attempt: u32,
    ) -> std::result::Result<String, Failure> {
        let c = &self.config;
        loop {
            let schema = self.send_schema.load(Ordering::Relaxed);
            let mut body = json!({
                "model": c.model,
                "messages": messages,
                "temperature": c.temperature,
                "max_tokens": c.max_tokens,
                "stream": false,
            });
            if let Some(p) = c.top_p {
                body["top_p"] = json!(p);
            }
            if let Some(s) = c.seed {
                body["seed"] = json!(s);
            }
            if schema {
                body["response_format"] = json!({
                    "type": "json_schema",
                    "json_schema": {
                        "name": "judge_score",
                        "strict": true,
                        "schema": {
                            "type": "object",
                            "properties": {
                                c.score_key.clone(): {"type": "number"},
                                c.explanation_key.clone(): {"type": "string"},
                            },
                            "required": [c.score_key.clone(), c.explanation_key.clone()],
                            "additionalProperties": false,
                        }
                    }
                });
            }
            let outcome = {
                let permit = self.semaphore.acquire().await;
                if let Some(l) = &self.rpm {
                    l.until_ready().await;
                }
                if let Some((l, burst)) = &self.tpm {
                    let n = NonZeroU32::new(est_tokens.clamp(1, *burst)).unwrap_or(NonZeroU32::MIN);
                    // n ≤ burst, so this cannot report insufficient capacity.
                    let _ = l.until_n_ready(n).await;
                }
                let now = self.stats.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
                self.stats.peak_in_flight.fetch_max(now, Ordering::Relaxed);
                self.stats.requests.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(judge = %c.name, attempt, schema, "judge request");
                let r = tokio::time::timeout(
                    Duration::from_secs_f64(c.timeout_secs),
                    self.client.chat().create_byot::<_, ChatReply>(body),
                )
                .await;
                self.stats.in_flight.fetch_sub(1, Ordering::Relaxed);
                drop(permit);
                r
            };
            let failure = match outcome {
                Ok(Ok(reply)) => {
                    let text = reply
                        .choices
                        .into_iter()
                        .next()
                        .and_then(|ch| ch.message.content);
                    return text.ok_or_else(|| {
                        Failure::Fatal(RewardError::Parse {
                            judge: c.name.clone(),
                            message: "the reply has no choices[0].message.content".into(),
                        })
                    });
                }
                Ok(Err(e)) => self.classify(e, schema),
                Err(_) => Failure::Retry(
                    RewardError::Timeout {
                        judge: c.name.clone(),
                        seconds: c.timeout_secs,
                    },
                    None,
                ),
            };
            match failure {
                // Once: the schema is never sent again by this judge.
                Failure::SchemaRejected(e) => {
                    if self.send_schema.swap(false, Ordering::Relaxed) {
                        self.stats.schema_fallbacks.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(judge = %c.name, error = %e, "server refused the JSON-schema response_format; sending without it");
                    }
                }
                other => return Err(other),
            }
        }
    }

    /// Judges one completion. Everything that goes wrong for this completion (a template that
    /// does not render for it, e.g. a field it lacks; the network; the reply) becomes a verdict
    /// without a score, counted as a failure. Templates that do not compile are refused when
    /// the judge is built.
    pub async fn judge(&self, input: &RewardInput) -> Result<Verdict> {
        let messages = match self.render(input) {
            Ok(m) => m,
            Err(e) => {
                self.stats.failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(judge = %self.config.name, error = %e, "judge template did not render for this sample");
                return Ok(Verdict {
                    error: Some(e.to_string()),
                    ..Verdict::default()
                });
            }
        };
        let key = self.cache.as_ref().map(|_| self.cache_key(&messages));
        if let (Some(cache), Some(key)) = (&self.cache, &key) {
            match cache.get(key) {
                Ok(Some(reply)) => {
                    if let Ok(p) = self.reader.read(&reply) {
                        self.stats.cache_hits.fetch_add(1, Ordering::Relaxed);
                        return Ok(Verdict {
                            score: Some(self.reader.map(p.raw)),
                            raw: Some(p.raw),
                            explanation: p.explanation,
                            cached: true,
                            error: None,
                            retries: 0,
                        });
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(judge = %self.config.name, error = %e, "cache read failed; asking the server")
                }
            }
            self.stats.cache_misses.fetch_add(1, Ordering::Relaxed);
        }
        let (reply, retries) = self.request(&messages).await;
        match &reply {
            Ok(_) => self.consecutive_failures.store(0, Ordering::Relaxed),
            Err(e) => {
                let n = self.consecutive_failures.fetch_add(1, Ordering::Relaxed) + 1;
                let limit = self.config.max_consecutive_failures;
                if limit > 0 && n >= limit {
                    self.stats.failures.fetch_add(1, Ordering::Relaxed);
                    return Err(RewardError::JudgeDown {
                        judge: self.config.name.clone(),
                        failures: n,
                        last: e.to_string(),
                    });
                }
            }
        }
        let parsed = reply.and_then(|r| {
            self.reader
                .read(&r)
                .map(|p| (p, r))
                .map_err(|message| RewardError::Parse {
                    judge: self.config.name.clone(),
                    message,
                })
        });
        match parsed {
            Ok((p, reply)) => {
                if let (Some(cache), Some(key)) = (&self.cache, &key)
                    && let Err(e) = cache.put(key, &reply)
                {
                    tracing::warn!(judge = %self.config.name, error = %e, "cache write failed");
                }
                Ok(Verdict {
                    score: Some(self.reader.map(p.raw)),
                    raw: Some(p.raw),
                    explanation: p.explanation,
                    cached: false,
                    error: None,
                    retries,
                })
            }
            Err(e) => {
                self.stats.failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(judge = %self.config.name, error = %e, "judge gave no score");
                Ok(Verdict {
                    error: Some(e.to_string()),
                    retries,
                    ..Verdict::default()
                })
            }
        }
    }

    /// Judges a batch concurrently (the semaphore bounds the requests in flight).
    pub async fn judge_batch(&self, batch: &[RewardInput]) -> Result<Vec<Verdict>> {
        let all = futures_util::future::join_all(batch.iter().map(|x| self.judge(x))).await;
        all.into_iter().collect()
    }
}

pub(crate) fn counters_of(verdicts: &[&Verdict]) -> std::collections::BTreeMap<String, f64> {
    let mut c = std::collections::BTreeMap::new();
    let count = |f: &dyn Fn(&Verdict) -> bool| verdicts.iter().filter(|v| f(v)).count() as f64;
    c.insert("judge/failures".to_owned(), count(&|v| v.error.is_some()));
    c.insert("judge/cache_hits".to_owned(), count(&|v| v.cached));
    c.insert(
        "judge/retries".to_owned(),
        verdicts.iter().map(|v| f64::from(v.retries)).sum(),
    );
    c
}

/// The variables a judge template sees.
const TEMPLATE_VARIABLES: [&str; 5] = [
    "prompt",
    "completion",
    "completion_tokens",
    "messages",
    "fields",
];

fn template_message(e: &minijinja::Error) -> String {
    let mut m = e.to_string();
    if let Some(d) = e.detail()
        && !m.contains(d)
    {
        m.push_str(&format!(" ({d})"));
    }
    m
}

impl AsyncReward for Judge {
    fn score_async<'a>(&'a self, batch: &'a [RewardInput]) -> BoxFuture<'a, Result<RewardOutput>> {
        Box::pin(async move {
            let verdicts = self.judge_batch(batch).await?;
            let refs: Vec<&Verdict> = verdicts.iter().collect();
            let counters = counters_of(&refs);
            Ok(RewardOutput {
                scores: verdicts.iter().map(|v| v.score).collect(),
                info: verdicts.iter().map(|v| Some(v.to_json())).collect(),
                counters,
            })
        })
    }
}
