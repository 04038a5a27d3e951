//! On-policy distillation (TRL 1.16's `DistillationTrainer`): the divergence between the
//! student's and the teacher's next-token distributions at each completion token.
//!
//! With `p_s = softmax(z_s / T)`, `p_t = softmax(z_t / T)` and `β`:
//! * `β = 0`: the forward KL `KL(p_t ‖ p_s)`;
//! * `β = 1`: the reverse KL `KL(p_s ‖ p_t)`;
//! * otherwise the generalized Jensen-Shannon divergence with the mixture
//!   `m = (1 − β) p_s + β p_t`: `β KL(p_t ‖ m) + (1 − β) KL(p_s ‖ m)`.
//!
//! The gradient flows to the student's logits only (the teacher's are detached).
//!
//! [`iw_opd_advantages`] is TRL's IW-OPD sampled-token objective's weighting.
//!
//! [`topk_divergence`] is TRL's SDPO `topk_logits` approximation: the same divergence over the
//! student's `k` most likely tokens only (both distributions renormalised there, or with one
//! more bucket holding the rest of each one's mass).
//!
//! [`Divergence::Sparse`] is TRL's `loss_top_k` (IW-OPD, server distillation): the divergence
//! over a small support — the teacher's top k (forward KL), the student's (reverse KL), their
//! union (between), or at `k = 1` with `β > 0` the teacher's top token and the sampled (or the
//! student's arg-max) token — renormalised or with a tail bucket. With a teacher on a server
//! ([`ServedRows`]: its top-k log-probs and the sampled token's) the forward KL takes the
//! served top k and `β > 0` the top-1 support.

use candle_core::{D, DType, Result, Tensor};

/// The per-token divergence `(N,)` of student logits `(N, V)` from teacher logits `(N, V)`
/// (see the module), in f32 (f64 for f64 input), with the student's gradient.
///
/// # Errors
/// Shapes that differ, or `β` outside `[0, 1]`, or a temperature that is not positive.
pub fn generalized_jsd(
    student_logits: &Tensor,
    teacher_logits: &Tensor,
    beta: f64,
    temperature: f64,
) -> Result<Tensor> {
    check_pair(
        "generalized_jsd",
        student_logits,
        teacher_logits,
        beta,
        temperature,
    )?;
    let ls = log_softmax(student_logits, temperature)?;
    let lt = log_softmax(&teacher_logits.detach(), temperature)?;
    // Σ_v p_a (log p_a − log p_b): KL(p_a ‖ p_b) per row.
    let kl =
        |la: &Tensor, lb: &Tensor| -> Result<Tensor> { (la.exp()? * (la - lb)?)?.sum(D::Minus1) };
    if beta == 0.0 {
        return kl(&lt, &ls);
    }
    if beta == 1.0 {
        return kl(&ls, &lt);
    }
    // log m = logaddexp(log p_s + log(1 − β), log p_t + log β), stably.
    let a = (&ls + (1.0 - beta).ln())?;
    let b = (&lt + beta.ln())?;
    let hi = a.maximum(&b)?;
    let lm = (&hi + ((&a - &hi)?.exp()? + (&b - &hi)?.exp()?)?.log()?)?;
    (kl(&lt, &lm)? * beta)? + (kl(&ls, &lm)? * (1.0 - beta))?
}

/// Which divergence a distillation step takes at each token (see the module).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Divergence {
    /// [`generalized_jsd`] over the whole vocabulary.
    Full {
        /// 0 forward KL, 1 reverse KL, between the generalized JSD.
        beta: f64,
    },
    /// [`topk_divergence`]: over the student's `k` most likely tokens.
    TopK {
        /// How many of the student's tokens make the support.
        k: usize,
        /// As [`Divergence::Full`]'s.
        beta: f64,
        /// One more category holding the mass outside the support (else both renormalised).
        add_tail: bool,
    },
    /// TRL's `loss_top_k` support (IW-OPD's and server distillation's `jsd` objective): with
    /// `β > 0` and `k = 1` the teacher's top token and `reverse`'s token (the second dropped
    /// where they are one); otherwise the teacher's top `k` at `β = 0`, the student's at
    /// `β = 1`, their union between; `k` at least the vocabulary is [`Divergence::Full`].
    Sparse {
        /// The support's size per side (TRL's `loss_top_k`, at least 1).
        k: usize,
        /// As [`Divergence::Full`]'s.
        beta: f64,
        /// One more category holding the mass outside the support (TRL's `loss_add_tail`).
        add_tail: bool,
        /// The reverse side's token of the top-1 support (TRL's `reverse_kl_top_1_mode`).
        reverse: ReverseTop1,
    },
}

/// Which token stands for the student in [`Divergence::Sparse`]'s top-1 support.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReverseTop1 {
    /// The completion's own (sampled) token.
    #[default]
    Sampled,
    /// The student's most likely token.
    Argmax,
}

/// A teacher on a server, row by row: its `K` most likely tokens `top_ids` `(N, K)` (u32) with
/// their log-probs `top_logps` `(N, K)` (`−inf` where the server gave fewer), and its log-prob
/// of the row's own token `actual` `(N,)`.
#[derive(Debug, Clone)]
pub struct ServedRows {
    /// The teacher's top-`K` token ids, most likely first.
    pub top_ids: Tensor,
    /// Their log-probs (`−inf`: absent).
    pub top_logps: Tensor,
    /// The teacher's log-prob of each row's own token.
    pub actual: Tensor,
}

impl ServedRows {
    /// Rows `[start, start + n)`.
    pub fn narrow(&self, start: usize, n: usize) -> Result<Self> {
        Ok(Self {
            top_ids: self.top_ids.narrow(0, start, n)?,
            top_logps: self.top_logps.narrow(0, start, n)?,
            actual: self.actual.narrow(0, start, n)?,
        })
    }

    /// On `device`.
    pub fn to_device(&self, device: &candle_core::Device) -> Result<Self> {
        Ok(Self {
            top_ids: self.top_ids.to_device(device)?,
            top_logps: self.top_logps.to_device(device)?,
            actual: self.actual.to_device(device)?,
        })
    }
}

/// What a distillation step knows of the teacher at each row.
#[derive(Debug, Clone, Copy)]
pub enum TeacherRows<'a> {
    /// Its logits `(N, V)`.
    Logits(&'a Tensor),
    /// Its top-k and own-token log-probs from a server.
    Served(&'a ServedRows),
}

impl From<f64> for Divergence {
    /// The full-vocabulary divergence at `beta`.
    fn from(beta: f64) -> Self {
        Divergence::Full { beta }
    }
}

impl Divergence {
    /// The per-token divergence `(N,)` of student logits `(N, V)` from teacher logits `(N, V)`
    /// at `temperature`, with the student's gradient.
    pub fn of(
        &self,
        student_logits: &Tensor,
        teacher_logits: &Tensor,
        temperature: f64,
    ) -> Result<Tensor> {
        self.of_rows(
            student_logits,
            TeacherRows::Logits(teacher_logits),
            None,
            temperature,
        )
    }

    /// [`Self::of`] against either kind of teacher rows, with each row's own token `tokens`
    /// `(N,)` (u32; [`Divergence::Sparse`]'s sampled top-1 support needs them).
    ///
    /// # Errors
    /// Besides [`Self::of`]'s: a served teacher with a divergence other than
    /// [`Divergence::Sparse`] (a server gives no whole distribution), or with `β > 0` and
    /// `k ≠ 1`, or an arg-max reverse token (the server scored only the sampled one); the
    /// sampled top-1 support without `tokens`.
    pub fn of_rows(
        &self,
        student_logits: &Tensor,
        teacher: TeacherRows<'_>,
        tokens: Option<&Tensor>,
        temperature: f64,
    ) -> Result<Tensor> {
        let teacher_logits = match teacher {
            TeacherRows::Logits(t) => t,
            TeacherRows::Served(served) => {
                return match *self {
                    Divergence::Sparse {
                        k,
                        beta,
                        add_tail,
                        reverse,
                    } => served_divergence(
                        student_logits,
                        served,
                        tokens,
                        (k, beta, add_tail, reverse),
                        temperature,
                    ),
                    _ => candle_core::bail!(
                        "a teacher on a server gives top-k log-probs only: its divergence must be \
                         the sparse one (loss_top_k)"
                    ),
                };
            }
        };
        match *self {
            Divergence::Full { beta } => {
                generalized_jsd(student_logits, teacher_logits, beta, temperature)
            }
            Divergence::TopK { k, beta, add_tail } => topk_divergence(
                student_logits,
                teacher_logits,
                k,
                beta,
                add_tail,
                temperature,
            ),
            Divergence::Sparse {
                k,
                beta,
                add_tail,
                reverse,
            } => sparse_divergence(
                student_logits,
                teacher_logits,
                tokens,
                (k, beta, add_tail, reverse),
                temperature,
            ),
        }
    }
}

/// [`Divergence::Sparse`]'s settings: `(k, β, add_tail, reverse)`.
type SparseSettings = (usize, f64, bool, ReverseTop1);

/// TRL's `generalized_jsd_loss` with `top_k` (IW-OPD's local path), per row `(N,)`, and its
/// mixed top-1 path (`β > 0`, `k = 1`): see [`Divergence::Sparse`]. The student's gradient only.
///
/// # Errors
/// Shapes that differ, `k` = 0, `β` outside `[0, 1]`, a temperature that is not positive, the
/// sampled top-1 support without `tokens`.
pub fn sparse_divergence(
    student_logits: &Tensor,
    teacher_logits: &Tensor,
    tokens: Option<&Tensor>,
    (k, beta, add_tail, reverse): SparseSettings,
    temperature: f64,
) -> Result<Tensor> {
    check_pair(
        "sparse_divergence",
        student_logits,
        teacher_logits,
        beta,
        temperature,
    )?;
    let (n, v) = student_logits.dims2()?;
    if k == 0 {
        candle_core::bail!("sparse_divergence: k must be at least 1 (0 is the full vocabulary)");
    }
    let top1 = beta > 0.0 && k == 1;
    if !top1 && k >= v {
        return generalized_jsd(student_logits, teacher_logits, beta, temperature);
    }
    let ls = log_softmax(student_logits, temperature)?;
    let lt = log_softmax(&teacher_logits.detach(), temperature)?;
    let (support, valid) = if top1 {
        let rev = reverse_tokens(&ls, tokens, reverse)?;
        top1_support(&topk_indices(&lt, 1)?.squeeze(1)?, &rev, beta)?
    } else if beta == 0.0 {
        let s = topk_indices(&lt, k)?;
        let ones = Tensor::ones((n, k), ls.dtype(), ls.device())?;
        (s, ones)
    } else if beta == 1.0 {
        let s = topk_indices(&ls, k)?;
        let ones = Tensor::ones((n, k), ls.dtype(), ls.device())?;
        (s, ones)
    } else {
        union_support(&topk_indices(&lt, k)?, &topk_indices(&ls, k)?, ls.dtype())?
    };
    let lt_s = lt.gather(&support, D::Minus1)?;
    support_divergence(&ls, &support, &valid, &lt_s, beta, add_tail)
}

/// TRL's server paths (its `ServerDistillationTrainer`, IW-OPD's `jsd` with a teacher server):
/// at `β = 0` the forward KL over the served top `K` (the student's log-probs gathered there;
/// the ones the server left out dropped), at `β > 0` (with `k = 1`) the top-1 support of the
/// served top token and the sampled token (the teacher's log-prob of it: `actual`), per row
/// `(N,)`. The student's gradient only.
///
/// # Errors
/// `β > 0` with `k ≠ 1`; an arg-max reverse token; no `tokens` at `β > 0`; shapes that do not
/// match; a row whose served top token is missing.
pub fn served_divergence(
    student_logits: &Tensor,
    served: &ServedRows,
    tokens: Option<&Tensor>,
    (k, beta, add_tail, reverse): SparseSettings,
    temperature: f64,
) -> Result<Tensor> {
    let (n, _) = student_logits.dims2()?;
    let (sn, sk) = served.top_ids.dims2()?;
    if sn != n || served.top_logps.dims() != [n, sk] || served.actual.dims() != [n] || sk == 0 {
        candle_core::bail!(
            "served_divergence: {n} student rows against served top ids {:?}, log-probs {:?}, \
             own-token log-probs {:?}",
            served.top_ids.dims(),
            served.top_logps.dims(),
            served.actual.dims()
        );
    }
    if !((0.0..=1.0).contains(&beta) && temperature > 0.0 && temperature.is_finite()) {
        candle_core::bail!(
            "served_divergence: beta {beta} must be in [0, 1], temperature {temperature} > 0"
        );
    }
    let ls = log_softmax(student_logits, temperature)?;
    let dt = ls.dtype();
    let top = served.top_logps.detach().to_dtype(dt)?;
    let present = top.ne(f64::NEG_INFINITY)?;
    let first = present.narrow(1, 0, 1)?.to_dtype(DType::F32)?.min_all()?;
    if first.to_scalar::<f32>()? < 1.0 {
        candle_core::bail!("served_divergence: a row without the teacher's top token");
    }
    let zeros = top.zeros_like()?;
    let top = present.where_cond(&top, &zeros)?;
    if beta == 0.0 {
        let kk = k.clamp(1, sk);
        let support = served.top_ids.narrow(1, 0, kk)?.contiguous()?;
        let valid = present.narrow(1, 0, kk)?.to_dtype(dt)?;
        return support_divergence(
            &ls,
            &support,
            &valid,
            &top.narrow(1, 0, kk)?,
            beta,
            add_tail,
        );
    }
    if k != 1 || reverse != ReverseTop1::Sampled {
        candle_core::bail!(
            "served_divergence: with beta > 0 a served teacher gives the top-1 support of the \
             sampled token only (k = 1, reverse = sampled)"
        );
    }
    let rev = reverse_tokens(&ls, tokens, reverse)?;
    let t1 = served.top_ids.narrow(1, 0, 1)?.squeeze(1)?;
    let (support, valid) = top1_support(&t1, &rev, beta)?;
    let actual = served.actual.detach().to_dtype(dt)?;
    let actual = actual
        .ne(f64::NEG_INFINITY)?
        .where_cond(&actual, &actual.zeros_like()?)?;
    let lt_s = match beta == 1.0 {
        true => actual.unsqueeze(1)?,
        false => Tensor::stack(&[&top.narrow(1, 0, 1)?.squeeze(1)?, &actual], 1)?,
    };
    support_divergence(&ls, &support, &valid, &lt_s, beta, add_tail)
}

/// The reverse side's token per row `(N,)` u32: the given `tokens` or the student's arg-max.
fn reverse_tokens(ls: &Tensor, tokens: Option<&Tensor>, reverse: ReverseTop1) -> Result<Tensor> {
    match (reverse, tokens) {
        (ReverseTop1::Argmax, _) => ls.detach().argmax(D::Minus1),
        (ReverseTop1::Sampled, Some(t)) => {
            let n = ls.dim(0)?;
            if t.dims() != [n] {
                candle_core::bail!("sparse divergence: tokens {:?} for {n} rows", t.dims());
            }
            t.to_dtype(DType::U32)?.to_device(ls.device())
        }
        (ReverseTop1::Sampled, None) => {
            candle_core::bail!("the sampled top-1 support needs each row's own token (tokens)")
        }
    }
}

/// The top-1 support `(N, S)` and its validity: `[rev]` at `β = 1`, else `[teacher, rev]` with
/// `rev` dropped where it is the teacher's token.
fn top1_support(teacher_top: &Tensor, rev: &Tensor, beta: f64) -> Result<(Tensor, Tensor)> {
    let n = rev.dim(0)?;
    let dt = DType::F32;
    if beta == 1.0 {
        return Ok((
            rev.unsqueeze(1)?.contiguous()?,
            Tensor::ones((n, 1), dt, rev.device())?,
        ));
    }
    let teacher_top = teacher_top.to_device(rev.device())?;
    let support = Tensor::stack(&[&teacher_top, rev], 1)?;
    let distinct = teacher_top.ne(rev)?.to_dtype(dt)?;
    let valid = Tensor::stack(&[&Tensor::ones(n, dt, rev.device())?, &distinct], 1)?;
    Ok((support, valid))
}

/// The union of the teacher's and the student's top-k `(N, 2k)`: the student's tokens that are
/// among the teacher's marked invalid (TRL's deduplication).
fn union_support(teacher: &Tensor, student: &Tensor, dt: DType) -> Result<(Tensor, Tensor)> {
    let (n, k) = teacher.dims2()?;
    let dup = teacher
        .unsqueeze(2)?
        .broadcast_eq(&student.unsqueeze(1)?)?
        .to_dtype(dt)?
        .max(1)?;
    let valid = Tensor::cat(
        &[
            &Tensor::ones((n, k), dt, teacher.device())?,
            &dup.affine(-1.0, 1.0)?,
        ],
        1,
    )?;
    Ok((Tensor::cat(&[teacher, student], 1)?, valid))
}

/// The divergence per row over `support` `(N, S)`: the student's full log-probs `ls` `(N, V)`
/// gathered there, the teacher's `lt` `(N, S)` (finite everywhere), the entries where `valid`
/// `(N, S)` is 0 left out; both renormalised over the valid ones, or joined by a tail bucket
/// (TRL's `_add_tail_bucket`), then TRL's masked `_jsd_divergence`.
fn support_divergence(
    ls: &Tensor,
    support: &Tensor,
    valid: &Tensor,
    lt: &Tensor,
    beta: f64,
    add_tail: bool,
) -> Result<Tensor> {
    let dt = ls.dtype();
    let valid = valid.to_dtype(dt)?;
    let ls = ls.gather(&support.contiguous()?, D::Minus1)?;
    let lt = lt.detach().to_dtype(dt)?;
    let (ls, lt, valid) = match add_tail {
        true => {
            let ones = Tensor::ones((valid.dim(0)?, 1), dt, valid.device())?;
            (
                masked_tail(&ls, &valid)?,
                masked_tail(&lt, &valid)?,
                Tensor::cat(&[&valid, &ones], 1)?,
            )
        }
        false => (
            masked_renorm(&ls, &valid)?,
            masked_renorm(&lt, &valid)?,
            valid,
        ),
    };
    masked_jsd(&ls, &lt, &valid, beta)
}

/// `log Σ exp(l) · valid` per row `(N, 1)`, in f64.
fn masked_lse(l: &Tensor, valid: &Tensor) -> Result<Tensor> {
    (l.to_dtype(DType::F64)?.exp()? * valid.to_dtype(DType::F64)?)?
        .sum_keepdim(D::Minus1)?
        .log()
}

/// `l` renormalised over its valid entries.
fn masked_renorm(l: &Tensor, valid: &Tensor) -> Result<Tensor> {
    l.broadcast_sub(&masked_lse(l, valid)?.to_dtype(l.dtype())?)
}

/// `l` with one more column `log(1 − Σ_valid exp(l))`, the sum clamped at `exp(−1e−7)`.
fn masked_tail(l: &Tensor, valid: &Tensor) -> Result<Tensor> {
    let lse = masked_lse(l, valid)?.minimum(-1e-7)?;
    let tail = lse.exp()?.affine(-1.0, 1.0)?.log()?.to_dtype(l.dtype())?;
    Tensor::cat(&[l, &tail], D::Minus1)
}

/// TRL's masked `_jsd_divergence` summed per row: the invalid entries count as zero.
fn masked_jsd(ls: &Tensor, lt: &Tensor, valid: &Tensor, beta: f64) -> Result<Tensor> {
    let ls = (ls * valid)?;
    let lt = (lt * valid)?;
    let ps = (ls.exp()? * valid)?;
    let pt = (lt.exp()? * valid)?;
    if beta == 0.0 {
        return (&pt * (&lt - &ls)?)?.sum(D::Minus1);
    }
    if beta == 1.0 {
        return (&ps * (&ls - &lt)?)?.sum(D::Minus1);
    }
    let tiny = match ls.dtype() {
        DType::F64 => f64::MIN_POSITIVE,
        _ => f64::from(f32::MIN_POSITIVE),
    };
    let m = ((&ps * (1.0 - beta))? + (&pt * beta)?)?;
    let lm = (m.maximum(tiny)?.log()? * valid)?;
    let kt = (&pt * (&lt - &lm)?)?.sum(D::Minus1)?;
    let ks = (&ps * (&ls - &lm)?)?.sum(D::Minus1)?;
    (kt * beta)? + (ks * (1.0 - beta))?
}

/// The indices `(N, k)` (u32) of the `k` largest entries of each row of `x` `(N, V)`, largest
/// first (ties: the lowest index first): `k` passes of an arg-max, each masking the one it found,
/// so it runs on any device and any vocabulary size.
pub fn topk_indices(x: &Tensor, k: usize) -> Result<Tensor> {
    let (n, v) = x.dims2()?;
    if k == 0 || k > v {
        candle_core::bail!("topk_indices: k = {k} must be in 1..={v} (the row width)");
    }
    let dtype = match x.dtype() {
        DType::F64 => DType::F64,
        _ => DType::F32,
    };
    let mut rest = x.detach().to_dtype(dtype)?;
    let iota = Tensor::arange(0u32, v as u32, x.device())?
        .unsqueeze(0)?
        .broadcast_as((n, v))?;
    let gone = Tensor::full(f64::NEG_INFINITY, (n, v), x.device())?.to_dtype(dtype)?;
    let mut picked = Vec::with_capacity(k);
    for i in 0..k {
        let idx = rest.argmax_keepdim(D::Minus1)?;
        if i + 1 < k {
            let hit = iota.broadcast_eq(&idx)?;
            rest = hit.where_cond(&gone, &rest)?;
        }
        picked.push(idx);
    }
    Tensor::cat(&picked, 1)
}

/// TRL's SDPO `topk_logits` divergence `(N,)`: the student's `k` most likely tokens at each row
/// (of `student_logits / temperature`) make the support; the student's and the teacher's
/// log-probabilities there are renormalised over it — or, with `add_tail`, joined by one bucket
/// holding `1 − Σ_k p` of each (the sum clamped to at most `exp(−1e−7)`, as TRL) — and
/// [`generalized_jsd`] at `beta` is taken between the two small distributions. The gradient
/// flows to the student's logits only.
///
/// # Errors
/// Shapes that differ, `k` outside `1..=V`, `β` outside `[0, 1]`, a temperature that is not
/// positive.
pub fn topk_divergence(
    student_logits: &Tensor,
    teacher_logits: &Tensor,
    k: usize,
    beta: f64,
    add_tail: bool,
    temperature: f64,
) -> Result<Tensor> {
    check_pair(
        "topk_divergence",
        student_logits,
        teacher_logits,
        beta,
        temperature,
    )?;
    let idx = topk_indices(student_logits, k)?;
    let ls = log_softmax(student_logits, temperature)?.gather(&idx, D::Minus1)?;
    let lt = log_softmax(&teacher_logits.detach(), temperature)?.gather(&idx, D::Minus1)?;
    let (ls, lt) = match add_tail {
        true => (with_tail(&ls)?, with_tail(&lt)?),
        false => (ls, lt),
    };
    // Over the (renormalised, or tail-completed) support the log-softmax inside
    // `generalized_jsd` renormalises, or leaves a complete distribution as it is.
    generalized_jsd(&ls, &lt, beta, 1.0)
}

/// `log_probs` `(N, k)` with one more column `log(1 − Σ exp)`: the mass outside the support,
/// the sum clamped at `exp(−1e−7)` (TRL's `add_tail_bucket`), formed in f64.
fn with_tail(log_probs: &Tensor) -> Result<Tensor> {
    let dt = log_probs.dtype();
    let wide = log_probs.to_dtype(DType::F64)?;
    let hi = wide.max_keepdim(D::Minus1)?.detach();
    let lse = (wide
        .broadcast_sub(&hi)?
        .exp()?
        .sum_keepdim(D::Minus1)?
        .log()?
        + &hi)?;
    let lse = lse.minimum(-1e-7)?;
    // log(1 − e^s) = log(−expm1(s)); in f64 the cancellation costs ~1e−9 relative at s = −1e−7.
    let tail = (lse.exp()?.affine(-1.0, 1.0)?).log()?;
    Tensor::cat(&[wide, tail], D::Minus1)?.to_dtype(dt)
}

/// Two `(N, V)` logits of one shape, `β` in `[0, 1]`, a positive temperature.
fn check_pair(what: &str, s: &Tensor, t: &Tensor, beta: f64, temperature: f64) -> Result<()> {
    if s.dims() != t.dims() || s.rank() != 2 {
        candle_core::bail!(
            "{what}: student logits {:?} and teacher logits {:?}, expected two (N, V)",
            s.dims(),
            t.dims()
        );
    }
    if !((0.0..=1.0).contains(&beta) && temperature > 0.0 && temperature.is_finite()) {
        candle_core::bail!("{what}: beta {beta} must be in [0, 1], temperature {temperature} > 0");
    }
    Ok(())
}

/// `log_softmax(z / temperature)` over the last dimension, in f32 (f64 for f64 input).
pub(crate) fn log_softmax(z: &Tensor, temperature: f64) -> Result<Tensor> {
    let dtype = match z.dtype() {
        DType::F64 => DType::F64,
        _ => DType::F32,
    };
    let z = (z.to_dtype(dtype)? / temperature)?;
    let z = z.broadcast_sub(&z.max_keepdim(D::Minus1)?.detach())?;
    z.broadcast_sub(&z.exp()?.sum_keepdim(D::Minus1)?.log()?)
}

/// IW-OPD's per-token advantages (TRL's experimental `IWOPDTrainer`, importance-weighted
/// on-policy distillation): with `a = (log π_T − log π_rollout) · mask` at each sampled token
/// (`teacher_logps`, `rollout_logps`, `mask` all `(B, T)`), each row's weights
/// `w_t = 1 + γ (1 − Σ_{s<t} |a_s| / max(Σ_s |a_s|, ε))` — early tokens, before the row's
/// disagreement has been spent, weigh up to `1 + γ` — and the advantages `w · a`. Returns
/// `(advantages, weights, |a|)`, all `(B, T)` and without gradient; the loss is
/// `−log π · advantages` summed over the loss tokens.
pub fn iw_opd_advantages(
    teacher_logps: &Tensor,
    rollout_logps: &Tensor,
    mask: &Tensor,
    gamma: f64,
    epsilon: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    let a = ((teacher_logps.detach() - rollout_logps.detach())? * mask)?;
    let abs = a.abs()?;
    let prefix = (abs.cumsum(D::Minus1)? - &abs)?;
    let total = abs.sum_keepdim(D::Minus1)?.maximum(epsilon)?;
    let weights = ((prefix.broadcast_div(&total)?.affine(-1.0, 1.0)? * gamma)? + 1.0)?;
    let adv = (&weights * &a)?;
    Ok((adv, weights, abs))
}

/// MiniLLM's reverse-KL advantages (TRL's experimental `MiniLLMTrainer._compute_advantage`):
/// each sampled token's reward `r_t = (log π_T − log π_S) · mask` (`teacher_logps`,
/// `student_logps` and `mask` all `(B, T)`, the log-probs at the distillation temperature), and
///
/// * `gamma = 0`: the advantage is the reward itself;
/// * `gamma > 0`: `A_t = Σ_{i≥t} γ^i r_i`, the powers counted from the first completion token
///   as TRL's code does, divided with `length_normalization` by
///   `Σ_{i≥t} γ^i m_i` where `m_i` is the mask with padding counted `1e-4` (so the powers
///   cancel and `A_t` is the discounted mean of the rewards from `t` on). Formed on the host.
///
/// Returns `(B, T)` in the student log-probs' dtype (summed in f32 at least), without gradient.
///
/// # Errors
/// Shapes that differ, or `gamma` negative or not finite.
pub fn minillm_advantages(
    teacher_logps: &Tensor,
    student_logps: &Tensor,
    mask: &Tensor,
    gamma: f64,
    length_normalization: bool,
) -> Result<Tensor> {
    let dims = student_logps.dims();
    if teacher_logps.dims() != dims || mask.dims() != dims || dims.len() != 2 {
        candle_core::bail!(
            "minillm_advantages: teacher log-probs {:?}, student log-probs {dims:?} and mask {:?} must be one (B, T) shape",
            teacher_logps.dims(),
            mask.dims()
        );
    }
    if !(gamma.is_finite() && gamma >= 0.0) {
        candle_core::bail!("minillm_advantages: gamma must be >= 0, got {gamma}");
    }
    let out = student_logps.dtype();
    // Summed in f32 at least (f64 for f64 inputs).
    let dtype = match out {
        DType::F64 => DType::F64,
        _ => DType::F32,
    };
    let mask = mask.to_dtype(dtype)?;
    let rewards = ((teacher_logps.detach().to_dtype(dtype)?
        - student_logps.detach().to_dtype(dtype)?)?
        * &mask)?;
    if gamma == 0.0 {
        return rewards.to_dtype(out);
    }
    // The discounted sums by the backward recursion `S_t = x_t + γ S_{t+1}` (in f64 on the
    // host: exact at any length, where powers of γ from the first token would underflow).
    let (b, t) = (dims[0], dims[1]);
    let r: Vec<f64> = rewards.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
    let m: Vec<f64> = mask.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
    let mut adv = vec![0f64; b * t];
    for row in 0..b {
        let (mut num, mut den) = (0f64, 0f64);
        for i in (0..t).rev() {
            let k = row * t + i;
            num = r[k] + gamma * num;
            // Padding counts 1e-4 in the lengths, as TRL's.
            den = if m[k] < 0.5 { 1e-4 } else { m[k] } + gamma * den;
            adv[k] = match length_normalization {
                true => num / den,
                // TRL's powers count from the first completion token: A_t = γ^t S_t.
                false => gamma.powi(i as i32) * num,
            };
        }
    }
    Tensor::from_vec(adv, (b, t), rewards.device())?.to_dtype(out)
}
