//! Environments written in Python, run in grpo-rewards' shared Python worker (feature
//! `rewards`): classes with NeMo RL's `step` signature ([`PythonEnvironment`]), and classes with
//! TRL's `environment_factory` interface ([`PythonFactoryEnvironment`]: an instance per episode,
//! `reset`, public methods as tools, `get_reward`).
//!
//! ```python
//! class GuessTheNumber:
//!     def __init__(self, max_guesses=5):            # `init` in the config
//!         self.max_guesses = max_guesses
//!
//!     def step(self, message_logs, metadata):
//!         # message_logs[i]: episode i's messages [{"role", "content"}, ...], the model's
//!         # turn last; metadata[i]: the prompt's dataset columns at the first turn, then what
//!         # the previous step returned.
//!         ...
//!         return {"observations": [{"role": "user", "content": "higher"}, ...],
//!                 "metadata": [...], "next_stop_strings": [None, ...],
//!                 "rewards": [0.0, ...], "terminateds": [False, ...]}
//!
//!     def global_post_process_and_metrics(self, episodes):   # optional
//!         return episodes, {"solved": ...}
//! ```
//!
//! `step` may return NeMo RL's `EnvironmentReturn` named tuple, any object with those fields,
//! or a dict; tensors and arrays are read with `tolist()`. An observation is a `{"role",
//! "content"}` dict (role `user`, `tool` or `environment`; default `environment`), a string
//! (role `environment`) or `None`; `metadata` and `next_stop_strings` may be left out (the
//! metadata is then kept, the stop strings unchanged). An `async def step` is awaited.
//!
//! `global_post_process_and_metrics(episodes)` gets every finished episode of a training step
//! as a dict (`messages`, `rewards` per turn, `metadata`, `terminated`, `prompt_index`,
//! `sample_index`) and returns metrics (a dict of numbers), or NeMo RL's `(batch, metrics)`;
//! when `batch` is that list of dicts, each one's `rewards` (per turn) replace the episode's.
//!
//! The class is instantiated once per worker as `cls(**init)`. Each `step` call is timed by
//! `timeout`: past it the worker is stopped and the step fails with the environment's name
//! (the trainer then ends the run with a checkpoint). A worker that died is started again
//! (the class instantiated again, its state lost) and the call retried once.

use std::collections::BTreeMap;

use candle_core::{Result, bail};
use grpo_rewards::python::{PythonConfig, PythonKind, PythonObject, PythonWorkers};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::env::{Environment, EnvironmentReset, EnvironmentReturn, EpisodeStart, row_with};
use crate::episode::Episode;
use crate::tokenizer::ChatMessage;

/// Config of a [`PythonEnvironment`] (`[environment.python]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PythonEnvironmentConfig {
    /// A `.py` file or a module name.
    pub path: String,
    /// The class.
    pub class: String,
    /// Keyword arguments of its constructor.
    #[serde(default)]
    pub init: Option<Value>,
    /// The interpreter. Default `python3`.
    #[serde(default = "default_python")]
    pub python: String,
    /// Seconds one `step` (or the post-process hook) may take. Default 60.
    #[serde(default = "default_timeout")]
    pub timeout: f64,
    /// The environment's name in errors and metrics; default the class's.
    #[serde(default)]
    pub name: Option<String>,
}

fn default_python() -> String {
    "python3".into()
}

fn default_timeout() -> f64 {
    60.0
}

/// A Python class as an [`Environment`]: see the [module docs](self).
#[derive(Debug)]
pub struct PythonEnvironment {
    name: String,
    object: PythonObject,
}

impl PythonEnvironment {
    /// Loads and instantiates the class in `workers`' worker. Errors name the field to fix
    /// (`path`, `class`, `init`, `python`, `timeout`).
    pub fn new(config: &PythonEnvironmentConfig, workers: &PythonWorkers) -> Result<Self> {
        let init = config.init.clone().unwrap_or(Value::Null);
        let (name, object) = load_class(config, PythonKind::Environment { init }, workers)?;
        Ok(Self { name, object })
    }
}

/// The class of `config` loaded in `workers`' worker as `kind`, with the environment's name;
/// errors name the field to fix (`path`, `class`, `init`, `python`, `timeout`).
fn load_class(
    config: &PythonEnvironmentConfig,
    kind: PythonKind,
    workers: &PythonWorkers,
) -> Result<(String, PythonObject)> {
    let name = config.name.clone().unwrap_or_else(|| config.class.clone());
    let object = PythonObject::load(
        &PythonConfig {
            path: config.path.clone(),
            function: config.class.clone(),
            python: config.python.clone(),
            timeout: config.timeout,
            init: None,
            signature: Default::default(),
        },
        kind,
        workers,
    )
    .map_err(|e| {
        let text = match e {
            grpo_rewards::RewardError::Config { field, message } => {
                let field = if field == "function" {
                    "class".into()
                } else {
                    field
                };
                format!("{field}: {message}")
            }
            other => other.to_string(),
        };
        candle_core::Error::msg(format!("environment `{name}`: {text}"))
    })?;
    Ok((name, object))
}

/// What `env_step` answers.
#[derive(Deserialize)]
struct StepAnswer {
    observations: Vec<Option<ChatMessage>>,
    metadata: Vec<Value>,
    next_stop_strings: Vec<Option<Vec<String>>>,
    rewards: Vec<f32>,
    terminateds: Vec<bool>,
}

/// What `env_post` answers.
#[derive(Deserialize)]
struct PostAnswer {
    #[serde(default)]
    metrics: BTreeMap<String, f64>,
    #[serde(default)]
    rewards: Option<Vec<Option<Vec<f32>>>>,
}

impl Environment for PythonEnvironment {
    fn name(&self) -> &str {
        &self.name
    }

    fn step(&self, logs: &[&[ChatMessage]], metadata: &[&Value]) -> Result<EnvironmentReturn> {
        let result = self
            .object
            .request(
                "env_step",
                json!({ "message_logs": logs, "metadata": metadata }),
            )
            .map_err(|e| candle_core::Error::msg(format!("step: {e}")))?;
        let a: StepAnswer = serde_json::from_value(result).map_err(|e| {
            candle_core::Error::msg(format!("step returned an unreadable answer: {e}"))
        })?;
        Ok(EnvironmentReturn {
            observations: a.observations,
            metadata: a.metadata,
            next_stop_strings: a.next_stop_strings,
            rewards: a.rewards,
            terminateds: a.terminateds,
        })
    }

    fn post_process(&self, episodes: &mut [Episode]) -> Result<BTreeMap<String, f64>> {
        let batch: Vec<Value> = episodes
            .iter()
            .map(|e| {
                json!({
                    "messages": e.messages,
                    "rewards": e.rewards(),
                    "metadata": e.metadata,
                    "terminated": e.terminated(),
                    "prompt_index": e.prompt_index,
                    "sample_index": e.sample_index,
                })
            })
            .collect();
        let result = self
            .object
            .request("env_post", json!({ "episodes": batch }))
            .map_err(|e| {
                candle_core::Error::msg(format!("global_post_process_and_metrics: {e}"))
            })?;
        let a: PostAnswer = serde_json::from_value(result).map_err(|e| {
            candle_core::Error::msg(format!(
                "global_post_process_and_metrics returned an unreadable answer: {e}"
            ))
        })?;
        if let Some(rewards) = a.rewards {
            for (i, (e, r)) in episodes.iter_mut().zip(rewards).enumerate() {
                let Some(r) = r else { continue };
                if r.len() != e.turns.len() {
                    bail!(
                        "global_post_process_and_metrics: episode {i} has {} turns, its returned rewards {}",
                        e.turns.len(),
                        r.len()
                    );
                }
                for (t, v) in e.turns.iter_mut().zip(r) {
                    t.reward = v;
                }
            }
        }
        Ok(a.metrics)
    }
}

/// The metadata key of an episode's instance of a [`PythonFactoryEnvironment`] class.
pub const INSTANCE_KEY: &str = "_env_instance";

/// A Python class with TRL's `environment_factory` interface as an [`Environment`]
/// (`[environment] type = "factory"`): one instance per episode, made with `cls(**init)` in
/// grpo-rewards' Python worker and reused across steps as TRL's trainer does.
///
/// ```python
/// class Wordle:
///     def reset(self, **row):                 # the row's columns; returns text or None
///         self.target, self.done = row["answer"], False
///         return "Guess the five-letter word."   # appended to the prompt's last user message
///
///     def guess(self, word: str) -> str:      # public methods are the tools
///         """Checks a guess.
///
///         Args:
///             word: the guessed word
///         """
///         ...
///
///     def get_reward(self) -> float:          # optional: the episode's reward
///         return 1.0 if self.done else 0.0
/// ```
///
/// [`Environment::reset`] resets an instance per episode with the row's columns as keyword
/// arguments (an instance whose text differs from its group's gives its episode a prompt of
/// its own, [`EnvironmentReset::episode_starts`]); the tools' schemas come from the methods' signatures and docstrings (transformers'
/// `get_json_schema`). Each model turn's Hermes `<tool_call>`s call the episode's instance's
/// methods in order and come back as one `tool` message (a method that raises, an unknown one
/// or a call that does not parse is answered `error: ...`); a turn without a call ends the
/// episode. `post_process` adds `get_reward()` (when the class has it) to each episode's last
/// turn, so it is the `env` reward with `environment.reward = "sum"`; Python reward functions
/// get the instances in TRL's `environments` argument (`RewardInput::environment_instance`),
/// and [`Environment::release`] returns them to the pool after scoring.
#[derive(Debug)]
pub struct PythonFactoryEnvironment {
    name: String,
    object: PythonObject,
    tools: Vec<Value>,
    has_reward: bool,
    max_calls_per_turn: usize,
}

impl PythonFactoryEnvironment {
    /// Loads the class in `workers`' worker and reads its tools (from one instance). Errors
    /// name the field to fix, as [`PythonEnvironment::new`]'s.
    pub fn new(config: &PythonEnvironmentConfig, workers: &PythonWorkers) -> Result<Self> {
        let init = config.init.clone().unwrap_or(Value::Null);
        let (name, object) = load_class(config, PythonKind::Factory { init }, workers)?;
        let loaded = object.loaded().clone();
        let tools = loaded
            .get("tools")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let has_reward = loaded.get("reward").and_then(Value::as_bool) == Some(true);
        Ok(Self {
            name,
            object,
            tools,
            has_reward,
            max_calls_per_turn: 8,
        })
    }

    /// Calls past this many in one turn are answered with an error instead of run (≥ 1).
    pub fn with_max_calls_per_turn(mut self, n: usize) -> Self {
        self.max_calls_per_turn = n.max(1);
        self
    }

    fn request(&self, op: &str, args: Value) -> Result<Value> {
        self.object.request(op, args).map_err(|e| {
            candle_core::Error::msg(format!("{}: {e}", op.trim_start_matches("factory_")))
        })
    }
}

fn instance_of(metadata: &Value) -> Option<&str> {
    metadata.get(INSTANCE_KEY).and_then(Value::as_str)
}

impl Environment for PythonFactoryEnvironment {
    fn name(&self) -> &str {
        &self.name
    }

    fn tools(&self) -> Vec<Value> {
        self.tools.clone()
    }

    fn reset(&self, metadata: &[&Value], n: usize) -> Result<Vec<EnvironmentReset>> {
        let rows: Vec<Value> = metadata
            .iter()
            .flat_map(|m| {
                let row = match m {
                    Value::Object(o) => Value::Object(
                        o.iter()
                            .filter(|(k, _)| !k.starts_with("_env"))
                            .map(|(k, v)| (k.clone(), v.clone()))
                            .collect(),
                    ),
                    _ => json!({}),
                };
                std::iter::repeat_n(row, n)
            })
            .collect();
        let out = self.request("factory_reset", json!({ "rows": rows }))?;
        let ids: Vec<String> = serde_json::from_value(out["ids"].clone())
            .map_err(|e| candle_core::Error::msg(format!("reset: unreadable answer: {e}")))?;
        let observations: Vec<Option<String>> = serde_json::from_value(out["observations"].clone())
            .map_err(|e| candle_core::Error::msg(format!("reset: unreadable answer: {e}")))?;
        if ids.len() != rows.len() || observations.len() != rows.len() {
            bail!("reset: {} answers for {} episodes", ids.len(), rows.len());
        }
        // Each instance's text; episodes of one row that got different texts (an environment
        // that draws its own task) each start from their own.
        let resets = metadata
            .iter()
            .enumerate()
            .map(|(p, m)| {
                let range = p * n..(p + 1) * n;
                let starts = observations[range.clone()]
                    .iter()
                    .map(|o| EpisodeStart {
                        observation: o.clone(),
                        messages: Vec::new(),
                    })
                    .collect();
                let episodes = ids[range]
                    .iter()
                    .map(|id| row_with(m, INSTANCE_KEY, Value::String(id.clone())))
                    .collect();
                EnvironmentReset::from_starts(starts, episodes)
            })
            .collect();
        Ok(resets)
    }

    fn step(&self, logs: &[&[ChatMessage]], metadata: &[&Value]) -> Result<EnvironmentReturn> {
        let n = logs.len();
        let mut ret = EnvironmentReturn::empty(n);
        ret.metadata = metadata.iter().map(|m| (*m).clone()).collect();
        // Every call of every episode in one request; what it answers, in order.
        let mut calls = Vec::new();
        let mut slots: Vec<Vec<std::result::Result<(usize, String), String>>> = vec![Vec::new(); n];
        for (i, (log, m)) in logs.iter().zip(metadata).enumerate() {
            let Some(id) = instance_of(m) else {
                bail!(
                    "episode {i} has no environment instance: call Environment::reset for the \
                     prompts before their episodes"
                );
            };
            let text = log.last().map_or("", |m| m.content.as_str());
            let parsed = crate::tools::parse_tool_calls(text);
            if parsed.is_empty() {
                ret.terminateds[i] = true;
                continue;
            }
            for (k, c) in parsed.into_iter().enumerate() {
                match c {
                    Ok(_) if k >= self.max_calls_per_turn => slots[i].push(Err(format!(
                        "more than {} tool calls in one turn; this one was not run",
                        self.max_calls_per_turn
                    ))),
                    Ok(c) => {
                        let args = match c.function.arguments {
                            Value::Null => json!({}),
                            v => v,
                        };
                        slots[i].push(Ok((calls.len(), c.function.name.clone())));
                        calls.push(json!([id, c.function.name, args]));
                    }
                    Err(e) => slots[i].push(Err(e)),
                }
            }
        }
        let answers: Vec<(bool, String)> = if calls.is_empty() {
            Vec::new()
        } else {
            let out = self.request("factory_call", json!({ "calls": calls }))?;
            serde_json::from_value(out)
                .map_err(|e| candle_core::Error::msg(format!("call: unreadable answer: {e}")))?
        };
        if answers.len() != calls.len() {
            bail!("call: {} answers for {} calls", answers.len(), calls.len());
        }
        for (i, slot) in slots.iter().enumerate() {
            if slot.is_empty() {
                continue;
            }
            let lines: Vec<String> = slot
                .iter()
                .map(|s| match s {
                    Ok((k, _)) => match &answers[*k] {
                        (true, text) => text.clone(),
                        (false, e) => format!("{}{e}", crate::tools::ERROR_PREFIX),
                    },
                    Err(e) => format!("{}{e}", crate::tools::ERROR_PREFIX),
                })
                .collect();
            let mut msg = ChatMessage::new("tool", lines.join("\n"));
            if let [Ok((_, name))] = slot.as_slice() {
                msg.name = Some(name.clone());
            }
            ret.observations[i] = Some(msg);
        }
        Ok(ret)
    }

    fn post_process(&self, episodes: &mut [Episode]) -> Result<BTreeMap<String, f64>> {
        let ids: Vec<String> = episodes
            .iter()
            .filter_map(|e| instance_of(&e.metadata).map(str::to_owned))
            .collect();
        let mut metrics = crate::tools::tool_metrics(episodes);
        let rewarded = if self.has_reward && !ids.is_empty() {
            self.request("factory_reward", json!({ "ids": ids }))
                .and_then(|out| {
                    serde_json::from_value::<Vec<Option<f64>>>(out).map_err(|e| {
                        candle_core::Error::msg(format!("get_reward: unreadable answer: {e}"))
                    })
                })
                .map(Some)
        } else {
            Ok(None)
        };
        if let Some(rewards) = rewarded? {
            let mut k = 0;
            let mut sum = 0.0;
            for e in episodes.iter_mut() {
                if instance_of(&e.metadata).is_none() {
                    continue;
                }
                if let (Some(Some(r)), Some(t)) = (rewards.get(k), e.turns.last_mut()) {
                    t.reward += *r as f32;
                    sum += r;
                }
                k += 1;
            }
            metrics.insert("get_reward_mean".into(), sum / episodes.len().max(1) as f64);
        }
        Ok(metrics)
    }

    fn release(&self, metadata: &[&Value]) -> Result<()> {
        let ids: Vec<&str> = metadata.iter().filter_map(|m| instance_of(m)).collect();
        if ids.is_empty() {
            return Ok(());
        }
        self.request("factory_release", json!({ "ids": ids }))
            .map(|_| ())
    }
}

/// The row column that picks a [`PythonFactoryRouter`]'s environment (TRL's name).
pub const ROUTE_COLUMN: &str = "environment";
/// The metadata key of the environment an episode was routed to.
pub const ROUTE_KEY: &str = "_env_name";

/// Several `environment_factory` classes in one run, each row routed by its `environment`
/// column (TRL's `environment_factory={name: factory, ...}`): a prompt shows only its own
/// environment's tools ([`Environment::tools_for`]), its episodes get instances of that class,
/// and the column is not passed to `reset`. Metrics: the tool metrics over every episode, and
/// `{name}_get_reward_mean` per environment with `get_reward`.
#[derive(Debug)]
pub struct PythonFactoryRouter {
    envs: BTreeMap<String, PythonFactoryEnvironment>,
}

impl PythonFactoryRouter {
    /// The environments by the names rows use (at least one).
    pub fn new(envs: BTreeMap<String, PythonFactoryEnvironment>) -> Result<Self> {
        if envs.is_empty() {
            bail!("a factory router needs at least one environment");
        }
        Ok(Self { envs })
    }

    /// The environment `row` names, or why not.
    fn route<'a>(
        &'a self,
        row: &Value,
    ) -> std::result::Result<(&'a str, &'a PythonFactoryEnvironment), String> {
        let names = || self.envs.keys().cloned().collect::<Vec<_>>().join(", ");
        match row.get(ROUTE_COLUMN) {
            Some(Value::String(n)) => match self.envs.get_key_value(n.as_str()) {
                Some((k, e)) => Ok((k.as_str(), e)),
                None => Err(format!(
                    "column `{ROUTE_COLUMN}` names `{n}`, which is not one of the environments: {}",
                    names()
                )),
            },
            _ => Err(format!(
                "the row has no `{ROUTE_COLUMN}` column (a string naming one of: {})",
                names()
            )),
        }
    }
}

impl Environment for PythonFactoryRouter {
    fn name(&self) -> &str {
        "factories"
    }

    fn tools(&self) -> Vec<Value> {
        let mut seen = std::collections::BTreeSet::new();
        self.envs
            .values()
            .flat_map(|e| e.tools())
            .filter(|t| seen.insert(t["function"]["name"].to_string()))
            .collect()
    }

    fn tools_for(&self, metadata: &Value) -> Vec<Value> {
        self.route(metadata)
            .map(|(_, e)| e.tools())
            .unwrap_or_default()
    }

    fn reset(&self, metadata: &[&Value], n: usize) -> Result<Vec<EnvironmentReset>> {
        let mut groups: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for (p, m) in metadata.iter().enumerate() {
            let (name, _) = self
                .route(m)
                .map_err(|e| candle_core::Error::msg(format!("prompt {p}: {e}")))?;
            groups.entry(name).or_default().push(p);
        }
        let mut out: Vec<Option<EnvironmentReset>> = vec![None; metadata.len()];
        for (name, prompts) in groups {
            // The routing column is the trainer's, not the class's (TRL drops it too).
            let rows: Vec<Value> = prompts
                .iter()
                .map(|&p| match metadata[p] {
                    Value::Object(o) => {
                        let mut o = o.clone();
                        o.remove(ROUTE_COLUMN);
                        Value::Object(o)
                    }
                    other => other.clone(),
                })
                .collect();
            let resets = self.envs[name]
                .reset(&rows.iter().collect::<Vec<_>>(), n)
                .map_err(|e| candle_core::Error::msg(format!("environment `{name}`: {e}")))?;
            for (&p, mut r) in prompts.iter().zip(resets) {
                for m in &mut r.episodes {
                    if let Value::Object(o) = m {
                        o.insert(ROUTE_KEY.into(), Value::String(name.to_owned()));
                        if let Some(v) = metadata[p].get(ROUTE_COLUMN) {
                            o.insert(ROUTE_COLUMN.into(), v.clone());
                        }
                    }
                }
                out[p] = Some(r);
            }
        }
        Ok(out.into_iter().map(Option::unwrap_or_default).collect())
    }

    fn step(&self, logs: &[&[ChatMessage]], metadata: &[&Value]) -> Result<EnvironmentReturn> {
        let n = logs.len();
        let mut groups: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for (i, m) in metadata.iter().enumerate() {
            let name = m.get(ROUTE_KEY).and_then(Value::as_str).unwrap_or("");
            let Some((k, _)) = self.envs.get_key_value(name) else {
                bail!(
                    "episode {i} was not routed to an environment: call Environment::reset for \
                     the prompts before their episodes"
                );
            };
            groups.entry(k.as_str()).or_default().push(i);
        }
        let mut ret = EnvironmentReturn::empty(n);
        for (name, members) in groups {
            let l: Vec<&[ChatMessage]> = members.iter().map(|&i| logs[i]).collect();
            let m: Vec<&Value> = members.iter().map(|&i| metadata[i]).collect();
            let r = self.envs[name]
                .step(&l, &m)
                .map_err(|e| candle_core::Error::msg(format!("environment `{name}`: {e}")))?;
            for (k, &i) in members.iter().enumerate() {
                ret.observations[i] = r.observations[k].clone();
                ret.metadata[i] = r.metadata[k].clone();
                ret.next_stop_strings[i] = r.next_stop_strings[k].clone();
                ret.rewards[i] = r.rewards[k];
                ret.terminateds[i] = r.terminateds[k];
            }
        }
        Ok(ret)
    }

    fn release(&self, metadata: &[&Value]) -> Result<()> {
        let mut groups: BTreeMap<&str, Vec<&Value>> = BTreeMap::new();
        for m in metadata {
            let name = m.get(ROUTE_KEY).and_then(Value::as_str).unwrap_or("");
            if let Some((k, _)) = self.envs.get_key_value(name) {
                groups.entry(k.as_str()).or_default().push(m);
            }
        }
        for (name, m) in groups {
            self.envs[name]
                .release(&m)
                .map_err(|e| candle_core::Error::msg(format!("environment `{name}`: {e}")))?;
        }
        Ok(())
    }

    fn post_process(&self, episodes: &mut [Episode]) -> Result<BTreeMap<String, f64>> {
        let mut metrics = crate::tools::tool_metrics(episodes);
        let mut groups: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for (i, e) in episodes.iter().enumerate() {
            let name = e
                .metadata
                .get(ROUTE_KEY)
                .and_then(Value::as_str)
                .unwrap_or("");
            if let Some((k, _)) = self.envs.get_key_value(name) {
                groups.entry(k.as_str()).or_default().push(i);
            }
        }
        let mut first_error = None;
        for (name, members) in groups {
            let mut part: Vec<Episode> = members.iter().map(|&i| episodes[i].clone()).collect();
            match self.envs[name].post_process(&mut part) {
                Ok(m) => {
                    if let Some(v) = m.get("get_reward_mean") {
                        metrics.insert(format!("{name}_get_reward_mean"), *v);
                    }
                    for (&i, e) in members.iter().zip(part) {
                        episodes[i] = e;
                    }
                }
                // Every environment is post-processed; the first error is reported.
                Err(e) if first_error.is_none() => {
                    first_error = Some(candle_core::Error::msg(format!(
                        "environment `{name}`: {e}"
                    )));
                }
                Err(_) => {}
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(metrics),
        }
    }
}
