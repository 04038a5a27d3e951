//! PPO with a learned value model, as TRL's experimental `PPOTrainer` computes it: per-token
//! rewards (the KL penalty to the reference on every token, the sequence's score after its
//! last token), generalized advantage estimation (GAE) against the value model's estimates,
//! whitening, and the clipped policy and value losses.
//!
//! [`ppo_targets`] works on plain slices (no candle needed) and returns the advantages and
//! returns of a whole batch; `ppo_loss` (feature `candle`) forms one micro-batch's loss from
//! tensors. TRL's layout is kept: a batch is `N` rows of width `T`, the longest completion;
//! row `i` has `L_i` completion tokens and `L_i + 1` value estimates (the state before each
//! token, and the state after the last, where the score is placed), the last one cut when
//! `L_i = T`.
//!
//! ```
//! use grpo_core::ppo::{ppo_targets, KlEstimator, PpoParams, PpoRollout};
//!
//! // One completion of two tokens; the policy is the reference (no KL), values all 0.
//! let lp = vec![vec![-1.0f32, -2.0], vec![-0.5]];
//! let values = vec![vec![0.0f32; 3], vec![0.0; 2]];
//! let t = ppo_targets(
//!     &PpoRollout { logprobs: &lp, ref_logprobs: &lp, values: &values, scores: &[1.0, 0.0] },
//!     &PpoParams { kl_coef: 0.05, kl_estimator: KlEstimator::K1, whiten_rewards: false, gamma: 1.0, lam: 0.95 },
//! )
//! .unwrap();
//! // Row 0 is the widest (T = 2): its score sits on its last token, whose return is 1.
//! assert_eq!(t.width, 2);
//! assert!((t.returns[1] - 1.0).abs() < 1e-6);
//! ```

/// How the per-token KL penalty is estimated from `r = log π_ref − log π_old` (TRL's
/// `kl_estimator`): `k1` is `−r`, `k3` is `(eʳ − 1) − r` (lower variance, never negative).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KlEstimator {
    /// `−r`: unbiased, can be negative per token.
    #[default]
    K1,
    /// `(eʳ − 1) − r`: unbiased, ≥ 0.
    K3,
}

impl KlEstimator {
    /// TRL's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::K1 => "k1",
            Self::K3 => "k3",
        }
    }

    /// The estimate at one token from the sampling policy's and the reference's log-probs.
    pub fn at(self, logprob: f64, ref_logprob: f64) -> f64 {
        let r = ref_logprob - logprob;
        match self {
            Self::K1 => -r,
            Self::K3 => r.exp_m1() - r,
        }
    }
}

impl std::str::FromStr for KlEstimator {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "k1" => Ok(Self::K1),
            "k3" => Ok(Self::K3),
            other => Err(format!("unknown kl_estimator `{other}`: expected k1 or k3")),
        }
    }
}

#[cfg(feature = "serde")]
crate::serde_by_name!(KlEstimator, "k1 or k3");

/// One batch of sampled completions, per row (completion): what [`ppo_targets`] reads.
#[derive(Debug, Clone, Copy)]
pub struct PpoRollout<'a> {
    /// Each completion's tokens' log-probs under the policy that sampled them (`L_i` values).
    pub logprobs: &'a [Vec<f32>],
    /// The same tokens' log-probs under the reference (`L_i` values).
    pub ref_logprobs: &'a [Vec<f32>],
    /// The value model's estimates of the states before each token and after the last
    /// (`L_i + 1` values; more are ignored, the missing ones are read as 0).
    pub values: &'a [Vec<f32>],
    /// Each completion's score (the reward model's, after any missing-EOS penalty).
    pub scores: &'a [f32],
}

/// PPO's settings that shape the targets (TRL's `PPOConfig` names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PpoParams {
    /// Weight of the per-token KL penalty in the reward.
    pub kl_coef: f64,
    /// How that KL is estimated.
    pub kl_estimator: KlEstimator,
    /// Whiten the per-token rewards over the batch (scaled, not shifted) before GAE.
    pub whiten_rewards: bool,
    /// Discount factor.
    pub gamma: f64,
    /// GAE's λ.
    pub lam: f64,
}

/// What [`ppo_targets`] returns: row-major `N × width` arrays.
#[derive(Debug, Clone, PartialEq)]
pub struct PpoTargets {
    /// `T`: the longest completion's length.
    pub width: usize,
    /// GAE advantages whitened over the batch's completion tokens, 0 past each row's tokens.
    pub advantages: Vec<f32>,
    /// The value targets (GAE advantages before whitening plus the values).
    pub returns: Vec<f32>,
    /// The value estimates as the loss compares them (0 past each row's last estimate).
    pub values: Vec<f32>,
    /// The per-token rewards GAE ran on.
    pub rewards: Vec<f32>,
    /// The per-token KL estimates (0 past each row's tokens).
    pub kl: Vec<f32>,
    /// Per row: its tokens.
    pub lengths: Vec<usize>,
}

impl PpoTargets {
    /// Whether position `j` of row `i` is one of its completion tokens (the policy loss's mask).
    pub fn is_token(&self, i: usize, j: usize) -> bool {
        j < self.lengths[i]
    }

    /// Whether position `j` of row `i` has a value estimate the value loss reads: its tokens
    /// and the state after its last token (when the width leaves room for it).
    pub fn has_value(&self, i: usize, j: usize) -> bool {
        j <= self.lengths[i] && j < self.width
    }

    /// Where row `i`'s score is placed: after its last token, or on it when the row fills
    /// the width.
    pub fn score_position(&self, i: usize) -> usize {
        let l = self.lengths[i];
        if l < self.width { l } else { l - 1 }
    }
}

/// Mean and unbiased variance of `x` over `mask`, as TRL's `masked_mean` / `masked_var`.
/// Errors when fewer than two entries are masked in (the variance is undefined).
pub fn masked_moments(x: &[f64], mask: &[bool]) -> Result<(f64, f64), String> {
    let n = mask.iter().filter(|&&m| m).count();
    if n < 2 {
        return Err(format!(
            "PPO whitens over the batch's tokens and needs at least two, got {n}: sample more or longer completions per step"
        ));
    }
    let mean = x
        .iter()
        .zip(mask)
        .filter(|p| *p.1)
        .map(|p| p.0)
        .sum::<f64>()
        / n as f64;
    let var = x
        .iter()
        .zip(mask)
        .filter(|p| *p.1)
        .map(|p| (p.0 - mean).powi(2))
        .sum::<f64>()
        / n as f64;
    Ok((mean, var * n as f64 / (n as f64 - 1.0)))
}

/// TRL's `masked_whiten`: `(x − mean) / √(var + 1e-8)` over `mask`, the mean added back when
/// `shift_mean` is false. Every entry is transformed; the caller zeroes the masked-out ones.
pub fn masked_whiten(x: &mut [f64], mask: &[bool], shift_mean: bool) -> Result<(), String> {
    let (mean, var) = masked_moments(x, mask)?;
    let inv = 1.0 / (var + 1e-8).sqrt();
    for v in x.iter_mut() {
        *v = (*v - mean) * inv + if shift_mean { 0.0 } else { mean };
    }
    Ok(())
}

/// GAE over rows of `width` steps: `δ_t = r_t + γ V_{t+1} − V_t` (V past the row's end is
/// 0), `A_t = δ_t + γλ A_{t+1}`; returns `(advantages, returns = A + V)`, row-major.
pub fn gae(
    rewards: &[f64],
    values: &[f64],
    width: usize,
    gamma: f64,
    lam: f64,
) -> (Vec<f64>, Vec<f64>) {
    let w = width.max(1);
    let mut adv = vec![0.0; rewards.len()];
    for ((r, v), a) in rewards
        .chunks(w)
        .zip(values.chunks(w))
        .zip(adv.chunks_mut(w))
    {
        let mut last = 0.0;
        for t in (0..r.len()).rev() {
            let next = v.get(t + 1).copied().unwrap_or(0.0);
            last = r[t] + gamma * next - v[t] + gamma * lam * last;
            a[t] = last;
        }
    }
    let returns = adv.iter().zip(values).map(|(a, v)| a + v).collect();
    (adv, returns)
}

/// PPO's advantages and value targets for a batch, as TRL's `PPOTrainer.train` forms them
/// between generation and the update epochs: per-token rewards `−kl_coef · KL` with the score
/// added after each completion's last token (on it when the completion fills the width),
/// optionally whitened (`whiten_rewards`), GAE against the values, advantages whitened over
/// the completion tokens. Errors on rows of mismatched lengths, an empty batch, or fewer than
/// two tokens to whiten over.
pub fn ppo_targets(r: &PpoRollout<'_>, p: &PpoParams) -> Result<PpoTargets, String> {
    let n = r.logprobs.len();
    if r.ref_logprobs.len() != n || r.values.len() != n || r.scores.len() != n {
        return Err(format!(
            "PPO batch: {n} rows of log-probs, {} of reference log-probs, {} of values, {} scores",
            r.ref_logprobs.len(),
            r.values.len(),
            r.scores.len()
        ));
    }
    let lengths: Vec<usize> = r.logprobs.iter().map(Vec::len).collect();
    let width = lengths.iter().copied().max().unwrap_or(0);
    if width == 0 {
        return Err("PPO batch: no completion has a token".into());
    }
    for (i, l) in lengths.iter().enumerate() {
        if r.ref_logprobs[i].len() != *l {
            return Err(format!(
                "PPO batch row {i}: {l} log-probs but {} reference log-probs",
                r.ref_logprobs[i].len()
            ));
        }
    }
    let mut t = PpoTargets {
        width,
        advantages: Vec::new(),
        returns: Vec::new(),
        values: vec![0.0; n * width],
        rewards: Vec::new(),
        kl: vec![0.0; n * width],
        lengths,
    };
    let mut rewards = vec![0.0f64; n * width];
    let mut values = vec![0.0f64; n * width];
    let (mut token_mask, mut value_mask) = (vec![false; n * width], vec![false; n * width]);
    for i in 0..n {
        for j in 0..width {
            let k = i * width + j;
            token_mask[k] = t.is_token(i, j);
            value_mask[k] = t.has_value(i, j);
            if token_mask[k] {
                let kl = p
                    .kl_estimator
                    .at(r.logprobs[i][j] as f64, r.ref_logprobs[i][j] as f64);
                t.kl[k] = kl as f32;
                rewards[k] = -p.kl_coef * kl;
            }
            if value_mask[k] {
                values[k] = r.values[i].get(j).copied().unwrap_or(0.0) as f64;
            }
        }
        rewards[i * width + t.score_position(i)] += r.scores[i] as f64;
    }
    if p.whiten_rewards {
        masked_whiten(&mut rewards, &value_mask, false)?;
        for (x, m) in rewards.iter_mut().zip(&value_mask) {
            if !m {
                *x = 0.0;
            }
        }
    }
    let (mut adv, returns) = gae(&rewards, &values, width, p.gamma, p.lam);
    masked_whiten(&mut adv, &token_mask, true)?;
    for (x, m) in adv.iter_mut().zip(&token_mask) {
        if !m {
            *x = 0.0;
        }
    }
    t.advantages = adv.into_iter().map(|x| x as f32).collect();
    t.returns = returns.into_iter().map(|x| x as f32).collect();
    t.values = values.into_iter().map(|x| x as f32).collect();
    t.rewards = rewards.into_iter().map(|x| x as f32).collect();
    Ok(t)
}

#[cfg(feature = "candle")]
pub use loss::{PpoLoss, PpoLossInputs, ppo_loss};

#[cfg(feature = "candle")]
mod loss {
    use candle_core::{DType, Result, Tensor};

    /// One micro-batch of PPO's update, `(b, T)` tensors (`T` the batch's width).
    #[derive(Debug, Clone, Copy)]
    pub struct PpoLossInputs<'a> {
        /// The policy's log-probs of the completion tokens now (with the graph).
        pub logprobs: &'a Tensor,
        /// Their log-probs when sampled (the old policy).
        pub old_logprobs: &'a Tensor,
        /// Whitened advantages.
        pub advantages: &'a Tensor,
        /// 1 on completion tokens.
        pub token_mask: &'a Tensor,
        /// The value model's estimates now (with the graph).
        pub values: &'a Tensor,
        /// Its estimates when sampled.
        pub old_values: &'a Tensor,
        /// The value targets.
        pub returns: &'a Tensor,
        /// 1 where a value estimate is trained (tokens and the state after the last).
        pub value_mask: &'a Tensor,
    }

    /// One micro-batch's PPO loss and TRL's statistics of it (detached scalars).
    #[derive(Debug, Clone)]
    pub struct PpoLoss {
        /// `pg_loss + vf_coef · vf_loss`, with the graph.
        pub loss: Tensor,
        /// The clipped policy loss (masked mean over tokens).
        pub pg_loss: f64,
        /// `½ ·` the clipped squared value error (masked mean).
        pub vf_loss: f64,
        /// Share of tokens whose clipped policy term is the larger.
        pub pg_clipfrac: f64,
        /// Share of value estimates whose clipped term is the larger.
        pub vf_clipfrac: f64,
        /// `½ · mean((log π − log π_old)²)` over the `(b, T)` entries (padding counts 0, as
        /// TRL's mean over the padded tensor).
        pub approxkl: f64,
        /// Mean ratio over the `(b, T)` entries (padding counts 1, as TRL's).
        pub ratio_mean: f64,
    }

    fn masked_mean(x: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let count = mask.sum_all()?.maximum(1.0)?;
        (x * mask)?.sum_all()?.broadcast_div(&count)
    }

    /// TRL's PPO loss of one micro-batch: the clipped surrogate
    /// `max(−A·ρ, −A·clip(ρ, 1 − ε, 1 + ε))` averaged over the tokens, plus `vf_coef ×` half
    /// the clipped squared error `max((V − R)², (clip(V, V_old ± ε_v) − R)²)` averaged over
    /// the value positions. Computed in f32 whatever the inputs' dtype.
    pub fn ppo_loss(
        x: &PpoLossInputs<'_>,
        cliprange: f64,
        cliprange_value: f64,
        vf_coef: f64,
    ) -> Result<PpoLoss> {
        let f = |t: &Tensor| t.to_dtype(DType::F32);
        let (lp, old, adv) = (f(x.logprobs)?, f(x.old_logprobs)?, f(x.advantages)?);
        let (tm, vm) = (f(x.token_mask)?, f(x.value_mask)?);
        let (v, vold, ret) = (f(x.values)?, f(x.old_values)?, f(x.returns)?);
        // Padding: the difference is 0 there (TRL fills both sides with the same value).
        let diff = ((&lp - &old)? * &tm)?;
        let ratio = diff.exp()?;
        let pg1 = (adv.neg()? * &ratio)?;
        let pg2 = (adv.neg()? * ratio.clamp(1.0 - cliprange, 1.0 + cliprange)?)?;
        let pg_loss = masked_mean(&pg1.maximum(&pg2)?, &tm)?;
        let vclip = v.clamp(&(&vold - cliprange_value)?, &(&vold + cliprange_value)?)?;
        let vf1 = (&v - &ret)?.sqr()?;
        let vf2 = (&vclip - &ret)?.sqr()?;
        let vf_loss = (masked_mean(&vf1.maximum(&vf2)?, &vm)? * 0.5)?;
        let loss = (&pg_loss + (&vf_loss * vf_coef)?)?;
        let scalar = |t: &Tensor| -> Result<f64> { t.detach().to_dtype(DType::F64)?.to_scalar() };
        let entries = diff.elem_count().max(1) as f64;
        Ok(PpoLoss {
            pg_loss: scalar(&pg_loss)?,
            vf_loss: scalar(&vf_loss)?,
            pg_clipfrac: scalar(&masked_mean(&pg2.gt(&pg1)?.to_dtype(DType::F32)?, &tm)?)?,
            vf_clipfrac: scalar(&masked_mean(&vf2.gt(&vf1)?.to_dtype(DType::F32)?, &vm)?)?,
            approxkl: 0.5 * scalar(&diff.sqr()?.sum_all()?)? / entries,
            ratio_mean: scalar(&ratio.sum_all()?)? / entries,
            loss,
        })
    }
}
