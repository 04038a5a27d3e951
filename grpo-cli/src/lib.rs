//! The grpo-rs trainer as a library: config, pipeline, learner, checkpoints. The `grpo-cli`
//! binary is a thin shell over it.
//!
//! - [`config::TrainConfig`]: one schema (TOML or YAML) with TRL's names, `--set` overrides,
//!   unknown keys refused with the closest valid key.
//! - [`trainer`]: the stages (loader → generator → scorer → learner) over bounded channels,
//!   checkpoints with exact resume, `metrics.jsonl` and `completions.jsonl`.
//! - [`Trainer`] ([`GrpoTrainer`], [`SftTrainer`], [`DpoTrainer`]): `from_config(...)` /
//!   `from_pretrained(path, ...)` then `fit() -> TrainingResult`, with [`trainer::Callbacks`];
//!   [`create_trainer`] by name, [`list_algorithms`].
//! - [`optim`]: AdamW with saveable state, gradient clipping, LR schedules.
//! - [`check`]: `grpo-cli check`, the build's self-test on a device (fused ops, device vs CPU,
//!   checkpointing, training, generation).
//! - [`serve`]: `grpo-cli serve`, an OpenAI-compatible server (completions, chat, vLLM's LoRA
//!   endpoints) batching concurrent requests on grpo-rollout's generator.
//!
//! ```no_run
//! use grpo_cli::{GrpoTrainer, config::TrainConfig};
//!
//! let mut cfg = TrainConfig::default();
//! cfg.data.path = vec!["data/arith.parquet".into()];
//! cfg.rewards = serde_json::from_value(serde_json::json!([{"type": "accuracy"}])).unwrap();
//! cfg.train.max_steps = Some(10);
//! let result = GrpoTrainer::from_pretrained("models/tiny", cfg).unwrap().fit().unwrap();
//! // SFT and DPO the same way: SftTrainer::from_pretrained(..), DpoTrainer::from_pretrained(..),
//! // or grpo_cli::create_trainer("sft", "models/tiny", cfg).
//! println!("{} steps, last reward {:?}", result.total_steps, result.metrics.last().map(|m| m["reward"]));
//! ```
#![deny(missing_docs)]

pub mod bench;
pub mod check;
pub mod config;
pub mod demo;
pub mod optim;
pub mod plot;
pub mod progress;
pub mod serve;
pub mod trainer;

use std::path::Path;

use anyhow::{Result, anyhow};

pub use trainer::{Callbacks, Metrics, NoCallbacks, RunMode, RunOptions, TrainingResult};

/// The first line of a message (error texts from candle and others may carry a backtrace or
/// detail after it; a user-facing line leaves that out).
pub fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or("").to_string()
}

/// A `--dtype` argument: `f32`, `bf16`, `f16` (or `f64`), with their long names.
pub fn parse_dtype_arg(s: &str) -> Result<candle_core::DType> {
    use candle_core::DType;
    match s {
        "f32" | "float32" => Ok(DType::F32),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        "f16" | "float16" => Ok(DType::F16),
        "f64" | "float64" => Ok(DType::F64),
        o => Err(anyhow!(
            "--dtype: unknown dtype `{o}`, expected f32, bf16 or f16"
        )),
    }
}

/// An error and its causes on one line, each cause's first line once, joined by `: `.
pub fn error_line(e: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in e.chain() {
        let first = first_line(&cause.to_string()).trim().to_string();
        if !first.is_empty() && !parts.iter().any(|p| p.contains(&first)) {
            parts.push(first);
        }
    }
    parts.join(": ")
}

/// The objective a [`Trainer`] optimises (a marker type: [`Grpo`], [`Sft`], [`Dpo`]).
pub trait Algorithm {
    /// The config's `algorithm` value.
    const NAME: &'static str;
}

/// GRPO (rewards, advantages, clipped policy loss).
#[derive(Debug, Clone, Copy)]
pub struct Grpo;
/// Supervised fine-tuning (`[sft]`).
#[derive(Debug, Clone, Copy)]
pub struct Sft;
/// Direct preference optimisation (`[dpo]`).
#[derive(Debug, Clone, Copy)]
pub struct Dpo;

impl Algorithm for Grpo {
    const NAME: &'static str = "grpo";
}
impl Algorithm for Sft {
    const NAME: &'static str = "sft";
}
impl Algorithm for Dpo {
    const NAME: &'static str = "dpo";
}

/// The algorithm chosen at run time by name ([`create_trainer`]).
#[derive(Debug, Clone, Copy)]
pub struct ByName;

/// A trainer whose algorithm was chosen by name.
pub type AnyTrainer = Trainer<ByName>;
/// A GRPO trainer.
pub type GrpoTrainer = Trainer<Grpo>;
/// An SFT trainer.
pub type SftTrainer = Trainer<Sft>;
/// A DPO trainer.
pub type DpoTrainer = Trainer<Dpo>;

/// The algorithms [`create_trainer`] knows, sorted.
pub fn list_algorithms() -> Vec<&'static str> {
    vec![Dpo::NAME, Grpo::NAME, Sft::NAME]
}

/// A trainer of any algorithm, by name (`"grpo"`, `"sft"`, `"dpo"`): `cfg.algorithm` is set to
/// it and the model loaded from `path`.
pub fn create_trainer(
    algorithm: &str,
    path: impl AsRef<Path>,
    mut cfg: config::TrainConfig,
) -> Result<AnyTrainer> {
    if !list_algorithms().contains(&algorithm) {
        anyhow::bail!(
            "unknown algorithm `{algorithm}`; expected one of {}",
            list_algorithms().join(", ")
        );
    }
    cfg.algorithm = algorithm.to_owned();
    cfg.model.path = path.as_ref().to_path_buf();
    Trainer::build(cfg)
}

/// A run: a validated setup (model, data, rewards or preference pairs) plus run options,
/// trained by [`Trainer::fit`]. One builder and one learner for the three algorithms.
pub struct Trainer<A = Grpo> {
    setup: Option<trainer::Setup>,
    /// Resume, threading and stop options.
    pub options: RunOptions,
    callbacks: Box<dyn Callbacks>,
    step: usize,
    last_checkpoint: Option<std::path::PathBuf>,
    algorithm: std::marker::PhantomData<A>,
}

impl<A> std::fmt::Debug for Trainer<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("setup", &self.setup)
            .field("step", &self.step)
            .finish_non_exhaustive()
    }
}

impl<A: Algorithm> Trainer<A> {
    /// Loads the model and data of `cfg` (with `algorithm` set to this trainer's) and checks
    /// them.
    pub fn from_config(mut cfg: config::TrainConfig) -> Result<Self> {
        cfg.algorithm = A::NAME.to_owned();
        Self::build(cfg)
    }

    /// `cfg` with `model.path = path` (NeMo RL's `from_pretrained(...)`).
    pub fn from_pretrained(path: impl AsRef<Path>, mut cfg: config::TrainConfig) -> Result<Self> {
        cfg.model.path = path.as_ref().to_path_buf();
        Self::from_config(cfg)
    }
}

impl<A> Trainer<A> {
    fn build(cfg: config::TrainConfig) -> Result<Self> {
        Ok(Self {
            setup: Some(trainer::setup(cfg)?),
            options: RunOptions::default(),
            callbacks: Box::new(NoCallbacks),
            step: 0,
            last_checkpoint: None,
            algorithm: std::marker::PhantomData,
        })
    }

    /// Sets the callbacks.
    pub fn with_callbacks(mut self, cb: impl Callbacks + 'static) -> Self {
        self.callbacks = Box::new(cb);
        self
    }

    /// Steps the run will take.
    pub fn total_steps(&self) -> usize {
        self.setup.as_ref().map_or(self.step, |s| s.total_steps)
    }

    /// Steps done: 0 before [`Self::fit`], the checkpoint's step after
    /// [`Self::load_checkpoint`], the last step after `fit`.
    pub fn current_step(&self) -> usize {
        self.step
    }

    /// Continues from a checkpoint directory (`checkpoints/step-N`) when [`Self::fit`] runs:
    /// weights, optimizer, schedule, data position and step, exactly.
    pub fn load_checkpoint(&mut self, dir: impl AsRef<Path>) -> Result<()> {
        let dir = dir.as_ref();
        let state = dir.join("trainer_state.json");
        let text = std::fs::read_to_string(&state)
            .map_err(|e| anyhow::anyhow!("{}: {e} (not a complete checkpoint)", state.display()))?;
        let st: trainer::TrainerState =
            serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", state.display()))?;
        self.step = st.step;
        self.options.resume = Some(Some(dir.to_path_buf()));
        Ok(())
    }

    /// [`Self::fit`] on `train` (and `eval`) instead of the config's files (NeMo RL's
    /// `fit(dataset)`); without `train.max_steps` the steps follow the new dataset's size.
    pub fn fit_on(
        &mut self,
        train: grpo_data::Dataset,
        eval: Option<grpo_data::Dataset>,
    ) -> Result<TrainingResult> {
        let s = self
            .setup
            .as_mut()
            .ok_or_else(|| anyhow::anyhow!("this trainer has already been fitted"))?;
        if train.is_empty() {
            anyhow::bail!("fit_on: the training dataset has no rows");
        }
        trainer::supervised_columns(&s.cfg, &train).map_err(|e| anyhow::anyhow!("fit_on: {e}"))?;
        let t = &s.cfg.train;
        if t.max_steps.is_none() {
            let per_epoch = train.len() as f64 / t.prompts_per_step as f64;
            s.total_steps = ((per_epoch * t.num_train_epochs).ceil() as usize).max(1);
        }
        s.train = train;
        s.eval = eval;
        self.fit()
    }

    /// Trains to the end (or to a stop request) and returns the metrics; checkpoints go to the
    /// run directory (`checkpoints/step-N`, see [`TrainingResult::best_checkpoint_path`]).
    /// A trainer fits once.
    pub fn fit(&mut self) -> Result<TrainingResult> {
        let setup = self
            .setup
            .take()
            .ok_or_else(|| anyhow::anyhow!("this trainer has already been fitted"))?;
        let r = trainer::run(setup, &self.options, self.callbacks.as_mut())?;
        self.step = r.total_steps;
        self.last_checkpoint = r.best_checkpoint_path.clone();
        Ok(r)
    }

    /// Writes the trainer's state after [`Self::fit`] (weights or adapter, optimizer, schedule
    /// and data position: the checkpoint `fit` ended with) to `dir`, which
    /// [`Self::load_checkpoint`] and `--resume DIR` read.
    pub fn save_checkpoint(&self, dir: impl AsRef<Path>) -> Result<()> {
        let src = self.last_checkpoint.as_ref().ok_or_else(|| {
            anyhow::anyhow!("save_checkpoint: nothing to save before fit() has run")
        })?;
        copy_dir(src, dir.as_ref())
    }
}

fn copy_dir(src: &Path, dst: &Path) -> Result<()> {
    use anyhow::Context;
    std::fs::create_dir_all(dst).with_context(|| format!("{}: cannot create", dst.display()))?;
    for entry in
        std::fs::read_dir(src).with_context(|| format!("{}: cannot read", src.display()))?
    {
        let entry = entry?;
        let to = dst.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &to)?;
        } else {
            std::fs::copy(entry.path(), &to)
                .with_context(|| format!("{}: cannot write", to.display()))?;
        }
    }
    Ok(())
}

/// `--device` and `--dtype`, shared by every subcommand that runs a model.
#[derive(Debug, Clone, clap::Args)]
pub struct DeviceArgs {
    /// `cpu`, `cuda` or `cuda:N` (CUDA needs a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Weight dtype: `f32`, `bf16` or `f16`.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
}

impl DeviceArgs {
    /// The device and dtype, or a one-line error naming the flag.
    pub fn resolve(&self) -> Result<(candle_core::Device, candle_core::DType)> {
        let device = config::parse_device(&self.device)
            .map_err(|e| anyhow!("--device {}: {e}", self.device))?;
        let dtype = parse_dtype_arg(&self.dtype)?;
        Ok((device, dtype))
    }
}
