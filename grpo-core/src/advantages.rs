//! Rewards to advantages, on plain `&[f32]` (no tensors needed).
//!
//! Completions are grouped contiguously: with `group_size = G`, completions `0..G` answer the
//! first prompt, `G..2G` the second, and so on. A reward of `NaN` means "unscorable" (every
//! reward function abstained): it is left out of every mean and standard deviation, and its
//! advantage is 0, exactly as TRL 1.16's `GRPOTrainer` does with `nanmean` / `nanstd`.

/// How group-centred rewards are scaled (TRL's `scale_rewards`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ScaleRewards {
    /// Divide by the group's standard deviation (+1e-4). TRL's default.
    #[default]
    Group,
    /// Centre per group, divide by the standard deviation of the whole batch (+1e-4).
    Batch,
    /// Centre per group only (Dr. GRPO's recommendation).
    None,
}

impl std::str::FromStr for ScaleRewards {
    type Err = String;

    /// Parses TRL's spellings: `group` (also `true`), `batch`, `none` (also `false`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "group" | "true" => Ok(Self::Group),
            "batch" => Ok(Self::Batch),
            "none" | "false" => Ok(Self::None),
            other => Err(format!(
                "unknown scale_rewards `{other}`: expected one of group, batch, none"
            )),
        }
    }
}

impl ScaleRewards {
    /// TRL's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Group => "group",
            Self::Batch => "batch",
            Self::None => "none",
        }
    }
}

// TRL also takes a boolean (`true` = group, `false` = none).
#[cfg(feature = "serde")]
crate::serde_by_name!(ScaleRewards, "group, batch or none", bool);

/// The constant TRL adds to the standard deviation before dividing.
pub const STD_EPS: f64 = 1e-4;

/// Mean of the non-NaN values (NaN when there are none), accumulated in f64.
pub fn nanmean(values: &[f32]) -> f64 {
    let (sum, n) = values
        .iter()
        .filter(|v| !v.is_nan())
        .fold((0f64, 0usize), |(s, n), &v| (s + v as f64, n + 1));
    if n == 0 { f64::NAN } else { sum / n as f64 }
}

/// Unbiased (n − 1) standard deviation of the non-NaN values; NaN with fewer than two values
/// (TRL's `nanstd`).
pub fn nanstd(values: &[f32]) -> f64 {
    let mean = nanmean(values);
    let (ss, n) = values
        .iter()
        .filter(|v| !v.is_nan())
        .fold((0f64, 0usize), |(s, n), &v| {
            let d = v as f64 - mean;
            (s + d * d, n + 1)
        });
    if n < 2 {
        f64::NAN
    } else {
        (ss / (n - 1) as f64).sqrt()
    }
}

fn check_groups(len: usize, group_size: usize) {
    assert!(group_size > 0, "group_size must be at least 1");
    assert!(
        len.is_multiple_of(group_size),
        "rewards.len() = {len} is not a multiple of group_size = {group_size}"
    );
}

/// Standard deviation used to scale each completion's advantage, before the 1e-4 term: the
/// group's (Group and None) or the batch's (Batch). A group of one has std 0, as in TRL.
/// NaN where too few values are scorable. Used for `frac_reward_zero_std`.
pub fn reward_stds(rewards: &[f32], group_size: usize, scale: ScaleRewards) -> Vec<f64> {
    check_groups(rewards.len(), group_size);
    match scale {
        ScaleRewards::Group | ScaleRewards::None => rewards
            .chunks(group_size)
            .flat_map(|g| {
                let s = if group_size > 1 { nanstd(g) } else { 0.0 };
                std::iter::repeat_n(s, g.len())
            })
            .collect(),
        ScaleRewards::Batch => {
            let s = if rewards.len() > 1 {
                nanstd(rewards)
            } else {
                0.0
            };
            vec![s; rewards.len()]
        }
    }
}

/// GRPO advantages: `A = (r − mean_group) / (std + 1e-4)` with the std of the group (`Group`),
/// of the batch (`Batch`), or no division (`None`). The std is unbiased (n − 1). NaN rewards are
/// ignored in the statistics and get advantage 0, as does every member of a group whose std
/// is undefined (fewer than two scorable rewards).
///
/// # Panics
/// When `group_size` is 0 or does not divide `rewards.len()`.
///
/// ```
/// use grpo_core::advantages::{group_advantages, ScaleRewards};
/// let a = group_advantages(&[1.0, 0.0, 5.0, 5.0], 2, ScaleRewards::None);
/// assert_eq!(a, vec![0.5, -0.5, 0.0, 0.0]);
/// ```
pub fn group_advantages(rewards: &[f32], group_size: usize, scale: ScaleRewards) -> Vec<f32> {
    check_groups(rewards.len(), group_size);
    let stds = reward_stds(rewards, group_size, scale);
    rewards
        .chunks(group_size)
        .enumerate()
        .flat_map(|(g, chunk)| {
            let mean = nanmean(chunk);
            let stds = &stds;
            chunk.iter().enumerate().map(move |(j, &r)| {
                let centred = r as f64 - mean;
                let a = match scale {
                    ScaleRewards::None => centred,
                    _ => centred / (stds[g * group_size + j] + STD_EPS),
                };
                if a.is_nan() { 0.0 } else { a as f32 }
            })
        })
        .collect()
}

/// RLOO advantages: `A_i = r_i − mean of the other G − 1 rewards of its group`. NaN rewards are
/// left out of the baselines and get advantage 0; so does a completion with no scorable peer.
///
/// # Panics
/// When `group_size` is 0 or does not divide `rewards.len()`.
///
/// ```
/// use grpo_core::advantages::leave_one_out_advantages;
/// let a = leave_one_out_advantages(&[1.0, 0.0, 0.0], 3);
/// assert_eq!(a, vec![1.0, -0.5, -0.5]);
/// ```
pub fn leave_one_out_advantages(rewards: &[f32], group_size: usize) -> Vec<f32> {
    check_groups(rewards.len(), group_size);
    rewards
        .chunks(group_size)
        .flat_map(|chunk| {
            let (sum, n) = chunk
                .iter()
                .filter(|v| !v.is_nan())
                .fold((0f64, 0usize), |(s, n), &v| (s + v as f64, n + 1));
            chunk.iter().map(move |&r| {
                if r.is_nan() || n < 2 {
                    0.0
                } else {
                    let baseline = (sum - r as f64) / (n - 1) as f64;
                    (r as f64 - baseline) as f32
                }
            })
        })
        .collect()
}

/// NeMo RL's GRPO advantages with `use_leave_one_out_baseline = true`
/// (`calculate_baseline_and_std_per_prompt`, then `GRPOAdvantageEstimator`): the baseline of
/// completion `i` is the mean of the other scorable rewards of its group, and with `normalize`
/// (NeMo's `normalize_rewards`) the centred reward is divided by the unbiased standard deviation
/// of those others, where it is positive (no epsilon: a zero std leaves the advantage unscaled).
///
/// NaN rewards are left out and get advantage 0, as does every member of a group with fewer
/// than two scorable rewards. With exactly two, the one other reward has no spread and the
/// advantage is the plain difference, as in NeMo. The spread is computed in two passes, so
/// equal rewards give exactly zero (NeMo's `E[r²] − E[r]²` in float32 can leave a rounding
/// residue there and divide by it).
///
/// # Panics
/// When `group_size` is 0 or does not divide `rewards.len()`.
///
/// ```
/// use grpo_core::advantages::leave_one_out_normalized;
/// // Completion 0: others [0, 1] → baseline 0.5, std 0.7071 → (1 − 0.5) / 0.7071.
/// let a = leave_one_out_normalized(&[1.0, 0.0, 1.0], 3, true);
/// assert!((a[0] - 0.70711).abs() < 1e-5);
/// assert_eq!(leave_one_out_normalized(&[1.0, 0.0, 1.0], 3, false)[1], -1.0);
/// ```
pub fn leave_one_out_normalized(rewards: &[f32], group_size: usize, normalize: bool) -> Vec<f32> {
    check_groups(rewards.len(), group_size);
    rewards
        .chunks(group_size)
        .flat_map(|chunk| {
            let valid: Vec<f64> = chunk
                .iter()
                .filter(|v| !v.is_nan())
                .map(|&v| v as f64)
                .collect();
            let n = valid.len();
            let mut seen = 0;
            chunk
                .iter()
                .map(|&r| {
                    if r.is_nan() || n < 2 {
                        return 0.0;
                    }
                    // The others: every scorable reward but this one (its first occurrence).
                    let me = seen;
                    seen += 1;
                    let others = || valid.iter().enumerate().filter(move |(j, _)| *j != me);
                    let m = (n - 1) as f64;
                    let baseline = others().map(|(_, v)| v).sum::<f64>() / m;
                    let centred = r as f64 - baseline;
                    if !normalize || n == 2 {
                        return centred as f32;
                    }
                    // Two passes, so equal others give exactly 0 (no normalisation).
                    let ss: f64 = others().map(|(_, v)| (v - baseline).powi(2)).sum();
                    let std = (ss / (m - 1.0)).sqrt();
                    if std > 0.0 {
                        (centred / std) as f32
                    } else {
                        centred as f32
                    }
                })
                .collect::<Vec<f32>>()
        })
        .collect()
}

/// Weighted sum of several reward functions: `r_i = Σ_k w_k · r_ik` over the functions that gave
/// a value (`None` is skipped, as TRL's `nansum`); a completion no function scored gets NaN,
/// which [`group_advantages`] turns into advantage 0. A NaN value counts as `None`.
///
/// `per_function[k][i]` is the reward of function `k` for completion `i`.
///
/// # Panics
/// When `weights.len() != per_function.len()` or the functions disagree on the batch size.
///
/// ```
/// use grpo_core::advantages::combine_rewards;
/// let r = combine_rewards(&[vec![Some(1.0), None], vec![Some(2.0), None]], &[1.0, 0.5]);
/// assert_eq!(r[0], 2.0);
/// assert!(r[1].is_nan());
/// ```
pub fn combine_rewards(per_function: &[Vec<Option<f32>>], weights: &[f32]) -> Vec<f32> {
    assert_eq!(
        per_function.len(),
        weights.len(),
        "one weight per reward function: {} functions, {} weights",
        per_function.len(),
        weights.len()
    );
    let n = per_function.first().map_or(0, Vec::len);
    for (k, f) in per_function.iter().enumerate() {
        assert_eq!(
            f.len(),
            n,
            "reward function {k} returned {} values, function 0 returned {n}",
            f.len()
        );
    }
    (0..n)
        .map(|i| {
            let mut any = false;
            let mut sum = 0f64;
            for (f, &w) in per_function.iter().zip(weights) {
                if let Some(v) = f[i].filter(|v| !v.is_nan()) {
                    any = true;
                    sum += w as f64 * v as f64;
                }
            }
            if any { sum as f32 } else { f32::NAN }
        })
        .collect()
}

/// How several reward functions make one advantage (TRL's `multi_objective_aggregation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MultiObjectiveAggregation {
    /// Weighted sum of the raw rewards, then scaled by `scale_rewards`. TRL's default.
    #[default]
    SumThenNormalize,
    /// GDPO: each function's rewards normalised within their group, the weighted sum of those
    /// normalised across the batch ([`normalize_then_sum_advantages`]); `scale_rewards` does
    /// not apply.
    NormalizeThenSum,
}

impl std::str::FromStr for MultiObjectiveAggregation {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "sum_then_normalize" => Ok(Self::SumThenNormalize),
            "normalize_then_sum" => Ok(Self::NormalizeThenSum),
            other => Err(format!(
                "unknown multi_objective_aggregation `{other}`: expected sum_then_normalize or \
                 normalize_then_sum"
            )),
        }
    }
}

impl MultiObjectiveAggregation {
    /// TRL's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::SumThenNormalize => "sum_then_normalize",
            Self::NormalizeThenSum => "normalize_then_sum",
        }
    }
}

#[cfg(feature = "serde")]
crate::serde_by_name!(
    MultiObjectiveAggregation,
    "sum_then_normalize or normalize_then_sum"
);

/// GDPO's aggregated rewards (TRL's `normalize_then_sum`): each function's rewards centred on
/// their group's mean and divided by the group's unbiased std + 1e-4 (`None` values left out;
/// a group of one, or with fewer than two values of a function, gives that function nothing),
/// then summed with the weights. NaN for a completion no function scored.
///
/// # Panics
/// When `group_size` is 0 or does not divide the completions, or a function's length differs.
pub fn normalize_then_sum_rewards(
    per_function: &[Vec<Option<f32>>],
    weights: &[f32],
    group_size: usize,
) -> Vec<f32> {
    let n = per_function.first().map_or(0, Vec::len);
    assert!(
        group_size > 0 && n.is_multiple_of(group_size),
        "bad group size"
    );
    assert!(per_function.iter().all(|f| f.len() == n), "ragged rewards");
    let mut sum = vec![0f64; n];
    let mut scored = vec![false; n];
    for (f, &w) in per_function.iter().zip(weights) {
        let vals: Vec<f32> = f.iter().map(|v| v.unwrap_or(f32::NAN)).collect();
        for (g, chunk) in vals.chunks(group_size).enumerate() {
            let mean = nanmean(chunk);
            let std = if group_size > 1 { nanstd(chunk) } else { 0.0 };
            for (j, &v) in chunk.iter().enumerate() {
                let i = g * group_size + j;
                if !v.is_nan() {
                    scored[i] = true;
                }
                // nansum: a NaN term (no value, or a std that is undefined) adds nothing.
                let z = (f64::from(v) - mean) / (std + STD_EPS);
                if z.is_finite() {
                    sum[i] += f64::from(w) * z;
                }
            }
        }
    }
    sum.iter()
        .zip(&scored)
        .map(|(&s, &ok)| if ok { s as f32 } else { f32::NAN })
        .collect()
}

/// GDPO's advantages (TRL's `normalize_then_sum`): [`normalize_then_sum_rewards`], then
/// `(r − mean) / (std + 1e-4)` over the whole batch (unbiased std; 0 for a batch of one).
/// Unscorable completions get 0.
pub fn normalize_then_sum_advantages(
    per_function: &[Vec<Option<f32>>],
    weights: &[f32],
    group_size: usize,
) -> Vec<f32> {
    let r = normalize_then_sum_rewards(per_function, weights, group_size);
    let mean = nanmean(&r);
    let std = if r.len() > 1 { nanstd(&r) } else { 0.0 };
    r.iter()
        .map(|&v| {
            let a = (f64::from(v) - mean) / (std + STD_EPS);
            if a.is_nan() { 0.0 } else { a as f32 }
        })
        .collect()
}

/// Reward statistics of one generation batch, under TRL's metric names.
#[derive(Debug, Clone, PartialEq)]
pub struct RewardStats {
    /// `reward`: mean of the combined rewards (scorable completions only).
    pub reward: f64,
    /// `reward_std`: unbiased std of the combined rewards.
    pub reward_std: f64,
    /// `frac_reward_zero_std`: fraction of completions whose scaling std is (close to) zero.
    pub frac_reward_zero_std: f64,
    /// `rewards/{name}/mean` and `rewards/{name}/std` per function, in input order.
    pub per_function: Vec<(f64, f64)>,
}

/// Computes [`RewardStats`] the way TRL logs them: per-function statistics over the values
/// each function gave, combined statistics over the scorable completions, and the fraction of
/// zero-std groups under the chosen scaling (`torch.isclose(std, 0)`).
pub fn reward_stats(
    per_function: &[Vec<Option<f32>>],
    weights: &[f32],
    group_size: usize,
    scale: ScaleRewards,
) -> RewardStats {
    let combined = combine_rewards(per_function, weights);
    let stds = if combined.is_empty() {
        Vec::new()
    } else {
        reward_stds(&combined, group_size, scale)
    };
    // torch.isclose(x, 0) with rtol 1e-5, atol 1e-8; NaN is never close.
    let zero = stds.iter().filter(|s| s.abs() <= 1e-8).count();
    let per_function = per_function
        .iter()
        .map(|f| {
            let vals: Vec<f32> = f.iter().map(|v| v.unwrap_or(f32::NAN)).collect();
            (nanmean(&vals), nanstd(&vals))
        })
        .collect();
    RewardStats {
        reward: nanmean(&combined),
        reward_std: nanstd(&combined),
        frac_reward_zero_std: if stds.is_empty() {
            f64::NAN
        } else {
            zero as f64 / stds.len() as f64
        },
        per_function,
    }
}

/// TRL 1.16's RLOO advantages (`RLOOTrainer`): each completion's reward minus the mean of its
/// group's other scorable rewards (a NaN reward is unscorable: it neither has a baseline nor
/// enters its siblings'); with `normalize`, the scorable advantages of the whole batch are
/// centred and divided by their standard deviation (Bessel-corrected) + 1e-4; unscorable ones,
/// and a group's only scorable one, get 0. The KL penalty, when there is one, is in `rewards`
/// already (`reward − β·Σ_t (log π_old − log π_ref)`).
///
/// ```
/// use grpo_core::advantages::rloo_advantages;
/// let a = rloo_advantages(&[1.0, 0.0, 0.5, f32::NAN], 4, false);
/// assert_eq!(a, vec![0.75, -0.75, 0.0, 0.0]);
/// ```
pub fn rloo_advantages(rewards: &[f32], group_size: usize, normalize: bool) -> Vec<f32> {
    check_groups(rewards.len(), group_size);
    let mut adv: Vec<f64> = rewards
        .chunks(group_size)
        .flat_map(|g| {
            let (sum, n) = g
                .iter()
                .filter(|r| !r.is_nan())
                .fold((0f64, 0usize), |(s, n), &r| (s + f64::from(r), n + 1));
            g.iter().map(move |&r| match (r.is_nan(), n) {
                (true, _) | (false, 0 | 1) if group_size > 1 => f64::NAN,
                (_, _) if group_size <= 1 => 0.0,
                _ => f64::from(r) - (sum - f64::from(r)) / (n - 1) as f64,
            })
        })
        .collect();
    if normalize {
        let ok: Vec<f64> = adv.iter().copied().filter(|a| !a.is_nan()).collect();
        if !ok.is_empty() {
            let mean = ok.iter().sum::<f64>() / ok.len() as f64;
            let var = ok.iter().map(|a| (a - mean).powi(2)).sum::<f64>() / ok.len() as f64;
            let var = if ok.len() > 1 {
                var * ok.len() as f64 / (ok.len() - 1) as f64
            } else {
                f64::NAN
            };
            for a in &mut adv {
                *a = (*a - mean) / (var.sqrt() + 1e-4);
            }
        }
    }
    adv.into_iter()
        .map(|a| if a.is_nan() { 0.0 } else { a as f32 })
        .collect()
}

#[cfg(test)]
mod tests {

    #[test]
    fn normalize_then_sum_follows_gdpo_as_trl() {
        // Values from TRL 1.16's normalize_then_sum branch written out in Python (float64).
        let n = f32::NAN;
        let o = |v: &[f32]| -> Vec<Option<f32>> {
            v.iter().map(|x| (!x.is_nan()).then_some(*x)).collect()
        };
        let f0 = o(&[1.0, 0.0, 1.0, 0.5, n, n, 2.0, 2.0, 2.0]);
        let f1 = o(&[0.2, 0.9, n, 0.1, 0.3, n, 0.0, 1.0, 0.5]);
        let r = normalize_then_sum_rewards(&[f0.clone(), f1.clone()], &[1.0, 0.5], 3);
        let want_r = [
            0.223768, -0.801019, 0.57725, -0.353304, 0.353304, n, -0.4999, 0.4999, 0.0,
        ];
        for (g, w) in r.iter().zip(want_r) {
            assert!(
                (g.is_nan() && w.is_nan()) || (g - w).abs() < 1e-5,
                "{g} vs {w}"
            );
        }
        let a = normalize_then_sum_advantages(&[f0, f1], &[1.0, 0.5], 3);
        let want = [
            0.444365, -1.590683, 1.146318, -0.701599, 0.701599, 0.0, -0.992714, 0.992714, 0.0,
        ];
        for (g, w) in a.iter().zip(want) {
            assert!((g - w).abs() < 1e-5, "{g} vs {w}");
        }
        assert_eq!(
            "normalize_then_sum".parse::<MultiObjectiveAggregation>(),
            Ok(MultiObjectiveAggregation::NormalizeThenSum)
        );
        assert!("mean".parse::<MultiObjectiveAggregation>().is_err());
    }
    use super::*;

    #[test]
    fn group_scaling_matches_hand_computation() {
        // group 1: mean 2, std sqrt(((1-2)^2 + (3-2)^2)/1) = sqrt(2)
        let a = group_advantages(&[1.0, 3.0], 2, ScaleRewards::Group);
        let s = 2f64.sqrt() + 1e-4;
        assert!((a[0] as f64 + 1.0 / s).abs() < 1e-6);
        assert!((a[1] as f64 - 1.0 / s).abs() < 1e-6);
    }

    #[test]
    fn nan_rewards_are_excluded_and_get_zero() {
        let a = group_advantages(&[1.0, f32::NAN, 3.0, 2.0], 4, ScaleRewards::Group);
        assert_eq!(a[1], 0.0);
        // mean of {1, 3, 2} = 2, std = 1
        assert!((a[0] + 1.0 / 1.0001).abs() < 1e-6);
        assert_eq!(a[3], 0.0);
    }

    #[test]
    fn single_scorable_reward_gives_zero_advantages() {
        let a = group_advantages(&[f32::NAN, 4.0], 2, ScaleRewards::Group);
        assert_eq!(a, vec![0.0, 0.0]);
    }

    #[test]
    fn batch_scaling_uses_global_std() {
        let r = [0.0, 2.0, 10.0, 10.0];
        let a = group_advantages(&r, 2, ScaleRewards::Batch);
        let std = nanstd(&r);
        assert!((a[0] as f64 + 1.0 / (std + 1e-4)).abs() < 1e-6);
        assert_eq!(a[2], 0.0);
    }

    #[test]
    fn parse_scale_rewards() {
        assert_eq!("group".parse::<ScaleRewards>(), Ok(ScaleRewards::Group));
        assert_eq!("Batch".parse::<ScaleRewards>(), Ok(ScaleRewards::Batch));
        assert_eq!("none".parse::<ScaleRewards>(), Ok(ScaleRewards::None));
        assert!("grup".parse::<ScaleRewards>().unwrap_err().contains("grup"));
    }

    #[test]
    fn stats_follow_trl() {
        let f0 = vec![Some(1.0), Some(1.0), Some(0.0), Some(1.0)];
        let f1 = vec![None, None, Some(1.0), None];
        let s = reward_stats(&[f0, f1], &[1.0, 2.0], 2, ScaleRewards::Group);
        // combined: [1, 1, 2, 1]; first group has zero std.
        assert!((s.reward - 1.25).abs() < 1e-12);
        assert!((s.frac_reward_zero_std - 0.5).abs() < 1e-12);
        assert!((s.per_function[1].0 - 1.0).abs() < 1e-12);
        assert!(s.per_function[1].1.is_nan());
    }

    #[test]
    #[should_panic(expected = "not a multiple")]
    fn ragged_groups_panic() {
        group_advantages(&[1.0, 2.0, 3.0], 2, ScaleRewards::Group);
    }
}
