//! Qwen3.5 (`qwen3_5_text`) against transformers: linear-attention layers (the gated delta
//! rule over more than one 64-position chunk, a causal convolution, two key heads serving four
//! value heads), gated full attention with RoPE on a quarter of each head, `1 + w` norms.
//!
//! Reference values: `fixtures/qwen3_5_reference.json` and the micro model
//! `fixtures/qwen3_5-micro` (4 layers: linear, full, linear, full; tied), written by
//! `scripts/gen_qwen3_5_reference.py` (transformers 5.24, float32, eager attention): log-probs
//! of the last `t` tokens of two left-padded rows of 90 and 57 tokens, the gradient of their
//! sum for one weight of each kind, a greedy continuation through transformers' cache.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use common::{fixtures, max_diff_f64 as max_diff, padded_logprobs as logprobs, to_f64, var_grad};
use grpo_rollout::config::Arch;
use serde_json::Value;

fn reference() -> Value {
    common::reference("qwen3_5_reference.json")
}

fn load(dtype: DType) -> grpo_rollout::LoadedModel {
    grpo_rollout::load(&fixtures().join("qwen3_5-micro"), dtype, &Device::Cpu).unwrap()
}

fn want_logprobs(r: &Value) -> Vec<f64> {
    serde_json::from_value::<Vec<Vec<f64>>>(r["logprobs"].clone())
        .unwrap()
        .concat()
}

#[test]
fn logprobs_gradients_and_decoding_match_transformers() {
    let r = reference();
    let m = load(DType::F32);
    let cfg = &m.model.cfg;
    assert_eq!(cfg.arch, Arch::Qwen3_5);
    assert_eq!(cfg.linear_attention.as_ref().unwrap().layers, vec![0, 2]);
    assert_eq!(cfg.rotary_dim(), 4);
    // Rounding apart (see `float64_equals_transformers_in_float64`).
    let d = max_diff(&to_f64(&logprobs(&m.model, &r)), &want_logprobs(&r));
    assert!(d < 3e-4, "{d}");
    check_grads(&m.model, &r, "grads", 5e-3);
    let prompt: Vec<u32> = serde_json::from_value(r["prompt"].clone()).unwrap();
    let greedy: Vec<u32> = serde_json::from_value(r["greedy"].clone()).unwrap();
    assert_eq!(common::greedy(&m, &prompt, greedy.len()), greedy);
}

/// The gradients of the padded rows' log-prob sum against the reference's `key` (transformers'
/// layout: q rows mapped to the model's), with and without gradient checkpointing, within
/// `tol` of each tensor's largest entry.
fn check_grads(model: &grpo_rollout::Transformer, r: &Value, key: &str, tol: f64) {
    let cfg = &model.cfg;
    for checkpointing in [false, true] {
        let mut tm = grpo_rollout::TrainableModel::full(model).unwrap();
        if checkpointing {
            tm.model.enable_gradient_checkpointing();
        }
        let loss = logprobs(&tm.model, r).sum_all().unwrap();
        let grads = tm.model.backward(&loss).unwrap();
        let Value::Object(want) = &r[key] else {
            panic!("{key}")
        };
        for (name, g) in want {
            let g: Vec<f64> = serde_json::from_value(g.clone()).unwrap();
            // The model's q rows: gate rows apart, heads reordered for the partial RoPE.
            let g = match name {
                n if n.ends_with("q_proj.weight") || n.ends_with("q_norm.weight") => {
                    let cols = if n.ends_with("q_norm.weight") {
                        1
                    } else {
                        cfg.hidden_size
                    };
                    let t =
                        Tensor::from_vec(g.clone(), (g.len() / cols, cols), &Device::Cpu).unwrap();
                    let t = match n.ends_with("q_proj.weight") {
                        true => grpo_rollout::layout::q_rows(cfg, &t, true).unwrap(),
                        false => grpo_rollout::layout::reorder_heads(cfg, &t, true).unwrap(),
                    };
                    to_f64(&t)
                }
                _ => g,
            };
            let got = var_grad(&tm, &grads, name);
            let scale = g.iter().fold(0f64, |m, x| m.max(x.abs()));
            let d = max_diff(&got, &g);
            assert!(
                d <= tol * scale.max(1.0),
                "{key} {name} ({checkpointing}): {d} of {scale}"
            );
        }
    }
}

/// Saved, the files hold transformers' names and layout (the gate rows back between each
/// head's query rows) and read back to the same model.
#[test]
fn saves_in_its_files_layout() {
    let r = reference();
    let m = load(DType::F32);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("q");
    grpo_rollout::save_hf_dir(&m.model, &m.tokenizer, &out, DType::F32).unwrap();
    let tensors = |d: &Path| {
        candle_core::safetensors::load(d.join("model.safetensors"), &Device::Cpu).unwrap()
    };
    let (ours, theirs) = (tensors(&out), tensors(&fixtures().join("qwen3_5-micro")));
    let mut names: Vec<&String> = ours.keys().collect();
    names.sort();
    let mut want: Vec<&String> = theirs.keys().collect();
    want.sort();
    assert_eq!(names, want);
    for (k, t) in &theirs {
        let d = (t - &ours[k]).unwrap().abs().unwrap().max_all().unwrap();
        assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0, "{k}");
    }
    let back = grpo_rollout::load(&out, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(back.model.cfg, m.model.cfg);
    let d = max_diff(
        &to_f64(&logprobs(&back.model, &r)),
        &to_f64(&logprobs(&m.model, &r)),
    );
    assert_eq!(d, 0.0);
}

/// In float64 the model equals transformers' computed in float64 throughout (each row alone):
/// the float32 runs differ by rounding only — the random micro model's decays reach
/// `exp(−16 · softplus(·))` per position, where the two chunk algorithms' orders of rounding
/// part by ~1e-4 (transformers' own padded and unpadded rows by 3.6e-5).
#[test]
fn float64_equals_transformers_in_float64() {
    let r = reference();
    let m = load(DType::F64);
    let rows: Vec<Vec<u32>> = serde_json::from_value(r["rows"].clone()).unwrap();
    let want: Vec<Vec<f64>> = serde_json::from_value(r["alone_f64"].clone()).unwrap();
    let t = r["t"].as_u64().unwrap() as usize;
    for (row, want) in rows.iter().zip(&want) {
        let (ids, mask) =
            grpo_rollout::generate::left_pad(std::slice::from_ref(row), 0, &Device::Cpu).unwrap();
        let got = m
            .model
            .completion_logprobs(&ids, &mask, t, 1.0, false)
            .unwrap()
            .0;
        let d = max_diff(&to_f64(&got), want);
        assert!(d < 1e-6, "{d}");
    }
    // The padded batch: each row as alone.
    let got = to_f64(&logprobs(&m.model, &r));
    let d = max_diff(&got, &want.concat());
    assert!(d < 1e-6, "padded: {d}");
    check_grads(&m.model, &r, "grads_f64", 1e-6);
    // bf16 as far from float64 as transformers' bf16 is from its float32 (1.76 here: this
    // random model's scores and decays are large).
    let b = load(DType::BF16);
    let d = max_diff(&to_f64(&logprobs(&b.model, &r)), &want.concat());
    let theirs = r["bf16_deviation"].as_f64().unwrap();
    assert!(d < 1.5 * theirs, "bf16: {d} (transformers' {theirs})");
}

/// A PEFT 0.21 adapter on every linear map (`all-linear`: the linear layers' `in_proj_*` and
/// `out_proj`, the gated `q_proj` whose `B` rows interleave each head's query and gate rows,
/// k, v, o, the MLPs'; `fixtures/qwen3_5-micro-peft`, random factors) loads with PEFT's
/// adapted log-probs, merges into the same model, and our own `all-linear` adapts and names the
/// same modules, with tensors of PEFT's names and shapes.
#[test]
fn peft_all_linear_adapter_matches_peft() {
    let r = reference();
    let mut m = load(DType::F32);
    let peft = fixtures().join("qwen3_5-micro-peft");
    grpo_rollout::lora::load_peft(&mut m.model, &peft).unwrap();
    let want: Vec<f64> = serde_json::from_value::<Vec<Vec<f64>>>(r["peft_logprobs"].clone())
        .unwrap()
        .concat();
    let got = to_f64(&logprobs(&m.model, &r));
    let d = max_diff(&got, &want);
    assert!(d < 3e-4, "{d}");
    let base = load(DType::F32);
    assert!(max_diff(&to_f64(&logprobs(&base.model, &r)), &want) > 1e-2);
    let merged = grpo_rollout::lora::merge(&m.model).unwrap();
    assert!(!merged.layers.iter().any(|l| l.has_adapters()));
    assert!(max_diff(&to_f64(&logprobs(&merged, &r)), &got) < 1e-4);
    let lcfg = grpo_rollout::lora::LoraConfig {
        target_modules: grpo_rollout::lora::TargetModules::Pattern("all-linear".into()),
        r: 2,
        ..Default::default()
    };
    let tm = grpo_rollout::TrainableModel::lora(&base.model, &lcfg, 3).unwrap();
    let dir = tempfile::tempdir().unwrap();
    grpo_rollout::lora::save_peft(&tm.model, tm.lora.as_ref().unwrap(), dir.path(), "base")
        .unwrap();
    let targets = |d: &Path| -> Vec<String> {
        let v: Value =
            serde_json::from_str(&std::fs::read_to_string(d.join("adapter_config.json")).unwrap())
                .unwrap();
        let mut t: Vec<String> = serde_json::from_value(v["target_modules"].clone()).unwrap();
        t.sort();
        t
    };
    assert_eq!(targets(dir.path()), targets(&peft));
    let tensors = |d: &Path| {
        candle_core::safetensors::load(d.join("adapter_model.safetensors"), &Device::Cpu).unwrap()
    };
    let (ours, theirs) = (tensors(dir.path()), tensors(&peft));
    let mut k: Vec<&String> = ours.keys().collect();
    k.sort();
    let mut want_k: Vec<&String> = theirs.keys().collect();
    want_k.sort();
    assert_eq!(k, want_k);
    for (name, t) in &theirs {
        assert_eq!(t.dims(), ours[name].dims(), "{name}");
    }
}

/// The released checkpoints' `qwen3_5` config (the language model's fields in `text_config`)
/// reads as its `qwen3_5_text`.
#[test]
fn reads_the_vision_language_config() {
    let path = fixtures().join("qwen3_5-micro/config.json");
    let text: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let vl = serde_json::json!({
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": text,
        "vision_config": {"model_type": "qwen3_5", "depth": 2},
        "tie_word_embeddings": true,
    });
    let a = grpo_rollout::config::ModelConfig::from_hf_json(&vl).unwrap();
    let b = grpo_rollout::config::ModelConfig::from_hf_file(&path).unwrap();
    assert_eq!(a, b);
}

/// Written as llama.cpp's `qwen35` (the linear layers under its `ssm_*` names, `A = −exp(A_log)`,
/// the value heads tiled over the key heads, `1 + w` norms as `1 + w`) and read back: the same
/// model. llama.cpp's own converter's file of the micro model
/// (`scripts/gen_qwen3_5_gguf_fixture.py`) reads as the Hugging Face directory.
#[test]
fn gguf_round_trips_and_reads_llama_cpps_file() {
    let r = reference();
    let m = load(DType::F32);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("q.gguf");
    let written = grpo_rollout::gguf::save_gguf(
        &m.model,
        &m.tokenizer,
        &path,
        grpo_rollout::gguf::GgufType::F32,
        "q",
    )
    .unwrap();
    assert!(written.iter().any(|(n, _)| n == "blk.0.ssm_a"));
    let want = to_f64(&logprobs(&m.model, &r));
    let text = "Hello world, 12345 tokens\n and more";
    for f in [path, fixtures().join("qwen3_5-micro-llama.gguf")] {
        let back = grpo_rollout::load(&f, DType::F32, &Device::Cpu).unwrap();
        let (a, b) = (&back.model.cfg, &m.model.cfg);
        assert_eq!(a.linear_attention, b.linear_attention, "{f:?}");
        assert_eq!(
            (a.arch, a.rotary_dim(), a.head_dim, a.num_key_value_heads),
            (b.arch, b.rotary_dim(), b.head_dim, b.num_key_value_heads),
            "{f:?}"
        );
        assert_eq!(
            (a.rope_theta, a.rms_norm_eps, a.tie_word_embeddings),
            (b.rope_theta, b.rms_norm_eps, b.tie_word_embeddings),
            "{f:?}"
        );
        assert_eq!(
            back.tokenizer.encode(text, false).unwrap(),
            m.tokenizer.encode(text, false).unwrap()
        );
        // (`A_log` goes through `−exp` and back in float32: 0 measured.)
        let d = max_diff(&to_f64(&logprobs(&back.model, &r)), &want);
        assert!(d < 1e-6, "{f:?}: {d}");
    }
}

/// Layers in no fixed pattern, as many value heads as key heads, untied, quantised: the list of
/// recurrent layers goes in the file, the convolution stays f32 (llama.cpp's `ssm_conv` reads
/// it so), the matrices q8_0 within their rounding. Widths llama.cpp reads as one (its value
/// heads are as wide as its keys) are refused by name.
#[test]
fn gguf_keeps_any_layer_pattern_and_refuses_what_llama_cpp_reads_otherwise() {
    use grpo_rollout::gguf::{GgufType, save_gguf};
    let tok = load(DType::F32).tokenizer;
    let mut c = grpo_rollout::init::preset_config(
        grpo_rollout::init::Preset::Tiny,
        Arch::Qwen3_5,
        300,
        2,
        0,
    );
    c.num_hidden_layers = 5;
    c.tie_word_embeddings = false;
    {
        let d = c.linear_attention.as_mut().unwrap();
        d.layers = vec![0, 1, 3];
        d.value_heads = d.key_heads;
    }
    let m = grpo_rollout::init::random_weights(&c, 3, DType::F32, &Device::Cpu).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let rows = [vec![5u32, 9, 40, 7, 7, 100, 3, 250, 11, 12, 13]];
    let lp = |m: &grpo_rollout::Transformer| {
        let (ids, mask) = grpo_rollout::generate::left_pad(&rows, 0, &Device::Cpu).unwrap();
        let lp = m
            .completion_logprobs(&ids, &mask, 10, 1.0, false)
            .unwrap()
            .0;
        to_f64(&lp)
    };
    let want = lp(&m);
    for (ty, tol) in [(GgufType::F32, 1e-6), (GgufType::Q8_0, 0.02)] {
        let path = dir.path().join(format!("{ty:?}.gguf"));
        let written = save_gguf(&m, &tok, &path, ty, "q").unwrap();
        for (name, kind) in &written {
            if name.ends_with("ssm_conv1d.weight") {
                assert_eq!(kind, "F32", "{name}");
            }
        }
        let back = grpo_rollout::load(&path, DType::F32, &Device::Cpu).unwrap();
        assert_eq!(back.model.cfg.linear_attention, m.cfg.linear_attention);
        assert!(!back.model.cfg.tie_word_embeddings);
        let d = max_diff(&lp(&back.model), &want);
        assert!(d < tol, "{ty:?}: {d}");
    }
    let mut wide = c.clone();
    wide.linear_attention.as_mut().unwrap().value_dim *= 2;
    let m = grpo_rollout::init::random_weights(&wide, 3, DType::F32, &Device::Cpu).unwrap();
    let e = save_gguf(&m, &tok, &dir.path().join("w.gguf"), GgufType::F32, "w")
        .unwrap_err()
        .to_string();
    assert!(e.contains("linear_value_head_dim"), "{e}");
}
