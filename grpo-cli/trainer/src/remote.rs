//! The glue of `rollout.backend = "openai"`: the policy's LoRA adapter goes to the server
//! (PEFT files under `rollout.openai.adapter_dir`, loaded with vLLM's `/v1/load_lora_adapter`)
//! whenever the generator has a newer version than the server.

use std::path::PathBuf;

use anyhow::{Context, Result, anyhow};
use grpo_rollout::remote::RemoteGenerator;
use grpo_rollout::{LoraConfig, Transformer};

use crate::config::TrainConfig;

/// What the rollout server has of the policy.
#[derive(Debug, Clone)]
pub struct RemoteSync {
    lora: Option<LoraConfig>,
    root: PathBuf,
    base: String,
    /// The policy version (and its adapter directory) the server has.
    synced: Option<(usize, PathBuf)>,
}

impl RemoteSync {
    /// Nothing synced yet.
    pub fn new(cfg: &TrainConfig) -> Self {
        Self {
            lora: cfg.model.lora.clone(),
            root: match cfg.rollout.openai.adapter_dir.as_str() {
                "" => cfg.output_dir.join("rollout_adapters"),
                d => PathBuf::from(d),
            },
            base: cfg.model.path.display().to_string(),
            synced: None,
        }
    }

    /// Sends the current policy to the server when it has an older one: the LoRA adapter is
    /// saved in PEFT's format under `rollout.openai.adapter_dir` and loaded with
    /// `/v1/load_lora_adapter` (the previous one is unloaded and its directory removed).
    pub fn sync(
        &mut self,
        server: &mut RemoteGenerator,
        model: &Transformer,
        version: usize,
    ) -> Result<()> {
        if self.synced.as_ref().map(|s| s.0) == Some(version) {
            return Ok(());
        }
        let lora = self
            .lora
            .as_ref()
            .context("rollout.backend = \"openai\" needs [model.lora]")?;
        let dir = self.root.join(format!("step-{version}"));
        grpo_rollout::lora::save_peft(model, lora, &dir, &self.base)
            .with_context(|| format!("rollout.openai: writing the adapter to {}", dir.display()))?;
        server
            .sync_adapter(&format!("policy-step-{version}"), &dir)
            .map_err(|e| anyhow!("rollout.openai: {e}"))?;
        if let Some((_, old)) = self.synced.replace((version, dir.clone()))
            && old != dir
        {
            let _ = std::fs::remove_dir_all(old);
        }
        Ok(())
    }
}
