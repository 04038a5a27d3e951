//! GOLD's step with the ULD loss (TRL's experimental GOLDTrainer, `gold.use_uld_loss`): the
//! teacher has a tokenizer of its own, so it reads each completion as text. The student's
//! prompt and completion are decoded (special tokens kept, as TRL's on-policy batches carry
//! them); the teacher's input is its tokenizer's encoding of the prompt text (its special
//! tokens added, a trailing EOS dropped) and of the completion text, then its EOS. Each side's
//! byte offsets in the completion text come from its tokens' byte-level pieces (TRL's
//! `piece_byte_len`; the teacher's EOS at the text's end), and `grpo_core::uld` aligns the two
//! tokenisations and compares the sorted distributions. The loss is the completions' mean
//! (with `uld_crossentropy_weight` the student's token cross-entropy added), per optimizer
//! update.

use anyhow::{Context, Result, bail};
use candle_core::{DType, Device, Tensor};
use grpo_core::uld::{UldSide, uld_loss};
use grpo_rollout::tokenizer::Tokenizer;

use super::Learner;
use super::batch::{StepBatch, padded_batch};
use super::distill::DistillPart;

impl Learner {
    /// ULD's summed loss over micro-batch `[a, b)` (each completion's share of the mean, with
    /// `model`'s graph), the student's entropy, its tokens, and the hybrid loss's parts.
    pub(crate) fn uld_part(
        &self,
        model: &grpo_rollout::Transformer,
        teacher: Option<&grpo_rollout::Transformer>,
        batch: &StepBatch<'_>,
        a: usize,
        b: usize,
    ) -> Result<DistillPart> {
        let (ttok, cfg) = self.gold.as_ref().context("GOLD's ULD state")?;
        let teacher = teacher.context("GOLD's ULD needs a local teacher")?;
        let (p, x) = (&batch.prompts[a..b], &batch.completions[a..b]);
        // The teacher's sequences: its encoding of the student's texts.
        let mut tp = Vec::with_capacity(p.len());
        let mut tx = Vec::with_capacity(p.len());
        let mut t_offsets = Vec::with_capacity(p.len());
        let mut s_offsets = Vec::with_capacity(p.len());
        let teos = *ttok
            .eos_token_ids
            .first()
            .context("GOLD: the teacher's tokenizer has no EOS token")?;
        for (pr, co) in p.iter().zip(x) {
            let prompt = self.tokenizer.decode(pr, false)?;
            let text = self.tokenizer.decode(co, false)?;
            let mut ids = ttok.encode(&prompt, true)?;
            if ids.last() == Some(&teos) {
                ids.pop();
            }
            if ids.is_empty() {
                bail!("GOLD: the teacher's tokenizer gives the prompt {prompt:?} no token");
            }
            let mut comp = ttok.encode(&text, false)?;
            let mut offs = piece_offsets(ttok, &comp)?;
            comp.push(teos);
            offs.push((text.len(), text.len()));
            s_offsets.push(piece_offsets(&self.tokenizer, co)?);
            tp.push(ids);
            tx.push(comp);
            t_offsets.push(offs);
        }
        let (tp, txs): (Vec<&[u32]>, Vec<&[u32]>) = (
            tp.iter().map(Vec::as_slice).collect(),
            tx.iter().map(Vec::as_slice).collect(),
        );
        let s_rows = side_rows(model, self.tokenizer.pad_token_id, p, x, &self.device)?;
        let t_rows = side_rows(teacher, ttok.pad_token_id, &tp, &txs, teacher.device())?;
        let ce_weight = self.cfg.gold.uld_crossentropy_weight;
        let mut samples = Vec::with_capacity(p.len());
        let (mut ce, mut ent, mut tokens) = (Vec::new(), 0.0, 0.0);
        let rows = x.iter().zip(s_rows.iter().zip(&t_rows));
        let teacher_sides = s_offsets.into_iter().zip(tx.into_iter().zip(t_offsets));
        for ((co, (sh, th)), (so, (tids, to))) in rows.zip(teacher_sides) {
            let zs = model.logits(sh)?;
            let zt = teacher
                .logits(&th.detach())?
                .detach()
                .to_device(zs.device())?;
            // The rows that predict the completion's tokens: entropy, cross-entropy.
            let n = co.len();
            let pred = zs.narrow(0, 0, n)?.to_dtype(DType::F32)?;
            ent += grpo_core::logprobs::entropy_from_logits(&pred.detach())?
                .to_dtype(DType::F64)?
                .sum_all()?
                .to_scalar::<f64>()?;
            if ce_weight > 0.0 {
                let ids = Tensor::new(*co, zs.device())?;
                let lp = grpo_core::logprobs::selective_log_softmax(&pred, &ids)?;
                ce.push(lp.sum_all()?.neg()?);
            }
            tokens += n as f64;
            let s_side = UldSide {
                logits: zs,
                ids: co.to_vec(),
                offsets: so,
            };
            let t_side = UldSide {
                logits: zt,
                ids: tids,
                offsets: to,
            };
            samples.push((s_side, t_side));
        }
        let out = uld_loss(&samples, cfg)?;
        let m = x.len() as f64;
        // Each completion's share: the micro-batch's mean times its completions.
        let mut loss = (out.loss * m)?;
        if !ce.is_empty() && tokens > 0.0 {
            // TRL's cross-entropy: the mean over the micro-batch's completion tokens.
            let ce = (Tensor::stack(&ce, 0)?.sum_all()? / tokens)?;
            let dt = loss.dtype();
            loss = (loss + (ce * (ce_weight * m))?.to_dtype(dt)?)?;
        }
        Ok(DistillPart {
            divergence: loss,
            entropy: ent,
            tokens,
            iw_opd: None,
            uld: out.matched.zip(out.unmatched),
        })
    }
}

/// Each sample's hidden rows at positions `start − 1 … start + n − 1` (`n + 1` rows: the
/// prompt's last position, then each completion token's), from one padded pass with a
/// padding column appended so the last completion token's row is among the scored ones.
fn side_rows(
    model: &grpo_rollout::Transformer,
    pad: u32,
    prompts: &[&[u32]],
    completions: &[&[u32]],
    device: &Device,
) -> Result<Vec<Tensor>> {
    let (ids, mask, c) = padded_batch(pad, prompts, completions, device)?;
    let bsz = ids.dim(0)?;
    let extra_ids = Tensor::full(pad, (bsz, 1), device)?;
    let extra_mask = Tensor::zeros((bsz, 1), mask.dtype(), device)?;
    let ids = Tensor::cat(&[&ids, &extra_ids], 1)?;
    let mask = Tensor::cat(&[&mask, &extra_mask], 1)?;
    let h = model.completion_hidden(&ids, &mask, c + 1)?;
    completions
        .iter()
        .enumerate()
        .map(|(k, co)| Ok(h.narrow(0, k * (c + 1), co.len() + 1)?))
        .collect()
}

/// The byte offsets of `ids` in their decoded text: each token's byte-level piece is one byte
/// per character (TRL's `piece_byte_len`), counted from the text's start.
fn piece_offsets(tok: &Tokenizer, ids: &[u32]) -> Result<Vec<(usize, usize)>> {
    let mut at = 0;
    ids.iter()
        .map(|&id| {
            let piece = tok
                .inner
                .id_to_token(id)
                .with_context(|| format!("GOLD: token id {id} is not in the tokenizer"))?;
            let n = piece.chars().count();
            let o = (at, at + n);
            at += n;
            Ok(o)
        })
        .collect()
}
