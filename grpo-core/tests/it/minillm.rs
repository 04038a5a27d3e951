//! MiniLLM's pieces: per-token advantages in the policy loss and the reverse-KL advantages.
#![allow(clippy::unwrap_used, clippy::needless_range_loop, missing_docs)]

use candle_core::{DType, Device, Tensor, Var};
use grpo_core::distill::minillm_advantages;
use grpo_core::loss::{ImportanceSamplingLevel, LossConfig, LossInputs, LossType, policy_loss};
use proptest::prelude::*;

const TOKEN_LOSS_TYPES: [LossType; 7] = [
    LossType::Grpo,
    LossType::Bnpo,
    LossType::DrGrpo,
    LossType::Dapo,
    LossType::Sapo,
    LossType::Luspo,
    LossType::Cispo,
];

#[derive(Debug, Clone)]
struct Case {
    b: usize,
    t: usize,
    logp: Vec<f32>,
    old: Vec<f32>,
    reference: Vec<f32>,
    sampled: Vec<f32>,
    adv: Vec<f32>,
    mask: Vec<f32>,
}

fn case() -> impl Strategy<Value = Case> {
    (1usize..5, 1usize..7).prop_flat_map(|(b, t)| {
        let n = b * t;
        (
            prop::collection::vec(-8f32..0.0, n),
            prop::collection::vec(-0.4f32..0.4, n),
            prop::collection::vec(-2f32..2.0, n),
            prop::collection::vec(-1f32..1.0, n),
            prop::collection::vec(-3f32..3.0, n),
            prop::collection::vec(prop::bool::weighted(0.7), n),
        )
            .prop_map(move |(logp, d, r, s, adv, m)| Case {
                b,
                t,
                old: logp.iter().zip(&d).map(|(l, d)| l + d).collect(),
                reference: logp.iter().zip(&r).map(|(l, r)| l + r).collect(),
                sampled: logp.iter().zip(&s).map(|(l, s)| l + s).collect(),
                logp,
                adv,
                mask: m.into_iter().map(|x| f32::from(u8::from(x))).collect(),
            })
    })
}

/// The loss and its gradient for advantages `adv` of any shape.
fn run(c: &Case, adv: &Tensor, cfg: &LossConfig) -> (f32, Vec<f32>) {
    let d = Device::Cpu;
    let t2 = |v: &[f32]| Tensor::from_slice(v, (c.b, c.t), &d).unwrap();
    let logp = Var::from_tensor(&t2(&c.logp)).unwrap();
    let (old, reference, sampled, mask) =
        (t2(&c.old), t2(&c.reference), t2(&c.sampled), t2(&c.mask));
    let out = policy_loss(
        &LossInputs {
            per_token_logps: logp.as_tensor(),
            old_per_token_logps: Some(&old),
            ref_per_token_logps: Some(&reference),
            sampling_per_token_logps: Some(&sampled),
            entropies: None,
            advantages: adv,
            completion_mask: &mask,
            num_items_in_batch: None,
            importance_weights: None,
        },
        cfg,
    )
    .unwrap();
    let loss = out.loss.to_scalar::<f32>().unwrap();
    let g = out.loss.backward().unwrap();
    let g = match g.get(logp.as_tensor()) {
        Some(g) => g.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        None => vec![0.0; c.b * c.t],
    };
    (loss, g)
}

proptest! {
    /// One advantage per completion and the same value repeated at each of its tokens give the
    /// same loss and gradient, for every loss type that weighs tokens, at both ratio levels,
    /// with the KL term and the off-policy sequence mask.
    #[test]
    fn per_token_advantages_repeated_along_a_row_are_the_per_completion_loss(c in case()) {
        let d = Device::Cpu;
        let per_seq = Tensor::from_slice(&c.adv[..c.b], c.b, &d).unwrap();
        let per_token = per_seq.unsqueeze(1).unwrap().broadcast_as((c.b, c.t)).unwrap().contiguous().unwrap();
        for lt in TOKEN_LOSS_TYPES {
            for level in [ImportanceSamplingLevel::Token, ImportanceSamplingLevel::Sequence] {
                let cfg = LossConfig {
                    loss_type: lt,
                    importance_sampling_level: level,
                    beta: 0.04,
                    off_policy_mask_threshold: Some(0.3),
                    max_completion_length: 8,
                    ..Default::default()
                };
                let (l1, g1) = run(&c, &per_seq, &cfg);
                let (l2, g2) = run(&c, &per_token, &cfg);
                prop_assert!((l1 - l2).abs() <= 1e-5 * (1.0 + l1.abs()), "{lt:?} {level:?}: {l1} vs {l2}");
                for (a, b) in g1.iter().zip(&g2) {
                    prop_assert!((a - b).abs() <= 1e-5 * (1.0 + a.abs()), "{lt:?} {level:?}: gradient {a} vs {b}");
                }
            }
        }
    }

    /// Per-token advantages against TRL's formula written out (dapo, token ratios, clipping,
    /// the off-policy mask per token: a token is dropped when its advantage is negative and
    /// its row's mean sampling gap exceeds the threshold).
    #[test]
    fn per_token_advantages_follow_trls_formula(c in case()) {
        let d = Device::Cpu;
        let adv = Tensor::from_slice(&c.adv, (c.b, c.t), &d).unwrap();
        let (eps_lo, eps_hi, thr) = (0.2f64, 0.28f64, 0.3f64);
        let cfg = LossConfig {
            loss_type: LossType::Dapo,
            epsilon_low: eps_lo,
            epsilon_high: eps_hi,
            off_policy_mask_threshold: Some(thr),
            ..Default::default()
        };
        let (loss, grad) = run(&c, &adv, &cfg);
        let n: f64 = c.mask.iter().map(|&m| f64::from(m)).sum::<f64>().max(1.0);
        let (mut want, mut want_g) = (0f64, vec![0f64; c.b * c.t]);
        for i in 0..c.b {
            let row = i * c.t..(i + 1) * c.t;
            let m: f64 = row.clone().map(|k| f64::from(c.mask[k])).sum();
            let gap: f64 = row.clone().map(|k| f64::from(c.mask[k]) * f64::from(c.sampled[k] - c.logp[k])).sum::<f64>() / m.max(1.0);
            for k in row {
                let a = f64::from(c.adv[k]);
                let keep = if a < 0.0 && gap > thr { 0.0 } else { 1.0 };
                let r = f64::from(c.logp[k] - c.old[k]).exp();
                let clipped = r.clamp(1.0 - eps_lo, 1.0 + eps_hi);
                let (l1, l2) = (r * a, clipped * a);
                want -= f64::from(c.mask[k]) * keep * l1.min(l2) / n;
                // The unclipped branch carries the gradient r·a (d r / d logp = r).
                if l1 <= l2 {
                    want_g[k] = -f64::from(c.mask[k]) * keep * r * a / n;
                }
            }
        }
        prop_assert!((f64::from(loss) - want).abs() <= 1e-4 * (1.0 + want.abs()), "{loss} vs {want}");
        for (g, w) in grad.iter().zip(&want_g) {
            prop_assert!((f64::from(*g) - w).abs() <= 1e-4 * (1.0 + w.abs()), "gradient {g} vs {w}");
        }
    }

    /// MiniLLM's advantages against TRL's `_compute_advantage` written out: powers of γ from the
    /// first completion token, reverse cumulative sums, the lengths with padding counted 1e-4.
    #[test]
    fn minillm_advantages_follow_trls_formula(
        c in case(),
        gamma in prop_oneof![Just(0.0f64), 0.05f64..1.0],
        norm in any::<bool>(),
    ) {
        let d = Device::Cpu;
        let t2 = |v: &[f32]| Tensor::from_slice(v, (c.b, c.t), &d).unwrap();
        // Teacher = reference, student = policy.
        let got = minillm_advantages(&t2(&c.reference), &t2(&c.logp), &t2(&c.mask), gamma, norm)
            .unwrap()
            .flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for i in 0..c.b {
            let r: Vec<f64> = (0..c.t).map(|j| f64::from(c.mask[i * c.t + j]) * f64::from(c.reference[i * c.t + j] - c.logp[i * c.t + j])).collect();
            for j in 0..c.t {
                let want = if gamma == 0.0 {
                    r[j]
                } else {
                    let num: f64 = (j..c.t).map(|k| gamma.powi(k as i32) * r[k]).sum();
                    if norm {
                        let den: f64 = (j..c.t).map(|k| {
                            let m = f64::from(c.mask[i * c.t + k]);
                            gamma.powi(k as i32) * if m < 0.5 { 1e-4 } else { m }
                        }).sum();
                        num / den
                    } else {
                        num
                    }
                };
                let g = f64::from(got[i * c.t + j]);
                prop_assert!((g - want).abs() <= 1e-4 * (1.0 + want.abs()), "row {i} token {j}: {g} vs {want}");
            }
        }
    }
}

/// The sequence-level loss types refuse per-token advantages in one line.
#[test]
fn sequence_loss_types_refuse_per_token_advantages() {
    let d = Device::Cpu;
    let logp = Tensor::zeros((2, 3), DType::F32, &d).unwrap();
    let mask = Tensor::ones((2, 3), DType::F32, &d).unwrap();
    let adv = Tensor::ones((2, 3), DType::F32, &d).unwrap();
    for lt in [LossType::Gmpo, LossType::Vespo] {
        let err = policy_loss(
            &LossInputs {
                per_token_logps: &logp,
                old_per_token_logps: None,
                ref_per_token_logps: None,
                sampling_per_token_logps: None,
                entropies: None,
                advantages: &adv,
                completion_mask: &mask,
                num_items_in_batch: None,
                importance_weights: None,
            },
            &LossConfig {
                loss_type: lt,
                ..Default::default()
            },
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("one advantage per completion"),
            "{lt:?}: {err}"
        );
    }
    let wrong = Tensor::ones((2, 2), DType::F32, &d).unwrap();
    let err = policy_loss(
        &LossInputs {
            per_token_logps: &logp,
            old_per_token_logps: None,
            ref_per_token_logps: None,
            sampling_per_token_logps: None,
            entropies: None,
            advantages: &wrong,
            completion_mask: &mask,
            num_items_in_batch: None,
            importance_weights: None,
        },
        &LossConfig::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("(2, 3)"), "{err}");
}

/// Long completions: where TRL's powers of γ from the first token underflow f32 (0.9^1000),
/// the normalised advantages stay the discounted mean of the rewards ahead.
#[test]
fn minillm_advantages_stay_finite_on_long_completions() {
    let d = Device::Cpu;
    let t = 3000;
    let teacher: Vec<f32> = (0..t).map(|i| -((i % 7) as f32) * 0.1).collect();
    let student = vec![-0.3f32; t];
    let mask = vec![1f32; t];
    let t2 = |v: &[f32]| Tensor::from_slice(v, (1, t), &d).unwrap();
    let got = minillm_advantages(&t2(&teacher), &t2(&student), &t2(&mask), 0.9, true)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    for j in [0, 1500, 2990, 2999] {
        let (mut num, mut den) = (0f64, 0f64);
        for k in j..t {
            let w = 0.9f64.powi((k - j) as i32);
            num += w * f64::from(teacher[k] - student[k]);
            den += w;
        }
        let want = num / den;
        assert!(
            (f64::from(got[j]) - want).abs() < 1e-5,
            "token {j}: {} vs {want}",
            got[j]
        );
    }
    let bf = minillm_advantages(
        &t2(&teacher).to_dtype(DType::BF16).unwrap(),
        &t2(&student).to_dtype(DType::BF16).unwrap(),
        &t2(&mask),
        0.9,
        true,
    )
    .unwrap();
    assert_eq!(bf.dtype(), DType::BF16);
    assert!(
        minillm_advantages(&t2(&teacher), &t2(&student), &t2(&mask), -0.5, true)
            .unwrap_err()
            .to_string()
            .contains("gamma")
    );
}
