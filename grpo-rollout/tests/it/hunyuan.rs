//! Tencent Hunyuan dense (`hunyuan_v1_dense`) against transformers: q/k norms after RoPE (with
//! weights, drawn around 1 so that their order shows), the fixed NTK `alpha` RoPE.
//!
//! Reference values: `fixtures/hunyuan_reference.json` and the micro model
//! `fixtures/hunyuan-micro` (3 layers, tied), written by `scripts/gen_hunyuan_reference.py`
//! (transformers 5.24, float32, eager attention): log-probs of the last `t` tokens of two
//! left-padded rows, the gradient of their sum for layer 1's q/k norms, a greedy continuation.
#![allow(clippy::unwrap_used, missing_docs)]

use crate::common;

use std::path::Path;

use candle_core::{DType, Device};
use common::{fixtures, max_diff_f64 as max_diff, padded_logprobs as logprobs, to_f64, var_grad};
use grpo_rollout::config::Arch;
use serde_json::Value;

fn reference() -> Value {
    common::reference("hunyuan_reference.json")
}

fn load(dtype: DType) -> grpo_rollout::LoadedModel {
    grpo_rollout::load(&fixtures().join("hunyuan-micro"), dtype, &Device::Cpu).unwrap()
}

#[test]
fn logprobs_gradients_and_decoding_match_transformers() {
    let r = reference();
    let m = load(DType::F32);
    assert_eq!(m.model.cfg.arch, Arch::HunyuanDense);
    // The NTK alpha read as the base it makes: 10000 · 1000^(8/6).
    let want_theta = 10_000.0 * 1000f64.powf(8.0 / 6.0);
    assert!((m.model.cfg.rope_theta - want_theta).abs() < 1e-6 * want_theta);
    assert!(m.model.cfg.rope_scaling.is_none());
    let want: Vec<f64> = serde_json::from_value::<Vec<Vec<f64>>>(r["logprobs"].clone())
        .unwrap()
        .concat();
    let d = max_diff(&to_f64(&logprobs(&m.model, &r)), &want);
    assert!(d < 2e-5, "{d}");
    for checkpointing in [false, true] {
        let mut tm = grpo_rollout::TrainableModel::full(&m.model).unwrap();
        if checkpointing {
            tm.model.enable_gradient_checkpointing();
        }
        let loss = logprobs(&tm.model, &r).sum_all().unwrap();
        let grads = tm.model.backward(&loss).unwrap();
        for (file, ours) in [("query_layernorm", "q_norm"), ("key_layernorm", "k_norm")] {
            let g: Vec<f64> = serde_json::from_value(
                r["grads"][format!("model.layers.1.self_attn.{file}.weight")].clone(),
            )
            .unwrap();
            let got = var_grad(
                &tm,
                &grads,
                &format!("model.layers.1.self_attn.{ours}.weight"),
            );
            let scale = g.iter().fold(0f64, |m, x| m.max(x.abs()));
            let d = max_diff(&got, &g);
            assert!(
                d <= 1e-4 * scale.max(1.0),
                "{ours} ({checkpointing}): {d} of {scale}"
            );
        }
    }
    let prompt: Vec<u32> = serde_json::from_value(r["prompt"].clone()).unwrap();
    let greedy: Vec<u32> = serde_json::from_value(r["greedy"].clone()).unwrap();
    assert_eq!(common::greedy(&m, &prompt, greedy.len()), greedy);
}

/// Saved, the files hold the norms under Hunyuan's names and read back to the same model; as
/// llama.cpp's `hunyuan-dense` GGUF (the NTK alpha in `rope.freq_base`, as its converter writes
/// it) too.
#[test]
fn saves_under_its_names_and_as_gguf() {
    let r = reference();
    let m = load(DType::F32);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("h");
    grpo_rollout::save_hf_dir(&m.model, &m.tokenizer, &out, DType::F32).unwrap();
    let names = |d: &Path| {
        let t = candle_core::safetensors::load(d.join("model.safetensors"), &Device::Cpu).unwrap();
        let mut k: Vec<String> = t.keys().cloned().collect();
        k.sort();
        k
    };
    assert_eq!(names(&out), names(&fixtures().join("hunyuan-micro")));
    let back = grpo_rollout::load(&out, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(back.model.cfg, m.model.cfg);
    let d = max_diff(
        &to_f64(&logprobs(&back.model, &r)),
        &to_f64(&logprobs(&m.model, &r)),
    );
    assert_eq!(d, 0.0);
    let path = dir.path().join("h.gguf");
    grpo_rollout::gguf::save_gguf(
        &m.model,
        &m.tokenizer,
        &path,
        grpo_rollout::gguf::GgufType::F32,
        "h",
    )
    .unwrap();
    let g = grpo_rollout::load(&path, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(g.model.cfg.arch, Arch::HunyuanDense);
    // The base as an f32 key.
    let theta = m.model.cfg.rope_theta;
    assert!((g.model.cfg.rope_theta - theta).abs() < 1e-6 * theta);
    assert_eq!(g.model.cfg.head_dim, m.model.cfg.head_dim);
    let d = max_diff(
        &to_f64(&logprobs(&g.model, &r)),
        &to_f64(&logprobs(&m.model, &r)),
    );
    assert!(d < 1e-6, "{d}");
    // Biases llama.cpp's graph does not add are refused by name.
    let mut biased = m.model.cfg.clone();
    biased.attention_bias = true;
    let b = grpo_rollout::init::random_weights(&biased, 1, DType::F32, &Device::Cpu).unwrap();
    let e = grpo_rollout::gguf::save_gguf(
        &b,
        &m.tokenizer,
        &dir.path().join("b.gguf"),
        grpo_rollout::gguf::GgufType::F32,
        "b",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("Hunyuan with attention_bias"), "{e}");
}
