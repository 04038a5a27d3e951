//! Each fused kernel against the plain composition of candle ops it replaces: the same values
#![allow(clippy::unwrap_used, missing_docs)]
//! and the same gradients (f64 to 1e-12, f32 to 1e-5), on shapes that are not multiples of
//! anything, with masked attention rows, and on enough rows to split across threads.

use candle_core::{DType, Device, Tensor, Var};
use grpo_rollout::fused;

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

fn tol(dtype: DType) -> f64 {
    if dtype == DType::F64 { 1e-12 } else { 2e-5 }
}

/// Runs `f` on fresh Vars made from `inputs`, backpropagates `Σ out · r` with a fixed random
/// `r`, and returns the output, the gradient of each input and the number of graph nodes.
fn run(
    inputs: &[Tensor],
    r: &Tensor,
    f: &dyn Fn(&[Tensor]) -> Tensor,
) -> (Tensor, Vec<Tensor>, usize) {
    let vars: Vec<Var> = inputs
        .iter()
        .map(|t| Var::from_tensor(t).unwrap())
        .collect();
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let out = f(&ts);
    let loss = (&out * r).unwrap().sum_all().unwrap();
    let nodes = loss.sorted_nodes().len();
    let grads = loss.backward().unwrap();
    let g = vars
        .iter()
        .map(|v| {
            grads
                .get(v.as_tensor())
                .expect("every input gets a gradient")
                .clone()
        })
        .collect();
    (out, g, nodes)
}

/// [`check_nodes`] for a kernel that replaces a composition of several ops (its graph must be
/// smaller, which proves the kernel ran).
fn check(
    name: &str,
    inputs: &[Tensor],
    fused_f: &dyn Fn(&[Tensor]) -> Tensor,
    plain_f: &dyn Fn(&[Tensor]) -> Tensor,
    grad_inputs: usize,
) {
    check_nodes(name, inputs, fused_f, plain_f, grad_inputs, true);
}

fn check_nodes(
    name: &str,
    inputs: &[Tensor],
    fused_f: &dyn Fn(&[Tensor]) -> Tensor,
    plain_f: &dyn Fn(&[Tensor]) -> Tensor,
    grad_inputs: usize,
    fewer_nodes: bool,
) {
    let dtype = inputs[0].dtype();
    let probe = fused_f(inputs);
    let r = Tensor::randn(0f64, 1.0, probe.shape(), &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    // The kernel path must be the one under test: GRPO_FUSED=0 would compare the composition
    // with itself.
    assert_eq!(
        grpo_core::fused::path(&inputs[0]),
        grpo_core::fused::Path::Kernel,
        "{name}: the fused kernel is off (GRPO_FUSED set?)"
    );
    let (a, ga, fused_nodes) = run(inputs, &r, fused_f);
    let (b, gb, plain_nodes) = run(inputs, &r, plain_f);
    assert!(
        fused_nodes < plain_nodes || (!fewer_nodes && fused_nodes == plain_nodes),
        "{name}: the fused graph has {fused_nodes} nodes, the composition {plain_nodes}: no kernel ran"
    );
    assert_eq!(a.dims(), b.dims(), "{name}: shapes");
    let d = max_diff(&a, &b);
    assert!(d < tol(dtype), "{name} {dtype:?}: forward differs by {d}");
    for i in 0..grad_inputs {
        let d = max_diff(&ga[i], &gb[i]);
        let size = max_diff(&gb[i], &gb[i].zeros_like().unwrap());
        assert!(size > 0.0, "{name}: the gradient of input {i} is zero");
        let scale = size.max(1.0);
        assert!(
            d / scale < tol(dtype),
            "{name} {dtype:?}: gradient of input {i} differs by {d} (scale {scale})"
        );
    }
}

fn randn(shape: &[usize], dtype: DType) -> Tensor {
    Tensor::randn(0f64, 1.0, shape, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

#[test]
fn rms_norm_matches_composition() {
    for dtype in [DType::F64, DType::F32] {
        // 700 rows: more than one reduction block and one rayon task.
        for shape in [vec![3usize, 5, 16], vec![700, 24], vec![2, 3, 4, 10]] {
            let h = *shape.last().unwrap();
            let x = randn(&shape, dtype);
            let w = (randn(&[h], dtype) + 1.0).unwrap();
            check(
                "rms_norm",
                &[x, w],
                &|t| fused::rms_norm(&t[0], &t[1], 1e-6).unwrap(),
                &|t| fused::rms_norm_composed(&t[0], &t[1], 1e-6).unwrap(),
                2,
            );
        }
    }
}

#[test]
fn rope_matches_composition() {
    for dtype in [DType::F64, DType::F32] {
        for (b, l, h, d) in [
            (2usize, 5usize, 3usize, 8usize),
            (3, 1, 4, 6),
            (2, 37, 2, 16),
        ] {
            let x = randn(&[b, l, h, d], dtype);
            let angles = (randn(&[b, l, d / 2], dtype) * 3.0).unwrap();
            let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
            let (c1, s1, c2, s2) = (cos.clone(), sin.clone(), cos.clone(), sin.clone());
            check(
                "rope",
                &[x],
                &move |t| fused::rope(&t[0], &c1, &s1).unwrap(),
                &move |t| fused::rope_composed(&t[0], &c2, &s2).unwrap(),
                1,
            );
        }
    }
}

#[test]
fn rope_output_is_head_major_and_norm_preserving() {
    let x = randn(&[2, 4, 3, 8], DType::F64);
    let angles = randn(&[2, 4, 4], DType::F64);
    let y = fused::rope(&x, &angles.cos().unwrap(), &angles.sin().unwrap()).unwrap();
    assert_eq!(y.dims(), &[2, 3, 4, 8]);
    // A rotation keeps each (i, i + D/2) pair's norm, so each row's norm.
    let nx = x.sqr().unwrap().sum(3).unwrap().transpose(1, 2).unwrap();
    let ny = y.sqr().unwrap().sum(3).unwrap();
    assert!(max_diff(&nx, &ny) < 1e-12);
}

#[test]
fn silu_mul_matches_composition() {
    for dtype in [DType::F64, DType::F32] {
        for shape in [vec![4usize, 33], vec![3, 7000]] {
            let a = (randn(&shape, dtype) * 3.0).unwrap();
            let u = randn(&shape, dtype);
            check(
                "silu_mul",
                &[a, u],
                &|t| fused::silu_mul(&t[0], &t[1]).unwrap(),
                &|t| fused::silu_mul_composed(&t[0], &t[1]).unwrap(),
                2,
            );
        }
    }
}

/// A `(B, 1, L, S)` causal mask over `S - L` earlier keys, with batch row 1's first query
/// fully masked (padding) and its first `pad_keys` keys masked.
fn causal_bias(b: usize, l: usize, s: usize, pad_keys: usize, dtype: DType) -> Tensor {
    let mut bias = vec![0f64; b * l * s];
    for bi in 0..b {
        for i in 0..l {
            for j in 0..s {
                if j > i + (s - l) || (bi == 1 && (i == 0 || j < pad_keys)) {
                    bias[(bi * l + i) * s + j] = -1e9;
                }
            }
        }
    }
    Tensor::from_vec(bias, (b, 1, l, s), &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

#[test]
fn attention_softmax_matches_composition_with_masked_rows() {
    for dtype in [DType::F64, DType::F32] {
        let (b, h, l, s) = (2usize, 3usize, 5usize, 7usize);
        let scores = (randn(&[b, h, l, s], dtype) * 4.0).unwrap();
        // Causal + padding: row 0 of batch 1 is padding (all masked), key 0 of batch 1 too.
        let bias = causal_bias(b, l, s, 1, dtype);
        let (m1, m2) = (bias.clone(), bias.clone());
        check(
            "attention_softmax",
            std::slice::from_ref(&scores),
            &move |t| fused::attention_softmax(&t[0], &m1, 0.125).unwrap(),
            &move |t| fused::attention_softmax_composed(&t[0], &m2, 0.125).unwrap(),
            1,
        );
        let p = fused::attention_softmax(&scores, &bias, 0.125).unwrap();
        let finite = p
            .to_dtype(DType::F64)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f64>()
            .unwrap();
        assert!(
            finite.iter().all(|v| v.is_finite()),
            "fully masked rows stay finite"
        );
        let sums = p.sum(3).unwrap();
        assert!(max_diff(&sums, &sums.ones_like().unwrap()) < tol(dtype) * 10.0);
    }
}

#[test]
fn half_precision_runs_the_recompute_path() {
    let x = randn(&[3, 8], DType::F32);
    let w = randn(&[8], DType::F32);
    let a = fused::rms_norm(&x, &w, 1e-5).unwrap();
    let xb = x.to_dtype(DType::BF16).unwrap();
    let wb = w.to_dtype(DType::BF16).unwrap();
    assert_eq!(
        grpo_core::fused::path(&xb),
        grpo_core::fused::Path::Recompute
    );
    let b = fused::rms_norm(&xb, &wb, 1e-5).unwrap();
    assert_eq!(b.dtype(), DType::BF16);
    assert!(max_diff(&a, &b.to_dtype(DType::F32).unwrap()) < 0.05);
}

/// The fused attention (one node, probabilities recomputed in backward) against the
/// composition: grouped heads (3 query heads per kv head), more keys than queries (a cached
/// or shared prefix), a fully masked row, padding keys, k and v as strided views of a larger
/// buffer (as a KV cache hands them over), and enough batch rows to split across threads.
#[test]
fn attention_matches_composition_with_gqa_prefix_and_strided_kv() {
    for dtype in [DType::F64, DType::F32] {
        let (b, nh, nkv, l, s, d) = (5usize, 6usize, 2usize, 4usize, 9usize, 8usize);
        let bias = causal_bias(b, l, s, 2, dtype);
        let q = randn(&[b, nh, l, d], dtype);
        // k and v as the first s positions of (B, G, s + 3, D) buffers: strided views.
        let kbuf = randn(&[b, nkv, s + 3, d], dtype);
        let vbuf = randn(&[b, nkv, s + 3, d], dtype);
        let (m1, m2) = (bias.clone(), bias.clone());
        let fused_f = move |t: &[Tensor]| {
            let (k, v) = (t[1].narrow(2, 0, s).unwrap(), t[2].narrow(2, 0, s).unwrap());
            assert!(!k.is_contiguous());
            fused::attention(&t[0], &k, &v, &m1, 0.3).unwrap()
        };
        let plain_f = move |t: &[Tensor]| {
            let (k, v) = (t[1].narrow(2, 0, s).unwrap(), t[2].narrow(2, 0, s).unwrap());
            fused::attention_composed(
                &t[0],
                &k.contiguous().unwrap(),
                &v.contiguous().unwrap(),
                &m2,
                0.3,
            )
            .unwrap()
        };
        check("attention", &[q.clone(), kbuf, vbuf], &fused_f, &plain_f, 3);
        // Contiguous k = v (one tensor read twice) and a single kv head.
        let kv = randn(&[b, 1, s, d], dtype);
        let (m1, m2) = (bias.clone(), bias.clone());
        check(
            "attention (k = v, one kv head)",
            &[q, kv],
            &move |t| fused::attention(&t[0], &t[1], &t[1], &m1, 0.5).unwrap(),
            &move |t| fused::attention_composed(&t[0], &t[1], &t[1], &m2, 0.5).unwrap(),
            2,
        );
    }
    // One query per row (a decode step, its own kernel) over strided cached keys, one key
    // of row 1 masked.
    for dtype in [DType::F64, DType::F32] {
        let (b, nh, nkv, s, d) = (3usize, 4usize, 2usize, 6usize, 8usize);
        let mut bias = vec![0f64; b * s];
        bias[s] = -1e9;
        let bias = Tensor::from_vec(bias, (b, 1, 1, s), &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let q = randn(&[b, nh, 1, d], dtype);
        let kbuf = randn(&[b, nkv, s + 2, d], dtype);
        let vbuf = randn(&[b, nkv, s + 2, d], dtype);
        let (k, v) = (kbuf.narrow(2, 0, s).unwrap(), vbuf.narrow(2, 0, s).unwrap());
        let a = fused::attention(&q, &k, &v, &bias, 0.35).unwrap();
        let c = fused::attention_composed(
            &q,
            &k.contiguous().unwrap(),
            &v.contiguous().unwrap(),
            &bias,
            0.35,
        )
        .unwrap();
        assert_eq!(a.dims(), &[b, nh * d]);
        let diff = max_diff(&a, &c);
        assert!(diff < tol(dtype), "decode attention {dtype:?}: {diff}");
    }
    // Shapes that do not fit are errors that say so.
    let q = randn(&[2, 3, 4, 8], DType::F32);
    let k = randn(&[2, 2, 5, 8], DType::F32);
    let bias = Tensor::zeros((2, 1, 4, 5), DType::F32, &Device::Cpu).unwrap();
    let e = fused::attention(&q, &k, &k, &bias, 1.0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("G dividing H"), "{e}");
}

/// A frozen weight's linear map: the same values and input gradient as `x · wᵀ`, and no
/// gradient formed for the weight; a trainable weight still gets its gradient.
#[test]
fn frozen_linear_gives_the_input_gradient_only() {
    for dtype in [DType::F64, DType::F32] {
        let w = randn(&[7, 5], dtype);
        let x = randn(&[300, 5], dtype);
        let (w1, w2) = (w.clone(), w.clone());
        // One node either way: what the kernel saves is the weight's gradient (checked below).
        check_nodes(
            "frozen_linear",
            std::slice::from_ref(&x),
            &move |t| fused::frozen_linear(&t[0], &w1).unwrap(),
            &move |t| t[0].matmul(&w2.t().unwrap()).unwrap(),
            1,
            false,
        );
        // The weight as a strided view (a transpose of a stored transpose) works too.
        let wt = w.t().unwrap().contiguous().unwrap().t().unwrap();
        let xv = Var::from_tensor(&x).unwrap();
        let y = fused::frozen_linear(xv.as_tensor(), &wt).unwrap();
        let y2 = x.matmul(&w.t().unwrap()).unwrap();
        assert!(max_diff(&y, &y2) < tol(dtype));
        let grads = y.sum_all().unwrap().backward().unwrap();
        assert!(grads.get(&wt).is_none() && grads.get(&w).is_none());
        assert!(grads.get(xv.as_tensor()).is_some());
        // A trainable weight is not frozen: both gradients.
        let wv = Var::from_tensor(&w).unwrap();
        let y = fused::frozen_linear(xv.as_tensor(), wv.as_tensor()).unwrap();
        let grads = y.sum_all().unwrap().backward().unwrap();
        assert!(grads.get(wv.as_tensor()).is_some());
    }
}

#[test]
fn add_rms_norm_matches_composition_and_the_norm_kernel() {
    // 700 rows split across threads; hidden 37 (no multiple of anything).
    for dtype in [DType::F32, DType::F64] {
        let x = randn(&[700, 37], dtype);
        let r = randn(&[700, 37], dtype);
        let w = randn(&[37], dtype);
        let (s0, y0) = fused::add_rms_norm_composed(&x, &r, &w, 1e-6).unwrap();
        let (s1, y1) = fused::add_rms_norm(&x, &r, &w, 1e-6).unwrap();
        assert!(max_diff(&s0, &s1) <= tol(dtype), "{dtype:?} sum");
        assert!(max_diff(&y0, &y1) <= tol(dtype), "{dtype:?} normed");
        // The kernel's normalisation is the RMSNorm kernel's, bit for bit.
        let y2 = fused::rms_norm(&s1, &w, 1e-6).unwrap();
        assert_eq!(
            max_diff(&y1, &y2),
            0.0,
            "{dtype:?}: not the RMSNorm kernel's arithmetic"
        );
    }
    // Inputs in a graph take the differentiable add and norm: gradients reach both.
    let (x, r, w) = (
        randn(&[5, 8], DType::F32),
        randn(&[5, 8], DType::F32),
        randn(&[8], DType::F32),
    );
    let (xv, rv) = (Var::from_tensor(&x).unwrap(), Var::from_tensor(&r).unwrap());
    let (_, y) = fused::add_rms_norm(&xv, &rv, &w, 1e-6).unwrap();
    let g = y.sum_all().unwrap().backward().unwrap();
    assert!(g.get(xv.as_tensor()).is_some() && g.get(rv.as_tensor()).is_some());
}

#[test]
fn kv_writes_match_composition_and_touch_only_their_positions() {
    let (b, l, g, d, cap, past) = (3, 4, 2, 12, 11, 5);
    for dtype in [DType::F32, DType::F64, DType::BF16] {
        let x = randn(&[b, l, g, d], DType::F32).to_dtype(dtype).unwrap();
        let ang = randn(&[b, l, d / 2], DType::F32);
        let (c, s) = (
            ang.cos().unwrap().to_dtype(dtype).unwrap(),
            ang.sin().unwrap().to_dtype(dtype).unwrap(),
        );
        for rot in [Some((&c, &s)), None] {
            let before = randn(&[b, g, cap, d], DType::F32).to_dtype(dtype).unwrap();
            let want = before.copy().unwrap();
            fused::kv_write_composed(&want, &x, rot, past).unwrap();
            let got = before.copy().unwrap();
            fused::kv_write(&got, &x, rot, past).unwrap();
            let t = if dtype == DType::F64 { 1e-12 } else { 1e-6 };
            assert!(
                max_diff(&want, &got) <= t,
                "{dtype:?} rotate {}",
                rot.is_some()
            );
            // Positions before `past` and after `past + l` are as they were.
            for (from, len) in [(0, past), (past + l, cap - past - l)] {
                let kept = got.narrow(2, from, len).unwrap();
                let was = before.narrow(2, from, len).unwrap();
                assert_eq!(
                    max_diff(&kept, &was),
                    0.0,
                    "{dtype:?}: wrote outside its rows"
                );
            }
        }
    }
    // A write past the capacity is refused in one line.
    let cache = Tensor::zeros((1, 1, 4, 2), DType::F32, &Device::Cpu).unwrap();
    let x = Tensor::ones((1, 2, 1, 2), DType::F32, &Device::Cpu).unwrap();
    let err = fused::kv_write(&cache, &x, None, 3)
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("kv_write: [1, 2, 1, 2] at position 3"),
        "{err}"
    );
}

/// candle's CUDA matmul refuses an operand whose rows are not packed (the last position of
/// each sequence, taken from `(B, L, H)`); `fused::matmul` copies exactly those, and the rule
/// it uses is candle's `gemm_config` rule.
#[test]
fn matmul_operands_follow_the_cublas_layout_rule() -> candle_core::Result<()> {
    use grpo_rollout::fused::{cublas_layout_ok, matmul};
    let dev = Device::Cpu;
    let h = Tensor::randn(0f32, 1.0, (3, 5, 8), &dev)?;
    let w = Tensor::randn(0f32, 1.0, (6, 8), &dev)?;
    let last = h.narrow(1, 4, 1)?.squeeze(1)?; // (3, 8), rows 40 apart
    assert!(!cublas_layout_ok(last.dims(), last.stride()));
    assert!(cublas_layout_ok(w.dims(), w.stride()));
    assert!(cublas_layout_ok(w.t()?.dims(), w.t()?.stride()));
    // A column block of a packed projection: rows 8 wide inside rows of 16.
    let packed = Tensor::randn(0f32, 1.0, (4, 16), &dev)?;
    let cols = packed.narrow(1, 8, 8)?;
    assert!(!cublas_layout_ok(cols.dims(), cols.stride()));
    // A single row takes any row stride; a batch of matrices one stride apart is fine, a
    // batch axis pair that no one stride walks is not.
    assert!(cublas_layout_ok(&[1, 8], &[40, 1]));
    assert!(cublas_layout_ok(&[2, 3, 4, 5], &[60, 20, 5, 1]));
    assert!(!cublas_layout_ok(&[2, 3, 4, 5], &[100, 20, 5, 1]));
    assert!(!cublas_layout_ok(&[2, 2, 3, 4, 5], &[120, 60, 20, 5, 1]));
    // Same values as candle's matmul (which takes the strided view on the CPU).
    let want = last.matmul(&w.t()?)?.flatten_all()?.to_vec1::<f32>()?;
    let got = matmul(&last, &w.t()?)?.flatten_all()?.to_vec1::<f32>()?;
    assert_eq!(want, got);
    let got = grpo_rollout::fused::frozen_linear(&last, &w)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    assert_eq!(want, got);
    Ok(())
}

/// gpt-oss's attention with a learned sink per head: the recomputed node against the
/// composition (values and the gradients of q, k, v and the sinks; grouped heads, a cached
/// prefix, a fully masked row), the composition against the definition written out row by row
/// (`exp(z_j) / (Σ exp(z) + exp(s_h))`), a sink far below every score giving plain attention,
/// and the sinks' gradient against central differences.
#[test]
fn sink_attention_matches_its_definition() {
    let (b, nh, nkv, l, s, d) = (3usize, 4usize, 2usize, 3usize, 5usize, 4usize);
    for dtype in [DType::F64, DType::F32] {
        let bias = causal_bias(b, l, s, 2, dtype);
        let inputs = [
            randn(&[b, nh, l, d], dtype),
            randn(&[b, nkv, s, d], dtype),
            randn(&[b, nkv, s, d], dtype),
            randn(&[nh], dtype),
        ];
        let (m1, m2) = (bias.clone(), bias.clone());
        check(
            "sink attention",
            &inputs,
            &move |t| fused::sink_attention(&t[0], &t[1], &t[2], &m1, 0.4, &t[3]).unwrap(),
            &move |t| fused::sink_attention_composed(&t[0], &t[1], &t[2], &m2, 0.4, &t[3]).unwrap(),
            4,
        );
    }
    // The definition, in f64 on the host.
    let bias = causal_bias(b, l, s, 2, DType::F64);
    let (q, k, v, sinks) = (
        randn(&[b, nh, l, d], DType::F64),
        randn(&[b, nkv, s, d], DType::F64),
        randn(&[b, nkv, s, d], DType::F64),
        randn(&[nh], DType::F64),
    );
    let out = fused::sink_attention(&q, &k, &v, &bias, 0.4, &sinks).unwrap();
    assert_eq!(out.dims(), &[b * l, nh * d]);
    let o: Vec<Vec<f64>> = out.to_vec2().unwrap();
    let q4 = |t: &Tensor, i: usize, h: usize, r: usize| -> Vec<f64> {
        t.get(i)
            .unwrap()
            .get(h)
            .unwrap()
            .get(r)
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    let sv: Vec<f64> = sinks.to_vec1().unwrap();
    let bv: Vec<f64> = bias.flatten_all().unwrap().to_vec1().unwrap();
    let mut worst = 0f64;
    for i in 0..b {
        for h in 0..nh {
            let g = h / (nh / nkv);
            for r in 0..l {
                let qr = q4(&q, i, h, r);
                let z: Vec<f64> = (0..s)
                    .map(|j| {
                        let kj = q4(&k, i, g, j);
                        0.4 * qr.iter().zip(&kj).map(|(a, c)| a * c).sum::<f64>()
                            + bv[(i * l + r) * s + j]
                    })
                    .collect();
                let m = z.iter().copied().fold(sv[h], f64::max);
                let den = z.iter().map(|x| (x - m).exp()).sum::<f64>() + (sv[h] - m).exp();
                for c in 0..d {
                    let want: f64 = (0..s)
                        .map(|j| (z[j] - m).exp() / den * q4(&v, i, g, j)[c])
                        .sum();
                    worst = worst.max((o[i * l + r][h * d + c] - want).abs());
                }
            }
        }
    }
    assert!(worst < 1e-12, "sink attention vs its definition: {worst}");
    // A sink far below every score: plain attention (on the rows with a visible key; the
    // fully masked row `l` — batch 1's first — gives the sink all its weight instead).
    let low = Tensor::full(-1e4f64, nh, &Device::Cpu).unwrap();
    let plain = fused::attention_composed(&q, &k, &v, &bias, 0.4).unwrap();
    let seen = |t: &Tensor| {
        let n = t.dim(0).unwrap();
        Tensor::cat(
            &[
                t.narrow(0, 0, l).unwrap(),
                t.narrow(0, l + 1, n - l - 1).unwrap(),
            ],
            0,
        )
        .unwrap()
    };
    let d0 = max_diff(
        &seen(&fused::sink_attention(&q, &k, &v, &bias, 0.4, &low).unwrap()),
        &seen(&plain),
    );
    assert!(d0 < 1e-12, "{d0}");
    // ... and the sinks do move it.
    assert!(max_diff(&out, &plain) > 1e-3);
    // The sinks' gradient of Σ out · r against central differences.
    let r = randn(out.dims(), DType::F64);
    let f = |sk: &Tensor| -> f64 {
        let y = fused::sink_attention(&q, &k, &v, &bias, 0.4, sk).unwrap();
        (y * &r).unwrap().sum_all().unwrap().to_scalar().unwrap()
    };
    let var = Var::from_tensor(&sinks).unwrap();
    let y = fused::sink_attention(&q, &k, &v, &bias, 0.4, var.as_tensor()).unwrap();
    let grads = (y * &r).unwrap().sum_all().unwrap().backward().unwrap();
    let g: Vec<f64> = grads.get(var.as_tensor()).unwrap().to_vec1().unwrap();
    for (h, gh) in g.iter().enumerate() {
        let e: Vec<f64> = (0..nh).map(|j| if j == h { 1e-6 } else { 0.0 }).collect();
        let e = Tensor::new(e.as_slice(), &Device::Cpu).unwrap();
        let fd = (f(&(&sinks + &e).unwrap()) - f(&(&sinks - &e).unwrap())) / 2e-6;
        assert!(
            (fd - gh).abs() < 1e-6 * fd.abs().max(1.0),
            "sink {h}: {fd} vs {gh}"
        );
    }
}
