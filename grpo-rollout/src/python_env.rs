//! Environments written in Python with NeMo RL's `step` signature, run in grpo-rewards'
//! shared Python worker (feature `rewards`).
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

use crate::env::{Environment, EnvironmentReturn};
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
        let name = config.name.clone().unwrap_or_else(|| config.class.clone());
        let object = PythonObject::load(
            &PythonConfig {
                path: config.path.clone(),
                function: config.class.clone(),
                python: config.python.clone(),
                timeout: config.timeout,
            },
            PythonKind::Environment {
                init: config.init.clone().unwrap_or(Value::Null),
            },
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
        Ok(Self { name, object })
    }
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
