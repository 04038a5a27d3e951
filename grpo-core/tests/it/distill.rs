//! The on-policy distillation divergence against TRL 1.16's definition (its
//! `ChunkedDivergenceFunction`: forward KL at β = 0, reverse KL at β = 1, the generalized JSD
//! with mixture `(1 − β) p_s + β p_t` between), computed in float64 with Python's `math`;
//! gradients by central finite differences (h = 1e-6):
//! ```python
//! def lsm(z, T): z = [x / T for x in z]; m = max(z); s = log(sum(exp(x - m) for x in z)) + m; return [x - s for x in z]
//! def div(zs, zt, beta, T):
//!     ls, lt = lsm(zs, T), lsm(zt, T); kl = lambda la, lb: sum(exp(a) * (a - b) for a, b in zip(la, lb))
//!     if beta == 0: return kl(lt, ls)
//!     if beta == 1: return kl(ls, lt)
//!     lm = [log((1 - beta) * exp(a) + beta * exp(b)) for a, b in zip(ls, lt)]
//!     return beta * kl(lt, lm) + (1 - beta) * kl(ls, lm)
//! ```
#![allow(clippy::unwrap_used, missing_docs)]

use candle_core::{Device, Tensor, Var};
use grpo_core::distill::{
    Divergence, ReverseTop1, ServedRows, TeacherRows, generalized_jsd, topk_indices,
};

type Case = (f64, f64, [f64; 2], [[f64; 4]; 2]);

#[test]
fn generalized_jsd_matches_trls_definition_and_gradient() {
    let d = Device::Cpu;
    let zs = [[1.0f64, -0.5, 2.0, 0.25], [0.0, 0.3, -1.2, 0.7]];
    let zt = [[0.5f64, 0.5, 1.0, -1.0], [2.0, -0.3, 0.1, 0.0]];
    let cases: [Case; 4] = [
        (
            0.0,
            1.0,
            [0.26227706769212694, 0.6866542310841767],
            [
                [
                    -0.03171112530897524,
                    -0.20772127917734196,
                    0.19004030640812353,
                    0.04939209793941579,
                ],
                [
                    -0.5075656287489849,
                    0.2169903001170148,
                    -0.04341173004407395,
                    0.3339870586205329,
                ],
            ],
        ),
        (
            1.0,
            1.0,
            [0.18136907776095612, 0.7488973969327894],
            [
                [
                    -0.07077097569085922,
                    -0.09162077969915305,
                    0.1155559221782676,
                    0.04683583339215591,
                ],
                [
                    -0.4208376643277667,
                    0.18429278786369352,
                    -0.08155671343823556,
                    0.3181015905129314,
                ],
            ],
        ),
        (
            0.5,
            1.0,
            [0.05119939648467496, 0.16711741524248208],
            [
                [
                    -0.014403783138439152,
                    -0.029728225638125938,
                    0.03327775570383107,
                    0.010854253058856234,
                ],
                [
                    -0.10097505769024462,
                    0.044697554588135624,
                    -0.01455284064089124,
                    0.07083034377075581,
                ],
            ],
        ),
        (
            0.3,
            2.0,
            [0.015969985415682425, 0.03851905743486795],
            [
                [
                    -0.0010876434475282082,
                    -0.013165020100111557,
                    0.008714826454231384,
                    0.005537837048305572,
                ],
                [
                    -0.02354100492318878,
                    0.012849701264833202,
                    -0.0061164302789240566,
                    0.016807733933810187,
                ],
            ],
        ),
    ];
    let teacher = Var::new(&zt, &d).unwrap();
    for (beta, t, want, grad_want) in cases {
        let student = Var::new(&zs, &d).unwrap();
        let div = generalized_jsd(student.as_tensor(), teacher.as_tensor(), beta, t).unwrap();
        let got: Vec<f64> = div.to_vec1().unwrap();
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-12, "beta {beta}: {got:?} vs {want:?}");
        }
        let grads = div.sum_all().unwrap().backward().unwrap();
        let g: Vec<Vec<f64>> = grads.get(student.as_tensor()).unwrap().to_vec2().unwrap();
        for (row, wrow) in g.iter().zip(grad_want) {
            for (a, b) in row.iter().zip(wrow) {
                assert!((a - b).abs() < 1e-7, "beta {beta}: {g:?}");
            }
        }
        // The teacher is detached: no gradient reaches it.
        assert!(grads.get(teacher.as_tensor()).is_none());
    }
    // Equal distributions diverge by 0 (every β); f32 logits give f32 values.
    let z = Tensor::new(&[[0.3f32, -2.0, 1.5]], &d).unwrap();
    for beta in [0.0, 0.4, 1.0] {
        let v: Vec<f32> = generalized_jsd(&z, &z, beta, 1.0)
            .unwrap()
            .to_vec1()
            .unwrap();
        assert!(v[0].abs() < 1e-6, "{v:?}");
    }
    // Bad arguments are errors.
    assert!(generalized_jsd(&z, &z, 1.5, 1.0).is_err());
    assert!(generalized_jsd(&z, &z, 0.5, 0.0).is_err());
    let other = Tensor::new(&[[0.3f32, -2.0]], &d).unwrap();
    assert!(generalized_jsd(&z, &other, 0.5, 1.0).is_err());
}

/// `(k, α, add_tail, T, values, student gradient)` from TRL 1.16's own
/// `compute_topk_self_distillation_loss` (`scripts/check_sdpo_divergence.py`).
type TopKCase = (usize, f64, bool, f64, [f64; 2], [[f64; 5]; 2]);

#[test]
fn topk_divergence_matches_trls_sdpo_loss() {
    use grpo_core::distill::topk_divergence;
    let d = Device::Cpu;
    let zs = [[1.0f64, -0.5, 2.0, 0.25, 0.9], [0.0, 0.3, -1.2, 0.7, 0.1]];
    let zt = [[0.5f64, 0.5, 1.0, -1.0, 0.2], [2.0, -0.3, 0.1, 0.0, -0.4]];
    let cases: [TopKCase; 4] = [
        (
            2,
            1.0,
            false,
            1.0,
            [0.026344585976886298, 0.0012087580798199118],
            [
                [-0.09830596662074087, 0.0, 0.09830596662074087, 0.0, 0.0],
                [0.0, -0.02402607457415293, 0.0, 0.024026074574152883, 0.0],
            ],
        ),
        (
            3,
            0.0,
            true,
            1.0,
            [0.08126697722692704, 0.6890362978777487],
            [
                [
                    -0.02877535473432194,
                    -0.04311871412274542,
                    0.1536549953359858,
                    -0.09128231851416924,
                    0.009521392035250764,
                ],
                [
                    -0.4252957048287205,
                    0.1660137444189853,
                    -0.12809660464553102,
                    0.25730736512612706,
                    0.13007119992913863,
                ],
            ],
        ),
        (
            3,
            0.5,
            false,
            0.7,
            [0.011070070587186166, 0.0016587929708177006],
            [
                [
                    -0.033963259765570894,
                    0.0,
                    0.0462351081516465,
                    0.0,
                    -0.012271848386075602,
                ],
                [
                    0.0,
                    -0.0038945664941475075,
                    0.0,
                    0.01828361261314776,
                    -0.014389046119000251,
                ],
            ],
        ),
        (
            2,
            0.3,
            true,
            1.3,
            [0.0061613307305955585, 0.04831108700705953],
            [
                [
                    -0.0029702526567076813,
                    -0.0027334952164221145,
                    0.018595415090022934,
                    -0.00486712866298896,
                    -0.008024538553904172,
                ],
                [
                    -0.021312602704813128,
                    0.021561542578188906,
                    -0.008467384379105502,
                    0.031235181598030216,
                    -0.02301673709230045,
                ],
            ],
        ),
    ];
    let teacher = Var::new(&zt, &d).unwrap();
    for (k, alpha, tail, t, want, grad_want) in cases {
        let student = Var::new(&zs, &d).unwrap();
        let div =
            topk_divergence(student.as_tensor(), teacher.as_tensor(), k, alpha, tail, t).unwrap();
        let got: Vec<f64> = div.to_vec1().unwrap();
        // The tail bucket's log(1 − e^s) in f64 (TRL: expm1) agrees to ~1e-9 relative.
        for (g, w) in got.iter().zip(want) {
            assert!(
                (g - w).abs() < 1e-9 * w.abs().max(1e-3),
                "k {k} α {alpha}: {got:?} vs {want:?}"
            );
        }
        let grads = div.sum_all().unwrap().backward().unwrap();
        let g: Vec<Vec<f64>> = grads.get(student.as_tensor()).unwrap().to_vec2().unwrap();
        for (row, wrow) in g.iter().zip(grad_want) {
            for (a, b) in row.iter().zip(wrow) {
                assert!((a - b).abs() < 1e-9, "k {k} α {alpha}: {g:?}");
            }
        }
        assert!(grads.get(teacher.as_tensor()).is_none());
        // Through the enum, in f32.
        let div32 = Divergence::TopK {
            k,
            beta: alpha,
            add_tail: tail,
        }
        .of(
            &student
                .as_tensor()
                .to_dtype(candle_core::DType::F32)
                .unwrap(),
            &teacher
                .as_tensor()
                .to_dtype(candle_core::DType::F32)
                .unwrap(),
            t,
        )
        .unwrap();
        let v: Vec<f32> = div32.to_vec1().unwrap();
        for (g, w) in v.iter().zip(want) {
            assert!((f64::from(*g) - w).abs() < 1e-5, "f32: {v:?} vs {want:?}");
        }
    }
    // k = V without a tail is the full divergence.
    let student = Tensor::new(&zs, &d).unwrap();
    let a = topk_divergence(&student, teacher.as_tensor(), 5, 0.4, false, 1.0).unwrap();
    let b = generalized_jsd(&student, teacher.as_tensor(), 0.4, 1.0).unwrap();
    let diff: f64 = (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar()
        .unwrap();
    assert!(diff < 1e-12, "{diff}");
    // The indices: largest first, ties by the lowest index; k outside 1..=V refused.
    let x = Tensor::new(&[[0.5f32, 2.0, 2.0, -1.0], [3.0, 1.0, 0.0, 4.0]], &d).unwrap();
    let idx: Vec<Vec<u32>> = topk_indices(&x, 3).unwrap().to_vec2().unwrap();
    assert_eq!(idx, vec![vec![1, 2, 0], vec![3, 0, 1]]);
    assert!(topk_indices(&x, 0).is_err() && topk_indices(&x, 5).is_err());
    assert!(topk_divergence(&x, &x, 2, 0.5, false, 0.0).is_err());
}

/// IW-OPD's loss `Σ −log π · w · a / N` and the student's logit gradient against TRL 1.16's own
/// `IWOPDTrainer._compute_iw_opd_loss` (`scripts/check_iw_opd.py`): with the rollout's
/// log-probs, and without them (the student's own, detached) at temperature 0.7; also TRL's
/// `iw_opd/*` metrics over the valid tokens.
#[test]
fn iw_opd_matches_trls_loss() {
    use candle_core::D;
    use grpo_core::distill::iw_opd_advantages;
    let d = Device::Cpu;
    let logits = [
        [
            [1.0f64, -0.5, 0.3, 0.2],
            [0.1, 0.4, -1.0, 0.9],
            [0.5, 0.5, -0.2, 0.0],
        ],
        [
            [-0.3, 0.8, 0.1, -0.6],
            [1.2, -0.4, 0.2, 0.3],
            [0.0, 0.0, 0.7, -0.9],
        ],
    ];
    let tokens = Tensor::new(&[[2u32, 3, 0], [1, 0, 3]], &d).unwrap();
    let mask = Tensor::new(&[[1f64, 1.0, 1.0], [1.0, 1.0, 0.0]], &d).unwrap();
    let teacher = Tensor::new(&[[-1.1f64, -0.7, -2.0], [-0.4, -1.9, 0.0]], &d).unwrap();
    let rollout = Tensor::new(&[[-1.3f64, -0.9, -1.2], [-0.8, -1.0, 0.0]], &d).unwrap();
    #[allow(clippy::type_complexity)]
    let cases: [(f64, f64, bool, f64, [[[f64; 4]; 3]; 2], [f64; 5]); 2] = [
        (
            0.5,
            1.0,
            true,
            -0.18571976119411504,
            [
                [
                    [
                        0.027661950683852736,
                        0.0061722154861060296,
                        -0.04626348181619599,
                        0.012429315646237222,
                    ],
                    [
                        0.01154513855235109,
                        0.015584306959576386,
                        0.003843042781365585,
                        -0.030972488293293063,
                    ],
                    [
                        0.14458523115398808,
                        -0.06874810217934527,
                        -0.03413929720581303,
                        -0.04169783176882982,
                    ],
                ],
                [
                    [
                        0.019240608636687688,
                        -0.06219801725361256,
                        0.02870361516186063,
                        0.014253793455064266,
                    ],
                    [
                        0.11970378639687518,
                        -0.02475330169593833,
                        -0.04510345639190751,
                        -0.04984702830902936,
                    ],
                    [0.0, 0.0, 0.0, 0.0],
                ],
            ],
            [
                -0.2189743589743589,
                0.4999999999999999,
                1.419230769230769,
                1.3333333333333333,
                1.5,
            ],
        ),
        (
            1.0,
            0.7,
            false,
            -0.2598369153785279,
            [
                [
                    [
                        0.15522209325304587,
                        0.018210526539851377,
                        -0.22293396317284642,
                        0.04950134337994917,
                    ],
                    [
                        -0.005827827395962991,
                        -0.008946082259866903,
                        -0.0012107205764971232,
                        0.01598463023232702,
                    ],
                    [
                        0.2873509304783921,
                        -0.1547042457769572,
                        -0.05691251148327651,
                        -0.0757341732181584,
                    ],
                ],
                [
                    [
                        0.009509499492264682,
                        -0.032543732580184614,
                        0.01683937370108697,
                        0.006194859386832958,
                    ],
                    [
                        0.29599690617071966,
                        -0.04872617462156002,
                        -0.11481925650505075,
                        -0.13245147504410892,
                    ],
                    [0.0, 0.0, 0.0, 0.0],
                ],
            ],
            [
                -0.6251465100726308,
                0.6135364083514364,
                1.843244217360241,
                1.6284863493731991,
                2.0,
            ],
        ),
    ];
    for (gamma, t, with_rollout, want, grad_want, metrics) in cases {
        let z = Var::new(&logits, &d).unwrap();
        let zt = (z.as_tensor() / t).unwrap();
        let lse = zt
            .exp()
            .unwrap()
            .sum_keepdim(D::Minus1)
            .unwrap()
            .log()
            .unwrap();
        let lp = zt
            .broadcast_sub(&lse)
            .unwrap()
            .gather(&tokens.unsqueeze(2).unwrap(), D::Minus1)
            .unwrap()
            .squeeze(2)
            .unwrap();
        let roll = match with_rollout {
            true => rollout.clone(),
            false => lp.detach(),
        };
        let (adv, w, abs) = iw_opd_advantages(&teacher, &roll, &mask, gamma, 1e-8).unwrap();
        let loss = ((lp.neg().unwrap() * &adv).unwrap() * &mask)
            .unwrap()
            .sum_all()
            .unwrap()
            .affine(1.0 / 5.0, 0.0)
            .unwrap();
        let got: f64 = loss.to_scalar().unwrap();
        assert!((got - want).abs() < 1e-12, "γ {gamma}: {got} vs {want}");
        let g: Vec<Vec<Vec<f64>>> = loss
            .backward()
            .unwrap()
            .get(z.as_tensor())
            .unwrap()
            .to_vec3()
            .unwrap();
        for (row, wrow) in g.iter().flatten().zip(grad_want.iter().flatten()) {
            for (a, b) in row.iter().zip(wrow) {
                assert!((a - b).abs() < 1e-12, "γ {gamma}: {g:?}");
            }
        }
        // TRL's metrics: means, min and max over the 5 valid tokens.
        let valid = |x: &Tensor| -> Vec<f64> {
            let v: Vec<f64> = x.flatten_all().unwrap().to_vec1().unwrap();
            let m: Vec<f64> = mask.flatten_all().unwrap().to_vec1().unwrap();
            v.into_iter()
                .zip(m)
                .filter(|(_, m)| *m > 0.0)
                .map(|(v, _)| v)
                .collect()
        };
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        let (a, b, c) = (valid(&adv), valid(&abs), valid(&w));
        let got = [
            mean(&a),
            mean(&b),
            mean(&c),
            c.iter().copied().fold(f64::INFINITY, f64::min),
            c.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        ];
        for (x, y) in got.iter().zip(metrics) {
            assert!((x - y).abs() < 1e-12, "γ {gamma}: {got:?} vs {metrics:?}");
        }
    }
}

type SparseCase = (Divergence, f64, Option<usize>, [f64; 2], [[f64; 5]; 2]);

fn sparse(k: usize, beta: f64, add_tail: bool, reverse: ReverseTop1) -> Divergence {
    Divergence::Sparse {
        k,
        beta,
        add_tail,
        reverse,
    }
}

/// TRL's `loss_top_k` supports: each case's per-row divergence and student gradient from TRL
/// 1.16's own IWOPDTrainer functions (`scripts/check_sparse_distill.py`): local top-k supports
/// (teacher's, student's, union with a duplicate), the mixed top-1 support (sampled and
/// arg-max; row 0's sampled token is the teacher's top one), and a served teacher (its top k,
/// row 1 given its top token only; its top-1 and the sampled token).
#[test]
fn sparse_divergence_matches_trls_losses() {
    let d = Device::Cpu;
    let zs = [[1.0f64, -0.5, 2.0, 0.25, 0.9], [0.0, 0.3, -1.2, 0.7, 0.1]];
    let zt = [[0.5f64, 0.45, 1.0, -1.0, 0.2], [2.0, -0.3, 0.1, 0.0, -0.4]];
    let tokens = Tensor::new(&[2u32, 3], &d).unwrap();
    let cases: [SparseCase; 11] = [
        (
            sparse(2, 0.0, true, ReverseTop1::Sampled),
            1.0,
            None,
            [0.04777525336200891, 0.7138604271088522],
            [
                [
                    -0.03109205311823244,
                    -0.016556057079875737,
                    0.14983540543263613,
                    -0.03504917311313733,
                    -0.06713812212139063,
                ],
                [
                    -0.5042506134716684,
                    0.16715995781131565,
                    -0.04914169600258289,
                    0.24937335351959344,
                    0.13685899814334213,
                ],
            ],
        ),
        (
            sparse(2, 1.0, false, ReverseTop1::Sampled),
            1.0,
            None,
            [0.026344585976886256, 0.0012087580798199118],
            [
                [
                    -0.09830596662074091,
                    -9.315364868485662e-18,
                    0.09830596662074098,
                    -1.9720627581337273e-17,
                    -3.7775667305829103e-17,
                ],
                [
                    1.9241378135917065e-17,
                    -0.02402607457415293,
                    5.795391723752216e-18,
                    0.024026074574152883,
                    2.1265011539512153e-17,
                ],
            ],
        ),
        (
            sparse(2, 0.5, true, ReverseTop1::Sampled),
            1.0,
            None,
            [0.01197485417817278, 0.16558389924915187],
            [
                [
                    -0.008586050850445382,
                    -0.004026901803350393,
                    0.03746779589781945,
                    -0.008524951184590394,
                    -0.016329892059433276,
                ],
                [
                    -0.09226394625306245,
                    0.031760596101846277,
                    -0.014418616032129357,
                    0.051158721125712764,
                    0.023763245057632734,
                ],
            ],
        ),
        (
            sparse(3, 0.3, false, ReverseTop1::Sampled),
            0.7,
            None,
            [0.05449916579668723, 0.24348775576627046],
            [
                [
                    -0.020845106931299536,
                    -0.02642322462635717,
                    0.05201677514930666,
                    -2.6119815270691516e-19,
                    -0.00474844359164995,
                ],
                [
                    -0.14691041257088627,
                    0.04422142183677776,
                    -0.010394969118822133,
                    0.08131231156360705,
                    0.031771648289323585,
                ],
            ],
        ),
        (
            sparse(1, 1.0, true, ReverseTop1::Sampled),
            1.0,
            None,
            [0.04663015089061337, 0.24964558499884656],
            [
                [
                    -0.05902979497696648,
                    -0.01317132760673951,
                    0.1534971906201349,
                    -0.027883700762278522,
                    -0.053412367274150406,
                ],
                [
                    -0.1009919337706307,
                    -0.13632485129441824,
                    -0.03041818590153442,
                    0.37934831913010636,
                    -0.11161334816352292,
                ],
            ],
        ),
        (
            sparse(1, 0.5, true, ReverseTop1::Sampled),
            1.0,
            None,
            [0.011458058205622144, 0.14187330125470698],
            [
                [
                    -0.014465962827281895,
                    -0.003227792602352642,
                    0.03761633687647926,
                    -0.006833236992802812,
                    -0.01308934445404192,
                ],
                [
                    -0.09061882401680924,
                    0.017703083153006838,
                    0.003950091779051385,
                    0.05447159048308758,
                    0.01449405860166342,
                ],
            ],
        ),
        (
            sparse(1, 0.5, false, ReverseTop1::Argmax),
            0.7,
            None,
            [0.0, 0.273320491916746],
            [
                [0.0, 0.0, 0.0, 0.0, 0.0],
                [-0.20167272027954464, 0.0, 0.0, 0.20167272027954464, 0.0],
            ],
        ),
        (
            sparse(3, 0.0, true, ReverseTop1::Sampled),
            1.0,
            Some(3),
            [0.19927068928725888, 0.6202152203403936],
            [
                [
                    -0.031092053118232453,
                    -0.16647205445970545,
                    0.14983540543263607,
                    0.016370445466011466,
                    0.031358256679290375,
                ],
                [
                    -0.5042506134716684,
                    0.14269821059374088,
                    0.031840274582675764,
                    0.2128807148729578,
                    0.1168314134222939,
                ],
            ],
        ),
        (
            sparse(2, 0.0, false, ReverseTop1::Sampled),
            1.0,
            Some(2),
            [0.02795503773718895, 0.0],
            [
                [
                    -0.10859924742815034,
                    2.3288412171214155e-18,
                    0.10859924742815033,
                    4.930156895334318e-18,
                    9.443916826457276e-18,
                ],
                [0.0, 0.0, 0.0, 0.0, 0.0],
            ],
        ),
        (
            sparse(1, 0.5, true, ReverseTop1::Sampled),
            1.0,
            Some(1),
            [0.011458058205622144, 0.14187330125470698],
            [
                [
                    -0.014465962827281895,
                    -0.003227792602352642,
                    0.03761633687647926,
                    -0.006833236992802812,
                    -0.01308934445404192,
                ],
                [
                    -0.09061882401680924,
                    0.017703083153006838,
                    0.003950091779051385,
                    0.05447159048308758,
                    0.01449405860166342,
                ],
            ],
        ),
        (
            sparse(1, 1.0, false, ReverseTop1::Sampled),
            1.0,
            Some(1),
            [0.0, 0.0],
            [[0.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]],
        ),
    ];
    for (i, (div, temp, served_k, want, want_grad)) in cases.into_iter().enumerate() {
        let z = Var::from_tensor(&Tensor::new(&zs, &d).unwrap()).unwrap();
        let t = Tensor::new(&zt, &d).unwrap();
        let got = match served_k {
            None => div.of_rows(z.as_tensor(), TeacherRows::Logits(&t), Some(&tokens), temp),
            Some(k) => {
                let served = served_rows(&t, &tokens, k);
                div.of_rows(
                    z.as_tensor(),
                    TeacherRows::Served(&served),
                    Some(&tokens),
                    temp,
                )
            }
        }
        .unwrap();
        let grads = got.sum_all().unwrap().backward().unwrap();
        let got = got.to_vec1::<f64>().unwrap();
        let g = grads.get(z.as_tensor()).unwrap().to_vec2::<f64>().unwrap();
        for r in 0..2 {
            assert!(
                (got[r] - want[r]).abs() < 1e-12,
                "case {i} row {r}: {} vs TRL's {}",
                got[r],
                want[r]
            );
            for v in 0..5 {
                let (a, b) = (g[r][v], want_grad[r][v]);
                assert!(
                    (a - b).abs() < 1e-12,
                    "case {i} row {r} grad {v}: {a} vs TRL's {b}"
                );
            }
        }
    }
}

/// The served rows of teacher logits `t` (temperature 1): its top `k` log-probs (row 1 only
/// its top token when `k > 1`, the rest `−inf`, as a server that gave fewer) and the log-prob
/// of each row's token.
fn served_rows(t: &Tensor, tokens: &Tensor, k: usize) -> ServedRows {
    let lse = t.exp().unwrap().sum_keepdim(1).unwrap().log().unwrap();
    let lt = t.broadcast_sub(&lse).unwrap();
    let ids = topk_indices(&lt, k).unwrap();
    let mut top = lt.gather(&ids, 1).unwrap().to_vec2::<f64>().unwrap();
    for x in top[1].iter_mut().skip(1) {
        *x = f64::NEG_INFINITY;
    }
    let actual = lt
        .gather(&tokens.unsqueeze(1).unwrap(), 1)
        .unwrap()
        .squeeze(1)
        .unwrap();
    ServedRows {
        top_ids: ids,
        top_logps: Tensor::new(top.concat(), t.device())
            .unwrap()
            .reshape((2, k))
            .unwrap(),
        actual,
    }
}
