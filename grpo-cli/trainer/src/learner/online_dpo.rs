//! Online DPO's step (TRL's experimental `OnlineDPOTrainer`): the policy sampled two
//! completions per prompt; their rewards (any `[[rewards]]`: functions, a reward model, LLM
//! judges; TRL's `missing_eos_penalty` subtracted from a completion without EOS; an unscored
//! reward counts 0, as TRL's `nansum`) pick the chosen one — the first on a tie — and DPO's
//! sigmoid or IPO loss on the completions' summed log-probs, against the frozen reference,
//! trains on the pair. The loss is the mean over the pairs of an optimizer update.
//!
//! XPO (TRL's experimental `XPOTrainer`) is the same step on pairs of one policy sample and
//! one reference sample, with `α · Σ log π(y_ref)` added to each pair's loss.

use std::time::Instant;

use anyhow::Result;
use candle_core::{DType, Tensor};
use grpo_core::preference::{DpoConfig, DpoInputs, DpoLossType, dpo_loss_with};

use super::Learner;
use super::batch::{StepBatch, rewards_or_zero, summed_policy_and_reference};
use super::metrics::OffPolicyStats;
use crate::callbacks::Metrics;
use crate::config::{Algorithm, OnlineDpoLoss};
use crate::stages::Scored;

impl Learner {
    /// One online DPO (or XPO) step over the scored pairs `s`: for each of `num_iterations`
    /// passes, the micro-batches' losses and gradients, one optimizer update per
    /// `steps_per_generation` share; TRL's metrics (`rewards/*`, `logps/*`, `objective/*`,
    /// `val/*`, `beta`; XPO's `loss/dpo`, `loss/xpo`, `alpha`) and the step's completion and
    /// reward metrics.
    pub(crate) fn online_dpo_step(&mut self, s: &Scored, t0: Instant) -> Result<Metrics> {
        let r = &s.rollouts;
        let (batch, reference) = self.single_turn_batch(s, "online DPO")?;
        let eos = &self.tokenizer.eos_token_ids;
        let o = &self.cfg.online_dpo;
        // TRL picks β by the epoch the batch was drawn from.
        let beta = o.beta.at(r.batch.epoch());
        let alpha =
            (self.cfg.algorithm == Algorithm::Xpo).then(|| self.cfg.xpo.alpha.at(r.batch.epoch()));
        let n = batch.completions.len();
        let has_eos = contains_eos(&batch, eos);
        let (rewards, chosen_first) =
            pair_rewards(&s.scores.rewards, &has_eos, o.missing_eos_penalty);
        let cfg = DpoConfig {
            loss_type: vec![match o.loss_type {
                OnlineDpoLoss::Sigmoid => DpoLossType::Sigmoid,
                OnlineDpoLoss::Ipo => DpoLossType::Ipo,
            }],
            beta,
            ..DpoConfig::default()
        };
        let (mut m, sums, grad_lr) = self.pair_updates(&batch, r.batch.step, |l, (a, b)| {
            let chosen_first = &chosen_first[a / 2..b / 2];
            l.pair_part(&reference, &batch, (a, b), chosen_first, &cfg, alpha)
        })?;
        // Per completion, over the whole batch, from the first pass (before any update of
        // this step, as TRL's values with one pass).
        let kl_per = &sums.kl_per_completion;
        let kl = kl_per.iter().sum::<f64>() / n.max(1) as f64;
        m.insert("objective/kl".into(), kl);
        m.insert("objective/entropy".into(), sums.entropy / n.max(1) as f64);
        if let Some(alpha) = alpha {
            // XPO's: the policy's and the reference's samples apart.
            let (model, other) = pair_sides(&mut m, &rewards, &has_eos);
            m.insert("objective/model_scores".into(), model);
            m.insert("objective/ref_scores".into(), other);
            m.insert("objective/scores_margin".into(), model - other);
            m.insert("alpha".into(), alpha);
        } else {
            m.insert("objective/non_score_reward".into(), -beta * kl);
            let rlhf: f64 = rewards
                .iter()
                .zip(kl_per)
                .map(|(r, k)| r - beta * k)
                .sum::<f64>()
                / n.max(1) as f64;
            m.insert("objective/rlhf_reward".into(), rlhf);
            m.insert(
                "objective/scores".into(),
                rewards.iter().sum::<f64>() / n.max(1) as f64,
            );
            let margin: f64 = chosen_first
                .iter()
                .enumerate()
                .map(|(k, &f)| {
                    let (c, r) = (rewards[2 * k], rewards[2 * k + 1]);
                    if f { c - r } else { r - c }
                })
                .sum::<f64>()
                / chosen_first.len().max(1) as f64;
            m.insert("objective/scores_margin".into(), margin);
            m.insert(
                "val/contain_eos_token".into(),
                has_eos.iter().filter(|&&e| e).count() as f64 / n.max(1) as f64,
            );
        }
        m.insert("beta".into(), beta);
        self.end_step(s, &batch, &OffPolicyStats::default(), grad_lr, t0, &mut m);
        Ok(m)
    }

    /// The updates of a pair step (online DPO, XPO, Nash-MD): each micro-batch's loss from
    /// `part` (of its completions `[a, b)`, whole pairs) weighted by its share of its update's
    /// pairs. Returns the metrics `loss` and the share-weighted means of the parts' metrics,
    /// the parts' sums, and the last update's gradient norm and learning rate.
    pub(super) fn pair_updates(
        &mut self,
        batch: &StepBatch<'_>,
        step: usize,
        mut part: impl FnMut(&Self, (usize, usize)) -> Result<PairPart>,
    ) -> Result<(Metrics, PairSums, (f64, f64))> {
        let mut sums = PairSums::default();
        let (loss, grad_norm, lr) = self.chunked_updates(&batch.chunks, step, |l, c| {
            let (a, b) = c.range;
            let pairs: usize = c.update.iter().map(|(a, b)| (b - a) / 2).sum();
            let share = ((b - a) / 2) as f64 / pairs.max(1) as f64;
            let p = part(l, (a, b))?;
            sums.add(&p, share, c.iteration == 0);
            Ok((&p.loss * share)?)
        })?;
        self.state.step = step + 1;
        let mut m = Metrics::new();
        m.insert("loss".into(), loss);
        let w = sums.weight.max(1e-12);
        for (k, v) in &sums.dpo {
            m.insert((*k).into(), v / w);
        }
        Ok((m, sums, (grad_norm, lr)))
    }

    /// The DPO loss (with the policy's graph) of the pairs in micro-batch `[a, b)` and their
    /// metrics; with XPO's `alpha`, plus `α` times the policy's mean summed log-prob of the
    /// pairs' second (the reference's) samples.
    fn pair_part(
        &self,
        reference: &grpo_rollout::Transformer,
        batch: &StepBatch<'_>,
        (a, b): (usize, usize),
        chosen_first: &[bool],
        cfg: &DpoConfig,
        alpha: Option<f64>,
    ) -> Result<PairPart> {
        // TRL's `_forward` scores the raw logits (no sampling temperature).
        let pad = self.tokenizer.pad_token_id;
        let (sums, ref_sums) =
            summed_policy_and_reference(&self.policy.model, reference, pad, batch, (a, b))?;
        let (dt, dev) = (sums.dtype(), sums.device().clone());
        let k = chosen_first.len();
        let idx = |chosen: bool| -> Result<Tensor> {
            let v: Vec<u32> = (0..k)
                .map(|i| (2 * i + usize::from(chosen_first[i] != chosen)) as u32)
                .collect();
            Ok(Tensor::from_vec(v, k, &dev)?)
        };
        let (ci, ri) = (idx(true)?, idx(false)?);
        let ones = Tensor::ones(k, dt, &dev)?;
        let out = dpo_loss_with(
            &DpoInputs {
                policy_chosen: &sums.index_select(&ci, 0)?,
                policy_rejected: &sums.index_select(&ri, 0)?,
                reference_chosen: &ref_sums.index_select(&ci, 0)?,
                reference_rejected: &ref_sums.index_select(&ri, 0)?,
                // Online DPO's IPO takes the summed log-probs: one "token" per completion.
                chosen_tokens: Some(&ones),
                rejected_tokens: Some(&ones),
                pair_weights: None,
            },
            cfg,
        )?;
        let wide = |t: &Tensor| -> Result<Vec<f64>> {
            Ok(t.detach().to_dtype(DType::F64)?.to_vec1::<f64>()?)
        };
        let (pol, refv) = (wide(&sums)?, wide(&ref_sums)?);
        let mut dpo = out.metrics();
        let mut loss = out.loss;
        if let Some(alpha) = alpha {
            let odd: Vec<u32> = (0..k).map(|i| (2 * i + 1) as u32).collect();
            let odd = Tensor::from_vec(odd, k, &dev)?;
            let xpo = (sums.index_select(&odd, 0)?.mean(0)? * alpha)?;
            let scalar = |t: &Tensor| -> Result<f64> { Ok(wide(&t.reshape(1)?)?[0]) };
            dpo.push(("loss/dpo", scalar(&loss)?));
            dpo.push(("loss/xpo", scalar(&xpo)?));
            // TRL's XPO logs the policy's plus the reference's mean summed log-probs.
            let mean = |v: &[f64], side: bool| {
                (0..k)
                    .map(|i| v[2 * i + usize::from(chosen_first[i] != side)])
                    .sum::<f64>()
                    / k.max(1) as f64
            };
            for (name, v) in dpo.iter_mut() {
                match *name {
                    "logps/chosen" => *v = mean(&pol, true) + mean(&refv, true),
                    "logps/rejected" => *v = mean(&pol, false) + mean(&refv, false),
                    _ => {}
                }
            }
            loss = (loss + xpo)?;
        }
        Ok(PairPart {
            dpo,
            loss,
            kl: pol.iter().zip(&refv).map(|(p, r)| p - r).collect(),
            entropy: -pol.iter().sum::<f64>(),
        })
    }
}

/// Whether each of the batch's completions holds one of the `eos` tokens.
pub(super) fn contains_eos(batch: &StepBatch<'_>, eos: &[u32]) -> Vec<bool> {
    batch
        .completions
        .iter()
        .map(|c| c.iter().any(|t| eos.contains(t)))
        .collect()
}

/// XPO's and Nash-MD's pairs (each a policy sample, then the other model's): the mean reward
/// of each side, with the shares of each side's completions holding an EOS token inserted
/// (`val/model_contain_eos_token`, `val/ref_contain_eos_token`).
pub(super) fn pair_sides(m: &mut Metrics, rewards: &[f64], has_eos: &[bool]) -> (f64, f64) {
    let k = rewards.len() / 2;
    let mean = |f: &dyn Fn(usize) -> f64| (0..k).map(f).sum::<f64>() / k.max(1) as f64;
    let eos = |side: usize| mean(&|i| f64::from(u8::from(has_eos[2 * i + side])));
    m.insert("val/model_contain_eos_token".into(), eos(0));
    m.insert("val/ref_contain_eos_token".into(), eos(1));
    (mean(&|i| rewards[2 * i]), mean(&|i| rewards[2 * i + 1]))
}

/// TRL's online DPO ranking: each completion's reward (an unscored one counts 0, as TRL's
/// `nansum`; `missing_eos_penalty` subtracted when it has no EOS), and for each pair of
/// neighbours `(2k, 2k + 1)` whether the first is chosen (`r_2k >= r_2k+1`: a tie keeps the
/// first).
pub(super) fn pair_rewards(
    rewards: &[f32],
    has_eos: &[bool],
    missing_eos_penalty: Option<f64>,
) -> (Vec<f64>, Vec<bool>) {
    let r: Vec<f64> = rewards_or_zero(rewards, has_eos.len())
        .into_iter()
        .zip(has_eos)
        .map(|(v, &eos)| match (missing_eos_penalty, eos) {
            (Some(pen), false) => v - pen,
            _ => v,
        })
        .collect();
    let first = (0..r.len() / 2).map(|k| r[2 * k] >= r[2 * k + 1]).collect();
    (r, first)
}

#[cfg(test)]
mod tests {
    use super::pair_rewards;

    #[test]
    fn pairs_rank_by_reward_with_ties_nan_and_the_eos_penalty() {
        let nan = f32::NAN;
        let (r, first) = pair_rewards(&[0.5, 1.0, 2.0, 2.0, nan, -0.5, 1.0, 0.8], &[true; 8], None);
        assert_eq!(
            r,
            vec![0.5, 1.0, 2.0, 2.0, 0.0, -0.5, 1.0, 0.800000011920929]
        );
        assert_eq!(first, vec![false, true, true, true]);
        // Without EOS the first completion loses 1.0 and its pair flips.
        let (r, first) = pair_rewards(&[1.0, 0.5], &[false, true], Some(1.0));
        assert_eq!((r, first), (vec![0.0, 0.5], vec![false]));
        // Missing scores (a shorter list) count 0.
        let (r, _) = pair_rewards(&[], &[true, true], None);
        assert_eq!(r, vec![0.0, 0.0]);
    }
}

/// One micro-batch's share of an online DPO step.
pub(super) struct PairPart {
    pub(super) loss: Tensor,
    /// DPO's metrics by TRL's names (Nash-MD: its own), means over the micro-batch's pairs.
    pub(super) dpo: Vec<(&'static str, f64)>,
    /// Per completion: Σ (log π − log π_ref).
    pub(super) kl: Vec<f64>,
    /// −Σ log π over the micro-batch's completions.
    pub(super) entropy: f64,
}

/// A step's pair metrics, weighted by each micro-batch's share of its update's pairs.
#[derive(Default)]
pub(super) struct PairSums {
    pub(super) weight: f64,
    /// DPO's metrics, share-weighted sums.
    pub(super) dpo: Vec<(&'static str, f64)>,
    /// The first pass's −Σ log π over the batch's completions.
    entropy: f64,
    /// The first pass's Σ (log π − log π_ref) of each completion, in the batch's order.
    kl_per_completion: Vec<f64>,
}

impl PairSums {
    pub(super) fn add(&mut self, p: &PairPart, share: f64, first_pass: bool) {
        self.weight += share;
        if self.dpo.is_empty() {
            self.dpo = p.dpo.iter().map(|&(k, _)| (k, 0.0)).collect();
        }
        for ((_, sum), (_, v)) in self.dpo.iter_mut().zip(&p.dpo) {
            *sum += v * share;
        }
        if first_pass {
            self.entropy += p.entropy;
            self.kl_per_completion.extend_from_slice(&p.kl);
        }
    }
}
