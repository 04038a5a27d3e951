//! The supervised objectives beside GRPO: SFT's masked token loss and DPO's sigmoid
//! preference loss, as TRL's `SFTTrainer` and `DPOTrainer` compute them.

use candle_core::{D, DType, Result, Tensor};

/// SFT: the negative log-likelihood of the completion tokens, averaged over the tokens whose
/// `mask` is 1 (the prompt and the padding are 0, so they carry no gradient).
///
/// `per_token_logps` and `mask` are `(B, T)`; `num_items` is the number of tokens the loss is
/// averaged over (pass the whole step's count when a step has several micro-batches, as
/// TRL's `num_items_in_batch`; `None` = this batch's `mask.sum()`).
pub fn sft_loss(per_token_logps: &Tensor, mask: &Tensor, num_items: Option<f64>) -> Result<Tensor> {
    let mask = mask.to_dtype(per_token_logps.dtype())?;
    let n = match num_items {
        Some(n) => n,
        None => mask.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?,
    };
    (per_token_logps * &mask)?.sum_all()?.neg()? / n.max(1.0)
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

/// DPO's sigmoid loss (TRL's `loss_type="sigmoid"`, `label_smoothing` ε):
/// `z = β ((π_c − π_r) − (ref_c − ref_r))`, loss `= −(1 − ε) log σ(z) − ε log σ(−z)`, the mean
/// over pairs.
pub fn dpo_loss(x: &DpoInputs<'_>, beta: f64, label_smoothing: f64) -> Result<DpoOutput> {
    let chosen = (x.policy_chosen - x.reference_chosen)?;
    let rejected = (x.policy_rejected - x.reference_rejected)?;
    let z = ((&chosen - &rejected)? * beta)?;
    // log σ(z) = −softplus(−z), computed stably as −(max(−z, 0) + log(1 + e^{−|z|})).
    let log_sigmoid = |t: &Tensor| -> Result<Tensor> {
        let softplus_neg = (t.neg()?.relu()? + (t.abs()?.neg()?.exp()? + 1.0)?.log()?)?;
        softplus_neg.neg()
    };
    let pos = log_sigmoid(&z)?;
    let neg = log_sigmoid(&z.neg()?)?;
    let per_pair = ((pos * (-(1.0 - label_smoothing)))? + (neg * (-label_smoothing))?)?;
    let loss = per_pair.mean(D::Minus1)?;
    let vec = |t: &Tensor| -> Result<Vec<f64>> { t.detach().to_dtype(DType::F64)?.to_vec1() };
    let rc: Vec<f64> = vec(&chosen)?.into_iter().map(|v| v * beta).collect();
    let rr: Vec<f64> = vec(&rejected)?.into_iter().map(|v| v * beta).collect();
    let n = rc.len().max(1) as f64;
    let mean = |v: &[f64]| v.iter().sum::<f64>() / n;
    Ok(DpoOutput {
        loss,
        rewards_chosen: mean(&rc),
        rewards_rejected: mean(&rr),
        rewards_accuracies: rc.iter().zip(&rr).filter(|(c, r)| c > r).count() as f64 / n,
        rewards_margins: rc.iter().zip(&rr).map(|(c, r)| c - r).sum::<f64>() / n,
        logps_chosen: mean(&vec(x.policy_chosen)?),
        logps_rejected: mean(&vec(x.policy_rejected)?),
    })
}
