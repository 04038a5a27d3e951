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
