//! On-policy distillation's step (TRL 1.16's `DistillationTrainer`): the policy (the student)
//! sampled the step's completions; at each of their tokens the loss is the divergence of the
//! student's next-token distribution from the frozen teacher's (`distillation.beta`: forward
//! KL, reverse KL or the generalized JSD, at `rollout.temperature`), summed over the loss tokens
//! and divided by the step's loss tokens (per optimizer update), as TRL's
//! `num_items_in_batch`. Rewards, when the config has any, are scored and logged, not trained
//! on. GKD (TRL's GKDTrainer) is the same step on whatever completions the generator gave
//! (the student's, the dataset's or the teacher's), its divergence at temperature 1 as TRL's
//! `compute_loss` takes it. IW-OPD (TRL's IWOPDTrainer, or `distillation.distillation_objective
//! = "iw_opd"`) is the same step with the sampled-token objective
//! (`grpo_core::distill::iw_opd_advantages`): `−log π · w · (log π_T − log π_rollout)` summed
//! over the loss tokens.

use std::time::Instant;

use anyhow::{Context, Result, bail};
use candle_core::{DType, Tensor};
use grpo_rollout::DistillTeacher;

use super::Learner;
use super::batch::{StepBatch, padded_batch};
use super::metrics::OffPolicyStats;
use crate::callbacks::Metrics;
use crate::config::DistillObjective;
use crate::stages::Scored;

impl Learner {
    /// One distillation step over the scored completions `s`: for each of `num_iterations`
    /// passes, the micro-batches' losses and gradients, one optimizer update per
    /// `steps_per_generation` share; TRL's metrics (`loss`, `entropy`) and the step's
    /// completion and reward metrics.
    pub(crate) fn distill_step(&mut self, s: &Scored, t0: Instant) -> Result<Metrics> {
        let r = &s.rollouts;
        let eos = self.tokenizer.eos_token_ids.clone();
        // Every sampled token carries loss (TRL masks only padding and environment tokens).
        let batch = StepBatch::new(s, &eos, self.cfg.micro_batch(), false);
        let teacher = self.distillation_teacher.clone();
        if teacher.is_none() && self.teacher_server.is_none() {
            bail!("distillation needs its teacher (distillation.teacher_model_name_or_path)");
        }
        // TRL divides each micro-batch's summed divergence by the loss tokens of the batch an
        // update trains on.
        let denom = (batch.total_tokens as f64 / self.cfg.updates_per_step() as f64).max(1.0);
        // GOLD's ULD loss is a mean over an update's completions.
        let per_update =
            (batch.completions.len() as f64 / self.cfg.updates_per_step() as f64).max(1.0);
        let mut uld: Vec<(f64, f64)> = Vec::new();
        let (mut ent_sum, mut tok_sum) = (0.0, 0.0);
        let mut iw: Vec<[f64; 5]> = Vec::new();
        let (loss, grad_norm, lr) = self.chunked_updates(&batch.chunks, r.batch.step, |l, c| {
            let (a, b) = c.range;
            let part = l.distill_part(&l.policy.model, teacher.as_ref(), s, &batch, a, b)?;
            ent_sum += part.entropy;
            tok_sum += part.tokens;
            iw.extend(part.iw_opd);
            uld.extend(part.uld);
            let d = if l.gold.is_some() { per_update } else { denom };
            Ok((part.divergence / d)?)
        })?;
        self.state.step = r.batch.step + 1;
        let mut m = Metrics::new();
        m.insert("loss".into(), loss);
        m.insert(
            "entropy".into(),
            if tok_sum > 0.0 {
                ent_sum / tok_sum
            } else {
                0.0
            },
        );
        if !iw.is_empty() {
            // TRL's IW-OPD metrics: each micro-batch's, averaged.
            let names = [
                "mean_advantage",
                "mean_abs_advantage",
                "mean_weight",
                "min_weight",
                "max_weight",
            ];
            for (k, name) in names.iter().enumerate() {
                let v = iw.iter().map(|x| x[k]).sum::<f64>() / iw.len() as f64;
                m.insert(format!("iw_opd/{name}"), v);
            }
        }
        if !uld.is_empty() {
            // TRL's GOLD metrics of the hybrid loss.
            let n = uld.len() as f64;
            m.insert(
                "matched_loss".into(),
                uld.iter().map(|x| x.0).sum::<f64>() / n,
            );
            m.insert(
                "unmatched_loss".into(),
                uld.iter().map(|x| x.1).sum::<f64>() / n,
            );
        }
        if self.cfg.distillation.lmbda_for(self.cfg.algorithm) < 1.0 {
            // GKD: whether this step trained on the student's own samples.
            let on = r.source == crate::stages::CompletionSource::Policy;
            m.insert("on_policy".into(), f64::from(u8::from(on)));
        }
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

    /// The summed divergence (with `model`'s graph) of micro-batch `[a, b)` of `batch`, its
    /// summed student entropy and its loss tokens.
    fn distill_part(
        &self,
        model: &grpo_rollout::Transformer,
        teacher: Option<&grpo_rollout::Transformer>,
        s: &Scored,
        batch: &StepBatch<'_>,
        a: usize,
        b: usize,
    ) -> Result<DistillPart> {
        if self.gold.is_some() {
            return self.uld_part(model, teacher, batch, a, b);
        }
        if self.cfg.distillation.objective_for(self.cfg.algorithm) == DistillObjective::IwOpd {
            return self.iw_opd_part(model, teacher, s, batch, a, b);
        }
        // TRL's GKD takes the divergence at temperature 1 (its sampling temperature is the
        // generator's); the DistillationTrainer at the sampling temperature.
        let temperature = match self.cfg.algorithm {
            crate::config::Algorithm::Gkd => 1.0,
            _ => self.cfg.rollout.temperature,
        };
        let d = &self.cfg.distillation;
        let divergence = d.divergence_for(self.cfg.algorithm);
        let (p, x) = (&batch.prompts[a..b], &batch.completions[a..b]);
        let (ids, mask, c) = padded_batch(self.tokenizer.pad_token_id, p, x, &self.device)?;
        let h = model.completion_hidden(&ids, &mask, c)?;
        // Each row's own token (the sampled top-1 support's reverse side).
        let tokens = ids.narrow(1, ids.dim(1)? - c, c)?.flatten_all()?;
        let (div, ent) = match (teacher, &self.teacher_server) {
            (_, Some(server)) => {
                let k = d.loss_top_k_for(self.cfg.algorithm);
                let served = super::batch::served_rows(server, p, x, c, k, &self.device)
                    .context("distillation.teacher_server")?;
                model.distill_rows_with(
                    &h,
                    DistillTeacher::Served(&served),
                    Some(&tokens),
                    divergence,
                    temperature,
                )?
            }
            (Some(teacher), None) => {
                let td = teacher.device();
                let th = teacher
                    .completion_hidden(&ids.to_device(td)?, &mask.to_device(td)?, c)?
                    .detach();
                let local = DistillTeacher::Local {
                    model: teacher,
                    hidden: &th,
                };
                model.distill_rows_with(&h, local, Some(&tokens), divergence, temperature)?
            }
            (None, None) => bail!("distillation's divergence needs a teacher"),
        };
        let loss_mask = batch
            .mask(a, b, c, &self.device)?
            .flatten_all()?
            .to_dtype(div.dtype())?;
        let wide = |t: Tensor| -> Result<f64> { Ok(t.to_dtype(DType::F64)?.to_scalar::<f64>()?) };
        Ok(DistillPart {
            divergence: (&div * &loss_mask)?.sum_all()?,
            entropy: wide((ent * &loss_mask)?.sum_all()?)?,
            tokens: wide(loss_mask.sum_all()?)?,
            iw_opd: None,
            uld: None,
        })
    }

    /// IW-OPD's summed loss `Σ −log π · w · a` over micro-batch `[a, b)`'s loss tokens (with
    /// `model`'s graph), with `a = log π_T − log π_rollout` at the sampled tokens: the rollout's
    /// log-probs those the tokens were sampled with on a rollout server (TRL's vLLM path), else
    /// the student's own, detached (TRL's local path); the student's entropy, the loss tokens
    /// and TRL's `iw_opd/*` values.
    fn iw_opd_part(
        &self,
        model: &grpo_rollout::Transformer,
        teacher: Option<&grpo_rollout::Transformer>,
        s: &Scored,
        batch: &StepBatch<'_>,
        a: usize,
        b: usize,
    ) -> Result<DistillPart> {
        let d = &self.cfg.distillation;
        if let Some(t) = teacher
            && t.cfg.vocab_size < model.cfg.vocab_size
        {
            bail!(
                "distillation: the teacher's vocabulary ({}) is smaller than the student's ({})",
                t.cfg.vocab_size,
                model.cfg.vocab_size
            );
        }
        let (p, x) = (&batch.prompts[a..b], &batch.completions[a..b]);
        // Both at `rollout.temperature`, through the learner's own log-prob path.
        let (lp, ent, c) = self.logps(model, p, x, true)?;
        let tlp = match (teacher, &self.teacher_server) {
            (_, Some(server)) => super::batch::served_logps(server, p, x, c, false, &self.device)
                .context("distillation.teacher_server")?,
            (Some(t), None) => self.logps(t, p, x, false)?.0,
            (None, None) => bail!("IW-OPD needs a teacher"),
        };
        let tlp = tlp.detach().to_device(lp.device())?.to_dtype(lp.dtype())?;
        let remote = self.cfg.rollout.backend == crate::config::Backend::Openai
            && s.rollouts.source == crate::stages::CompletionSource::Policy;
        let rollout = match remote {
            true => self.sampled_logps(s, a, b, &lp.detach())?,
            false => lp.detach(),
        };
        let loss_mask = batch.mask(a, b, c, &self.device)?.to_dtype(lp.dtype())?;
        let (adv, w, abs) = grpo_core::distill::iw_opd_advantages(
            &tlp,
            &rollout,
            &loss_mask,
            d.iw_opd_gamma,
            d.iw_opd_epsilon,
        )?;
        let loss = ((lp.neg()? * &adv)? * &loss_mask)?.sum_all()?;
        let wide = |t: Tensor| -> Result<f64> { Ok(t.to_dtype(DType::F64)?.to_scalar::<f64>()?) };
        let tokens = wide(loss_mask.sum_all()?)?;
        let iw_opd = match tokens > 0.0 {
            true => {
                let mean = |x: &Tensor| -> Result<f64> {
                    Ok(wide((x * &loss_mask)?.sum_all()?)? / tokens)
                };
                let on = loss_mask.ne(0.0)?;
                let fill = |v: f64| -> Result<Tensor> {
                    Ok(Tensor::full(v, w.shape(), w.device())?.to_dtype(w.dtype())?)
                };
                let min = wide(on.where_cond(&w, &fill(f64::INFINITY)?)?.min_all()?)?;
                let max = wide(on.where_cond(&w, &fill(f64::NEG_INFINITY)?)?.max_all()?)?;
                Some([mean(&adv)?, mean(&abs)?, mean(&w)?, min, max])
            }
            false => None,
        };
        let entropy = match &ent {
            Some(e) => wide((e.detach() * &loss_mask)?.sum_all()?)?,
            None => 0.0,
        };
        Ok(DistillPart {
            divergence: loss,
            entropy,
            tokens,
            iw_opd,
            uld: None,
        })
    }

    /// Evaluation: the summed divergence, student entropy and loss tokens of scored
    /// completions `s` under the current policy, without gradients.
    pub(crate) fn distill_eval(&self, s: &Scored) -> Result<(f64, f64, f64)> {
        let teacher = self.distillation_teacher.as_ref();
        let eos = self.tokenizer.eos_token_ids.clone();
        let batch = StepBatch::new(s, &eos, self.cfg.micro_batch(), false);
        let model = self.policy.model.detached();
        let (mut div, mut ent, mut tok) = (0.0, 0.0, 0.0);
        for &(a, b) in &batch.chunks {
            let p = self.distill_part(&model, teacher, s, &batch, a, b)?;
            div += p.divergence.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            ent += p.entropy;
            tok += p.tokens;
        }
        Ok((div, ent, tok))
    }
}

/// One micro-batch's share of a distillation step.
pub(crate) struct DistillPart {
    pub(crate) divergence: Tensor,
    pub(crate) entropy: f64,
    pub(crate) tokens: f64,
    /// IW-OPD's mean advantage, mean |a|, mean, min and max weight over the loss tokens.
    pub(crate) iw_opd: Option<[f64; 5]>,
    /// GOLD's hybrid ULD: the matched and unmatched parts (means over the micro-batch).
    pub(crate) uld: Option<(f64, f64)>,
}
