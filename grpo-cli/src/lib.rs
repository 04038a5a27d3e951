//! The grpo-rs trainer as a library: config, pipeline, learner, checkpoints. The `grpo-cli`
//! binary is a thin shell over it.
//!
//! - [`config::TrainConfig`]: one schema (TOML or YAML) with TRL's names, `--set` overrides,
//!   unknown keys refused with the closest valid key.
//! - [`trainer`]: the stages (loader → generator → scorer → learner) over bounded channels,
//!   checkpoints with exact resume, `metrics.jsonl` and `completions.jsonl`.
//! - [`GrpoTrainer`]: `from_config(...)` / `from_pretrained(path, ...)` then
//!   `fit() -> TrainingResult`, with [`trainer::Callbacks`].
//! - [`optim`]: AdamW with saveable state, gradient clipping, LR schedules.
//!
//! ```no_run
//! use grpo_cli::{GrpoTrainer, config::TrainConfig};
//!
//! let mut cfg = TrainConfig::default();
//! cfg.data.path = vec!["data/arith.parquet".into()];
//! cfg.rewards = serde_json::from_value(serde_json::json!([{"type": "accuracy"}])).unwrap();
//! cfg.train.max_steps = Some(10);
//! let result = GrpoTrainer::from_pretrained("models/tiny", cfg).unwrap().fit().unwrap();
//! println!("{} steps, last reward {:?}", result.total_steps, result.metrics.last().map(|m| m["reward"]));
//! ```
#![deny(missing_docs)]

pub mod bench;
pub mod config;
pub mod demo;
pub mod optim;
pub mod plot;
pub mod progress;
pub mod trainer;

use std::path::Path;

use anyhow::Result;

pub use trainer::{Callbacks, Metrics, NoCallbacks, RunMode, RunOptions, TrainingResult};

/// A GRPO run: a validated setup plus run options.
pub struct GrpoTrainer {
    setup: trainer::Setup,
    /// Resume, threading and stop options.
    pub options: RunOptions,
    callbacks: Box<dyn Callbacks>,
}

impl std::fmt::Debug for GrpoTrainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpoTrainer")
            .field("setup", &self.setup)
            .finish_non_exhaustive()
    }
}

impl GrpoTrainer {
    /// Loads the model, data and rewards of `cfg` and checks them.
    pub fn from_config(cfg: config::TrainConfig) -> Result<Self> {
        Ok(Self {
            setup: trainer::setup(cfg)?,
            options: RunOptions::default(),
            callbacks: Box::new(NoCallbacks),
        })
    }

    /// `cfg` with `model.path = path`.
    pub fn from_pretrained(path: impl AsRef<Path>, mut cfg: config::TrainConfig) -> Result<Self> {
        cfg.model.path = path.as_ref().to_path_buf();
        Self::from_config(cfg)
    }

    /// Sets the callbacks.
    pub fn with_callbacks(mut self, cb: impl Callbacks + 'static) -> Self {
        self.callbacks = Box::new(cb);
        self
    }

    /// Generation batches the run will take.
    pub fn total_steps(&self) -> usize {
        self.setup.total_steps
    }

    /// Trains to the end (or to a stop request) and returns the metrics.
    pub fn fit(mut self) -> Result<TrainingResult> {
        trainer::run(self.setup, &self.options, self.callbacks.as_mut())
    }
}
