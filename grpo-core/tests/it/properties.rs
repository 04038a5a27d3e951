//! Properties of the GRPO math that must hold for any input (proptest).
#![allow(clippy::unwrap_used, clippy::needless_range_loop, missing_docs)]

use candle_core::{D, DType, Device, Tensor, Var};
use grpo_core::advantages::{ScaleRewards, combine_rewards, group_advantages};
use grpo_core::logprobs::selective_log_softmax;
use grpo_core::loss::{ImportanceSamplingLevel, LossConfig, LossInputs, LossType, policy_loss};
use proptest::prelude::*;

const LOSS_TYPES: [LossType; 9] = [
    LossType::Grpo,
    LossType::Bnpo,
    LossType::DrGrpo,
    LossType::Dapo,
    LossType::Sapo,
    LossType::Luspo,
    LossType::Vespo,
    LossType::Cispo,
    LossType::Gmpo,
];

fn scale() -> impl Strategy<Value = ScaleRewards> {
    prop_oneof![
        Just(ScaleRewards::Group),
        Just(ScaleRewards::Batch),
        Just(ScaleRewards::None)
    ]
}

/// (group_size, rewards) with 1..6 groups of 2..8 finite rewards.
fn grouped_rewards() -> impl Strategy<Value = (usize, Vec<f32>)> {
    (2usize..8, 1usize..6)
        .prop_flat_map(|(g, n)| (Just(g), prop::collection::vec(-100f32..100.0, g * n)))
}

/// One batch of loss inputs: (B, T, logp, old, adv, mask).
#[derive(Debug, Clone)]
struct Batch {
    b: usize,
    t: usize,
    logp: Vec<f32>,
    old: Vec<f32>,
    reference: Vec<f32>,
    adv: Vec<f32>,
    mask: Vec<f32>,
}

fn batch(max_delta: f32) -> impl Strategy<Value = Batch> {
    (1usize..5, 1usize..7).prop_flat_map(move |(b, t)| {
        let n = b * t;
        (
            prop::collection::vec(-20f32..0.0, n),
            prop::collection::vec(-max_delta..max_delta, n),
            prop::collection::vec(-5f32..5.0, n),
            prop::collection::vec(-10f32..10.0, b),
            prop::collection::vec(prop::bool::weighted(0.7), n),
        )
            .prop_map(move |(logp, d, r, adv, m)| Batch {
                b,
                t,
                old: logp.iter().zip(&d).map(|(l, d)| l + d).collect(),
                reference: logp.iter().zip(&r).map(|(l, r)| l + r).collect(),
                logp,
                adv,
                mask: m.into_iter().map(|x| if x { 1.0 } else { 0.0 }).collect(),
            })
    })
}

struct Tensors {
    logp: Var,
    old: Tensor,
    reference: Tensor,
    adv: Tensor,
    mask: Tensor,
}

fn tensors(x: &Batch) -> Tensors {
    let d = Device::Cpu;
    let t2 = |v: &[f32]| Tensor::from_slice(v, (x.b, x.t), &d).unwrap();
    Tensors {
        logp: Var::from_tensor(&t2(&x.logp)).unwrap(),
        old: t2(&x.old),
        reference: t2(&x.reference),
        adv: Tensor::from_slice(&x.adv, x.b, &d).unwrap(),
        mask: t2(&x.mask),
    }
}

fn grad_of(
    t: &Tensors,
    old: Option<&Tensor>,
    reference: Option<&Tensor>,
    cfg: &LossConfig,
) -> (f32, Vec<Vec<f32>>, grpo_core::LossMetrics) {
    let out = policy_loss(
        &LossInputs {
            per_token_logps: t.logp.as_tensor(),
            old_per_token_logps: old,
            ref_per_token_logps: reference,
            advantages: &t.adv,
            completion_mask: &t.mask,
            num_items_in_batch: None,
            importance_weights: None,
            sampling_per_token_logps: None,
            entropies: None,
        },
        cfg,
    )
    .unwrap();
    let loss = out.loss.to_scalar::<f32>().unwrap();
    let grads = out.loss.backward().unwrap();
    let g = match grads.get(t.logp.as_tensor()) {
        Some(g) => g.to_vec2::<f32>().unwrap(),
        None => t
            .logp
            .as_tensor()
            .zeros_like()
            .unwrap()
            .to_vec2::<f32>()
            .unwrap(),
    };
    (loss, g, out.metrics)
}

proptest! {
    /// The leave-one-out baseline is the group mean moved away from the reward: unscaled,
    /// `r − mean(others) = G/(G−1)·(r − mean(group))`, so each group's advantages sum to 0;
    /// normalised, the sign is kept.
    #[test]
    fn leave_one_out_is_a_rescaled_centring((g, r) in grouped_rewards()) {
        let loo = grpo_core::advantages::leave_one_out_normalized(&r, g, false);
        let centred = group_advantages(&r, g, ScaleRewards::None);
        let k = g as f32 / (g as f32 - 1.0);
        for (a, c) in loo.iter().zip(&centred) {
            prop_assert!((a - k * c).abs() <= 1e-3 * (1.0 + c.abs()), "{a} vs {k} * {c}");
        }
        for group in loo.chunks(g) {
            let sum: f32 = group.iter().sum();
            prop_assert!(sum.abs() <= 1e-2, "{sum}");
        }
        let norm = grpo_core::advantages::leave_one_out_normalized(&r, g, true);
        for (a, c) in norm.iter().zip(&loo) {
            prop_assert!(a.signum() == c.signum() || *c == 0.0 || a.abs() < 1e-6, "{a} vs {c}");
        }
    }

    #[test]
    fn group_advantages_sum_to_zero_per_group((g, r) in grouped_rewards(), s in scale()) {
        let a = group_advantages(&r, g, s);
        for (chunk, rchunk) in a.chunks(g).zip(r.chunks(g)) {
            let sum: f64 = chunk.iter().map(|&x| x as f64).sum();
            let spread = rchunk.iter().fold(0f32, |m, &x| m.max(x.abs())) as f64;
            let scale_bound = match s { ScaleRewards::None => spread.max(1.0), _ => 1.0 };
            prop_assert!(sum.abs() <= 1e-4 * g as f64 * scale_bound, "sum {sum}");
        }
    }

    #[test]
    fn group_scaling_is_affine_invariant((g, r) in grouped_rewards(), a in 0.5f32..20.0, b in -50f32..50.0) {
        let r2: Vec<f32> = r.iter().map(|&x| a * x + b).collect();
        let a1 = group_advantages(&r, g, ScaleRewards::Group);
        let a2 = group_advantages(&r2, g, ScaleRewards::Group);
        for (chunk, (x1, x2)) in r.chunks(g).zip(a1.chunks(g).zip(a2.chunks(g))) {
            let m = chunk.iter().sum::<f32>() / g as f32;
            let sd = (chunk.iter().map(|x| (x - m).powi(2)).sum::<f32>() / (g - 1) as f32).sqrt();
            if sd < 0.1 { continue; } // the 1e-4 term dominates tiny spreads
            for (u, v) in x1.iter().zip(x2) {
                prop_assert!((u - v).abs() <= 2e-3 * u.abs() + 1e-3, "{u} vs {v}");
            }
        }
    }

    #[test]
    fn constant_groups_give_zero(g in 1usize..9, n in 1usize..5, c in -1e3f32..1e3, s in scale()) {
        let r = vec![c; g * n];
        prop_assert!(group_advantages(&r, g, s).iter().all(|&x| x == 0.0));
    }

    #[test]
    fn combination_is_weighted_nansum(
        vals in prop::collection::vec(prop::collection::vec(prop::option::of(-10f32..10.0), 6), 1..4),
        w in prop::collection::vec(-2f32..2.0, 4),
    ) {
        let w = &w[..vals.len()];
        let r = combine_rewards(&vals, w);
        for (i, &ri) in r.iter().enumerate() {
            let present: Vec<f32> = vals.iter().zip(w).filter_map(|(f, &wk)| f[i].map(|v| v * wk)).collect();
            if present.is_empty() {
                prop_assert!(ri.is_nan());
            } else {
                prop_assert!((ri - present.iter().sum::<f32>()).abs() < 1e-4);
            }
        }
    }

    /// At ρ = 1 and β = 0, d loss / d logp_t = −A·m_t / normaliser, for every loss type and
    /// both importance levels: positive advantages push their tokens up.
    #[test]
    fn on_policy_gradient_is_advantage_over_normaliser(x in batch(1.0), seq in any::<bool>()) {
        let t = tensors(&x);
        let mask = &x.mask;
        let n_tokens: f32 = mask.iter().sum();
        // gmpo's ratio is per sequence already: it refuses the sequence level.
        for lt in LOSS_TYPES.into_iter().filter(|&lt| !(seq && lt == LossType::Gmpo)) {
            let cfg = LossConfig {
                loss_type: lt,
                epsilon_high: if lt == LossType::Cispo { 5.0 } else { 0.2 },
                importance_sampling_level: if seq { ImportanceSamplingLevel::Sequence } else { ImportanceSamplingLevel::Token },
                max_completion_length: 8,
                ..Default::default()
            };
            let (_, g, _) = grad_of(&t, None, None, &cfg);
            for i in 0..x.b {
                let row: f32 = mask[i * x.t..(i + 1) * x.t].iter().sum();
                let norm = match lt {
                    // sapo's gate has slope 1 at ρ = 1 (σ′(0)·4), vespo's weight is φ(1) = 1,
                    // gmpo's geometric mean exp(mean log ρ) has slope 1/n per token.
                    LossType::Grpo | LossType::Sapo | LossType::Gmpo => x.b as f32 * row.max(1.0),
                    LossType::Bnpo | LossType::Dapo | LossType::Cispo | LossType::Vespo => {
                        n_tokens.max(1.0)
                    }
                    LossType::DrGrpo => (x.b * 8) as f32,
                    LossType::Luspo => x.b as f32,
                };
                for j in 0..x.t {
                    let want = -x.adv[i] * mask[i * x.t + j] / norm;
                    prop_assert!((g[i][j] - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "{lt:?} seq={seq} [{i}][{j}]: {} vs {want}", g[i][j]);
                }
            }
        }
    }

    /// Tokens whose ratio is clipped (ρ > 1+ε with A > 0, or ρ < 1−ε with A < 0) get no gradient.
    #[test]
    fn clipped_tokens_get_zero_gradient(x in batch(2.0)) {
        let t = tensors(&x);
        for lt in [LossType::Grpo, LossType::Bnpo, LossType::DrGrpo, LossType::Dapo, LossType::Luspo] {
            let cfg = LossConfig { loss_type: lt, ..Default::default() };
            let (_, g, _) = grad_of(&t, Some(&t.old), None, &cfg);
            for i in 0..x.b {
                for j in 0..x.t {
                    let k = i * x.t + j;
                    let rho = (x.logp[k] - x.old[k]).exp();
                    let a = x.adv[i];
                    let clipped = (rho > 1.2 + 1e-3 && a > 0.0) || (rho < 0.8 - 1e-3 && a < 0.0);
                    if clipped {
                        prop_assert_eq!(g[i][j], 0.0, "{:?} rho {} A {}", lt, rho, a);
                    }
                }
            }
        }
    }

    #[test]
    fn kl_is_nonnegative_and_zero_at_the_reference(x in batch(1.0), corr in any::<bool>()) {
        let t = tensors(&x);
        let cfg = LossConfig { beta: 0.1, kl_importance_correction: corr, ..Default::default() };
        let (_, _, m) = grad_of(&t, Some(&t.old), Some(&t.reference), &cfg);
        prop_assert!(m.kl >= 0.0 && m.kl.is_finite(), "kl {}", m.kl);
        let (_, _, m) = grad_of(&t, Some(&t.old), Some(t.logp.as_tensor()), &cfg);
        prop_assert!(m.kl.abs() < 1e-7, "kl at the reference {}", m.kl);
    }

    #[test]
    fn loss_and_gradient_are_finite(x in batch(20.0), beta in 0f64..1.0, seq in any::<bool>()) {
        let t = tensors(&x);
        for lt in LOSS_TYPES.into_iter().filter(|&lt| !(seq && lt == LossType::Gmpo)) {
            let cfg = LossConfig {
                loss_type: lt,
                beta,
                delta: if beta > 0.5 && lt != LossType::Gmpo { Some(1.5) } else { None },
                importance_sampling_level: if seq { ImportanceSamplingLevel::Sequence } else { ImportanceSamplingLevel::Token },
                ..Default::default()
            };
            let (loss, g, m) = grad_of(&t, Some(&t.old), Some(&t.reference), &cfg);
            prop_assert!(loss.is_finite(), "{lt:?}: loss {loss}");
            prop_assert!(g.iter().flatten().all(|v| v.is_finite()), "{lt:?}: gradient");
            prop_assert!(m.kl.is_finite() && m.clip_ratio_region_mean.is_finite());
        }
    }

    /// GSPO-token (`sequence_token`) is the token level with each token's log-ratio replaced by
    /// its sequence's masked mean, its gradient still the token's own: loss, gradient, KL and
    /// clip fractions equal the token level's with `old_t = logp_t − s_i` (detached), for every
    /// loss type that takes a level and with the KL's importance correction.
    #[test]
    fn sequence_token_is_the_token_level_at_the_sequence_ratio(
        x in batch(2.0),
        beta in prop_oneof![Just(0.0f64), 0.01f64..0.5],
        corr in any::<bool>(),
    ) {
        let t = tensors(&x);
        let mut moved = x.old.clone();
        for i in 0..x.b {
            let row = i * x.t..(i + 1) * x.t;
            let n: f32 = x.mask[row.clone()].iter().sum();
            let s: f32 = row.clone().map(|k| x.mask[k] * (x.logp[k] - x.old[k])).sum::<f32>() / n.max(1.0);
            for k in row {
                moved[k] = x.logp[k] - s;
            }
        }
        let moved = Tensor::from_slice(&moved, (x.b, x.t), &Device::Cpu).unwrap();
        for lt in LOSS_TYPES.into_iter().filter(|&lt| lt != LossType::Gmpo) {
            let cfg = |level| LossConfig {
                loss_type: lt,
                beta,
                kl_importance_correction: corr,
                importance_sampling_level: level,
                max_completion_length: 8,
                ..Default::default()
            };
            let (l1, g1, m1) = grad_of(&t, Some(&t.old), Some(&t.reference), &cfg(ImportanceSamplingLevel::SequenceToken));
            let (l2, g2, m2) = grad_of(&t, Some(&moved), Some(&t.reference), &cfg(ImportanceSamplingLevel::Token));
            prop_assert!((l1 - l2).abs() <= 1e-4 * (1.0 + l2.abs()), "{lt:?}: loss {l1} vs {l2}");
            for (a, b) in g1.iter().flatten().zip(g2.iter().flatten()) {
                prop_assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{lt:?}: gradient {a} vs {b}");
            }
            prop_assert!((m1.kl - m2.kl).abs() <= 1e-4 * (1.0 + m2.kl.abs()), "{lt:?}: kl");
            prop_assert_eq!(m1.clip_ratio_region_mean, m2.clip_ratio_region_mean);
        }
    }

    /// With one advantage per sequence and every token weighed alike, GSPO-token trains as
    /// GSPO: the same loss and gradient as the sequence level, for every loss type that takes a
    /// level (TRL's note on its experimental trainer).
    #[test]
    fn sequence_token_trains_as_gspo_with_sequence_advantages(x in batch(2.0)) {
        let t = tensors(&x);
        for lt in LOSS_TYPES.into_iter().filter(|&lt| lt != LossType::Gmpo) {
            let cfg = |level| LossConfig {
                loss_type: lt,
                importance_sampling_level: level,
                max_completion_length: 8,
                ..Default::default()
            };
            let (l1, g1, _) = grad_of(&t, Some(&t.old), None, &cfg(ImportanceSamplingLevel::SequenceToken));
            let (l2, g2, _) = grad_of(&t, Some(&t.old), None, &cfg(ImportanceSamplingLevel::Sequence));
            prop_assert!((l1 - l2).abs() <= 1e-4 * (1.0 + l2.abs()), "{lt:?}: loss {l1} vs {l2}");
            for (a, b) in g1.iter().flatten().zip(g2.iter().flatten()) {
                prop_assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{lt:?}: gradient {a} vs {b}");
            }
        }
    }

    /// The sequence-level ratio is exp of the masked mean log-ratio: with no clipping in reach,
    /// A = 1 and a single row, the grpo loss is −ρ.
    #[test]
    fn sequence_ratio_is_exp_of_masked_mean(x in batch(1.0)) {
        let d = Device::Cpu;
        let row = |v: &[f32]| Tensor::from_slice(&v[..x.t], (1, x.t), &d).unwrap();
        let logp = row(&x.logp);
        let old = row(&x.old);
        let mask = row(&x.mask);
        let adv = Tensor::new(&[1f32], &d).unwrap();
        let cfg = LossConfig {
            loss_type: LossType::Grpo,
            epsilon_high: 1e6,
            epsilon_low: 0.0,
            importance_sampling_level: ImportanceSamplingLevel::Sequence,
            ..Default::default()
        };
        let out = policy_loss(&LossInputs {
            per_token_logps: &logp, old_per_token_logps: Some(&old), ref_per_token_logps: None,
            advantages: &adv, completion_mask: &mask, num_items_in_batch: None, importance_weights: None, sampling_per_token_logps: None, entropies: None,
        }, &cfg).unwrap();
        let n: f32 = x.mask[..x.t].iter().sum();
        let s: f32 = (0..x.t).map(|j| x.mask[j] * (x.logp[j] - x.old[j])).sum();
        let want = if n > 0.0 { -(s / n).exp() } else { 0.0 };
        let got = out.loss.to_scalar::<f32>().unwrap();
        prop_assert!((got - want).abs() <= 1e-5 * (1.0 + want.abs()), "{got} vs {want}");
    }

    #[test]
    fn selective_log_softmax_is_log_softmax_gather(
        (v, logits) in (2usize..40).prop_flat_map(|v| (Just(v), prop::collection::vec(-30f32..30.0, 3 * v))),
        seed in 0u32..1000,
    ) {
        let d = Device::Cpu;
        let x = Tensor::from_slice(&logits, (3, v), &d).unwrap();
        let targets: Vec<u32> = (0..3).map(|i| (seed + 7 * i) % v as u32).collect();
        let lp = selective_log_softmax(&x, &Tensor::new(targets.as_slice(), &d).unwrap()).unwrap();
        let lp = lp.to_vec1::<f32>().unwrap();
        for i in 0..3 {
            let row = &logits[i * v..(i + 1) * v];
            let m = row.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
            let lse = m + row.iter().map(|&z| (z as f64 - m).exp()).sum::<f64>().ln();
            let want = row[targets[i] as usize] as f64 - lse;
            prop_assert!((lp[i] as f64 - want).abs() < 1e-4, "{} vs {want}", lp[i]);
        }
        // exp of the log-probs of every token sums to 1 at each position.
        let all_ids = Tensor::arange(0u32, v as u32, &d).unwrap().unsqueeze(0).unwrap()
            .broadcast_as((3, v)).unwrap().contiguous().unwrap();
        let x3 = x.unsqueeze(1).unwrap().broadcast_as((3, v, v)).unwrap().contiguous().unwrap();
        let every = selective_log_softmax(&x3, &all_ids).unwrap();
        let sums = every.exp().unwrap().sum(D::Minus1).unwrap().to_dtype(DType::F64).unwrap()
            .to_vec1::<f64>().unwrap();
        for s in sums {
            prop_assert!((s - 1.0).abs() < 1e-5, "sum {s}");
        }
    }
}

/// Where tokens are weighed apart (the high-entropy token mask), GSPO-token and GSPO differ: a
/// masked-out token gets no gradient under GSPO-token, and its share of the sequence ratio's
/// gradient under GSPO; the kept tokens get their own under both.
#[test]
fn sequence_token_leaves_masked_out_tokens_without_gradient() {
    let d = Device::Cpu;
    let logp = Var::from_tensor(&Tensor::new(&[[-1.0f32, -2.0, -0.5, -1.5]], &d).unwrap()).unwrap();
    let old = Tensor::new(&[[-1.1f32, -1.9, -0.6, -1.5]], &d).unwrap();
    let mask = Tensor::ones((1, 4), DType::F32, &d).unwrap();
    // Entropies: the two highest (tokens 1 and 3) are kept at quantile 0.5.
    let entropies = Tensor::new(&[[0.1f32, 2.0, 0.2, 3.0]], &d).unwrap();
    let adv = Tensor::new(&[1.0f32], &d).unwrap();
    let grad = |level| {
        let out = policy_loss(
            &LossInputs {
                per_token_logps: logp.as_tensor(),
                old_per_token_logps: Some(&old),
                ref_per_token_logps: None,
                advantages: &adv,
                completion_mask: &mask,
                num_items_in_batch: None,
                importance_weights: None,
                sampling_per_token_logps: None,
                entropies: Some(&entropies),
            },
            &LossConfig {
                loss_type: LossType::Grpo,
                top_entropy_quantile: 0.5,
                importance_sampling_level: level,
                ..Default::default()
            },
        )
        .unwrap();
        let g = out.loss.backward().unwrap();
        g.get(logp.as_tensor()).unwrap().to_vec2::<f32>().unwrap()[0].clone()
    };
    let token = grad(ImportanceSamplingLevel::SequenceToken);
    let sequence = grad(ImportanceSamplingLevel::Sequence);
    assert_eq!((token[0], token[2]), (0.0, 0.0), "{token:?}");
    assert!(token[1] < 0.0 && token[3] < 0.0, "{token:?}");
    assert!(sequence.iter().all(|g| *g < 0.0), "{sequence:?}");
    // The sequence ratio's gradient spreads over all four tokens, GSPO-token's over the two kept.
    let (st, ss): (f32, f32) = (token.iter().sum(), sequence.iter().sum());
    assert!((st - ss).abs() < 1e-6, "{st} vs {ss}");
}
