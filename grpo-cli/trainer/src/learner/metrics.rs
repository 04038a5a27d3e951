//! A GRPO step's metrics, by TRL's names: rewards (per function and combined), completion
//! lengths, tokens, staleness, the off-policy ratios, timings; and the process's peak memory.

use std::collections::BTreeMap;

use anyhow::Result;
use candle_core::{DType, Tensor};
use grpo_core::advantages::{MultiObjectiveAggregation, nanstd, normalize_then_sum_rewards};
use grpo_rollout::FinishReason;

use super::Learner;
use super::batch::StepBatch;
use crate::callbacks::Metrics;
use crate::stages::Scored;

/// Sums of per-micro-batch metrics, reported as means (the loss as a per-pass sum).
#[derive(Debug, Default)]
pub(crate) struct MeanOf(BTreeMap<&'static str, (f64, f64)>);

impl MeanOf {
    pub(crate) fn add(&mut self, k: &'static str, v: f64) {
        let e = self.0.entry(k).or_insert((0.0, 0.0));
        e.0 += v;
        e.1 += 1.0;
    }

    pub(crate) fn into_metrics(self, num_iterations: usize) -> Metrics {
        let mut m = Metrics::new();
        for (k, (sum, cnt)) in self.0 {
            let v = if k == "loss" {
                sum / num_iterations as f64
            } else {
                sum / cnt.max(1.0)
            };
            m.insert(k.to_string(), v);
        }
        m
    }
}

/// The importance ratios of the off-policy correction and the gap between the learner's and
/// the sampler's log-probs, over a step's micro-batches.
#[derive(Debug, Default)]
pub(crate) struct OffPolicyStats {
    /// (min, mean, max) of each micro-batch's weights.
    ratios: Vec<(f64, f64, f64)>,
    /// |old − sampled| over loss tokens: (sum, count, max).
    diff: (f64, f64, f64),
}

/// What one micro-batch's off-policy metrics read: its importance weights, old and sampling
/// log-probs, and loss mask.
pub(crate) struct OffPolicyParts {
    pub(crate) weights: Tensor,
    pub(crate) old: Tensor,
    pub(crate) sampled: Tensor,
    pub(crate) mask: Tensor,
}

impl OffPolicyStats {
    /// Adds one micro-batch (reads it from the device).
    pub(crate) fn add(&mut self, p: &OffPolicyParts) -> Result<()> {
        let mask = &p.mask;
        self.ratios
            .push(grpo_core::loss::importance_weight_stats(&p.weights, mask)?);
        let d: Vec<Vec<f64>> = (&p.old - &p.sampled)?
            .abs()?
            .to_dtype(DType::F64)?
            .to_vec2()?;
        let m: Vec<Vec<f32>> = mask.to_vec2()?;
        for (dr, mr) in d.iter().zip(&m) {
            for (dv, mv) in dr.iter().zip(mr) {
                if *mv > 0.5 && dv.is_finite() {
                    self.diff.0 += dv;
                    self.diff.1 += 1.0;
                    self.diff.2 = self.diff.2.max(*dv);
                }
            }
        }
        Ok(())
    }

    fn insert_into(&self, m: &mut Metrics) {
        if self.ratios.is_empty() {
            return;
        }
        let k = self.ratios.len() as f64;
        let min = self
            .ratios
            .iter()
            .map(|s| s.0)
            .fold(f64::INFINITY, f64::min);
        let mean = self.ratios.iter().map(|s| s.1).sum::<f64>() / k;
        let max = self
            .ratios
            .iter()
            .map(|s| s.2)
            .fold(f64::NEG_INFINITY, f64::max);
        m.insert("sampling/importance_sampling_ratio/min".into(), min);
        m.insert("sampling/importance_sampling_ratio/mean".into(), mean);
        m.insert("sampling/importance_sampling_ratio/max".into(), max);
        m.insert(
            "sampling/sampling_logp_difference/mean".into(),
            self.diff.0 / self.diff.1.max(1.0),
        );
        m.insert("sampling/sampling_logp_difference/max".into(), self.diff.2);
    }
}

impl Learner {
    /// The end of a step: the last update's gradient norm and learning rate, the step's
    /// completion and reward metrics ([`Self::step_metrics`]), its learner time since `t0`; the
    /// data position moves past the step's batch.
    pub(crate) fn end_step(
        &mut self,
        s: &Scored,
        batch: &StepBatch<'_>,
        off_policy: &OffPolicyStats,
        (grad_norm, lr): (f64, f64),
        t0: std::time::Instant,
        m: &mut Metrics,
    ) {
        m.insert("grad_norm".into(), grad_norm);
        m.insert("learning_rate".into(), lr);
        self.step_metrics(s, batch, off_policy, m);
        m.insert("timing/train_s".into(), t0.elapsed().as_secs_f64());
        self.state.position = Some(s.rollouts.batch.position);
        if self.cfg.loss.filter_groups.enable {
            self.state.draws = Some(s.rollouts.batch.draw + 1);
        }
        self.updating = false;
    }

    /// Adds the step's reward, completion, token, staleness, off-policy and timing metrics.
    pub(crate) fn step_metrics(
        &mut self,
        s: &Scored,
        batch: &StepBatch<'_>,
        off_policy: &OffPolicyStats,
        m: &mut Metrics,
    ) {
        let r = &s.rollouts;
        let sc = &s.scores;
        // An environment's `env` reward comes last, weight 1.
        let env = usize::from(r.episodes.is_some());
        let weights = match self.reward_weights.len() + env == sc.per_function.len() {
            true => {
                let mut w = self.reward_weights.clone();
                w.resize(sc.per_function.len(), 1.0);
                w
            }
            false => vec![1.0; sc.per_function.len()],
        };
        let stats = grpo_core::advantages::reward_stats(
            &sc.per_function,
            &weights,
            self.cfg.rollout.num_generations,
            self.cfg.loss.scale_rewards,
        );
        m.insert("reward".into(), stats.reward);
        m.insert("reward_std".into(), stats.reward_std);
        let frac_zero_std = match self.cfg.loss.multi_objective_aggregation {
            // GDPO scales by the batch's std of the normalised sum: every completion or none.
            MultiObjectiveAggregation::NormalizeThenSum => {
                let r = normalize_then_sum_rewards(
                    &sc.per_function,
                    &weights,
                    self.cfg.rollout.num_generations,
                );
                let std = if r.len() > 1 { nanstd(&r) } else { 0.0 };
                f64::from(u8::from(std.abs() <= 1e-8))
            }
            MultiObjectiveAggregation::SumThenNormalize => stats.frac_reward_zero_std,
        };
        m.insert("frac_reward_zero_std".into(), frac_zero_std);
        for (k, v) in &sc.metrics {
            m.insert(k.clone(), *v);
        }
        if let Some(e) = &r.episodes {
            for (k, v) in &e.metrics {
                m.insert(k.clone(), *v);
            }
        }
        // Lengths count the model's tokens (an episode's environment tokens are not its).
        let lf: Vec<f64> = batch.model_lens.iter().map(|&l| l as f64).collect();
        let truncated: Vec<bool> = r
            .completions
            .iter()
            .map(|c| c.finish_reason == FinishReason::Length)
            .collect();
        m.insert("completions/mean_length".into(), mean(&lf));
        m.insert(
            "completions/min_length".into(),
            lf.iter().copied().fold(f64::INFINITY, f64::min),
        );
        m.insert(
            "completions/max_length".into(),
            lf.iter().copied().fold(0.0, f64::max),
        );
        m.insert(
            "completions/clipped_ratio".into(),
            truncated.iter().filter(|&&t| t).count() as f64 / lf.len().max(1) as f64,
        );
        let term: Vec<f64> = lf
            .iter()
            .zip(&truncated)
            .filter(|(_, t)| !**t)
            .map(|(l, _)| *l)
            .collect();
        // TRL: with no terminated completion, the three are 0.
        let term = if term.is_empty() { vec![0.0] } else { term };
        m.insert("completions/mean_terminated_length".into(), mean(&term));
        m.insert(
            "completions/min_terminated_length".into(),
            term.iter().copied().fold(f64::INFINITY, f64::min),
        );
        m.insert(
            "completions/max_terminated_length".into(),
            term.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        );
        let prompt_tokens: usize = batch.prompts.iter().map(|p| p.len()).sum();
        self.state.num_tokens += (prompt_tokens + batch.lens.iter().sum::<usize>()) as u64;
        m.insert("num_tokens".into(), self.state.num_tokens as f64);
        m.insert("step".into(), self.state.step as f64);
        m.insert("policy_version".into(), r.version as f64);
        if self.cfg.pipeline.max_staleness > 0 {
            // One policy version per batch: the mean and the max over its samples are equal.
            let staleness = r.batch.step.saturating_sub(r.version) as f64;
            m.insert("staleness/mean".into(), staleness);
            m.insert("staleness/max".into(), staleness);
        }
        off_policy.insert_into(m);
        m.insert("timing/generate_s".into(), r.seconds);
        m.insert("timing/score_s".into(), s.seconds);
        m.insert(
            "scoring/batches_in_flight".into(),
            s.batches_in_flight as f64,
        );
    }
}

/// The mean (NaN when empty).
pub(crate) fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        f64::NAN
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// Peak resident memory of this process in MiB (Linux; NaN elsewhere).
pub fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| {
                l.split_whitespace()
                    .nth(1)
                    .and_then(|k| k.parse::<f64>().ok())
            })
        })
        .map_or(f64::NAN, |kb| kb / 1024.0)
}
