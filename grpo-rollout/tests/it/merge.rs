//! Model merging against mergekit 0.1.5 itself: `scripts/check_merge.py` ran mergekit's
//! `run_merge` on three tiny Qwen2 directories whose weights follow a formula repeated here, one
//! merge per method (linear with a gradient weight, task_arithmetic with λ, ties with a
//! gradient density and the base among the models, dare_ties at density 1, slerp with filtered
//! gradients), and stored each merged tensor's sum and sum of squares
//! (`tests/fixtures/merge/mergekit-0.1.5.txt`); the same merges here give them within 1e-6.
//! Then properties mergekit's methods have, and the refusals.
#![allow(clippy::unwrap_used, missing_docs)]

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use grpo_rollout::merge::{MergeConfig, merge_weights};

const H: usize = 4;
const I: usize = 8;
const V: usize = 8;

fn shapes() -> Vec<(String, Vec<usize>)> {
    let mut s = vec![
        ("model.embed_tokens.weight".to_string(), vec![V, H]),
        ("model.norm.weight".to_string(), vec![H]),
    ];
    for i in 0..2 {
        let p = format!("model.layers.{i}.");
        for (n, shape) in [
            ("input_layernorm.weight", vec![H]),
            ("post_attention_layernorm.weight", vec![H]),
            ("self_attn.q_proj.weight", vec![H, H]),
            ("self_attn.q_proj.bias", vec![H]),
            ("self_attn.k_proj.weight", vec![H, H]),
            ("self_attn.k_proj.bias", vec![H]),
            ("self_attn.v_proj.weight", vec![H, H]),
            ("self_attn.v_proj.bias", vec![H]),
            ("self_attn.o_proj.weight", vec![H, H]),
            ("mlp.gate_proj.weight", vec![I, H]),
            ("mlp.up_proj.weight", vec![I, H]),
            ("mlp.down_proj.weight", vec![H, I]),
        ] {
            s.push((format!("{p}{n}"), shape));
        }
    }
    s
}

/// Model `m`'s weights: `0.1·sin(1.3·m + 0.7·j + 0.013·Σ bytes(name))`, in f32.
fn weights(m: usize) -> HashMap<String, Tensor> {
    shapes()
        .into_iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            let h: f64 = name.bytes().map(f64::from).sum();
            let v: Vec<f32> = (0..n)
                .map(|j| (0.1 * (1.3 * m as f64 + 0.7 * j as f64 + 0.013 * h).sin()) as f32)
                .collect();
            (name, Tensor::from_vec(v, shape, &Device::Cpu).unwrap())
        })
        .collect()
}

/// The script's configurations (model paths `m1`..`m3`), as JSON.
fn config(method: &str) -> MergeConfig {
    let v = match method {
        "linear" => serde_json::json!({
            "merge_method": "linear",
            "models": [
                {"model": "m1", "parameters": {"weight": 0.7}},
                {"model": "m2", "parameters": {"weight": 0.5}},
                {"model": "m3", "parameters": {"weight": [0.1, 1.0]}},
            ],
            "dtype": "float32",
        }),
        "task_arithmetic" => serde_json::json!({
            "merge_method": "task_arithmetic",
            "base_model": "m1",
            "models": [
                {"model": "m2", "parameters": {"weight": 0.6}},
                {"model": "m3", "parameters": {"weight": -0.4}},
            ],
            "parameters": {"lambda": 0.8},
            "dtype": "float32",
        }),
        "ties" => serde_json::json!({
            "merge_method": "ties",
            "base_model": "m1",
            "models": [
                {"model": "m1"},
                {"model": "m2", "parameters": {"weight": 0.6, "density": [1.0, 0.7, 0.1]}},
                {"model": "m3", "parameters": {"weight": 0.4, "density": 0.5}},
            ],
            "dtype": "float32",
        }),
        "dare_ties" => serde_json::json!({
            "merge_method": "dare_ties",
            "base_model": "m1",
            "models": [
                {"model": "m2", "parameters": {"weight": 0.6}},
                {"model": "m3", "parameters": {"weight": 0.4}},
            ],
            "parameters": {"normalize": true},
            "dtype": "float32",
        }),
        "slerp" => serde_json::json!({
            "merge_method": "slerp",
            "base_model": "m1",
            "models": [{"model": "m1"}, {"model": "m2"}],
            "parameters": {"t": [
                {"filter": "self_attn", "value": [0, 0.5, 0.3, 0.7, 1]},
                {"filter": "mlp", "value": [1, 0.5, 0.7, 0.3, 0]},
                {"value": 0.5},
            ]},
            "dtype": "float32",
        }),
        _ => unreachable!(),
    };
    serde_json::from_value(v).unwrap()
}

/// The weight maps in the order the merge takes its inputs: `models`, then the base when it
/// is not among them.
fn inputs(cfg: &MergeConfig) -> Vec<HashMap<String, Tensor>> {
    let idx = |p: &std::path::Path| p.to_str().unwrap()[1..].parse::<usize>().unwrap();
    let mut v: Vec<_> = cfg.models.iter().map(|m| weights(idx(&m.model))).collect();
    if let Some(b) = &cfg.base_model
        && !cfg.models.iter().any(|m| &m.model == b)
    {
        v.push(weights(idx(b)));
    }
    v
}

#[test]
fn each_method_gives_mergekits_tensors() {
    let text = include_str!("../fixtures/merge/mergekit-0.1.5.txt");
    let mut seen = 0;
    for line in text.lines() {
        let (method, json) = line.split_once(' ').unwrap();
        let want: HashMap<String, [f64; 2]> = serde_json::from_str(json).unwrap();
        let cfg = config(method);
        let got = merge_weights(&cfg, &inputs(&cfg)).unwrap();
        assert_eq!(got.len(), want.len(), "{method}");
        for (name, [sum, sq]) in &want {
            let t = got[name].to_dtype(DType::F64).unwrap();
            assert_eq!(got[name].dtype(), DType::F32, "{method} {name}");
            let s = t.sum_all().unwrap().to_scalar::<f64>().unwrap();
            let q = t
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap();
            assert!(
                (s - sum).abs() < 1e-6 && (q - sq).abs() < 1e-6,
                "{method} {name}: sum {s} vs mergekit's {sum}, squares {q} vs {sq}"
            );
        }
        seen += 1;
    }
    assert_eq!(seen, 5);
}

/// Properties: a linear merge of one model with itself is that model; task arithmetic with
/// λ 0 is the base; TIES at density 1 of one model over a base is that model (its deltas
/// elect their own signs); slerp at t 0 and 1 gives its ends; DARE keeps about `density` of
/// each delta, rescaled to the delta's L1 norm, and the same seed gives the same merge.
#[test]
fn the_methods_meet_their_ends() {
    let (a, b) = (weights(1), weights(2));
    let same = |x: &HashMap<String, Tensor>, y: &HashMap<String, Tensor>, tol: f64| {
        for (k, t) in x {
            let d = (t - &y[k])
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(f64::from(d) <= tol, "{k}: {d}");
        }
    };
    let cfg = |v: serde_json::Value| -> MergeConfig { serde_json::from_value(v).unwrap() };
    let lin = cfg(serde_json::json!({"merge_method": "linear", "models": [
        {"model": "a", "parameters": {"weight": 0.3}}, {"model": "a", "parameters": {"weight": 2.0}}]}));
    same(
        &merge_weights(&lin, &[a.clone(), a.clone()]).unwrap(),
        &a,
        1e-7,
    );
    let ta = cfg(
        serde_json::json!({"merge_method": "task_arithmetic", "base_model": "a",
        "models": [{"model": "b", "parameters": {"weight": 1.0}}], "parameters": {"lambda": 0.0}}),
    );
    same(
        &merge_weights(&ta, &[b.clone(), a.clone()]).unwrap(),
        &a,
        0.0,
    );
    let ties = cfg(
        serde_json::json!({"merge_method": "ties", "base_model": "a",
        "models": [{"model": "b", "parameters": {"weight": 0.5}}]}),
    );
    same(
        &merge_weights(&ties, &[b.clone(), a.clone()]).unwrap(),
        &b,
        1e-7,
    );
    for (t, end) in [(0.0, &a), (1.0, &b)] {
        let s = cfg(
            serde_json::json!({"merge_method": "slerp", "base_model": "a",
            "models": [{"model": "b"}], "parameters": {"t": t}}),
        );
        same(
            &merge_weights(&s, &[b.clone(), a.clone()]).unwrap(),
            end,
            1e-6,
        );
    }
    // DARE on a large delta: the kept share and the L1 norm.
    let big = |m: f32| -> HashMap<String, Tensor> {
        let v: Vec<f32> = (0..20_000).map(|j| m * ((j as f32) * 0.37).sin()).collect();
        HashMap::from([(
            "w".to_string(),
            Tensor::from_vec(v, 20_000, &Device::Cpu).unwrap(),
        )])
    };
    let dare = |seed: u64| -> MergeConfig {
        cfg(
            serde_json::json!({"merge_method": "dare_linear", "base_model": "z",
            "models": [{"model": "x", "parameters": {"weight": 1.0, "density": 0.3}}],
            "random_seed": seed}),
        )
    };
    let (x, z) = (big(1.0), big(0.0));
    let m = merge_weights(&dare(7), &[x.clone(), z.clone()]).unwrap();
    let v: Vec<f32> = m["w"].to_vec1().unwrap();
    let xv: Vec<f32> = x["w"].to_vec1().unwrap();
    let kept = v.iter().filter(|&&e| e != 0.0).count() as f64 / v.len() as f64;
    assert!((kept - 0.3).abs() < 0.02, "kept {kept}");
    let l1 = |s: &[f32]| s.iter().map(|e| f64::from(e.abs())).sum::<f64>();
    assert!((l1(&v) / l1(&xv) - 1.0).abs() < 1e-5);
    let again = merge_weights(&dare(7), &[x.clone(), z.clone()]).unwrap();
    same(&m, &again, 0.0);
    let other = merge_weights(&dare(8), &[x, z]).unwrap();
    assert!(other["w"].to_vec1::<f32>().unwrap() != v);
}

#[test]
fn what_a_merge_cannot_take_is_refused() {
    let a = weights(1);
    let cfg = |v: serde_json::Value| -> MergeConfig { serde_json::from_value(v).unwrap() };
    let cases = [
        (
            serde_json::json!({"merge_method": "ties", "models": [{"model": "a"}]}),
            "`ties` needs `base_model`",
        ),
        (
            serde_json::json!({"merge_method": "linear", "models": [{"model": "a", "parameters": {"density": 0.5, "weight": 1.0}}]}),
            "`density` in a model's parameters is not a parameter of `linear`",
        ),
        (
            serde_json::json!({"merge_method": "slerp", "base_model": "a", "models": [{"model": "b"}, {"model": "c"}], "parameters": {"t": 0.5}}),
            "exactly one other model",
        ),
        (
            serde_json::json!({"merge_method": "linear", "models": [{"model": "a"}]}),
            "has no `weight`",
        ),
        (
            serde_json::json!({"merge_method": "linear", "models": [{"model": "a", "parameters": {"weight": 1.0}}], "dtype": "int4"}),
            "unknown dtype `int4`",
        ),
    ];
    for (v, want) in cases {
        let c = cfg(v);
        let n = c.models.len()
            + usize::from(
                c.base_model.is_some()
                    && !c
                        .models
                        .iter()
                        .any(|m| Some(&m.model) == c.base_model.as_ref()),
            );
        let e = merge_weights(&c, &vec![a.clone(); n])
            .unwrap_err()
            .to_string();
        assert!(e.contains(want), "{e}");
    }
    // A tensor missing from one model, or of another shape, is named.
    let mut b = a.clone();
    b.remove("model.norm.weight");
    let lin = cfg(serde_json::json!({"merge_method": "linear", "models": [
        {"model": "a", "parameters": {"weight": 1.0}}, {"model": "b", "parameters": {"weight": 1.0}}]}));
    let e = merge_weights(&lin, &[a.clone(), b])
        .unwrap_err()
        .to_string();
    assert!(e.contains("`model.norm.weight` is missing from b"), "{e}");
    let mut c = a.clone();
    c.insert(
        "model.norm.weight".into(),
        Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap(),
    );
    let e = merge_weights(&lin, &[a, c]).unwrap_err().to_string();
    assert!(
        e.contains("`model.norm.weight` is [3] in b but [4] in a"),
        "{e}"
    );
    let bad: Result<MergeConfig, _> =
        serde_json::from_value(serde_json::json!({"merge_method": "karcher", "models": []}));
    assert!(bad.is_err());
}
