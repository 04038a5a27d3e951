//! BCO's UDM classifier (grpo_core::udm) against scikit-learn's
//! `LogisticRegression(class_weight="balanced")`, as TRL's BCOTrainer fits it: reference values
//! printed by `data/udm_reference.py`; the density-ratio weights; the errors.
#![allow(clippy::excessive_precision)]

use grpo_core::udm::UdmClassifier;

// Printed by `python3 data/udm_reference.py`.
const OPTIMUM_COEF: [f64; 4] = [0.5601883680, 0.4595308164, -0.1652311560, -0.4750728046];
const OPTIMUM_INTERCEPT: f64 = -0.1493963759;
const OPTIMUM_PROBE: [f64; 2] = [0.4627153267, 0.2852152049];
const TRL_COEF: [f64; 4] = [0.5601013303, 0.4594757557, -0.1652299017, -0.4750146270];
const TRL_INTERCEPT: f64 = -0.1493181288;
const TRL_PROBE: [f64; 2] = [0.4627276957, 0.2852549553];

/// The script's embeddings: 13 rows of 4 values, 8 desirable.
fn embeddings() -> (Vec<Vec<f32>>, Vec<bool>) {
    let (mut xs, mut ys) = (Vec::new(), Vec::new());
    for i in 0..13 {
        let label = i % 3 != 0;
        let shift = if label { 0.3 } else { -0.2 };
        xs.push(
            (0..4)
                .map(|j| {
                    ((i as f64 * 1.3 + j as f64 * 0.7).sin() + shift * (j as f64).cos()) as f32
                })
                .collect(),
        );
        ys.push(label);
    }
    (xs, ys)
}

#[test]
fn the_fit_is_scikit_learns_balanced_logistic_regression() {
    let (x, y) = embeddings();
    let c = UdmClassifier::fit(&x, &y).unwrap();
    for (g, w) in c.coef.iter().zip(OPTIMUM_COEF) {
        assert!((g - w).abs() < 1e-8, "{:?} vs {OPTIMUM_COEF:?}", c.coef);
    }
    assert!(
        (c.intercept - OPTIMUM_INTERCEPT).abs() < 1e-6,
        "{}",
        c.intercept
    );
    let probe = [[0.5f32, -0.25, 1.0, 0.0], [-1.0, 0.3, -0.2, 0.8]];
    for (p, (o, d)) in probe.iter().zip(OPTIMUM_PROBE.iter().zip(TRL_PROBE)) {
        let got = c.probability(p);
        assert!((got - o).abs() < 1e-8, "{got} vs {o}");
        // TRL's call (float32 embeddings, default tolerance) stops near the optimum.
        assert!((got - d).abs() < 1e-4, "{got} vs {d}");
    }
    for (g, w) in c.coef.iter().zip(TRL_COEF) {
        assert!((g - w).abs() < 1e-3, "{:?} vs {TRL_COEF:?}", c.coef);
    }
    assert!((c.intercept - TRL_INTERCEPT).abs() < 1e-3);
}

#[test]
fn density_ratio_weights_are_clamped_odds() {
    let c = UdmClassifier {
        coef: vec![1.0, -1.0],
        intercept: 0.0,
    };
    // p = σ(0) = ½: odds 1.
    assert!((c.density_ratio(&[0.3, 0.3], 0.5, 10.0) - 1.0).abs() < 1e-7);
    // p = σ(ln 3) = ¾: odds 3.
    let z = 3f64.ln() as f32;
    assert!((c.density_ratio(&[z, 0.0], 0.5, 10.0) - 3.0).abs() < 1e-5);
    assert_eq!(c.density_ratio(&[20.0, 0.0], 0.5, 10.0), 10.0);
    assert_eq!(c.density_ratio(&[-20.0, 0.0], 0.5, 10.0), 0.5);
    assert_eq!(c.accuracy(&[vec![1.0, 0.0], vec![-1.0, 0.0]], true), 0.5);
}

#[test]
fn separable_classes_stay_finite_and_bad_input_is_refused() {
    // Separable: the L2 penalty keeps the optimum finite.
    let x = vec![
        vec![3.0f32, 0.0],
        vec![2.0, 1.0],
        vec![-2.0, 0.5],
        vec![-3.0, -1.0],
    ];
    let y = [true, true, false, false];
    let c = UdmClassifier::fit(&x, &y).unwrap();
    assert!(c.coef.iter().all(|v| v.is_finite()) && c.accuracy(&x[..2], true) == 1.0);
    assert!(
        UdmClassifier::fit(&x, &[true; 4])
            .unwrap_err()
            .contains("0 undesirable")
            || UdmClassifier::fit(&x, &[true; 4])
                .unwrap_err()
                .contains("4 of 4")
    );
    assert!(UdmClassifier::fit(&[], &[]).is_err());
    let ragged = vec![vec![1.0f32, 0.0], vec![1.0]];
    assert!(
        UdmClassifier::fit(&ragged, &[true, false])
            .unwrap_err()
            .contains("embedding 1")
    );
    let nan = vec![vec![f32::NAN], vec![1.0]];
    assert!(
        UdmClassifier::fit(&nan, &[true, false])
            .unwrap_err()
            .contains("non-finite")
    );
}
