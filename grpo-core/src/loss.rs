//! The clipped policy-gradient losses of GRPO and its variants, on candle tensors.
//!
//! [`policy_loss`] follows TRL 1.16's `GRPOTrainer._compute_loss` term by term, so that the same
//! inputs give the same loss, gradient and metrics:
//!
//! * ratio `ρ = exp(logp − old_logp)` per token, or per sequence
//!   `ρ_i = exp(Σ_t m·Δ / max(1, Σ_t m))` ([`ImportanceSamplingLevel::Sequence`], GSPO), or
//!   per token with that value, `ρ_t = sg(ρ_i)·π(y_t)/sg(π(y_t))`
//!   ([`ImportanceSamplingLevel::SequenceToken`], GSPO-token);
//! * grpo, bnpo, dr_grpo, dapo, luspo: `ℓ = −min(ρ′·A, clip(ρ, 1−ε_low, 1+ε_high)·A)`,
//!   `ρ′ = min(ρ, δ)` when `delta` is set; cispo: `ℓ = −stopgrad(min(ρ, ε_high))·A·logp`;
//!   sapo: `ℓ = −σ(τ·(ρ − 1))·4/τ·A` with `τ` by the sign of `A`; vespo:
//!   `ℓ = −stopgrad(φ(w))·A·logp`, `φ(w) = e^λ·w^k·e^(−λw)` of the sequence ratio `w`;
//!   gmpo (TRL's experimental GMPO): per sequence `ℓ = −exp(mean_t clip±(Δ_t))·A`, the token
//!   log-ratios clipped in log space on the advantage's pessimistic side, averaged over
//!   sequences (its KL is the sequence's mean, without importance correction);
//! * optional masks: sequences with `A < 0` whose mean KL to the sampling policy exceeds
//!   `off_policy_mask_threshold` (DeepSeek-V3.2's off-policy sequence mask); tokens below the
//!   `1 − top_entropy_quantile` quantile of the batch's entropies (Beyond the 80/20 rule);
//! * β > 0: `KL_t = exp(ref − logp) − (ref − logp) − 1`, times `ρ` when
//!   `kl_importance_correction` (TRL's `use_bias_correction_kl`), and `ℓ += β·KL`;
//! * aggregation by [`LossType`]; an entropy bonus `− entropy_coef · mean H` over the tokens
//!   the policy term acts on, whatever the aggregation.
//!
//! Gradients match PyTorch's, ties included: `clamp` passes the gradient on its closed
//! interval and `min` splits it evenly between equal arguments.

use candle_core::{DType, Result, Tensor};

use crate::cov::CovLoss;

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
    /// Soft adaptive policy optimization: a sigmoid gate on the ratio instead of the clip,
    /// temperatures by the advantage's sign; aggregated as grpo.
    Sapo,
    /// The clipped objective, each sequence's token sum averaged over sequences (LUSPO:
    /// length-unbiased sequence policy optimization).
    Luspo,
    /// Gamma-weighted sequence importance weights as constants times the log-prob (VESPO);
    /// aggregated as dapo. Takes the off-policy weights into the sequence ratio instead of
    /// multiplying the loss by them.
    Vespo,
    /// Geometric-mean policy optimization (TRL's experimental GMPO): each sequence's weight is
    /// the geometric mean of its token ratios, clipped sign-aware in log space to
    /// `[−epsilon_low, epsilon_high]`; the loss is the mean over sequences of `−w·A` (plus
    /// `β ×` the sequence's mean KL, without importance correction).
    Gmpo,
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
            "sapo" => Ok(Self::Sapo),
            "luspo" => Ok(Self::Luspo),
            "vespo" => Ok(Self::Vespo),
            "gmpo" => Ok(Self::Gmpo),
            other => Err(format!(
                "unknown loss_type `{other}`: expected one of grpo, bnpo, dr_grpo, dapo, cispo, \
                 sapo, luspo, vespo, gmpo"
            )),
        }
    }
}

#[cfg(feature = "serde")]
crate::serde_by_name!(
    LossType,
    "grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo or gmpo"
);

impl LossType {
    /// TRL's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Grpo => "grpo",
            Self::Bnpo => "bnpo",
            Self::DrGrpo => "dr_grpo",
            Self::Dapo => "dapo",
            Self::Cispo => "cispo",
            Self::Sapo => "sapo",
            Self::Luspo => "luspo",
            Self::Vespo => "vespo",
            Self::Gmpo => "gmpo",
        }
    }

    /// TRL's default `epsilon` for the loss type: 0.4 (in log space) for gmpo, as
    /// `GMPOConfig`; 0.2 otherwise.
    pub fn default_epsilon(self) -> f64 {
        match self {
            Self::Gmpo => 0.4,
            _ => 0.2,
        }
    }

    /// Whether the loss is divided by the tokens of the whole step (`num_items_in_batch`)
    /// rather than averaged per micro-batch: dapo, cispo, vespo.
    pub fn normalizes_by_step_tokens(self) -> bool {
        matches!(self, Self::Dapo | Self::Cispo | Self::Vespo)
    }

    /// Whether the objective is the clipped ratio (and the clip-ratio metrics mean something):
    /// grpo, bnpo, dr_grpo, dapo, luspo, and gmpo (clipped in log space).
    pub fn is_clipped(self) -> bool {
        matches!(
            self,
            Self::Grpo | Self::Bnpo | Self::DrGrpo | Self::Dapo | Self::Luspo | Self::Gmpo
        )
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
    /// GSPO-token (TRL's experimental `gspo_token` trainer): per token, the sequence's ratio
    /// as its value and the token's own log-prob as its gradient,
    /// `exp(logp_t − sg(logp_t) + sg(mean log-ratio))`. With one advantage per sequence and
    /// every token weighed alike it trains as GSPO; per-token weights (the high-entropy mask,
    /// token-level importance weights) then act on each token's own gradient.
    SequenceToken,
}

impl std::str::FromStr for ImportanceSamplingLevel {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "token" => Ok(Self::Token),
            "sequence" => Ok(Self::Sequence),
            "sequence_token" => Ok(Self::SequenceToken),
            other => Err(format!(
                "unknown importance_sampling_level `{other}`: expected token, sequence or \
                 sequence_token"
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
            Self::SequenceToken => "sequence_token",
        }
    }
}

#[cfg(feature = "serde")]
crate::serde_by_name!(ImportanceSamplingLevel, "token, sequence or sequence_token");

/// The log importance weights of `logp` against the detached `old` log-probs, both `(B, T)`,
/// at `level`: `(B, T)` per token (and GSPO-token's), `(B, 1)` per sequence (the masked mean of
/// the log-ratios, over at least one token).
pub fn log_importance_weights(
    level: ImportanceSamplingLevel,
    logp: &Tensor,
    old: &Tensor,
    mask: &Tensor,
) -> Result<Tensor> {
    let log_ratio = (logp - old)?;
    let sequence_mean = |log_ratio: Tensor| -> Result<Tensor> {
        let tokens = mask.sum_keepdim(1)?.maximum(1.0)?;
        (log_ratio * mask)?.sum_keepdim(1)?.div(&tokens)
    };
    match level {
        ImportanceSamplingLevel::Token => Ok(log_ratio),
        ImportanceSamplingLevel::Sequence => sequence_mean(log_ratio),
        ImportanceSamplingLevel::SequenceToken => {
            let s = sequence_mean(log_ratio)?.detach();
            (logp - logp.detach())?.broadcast_add(&s)
        }
    }
}

/// The per-token KL estimate of the loss's `β` term, of `d = log π − log π_ref` (verl's
/// `actor.kl_loss_type`; TRL has k3 only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KlEstimate {
    /// `d` (verl's `kl`, `k1`).
    K1,
    /// `|d|`.
    Abs,
    /// `d² / 2` (verl's `mse`, `k2`).
    K2,
    /// `e^{−d} + d − 1`, TRL's (the default).
    #[default]
    K3,
    /// k3 with `−d` clamped to ±20 and the estimate to ±10, verl's `low_var_kl` (and its `k3`).
    LowVarKl,
}

/// [`KlEstimate`] and whether its gradient is k2's (verl's `+` suffix, e.g. `k3+`: the value of
/// the estimate, the gradient of `d² / 2`, whose expectation is the KL's gradient).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KlLossType {
    /// The estimate (its value).
    pub estimate: KlEstimate,
    /// k2's gradient (a straight-through estimate).
    pub straight_through: bool,
}

impl KlLossType {
    /// The config spelling: `k3` (TRL's), or verl's `kl` / `k1`, `abs`, `mse` / `k2`,
    /// `low_var_kl`, with `+` for the straight-through gradient.
    pub fn as_str(self) -> &'static str {
        use KlEstimate::*;
        match (self.estimate, self.straight_through) {
            (K1, false) => "k1",
            (K1, true) => "k1+",
            (Abs, false) => "abs",
            (Abs, true) => "abs+",
            (K2, _) => "k2",
            (K3, false) => "k3",
            (K3, true) => "k3+",
            (LowVarKl, false) => "low_var_kl",
            (LowVarKl, true) => "low_var_kl+",
        }
    }

    /// The estimate per token of `logp` against `reference` (both `(B, T)`).
    pub fn per_token(self, logp: &Tensor, reference: &Tensor) -> Result<Tensor> {
        // m = log π_ref − log π = −d.
        let m = (reference - logp)?;
        let value = match self.estimate {
            KlEstimate::K1 => m.neg()?,
            KlEstimate::Abs => abs_like_torch(&m.neg()?)?,
            KlEstimate::K2 => (m.sqr()? * 0.5)?,
            KlEstimate::K3 => ((m.exp()? - &m)? - 1.0)?,
            KlEstimate::LowVarKl => {
                let c = clamp_like_torch(&m, Some(-20.0), Some(20.0))?;
                let k = ((c.exp()? - &c)? - 1.0)?;
                clamp_like_torch(&k, Some(-10.0), Some(10.0))?
            }
        };
        if !self.straight_through || self.estimate == KlEstimate::K2 {
            return Ok(value);
        }
        let k2 = (m.sqr()? * 0.5)?;
        (&k2 - k2.detach())? + value.detach()
    }
}

impl std::str::FromStr for KlLossType {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        let lower = s.to_ascii_lowercase();
        let (name, straight_through) = match lower.strip_suffix('+') {
            Some(n) => (n, true),
            None => (lower.as_str(), false),
        };
        let estimate = match name {
            "k1" | "kl" => KlEstimate::K1,
            "abs" => KlEstimate::Abs,
            "k2" | "mse" => KlEstimate::K2,
            "k3" => KlEstimate::K3,
            "low_var_kl" => KlEstimate::LowVarKl,
            "full" => {
                return Err("kl_loss_type `full` needs the whole vocabulary's log-probs, which verl itself does not implement: use k1, abs, k2, k3 or low_var_kl".into());
            }
            other => {
                return Err(format!(
                    "unknown kl_loss_type `{other}`: expected k3 (TRL's), k1 (kl), abs, k2 (mse) or low_var_kl, with `+` for k2's gradient"
                ));
            }
        };
        Ok(Self {
            estimate,
            // k2's own gradient: `k2+` is k2.
            straight_through: straight_through && estimate != KlEstimate::K2,
        })
    }
}

#[cfg(feature = "serde")]
crate::serde_by_name!(
    KlLossType,
    "k3, k1, abs, k2 or low_var_kl (with + for k2's gradient)"
);

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
    /// default false, as TRL's.
    pub kl_importance_correction: bool,
    /// The KL estimate of the `β` term (and the `kl` metric); default TRL's k3.
    pub kl_loss_type: KlLossType,
    /// Token or sequence ratios; default token.
    pub importance_sampling_level: ImportanceSamplingLevel,
    /// The dr_grpo normaliser; default 512 (TRL's `max_completion_length`).
    pub max_completion_length: usize,
    /// sapo's temperature for tokens with positive advantage; default 1.0.
    pub sapo_temperature_pos: f64,
    /// sapo's temperature for tokens with non-positive advantage; default 1.05.
    pub sapo_temperature_neg: f64,
    /// vespo's power `k` for non-negative advantages; default 2.0.
    pub vespo_k_pos: f64,
    /// vespo's decay `λ` for non-negative advantages; default 3.0.
    pub vespo_lambda_pos: f64,
    /// vespo's power `k` for negative advantages; default 3.0.
    pub vespo_k_neg: f64,
    /// vespo's decay `λ` for negative advantages; default 2.0.
    pub vespo_lambda_neg: f64,
    /// Drop sequences with a negative advantage whose mean `sampling − policy` log-prob
    /// difference exceeds this (DeepSeek-V3.2's off-policy sequence mask, TRL's
    /// `off_policy_mask_threshold`); default none.
    pub off_policy_mask_threshold: Option<f64>,
    /// Keep in the policy term only the tokens whose entropy is at or above this quantile from
    /// the top of the batch's (TRL's `top_entropy_quantile`, ρ); 1.0 (the default) keeps all.
    /// Needs [`LossInputs::entropies`] when below 1.
    pub top_entropy_quantile: f64,
    /// Coefficient of the entropy bonus subtracted from the loss (TRL's `entropy_coef`, as
    /// applied this step); 0.0 (the default) adds none. Needs [`LossInputs::entropies`].
    pub entropy_coef: f64,
    /// Clip-Cov or KL-Cov on the tokens whose log-prob moves most with their advantage
    /// ([`crate::cov`], verl's `clip_cov` / `kl_cov` loss modes); default off.
    pub cov: CovLoss,
}

impl Default for LossConfig {
    fn default() -> Self {
        Self {
            loss_type: LossType::Dapo,
            epsilon_low: 0.2,
            epsilon_high: 0.2,
            delta: None,
            beta: 0.0,
            kl_importance_correction: false,
            kl_loss_type: KlLossType::default(),
            importance_sampling_level: ImportanceSamplingLevel::Token,
            max_completion_length: 512,
            sapo_temperature_pos: 1.0,
            sapo_temperature_neg: 1.05,
            vespo_k_pos: 2.0,
            vespo_lambda_pos: 3.0,
            vespo_k_neg: 3.0,
            vespo_lambda_neg: 2.0,
            off_policy_mask_threshold: None,
            top_entropy_quantile: 1.0,
            entropy_coef: 0.0,
            cov: CovLoss::Off,
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
        self.cov.validate()?;
        if self.cov != CovLoss::Off {
            let name = self.cov.name();
            if !matches!(
                self.loss_type,
                LossType::Grpo
                    | LossType::Bnpo
                    | LossType::DrGrpo
                    | LossType::Dapo
                    | LossType::Luspo
            ) {
                return Err(format!(
                    "{name} reworks the clipped token loss; loss_type {} has another objective (grpo, bnpo, dr_grpo, dapo or luspo take it)",
                    self.loss_type.as_str()
                ));
            }
            if self.importance_sampling_level != ImportanceSamplingLevel::Token {
                return Err(format!(
                    "{name} selects tokens by their own ratios: importance_sampling_level must be token"
                ));
            }
            if self.delta.is_some() {
                return Err(format!(
                    "{name} has no two-sided clip (verl's ignores clip_ratio_c): leave delta out"
                ));
            }
        }
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
        if self.loss_type == LossType::Gmpo {
            if self.delta.is_some() {
                return Err(
                    "delta (two-sided GRPO) does not apply to loss_type gmpo: its clip \
                            is in log space, epsilon and epsilon_high"
                        .into(),
                );
            }
            if self.importance_sampling_level != ImportanceSamplingLevel::Token {
                return Err(format!(
                    "importance_sampling_level = \"{}\" does not apply to loss_type gmpo: \
                     gmpo's ratio is already one per sequence (the geometric mean of its \
                     clipped token ratios)",
                    self.importance_sampling_level.as_str()
                ));
            }
        }
        if self.loss_type == LossType::DrGrpo && self.max_completion_length == 0 {
            return Err("max_completion_length must be >= 1 for loss_type dr_grpo".into());
        }
        for (name, v) in [
            ("sapo_temperature_pos", self.sapo_temperature_pos),
            ("sapo_temperature_neg", self.sapo_temperature_neg),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("{name} must be a finite number > 0, got {v}"));
            }
        }
        for (name, v) in [
            ("vespo_k_pos", self.vespo_k_pos),
            ("vespo_lambda_pos", self.vespo_lambda_pos),
            ("vespo_k_neg", self.vespo_k_neg),
            ("vespo_lambda_neg", self.vespo_lambda_neg),
        ] {
            finite_nonneg(name, v)?;
        }
        if let Some(t) = self.off_policy_mask_threshold
            && !t.is_finite()
        {
            return Err(format!("off_policy_mask_threshold must be finite, got {t}"));
        }
        if !(0.0..=1.0).contains(&self.top_entropy_quantile) {
            return Err(format!(
                "top_entropy_quantile must be in [0, 1], got {}",
                self.top_entropy_quantile
            ));
        }
        if !self.entropy_coef.is_finite() {
            return Err(format!(
                "entropy_coef must be finite, got {}",
                self.entropy_coef
            ));
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
    /// `(B, T)` log-probs the tokens were sampled with, for the off-policy sequence mask
    /// (`off_policy_mask_threshold`); `None` = the old log-probs. NaN entries (tokens the
    /// sampler could not score) count 0.
    pub sampling_per_token_logps: Option<&'a Tensor>,
    /// `(B, T)` entropy of the policy's distribution at each completion position, needed by
    /// `top_entropy_quantile < 1` and `entropy_coef != 0`; differentiable for the entropy
    /// bonus.
    pub entropies: Option<&'a Tensor>,
    /// `(B,)` one advantage per completion, or `(B, T)` one per token (MiniLLM's reverse-KL
    /// advantages; not with the sequence-level gmpo and vespo loss types).
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
    /// vespo: the mean over sequences of the gamma weight `φ(w)` (TRL's
    /// `vespo/phi_seq_mean`); 0 for the other loss types.
    pub phi_seq_mean: f64,
    /// TRL's `clip_ratio/low_min`: the token objectives log the low fraction of the batch (one
    /// process: `clip_ratio_low_mean`); gmpo the smallest per-sequence fraction.
    pub clip_ratio_low_min: f64,
    /// TRL's `clip_ratio/high_max`: as `clip_ratio_low_min`, the largest high fraction.
    pub clip_ratio_high_max: f64,
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
/// clip_ratio/region_mean, phi_seq_mean, clip_ratio/low_min, clip_ratio/high_max)` as one `(7,)`
/// tensor, so that a training step can read
/// the metrics of all its micro-batches with one copy to the host (each read waits for the
/// device).
#[derive(Debug, Clone)]
pub struct DeviceMetrics(Tensor);

impl DeviceMetrics {
    /// The `(7,)` tensor, in [`LossMetrics`]' field order.
    pub fn as_tensor(&self) -> &Tensor {
        &self.0
    }

    /// Reads the values (one copy to the host).
    pub fn read(&self) -> Result<LossMetrics> {
        LossMetrics::from_values(&self.0.to_dtype(DType::F64)?.to_vec1::<f64>()?)
    }
}

impl LossMetrics {
    /// How many values a [`DeviceMetrics`] tensor holds.
    pub const LEN: usize = 7;

    /// The metrics from the values of a [`DeviceMetrics`] tensor.
    pub fn from_values(v: &[f64]) -> Result<Self> {
        match v {
            [kl, low, high, region, phi, low_min, high_max] => Ok(Self {
                kl: *kl,
                clip_ratio_low_mean: *low,
                clip_ratio_high_mean: *high,
                clip_ratio_region_mean: *region,
                phi_seq_mean: *phi,
                clip_ratio_low_min: *low_min,
                clip_ratio_high_max: *high_max,
            }),
            _ => Err(bail(format!(
                "loss metrics: 7 values expected, got {}",
                v.len()
            ))),
        }
    }
}

/// [`LossOutput`] with its metrics still on the device ([`policy_loss_on_device`]).
#[derive(Debug, Clone)]
pub struct DeviceLossOutput {
    /// 0-dimensional policy loss (with the KL term; without the entropy bonus), aggregated by
    /// the loss type.
    pub loss: Tensor,
    /// `entropy_coef ×` the mean entropy over the tokens the policy term acts on, 0-dimensional
    /// and differentiable, when `entropy_coef != 0`: the total loss of one micro-batch is
    /// `loss − entropy_bonus`; with gradient accumulation over `n` micro-batches TRL divides
    /// the bonus by `n` whatever the loss type.
    pub entropy_bonus: Option<Tensor>,
    /// When entropies were given: `(2,)` f32 — the entropy summed over the tokens the policy
    /// term acts on, and their count (what TRL's adaptive entropy control averages over an
    /// optimizer step). No gradient.
    pub entropy_stats: Option<Tensor>,
    /// Diagnostics, not yet read.
    pub metrics: DeviceMetrics,
}

fn bail(msg: String) -> candle_core::Error {
    candle_core::Error::Msg(msg)
}

/// `|x|` whose gradient is torch's `sign(x)`, 0 at 0 (candle's `abs` takes +1 there): `x` times
/// its sign held constant.
fn abs_like_torch(x: &Tensor) -> Result<Tensor> {
    let sign = (x.gt(0.0)?.to_dtype(x.dtype())? - x.lt(0.0)?.to_dtype(x.dtype())?)?;
    x * sign
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

/// `pos` where `pred` holds, else `neg`, in the shape and dtype of `like`.
fn by_sign(pred: &Tensor, like: &Tensor, pos: f64, neg: f64) -> Result<Tensor> {
    pred.where_cond(
        &like.ones_like()?.affine(pos, 0.0)?,
        &like.ones_like()?.affine(neg, 0.0)?,
    )
}

/// `1 / (1 + e^(−x))`.
fn sigmoid(x: &Tensor) -> Result<Tensor> {
    (x.neg()?.exp()? + 1.0)?.recip()
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
    let loss = match &out.entropy_bonus {
        Some(bonus) => (&out.loss - bonus)?,
        None => out.loss,
    };
    Ok(LossOutput {
        loss,
        metrics: out.metrics.read()?,
    })
}

/// TRL's `torch.quantile` (linear interpolation) of the non-NaN `values`, in f64; `None` when
/// there are none.
pub fn quantile(values: &[f32], q: f64) -> Option<f64> {
    let mut v: Vec<f64> = values
        .iter()
        .filter(|x| !x.is_nan())
        .map(|&x| f64::from(x))
        .collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let pos = q.clamp(0.0, 1.0) * (v.len() - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = (lo + 1).min(v.len() - 1);
    Some(v[lo] + (pos - lo as f64) * (v[hi] - v[lo]))
}

/// TRL's high-entropy mask (`get_high_entropy_mask`): 1 where a real token's entropy is at
/// least the `1 − top_entropy_quantile` quantile of the real tokens' entropies (computed in
/// f32, as TRL does), else 0; all 0 when there are no real tokens. Reads the entropies to the
/// host (the quantile needs them sorted).
fn high_entropy_mask(entropies: &Tensor, mask: &Tensor, top_quantile: f64) -> Result<Tensor> {
    let e32 = entropies.detach().to_dtype(DType::F32)?;
    let m32 = mask.to_dtype(DType::F32)?;
    let ev: Vec<f32> = e32.flatten_all()?.to_vec1()?;
    let mv: Vec<f32> = m32.flatten_all()?.to_vec1()?;
    let real: Vec<f32> = ev
        .iter()
        .zip(&mv)
        .filter(|&(_, &m)| m != 0.0)
        .map(|(&e, _)| e)
        .collect();
    let Some(threshold) = quantile(&real, 1.0 - top_quantile) else {
        return mask.zeros_like();
    };
    // TRL compares `entropies · mask` (f32) with the f32 quantile.
    let threshold = threshold as f32;
    let keep: Vec<f32> = ev
        .iter()
        .zip(&mv)
        .map(|(&e, &m)| f32::from(m != 0.0 && e * m >= threshold))
        .collect();
    Tensor::from_vec(keep, mask.dims(), mask.device())?.to_dtype(mask.dtype())
}

/// VESPO's gamma weights per sequence (TRL's `get_gamma_weights`), `(B, 1)`, no gradient:
/// `φ(w) = exp(λ + k·log w − λ·w)` of the sequence ratio
/// `log w = clamp(Σ_t m·clamp(Δ_t, ±20) + Σ_t log clamp(is_t), log 1e-8, 20)`, `k` and `λ` by
/// the advantage's sign (`A ≥ 0`: the positive pair); non-finite weights become 0.
fn gamma_weights(
    adv: &Tensor,
    log_ratio: &Tensor,
    mask: &Tensor,
    is_weights: Option<&Tensor>,
    cfg: &LossConfig,
) -> Result<Tensor> {
    let lower = 1e-8f64.ln();
    let seq = log_ratio
        .detach()
        .clamp(-20.0, 20.0)?
        .broadcast_mul(mask)?
        .sum_keepdim(1)?;
    let seq = match is_weights {
        Some(w) => {
            let lw = w
                .detach()
                .to_dtype(seq.dtype())?
                .log()?
                .clamp(lower, 20.0)?;
            (seq + lw.sum_keepdim(1)?)?
        }
        None => seq,
    };
    let log_w = seq.clamp(lower, 20.0)?;
    let w = log_w.exp()?;
    let nonneg = adv.ge(0.0)?;
    let k = by_sign(&nonneg, adv, cfg.vespo_k_pos, cfg.vespo_k_neg)?;
    let lambda =
        by_sign(&nonneg, adv, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg)?.maximum(1e-4)?;
    let log_phi = ((&lambda + (k * &log_w)?)? - (&lambda * &w)?)?;
    let phi = log_phi.exp()?;
    // nan_to_num(nan=0, posinf=0, neginf=0): finite values pass, the rest become 0.
    let finite = phi.abs()?.le(f64::MAX)?;
    finite.where_cond(&phi, &phi.zeros_like()?)
}

/// DeepSeek-V3.2's off-policy sequence mask (TRL's `get_off_policy_mask`), `(B, 1)`: keep a
/// sequence when `A ≥ 0` or its mean `sampling − policy` log-prob difference over real tokens is
/// at most `threshold` (NaN differences count 0).
fn off_policy_mask(
    adv: &Tensor,
    logp: &Tensor,
    sampling: &Tensor,
    mask: &Tensor,
    threshold: f64,
) -> Result<Tensor> {
    let d = (sampling - logp.detach())?;
    let d = d.eq(&d)?.where_cond(&d, &d.zeros_like()?)?;
    let avg = d
        .broadcast_mul(mask)?
        .sum_keepdim(1)?
        .div(&mask.sum_keepdim(1)?.maximum(1.0)?)?;
    let keep = adv
        .ge(0.0)?
        .to_dtype(DType::U8)?
        .broadcast_add(&avg.le(threshold)?.to_dtype(DType::U8)?)?;
    keep.gt(0u8)?.to_dtype(mask.dtype())
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
    // One advantage per completion, or per token (MiniLLM's).
    let adv = match inputs.advantages.dims() {
        d if d == [b, t] && t != 1 => inputs.advantages.to_dtype(dtype)?.detach(),
        _ if inputs.advantages.elem_count() == b => {
            inputs.advantages.to_dtype(dtype)?.reshape((b, 1))?.detach()
        }
        d => {
            return Err(bail(format!(
                "advantages must have one value per completion ({b}) or one per token ({b}, {t}), got shape {d:?}"
            )));
        }
    };
    if adv.dim(1)? != 1 && matches!(cfg.loss_type, LossType::Gmpo | LossType::Vespo) {
        return Err(bail(format!(
            "loss_type {} weighs whole sequences: it takes one advantage per completion, not one per token",
            cfg.loss_type.as_str()
        )));
    }

    let log_w = log_importance_weights(cfg.importance_sampling_level, logp, &old, &mask)?;
    let mut coef_1 = log_w.exp()?;

    let per_token_kl = match &reference {
        Some(r) => {
            let kl = cfg.kl_loss_type.per_token(logp, r)?;
            Some(if cfg.kl_importance_correction {
                kl.broadcast_mul(&coef_1)?
            } else {
                kl
            })
        }
        None => None,
    };

    let needs_entropies = cfg.top_entropy_quantile < 1.0 || cfg.entropy_coef != 0.0;
    let entropies = match (inputs.entropies, needs_entropies) {
        (Some(e), _) => Some(same("entropies", e)?),
        (None, true) => {
            return Err(bail(
                "top_entropy_quantile < 1 and entropy_coef != 0 need the entropies".into(),
            ));
        }
        (None, false) => None,
    };
    let opsm = match cfg.off_policy_mask_threshold {
        Some(threshold) => {
            let sampling = match inputs.sampling_per_token_logps {
                Some(s) => same("sampling_per_token_logps", s)?.detach(),
                None => old.clone(),
            };
            Some(off_policy_mask(&adv, logp, &sampling, &mask, threshold)?)
        }
        None => None,
    };
    let entropy_mask = match (&entropies, cfg.top_entropy_quantile < 1.0) {
        (Some(e), true) => Some(high_entropy_mask(e, &mask, cfg.top_entropy_quantile)?),
        _ => None,
    };
    let is_weights = inputs
        .importance_weights
        .map(|w| w.to_dtype(dtype).map(|w| w.detach()))
        .transpose()?;
    if cfg.loss_type == LossType::Gmpo {
        let parts = GmpoParts {
            logp,
            old: &old,
            reference: reference.as_ref(),
            adv: &adv,
            mask: &mask,
            entropy_mask: entropy_mask.as_ref(),
            opsm: opsm.as_ref(),
            is_weights: is_weights.as_ref(),
        };
        let (loss, metrics) = gmpo_loss(&parts, cfg)?;
        let (entropy_bonus, entropy_stats) =
            entropy_terms(entropies.as_ref(), &mask, entropy_mask.as_ref(), cfg)?;
        return Ok(DeviceLossOutput {
            loss,
            entropy_bonus,
            entropy_stats,
            metrics,
        });
    }
    let mut phi_seq = None;

    let per_token_loss = match cfg.loss_type {
        LossType::Cispo => {
            let w = coef_1.minimum(cfg.epsilon_high)?.detach();
            w.broadcast_mul(&adv)?.broadcast_mul(logp)?.neg()?
        }
        LossType::Sapo => {
            let tau = by_sign(
                &adv.gt(0.0)?,
                &adv,
                cfg.sapo_temperature_pos,
                cfg.sapo_temperature_neg,
            )?;
            let gate = (&coef_1 - 1.0)?.broadcast_mul(&tau)?;
            let soft = sigmoid(&gate)?.affine(4.0, 0.0)?.broadcast_div(&tau)?;
            soft.broadcast_mul(&adv)?.neg()?
        }
        LossType::Vespo => {
            let log_ratio = (logp - &old)?;
            let phi = gamma_weights(&adv, &log_ratio, &mask, is_weights.as_ref(), cfg)?;
            let l = phi.broadcast_mul(&adv)?.broadcast_mul(logp)?.neg()?;
            phi_seq = Some(phi);
            l
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
            match cfg.cov {
                CovLoss::Off => l1.minimum(&l2)?.neg()?,
                CovLoss::ClipCov { .. } => {
                    // Tokens the clip holds (verl's `pg_losses2 > pg_losses1`) are left out of
                    // the draw; the drawn ones lose their gradient.
                    let clipped = l2.lt(&l1)?.to_dtype(dtype)?.broadcast_mul(&mask)?;
                    let picked = crate::cov::select(cfg.cov, &adv, logp, &mask, &clipped)?;
                    l1.minimum(&l2)?
                        .neg()?
                        .broadcast_mul(&picked.affine(-1.0, 1.0)?)?
                }
                CovLoss::KlCov { coef, .. } => {
                    let none = mask.zeros_like()?;
                    let picked = crate::cov::select(cfg.cov, &adv, logp, &mask, &none)?;
                    let penalty = abs_like_torch(&(logp - &old)?)?.broadcast_mul(&picked)?;
                    (l1.neg()? + (penalty * coef)?)?
                }
            }
        }
    };
    let per_token_loss = match &opsm {
        Some(m) => per_token_loss.broadcast_mul(m)?,
        None => per_token_loss,
    };
    let per_token_loss = match &entropy_mask {
        Some(m) => per_token_loss.broadcast_mul(m)?,
        None => per_token_loss,
    };
    // vespo took the off-policy weights into its sequence ratio.
    let per_token_loss = match (&is_weights, cfg.loss_type) {
        (Some(w), t) if t != LossType::Vespo => per_token_loss.broadcast_mul(w)?,
        _ => per_token_loss,
    };
    let per_token_loss = match (&per_token_kl, cfg.beta != 0.0) {
        (Some(kl), true) => per_token_loss.broadcast_add(&(kl * cfg.beta)?)?,
        _ => per_token_loss,
    };

    let masked = per_token_loss.broadcast_mul(&mask)?; // (B, T)
    let loss = match cfg.loss_type {
        LossType::Grpo | LossType::Sapo => {
            let tokens = mask.sum_keepdim(1)?.maximum(1.0)?;
            (masked.sum_keepdim(1)?.div(&tokens)?.sum_all()? / b.max(1) as f64)?
        }
        LossType::Bnpo => {
            let tokens = mask.sum_all()?.maximum(1.0)?;
            masked.sum_all()?.div(&tokens)?
        }
        LossType::DrGrpo => (masked.sum_all()? / (b * cfg.max_completion_length).max(1) as f64)?,
        LossType::Dapo | LossType::Cispo | LossType::Vespo => {
            let n = match inputs.num_items_in_batch {
                Some(n) => n,
                None => scalar(&mask.sum_all()?)?,
            };
            (masked.sum_all()? / n.max(1.0))?
        }
        LossType::Luspo => (masked.sum_all()? / b.max(1) as f64)?,
        LossType::Gmpo => unreachable!("gmpo returned above"),
    };
    let (entropy_bonus, entropy_stats) =
        entropy_terms(entropies.as_ref(), &mask, entropy_mask.as_ref(), cfg)?;

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
        // No clip: TRL logs no clip ratios for these (nor verl for kl_cov).
        LossType::Sapo | LossType::Vespo => (coef_1.zeros_like()?, coef_1.zeros_like()?),
        _ if matches!(cfg.cov, CovLoss::KlCov { .. }) => {
            (coef_1.zeros_like()?, coef_1.zeros_like()?)
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
    let phi_mean = match &phi_seq {
        Some(phi) => masked_mean(phi, &mask)?,
        None => masked_mean(&mask.zeros_like()?, &mask)?,
    };
    let (low, high) = (masked_mean(&low, &mask)?, masked_mean(&high, &mask)?);
    let values = Tensor::stack(
        &[
            kl,
            low.clone(),
            high.clone(),
            masked_mean(&region, &mask)?,
            phi_mean,
            low,
            high,
        ],
        0,
    )?;
    Ok(DeviceLossOutput {
        loss,
        entropy_bonus,
        entropy_stats,
        metrics: DeviceMetrics(values),
    })
}

/// The entropy bonus (`entropy_coef ×` the mean entropy over the tokens the policy term acts
/// on, differentiable) and the entropy statistics `(Σ entropy, count)` over those tokens.
fn entropy_terms(
    entropies: Option<&Tensor>,
    mask: &Tensor,
    entropy_mask: Option<&Tensor>,
    cfg: &LossConfig,
) -> Result<(Option<Tensor>, Option<Tensor>)> {
    let acts = match entropy_mask {
        Some(m) => (mask * m)?,
        None => mask.clone(),
    };
    let bonus = match (entropies, cfg.entropy_coef != 0.0) {
        (Some(e), true) => {
            let mean = e
                .broadcast_mul(&acts)?
                .sum_all()?
                .div(&acts.sum_all()?.maximum(1.0)?)?;
            Some((mean * cfg.entropy_coef)?)
        }
        _ => None,
    };
    let stats = match entropies {
        Some(e) => {
            let (e, a) = (e.detach().to_dtype(DType::F32)?, acts.to_dtype(DType::F32)?);
            Some(Tensor::stack(&[(e * &a)?.sum_all()?, a.sum_all()?], 0)?)
        }
        None => None,
    };
    Ok((bonus, stats))
}

/// What [`gmpo_loss`] reads, prepared by [`policy_loss_on_device`]: `(B, T)` log-probs, old
/// log-probs, reference log-probs, mask and high-entropy mask; `(B, 1)` advantages, off-policy
/// sequence mask and sequence importance weights.
struct GmpoParts<'a> {
    logp: &'a Tensor,
    old: &'a Tensor,
    reference: Option<&'a Tensor>,
    adv: &'a Tensor,
    mask: &'a Tensor,
    entropy_mask: Option<&'a Tensor>,
    opsm: Option<&'a Tensor>,
    is_weights: Option<&'a Tensor>,
}

/// TRL's `GMPOTrainer._compute_loss`: each token's log-ratio `logp − old` clipped in log space
/// to `[−epsilon_low, epsilon_high]` on the side the advantage's sign makes pessimistic
/// (`A > 0`: `min(r, clip(r))`, else `max`), the sequence weight `w = exp(mean of the clipped
/// log-ratios over its tokens)` (the high-entropy mask narrows the mean, as TRL), the loss the
/// mean over sequences of `−w·A`, plus `β ×` each sequence's mean KL (`e^(ref−logp) −
/// (ref−logp) − 1`, no importance correction). Beyond TRL's GMPO (which has neither), the
/// off-policy sequence mask and sequence-level importance weights multiply `−w·A`.
fn gmpo_loss(p: &GmpoParts<'_>, cfg: &LossConfig) -> Result<(Tensor, DeviceMetrics)> {
    let dtype = p.logp.dtype();
    let log_ratio = (p.logp - p.old)?;
    let clamped = clamp_like_torch(&log_ratio, Some(-cfg.epsilon_low), Some(cfg.epsilon_high))?;
    let positive = p.adv.gt(0.0)?.broadcast_as(log_ratio.shape())?;
    let clipped =
        positive.where_cond(&log_ratio.minimum(&clamped)?, &log_ratio.maximum(&clamped)?)?;
    let seq_mask = match p.entropy_mask {
        Some(m) => (p.mask * m)?,
        None => p.mask.clone(),
    };
    let log_w = (clipped * &seq_mask)?
        .sum_keepdim(1)?
        .div(&seq_mask.sum_keepdim(1)?.maximum(1.0)?)?;
    let mut per_seq = (log_w.exp()? * p.adv)?.neg()?; // (B, 1)
    if let Some(m) = p.opsm {
        per_seq = (per_seq * m)?;
    }
    if let Some(w) = p.is_weights {
        if w.dim(1)? != 1 {
            return Err(bail(
                "loss_type gmpo takes one importance weight per sequence (a sequence_* \
                 importance sampling mode), got per-token weights"
                    .into(),
            ));
        }
        per_seq = (per_seq * w)?;
    }
    let tokens = p.mask.sum_keepdim(1)?.maximum(1.0)?;
    let per_token_kl = match p.reference {
        Some(r) => Some(cfg.kl_loss_type.per_token(p.logp, r)?),
        None => None,
    };
    if let (Some(kl), true) = (&per_token_kl, cfg.beta != 0.0) {
        let seq_kl = (kl * p.mask)?.sum_keepdim(1)?.div(&tokens)?;
        per_seq = (per_seq + (seq_kl * cfg.beta)?)?;
    }
    let loss = per_seq.mean_all()?;

    // Metrics: clipped tokens in log space, their masked means and per-sequence extremes.
    let lr = log_ratio.detach();
    let flag = |x: Tensor| x.to_dtype(dtype);
    let low = flag(lr.lt(-cfg.epsilon_low)?)?.broadcast_mul(&flag(p.adv.lt(0.0)?)?)?;
    let high = flag(lr.gt(cfg.epsilon_high)?)?.broadcast_mul(&flag(p.adv.gt(0.0)?)?)?;
    let region = (&low + &high)?.minimum(1.0)?;
    let kl = match &per_token_kl {
        Some(kl) => masked_mean(kl, p.mask)?,
        None => masked_mean(&p.mask.zeros_like()?, p.mask)?,
    };
    // TRL's nanmin / nanmax over sequences of each one's fraction (a sequence without tokens
    // is NaN there and skipped; none at all gives 0 here).
    let extreme = |x: &Tensor, max: bool| -> Result<Tensor> {
        let wide = if dtype == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        let m = p.mask.to_dtype(wide)?;
        let n = m.sum(1)?;
        let frac = (x.to_dtype(wide)? * &m)?.sum(1)?.div(&n.maximum(1.0)?)?;
        let has = n.gt(0.0)?;
        let fill = if max {
            f64::NEG_INFINITY
        } else {
            f64::INFINITY
        };
        let v = has.where_cond(&frac, &frac.ones_like()?.affine(0.0, fill)?)?;
        let e = if max { v.max(0)? } else { v.min(0)? };
        let finite = e.abs()?.le(f64::MAX)?;
        finite.where_cond(&e, &e.zeros_like()?)
    };
    let values = Tensor::stack(
        &[
            kl,
            masked_mean(&low, p.mask)?,
            masked_mean(&high, p.mask)?,
            masked_mean(&region, p.mask)?,
            masked_mean(&p.mask.zeros_like()?, p.mask)?,
            extreme(&low, false)?,
            extreme(&high, true)?,
        ],
        0,
    )?;
    Ok((loss, DeviceMetrics(values)))
}

/// TRL 1.16's RLOO loss (`RLOOTrainer._compute_loss`): PPO's clip on whole sequences. Each
/// completion's log-prob is the sum over its masked tokens; `ρ = exp(Σ log π − Σ log π_old)`
/// (`old_per_token_logps` `None`: the policy's own, detached, so ρ = 1); the loss is the mean
/// over sequences of `−min(ρA, clip(ρ, 1 − ε_low, 1 + ε_high)A)`. No KL term: RLOO puts the KL
/// penalty in the reward ([`crate::advantages::rloo_advantages`]). The metrics are the
/// sequence-level clip ratios (`kl` and `phi_seq_mean` 0).
///
/// `importance_weights` `(B, 1)` (sequence-level, from [`importance_weights`] in a sequence
/// mode) multiply each sequence's term: the off-policy correction of samples drawn by another
/// or an older policy (TRL's RLOO has none; GRPO's `vllm_importance_sampling_*` applied to
/// whole sequences).
///
/// # Errors
/// Shapes that disagree.
pub fn rloo_loss(
    per_token_logps: &Tensor,
    old_per_token_logps: Option<&Tensor>,
    completion_mask: &Tensor,
    advantages: &Tensor,
    epsilon_low: f64,
    epsilon_high: f64,
    importance_weights: Option<&Tensor>,
) -> Result<(Tensor, DeviceMetrics)> {
    let dtype = per_token_logps.dtype();
    let mask = completion_mask.to_dtype(dtype)?;
    let logps = (per_token_logps * &mask)?.sum(1)?;
    let old = match old_per_token_logps {
        Some(o) => (o.to_dtype(dtype)? * &mask)?.sum(1)?,
        None => logps.detach(),
    };
    let adv = advantages.to_dtype(dtype)?;
    let coef_1 = (&logps - &old)?.exp()?;
    let coef_2 = coef_1.clamp(1.0 - epsilon_low, 1.0 + epsilon_high)?;
    let mut per_sequence = (&coef_1 * &adv)?.minimum(&(&coef_2 * &adv)?)?.neg()?;
    if let Some(w) = importance_weights {
        let n = per_sequence.dim(0)?;
        if w.dims() != [n, 1] {
            candle_core::bail!(
                "rloo_loss: importance weights {:?}, expected one per sequence ({n}, 1)",
                w.dims()
            );
        }
        per_sequence = (per_sequence * w.detach().to_dtype(dtype)?.squeeze(1)?)?;
    }
    let loss = per_sequence.mean_all()?;
    let c = coef_1.detach();
    let flag = |x: Tensor| x.to_dtype(dtype);
    let low = (flag(c.lt(1.0 - epsilon_low)?)? * flag(adv.lt(0.0)?)?)?;
    let high = (flag(c.gt(1.0 + epsilon_high)?)? * flag(adv.gt(0.0)?)?)?;
    let region = (&low + &high)?.minimum(1.0)?;
    let zero = low.zeros_like()?.mean_all()?;
    let (low, high) = (low.mean_all()?, high.mean_all()?);
    let values = Tensor::stack(
        &[
            zero.clone(),
            low.clone(),
            high.clone(),
            region.mean_all()?,
            zero,
            low,
            high,
        ],
        0,
    )?;
    Ok((loss, DeviceMetrics(values)))
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
                        sampling_per_token_logps: None,
                        entropies: None,
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
                        sampling_per_token_logps: None,
                        entropies: None,
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
        assert!(!c.kl_importance_correction);
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
            sampling_per_token_logps: None,
            entropies: None,
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
