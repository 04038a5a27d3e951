//! Qwen3.5 (`qwen3_5_text`) against transformers: linear-attention layers (the gated delta
//! rule over more than one 64-position chunk, a causal convolution, two key heads serving four
//! value heads), gated full attention with RoPE on a quarter of each head, `1 + w` norms.
//!
//! Reference values: `fixtures/qwen3_5_reference.json` and the micro model
//! `fixtures/qwen3_5-micro` (4 layers: linear, full, linear, full; tied), written by
//! `scripts/gen_qwen3_5_reference.py` (transformers 5.24, float32, eager attention): log-probs
//! of the last `t` tokens of two left-padded rows of 90 and 57 tokens, the gradient of their
//! sum for one weight of each kind, a greedy continuation through transformers' cache. Its
//! mixture of experts (`qwen3_5_moe_text`) likewise: `fixtures/qwen3_5_moe-micro` (full, linear,
//! linear, full; 4 experts of which 2 per token and a gated shared expert in every layer;
//! untied) and `fixtures/qwen3_5_moe_reference.json` from `scripts/gen_qwen3_5_moe_reference.py`,
//! with the load-balancing loss and its router gradients.
#![allow(clippy::unwrap_used, missing_docs)]

use crate::common;

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use common::{fixtures, max_diff_f64 as max_diff, padded_logprobs as logprobs, to_f64, var_grad};
use grpo_rollout::config::Arch;
use serde_json::Value;

/// The micro models: Qwen3.5 and its mixture of experts.
const MODELS: [&str; 2] = ["qwen3_5-micro", "qwen3_5_moe-micro"];

/// A micro model's reference values (`qwen3_5_reference.json` of `qwen3_5-micro`).
fn reference_of(model: &str) -> Value {
    common::reference(&format!(
        "{}_reference.json",
        model.trim_end_matches("-micro")
    ))
}

fn load_model(model: &str, dtype: DType) -> grpo_rollout::LoadedModel {
    grpo_rollout::load(&fixtures().join(model), dtype, &Device::Cpu).unwrap()
}

fn load(dtype: DType) -> grpo_rollout::LoadedModel {
    load_model(MODELS[0], dtype)
}

fn want_logprobs(r: &Value) -> Vec<f64> {
    serde_json::from_value::<Vec<Vec<f64>>>(r["logprobs"].clone())
        .unwrap()
        .concat()
}

#[test]
fn logprobs_gradients_and_decoding_match_transformers() {
    for (model, arch, linear) in [
        (MODELS[0], Arch::Qwen3_5, vec![0, 2]),
        (MODELS[1], Arch::Qwen3_5Moe, vec![1, 2]),
    ] {
        let r = reference_of(model);
        let m = load_model(model, DType::F32);
        let cfg = &m.model.cfg;
        assert_eq!(cfg.arch, arch);
        assert_eq!(cfg.linear_attention.as_ref().unwrap().layers, linear);
        assert_eq!(cfg.rotary_dim(), 4);
        assert_eq!(
            m.model.layers.iter().all(|l| l.moe.is_some()),
            cfg.moe.is_some()
        );
        // Rounding apart (see `float64_equals_transformers_in_float64`): within twice
        // transformers' own float32 rows' distance from float64 (8.5e-5 and 5.1e-4 here).
        let own: Vec<Vec<f64>> = serde_json::from_value(r["alone_f64"].clone()).unwrap();
        let own = max_diff(&want_logprobs(&r), &own.concat());
        let d = max_diff(&to_f64(&logprobs(&m.model, &r)), &want_logprobs(&r));
        assert!(
            d < 2.0 * own,
            "{model}: {d} (transformers' float32 {own} from float64)"
        );
        check_grads(&m.model, &r, "grads", 5e-3);
        let prompt: Vec<u32> = serde_json::from_value(r["prompt"].clone()).unwrap();
        let greedy: Vec<u32> = serde_json::from_value(r["greedy"].clone()).unwrap();
        assert_eq!(common::greedy(&m, &prompt, greedy.len()), greedy, "{model}");
    }
}

/// The gradients of the padded rows' log-prob sum against the reference's `key` (transformers'
/// layout: q rows mapped to the model's), with and without gradient checkpointing, within
/// `tol` of each tensor's largest entry.
fn check_grads(model: &grpo_rollout::Transformer, r: &Value, key: &str, tol: f64) {
    let cfg = &model.cfg;
    let experts = cfg.moe.as_ref().map_or(1, |m| m.num_experts);
    common::check_grads(model, r, key, tol, &|name, g| {
        // transformers' fused experts: each expert's maps apart in the model.
        if let Some(parts) = common::fused_expert_grads(name, &g, experts) {
            return parts;
        }
        // The model's q rows: gate rows apart, heads reordered for the partial RoPE.
        let g = match name {
            n if n.ends_with("q_proj.weight") || n.ends_with("q_norm.weight") => {
                let cols = if n.ends_with("q_norm.weight") {
                    1
                } else {
                    cfg.hidden_size
                };
                let t = Tensor::from_vec(g.clone(), (g.len() / cols, cols), &Device::Cpu).unwrap();
                let t = match n.ends_with("q_proj.weight") {
                    true => grpo_rollout::layout::q_rows(cfg, &t, true).unwrap(),
                    false => grpo_rollout::layout::reorder_heads(cfg, &t, true).unwrap(),
                };
                to_f64(&t)
            }
            _ => g,
        };
        vec![(name.to_string(), g)]
    });
}

/// Saved, the files hold transformers' names and layout (the gate rows back between each
/// head's query rows) and read back to the same model.
#[test]
fn saves_in_its_files_layout() {
    for model in MODELS {
        saves_in_its_files_layout_of(model);
    }
}

fn saves_in_its_files_layout_of(model: &str) {
    let r = reference_of(model);
    let m = load_model(model, DType::F32);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("q");
    grpo_rollout::save_hf_dir(&m.model, &m.tokenizer, &out, DType::F32).unwrap();
    let tensors = |d: &Path| {
        candle_core::safetensors::load(d.join("model.safetensors"), &Device::Cpu).unwrap()
    };
    let (ours, theirs) = (tensors(&out), tensors(&fixtures().join(model)));
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
    for model in MODELS {
        float64_equals_transformers_in_float64_of(model);
    }
}

fn float64_equals_transformers_in_float64_of(model: &str) {
    let r = reference_of(model);
    // The RoPE angles' cos and sin are float32 on both sides (as transformers computes them at
    // any dtype), rounded by two libraries: the MoE model is sensitive enough that their last
    // bit shows — one ulp on 30% of them moves transformers' own float64 log-probs by 3.5e-5
    // and the experts' gradients by 1.5e-5 of their largest; 4.5e-6 and 1.1e-5 measured here.
    let tol = if model == MODELS[1] { 2e-5 } else { 1e-6 };
    let m = load_model(model, DType::F64);
    let want: Vec<Vec<f64>> = serde_json::from_value(r["alone_f64"].clone()).unwrap();
    for (got, want) in common::logprobs_alone(&m.model, &r).iter().zip(&want) {
        let d = max_diff(got, want);
        assert!(d < tol, "{model}: {d}");
    }
    // The padded batch: each row as alone.
    let got = to_f64(&logprobs(&m.model, &r));
    let d = max_diff(&got, &want.concat());
    assert!(d < tol, "{model} padded: {d}");
    check_grads(&m.model, &r, "grads_f64", tol);
    // bf16 as far from float64 as transformers' bf16 is from its float32 (1.76 here: this
    // random model's scores and decays are large).
    let b = load_model(model, DType::BF16);
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
    for model in MODELS {
        peft_all_linear_adapter_matches_peft_of(model);
    }
}

fn peft_all_linear_adapter_matches_peft_of(model: &str) {
    let r = reference_of(model);
    let mut m = load_model(model, DType::F32);
    let peft = fixtures().join(format!("{model}-peft"));
    grpo_rollout::lora::load_peft(&mut m.model, &peft).unwrap();
    let want: Vec<f64> = serde_json::from_value::<Vec<Vec<f64>>>(r["peft_logprobs"].clone())
        .unwrap()
        .concat();
    let got = to_f64(&logprobs(&m.model, &r));
    let d = max_diff(&got, &want);
    assert!(d < 3e-4, "{d}");
    let base = load_model(model, DType::F32);
    assert!(max_diff(&to_f64(&logprobs(&base.model, &r)), &want) > 1e-2);
    let merged = grpo_rollout::lora::merge(&m.model).unwrap();
    assert!(!merged.layers.iter().any(|l| l.has_adapters()));
    assert!(max_diff(&to_f64(&logprobs(&merged, &r)), &got) < 1e-4);
    common::all_linear_like_peft(&base.model, &peft);
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
/// (`scripts/gen_recurrent_gguf_fixtures.py`) reads as the Hugging Face directory.
#[test]
fn gguf_round_trips_and_reads_llama_cpps_file() {
    for model in MODELS {
        gguf_round_trips_and_reads_llama_cpps_file_of(model);
    }
}

fn gguf_round_trips_and_reads_llama_cpps_file_of(model: &str) {
    let r = reference_of(model);
    let m = load_model(model, DType::F32);
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
    assert!(written.iter().any(|(n, _)| n == "blk.2.ssm_a"));
    let want = to_f64(&logprobs(&m.model, &r));
    let text = "Hello world, 12345 tokens\n and more";
    for f in [path, fixtures().join(format!("{model}-llama.gguf"))] {
        let back = grpo_rollout::load(&f, DType::F32, &Device::Cpu).unwrap();
        let (a, b) = (&back.model.cfg, &m.model.cfg);
        // (A GGUF file holds no load-balancing coefficient: transformers' default is read.)
        let mut moe = a.moe.clone();
        if let (Some(x), Some(y)) = (moe.as_mut(), &b.moe) {
            assert_eq!(x.router_aux_loss_coef, 0.001);
            x.router_aux_loss_coef = y.router_aux_loss_coef;
        }
        assert_eq!(
            (&a.linear_attention, &moe),
            (&b.linear_attention, &b.moe),
            "{f:?}"
        );
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

/// Qwen3.5's MoE: the load-balancing loss over the padded rows (what TRL adds times
/// `router_aux_loss_coef`) and its gradient into each layer's router, as transformers'
/// `aux_loss` with the attention mask given; with and without gradient checkpointing.
#[test]
fn moe_load_balancing_loss_matches_transformers() {
    use grpo_rollout::moe::{AuxCollector, MoeNames, recording};
    let r = reference_of(MODELS[1]);
    let m = load_model(MODELS[1], DType::F32);
    let names = MoeNames::of(m.model.cfg.arch);
    let want = r["aux_loss"].as_f64().unwrap();
    for checkpointing in [false, true] {
        let mut tm = grpo_rollout::TrainableModel::full(&m.model).unwrap();
        if checkpointing {
            tm.model.enable_gradient_checkpointing();
        }
        let c = AuxCollector::new(1.0);
        let lp = recording(Some(c.clone()), || logprobs(&tm.model, &r));
        // The log-probs enter times 0: the aux loss's gradient alone.
        let zero = Tensor::zeros((), lp.dtype(), lp.device()).unwrap();
        let loss = lp.sum_all().unwrap().broadcast_mul(&zero).unwrap();
        let grads = tm.model.backward(&loss).unwrap();
        assert!(
            (c.loss() - want).abs() < 1e-5 * want,
            "{checkpointing}: {} vs {want}",
            c.loss()
        );
        for i in 0..4 {
            let g: Vec<f64> =
                serde_json::from_value(r["aux_grads"][i.to_string()].clone()).unwrap();
            let got = var_grad(&tm, &grads, &names.router(i));
            common::close(&got, &g, 1e-4, &format!("router {i} ({checkpointing})"));
        }
    }
}

/// A checkpoint whose experts are fused as transformers 5 holds them (`mlp.experts.gate_up_proj`
/// `(experts, 2 · width, hidden)`, `mlp.experts.down_proj`) reads as the same model as the one
/// with each expert apart (as transformers writes them).
#[test]
fn reads_fused_experts() {
    let r = reference_of(MODELS[1]);
    let src = fixtures().join(MODELS[1]);
    let mut t =
        candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
    let m = load_model(MODELS[1], DType::F32);
    let e = m.model.cfg.moe.as_ref().unwrap().num_experts;
    for i in 0..m.model.cfg.num_hidden_layers {
        let p = format!("model.layers.{i}.mlp.experts");
        let mut gate_up = Vec::new();
        let mut down = Vec::new();
        for x in 0..e {
            let mut w = |n: &str| t.remove(&format!("{p}.{x}.{n}.weight")).unwrap();
            let (g, u) = (w("gate_proj"), w("up_proj"));
            gate_up.push(Tensor::cat(&[g, u], 0).unwrap());
            down.push(w("down_proj"));
        }
        t.insert(
            format!("{p}.gate_up_proj"),
            Tensor::stack(&gate_up, 0).unwrap(),
        );
        t.insert(format!("{p}.down_proj"), Tensor::stack(&down, 0).unwrap());
    }
    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    candle_core::safetensors::save(&t, dir.path().join("model.safetensors")).unwrap();
    let fused = grpo_rollout::load(dir.path(), DType::F32, &Device::Cpu).unwrap();
    let d = max_diff(
        &to_f64(&logprobs(&fused.model, &r)),
        &to_f64(&logprobs(&m.model, &r)),
    );
    assert_eq!(d, 0.0);
    // A fused tensor of the wrong shape is named.
    let bad = t["model.layers.0.mlp.experts.down_proj"]
        .narrow(0, 0, e - 1)
        .unwrap();
    t.insert("model.layers.0.mlp.experts.down_proj".into(), bad);
    candle_core::safetensors::save(&t, dir.path().join("model.safetensors")).unwrap();
    let err = grpo_rollout::load(dir.path(), DType::F32, &Device::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("model.layers.0.mlp.experts.down_proj"),
        "{err}"
    );
}
