//! The supervised objectives beside GRPO: SFT's masked token loss and DPO's preference losses,
//! as TRL's `SFTTrainer` and `DPOTrainer` compute them: [`dpo_loss_with`] has TRL 1.16's
//! fifteen `loss_type`s (combined with weights), its f-divergences and metrics;
//! [`dpo_loss`] is the sigmoid loss with conservative-DPO label smoothing; [`kto_loss`] is
//! TRL's KTO and [`bco_loss`] its experimental BCO (with [`RunningMoments`], the running mean
//! of the implicit rewards), [`reward_loss`] its RewardTrainer's Bradley-Terry loss for reward models;
//! [`orpo_loss`] and [`cpo_loss`] (with SimPO and AlphaPO) are the reference-free preference
//! losses of TRL's experimental ORPO and CPO trainers.

use candle_core::{D, DType, Result, Tensor};

/// SFT: the negative log-likelihood of the completion tokens, averaged over the tokens whose
/// `mask` is 1 (the prompt and the padding are 0, so they carry no gradient).
///
/// `per_token_logps` and `mask` are `(B, T)`; `num_items` is the number of tokens the loss is
/// averaged over (pass the whole step's count when a step has several micro-batches, as
/// TRL's `num_items_in_batch`; `None` = this batch's `mask.sum()`).
pub fn sft_loss(per_token_logps: &Tensor, mask: &Tensor, num_items: Option<f64>) -> Result<Tensor> {
    sft_loss_typed(per_token_logps, mask, num_items, SftLossType::Nll)
}

/// TRL's SFT `loss_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SftLossType {
    /// The negative log-likelihood (TRL's default).
    #[default]
    Nll,
    /// Dynamic fine-tuning: each token's NLL weighted by its probability, as a constant
    /// (`−p·log p`, `p` without gradient).
    Dft,
}

impl std::str::FromStr for SftLossType {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "nll" => Ok(Self::Nll),
            "dft" => Ok(Self::Dft),
            other => Err(format!(
                "unknown SFT loss_type `{other}`: expected nll or dft"
            )),
        }
    }
}

impl SftLossType {
    /// TRL's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Nll => "nll",
            Self::Dft => "dft",
        }
    }
}

#[cfg(feature = "serde")]
crate::serde_by_name!(SftLossType, "nll or dft");

/// [`sft_loss`] with TRL's `loss_type`: `nll`, or `dft` (each token's NLL times its
/// probability, detached), summed over the masked tokens and divided by `num_items`.
pub fn sft_loss_typed(
    per_token_logps: &Tensor,
    mask: &Tensor,
    num_items: Option<f64>,
    loss_type: SftLossType,
) -> Result<Tensor> {
    let mask = mask.to_dtype(per_token_logps.dtype())?;
    let n = match num_items {
        Some(n) => n,
        None => mask.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?,
    };
    let nll = per_token_logps.neg()?;
    let per_token = match loss_type {
        SftLossType::Nll => nll,
        SftLossType::Dft => (nll * per_token_logps.detach().exp()?)?,
    };
    (per_token * &mask)?.sum_all()? / n.max(1.0)
}

/// Inputs of [`dpo_loss`]: summed log-probs of each pair's chosen and rejected completions,
/// `(B,)` each, under the policy and the frozen reference.
#[derive(Debug, Clone, Copy)]
pub struct DpoInputs<'a> {
    /// `Σ log π(chosen)`.
    pub policy_chosen: &'a Tensor,
    /// `Σ log π(rejected)`.
    pub policy_rejected: &'a Tensor,
    /// `Σ log π_ref(chosen)`.
    pub reference_chosen: &'a Tensor,
    /// `Σ log π_ref(rejected)`.
    pub reference_rejected: &'a Tensor,
    /// Completion tokens of each chosen completion, `(B,)`: needed by `ipo`, `sigmoid_norm`
    /// and `sft` ([`dpo_loss_with`]).
    pub chosen_tokens: Option<&'a Tensor>,
    /// Completion tokens of each rejected completion, `(B,)`: needed by `ipo` and
    /// `sigmoid_norm`.
    pub rejected_tokens: Option<&'a Tensor>,
    /// WPO's weight of each pair, `(B,)` ([`wpo_pair_weights`]), a constant factor of every
    /// loss type's per-pair loss; needed when [`DpoConfig::use_weighting`], refused otherwise.
    pub pair_weights: Option<&'a Tensor>,
}

/// WPO's pair weights (TRL's `use_weighting`, eq. 2 of the WPO paper), without gradient: for
/// each completion, `w = exp(mean over its tokens of (log π(y_t) − log Σ_v π(v)²))` — how
/// likely the completion is under the policy's own sampling, relative to the distribution's
/// sharpness — and for each pair `w_chosen · w_rejected`. `per_token_logps`, `log_sum_sq`
/// (`log Σ_v p_v²` at each position) and the 0/1 `mask` are `(2B, T)`: the B chosen
/// completions, then the B rejected ones. Returns `(B,)`.
///
/// # Errors
/// Shapes that differ, or an odd number of rows.
pub fn wpo_pair_weights(
    per_token_logps: &Tensor,
    log_sum_sq: &Tensor,
    mask: &Tensor,
) -> Result<Tensor> {
    let (n, _) = per_token_logps.dims2()?;
    if n % 2 != 0
        || log_sum_sq.dims() != per_token_logps.dims()
        || mask.dims() != per_token_logps.dims()
    {
        candle_core::bail!(
            "wpo_pair_weights: log-probs {:?}, log Σp² {:?} and mask {:?} must be one (2B, T) shape",
            per_token_logps.dims(),
            log_sum_sq.dims(),
            mask.dims()
        );
    }
    let dt = per_token_logps.dtype();
    let mask = mask.to_dtype(dt)?;
    let aligned = ((per_token_logps.detach() - log_sum_sq.detach().to_dtype(dt)?)? * &mask)?;
    let lengths = mask.sum(D::Minus1)?.maximum(1.0)?;
    let w = (aligned.sum(D::Minus1)? / lengths)?.exp()?;
    let b = n / 2;
    w.narrow(0, 0, b)? * w.narrow(0, b, b)?
}

/// What [`dpo_loss`] returns: the differentiable loss and TRL's metrics.
#[derive(Debug, Clone)]
pub struct DpoOutput {
    /// The mean loss over the pairs.
    pub loss: Tensor,
    /// `rewards/chosen`: mean of `β (log π(c) − log π_ref(c))`.
    pub rewards_chosen: f64,
    /// `rewards/rejected`: mean of `β (log π(r) − log π_ref(r))`.
    pub rewards_rejected: f64,
    /// `rewards/accuracies`: fraction of pairs whose chosen reward exceeds the rejected one.
    pub rewards_accuracies: f64,
    /// `rewards/margins`: mean of chosen − rejected reward.
    pub rewards_margins: f64,
    /// `logps/chosen`: mean summed policy log-prob of the chosen completions.
    pub logps_chosen: f64,
    /// `logps/rejected`: the same for the rejected ones.
    pub logps_rejected: f64,
}

impl DpoOutput {
    /// The metrics by TRL's names: `rewards/chosen`, `rewards/rejected`, `rewards/accuracies`,
    /// `rewards/margins`, `logps/chosen`, `logps/rejected`.
    pub fn metrics(&self) -> Vec<(&'static str, f64)> {
        named_pair_metrics([
            self.rewards_chosen,
            self.rewards_rejected,
            self.rewards_accuracies,
            self.rewards_margins,
            self.logps_chosen,
            self.logps_rejected,
        ])
    }
}

/// DPO's six metrics by TRL's names, in [`DpoOutput`]'s field order.
fn named_pair_metrics(v: [f64; 6]) -> Vec<(&'static str, f64)> {
    [
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    ]
    .into_iter()
    .zip(v)
    .collect()
}

/// DPO's metrics of a batch of pairs: the rewards `β ×` `reward_chosen` / `reward_rejected`
/// (their means, the share of pairs whose chosen reward is strictly larger, the mean margin)
/// and the mean policy log-probs `logps_chosen` / `logps_rejected`; all `(n,)`.
fn pair_metrics(
    loss: Tensor,
    (reward_chosen, reward_rejected): (&Tensor, &Tensor),
    beta: f64,
    (logps_chosen, logps_rejected): (&Tensor, &Tensor),
) -> Result<DpoOutput> {
    let vec = |t: &Tensor| -> Result<Vec<f64>> { t.detach().to_dtype(DType::F64)?.to_vec1() };
    let rc: Vec<f64> = vec(reward_chosen)?.into_iter().map(|v| v * beta).collect();
    let rr: Vec<f64> = vec(reward_rejected)?
        .into_iter()
        .map(|v| v * beta)
        .collect();
    let n = rc.len().max(1) as f64;
    let mean = |v: &[f64]| v.iter().sum::<f64>() / n;
    Ok(DpoOutput {
        loss,
        rewards_chosen: mean(&rc),
        rewards_rejected: mean(&rr),
        rewards_accuracies: rc.iter().zip(&rr).filter(|(c, r)| c > r).count() as f64 / n,
        rewards_margins: rc.iter().zip(&rr).map(|(c, r)| c - r).sum::<f64>() / n,
        logps_chosen: mean(&vec(logps_chosen)?),
        logps_rejected: mean(&vec(logps_rejected)?),
    })
}

/// `log σ(t)` computed stably as `min(t, 0) − log(1 + e^{−|t|})`, written so that candle's
/// gradient is `σ(−t)` everywhere, `t = 0` included (where the policy equals the reference:
/// a DPO run's first step). A form through `relu(−t)` takes candle's `relu′(0) = 1` and
/// `|t|′(0) = 1` and gives 1.5 there instead of 0.5.
fn log_sigmoid(t: &Tensor) -> Result<Tensor> {
    let negative = t.lt(0.0)?.where_cond(t, &t.zeros_like()?)?;
    negative - (t.abs()?.neg()?.exp()? + 1.0)?.log()?
}

/// `σ(t)`.
fn sigmoid(t: &Tensor) -> Result<Tensor> {
    log_sigmoid(t)?.exp()
}

/// DPO's sigmoid loss with conservative-DPO label smoothing ε:
/// `z = β ((π_c − π_r) − (ref_c − ref_r))`, loss `= −(1 − ε) log σ(z) − ε log σ(−z)`, the mean
/// over pairs. At ε = 0 it is TRL 1.16's `sigmoid`; TRL 1.16's sigmoid ignores ε, see
/// [`dpo_loss_with`] for its loss types (and WPO's `pair_weights`, which this one refuses).
pub fn dpo_loss(x: &DpoInputs<'_>, beta: f64, label_smoothing: f64) -> Result<DpoOutput> {
    if x.pair_weights.is_some() {
        candle_core::bail!("dpo_loss takes no pair_weights: use dpo_loss_with with use_weighting");
    }
    let chosen = (x.policy_chosen - x.reference_chosen)?;
    let rejected = (x.policy_rejected - x.reference_rejected)?;
    let z = ((&chosen - &rejected)? * beta)?;
    let pos = log_sigmoid(&z)?;
    let neg = log_sigmoid(&z.neg()?)?;
    let per_pair = ((pos * (-(1.0 - label_smoothing)))? + (neg * (-label_smoothing))?)?;
    let loss = per_pair.mean(D::Minus1)?;
    dpo_output(x, loss, beta)
}

/// TRL 1.16's DPO loss types (`DPOConfig.loss_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DpoLossType {
    /// `−log σ(βΔ)`, Δ the chosen − rejected score (the original DPO). TRL's default.
    #[default]
    Sigmoid,
    /// `relu(1 − βΔ)` (SLiC).
    Hinge,
    /// `(Δ_c/n_c − Δ_r/n_r − 1/(2β))²` on token-averaged scores (IPO).
    Ipo,
    /// EXO-pref with label smoothing ε (must be > 0).
    ExoPair,
    /// NCA: `−log σ(βΔ_c) − ½ log σ(−βΔ_c) − ½ log σ(−βΔ_r)` on the log-ratios.
    NcaPair,
    /// Robust DPO: `(−(1−ε) log σ(βΔ) + ε log σ(−βΔ)) / (1 − 2ε)`.
    Robust,
    /// BCO on pairs: `−log σ(β r_c) − log σ(−β r_r)`.
    BcoPair,
    /// SPPO with hard labels: `(r_c − 1/(2β))² + (r_r + 1/(2β))²`.
    SppoHard,
    /// AOT: the batch's policy and reference log-ratio differences sorted, then the smoothed
    /// sigmoid loss on their differences.
    Aot,
    /// AOT unpaired: the chosen and rejected log-ratios sorted separately.
    AotUnpaired,
    /// APO-zero: `1 − σ(β r_c) + σ(β r_r)`.
    ApoZero,
    /// APO-down: `σ(β r_c) + 1 − σ(β (r_c − r_r))`.
    ApoDown,
    /// DiscoPOP: logistic and exponential losses blended by `σ(βΔ/τ)`.
    Discopop,
    /// The chosen completions' mean token NLL (an SFT term, for combinations such as MPO).
    Sft,
    /// `−log σ(β (Δ_c/n_c − Δ_r/n_r))` on token-averaged scores.
    SigmoidNorm,
}

const DPO_LOSS_TYPES: [(&str, DpoLossType); 15] = [
    ("sigmoid", DpoLossType::Sigmoid),
    ("hinge", DpoLossType::Hinge),
    ("ipo", DpoLossType::Ipo),
    ("exo_pair", DpoLossType::ExoPair),
    ("nca_pair", DpoLossType::NcaPair),
    ("robust", DpoLossType::Robust),
    ("bco_pair", DpoLossType::BcoPair),
    ("sppo_hard", DpoLossType::SppoHard),
    ("aot", DpoLossType::Aot),
    ("aot_unpaired", DpoLossType::AotUnpaired),
    ("apo_zero", DpoLossType::ApoZero),
    ("apo_down", DpoLossType::ApoDown),
    ("discopop", DpoLossType::Discopop),
    ("sft", DpoLossType::Sft),
    ("sigmoid_norm", DpoLossType::SigmoidNorm),
];

impl std::str::FromStr for DpoLossType {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        let l = s.to_ascii_lowercase();
        DPO_LOSS_TYPES
            .iter()
            .find(|(n, _)| *n == l)
            .map(|(_, t)| *t)
            .ok_or_else(|| {
                let names: Vec<&str> = DPO_LOSS_TYPES.iter().map(|(n, _)| *n).collect();
                format!(
                    "unknown DPO loss_type `{s}`: expected one of {}",
                    names.join(", ")
                )
            })
    }
}

impl DpoLossType {
    /// TRL's spelling.
    pub fn as_str(self) -> &'static str {
        DPO_LOSS_TYPES
            .iter()
            .find(|(_, t)| *t == self)
            .map_or("sigmoid", |(n, _)| *n)
    }

    /// Whether `label_smoothing` enters the loss (robust, exo_pair, aot, aot_unpaired).
    pub fn uses_label_smoothing(self) -> bool {
        matches!(
            self,
            Self::Robust | Self::ExoPair | Self::Aot | Self::AotUnpaired
        )
    }

    /// Whether the loss sorts the pairs' log-ratios (aot, aot_unpaired), so that per-pair
    /// weights do not apply.
    pub fn sorts_pairs(self) -> bool {
        matches!(self, Self::Aot | Self::AotUnpaired)
    }

    /// Whether an f-divergence other than the reverse KL applies (the losses built on the
    /// chosen − rejected score difference).
    pub fn takes_f_divergence(self) -> bool {
        matches!(
            self,
            Self::Sigmoid
                | Self::SigmoidNorm
                | Self::Hinge
                | Self::Ipo
                | Self::ExoPair
                | Self::Robust
                | Self::Discopop
                | Self::Sft
        )
    }
}

#[cfg(feature = "serde")]
crate::serde_by_name!(DpoLossType, "a DPO loss type (sigmoid, hinge, ipo, ...)");

/// The f-divergence that turns each log-ratio into a score (TRL's `f_divergence_type`, f-DPO).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FDivergence {
    /// The score is the log-ratio (standard DPO). TRL's default.
    #[default]
    ReverseKl,
    /// `1 − e^(−u)`.
    ForwardKl,
    /// `log 2 + log σ(u)`.
    JsDivergence,
    /// `(e^((α−1)u) − 1)/(α − 1)` (the log-ratio itself at α = 1).
    AlphaDivergence,
}

impl std::str::FromStr for FDivergence {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "reverse_kl" => Ok(Self::ReverseKl),
            "forward_kl" => Ok(Self::ForwardKl),
            "js_divergence" => Ok(Self::JsDivergence),
            "alpha_divergence" => Ok(Self::AlphaDivergence),
            other => Err(format!(
                "unknown f_divergence_type `{other}`: expected reverse_kl, forward_kl, \
                 js_divergence or alpha_divergence"
            )),
        }
    }
}

impl FDivergence {
    /// TRL's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ReverseKl => "reverse_kl",
            Self::ForwardKl => "forward_kl",
            Self::JsDivergence => "js_divergence",
            Self::AlphaDivergence => "alpha_divergence",
        }
    }
}

#[cfg(feature = "serde")]
crate::serde_by_name!(
    FDivergence,
    "reverse_kl, forward_kl, js_divergence or alpha_divergence"
);

/// Options of [`dpo_loss_with`]; `Default` is TRL 1.16's `DPOConfig`.
#[derive(Debug, Clone, PartialEq)]
pub struct DpoConfig {
    /// The loss types, summed with `loss_weights`.
    pub loss_type: Vec<DpoLossType>,
    /// One weight per loss type; `None` = 1 each.
    pub loss_weights: Option<Vec<f64>>,
    /// β; 0.1.
    pub beta: f64,
    /// ε of robust, exo_pair, aot and aot_unpaired; 0.
    pub label_smoothing: f64,
    /// How log-ratios become scores; reverse KL.
    pub f_divergence_type: FDivergence,
    /// α of the α-divergence; 0.5.
    pub f_alpha_divergence_coef: f64,
    /// DiscoPOP's τ; 0.05.
    pub discopop_tau: f64,
    /// WPO (TRL's `use_weighting`): each pair's loss weighted by [`wpo_pair_weights`], passed
    /// as [`DpoInputs::pair_weights`]; false.
    pub use_weighting: bool,
}

impl Default for DpoConfig {
    fn default() -> Self {
        Self {
            loss_type: vec![DpoLossType::Sigmoid],
            loss_weights: None,
            beta: 0.1,
            label_smoothing: 0.0,
            f_divergence_type: FDivergence::ReverseKl,
            f_alpha_divergence_coef: 0.5,
            discopop_tau: 0.05,
            use_weighting: false,
        }
    }
}

impl DpoConfig {
    /// Checks the values as TRL does, naming the field to fix; also refuses a
    /// `label_smoothing` that no chosen loss type would use (TRL ignores it).
    pub fn validate(&self) -> std::result::Result<(), String> {
        if self.loss_type.is_empty() {
            return Err("loss_type needs at least one DPO loss type".into());
        }
        if let Some(w) = &self.loss_weights
            && w.len() != self.loss_type.len()
        {
            return Err(format!(
                "loss_weights has {} weights for {} loss types",
                w.len(),
                self.loss_type.len()
            ));
        }
        if !(self.beta.is_finite() && self.beta > 0.0) {
            return Err(format!(
                "beta must be a finite number > 0, got {}",
                self.beta
            ));
        }
        let ls = self.label_smoothing;
        if !(0.0..0.5).contains(&ls) {
            return Err(format!("label_smoothing must be in [0, 0.5), got {ls}"));
        }
        if ls > 0.0 && !self.loss_type.iter().any(|t| t.uses_label_smoothing()) {
            return Err(format!(
                "label_smoothing = {ls} is used by robust, exo_pair, aot and aot_unpaired only \
                 (TRL 1.16's sigmoid ignores it): choose one of them or set it to 0"
            ));
        }
        if self.loss_type.contains(&DpoLossType::ExoPair) && ls == 0.0 {
            return Err("exo_pair needs label_smoothing > 0 (the EXO paper suggests 1e-3)".into());
        }
        if self.f_divergence_type != FDivergence::ReverseKl
            && let Some(t) = self.loss_type.iter().find(|t| !t.takes_f_divergence())
        {
            return Err(format!(
                "f_divergence_type = {} does not apply to loss_type {} (only to sigmoid, \
                 sigmoid_norm, hinge, ipo, exo_pair, robust, discopop, sft)",
                self.f_divergence_type.as_str(),
                t.as_str()
            ));
        }
        if !(self.discopop_tau.is_finite() && self.discopop_tau > 0.0) {
            return Err(format!(
                "discopop_tau must be a finite number > 0, got {}",
                self.discopop_tau
            ));
        }
        if !self.f_alpha_divergence_coef.is_finite() {
            return Err("f_alpha_divergence_coef must be finite".into());
        }
        if self.use_weighting
            && let Some(t) = self.loss_type.iter().find(|t| t.sorts_pairs())
        {
            return Err(format!(
                "use_weighting (WPO) does not apply to loss_type {}: it sorts the pairs, so \
                 per-pair weights would not line up (as in TRL)",
                t.as_str()
            ));
        }
        Ok(())
    }
}

/// TRL 1.16's DPO loss (`DPOTrainer._compute_loss`): each log-ratio `r = π − π_ref` scored by
/// the f-divergence, `Δ = score_c − score_r`, each loss type's per-pair loss averaged over the
/// pairs and summed with the weights; the metrics as [`dpo_loss`]'s.
///
/// # Errors
/// An invalid config, or token counts missing for `ipo`, `sigmoid_norm` or `sft`.
pub fn dpo_loss_with(x: &DpoInputs<'_>, cfg: &DpoConfig) -> Result<DpoOutput> {
    cfg.validate().map_err(candle_core::Error::Msg)?;
    let beta = cfg.beta;
    let eps = cfg.label_smoothing;
    let cl = (x.policy_chosen - x.reference_chosen)?;
    let rl = (x.policy_rejected - x.reference_rejected)?;
    let score = |u: &Tensor| -> Result<Tensor> {
        match cfg.f_divergence_type {
            FDivergence::ReverseKl => Ok(u.clone()),
            FDivergence::ForwardKl => u.neg()?.exp()?.neg()? + 1.0,
            FDivergence::JsDivergence => log_sigmoid(u)? + std::f64::consts::LN_2,
            FDivergence::AlphaDivergence => {
                let a = cfg.f_alpha_divergence_coef;
                if (a - 1.0).abs() < 1e-6 {
                    return Ok(u.clone());
                }
                // TRL clamps (α − 1)·u at 11 in f16, 80 otherwise, so e^t stays finite.
                let cap = if u.dtype() == DType::F16 { 11.0 } else { 80.0 };
                let t = (u * (a - 1.0))?;
                let t = t.minimum(cap)?;
                (t.exp()? - 1.0)? * (1.0 / (a - 1.0))
            }
        }
    };
    let (cs, rs) = (score(&cl)?, score(&rl)?);
    let delta = (&cs - &rs)?;
    let pair_weights = match (cfg.use_weighting, x.pair_weights) {
        (true, Some(w)) => Some(w.detach().to_dtype(cl.dtype())?),
        (false, None) => None,
        (true, None) => candle_core::bail!("use_weighting needs DpoInputs::pair_weights"),
        (false, Some(_)) => {
            candle_core::bail!("pair_weights given without use_weighting in the DPO config")
        }
    };
    let tokens = |t: Option<&Tensor>, what: &str| -> Result<Tensor> {
        match t {
            Some(n) => n.to_dtype(cl.dtype())?.maximum(1.0),
            None => {
                candle_core::bail!("this DPO loss type needs the {what} completions' token counts")
            }
        }
    };
    let sorted = |t: &Tensor| -> Result<Tensor> {
        let idx = t.unsqueeze(0)?.arg_sort_last_dim(true)?.squeeze(0)?;
        t.index_select(&idx, 0)
    };
    let smoothed = |d: &Tensor| -> Result<Tensor> {
        let z = (d * beta)?;
        (log_sigmoid(&z)? * (-(1.0 - eps)))? - (log_sigmoid(&z.neg()?)? * eps)?
    };
    let weights = cfg
        .loss_weights
        .clone()
        .unwrap_or_else(|| vec![1.0; cfg.loss_type.len()]);
    let mut total: Option<Tensor> = None;
    for (&lt, &w) in cfg.loss_type.iter().zip(&weights) {
        let bd = (&delta * beta)?;
        let per_pair = match lt {
            DpoLossType::Sigmoid => log_sigmoid(&bd)?.neg()?,
            // torch's relu has slope 0 at 0, candle's 1: a where keeps torch's.
            DpoLossType::Hinge => {
                let h = (bd.neg()? + 1.0)?;
                h.gt(0.0)?.where_cond(&h, &h.zeros_like()?)?
            }
            DpoLossType::Ipo | DpoLossType::SigmoidNorm => {
                let nc = tokens(x.chosen_tokens, "chosen")?;
                let nr = tokens(x.rejected_tokens, "rejected")?;
                let d = ((&cs / &nc)? - (&rs / &nr)?)?;
                match lt {
                    DpoLossType::Ipo => (d - 1.0 / (2.0 * beta))?.sqr()?,
                    _ => log_sigmoid(&(d * beta)?)?.neg()?,
                }
            }
            DpoLossType::ExoPair => {
                let (qw, log_qw) = (sigmoid(&bd)?, log_sigmoid(&bd)?);
                let (ql, log_ql) = (sigmoid(&bd.neg()?)?, log_sigmoid(&bd.neg()?)?);
                let (log_pw, log_pl) = ((-eps).ln_1p(), eps.ln());
                ((qw * (log_qw - log_pw)?)? + (ql * (log_ql - log_pl)?)?)?
            }
            DpoLossType::NcaPair => {
                let (c, r) = ((&cl * beta)?, (&rl * beta)?);
                ((log_sigmoid(&c)?.neg()? - (log_sigmoid(&c.neg()?)? * 0.5)?)?
                    - (log_sigmoid(&r.neg()?)? * 0.5)?)?
            }
            DpoLossType::Robust => {
                let clean = (log_sigmoid(&bd)? * (-(1.0 - eps)))?;
                let flipped = (log_sigmoid(&bd.neg()?)? * (-eps))?;
                ((clean - flipped)? / (1.0 - 2.0 * eps))?
            }
            DpoLossType::BcoPair => {
                (log_sigmoid(&(&cl * beta)?)?.neg()? - log_sigmoid(&(&rl * (-beta))?)?)?
            }
            DpoLossType::SppoHard => ((&cl - 0.5 / beta)?.sqr()? + (&rl + 0.5 / beta)?.sqr()?)?,
            DpoLossType::Aot => {
                let lr = (x.policy_chosen - x.policy_rejected)?;
                let rr = (x.reference_chosen - x.reference_rejected)?;
                smoothed(&(sorted(&lr)? - sorted(&rr)?)?)?
            }
            DpoLossType::AotUnpaired => smoothed(&(sorted(&cl)? - sorted(&rl)?)?)?,
            DpoLossType::ApoZero => {
                ((sigmoid(&(&cl * beta)?)?.neg()? + 1.0)? + sigmoid(&(&rl * beta)?)?)?
            }
            DpoLossType::ApoDown => {
                let d = ((&cl - &rl)? * beta)?;
                (sigmoid(&(&cl * beta)?)? + (sigmoid(&d)?.neg()? + 1.0)?)?
            }
            DpoLossType::Discopop => {
                let m = sigmoid(&(&bd / cfg.discopop_tau)?)?;
                let logistic = log_sigmoid(&bd)?.neg()?;
                let exp = bd.neg()?.exp()?;
                ((logistic * (m.neg()? + 1.0)?)? + (exp * m)?)?
            }
            DpoLossType::Sft => {
                let nc = tokens(x.chosen_tokens, "chosen")?;
                let mean = (x.policy_chosen.sum_all()? / nc.sum_all()?)?.neg()?;
                mean.broadcast_as(x.policy_chosen.shape())?
            }
        };
        let per_pair = match &pair_weights {
            Some(pw) => (per_pair * pw)?,
            None => per_pair,
        };
        let term = (per_pair.mean(D::Minus1)? * w)?;
        total = Some(match total {
            Some(t) => (t + term)?,
            None => term,
        });
    }
    let loss = match total {
        Some(t) => t,
        None => candle_core::bail!("no DPO loss type"),
    };
    dpo_output(x, loss, beta)
}

/// The loss with TRL's metrics (`rewards/*` from `β ×` the log-ratios, `logps/*`).
fn dpo_output(x: &DpoInputs<'_>, loss: Tensor, beta: f64) -> Result<DpoOutput> {
    let chosen = (x.policy_chosen - x.reference_chosen)?;
    let rejected = (x.policy_rejected - x.reference_rejected)?;
    pair_metrics(
        loss,
        (&chosen, &rejected),
        beta,
        (x.policy_chosen, x.policy_rejected),
    )
}

/// TRL's KTO `loss_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KtoLossType {
    /// KTO (eq. 7 of the KTO paper): desirable `1 − σ(β(r − z))`, undesirable `1 − σ(β(z − r))`
    /// with `z` the batch's KL estimate (TRL's default).
    #[default]
    Kto,
    /// APO-zero on unpaired rows: desirable `1 − σ(βr)`, undesirable `σ(βr)`; no KL estimate.
    ApoZeroUnpaired,
}

impl std::str::FromStr for KtoLossType {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "kto" => Ok(Self::Kto),
            "apo_zero_unpaired" => Ok(Self::ApoZeroUnpaired),
            other => Err(format!(
                "unknown KTO loss_type `{other}`: expected kto or apo_zero_unpaired"
            )),
        }
    }
}

impl KtoLossType {
    /// TRL's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Kto => "kto",
            Self::ApoZeroUnpaired => "apo_zero_unpaired",
        }
    }

    /// Whether the loss uses the KL estimate from mismatched (prompt, completion) pairs.
    pub fn uses_kl(self) -> bool {
        self == Self::Kto
    }
}

#[cfg(feature = "serde")]
crate::serde_by_name!(KtoLossType, "kto or apo_zero_unpaired");

/// Options of [`kto_loss`]; `Default` is TRL 1.16's `KTOConfig`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KtoConfig {
    /// β; 0.1.
    pub beta: f64,
    /// The weight of each desirable row's loss; 1.
    pub desirable_weight: f64,
    /// The weight of each undesirable row's loss; 1.
    pub undesirable_weight: f64,
    /// kto or apo_zero_unpaired.
    pub loss_type: KtoLossType,
}

impl Default for KtoConfig {
    fn default() -> Self {
        Self {
            beta: 0.1,
            desirable_weight: 1.0,
            undesirable_weight: 1.0,
            loss_type: KtoLossType::Kto,
        }
    }
}

/// What [`kto_loss`] and [`bco_loss`] return: the loss and the sums TRL's metrics are made of.
#[derive(Debug, Clone)]
pub struct KtoOutput {
    /// The mean of the rows' weighted losses.
    pub loss: Tensor,
    /// Σ β·(π − π_ref) over the desirable rows, and their count.
    pub chosen_rewards: (f64, usize),
    /// Σ β·(π − π_ref) over the undesirable rows, and their count.
    pub rejected_rewards: (f64, usize),
    /// Σ π over the desirable rows.
    pub chosen_logps: f64,
    /// Σ π over the undesirable rows.
    pub rejected_logps: f64,
}

/// TRL 1.16's KTO loss (`KTOTrainer._compute_loss`) on a batch of unpaired rows: `policy` and
/// `reference` are each completion's summed log-probs `(B,)`, `desirable` each row's label,
/// `kl` the batch's KL estimate (TRL: the mean of policy − reference log-probs of mismatched
/// prompt/completion pairs, clamped at 0, no gradient; ignored by apo_zero_unpaired). The
/// loss is the mean over the rows of each row's loss times its label's weight.
///
/// # Errors
/// Shapes that differ from `desirable`'s length, or an empty batch.
pub fn kto_loss(
    policy: &Tensor,
    reference: &Tensor,
    desirable: &[bool],
    kl: f64,
    cfg: &KtoConfig,
) -> Result<KtoOutput> {
    let n = check_unpaired("kto_loss", policy, reference, desirable)?;
    let beta = cfg.beta;
    let dt = policy.dtype();
    let dev = policy.device();
    let r = (policy - reference)?;
    let z = if cfg.loss_type.uses_kl() { kl } else { 0.0 };
    // Desirable rows: 1 − σ(β(r − z)); undesirable: 1 − σ(β(z − r)) = σ(β(r − z)) for kto,
    // σ(βr) for apo_zero_unpaired — both σ(β(r − z)) with z = 0 there.
    let s = sigmoid(&((&r - z)? * beta)?)?;
    let sign: Vec<f64> = desirable
        .iter()
        .map(|&d| if d { -1.0 } else { 1.0 })
        .collect();
    let offset: Vec<f64> = desirable
        .iter()
        .map(|&d| if d { 1.0 } else { 0.0 })
        .collect();
    let weight: Vec<f64> = desirable
        .iter()
        .map(|&d| {
            if d {
                cfg.desirable_weight
            } else {
                cfg.undesirable_weight
            }
        })
        .collect();
    let t = |v: Vec<f64>| -> Result<Tensor> { Tensor::from_vec(v, n, dev)?.to_dtype(dt) };
    let per_row = ((s * t(sign)?)? + t(offset)?)?;
    let loss = (per_row * t(weight)?)?.mean_all()?;
    unpaired_output(loss, &(r * beta)?, policy, desirable)
}

/// The row count of an unpaired batch: `policy` and `reference` `(n,)` for `n ≥ 1` labels.
fn check_unpaired(
    what: &str,
    policy: &Tensor,
    reference: &Tensor,
    desirable: &[bool],
) -> Result<usize> {
    let n = desirable.len();
    if n == 0 || policy.dims() != [n] || reference.dims() != [n] {
        candle_core::bail!(
            "{what}: log-probs {:?} and {:?} for {n} labels",
            policy.dims(),
            reference.dims()
        );
    }
    Ok(n)
}

/// `loss` with the sums of the rows' implicit `rewards` and `policy` log-probs by label.
fn unpaired_output(
    loss: Tensor,
    rewards: &Tensor,
    policy: &Tensor,
    desirable: &[bool],
) -> Result<KtoOutput> {
    let rv: Vec<f64> = rewards.detach().to_dtype(DType::F64)?.to_vec1()?;
    let pv: Vec<f64> = policy.detach().to_dtype(DType::F64)?.to_vec1()?;
    let sum = |want: bool, v: &[f64]| -> f64 {
        v.iter()
            .zip(desirable)
            .filter(|(_, d)| **d == want)
            .map(|(x, _)| x)
            .sum()
    };
    let count = |want: bool| desirable.iter().filter(|&&d| d == want).count();
    Ok(KtoOutput {
        loss,
        chosen_rewards: (sum(true, &rv), count(true)),
        rejected_rewards: (sum(false, &rv), count(false)),
        chosen_logps: sum(true, &pv),
        rejected_logps: sum(false, &pv),
    })
}

/// TRL's experimental BCO loss (`BCOTrainer.bco_loss`, "Binary Classifier Optimization for
/// Large Language Model Alignment", without the underlying-distribution matching): each row's
/// implicit reward `r = β·(π − π_ref)` (summed log-probs `(B,)`) is a logit of a binary
/// classifier shifted by `delta`, the running mean of the rewards seen ([`RunningMoments`]):
/// desirable rows `−log σ(r − δ)`, undesirable ones `−log σ(−(r − δ))`. The loss is the mean
/// over the rows.
///
/// # Errors
/// Shapes that differ from `desirable`'s length, or an empty batch.
pub fn bco_loss(
    policy: &Tensor,
    reference: &Tensor,
    desirable: &[bool],
    beta: f64,
    delta: f64,
) -> Result<KtoOutput> {
    bco_loss_weighted(policy, reference, desirable, beta, delta, None)
}

/// [`bco_loss`] with each row's loss multiplied by its weight before the mean over the rows
/// (`None`: every weight 1): BCO's underlying distribution matching weighs each undesirable
/// row by the density ratio of its prompt ([`crate::udm`]) and each desirable row by 1, as
/// TRL's `bco_loss` with an `embedding_func`.
///
/// # Errors
/// Shapes that differ from `desirable`'s length, a weight per row missing, or an empty batch.
pub fn bco_loss_weighted(
    policy: &Tensor,
    reference: &Tensor,
    desirable: &[bool],
    beta: f64,
    delta: f64,
    weights: Option<&[f64]>,
) -> Result<KtoOutput> {
    let n = check_unpaired("bco_loss", policy, reference, desirable)?;
    let r = ((policy - reference)? * beta)?;
    let sign: Vec<f64> = desirable
        .iter()
        .map(|&d| if d { 1.0 } else { -1.0 })
        .collect();
    let sign = Tensor::from_vec(sign, n, policy.device())?.to_dtype(policy.dtype())?;
    let losses = log_sigmoid(&(&r - delta)?.mul(&sign)?)?.neg()?;
    let losses = match weights {
        None => losses,
        Some(w) if w.len() == n => {
            let w = Tensor::from_slice(w, n, policy.device())?.to_dtype(policy.dtype())?;
            (losses * w)?
        }
        Some(w) => candle_core::bail!("bco_loss: {} weights for {n} rows", w.len()),
    };
    unpaired_output(losses.mean_all()?, &r, policy, desirable)
}

/// The running mean and variance of a stream of values, merged batch by batch (TRL's
/// `RunningMoments`, BCO's `delta`): starting from mean 0, variance 1 and a count of 1e-24 (so
/// the first batch sets them), each batch's population mean and variance are merged by
/// Chan et al.'s parallel update; `std` is the unbiased standard deviation of all values seen.
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct RunningMoments {
    /// The mean of the values seen.
    pub mean: f64,
    /// Their standard deviation (n − 1).
    pub std: f64,
    /// Their population variance.
    pub var: f64,
    /// How many (plus 1e-24).
    pub count: f64,
}

impl Default for RunningMoments {
    fn default() -> Self {
        Self {
            mean: 0.0,
            std: 1.0,
            var: 1.0,
            count: 1e-24,
        }
    }
}

impl RunningMoments {
    /// Merges a batch of values (none: no change). Returns the batch's mean and unbiased
    /// standard deviation (NaN for a single value), as TRL's `update`.
    pub fn update(&mut self, xs: &[f64]) -> (f64, f64) {
        if xs.is_empty() {
            return (f64::NAN, f64::NAN);
        }
        let n = xs.len() as f64;
        let mean = xs.iter().sum::<f64>() / n;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
        let delta = mean - self.mean;
        let total = self.count + n;
        let old_sum = self.var * self.count + delta * delta * self.count * n / total;
        let new_var = (old_sum + var * n) / total;
        self.mean += delta * n / total;
        self.std = (new_var * total / (total - 1.0)).sqrt();
        self.var = new_var;
        self.count = total;
        (mean, (var * n / (n - 1.0)).sqrt())
    }
}

/// What [`reward_loss`] returns: the loss (with its graph) and TRL's `RewardTrainer` metrics.
#[derive(Debug, Clone)]
pub struct RewardOutput {
    /// `−log σ(r_c − r_r − margin)` averaged over the pairs, plus the centring term.
    pub loss: Tensor,
    /// `accuracy`: the share of pairs with `r_c > r_r` (strictly).
    pub accuracy: f64,
    /// `margin`: the mean of `r_c − r_r`.
    pub margin: f64,
    /// `min_reward`, `mean_reward`, `max_reward`: over every score of the batch, chosen and
    /// rejected.
    pub min_reward: f64,
    /// See `min_reward`.
    pub mean_reward: f64,
    /// See `min_reward`.
    pub max_reward: f64,
}

/// TRL 1.16's `RewardTrainer` loss (Bradley-Terry): the reward model's scores of each pair's
/// chosen (`chosen`, `(n,)`) and rejected (`rejected`) sequence give
/// `−log σ(r_c − r_r − m)` averaged over the pairs, with `m` the row's `margin` when given
/// (zero otherwise), plus `center · mean((r_c + r_r)²)` when `center_rewards_coefficient` is
/// set (Eisenstein et al.'s centring: scores stay near zero).
///
/// # Errors
/// Shapes that differ, or an empty batch.
pub fn reward_loss(
    chosen: &Tensor,
    rejected: &Tensor,
    margin: Option<&Tensor>,
    center_rewards_coefficient: Option<f64>,
) -> Result<RewardOutput> {
    let n = chosen.elem_count();
    if n == 0 || chosen.dims() != [n] || rejected.dims() != [n] {
        candle_core::bail!(
            "reward_loss: scores {:?} (chosen) and {:?} (rejected), expected two (n,) vectors",
            chosen.dims(),
            rejected.dims()
        );
    }
    let diff = (chosen - rejected)?;
    let shifted = match margin {
        Some(m) if m.dims() != [n] => {
            candle_core::bail!("reward_loss: margins {:?} for {n} pairs", m.dims())
        }
        Some(m) => (&diff - m.to_dtype(diff.dtype())?)?,
        None => diff.clone(),
    };
    let mut loss = log_sigmoid(&shifted)?.mean_all()?.neg()?;
    if let Some(c) = center_rewards_coefficient {
        loss = (loss + ((chosen + rejected)?.sqr()?.mean_all()? * c)?)?;
    }
    let d: Vec<f64> = diff.detach().to_dtype(DType::F64)?.to_vec1()?;
    let all: Vec<f64> = Tensor::cat(&[chosen.detach(), rejected.detach()], 0)?
        .to_dtype(DType::F64)?
        .to_vec1()?;
    Ok(RewardOutput {
        loss,
        accuracy: d.iter().filter(|&&x| x > 0.0).count() as f64 / n as f64,
        margin: d.iter().sum::<f64>() / n as f64,
        min_reward: all.iter().copied().fold(f64::INFINITY, f64::min),
        mean_reward: all.iter().sum::<f64>() / all.len() as f64,
        max_reward: all.iter().copied().fold(f64::NEG_INFINITY, f64::max),
    })
}

/// TRL's CPO `loss_type` (its experimental `CPOTrainer`); `alphapo` is `simpo` with
/// `cpo_alpha = 0` (see [`CpoConfig::alphapo`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CpoLossType {
    /// `−(1−ε) log σ(βΔ) − ε log σ(−βΔ)` on the summed log-probs (CPO, eq. 3). The default.
    #[default]
    Sigmoid,
    /// `relu(1 − βΔ)` on the summed log-probs (SLiC).
    Hinge,
    /// `(Δ − 1/(2β))²` on the token-averaged log-probs (IPO).
    Ipo,
    /// `−(1−ε) log σ(βΔ − γ) − ε log σ(−(βΔ − γ))` on the token-averaged log-probs (SimPO, γ =
    /// `simpo_gamma`).
    Simpo,
}

impl std::str::FromStr for CpoLossType {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "sigmoid" => Ok(Self::Sigmoid),
            "hinge" => Ok(Self::Hinge),
            "ipo" => Ok(Self::Ipo),
            "simpo" => Ok(Self::Simpo),
            other => Err(format!(
                "unknown CPO loss_type `{other}`: expected sigmoid, hinge, ipo, simpo or alphapo"
            )),
        }
    }
}

impl CpoLossType {
    /// TRL's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Sigmoid => "sigmoid",
            Self::Hinge => "hinge",
            Self::Ipo => "ipo",
            Self::Simpo => "simpo",
        }
    }

    /// Whether the loss takes each completion's mean token log-prob (ipo, simpo) rather than
    /// the sum (TRL's `average_log_prob`).
    pub fn averages_log_probs(self) -> bool {
        matches!(self, Self::Ipo | Self::Simpo)
    }

    /// Whether `label_smoothing` enters the loss (sigmoid, simpo).
    pub fn uses_label_smoothing(self) -> bool {
        matches!(self, Self::Sigmoid | Self::Simpo)
    }
}

/// Options of [`cpo_loss`]; `Default` is TRL 1.16's `CPOConfig`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CpoConfig {
    /// β; 0.1. For ipo it is the regulariser τ.
    pub beta: f64,
    /// Label smoothing ε of sigmoid and simpo; 0.
    pub label_smoothing: f64,
    /// The loss type; sigmoid.
    pub loss_type: CpoLossType,
    /// The weight of the behaviour-cloning term (the chosen completions' mean token NLL); 1.
    pub cpo_alpha: f64,
    /// SimPO's target margin γ; 0.5.
    pub simpo_gamma: f64,
    /// AlphaPO's α: when non-zero each completion's reward is `(1 − p^(−α)) / α` with `p` the
    /// exponentiated log-prob, instead of the log-prob itself; 0.
    pub alpha: f64,
}

impl Default for CpoConfig {
    fn default() -> Self {
        Self {
            beta: 0.1,
            label_smoothing: 0.0,
            loss_type: CpoLossType::Sigmoid,
            cpo_alpha: 1.0,
            simpo_gamma: 0.5,
            alpha: 0.0,
        }
    }
}

impl CpoConfig {
    /// TRL's `loss_type = "alphapo"`: SimPO without the behaviour-cloning term, with AlphaPO's
    /// reward shape `alpha`.
    pub fn alphapo(alpha: f64) -> Self {
        Self {
            loss_type: CpoLossType::Simpo,
            cpo_alpha: 0.0,
            alpha,
            ..Self::default()
        }
    }

    /// Checks the options: β > 0, ε in [0, 0.5) and only where it applies, finite weights.
    ///
    /// # Errors
    /// The first option out of range, in one line.
    pub fn validate(&self) -> std::result::Result<(), String> {
        if !(self.beta > 0.0 && self.beta.is_finite()) {
            return Err(format!("beta must be > 0, got {}", self.beta));
        }
        let ls = self.label_smoothing;
        if !(0.0..0.5).contains(&ls) {
            return Err(format!("label_smoothing must be in [0, 0.5), got {ls}"));
        }
        if ls > 0.0 && !self.loss_type.uses_label_smoothing() {
            return Err(format!(
                "label_smoothing does not apply to loss_type {} (only to sigmoid and simpo)",
                self.loss_type.as_str()
            ));
        }
        if !(self.cpo_alpha >= 0.0 && self.cpo_alpha.is_finite()) {
            return Err(format!("cpo_alpha must be >= 0, got {}", self.cpo_alpha));
        }
        if !self.simpo_gamma.is_finite() || !self.alpha.is_finite() {
            return Err("simpo_gamma and alpha must be finite".into());
        }
        Ok(())
    }
}

/// What [`cpo_loss`] and [`orpo_loss`] return: the differentiable loss and TRL's metrics.
#[derive(Debug, Clone)]
pub struct PairLossOutput {
    /// The scalar loss: the mean pair loss plus the NLL term.
    pub loss: Tensor,
    /// `rewards/chosen`: mean of β × the chosen completions' reward (log-prob, or AlphaPO's).
    pub rewards_chosen: f64,
    /// `rewards/rejected`: the same for the rejected completions.
    pub rewards_rejected: f64,
    /// `rewards/accuracies`: the share of pairs whose chosen reward is strictly larger.
    pub rewards_accuracies: f64,
    /// `rewards/margins`: mean of chosen − rejected reward.
    pub rewards_margins: f64,
    /// `logps/chosen`: mean log-prob of the chosen completions as the loss takes them (summed
    /// or token-averaged).
    pub logps_chosen: f64,
    /// `logps/rejected`: the same for the rejected ones.
    pub logps_rejected: f64,
    /// `nll_loss`: the NLL term before its weight.
    pub nll_loss: f64,
    /// ORPO's `log_odds_ratio`: mean of `log σ(log odds(chosen) − log odds(rejected))`.
    pub log_odds_ratio: Option<f64>,
    /// ORPO's `log_odds_chosen`: mean of the log odds ratio itself.
    pub log_odds_chosen: Option<f64>,
}

impl PairLossOutput {
    /// The metrics by TRL's names: DPO's six ([`DpoOutput::metrics`]), `nll_loss`, and ORPO's
    /// `log_odds_ratio` and `log_odds_chosen`.
    pub fn metrics(&self) -> Vec<(&'static str, f64)> {
        let mut m = named_pair_metrics([
            self.rewards_chosen,
            self.rewards_rejected,
            self.rewards_accuracies,
            self.rewards_margins,
            self.logps_chosen,
            self.logps_rejected,
        ]);
        m.push(("nll_loss", self.nll_loss));
        if let (Some(r), Some(c)) = (self.log_odds_ratio, self.log_odds_chosen) {
            m.extend([("log_odds_ratio", r), ("log_odds_chosen", c)]);
        }
        m
    }
}

fn check_pairs(what: &str, chosen: &Tensor, rejected: &Tensor, nll: &Tensor) -> Result<usize> {
    let n = chosen.elem_count();
    if n == 0 || chosen.dims() != [n] || rejected.dims() != [n] || nll.elem_count() != 1 {
        candle_core::bail!(
            "{what}: log-probs {:?} (chosen) and {:?} (rejected), NLL {:?}: expected two (n,) \
             vectors and a scalar",
            chosen.dims(),
            rejected.dims(),
            nll.dims()
        );
    }
    Ok(n)
}

/// Rewards `β r` of both sides and the metrics shared by CPO and ORPO.
fn pair_output(
    loss: Tensor,
    (chosen, rejected): (&Tensor, &Tensor),
    (reward_chosen, reward_rejected): (&Tensor, &Tensor),
    beta: f64,
    nll: &Tensor,
) -> Result<PairLossOutput> {
    let d = pair_metrics(
        loss,
        (reward_chosen, reward_rejected),
        beta,
        (chosen, rejected),
    )?;
    Ok(PairLossOutput {
        loss: d.loss,
        rewards_chosen: d.rewards_chosen,
        rewards_rejected: d.rewards_rejected,
        rewards_accuracies: d.rewards_accuracies,
        rewards_margins: d.rewards_margins,
        logps_chosen: d.logps_chosen,
        logps_rejected: d.logps_rejected,
        nll_loss: nll
            .detach()
            .flatten_all()?
            .to_dtype(DType::F64)?
            .to_vec1::<f64>()?[0],
        log_odds_ratio: None,
        log_odds_chosen: None,
    })
}

/// TRL 1.16's CPO loss (its experimental `CPOTrainer`), reference-free: `chosen` and
/// `rejected` are the policy's log-probs of each pair's completions, `(n,)` — summed over the
/// completion tokens, or token-averaged for ipo and simpo
/// ([`CpoLossType::averages_log_probs`]); `nll` is the chosen completions' mean token NLL (a
/// scalar, TRL's `CrossEntropyLoss` over the batch's chosen completion tokens). With AlphaPO's
/// `alpha ≠ 0` each side's reward is `(1 − e^{−α·logp}) / α`, otherwise the log-prob; `Δ` is
/// the chosen − rejected reward, and the loss is the loss type's mean over the pairs plus
/// `cpo_alpha · nll`.
///
/// # Errors
/// Shapes that differ, or an empty batch.
pub fn cpo_loss(
    chosen: &Tensor,
    rejected: &Tensor,
    nll: &Tensor,
    cfg: &CpoConfig,
) -> Result<PairLossOutput> {
    check_pairs("cpo_loss", chosen, rejected, nll)?;
    let beta = cfg.beta;
    // AlphaPO: (1 − p^(−α)) / α = (1 − e^(−α·logp)) / α.
    let reward = |lp: &Tensor| -> Result<Tensor> {
        match cfg.alpha {
            0.0 => Ok(lp.clone()),
            a => ((lp * -a)?.exp()?.neg()? + 1.0)? / a,
        }
    };
    let (rc, rr) = (reward(chosen)?, reward(rejected)?);
    let delta = (&rc - &rr)?;
    let ls = cfg.label_smoothing;
    let smoothed = |z: &Tensor| -> Result<Tensor> {
        let pos = log_sigmoid(z)?;
        let neg = log_sigmoid(&z.neg()?)?;
        (pos * (-(1.0 - ls)))? + (neg * (-ls))?
    };
    let per_pair = match cfg.loss_type {
        CpoLossType::Sigmoid => smoothed(&(&delta * beta)?)?,
        CpoLossType::Simpo => smoothed(&((&delta * beta)? - cfg.simpo_gamma)?)?,
        CpoLossType::Hinge => ((&delta * -beta)? + 1.0)?.relu()?,
        CpoLossType::Ipo => (&delta - 1.0 / (2.0 * beta))?.sqr()?,
    };
    let mut loss = per_pair.mean_all()?;
    if cfg.cpo_alpha != 0.0 {
        let nll = nll.flatten_all()?.squeeze(0)?.to_dtype(loss.dtype())?;
        loss = (loss + (nll * cfg.cpo_alpha)?)?;
    }
    pair_output(loss, (chosen, rejected), (&rc, &rr), beta, nll)
}

/// `log(1 − e^x)` for `x < 0`, in f64 (TRL's `log1mexp`; f64 keeps `1 − e^x` accurate as `x`
/// nears 0, where TRL takes `expm1`).
fn log1mexp(x: &Tensor) -> Result<Tensor> {
    (x.to_dtype(DType::F64)?.exp()?.neg()? + 1.0)?.log()
}

/// TRL 1.16's ORPO loss (its experimental `ORPOTrainer`), reference-free: `chosen` and
/// `rejected` are the policy's token-averaged log-probs of each pair's completions, `(n,)`;
/// `nll` is the chosen sequences' mean token NLL (a scalar: ORPO's NLL covers prompt and
/// completion). With `log odds(y) = logp − log(1 − e^logp)` and
/// `L_OR = log σ(log odds(chosen) − log odds(rejected))`, the loss is `nll − β · mean(L_OR)`;
/// the rewards are `β · logp`.
///
/// # Errors
/// Shapes that differ, or an empty batch.
pub fn orpo_loss(
    chosen: &Tensor,
    rejected: &Tensor,
    nll: &Tensor,
    beta: f64,
) -> Result<PairLossOutput> {
    check_pairs("orpo_loss", chosen, rejected, nll)?;
    let (c, r) = (chosen.to_dtype(DType::F64)?, rejected.to_dtype(DType::F64)?);
    let log_odds = ((&c - &r)? - (log1mexp(&c)? - log1mexp(&r)?)?)?;
    let ratio = log_sigmoid(&log_odds)?;
    let nll_t = nll.flatten_all()?.squeeze(0)?;
    let odds_term = (ratio.mean_all()? * beta)?.to_dtype(nll_t.dtype())?;
    let loss = (&nll_t - odds_term)?;
    let mean = |t: &Tensor| -> Result<f64> { t.detach().mean_all()?.to_scalar::<f64>() };
    let mut out = pair_output(loss, (chosen, rejected), (chosen, rejected), beta, nll)?;
    out.log_odds_ratio = Some(mean(&ratio)?);
    out.log_odds_chosen = Some(mean(&log_odds)?);
    Ok(out)
}
