//! SFT and DPO losses against PyTorch (TRL's formulas), values and gradients.
#![allow(clippy::unwrap_used, missing_docs)]

use candle_core::{DType, Device, Tensor, Var};
use grpo_core::preference::{DpoInputs, dpo_loss, sft_loss};

/// Reference values from PyTorch 2.15 (TRL's sigmoid DPO loss with label smoothing):
/// ```python
/// pc = torch.tensor([-12.5, -3.0, -40.25, -7.0], dtype=torch.float64, requires_grad=True)
/// pr = torch.tensor([-11.0, -9.5, -38.0, -7.0], dtype=torch.float64, requires_grad=True)
/// rc = torch.tensor([-12.0, -4.0, -41.0, -6.5], dtype=torch.float64)
/// rr = torch.tensor([-12.0, -8.0, -37.5, -7.25], dtype=torch.float64)
/// for beta, ls in [(0.1, 0.0), (0.5, 0.2)]:
///     pc.grad = None; pr.grad = None
///     logits = (pc - pr) - (rc - rr)
///     losses = -F.logsigmoid(beta * logits) * (1 - ls) - F.logsigmoid(-beta * logits) * ls
///     loss = losses.mean(); loss.backward()
///     cr = beta * (pc - rc).detach(); rj = beta * (pr - rr).detach()
///     print(loss.item(), pc.grad.tolist(), cr.mean().item(), rj.mean().item(),
///           (cr > rj).float().mean().item(), (cr - rj).mean().item())
/// ```
#[test]
fn dpo_matches_pytorch() {
    let dev = Device::Cpu;
    let t = |v: &[f64]| Tensor::new(v, &dev).unwrap();
    let cases = [
        (
            0.1,
            0.0,
            0.677711410953085,
            [
                -0.01343574613359374,
                -0.010945587477855047,
                -0.011719765665656095,
                -0.012968530396963383,
            ],
            0.01875,
            -0.01875,
            0.5,
            0.0375,
        ),
        (
            0.5,
            0.2,
            0.716406007469158,
            [
                -0.05989733739692413,
                -0.002837517353163607,
                -0.01858064191674322,
                -0.04908332499425872,
            ],
            0.09375,
            -0.09375,
            0.5,
            0.1875,
        ),
    ];
    for (beta, ls, loss, grad_c, ch, rj, acc, margin) in cases {
        let pc = Var::from_tensor(&t(&[-12.5, -3.0, -40.25, -7.0])).unwrap();
        let pr = Var::from_tensor(&t(&[-11.0, -9.5, -38.0, -7.0])).unwrap();
        let rc = t(&[-12.0, -4.0, -41.0, -6.5]);
        let rr = t(&[-12.0, -8.0, -37.5, -7.25]);
        let out = dpo_loss(
            &DpoInputs {
                policy_chosen: pc.as_tensor(),
                policy_rejected: pr.as_tensor(),
                reference_chosen: &rc,
                reference_rejected: &rr,
                chosen_tokens: None,
                rejected_tokens: None,
                pair_weights: None,
            },
            beta,
            ls,
        )
        .unwrap();
        let l = out.loss.to_scalar::<f64>().unwrap();
        assert!((l - loss).abs() < 1e-12, "{l} vs {loss}");
        let grads = out.loss.backward().unwrap();
        let gc: Vec<f64> = grads.get(&pc).unwrap().to_vec1().unwrap();
        let gr: Vec<f64> = grads.get(&pr).unwrap().to_vec1().unwrap();
        for i in 0..4 {
            assert!((gc[i] - grad_c[i]).abs() < 1e-12, "{gc:?}");
            assert!((gr[i] + grad_c[i]).abs() < 1e-12, "{gr:?}");
        }
        assert!((out.rewards_chosen - ch).abs() < 1e-12);
        assert!((out.rewards_rejected - rj).abs() < 1e-12);
        assert_eq!(out.rewards_accuracies, acc);
        assert!((out.rewards_margins - margin).abs() < 1e-12);
        assert!((out.logps_chosen - (-62.75 / 4.0)).abs() < 1e-12);
    }
}

/// A DPO run's first step: the policy is the reference, every score difference is exactly 0,
/// and PyTorch's gradient of `−log σ(β·0)` is `−β/2` per pair over the `B` pairs.
#[test]
fn dpo_gradient_at_the_reference_is_half_beta() {
    let dev = Device::Cpu;
    let pc = Var::from_tensor(&Tensor::new(&[-3.0f64, -7.5], &dev).unwrap()).unwrap();
    let pr = Var::from_tensor(&Tensor::new(&[-4.0f64, -1.25], &dev).unwrap()).unwrap();
    let (rc, rr) = (pc.as_tensor().detach(), pr.as_tensor().detach());
    let out = dpo_loss(
        &DpoInputs {
            policy_chosen: pc.as_tensor(),
            policy_rejected: pr.as_tensor(),
            reference_chosen: &rc,
            reference_rejected: &rr,
            chosen_tokens: None,
            rejected_tokens: None,
            pair_weights: None,
        },
        0.1,
        0.0,
    )
    .unwrap();
    assert!((out.loss.to_scalar::<f64>().unwrap() - std::f64::consts::LN_2).abs() < 1e-12);
    let g = out.loss.backward().unwrap();
    let gc: Vec<f64> = g.get(&pc).unwrap().to_vec1().unwrap();
    let gr: Vec<f64> = g.get(&pr).unwrap().to_vec1().unwrap();
    for i in 0..2 {
        assert!((gc[i] + 0.1 / 2.0 / 2.0).abs() < 1e-12, "{gc:?}");
        assert!((gr[i] - 0.1 / 2.0 / 2.0).abs() < 1e-12, "{gr:?}");
    }
}

#[test]
fn dpo_is_stable_for_large_margins() {
    let dev = Device::Cpu;
    let big = Tensor::new(&[1000.0f32, -1000.0], &dev).unwrap();
    let zero = Tensor::zeros(2, DType::F32, &dev).unwrap();
    let out = dpo_loss(
        &DpoInputs {
            policy_chosen: &big,
            policy_rejected: &zero,
            reference_chosen: &zero,
            reference_rejected: &zero,
            chosen_tokens: None,
            rejected_tokens: None,
            pair_weights: None,
        },
        1.0,
        0.0,
    )
    .unwrap();
    // −log σ(1000) ≈ 0 and −log σ(−1000) = 1000: mean 500, finite.
    let l = out.loss.to_scalar::<f32>().unwrap();
    assert!((l - 500.0).abs() < 1e-3, "{l}");
}

#[test]
fn sft_loss_ignores_masked_positions() {
    let dev = Device::Cpu;
    let lp =
        Var::from_tensor(&Tensor::new(&[[-1.0f64, -2.0, -3.0], [-4.0, -5.0, -6.0]], &dev).unwrap())
            .unwrap();
    // Prompt / padding positions masked out.
    let mask = Tensor::new(&[[0f64, 1.0, 1.0], [0.0, 0.0, 1.0]], &dev).unwrap();
    let loss = sft_loss(lp.as_tensor(), &mask, None).unwrap();
    assert!((loss.to_scalar::<f64>().unwrap() - (2.0 + 3.0 + 6.0) / 3.0).abs() < 1e-12);
    let g: Vec<Vec<f64>> = loss
        .backward()
        .unwrap()
        .get(&lp)
        .unwrap()
        .to_vec2()
        .unwrap();
    assert_eq!(
        g,
        vec![
            vec![0.0, -1.0 / 3.0, -1.0 / 3.0],
            vec![0.0, 0.0, -1.0 / 3.0]
        ]
    );
    // With the step's token count (several micro-batches), the sum is divided by it.
    let loss = sft_loss(lp.as_tensor(), &mask, Some(6.0)).unwrap();
    assert!((loss.to_scalar::<f64>().unwrap() - 11.0 / 6.0).abs() < 1e-12);
}

/// TRL's `loss_type = "dft"`: `Σ −log p · stopgrad(p)` over the masked tokens / their count;
/// the gradient of each token is `−p / n`.
#[test]
fn sft_dft_weights_each_token_by_its_detached_probability() {
    use grpo_core::preference::{SftLossType, sft_loss_typed};
    let dev = Device::Cpu;
    let lp = Var::from_tensor(&Tensor::new(&[[-0.5f64, -2.0, -1.0]], &dev).unwrap()).unwrap();
    let mask = Tensor::new(&[[1f64, 1.0, 0.0]], &dev).unwrap();
    let loss = sft_loss_typed(lp.as_tensor(), &mask, None, SftLossType::Dft).unwrap();
    let want = (0.5 * (-0.5f64).exp() + 2.0 * (-2.0f64).exp()) / 2.0;
    assert!((loss.to_scalar::<f64>().unwrap() - want).abs() < 1e-12);
    let g: Vec<Vec<f64>> = loss
        .backward()
        .unwrap()
        .get(&lp)
        .unwrap()
        .to_vec2()
        .unwrap();
    let gw = [-(-0.5f64).exp() / 2.0, -(-2.0f64).exp() / 2.0, 0.0];
    for (a, b) in g[0].iter().zip(gw) {
        assert!((a - b).abs() < 1e-12, "{g:?}");
    }
    assert_eq!("DFT".parse::<SftLossType>(), Ok(SftLossType::Dft));
}

/// TRL 1.16's RLOO loss: PPO's clip on summed sequence log-probs, mean over sequences, and the
/// sequence-level clip ratios; the gradient is −Aρ/N per masked token where the unclipped term
/// is the minimum, 0 where the clipped one is.
#[test]
fn rloo_loss_clips_whole_sequences() {
    use candle_core::{Device, Tensor, Var};
    let d = Device::Cpu;
    let lp = [[-1.0f64, -0.5, -2.0], [-0.3, -0.2, -9.0]];
    let old = [[-1.1f64, -0.5, -7.0], [-0.2, -0.1, 0.0]];
    let mask = [[1f64, 1.0, 0.0], [1.0, 1.0, 0.0]];
    let adv = [1.5f64, -0.5];
    let (el, eh) = (0.2, 0.28);
    let grad_of = |loss: &Tensor, v: &Var| -> Vec<Vec<f64>> {
        loss.backward()
            .unwrap()
            .get(v.as_tensor())
            .unwrap()
            .to_vec2()
            .unwrap()
    };
    let loss_of = |v: &Var| {
        grpo_core::loss::rloo_loss(
            v.as_tensor(),
            Some(&Tensor::new(&old, &d).unwrap()),
            &Tensor::new(&mask, &d).unwrap(),
            &Tensor::new(&adv, &d).unwrap(),
            el,
            eh,
            None,
        )
        .unwrap()
    };
    let v = Var::from_tensor(&Tensor::new(&lp, &d).unwrap()).unwrap();
    let (loss, metrics) = loss_of(&v);
    // By hand: sequence 0: Σ lp − Σ old = 0.1, ρ = e^0.1 = 1.105 (inside the clip), term −1.5ρ;
    // sequence 1: −0.2, ρ = e^−0.2 = 0.819 (inside [0.8, 1.28]): −(−0.5ρ).
    let rho = [0.1f64.exp(), (-0.2f64).exp()];
    let want = -(rho[0] * adv[0] + rho[1] * adv[1]) / 2.0;
    let got = loss.to_scalar::<f64>().unwrap();
    assert!((got - want).abs() < 1e-12, "{got} vs {want}");
    let g = grad_of(&loss, &v);
    for s in 0..2 {
        for t in 0..3 {
            let want = -adv[s] * rho[s] / 2.0 * mask[s][t];
            assert!(
                (g[s][t] - want).abs() < 1e-12,
                "grad [{s}][{t}]: {} vs {want}",
                g[s][t]
            );
        }
    }
    assert_eq!(metrics.read().unwrap().clip_ratio_region_mean, 0.0);
    // A sequence far above the clip with A > 0: the clipped term is the minimum, no gradient,
    // counted in the high clip ratio.
    let far = [[-0.1f64, -0.1, 0.0], [-0.3, -0.2, 0.0]];
    let v = Var::from_tensor(&Tensor::new(&far, &d).unwrap()).unwrap();
    let (loss, metrics) = loss_of(&v);
    let rho1 = (-0.2f64).exp();
    let want = -((1.0 + eh) * adv[0] + rho1 * adv[1]) / 2.0;
    assert!((loss.to_scalar::<f64>().unwrap() - want).abs() < 1e-12);
    let g = grad_of(&loss, &v);
    assert!(g[0].iter().all(|x| *x == 0.0), "{g:?}");
    let m = metrics.read().unwrap();
    assert_eq!(
        (
            m.clip_ratio_high_mean,
            m.clip_ratio_low_mean,
            m.clip_ratio_region_mean
        ),
        (0.5, 0.0, 0.5)
    );
    // Sequence-level importance weights multiply each sequence's term (and its gradient).
    let v = Var::from_tensor(&Tensor::new(&lp, &d).unwrap()).unwrap();
    let w = [0.5f64, 2.0];
    let (loss, _) = grpo_core::loss::rloo_loss(
        v.as_tensor(),
        Some(&Tensor::new(&old, &d).unwrap()),
        &Tensor::new(&mask, &d).unwrap(),
        &Tensor::new(&adv, &d).unwrap(),
        el,
        eh,
        Some(&Tensor::new(&[[w[0]], [w[1]]], &d).unwrap()),
    )
    .unwrap();
    let want = -(w[0] * rho[0] * adv[0] + w[1] * rho[1] * adv[1]) / 2.0;
    assert!((loss.to_scalar::<f64>().unwrap() - want).abs() < 1e-12);
    let g = grad_of(&loss, &v);
    assert!(
        (g[1][0] - (-adv[1] * rho[1] * w[1] / 2.0)).abs() < 1e-12,
        "{g:?}"
    );
    // Token-level weights do not fit a sequence loss.
    let token_w = Tensor::ones((2, 3), candle_core::DType::F64, &d).unwrap();
    assert!(
        grpo_core::loss::rloo_loss(
            v.as_tensor(),
            None,
            &Tensor::new(&mask, &d).unwrap(),
            &Tensor::new(&adv, &d).unwrap(),
            el,
            eh,
            Some(&token_w),
        )
        .is_err()
    );
}

/// TRL's RLOO advantages: leave-one-out over scorable siblings, batch normalisation with
/// Bessel's correction, unscorable and lone completions 0.
#[test]
fn rloo_advantages_follow_trl() {
    use grpo_core::advantages::rloo_advantages;
    let r = [
        1.0f32,
        0.0,
        0.5,
        f32::NAN,
        2.0,
        f32::NAN,
        f32::NAN,
        f32::NAN,
    ];
    let a = rloo_advantages(&r, 4, false);
    assert_eq!(a, vec![0.75, -0.75, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
    let n = rloo_advantages(&r, 4, true);
    // The scorable advantages [0.75, −0.75, 0]: mean 0, Bessel std 0.75.
    let s = 0.75f64 + 1e-4;
    for (x, want) in n
        .iter()
        .zip([0.75 / s, -0.75 / s, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    {
        assert!((f64::from(*x) - want).abs() < 1e-6, "{n:?}");
    }
    assert_eq!(rloo_advantages(&[3.0, 1.0], 1, true), vec![0.0, 0.0]);
}

/// TRL 1.16's `RewardTrainer.compute_loss`, computed in float64 with Python's `math`
/// (`-logsigmoid(c - r - m).mean() + coef * ((c + r) ** 2).mean()`, gradients by hand:
/// ∂/∂c_i = (−σ(−d_i) + 2·coef·(c_i + r_i)) / n):
/// the third pair ties (accuracy counts it as wrong, as TRL's strict `>` does).
#[test]
fn reward_loss_matches_trl() {
    use grpo_core::preference::reward_loss;
    let dev = Device::Cpu;
    let c = [1.25, -0.5, 2.0, 0.3, -1.75];
    let r = [0.5, 0.25, 2.0, -1.2, -1.0];
    let m = Tensor::new(&[0.0, 1.0, 0.5, -0.25, 2.0], &dev).unwrap();
    // (margins, centring coefficient, loss, ∂/∂chosen, ∂/∂rejected)
    type Case<'a> = (Option<&'a Tensor>, Option<f64>, f64, [f64; 5], [f64; 5]);
    let cases: [Case<'_>; 3] = [
        (
            None,
            None,
            0.7110346953774795,
            [
                -0.06416426016492141,
                -0.1358357398350786,
                -0.1,
                -0.03648510476127127,
                -0.1358357398350786,
            ],
            [
                0.06416426016492141,
                0.1358357398350786,
                0.1,
                0.03648510476127127,
                0.1358357398350786,
            ],
        ),
        (
            Some(&m),
            None,
            1.248672776034876,
            [
                -0.06416426016492141,
                -0.17039056039366213,
                -0.12449186624037092,
                -0.029609439606337894,
                -0.18798266996519847,
            ],
            [
                0.06416426016492141,
                0.17039056039366213,
                0.12449186624037092,
                0.029609439606337894,
                0.18798266996519847,
            ],
        ),
        (
            Some(&m),
            Some(0.01),
            1.3036677760348758,
            [
                -0.05716426016492141,
                -0.17139056039366213,
                -0.10849186624037092,
                -0.0332094396063379,
                -0.19898266996519848,
            ],
            [
                0.07116426016492142,
                0.16939056039366213,
                0.1404918662403709,
                0.026009439606337895,
                0.17698266996519846,
            ],
        ),
    ];
    for (margin, coef, want, gc_want, gr_want) in cases {
        let cv = Var::new(&c, &dev).unwrap();
        let rv = Var::new(&r, &dev).unwrap();
        let out = reward_loss(cv.as_tensor(), rv.as_tensor(), margin, coef).unwrap();
        let loss = out.loss.to_scalar::<f64>().unwrap();
        assert!((loss - want).abs() < 1e-12, "{loss} vs {want}");
        let g = out.loss.backward().unwrap();
        let gc: Vec<f64> = g.get(cv.as_tensor()).unwrap().to_vec1().unwrap();
        let gr: Vec<f64> = g.get(rv.as_tensor()).unwrap().to_vec1().unwrap();
        for (a, b) in gc.iter().zip(gc_want).chain(gr.iter().zip(gr_want)) {
            assert!((a - b).abs() < 1e-12, "{gc:?} {gr:?}");
        }
        assert_eq!(out.accuracy, 0.4);
        assert!((out.margin - (0.75 - 0.75 + 0.0 + 1.5 - 0.75) / 5.0).abs() < 1e-12);
        assert_eq!((out.min_reward, out.max_reward), (-1.75, 2.0));
        assert!(
            (out.mean_reward - (c.iter().sum::<f64>() + r.iter().sum::<f64>()) / 10.0).abs()
                < 1e-12
        );
    }
    // Bad shapes are one-line errors.
    let a = Tensor::new(&[1.0f64, 2.0], &dev).unwrap();
    let b = Tensor::new(&[1.0f64], &dev).unwrap();
    assert!(reward_loss(&a, &b, None, None).is_err());
    assert!(reward_loss(&a, &a, Some(&b), None).is_err());
}
