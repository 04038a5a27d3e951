//! Universal Logit Distillation (ULD), TRL 1.16's `GOLDTrainer` loss for a teacher whose
//! tokenizer differs from the student's: the two sides' next-token distributions over the same
//! answer text cannot be compared token by token, so each side's probabilities are sorted and
//! the sorted vectors compared (L1), position by position — after aligning the two
//! tokenisations by their byte offsets (`extended`), where a run of tokens on one side that
//! covers the same bytes as a run on the other becomes one position, its distribution the
//! chain rule's product (`observed`: the first position's distribution times the later
//! tokens' probabilities; `bayesian`: the last position's times the earlier ones'). The hybrid
//! loss compares the tokens both vocabularies hold directly (the generalized JSD of the
//! unnormalised probabilities) and sorts only the rest.
//!
//! A sample's side is its answer's tokens (EOS last), their byte offsets in the answer text and
//! the logits rows at positions `start − 1 … start + size − 1` (`size + 1` rows; `start` the
//! answer's first position): `observed` reads the rows at the answer positions, as TRL's
//! original ULD slicing, `bayesian` the rows that predict the answer tokens.

use std::collections::HashMap;

use candle_core::{D, DType, Result, Tensor, bail};

/// How a group of several tokens becomes one distribution (TRL's `uld_token_merge_strategy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MergeStrategy {
    /// The first position's distribution times the later tokens' probabilities; the logits
    /// rows at the answer positions.
    #[default]
    Observed,
    /// The last position's distribution times the earlier tokens' probabilities; the rows that
    /// predict the answer tokens.
    Bayesian,
}

/// One side (student or teacher) of one sample.
#[derive(Debug, Clone)]
pub struct UldSide {
    /// Logits `(size + 1, V)` at positions `start − 1 … start + size − 1`.
    pub logits: Tensor,
    /// The answer's tokens (EOS last).
    pub ids: Vec<u32>,
    /// Their byte offsets `(start, end)` in the answer text (EOS: `(len, len)`).
    pub offsets: Vec<(usize, usize)>,
}

/// The tokens both vocabularies hold (the same string), as (teacher id, student id) pairs
/// sorted by teacher id: the hybrid loss's direct correspondence.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct VocabMatch {
    /// Matched teacher ids, ascending.
    pub teacher: Vec<u32>,
    /// The student id of each.
    pub student: Vec<u32>,
}

impl VocabMatch {
    /// The match of two vocabularies (token string → id).
    pub fn new(student: &HashMap<String, u32>, teacher: &HashMap<String, u32>) -> Self {
        let mut pairs: Vec<(u32, u32)> = teacher
            .iter()
            .filter_map(|(tok, &t)| student.get(tok).map(|&s| (t, s)))
            .collect();
        pairs.sort_unstable();
        let (teacher, student) = pairs.into_iter().unzip();
        Self { teacher, student }
    }
}

/// The hybrid loss's settings (TRL's `uld_use_hybrid_loss`).
#[derive(Debug, Clone, PartialEq)]
pub struct Hybrid {
    /// The shared tokens.
    pub vocab: VocabMatch,
    /// The matched tokens' generalized JSD β (TRL's `beta`).
    pub beta: f64,
    /// (matched, unmatched) weights; `None`: the matched share of the teacher's vocabulary
    /// and its complement.
    pub weights: Option<(f64, f64)>,
}

/// ULD's settings (TRL's `uld_*` fields of GOLDConfig).
#[derive(Debug, Clone, PartialEq)]
pub struct UldConfig {
    /// Student softmax temperature.
    pub student_temperature: f64,
    /// Teacher softmax temperature.
    pub teacher_temperature: f64,
    /// Leave the student's last answer token (EOS) out.
    pub skip_student_eos: bool,
    /// Leave the teacher's last answer token (EOS) out.
    pub skip_teacher_eos: bool,
    /// Align by byte offsets (else position by position up to the shorter side).
    pub extended: bool,
    /// How multi-token groups merge.
    pub strategy: MergeStrategy,
    /// The distillation term's weight.
    pub distillation_weight: f64,
    /// The hybrid loss, or all tokens sorted.
    pub hybrid: Option<Hybrid>,
}

impl Default for UldConfig {
    fn default() -> Self {
        Self {
            student_temperature: 1.0,
            teacher_temperature: 1.0,
            skip_student_eos: true,
            skip_teacher_eos: true,
            extended: true,
            strategy: MergeStrategy::Observed,
            distillation_weight: 1.0,
            hybrid: None,
        }
    }
}

/// A batch's ULD loss and, with the hybrid loss, its parts' means over the samples.
#[derive(Debug)]
pub struct UldLoss {
    /// `distillation_weight ×` the mean over the samples of each one's aligned loss.
    pub loss: Tensor,
    /// The matched tokens' JSD, averaged over the samples (hybrid only).
    pub matched: Option<f64>,
    /// The unmatched tokens' sorted L1, averaged over the samples (hybrid only).
    pub unmatched: Option<f64>,
}

/// TRL's `_align_by_byte_offsets`: walks both sides' byte offsets, advancing the side whose
/// token ends first; a group closes where both end on the same byte. What is left over makes
/// one last group on each side.
pub fn align_by_byte_offsets(
    s: &[(usize, usize)],
    t: &[(usize, usize)],
) -> (Vec<Vec<usize>>, Vec<Vec<usize>>) {
    let (mut sg, mut tg) = (Vec::new(), Vec::new());
    let (mut s0, mut t0, mut i, mut j) = (0, 0, 0, 0);
    while i < s.len() && j < t.len() {
        let (se, te) = (s[i].1, t[j].1);
        if se < te {
            i += 1;
        } else if se > te {
            j += 1;
        } else {
            i += 1;
            j += 1;
            sg.push((s0..i).collect());
            tg.push((t0..j).collect());
            (s0, t0) = (i, j);
        }
    }
    if i < s.len() || j < t.len() {
        sg.push((s0..s.len()).collect());
        tg.push((t0..t.len()).collect());
    }
    (sg, tg)
}

/// The batch's ULD loss over `samples` (student side, teacher side), with the student's
/// gradient (the teacher's logits are detached).
///
/// # Errors
/// A side whose logits are not `(answer length + 1, V)` rows or whose offsets do not match its
/// tokens; sides that end up of different lengths (positional alignment cannot, byte alignment
/// with no common boundary can).
pub fn uld_loss(samples: &[(UldSide, UldSide)], cfg: &UldConfig) -> Result<UldLoss> {
    if samples.is_empty() {
        bail!("uld_loss: no samples");
    }
    let (mut losses, mut matched, mut unmatched) = (Vec::new(), Vec::new(), Vec::new());
    for (k, (s, t)) in samples.iter().enumerate() {
        for (what, side) in [("student", s), ("teacher", t)] {
            let rows = side.logits.dim(0)?;
            if rows != side.ids.len() + 1 || (cfg.extended && side.offsets.len() != side.ids.len())
            {
                bail!(
                    "uld_loss: sample {k}'s {what} side has {rows} logits rows, {} tokens and {} \
                     offsets (rows must be tokens + 1)",
                    side.ids.len(),
                    side.offsets.len()
                );
            }
        }
        let size_s = s
            .ids
            .len()
            .saturating_sub(usize::from(cfg.skip_student_eos));
        let size_t = t
            .ids
            .len()
            .saturating_sub(usize::from(cfg.skip_teacher_eos));
        if size_s == 0 || size_t == 0 {
            losses.push((s.logits.sum_all()? * 0.0)?);
            continue;
        }
        let first = match cfg.strategy {
            MergeStrategy::Observed => 1,
            MergeStrategy::Bayesian => 0,
        };
        let ps = softmax(&s.logits.narrow(0, first, size_s)?, cfg.student_temperature)?;
        let pt = softmax(
            &t.logits.detach().narrow(0, first, size_t)?,
            cfg.teacher_temperature,
        )?;
        let (sa, ta) = if cfg.extended {
            let (sg, tg) = align_by_byte_offsets(&s.offsets[..size_s], &t.offsets[..size_t]);
            let (sg, tg): (Vec<_>, Vec<_>) = sg
                .into_iter()
                .zip(tg)
                .filter(|(a, b)| !a.is_empty() && !b.is_empty())
                .unzip();
            (
                merge_groups(&ps, &sg, &s.ids[..size_s], cfg.strategy)?,
                merge_groups(&pt, &tg, &t.ids[..size_t], cfg.strategy)?,
            )
        } else {
            let m = size_s.min(size_t);
            (ps.narrow(0, 0, m)?, pt.narrow(0, 0, m)?)
        };
        if sa.dim(0)? != ta.dim(0)? {
            bail!(
                "uld_loss: sample {k} aligns {} student positions with {} teacher positions",
                sa.dim(0)?,
                ta.dim(0)?
            );
        }
        let loss = match &cfg.hybrid {
            None => sorted_l1(&sa, &ta)?,
            Some(h) => {
                let (total, m, u) = hybrid_loss(&sa, &ta, h)?;
                matched.push(m);
                unmatched.push(u);
                total
            }
        };
        losses.push(loss);
    }
    let n = losses.len() as f64;
    let loss = ((Tensor::stack(&losses, 0)?.sum_all()? / n)? * cfg.distillation_weight)?;
    let mean = |v: &[f64]| (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64);
    Ok(UldLoss {
        loss,
        matched: mean(&matched),
        unmatched: mean(&unmatched),
    })
}

/// `softmax(z / T)` per row, in f32 (f64 for f64 input).
fn softmax(z: &Tensor, temperature: f64) -> Result<Tensor> {
    crate::distill::log_softmax(z, temperature)?.exp()
}

/// TRL's `_merge_probabilities_with_alignment_groups`: one row per group, a group of several
/// positions its base row (the first, or with `bayesian` the last) times the probabilities of
/// the other positions' own tokens (each at least 1e-8). No groups: `probs` as it is.
fn merge_groups(
    probs: &Tensor,
    groups: &[Vec<usize>],
    ids: &[u32],
    strategy: MergeStrategy,
) -> Result<Tensor> {
    if groups.is_empty() {
        return Ok(probs.clone());
    }
    let rows = groups
        .iter()
        .map(|g| {
            let (base, rest): (usize, Vec<usize>) = match strategy {
                MergeStrategy::Observed => (g[0], g[1..].to_vec()),
                MergeStrategy::Bayesian => (g[g.len() - 1], g[..g.len() - 1].to_vec()),
            };
            let mut row = probs.get(base)?;
            for i in rest {
                let p = probs.get(i)?.get(ids[i] as usize)?.maximum(1e-8)?;
                row = row.broadcast_mul(&p)?;
            }
            Ok(row)
        })
        .collect::<Result<Vec<_>>>()?;
    Tensor::stack(&rows, 0)
}

/// Each row sorted descending, the narrower side padded with zeros: `Σ |s − t| / rows`.
fn sorted_l1(s: &Tensor, t: &Tensor) -> Result<Tensor> {
    // The order is found on the CPU (candle's CUDA arg-sort holds a row in one block's shared
    // memory: up to 8,192 columns), the gather (and its gradient) runs where the rows are.
    let sort = |x: &Tensor| -> Result<Tensor> {
        let cpu = candle_core::Device::Cpu;
        let idx = x
            .detach()
            .to_device(&cpu)?
            .contiguous()?
            .arg_sort_last_dim(false)?;
        x.contiguous()?
            .gather(&idx.to_device(x.device())?, D::Minus1)
    };
    let (mut a, mut b) = (sort(s)?, sort(&t.to_dtype(s.dtype())?)?);
    let (va, vb) = (a.dim(1)?, b.dim(1)?);
    let pad = |x: Tensor, n: usize| -> Result<Tensor> {
        match n {
            0 => Ok(x),
            _ => {
                let z = Tensor::zeros((x.dim(0)?, n), x.dtype(), x.device())?;
                Tensor::cat(&[&x, &z], 1)
            }
        }
    };
    a = pad(a, vb.saturating_sub(va))?;
    b = pad(b, va.saturating_sub(vb))?;
    (a - b)?.abs()?.sum_all()? / s.dim(0)? as f64
}

/// TRL's `_compute_hybrid_uld_loss`: the matched tokens' generalized JSD of the probabilities
/// (GOLD's `logits_are_probs`: `log max(p, 1e−8)`, not renormalised; summed and divided by the
/// rows), the other tokens' sorted L1, weighted. Returns (total, matched, unmatched).
fn hybrid_loss(s: &Tensor, t: &Tensor, h: &Hybrid) -> Result<(Tensor, f64, f64)> {
    let (vs, vt) = (s.dim(1)?, t.dim(1)?);
    let dev = s.device();
    let pairs: Vec<(u32, u32)> = h
        .vocab
        .teacher
        .iter()
        .zip(&h.vocab.student)
        .filter(|&(&a, &b)| (a as usize) < vt && (b as usize) < vs)
        .map(|(&a, &b)| (a, b))
        .collect();
    let rows = s.dim(0)? as f64;
    let t = t.to_dtype(s.dtype())?;
    let zero = || Tensor::zeros((), s.dtype(), dev);
    let matched = if pairs.is_empty() {
        zero()
    } else {
        let ti = Tensor::new(pairs.iter().map(|p| p.0).collect::<Vec<_>>(), dev)?;
        let si = Tensor::new(pairs.iter().map(|p| p.1).collect::<Vec<_>>(), dev)?;
        let ls = s.index_select(&si, 1)?.maximum(1e-8)?.log()?;
        let lt = t.index_select(&ti, 1)?.maximum(1e-8)?.log()?;
        prob_jsd(&ls, &lt, h.beta)?.sum_all()? / rows
    }?;
    let unmatched_cols = |v: usize, used: &[u32]| -> Vec<u32> {
        let mut keep = vec![true; v];
        for &u in used {
            keep[u as usize] = false;
        }
        (0..v as u32).filter(|&i| keep[i as usize]).collect()
    };
    let tu = unmatched_cols(vt, &pairs.iter().map(|p| p.0).collect::<Vec<_>>());
    let su = unmatched_cols(vs, &pairs.iter().map(|p| p.1).collect::<Vec<_>>());
    let unmatched = if tu.is_empty() || su.is_empty() {
        zero()?
    } else {
        sorted_l1(
            &s.index_select(&Tensor::new(su, dev)?, 1)?,
            &t.index_select(&Tensor::new(tu, dev)?, 1)?,
        )?
    };
    let (wm, wu) = h.weights.unwrap_or_else(|| {
        let w = pairs.len() as f64 / vt.max(1) as f64;
        (w, 1.0 - w)
    });
    let total = ((&matched * wm)? + (&unmatched * wu)?)?;
    let f = |x: &Tensor| -> Result<f64> { x.to_dtype(DType::F64)?.to_scalar::<f64>() };
    Ok((total, f(&matched)?, f(&unmatched)?))
}

/// GOLD's generalized JSD of log-probabilities `ls`, `lt`, element by element (torch's
/// `kl_div` with `log_target`): β 0 `p_t (log p_t − log p_s)`, β 1 `p_s (log p_s − log p_t)`,
/// between the mixture `log((1 − β) p_s + β p_t)`.
fn prob_jsd(ls: &Tensor, lt: &Tensor, beta: f64) -> Result<Tensor> {
    let kl =
        |target: &Tensor, input: &Tensor| -> Result<Tensor> { target.exp()? * (target - input)? };
    if beta == 0.0 {
        return kl(lt, ls);
    }
    if beta == 1.0 {
        return kl(ls, lt);
    }
    let a = (ls + (-beta).ln_1p())?;
    let b = (lt + beta.ln())?;
    let hi = a.maximum(&b)?.detach();
    let lm = (&hi + ((&a - &hi)?.exp()? + (&b - &hi)?.exp()?)?.log()?)?;
    (kl(lt, &lm)? * beta)? + (kl(ls, &lm)? * (1.0 - beta))?
}
