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
use grpo_core::distill::generalized_jsd;

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
    use grpo_core::distill::{Divergence, topk_divergence, topk_indices};
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
