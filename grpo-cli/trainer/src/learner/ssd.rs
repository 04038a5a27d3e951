//! Simple self-distillation's step (TRL's experimental `SSDTrainer`, "Embarrassingly Simple
//! Self-Distillation Improves Code Generation"): the policy sampled the step's completions at
//! the training-time temperature and truncation (`rollout.*`); it learns them with plain
//! cross-entropy at temperature 1, `−log π(y_t | x, y_<t)` averaged over each micro-batch's
//! tokens (up to and including EOS) and divided by the micro-batches of its optimizer update,
//! as TRL's `compute_loss`. With `ssd.filter_empty` (the default) empty completions and
//! one-line stubs carry no loss. Rewards, when the config has any, are scored and logged only.

use std::time::Instant;

use anyhow::Result;
use candle_core::{DType, Tensor};

use super::Learner;
use super::batch::{StepBatch, completion_logps};
use super::metrics::OffPolicyStats;
use crate::callbacks::Metrics;
use crate::stages::Scored;

/// TRL's filter of raw samples: empty once stripped, or one line (no newline) of fewer than
/// 10 characters.
pub fn is_stub(text: &str) -> bool {
    let t = text.trim();
    t.is_empty() || (!t.contains('\n') && t.chars().count() < 10)
}

impl Learner {
    /// One SSD step over the sampled completions `s`: `num_iterations` passes of the
    /// micro-batches' cross-entropy, an optimizer update per `steps_per_generation` share;
    /// metrics `loss`, `ssd/cross_entropy_loss`, `ssd/active_sample_ratio` and the step's
    /// completion and reward metrics (with the filter, TRL's `completions/mean_length`,
    /// `min_length` and `max_length` count a filtered completion as 0 tokens).
    pub(crate) fn ssd_step(&mut self, s: &Scored, t0: Instant) -> Result<Metrics> {
        let r = &s.rollouts;
        let eos = self.tokenizer.eos_token_ids.clone();
        let mut batch = StepBatch::new(s, &eos, self.cfg.micro_batch(), false);
        if self.cfg.ssd.filter_empty {
            for (k, c) in batch.keep.iter_mut().zip(&r.completions) {
                *k &= !is_stub(&c.text);
            }
        }
        let n = batch.keep.len().max(1) as f64;
        let active = (0..batch.keep.len())
            .filter(|&i| batch.keep[i] && batch.lens[i] > 0)
            .count() as f64
            / n;
        let pad = self.tokenizer.pad_token_id;
        let mut ce: Vec<Tensor> = Vec::new();
        let (loss, grad_norm, lr) = self.chunked_updates(&batch.chunks, r.batch.step, |l, c| {
            let (a, b) = c.range;
            let (p, x) = (&batch.prompts[a..b], &batch.completions[a..b]);
            let (lp, _, width) = completion_logps(&l.policy.model, pad, p, x, 1.0, false)?;
            let mask = batch.mask(a, b, width, &l.device)?;
            let tokens = mask.sum_all()?.maximum(1f64)?;
            let summed = (lp.to_dtype(DType::F32)?.neg()? * &mask)?.sum_all()?;
            let nll = (summed / tokens)?;
            ce.push(nll.detach().to_dtype(DType::F64)?);
            Ok((nll / c.update.len().max(1) as f64)?)
        })?;
        self.state.step = r.batch.step + 1;
        let mut m = Metrics::new();
        m.insert("loss".into(), loss);
        let ce = match ce.is_empty() {
            true => 0.0,
            false => Tensor::stack(&ce, 0)?.mean_all()?.to_scalar::<f64>()?,
        };
        m.insert("ssd/cross_entropy_loss".into(), ce);
        m.insert("ssd/active_sample_ratio".into(), active);
        self.end_step(
            s,
            &batch,
            &OffPolicyStats::default(),
            (grad_norm, lr),
            t0,
            &mut m,
        );
        if self.cfg.ssd.filter_empty {
            // TRL logs the lengths of the completion masks after the filter zeroed them.
            let lens: Vec<f64> = (0..batch.keep.len())
                .map(|i| {
                    if batch.keep[i] {
                        batch.lens[i] as f64
                    } else {
                        0.0
                    }
                })
                .collect();
            let min = lens.iter().copied().fold(f64::INFINITY, f64::min);
            let max = lens.iter().copied().fold(0.0, f64::max);
            m.insert(
                "completions/mean_length".into(),
                lens.iter().sum::<f64>() / n,
            );
            m.insert("completions/min_length".into(), min);
            m.insert("completions/max_length".into(), max);
        }
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::is_stub;

    #[test]
    fn stubs_are_empty_or_short_single_lines_as_trls_filter() {
        for t in [
            "",
            "   \n\t",
            "return 1",
            "  x = 12345 ",
            "ééééééééé",
            "def f():\n",
        ] {
            assert!(is_stub(t), "{t:?}");
        }
        // Ten characters once stripped, or any second line, is kept.
        for t in [
            "return 10;",
            "  return 10; ",
            "a\nb",
            "def f():\n  return 1",
        ] {
            assert!(!is_stub(t), "{t:?}");
        }
    }
}
