//! The optimizer update (global-norm clipping, the schedule's learning rate, AdamW) and the
//! TR-DPO reference sync.

use std::collections::HashMap;

use anyhow::{Context, Result, bail};
use candle_core::Tensor;
use grpo_rollout::{TrainableModel, Transformer};

use super::Learner;
use crate::optim::clip_grad_norm;

impl Learner {
    /// Clips `grads` to `optim.max_grad_norm` and applies one AdamW update at the schedule's
    /// learning rate. Returns the gradient norm before clipping and the learning rate.
    pub(crate) fn optimizer_step(
        &mut self,
        mut grads: HashMap<String, Tensor>,
        step: usize,
    ) -> Result<(f64, f64)> {
        let norm = clip_grad_norm(&mut grads, self.cfg.optim.max_grad_norm)?;
        if !norm.is_finite() {
            bail!("non-finite gradient norm at step {step}");
        }
        let lr = self.schedule.lr_at(self.state.optimizer_steps);
        self.updating = true;
        self.opt.step(&grads, lr)?;
        self.state.optimizer_steps += 1;
        Ok((norm, lr))
    }

    /// TR-DPO's reference sync: every `ref_model_sync_steps` steps,
    /// ref ← α·policy + (1 − α)·ref (`reference.sync_ref_model`).
    pub(crate) fn sync_reference(&mut self) -> Result<()> {
        let r = &self.cfg.reference;
        if !r.sync_ref_model || !self.state.step.is_multiple_of(r.ref_model_sync_steps) {
            return Ok(());
        }
        let Some(reference) = &self.reference else {
            return Ok(());
        };
        let alpha = r.ref_model_mixup_alpha;
        let merged = merged_policy(&self.policy)?;
        let pw: HashMap<String, Tensor> = merged.weights().into_iter().collect();
        let mut new_w = HashMap::new();
        for (k, rw) in reference.weights() {
            let p = pw.get(&k).with_context(|| format!("policy has no `{k}`"))?;
            new_w.insert(k, ((p * alpha)? + (rw * (1.0 - alpha))?)?);
        }
        self.reference = Some(Transformer::from_weights_like(reference, &new_w)?);
        Ok(())
    }
}

/// The policy as one plain model (LoRA adapters merged into the base).
fn merged_policy(p: &TrainableModel) -> Result<Transformer> {
    Ok(match &p.lora {
        Some(_) => grpo_rollout::lora::merge(&p.model.detached())?,
        None => p.model.detached(),
    })
}
