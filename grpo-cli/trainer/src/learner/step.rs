//! The optimizer update (global-norm clipping, the schedule's learning rate, AdamW), the
//! update loop of the steps that train on their micro-batches directly (distillation, online
//! DPO), and the TR-DPO reference sync.

use std::collections::HashMap;

use anyhow::{Context, Result, bail};
use candle_core::Tensor;
use grpo_rollout::{TrainableModel, Transformer};

use super::Learner;
use crate::optim::clip_grad_norm;

/// One micro-batch as [`Learner::chunked_updates`] hands it to the loss: the pass
/// (`num_iterations`), the micro-batch's completions `[a, b)`, and the micro-batches of its
/// optimizer update.
pub(crate) struct Chunk<'a> {
    /// 0 for the first pass over the step.
    pub iteration: usize,
    /// The micro-batch's completions.
    pub range: (usize, usize),
    /// The micro-batches that make its optimizer update.
    pub update: &'a [(usize, usize)],
}

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
        self.apply_update(&grads, lr)?;
        drop(grads);
        Ok((norm, lr))
    }

    /// One AdamW update of the policy at `lr` with `grads` as they are, and what follows each
    /// update (SDPO's EMA teacher, BEMA).
    pub(crate) fn apply_update(&mut self, grads: &HashMap<String, Tensor>, lr: f64) -> Result<()> {
        self.updating = true;
        self.opt.step(grads, lr)?;
        if let Some((_, v)) = self.opt.vars().first() {
            grpo_core::memlog::log("learner: optimizer step", v.device());
            grpo_core::memlog::release_unused(v.device());
        }
        self.state.optimizer_steps += 1;
        self.sdpo_after_update()?;
        self.bema_after_update()?;
        Ok(())
    }

    /// The update loop: `optim.num_iterations` passes over the step's micro-batches `chunks`,
    /// cut into `updates_per_step` optimizer updates; `loss_of` gives each micro-batch's loss
    /// (with the policy's graph, already scaled to its share of the update), whose gradients
    /// are summed into the update. Returns the mean update loss, and the last update's gradient
    /// norm and learning rate. A non-finite loss fails the step (before its update).
    pub(crate) fn chunked_updates(
        &mut self,
        chunks: &[(usize, usize)],
        step: usize,
        mut loss_of: impl FnMut(&Self, Chunk<'_>) -> Result<Tensor>,
    ) -> Result<(f64, f64, f64)> {
        let updates = self.cfg.updates_per_step();
        let per_update = chunks.len().div_ceil(updates).max(1);
        let (mut loss_sum, mut passes) = (0.0, 0.0f64);
        let (mut grad_norm, mut lr) = (0.0, 0.0);
        for iteration in 0..self.cfg.optim.num_iterations {
            for u in 0..updates {
                let update = &chunks
                    [(u * per_update).min(chunks.len())..((u + 1) * per_update).min(chunks.len())];
                let mut acc = HashMap::new();
                // The micro-batches' losses stay on the device and cross to the host once per
                // update: a read per micro-batch would make the host wait for each forward
                // before issuing its backward.
                let mut losses = Vec::with_capacity(update.len());
                for &range in update {
                    let loss = loss_of(
                        self,
                        Chunk {
                            iteration,
                            range,
                            update,
                        },
                    )?;
                    losses.push(loss.detach().to_dtype(candle_core::DType::F64)?);
                    let dev = loss.device().clone();
                    grpo_core::memlog::log("learner: micro-batch forward", &dev);
                    let grads = self.policy.model.backward(&loss)?;
                    grpo_core::memlog::log("learner: backward (graph alive)", &dev);
                    // The forward graph (every activation) goes before the sums are made.
                    drop(loss);
                    self.opt.accumulate(&mut acc, &grads)?;
                    drop(grads);
                    grpo_core::memlog::log("learner: gradients summed", &dev);
                }
                let update_loss = match losses.is_empty() {
                    true => 0.0,
                    false => Tensor::stack(&losses, 0)?.sum_all()?.to_scalar::<f64>()?,
                };
                if !update_loss.is_finite() {
                    bail!("non-finite loss ({update_loss}) at step {}", step + 1);
                }
                loss_sum += update_loss;
                passes += 1.0;
                (grad_norm, lr) = self.optimizer_step(acc, step)?;
            }
        }
        Ok((loss_sum / passes.max(1.0), grad_norm, lr))
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
        self.reference = Some(ema_into(reference, &self.policy, r.ref_model_mixup_alpha)?);
        Ok(())
    }
}

/// `target` moved toward the policy: `α · policy + (1 − α) · target` for every weight (the
/// policy's LoRA adapters merged first): TR-DPO's reference sync and SDPO's EMA teacher.
pub(crate) fn ema_into(
    target: &Transformer,
    policy: &TrainableModel,
    alpha: f64,
) -> Result<Transformer> {
    let merged = merged_policy(policy)?;
    let pw: HashMap<String, Tensor> = merged.weights().into_iter().collect();
    let mut new_w = HashMap::new();
    for (k, rw) in target.weights() {
        let p = pw.get(&k).with_context(|| format!("policy has no `{k}`"))?;
        new_w.insert(k, ((p * alpha)? + (rw * (1.0 - alpha))?)?);
    }
    Ok(Transformer::from_weights_like(target, &new_w)?)
}

/// The policy as one plain model (LoRA adapters merged into the base).
fn merged_policy(p: &TrainableModel) -> Result<Transformer> {
    Ok(match &p.lora {
        Some(_) => grpo_rollout::lora::merge(&p.model.detached())?,
        None => p.model.detached(),
    })
}
