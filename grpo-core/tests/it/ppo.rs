//! PPO's targets and loss (grpo_core::ppo) against TRL's `PPOTrainer`: reference values from a
//! line-by-line transcription of its code on padded rows (`data/ppo_reference.py`), GAE's
//! identities, the loss's values and gradients by hand, and the errors.
#![allow(
    clippy::needless_range_loop,
    clippy::excessive_precision,
    clippy::type_complexity
)]

use candle_core::{Device, Tensor, Var};
use grpo_core::ppo::{
    KlEstimator, PpoLossInputs, PpoParams, PpoRollout, gae, masked_whiten, ppo_loss, ppo_targets,
};
use proptest::prelude::*;

// Printed by `python3 data/ppo_reference.py`.
const K3_WHITENED_ADV: [f32; 16] = [
    0.024976806,
    1.292544947,
    1.178461631,
    0.000000000,
    -1.723425719,
    0.000000000,
    0.000000000,
    0.000000000,
    -0.501525607,
    -0.055166898,
    1.003607344,
    0.470761541,
    -0.675007423,
    -1.015226622,
    0.000000000,
    0.000000000,
];
const K3_WHITENED_RET: [f32; 16] = [
    0.800989472,
    1.362476236,
    1.966940600,
    2.916824797,
    -0.913157567,
    -1.161356679,
    0.000000000,
    0.000000000,
    0.260085883,
    0.533875541,
    1.020514142,
    1.474298472,
    -0.185191240,
    -0.120097562,
    -0.141811310,
    0.000000000,
];
const K1_PLAIN_ADV: [f32; 16] = [
    0.753394408,
    1.564560856,
    0.650644409,
    0.000000000,
    -1.740982718,
    0.000000000,
    0.000000000,
    0.000000000,
    -0.032712436,
    0.200433723,
    0.793092420,
    -0.413967039,
    -0.648256530,
    -1.126207093,
    0.000000000,
    0.000000000,
];
const K1_PLAIN_RET: [f32; 16] = [
    1.378525000,
    1.419500000,
    1.510000000,
    1.500000000,
    -0.535000000,
    -0.500000000,
    0.000000000,
    0.000000000,
    0.754262500,
    0.809750000,
    0.805000000,
    0.900000000,
    0.043750000,
    0.075000000,
    0.000000000,
    0.000000000,
];

fn case() -> (Vec<Vec<f32>>, Vec<Vec<f32>>, Vec<Vec<f32>>, Vec<f32>) {
    (
        vec![
            vec![-1.2, -0.3, -2.1],
            vec![-0.7],
            vec![-0.1, -1.5, -0.9, -3.0],
            vec![-0.4, -2.2],
        ],
        vec![
            vec![-1.0, -0.5, -1.7],
            vec![-1.1],
            vec![-0.2, -1.2, -1.3, -2.5],
            vec![-0.6, -2.0],
        ],
        vec![
            vec![0.3, -0.2, 0.5, 0.1],
            vec![0.05, 0.4],
            vec![0.2, 0.1, -0.3, 0.6, 0.9],
            vec![-0.1, 0.25, 0.7],
        ],
        vec![1.5, -0.5, 0.8, 0.0],
    )
}

fn close(got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol, "entry {i}: {g} vs {w}\n{got:?}");
    }
}

#[test]
fn targets_match_trl_with_k3_and_whitened_rewards() {
    let (lp, rlp, v, s) = case();
    let r = PpoRollout {
        logprobs: &lp,
        ref_logprobs: &rlp,
        values: &v,
        scores: &s,
    };
    let p = PpoParams {
        kl_coef: 0.05,
        kl_estimator: KlEstimator::K3,
        whiten_rewards: true,
        gamma: 0.9,
        lam: 0.8,
    };
    let t = ppo_targets(&r, &p).unwrap();
    assert_eq!(t.width, 4);
    close(&t.advantages, &K3_WHITENED_ADV, 2e-5);
    close(&t.returns, &K3_WHITENED_RET, 2e-5);
}

#[test]
fn targets_match_trl_with_k1() {
    let (lp, rlp, v, s) = case();
    let r = PpoRollout {
        logprobs: &lp,
        ref_logprobs: &rlp,
        values: &v,
        scores: &s,
    };
    let p = PpoParams {
        kl_coef: 0.2,
        kl_estimator: KlEstimator::K1,
        whiten_rewards: false,
        gamma: 1.0,
        lam: 0.95,
    };
    let t = ppo_targets(&r, &p).unwrap();
    close(&t.advantages, &K1_PLAIN_ADV, 2e-5);
    close(&t.returns, &K1_PLAIN_RET, 2e-5);
    // The score sits after each row's last token, on it for the row that fills the width.
    assert_eq!(
        (0..4).map(|i| t.score_position(i)).collect::<Vec<_>>(),
        [3, 1, 3, 2]
    );
    // k1's KL is log π − log π_ref per token, 0 past the tokens.
    assert!((t.kl[0] - (-1.2 + 1.0)).abs() < 1e-6 && t.kl[5] == 0.0);
    assert!(t.has_value(1, 1) && !t.has_value(1, 2) && !t.is_token(1, 1));
}

#[test]
fn k3_is_never_negative_and_k1_is_the_log_ratio() {
    for (a, b) in [(-1.0, -2.0), (-2.0, -1.0), (-0.5, -0.5)] {
        assert!(KlEstimator::K3.at(a, b) >= 0.0);
        assert!((KlEstimator::K1.at(a, b) - (a - b)).abs() < 1e-12);
    }
    assert_eq!("K3".parse::<KlEstimator>().unwrap(), KlEstimator::K3);
    let e = "k2".parse::<KlEstimator>().unwrap_err();
    assert!(e.contains("k1 or k3"), "{e}");
}

#[test]
fn whitening_uses_the_unbiased_variance_and_can_keep_the_mean() {
    let mut x = vec![1.0, 2.0, 3.0, 100.0];
    let mask = [true, true, true, false];
    masked_whiten(&mut x, &mask, true).unwrap();
    // mean 2, unbiased variance 1.
    close(
        &x[..3].iter().map(|&v| v as f32).collect::<Vec<_>>(),
        &[-1.0, 0.0, 1.0],
        1e-6,
    );
    let mut y = vec![1.0, 2.0, 3.0];
    masked_whiten(&mut y, &[true; 3], false).unwrap();
    close(
        &y.iter().map(|&v| v as f32).collect::<Vec<_>>(),
        &[1.0, 2.0, 3.0],
        1e-6,
    );
    let e = masked_whiten(&mut [1.0, 2.0], &[true, false], true).unwrap_err();
    assert!(e.contains("at least two"), "{e}");
}

#[test]
fn a_batch_of_one_token_or_of_mismatched_rows_is_refused() {
    let one = vec![vec![-1.0f32]];
    let v = vec![vec![0.0f32, 0.0]];
    let r = PpoRollout {
        logprobs: &one,
        ref_logprobs: &one,
        values: &v,
        scores: &[1.0],
    };
    let p = PpoParams {
        kl_coef: 0.05,
        kl_estimator: KlEstimator::K1,
        whiten_rewards: false,
        gamma: 1.0,
        lam: 0.95,
    };
    assert!(ppo_targets(&r, &p).unwrap_err().contains("at least two"));
    let two = vec![vec![-1.0f32, -1.0]];
    let r = PpoRollout {
        logprobs: &two,
        ref_logprobs: &one,
        values: &v,
        scores: &[1.0],
    };
    assert!(ppo_targets(&r, &p).unwrap_err().contains("row 0"));
    let empty: Vec<Vec<f32>> = vec![vec![]];
    let r = PpoRollout {
        logprobs: &empty,
        ref_logprobs: &empty,
        values: &v,
        scores: &[1.0],
    };
    assert!(ppo_targets(&r, &p).unwrap_err().contains("no completion"));
}

proptest! {
    /// With γ = λ = 1 and no KL, GAE telescopes: every return is the row's score.
    #[test]
    fn undiscounted_returns_are_the_score(
        rows in prop::collection::vec((1usize..7, -3f32..3.0), 2..6),
        seed in 0u64..1000,
    ) {
        let mut x = seed;
        let mut next = || { x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407); ((x >> 33) as f32 / (1u64 << 31) as f32) - 0.5 };
        let lp: Vec<Vec<f32>> = rows.iter().map(|&(l, _)| (0..l).map(|_| next() - 1.0).collect()).collect();
        let v: Vec<Vec<f32>> = rows.iter().map(|&(l, _)| (0..=l).map(|_| next()).collect()).collect();
        let s: Vec<f32> = rows.iter().map(|r| r.1).collect();
        let r = PpoRollout { logprobs: &lp, ref_logprobs: &lp, values: &v, scores: &s };
        let p = PpoParams { kl_coef: 0.3, kl_estimator: KlEstimator::K1, whiten_rewards: false, gamma: 1.0, lam: 1.0 };
        let t = ppo_targets(&r, &p).unwrap();
        for i in 0..rows.len() {
            for j in 0..t.width {
                if t.has_value(i, j) {
                    prop_assert!((t.returns[i * t.width + j] - s[i]).abs() < 1e-4);
                }
            }
        }
    }

    /// With λ = 0 each advantage is the one-step TD error `r_t + γ V_{t+1} − V_t`.
    #[test]
    fn lambda_zero_is_the_td_error(
        r in prop::collection::vec(-2f64..2.0, 1..10),
        v in prop::collection::vec(-2f64..2.0, 10),
        gamma in 0f64..1.0,
    ) {
        let w = r.len();
        let (a, ret) = gae(&r, &v[..w], w, gamma, 0.0);
        for t in 0..w {
            let next = if t + 1 < w { v[t + 1] } else { 0.0 };
            prop_assert!((a[t] - (r[t] + gamma * next - v[t])).abs() < 1e-12);
            prop_assert!((ret[t] - a[t] - v[t]).abs() < 1e-12);
        }
    }
}

fn t2(rows: &[&[f32]]) -> Tensor {
    let w = rows[0].len();
    let flat: Vec<f32> = rows.iter().flat_map(|r| r.iter().copied()).collect();
    Tensor::from_vec(flat, (rows.len(), w), &Device::Cpu).unwrap()
}

#[test]
fn the_loss_clips_as_trl_and_its_gradient_is_the_surrogate() {
    // Two rows of width 3; row 1 has two tokens and three value positions.
    let lp = Var::from_tensor(&t2(&[&[-1.0, -0.5, -2.0], &[-0.3, -1.0, 1.0]])).unwrap();
    let old = t2(&[&[-1.0, -0.9, -1.8], &[-0.3, -0.2, 1.0]]);
    let adv = t2(&[&[1.0, 2.0, -1.0], &[0.5, -1.5, 0.0]]);
    let tm = t2(&[&[1.0, 1.0, 1.0], &[1.0, 1.0, 0.0]]);
    let v = Var::from_tensor(&t2(&[&[0.1, 0.5, -0.25], &[0.0, 0.3, 0.9]])).unwrap();
    let vold = t2(&[&[0.0, 0.0, 0.0], &[0.0, 0.0, 0.0]]);
    let ret = t2(&[&[1.0, 1.0, 1.0], &[-1.0, 0.2, 0.5]]);
    let vm = t2(&[&[1.0, 1.0, 1.0], &[1.0, 1.0, 1.0]]);
    let out = ppo_loss(
        &PpoLossInputs {
            logprobs: lp.as_tensor(),
            old_logprobs: &old,
            advantages: &adv,
            token_mask: &tm,
            values: v.as_tensor(),
            old_values: &vold,
            returns: &ret,
            value_mask: &vm,
        },
        0.2,
        0.2,
        0.1,
    )
    .unwrap();
    // Per token: ratio e^(lp − old); pg = max(−Aρ, −A clip(ρ)).
    let lpv = [[-1.0f64, -0.5, -2.0], [-0.3, -1.0, 1.0]];
    let oldv = [[-1.0f64, -0.9, -1.8], [-0.3, -0.2, 1.0]];
    let a = [[1.0f64, 2.0, -1.0], [0.5, -1.5, 0.0]];
    let m = [[1.0f64, 1.0, 1.0], [1.0, 1.0, 0.0]];
    let (mut pg, mut clipped, mut grad) = (0.0, 0.0, [[0.0f64; 3]; 2]);
    for i in 0..2 {
        for j in 0..3 {
            if m[i][j] == 0.0 {
                continue;
            }
            let rho = (lpv[i][j] - oldv[i][j]).exp();
            let (p1, p2) = (-a[i][j] * rho, -a[i][j] * rho.clamp(0.8, 1.2));
            pg += p1.max(p2);
            if p2 > p1 {
                clipped += 1.0;
            } else {
                grad[i][j] = -a[i][j] * rho / 5.0;
            }
        }
    }
    assert!(
        (out.pg_loss - pg / 5.0).abs() < 1e-6,
        "{} vs {}",
        out.pg_loss,
        pg / 5.0
    );
    assert!((out.pg_clipfrac - clipped / 5.0).abs() < 1e-6);
    // Values: clip(V, ±0.2 around 0); vf = ½ mean(max((V − R)², (Vc − R)²)).
    let vv = [[0.1f64, 0.5, -0.25], [0.0, 0.3, 0.9]];
    let rr = [[1.0f64, 1.0, 1.0], [-1.0, 0.2, 0.5]];
    let (mut vf, mut vclip, mut vgrad) = (0.0, 0.0, [[0.0f64; 3]; 2]);
    for i in 0..2 {
        for j in 0..3 {
            let (e1, e2) = (
                (vv[i][j] - rr[i][j]).powi(2),
                (vv[i][j].clamp(-0.2, 0.2) - rr[i][j]).powi(2),
            );
            vf += e1.max(e2);
            if e2 > e1 {
                vclip += 1.0;
            } else {
                vgrad[i][j] = 0.1 * 0.5 * 2.0 * (vv[i][j] - rr[i][j]) / 6.0;
            }
        }
    }
    assert!((out.vf_loss - 0.5 * vf / 6.0).abs() < 1e-6);
    assert!((out.vf_clipfrac - vclip / 6.0).abs() < 1e-6);
    let total = out.loss.to_scalar::<f32>().unwrap() as f64;
    assert!((total - (pg / 5.0 + 0.1 * 0.5 * vf / 6.0)).abs() < 1e-6);
    // TRL's statistics over the padded (b, T) entries.
    let mut kl = 0.0;
    let mut ratio = 0.0;
    for i in 0..2 {
        for j in 0..3 {
            let d = (lpv[i][j] - oldv[i][j]) * m[i][j];
            kl += d * d;
            ratio += d.exp();
        }
    }
    assert!((out.approxkl - 0.5 * kl / 6.0).abs() < 1e-6);
    assert!((out.ratio_mean - ratio / 6.0).abs() < 1e-6);
    let g = out.loss.backward().unwrap();
    let gl = g.get(lp.as_tensor()).unwrap().to_vec2::<f32>().unwrap();
    let gv = g.get(v.as_tensor()).unwrap().to_vec2::<f32>().unwrap();
    for i in 0..2 {
        for j in 0..3 {
            assert!(
                (gl[i][j] as f64 - grad[i][j]).abs() < 1e-6,
                "d/dlp [{i}][{j}]: {} vs {}",
                gl[i][j],
                grad[i][j]
            );
            assert!(
                (gv[i][j] as f64 - vgrad[i][j]).abs() < 1e-6,
                "d/dv [{i}][{j}]: {} vs {}",
                gv[i][j],
                vgrad[i][j]
            );
        }
    }
}
