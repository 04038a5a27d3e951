//! verl's advantage estimators and in-reward KL penalty against reference values from a
//! line-by-line transcription of verl's `core_algos` on padded rows (`data/verl_reference.py`,
//! output in `data/verl_reference.rs`), and their properties.

use grpo_core::advantages::{ScaleRewards, group_advantages, leave_one_out_advantages};
use grpo_core::estimators::{
    AdvEstimator, EstimatorParams, KlController, KlPenalty, apply_kl_penalty, discounted_returns,
    estimate, optimal_token_baseline, remax_advantages, score_rows,
};

include!("data/verl_reference.rs");

fn close(got: &[Vec<f64>], want: &[Vec<f64>], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: rows");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.len(), w.len(), "{what}: row {i} length");
        for (t, (a, b)) in g.iter().zip(w).enumerate() {
            assert!(
                (a - b).abs() <= 1e-6 * (1.0 + b.abs()),
                "{what}: row {i} token {t}: got {a}, verl {b}"
            );
        }
    }
}

fn scores() -> Vec<Vec<f64>> {
    score_rows(&SCORES, &LENS)
}

fn kls(kind: KlPenalty) -> Vec<Vec<f64>> {
    old()
        .iter()
        .zip(refs())
        .map(|(o, r)| o.iter().zip(&r).map(|(&a, &b)| kind.at(a, b)).collect())
        .collect()
}

fn params(scale: ScaleRewards, gamma: f64) -> EstimatorParams {
    EstimatorParams {
        gamma,
        scale_rewards: scale,
    }
}

#[test]
fn the_kl_penalty_in_the_reward_matches_verl_for_every_estimate() {
    for (kind, want, current) in [
        (KlPenalty::Kl, tlr_kl(), CURRENT_KL_KL),
        (KlPenalty::Abs, tlr_abs(), CURRENT_KL_ABS),
        (KlPenalty::Mse, tlr_mse(), CURRENT_KL_MSE),
        (KlPenalty::LowVarKl, tlr_low_var_kl(), CURRENT_KL_LOW_VAR_KL),
    ] {
        let (rows, kl) = apply_kl_penalty(&SCORES, &kls(kind), 0.05);
        close(&rows, &want, kind.as_str());
        assert!(
            (kl - current).abs() < 1e-9,
            "{}: {kl} vs {current}",
            kind.as_str()
        );
    }
}

#[test]
fn the_outcome_estimators_match_verl() {
    let (kl_rows, _) = apply_kl_penalty(&SCORES, &kls(KlPenalty::Kl), 0.05);
    let group = params(ScaleRewards::Group, 1.0);
    let cases = [
        (AdvEstimator::GrpoPassk, scores(), group, want_passk_norm()),
        (
            AdvEstimator::GrpoPassk,
            scores(),
            params(ScaleRewards::None, 1.0),
            want_passk_plain(),
        ),
        (
            AdvEstimator::ReinforcePlusPlusBaseline,
            scores(),
            group,
            want_rfpp_baseline(),
        ),
        (
            AdvEstimator::ReinforcePlusPlusBaseline,
            kl_rows.clone(),
            group,
            want_rfpp_baseline_kl(),
        ),
        (AdvEstimator::Opo, scores(), group, want_opo()),
        (AdvEstimator::Opo, kl_rows.clone(), group, want_opo_kl()),
        (AdvEstimator::Gpg, scores(), group, want_gpg()),
        (AdvEstimator::Gpg, kl_rows.clone(), group, want_gpg_kl()),
    ];
    for (est, rows, p, want) in cases {
        let got = estimate(est, &rows, 4, &p).unwrap();
        close(&got, &want, est.as_str());
    }
}

#[test]
fn reinforce_plus_plus_matches_verl_with_and_without_discount() {
    let got = estimate(
        AdvEstimator::ReinforcePlusPlus,
        &scores(),
        4,
        &params(ScaleRewards::Group, 1.0),
    )
    .unwrap();
    close(&got, &want_rfpp(), "reinforce_plus_plus");
    let (kl_rows, _) = apply_kl_penalty(&SCORES, &kls(KlPenalty::Kl), 0.05);
    let got = estimate(
        AdvEstimator::ReinforcePlusPlus,
        &kl_rows,
        4,
        &params(ScaleRewards::Group, 0.9),
    )
    .unwrap();
    close(
        &got,
        &want_rfpp_kl_gamma(),
        "reinforce_plus_plus, KL, gamma 0.9",
    );
    // The tokens of a completion differ once the KL or the discount is in.
    assert!(got[3].windows(2).any(|w| (w[0] - w[1]).abs() > 1e-6));
}

#[test]
fn remax_matches_verl_with_and_without_the_kl() {
    let baselines: Vec<f64> = (0..LENS.len()).map(|i| GREEDY[i / 4]).collect();
    close(
        &remax_advantages(&scores(), &baselines).unwrap(),
        &want_remax(),
        "remax",
    );
    let (kl_rows, _) = apply_kl_penalty(&SCORES, &kls(KlPenalty::Kl), 0.05);
    close(
        &remax_advantages(&kl_rows, &baselines).unwrap(),
        &want_remax_kl(),
        "remax, KL",
    );
    // Without baselines `estimate` refuses it; a NaN baseline gives 0.
    assert!(
        estimate(
            AdvEstimator::Remax,
            &scores(),
            4,
            &EstimatorParams::default()
        )
        .is_err()
    );
    let mut b = baselines.clone();
    b[0] = f64::NAN;
    let a = remax_advantages(&scores(), &b).unwrap();
    assert!(a[0].iter().all(|&x| x == 0.0));
    assert!(remax_advantages(&scores(), &b[1..]).is_err());
}

#[test]
fn the_optimal_token_baseline_matches_verl() {
    let (old, spsq) = (old(), sum_pi_sq());
    let otb =
        |rows: &[Vec<f64>], tail: bool| optimal_token_baseline(rows, &old, &spsq, 4, tail).unwrap();
    close(&otb(&scores(), false), &want_otb(), "otb");
    // TIR's zero tail: the group's unique longest row keeps its return past the second longest.
    close(&otb(&scores(), true), &want_otb_tail(), "otb, zero tail");
    assert_ne!(want_otb(), want_otb_tail());
    let (kl_rows, _) = apply_kl_penalty(&SCORES, &kls(KlPenalty::Kl), 0.05);
    close(&otb(&kl_rows, false), &want_otb_kl(), "otb, KL");
    // With equal path variances the baseline is the group's mean return at each position, and a
    // group of one row has none.
    let rows = vec![vec![0.0, 1.0], vec![0.0, 0.0]];
    let flat = vec![vec![(0.5f64).ln(); 2]; 2];
    let s = vec![vec![0.5; 2]; 2];
    let a = optimal_token_baseline(&rows, &flat, &s, 2, false).unwrap();
    close(&a, &[vec![0.5, 0.5], vec![-0.5, -0.5]], "equal weights");
    let a = optimal_token_baseline(&rows, &flat, &s, 1, false).unwrap();
    assert_eq!(a, [vec![1.0, 1.0], vec![0.0, 0.0]]);
    // An unscorable row gets 0 and leaves its group's baseline.
    let nan = vec![vec![0.0, 1.0], vec![0.0, f64::NAN], vec![0.0, 0.0]];
    let three = |v: &Vec<Vec<f64>>| vec![v[0].clone(), v[0].clone(), v[0].clone()];
    let a = optimal_token_baseline(&nan, &three(&flat), &three(&s), 3, false).unwrap();
    close(
        &a,
        &[vec![0.5, 0.5], vec![0.0, 0.0], vec![-0.5, -0.5]],
        "NaN row",
    );
    // `estimate` refuses it without the log-probs; mismatched rows are refused naming them.
    assert!(
        estimate(
            AdvEstimator::OptimalTokenBaseline,
            &rows,
            2,
            &EstimatorParams::default()
        )
        .is_err()
    );
    let e = optimal_token_baseline(&rows, &flat[..1], &s, 2, false).unwrap_err();
    assert!(e.contains("old log-probs"), "{e}");
    assert_eq!(
        "tir_optimal_token_baseline"
            .parse::<AdvEstimator>()
            .unwrap(),
        AdvEstimator::TirOptimalTokenBaseline
    );
}

#[test]
fn grpo_and_rloo_are_trls_on_the_summed_rows() {
    let (kl_rows, _) = apply_kl_penalty(&SCORES, &kls(KlPenalty::Kl), 0.05);
    let summed: Vec<f32> = kl_rows
        .iter()
        .map(|r| r.iter().sum::<f64>() as f32)
        .collect();
    for scale in [ScaleRewards::Group, ScaleRewards::Batch, ScaleRewards::None] {
        let got = estimate(AdvEstimator::Grpo, &kl_rows, 4, &params(scale, 1.0)).unwrap();
        let want = group_advantages(&summed, 4, scale);
        for (row, w) in got.iter().zip(&want) {
            assert!(row.iter().all(|a| (a - f64::from(*w)).abs() < 1e-6));
        }
    }
    let got = estimate(AdvEstimator::Rloo, &kl_rows, 4, &EstimatorParams::default()).unwrap();
    for (row, w) in got.iter().zip(leave_one_out_advantages(&summed, 4)) {
        assert!(row.iter().all(|a| (a - f64::from(w)).abs() < 1e-6));
    }
}

#[test]
fn the_adaptive_controller_moves_as_verls_and_the_fixed_one_does_not() {
    let mut c = KlController {
        value: 0.05,
        adaptive: Some((0.1, 100.0)),
    };
    for ((kl, n), want) in [(0.3, 12), (0.02, 12), (0.1, 24)].into_iter().zip(ADAPTIVE) {
        c.update(kl, n);
        assert!((c.value - want).abs() < 1e-15, "{} vs {want}", c.value);
    }
    let mut fixed = KlController {
        value: 0.05,
        adaptive: None,
    };
    fixed.update(5.0, 100);
    assert_eq!(fixed.value, 0.05);
}

#[test]
fn unscorable_completions_learn_nothing_and_leave_the_statistics() {
    // The second group's last completion could not be scored.
    let mut s = SCORES.to_vec();
    let nan_row = 7;
    s[nan_row] = f32::NAN;
    let rows = score_rows(&s, &LENS);
    for est in AdvEstimator::ALL
        .into_iter()
        .filter(|e| *e != AdvEstimator::Remax && !e.optimal_token())
    {
        let got = estimate(est, &rows, 4, &EstimatorParams::default()).unwrap();
        assert!(got[nan_row].iter().all(|&a| a == 0.0), "{}", est.as_str());
        assert!(
            got.iter().flatten().all(|a| a.is_finite()),
            "{}",
            est.as_str()
        );
    }
    // OPO's baseline of that group is over the other three only (all 0 here): the others' 0.
    let got = estimate(AdvEstimator::Opo, &rows, 4, &EstimatorParams::default()).unwrap();
    assert!(got[4..7].iter().flatten().all(|&a| a == 0.0));
}

#[test]
fn bad_batches_are_refused_in_one_line() {
    let rows = scores();
    let err = estimate(AdvEstimator::Opo, &rows, 5, &EstimatorParams::default()).unwrap_err();
    assert!(err.contains("not whole groups of 5"), "{err}");
    let err = estimate(
        AdvEstimator::GrpoPassk,
        &rows,
        1,
        &EstimatorParams::default(),
    )
    .unwrap_err();
    assert!(err.contains("at least two completions per prompt"), "{err}");
    let err = estimate(
        AdvEstimator::GrpoPassk,
        &rows,
        4,
        &params(ScaleRewards::Batch, 1.0),
    )
    .unwrap_err();
    assert!(err.contains("scale_rewards group or none"), "{err}");
    let one = vec![vec![1.0]];
    let err = estimate(
        AdvEstimator::ReinforcePlusPlus,
        &one,
        1,
        &EstimatorParams::default(),
    )
    .unwrap_err();
    assert!(err.contains("at least two"), "{err}");
    for e in [
        "full".parse::<KlPenalty>().unwrap_err(),
        "reinforce".parse::<AdvEstimator>().unwrap_err(),
    ] {
        assert!(!e.contains('\n') && e.len() < 200, "{e}");
    }
    assert_eq!("k3".parse::<KlPenalty>().unwrap(), KlPenalty::LowVarKl);
    assert_eq!(
        "grpo_vectorized".parse::<AdvEstimator>().unwrap(),
        AdvEstimator::Grpo
    );
}

mod properties {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn discounted_returns_satisfy_the_bellman_identity(
            r in proptest::collection::vec(-5.0f64..5.0, 1..20),
            gamma in 0.0f64..1.0,
        ) {
            let g = discounted_returns(&r, gamma);
            for t in 0..r.len() {
                let next = g.get(t + 1).copied().unwrap_or(0.0);
                prop_assert!((g[t] - (r[t] + gamma * next)).abs() < 1e-9);
            }
        }

        #[test]
        fn whitened_estimators_have_zero_token_mean_and_unit_variance(
            scores in proptest::collection::vec(-3.0f32..3.0, 8),
            lens in proptest::collection::vec(1usize..6, 8),
        ) {
            let rows = score_rows(&scores, &lens);
            for est in [AdvEstimator::ReinforcePlusPlus, AdvEstimator::ReinforcePlusPlusBaseline] {
                let a = estimate(est, &rows, 4, &EstimatorParams::default()).unwrap();
                let flat: Vec<f64> = a.into_iter().flatten().collect();
                let n = flat.len() as f64;
                let mean = flat.iter().sum::<f64>() / n;
                let var = flat.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
                prop_assert!(mean.abs() < 1e-6);
                // Unit variance unless every token is equal (then all 0).
                prop_assert!((var - 1.0).abs() < 1e-4 || var < 1e-6, "var {}", var);
            }
        }

        #[test]
        fn passk_rewards_only_the_best_of_each_group(
            scores in proptest::collection::vec(-3.0f32..3.0, 8),
        ) {
            let rows = score_rows(&scores, &[2; 8]);
            let a = estimate(AdvEstimator::GrpoPassk, &rows, 4, &EstimatorParams::default()).unwrap();
            for g in 0..2 {
                let nonzero = (0..4).filter(|&j| a[4 * g + j][0] != 0.0).count();
                prop_assert!(nonzero <= 1);
                for j in 0..4 {
                    prop_assert!(a[4 * g + j][0] >= 0.0);
                }
            }
        }

        #[test]
        fn opo_with_equal_lengths_is_the_plain_group_mean(
            scores in proptest::collection::vec(-3.0f32..3.0, 8),
            len in 1usize..5,
        ) {
            let rows = score_rows(&scores, &[len; 8]);
            let a = estimate(AdvEstimator::Opo, &rows, 4, &EstimatorParams::default()).unwrap();
            let b = group_advantages(&scores, 4, ScaleRewards::None);
            for (row, w) in a.iter().zip(b) {
                prop_assert!((row[0] - f64::from(w)).abs() < 1e-5);
            }
        }
    }
}
