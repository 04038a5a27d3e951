//! GRPO math end to end on a policy small enough to train in a test: a categorical policy
//! with one logit row per completion position (T positions, V tokens), trained with the exact
//! pieces the trainer uses (reward combination, group advantages, chunked log-probs, the
//! clipped loss with a KL penalty to a frozen reference), updated by plain SGD.
#![allow(clippy::unwrap_used, clippy::needless_range_loop, missing_docs)]

use candle_core::{D, DType, Device, Tensor, Var};
use grpo_core::advantages::{ScaleRewards, combine_rewards, group_advantages, reward_stats};
use grpo_core::logprobs::{entropy_from_logits, selective_log_softmax};
use grpo_core::loss::{LossConfig, LossInputs, LossType, policy_loss};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const T: usize = 4;
const V: usize = 6;
const TARGET: u32 = 2;
const PROMPTS: usize = 4;
const G: usize = 8;

/// Samples `n` completions from softmax(logits) row by row; returns token ids (n, T).
fn sample(logits: &Tensor, n: usize, rng: &mut ChaCha8Rng) -> Vec<Vec<u32>> {
    let probs: Vec<Vec<f32>> = {
        let e = logits
            .broadcast_sub(&logits.max_keepdim(D::Minus1).unwrap())
            .unwrap()
            .exp()
            .unwrap();
        let p = e.broadcast_div(&e.sum_keepdim(D::Minus1).unwrap()).unwrap();
        p.to_vec2().unwrap()
    };
    (0..n)
        .map(|_| {
            (0..T)
                .map(|t| {
                    let u: f32 = rng.random();
                    let mut acc = 0.0;
                    for (v, p) in probs[t].iter().enumerate() {
                        acc += p;
                        if u < acc {
                            return v as u32;
                        }
                    }
                    (V - 1) as u32
                })
                .collect()
        })
        .collect()
}

/// Per-token log-probs (B, T) of `ids` under per-position `logits` (T, V).
fn logps(logits: &Tensor, ids: &Tensor) -> Tensor {
    let b = ids.dim(0).unwrap();
    let full = logits
        .unsqueeze(0)
        .unwrap()
        .broadcast_as((b, T, V))
        .unwrap()
        .contiguous()
        .unwrap();
    selective_log_softmax(&full, ids).unwrap()
}

struct Run {
    first_reward: f64,
    last_reward: f64,
    last_kl: f64,
    max_clip: f64,
    /// Mean per-position entropy of the policy before training and after.
    entropy: (f32, f32),
}

fn train(loss_type: LossType, num_iterations: usize, steps: usize) -> Run {
    let dev = Device::Cpu;
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let policy = Var::zeros((T, V), DType::F32, &dev).unwrap();
    let reference = policy.as_tensor().detach().copy().unwrap();
    let cfg = LossConfig {
        loss_type,
        beta: 0.04,
        epsilon_high: if loss_type == LossType::Cispo {
            5.0
        } else {
            0.28
        },
        max_completion_length: T,
        ..Default::default()
    };
    let lr = 2.0;
    let h0 = mean_entropy(policy.as_tensor());
    let (mut first, mut last, mut last_kl, mut max_clip) = (f64::NAN, f64::NAN, 0.0, 0.0f64);
    for step in 0..steps {
        // Generate with detached weights, as the rollout stage does.
        let behaviour = policy.as_tensor().detach();
        let completions = sample(&behaviour, PROMPTS * G, &mut rng);
        // Two reward functions: fraction of TARGET tokens, and a "judge" that abstains on
        // every third completion.
        let frac: Vec<Option<f32>> = completions
            .iter()
            .map(|c| Some(c.iter().filter(|&&t| t == TARGET).count() as f32 / T as f32))
            .collect();
        let judge: Vec<Option<f32>> = completions
            .iter()
            .enumerate()
            .map(|(i, c)| (i % 3 != 0).then(|| if c[0] == TARGET { 0.5 } else { 0.0 }))
            .collect();
        let per_fn = vec![frac.clone(), judge];
        let weights = [1.0, 0.5];
        let rewards = combine_rewards(&per_fn, &weights);
        let adv = group_advantages(&rewards, G, ScaleRewards::Group);
        let stats = reward_stats(&per_fn, &weights, G, ScaleRewards::Group);
        let mean_frac = stats.per_function[0].0;
        if step == 0 {
            first = mean_frac;
        }
        last = mean_frac;

        let flat: Vec<u32> = completions.concat();
        let ids = Tensor::from_vec(flat, (PROMPTS * G, T), &dev).unwrap();
        let old = logps(&behaviour, &ids);
        let ref_lp = logps(&reference, &ids);
        let adv_t = Tensor::from_slice(&adv, PROMPTS * G, &dev).unwrap();
        let mask = Tensor::ones((PROMPTS * G, T), DType::F32, &dev).unwrap();
        for _ in 0..num_iterations {
            let lp = logps(policy.as_tensor(), &ids);
            let out = policy_loss(
                &LossInputs {
                    per_token_logps: &lp,
                    old_per_token_logps: Some(&old),
                    ref_per_token_logps: Some(&ref_lp),
                    advantages: &adv_t,
                    completion_mask: &mask,
                    num_items_in_batch: None,
                    importance_weights: None,
                    sampling_per_token_logps: None,
                    entropies: None,
                },
                &cfg,
            )
            .unwrap();
            assert!(out.loss.to_scalar::<f32>().unwrap().is_finite());
            let grads = out.loss.backward().unwrap();
            let g = grads
                .get(policy.as_tensor())
                .expect("the policy logits receive a gradient");
            policy
                .set(&(policy.as_tensor() - (g * lr).unwrap()).unwrap())
                .unwrap();
            last_kl = out.metrics.kl;
            max_clip = max_clip.max(out.metrics.clip_ratio_region_mean);
            assert!((0.0..=1.0).contains(&out.metrics.clip_ratio_region_mean));
        }
    }
    Run {
        first_reward: first,
        last_reward: last,
        last_kl,
        max_clip,
        entropy: (h0, mean_entropy(policy.as_tensor())),
    }
}

fn mean_entropy(logits: &Tensor) -> f32 {
    entropy_from_logits(logits)
        .unwrap()
        .mean_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

#[test]
fn every_loss_type_learns_the_rewarded_token() {
    for lt in [
        LossType::Grpo,
        LossType::Bnpo,
        LossType::DrGrpo,
        LossType::Dapo,
        LossType::Cispo,
    ] {
        let r = train(lt, 1, 40);
        assert!(
            r.first_reward < 0.35,
            "{lt:?}: starts near 1/V, got {}",
            r.first_reward
        );
        assert!(
            r.last_reward > 0.6,
            "{lt:?}: reward should rise from {:.3}, ended at {:.3}",
            r.first_reward,
            r.last_reward
        );
        assert!(
            r.last_kl > 0.0,
            "{lt:?}: the policy moved away from the reference"
        );
    }
}

#[test]
fn several_iterations_per_batch_clip_and_still_learn() {
    let r = train(LossType::Dapo, 3, 25);
    assert!(
        r.max_clip > 0.0,
        "with 3 updates per batch some ratios leave the clip range"
    );
    assert!(r.last_reward > 0.5, "ended at {:.3}", r.last_reward);
}

/// Training toward TARGET sharpens the policy: its entropy starts at ln V (uniform logits) and
/// falls as the reward is learned.
#[test]
fn entropy_falls_as_the_policy_sharpens() {
    let r = train(LossType::Dapo, 1, 25);
    let (h0, h1) = r.entropy;
    assert!((h0 - (V as f32).ln()).abs() < 1e-5, "start {h0}");
    assert!(r.last_reward > r.first_reward);
    assert!(h1 < 0.8 * h0, "entropy {h0} -> {h1}");
}
