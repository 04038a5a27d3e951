//! Nash-MD's step (TRL's experimental `NashMDTrainer`, "Nash Learning from Human Feedback"):
//! each prompt's pair is a sample of the policy and one of the geometric mixture of policy and
//! reference (the generator's). Their rewards (any `[[rewards]]`; `missing_eos_penalty`
//! subtracted from a completion without EOS; an unscored one counts 0) give the probability
//! that the policy's sample is preferred, `p = σ(r_policy − r_mixture)`. On the policy's
//! sample `y`, with `ℓ_t = log π(y_t)` and `ρ_t = ℓ_t − log π_ref(y_t)` (no gradient through
//! `ρ`):
//!
//! ```text
//! loss = mean over pairs of  β · Σ_t ρ_t ℓ_t  −  (p − ½) · Σ_t ℓ_t
//! ```
//!
//! a REINFORCE step on the preference (½ its control variate) with the KL to the reference as
//! REINFORCE's penalty. The mixture's samples are scored, not trained on.

use std::time::Instant;

use anyhow::Result;
use candle_core::{D, DType, Tensor};

use super::Learner;
use super::batch::{StepBatch, policy_and_reference_logps};
use super::metrics::OffPolicyStats;
use super::online_dpo::{PairPart, contains_eos, pair_rewards, pair_sides};
use crate::callbacks::Metrics;
use crate::stages::Scored;

impl Learner {
    /// One Nash-MD step over the scored pairs `s`: for each of `num_iterations` passes, the
    /// micro-batches' losses and gradients, one optimizer update per `steps_per_generation`
    /// share; TRL's metrics (`loss/score`, `loss/kl`, `rewards/*`, `logps/*`,
    /// `objective/entropy`, `val/*`, `beta`, `mixture_coef`) and the step's completion and
    /// reward metrics.
    pub(crate) fn nash_md_step(&mut self, s: &Scored, t0: Instant) -> Result<Metrics> {
        let r = &s.rollouts;
        let (batch, reference) = self.single_turn_batch(s, "Nash-MD")?;
        let eos = &self.tokenizer.eos_token_ids;
        let o = &self.cfg.online_dpo;
        let epoch = r.batch.epoch();
        let beta = o.beta.at(epoch);
        let has_eos = contains_eos(&batch, eos);
        let (rewards, _) = pair_rewards(&s.scores.rewards, &has_eos, o.missing_eos_penalty);
        let probability: Vec<f64> = (0..rewards.len() / 2)
            .map(|k| 1.0 / (1.0 + (rewards[2 * k + 1] - rewards[2 * k]).exp()))
            .collect();
        let (mut m, _, grad_lr) = self.pair_updates(&batch, r.batch.step, |l, (a, b)| {
            l.nash_md_part(&reference, &batch, (a, b), &probability[a / 2..b / 2], beta)
        })?;
        // TRL's names: the policy's sample's reward is "chosen", the mixture's "rejected".
        let (chosen, rejected) = pair_sides(&mut m, &rewards, &has_eos);
        m.insert("rewards/chosen".into(), chosen);
        m.insert("rewards/rejected".into(), rejected);
        let k = probability.len().max(1) as f64;
        m.insert(
            "rewards/probabilities".into(),
            probability.iter().sum::<f64>() / k,
        );
        m.insert("beta".into(), beta);
        m.insert(
            "mixture_coef".into(),
            self.cfg.nash_md.mixture_coef.at(epoch),
        );
        self.end_step(s, &batch, &OffPolicyStats::default(), grad_lr, t0, &mut m);
        Ok(m)
    }

    /// Nash-MD's loss (with the policy's graph) on the policy's samples of the pairs in
    /// micro-batch `[a, b)` (`probability`: each pair's `p`) and their metrics, means over the
    /// pairs.
    fn nash_md_part(
        &self,
        reference: &grpo_rollout::Transformer,
        batch: &StepBatch<'_>,
        (a, b): (usize, usize),
        probability: &[f64],
        beta: f64,
    ) -> Result<PairPart> {
        let pad = self.tokenizer.pad_token_id;
        // The pairs' first completions: the policy's samples.
        let prompts: Vec<&[u32]> = batch.prompts[a..b].iter().step_by(2).copied().collect();
        let completions: Vec<&[u32]> = batch.completions[a..b].iter().step_by(2).copied().collect();
        // TRL scores the raw logits (no sampling temperature).
        let (lp, rlp) =
            policy_and_reference_logps(&self.policy.model, reference, pad, &prompts, &completions)?;
        let (k, dt, dev) = (completions.len(), lp.dtype(), lp.device().clone());
        let ratio = (&lp - &rlp)?.detach();
        let kl_loss = (&ratio * &lp)?.sum(D::Minus1)?;
        let summed = lp.sum(D::Minus1)?;
        let centred: Vec<f32> = probability.iter().map(|p| (p - 0.5) as f32).collect();
        let centred = Tensor::from_vec(centred, k, &dev)?.to_dtype(dt)?;
        let score = (&centred * &summed)?;
        let loss = ((kl_loss * beta)? - &score)?.mean(0)?;
        let wide = |t: &Tensor| -> Result<Vec<f64>> {
            Ok(t.detach().to_dtype(DType::F64)?.to_vec1::<f64>()?)
        };
        let (pol, refv, score) = (wide(&summed)?, wide(&rlp.sum(D::Minus1)?)?, wide(&score)?);
        let mean = |f: &dyn Fn(usize) -> f64| (0..k).map(f).sum::<f64>() / k.max(1) as f64;
        let metrics = vec![
            ("loss/score", mean(&|i| score[i])),
            ("loss/kl", mean(&|i| pol[i] - refv[i])),
            ("logps/chosen", mean(&|i| pol[i])),
            ("logps/rejected", mean(&|i| refv[i])),
            ("rewards/margins", mean(&|i| pol[i] - refv[i])),
            (
                "rewards/accuracies",
                mean(&|i| f64::from(u8::from(pol[i] > refv[i]))),
            ),
            ("objective/entropy", mean(&|i| -pol[i])),
        ];
        Ok(PairPart {
            loss,
            dpo: metrics,
            kl: Vec::new(),
            entropy: 0.0,
        })
    }
}
