//! The device-generic path of every fused op (what CUDA and half precision run): the
//! composition on detached inputs as one graph node that keeps only its inputs, with a
//! recomputed (or explicit) backward. Checked on the CPU, where `GRPO_FUSED=recompute` forces
//! it for f32 too: the same values and gradients as the plain composition, and graphs that hold
//! no attention-probability or logits tensor. Its own binary, because it flips the process-wide
//! switch.
#![allow(clippy::unwrap_used, missing_docs)]

#[path = "it/common/mod.rs"]
mod common;

use candle_core::{DType, Device, Tensor, Var};
use grpo_rollout::config::Arch;
use grpo_rollout::fused;
use grpo_rollout::init::{Preset, preset_config, random_weights};
use grpo_rollout::policy::TrainableModel;

/// The tests flip the process-wide switch: one at a time.
static SWITCH: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn max_abs(t: &Tensor) -> f64 {
    t.abs()
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

fn randn(shape: &[usize], dtype: DType) -> Tensor {
    Tensor::randn(0f64, 1.0, shape, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// A small decoder: `hidden` wide, 4 heads on 2 kv heads, an MLP of 3 × `hidden`, q/k/v
/// biases where `bias`.
fn small(arch: Arch, vocab: usize, hidden: usize, bias: bool) -> grpo_rollout::config::ModelConfig {
    let mut c = preset_config(Preset::Tiny, arch, vocab, 1, 0);
    c.hidden_size = hidden;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = hidden / 4;
    c.intermediate_size = 3 * hidden;
    // Mixtral's and OLMoE's experts are the MLP's width.
    if let (true, Some(m)) = (arch.experts_mlp_wide(), c.moe.as_mut()) {
        m.moe_intermediate_size = c.intermediate_size;
    }
    c.attention_bias = bias;
    c
}

/// Backward from `loss`: each trainable variable's gradient, by name.
fn var_grads(loss: &Tensor, tm: &TrainableModel) -> Vec<(String, Tensor)> {
    let grads = loss.backward().unwrap();
    tm.vars
        .iter()
        .map(|(n, v)| (n.clone(), grads.get(v.as_tensor()).unwrap().clone()))
        .collect()
}

/// `a` and `b` within `tol` (compared in f32).
fn assert_close(what: &str, a: &Tensor, b: &Tensor, tol: f64) {
    let f32 = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    let d = max_abs(&(f32(a) - f32(b)).unwrap());
    assert!(d < tol, "{what}: {d}");
}

/// Each input's gradient (if any) under `Σ y · weights`.
fn weighted_grads(y: &Tensor, weights: &Tensor, inputs: &[&Tensor]) -> Vec<Option<Tensor>> {
    let g = (y * weights)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    inputs.iter().map(|t| g.get(t).cloned()).collect()
}

/// The same inputs have gradients on both sides, equal within 1e-12 (f64 nodes against their
/// compositions).
fn assert_same_grads(what: &str, a: &[Option<Tensor>], b: &[Option<Tensor>]) {
    for (k, (ga, gb)) in a.iter().zip(b).enumerate() {
        match (ga, gb) {
            (Some(ga), Some(gb)) => {
                assert!(max_abs(&(ga - gb).unwrap()) < 1e-12, "{what}input {k}")
            }
            (None, None) => {}
            _ => panic!("{what}input {k}: gradient on one side only"),
        }
    }
}

/// Each named gradient of `a` within `tol × 10` of `b`'s, relative to `b`'s largest value.
fn assert_grads_close(what: &str, a: &[(String, Tensor)], b: &[(String, Tensor)], tol: f64) {
    let f32 = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    for ((name, ga), (_, gb)) in a.iter().zip(b) {
        let scale = max_abs(gb).max(1e-3);
        let d = max_abs(&(f32(ga) - f32(gb)).unwrap());
        assert!(
            d / scale < tol * 10.0,
            "{what} gradient of {name}: {d} ({scale})"
        );
    }
}

/// Output, input gradients and graph size of `f` on fresh Vars, under `Σ out · r`.
fn run(
    inputs: &[Tensor],
    r: &Tensor,
    f: &dyn Fn(&[Tensor]) -> Tensor,
) -> (Tensor, Vec<Tensor>, Vec<Vec<usize>>) {
    let vars: Vec<Var> = inputs
        .iter()
        .map(|t| Var::from_tensor(t).unwrap())
        .collect();
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let out = f(&ts);
    let loss = (&out * r).unwrap().sum_all().unwrap();
    let shapes = loss
        .sorted_nodes()
        .iter()
        .map(|t| t.dims().to_vec())
        .collect();
    let grads = loss.backward().unwrap();
    let g = vars
        .iter()
        .map(|v| grads.get(v.as_tensor()).expect("gradient").clone())
        .collect();
    (out, g, shapes)
}

/// The op on the recompute path against the plain composition (fused ops off): equal values
/// and gradients; returns the shapes the recompute graph holds.
fn check(
    name: &str,
    inputs: &[Tensor],
    f: &dyn Fn(&[Tensor]) -> Tensor,
    grads: usize,
) -> Vec<Vec<usize>> {
    let dtype = inputs[0].dtype();
    grpo_core::fused::set_enabled(false);
    let probe = f(inputs);
    let r = randn(probe.dims(), DType::F32)
        .to_dtype(probe.dtype())
        .unwrap();
    let (b, gb, plain_shapes) = run(inputs, &r, f);
    grpo_core::fused::set_force_recompute(true);
    let (a, ga, shapes) = run(inputs, &r, f);
    grpo_core::fused::set_force_recompute(false);
    let tol = if dtype == DType::F32 { 1e-6 } else { 1e-2 };
    let d = max_abs(&(&a - &b).unwrap().to_dtype(DType::F32).unwrap());
    assert!(d <= tol, "{name} {dtype:?}: forward differs by {d}");
    for i in 0..grads {
        let scale = max_abs(&gb[i]).max(1e-3);
        let d = max_abs(&(&ga[i] - &gb[i]).unwrap().to_dtype(DType::F32).unwrap());
        assert!(scale > 1e-3, "{name}: zero gradient {i}");
        assert!(
            d <= tol * scale,
            "{name} {dtype:?}: gradient {i} differs by {d} ({scale})"
        );
    }
    assert!(
        shapes.len() <= plain_shapes.len(),
        "{name}: the recompute graph ({} nodes) is not smaller than the composition's ({})",
        shapes.len(),
        plain_shapes.len()
    );
    shapes
}

fn causal_bias(b: usize, l: usize, s: usize, dtype: DType) -> Tensor {
    let mut v = vec![0f32; b * l * s];
    for r in 0..b {
        for i in 0..l {
            for j in 0..s {
                // Keys past the query (after the s - l prefix) and row r's first r keys masked.
                if j > s - l + i || j < r {
                    v[(r * l + i) * s + j] = -1e9;
                }
            }
        }
    }
    Tensor::from_vec(v, (b, 1, l, s), &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

#[test]
fn every_op_on_the_recompute_path_equals_its_composition() {
    let _one = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    for dtype in [DType::F32, DType::BF16] {
        let x = randn(&[7, 16], dtype);
        let w = (randn(&[16], dtype) + 1.0).unwrap();
        check(
            "rms_norm",
            &[x, w],
            &|t| fused::rms_norm(&t[0], &t[1], 1e-6).unwrap(),
            2,
        );

        let (b, l, h, d) = (2, 5, 3, 8);
        let x = randn(&[b, l, h, d], dtype);
        let ang = randn(&[b, l, d / 2], DType::F32);
        let (cos, sin) = (
            ang.cos().unwrap().to_dtype(dtype).unwrap(),
            ang.sin().unwrap().to_dtype(dtype).unwrap(),
        );
        check(
            "rope",
            &[x],
            &|t| fused::rope(&t[0], &cos, &sin).unwrap(),
            1,
        );

        let g = randn(&[9, 12], dtype);
        let u = randn(&[9, 12], dtype);
        check(
            "silu_mul",
            &[g, u],
            &|t| fused::silu_mul(&t[0], &t[1]).unwrap(),
            2,
        );

        // Attention: 4 query heads on 2 kv heads, 3 prefix keys, masked keys.
        let (b, nh, nkv, l, s, d) = (2, 4, 2, 5, 9, 8);
        let q = randn(&[b, nh, l, d], dtype);
        let k = randn(&[b, nkv, s, d], dtype);
        let v = randn(&[b, nkv, s, d], dtype);
        let bias = causal_bias(b, l, s, dtype);
        let shapes = check(
            "attention",
            &[q, k, v],
            &|t| fused::attention(&t[0], &t[1], &t[2], &bias, 0.35).unwrap(),
            3,
        );
        // Nothing with a (queries, keys) plane is kept for backward.
        assert!(
            shapes
                .iter()
                .all(|sh| !sh.ends_with(&[l, s]) && !sh.ends_with(&[2 * l, s])),
            "attention keeps a probability tensor: {shapes:?}"
        );

        // A frozen weight: only the input gets a gradient, none is formed for the weight.
        let wf = randn(&[6, 16], dtype);
        let x = randn(&[7, 16], dtype);
        let shapes = check(
            "frozen_linear",
            &[x],
            &|t| fused::frozen_linear(&t[0], &wf).unwrap(),
            1,
        );
        assert!(
            shapes.len() <= 5 && !shapes.contains(&vec![6, 16]),
            "{shapes:?}"
        );

        let logits = randn(&[6, 40], dtype);
        let ids = Tensor::new(&[3u32, 0, 39, 7, 7, 12], &Device::Cpu).unwrap();
        check(
            "selective_log_softmax",
            std::slice::from_ref(&logits),
            &|t| grpo_core::logprobs::selective_log_softmax(&t[0], &ids).unwrap(),
            1,
        );
        check(
            "entropy",
            &[logits],
            &|t| grpo_core::logprobs::entropy_from_logits(&t[0]).unwrap(),
            1,
        );
    }
}

/// The whole decoder on the recompute path (forced on CPU f32, and bf16 as it runs on a GPU)
/// against the plain compositions: equal log-probs, entropies and every weight's gradient, and
/// the training graph holds no logits (rows × vocab) and no attention probabilities.
#[test]
fn the_decoder_on_the_recompute_path_equals_the_composition() {
    let _one = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let rows = vec![
        vec![5u32, 9, 2, 33, 7, 12, 40],
        vec![8, 3, 20, 11],
        vec![17, 6, 50, 4, 9],
    ];
    let (ids, mask) = grpo_rollout::generate::left_pad(&rows, 0, &Device::Cpu).unwrap();
    let vocab = 61;
    for arch in [
        Arch::Llama,
        Arch::Qwen2,
        Arch::Qwen3,
        Arch::Gemma3,
        Arch::Olmo2,
        Arch::Phi3,
        Arch::Gemma2,
        Arch::Granite,
    ] {
        for dtype in [DType::F32, DType::BF16] {
            let c = small(arch, vocab, 32, arch != Arch::Qwen3);
            let base = random_weights(&c, 5, dtype, &Device::Cpu).unwrap();
            let mut outs = Vec::new();
            for recompute in [true, false] {
                if recompute {
                    grpo_core::fused::set_force_recompute(true);
                } else {
                    grpo_core::fused::set_enabled(false);
                }
                let tm = TrainableModel::full(&base).unwrap();
                let (lp, ent) = tm
                    .model
                    .completion_logprobs(&ids, &mask, 3, 0.7, true)
                    .unwrap();
                let ent = ent.unwrap();
                let loss =
                    ((&lp * 0.3).unwrap().sum_all().unwrap() - ent.sum_all().unwrap()).unwrap();
                let shapes: Vec<Vec<usize>> = loss
                    .sorted_nodes()
                    .iter()
                    .map(|t| t.dims().to_vec())
                    .collect();
                outs.push((lp, ent, var_grads(&loss, &tm), shapes));
            }
            grpo_core::fused::set_enabled(true);
            let tol = if dtype == DType::F32 { 1e-5 } else { 2e-2 };
            let (a, b) = (&outs[0], &outs[1]);
            let what = format!("{arch:?} {dtype:?}");
            assert_close(&format!("{what} log-probs"), &a.0, &b.0, tol);
            assert_close(&format!("{what} entropies"), &a.1, &b.1, tol);
            assert_grads_close(&what, &a.2, &b.2, tol);
            let (shapes, plain) = (&a.3, &b.3);
            let logits_like =
                |s: &Vec<usize>| s.last() == Some(&vocab) && s.len() >= 2 && s[0] != vocab;
            assert!(
                plain.iter().any(logits_like),
                "the composition should keep logits"
            );
            assert!(
                !shapes.iter().any(logits_like),
                "{arch:?} {dtype:?}: logits kept: {shapes:?}"
            );
            assert!(
                shapes.len() * 2 < plain.len(),
                "{arch:?} {dtype:?}: {} nodes vs {}",
                shapes.len(),
                plain.len()
            );
        }
    }
}

/// LoRA training graphs: each adapted projection is one node (`Lora::fused_projection`) with
/// the composition's log-probs and every adapter factor's gradient, and the graph holds far
/// fewer bytes (no base product, low-rank product or scaled copy per projection).
#[test]
fn lora_projections_as_one_node_equal_the_composition() {
    use grpo_rollout::lora::{self, LoraConfig, TargetModules};
    let _one = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let rows = vec![vec![5u32, 9, 2, 33, 7, 12, 40], vec![8, 3, 20, 11]];
    let (ids, mask) = grpo_rollout::generate::left_pad(&rows, 0, &Device::Cpu).unwrap();
    let cfg = LoraConfig {
        r: 4,
        lora_alpha: 8.0,
        lora_dropout: 0.0,
        target_modules: TargetModules::Pattern(lora::ALL_LINEAR.into()),
        ..LoraConfig::default()
    };
    for arch in [Arch::Qwen2, Arch::Llama] {
        for dtype in [DType::F32, DType::BF16] {
            let c = small(arch, 61, 32, arch == Arch::Qwen2);
            let base = random_weights(&c, 5, dtype, &Device::Cpu).unwrap();
            let mut outs = Vec::new();
            for on in [true, false] {
                grpo_core::fused::set_enabled(on);
                let tm = TrainableModel::lora(&base, &cfg, 1).unwrap();
                for (i, (name, v)) in tm.vars.iter().enumerate() {
                    if name.contains("lora_B") {
                        let n = v.elem_count();
                        let vals: Vec<f32> =
                            (0..n).map(|j| 0.05 * ((j * 7 + i) as f32).sin()).collect();
                        let t = Tensor::from_vec(vals, v.shape(), &Device::Cpu).unwrap();
                        v.set(&t.to_dtype(v.dtype()).unwrap()).unwrap();
                    }
                }
                let (lp, _) = tm
                    .model
                    .completion_logprobs(&ids, &mask, 3, 1.0, false)
                    .unwrap();
                let loss = (&lp * 0.3).unwrap().sum_all().unwrap();
                let bytes = graph_bytes(&loss);
                outs.push((lp, var_grads(&loss, &tm), bytes));
            }
            grpo_core::fused::set_enabled(true);
            let tol = if dtype == DType::F32 { 1e-5 } else { 2e-2 };
            let (a, b) = (&outs[0], &outs[1]);
            let what = format!("{arch:?} {dtype:?}");
            assert_close(&format!("{what} log-probs"), &a.0, &b.0, tol);
            assert_grads_close(&what, &a.1, &b.1, tol);
            eprintln!("{arch:?} {dtype:?}: graph {} vs {} bytes", a.2, b.2);
            assert!(
                (a.2 as f64) < 0.6 * b.2 as f64,
                "{arch:?} {dtype:?}: graph {} bytes vs the composition's {}",
                a.2,
                b.2
            );
        }
    }
}

/// `fused::affine` (`[res +] x Wᵀ [+ b]` as one node) against the composition: values and the
/// gradient of every tracked input (f64 to 1e-12), for each mix of tracked and frozen inputs
/// (a trainable weight alone too); its graph keeps no product before the bias or the residual,
/// nor a transposed view of the weight; four tracked inputs compose.
#[test]
fn affine_node_equals_the_composition() {
    let _one = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    grpo_core::fused::set_force_recompute(true);
    let dev = Device::Cpu;
    let rnd = |s: &[usize]| Tensor::randn(0f64, 1.0, s, &dev).unwrap();
    let (n, i, o) = (7, 5, 6);
    let (x0, w0, b0, r0) = (rnd(&[n, i]), rnd(&[o, i]), rnd(&[o]), rnd(&[n, o]));
    let weights = rnd(&[n, o]);
    // (residual, bias, tracked: res x w b)
    let cases: [(bool, bool, [bool; 4]); 6] = [
        (true, false, [true, true, true, false]),
        // A trainable weight alone: one node where candle's product is two (the transpose).
        (false, false, [false, true, true, false]),
        (false, true, [false, true, false, false]),
        (true, true, [true, true, false, false]),
        (false, true, [false, true, true, true]),
        (true, true, [true, true, false, true]),
    ];
    for (res_on, bias_on, tr) in cases {
        let make = |t: &Tensor, on: bool| -> Tensor {
            if on {
                Var::from_tensor(t).unwrap().as_tensor().clone()
            } else {
                t.clone()
            }
        };
        let run = |fused: bool| {
            let (r, x, w, b) = (
                make(&r0, tr[0]),
                make(&x0, tr[1]),
                make(&w0, tr[2]),
                make(&b0, tr[3]),
            );
            let (rr, bb) = (res_on.then_some(&r), bias_on.then_some(&b));
            let y = if fused {
                fused::affine(rr, &x, &w, bb).unwrap().expect("applies")
            } else {
                let mut y = x.matmul(&w.t().unwrap()).unwrap();
                if let Some(b) = bb {
                    y = y.broadcast_add(b).unwrap();
                }
                if let Some(r) = rr {
                    y = (r + y).unwrap();
                }
                y
            };
            let bytes: usize = y
                .sorted_nodes()
                .iter()
                .filter(|t| !t.is_variable())
                .map(|t| t.elem_count())
                .sum();
            let grads = weighted_grads(&y, &weights, &[&r, &x, &w, &b]);
            (y, grads, bytes)
        };
        let (a, b) = (run(true), run(false));
        assert!(max_abs(&(&a.0 - &b.0).unwrap()) < 1e-12);
        assert_same_grads("", &a.1, &b.1);
        // The composition keeps the product (and the biased product) beside the output.
        assert!(a.2 < b.2, "{res_on} {bias_on} {tr:?}: {} vs {}", a.2, b.2);
    }
    // Four tracked inputs: not one node.
    let t = |v: &Tensor| Var::from_tensor(v).unwrap().as_tensor().clone();
    let (r, x, w, b) = (t(&r0), t(&x0), t(&w0), t(&b0));
    assert!(fused::affine(Some(&r), &x, &w, Some(&b)).unwrap().is_none());
    // Nothing to fuse: a plain product of a frozen weight is the caller's (frozen_linear).
    assert!(fused::affine(None, &x, &w0, None).unwrap().is_none());
    // The CPU kernels' path (f64 here) keeps candle's ops.
    grpo_core::fused::set_enabled(true);
    assert!(fused::affine(Some(&r), &x, &w, None).unwrap().is_none());
}

/// `fused::project_heads` (a q/k/v projection as rotated heads, or v's heads, in one node)
/// against the composition — product, bias, reshape, RoPE (or transpose and copy): values and
/// the gradients of x, W and b (f64 to 1e-12), trainable and frozen weights; its graph keeps
/// neither the projection's output nor a view of the weight.
#[test]
fn project_heads_node_equals_the_composition() {
    let _one = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    grpo_core::fused::set_force_recompute(true);
    let dev = Device::Cpu;
    let rnd = |s: &[usize]| Tensor::randn(0f64, 1.0, s, &dev).unwrap();
    let (b, l, h, d, i) = (2, 3, 2, 4, 5);
    let (x0, w0, b0) = (rnd(&[b * l, i]), rnd(&[h * d, i]), rnd(&[h * d]));
    let ang = rnd(&[b, l, d / 2]);
    let (cos, sin) = (ang.cos().unwrap(), ang.sin().unwrap());
    let weights = rnd(&[b, h, l, d]);
    for rotate in [true, false] {
        for (bias_on, w_tracked) in [(true, true), (false, true), (true, false)] {
            let run = |fused: bool| {
                let var = |t: &Tensor| Var::from_tensor(t).unwrap().as_tensor().clone();
                let x = var(&x0);
                let w = if w_tracked { var(&w0) } else { w0.clone() };
                let bb = var(&b0);
                let bias = bias_on.then_some(&bb);
                let rot = rotate.then_some((&cos, &sin));
                let y = if fused {
                    fused::project_heads(&x, &w, bias, (b, l, h, d), rot)
                        .unwrap()
                        .expect("applies")
                } else {
                    let mut y = x.matmul(&w.t().unwrap()).unwrap();
                    if let Some(bb) = bias {
                        y = y.broadcast_add(bb).unwrap();
                    }
                    let y = y.reshape((b, l, h, d)).unwrap();
                    match rot {
                        Some((c, s)) => fused::rope_composed(&y, c, s).unwrap(),
                        None => y.transpose(1, 2).unwrap().contiguous().unwrap(),
                    }
                };
                let nodes = y.sorted_nodes().len();
                let grads = weighted_grads(&y, &weights, &[&x, &w, &bb]);
                (y, grads, nodes)
            };
            let (a, c) = (run(true), run(false));
            let what = format!("rotate {rotate}, bias {bias_on}, trainable W {w_tracked}");
            assert!(max_abs(&(&a.0 - &c.0).unwrap()) < 1e-12, "{what}: values");
            assert_same_grads(&format!("{what}: "), &a.1, &c.1);
            assert!(a.2 < c.2, "{what}: {} nodes vs {}", a.2, c.2);
        }
    }
    // The CPU kernels' path keeps the composition.
    grpo_core::fused::set_enabled(true);
    let x = Var::from_tensor(&x0).unwrap().as_tensor().clone();
    assert!(
        fused::project_heads(&x, &w0, None, (b, l, h, d), None)
            .unwrap()
            .is_none()
    );
}

/// The MLP as two nodes (`fused::project_pair`: gate and up side by side; `fused::down_silu`:
/// SiLU·mul, the down projection and the residual, recomputing the product in backward)
/// against the composition: values and the gradients of the residual, the input and the three
/// weights (f64 to 1e-12), trainable and frozen weights; the graph keeps fewer nodes and not the
/// product.
#[test]
fn mlp_nodes_equal_the_composition() {
    let _one = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    grpo_core::fused::set_force_recompute(true);
    let dev = Device::Cpu;
    let rnd = |s: &[usize]| Tensor::randn(0f64, 1.0, s, &dev).unwrap();
    let (n, hidden, inter) = (6, 5, 7);
    let (x0, r0) = (rnd(&[n, hidden]), rnd(&[n, hidden]));
    let (wg0, wu0, wd0) = (
        rnd(&[inter, hidden]),
        rnd(&[inter, hidden]),
        rnd(&[hidden, inter]),
    );
    let weights = rnd(&[n, hidden]);
    for trainable in [true, false] {
        let run = |fused: bool| {
            let var = |t: &Tensor| Var::from_tensor(t).unwrap().as_tensor().clone();
            let w = |t: &Tensor| if trainable { var(t) } else { t.clone() };
            let (x, r) = (var(&x0), var(&r0));
            let (wg, wu, wd) = (w(&wg0), w(&wu0), w(&wd0));
            let y = if fused {
                let gu = fused::project_pair(&x, &wg, &wu).unwrap().expect("applies");
                fused::down_silu(&r, &gu, &wd).unwrap().expect("applies")
            } else {
                let gate = x.matmul(&wg.t().unwrap()).unwrap();
                let up = x.matmul(&wu.t().unwrap()).unwrap();
                let act = fused::silu_mul_composed(&gate, &up).unwrap();
                (&r + act.matmul(&wd.t().unwrap()).unwrap()).unwrap()
            };
            let nodes = y.sorted_nodes().len();
            let grads = weighted_grads(&y, &weights, &[&x, &r, &wg, &wu, &wd]);
            (y, grads, nodes)
        };
        let (a, c) = (run(true), run(false));
        assert!(max_abs(&(&a.0 - &c.0).unwrap()) < 1e-12, "values");
        assert_same_grads(&format!("trainable {trainable}: "), &a.1, &c.1);
        assert!(a.2 < c.2, "trainable {trainable}: {} nodes vs {}", a.2, c.2);
    }
    // The CPU kernels' path keeps the composition.
    grpo_core::fused::set_enabled(true);
    let x = Var::from_tensor(&x0).unwrap().as_tensor().clone();
    assert!(fused::project_pair(&x, &wg0, &wu0).unwrap().is_none());
}

/// Bytes of the tensors a training graph keeps (weights excluded), each storage once.
fn graph_bytes(loss: &Tensor) -> usize {
    use candle_core::{CpuStorage, Storage};
    let ptr_len = |t: &Tensor| -> (usize, usize) {
        let (st, _) = t.storage_and_layout();
        match &*st {
            Storage::Cpu(CpuStorage::BF16(v)) => (v.as_ptr() as usize, v.len() * 2),
            Storage::Cpu(CpuStorage::F16(v)) => (v.as_ptr() as usize, v.len() * 2),
            Storage::Cpu(CpuStorage::F32(v)) => (v.as_ptr() as usize, v.len() * 4),
            Storage::Cpu(CpuStorage::F64(v)) => (v.as_ptr() as usize, v.len() * 8),
            Storage::Cpu(CpuStorage::U32(v)) => (v.as_ptr() as usize, v.len() * 4),
            Storage::Cpu(CpuStorage::I64(v)) => (v.as_ptr() as usize, v.len() * 8),
            Storage::Cpu(CpuStorage::U8(v)) => (v.as_ptr() as usize, v.len()),
            _ => (0, 0),
        }
    };
    let nodes = loss.sorted_nodes();
    let weights: std::collections::HashSet<usize> = nodes
        .iter()
        .filter(|t| t.is_variable())
        .map(|t| ptr_len(t).0)
        .collect();
    let mut seen = std::collections::HashSet::new();
    nodes
        .iter()
        .filter(|t| !t.is_variable())
        .map(|t| ptr_len(t))
        .filter(|(p, _)| !weights.contains(p) && seen.insert(*p))
        .map(|(_, n)| n)
        .sum()
}

/// What the GPU's path keeps for backward, per position and decoder layer, against what
/// PyTorch saves on the same small Qwen2 in bf16 (transformers' sdpa attention; peft for LoRA;
/// `scripts/gen_activation_reference.py`): no more, full fine-tune and LoRA. The difference
/// between 4 and 2 layers isolates the layers from the embedding and the head.
#[test]
fn the_training_graph_keeps_no_more_than_torch_saves() {
    use grpo_rollout::lora::{self, LoraConfig, TargetModules};
    let _one = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/activation_reference.json"
    );
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let (batch, positions, completion) = (4usize, 40usize, 30usize);
    let rows: Vec<Vec<u32>> = (0..batch)
        .map(|r| {
            (0..positions)
                .map(|i| ((i * 7 + r * 3) % 127) as u32)
                .collect()
        })
        .collect();
    let (ids, mask) = grpo_rollout::generate::left_pad(&rows, 0, &Device::Cpu).unwrap();
    grpo_core::fused::set_force_recompute(true);
    let bytes = |layers: usize, adapters: bool| -> usize {
        let mut c = small(Arch::Qwen2, 128, 64, true);
        c.num_hidden_layers = layers;
        c.tie_word_embeddings = true;
        let base = random_weights(&c, 5, DType::BF16, &Device::Cpu).unwrap();
        let tm = if adapters {
            let cfg = LoraConfig {
                r: 4,
                lora_alpha: 8.0,
                target_modules: TargetModules::Pattern(lora::ALL_LINEAR.into()),
                ..LoraConfig::default()
            };
            TrainableModel::lora(&base, &cfg, 1).unwrap()
        } else {
            TrainableModel::full(&base).unwrap()
        };
        let (lp, _) = tm
            .model
            .completion_logprobs(&ids, &mask, completion, 1.0, false)
            .unwrap();
        graph_bytes(&lp.sum_all().unwrap())
    };
    for (adapters, key) in [
        (false, "full_values_per_position_layer"),
        (true, "lora_values_per_position_layer"),
    ] {
        let ours = (bytes(4, adapters) - bytes(2, adapters)) as f64
            / 2.0
            / (batch * positions) as f64
            / 2.0;
        let torch = reference[key].as_f64().unwrap();
        eprintln!("{key}: ours {ours}, torch {torch}");
        assert!(ours <= torch, "{key}: ours {ours} > torch's {torch}");
    }
    grpo_core::fused::set_enabled(true);
}

/// The token statistics (`completion_stats`: log-probs, entropies, top-1, mean logits) on the
/// GPU's path equal the CPU kernels' (the indicator computed in the head's node, zeros when
/// backward recomputes it), and the log-probs' gradient is unchanged by the extra column.
#[test]
fn completion_stats_on_the_recompute_path_equal_the_kernels() {
    let _one = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let rows = vec![vec![5u32, 9, 2, 33, 7, 12, 40], vec![8, 3, 20, 11]];
    let (ids, mask) = grpo_rollout::generate::left_pad(&rows, 0, &Device::Cpu).unwrap();
    let base = random_weights(
        &small(Arch::Qwen2, 61, 32, true),
        5,
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let mut outs = Vec::new();
    for recompute in [true, false] {
        grpo_core::fused::set_force_recompute(recompute);
        let tm = TrainableModel::full(&base).unwrap();
        let st = tm.model.completion_stats(&ids, &mask, 4).unwrap();
        let (plain, _) = tm
            .model
            .completion_logprobs(&ids, &mask, 4, 1.0, false)
            .unwrap();
        assert_close("log-probs with and without stats", &st.logps, &plain, 1e-6);
        let loss = (&st.logps * 0.3).unwrap().sum_all().unwrap();
        let g = var_grads(&loss, &tm);
        outs.push((st.logps, st.entropy, st.top1, g, st.mean_logits));
    }
    grpo_core::fused::set_enabled(true);
    let (a, b) = (&outs[0], &outs[1]);
    assert_close("log-probs", &a.0, &b.0, 1e-5);
    assert_close("entropies", &a.1, &b.1, 1e-5);
    assert_eq!(
        a.2.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        b.2.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    );
    let top: Vec<f32> = b.2.flatten_all().unwrap().to_vec1().unwrap();
    assert!(top.iter().all(|&x| x == 0.0 || x == 1.0));
    assert!(!a.2.track_op(), "the indicator carries no graph");
    assert_grads_close("stats", &a.3, &b.3, 1e-5);
    assert_close("mean logits", &a.4, &b.4, 1e-5);
    assert!(!a.4.track_op(), "the mean logits carry no graph");
}

#[test]
fn taped_layers_give_the_plain_graphs_values_and_gradients() {
    // The GPU's node path (forced on the CPU): a full fine-tune's decoder layers as taped
    // blocks (`enable_layer_segments` where every op records) against the same ops as graph
    // nodes — log-probs, entropies and every weight's gradient, padded rows and GRPO's shared
    // prompts; no tape fell back; the blocks are freed by backward; the loss graph keeps one
    // node per layer instead of each op's.
    let _one = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    grpo_core::fused::set_force_recompute(true);
    let rows = vec![
        vec![5u32, 9, 2, 33, 7, 12, 40],
        vec![8, 3, 20, 11],
        vec![17, 6, 50, 4, 9],
    ];
    let (ids, mask) = grpo_rollout::generate::left_pad(&rows, 0, &Device::Cpu).unwrap();
    // GRPO's shared prompts: each distinct prompt once (its keys and values collected), the
    // completions after them (attending over those as a prefix).
    let common::SharedPromptBatch {
        pids,
        pmask,
        prompt_of,
        cid,
        cmask,
    } = common::shared_prompt_batch();
    let fallbacks = grpo_core::recompute::tape_fallbacks();
    // Qwen2 with its q/k/v biases; Llama without biases (an o_proj bias composes: no tape).
    for (arch, bias, shared) in [
        (Arch::Qwen2, true, false),
        (Arch::Llama, false, false),
        (Arch::Qwen2, true, true),
    ] {
        for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5), (DType::BF16, 2e-2)] {
            let mut c = small(arch, 61, 32, bias);
            c.num_hidden_layers = 2;
            let base = random_weights(&c, 5, dtype, &Device::Cpu).unwrap();
            // 0: the plain graph; 1: taped blocks; 2: gradient checkpointing (taped recompute).
            let run = |mode: u8| {
                let mut tm = TrainableModel::full(&base).unwrap();
                match mode {
                    1 => tm.model.enable_layer_segments(),
                    2 => tm.model.enable_gradient_checkpointing(),
                    _ => {}
                }
                let (lp, ent) = if shared {
                    tm.model
                        .shared_prompt_logprobs(&pids, &pmask, &prompt_of, &cid, &cmask, 0.7, true)
                        .unwrap()
                } else {
                    tm.model
                        .completion_logprobs(&ids, &mask, 3, 0.7, true)
                        .unwrap()
                };
                let ent = ent.unwrap();
                let loss =
                    ((&lp * 0.3).unwrap().sum_all().unwrap() - ent.sum_all().unwrap()).unwrap();
                let nodes = loss.sorted_nodes().len();
                let live = grpo_core::recompute::live_segments();
                let grads = tm.model.backward(&loss).unwrap();
                assert_eq!(
                    grpo_core::recompute::live_segments(),
                    0,
                    "blocks outlive backward"
                );
                let g: Vec<(String, Tensor)> = tm
                    .vars
                    .iter()
                    .map(|(n, v)| (n.clone(), grads.get(v.as_tensor()).unwrap().clone()))
                    .collect();
                // A weight's gradient carries no graph (the optimizer keeps what it is given:
                // a graph would chain its moments, and the recomputations' tensors, step
                // after step — a leak of ≈ 64 MiB a step on the GRPO bench before).
                for (n, g) in &g {
                    assert!(!g.track_op(), "mode {mode}: {n}'s gradient has a graph");
                }
                (lp, ent, g, nodes, live)
            };
            let (plain, taped, ckpt) = (run(0), run(1), run(2));
            let what = format!("{arch:?} {dtype:?} shared={shared}");
            assert_eq!(plain.4, 0, "{what}: blocks without enabling them");
            // One block per layer and pass (the shared prompts' pass, then the completions').
            let passes = if shared { 2 } else { 1 };
            assert_eq!(taped.4, 2 * passes, "{what}: one block per layer");
            assert_close(&format!("{what} log-probs"), &taped.0, &plain.0, tol);
            assert_close(&format!("{what} entropies"), &taped.1, &plain.1, tol);
            assert_grads_close(&what, &taped.2, &plain.2, tol / 10.0);
            assert!(
                taped.3 * 2 < plain.3,
                "{what}: {} graph nodes taped, {} plain",
                taped.3,
                plain.3
            );
            let what = format!("{what} checkpointing");
            assert_close(&format!("{what} log-probs"), &ckpt.0, &plain.0, tol);
            assert_grads_close(&what, &ckpt.2, &plain.2, tol / 10.0);
        }
    }
    assert_eq!(
        grpo_core::recompute::tape_fallbacks(),
        fallbacks,
        "a layer's tape was incomplete"
    );
    grpo_core::fused::set_force_recompute(false);
}

#[test]
fn kernel_ops_record_on_a_tape_with_their_nodes_gradients() {
    // The ops that are candle CustomOps with their own backward (the kernels: here the CPU
    // f32 ones, as CUDA's run on a GPU) through `tape::apply_op*` while a tape records: the
    // walk's gradients are the node's under candle's backward, to the bit, and only inputs
    // that carry a gradient get one (the tables and the bias are constants).
    let _one = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    grpo_core::fused::set_enabled(true);
    let (x, w) = (randn(&[6, 16], DType::F32), randn(&[16], DType::F32));
    let (a, u) = (randn(&[6, 16], DType::F32), randn(&[6, 16], DType::F32));
    let q = randn(&[2, 3, 4, 8], DType::F32); // (B, L, H, D)
    let (cos, sin) = (randn(&[2, 3, 4], DType::F32), randn(&[2, 3, 4], DType::F32));
    let (sc, bias) = (
        randn(&[2, 4, 3, 3], DType::F32),
        randn(&[2, 1, 3, 3], DType::F32),
    );
    type Op = fn(&[Tensor]) -> candle_core::Result<Tensor>;
    let cases: Vec<(&str, Vec<Tensor>, Op)> = vec![
        ("rms_norm", vec![x, w], |t| {
            fused::rms_norm(&t[0], &t[1], 1e-6)
        }),
        ("silu_mul", vec![a, u], |t| fused::silu_mul(&t[0], &t[1])),
        ("rope", vec![q, cos, sin], |t| {
            fused::rope(&t[0], &t[1], &t[2])
        }),
        ("attention_softmax", vec![sc, bias], |t| {
            fused::attention_softmax(&t[0], &t[1], 0.5)
        }),
    ];
    for (name, inputs, op) in cases {
        // The first input (and the norm's weight) trained, the rest constants.
        let trained = if name == "rms_norm" { 2 } else { 1 };
        let vars: Vec<Var> = inputs[..trained]
            .iter()
            .map(|t| Var::from_tensor(t).unwrap())
            .collect();
        let args: Vec<Tensor> = vars
            .iter()
            .map(|v| v.as_tensor().clone())
            .chain(inputs[trained..].iter().cloned())
            .collect();
        let y = op(&args).unwrap();
        let r = randn(y.dims(), DType::F32);
        let want = (&y * &r).unwrap().sum_all().unwrap().backward().unwrap();
        let tracked: Vec<&Tensor> = vars.iter().map(|v| v.as_tensor()).collect();
        let (yt, tape) = grpo_core::tape::record(&tracked, || op(&args)).unwrap();
        assert_eq!(tape.broken(&yt), None, "{name}");
        assert_eq!(tape.len(), 1, "{name}: one recorded op");
        assert_close(&format!("{name} output"), &yt, &y, 1e-30);
        let got = tape.backward(&yt, &r).unwrap();
        for v in &vars {
            let (g, w) = (&got[&v.id()], want.get(v).unwrap());
            assert_eq!(
                g.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                w.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                "{name}: gradient"
            );
        }
        assert_eq!(got.len(), vars.len(), "{name}: a constant got a gradient");
    }
}
