//! Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for
//! Reasoning Language Models"; verl's `policy_loss.loss_mode` `clip_cov` / `kl_cov`): the policy
//! loss treats apart the few tokens whose log-prob moves most with their advantage, which is
//! what drives the entropy down.
//!
//! A token's covariance is `(A − Ā)(log π − mean log π)`, the means over the micro-batch's
//! tokens. Clip-Cov takes the gradient off a random `ratio` share (at least one) of the tokens no
//! clip already holds whose covariance lies strictly between `lb` and `ub`; KL-Cov drops the
//! clip and adds `coef · |log π − log π_old|` on the `ratio` share (at least one) of tokens with
//! the largest covariance. [`select`] picks the tokens on the host (it sorts or draws), as verl
//! does; [`crate::loss::policy_loss`] applies them.

use candle_core::{DType, Result, Tensor};

/// Which covariance-selected treatment the policy loss gives (`LossConfig::cov`).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum CovLoss {
    /// The plain clipped loss.
    #[default]
    Off,
    /// Clip-Cov: no gradient on a random share of the tokens whose covariance is in `(lb, ub)`.
    ClipCov {
        /// Share of the micro-batch's tokens (verl's `clip_cov_ratio`, 0.0002).
        ratio: f64,
        /// Lower bound of the covariance (`clip_cov_lb`, 1.0).
        lb: f64,
        /// Upper bound (`clip_cov_ub`, 5.0).
        ub: f64,
        /// Seeds the draw (a trainer varies it per micro-batch and update).
        seed: u64,
    },
    /// KL-Cov: no clip, and `coef · |log ratio|` on the share of tokens with the largest
    /// covariance.
    KlCov {
        /// Share of the micro-batch's tokens (verl's `kl_cov_ratio`, 0.0002).
        ratio: f64,
        /// The penalty's coefficient (verl's `ppo_kl_coef`, 1.0).
        coef: f64,
    },
}

impl CovLoss {
    /// verl's loss-mode name (`vanilla` when off).
    pub fn name(&self) -> &'static str {
        match self {
            Self::Off => "vanilla",
            Self::ClipCov { .. } => "clip_cov",
            Self::KlCov { .. } => "kl_cov",
        }
    }

    /// Checks the values, naming the field to fix.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let share = |name: &str, r: f64| {
            if r > 0.0 && r <= 1.0 {
                Ok(())
            } else {
                Err(format!("{name} must be in (0, 1], got {r}"))
            }
        };
        match *self {
            Self::Off => Ok(()),
            Self::ClipCov { ratio, lb, ub, .. } => {
                share("clip_cov_ratio", ratio)?;
                if lb.is_nan() || ub.is_nan() || lb >= ub {
                    return Err(format!(
                        "clip_cov_lb must be below clip_cov_ub, got {lb} and {ub}"
                    ));
                }
                Ok(())
            }
            Self::KlCov { ratio, coef } => {
                share("kl_cov_ratio", ratio)?;
                if coef.is_finite() && coef >= 0.0 {
                    Ok(())
                } else {
                    Err(format!(
                        "ppo_kl_coef must be a finite number >= 0, got {coef}"
                    ))
                }
            }
        }
    }
}

/// Each token's covariance `(A − Ā)(l − l̄)` over the tokens where `mask` is set (the means over
/// them); other tokens get `None`. `adv` holds one value per token.
pub fn covariances(adv: &[f64], logp: &[f64], mask: &[bool]) -> Vec<Option<f64>> {
    let n = mask.iter().filter(|&&m| m).count().max(1) as f64;
    let mean = |v: &[f64]| {
        v.iter()
            .zip(mask)
            .filter(|(_, m)| **m)
            .map(|(x, _)| x)
            .sum::<f64>()
            / n
    };
    let (ma, ml) = (mean(adv), mean(logp));
    adv.iter()
        .zip(logp)
        .zip(mask)
        .map(|((a, l), &m)| m.then(|| (a - ma) * (l - ml)))
        .collect()
}

/// The tokens `mode` treats apart, as indices into the flattened `(B, T)` micro-batch.
/// `clipped` marks the tokens a clip already holds (Clip-Cov leaves them).
pub fn select_indices(
    mode: CovLoss,
    adv: &[f64],
    logp: &[f64],
    mask: &[bool],
    clipped: &[bool],
) -> Vec<usize> {
    let cov = covariances(adv, logp, mask);
    let valid = mask.iter().filter(|&&m| m).count();
    match mode {
        CovLoss::Off => Vec::new(),
        CovLoss::KlCov { ratio, .. } => {
            if valid == 0 {
                return Vec::new();
            }
            let k = ((valid as f64 * ratio) as usize).max(1);
            let mut order: Vec<(usize, f64)> = cov
                .iter()
                .enumerate()
                .filter_map(|(i, c)| c.map(|c| (i, c)))
                .collect();
            // Largest first; of equal covariances the earlier token.
            order.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let mut top: Vec<usize> = order.into_iter().take(k).map(|(i, _)| i).collect();
            top.sort_unstable();
            top
        }
        CovLoss::ClipCov {
            ratio,
            lb,
            ub,
            seed,
        } => {
            let k = ((valid as f64 * ratio) as usize).max(1);
            let mut candidates: Vec<usize> = cov
                .iter()
                .enumerate()
                .filter(|(i, c)| !clipped[*i] && c.is_some_and(|c| c > lb && c < ub))
                .map(|(i, _)| i)
                .collect();
            // A seeded Fisher-Yates shuffle (verl draws with torch.randperm).
            let mut state = seed;
            for i in (1..candidates.len()).rev() {
                let j = (splitmix64(&mut state) % (i as u64 + 1)) as usize;
                candidates.swap(i, j);
            }
            candidates.truncate(k);
            candidates.sort_unstable();
            candidates
        }
    }
}

/// The tokens `mode` treats apart as a `(B, T)` 0/1 tensor of `logp`'s dtype and device: reads
/// the advantages (`(B, 1)` or `(B, T)`), log-probs, mask and clip flags to the host.
pub fn select(
    mode: CovLoss,
    adv: &Tensor,
    logp: &Tensor,
    mask: &Tensor,
    clipped: &Tensor,
) -> Result<Tensor> {
    let (b, t) = logp.dims2()?;
    let host = |x: &Tensor| -> Result<Vec<f64>> {
        x.broadcast_as((b, t))?
            .to_dtype(DType::F64)?
            .flatten_all()?
            .to_vec1()
    };
    let (a, l) = (host(&adv.detach())?, host(&logp.detach())?);
    let m: Vec<bool> = host(mask)?.into_iter().map(|v| v > 0.0).collect();
    let c: Vec<bool> = host(clipped)?.into_iter().map(|v| v > 0.0).collect();
    let mut picked = vec![0f64; b * t];
    for i in select_indices(mode, &a, &l, &m, &c) {
        picked[i] = 1.0;
    }
    Tensor::from_vec(picked, (b, t), logp.device())?.to_dtype(logp.dtype())
}

/// SplitMix64's next value.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
