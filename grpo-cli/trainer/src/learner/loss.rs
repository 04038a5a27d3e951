//! The GRPO step: log-probs of the old policy and the reference (no graph), TRL's off-policy
//! importance weights, then for each of `num_iterations` passes the policy loss and its
//! gradients over the micro-batches, and an optimizer update.

use std::collections::HashMap;
use std::time::Instant;

use anyhow::{Result, bail};
use candle_core::{DType, Tensor};
use grpo_core::loss::{LossInputs, LossMetrics, LossType, policy_loss_on_device, rloo_loss};
use grpo_rollout::Transformer;

use super::Learner;
use super::batch::{StepBatch, completion_logps};
use super::metrics::{MeanOf, OffPolicyParts, OffPolicyStats};
use crate::callbacks::Metrics;
use crate::config::Algorithm;
use crate::stages::Scored;

/// Per completion, one value per loss token.
type Rows = Vec<Vec<f64>>;

impl Learner {
    pub(crate) fn logps(
        &self,
        model: &Transformer,
        prompts: &[&[u32]],
        completions: &[&[u32]],
        with_entropy: bool,
    ) -> Result<(Tensor, Option<Tensor>, usize)> {
        completion_logps(
            model,
            self.tokenizer.pad_token_id,
            prompts,
            completions,
            self.cfg.rollout.temperature,
            with_entropy,
        )
    }

    /// One step: old and reference log-probs, `num_iterations` optimizer updates over the
    /// micro-batches, metrics. Returns the step's metrics.
    pub fn process(&mut self, s: &Scored) -> Result<Metrics> {
        let t0 = Instant::now();
        if self.cfg.algorithm.is_distillation() {
            return self.distill_step(s, t0);
        }
        if self.cfg.algorithm == Algorithm::NashMd {
            return self.nash_md_step(s, t0);
        }
        if self.cfg.algorithm.is_online_dpo() {
            return self.online_dpo_step(s, t0);
        }
        if self.cfg.algorithm == Algorithm::A2po {
            return self.a2po_step(s, t0);
        }
        if self.cfg.algorithm == Algorithm::Ppo {
            return self.ppo_step(s, t0);
        }
        if matches!(self.cfg.algorithm, Algorithm::Sdpo | Algorithm::Sdft) {
            return self.sdpo_step(s, t0);
        }
        if self.cfg.algorithm == Algorithm::Ssd {
            return self.ssd_step(s, t0);
        }
        // With replayed groups (`loss.replay_buffer_size`) the loss trains on the step with
        // them in place; the step's metrics describe it as generated (as TRL's).
        let fresh = s;
        if let Some(rep) = &fresh.replay {
            self.replay_buffer = Some(rep.buffer.clone());
        }
        let s = fresh.trained();
        let r = &s.rollouts;
        let eos = self.tokenizer.eos_token_ids.clone();
        let updates = self.cfg.updates_per_step();
        let batch = StepBatch::new(
            s,
            &eos,
            self.cfg.micro_batch(),
            self.cfg.loss.mask_truncated_completions,
        )
        .planned(updates, self.cfg.train.token_budget);
        // Off-policy samples: with `max_staleness` > 0 the generator may have sampled with an
        // older version than the learner's current one, and samples of another model (the
        // frozen teacher of `use_reference_teacher_model`, a rollout server) are off-policy
        // whatever the staleness. Then the old log-probs come from the current policy and
        // TRL's importance-sampling correction weighs each sample by its ratio to the sampling
        // log-probs recorded at generation.
        let correct = (self.cfg.pipeline.max_staleness > 0 || r.sampled_by_other_model)
            && self.cfg.loss.vllm_importance_sampling_correction;
        // With one update per step the old policy is the policy each micro-batch's own forward
        // runs (the update comes after the last one): its log-probs, detached, are the old
        // log-probs, and the importance weights are formed in that pass — no extra forward
        // (TRL runs one). Several updates need the old log-probs before the first.
        // TRL's `steps_per_generation`: the batch's micro-batches feed `updates` optimizer
        // steps in turn, so the policy moves within the batch too.
        // RLOO with a KL penalty needs the old and reference log-probs of the whole batch
        // before its advantages (the penalty is in the reward), as TRL computes them.
        let rloo = self.cfg.algorithm == Algorithm::Rloo;
        let rloo_kl = rloo && self.cfg.rloo.beta > 0.0 && self.reference.is_some();
        // verl's in-reward KL (and REINFORCE++'s discounted returns) are formed here, from the
        // old and reference log-probs of the whole batch; the scorer's advantages serve otherwise.
        let l = &self.cfg.loss;
        let kl_in_reward = !rloo && l.use_kl_in_reward && self.reference.is_some();
        let estimated_here = kl_in_reward
            || l.adv_estimator.optimal_token()
            || (l.adv_estimator == grpo_core::estimators::AdvEstimator::ReinforcePlusPlus
                && l.gamma != 1.0);
        let need_old = self.cfg.optim.num_iterations > 1 || updates > 1 || rloo_kl || kl_in_reward;
        let (old, refs) = self.frozen_logps(&batch, need_old)?;
        let (rloo_advantages, rloo_kl_mean) = match rloo {
            true => {
                let (a, kl) = self.rloo_advantages(s, &batch, &old, &refs)?;
                (Some(a), kl)
            }
            false => (None, None),
        };
        let mut estimator_metrics = Vec::new();
        let estimated = match estimated_here {
            true => Some(self.estimated_advantages(
                s,
                &batch,
                (&old, &refs),
                kl_in_reward,
                &mut estimator_metrics,
            )?),
            false => None,
        };
        let advantages = match &estimated {
            Some(Estimated::Seq(v)) => Adv::Seq(v),
            Some(Estimated::Token(rows)) => Adv::Token(rows),
            None => Adv::Seq(rloo_advantages.as_deref().unwrap_or(&s.advantages)),
        };
        let mut off_policy = OffPolicyStats::default();
        let weights = match (correct, need_old) {
            (false, _) => Weights::None,
            (true, false) => Weights::InPass,
            (true, true) => {
                let mut w = Vec::with_capacity(batch.chunks.len());
                for (ci, &(a, b)) in batch.chunks.iter().enumerate() {
                    w.push(match &old[ci] {
                        Some(old_lp) => {
                            let sampled = self.sampled_logps(s, a, b, old_lp)?;
                            let mask = batch.mask(a, b, old_lp.dim(1)?, &self.device)?;
                            let (w, parts) = self.importance_weights(old_lp, sampled, mask)?;
                            off_policy.add(&parts)?;
                            Some(w)
                        }
                        None => None,
                    });
                }
                Weights::Given(w)
            }
        };

        let mut sums = MeanOf::default();
        let (mut grad_norm, mut lr) = (0.0, 0.0);
        for _ in 0..self.cfg.optim.num_iterations {
            for u in 0..updates {
                let range = batch.updates[u].clone();
                let grads = self.loss_and_grads(
                    s,
                    &batch,
                    range,
                    updates,
                    (&old, &refs),
                    advantages,
                    &weights,
                    &mut sums,
                    &mut off_policy,
                )?;
                (grad_norm, lr) = self.optimizer_step(grads, r.batch.step)?;
            }
        }
        self.state.step = r.batch.step + 1;
        self.sync_reference()?;
        let mut m = sums.into_metrics(self.cfg.optim.num_iterations * updates);
        if self.reference.is_none() {
            m.insert("kl".into(), 0.0);
        }
        if let Some(kl) = rloo_kl_mean {
            m.insert("kl".into(), kl);
        }
        m.extend(estimator_metrics);
        let generated = (!std::ptr::eq(fresh, s)).then(|| {
            StepBatch::new(
                fresh,
                &eos,
                self.cfg.micro_batch(),
                self.cfg.loss.mask_truncated_completions,
            )
        });
        let metrics_batch = generated.as_ref().unwrap_or(&batch);
        self.end_step(
            fresh,
            metrics_batch,
            &off_policy,
            (grad_norm, lr),
            t0,
            &mut m,
        );
        Ok(m)
    }

    /// The optimal token baseline's inputs: each completion's old log-probs (the policy before
    /// this step's update, at the sampling temperature) and `Σπ²` of each of its tokens'
    /// distributions, at its loss-token `positions`, from one forward without gradient.
    fn old_logps_and_sum_sq(
        &self,
        batch: &StepBatch<'_>,
        positions: &[Vec<usize>],
    ) -> Result<(Rows, Rows)> {
        let (mut old, mut spsq) = (Vec::new(), Vec::new());
        let pad = self.tokenizer.pad_token_id;
        for &(a, b) in &batch.chunks {
            let (p, c) = (&batch.prompts[a..b], &batch.completions[a..b]);
            let (ids, mask, width) =
                super::batch::padded_batch(pad, p, c, self.policy.model.device())?;
            let (lp, log_sq) = self.policy.model.completion_logprobs_and_sum_sq(
                &ids,
                &mask,
                width,
                self.cfg.rollout.temperature,
            )?;
            let lp: Vec<Vec<f64>> = lp.to_dtype(DType::F64)?.to_vec2()?;
            let sq: Vec<Vec<f64>> = log_sq.to_dtype(DType::F64)?.to_vec2()?;
            for (k, i) in (a..b).enumerate() {
                old.push(positions[i].iter().map(|&j| lp[k][j]).collect());
                spsq.push(positions[i].iter().map(|&j| sq[k][j].exp()).collect());
            }
        }
        Ok((old, spsq))
    }

    /// verl's advantages of the step's completions, one per completion or (REINFORCE++,
    /// ReMax, the optimal token baselines) per token, 0 on an episode's environment tokens:
    /// the token-level rewards (each completion's score on its last loss token, and
    /// with `loss.use_kl_in_reward` `−β · KL(π_old ‖ π_ref)` on every loss token, β from the
    /// KL controller, which then moves), then `loss.adv_estimator`. Adds verl's
    /// `actor/reward_kl_penalty` and `actor/reward_kl_penalty_coeff` metrics.
    fn estimated_advantages(
        &mut self,
        s: &Scored,
        batch: &StepBatch<'_>,
        (old, refs): (&[Option<Tensor>], &[Option<Tensor>]),
        kl_in_reward: bool,
        metrics: &mut Vec<(String, f64)>,
    ) -> Result<Estimated> {
        use grpo_core::estimators::{
            AdvEstimator, EstimatorParams, apply_kl_penalty, estimate, remax_advantages, score_rows,
        };
        let l = &self.cfg.loss;
        // Each completion's loss-token positions (the model's tokens, dropped or not: the
        // advantages are formed over the whole batch, as the scorer's are).
        let positions: Vec<Vec<usize>> = (0..batch.lens.len())
            .map(|i| {
                (0..batch.lens[i])
                    .filter(|&j| {
                        batch.model_masks[i].is_none_or(|m| m.get(j).copied().unwrap_or(false))
                    })
                    .collect()
            })
            .collect();
        let rows = match kl_in_reward {
            false => {
                let lens: Vec<usize> = positions.iter().map(Vec::len).collect();
                score_rows(&s.scores.rewards, &lens)
            }
            true => {
                let mut kls: Vec<Vec<f64>> = Vec::with_capacity(positions.len());
                for (ci, &(a, b)) in batch.chunks.iter().enumerate() {
                    let (Some(o), Some(r)) = (&old[ci], &refs[ci]) else {
                        bail!("the in-reward KL needs the old and reference log-probs");
                    };
                    let o: Vec<Vec<f32>> = o.to_dtype(DType::F32)?.to_vec2()?;
                    let r: Vec<Vec<f32>> = r.to_dtype(DType::F32)?.to_vec2()?;
                    for (k, i) in (a..b).enumerate() {
                        kls.push(
                            positions[i]
                                .iter()
                                .map(|&j| l.kl_penalty.at(f64::from(o[k][j]), f64::from(r[k][j])))
                                .collect(),
                        );
                    }
                }
                let mut ctrl = l.kl_ctrl.controller();
                if let Some(v) = self.state.kl_ctrl_value {
                    ctrl.value = v;
                }
                let (rows, current) = apply_kl_penalty(&s.scores.rewards, &kls, ctrl.value);
                metrics.push(("actor/reward_kl_penalty".into(), current));
                metrics.push(("actor/reward_kl_penalty_coeff".into(), ctrl.value));
                ctrl.update(current, kls.len());
                if ctrl.adaptive.is_some() {
                    self.state.kl_ctrl_value = Some(ctrl.value);
                }
                rows
            }
        };
        let params = EstimatorParams {
            gamma: l.gamma,
            scale_rewards: l.scale_rewards,
        };
        let g = self.cfg.rollout.num_generations.max(1);
        let adv = match l.adv_estimator {
            AdvEstimator::Remax => remax_advantages(
                &rows,
                &crate::stages::scorer::greedy_baselines(&s.rollouts)?,
            ),
            e if e.optimal_token() => {
                let (old_rows, spsq) = self.old_logps_and_sum_sq(batch, &positions)?;
                grpo_core::estimators::optimal_token_baseline(
                    &rows,
                    &old_rows,
                    &spsq,
                    g,
                    e == AdvEstimator::TirOptimalTokenBaseline,
                )
            }
            e => estimate(e, &rows, g, &params),
        }
        .map_err(|e| anyhow::anyhow!("loss.adv_estimator {}: {e}", l.adv_estimator.as_str()))?;
        if !l.adv_estimator.per_token() {
            // Every token of a completion has its completion's advantage.
            return Ok(Estimated::Seq(
                adv.iter()
                    .map(|r| r.first().copied().unwrap_or(0.0) as f32)
                    .collect(),
            ));
        }
        Ok(Estimated::Token(
            adv.iter()
                .zip(&positions)
                .zip(&batch.lens)
                .map(|((a, pos), &n)| {
                    let mut row = vec![0f32; n];
                    for (&j, &x) in pos.iter().zip(a) {
                        row[j] = x as f32;
                    }
                    row
                })
                .collect(),
        ))
    }

    /// TRL's RLOO advantages of the step's completions: the combined rewards, clipped to
    /// `rloo.reward_clip_range`, minus `rloo.beta` × each completion's summed `log π_old −
    /// log π_ref` (RLOO's first-order KL, a reward penalty), then the leave-one-out baseline
    /// (grpo-core's `rloo_advantages`). Also the per-token mean of that KL (TRL's `kl`).
    fn rloo_advantages(
        &self,
        s: &Scored,
        batch: &StepBatch<'_>,
        old: &[Option<Tensor>],
        refs: &[Option<Tensor>],
    ) -> Result<(Vec<f32>, Option<f64>)> {
        let r = &self.cfg.rloo;
        let mut rewards = s.scores.rewards.clone();
        if let Some([lo, hi]) = r.reward_clip_range {
            for x in rewards.iter_mut().filter(|x| !x.is_nan()) {
                *x = x.clamp(lo as f32, hi as f32);
            }
        }
        let mut kl_mean = None;
        if r.beta > 0.0 {
            let (mut kl_sum, mut tokens) = (0f64, 0f64);
            for (ci, &(a, b)) in batch.chunks.iter().enumerate() {
                let (Some(o), Some(rf)) = (&old[ci], &refs[ci]) else {
                    continue;
                };
                let mask = batch.mask(a, b, o.dim(1)?, &self.device)?;
                let per_token = ((o - rf.to_dtype(o.dtype())?)?.to_dtype(DType::F32)? * &mask)?;
                let per_seq: Vec<f32> = per_token.sum(1)?.to_vec1()?;
                kl_sum += f64::from(per_token.sum_all()?.to_scalar::<f32>()?);
                tokens += f64::from(mask.sum_all()?.to_scalar::<f32>()?);
                for (i, kl) in (a..b).zip(per_seq) {
                    rewards[i] -= (r.beta as f32) * kl;
                }
            }
            kl_mean = Some(kl_sum / tokens.max(1.0));
        }
        let g = self.cfg.rollout.num_generations;
        let adv =
            grpo_core::advantages::rloo_advantages(&rewards, g.max(1), r.normalize_advantages);
        Ok((adv, kl_mean))
    }

    /// Old-policy log-probs (when `need_old`) and reference log-probs of every micro-batch,
    /// without a graph.
    #[allow(clippy::type_complexity)]
    pub(crate) fn frozen_logps(
        &self,
        batch: &StepBatch<'_>,
        need_old: bool,
    ) -> Result<(Vec<Option<Tensor>>, Vec<Option<Tensor>>)> {
        let frozen = need_old.then(|| self.policy.model.detached());
        let (mut old, mut refs) = (Vec::new(), Vec::new());
        for &(a, b) in &batch.chunks {
            let (p, c) = (&batch.prompts[a..b], &batch.completions[a..b]);
            for (model, out) in [
                (frozen.as_ref(), &mut old),
                (self.reference.as_ref(), &mut refs),
            ] {
                out.push(match model {
                    Some(m) => Some(self.logps(m, p, c, false)?.0.detach()),
                    None => None,
                });
            }
        }
        Ok((old, refs))
    }

    /// The log-probs completions `[a, b)` were sampled with, `(b − a, C)` like `old_lp`; a
    /// completion without usable ones (a server that gave none, see grpo_rollout::remote)
    /// takes `old_lp`'s row (weight 1, no off-policy evidence).
    pub(crate) fn sampled_logps(
        &self,
        s: &Scored,
        a: usize,
        b: usize,
        old_lp: &Tensor,
    ) -> Result<Tensor> {
        let c = old_lp.dim(1)?;
        let mut sampled = Vec::with_capacity((b - a) * c);
        let mut usable = Vec::with_capacity(b - a);
        for comp in &s.rollouts.completions[a..b] {
            let ok = comp.logprobs.len() == comp.token_ids.len();
            usable.push(u8::from(ok));
            sampled.extend((0..c).map(|j| match ok {
                true => comp.logprobs.get(j).copied().unwrap_or(0.0),
                false => 0.0,
            }));
        }
        let sampled =
            Tensor::from_vec(sampled, (b - a, c), &self.device)?.to_dtype(old_lp.dtype())?;
        Ok(Tensor::from_vec(usable, (b - a, 1), &self.device)?
            .broadcast_as((b - a, c))?
            .where_cond(&sampled, old_lp)?)
    }

    /// TRL's importance weights of a micro-batch: the ratio of the learner's old log-probs to
    /// the log-probs the tokens were `sampled` with ([`Self::sampled_logps`]), over its loss
    /// `mask`; also what the off-policy metrics read. Formed on the device without waiting
    /// for it.
    fn importance_weights(
        &self,
        old_lp: &Tensor,
        sampled: Tensor,
        mask: Tensor,
    ) -> Result<(Tensor, OffPolicyParts)> {
        let l = &self.cfg.loss;
        let w = grpo_core::loss::importance_weights(
            old_lp,
            &sampled,
            &mask,
            l.vllm_importance_sampling_mode,
            l.vllm_importance_sampling_clip_min,
            l.vllm_importance_sampling_clip_max,
        )?;
        let parts = OffPolicyParts {
            weights: w.clone(),
            old: old_lp.clone(),
            sampled,
            mask,
        };
        Ok((w, parts))
    }

    /// One pass over the micro-batches: the policy loss of each, its backward, the gradients
    /// summed; the loss, entropy, KL and clip ratios into `sums`. Nothing in a micro-batch waits
    /// for the device: each one's scalars stay there until the pass ends and are read with one
    /// copy (a non-finite loss is refused then, before any optimizer step).
    #[allow(clippy::too_many_arguments)]
    fn loss_and_grads(
        &mut self,
        s: &Scored,
        batch: &StepBatch<'_>,
        range: std::ops::Range<usize>,
        updates: usize,
        (old, refs): (&[Option<Tensor>], &[Option<Tensor>]),
        advantages: Adv<'_>,
        weights: &Weights,
        sums: &mut MeanOf,
        off_policy: &mut OffPolicyStats,
    ) -> Result<HashMap<String, Tensor>> {
        let mut loss_cfg = self.cfg.loss_config();
        let l = &self.cfg.loss;
        // The entropy bonus: TRL applies the coefficient of the last optimizer update, with
        // adaptive control only while the entropy it measured is at or below the target.
        let bonus_on = l.entropy_coef != 0.0 || l.use_adaptive_entropy;
        let wants_entropies = bonus_on || l.top_entropy_quantile < 1.0;
        let coef = self.state.entropy_coef.unwrap_or(l.entropy_coef);
        loss_cfg.entropy_coef = match l.use_adaptive_entropy {
            true if self
                .state
                .last_entropy
                .is_some_and(|e| e <= l.entropy_target) =>
            {
                coef
            }
            true => 0.0,
            false => l.entropy_coef,
        };
        // The off-policy sequence mask compares with the sampling log-probs when the samples
        // are off-policy (TRL with vLLM), else with the old log-probs.
        let correct = (self.cfg.pipeline.max_staleness > 0 || s.rollouts.sampled_by_other_model)
            && l.vllm_importance_sampling_correction;
        let opsm_sampled = correct && l.off_policy_mask_threshold.is_some();
        // The micro-batches of this optimizer update (all of the step's but with TRL's
        // `steps_per_generation`): each micro-batch's mean loss weighs 1 / their count, or,
        // formed by a token budget (unequal sizes), its share of the update's completions.
        let ga_all = range.len().max(1) as f64;
        let rows_in_update: usize = range
            .clone()
            .map(|ci| {
                let (a, b) = batch.chunks[ci];
                b - a
            })
            .sum();
        // dapo, cispo and vespo divide by the step's tokens already; the others average
        // micro-batches.
        let rloo = self.cfg.algorithm == Algorithm::Rloo;
        let minillm = self.cfg.algorithm == Algorithm::MiniLlm;
        let dapo_like = !rloo && loss_cfg.loss_type.normalizes_by_step_tokens();
        let mut acc: HashMap<String, Tensor> = HashMap::new();
        // Per micro-batch: [loss, Σ entropy·mask, Σ mask (0 without entropies), the loss
        // metrics, the policy loss without the bonus, Σ entropy and count over the tokens the
        // policy term acts on].
        let mut scalars: Vec<Tensor> = Vec::with_capacity(range.len());
        // The in-pass weights' metric inputs, read after the pass (no wait inside it).
        let mut parts = Vec::new();
        // Each micro-batch's divisor, to read its mean loss back.
        let mut divisors = Vec::with_capacity(range.len());
        for ci in range {
            let (a, b) = batch.chunks[ci];
            let ga = match batch.budgeted {
                true => rows_in_update as f64 / (b - a) as f64,
                false => ga_all,
            };
            divisors.push(ga);
            let (p, c) = (&batch.prompts[a..b], &batch.completions[a..b]);
            // Clip-Cov draws its tokens anew for each micro-batch of each update.
            if let grpo_core::cov::CovLoss::ClipCov { seed, .. } = &mut loss_cfg.cov {
                *seed = grpo_data::rng::mix(
                    self.cfg.train.seed,
                    self.state.optimizer_steps as u64,
                    ci as u64,
                );
            }
            // An MoE policy's load-balancing loss: recorded by this forward, its gradient
            // handed to the routers in the backward below.
            let aux = self.aux_collector(ga);
            let (lp, ent, width, minillm) = grpo_rollout::moe::recording(aux.clone(), || {
                if minillm {
                    let f = self.minillm_forward(batch, a, b)?;
                    let extra = (f.advantages, f.single_step);
                    return Ok((f.logps, f.entropies, f.width, extra));
                }
                let (lp, ent, width) = self.logps(&self.policy.model, p, c, true)?;
                Ok::<_, anyhow::Error>((lp, ent, width, (None, None)))
            })?;
            let (token_advantages, single_step) = minillm;
            let mask = batch.mask(a, b, width, &self.device)?;
            // The sampling log-probs, built once for the in-pass weights and the off-policy
            // mask (with one update per step the old log-probs are this pass's own).
            let in_pass_weights = matches!(weights, Weights::InPass);
            let old_lp = match &old[ci] {
                Some(o) => o.clone(),
                None => lp.detach(),
            };
            let sampled = match in_pass_weights || opsm_sampled {
                true => Some(self.sampled_logps(s, a, b, &old_lp)?),
                false => None,
            };
            let in_pass = match (&sampled, in_pass_weights) {
                (Some(sp), true) => {
                    let (w, part) = self.importance_weights(&old_lp, sp.clone(), mask.clone())?;
                    parts.push(part);
                    Some(w)
                }
                _ => None,
            };
            let is_weights = match weights {
                Weights::Given(w) => w[ci].as_ref(),
                _ => in_pass.as_ref(),
            };
            let adv = match advantages {
                Adv::Seq(v) => Tensor::from_slice(&v[a..b], b - a, &self.device)?,
                Adv::Token(rows) => {
                    let mut flat = Vec::with_capacity((b - a) * width);
                    for row in &rows[a..b] {
                        flat.extend((0..width).map(|j| row.get(j).copied().unwrap_or(0.0)));
                    }
                    Tensor::from_vec(flat, (b - a, width), &self.device)?
                }
            };
            // MiniLLM: each token's reverse-KL advantage added to its completion's.
            let adv = match &token_advantages {
                Some(t) => adv.to_dtype(t.dtype())?.unsqueeze(1)?.broadcast_add(t)?,
                None => adv,
            };
            // Per micro-batch: the loss to differentiate, the undivided policy loss, the loss
            // metrics and the entropy-bonus statistics.
            let (loss, policy_part, metrics, stats) = if rloo {
                // TRL's RLOO: the clipped ratio of whole sequences, no KL term (it is in the
                // reward), the mean over sequences averaged over micro-batches.
                // Off-policy samples (staleness, a rollout server, teacher samples): each
                // sequence weighed by its truncated or masked sampling ratio (sequence modes).
                let (out, metrics) = rloo_loss(
                    &lp,
                    old[ci].as_ref(),
                    &mask,
                    &adv,
                    loss_cfg.epsilon_low,
                    loss_cfg.epsilon_high,
                    is_weights,
                )?;
                let policy_part = wide_scalar(&out)?;
                let zeros = Tensor::zeros(2, DType::F64, &self.device)?;
                ((out / ga)?, policy_part, metrics, zeros)
            } else {
                let out = policy_loss_on_device(
                    &LossInputs {
                        per_token_logps: &lp,
                        old_per_token_logps: old[ci].as_ref(),
                        ref_per_token_logps: refs[ci].as_ref(),
                        advantages: &adv,
                        completion_mask: &mask,
                        // TRL: the batch's tokens × gradient_accumulation_steps /
                        // steps_per_generation, the tokens of one update on average.
                        num_items_in_batch: Some(batch.total_tokens as f64 / updates as f64),
                        importance_weights: is_weights,
                        sampling_per_token_logps: sampled.as_ref().filter(|_| opsm_sampled),
                        // Only the entropy options read them (the metric takes `ent` below).
                        entropies: ent.as_ref().filter(|_| wants_entropies),
                    },
                    &loss_cfg,
                )?;
                let policy_part = wide_scalar(&out.loss)?;
                let mut loss = if dapo_like {
                    out.loss
                } else {
                    (out.loss / ga)?
                };
                // TRL divides the bonus by the accumulation steps whatever the loss type.
                if let Some(bonus) = &out.entropy_bonus {
                    loss = (loss - (bonus / ga)?)?;
                }
                let stats = match &out.entropy_stats {
                    Some(t) => t.to_dtype(DType::F64)?,
                    None => Tensor::zeros(2, DType::F64, &self.device)?,
                };
                (loss, policy_part, out.metrics, stats)
            };
            // MiniLLM's single-step reverse KL, added to each micro-batch's loss as TRL adds it.
            let (loss, single_step) = match single_step {
                Some(kl) => {
                    let kl = kl.to_dtype(loss.dtype())?;
                    ((loss + &kl)?, wide_scalar(&kl)?)
                }
                None => (loss, Tensor::zeros(1, DType::F64, &self.device)?),
            };
            // The loss's value with TRL's `coef · aux / accumulation steps`.
            let loss = match &aux {
                Some(c) => {
                    let (loss, aux_loss) = c.add_to(loss)?;
                    sums.add("aux_loss", aux_loss);
                    loss
                }
                None => loss,
            };
            let wide = |t: Tensor| t.to_dtype(DType::F64)?.reshape(1);
            let (es, ms) = match &ent {
                Some(e) => (
                    wide((e.detach() * &mask)?.sum_all()?)?,
                    wide(mask.sum_all()?)?,
                ),
                None => {
                    let zero = Tensor::zeros(1, DType::F64, &self.device)?;
                    (zero.clone(), zero)
                }
            };
            scalars.push(Tensor::cat(
                &[
                    wide(loss.detach())?,
                    es,
                    ms,
                    metrics.as_tensor().to_dtype(DType::F64)?,
                    policy_part,
                    stats,
                    single_step,
                ],
                0,
            )?);
            grpo_core::memlog::log("learner: micro-batch forward", &self.device);
            let grads = self.policy.model.backward(&loss)?;
            grpo_core::memlog::log("learner: backward (graph alive)", &self.device);
            drop(loss);
            self.opt.accumulate(&mut acc, &grads)?;
            drop(grads);
            grpo_core::memlog::log("learner: gradients summed", &self.device);
        }
        for part in &parts {
            off_policy.add(part)?;
        }
        if scalars.is_empty() {
            return Ok(acc);
        }
        let rows: Vec<Vec<f64>> = Tensor::stack(&scalars, 0)?.to_vec2()?;
        let lt = loss_cfg.loss_type;
        let n = LossMetrics::LEN;
        let (mut window_sum, mut window_count) = (0.0, 0.0);
        for (r, ga) in rows.into_iter().zip(divisors) {
            let lv = r[0];
            if !lv.is_finite() {
                bail!("non-finite loss ({lv}) at step {}", s.rollouts.batch.step);
            }
            // MiniLLM's single-step term is in each micro-batch's loss undivided.
            let ss = r[6 + n];
            sums.add("loss", if dapo_like { lv } else { (lv - ss) * ga + ss });
            if minillm && self.cfg.minillm.single_step_decomposition {
                sums.add("minillm/single_step_kl", ss);
            }
            if r[2] > 0.0 {
                sums.add("entropy", r[1] / r[2]);
            }
            let m = LossMetrics::from_values(&r[3..3 + n])?;
            // (RLOO's KL is the reward penalty's, set by `process`.)
            if self.reference.is_some() && !rloo {
                sums.add("kl", m.kl);
            }
            // TRL's metrics by loss type: clip ratios for the clipped objectives (and, here,
            // cispo's cap as before), cispo_clip_ratio, vespo/phi_seq_mean.
            if rloo || lt.is_clipped() || lt == LossType::Cispo {
                sums.add("clip_ratio/low_mean", m.clip_ratio_low_mean);
                sums.add("clip_ratio/high_mean", m.clip_ratio_high_mean);
                // TRL's min / max over processes of each micro-batch's ratio (one process
                // here); gmpo's over its sequences.
                sums.add("clip_ratio/low_min", m.clip_ratio_low_min);
                sums.add("clip_ratio/high_max", m.clip_ratio_high_max);
                sums.add("clip_ratio/region_mean", m.clip_ratio_region_mean);
            }
            if lt == LossType::Cispo && !rloo {
                sums.add("cispo_clip_ratio", m.clip_ratio_high_mean);
            }
            if lt == LossType::Vespo && !rloo {
                sums.add("vespo/phi_seq_mean", m.phi_seq_mean);
            }
            if bonus_on {
                sums.add("policy_loss", r[3 + n]);
            }
            window_sum += r[4 + n];
            window_count += r[5 + n];
        }
        if l.use_adaptive_entropy {
            // Skywork-OR1's controller, as TRL: the window's token-weighted mean entropy moves
            // the coefficient one step toward keeping it above the target.
            let world = window_sum / window_count.max(1.0);
            let next = if world <= l.entropy_target {
                (coef + l.entropy_coef_delta).min(l.entropy_coef_max)
            } else {
                (coef - l.entropy_coef_delta).max(l.entropy_coef_min)
            };
            self.state.entropy_coef = Some(next);
            self.state.last_entropy = Some(world);
        }
        if bonus_on {
            sums.add(
                "entropy_coef",
                self.state.entropy_coef.unwrap_or(l.entropy_coef),
            );
        }
        Ok(acc)
    }
}

/// A 0-dimensional tensor as a `(1,)` f64 one (no gradient).
fn wide_scalar(t: &Tensor) -> Result<Tensor> {
    Ok(t.detach().to_dtype(DType::F64)?.reshape(1)?)
}

/// The advantages the learner formed itself (verl's estimators with the KL in the reward or a
/// discount): one per completion, or one per token.
enum Estimated {
    Seq(Vec<f32>),
    Token(Vec<Vec<f32>>),
}

/// The advantages the policy loss reads: one per completion, or one per token (REINFORCE++'s
/// discounted returns), each completion's row as long as its tokens.
#[derive(Clone, Copy)]
enum Adv<'a> {
    Seq(&'a [f32]),
    Token(&'a [Vec<f32>]),
}

/// Where a step's importance-sampling weights come from.
enum Weights {
    /// No correction.
    None,
    /// Formed in each micro-batch's pass from its own log-probs (one update per step).
    InPass,
    /// Formed before the updates from the old log-probs, one per micro-batch.
    Given(Vec<Option<Tensor>>),
}
