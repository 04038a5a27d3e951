//! The clipped policy-gradient losses of GRPO and its variants, on candle tensors.
//!
//! [`policy_loss`] follows TRL 1.16's `GRPOTrainer._compute_loss` term by term, so that the same
//! inputs give the same loss, gradient and metrics:
//!
//! * ratio `ρ = exp(logp − old_logp)` per token, or per sequence
//!   `ρ_i = exp(Σ_t m·Δ / max(1, Σ_t m))` ([`ImportanceSamplingLevel::Sequence`], GSPO);
//! * grpo, bnpo, dr_grpo, dapo: `ℓ = −min(ρ′·A, clip(ρ, 1−ε_low, 1+ε_high)·A)`, `ρ′ = min(ρ, δ)`
//!   when `delta` is set; cispo: `ℓ = −stopgrad(min(ρ, ε_high))·A·logp`;
//! * β > 0: `KL_t = exp(ref − logp) − (ref − logp) − 1`, times `ρ` when
//!   `kl_importance_correction` (TRL's `use_bias_correction_kl`), and `ℓ += β·KL`;
//! * aggregation by [`LossType`].
//!
//! Gradients match PyTorch's, ties included: `clamp` passes the gradient on its closed
//! interval and `min` splits it evenly between equal arguments.

use candle_core::{DType, Result, Tensor};

/// How per-token losses are aggregated (TRL's `loss_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LossType {
    /// Mean over sequences of each sequence's token mean (the original GRPO; length-biased).
    Grpo,
    /// Token mean over the (micro-)batch.
    Bnpo,
    /// Token sum divided by `B · max_completion_length` (Dr. GRPO).
    DrGrpo,
    /// Token sum divided by the tokens of the whole generation batch (`num_items_in_batch`).
    #[default]
    Dapo,
    /// Clipped importance-sampling weights as constants times the log-prob (MiniMax-M1's CISPO);
    /// aggregated as dapo.
    Cispo,
}

impl std::str::FromStr for LossType {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "grpo" => Ok(Self::Grpo),
            "bnpo" => Ok(Self::Bnpo),
            "dr_grpo" => Ok(Self::DrGrpo),
            "dapo" => Ok(Self::Dapo),
            "cispo" => Ok(Self::Cispo),
            other => Err(format!(
                "unknown loss_type `{other}`: expected one of grpo, bnpo, dr_grpo, dapo, cispo"
            )),
        }
    }
}

#[cfg(feature = "serde")]
crate::serde_by_name!(LossType, "grpo, bnpo, dr_grpo, dapo or cispo");

impl LossType {
    /// TRL's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Grpo => "grpo",
            Self::Bnpo => "bnpo",
            Self::DrGrpo => "dr_grpo",
            Self::Dapo => "dapo",
            Self::Cispo => "cispo",
        }
    }
}

/// Whether the importance ratio is taken per token or per sequence (TRL's
/// `importance_sampling_level`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ImportanceSamplingLevel {
    /// One ratio per token.
    #[default]
    Token,
    /// One ratio per sequence: the exponential of the masked mean log-ratio (GSPO).
    Sequence,
}

impl std::str::FromStr for ImportanceSamplingLevel {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "token" => Ok(Self::Token),
            "sequence" => Ok(Self::Sequence),
            other => Err(format!(
                "unknown importance_sampling_level `{other}`: expected token or sequence"
            )),
        }
    }
}

impl ImportanceSamplingLevel {
    /// TRL's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Token => "token",
            Self::Sequence => "sequence",
        }
    }
}

#[cfg(feature = "serde")]
crate::serde_by_name!(ImportanceSamplingLevel, "token or sequence");

/// Options of [`policy_loss`]. `Default` is TRL 1.16's `GRPOConfig` defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct LossConfig {
    /// Aggregation and objective; default [`LossType::Dapo`].
    pub loss_type: LossType,
    /// Lower clipping bound `1 − epsilon_low` (TRL's `epsilon`); default 0.2.
    pub epsilon_low: f64,
    /// Upper clipping bound `1 + epsilon_high`; for cispo the cap on the ratio itself (ε_max);
    /// default 0.2.
    pub epsilon_high: f64,
    /// Two-sided GRPO: upper cap `δ` on the unclipped ratio; default none.
    pub delta: Option<f64>,
    /// KL coefficient; default 0.0 (no reference model needed).
    pub beta: f64,
    /// Multiply the KL estimate by the importance ratio (TRL's `use_bias_correction_kl`);
    /// default true.
    pub kl_importance_correction: bool,
    /// Token or sequence ratios; default token.
    pub importance_sampling_level: ImportanceSamplingLevel,
    /// The dr_grpo normaliser; default 512 (TRL's `max_completion_length`).
    pub max_completion_length: usize,
}

impl Default for LossConfig {
    fn default() -> Self {
        Self {
            loss_type: LossType::Dapo,
            epsilon_low: 0.2,
            epsilon_high: 0.2,
            delta: None,
            beta: 0.0,
            kl_importance_correction: true,
            importance_sampling_level: ImportanceSamplingLevel::Token,
            max_completion_length: 512,
        }
    }
}

impl LossConfig {
    /// Checks the values, naming the field to fix.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let finite_nonneg = |name: &str, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(format!("{name} must be a finite number >= 0, got {v}"))
            }
        };
        finite_nonneg("epsilon_low", self.epsilon_low)?;
        finite_nonneg("epsilon_high", self.epsilon_high)?;
        finite_nonneg("beta", self.beta)?;
        if self.epsilon_low >= 1.0 && self.loss_type != LossType::Cispo {
            return Err(format!(
                "epsilon_low must be < 1 (the lower clip bound is 1 - epsilon_low), got {}",
                self.epsilon_low
            ));
        }
        if let Some(d) = self.delta
            && !(d.is_finite() && d > 0.0)
        {
            return Err(format!("delta must be a finite number > 0, got {d}"));
        }
        if self.loss_type == LossType::DrGrpo && self.max_completion_length == 0 {
            return Err("max_completion_length must be >= 1 for loss_type dr_grpo".into());
        }
        Ok(())
    }
}

/// The tensors one loss evaluation needs. Shapes: `B` completions of `T` (padded) tokens.
#[derive(Debug, Clone, Copy)]
pub struct LossInputs<'a> {
    /// `(B, T)` log-probs of the completion tokens under the policy being trained
    /// (differentiable).
    pub per_token_logps: &'a Tensor,
    /// `(B, T)` log-probs under the policy that sampled (or the policy before this round of
    /// updates); `None` means `per_token_logps` detached (ratio 1, the on-policy case).
    pub old_per_token_logps: Option<&'a Tensor>,
    /// `(B, T)` log-probs under the frozen reference model; required when `beta > 0`, and
    /// used for the `kl` metric whenever given.
    pub ref_per_token_logps: Option<&'a Tensor>,
    /// `(B,)` one advantage per completion.
    pub advantages: &'a Tensor,
    /// `(B, T)` 1.0 on real completion tokens, 0.0 on padding (any float or integer dtype).
    pub completion_mask: &'a Tensor,
    /// dapo / cispo normaliser: the number of completion tokens the optimizer step averages over
    /// (clamped to ≥ 1); `None` = this batch's mask sum.
    pub num_items_in_batch: Option<f64>,
    /// Off-policy correction weights, `(B, T)` per token or `(B, 1)` per sequence, multiplying
    /// each token's policy loss before the KL term is added (TRL's
    /// `importance_sampling_ratio` from [`importance_weights`]); `None` = 1.
    pub importance_weights: Option<&'a Tensor>,
}

/// How [`importance_weights`] corrects samples drawn by another policy than the one the
/// learner evaluates (a stale generator, or an inference engine): TRL's
/// `vllm_importance_sampling_mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ImportanceSamplingMode {
    /// Per-token ratio clamped to `[min, max]`.
    TokenTruncate,
    /// Per-token ratio, tokens outside `[min, max]` get weight 0.
    TokenMask,
    /// Per-sequence ratio (exp of the summed log-ratio) clamped to `[min, max]`.
    SequenceTruncate,
    /// Per-sequence ratio, sequences outside `[min, max]` get weight 0 (TRL's default).
    #[default]
    SequenceMask,
}

impl std::str::FromStr for ImportanceSamplingMode {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "token_truncate" => Ok(Self::TokenTruncate),
            "token_mask" => Ok(Self::TokenMask),
            "sequence_truncate" => Ok(Self::SequenceTruncate),
            "sequence_mask" => Ok(Self::SequenceMask),
            other => Err(format!(
                "unknown importance sampling mode `{other}`: expected token_truncate, token_mask, sequence_truncate or sequence_mask"
            )),
        }
    }
}

impl ImportanceSamplingMode {
    /// TRL's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::TokenTruncate => "token_truncate",
            Self::TokenMask => "token_mask",
            Self::SequenceTruncate => "sequence_truncate",
            Self::SequenceMask => "sequence_mask",
        }
    }
}

#[cfg(feature = "serde")]
crate::serde_by_name!(
    ImportanceSamplingMode,
    "token_truncate, token_mask, sequence_truncate or sequence_mask"
);

/// TRL's off-policy correction: the ratio `exp(old − sampling)` of the log-probs the learner's
/// policy (before this update) gives the sampled tokens to the log-probs they were sampled with,
/// per token or summed per sequence (masked tokens count 0; NaN sampling log-probs count 0),
/// then truncated or masked outside `[min, max]` (`min` `None` = no lower bound). Returns the
/// weights (`(B, T)` or `(B, 1)`, no gradient) for [`LossInputs::importance_weights`].
pub fn importance_weights(
    old_per_token_logps: &Tensor,
    sampling_per_token_logps: &Tensor,
    completion_mask: &Tensor,
    mode: ImportanceSamplingMode,
    min: Option<f64>,
    max: f64,
) -> Result<Tensor> {
    let dtype = old_per_token_logps.dtype();
    let mask = completion_mask.to_dtype(dtype)?;
    let diff = (old_per_token_logps.detach() - sampling_per_token_logps.to_dtype(dtype)?)?;
    // NaN → 0 (a token without a sampling log-prob gets ratio 1), then masked.
    let diff = diff.eq(&diff)?.where_cond(&diff, &diff.zeros_like()?)?;
    let diff = (diff * &mask)?;
    let seq = matches!(
        mode,
        ImportanceSamplingMode::SequenceMask | ImportanceSamplingMode::SequenceTruncate
    );
    let ratio = if seq {
        diff.sum_keepdim(1)?.exp()?
    } else {
        diff.exp()?
    };
    let lo = min.unwrap_or(f64::NEG_INFINITY);
    match mode {
        ImportanceSamplingMode::TokenTruncate | ImportanceSamplingMode::SequenceTruncate => {
            ratio.clamp(lo, max)
        }
        _ => {
            let inside = ratio.ge(lo)?.mul(&ratio.le(max)?)?;
            inside.where_cond(&ratio, &ratio.zeros_like()?)
        }
    }
}

/// min / mean / max of importance weights as TRL logs them (`sampling/importance_sampling_ratio/*`):
/// over all sequences for `(B, 1)` weights, over completion tokens for `(B, T)` weights.
pub fn importance_weight_stats(
    weights: &Tensor,
    completion_mask: &Tensor,
) -> Result<(f64, f64, f64)> {
    let w: Vec<Vec<f64>> = weights.to_dtype(DType::F64)?.to_vec2()?;
    let m: Vec<Vec<f64>> = completion_mask.to_dtype(DType::F64)?.to_vec2()?;
    let mut vals = Vec::new();
    for (wr, mr) in w.iter().zip(&m) {
        if wr.len() == 1 {
            vals.push(wr[0]);
        } else {
            vals.extend(
                wr.iter()
                    .zip(mr)
                    .filter(|(_, m)| **m > 0.5)
                    .map(|(w, _)| *w),
            );
        }
    }
    if vals.is_empty() {
        return Ok((0.0, 0.0, 0.0));
    }
    let min = vals.iter().copied().fold(f64::INFINITY, f64::min);
    let max = vals.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    Ok((min, vals.iter().sum::<f64>() / vals.len() as f64, max))
}

/// Diagnostics of one loss evaluation, under TRL's metric names (`kl`,
/// `clip_ratio/low_mean`, `clip_ratio/high_mean`, `clip_ratio/region_mean`).
///
/// Means are over completion tokens (token level) or over sequences (sequence level), as TRL's
/// `global_masked_mean`. For cispo, `clip_ratio_high_mean` is TRL's `cispo_clip_ratio`
/// (`ρ > ε_high` and `A > 0`), `clip_ratio_low_mean` is 0 and the region equals the high ratio.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct LossMetrics {
    /// Masked mean of the per-token KL estimate (importance-corrected when configured); 0 when
    /// no reference log-probs were given.
    pub kl: f64,
    /// Fraction where `ρ < 1 − ε_low` and `A < 0`.
    pub clip_ratio_low_mean: f64,
    /// Fraction where `ρ > 1 + ε_high` and `A > 0`.
    pub clip_ratio_high_mean: f64,
    /// Fraction clipped on either side.
    pub clip_ratio_region_mean: f64,
}

/// The scalar loss (differentiable w.r.t. `per_token_logps`) and its metrics.
#[derive(Debug, Clone)]
pub struct LossOutput {
    /// 0-dimensional loss tensor; call `backward()` on it.
    pub loss: Tensor,
    /// Diagnostics.
    pub metrics: LossMetrics,
}

/// [`LossMetrics`] still on the loss's device: `(kl, clip_ratio/low_mean, clip_ratio/high_mean,
/// clip_ratio/region_mean)` as one `(4,)` tensor, so that a training step can read the metrics of
/// all its micro-batches with one copy to the host (each read waits for the device).
#[derive(Debug, Clone)]
pub struct DeviceMetrics(Tensor);

impl DeviceMetrics {
    /// The `(4,)` tensor, in [`LossMetrics`]' field order.
    pub fn as_tensor(&self) -> &Tensor {
        &self.0
    }

    /// Reads the values (one copy to the host).
    pub fn read(&self) -> Result<LossMetrics> {
        LossMetrics::from_values(&self.0.to_dtype(DType::F64)?.to_vec1::<f64>()?)
    }
}

impl LossMetrics {
    /// The metrics from the four values of a [`DeviceMetrics`] tensor.
    pub fn from_values(v: &[f64]) -> Result<Self> {
        match v {
            [kl, low, high, region] => Ok(Self {
                kl: *kl,
                clip_ratio_low_mean: *low,
                clip_ratio_high_mean: *high,
                clip_ratio_region_mean: *region,
            }),
            _ => Err(bail(format!(
                "loss metrics: 4 values expected, got {}",
                v.len()
            ))),
        }
    }
}

/// [`LossOutput`] with its metrics still on the device ([`policy_loss_on_device`]).
#[derive(Debug, Clone)]
pub struct DeviceLossOutput {
    /// 0-dimensional loss tensor; call `backward()` on it.
    pub loss: Tensor,
    /// Diagnostics, not yet read.
    pub metrics: DeviceMetrics,
}

fn bail(msg: String) -> candle_core::Error {
    candle_core::Error::Msg(msg)
}

/// `x.clamp(lo, hi)` whose gradient is 1 on the closed interval `[lo, hi]` and 0 outside,
/// like `torch.clamp` (candle's `clamp` halves the gradient at the bounds).
fn clamp_like_torch(x: &Tensor, lo: Option<f64>, hi: Option<f64>) -> Result<Tensor> {
    // `inside` is a u8 predicate (where_cond needs an integer one).
    let mut inside: Option<Tensor> = None;
    let mut value = x.detach();
    if let Some(lo) = lo {
        inside = Some(x.ge(lo)?);
        value = value.maximum(lo)?;
    }
    if let Some(hi) = hi {
        let le = x.le(hi)?;
        inside = Some(match inside {
            Some(p) => (p * le)?,
            None => le,
        });
        value = value.minimum(hi)?;
    }
    match inside {
        Some(p) => p.where_cond(x, &value),
        None => Ok(x.clone()),
    }
}

/// Mean of `x` over masked tokens when `x` is `(B, T)`, or over rows when it is `(B, 1)`,
/// as TRL's `global_masked_mean`: a 0-dimensional tensor on `x`'s device, in f32 (f64 for
/// f64 inputs) whatever `x`'s dtype.
fn masked_mean(x: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let wide = if x.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let x = x.detach().to_dtype(wide)?;
    if x.dim(1)? == 1 && mask.dim(1)? != 1 {
        x.sum_all()? / (x.dim(0)? as f64).max(1.0)
    } else {
        let mask = mask.to_dtype(wide)?;
        x.broadcast_mul(&mask)?
            .sum_all()?
            .div(&mask.sum_all()?.maximum(1.0)?)
    }
}

fn scalar(t: &Tensor) -> Result<f64> {
    t.to_dtype(DType::F64)?.to_scalar::<f64>()
}

/// GRPO-family policy loss with TRL 1.16's semantics (see the module docs).
///
/// The loss is differentiable with respect to `per_token_logps`; every other input is treated
/// as a constant. Computation happens in the dtype of `per_token_logps`, on its device.
///
/// # Errors
/// Mismatched shapes, a missing `ref_per_token_logps` with `beta > 0`, or an invalid config.
pub fn policy_loss(inputs: &LossInputs<'_>, cfg: &LossConfig) -> Result<LossOutput> {
    let out = policy_loss_on_device(inputs, cfg)?;
    Ok(LossOutput {
        loss: out.loss,
        metrics: out.metrics.read()?,
    })
}

/// [`policy_loss`] without a copy to the host: the metrics stay on the device until
/// [`DeviceMetrics::read`] (a trainer reads a whole step's at once). With
/// `num_items_in_batch` given (or any loss type but dapo / cispo), nothing in it waits for the
/// device.
pub fn policy_loss_on_device(
    inputs: &LossInputs<'_>,
    cfg: &LossConfig,
) -> Result<DeviceLossOutput> {
    cfg.validate().map_err(bail)?;
    let logp = inputs.per_token_logps;
    let (b, t) = logp.dims2().map_err(|_| {
        bail(format!(
            "per_token_logps must be (B, T), got {:?}",
            logp.dims()
        ))
    })?;
    let dtype = logp.dtype();
    let same = |name: &str, x: &Tensor| -> Result<Tensor> {
        if x.dims() != [b, t] {
            return Err(bail(format!(
                "{name} must have the shape of per_token_logps ({b}, {t}), got {:?}",
                x.dims()
            )));
        }
        x.to_dtype(dtype)
    };
    let mask = same("completion_mask", inputs.completion_mask)?;
    let old = match inputs.old_per_token_logps {
        Some(o) => same("old_per_token_logps", o)?.detach(),
        None => logp.detach(),
    };
    let reference = inputs
        .ref_per_token_logps
        .map(|r| same("ref_per_token_logps", r).map(|r| r.detach()))
        .transpose()?;
    if cfg.beta != 0.0 && reference.is_none() {
        return Err(bail(format!(
            "beta = {} needs ref_per_token_logps (the reference model's log-probs)",
            cfg.beta
        )));
    }
    if inputs.advantages.elem_count() != b {
        return Err(bail(format!(
            "advantages must have one value per completion ({b}), got shape {:?}",
            inputs.advantages.dims()
        )));
    }
    let adv = inputs.advantages.to_dtype(dtype)?.reshape((b, 1))?.detach();

    // Importance weights: (B, T) at token level, (B, 1) at sequence level.
    let log_ratio = (logp - &old)?;
    let log_w = match cfg.importance_sampling_level {
        ImportanceSamplingLevel::Token => log_ratio,
        ImportanceSamplingLevel::Sequence => {
            let tokens = mask.sum_keepdim(1)?.maximum(1.0)?;
            (log_ratio * &mask)?.sum_keepdim(1)?.div(&tokens)?
        }
    };
    let mut coef_1 = log_w.exp()?;

    let per_token_kl = match &reference {
        Some(r) => {
            let d = (r - logp)?;
            let kl = ((d.exp()? - &d)? - 1.0)?;
            Some(if cfg.kl_importance_correction {
                kl.broadcast_mul(&coef_1)?
            } else {
                kl
            })
        }
        None => None,
    };

    let per_token_loss = match cfg.loss_type {
        LossType::Cispo => {
            let w = coef_1.minimum(cfg.epsilon_high)?.detach();
            w.broadcast_mul(&adv)?.broadcast_mul(logp)?.neg()?
        }
        _ => {
            let coef_2 = clamp_like_torch(
                &coef_1,
                Some(1.0 - cfg.epsilon_low),
                Some(1.0 + cfg.epsilon_high),
            )?;
            if let Some(delta) = cfg.delta {
                coef_1 = clamp_like_torch(&coef_1, None, Some(delta))?;
            }
            let l1 = coef_1.broadcast_mul(&adv)?;
            let l2 = coef_2.broadcast_mul(&adv)?;
            l1.minimum(&l2)?.neg()?
        }
    };
    let per_token_loss = match inputs.importance_weights {
        Some(w) => per_token_loss.broadcast_mul(&w.to_dtype(logp.dtype())?.detach())?,
        None => per_token_loss,
    };
    let per_token_loss = match (&per_token_kl, cfg.beta != 0.0) {
        (Some(kl), true) => per_token_loss.broadcast_add(&(kl * cfg.beta)?)?,
        _ => per_token_loss,
    };

    let masked = per_token_loss.broadcast_mul(&mask)?; // (B, T)
    let loss = match cfg.loss_type {
        LossType::Grpo => {
            let tokens = mask.sum_keepdim(1)?.maximum(1.0)?;
            (masked.sum_keepdim(1)?.div(&tokens)?.sum_all()? / b.max(1) as f64)?
        }
        LossType::Bnpo => {
            let tokens = mask.sum_all()?.maximum(1.0)?;
            masked.sum_all()?.div(&tokens)?
        }
        LossType::DrGrpo => (masked.sum_all()? / (b * cfg.max_completion_length).max(1) as f64)?,
        LossType::Dapo | LossType::Cispo => {
            let n = match inputs.num_items_in_batch {
                Some(n) => n,
                None => scalar(&mask.sum_all()?)?,
            };
            (masked.sum_all()? / n.max(1.0))?
        }
    };

    // Metrics.
    let kl = match &per_token_kl {
        Some(kl) => masked_mean(kl, &mask)?,
        None => masked_mean(&mask.zeros_like()?, &mask)?,
    };
    let flag = |x: Tensor| x.to_dtype(dtype);
    let (low, high) = match cfg.loss_type {
        LossType::Cispo => {
            let high = flag(coef_1.gt(cfg.epsilon_high)?)?.broadcast_mul(&flag(adv.gt(0.0)?)?)?;
            let low = high.zeros_like()?;
            (low, high)
        }
        _ => {
            let low =
                flag(coef_1.lt(1.0 - cfg.epsilon_low)?)?.broadcast_mul(&flag(adv.lt(0.0)?)?)?;
            let high =
                flag(coef_1.gt(1.0 + cfg.epsilon_high)?)?.broadcast_mul(&flag(adv.gt(0.0)?)?)?;
            (low, high)
        }
    };
    let region = (&low + &high)?.minimum(1.0)?;
    let values = Tensor::stack(
        &[
            kl,
            masked_mean(&low, &mask)?,
            masked_mean(&high, &mask)?,
            masked_mean(&region, &mask)?,
        ],
        0,
    )?;
    Ok(DeviceLossOutput {
        loss,
        metrics: DeviceMetrics(values),
    })
}

#[cfg(test)]
mod tests {

    #[test]
    fn importance_weights_follow_trl_modes() {
        use super::ImportanceSamplingMode as M;
        let d = candle_core::Device::Cpu;
        let old = Tensor::new(&[[-1.0f64, -2.0, -3.0], [-1.0, -1.0, -1.0]], &d).unwrap();
        let samp = Tensor::new(&[[-1.5f64, -2.0, -2.0], [-1.0, f64::NAN, -3.5]], &d).unwrap();
        let mask = Tensor::new(&[[1f64, 1.0, 0.0], [1.0, 1.0, 1.0]], &d).unwrap();
        let w = |mode, min, max| {
            importance_weights(&old, &samp, &mask, mode, min, max)
                .unwrap()
                .to_vec2::<f64>()
                .unwrap()
        };
        let e = |x: f64| x.exp();
        // Row 0: log-ratios [0.5, 0, masked]; row 1: [0, NaN → 0, 2.5].
        let t = w(M::TokenTruncate, None, 1.5);
        assert_eq!(t[0], vec![1.5, 1.0, 1.0]);
        assert_eq!(t[1], vec![1.0, 1.0, 1.5]);
        let t = w(M::TokenMask, None, 1.5);
        assert_eq!(t[0], vec![0.0, 1.0, 1.0]);
        assert_eq!(t[1], vec![1.0, 1.0, 0.0]);
        let t = w(M::TokenMask, None, 20.0);
        assert!((t[0][0] - e(0.5)).abs() < 1e-12 && (t[1][2] - e(2.5)).abs() < 1e-12);
        let t = w(M::SequenceTruncate, Some(0.5), 2.0);
        assert_eq!((t[0].len(), t[0][0], t[1][0]), (1, e(0.5), 2.0));
        let t = w(M::SequenceMask, None, 3.0);
        assert_eq!((t[0][0], t[1][0]), (e(0.5), 0.0));
        let t = w(M::SequenceMask, Some(1.7), 30.0);
        assert_eq!((t[0][0], t[1][0]), (0.0, e(2.5)));
        assert!("sequence_mask".parse::<M>().is_ok() && "x".parse::<M>().is_err());
    }

    #[test]
    fn importance_weights_scale_the_policy_term_not_the_kl() {
        let d = candle_core::Device::Cpu;
        let lp = Tensor::new(&[[-1.0f64, -0.5], [-2.0, -0.3]], &d).unwrap();
        let old = Tensor::new(&[[-1.1f64, -0.4], [-2.0, -0.2]], &d).unwrap();
        let rf = Tensor::new(&[[-0.9f64, -0.6], [-1.8, -0.35]], &d).unwrap();
        let adv = Tensor::new(&[0.7f64, -0.4], &d).unwrap();
        let mask = Tensor::new(&[[1f64, 1.0], [1.0, 0.0]], &d).unwrap();
        let two = Tensor::new(&[[2.0f64], [2.0]], &d).unwrap();
        for beta in [0.0, 0.1] {
            let cfg = LossConfig {
                beta,
                ..LossConfig::default()
            };
            let run = |w: Option<&Tensor>, r: Option<&Tensor>| {
                policy_loss(
                    &LossInputs {
                        per_token_logps: &lp,
                        old_per_token_logps: Some(&old),
                        ref_per_token_logps: r,
                        advantages: &adv,
                        completion_mask: &mask,
                        num_items_in_batch: None,
                        importance_weights: w,
                    },
                    &cfg,
                )
                .unwrap()
                .loss
                .to_scalar::<f64>()
                .unwrap()
            };
            let r = (beta > 0.0).then_some(&rf);
            let plain = run(None, r);
            let doubled = run(Some(&two), r);
            let kl_only = if beta > 0.0 {
                let zero = Tensor::new(&[0.0f64, 0.0], &d).unwrap();
                policy_loss(
                    &LossInputs {
                        per_token_logps: &lp,
                        old_per_token_logps: Some(&old),
                        ref_per_token_logps: Some(&rf),
                        advantages: &zero,
                        completion_mask: &mask,
                        num_items_in_batch: None,
                        importance_weights: None,
                    },
                    &cfg,
                )
                .unwrap()
                .loss
                .to_scalar::<f64>()
                .unwrap()
            } else {
                0.0
            };
            // loss = policy + KL; weights 2 double the policy part only.
            assert!(
                (doubled - (2.0 * (plain - kl_only) + kl_only)).abs() < 1e-12,
                "beta {beta}"
            );
        }
    }
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn default_is_trl_1_16() {
        let c = LossConfig::default();
        assert_eq!(c.loss_type, LossType::Dapo);
        assert_eq!((c.epsilon_low, c.epsilon_high, c.beta), (0.2, 0.2, 0.0));
        assert!(c.kl_importance_correction);
        assert_eq!(c.importance_sampling_level, ImportanceSamplingLevel::Token);
        assert_eq!(c.delta, None);
    }

    #[test]
    fn parse_names() {
        for name in ["grpo", "bnpo", "dr_grpo", "dapo", "cispo"] {
            assert_eq!(name.parse::<LossType>().unwrap().as_str(), name);
        }
        assert!("ppo".parse::<LossType>().unwrap_err().contains("ppo"));
        assert_eq!(
            "sequence".parse::<ImportanceSamplingLevel>(),
            Ok(ImportanceSamplingLevel::Sequence)
        );
    }

    #[test]
    fn clamp_gradient_is_torch_like_at_the_bounds() {
        let x = Var::new(&[0.5f64, 0.8, 1.0, 1.2, 1.5], &Device::Cpu).unwrap();
        let y = clamp_like_torch(x.as_tensor(), Some(0.8), Some(1.2)).unwrap();
        assert_eq!(y.to_vec1::<f64>().unwrap(), vec![0.8, 0.8, 1.0, 1.2, 1.2]);
        let g = y.sum_all().unwrap().backward().unwrap();
        let g = g.get(x.as_tensor()).unwrap().to_vec1::<f64>().unwrap();
        assert_eq!(g, vec![0.0, 1.0, 1.0, 1.0, 0.0]);
    }

    #[test]
    fn beta_without_reference_is_an_error() {
        let d = Device::Cpu;
        let lp = Tensor::zeros((1, 2), DType::F32, &d).unwrap();
        let a = Tensor::zeros(1, DType::F32, &d).unwrap();
        let m = Tensor::ones((1, 2), DType::F32, &d).unwrap();
        let inputs = LossInputs {
            per_token_logps: &lp,
            old_per_token_logps: None,
            ref_per_token_logps: None,
            advantages: &a,
            completion_mask: &m,
            num_items_in_batch: None,
            importance_weights: None,
        };
        let cfg = LossConfig {
            beta: 0.1,
            ..Default::default()
        };
        let err = policy_loss(&inputs, &cfg).unwrap_err().to_string();
        assert!(err.contains("ref_per_token_logps"), "{err}");
        let bad_mask = Tensor::ones((2, 2), DType::F32, &d).unwrap();
        let err = policy_loss(
            &LossInputs {
                completion_mask: &bad_mask,
                ..inputs
            },
            &LossConfig::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("completion_mask"), "{err}");
    }

    #[test]
    fn invalid_config_names_the_field() {
        let c = LossConfig {
            delta: Some(-0.5),
            ..Default::default()
        };
        assert!(c.validate().unwrap_err().contains("delta"));
        let c = LossConfig {
            epsilon_low: -0.1,
            ..Default::default()
        };
        assert!(c.validate().unwrap_err().contains("epsilon_low"));
    }
}
