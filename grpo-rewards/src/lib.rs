//! # grpo-rewards: scoring completions for GRPO
//!
//! This crate's one job is to turn a batch of generated completions into one reward per
//! completion. It does not depend on candle or on any sibling crate.
//!
//! * **The seam**: [`Reward`] (synchronous) and [`AsyncReward`] (LLM judges) score a batch of
//!   [`RewardInput`]s (prompt text and messages, completion text and token count, the sample's
//!   other fields as [`FieldValue`]s) into a [`RewardOutput`]: one `Option<f32>` per completion
//!   (`None` = no opinion) plus optional per-completion info. Any
//!   `Fn(&[RewardInput]) -> Vec<Option<f32>>` closure is a [`Reward`].
//! * **Combination**: a [`RewardSet`] holds named, weighted rewards (TRL's `reward_weights`):
//!   the weighted sum over the functions that gave a value (`NaN` when none did), and the
//!   metrics `rewards/{name}/mean`, `rewards/{name}/std` plus counters such as `judge/failures`.
//! * **Built-ins** ([`builtin`]): `accuracy`, `format`, `overlong` (DAPO), TRL's reward
//!   functions (`math_verify` = `accuracy_reward`, `think_format`, `repetition_penalty`,
//!   `cosine_scaled`, `reasoning_accuracy`) on a native port of math-verify
//!   ([`builtin::math_verify`]), and, through the
//!   small scoring traits [`builtin::LanguageScorer`], [`builtin::SequenceClassifier`] and
//!   [`builtin::StepClassifier`] that the model crate implements, `inverse_loss`, `coverage_ce`,
//!   `reward_model` and `process_reward_model`.
//! * **LLM judges** ([`judge`]): OpenAI-compatible chat completions through async-openai,
//!   minijinja prompt templates, scores parsed from JSON or a regex, weighted ensembles and
//!   escalation to a stronger judge, a persistent SQLite cache, rate limits, a concurrency cap,
//!   timeouts and retries with backoff. Behind the default feature `judges` (which also brings
//!   the tokio runtime for asynchronous rewards); without it the traits, `RewardSet` over
//!   synchronous rewards, the configs and the built-ins need only serde, serde_json, regex,
//!   fancy-regex and thiserror.
//! * **HTTP** ([`http`], with `judges`): the one retry policy (exponential backoff with equal
//!   jitter on backon, the server's `Retry-After` as delta-seconds or an HTTP date) and the
//!   async-openai transport that keeps a failure's status and `Retry-After`; grpo-rollout's
//!   `remote` client (vLLM) uses them too; and [`http::HttpReward`] (`type = "http"`), a reward
//!   model behind an HTTP service that gets each batch as TRL's reward-function arguments.
//! * **Programs** (`command`, feature `command`, default): `type = "command"` runs a program per
//!   completion (argv placeholders, stdin or a file in a fresh temporary directory) and scores
//!   its exit status or the number it prints, with a timeout, a concurrency cap, CPU, memory
//!   and output limits.
//! * **Python** ([`python`]): `type = "python"` runs reward functions written for TRL
//!   (`f(prompts, completions, completion_ids, **kwargs)`) in one persistent worker process,
//!   over a JSON line protocol on std::process (no extra dependency).
//! * **Configs** ([`RewardsConfig`]): serde structs (TOML/YAML/JSON) validated once into a
//!   [`RewardSet`]; errors name the field to fix.
//!
//! The data crate feeds the samples; the scorer stage of the training pipeline (`grpo-cli`)
//! builds the `RewardInput`s, calls [`RewardSet::score`] and hands the rewards to `grpo-core`'s
//! advantages; `grpo-teacher` implements its own rewards on these traits.
//!
//! ```
//! use grpo_rewards::{RewardInput, RewardsConfig, ScoringModels};
//!
//! let config: RewardsConfig = serde_json::from_str(r#"{
//!     "rewards": [
//!         {"type": "accuracy", "answer_field": "answer"},
//!         {"type": "overlong", "weight": 0.5, "max_completion_length": 100, "overlong_buffer": 20}
//!     ]
//! }"#).unwrap();
//! let set = config.build(&ScoringModels::default()).unwrap();
//! let batch = vec![
//!     RewardInput::new("What is 6 × 7?", "… so it is <answer>42</answer>")
//!         .with_tokens(90)
//!         .with_field("answer", "42"),
//! ];
//! let scored = set.score(&batch).unwrap();
//! // accuracy 1, overlong (80 − 90) / 20 = −0.5 with weight 0.5
//! assert_eq!(scored.rewards, vec![1.0 - 0.25]);
//! assert_eq!(scored.metrics["rewards/accuracy/mean"], 1.0);
//! ```
#![deny(missing_docs)]

pub mod builtin;
mod combine;
#[cfg(feature = "command")]
pub mod command;
mod config;
mod error;
#[cfg(feature = "judges")]
pub mod http;
#[cfg(feature = "judges")]
pub mod judge;
pub mod python;
mod reward;
mod types;

#[cfg(feature = "judges")]
pub use combine::ScoreTask;
pub use combine::{RewardSet, ScoredBatch, combine_rewards, nan_mean, nan_std};
pub use config::{RewardKind, RewardSpec, RewardsConfig, ScoringModels};
pub use error::{Result, RewardError};
pub use reward::{AsyncReward, BoxFuture, Reward};
pub use types::{FieldValue, Message, RewardInput, RewardOutput};
