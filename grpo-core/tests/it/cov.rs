//! Clip-Cov and KL-Cov (`grpo_core::cov`, `LossConfig::cov`): the tokens chosen and the loss
//! against a transcription of verl's `compute_policy_loss_clip_cov` / `_kl_cov`
//! (`data/verl_cov_reference.py`), the gradients each gives, the draw's rules, the refusals.

use candle_core::{Device, Tensor, Var};
use grpo_core::cov::{CovLoss, covariances, select_indices};
use grpo_core::loss::{ImportanceSamplingLevel, LossConfig, LossInputs, LossType, policy_loss};

include!("data/verl_cov_reference.rs");

fn per_token_adv() -> Vec<f64> {
    (0..B * T).map(|i| SEQ_ADV[i / T]).collect()
}

fn mask() -> Vec<bool> {
    MASK.iter().map(|&m| m > 0.0).collect()
}

fn cfg(cov: CovLoss) -> LossConfig {
    LossConfig {
        loss_type: LossType::Dapo,
        epsilon_low: 0.2,
        epsilon_high: 0.28,
        cov,
        ..Default::default()
    }
}

const KL_COV: CovLoss = CovLoss::KlCov {
    ratio: 0.2,
    coef: 1.0,
};

fn clip_cov(seed: u64) -> CovLoss {
    CovLoss::ClipCov {
        ratio: 0.5,
        lb: 0.05,
        ub: 5.0,
        seed,
    }
}

/// The loss of the reference case under `cov`, and its gradient per token.
fn loss_and_grad(cov: CovLoss) -> (f64, Vec<f64>) {
    let dev = Device::Cpu;
    let lp = Var::from_tensor(&Tensor::from_slice(&LP, (B, T), &dev).unwrap()).unwrap();
    let old = Tensor::from_slice(&OLD, (B, T), &dev).unwrap();
    let mask = Tensor::from_slice(&MASK, (B, T), &dev).unwrap();
    let adv = Tensor::from_slice(&SEQ_ADV, B, &dev).unwrap();
    let inputs = LossInputs {
        per_token_logps: lp.as_tensor(),
        old_per_token_logps: Some(&old),
        ref_per_token_logps: None,
        sampling_per_token_logps: None,
        entropies: None,
        advantages: &adv,
        completion_mask: &mask,
        num_items_in_batch: None,
        importance_weights: None,
    };
    let out = policy_loss(&inputs, &cfg(cov)).unwrap();
    let grads = out.loss.backward().unwrap();
    let g = grads.get(lp.as_tensor()).unwrap();
    (
        out.loss.to_scalar::<f64>().unwrap(),
        g.flatten_all().unwrap().to_vec1().unwrap(),
    )
}

#[test]
fn kl_cov_penalises_the_tokens_verl_picks_and_drops_the_clip() {
    let picked = select_indices(KL_COV, &per_token_adv(), &LP, &mask(), &[false; B * T]);
    assert_eq!(picked, KL_COV_PICKED);
    let (loss, g) = loss_and_grad(KL_COV);
    assert!(
        (loss - KL_COV_LOSS).abs() < 1e-12,
        "{loss} vs {KL_COV_LOSS}"
    );
    // d/dl of (−A·r + [picked]·|l − old|) / n: no clip anywhere, the sign where picked.
    let n = MASK.iter().sum::<f64>();
    let adv = per_token_adv();
    for i in 0..B * T {
        let d = LP[i] - OLD[i];
        let mut want = -adv[i] * d.exp() * MASK[i];
        if KL_COV_PICKED.contains(&i) {
            want += d.signum();
        }
        assert!(
            (g[i] - want / n).abs() < 1e-12,
            "token {i}: {} vs {}",
            g[i],
            want / n
        );
    }
}

#[test]
fn clip_cov_takes_the_gradient_off_the_tokens_verl_draws() {
    let (adv, r): (Vec<f64>, Vec<f64>) = (
        per_token_adv(),
        LP.iter().zip(&OLD).map(|(l, o)| (l - o).exp()).collect(),
    );
    // verl's `pg_losses2 > pg_losses1`: the tokens a clip holds.
    let clipped: Vec<bool> = (0..B * T)
        .map(|i| {
            let c = r[i].clamp(0.8, 1.28);
            -adv[i] * c > -adv[i] * r[i] && MASK[i] > 0.0
        })
        .collect();
    assert!(clipped.iter().any(|&c| c));
    // Every candidate is drawn (no more candidates than draws), whatever the seed.
    for seed in [0, 1, 99] {
        let picked = select_indices(clip_cov(seed), &adv, &LP, &mask(), &clipped);
        assert_eq!(picked, CLIP_COV_PICKED);
        let (loss, g) = loss_and_grad(clip_cov(seed));
        assert!(
            (loss - CLIP_COV_LOSS).abs() < 1e-12,
            "{loss} vs {CLIP_COV_LOSS}"
        );
        // The drawn tokens have no gradient; the others the plain clipped loss's.
        let (_, plain) = loss_and_grad(CovLoss::Off);
        for i in 0..B * T {
            let want = if CLIP_COV_PICKED.contains(&i) {
                0.0
            } else {
                plain[i]
            };
            assert!((g[i] - want).abs() < 1e-15, "token {i}: {} vs {want}", g[i]);
        }
    }
}

#[test]
fn the_draw_takes_its_share_of_the_candidates_by_seed() {
    // 40 tokens, every one a candidate: covariances (a − ā)(l − l̄) with a = l = i.
    let n = 40;
    let v: Vec<f64> = (0..n).map(|i| i as f64).collect();
    let m = vec![true; n];
    let cov = covariances(&v, &v, &m);
    let mean = (n - 1) as f64 / 2.0;
    for (i, c) in cov.iter().enumerate() {
        assert_eq!(*c, Some((i as f64 - mean).powi(2)));
    }
    let draw = |ratio: f64, seed: u64, clipped: &[bool]| {
        let mode = CovLoss::ClipCov {
            ratio,
            lb: -1.0,
            ub: 1e9,
            seed,
        };
        select_indices(mode, &v, &v, &m, clipped)
    };
    let none = vec![false; n];
    // int(0.1 · 40) = 4 tokens; at least one for a tiny share.
    assert_eq!(draw(0.1, 3, &none).len(), 4);
    assert_eq!(draw(1e-6, 3, &none).len(), 1);
    // The same seed draws the same tokens; seeds differ in what they draw.
    assert_eq!(draw(0.1, 3, &none), draw(0.1, 3, &none));
    let distinct: std::collections::BTreeSet<Vec<usize>> =
        (0..20).map(|s| draw(0.1, s, &none)).collect();
    assert!(distinct.len() > 10, "{distinct:?}");
    // Tokens a clip holds, padding and covariances outside (lb, ub) are never drawn.
    let mut clipped = vec![false; n];
    clipped[..30].iter_mut().for_each(|c| *c = true);
    for s in 0..20 {
        assert!(draw(0.5, s, &clipped).iter().all(|&i| i >= 30));
    }
    let bounded = CovLoss::ClipCov {
        ratio: 1.0,
        lb: 0.0,
        ub: 1.0,
        seed: 0,
    };
    // Only i = 19 and 20 have 0 < (i − 19.5)² < 1.
    assert_eq!(select_indices(bounded, &v, &v, &m, &none), [19, 20]);
    // KL-Cov: the largest covariances, never a padding token, none without tokens.
    let mut pad = m.clone();
    pad[0] = false;
    let top = select_indices(
        CovLoss::KlCov {
            ratio: 0.06,
            coef: 1.0,
        },
        &v,
        &v,
        &pad,
        &none,
    );
    assert_eq!(top, [1, 39]);
    let empty = vec![false; n];
    assert!(select_indices(KL_COV, &v, &v, &empty, &none).is_empty());
}

#[test]
fn cov_modes_refuse_what_they_do_not_rework() {
    let bad = |c: LossConfig, want: &str| {
        let e = c.validate().unwrap_err();
        assert!(e.contains(want), "{e}");
    };
    bad(
        LossConfig {
            loss_type: LossType::Cispo,
            ..cfg(KL_COV)
        },
        "loss_type cispo",
    );
    bad(
        LossConfig {
            importance_sampling_level: ImportanceSamplingLevel::Sequence,
            ..cfg(clip_cov(0))
        },
        "importance_sampling_level must be token",
    );
    bad(
        LossConfig {
            delta: Some(3.0),
            ..cfg(KL_COV)
        },
        "leave delta out",
    );
    bad(
        cfg(CovLoss::KlCov {
            ratio: 0.0,
            coef: 1.0,
        }),
        "kl_cov_ratio",
    );
    bad(
        cfg(CovLoss::ClipCov {
            ratio: 0.1,
            lb: 5.0,
            ub: 1.0,
            seed: 0,
        }),
        "clip_cov_lb",
    );
    bad(
        cfg(CovLoss::KlCov {
            ratio: 0.1,
            coef: -1.0,
        }),
        "ppo_kl_coef",
    );
    cfg(KL_COV).validate().unwrap();
}
