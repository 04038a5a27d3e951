//! Liquid AI's LFM2 (`lfm2`) against transformers: gated short convolutions (`B · x` through a
//! causal depthwise convolution of 3 taps, gated by `C`, with biases) in two layers of four,
//! grouped-query attention with per-head q/k RMSNorms in the others, the MLP's width derived as
//! its configs ask (`block_auto_adjust_ff_dim`), its own tensor names.
//!
//! Reference values: `fixtures/lfm2_reference.json` and the micro model `fixtures/lfm2-micro`
//! (conv, attention, conv, attention; tied), written by `scripts/gen_lfm2_reference.py`
//! (transformers 5.24, eager attention): log-probs of the last `t` tokens of two left-padded
//! rows (float32, and each row alone in float64), the gradient of their sum for one weight of
//! each kind, a greedy continuation through transformers' cache, a PEFT `all-linear` adapter's
//! log-probs (`fixtures/lfm2-micro-peft`).
#![allow(clippy::unwrap_used, missing_docs)]

use crate::common;

use std::path::Path;

use candle_core::{DType, Device};
use common::{fixtures, max_diff_f64 as max_diff, padded_logprobs as logprobs, to_f64};
use grpo_rollout::config::Arch;
use serde_json::Value;

fn reference() -> Value {
    common::reference("lfm2_reference.json")
}

fn load(dtype: DType) -> grpo_rollout::LoadedModel {
    grpo_rollout::load(&fixtures().join("lfm2-micro"), dtype, &Device::Cpu).unwrap()
}

fn want(r: &Value, key: &str) -> Vec<f64> {
    serde_json::from_value::<Vec<Vec<f64>>>(r[key].clone())
        .unwrap()
        .concat()
}

/// The gradients of the padded rows' log-prob sum against the reference's `key`, under the
/// model's names (LFM2's files' mapped, its fused experts apart), with and without gradient
/// checkpointing.
fn check_grads(model: &grpo_rollout::Transformer, r: &Value, key: &str, tol: f64) {
    let experts = model.cfg.moe.as_ref().map_or(1, |m| m.num_experts);
    common::check_grads(model, r, key, tol, &|file, g| {
        let name = grpo_rollout::layout::renamed(model.cfg.arch, file, true);
        common::fused_expert_grads(&name, &g, experts).unwrap_or_else(|| vec![(name, g)])
    });
}

#[test]
fn logprobs_gradients_and_decoding_match_transformers() {
    let r = reference();
    let m = load(DType::F32);
    let cfg = &m.model.cfg;
    assert_eq!(cfg.arch, Arch::Lfm2);
    assert_eq!(cfg.short_conv.as_ref().unwrap().layers, vec![0, 2]);
    assert_eq!(
        cfg.intermediate_size,
        r["mlp_width"].as_u64().unwrap() as usize
    );
    assert_eq!((cfg.rms_norm_eps, cfg.rope_theta), (1e-5, 1e6));
    let d = max_diff(&to_f64(&logprobs(&m.model, &r)), &want(&r, "logprobs"));
    assert!(d < 2e-5, "{d}");
    check_grads(&m.model, &r, "grads", 1e-4);
    let prompt: Vec<u32> = serde_json::from_value(r["prompt"].clone()).unwrap();
    let greedy: Vec<u32> = serde_json::from_value(r["greedy"].clone()).unwrap();
    assert_eq!(common::greedy(&m, &prompt, greedy.len()), greedy);
}

/// In float64 (transformers' float32 RMSNorms and softmax switched to float64) the model
/// equals transformers: the padded rows' log-probs and gradients, and each row alone — which
/// differs from its padded self, as in transformers: a padding position is zeroed before the
/// biased `in_proj`, whose bias then reaches the convolution of the first real positions.
#[test]
fn float64_equals_transformers_in_float64() {
    let r = reference();
    let m = load(DType::F64);
    let padded = to_f64(&logprobs(&m.model, &r));
    let d = max_diff(&padded, &want(&r, "logprobs_f64"));
    assert!(d < 1e-6, "{d}");
    check_grads(&m.model, &r, "grads_f64", 1e-6);
    let alone: Vec<Vec<f64>> = serde_json::from_value(r["alone_f64"].clone()).unwrap();
    for (got, want) in common::logprobs_alone(&m.model, &r).iter().zip(&alone) {
        let d = max_diff(got, want);
        assert!(d < 1e-6, "alone: {d}");
    }
    assert!(max_diff(&padded, &alone.concat()) > 1e-3);
}

/// Saved, the files hold LFM2's names and layout and read back to the same model, whose config
/// transformers reads back (the MLP's derived width written as it is).
#[test]
fn saves_in_its_files_layout() {
    let r = reference();
    let m = load(DType::F32);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("l");
    saves_as_read(&m, &fixtures().join("lfm2-micro"), &out);
    let text = std::fs::read_to_string(out.join("config.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["block_auto_adjust_ff_dim"], false);
    assert_eq!(v["norm_eps"], 1e-5);
    let back = grpo_rollout::load(&out, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(back.model.cfg, m.model.cfg);
    let d = max_diff(
        &to_f64(&logprobs(&back.model, &r)),
        &to_f64(&logprobs(&m.model, &r)),
    );
    assert_eq!(d, 0.0);
}

/// `m`, loaded from `from`, saved at `out`: the files' tensors under the same names, bit for bit.
fn saves_as_read(m: &grpo_rollout::LoadedModel, from: &Path, out: &Path) {
    grpo_rollout::save_hf_dir(&m.model, &m.tokenizer, out, DType::F32).unwrap();
    let tensors = |d: &Path| {
        candle_core::safetensors::load(d.join("model.safetensors"), &Device::Cpu).unwrap()
    };
    let (ours, theirs) = (tensors(out), tensors(from));
    let mut names: Vec<&String> = ours.keys().collect();
    names.sort();
    let mut want_names: Vec<&String> = theirs.keys().collect();
    want_names.sort();
    assert_eq!(names, want_names);
    for (k, t) in &theirs {
        let d = (t - &ours[k]).unwrap().abs().unwrap().max_all().unwrap();
        assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0, "{k}");
    }
}

/// A PEFT 0.21 adapter on every linear map (`all-linear`: the convolutions' `in_proj` and
/// `out_proj`, the attention's q, k, v and `out_proj`, the MLP's `w1`, `w3`, `w2`; random
/// factors) loads with PEFT's adapted log-probs and merges into the same model; our own
/// `all-linear` adapts and names the same modules, with tensors of PEFT's names and shapes.
#[test]
fn peft_all_linear_adapter_matches_peft() {
    let r = reference();
    let mut m = load(DType::F32);
    let peft = fixtures().join("lfm2-micro-peft");
    grpo_rollout::lora::load_peft(&mut m.model, &peft).unwrap();
    let want = want(&r, "peft_logprobs");
    let got = to_f64(&logprobs(&m.model, &r));
    let d = max_diff(&got, &want);
    assert!(d < 2e-5, "{d}");
    let base = load(DType::F32);
    assert!(max_diff(&to_f64(&logprobs(&base.model, &r)), &want) > 1e-2);
    let merged = grpo_rollout::lora::merge(&m.model).unwrap();
    assert!(max_diff(&to_f64(&logprobs(&merged, &r)), &got) < 1e-5);
    common::all_linear_like_peft(&base.model, &peft);
}

/// LFM2's configs as released: `block_ff_dim` and `tie_embedding` (its older names), the MLP's
/// width two thirds rounded up to `block_multiple_of` (LFM2-1.2B: 12288 → 8192), the attention
/// layers from `full_attn_idxs`.
#[test]
fn reads_its_released_config_fields() {
    let v = serde_json::json!({
        "model_type": "lfm2", "vocab_size": 65536, "hidden_size": 2048, "block_ff_dim": 12288,
        "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "full_attn_idxs": [2, 5, 8, 10, 12, 14], "tie_embedding": true, "norm_eps": 1e-5,
        "block_multiple_of": 256, "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": true,
        "conv_L_cache": 3, "conv_bias": false, "rope_theta": 1000000.0
    });
    let c = grpo_rollout::config::ModelConfig::from_hf_json(&v).unwrap();
    assert_eq!(c.intermediate_size, 8192);
    assert!(c.tie_word_embeddings);
    let sc = c.short_conv.as_ref().unwrap();
    assert_eq!(sc.layers, vec![0, 1, 3, 4, 6, 7, 9, 11, 13, 15]);
    assert!(!sc.bias);
    // A width 2/3 of which is no multiple: rounded up (LFM2-350M: 6656 → 4608).
    let mut w = v.clone();
    w["block_ff_dim"] = 6656.into();
    let c = grpo_rollout::config::ModelConfig::from_hf_json(&w).unwrap();
    assert_eq!(c.intermediate_size, 4608);
    let mut bad = v.clone();
    bad["layer_types"] = serde_json::json!(["conv", "mamba"]);
    let e = grpo_rollout::config::ModelConfig::from_hf_json(&bad)
        .unwrap_err()
        .to_string();
    assert!(e.contains("layer_types"), "{e}");
}

/// GGUF both ways as llama.cpp's `lfm2` (the convolutions under `shortconv.*`, the final norm as
/// `token_embd_norm`, the key/value heads per layer, 0 on a convolution layer): llama.cpp's own
/// converter's file of `fixtures/lfm2-plain-micro` (no biases, as LFM2's releases;
/// `scripts/gen_recurrent_gguf_fixtures.py`) reads as the Hugging Face directory, and ours
/// back to the same model. Biased convolutions (which llama.cpp's graph has not) are refused by
/// name.
#[test]
fn gguf_round_trips_and_reads_llama_cpps_file() {
    let r = reference();
    let dir_model = grpo_rollout::load(
        &fixtures().join("lfm2-plain-micro"),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let want_lp = to_f64(&logprobs(&dir_model.model, &r));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l.gguf");
    let written = grpo_rollout::gguf::save_gguf(
        &dir_model.model,
        &dir_model.tokenizer,
        &path,
        grpo_rollout::gguf::GgufType::F32,
        "l",
    )
    .unwrap();
    assert!(
        written
            .iter()
            .any(|(n, _)| n == "blk.0.shortconv.conv.weight")
    );
    for f in [path, fixtures().join("lfm2-plain-micro-llama.gguf")] {
        let back = grpo_rollout::load(&f, DType::F32, &Device::Cpu).unwrap();
        let (a, b) = (&back.model.cfg, &dir_model.model.cfg);
        assert_eq!(
            (
                &a.short_conv,
                a.num_key_value_heads,
                a.intermediate_size,
                a.rms_norm_eps,
                a.rope_theta,
                a.tie_word_embeddings
            ),
            (
                &b.short_conv,
                b.num_key_value_heads,
                b.intermediate_size,
                b.rms_norm_eps,
                b.rope_theta,
                b.tie_word_embeddings
            ),
            "{f:?}"
        );
        let d = max_diff(&to_f64(&logprobs(&back.model, &r)), &want_lp);
        assert!(d < 1e-6, "{f:?}: {d}");
    }
    let biased = load(DType::F32);
    let e = grpo_rollout::gguf::save_gguf(
        &biased.model,
        &biased.tokenizer,
        &dir.path().join("b.gguf"),
        grpo_rollout::gguf::GgufType::F32,
        "b",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("conv_bias"), "{e}");
}

/// LFM2-MoE (`lfm2_moe`) against transformers (`fixtures/lfm2_moe-micro`,
/// `scripts/gen_lfm2_moe_reference.py`: a dense first layer, then 4 experts of which 2 chosen by
/// `sigmoid(logit) + expert_bias`, renormalised and scaled by 1.5): log-probs and gradients in
/// float32 and float64 (the experts', the router's, the dense MLP's, the convolution's), greedy
/// decoding, the files' names (each expert's `w1` / `w3` / `w2`, the offsets `expert_bias`)
/// written back as read, a PEFT `all-linear` adapter's log-probs.
#[test]
fn lfm2_moe_matches_transformers() {
    let r = common::reference("lfm2_moe_reference.json");
    let path = fixtures().join("lfm2_moe-micro");
    let m = grpo_rollout::load(&path, DType::F32, &Device::Cpu).unwrap();
    let cfg = &m.model.cfg;
    assert_eq!(cfg.arch, Arch::Lfm2Moe);
    let moe = cfg.moe.as_ref().unwrap();
    assert_eq!(
        (moe.mlp_only_layers.clone(), moe.router_aux_loss_coef),
        (vec![0], 0.0)
    );
    assert_eq!(
        moe.routing,
        grpo_rollout::config::Routing::Sigmoid {
            routed_scaling_factor: 1.5,
            expert_bias: true
        }
    );
    let d = max_diff(&to_f64(&logprobs(&m.model, &r)), &want(&r, "logprobs"));
    assert!(d < 2e-5, "{d}");
    check_grads(&m.model, &r, "grads", 1e-4);
    let prompt: Vec<u32> = serde_json::from_value(r["prompt"].clone()).unwrap();
    let greedy: Vec<u32> = serde_json::from_value(r["greedy"].clone()).unwrap();
    assert_eq!(common::greedy(&m, &prompt, greedy.len()), greedy);
    let m64 = grpo_rollout::load(&path, DType::F64, &Device::Cpu).unwrap();
    let d = max_diff(
        &to_f64(&logprobs(&m64.model, &r)),
        &want(&r, "logprobs_f64"),
    );
    assert!(d < 1e-6, "f64: {d}");
    check_grads(&m64.model, &r, "grads_f64", 1e-6);
    // Saved: the files' names and values, read back to the same model.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("m");
    saves_as_read(&m, &path, &out);
    let back = grpo_rollout::load(&out, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(back.model.cfg, m.model.cfg);
    // PEFT's adapter (its all-linear: the dense MLP's, the attention's and the convolutions'
    // maps, not the experts').
    let mut a = grpo_rollout::load(&path, DType::F32, &Device::Cpu).unwrap();
    grpo_rollout::lora::load_peft(&mut a.model, &fixtures().join("lfm2_moe-micro-peft")).unwrap();
    let d = max_diff(&to_f64(&logprobs(&a.model, &r)), &want(&r, "peft_logprobs"));
    assert!(d < 2e-5, "peft: {d}");
}

/// LFM2-MoE as llama.cpp's `lfm2moe` (the experts stacked as `ffn_{gate,up,down}_exps`, the
/// router `ffn_gate_inp` and its offsets `exp_probs_b`, `leading_dense_block_count`, sigmoid
/// gating) and read back: the same model. What llama.cpp computes otherwise — a scale on the
/// chosen weights, which it does not read — is refused by name.
#[test]
fn lfm2_moe_gguf_round_trips() {
    use grpo_rollout::gguf::{GgufType, save_gguf};
    use grpo_rollout::init::{Preset, preset_config, random_weights};
    let r = reference();
    let tok = load(DType::F32).tokenizer;
    let c = preset_config(Preset::Small, Arch::Lfm2Moe, 300, 2, 0);
    let m = random_weights(&c, 5, DType::F32, &Device::Cpu).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    let written = save_gguf(&m, &tok, &path, GgufType::F32, "m").unwrap();
    for n in [
        "blk.1.exp_probs_b.bias",
        "blk.1.ffn_gate_exps.weight",
        "blk.0.ffn_gate.weight",
    ] {
        assert!(written.iter().any(|(w, _)| w == n), "{n}");
    }
    let back = grpo_rollout::load(&path, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(
        (&back.model.cfg.moe, &back.model.cfg.short_conv),
        (&m.cfg.moe, &m.cfg.short_conv)
    );
    let d = max_diff(
        &to_f64(&logprobs(&back.model, &r)),
        &to_f64(&logprobs(&m, &r)),
    );
    assert!(d < 1e-6, "{d}");
    let scaled =
        grpo_rollout::load(&fixtures().join("lfm2_moe-micro"), DType::F32, &Device::Cpu).unwrap();
    let e = save_gguf(
        &scaled.model,
        &tok,
        &dir.path().join("s.gguf"),
        GgufType::F32,
        "s",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("routed_scaling_factor"), "{e}");
}

/// An LFM2-VL checkpoint's `lfm2_vl` config reads as its language model's `lfm2` (a text
/// config without the sizes transformers leaves at their defaults takes Lfm2Config's).
#[test]
fn reads_the_vision_language_config() {
    let path = fixtures().join("lfm2-micro/config.json");
    let text: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let vl = serde_json::json!({
        "model_type": "lfm2_vl",
        "architectures": ["Lfm2VlForConditionalGeneration"],
        "text_config": text,
        "vision_config": {"model_type": "siglip2_vision_model", "num_hidden_layers": 1},
        "image_token_id": 299,
        "tie_word_embeddings": true,
    });
    let a = grpo_rollout::config::ModelConfig::from_hf_json(&vl).unwrap();
    let b = grpo_rollout::config::ModelConfig::from_hf_file(&path).unwrap();
    assert_eq!(a, b);
    let sparse = serde_json::json!({
        "model_type": "lfm2_vl",
        "text_config": {"model_type": "lfm2", "block_auto_adjust_ff_dim": false},
    });
    let c = grpo_rollout::config::ModelConfig::from_hf_json(&sparse).unwrap();
    assert_eq!(
        (
            c.vocab_size,
            c.hidden_size,
            c.intermediate_size,
            c.num_key_value_heads
        ),
        (65_536, 2560, 12_288, 8)
    );
}
