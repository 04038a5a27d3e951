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
    if student_logits.dims() != teacher_logits.dims() || student_logits.rank() != 2 {
        candle_core::bail!(
            "generalized_jsd: student logits {:?} and teacher logits {:?}, expected two (N, V)",
            student_logits.dims(),
            teacher_logits.dims()
        );
    }
    if !((0.0..=1.0).contains(&beta) && temperature > 0.0 && temperature.is_finite()) {
        candle_core::bail!(
            "generalized_jsd: beta {beta} must be in [0, 1], temperature {temperature} > 0"
        );
    }
    let dtype = match student_logits.dtype() {
        DType::F64 => DType::F64,
        _ => DType::F32,
    };
    let log_softmax = |z: &Tensor| -> Result<Tensor> {
        let z = (z.to_dtype(dtype)? / temperature)?;
        let z = z.broadcast_sub(&z.max_keepdim(D::Minus1)?.detach())?;
        z.broadcast_sub(&z.exp()?.sum_keepdim(D::Minus1)?.log()?)
    };
    let ls = log_softmax(student_logits)?;
    let lt = log_softmax(&teacher_logits.detach())?;
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
