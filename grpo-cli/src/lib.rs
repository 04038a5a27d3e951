//! The `grpo-cli` binary's library: the parts of the command line worth testing and reusing
//! that are not the trainer. The trainer itself (GRPO, SFT, DPO, the pipeline, config,
//! checkpoints) is the crate `grpo-trainer`, which this crate re-exports as [`trainer`].
//!
//! - [`progress`]: the progress bar (an event sink of the trainer's events thread).
//! - [`check`]: `grpo-cli check`, the build's self-test on a device (fused ops, device vs CPU,
//!   checkpointing, training, generation).
//! - [`serve`]: `grpo-cli serve`, an OpenAI-compatible server (completions, chat, vLLM's LoRA
//!   endpoints) batching concurrent requests on grpo-rollout's generator.
//! - [`mod@bench`], [`demo`], [`plot`]: the GRPO step benchmark, the offline demo, run curves.
#![deny(missing_docs)]

pub mod bench;
pub mod calculator;
pub mod check;
pub mod demo;
pub mod plot;
pub mod progress;
pub mod serve;

use anyhow::{Result, anyhow};
pub use grpo_trainer as trainer;
pub use grpo_trainer::{error_line, first_line};

/// A mergekit merge configuration from `path`: YAML (`.yml`, `.yaml`, mergekit's own format)
/// or TOML (`.toml`), the same schema ([`grpo_rollout::merge::MergeConfig`]); an error names
/// the file and the field.
pub fn read_merge_config(path: &std::path::Path) -> Result<grpo_rollout::merge::MergeConfig> {
    let text = std::fs::read_to_string(path).map_err(|e| anyhow!("{}: {e}", path.display()))?;
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .unwrap_or_default();
    let one_line = |e: String| anyhow!("{}: {}", path.display(), e.replace('\n', " "));
    match ext {
        "toml" => toml::from_str(&text).map_err(|e| one_line(e.message().to_string())),
        "yml" | "yaml" => serde_norway::from_str(&text).map_err(|e| one_line(e.to_string())),
        _ => Err(anyhow!(
            "{}: a merge configuration is a .yml, .yaml or .toml file",
            path.display()
        )),
    }
}

/// A `--dtype` argument: `f32`, `bf16`, `f16` (or their long names `float32`, ...).
pub fn parse_dtype_arg(s: &str) -> Result<candle_core::DType> {
    s.parse::<grpo_rollout::Dtype>()
        .map(|d| d.dtype())
        .map_err(|e| anyhow!("--dtype: {e}"))
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
        let device = self
            .device
            .parse::<grpo_rollout::DeviceSpec>()
            .and_then(|d| d.device())
            .map_err(|e| anyhow!("--device {}: {e}", self.device))?;
        let dtype = parse_dtype_arg(&self.dtype)?;
        Ok((device, dtype))
    }
}
