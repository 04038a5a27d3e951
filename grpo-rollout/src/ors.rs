//! Environments on an Open Reward Standard (ORS) server: the `openreward` SDK's HTTP protocol,
//! which openreward.ai's catalogue and any self-hosted `openreward.environments.Server` speak
//! (feature `remote`). TRL's `trl.experimental.openreward` wires the same servers into its
//! GRPOTrainer; [`OrsEnvironment`] does it as one more [`crate::env::AsyncEnvironment`].
//!
//! **The protocol.** A server holds one or more environments (`GET /list_environments`), each
//! with splits of tasks (`POST /{env}/num_tasks`, `/{env}/task`, `/{env}/task_range`) and tools
//! (`GET /{env}/tools`: name, description, JSON schema of the input; and the `@terminal` tool,
//! hidden from the model, that grades a plain answer). An episode is a *session*: `POST
//! /create_session` (a server-sent event stream whose `task_id` event is the session id), then
//! `POST /create` with `X-Session-ID` and the task (`split` and `index`, or a `task_spec`)
//! builds the environment; `GET /{env}/prompt` is the task's prompt (text blocks), `POST
//! /{env}/call` runs a tool (an event stream: `task_id`, then the JSON result in `chunk`s and
//! an `end`, or an `error`; a stream that breaks is resumed by posting again with the
//! `task_id`), answering `{"ok": true, "output": {blocks, metadata, reward, finished}}` or
//! `{"ok": false, "error", "reason"}`; `POST /delete` ends the session. `POST
//! /{env}/score_group` scores a group of candidate transcripts comparatively, where the
//! environment implements it. Secrets go in `X-Secrets` (base64 JSON `{name: {value,
//! allowed_domains}}`), an API key in `X-API-Key`.
//!
//! **As an environment.** [`OrsEnvironment::reset`] opens one session per episode (the row's
//! `task_index` column, or its `task_spec`) and appends the task's prompt to the prompt's last
//! user message, as TRL appends `reset()`'s return (TRL's datasets for ORS have an empty user
//! message and a `task_index` column: `grpo-cli data ors-tasks` writes one). Sessions of one
//! row that give different prompts (a task drawn per session) each start their episode from
//! their own ([`EnvironmentReset::episode_starts`]). The tools (`/{env}/task_tools` of a probe session, so task-specific tools
//! are included; `/{env}/tools` on older servers) go into the chat template's `tools`. Each
//! model turn's Hermes `<tool_call>`s are sent in order to the episode's session; their results
//! come back as one `tool` message. A turn's reward is the sum of its calls' rewards (`null` =
//! 0), so `environment.reward = "sum"` is the total the server gave (for an outcome-only
//! environment, its one reward — TRL's "last non-null reward"). The episode ends when a result
//! says `finished`, when a tool raises on the server (the session is dead, as the SDK treats
//! it), or on a turn without a call: that turn is the model's answer and, when the environment
//! has a `@terminal` tool, is graded by it (its text as the tool's one argument). A refused
//! call (an unknown tool, bad input) and a call that does not parse are answered `error: ...`,
//! which the model sees. With `score_group`, [`OrsEnvironment::post_process`] sends each
//! group's transcripts to `/{env}/score_group` and adds `score_group_weight` × each score to
//! its episode's last turn. Then every session is deleted. A server that cannot be reached (after
//! the retries) or answers malformed JSON fails the call with one line naming the server and
//! the route; the trainer then ends the run with a checkpoint.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use base64::Engine as _;
use candle_core::{Result, bail};
use futures_util::StreamExt;
use grpo_rewards::http::{FailedAttempt as Failure, RetryPolicy, error_chain, retry_after};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::env::{AsyncEnvironment, EnvironmentReset, EnvironmentReturn, EpisodeStart, row_with};
use crate::episode::Episode;
use crate::tokenizer::ChatMessage;
use crate::tools::{ERROR_PREFIX, function_schema, parse_tool_calls, tool_metrics};

/// The metadata key of an episode's session id.
pub const SESSION_KEY: &str = "_ors_session";
/// The row column naming the split of its `task_index` (else `OrsConfig::split`).
pub const SPLIT_COLUMN: &str = "ors_split";
/// The metadata key set when the server said the episode is finished.
pub const FINISHED_KEY: &str = "_ors_finished";

/// Where an ORS environment is and how to talk to it (`[environment.ors]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OrsConfig {
    /// The server's base URL (`http://127.0.0.1:8080`, a Space's URL).
    pub url: String,
    /// The environment on the server; absent = the server's first (`/list_environments`).
    pub env_name: Option<String>,
    /// The split the rows' `task_index` refers to. Default `train`.
    pub split: String,
    /// Session secrets: secret name → the name of the environment variable holding its value
    /// (sent in `X-Secrets` when a session is created; the values never enter a run directory).
    pub secrets: BTreeMap<String, String>,
    /// Name of an environment variable holding an API key, sent as `X-API-Key`; unset or
    /// empty = none. Default `OPENREWARD_API_KEY`.
    pub api_key_env: Option<String>,
    /// A built-in ORS toolset to attach to each session (`toolset_name`); absent = none.
    pub toolset: Option<String>,
    /// The row column holding the task's index in `split`. Default `task_index`.
    pub task_index_column: String,
    /// The row column holding a task spec (a JSON object, or a string of one), used when the
    /// row has no `task_index_column`. Default `task_spec`.
    pub task_spec_column: String,
    /// Read the tools from a probe session's `/task_tools` (task-specific tools included), else
    /// the environment's shared `/tools`. Default true.
    pub discover_task_tools: bool,
    /// The task the probe session opens. Default 0.
    pub probe_index: usize,
    /// Calls per model turn at most (later ones are answered with an error). Default 8; the
    /// trainer sets it from `environment.max_calls_per_turn`.
    #[serde(skip)]
    pub max_calls_per_turn: usize,
    /// Requests in flight at once (sessions opened, episodes' calls). Default 32.
    pub max_concurrent: usize,
    /// Seconds one request may take. Default 600.
    pub timeout: f64,
    /// Retries of a request that failed with a connection error or HTTP 429, 502, 503 or
    /// 504 (a 500 is the environment's own error and is not retried). Default 3.
    pub max_retries: u32,
    /// Score each group's transcripts with the environment's `score_group` and add them to
    /// the episodes' last turn rewards. Default false.
    pub score_group: bool,
    /// The weight of the group scores. Default 1.
    pub score_group_weight: f64,
    /// Read each task's prompt as a conversation (`/{env}/messages`, with its roles) where the
    /// server has that route; a one-message conversation is the `/prompt` text as before.
    /// Default true.
    pub prompt_messages: bool,
    /// Seconds between keep-alive pings of the open sessions (`POST /ping`, as the SDK sends
    /// them: a server deletes a session that has heard nothing for 15 minutes, which a long
    /// model turn can take); 0 = none. Default 60.
    pub ping_interval: f64,
}

impl Default for OrsConfig {
    fn default() -> Self {
        Self {
            url: String::new(),
            env_name: None,
            split: "train".into(),
            secrets: BTreeMap::new(),
            api_key_env: Some("OPENREWARD_API_KEY".into()),
            toolset: None,
            task_index_column: "task_index".into(),
            task_spec_column: "task_spec".into(),
            discover_task_tools: true,
            probe_index: 0,
            max_calls_per_turn: 8,
            max_concurrent: 32,
            timeout: 600.0,
            max_retries: 3,
            score_group: false,
            score_group_weight: 1.0,
            ping_interval: 60.0,
            prompt_messages: true,
        }
    }
}

impl OrsConfig {
    /// A config for the server at `url`, everything else default.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            ..Self::default()
        }
    }

    /// Checks the values; errors name the key.
    pub fn validate(&self) -> Result<()> {
        let u = self.url.trim();
        if !(u.starts_with("http://") || u.starts_with("https://")) {
            bail!(
                "environment.ors.url must be an http:// or https:// URL, got {:?}",
                self.url
            );
        }
        if self.split.trim().is_empty() {
            bail!("environment.ors.split is empty");
        }
        if !(self.timeout.is_finite() && self.timeout > 0.0) {
            bail!(
                "environment.ors.timeout must be a number of seconds > 0, got {}",
                self.timeout
            );
        }
        if self.max_concurrent == 0 {
            bail!("environment.ors.max_concurrent must be >= 1");
        }
        if self.max_calls_per_turn == 0 {
            bail!("environment.ors.max_calls_per_turn must be >= 1");
        }
        if !(self.ping_interval.is_finite() && self.ping_interval >= 0.0) {
            bail!(
                "environment.ors.ping_interval must be a number of seconds >= 0, got {}",
                self.ping_interval
            );
        }
        if !self.score_group_weight.is_finite() {
            bail!("environment.ors.score_group_weight must be a finite number");
        }
        for (name, var) in &self.secrets {
            if var.trim().is_empty() {
                bail!("environment.ors.secrets.{name}: name the environment variable holding it");
            }
        }
        Ok(())
    }
}

/// A tool an ORS environment offers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OrsTool {
    /// Its name.
    pub name: String,
    /// What it does.
    #[serde(default)]
    pub description: String,
    /// The JSON schema of its input (`None`: no input).
    #[serde(default)]
    pub input_schema: Option<Value>,
}

/// The `@terminal` tool: a plain answer ends the episode and is passed to it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TerminalTool {
    /// Its name.
    pub name: String,
    /// The one input field the answer goes in (`None`: called without input).
    #[serde(default)]
    pub arg: Option<String>,
}

/// `/{env}/tools` and `/{env}/task_tools`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OrsToolList {
    /// The tools the model sees.
    pub tools: Vec<OrsTool>,
    /// The terminal tool, if any.
    #[serde(default)]
    pub terminal_tool: Option<TerminalTool>,
    /// Whether the environment scores groups (`/{env}/score_group`).
    #[serde(default)]
    pub supports_score_group: Option<bool>,
}

/// What a tool call came back with.
#[derive(Debug, Clone, PartialEq)]
pub enum CallOutcome {
    /// It ran: its text blocks (joined by newlines), reward, metadata and whether the
    /// episode is over.
    Done {
        /// The text blocks, joined.
        text: String,
        /// Its reward, if it gave one.
        reward: Option<f64>,
        /// Whether the episode is finished.
        finished: bool,
        /// What it reported beside.
        metadata: Value,
    },
    /// The server refused it (`not_found`, `input_validation`, `episode_finished`, ...).
    Refused {
        /// Why.
        error: String,
        /// The reason code.
        reason: Option<String>,
    },
    /// The tool raised on the server: the session is dead.
    Failed(String),
}

/// What to open a session on.
#[derive(Debug, Clone, PartialEq)]
pub enum OrsTask {
    /// Task `index` of `split`.
    Index {
        /// The split.
        split: String,
        /// The index.
        index: u64,
    },
    /// A task spec given whole.
    Spec(Value),
}

/// An HTTP client of one ORS server (see the [module docs](self)).
#[derive(Debug, Clone)]
pub struct OrsClient {
    http: reqwest::Client,
    base: String,
    api_key: Option<String>,
    secrets: Option<String>,
    retry: RetryPolicy,
    timeout: Duration,
}

impl OrsClient {
    /// A client for `cfg.url`, with the secrets and the API key read from the environment
    /// variables `cfg` names (a secret whose variable is unset is an error naming it).
    pub fn new(cfg: &OrsConfig) -> Result<Self> {
        cfg.validate()?;
        let api_key = cfg
            .api_key_env
            .as_deref()
            .and_then(|v| std::env::var(v).ok())
            .filter(|k| !k.trim().is_empty());
        let mut secrets = serde_json::Map::new();
        for (name, var) in &cfg.secrets {
            let value = std::env::var(var).map_err(|_| {
                candle_core::Error::msg(format!(
                    "environment.ors.secrets.{name}: the environment variable {var} is not set"
                ))
            })?;
            secrets.insert(
                name.clone(),
                json!({ "value": value, "allowed_domains": [] }),
            );
        }
        let secrets = (!secrets.is_empty()).then(|| {
            base64::engine::general_purpose::STANDARD.encode(Value::Object(secrets).to_string())
        });
        let http = reqwest::Client::builder()
            .build()
            .map_err(|e| candle_core::Error::msg(format!("ORS client: {e}")))?;
        Ok(Self {
            http,
            base: cfg.url.trim().trim_end_matches('/').to_owned(),
            api_key,
            secrets,
            retry: RetryPolicy::new(
                cfg.max_retries,
                Duration::from_millis(500),
                Duration::from_secs(10),
            ),
            timeout: Duration::from_secs_f64(cfg.timeout),
        })
    }

    /// The server's base URL.
    pub fn url(&self) -> &str {
        &self.base
    }

    fn error(&self, route: &str, message: impl std::fmt::Display) -> candle_core::Error {
        candle_core::Error::msg(format!("ORS server {}: {route}: {message}", self.base))
    }

    fn request(
        &self,
        method: reqwest::Method,
        path: &str,
        sid: Option<&str>,
        with_secrets: bool,
    ) -> reqwest::RequestBuilder {
        let mut r = self
            .http
            .request(method, format!("{}{path}", self.base))
            .timeout(self.timeout);
        if let Some(k) = &self.api_key {
            r = r.header("X-API-Key", k);
        }
        if let Some(sid) = sid {
            r = r.header("X-Session-ID", sid);
        }
        if with_secrets && let Some(s) = &self.secrets {
            r = r.header("X-Secrets", s);
        }
        r
    }

    /// A failed response as a [`Failure`]: the server's `detail` when it gave one.
    async fn failure(response: reqwest::Response) -> Failure {
        let status = response.status().as_u16();
        let wait = response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(retry_after);
        let text = response.text().await.unwrap_or_default();
        let detail = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| v.get("detail").cloned())
            .map(|d| match d {
                Value::String(s) => s,
                other => other.to_string(),
            })
            .unwrap_or(text);
        let first = detail.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
        Failure {
            message: format!("HTTP {status}: {}", first.trim()),
            status: Some(status),
            retryable: matches!(status, 429 | 502 | 503 | 504),
            retry_after: wait,
        }
    }

    fn transport(e: reqwest::Error) -> Failure {
        let retryable = e.is_connect();
        let message = if e.is_timeout() {
            "no answer in time (environment.ors.timeout)".into()
        } else {
            error_chain(&e.without_url())
        };
        Failure {
            message,
            status: None,
            retryable,
            retry_after: None,
        }
    }

    /// One JSON request with retries; `Ok(None)` for a 404 when `missing_ok`.
    async fn json(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
        sid: Option<&str>,
        missing_ok: bool,
    ) -> Result<Option<Value>> {
        let route = format!("{method} {path}");
        let attempt = || async {
            let mut r = self.request(method.clone(), path, sid, path == "/create");
            if let Some(b) = body {
                r = r.json(b);
            }
            let response = r.send().await.map_err(Self::transport)?;
            if !response.status().is_success() {
                return Err(Self::failure(response).await);
            }
            let bytes = response.bytes().await.map_err(Self::transport)?;
            Ok(bytes)
        };
        match self.retry.retry(attempt, |_, _| {}).await {
            Ok(bytes) if bytes.is_empty() => Ok(Some(Value::Null)),
            Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|e| {
                self.error(
                    &route,
                    format!(
                        "the answer is not JSON ({e}): {}",
                        String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
                    ),
                )
            }),
            Err(f) if missing_ok && f.status == Some(404) => Ok(None),
            Err(f) => Err(self.error(&route, f.message)),
        }
    }

    /// A server-sent-event request: the data of its result (the `chunk`s and the `end`), or
    /// `Err(Some(message))` for an `error` event. A stream that breaks after its `task_id` is
    /// resumed with it (at most `max_retries` times).
    async fn sse(&self, path: &str, body: &Value, sid: Option<&str>) -> Result<SseResult> {
        let route = format!("POST {path}");
        let mut body = body.clone();
        let mut resumes = 0;
        loop {
            let attempt = || async {
                let response = self
                    .request(reqwest::Method::POST, path, sid, path == "/create_session")
                    .header("Accept", "text/event-stream")
                    .json(&body)
                    .send()
                    .await
                    .map_err(Self::transport)?;
                if !response.status().is_success() {
                    return Err(Self::failure(response).await);
                }
                Ok(response)
            };
            let mut response = self
                .retry
                .retry(attempt, |_, _| {})
                .await
                .map_err(|f| self.error(&route, f.message))?;
            // The stream as it came, kept when it breaks (the task id in it resumes it).
            let mut raw = Vec::new();
            let broke = loop {
                match response.chunk().await {
                    Ok(Some(c)) => raw.extend_from_slice(&c),
                    Ok(None) => break None,
                    Err(e) => break Some(Self::transport(e).message),
                }
            };
            let events = parse_events(&raw).await;
            let mut task_id = None;
            let mut data = String::new();
            for (event, payload) in events {
                match event.as_str() {
                    "task_id" => task_id = Some(payload.trim().to_owned()),
                    "chunk" => data.push_str(&payload),
                    "end" => {
                        data.push_str(&payload);
                        return Ok(SseResult::Done { task_id, data });
                    }
                    "error" => return Ok(SseResult::Error(payload)),
                    _ => {}
                }
            }
            match task_id {
                Some(id) if resumes < self.retry.max_retries => {
                    resumes += 1;
                    if let Value::Object(m) = &mut body {
                        m.insert("task_id".into(), Value::String(id));
                    }
                }
                _ => {
                    return Err(self.error(
                        &route,
                        format!(
                            "the event stream ended without a result{}",
                            broke.map(|b| format!(" ({b})")).unwrap_or_default()
                        ),
                    ));
                }
            }
        }
    }

    /// The environments the server holds.
    pub async fn list_environments(&self) -> Result<Vec<String>> {
        let v = self
            .json(
                reqwest::Method::GET,
                "/list_environments",
                None,
                None,
                false,
            )
            .await?
            .unwrap_or_default();
        serde_json::from_value(v.clone()).map_err(|e| {
            self.error(
                "GET /list_environments",
                format!("not a list of names ({e}): {v}"),
            )
        })
    }

    /// The environment named `name` (an error lists the server's), or the server's first.
    pub async fn resolve_env(&self, name: Option<&str>) -> Result<String> {
        let envs = self.list_environments().await?;
        match name {
            Some(n) if envs.iter().any(|e| e == n) => Ok(n.to_owned()),
            Some(n) => bail!(
                "ORS server {}: no environment `{n}` (environment.ors.env_name); it has: {}",
                self.base,
                envs.join(", ")
            ),
            None => match envs.first() {
                Some(e) => Ok(e.clone()),
                None => bail!("ORS server {}: it holds no environment", self.base),
            },
        }
    }

    /// An environment's shared tools (`/{env}/tools`).
    pub async fn tools(&self, env: &str) -> Result<OrsToolList> {
        let path = format!("/{env}/tools");
        let v = self
            .json(reqwest::Method::GET, &path, None, None, false)
            .await?
            .unwrap_or_default();
        self.parse(&format!("GET {path}"), v)
    }

    /// A session's tools, task-specific ones included (`/{env}/task_tools`); `None` when the
    /// server has no such route.
    pub async fn task_tools(&self, env: &str, sid: &str) -> Result<Option<OrsToolList>> {
        let path = format!("/{env}/task_tools");
        match self
            .json(reqwest::Method::GET, &path, None, Some(sid), true)
            .await?
        {
            Some(v) => self.parse(&format!("GET {path}"), v).map(Some),
            None => Ok(None),
        }
    }

    fn parse<T: serde::de::DeserializeOwned>(&self, route: &str, v: Value) -> Result<T> {
        serde_json::from_value(v.clone()).map_err(|e| {
            let text = v.to_string();
            self.error(
                route,
                format!("unexpected answer ({e}): {}", &text[..text.len().min(200)]),
            )
        })
    }

    /// The number of tasks in `split`.
    pub async fn num_tasks(&self, env: &str, split: &str) -> Result<usize> {
        let path = format!("/{env}/num_tasks");
        let v = self
            .json(
                reqwest::Method::POST,
                &path,
                Some(&json!({ "split": split })),
                None,
                false,
            )
            .await?
            .unwrap_or_default();
        v.get("num_tasks")
            .and_then(Value::as_u64)
            .map(|n| n as usize)
            .ok_or_else(|| self.error(&format!("POST {path}"), format!("no `num_tasks` in {v}")))
    }

    /// Task `index` of `split` (its spec).
    pub async fn task(&self, env: &str, split: &str, index: usize) -> Result<Value> {
        let path = format!("/{env}/task");
        let v = self
            .json(
                reqwest::Method::POST,
                &path,
                Some(&json!({ "split": split, "index": index })),
                None,
                false,
            )
            .await?
            .unwrap_or_default();
        v.get("task")
            .cloned()
            .ok_or_else(|| self.error(&format!("POST {path}"), format!("no `task` in {v}")))
    }

    /// Tasks `start..stop` of `split`; `None` when the server has no `task_range` route.
    pub async fn task_range(
        &self,
        env: &str,
        split: &str,
        start: usize,
        stop: usize,
    ) -> Result<Option<Vec<Value>>> {
        let path = format!("/{env}/task_range");
        let Some(v) = self
            .json(
                reqwest::Method::POST,
                &path,
                Some(&json!({ "split": split, "start": start, "stop": stop })),
                None,
                true,
            )
            .await?
        else {
            return Ok(None);
        };
        match v.get("tasks").and_then(Value::as_array) {
            Some(t) => Ok(Some(t.clone())),
            None => Err(self.error(&format!("POST {path}"), format!("no `tasks` in {v}"))),
        }
    }

    /// Opens a session on `task` (with `toolset`): its id.
    pub async fn open(&self, env: &str, task: &OrsTask, toolset: Option<&str>) -> Result<String> {
        let sid = match self.sse("/create_session", &json!({}), None).await? {
            SseResult::Done {
                task_id: Some(sid), ..
            } if !sid.is_empty() => sid,
            SseResult::Done { .. } => {
                return Err(self.error("POST /create_session", "no session id in the stream"));
            }
            SseResult::Error(e) => return Err(self.error("POST /create_session", e)),
        };
        let mut body = match task {
            OrsTask::Index { split, index } => {
                json!({ "env_name": env, "split": split, "index": index })
            }
            OrsTask::Spec(spec) => json!({ "env_name": env, "task_spec": spec }),
        };
        if let Some(t) = toolset {
            body["toolset_name"] = Value::String(t.to_owned());
        }
        if let Err(e) = self
            .json(
                reqwest::Method::POST,
                "/create",
                Some(&body),
                Some(&sid),
                false,
            )
            .await
        {
            let _ = self.close(&sid).await;
            return Err(e);
        }
        Ok(sid)
    }

    /// A session's prompt: its text blocks joined by newlines (other blocks skipped).
    pub async fn prompt(&self, env: &str, sid: &str) -> Result<String> {
        let path = format!("/{env}/prompt");
        let v = self
            .json(reqwest::Method::GET, &path, None, Some(sid), false)
            .await?
            .unwrap_or_default();
        match v.as_array() {
            Some(blocks) => Ok(join_text(blocks)),
            None => Err(self.error(&format!("GET {path}"), format!("not a list of blocks: {v}"))),
        }
    }

    /// A session's prompt as a conversation (`/{env}/messages`, SDK 0.1.157): `None` when the
    /// server has no such route. Text blocks become the message's text; a reasoning block
    /// `<think>…</think>`, a tool call block a Hermes `<tool_call>`, a tool result block its
    /// content's text; images are left out.
    pub async fn messages(&self, env: &str, sid: &str) -> Result<Option<Vec<ChatMessage>>> {
        let path = format!("/{env}/messages");
        let Some(v) = self
            .json(reqwest::Method::GET, &path, None, Some(sid), true)
            .await?
        else {
            return Ok(None);
        };
        let Some(list) = v.as_array() else {
            return Err(self.error(
                &format!("GET {path}"),
                format!("not a list of messages: {v}"),
            ));
        };
        list.iter()
            .map(|m| {
                let role = m.get("role").and_then(Value::as_str);
                let blocks = m.get("blocks").and_then(Value::as_array);
                match (role, blocks) {
                    (Some(role), Some(blocks)) => Ok(ChatMessage::new(role, block_text(blocks))),
                    _ => Err(self.error(
                        &format!("GET {path}"),
                        format!("a message without `role` and `blocks`: {m}"),
                    )),
                }
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    /// Runs tool `name` with `input` in session `sid`.
    pub async fn call(
        &self,
        env: &str,
        sid: &str,
        name: &str,
        input: &Value,
    ) -> Result<CallOutcome> {
        let path = format!("/{env}/call");
        let route = format!("POST {path}");
        let data = match self
            .sse(&path, &json!({ "name": name, "input": input }), Some(sid))
            .await?
        {
            SseResult::Done { data, .. } => data,
            SseResult::Error(e) => return Ok(CallOutcome::Failed(e)),
        };
        let v: Value = serde_json::from_str(&data).map_err(|e| {
            self.error(
                &route,
                format!(
                    "the result is not JSON ({e}): {}",
                    &data[..data.len().min(200)]
                ),
            )
        })?;
        match v.get("ok").and_then(Value::as_bool) {
            Some(true) => {
                let out = v.get("output").cloned().unwrap_or_default();
                let blocks = out.get("blocks").and_then(Value::as_array);
                Ok(CallOutcome::Done {
                    text: blocks.map(|b| join_text(b)).unwrap_or_default(),
                    reward: out.get("reward").and_then(Value::as_f64),
                    finished: out
                        .get("finished")
                        .and_then(Value::as_bool)
                        .unwrap_or(false),
                    metadata: out.get("metadata").cloned().unwrap_or(Value::Null),
                })
            }
            Some(false) => Ok(CallOutcome::Refused {
                error: v
                    .get("error")
                    .and_then(Value::as_str)
                    .unwrap_or("refused")
                    .to_owned(),
                reason: v.get("reason").and_then(Value::as_str).map(str::to_owned),
            }),
            None => Err(self.error(&route, format!("no `ok` in the result: {v}"))),
        }
    }

    /// Scores a group of transcripts (`/{env}/score_group`) through session `sid`: one score
    /// per candidate.
    pub async fn score_group(
        &self,
        env: &str,
        sid: &str,
        candidates: &[Value],
    ) -> Result<Vec<f64>> {
        let path = format!("/{env}/score_group");
        let route = format!("POST {path}");
        let data = match self
            .sse(&path, &json!({ "candidates": candidates }), Some(sid))
            .await?
        {
            SseResult::Done { data, .. } => data,
            SseResult::Error(e) => return Err(self.error(&route, e)),
        };
        let v: Value = serde_json::from_str(&data)
            .map_err(|e| self.error(&route, format!("the result is not JSON ({e})")))?;
        let scores = v
            .get("scores")
            .and_then(Value::as_array)
            .ok_or_else(|| self.error(&route, format!("no `scores` in {v}")))?;
        if scores.len() != candidates.len() {
            return Err(self.error(
                &route,
                format!(
                    "{} scores for {} candidates",
                    scores.len(),
                    candidates.len()
                ),
            ));
        }
        scores
            .iter()
            .enumerate()
            .map(|(i, s)| {
                s.get("reward")
                    .and_then(Value::as_f64)
                    .filter(|r| r.is_finite())
                    .ok_or_else(|| {
                        self.error(&route, format!("score {i} has no finite `reward`: {s}"))
                    })
            })
            .collect()
    }

    /// Keeps session `sid` alive (`POST /ping`).
    pub async fn ping(&self, sid: &str) -> Result<()> {
        self.json(reqwest::Method::POST, "/ping", None, Some(sid), false)
            .await
            .map(|_| ())
    }

    /// Ends session `sid` (`/delete`, then `/delete_session`).
    pub async fn close(&self, sid: &str) -> Result<()> {
        self.json(reqwest::Method::POST, "/delete", None, Some(sid), false)
            .await?;
        self.json(
            reqwest::Method::POST,
            "/delete_session",
            None,
            Some(sid),
            true,
        )
        .await?;
        Ok(())
    }
}

/// Which tasks of a split [`task_rows`] reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TaskSelection {
    /// Every task.
    All,
    /// The first `n` (all when the split has fewer).
    First(usize),
    /// These indices.
    Indices(Vec<usize>),
}

/// A dataset of an environment's tasks, as TRL's `OpenRewardSpec.train_dataset`: one row per
/// task, `prompt` an empty user message (the session's prompt is appended to it at reset),
/// `task_index` its index in `split`, `ors_split` the split, and with `include_metadata` the
/// task spec's own keys as further columns (except those three).
pub async fn task_rows(
    client: &OrsClient,
    env: &str,
    split: &str,
    which: &TaskSelection,
    include_metadata: bool,
) -> Result<Vec<Value>> {
    let total = client.num_tasks(env, split).await?;
    let indices: Vec<usize> = match which {
        TaskSelection::All => (0..total).collect(),
        TaskSelection::First(n) => (0..total.min(*n)).collect(),
        TaskSelection::Indices(ix) => {
            if let Some(bad) = ix.iter().find(|&&i| i >= total) {
                bail!(
                    "ORS server {}: task index {bad} is out of range: split `{split}` of `{env}` has {total} tasks",
                    client.url()
                );
            }
            ix.clone()
        }
    };
    let contiguous = indices.windows(2).all(|w| w[1] == w[0] + 1);
    let ranged = match (contiguous, indices.first(), indices.last()) {
        (true, Some(&a), Some(&b)) => client.task_range(env, split, a, b + 1).await?,
        _ => None,
    };
    let specs = match ranged {
        Some(t) if t.len() == indices.len() => t,
        _ => futures_util::stream::iter(indices.clone())
            .map(|i| async move { client.task(env, split, i).await })
            .buffered(16)
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<Result<Vec<_>>>()?,
    };
    Ok(indices
        .iter()
        .zip(specs)
        .map(|(&i, spec)| {
            let mut row = serde_json::Map::new();
            row.insert("prompt".into(), json!([{ "role": "user", "content": "" }]));
            row.insert("task_index".into(), json!(i));
            row.insert(SPLIT_COLUMN.into(), json!(split));
            if include_metadata && let Value::Object(o) = spec {
                for (k, v) in o {
                    if !row.contains_key(&k) {
                        row.insert(k, v);
                    }
                }
            }
            Value::Object(row)
        })
        .collect())
}

/// What an event stream ended with.
#[derive(Debug)]
enum SseResult {
    Done {
        task_id: Option<String>,
        data: String,
    },
    Error(String),
}

/// The events of a server-sent event stream (`event`, data lines joined by newlines), by
/// eventsource-stream's parser.
async fn parse_events(raw: &[u8]) -> Vec<(String, String)> {
    use eventsource_stream::Eventsource;
    let chunk = Ok::<_, std::convert::Infallible>(raw.to_vec());
    let mut stream = futures_util::stream::iter([chunk]).eventsource();
    let mut out = Vec::new();
    while let Some(e) = stream.next().await {
        match e {
            Ok(e) => out.push((e.event, e.data)),
            Err(_) => break,
        }
    }
    out
}

/// A message's blocks as text (see [`OrsClient::messages`]), joined by newlines.
fn block_text(blocks: &[Value]) -> String {
    blocks
        .iter()
        .filter_map(
            |b| match b.get("type").and_then(Value::as_str).unwrap_or("text") {
                "text" => b.get("text").and_then(Value::as_str).map(str::to_owned),
                "reasoning" => b
                    .get("text")
                    .and_then(Value::as_str)
                    .map(|t| format!("<think>{t}</think>")),
                "tool_call" => Some(format!(
                    "{}{}{}",
                    crate::tools::CALL_OPEN,
                    json!({ "name": b.get("name").cloned().unwrap_or_default(),
                        "arguments": b.get("input").cloned().unwrap_or(json!({})) }),
                    crate::tools::CALL_CLOSE
                )),
                "tool_result" => b
                    .get("blocks")
                    .and_then(Value::as_array)
                    .map(|inner| block_text(inner)),
                _ => None,
            },
        )
        .filter(|t| !t.is_empty())
        .collect::<Vec<_>>()
        .join("\n")
}

/// The `text` of every text block, joined by newlines (as TRL's adapter).
fn join_text(blocks: &[Value]) -> String {
    blocks
        .iter()
        .filter(|b| b.get("type").and_then(Value::as_str).unwrap_or("text") == "text")
        .filter_map(|b| b.get("text").and_then(Value::as_str))
        .filter(|t| !t.is_empty())
        .collect::<Vec<_>>()
        .join("\n")
}

/// An ORS environment as an [`AsyncEnvironment`] (see the [module docs](self)); wrap it in
/// [`crate::env::Blocking`] for the trainer.
#[derive(Debug)]
pub struct OrsEnvironment {
    client: OrsClient,
    cfg: OrsConfig,
    env: String,
    name: String,
    tools: OrsToolList,
    /// The sessions open now (reset opened them, post_process not yet closed them), which the
    /// keep-alive task pings.
    open: std::sync::Arc<std::sync::Mutex<BTreeSet<String>>>,
    pinger: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// Whether `/messages` is still worth asking (false after a 404).
    has_messages: std::sync::atomic::AtomicBool,
}

impl Drop for OrsEnvironment {
    fn drop(&mut self) {
        if let Ok(mut p) = self.pinger.lock()
            && let Some(h) = p.take()
        {
            h.abort();
        }
    }
}

impl OrsEnvironment {
    /// Connects to the server: resolves the environment's name and reads its tools (through a
    /// probe session with `discover_task_tools`).
    pub async fn connect(cfg: &OrsConfig) -> Result<Self> {
        let client = OrsClient::new(cfg)?;
        let env = client.resolve_env(cfg.env_name.as_deref()).await?;
        let mut tools = None;
        if cfg.discover_task_tools {
            let task = OrsTask::Index {
                split: cfg.split.clone(),
                index: cfg.probe_index as u64,
            };
            let sid = client.open(&env, &task, cfg.toolset.as_deref()).await?;
            let found = client.task_tools(&env, &sid).await;
            let _ = client.close(&sid).await;
            tools = found?;
        }
        let tools = match tools {
            Some(t) => t,
            None => client.tools(&env).await?,
        };
        if cfg.score_group && tools.supports_score_group != Some(true) {
            bail!(
                "ORS environment `{env}` does not score groups (environment.ors.score_group = true)"
            );
        }
        Ok(Self {
            name: format!("ors:{env}"),
            client,
            cfg: cfg.clone(),
            env,
            tools,
            open: Default::default(),
            pinger: std::sync::Mutex::new(None),
            has_messages: std::sync::atomic::AtomicBool::new(cfg.prompt_messages),
        })
    }

    /// The environment's name on the server.
    pub fn env_name(&self) -> &str {
        &self.env
    }

    /// The tools and the terminal tool the server declared.
    pub fn tool_list(&self) -> &OrsToolList {
        &self.tools
    }

    /// The client.
    pub fn client(&self) -> &OrsClient {
        &self.client
    }

    /// The task a prompt's row names.
    fn task_of(&self, row: &Value) -> Result<OrsTask> {
        let c = &self.cfg;
        if let Some(v) = row.get(&c.task_index_column).filter(|v| !v.is_null()) {
            // A row may name its split (`grpo-cli data ors-tasks` writes it): an eval split
            // of test tasks beside a train split.
            let split = row
                .get(SPLIT_COLUMN)
                .and_then(Value::as_str)
                .unwrap_or(&c.split)
                .to_owned();
            return match v.as_u64() {
                Some(index) => Ok(OrsTask::Index { split, index }),
                None => bail!(
                    "column `{}` must hold a task index (an integer >= 0), got {v}",
                    c.task_index_column
                ),
            };
        }
        match row.get(&c.task_spec_column) {
            Some(Value::Object(o)) => Ok(OrsTask::Spec(Value::Object(o.clone()))),
            Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
                Ok(v @ Value::Object(_)) => Ok(OrsTask::Spec(v)),
                _ => bail!(
                    "column `{}` must hold a JSON object (a task spec)",
                    c.task_spec_column
                ),
            },
            _ => bail!(
                "the row has no `{}` column (environment.ors.task_index_column) nor a `{}` \
                 (environment.ors.task_spec_column); `grpo-cli data ors-tasks` writes them",
                c.task_index_column,
                c.task_spec_column
            ),
        }
    }

    /// Starts the keep-alive task on the runtime this runs on, once (`ping_interval` > 0): it
    /// pings every open session each interval until the environment is dropped.
    fn keep_alive(&self) {
        if self.cfg.ping_interval <= 0.0 {
            return;
        }
        let Ok(mut pinger) = self.pinger.lock() else {
            return;
        };
        if pinger.as_ref().is_some_and(|h| !h.is_finished()) {
            return;
        }
        let open = std::sync::Arc::downgrade(&self.open);
        let client = self.client.clone();
        let every = Duration::from_secs_f64(self.cfg.ping_interval);
        *pinger = Some(tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let Some(open) = open.upgrade() else { return };
                let sids: Vec<String> = match open.lock() {
                    Ok(o) => o.iter().cloned().collect(),
                    Err(_) => return,
                };
                drop(open);
                futures_util::stream::iter(sids)
                    .for_each_concurrent(16, |sid| {
                        let client = &client;
                        async move {
                            let _ = client.ping(&sid).await;
                        }
                    })
                    .await;
            }
        }));
    }

    fn opened(&self, sids: &[String]) {
        if let Ok(mut o) = self.open.lock() {
            o.extend(sids.iter().cloned());
        }
    }

    async fn close_all(&self, sids: impl IntoIterator<Item = String>) -> usize {
        let sids: Vec<String> = sids.into_iter().collect();
        if let Ok(mut o) = self.open.lock() {
            for s in &sids {
                o.remove(s);
            }
        }
        let closed: Vec<bool> = futures_util::stream::iter(sids)
            .map(|sid| async move { self.client.close(&sid).await.is_ok() })
            .buffer_unordered(self.cfg.max_concurrent)
            .collect()
            .await;
        closed.iter().filter(|ok| !**ok).count()
    }

    /// A session's task prompt: its conversation (`/messages`) when it has more than one user
    /// message's text, else the text.
    async fn task_prompt(&self, sid: &str) -> Result<TaskPrompt> {
        use std::sync::atomic::Ordering;
        if self.has_messages.load(Ordering::Relaxed) {
            match self.client.messages(&self.env, sid).await? {
                Some(m) if m.len() == 1 && m[0].role == "user" => {
                    return Ok(TaskPrompt::Text(m[0].content.clone()));
                }
                Some(m) => return Ok(TaskPrompt::Conversation(m)),
                None => self.has_messages.store(false, Ordering::Relaxed),
            }
        }
        self.client
            .prompt(&self.env, sid)
            .await
            .map(TaskPrompt::Text)
    }

    /// One episode's turn: its calls in order, in its session.
    async fn turn(&self, text: &str, sid: &str) -> Result<TurnAnswer> {
        let calls = parse_tool_calls(text);
        let mut answer = TurnAnswer::default();
        if calls.is_empty() {
            answer.terminated = true;
            if let Some(t) = &self.tools.terminal_tool {
                let input = match &t.arg {
                    Some(a) => json!({ a.as_str(): text.trim() }),
                    None => json!({}),
                };
                match self.client.call(&self.env, sid, &t.name, &input).await? {
                    CallOutcome::Done {
                        reward, finished, ..
                    } => {
                        answer.reward += reward.unwrap_or(0.0);
                        answer.finished = finished;
                    }
                    CallOutcome::Refused { error, .. } | CallOutcome::Failed(error) => {
                        answer.terminal_error = Some(error);
                    }
                }
            }
            return Ok(answer);
        }
        let max = self.cfg.max_calls_per_turn;
        let mut lines = Vec::with_capacity(calls.len());
        let mut names = Vec::new();
        for (k, call) in calls.into_iter().enumerate() {
            if answer.terminated {
                lines.push(format!(
                    "{ERROR_PREFIX}the episode is over; this call was not run"
                ));
                continue;
            }
            let call = match call {
                Ok(c) if k < max => c,
                Ok(_) => {
                    lines.push(format!(
                        "{ERROR_PREFIX}more than {max} tool calls in one turn; this one was not run"
                    ));
                    continue;
                }
                Err(e) => {
                    lines.push(format!("{ERROR_PREFIX}{e}"));
                    continue;
                }
            };
            names.push(call.function.name.clone());
            let input = match &call.function.arguments {
                Value::Null => json!({}),
                v => v.clone(),
            };
            match self
                .client
                .call(&self.env, sid, &call.function.name, &input)
                .await?
            {
                CallOutcome::Done {
                    text,
                    reward,
                    finished,
                    ..
                } => {
                    answer.reward += reward.unwrap_or(0.0);
                    if finished {
                        answer.finished = true;
                        answer.terminated = true;
                    }
                    lines.push(if text.is_empty() {
                        "(no output)".into()
                    } else {
                        text
                    });
                }
                CallOutcome::Refused { error, .. } => lines.push(format!("{ERROR_PREFIX}{error}")),
                CallOutcome::Failed(error) => {
                    lines.push(format!("{ERROR_PREFIX}{error}"));
                    answer.terminated = true;
                }
            }
        }
        let mut msg = ChatMessage::new("tool", lines.join("\n"));
        if let [name] = names.as_slice() {
            msg.name = Some(name.clone());
        }
        answer.observation = Some(msg);
        Ok(answer)
    }
}

/// A task's prompt: text for the row's user message, or a conversation.
#[derive(Debug, Clone, PartialEq)]
enum TaskPrompt {
    Text(String),
    Conversation(Vec<ChatMessage>),
}

#[derive(Debug, Default)]
struct TurnAnswer {
    observation: Option<ChatMessage>,
    reward: f64,
    finished: bool,
    terminated: bool,
    terminal_error: Option<String>,
}

/// An episode's session id from its metadata.
fn session_of(metadata: &Value) -> Option<&str> {
    metadata.get(SESSION_KEY).and_then(Value::as_str)
}

/// A transcript as ORS group candidates' messages: assistant turns as assistant text, the
/// observations between them as user text (ORS has no tool role).
fn candidate_messages(messages: &[ChatMessage]) -> Vec<Value> {
    let first = messages
        .iter()
        .position(|m| m.role == "assistant")
        .unwrap_or(messages.len());
    messages[first..]
        .iter()
        .map(|m| {
            let role = if m.role == "assistant" {
                "assistant"
            } else {
                "user"
            };
            json!({ "role": role, "blocks": [{ "type": "text", "text": m.content }] })
        })
        .collect()
}

impl AsyncEnvironment for OrsEnvironment {
    fn name(&self) -> &str {
        &self.name
    }

    fn tools(&self) -> Vec<Value> {
        self.tools
            .tools
            .iter()
            .map(|t| {
                let params = t
                    .input_schema
                    .clone()
                    .filter(Value::is_object)
                    .unwrap_or_else(|| json!({ "type": "object", "properties": {} }));
                let description = match t.description.trim() {
                    "" => format!("Call the {} tool.", t.name),
                    d => d.to_owned(),
                };
                function_schema(&t.name, &description, params)
            })
            .collect()
    }

    async fn reset(&self, metadata: &[&Value], n: usize) -> Result<Vec<EnvironmentReset>> {
        let tasks = metadata
            .iter()
            .enumerate()
            .map(|(p, row)| {
                self.task_of(row)
                    .map_err(|e| candle_core::Error::msg(format!("prompt {p}: {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        // Every episode's session, then every session's prompt.
        let jobs: Vec<OrsTask> = tasks
            .iter()
            .flat_map(|t| std::iter::repeat_n(t.clone(), n))
            .collect();
        let toolset = self.cfg.toolset.as_deref();
        let opened: Vec<Result<String>> = futures_util::stream::iter(jobs)
            .map(|task| async move { self.client.open(&self.env, &task, toolset).await })
            .buffered(self.cfg.max_concurrent)
            .collect()
            .await;
        let sids: Vec<String> = opened
            .iter()
            .filter_map(|r| r.as_ref().ok().cloned())
            .collect();
        self.opened(&sids);
        self.keep_alive();
        if let Some(Err(e)) = opened.into_iter().find(Result::is_err) {
            self.close_all(sids).await;
            return Err(e);
        }
        let prompts: Vec<Result<TaskPrompt>> = futures_util::stream::iter(sids.clone())
            .map(|sid| async move { self.task_prompt(&sid).await })
            .buffered(self.cfg.max_concurrent)
            .collect()
            .await;
        let mut texts = Vec::with_capacity(prompts.len());
        for r in prompts {
            match r {
                Ok(t) => texts.push(t),
                Err(e) => {
                    self.close_all(sids).await;
                    return Err(e);
                }
            }
        }
        // Sessions of one task that gave different prompts (a task drawn at random per
        // session) each start their episode from their own.
        let mut texts = texts.into_iter();
        let mut out = Vec::with_capacity(metadata.len());
        for (p, row) in metadata.iter().enumerate() {
            let range = p * n..(p + 1) * n;
            let starts = texts
                .by_ref()
                .take(n)
                .map(|t| match t {
                    TaskPrompt::Text(t) => EpisodeStart {
                        observation: Some(t),
                        messages: Vec::new(),
                    },
                    TaskPrompt::Conversation(messages) => EpisodeStart {
                        observation: None,
                        messages,
                    },
                })
                .collect();
            let episodes = sids[range]
                .iter()
                .map(|sid| row_with(row, SESSION_KEY, Value::String(sid.clone())))
                .collect();
            out.push(EnvironmentReset::from_starts(starts, episodes));
        }
        Ok(out)
    }

    async fn step(
        &self,
        logs: &[&[ChatMessage]],
        metadata: &[&Value],
    ) -> Result<EnvironmentReturn> {
        let n = logs.len();
        let mut ret = EnvironmentReturn::empty(n);
        ret.metadata = metadata.iter().map(|m| (*m).clone()).collect();
        let mut sids = Vec::with_capacity(n);
        for (i, m) in metadata.iter().enumerate() {
            match session_of(m) {
                Some(s) => sids.push(s),
                None => bail!(
                    "episode {i} has no ORS session: call Environment::reset for the prompts \
                     before their episodes"
                ),
            }
        }
        let answers: Vec<Result<TurnAnswer>> = futures_util::stream::iter(0..n)
            .map(|i| {
                let text = logs[i].last().map_or("", |m| m.content.as_str());
                self.turn(text, sids[i])
            })
            .buffered(self.cfg.max_concurrent)
            .collect()
            .await;
        for (i, a) in answers.into_iter().enumerate() {
            let a = a?;
            ret.observations[i] = a.observation;
            ret.rewards[i] = a.reward as f32;
            ret.terminateds[i] = a.terminated;
            if let Value::Object(m) = &mut ret.metadata[i] {
                if a.finished {
                    m.insert(FINISHED_KEY.into(), Value::Bool(true));
                }
                if let Some(e) = a.terminal_error {
                    m.insert("_ors_terminal_error".into(), Value::String(e));
                }
            }
        }
        Ok(ret)
    }

    async fn post_process(&self, episodes: &mut [Episode]) -> Result<BTreeMap<String, f64>> {
        let mut metrics = tool_metrics(episodes);
        let n = episodes.len().max(1) as f64;
        let finished = episodes
            .iter()
            .filter(|e| e.metadata.get(FINISHED_KEY) == Some(&Value::Bool(true)))
            .count();
        metrics.insert("ors_finished_ratio".into(), finished as f64 / n);
        let scored = if self.cfg.score_group {
            self.score_groups(episodes).await
        } else {
            Ok(())
        };
        let sids: BTreeSet<String> = episodes
            .iter()
            .filter_map(|e| session_of(&e.metadata).map(str::to_owned))
            .collect();
        let failed = self.close_all(sids).await;
        metrics.insert("ors_close_failures".into(), failed as f64);
        scored?;
        Ok(metrics)
    }
}

impl OrsEnvironment {
    /// Adds each group's `score_group` scores (× the weight) to its episodes' last turns.
    async fn score_groups(&self, episodes: &mut [Episode]) -> Result<()> {
        let mut groups: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for (i, e) in episodes.iter().enumerate() {
            groups.entry(e.prompt_index).or_default().push(i);
        }
        let requests: Vec<(Vec<usize>, String, Vec<Value>)> = groups
            .into_values()
            .filter_map(|members| {
                let sid = session_of(&episodes[members[0]].metadata)?.to_owned();
                let candidates = members
                    .iter()
                    .map(|&i| json!({ "messages": candidate_messages(&episodes[i].messages) }))
                    .collect();
                Some((members, sid, candidates))
            })
            .collect();
        let jobs: Vec<(String, Vec<Value>)> = requests
            .iter()
            .map(|(_, sid, c)| (sid.clone(), c.clone()))
            .collect();
        let scores: Vec<Result<Vec<f64>>> = futures_util::stream::iter(jobs)
            .map(|(sid, c)| async move { self.client.score_group(&self.env, &sid, &c).await })
            .buffered(self.cfg.max_concurrent)
            .collect()
            .await;
        for ((members, _, _), s) in requests.iter().zip(scores) {
            for (&i, score) in members.iter().zip(s?) {
                if let Some(t) = episodes[i].turns.last_mut() {
                    t.reward += (self.cfg.score_group_weight * score) as f32;
                }
            }
        }
        Ok(())
    }
}
