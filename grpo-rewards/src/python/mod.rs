//! `type = "python"`: reward functions written in Python, with TRL's signature, run in one
//! persistent worker process.
//!
//! ```toml
//! [[rewards]]
//! type = "python"
//! path = "rewards.py"        # a .py file, or a module name importable on PYTHONPATH
//! function = "accuracy"
//! # python = "python3"       # the interpreter (default python3)
//! # timeout = 60             # seconds per batched call
//! ```
//!
//! The function is called once per step with the whole batch, as TRL calls it:
//! `f(prompts=..., completions=..., completion_ids=..., trainer_state=..., **columns)`. Prompts
//! and completions are strings, or, for conversational samples, lists of `{"role", "content"}`
//! messages (the completion as `[{"role": "assistant", "content": text}]`; of a multi-turn
//! episode, its messages after the prompt: assistant turns, tool results, observations); `completion_ids`
//! are lists of ints; every dataset column comes as a keyword list (one value per completion);
//! `trainer_state.global_step` is the number of steps done. It returns one float (or `None`,
//! no opinion) per completion; an `async def` function is awaited (on one event loop kept for
//! the worker's life).
//!
//! # The worker
//!
//! All the python rewards of one [`crate::RewardsConfig::build`] share one process per
//! interpreter ([`PythonWorkers`]). The worker script (`worker.py`, embedded in the crate) runs
//! as `python -c`; its stderr is ours, and user code's `print` (its stdout, file descriptor 1
//! included) goes to stderr too, so nothing a function prints reaches the protocol. Each module
//! is imported once; functions are loaded when the reward is built, so a bad `path` or
//! `function` is a config error before training starts. Imports are not timed (a module may
//! load a model); each call is, by `timeout`: past it the worker is killed and the call fails,
//! and the next call starts a fresh worker. A worker that dies (killed, crashed) is restarted
//! once and the call retried (counted in `rewards/{name}/worker_restarts`); if it dies again
//! the call fails.
//!
//! # The line protocol
//!
//! One JSON object per line; the worker answers each request with one line, in order:
//!
//! | direction | line |
//! |---|---|
//! | worker, at start | `{"ready": true, "pid": 123, "python": "3.11.7"}` |
//! | load | `{"op": "load", "path": "/abs/rewards.py", "file": true, "function": "accuracy"}` |
//! | answer | `{"ok": true}` or `{"ok": false, "field": "path" \| "function" \| "init", "error": "..."}` |
//! | call | `{"op": "call", "path", "file", "function", "prompts": [...], "completions": [...], "completion_ids": [[...]], "kwargs": {"answer": [...]}, "global_step": 3}` |
//! | answer | `{"ok": true, "scores": [1.0, null]}` or `{"ok": false, "error": "raised ValueError: ... at /abs/rewards.py:12"}` |
//!
//! `file` says whether `path` is a file (absolute) or a module name. Errors are one line; the
//! worker prints the full traceback to stderr. A NaN score is sent as `null`.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Result, RewardError};
use crate::reward::Reward;
use crate::types::{FieldValue, Message, RewardInput, RewardOutput};

/// The worker script, run with `python -c`.
const WORKER: &str = include_str!("worker.py");

/// How long a starting interpreter may take to say it is ready.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// Keyword arguments the call itself passes: dataset columns with these names are left out.
const RESERVED: [&str; 6] = [
    "prompts",
    "completions",
    "completion_ids",
    "trainer_state",
    "log_extra",
    "log_metric",
];

/// Config of [`PythonReward`] (`type = "python"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PythonConfig {
    /// A `.py` file (relative paths are read from the working directory) or a module name
    /// importable on the Python path (`PYTHONPATH`, the working directory).
    pub path: String,
    /// The function in it.
    pub function: String,
    /// The interpreter to run. Default `python3`.
    #[serde(default = "default_python")]
    pub python: String,
    /// Seconds one batched call may take. Default 60.
    #[serde(default = "default_timeout")]
    pub timeout: f64,
    /// Keyword arguments of a reward *factory*: `function(**init)` is called once at load and
    /// what it returns is the reward function (TRL's `get_cosine_scaled_reward(max_len=...)`,
    /// `get_soft_overlong_punishment(...)`). `None` = `function` is the reward itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init: Option<Value>,
    /// How the function is called: `trl` (default; TRL's batched `f(prompts=...,
    /// completions=..., **columns)`) or `verl` (verl's `compute_score(data_source,
    /// solution_str, ground_truth, extra_info)` once per completion, `ground_truth` from the
    /// row's `reward_model.ground_truth`; a dict answer's `"score"` is the reward).
    #[serde(default, skip_serializing_if = "Signature::is_trl")]
    pub signature: Signature,
}

/// How a [`PythonConfig`] function is called.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Signature {
    /// TRL's reward functions: one batched call.
    #[default]
    Trl,
    /// verl's `compute_score`: one call per completion.
    Verl,
}

impl Signature {
    fn is_trl(&self) -> bool {
        *self == Signature::Trl
    }
}

fn default_python() -> String {
    "python3".into()
}

impl PythonConfig {
    /// Checks `timeout` and `python`; the timeout as a duration.
    fn checked_timeout(&self) -> Result<Duration> {
        if !(self.timeout.is_finite() && self.timeout > 0.0) {
            return Err(RewardError::config(
                "timeout",
                format!("must be a number of seconds > 0, got {}", self.timeout),
            ));
        }
        if self.python.trim().is_empty() {
            return Err(RewardError::config(
                "python",
                "must name an interpreter, e.g. \"python3\"",
            ));
        }
        Duration::try_from_secs_f64(self.timeout)
            .map_err(|e| RewardError::config("timeout", e.to_string()))
    }
}

fn default_timeout() -> f64 {
    60.0
}

/// What the worker loads: a file (absolute path) or a module, and a function in it.
#[derive(Debug, Clone, PartialEq)]
struct Target {
    path: String,
    file: bool,
    function: String,
    /// `path` as the config wrote it (for messages).
    shown: String,
    /// `reward`, `tool`, `environment` or `factory`.
    kind: &'static str,
    /// An environment class's constructor keyword arguments, or a reward factory's.
    init: Value,
    /// `Some("verl")`: verl's `compute_score` convention.
    signature: Option<&'static str>,
}

impl Target {
    fn of(config: &PythonConfig) -> Result<Self> {
        let shown = config.path.trim();
        if shown.is_empty() {
            return Err(RewardError::config(
                "path",
                "must name a .py file or a module, e.g. \"rewards.py\"",
            ));
        }
        let file = shown.ends_with(".py") || shown.contains('/') || shown.contains('\\');
        let path = if file {
            let abs = std::fs::canonicalize(shown).map_err(|e| {
                let cwd = std::env::current_dir()
                    .map(|d| d.display().to_string())
                    .unwrap_or_else(|_| "?".into());
                RewardError::config(
                    "path",
                    format!(
                        "`{shown}`: {e} (a relative path is read from the working directory {cwd})"
                    ),
                )
            })?;
            if !abs.is_file() {
                return Err(RewardError::config(
                    "path",
                    format!("`{shown}` is not a file"),
                ));
            }
            abs.to_str()
                .ok_or_else(|| {
                    RewardError::config("path", format!("`{shown}`: the path is not UTF-8"))
                })?
                .to_owned()
        } else {
            if !shown.split('.').all(is_identifier) {
                return Err(RewardError::config(
                    "path",
                    format!("`{shown}` is neither a .py file nor a module name"),
                ));
            }
            shown.to_owned()
        };
        if config.init.as_ref().is_some_and(|v| !v.is_object()) {
            return Err(RewardError::config(
                "init",
                "must be a table of the reward factory's keyword arguments",
            ));
        }
        let function = config.function.trim();
        if !is_identifier(function) {
            return Err(RewardError::config(
                "function",
                format!("`{function}` is not a Python function name"),
            ));
        }
        Ok(Self {
            path,
            file,
            function: function.to_owned(),
            shown: shown.to_owned(),
            kind: "reward",
            init: config.init.clone().unwrap_or(Value::Null),
            signature: (config.signature == Signature::Verl).then_some("verl"),
        })
    }
}

fn is_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c == '_' || c.is_alphabetic())
        && chars.all(|c| c == '_' || c.is_alphanumeric())
}

/// The Python worker processes of one [`crate::RewardsConfig::build`]: one per interpreter,
/// started by the first reward that needs it and shared by every python reward that names
/// the same `python`.
#[derive(Debug, Default)]
pub struct PythonWorkers(Mutex<BTreeMap<String, Arc<Worker>>>);

impl PythonWorkers {
    /// No workers yet.
    pub fn new() -> Self {
        Self::default()
    }

    fn get(&self, python: &str) -> Arc<Worker> {
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        map.entry(python.to_owned())
            .or_insert_with(|| {
                Arc::new(Worker {
                    python: python.to_owned(),
                    state: Mutex::new(State::default()),
                })
            })
            .clone()
    }
}

/// A reward function in Python ([module docs](self)).
#[derive(Debug)]
pub struct PythonReward {
    name: String,
    target: Target,
    timeout: Duration,
    timeout_secs: f64,
    worker: Arc<Worker>,
}

impl PythonReward {
    /// Checks `config`, starts the worker of `config.python` in `workers` if it is not running
    /// and has it import the function. Errors are config errors naming `path`, `function`,
    /// `python` or `timeout`. `name` is the reward's name (in errors and counters).
    pub fn new(name: &str, config: &PythonConfig, workers: &PythonWorkers) -> Result<Self> {
        let timeout = config.checked_timeout()?;
        let target = Target::of(config)?;
        let worker = workers.get(config.python.trim());
        worker.load(&target)?;
        Ok(Self {
            name: name.to_owned(),
            target,
            timeout,
            timeout_secs: config.timeout,
            worker,
        })
    }

    /// The worker's process id, while it runs.
    pub fn worker_pid(&self) -> Option<u32> {
        self.worker.lock().proc.as_ref().map(|p| p.child.id())
    }

    fn error(&self, message: impl std::fmt::Display) -> RewardError {
        RewardError::Python {
            reward: self.name.clone(),
            message: format!(
                "`{}` in {} {message}",
                self.target.function, self.target.shown
            ),
        }
    }
}

impl Reward for PythonReward {
    fn score(&self, batch: &[RewardInput]) -> Result<RewardOutput> {
        let restarts_key = format!("rewards/{}/worker_restarts", self.name);
        if batch.is_empty() {
            return Ok(RewardOutput {
                counters: BTreeMap::from([(restarts_key, 0.0)]),
                ..RewardOutput::default()
            });
        }
        let mut line = serde_json::to_vec(&CallRequest::new(&self.target, batch))
            .map_err(|e| self.error(format_args!("cannot encode the batch: {e}")))?;
        line.push(b'\n');
        let (answer, restarts) = self
            .worker
            .call(&line, self.timeout)
            .map_err(|e| match e {
                CallError::Timeout => self.error(format_args!(
                    "did not return within {} s (`timeout`); the worker was stopped, the next call starts a new one",
                    self.timeout_secs
                )),
                CallError::Other(m) => self.error(m),
            })?;
        let scores = answer.scores;
        if scores.len() != batch.len() {
            return Err(self.error(format_args!(
                "returned {} scores for {} completions",
                scores.len(),
                batch.len()
            )));
        }
        #[cfg(feature = "judges")]
        if restarts > 0 {
            tracing::warn!(reward = %self.name, "the Python worker had died; restarted it and retried the call");
        }
        // TRL's `log_extra` columns: each completion's values as its info.
        let info = match answer.extra.is_empty() {
            true => Vec::new(),
            false => (0..batch.len())
                .map(|i| {
                    let row: serde_json::Map<String, Value> = answer
                        .extra
                        .iter()
                        .filter_map(|(k, vs)| Some((k.clone(), vs.get(i)?.clone())))
                        .collect();
                    (!row.is_empty()).then_some(Value::Object(row))
                })
                .collect(),
        };
        let mut counters = BTreeMap::from([(restarts_key, restarts as f64)]);
        counters.extend(answer.metrics.into_iter().filter(|(_, v)| v.is_finite()));
        Ok(RewardOutput {
            scores: scores.into_iter().map(|s| s.map(|v| v as f32)).collect(),
            info,
            counters,
        })
    }
}

/// What a [`PythonObject`] is: a tool function, or an environment class instantiated once.
#[derive(Debug, Clone, PartialEq)]
pub enum PythonKind {
    /// A function called with keyword arguments (grpo-rollout's Python tools). Its load
    /// answers the function's JSON schema.
    Tool,
    /// A class with `step(message_logs, metadata)` (NeMo RL's environment signature),
    /// instantiated in the worker as `cls(**init)` (grpo-rollout's Python environments).
    Environment {
        /// The constructor's keyword arguments (a JSON object, or null for none).
        init: Value,
    },
    /// A class with TRL's `environment_factory` interface (`reset(**row)`, public methods as
    /// tools, optional `get_reward()`), instantiated per episode as `cls(**init)`. Its load
    /// answers `{"tools": [schemas], "reward": has get_reward}`.
    Factory {
        /// The constructor's keyword arguments (a JSON object, or null for none).
        init: Value,
    },
}

/// A Python function or object in the shared worker, called with JSON requests: the seam
/// grpo-rollout's Python tools and environments use (the requests are in the worker's module
/// docs). Calls are timed as a reward's are; a worker that dies is restarted (its objects
/// created again) and the request retried once.
#[derive(Debug)]
pub struct PythonObject {
    target: Target,
    timeout: Duration,
    timeout_secs: f64,
    worker: Arc<Worker>,
    loaded: Value,
}

impl PythonObject {
    /// Checks `config`, starts its worker in `workers` if needed and loads the function or
    /// class: errors are config errors naming `path`, `function`, `python` or `timeout`.
    pub fn load(config: &PythonConfig, kind: PythonKind, workers: &PythonWorkers) -> Result<Self> {
        let timeout = config.checked_timeout()?;
        let mut target = Target::of(config)?;
        let kind_name = match &kind {
            PythonKind::Factory { .. } => "factory",
            _ => "other",
        };
        match kind {
            PythonKind::Tool => target.kind = "tool",
            PythonKind::Environment { init } | PythonKind::Factory { init } => {
                if !(init.is_null() || init.is_object()) {
                    return Err(RewardError::config(
                        "init",
                        "must be a table of the class's keyword arguments",
                    ));
                }
                target.kind = if matches!(kind_name, "factory") {
                    "factory"
                } else {
                    "environment"
                };
                target.init = init;
            }
        }
        let worker = workers.get(config.python.trim());
        let loaded = worker.load(&target)?;
        Ok(Self {
            target,
            timeout,
            timeout_secs: config.timeout,
            worker,
            loaded,
        })
    }

    /// What the load answered: a tool's JSON schema (transformers' `get_json_schema` when the
    /// worker's Python has transformers, else the same form from the signature and docstring);
    /// null for an environment.
    pub fn loaded(&self) -> &Value {
        &self.loaded
    }

    /// `function in path`, for messages.
    pub fn describe(&self) -> String {
        format!("`{}` in {}", self.target.function, self.target.shown)
    }

    /// Sends request `op` with the fields of `args` (a JSON object) and returns the answer's
    /// `result`. Errors are one line: what the Python code raised, a timeout, a worker that
    /// died twice.
    pub fn request(&self, op: &str, args: Value) -> std::result::Result<Value, String> {
        let mut req = match args {
            Value::Object(m) => m,
            Value::Null => serde_json::Map::new(),
            other => {
                return Err(format!(
                    "request `{op}`: arguments must be an object, got {other}"
                ));
            }
        };
        req.insert("op".into(), op.into());
        req.insert("path".into(), self.target.path.clone().into());
        req.insert("file".into(), self.target.file.into());
        req.insert("function".into(), self.target.function.clone().into());
        req.insert("kind".into(), self.target.kind.into());
        if !self.target.init.is_null() {
            req.insert("init".into(), self.target.init.clone());
        }
        let mut line =
            serde_json::to_vec(&req).map_err(|e| format!("cannot encode the request: {e}"))?;
        line.push(b'\n');
        match self.worker.call(&line, self.timeout) {
            Ok((answer, _)) => Ok(answer.result),
            Err(CallError::Timeout) => Err(format!(
                "did not return within {} s (`timeout`); the worker was stopped, the next call starts a new one",
                self.timeout_secs
            )),
            Err(CallError::Other(m)) => Err(m),
        }
    }
}

/// A prompt as TRL passes it: text, or the conversation's messages.
#[derive(Serialize)]
#[serde(untagged)]
enum PromptArg<'a> {
    Text(&'a str),
    Messages(&'a [Message]),
}

/// A completion as TRL passes it: text, or `[{"role": "assistant", "content": text}]`, or a
/// multi-turn episode's messages after the prompt.
#[derive(Serialize)]
#[serde(untagged)]
enum CompletionArg<'a> {
    Text(&'a str),
    Messages([AssistantMessage<'a>; 1]),
    Episode(&'a [Message]),
}

#[derive(Serialize)]
struct AssistantMessage<'a> {
    role: &'static str,
    content: &'a str,
}

#[derive(Serialize)]
struct LoadRequest<'a> {
    op: &'static str,
    path: &'a str,
    file: bool,
    function: &'a str,
    kind: &'static str,
    #[serde(skip_serializing_if = "Value::is_null")]
    init: &'a Value,
}

impl<'a> LoadRequest<'a> {
    fn line(t: &'a Target) -> Vec<u8> {
        let mut line = serde_json::to_vec(&LoadRequest {
            op: "load",
            path: &t.path,
            file: t.file,
            function: &t.function,
            kind: t.kind,
            init: &t.init,
        })
        .unwrap_or_default();
        line.push(b'\n');
        line
    }
}

#[derive(Serialize)]
struct CallRequest<'a> {
    op: &'static str,
    path: &'a str,
    file: bool,
    function: &'a str,
    prompts: Vec<PromptArg<'a>>,
    completions: Vec<CompletionArg<'a>>,
    completion_ids: Vec<&'a [u32]>,
    kwargs: BTreeMap<&'a str, Vec<&'a FieldValue>>,
    global_step: usize,
    /// Per completion, its environment instance (TRL's `environments`); absent when none has
    /// one.
    #[serde(skip_serializing_if = "Option::is_none")]
    environment_ids: Option<Vec<Option<&'a str>>>,
    /// The reward factory's keyword arguments (the worker finds the loaded function by them).
    #[serde(skip_serializing_if = "Value::is_null")]
    init: &'a Value,
    /// `verl`: call the function as verl's `compute_score`, once per completion.
    #[serde(skip_serializing_if = "Option::is_none")]
    signature: Option<&'static str>,
}

static NULL: FieldValue = FieldValue::Null;

impl<'a> CallRequest<'a> {
    fn new(t: &'a Target, batch: &'a [RewardInput]) -> Self {
        let columns: BTreeSet<&str> = batch
            .iter()
            .flat_map(|x| x.fields.keys().map(String::as_str))
            .filter(|k| !RESERVED.contains(k))
            .collect();
        let kwargs = columns
            .into_iter()
            .map(|c| {
                let values = batch
                    .iter()
                    .map(|x| x.fields.get(c).unwrap_or(&NULL))
                    .collect();
                (c, values)
            })
            .collect();
        Self {
            op: "call",
            path: &t.path,
            file: t.file,
            function: &t.function,
            prompts: batch
                .iter()
                .map(|x| match &x.prompt_messages {
                    Some(m) => PromptArg::Messages(m),
                    None => PromptArg::Text(&x.prompt),
                })
                .collect(),
            completions: batch
                .iter()
                .map(|x| match (&x.completion_messages, &x.prompt_messages) {
                    (Some(m), _) => CompletionArg::Episode(m),
                    (None, Some(_)) => CompletionArg::Messages([AssistantMessage {
                        role: "assistant",
                        content: &x.completion,
                    }]),
                    (None, None) => CompletionArg::Text(&x.completion),
                })
                .collect(),
            completion_ids: batch.iter().map(|x| x.completion_ids.as_slice()).collect(),
            kwargs,
            global_step: batch.first().map_or(0, |x| x.global_step),
            environment_ids: batch
                .iter()
                .any(|x| x.environment_instance.is_some())
                .then(|| {
                    batch
                        .iter()
                        .map(|x| x.environment_instance.as_deref())
                        .collect()
                }),
            init: &t.init,
            signature: t.signature,
        }
    }
}

/// The worker's first line.
#[derive(Deserialize)]
struct Ready {
    ready: bool,
}

/// The worker's answer to a request.
#[derive(Deserialize)]
struct Answer {
    ok: bool,
    #[serde(default)]
    scores: Vec<Option<f64>>,
    /// What a reward logged with TRL's `log_extra(column, values)`: per column, one value per
    /// completion.
    #[serde(default)]
    extra: BTreeMap<String, Vec<Value>>,
    /// What a reward logged with TRL's `log_metric(name, value)`: each name's mean.
    #[serde(default)]
    metrics: BTreeMap<String, f64>,
    #[serde(default)]
    error: Option<String>,
    #[serde(default)]
    field: Option<String>,
    /// What a tool or environment request answered.
    #[serde(default)]
    result: Value,
}

impl Answer {
    fn read(line: &[u8]) -> std::result::Result<Self, Fail> {
        serde_json::from_slice(line).map_err(|e| {
            let text = String::from_utf8_lossy(line);
            let start: String = text.trim().chars().take(120).collect();
            Fail::Protocol(format!("the worker sent an unreadable line ({e}): {start}"))
        })
    }

    fn error(self) -> String {
        self.error
            .unwrap_or_else(|| "failed (the worker gave no reason)".into())
    }
}

/// Why a round trip with the worker failed.
#[derive(Debug)]
enum Fail {
    /// The process exited (its status).
    Died(String),
    /// No answer before the deadline.
    Timeout,
    /// Something else (could not start, unreadable line).
    Protocol(String),
}

enum CallError {
    Timeout,
    Other(String),
}

/// One Python interpreter running the worker script, shared by the rewards that use it.
#[derive(Debug)]
struct Worker {
    python: String,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    proc: Option<Proc>,
    /// Every function loaded so far, reloaded in order by a restarted worker.
    loaded: Vec<Target>,
}

impl Worker {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Has the worker import `t` (at build): errors are config errors. Returns what the load
    /// answered (a tool's schema).
    fn load(&self, t: &Target) -> Result<Value> {
        let mut st = self.lock();
        let proc = st
            .ensure(&self.python)
            .map_err(|m| RewardError::config("python", m))?;
        match proc.round_trip(&LoadRequest::line(t), None) {
            Ok(a) if a.ok => {
                if !st.loaded.contains(t) {
                    st.loaded.push(t.clone());
                }
                Ok(a.result)
            }
            Ok(a) => {
                let field = match a.field.as_deref() {
                    Some("function") => "function",
                    Some("init") => "init",
                    _ => "path",
                };
                Err(RewardError::config(field, a.error()))
            }
            Err(f) => {
                st.stop();
                let why = match f {
                    Fail::Died(status) => format!(
                        "the Python worker died while importing `{}` ({status}); its stderr above says why",
                        t.shown
                    ),
                    Fail::Timeout | Fail::Protocol(_) => {
                        format!("importing `{}`: {}", t.shown, fail_text(&f))
                    }
                };
                Err(RewardError::config("path", why))
            }
        }
    }

    /// One request; a worker that dies is restarted once and the request retried. Returns
    /// the answer and the number of restarts.
    fn call(
        &self,
        line: &[u8],
        timeout: Duration,
    ) -> std::result::Result<(Answer, usize), CallError> {
        let mut st = self.lock();
        let mut restarts = 0;
        loop {
            let proc = st.ensure(&self.python).map_err(CallError::Other)?;
            match proc.round_trip(line, Some(Instant::now() + timeout)) {
                Ok(a) if a.ok => return Ok((a, restarts)),
                Ok(a) => return Err(CallError::Other(a.error())),
                Err(Fail::Died(status)) => {
                    st.stop();
                    if restarts == 1 {
                        return Err(CallError::Other(format!(
                            "failed: the Python worker died twice in a row ({status}); its stderr above may say why"
                        )));
                    }
                    restarts += 1;
                }
                Err(Fail::Timeout) => {
                    st.stop();
                    return Err(CallError::Timeout);
                }
                Err(Fail::Protocol(m)) => {
                    st.stop();
                    return Err(CallError::Other(m));
                }
            }
        }
    }
}

impl State {
    /// The running worker, started (and given the loaded functions again) when there is none.
    fn ensure(&mut self, python: &str) -> std::result::Result<&mut Proc, String> {
        if self.proc.is_none() {
            let mut p = Proc::start(python)?;
            for t in &self.loaded {
                match p.round_trip(&LoadRequest::line(t), None) {
                    Ok(a) if a.ok => {}
                    Ok(a) => return Err(format!("could not be loaded again: {}", a.error())),
                    Err(f) => {
                        return Err(format!(
                            "could not be loaded again in a new worker: {}",
                            fail_text(&f)
                        ));
                    }
                }
            }
            self.proc = Some(p);
        }
        self.proc
            .as_mut()
            .ok_or_else(|| "the Python worker is gone".to_owned())
    }

    /// Kills the worker, if any.
    fn stop(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
    }
}

fn fail_text(f: &Fail) -> String {
    match f {
        Fail::Died(s) => format!("the worker died ({s})"),
        Fail::Timeout => "no answer in time".into(),
        Fail::Protocol(m) => m.clone(),
    }
}

/// A running worker process: its stdin, and its stdout's lines from a reader thread.
#[derive(Debug)]
struct Proc {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<Vec<u8>>,
}

impl Proc {
    fn start(python: &str) -> std::result::Result<Self, String> {
        let mut child = Command::new(python)
            .arg("-c")
            .arg(WORKER)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("cannot start `{python}`: {e}"))?;
        let (stdin, stdout) = match (child.stdin.take(), child.stdout.take()) {
            (Some(i), Some(o)) => (i, o),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("`{python}` started without pipes"));
            }
        };
        let (tx, lines) = std::sync::mpsc::channel();
        let reader = std::thread::Builder::new()
            .name("grpo-python-reward".into())
            .spawn(move || {
                let mut r = BufReader::new(stdout);
                loop {
                    let mut line = Vec::new();
                    match r.read_until(b'\n', &mut line) {
                        Ok(0) | Err(_) => break,
                        Ok(_) => {
                            if tx.send(line).is_err() {
                                break;
                            }
                        }
                    }
                }
            });
        let mut p = Self {
            child,
            stdin: Some(stdin),
            lines,
        };
        if let Err(e) = reader {
            p.kill();
            return Err(format!("cannot start a thread to read the worker: {e}"));
        }
        let ready = p.recv(Some(Instant::now() + READY_TIMEOUT)).and_then(|l| {
            serde_json::from_slice::<Ready>(&l)
                .ok()
                .filter(|r| r.ready)
                .ok_or_else(|| {
                    Fail::Protocol(format!(
                        "`{python}` did not start the worker; it wrote: {}",
                        String::from_utf8_lossy(&l).trim()
                    ))
                })
        });
        match ready {
            Ok(_) => Ok(p),
            Err(f) => {
                p.kill();
                Err(match f {
                    Fail::Died(status) => format!(
                        "`{python}` exited before the worker was ready ({status}); its stderr above says why (Python ≥ 3.8 is needed)"
                    ),
                    Fail::Timeout => format!(
                        "`{python}` did not start the worker within {} s",
                        READY_TIMEOUT.as_secs()
                    ),
                    Fail::Protocol(m) => m,
                })
            }
        }
    }

    /// Sends one request line and reads its answer (by `deadline`, if any).
    fn round_trip(
        &mut self,
        line: &[u8],
        deadline: Option<Instant>,
    ) -> std::result::Result<Answer, Fail> {
        // A worker known to be gone is not written to (a host that does not ignore SIGPIPE, as
        // Rust programs do, would die of it).
        if !matches!(self.child.try_wait(), Ok(None)) {
            return Err(Fail::Died(self.exit_status()));
        }
        let sent = match self.stdin.as_mut() {
            Some(w) => w.write_all(line).and_then(|()| w.flush()).is_ok(),
            None => false,
        };
        if !sent {
            return Err(Fail::Died(self.exit_status()));
        }
        Answer::read(&self.recv(deadline)?)
    }

    fn recv(&mut self, deadline: Option<Instant>) -> std::result::Result<Vec<u8>, Fail> {
        let got = match deadline {
            None => self
                .lines
                .recv()
                .map_err(|_| RecvTimeoutError::Disconnected),
            Some(d) => self
                .lines
                .recv_timeout(d.saturating_duration_since(Instant::now())),
        };
        match got {
            Ok(line) => Ok(line),
            Err(RecvTimeoutError::Timeout) => Err(Fail::Timeout),
            Err(RecvTimeoutError::Disconnected) => Err(Fail::Died(self.exit_status())),
        }
    }

    /// The exit status of a worker whose output has ended (killed if it lingers).
    fn exit_status(&mut self) -> String {
        let until = Instant::now() + Duration::from_secs(2);
        loop {
            match self.child.try_wait() {
                Ok(Some(s)) => return s.to_string(),
                Ok(None) if Instant::now() < until => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Ok(None) => {
                    self.kill();
                    return "it closed its output and was killed".into();
                }
                Err(e) => return format!("status unknown: {e}"),
            }
        }
    }

    fn kill(&mut self) {
        self.stdin = None;
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    /// Closes the worker's stdin (it then exits) and waits a little before killing it.
    fn drop(&mut self) {
        self.stdin = None;
        let until = Instant::now() + Duration::from_secs(1);
        while Instant::now() < until {
            match self.child.try_wait() {
                Ok(None) => std::thread::sleep(Duration::from_millis(5)),
                _ => return,
            }
        }
        self.kill();
    }
}
