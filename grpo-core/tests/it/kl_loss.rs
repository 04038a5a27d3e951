//! `LossConfig::kl_loss_type` (verl's `actor.kl_loss_type`): each estimate's value and gradient
//! per token, the straight-through `+` variants, and the loss's β term built from them.

use candle_core::{Device, Tensor, Var};
use grpo_core::estimators::KlPenalty;
use grpo_core::loss::{KlEstimate, KlLossType, LossConfig, LossInputs, LossType, policy_loss};

/// Log-probs and reference log-probs, one row, with gaps `d = logp − ref` from −30 to 30
/// (beyond verl's clamps) and an exact 0.
fn rows() -> (Vec<f64>, Vec<f64>) {
    let d = [-30.0, -12.0, -2.5, -0.3, 0.0, 0.02, 0.7, 3.0, 25.0];
    let logp: Vec<f64> = (0..d.len()).map(|i| -0.5 - 0.1 * i as f64).collect();
    let reference: Vec<f64> = logp.iter().zip(&d).map(|(l, d)| l - d).collect();
    (logp, reference)
}

/// The estimate per token and its gradient with respect to `logp`.
fn value_and_grad(t: KlLossType) -> (Vec<f64>, Vec<f64>) {
    let (logp, reference) = rows();
    let n = logp.len();
    let dev = Device::Cpu;
    let lp = Var::from_tensor(&Tensor::from_vec(logp, (1, n), &dev).unwrap()).unwrap();
    let r = Tensor::from_vec(reference, (1, n), &dev).unwrap();
    let kl = t.per_token(lp.as_tensor(), &r).unwrap();
    let grads = kl.sum_all().unwrap().backward().unwrap();
    let g = grads.get(lp.as_tensor()).unwrap();
    (
        kl.flatten_all().unwrap().to_vec1().unwrap(),
        g.flatten_all().unwrap().to_vec1().unwrap(),
    )
}

fn close(a: &[f64], b: &[f64], what: &str) {
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-9 * (1.0 + y.abs()),
            "{what}[{i}]: {x} vs {y}"
        );
    }
}

fn parse(s: &str) -> KlLossType {
    s.parse().unwrap()
}

#[test]
fn each_estimate_has_its_value_and_gradient() {
    let (logp, reference) = rows();
    let d: Vec<f64> = logp.iter().zip(&reference).map(|(l, r)| l - r).collect();
    // verl's four, against grpo-core's scalar transcription of verl's kl_penalty (itself
    // checked against verl's code in estimators.rs).
    for (name, verl) in [
        ("k1", KlPenalty::Kl),
        ("abs", KlPenalty::Abs),
        ("k2", KlPenalty::Mse),
        ("low_var_kl", KlPenalty::LowVarKl),
    ] {
        let (v, _) = value_and_grad(parse(name));
        let want: Vec<f64> = logp
            .iter()
            .zip(&reference)
            .map(|(&l, &r)| verl.at(l, r))
            .collect();
        close(&v, &want, name);
    }
    // TRL's k3: unclamped.
    let (v, g) = value_and_grad(KlLossType::default());
    let want: Vec<f64> = d.iter().map(|d| (-d).exp() + d - 1.0).collect();
    close(&v, &want, "k3");
    close(
        &g,
        &d.iter().map(|d| 1.0 - (-d).exp()).collect::<Vec<_>>(),
        "k3 grad",
    );
    // Gradients, as torch takes them: k1 1, abs sign(d) (0 at 0), k2 d, low_var_kl k3's inside
    // its clamps and 0 outside (d = −30 and 25 clamp the log-ratio, d = −12 the estimate).
    let (_, g) = value_and_grad(parse("kl"));
    close(&g, &vec![1.0; d.len()], "k1 grad");
    let (_, g) = value_and_grad(parse("abs"));
    let sign: Vec<f64> = d
        .iter()
        .map(|&d| {
            if d > 0.0 {
                1.0
            } else if d < 0.0 {
                -1.0
            } else {
                0.0
            }
        })
        .collect();
    close(&g, &sign, "abs grad");
    let (_, g) = value_and_grad(parse("mse"));
    close(&g, &d, "k2 grad");
    let (_, g) = value_and_grad(parse("low_var_kl"));
    let want: Vec<f64> = d
        .iter()
        .map(|&d| {
            let k3 = (-d).exp() + d - 1.0;
            if d.abs() > 20.0 || k3 > 10.0 {
                0.0
            } else {
                1.0 - (-d).exp()
            }
        })
        .collect();
    close(&g, &want, "low_var_kl grad");
}

#[test]
fn plus_keeps_the_value_and_takes_k2s_gradient() {
    let (logp, reference) = rows();
    let d: Vec<f64> = logp.iter().zip(&reference).map(|(l, r)| l - r).collect();
    for name in ["k1", "abs", "k3", "low_var_kl"] {
        let (v, _) = value_and_grad(parse(name));
        let (v_plus, g_plus) = value_and_grad(parse(&format!("{name}+")));
        close(&v_plus, &v, name);
        close(&g_plus, &d, &format!("{name}+ grad"));
    }
    // k2+ is k2; names round-trip; `full` and unknown names are refused naming the choices.
    assert_eq!(parse("k2+"), parse("mse"));
    for t in [
        "k1",
        "k1+",
        "abs",
        "abs+",
        "k2",
        "k3",
        "k3+",
        "low_var_kl",
        "low_var_kl+",
    ] {
        assert_eq!(parse(t).as_str(), t);
    }
    assert_eq!(parse("KL").estimate, KlEstimate::K1);
    let e = "full".parse::<KlLossType>().unwrap_err();
    assert!(e.contains("full") && e.contains("low_var_kl"), "{e}");
    let e = "k4".parse::<KlLossType>().unwrap_err();
    assert!(e.contains("`k4`") && e.contains("k2's gradient"), "{e}");
}

/// The β term of the loss is β times the token mean of the chosen estimate (dapo: over the
/// batch's tokens), and the `kl` metric is that mean.
#[test]
fn the_loss_adds_beta_times_the_chosen_estimate() {
    let dev = Device::Cpu;
    let (logp, reference) = rows();
    let n = logp.len();
    let lp = Tensor::from_vec(logp, (1, n), &dev).unwrap();
    let r = Tensor::from_vec(reference, (1, n), &dev).unwrap();
    let mask = Tensor::ones((1, n), candle_core::DType::F64, &dev).unwrap();
    let adv = Tensor::new(&[0.5f64], &dev).unwrap();
    let inputs = LossInputs {
        per_token_logps: &lp,
        old_per_token_logps: None,
        ref_per_token_logps: Some(&r),
        sampling_per_token_logps: None,
        entropies: None,
        advantages: &adv,
        completion_mask: &mask,
        num_items_in_batch: None,
        importance_weights: None,
    };
    let loss = |t: &str, beta: f64| {
        let cfg = LossConfig {
            loss_type: LossType::Dapo,
            beta,
            kl_loss_type: parse(t),
            ..Default::default()
        };
        policy_loss(&inputs, &cfg).unwrap()
    };
    let plain = loss("k3", 0.0).loss.to_scalar::<f64>().unwrap();
    for t in ["k1", "abs", "k2", "k3", "low_var_kl"] {
        let (v, _) = value_and_grad(parse(t));
        let mean = v.iter().sum::<f64>() / n as f64;
        let out = loss(t, 0.1);
        let l = out.loss.to_scalar::<f64>().unwrap();
        let tol = 1e-9 * (1.0 + mean.abs());
        assert!((l - plain - 0.1 * mean).abs() < tol, "{t}: {l}");
        assert!(
            (out.metrics.kl - mean).abs() < tol,
            "{t}: {}",
            out.metrics.kl
        );
    }
}
