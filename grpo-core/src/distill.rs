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
        }
    }
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
fn log_softmax(z: &Tensor, temperature: f64) -> Result<Tensor> {
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
