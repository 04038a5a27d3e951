//! MiniLLM's part of the GRPO step (TRL's experimental `MiniLLMTrainer`): one forward of the
//! policy (the student) gives GRPO's log-probs at `rollout.temperature` and, at
//! `minillm.kd_temperature`, the two teacher terms — each token's reverse-KL advantage
//! `log π_T − log π_S` (no gradient, `grpo_core::distill::minillm_advantages`) added to its
//! reward advantage, and the single-step decomposition: the full-vocabulary reverse KL
//! `KL(π_S ‖ π_T)` averaged over the micro-batch's loss tokens, added to its loss (as TRL adds
//! it to each micro-batch's, not divided by the accumulation steps).

use anyhow::{Context, Result};
use candle_core::{DType, Tensor};

use super::Learner;
use super::batch::{StepBatch, padded_batch};

/// A micro-batch's forward for MiniLLM.
pub(crate) struct MiniLlmForward {
    /// `(B, T)` policy log-probs at `rollout.temperature`, with the graph.
    pub(crate) logps: Tensor,
    /// `(B, T)` policy entropies (at `rollout.temperature`).
    pub(crate) entropies: Option<Tensor>,
    /// The completion width `T`.
    pub(crate) width: usize,
    /// `(B, T)` reverse-KL advantages (`minillm.rkl_advantage`), without gradient.
    pub(crate) advantages: Option<Tensor>,
    /// The single-step reverse KL, a 0-dimensional tensor with the graph
    /// (`minillm.single_step_decomposition`).
    pub(crate) single_step: Option<Tensor>,
}

impl Learner {
    /// MiniLLM's forward of micro-batch `[a, b)` of `batch` (see the module).
    pub(crate) fn minillm_forward(
        &self,
        batch: &StepBatch<'_>,
        a: usize,
        b: usize,
    ) -> Result<MiniLlmForward> {
        let m = &self.cfg.minillm;
        let model = &self.policy.model;
        let teacher = self
            .distillation_teacher
            .as_ref()
            .context("MiniLLM needs its teacher (distillation.teacher_model_name_or_path)")?;
        let (p, x) = (&batch.prompts[a..b], &batch.completions[a..b]);
        let (ids, attn, width) = padded_batch(self.tokenizer.pad_token_id, p, x, &self.device)?;
        let (h, targets, shape) = model.completion_rows(&ids, &attn, width)?;
        let temperature = self.cfg.rollout.temperature;
        let (logps, entropies) = model.rows_logprobs(&h, &targets, shape, temperature, true)?;
        let td = teacher.device();
        let th = teacher
            .completion_rows(&ids.to_device(td)?, &attn.to_device(td)?, width)?
            .0
            .detach();
        let mask = batch.mask(a, b, width, &self.device)?;
        let kd = m.kd_temperature;
        let advantages = match m.rkl_advantage {
            true => {
                let student = match kd == temperature {
                    true => logps.detach(),
                    false => {
                        model
                            .rows_logprobs(&h.detach(), &targets, shape, kd, false)?
                            .0
                    }
                };
                let teacher_lp = teacher_logps(teacher, &th, &targets.to_device(td)?, model, kd)?
                    .reshape(shape)?
                    .to_device(&self.device)?;
                Some(grpo_core::distill::minillm_advantages(
                    &teacher_lp,
                    &student,
                    &mask,
                    m.gamma,
                    m.length_normalization,
                )?)
            }
            false => None,
        };
        let single_step = match m.single_step_decomposition {
            // β = 1: the reverse KL.
            true => {
                let (div, _) = model.distill_rows(&h, teacher, &th, 1.0, kd)?;
                let on = mask.flatten_all()?.to_dtype(div.dtype())?;
                let tokens = on.sum_all()?.maximum(1.0)?;
                Some((&div * &on)?.sum_all()?.div(&tokens)?)
            }
            false => None,
        };
        Ok(MiniLlmForward {
            logps,
            entropies,
            width,
            advantages,
            single_step,
        })
    }
}

/// The teacher's log-probs `(N,)` of `targets` at its hidden rows `th` `(N, H)`, at
/// `temperature`, over the student's vocabulary: a teacher with a larger (padded) one is read
/// over the student's tokens, as the single-step term reads it (TRL would need equal sizes).
fn teacher_logps(
    teacher: &grpo_rollout::Transformer,
    th: &Tensor,
    targets: &Tensor,
    student: &grpo_rollout::Transformer,
    temperature: f64,
) -> Result<Tensor> {
    let v = student.cfg.vocab_size;
    let n = th.dim(0)?;
    if teacher.cfg.vocab_size == v {
        let (lp, _) = teacher.rows_logprobs(th, targets, (n, 1), temperature, false)?;
        return Ok(lp.flatten_all()?);
    }
    let rows = grpo_core::logprobs::chunk_rows_on(teacher.cfg.vocab_size, th.device());
    let wide = match teacher.dtype() {
        DType::F64 => DType::F64,
        _ => DType::F32,
    };
    let mut out = Vec::new();
    let mut start = 0;
    while start < n {
        let k = rows.min(n - start);
        let z = teacher
            .logits(&th.narrow(0, start, k)?)?
            .narrow(1, 0, v)?
            .to_dtype(wide)?;
        let z = (z / temperature)?;
        out.push(grpo_core::logprobs::selective_log_softmax(
            &z,
            &targets.narrow(0, start, k)?,
        )?);
        start += k;
    }
    Ok(Tensor::cat(&out, 0)?)
}
