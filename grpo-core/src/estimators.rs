//! verl's advantage estimators (`algorithm.adv_estimator`) and its in-reward KL penalty, on
//! plain slices: REINFORCE++ (discounted returns whitened over the batch's tokens), the
//! REINFORCE++ baseline (group mean, then whitening), OPO (length-weighted group baseline),
//! GRPO pass@k (only each group's best completion learns), GPG (group mean, scaled by the share
//! of non-zero rewards), ReMax (returns minus the greedy completion's reward), the optimal token
//! baseline (returns minus a per-position group baseline weighted by each completion's path
//! variance under the old policy), beside TRL's GRPO and RLOO advantages from
//! [`crate::advantages`].
//!
//! Every estimator reads *token-level rewards*: one row per completion, one value per loss
//! token, the completion's score on its last token (verl's reward managers place it there) and,
//! with `use_kl_in_reward`, `−β · KL` on every token ([`apply_kl_penalty`]). The outcome
//! estimators sum each row, as verl does, and give every token of a row its completion's
//! advantage; REINFORCE++ gives each token its own.
//!
//! A row whose score is NaN (a reward that could not score it) gets advantages of 0 and is left
//! out of its group's statistics and of the whitening, as [`crate::advantages`] leaves NaN
//! rewards out.
//!
//! ```
//! use grpo_core::estimators::{estimate, AdvEstimator, EstimatorParams};
//!
//! // One prompt, two completions of two and three tokens, scores on their last tokens.
//! let rows = vec![vec![0.0, 1.0], vec![0.0, 0.0, 0.0]];
//! let adv = estimate(AdvEstimator::Opo, &rows, 2, &EstimatorParams::default()).unwrap();
//! // OPO's baseline weighs each score by its length: (2·1 + 3·0) / 5 = 0.4.
//! assert!((adv[0][0] - 0.6).abs() < 1e-12 && (adv[1][2] + 0.4).abs() < 1e-12);
//! ```

use crate::advantages::{ScaleRewards, group_advantages, leave_one_out_advantages};

/// verl's `adv_estimator` values this crate computes (`gae` is PPO with a value model:
/// [`crate::ppo`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AdvEstimator {
    /// TRL's group-normalised advantages ([`group_advantages`]; verl's `grpo` divides by
    /// `std + 1e-6` where TRL uses `1e-4`).
    #[default]
    Grpo,
    /// Leave-one-out baseline ([`leave_one_out_advantages`]).
    Rloo,
    /// REINFORCE++: per token, the discounted return `Σ_{k≥t} γ^{k−t} r_k`, whitened over all
    /// tokens of the batch.
    ReinforcePlusPlus,
    /// REINFORCE++ with a baseline: the score minus its group's mean, whitened over all tokens.
    ReinforcePlusPlusBaseline,
    /// OPO: the score minus the length-weighted mean of its group's scores.
    Opo,
    /// GRPO pass@k: the group's best completion gets `r_max − r_second` (divided by the group's
    /// std + 1e-6 when normalising), every other completion 0.
    GrpoPassk,
    /// GPG: `(r − mean_group) · N / #{r ≠ 0}` over the batch's `N` completions.
    Gpg,
    /// ReMax: per token, the return `Σ_{k≥t} r_k` minus the reward of the prompt's greedy
    /// completion ([`remax_advantages`]).
    Remax,
    /// The optimal token baseline: per token, the return minus its group's baseline at that
    /// position, weighted by each completion's cumulative path variance
    /// ([`optimal_token_baseline`]; needs the old log-probs and `Σπ²`).
    OptimalTokenBaseline,
    /// The same over the model's tokens of multi-turn episodes, the longest completion's tail
    /// beyond its group's second longest given no baseline (verl's `tir_optimal_token_baseline`).
    TirOptimalTokenBaseline,
}

impl AdvEstimator {
    /// Every estimator.
    pub const ALL: [AdvEstimator; 10] = [
        Self::Grpo,
        Self::Rloo,
        Self::ReinforcePlusPlus,
        Self::ReinforcePlusPlusBaseline,
        Self::Opo,
        Self::GrpoPassk,
        Self::Gpg,
        Self::Remax,
        Self::OptimalTokenBaseline,
        Self::TirOptimalTokenBaseline,
    ];

    /// verl's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Grpo => "grpo",
            Self::Rloo => "rloo",
            Self::ReinforcePlusPlus => "reinforce_plus_plus",
            Self::ReinforcePlusPlusBaseline => "reinforce_plus_plus_baseline",
            Self::Opo => "opo",
            Self::GrpoPassk => "grpo_passk",
            Self::Gpg => "gpg",
            Self::Remax => "remax",
            Self::OptimalTokenBaseline => "optimal_token_baseline",
            Self::TirOptimalTokenBaseline => "tir_optimal_token_baseline",
        }
    }

    /// Whether the advantages need each token's old log-prob and `Σπ²` (the learner forms
    /// them with [`optimal_token_baseline`]).
    pub fn optimal_token(self) -> bool {
        matches!(
            self,
            Self::OptimalTokenBaseline | Self::TirOptimalTokenBaseline
        )
    }

    /// Whether the advantages may vary within a completion (REINFORCE++'s and ReMax's returns
    /// of token-level rewards); the others give every token of a completion the same advantage.
    pub fn per_token(self) -> bool {
        matches!(self, Self::ReinforcePlusPlus | Self::Remax) || self.optimal_token()
    }
}

impl std::str::FromStr for AdvEstimator {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.to_ascii_lowercase();
        Self::ALL
            .into_iter()
            .find(|e| {
                e.as_str() == s
                    || (s == "grpo_vectorized" && *e == Self::Grpo)
                    || (s == "rloo_vectorized" && *e == Self::Rloo)
            })
            .ok_or_else(|| {
                let names: Vec<_> = Self::ALL.iter().map(|e| e.as_str()).collect();
                format!("unknown adv_estimator `{s}`: expected {}", names.join(", "))
            })
    }
}

#[cfg(feature = "serde")]
crate::serde_by_name!(
    AdvEstimator,
    "grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, opo, grpo_passk, gpg, remax, optimal_token_baseline or tir_optimal_token_baseline"
);

/// How verl estimates the per-token KL for the in-reward penalty (`algorithm.kl_penalty`),
/// from `d = log π_old − log π_ref`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KlPenalty {
    /// `d` (`kl`, `k1`).
    #[default]
    Kl,
    /// `|d|`.
    Abs,
    /// `d² / 2` (`mse`, `k2`).
    Mse,
    /// `e^{−d} + d − 1` with `−d` clamped to ±20 and the result to ±10 (`low_var_kl`, `k3`).
    LowVarKl,
}

impl KlPenalty {
    /// verl's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Kl => "kl",
            Self::Abs => "abs",
            Self::Mse => "mse",
            Self::LowVarKl => "low_var_kl",
        }
    }

    /// The estimate at one token.
    pub fn at(self, logprob: f64, ref_logprob: f64) -> f64 {
        let d = logprob - ref_logprob;
        match self {
            Self::Kl => d,
            Self::Abs => d.abs(),
            Self::Mse => 0.5 * d * d,
            Self::LowVarKl => {
                let kl = (-d).clamp(-20.0, 20.0);
                (kl.exp() - kl - 1.0).clamp(-10.0, 10.0)
            }
        }
    }
}

impl std::str::FromStr for KlPenalty {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "kl" | "k1" => Ok(Self::Kl),
            "abs" => Ok(Self::Abs),
            "mse" | "k2" => Ok(Self::Mse),
            "low_var_kl" | "k3" => Ok(Self::LowVarKl),
            "full" => Err("kl_penalty `full` needs the whole vocabulary's log-probs, which verl itself does not implement: use kl, abs, mse or low_var_kl".into()),
            other => Err(format!(
                "unknown kl_penalty `{other}`: expected kl (k1), abs, mse (k2) or low_var_kl (k3)"
            )),
        }
    }
}

#[cfg(feature = "serde")]
crate::serde_by_name!(KlPenalty, "kl, abs, mse or low_var_kl");

/// verl's KL coefficient controller (`algorithm.kl_ctrl`): fixed, or adaptive (Ziegler et al.
/// 2019): after each step `β ← β · (1 + clip(KL / target − 1, ±0.2) · n / horizon)`, `n` the
/// step's completions.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KlController {
    /// The current coefficient β.
    pub value: f64,
    /// `Some((target_kl, horizon))` when adaptive.
    pub adaptive: Option<(f64, f64)>,
}

impl KlController {
    /// Moves β after a step whose mean KL was `current_kl` over `n_steps` completions (a fixed
    /// controller keeps it).
    pub fn update(&mut self, current_kl: f64, n_steps: usize) {
        if let Some((target, horizon)) = self.adaptive {
            let err = (current_kl / target - 1.0).clamp(-0.2, 0.2);
            self.value *= 1.0 + err * n_steps as f64 / horizon;
        }
    }
}

/// verl's `apply_kl_penalty`: the token-level rewards `score·[t = last] − β · kl_t` of each
/// completion, from its score and its tokens' KL estimates, and the step's KL (the mean over
/// completions of each one's mean token KL, a completion without tokens counting 0), which
/// [`KlController::update`] reads.
pub fn apply_kl_penalty(scores: &[f32], kls: &[Vec<f64>], beta: f64) -> (Vec<Vec<f64>>, f64) {
    let mut rows = Vec::with_capacity(scores.len());
    let mut mean_kl = 0.0;
    for (&score, kl) in scores.iter().zip(kls) {
        let mut row: Vec<f64> = kl.iter().map(|k| -beta * k).collect();
        if let Some(last) = row.last_mut() {
            *last += f64::from(score);
        }
        mean_kl += kl.iter().sum::<f64>() / (kl.len() as f64 + 1e-8);
        rows.push(row);
    }
    (rows, mean_kl / scores.len().max(1) as f64)
}

/// Token-level rewards without a KL penalty: each completion's score on its last of `len`
/// tokens.
pub fn score_rows(scores: &[f32], lens: &[usize]) -> Vec<Vec<f64>> {
    scores
        .iter()
        .zip(lens)
        .map(|(&s, &n)| {
            let mut row = vec![0.0; n];
            if let Some(last) = row.last_mut() {
                *last = f64::from(s);
            }
            row
        })
        .collect()
}

/// ReMax's advantages: per token, the return `Σ_{k≥t} r_k` of the completion's token-level
/// rewards minus `baselines[i]`, the reward of its prompt's greedy completion (one per row;
/// verl's `compute_remax_outcome_advantage`, not whitened). A row or baseline that is NaN gets
/// 0.
pub fn remax_advantages(rows: &[Vec<f64>], baselines: &[f64]) -> Result<Vec<Vec<f64>>, String> {
    if rows.len() != baselines.len() {
        return Err(format!(
            "remax: {} completions but {} baselines",
            rows.len(),
            baselines.len()
        ));
    }
    Ok(rows
        .iter()
        .zip(baselines)
        .map(
            |(r, &b)| match r.iter().all(|x| !x.is_nan()) && !b.is_nan() {
                true => discounted_returns(r, 1.0).iter().map(|g| g - b).collect(),
                false => vec![0.0; r.len()],
            },
        )
        .collect())
}

/// Settings the estimators read.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EstimatorParams {
    /// REINFORCE++'s discount γ (verl's `algorithm.gamma`); default 1.
    pub gamma: f64,
    /// GRPO's scaling ([`group_advantages`]); for pass@k, `Group` divides by the group's std
    /// (verl's `norm_adv_by_std_in_grpo`) and `None` does not. Default `Group`.
    pub scale_rewards: ScaleRewards,
}

impl Default for EstimatorParams {
    fn default() -> Self {
        Self {
            gamma: 1.0,
            scale_rewards: ScaleRewards::Group,
        }
    }
}

/// The advantages of every token of every completion: `rows` are the token-level rewards
/// (completions of one prompt contiguous, `group_size` each), the result has their shape.
/// Errors on a batch that is not whole groups, pass@k with groups of one or `batch` scaling,
/// whitening over fewer than two tokens, and ReMax (its baselines are the greedy completions'
/// rewards: [`remax_advantages`]).
pub fn estimate(
    estimator: AdvEstimator,
    rows: &[Vec<f64>],
    group_size: usize,
    p: &EstimatorParams,
) -> Result<Vec<Vec<f64>>, String> {
    let g = whole_groups(rows.len(), group_size)?;
    if estimator == AdvEstimator::Remax {
        return Err("remax subtracts each prompt's greedy completion's reward: use remax_advantages with those baselines".into());
    }
    if estimator.optimal_token() {
        return Err("the optimal token baseline weighs by each token's old log-prob and Σπ²: use optimal_token_baseline with them".into());
    }
    let valid: Vec<bool> = rows.iter().map(|r| r.iter().all(|x| !x.is_nan())).collect();
    let lens: Vec<usize> = rows.iter().map(Vec::len).collect();
    if estimator == AdvEstimator::ReinforcePlusPlus {
        let mut out: Vec<Vec<f64>> = rows
            .iter()
            .zip(&valid)
            .map(|(r, &ok)| match ok {
                true => discounted_returns(r, p.gamma),
                false => vec![0.0; r.len()],
            })
            .collect();
        whiten_tokens(&mut out, &valid)?;
        return Ok(out);
    }
    let scores: Vec<f64> = rows
        .iter()
        .zip(&valid)
        .map(|(r, &ok)| if ok { r.iter().sum() } else { f64::NAN })
        .collect();
    let per_seq: Vec<f64> = match estimator {
        AdvEstimator::Grpo | AdvEstimator::Rloo => {
            let s32: Vec<f32> = scores.iter().map(|&s| s as f32).collect();
            let a = match estimator {
                AdvEstimator::Grpo => group_advantages(&s32, g, p.scale_rewards),
                _ => leave_one_out_advantages(&s32, g),
            };
            a.into_iter().map(f64::from).collect()
        }
        AdvEstimator::Opo => {
            let mut out = vec![0.0; scores.len()];
            for (gi, group) in scores.chunks(g).enumerate() {
                let (mut num, mut den) = (0.0, 0.0);
                for (j, &s) in group.iter().enumerate() {
                    if !s.is_nan() {
                        num += lens[gi * g + j] as f64 * s;
                        den += lens[gi * g + j] as f64;
                    }
                }
                // verl: a group of one has baseline 0; an all-empty group divides 0 by 0.
                let baseline = if g == 1 { 0.0 } else { num / den };
                for (j, &s) in group.iter().enumerate() {
                    out[gi * g + j] = s - baseline;
                }
            }
            out
        }
        AdvEstimator::GrpoPassk => {
            if g < 2 {
                return Err(
                    "adv_estimator grpo_passk needs at least two completions per prompt".into(),
                );
            }
            let normalize = match p.scale_rewards {
                ScaleRewards::Group => true,
                ScaleRewards::None => false,
                ScaleRewards::Batch => {
                    return Err("adv_estimator grpo_passk divides by its group's std or by nothing (scale_rewards group or none), not by the batch's".into());
                }
            };
            let mut out = vec![0.0; scores.len()];
            for (gi, group) in scores.chunks(g).enumerate() {
                let ok: Vec<(usize, f64)> = group
                    .iter()
                    .copied()
                    .enumerate()
                    .filter(|p| !p.1.is_nan())
                    .collect();
                if ok.len() < 2 {
                    continue;
                }
                // The first of the largest (ties give r_max − r_second = 0 whichever wins).
                let (i_max, r_max) =
                    ok.iter()
                        .copied()
                        .fold((usize::MAX, f64::NEG_INFINITY), |b, c| {
                            if c.1 > b.1 { c } else { b }
                        });
                let r_second = ok
                    .iter()
                    .filter(|c| c.0 != i_max)
                    .map(|c| c.1)
                    .fold(f64::NEG_INFINITY, f64::max);
                let mut a = r_max - r_second;
                if normalize {
                    let (_, var) = moments(ok.iter().map(|c| c.1));
                    a /= var.sqrt() + 1e-6;
                }
                out[gi * g + i_max] = a;
            }
            out
        }
        AdvEstimator::Gpg | AdvEstimator::ReinforcePlusPlusBaseline => {
            let means: Vec<f64> = scores
                .chunks(g)
                .map(|group| match g {
                    1 => 0.0,
                    _ => moments(group.iter().copied().filter(|s| !s.is_nan())).0,
                })
                .collect();
            let centred: Vec<f64> = scores
                .iter()
                .enumerate()
                .map(|(i, &s)| s - means[i / g])
                .collect();
            if estimator == AdvEstimator::Gpg {
                let n = scores.iter().filter(|s| !s.is_nan()).count();
                let nonzero = scores.iter().filter(|s| !s.is_nan() && **s != 0.0).count();
                let alpha = n as f64 / nonzero.max(1) as f64;
                centred.into_iter().map(|c| alpha * c).collect()
            } else {
                let mut out: Vec<Vec<f64>> = centred
                    .iter()
                    .zip(&lens)
                    .map(|(&c, &n)| vec![if c.is_nan() { 0.0 } else { c }; n])
                    .collect();
                whiten_tokens(&mut out, &valid)?;
                return Ok(out);
            }
        }
        AdvEstimator::ReinforcePlusPlus
        | AdvEstimator::Remax
        | AdvEstimator::OptimalTokenBaseline
        | AdvEstimator::TirOptimalTokenBaseline => unreachable!("handled above"),
    };
    Ok(per_seq
        .iter()
        .zip(&lens)
        .map(|(&a, &n)| vec![if a.is_finite() { a } else { 0.0 }; n])
        .collect())
}

/// `Σ_{k≥t} γ^{k−t} r_k` at every token of one completion.
pub fn discounted_returns(rewards: &[f64], gamma: f64) -> Vec<f64> {
    let mut out = vec![0.0; rewards.len()];
    let mut running = 0.0;
    for t in (0..rewards.len()).rev() {
        running = rewards[t] + gamma * running;
        out[t] = running;
    }
    out
}

/// Mean and unbiased variance (torch's `std` squared) of `x`; NaN for fewer than two values'
/// variance.
fn moments(x: impl Iterator<Item = f64> + Clone) -> (f64, f64) {
    let n = x.clone().count() as f64;
    let mean = x.clone().sum::<f64>() / n;
    let var = x.map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, var)
}

/// verl's `masked_whiten` over every token of the `valid` rows (the others set to 0): the
/// mean `Σx / (N + 1e-8)`, the variance the mean square deviation the same way times
/// `N / (N − 1)`, then `(x − mean) / √(var + 1e-8)`.
fn whiten_tokens(rows: &mut [Vec<f64>], valid: &[bool]) -> Result<(), String> {
    let tokens = || {
        rows.iter()
            .zip(valid)
            .filter(|p| *p.1)
            .flat_map(|p| p.0.iter())
    };
    let n = tokens().count() as f64;
    if n < 2.0 {
        return Err(format!(
            "the advantages are whitened over the batch's tokens, which needs at least two; got {n}"
        ));
    }
    let mean = tokens().sum::<f64>() / (n + 1e-8);
    let var = tokens().map(|x| (x - mean).powi(2)).sum::<f64>() / (n + 1e-8) * n / (n - 1.0);
    let inv = 1.0 / (var + 1e-8).sqrt();
    for (row, &ok) in rows.iter_mut().zip(valid) {
        for x in row.iter_mut() {
            *x = if ok { (*x - mean) * inv } else { 0.0 };
        }
    }
    Ok(())
}

/// The group size (at least 1), or an error when `n` completions are not whole groups.
fn whole_groups(n: usize, group_size: usize) -> Result<usize, String> {
    let g = group_size.max(1);
    match n.is_multiple_of(g) {
        true => Ok(g),
        false => Err(format!("{n} completions are not whole groups of {g}")),
    }
}

/// verl's optimal token baseline (`optimal_token_baseline`, `tir_optimal_token_baseline`):
/// per token the return `G_t = Σ_{k≥t} r_k` minus the group's baseline at that position
/// `B_t = Σ_i G_{i,t} W_{i,t} / (Σ_i W_{i,t} + 1e-8)`, where `W_{i,t} = Σ_{j≤t} (1 − 2π_j + Σπ²_j)`
/// is completion `i`'s cumulative path variance (`π_j = exp(old_logps[i][j])`, `Σπ²` its
/// distribution's sum of squared probabilities), over the group's rows long enough to have
/// position `t`. A group of one valid row has no baseline. With `handle_zero_tail` the longest
/// row's positions beyond its group's second longest get no baseline when it alone is longest.
/// Rows hold the loss tokens (an episode's model tokens), as the other estimators' do; a row
/// with a NaN reward gets 0 and leaves its group's baseline.
pub fn optimal_token_baseline(
    rows: &[Vec<f64>],
    old_logps: &[Vec<f64>],
    sum_pi_squared: &[Vec<f64>],
    group_size: usize,
    handle_zero_tail: bool,
) -> Result<Vec<Vec<f64>>, String> {
    let g = whole_groups(rows.len(), group_size)?;
    if old_logps.len() != rows.len() || sum_pi_squared.len() != rows.len() {
        return Err(format!(
            "{} rows of rewards, {} of old log-probs and {} of Σπ²",
            rows.len(),
            old_logps.len(),
            sum_pi_squared.len()
        ));
    }
    let mut out = Vec::with_capacity(rows.len());
    for (i, r) in rows.iter().enumerate() {
        if old_logps[i].len() != r.len() || sum_pi_squared[i].len() != r.len() {
            return Err(format!(
                "completion {i}: {} rewards, {} old log-probs, {} Σπ² values",
                r.len(),
                old_logps[i].len(),
                sum_pi_squared[i].len()
            ));
        }
    }
    for start in (0..rows.len()).step_by(g) {
        let group = start..start + g;
        let valid: Vec<usize> = group
            .clone()
            .filter(|&i| rows[i].iter().all(|x| !x.is_nan()))
            .collect();
        let returns: Vec<Vec<f64>> = group
            .clone()
            .map(|i| discounted_returns(&rows[i], 1.0))
            .collect();
        let weights: Vec<Vec<f64>> = group
            .clone()
            .map(|i| {
                let mut acc = 0.0;
                old_logps[i]
                    .iter()
                    .zip(&sum_pi_squared[i])
                    .map(|(&lp, &s)| {
                        acc += 1.0 - 2.0 * lp.exp() + s;
                        acc
                    })
                    .collect()
            })
            .collect();
        let longest = group.clone().map(|i| rows[i].len()).max().unwrap_or(0);
        let mut baseline = vec![0.0; longest];
        if valid.len() > 1 {
            for (t, b) in baseline.iter_mut().enumerate() {
                let (mut num, mut den) = (0.0, 0.0);
                for &i in &valid {
                    if let (Some(gt), Some(wt)) =
                        (returns[i - start].get(t), weights[i - start].get(t))
                    {
                        num += gt * wt;
                        den += wt;
                    }
                }
                *b = num / (den + 1e-8);
            }
        }
        // The longest valid row, when it alone is longest: no baseline past the second longest.
        let mut tail: Option<(usize, usize)> = None;
        if handle_zero_tail && valid.len() > 1 {
            let mut lens: Vec<usize> = valid.iter().map(|&i| rows[i].len()).collect();
            lens.sort_unstable();
            let (max, second) = (lens[lens.len() - 1], lens[lens.len() - 2]);
            let at_max: Vec<usize> = valid
                .iter()
                .copied()
                .filter(|&i| rows[i].len() == max)
                .collect();
            if at_max.len() == 1 && max > second {
                tail = Some((at_max[0], second));
            }
        }
        for i in group {
            if !valid.contains(&i) {
                out.push(vec![0.0; rows[i].len()]);
                continue;
            }
            out.push(
                returns[i - start]
                    .iter()
                    .enumerate()
                    .map(|(t, &gt)| match tail {
                        Some((j, from)) if j == i && t >= from => gt,
                        _ => gt - baseline[t],
                    })
                    .collect(),
            );
        }
    }
    Ok(out)
}
