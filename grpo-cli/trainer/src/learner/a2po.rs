//! A*-PO (TRL's experimental `A2POTrainer`, "Accelerating RL for LLM Reasoning with Optimal
//! Advantage Regression"), in two stages:
//!
//! 1. [`stage_one`], when the run starts: `a2po.num_value_samples` completions of the frozen
//!    reference for every training prompt, scored by the run's rewards, estimate each prompt's
//!    optimal value `V*(x) = β1 · log mean_i exp(r_i / β1)`; prompts whose samples all scored 0
//!    leave the training set (`filter_all_incorrect`). The samples are seeded by the run's
//!    seed, so a resumed run estimates the same values.
//! 2. `Learner::a2po_step`: the policy samples (one completion per prompt by default); the
//!    loss is the mean over the completions of `(β2 · log(π(y|x) / π_ref(y|x)) − (r − V*))²`,
//!    the summed log-probs taken from the raw logits.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail};
use candle_core::{DType, Tensor};
use grpo_data::{SampleStream, StreamConfig};

use super::Learner;
use super::batch::{rewards_or_zero, summed_policy_and_reference};
use super::metrics::OffPolicyStats;
use crate::callbacks::Metrics;
use crate::setup::Setup;
use crate::stages::{Generator, PromptBatch, Scored, Scorer};

/// Steps of the value-estimation pass's seeds, far from any training step's.
const STAGE_ONE_STEP: usize = 1 << 40;

/// `V* = β1 · (logsumexp(r / β1) − log n)` of one prompt's reward samples, computed stably;
/// an unscored sample (NaN) counts 0.
pub fn optimal_value(rewards: &[f32], beta1: f64) -> f64 {
    let r: Vec<f64> = rewards
        .iter()
        .map(|&x| {
            if x.is_nan() {
                0.0
            } else {
                f64::from(x) / beta1
            }
        })
        .collect();
    let m = r.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let lse = m + r.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
    beta1 * (lse - (r.len() as f64).ln())
}

/// Stage 1: the optimal value of every training prompt from the reference's samples
/// (`setup.a2po_values`), the all-incorrect prompts left out of `setup.train` (and the run's
/// step count recomputed) with `a2po.filter_all_incorrect`.
pub fn stage_one(setup: &mut Setup) -> Result<()> {
    let cfg = &setup.cfg;
    let a = &cfg.a2po;
    let reference = setup
        .reference
        .clone()
        .context("A*-PO needs the reference model")?;
    let n = a.num_value_samples;
    let generator = Generator::new(setup, Arc::new(reference), 0)
        .with_num_generations(n)
        .local();
    // No learner runs yet: the overlapped generator's own handle of the GPU would only hold a
    // second copy of the reference (a `rollout.device` of its own is kept).
    let mut generator = match cfg.rollout.device.is_none_or(|d| d == cfg.model.device) {
        true => generator.on_model_device(),
        false => generator,
    };
    let mut scorer = Scorer::new(setup).without_logs().with_num_generations(n);
    let sc = StreamConfig {
        seed: cfg.train.seed,
        shuffle: false,
        batch_size: cfg.train.prompts_per_step,
        epochs: Some(1),
        ..Default::default()
    };
    let mut stream =
        SampleStream::new(setup.train.clone(), sc).map_err(|e| anyhow!("training data: {e}"))?;
    let (mut values, mut all_incorrect) = (HashMap::new(), HashSet::new());
    let mut k = 0;
    while let Some(samples) = stream
        .next_batch()
        .map_err(|e| anyhow!("training data: {e}"))?
    {
        let indices: Vec<u64> = samples.iter().map(|s| s.index).collect();
        let batch = PromptBatch {
            step: STAGE_ONE_STEP + k,
            draw: STAGE_ONE_STEP + k,
            samples,
            position: stream.position(),
        };
        k += 1;
        let s = scorer.process(generator.process(batch)?)?;
        for (i, index) in indices.into_iter().enumerate() {
            let r = &s.scores.rewards[i * n..(i + 1) * n];
            values.insert(index, optimal_value(r, a.beta1));
            if r.iter().all(|x| x.is_nan() || *x == 0.0) {
                all_incorrect.insert(index);
            }
        }
    }
    if a.filter_all_incorrect && !all_incorrect.is_empty() {
        if all_incorrect.len() as u64 >= setup.train.len() {
            bail!(
                "A*-PO: the reference's {n} samples of every training prompt scored 0, so no \
                 prompt is left to learn from (set `a2po.filter_all_incorrect = false`, or raise \
                 `a2po.num_value_samples`)"
            );
        }
        setup.train = setup.train.without_rows(&all_incorrect);
        setup.total_steps = crate::setup::total_steps(&setup.cfg, setup.train.len());
    }
    setup.a2po_values = Some(Arc::new(values));
    Ok(())
}

impl Learner {
    /// One A*-PO step over the scored completions `s` (see the module): for each of
    /// `num_iterations` passes, the micro-batches' regression losses and gradients, one
    /// optimizer update per `steps_per_generation` share; TRL's metrics (`reward`, `v_star`,
    /// `implicit_reward`, `advantage`) and the step's completion and reward metrics.
    pub(crate) fn a2po_step(&mut self, s: &Scored, t0: Instant) -> Result<Metrics> {
        let r = &s.rollouts;
        let (batch, reference) = self.single_turn_batch(s, "A*-PO")?;
        let values = self
            .a2po_values
            .clone()
            .context("A*-PO's optimal values were not estimated (stage 1)")?;
        let n = batch.completions.len();
        let rewards = rewards_or_zero(&s.scores.rewards, n);
        let v_star: Vec<f64> = r
            .completions
            .iter()
            .map(|c| {
                let row = r.batch.samples[c.prompt_index].index;
                values
                    .get(&row)
                    .copied()
                    .with_context(|| format!("row {row}: no optimal value estimated"))
            })
            .collect::<Result<_>>()?;
        let beta2 = self.cfg.a2po.beta2;
        let pad = self.tokenizer.pad_token_id;
        let mut implicit_sum = 0.0;
        let (loss, grad_norm, lr) = self.chunked_updates(&batch.chunks, r.batch.step, |l, c| {
            let (a, b) = c.range;
            let update: usize = c.update.iter().map(|(a, b)| b - a).sum();
            // TRL's `_get_sequence_logps`: the raw logits, summed over the completion.
            let (pol, refs) =
                summed_policy_and_reference(&l.policy.model, &reference, pad, &batch, (a, b))?;
            let implicit = ((pol - refs)? * beta2)?;
            let target: Vec<f64> = (a..b).map(|i| rewards[i] - v_star[i]).collect();
            let target =
                Tensor::from_vec(target, b - a, implicit.device())?.to_dtype(implicit.dtype())?;
            if c.iteration == 0 {
                implicit_sum += implicit
                    .detach()
                    .to_dtype(DType::F64)?
                    .sum_all()?
                    .to_scalar::<f64>()?;
            }
            // The mean over the update's completions of the squared regression error.
            let loss = ((&implicit - target)?.sqr()?.sum_all()? / update.max(1) as f64)?;
            Ok(loss)
        })?;
        self.state.step = r.batch.step + 1;
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
        let mut m = Metrics::new();
        m.insert("loss".into(), loss);
        m.insert("v_star".into(), mean(&v_star));
        m.insert("implicit_reward".into(), implicit_sum / n.max(1) as f64);
        let adv: Vec<f64> = rewards.iter().zip(&v_star).map(|(r, v)| r - v).collect();
        m.insert("advantage".into(), mean(&adv));
        self.end_step(
            s,
            &batch,
            &OffPolicyStats::default(),
            (grad_norm, lr),
            t0,
            &mut m,
        );
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::optimal_value;

    #[test]
    fn optimal_value_is_trls_soft_maximum() {
        // All equal: V* is that reward. All zero: 0.
        assert!((optimal_value(&[1.0; 4], 0.5) - 1.0).abs() < 1e-12);
        assert_eq!(optimal_value(&[0.0; 8], 0.5), 0.0);
        // β1 · log((e^(1/β1) + 3) / 4), and NaN as 0.
        let want = 0.5 * (((2.0f64).exp() + 3.0) / 4.0).ln();
        assert!((optimal_value(&[1.0, 0.0, f32::NAN, 0.0], 0.5) - want).abs() < 1e-12);
        // Between the mean and the maximum.
        let v = optimal_value(&[1.0, 0.0, 0.0, 0.0], 0.1);
        assert!(v > 0.25 && v < 1.0, "{v}");
    }
}
