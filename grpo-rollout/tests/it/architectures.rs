//! Mistral (sliding-window attention), SmolLM3 (NoPE layers), Gemma 3 (`1 + w` norms,
//! sublayer output norms, GELU-tanh, scaled embeddings, sliding layers with a RoPE base of
//! their own) and OLMo 2 (output norms without pre-norms, q/k norms over all heads) against
//! transformers.
//!
//! Reference values: `fixtures/arch_reference.json`, written with the micro models
//! `fixtures/arch-mistral-micro` (2 layers, untied), `fixtures/arch-smollm3-micro` (3 layers,
//! tied) and `fixtures/arch-gemma3-micro` (3 layers: sliding, full, sliding) by
//! `scripts/gen_arch_reference.py` (transformers 5.24), and `fixtures/arch-olmo2-micro` (2 layers,
//! no pre-norms, q/k norms over all heads): for variants of their config.json
//! (`sliding_window` null / 64 / 12; `no_rope_layers` listed, derived from
//! `no_rope_layer_interval`, all ones; SmolLM3's window on its NoPE layers; Gemma's full layer
//! with linear RoPE scaling, its layer types from `sliding_window_pattern`), log-probs of the
//! last `t` tokens of left-padded rows of 40 and 27 tokens (float32, eager attention, per-row
//! position ids), and the variant's config as transformers resolves it.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use grpo_rollout::config::{Arch, ModelConfig, RopeScaling};
use grpo_rollout::generate::left_pad;
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn reference() -> Value {
    let text = std::fs::read_to_string(fixtures().join("arch_reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// A copy of the case's micro model with the case's changes in its config.json.
fn model_dir(case: &Value, dir: &Path) -> PathBuf {
    let d = dir.join(case["model"].as_str().unwrap());
    std::fs::create_dir_all(&d).unwrap();
    for e in std::fs::read_dir(fixtures().join(case["model"].as_str().unwrap())).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), d.join(e.file_name())).unwrap();
    }
    let path = d.join("config.json");
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let o = cfg.as_object_mut().unwrap();
    // A null `layer_types` lets the reader derive them, as the script let transformers.
    for (k, v) in case["config"].as_object().unwrap() {
        o.insert(k.clone(), v.clone());
    }
    std::fs::write(&path, cfg.to_string()).unwrap();
    d
}

/// [`model_dir`] of `case`, loaded in f32 on the CPU.
fn load_case(case: &Value, dir: &Path) -> grpo_rollout::LoadedModel {
    grpo_rollout::load(&model_dir(case, dir), DType::F32, &Device::Cpu).unwrap()
}

fn batch(r: &Value) -> (Tensor, Tensor, usize) {
    let rows: Vec<Vec<u32>> = serde_json::from_value(r["rows"].clone()).unwrap();
    let (ids, mask) = left_pad(&rows, 0, &Device::Cpu).unwrap();
    (ids, mask, r["t"].as_u64().unwrap() as usize)
}

fn logprobs(m: &grpo_rollout::Transformer, r: &Value) -> Vec<f32> {
    let (ids, mask, t) = batch(r);
    let (lp, _) = m.completion_logprobs(&ids, &mask, t, 1.0, false).unwrap();
    lp.flatten_all().unwrap().to_vec1().unwrap()
}

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f64, f64::max)
}

fn want(case: &Value) -> Vec<f64> {
    serde_json::from_value::<Vec<Vec<f64>>>(case["logprobs"].clone())
        .unwrap()
        .concat()
}

#[test]
fn logprobs_match_transformers_for_each_variant() {
    let r = reference();
    let cases = r["cases"].as_object().unwrap();
    assert!(cases.len() >= 88);
    for (name, case) in cases {
        let tmp = tempfile::tempdir().unwrap();
        let m = load_case(case, tmp.path());
        let cfg = &m.model.cfg;
        // The config as transformers resolves it: which layers rotate, which are windowed.
        let res = &case["resolved"];
        let layers = cfg.num_hidden_layers;
        if let Some(rope) = res["no_rope_layers"].as_array() {
            let rope: Vec<bool> = rope.iter().map(|x| x.as_u64() == Some(1)).collect();
            let ours: Vec<bool> = (0..layers).map(|i| cfg.uses_rope(i)).collect();
            assert_eq!(ours, rope[..layers], "{name}: RoPE layers");
        }
        let windowed: Vec<bool> = match res["layer_types"].as_array() {
            Some(t) => t.iter().map(|x| x == "sliding_attention").collect(),
            None => vec![res["sliding_window"].is_u64(); layers],
        };
        let ours: Vec<bool> = (0..layers).map(|i| cfg.windowed(i)).collect();
        assert_eq!(ours, windowed, "{name}: windowed layers");
        if windowed.contains(&true) {
            assert_eq!(
                cfg.sliding_window.map(|w| w as u64),
                res["sliding_window"].as_u64()
            );
        }
        let got: Vec<f64> = logprobs(&m.model, &r).iter().map(|x| *x as f64).collect();
        let d = max_diff(&got, &want(case));
        eprintln!("{name}: max |ours - transformers| = {d:e}");
        assert!(d <= 2e-5, "{name}: max |ours - transformers| = {d:e}");
        // What the config writes back reads back the same.
        assert_eq!(&ModelConfig::from_hf_json(&cfg.to_hf_json()).unwrap(), cfg);
    }
    // The variants differ where they should by far more than the tolerance: the test sees the
    // window and the NoPE layer.
    let d = |a: &str, b: &str| max_diff(&want(&cases[a]), &want(&cases[b]));
    assert!(d("mistral-window-12", "mistral-no-window") > 0.05);
    assert!(d("mistral-window-64", "mistral-no-window") < 1e-12);
    assert!(d("smollm3-all-rope", "smollm3-nope-1") > 0.05);
    assert!(d("smollm3-window-12", "smollm3-nope-1") > 0.05);
    assert!(d("smollm3-interval-2", "smollm3-nope-1") < 1e-12);
    assert!(d("gemma3-window-12", "gemma3-window-64") > 0.05);
    assert!(d("gemma3-linear-full", "gemma3-window-12") > 0.05);
    assert!(d("gemma3-pattern-2", "gemma3-window-12") < 1e-12);
    assert!(d("olmo2-linear", "olmo2") > 0.05);
    assert!(d("gemma2-caps", "gemma2-no-caps") > 0.05);
    assert!(d("gemma2-default-caps", "gemma2-no-caps") > 1e-3);
    assert!(d("gemma2-window-64", "gemma2-caps") > 0.05);
    assert!(d("granite", "granite-unit") > 0.05);
    assert!(d("phi3-window-12", "phi3") > 0.05);
    assert!(d("phi3-partial-half", "phi3") > 0.05);
    assert!(d("phi3-longrope-partial", "phi3") > 0.05);
    assert!(d("phi3-longrope-v4-layout", "phi3-longrope-partial") > 0.05);
    // The routing's settings each matter.
    assert!(d("qwen3moe-norm", "qwen3moe") > 0.05);
    assert!(d("qwen3moe-top3", "qwen3moe") > 0.05);
    assert!(d("qwen2moe-norm", "qwen2moe") > 0.05);
    assert!(d("mixtral-top1", "mixtral") > 0.05);
    assert!(d("mixtral-window-12", "mixtral") > 0.05);
    assert!(d("olmoe-norm", "olmoe") > 0.05);
    assert!(d("granitemoe-top1", "granitemoe") > 0.05);
    assert!(d("granitemoe-top3", "granitemoe") > 0.05);
    assert!(d("ernie45-bias", "ernie45") > 0.05);
    assert!(d("exaone4-window-12", "exaone4-no-window") > 0.05);
    assert!(d("exaone4-pattern-2", "exaone4-window-12") > 0.05);
    assert!(d("gptoss-top1", "gptoss") > 0.05);
    assert!(d("gptoss-limit", "gptoss") > 0.05);
    assert!(d("gptoss-window-64", "gptoss") > 0.05);
    // MXFP4 rounds the experts' weights: the quantized file is read as transformers reads it.
    assert!(d("gptoss-mxfp4", "gptoss") > 0.05);
    assert!(d("glm-full-rotary", "glm") > 0.05);
    assert!(d("glm-no-bias", "glm") > 0.05);
    assert!(d("glm4-three-quarters", "glm4") > 0.05);
    assert!(d("glm4-linear", "glm4") > 0.05);
    assert!(d("olmo3-no-scaling", "olmo3") > 0.05);
    assert!(d("olmo3-local-base", "olmo3-no-scaling") > 0.05);
    assert!(d("olmo3-window-64", "olmo3") > 0.05);
    // transformers 5 spends a top-level `rope_theta` on the global layers only.
    assert!(d("olmo3-v4-layout", "olmo3") > 0.05);
    assert!(d("seedoss-out-bias", "seedoss") > 0.05);
    assert!(d("glm4moe-groups", "glm4moe") > 0.05);
    assert!(d("glm4moe-scaled", "glm4moe") > 0.05);
    assert!(d("glm4moe-qk-norm", "glm4moe") > 0.05);
    assert!(d("glm4moe-no-bias", "glm4moe") > 0.05);
    assert!(d("glm4moe-full-rotary", "glm4moe") > 0.05);
    assert!(d("deepseekv3-bias", "deepseekv3") > 0.05);
    assert!(d("deepseekv3-rotate-half", "deepseekv3") > 0.05);
    assert!(d("deepseekv3-yarn", "deepseekv3") > 0.05);
    assert!(d("deepseekv3-groups-4", "deepseekv3") > 0.05);
    assert!(d("glm4moelite-rotate-half", "glm4moelite") > 0.05);
    assert!(d("deepseekv2-group-limited", "deepseekv2") > 0.05);
    assert!(d("deepseekv2-scaled", "deepseekv2") > 0.05);
    assert!(d("deepseekv2-yarn", "deepseekv2") > 0.05);
    assert!(d("seedoss-mlp-bias", "seedoss") > 0.05);
    assert!(d("seedoss-no-bias", "seedoss") > 0.05);
    assert!(d("arcee-mlp-bias", "arcee") > 0.05);
    assert!(d("arcee-yarn", "arcee") > 0.05);
    assert!(d("nanochat-bias", "nanochat") > 0.05);
    assert!(d("nanochat-cap-3", "nanochat") > 0.05);
    assert!(d("nanochat-no-cap", "nanochat") > 1e-3);
    assert!(d("nanochat-yarn", "nanochat") > 0.05);
}

/// Gemma 3's pieces each matter, so the match above sees them: the local RoPE base, the
/// attention scale and the activation changed one at a time move the log-probs by far more
/// than the tolerance (the norms' `1 + w` and the embedding scale: see the unit tests).
#[test]
fn each_gemma_piece_moves_the_logprobs() {
    let r = reference();
    let case = &r["cases"]["gemma3-window-64"];
    let tmp = tempfile::tempdir().unwrap();
    let m = load_case(case, tmp.path());
    let base = logprobs(&m.model, &r);
    assert_eq!(base.len(), want(case).len());
    let weights: std::collections::HashMap<String, Tensor> =
        m.model.weights().into_iter().collect();
    let moved = |cfg: ModelConfig| {
        let other =
            grpo_rollout::Transformer::from_weights(&cfg, &weights, DType::F32, &Device::Cpu)
                .unwrap();
        let lp = logprobs(&other, &r);
        lp.iter()
            .zip(&base)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max)
    };
    let c = m.model.cfg.clone();
    let same = moved(c.clone());
    assert_eq!(same, 0.0);
    for (what, cfg) in [
        (
            "local base",
            ModelConfig {
                local_rope_theta: Some(c.rope_theta),
                ..c.clone()
            },
        ),
        (
            "scale",
            ModelConfig {
                query_pre_attn_scalar: None,
                ..c.clone()
            },
        ),
        (
            "activation",
            ModelConfig {
                activation: grpo_rollout::config::Activation::Silu,
                ..c.clone()
            },
        ),
    ] {
        let d = moved(cfg);
        assert!(d > 0.05, "{what}: {d}");
    }
}

/// Greedy generation through the KV cache (the window's mask and the NoPE layers' identity
/// rotation built per step), eager and with the decode step replayed as a GPU replays it (the
/// replay makes the window's band from the cached length on the device, so it goes on past
/// the window), records the log-probs the full forward gives the same tokens.
#[test]
fn cached_decoding_matches_the_full_forward_past_the_window() {
    use grpo_rollout::graph::{captures, replayed_on_the_host, replays};
    let r = reference();
    for name in [
        "mistral-window-12",
        "smollm3-window-12",
        "smollm3-nope-1",
        "gemma3-window-12",
        "olmo2",
        "phi3-window-12",
        "phi3-longrope-partial",
        "gemma2-caps",
        "granite",
        "ernie45-bias",
        "exaone4-window-12",
        "gptoss",
        "glm",
        "glm4-three-quarters",
        "olmo3",
        "arcee-mlp-bias",
        "nanochat-bias",
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let m = load_case(&r["cases"][name], tmp.path());
        let prompts: Vec<Vec<u32>> = vec![(0..9).map(|i| 3 + 7 * i).collect(), vec![7, 8, 9]];
        let params = sampled_14();
        let d = m.model.for_decoding().unwrap();
        let run = || grpo_rollout::generate(&d, &m.tokenizer, &prompts, 1, &params).unwrap();
        let eager = run();
        let (before, replays_before) = (captures(), replays());
        let replayed = replayed_on_the_host(run);
        if m.model.cfg.attn_logit_softcapping.is_some() || m.model.cfg.arch.attention_sinks() {
            // Gemma 2's capped scores and gpt-oss's sinks take no cache kernel: their steps
            // run eagerly.
            assert_eq!(captures(), before, "{name}: a step was captured");
        } else {
            assert!(captures() > before, "{name}: no step was captured");
            // 14 steps, the first eager: the replays run on past the window (from position 12).
            let n = replays() - replays_before;
            assert!(n >= 12, "{name}: {n} steps replayed");
        }
        for (a, b) in eager.iter().zip(&replayed) {
            assert_eq!(a.token_ids, b.token_ids, "{name}");
            for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
                assert!((x - y).abs() < 1e-5, "{name}: replayed {y} vs eager {x}");
            }
        }
        assert!(
            prompts[0].len() + eager[0].token_ids.len() > 12,
            "{name}: the rows pass the window"
        );
        let worst = full_forward_gap(&m.model, &prompts, &eager);
        assert!(worst < 1e-4, "{name}: cached vs full {worst}");
    }
}

/// 14 sampled tokens (temperature 1, seed 3), none stopping early.
fn sampled_14() -> grpo_rollout::SamplingParams {
    grpo_rollout::SamplingParams {
        max_new_tokens: 14,
        min_new_tokens: 14,
        temperature: 1.0,
        seed: 3,
        ..Default::default()
    }
}

/// The largest gap between the log-probs generation gave `completions` of `prompts` and those
/// of `model`'s full forward over prompt + completion, left-padded together.
fn full_forward_gap(
    model: &grpo_rollout::Transformer,
    prompts: &[Vec<u32>],
    completions: &[grpo_rollout::Completion],
) -> f32 {
    let rows: Vec<Vec<u32>> = prompts
        .iter()
        .zip(completions)
        .map(|(p, c)| [p.as_slice(), &c.token_ids].concat())
        .collect();
    let t = completions[0].token_ids.len();
    let (ids, mask) = left_pad(&rows, 0, &Device::Cpu).unwrap();
    let (lp, _) = model
        .completion_logprobs(&ids, &mask, t, 1.0, false)
        .unwrap();
    let full: Vec<Vec<f32>> = lp.to_vec2().unwrap();
    let mut worst = 0f32;
    for (c, f) in completions.iter().zip(&full) {
        assert_eq!(c.logprobs.len(), t);
        for (a, b) in c.logprobs.iter().zip(f) {
            worst = worst.max((a - b).abs());
        }
    }
    worst
}

/// GGUF as llama.cpp writes these families: Mistral as `llama` (which has no window; the same
/// within it), SmolLM3 as `smollm3` with RoPE skipped on every 4th layer — another pattern has
/// no GGUF form and is refused.
#[test]
fn gguf_writes_mistral_as_llama_and_smollm3_with_its_fixed_pattern() {
    use grpo_rollout::gguf::{GgufType, load_gguf, save_gguf};
    let r = reference();
    let tmp = tempfile::tempdir().unwrap();
    let mistral = load_case(&r["cases"]["mistral-window-64"], &tmp.path().join("m"));
    let path = tmp.path().join("mistral.gguf");
    save_gguf(
        &mistral.model,
        &mistral.tokenizer,
        &path,
        GgufType::F32,
        "m",
    )
    .unwrap();
    let (cfg, _, _) = load_gguf(&path, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(cfg.arch, Arch::Llama);
    let back = grpo_rollout::load(&path, DType::F32, &Device::Cpu).unwrap();
    let (a, b) = (logprobs(&mistral.model, &r), logprobs(&back.model, &r));
    let d = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(d < 1e-5, "mistral through GGUF: {d}");

    // SmolLM3 with llama.cpp's pattern (4 layers: the last without RoPE) round-trips.
    let mut c = grpo_rollout::init::preset_config(
        grpo_rollout::init::Preset::Tiny,
        Arch::SmolLM3,
        300,
        2,
        0,
    );
    c.num_hidden_layers = 4;
    c.nope_layers = vec![3];
    let m = grpo_rollout::init::random_weights(&c, 4, DType::F32, &Device::Cpu).unwrap();
    let path = tmp.path().join("smollm3.gguf");
    save_gguf(&m, &mistral.tokenizer, &path, GgufType::F32, "s").unwrap();
    let back = grpo_rollout::load(&path, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(back.model.cfg.arch, Arch::SmolLM3);
    assert_eq!(back.model.cfg.nope_layers, vec![3]);
    let (a, b) = (logprobs(&m, &r), logprobs(&back.model, &r));
    let d = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(d < 1e-5, "smollm3 through GGUF: {d}");
    // The micro model's pattern ([1, 0, 1]) is not llama.cpp's.
    let s = load_case(&r["cases"]["smollm3-nope-1"], &tmp.path().join("s"));
    let e = gguf_refusal(&s, &tmp.path().join("x.gguf"));
    assert!(
        e.contains("NoPE layers [1]") && e.contains("every 4th"),
        "{e}"
    );
    // The micro Gemma 3's global middle layer is not llama.cpp's pattern (every 6th).
    let g = load_case(&r["cases"]["gemma3-window-12"], &tmp.path().join("g"));
    let e = gguf_refusal(&g, &tmp.path().join("g.gguf"));
    assert!(
        e.contains("sliding-window layers [0, 2]") && e.contains("gemma3"),
        "{e}"
    );
}

/// The one-line error writing `m` as GGUF gives.
/// Writes `m` as GGUF, which must succeed.
fn gguf_written(m: &grpo_rollout::LoadedModel, path: &Path) {
    use grpo_rollout::gguf::{GgufType, save_gguf};
    save_gguf(&m.model, &m.tokenizer, path, GgufType::F32, "x").unwrap();
}

fn gguf_refusal(m: &grpo_rollout::LoadedModel, path: &Path) -> String {
    use grpo_rollout::gguf::{GgufType, save_gguf};
    save_gguf(&m.model, &m.tokenizer, path, GgufType::F32, "x")
        .unwrap_err()
        .to_string()
}

#[test]
fn bad_nope_and_window_fields_are_named() {
    let base = serde_json::json!({
        "model_type": "smollm3", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 3, "num_attention_heads": 2,
    });
    let with = |k: &str, x: Value| {
        let mut v = base.clone();
        v[k] = x;
        ModelConfig::from_hf_json(&v)
    };
    let e = with("no_rope_layers", serde_json::json!([1, 0]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no_rope_layers") && e.contains("3 layers"),
        "{e}"
    );
    let e = with("no_rope_layers", serde_json::json!([1, 2, 1]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("no_rope_layers[1]"), "{e}");
    let e = with("sliding_window", serde_json::json!("big"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("sliding_window"), "{e}");
    // transformers' SmolLM3 defaults: tied, RoPE base 2e6, every 4th layer NoPE (none of 3).
    let c = ModelConfig::from_hf_json(&base).unwrap();
    assert!(c.tie_word_embeddings && c.nope_layers.is_empty() && c.rope_theta == 2e6);
    // Mistral's: a 4096-position window unless null, never biases.
    let mut v = base.clone();
    v["model_type"] = "mistral".into();
    v["attention_bias"] = true.into();
    let c = ModelConfig::from_hf_json(&v).unwrap();
    assert_eq!(c.sliding_window, Some(4096));
    assert!(!c.attention_bias && !c.tie_word_embeddings);
    v["sliding_window"] = Value::Null;
    assert_eq!(ModelConfig::from_hf_json(&v).unwrap().sliding_window, None);
    // Gemma 3's: GELU-tanh, scale 256^-1/2, window 4096 on all but each 6th layer, RoPE bases
    // 1e6 and 1e4; Gemma 2's soft-capping and the multimodal config are refused by name.
    let mut v = base.clone();
    v["model_type"] = "gemma3_text".into();
    v["num_hidden_layers"] = 7.into();
    let c = ModelConfig::from_hf_json(&v).unwrap();
    assert_eq!(
        c.activation,
        grpo_rollout::config::Activation::GeluPytorchTanh
    );
    assert_eq!((c.head_dim, c.sliding_window), (256, Some(4096)));
    assert_eq!(c.attention_scale(), 1.0 / 16.0);
    assert_eq!((c.rope_theta, c.local_rope_theta), (1e6, Some(1e4)));
    let local: Vec<usize> = (0..7).filter(|i| c.local_rope(*i)).collect();
    assert_eq!(local, vec![0, 1, 2, 3, 4, 6]);
    assert_eq!(ModelConfig::from_hf_json(&c.to_hf_json()).unwrap(), c);
    // transformers' Gemma3TextConfig is strictly typed: an integer there.
    assert!(c.to_hf_json()["query_pre_attn_scalar"].is_i64());
    v["final_logit_softcapping"] = 30.0.into();
    let e = ModelConfig::from_hf_json(&v).unwrap_err().to_string();
    assert!(e.contains("final_logit_softcapping"), "{e}");
    // The vision-language `gemma3` names its language model in `text_config`.
    v["model_type"] = "gemma3".into();
    let e = ModelConfig::from_hf_json(&v).unwrap_err().to_string();
    assert!(
        e.contains("text_config") && e.contains("gemma3_text"),
        "{e}"
    );
}

/// Phi-3's files keep `qkv_proj` and `gate_up_proj` fused, GLM's `gate_up_proj`: a model
/// saved and read back is the one loaded (the fused weights byte for byte, q/k rows back in
/// transformers' order under partial and interleaved rotary), and the config reads back equal.
#[test]
fn phi3_saves_its_fused_layout_and_reads_back_the_same() {
    let r = reference();
    for (name, files) in [
        ("phi3", "arch-phi3-micro"),
        ("phi3-longrope-partial", "arch-phi3-micro"),
        ("glm", "arch-glm-micro"),
        ("glm4-three-quarters", "arch-glm4-micro"),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let m = load_case(&r["cases"][name], tmp.path());
        let out = tmp.path().join("saved");
        grpo_rollout::save_hf_dir(&m.model, &m.tokenizer, &out, DType::F32).unwrap();
        let saved = grpo_rollout::loader::read_safetensors(&out, &Device::Cpu).unwrap();
        let original =
            grpo_rollout::loader::read_safetensors(&fixtures().join(files), &Device::Cpu).unwrap();
        same_tensors(&saved, &original, name);
        assert!(saved.keys().any(|k| k.ends_with("gate_up_proj.weight")));
        let back = grpo_rollout::load(&out, DType::F32, &Device::Cpu).unwrap();
        assert_eq!(back.model.cfg, m.model.cfg, "{name}");
        assert_eq!(logprobs(&back.model, &r), logprobs(&m.model, &r), "{name}");
    }
}

/// `got` holds `want`'s tensors under the same names, bit for bit.
fn same_tensors(
    got: &std::collections::HashMap<String, Tensor>,
    want: &std::collections::HashMap<String, Tensor>,
    what: &str,
) {
    let mut a: Vec<&String> = got.keys().collect();
    let mut b: Vec<&String> = want.keys().collect();
    a.sort();
    b.sort();
    assert_eq!(a, b, "{what}: the names");
    for (k, t) in got {
        let d = (t - &want[k])
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert_eq!(d, 0.0, "{what}: {k}");
    }
}

fn fused_peft(dir: &str) -> Value {
    let p = fixtures().join(dir).join("reference.json");
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

/// Adapters peft wrote on Phi-3's fused modules (one `A` for q, k, v; `B` rows for each; DoRA
/// magnitudes per row) give peft's log-probs, adapted and merged, on a base whose q/k rows the
/// model reorders (three quarters of each head rotating), and save back as peft wrote them;
/// the same for GLM-4-0414's fused `gate_up_proj` beside its separate q, k, v (their rows in
/// the interleaved order, three quarters rotating; `FAMILY=glm4
/// scripts/gen_phi3_peft_reference.py`).
#[test]
fn phi3_peft_adapters_on_fused_modules_match_peft() {
    let r = reference();
    let mut seen = 0;
    for (dir, model) in [
        ("peft-phi3", "arch-phi3-micro"),
        ("peft-glm4", "arch-glm4-micro"),
    ] {
        let p = fused_peft(dir);
        let case = serde_json::json!({"model": model, "config": p["config"]});
        for (name, want) in p["cases"].as_object().unwrap() {
            let tmp = tempfile::tempdir().unwrap();
            let mut m = load_case(&case, tmp.path());
            let dir = fixtures().join(dir).join(name);
            let cfg = grpo_rollout::lora::load_peft(&mut m.model, &dir).unwrap();
            // q, k and v share the module's `A` (Phi-3), gate and up theirs (both).
            let l = &m.model.layers[0];
            if let (Some(q), Some(v)) = (&l.q_proj.lora, &l.v_proj.lora) {
                match m.model.cfg.arch {
                    Arch::Glm4 => assert_ne!(q.a.id(), v.a.id(), "{name}: GLM's q and v apart"),
                    _ => assert_eq!(q.a.id(), v.a.id(), "{name}: one A for qkv_proj"),
                }
            }
            if let (Some(g), Some(u)) = (&l.gate_proj.lora, &l.up_proj.lora) {
                assert_eq!(g.a.id(), u.a.id(), "{name}: one A for gate_up_proj");
            }
            let flat = |v: &Value| -> Vec<f64> {
                serde_json::from_value::<Vec<Vec<f64>>>(v.clone())
                    .unwrap()
                    .concat()
            };
            let got: Vec<f64> = logprobs(&m.model, &r).iter().map(|x| *x as f64).collect();
            let d = max_diff(&got, &flat(&want["adapted"]));
            assert!(d < 1e-4, "{name}: adapted, max |ours - peft| = {d:e}");
            assert!(
                max_diff(&got, &flat(&p["base"])) > 0.5,
                "{name}: the adapter shows"
            );
            let merged = grpo_rollout::lora::merge(&m.model).unwrap();
            let got: Vec<f64> = logprobs(&merged, &r).iter().map(|x| *x as f64).collect();
            let d = max_diff(&got, &flat(&want["merged"]));
            assert!(d < 1e-4, "{name}: merged, max |ours - peft| = {d:e}");
            // Saved again: peft's tensors under peft's keys.
            let out = tmp.path().join("adapter");
            grpo_rollout::lora::save_peft(&m.model, &cfg, &out, "base").unwrap();
            let a =
                candle_core::safetensors::load(dir.join("adapter_model.safetensors"), &Device::Cpu)
                    .unwrap();
            let b =
                candle_core::safetensors::load(out.join("adapter_model.safetensors"), &Device::Cpu)
                    .unwrap();
            same_tensors(&b, &a, name);
            seen += 1;
        }
    }
    assert_eq!(seen, 6);
}

/// Training adapters on Phi-3's fused modules: one variable per module's `A` (PEFT's count of
/// trainable parameters), whose gradient gathers the q, k and v paths — equal with gradient
/// checkpointing and to a finite difference (f64). Naming q_proj on Phi-3 is refused.
#[test]
fn phi3_lora_trains_one_a_per_fused_module() {
    use grpo_rollout::lora::{LoraConfig, TargetModules};
    use grpo_rollout::policy::TrainableModel;
    let r = reference();
    let tmp = tempfile::tempdir().unwrap();
    let case = r["cases"]["phi3-longrope-partial"].clone();
    let m = grpo_rollout::load(&model_dir(&case, tmp.path()), DType::F64, &Device::Cpu).unwrap();
    let cfg = LoraConfig {
        r: 2,
        lora_alpha: 4.0,
        target_modules: TargetModules::Pattern("all-linear".into()),
        ..LoraConfig::default()
    };
    let c = &m.model.cfg;
    let (h, q, kv, im) = (
        c.hidden_size,
        c.num_attention_heads * c.head_dim,
        c.num_key_value_heads * c.head_dim,
        c.intermediate_size,
    );
    // PEFT's count: qkv_proj (A 2×h, B (q+2kv)×2), o_proj, gate_up_proj, down_proj.
    let per_layer =
        (2 * h + (q + 2 * kv) * 2) + (2 * q + h * 2) + (2 * h + 2 * im * 2) + (2 * im + h * 2);
    let (ids, mask, t) = batch(&r);
    let grad_of_a = |checkpointing: bool, nudge: f64| {
        let mut tm = TrainableModel::lora(&m.model, &cfg, 7).unwrap();
        assert_eq!(tm.num_trainable(), per_layer * c.num_hidden_layers);
        // B away from zero, so that A's gradient is not zero.
        let mut filled = std::collections::HashMap::new();
        for (i, (k, v)) in tm.vars.iter().enumerate() {
            let t = v.as_tensor();
            let n = t.elem_count();
            let noise = Tensor::arange(0f64, n as f64, &Device::Cpu)
                .unwrap()
                .affine(0.37, i as f64)
                .unwrap()
                .sin()
                .unwrap()
                .affine(0.5, 0.0)
                .unwrap()
                .reshape(t.shape())
                .unwrap();
            let mut x = if k.contains("lora_B") {
                noise
            } else {
                t.copy().unwrap()
            };
            if k.ends_with("layers.1.self_attn.qkv_proj.lora_A.weight") {
                let bump = Tensor::zeros(t.shape(), DType::F64, &Device::Cpu)
                    .unwrap()
                    .slice_assign(
                        &[0..1, 3..4],
                        &Tensor::full(nudge, (1, 1), &Device::Cpu).unwrap(),
                    )
                    .unwrap();
                x = (x + bump).unwrap();
            }
            v.set(&x).unwrap();
            filled.insert(k.clone(), v.as_tensor().clone());
        }
        grpo_rollout::lora::set_factors(&mut tm.model, &cfg, &filled).unwrap();
        if checkpointing {
            tm.model.enable_gradient_checkpointing();
        }
        let (lp, _) = tm
            .model
            .completion_logprobs(&ids, &mask, t, 1.0, false)
            .unwrap();
        let loss = lp.sum_all().unwrap();
        let grads = tm.model.backward(&loss).unwrap();
        let (_, a) = tm
            .vars
            .iter()
            .find(|(k, _)| k.ends_with("layers.1.self_attn.qkv_proj.lora_A.weight"))
            .unwrap();
        let g: Vec<Vec<f64>> = grads.get(a.as_tensor()).unwrap().to_vec2().unwrap();
        (loss.to_scalar::<f64>().unwrap(), g[0][3])
    };
    let (_, plain) = grad_of_a(false, 0.0);
    let (_, ckpt) = grad_of_a(true, 0.0);
    let eps = 1e-5;
    let (up, _) = grad_of_a(false, eps);
    let (down, _) = grad_of_a(false, -eps);
    let fd = (up - down) / (2.0 * eps);
    assert!(plain.abs() > 1e-3, "A's gradient {plain}");
    assert!(
        (plain - fd).abs() < 1e-6 * fd.abs().max(1.0),
        "autograd {plain} vs finite difference {fd}"
    );
    assert!(
        (plain - ckpt).abs() < 1e-9 * plain.abs().max(1.0),
        "checkpointing {ckpt} vs {plain}"
    );
    // PEFT's default targets on Phi-3 are its qkv_proj; q_proj is not a module of Phi-3's as
    // PEFT sees it.
    let tm = TrainableModel::lora(&m.model, &LoraConfig::default(), 7).unwrap();
    assert!(
        tm.vars
            .iter()
            .all(|(k, _)| !k.contains("o_proj") && !k.contains("mlp"))
    );
    assert!(m.model.layers.iter().all(|l| l.q_proj.lora.is_none()));
    assert!(tm.model.layers.iter().all(|l| l.k_proj.lora.is_some()));
    let bad = LoraConfig {
        target_modules: TargetModules::Names(vec!["q_proj".into()]),
        ..LoraConfig::default()
    };
    let e = TrainableModel::lora(&m.model, &bad, 7)
        .unwrap_err()
        .to_string();
    assert!(e.contains("qkv_proj") && e.contains("`q_proj`"), "{e}");
}

/// Phi-3 as llama.cpp's `phi3` GGUF: fused `attn_qkv` and `ffn_up` (gate and up), the rotary
/// dimensions as `rope.dimension_count`, LongRoPE's factors as `rope_factors_short` /
/// `rope_factors_long` with its attention factor and pre-training length as keys. Read back,
/// the model is the one written (log-probs within 1e-5, the config's pieces equal).
#[test]
fn phi3_gguf_round_trips() {
    let r = reference();
    for name in ["phi3", "phi3-longrope-partial", "phi3-window-12"] {
        let tmp = tempfile::tempdir().unwrap();
        let m = load_case(&r["cases"][name], tmp.path());
        let (written, cfg, d) = through_gguf(&m, &r, tmp.path());
        assert!(d < 1e-5, "{name} through GGUF: {d}");
        assert!(
            written.iter().any(|(n, _)| n == "blk.0.attn_qkv.weight"),
            "{name}"
        );
        assert!(
            written.iter().all(|(n, _)| !n.contains("ffn_gate")),
            "{name}"
        );
        let c = &m.model.cfg;
        assert_eq!(
            (cfg.arch, cfg.rotary_dim(), cfg.sliding_window),
            (Arch::Phi3, c.rotary_dim(), c.sliding_window),
            "{name}"
        );
        match (&cfg.rope_scaling, &c.rope_scaling) {
            (Some(RopeScaling::LongRope(a)), Some(RopeScaling::LongRope(b))) => {
                // Stored as f32 (as the model uses them).
                let f32s = |v: &[f64]| v.iter().map(|x| *x as f32).collect::<Vec<_>>();
                assert_eq!(f32s(&a.short_factor), f32s(&b.short_factor));
                assert_eq!(f32s(&a.long_factor), f32s(&b.long_factor));
                assert_eq!(
                    a.original_max_position_embeddings,
                    b.original_max_position_embeddings
                );
                assert!((a.attention_factor - b.attention_factor).abs() < 1e-6);
            }
            (None, None) => {}
            (a, b) => panic!("{name}: {a:?} vs {b:?}"),
        }
    }
}

/// `m` written as an f32 GGUF in `dir` and read back: the tensors written, the config read, and
/// the largest log-prob difference from `m`.
fn through_gguf(
    m: &grpo_rollout::LoadedModel,
    r: &Value,
    dir: &Path,
) -> (Vec<(String, String)>, ModelConfig, f32) {
    use grpo_rollout::gguf::{GgufType, load_gguf, save_gguf};
    let path = dir.join("m.gguf");
    let written = save_gguf(&m.model, &m.tokenizer, &path, GgufType::F32, "m").unwrap();
    let (cfg, weights, _) = load_gguf(&path, DType::F32, &Device::Cpu).unwrap();
    let back =
        grpo_rollout::Transformer::from_weights(&cfg, &weights, DType::F32, &Device::Cpu).unwrap();
    let (a, b) = (logprobs(&back, r), logprobs(&m.model, r));
    let d = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    (written, cfg, d)
}

/// Granite as llama.cpp's `granite` GGUF: llama's tensors (q/k rows permuted) with the four
/// scalars as `embedding_scale`, `attention.scale`, `residual_scale`, `logit_scale`; read back,
/// the same model.
#[test]
fn granite_gguf_round_trips() {
    let r = reference();
    let tmp = tempfile::tempdir().unwrap();
    let m = load_case(&r["cases"]["granite"], tmp.path());
    let (_, cfg, d) = through_gguf(&m, &r, tmp.path());
    assert!(d < 1e-5, "granite through GGUF: {d}");
    let (a, b) = (cfg.granite.unwrap(), m.model.cfg.granite.unwrap());
    for (x, y) in [
        (a.embedding_multiplier, b.embedding_multiplier),
        (a.attention_multiplier, b.attention_multiplier),
        (a.residual_multiplier, b.residual_multiplier),
        (a.logits_scaling, b.logits_scaling),
    ] {
        assert_eq!(x as f32, y as f32);
    }
}

/// GLM-4-0414 as llama.cpp's `glm4` GGUF: q/k rows in transformers' interleaved order (llama.cpp
/// rotates adjacent pairs too), the rotary share as `rope.dimension_count`, `gate_up_proj` as
/// one `ffn_up`, the sublayers' output norms as `post_attention_norm` / `post_ffw_norm`; read
/// back, the same model (half and three quarters of each head rotating, with q/k/v biases).
/// llama.cpp itself reads these files to transformers' log-probs (README).
#[test]
fn glm4_gguf_round_trips() {
    let r = reference();
    for name in ["glm4", "glm4-three-quarters", "glm4-linear"] {
        let tmp = tempfile::tempdir().unwrap();
        let m = load_case(&r["cases"][name], tmp.path());
        let (written, cfg, d) = through_gguf(&m, &r, tmp.path());
        assert!(d < 1e-5, "{name} through GGUF: {d}");
        assert_eq!(cfg.arch, Arch::Glm4);
        assert_eq!(cfg.rotary_dim(), m.model.cfg.rotary_dim(), "{name}");
        assert!(cfg.attention_bias);
        let has = |g: &str| written.iter().any(|(n, _)| n == g);
        assert!(has("blk.0.ffn_up.weight") && !has("blk.0.ffn_gate.weight"));
        assert!(has("blk.1.post_attention_norm.weight") && has("blk.1.post_ffw_norm.weight"));
        assert!(has("blk.1.attn_q.bias"));
    }
}

/// Phi-3's refusals name what to change: LongRoPE past the pre-training length, factor lists of
/// the wrong length, partial rotary elsewhere, a GGUF of heads that do not fill the hidden size.
#[test]
fn phi3_refusals_are_named() {
    let r = reference();
    let tmp = tempfile::tempdir().unwrap();
    let m = load_case(&r["cases"]["phi3-longrope-partial"], tmp.path());
    let mut wide = m.model.clone();
    wide.cfg.hidden_size = 64;
    let wide = grpo_rollout::LoadedModel {
        model: wide,
        tokenizer: m.tokenizer.clone(),
        source: m.source.clone(),
    };
    let e = gguf_refusal(&wide, &tmp.path().join("p.gguf"));
    assert!(e.contains("≠ hidden_size 64") && e.contains("phi3"), "{e}");
    // 64 positions pre-trained: 70 are refused, naming the field.
    let rows = vec![(0..70u32).map(|i| 3 + i % 200).collect::<Vec<_>>()];
    let (ids, mask) = left_pad(&rows, 0, &Device::Cpu).unwrap();
    let e = m
        .model
        .completion_logprobs(&ids, &mask, 4, 1.0, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("original_max_position_embeddings (64"), "{e}");
    let mut v: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("arch-phi3-micro/config.json")).unwrap(),
    )
    .unwrap();
    v["rope_parameters"]["rope_type"] = "longrope".into();
    v["rope_parameters"]["short_factor"] = serde_json::json!([1.0, 2.0]);
    v["rope_parameters"]["long_factor"] = serde_json::json!([1.0, 2.0, 3.0, 4.0]);
    let e = ModelConfig::from_hf_json(&v).unwrap_err().to_string();
    assert!(e.contains("short_factor has 2 values, expected 4"), "{e}");
    v["model_type"] = "llama".into();
    v["rope_parameters"] =
        serde_json::json!({"rope_type": "default", "partial_rotary_factor": 0.5});
    let e = ModelConfig::from_hf_json(&v).unwrap_err().to_string();
    assert!(
        e.contains("partial_rotary_factor = 0.5") && e.contains("llama"),
        "{e}"
    );
    // transformers' Phi3Config defaults: a 4096-position pre-training length, eps 1e-5, no
    // window.
    let c = ModelConfig::from_hf_json(&serde_json::json!({
        "model_type": "phi3", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2,
        "rope_scaling": {"type": "su", "short_factor": [1.0, 1.0], "long_factor": [2.0, 2.0]},
        "max_position_embeddings": 16384,
    }))
    .unwrap();
    let Some(RopeScaling::LongRope(l)) = &c.rope_scaling else {
        panic!("{:?}", c.rope_scaling)
    };
    assert_eq!(l.original_max_position_embeddings, 4096);
    // sqrt(1 + ln 4 / ln 4096)
    assert!((l.attention_factor - (1.0f64 + 4f64.ln() / 4096f64.ln()).sqrt()).abs() < 1e-12);
    assert_eq!((c.rms_norm_eps, c.sliding_window), (1e-5, None));
}

/// EXAONE 4's `sliding_window_pattern` as a string of `L` (sliding, rotating) and `G` (global,
/// NoPE) repeated from layer 0, or an integer; a bad pattern is named.
#[test]
fn exaone4_layer_patterns() {
    let cfg = |pattern: Value| {
        let v = serde_json::json!({
            "model_type": "exaone4", "vocab_size": 300, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 5, "num_attention_heads": 4,
            "num_key_value_heads": 2, "sliding_window": 8, "sliding_window_pattern": pattern
        });
        ModelConfig::from_hf_json(&v)
    };
    let c = cfg("LLG".into()).unwrap();
    assert_eq!(c.sliding_layers, vec![0, 1, 3, 4]);
    assert_eq!(c.nope_layers, vec![2]);
    assert!((0..5).all(|i| c.uses_rope(i) == c.windowed(i)));
    let c = cfg(4.into()).unwrap();
    assert_eq!(
        (c.sliding_layers, c.nope_layers),
        (vec![0, 1, 2, 4], vec![3])
    );
    let e = cfg("LXG".into()).unwrap_err().to_string();
    assert!(e.contains("sliding_window_pattern"), "{e}");
    // Written back: the window and every layer's type, read back the same.
    let c = cfg("LLG".into()).unwrap();
    assert_eq!(ModelConfig::from_hf_json(&c.to_hf_json()).unwrap(), c);
}

/// gpt-oss's files keep the experts fused and transposed (`gate_up_proj` `(experts, hidden,
/// 2 · width)`, gate and up columns alternating) with the router as `mlp.router`: a model saved
/// and read back is the one loaded, tensor for tensor. Its MXFP4 form (OpenAI's checkpoints) is
/// saved dense, as transformers saves a dequantized model: no blocks, no quantization_config,
/// the same log-probs read back.
#[test]
fn gpt_oss_saves_its_fused_layout_and_mxfp4_dense() {
    let r = reference();
    let tmp = tempfile::tempdir().unwrap();
    let m = load_case(&r["cases"]["gptoss"], tmp.path());
    let out = tmp.path().join("saved");
    grpo_rollout::save_hf_dir(&m.model, &m.tokenizer, &out, DType::F32).unwrap();
    let saved = grpo_rollout::loader::read_safetensors(&out, &Device::Cpu).unwrap();
    let original =
        grpo_rollout::loader::read_safetensors(&fixtures().join("arch-gptoss-micro"), &Device::Cpu)
            .unwrap();
    same_tensors(&saved, &original, "gpt-oss");
    assert_eq!(
        saved["model.layers.1.mlp.experts.gate_up_proj"].dims(),
        &[4, 32, 128]
    );
    let back = grpo_rollout::load(&out, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(back.model.cfg, m.model.cfg);
    assert_eq!(logprobs(&back.model, &r), logprobs(&m.model, &r));

    let q = load_case(&r["cases"]["gptoss-mxfp4"], tmp.path());
    let out = tmp.path().join("saved-mxfp4");
    grpo_rollout::save_hf_dir(&q.model, &q.tokenizer, &out, DType::F32).unwrap();
    let saved = grpo_rollout::loader::read_safetensors(&out, &Device::Cpu).unwrap();
    assert!(
        saved
            .keys()
            .all(|k| !k.ends_with("_blocks") && !k.ends_with("_scales"))
    );
    assert!(saved.contains_key("model.layers.0.mlp.experts.down_proj"));
    let cfg = std::fs::read_to_string(out.join("config.json")).unwrap();
    assert!(!cfg.contains("quantization_config"), "{cfg}");
    let back = grpo_rollout::load(&out, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(logprobs(&back.model, &r), logprobs(&q.model, &r));
}

/// MXFP4 as transformers reads it: two FP4 (E2M1) codes a byte, the low nibble first, each
/// group of 32 times `2^(scale − 127)`; blocks and scales that do not fit, or are not uint8,
/// are errors naming the weight.
#[test]
fn mxfp4_dequantizes_as_transformers_does() {
    use grpo_rollout::layout::dequantize_mxfp4;
    // Two rows of one group: codes 0..16 then 16..32 (as bytes lo | hi << 4).
    let mut bytes = Vec::new();
    for row in 0..2u8 {
        for j in 0..16u8 {
            let lo = (2 * j) % 16;
            let hi = (2 * j + 1 + row) % 16;
            bytes.push(lo | (hi << 4));
        }
    }
    let blocks = Tensor::from_vec(bytes, (2, 1, 16), &Device::Cpu).unwrap();
    let scales = Tensor::from_vec(vec![127u8, 129], (2, 1), &Device::Cpu).unwrap();
    let w: Vec<Vec<f32>> = dequantize_mxfp4(&blocks, &scales, DType::F32, "w")
        .unwrap()
        .to_vec2()
        .unwrap();
    let fp4 = [
        0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
    ];
    for (row, scale) in [(0usize, 1.0f32), (1, 4.0)] {
        for j in 0..16 {
            assert_eq!(
                w[row][2 * j],
                fp4[(2 * j) % 16] * scale,
                "row {row} value {}",
                2 * j
            );
            let hi = (2 * j + 1 + row) % 16;
            assert_eq!(
                w[row][2 * j + 1],
                fp4[hi] * scale,
                "row {row} value {}",
                2 * j + 1
            );
        }
    }
    // Exponents at both ends: 2^-127 (a subnormal f32) and 2^127.
    let one = Tensor::from_vec(vec![0x22u8; 16], (1, 1, 16), &Device::Cpu).unwrap();
    for (s, want) in [(0u8, 2f32.powi(-127)), (254, 2f32.powi(127))] {
        let sc = Tensor::from_vec(vec![s], (1, 1), &Device::Cpu).unwrap();
        let v: Vec<f32> = dequantize_mxfp4(&one, &sc, DType::F32, "w")
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert!(v.iter().all(|x| *x == want), "scale {s}: {}", v[0]);
    }
    // Every value is exact in bf16 (two significant bits times a power of two): read into
    // bf16 (the dtype of OpenAI's files) they are the f32 ones.
    let bytes: Vec<u8> = (0..3 * 4 * 16)
        .map(|i| ((i * 37 + 11) % 256) as u8)
        .collect();
    let scales: Vec<u8> = (0..3 * 4).map(|i| (100 + i * 7) as u8).collect();
    let blocks = Tensor::from_vec(bytes, (3, 4, 16), &Device::Cpu).unwrap();
    let scales = Tensor::from_vec(scales, (3, 4), &Device::Cpu).unwrap();
    let f = dequantize_mxfp4(&blocks, &scales, DType::F32, "w").unwrap();
    let b = dequantize_mxfp4(&blocks, &scales, DType::BF16, "w").unwrap();
    assert_eq!(b.dtype(), DType::BF16);
    assert_eq!(f.dims(), &[3, 128]);
    let (f, b): (Vec<f32>, Vec<f32>) = (
        f.flatten_all().unwrap().to_vec1().unwrap(),
        b.to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap(),
    );
    assert_eq!(f, b);
    let bad = Tensor::from_vec(vec![127u8; 2], (1, 2), &Device::Cpu).unwrap();
    let e = dequantize_mxfp4(&one, &bad, DType::F32, "weight `x_blocks`")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("weight `x_blocks`") && e.contains("do not fit"),
        "{e}"
    );
    let e = dequantize_mxfp4(&one.to_dtype(DType::F32).unwrap(), &bad, DType::F32, "w")
        .unwrap_err()
        .to_string();
    assert!(e.contains("uint8"), "{e}");
}

/// gpt-oss's clamped SwiGLU at hand-computed points: `(clamp(up) + 1) · g · sigmoid(1.702 g)`
/// with `g = min(gate, 7)`; a clamped input passes no gradient, the others do.
#[test]
fn clamped_swiglu_values_and_gradients() {
    use candle_core::Var;
    let gate = Var::new(&[-1.0f64, 0.5, 8.0, 2.0], &Device::Cpu).unwrap();
    let up = Var::new(&[-9.0f64, 0.2, 3.0, 7.5], &Device::Cpu).unwrap();
    let y =
        grpo_rollout::model::clamped_swiglu(gate.as_tensor(), up.as_tensor(), 1.702, 7.0).unwrap();
    let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
    let want: Vec<f64> = [(-1.0, -7.0), (0.5, 0.2), (7.0, 3.0), (2.0, 7.0)]
        .iter()
        .map(|(g, u): &(f64, f64)| (u + 1.0) * g * sig(1.702 * g))
        .collect();
    let got: Vec<f64> = y.to_vec1().unwrap();
    for (a, b) in got.iter().zip(&want) {
        assert!((a - b).abs() < 1e-12, "{got:?} vs {want:?}");
    }
    let grads = y.sum_all().unwrap().backward().unwrap();
    let gg: Vec<f64> = grads.get(gate.as_tensor()).unwrap().to_vec1().unwrap();
    let gu: Vec<f64> = grads.get(up.as_tensor()).unwrap().to_vec1().unwrap();
    // d/d up = g · sigmoid(alpha g) where up is inside the clamp; 0 where it is clamped.
    assert_eq!(gu[0], 0.0);
    assert_eq!(gu[3], 0.0);
    assert!((gu[1] - 0.5 * sig(1.702 * 0.5)).abs() < 1e-12);
    // d/d gate = (u + 1)(sigmoid(a g) + a g sigmoid(a g)(1 − sigmoid(a g))); 0 above the limit.
    assert_eq!(gg[2], 0.0);
    let dg = |g: f64, u: f64| {
        let s = sig(1.702 * g);
        (u + 1.0) * (s + 1.702 * g * s * (1.0 - s))
    };
    assert!((gg[0] - dg(-1.0, -7.0)).abs() < 1e-12);
    assert!((gg[1] - dg(0.5, 0.2)).abs() < 1e-12);
}

/// What gpt-oss's files can hold that the model does not read is refused by name: another
/// quantization method, an MXFP4 weight without its scales, a GGUF export.
#[test]
fn gpt_oss_refusals_are_named() {
    let r = reference();
    let tmp = tempfile::tempdir().unwrap();
    let mut case = r["cases"]["gptoss"].clone();
    case["config"] = serde_json::json!({"quantization_config": {"quant_method": "bitsandbytes"}});
    let e = grpo_rollout::load(&model_dir(&case, tmp.path()), DType::F32, &Device::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("quant_method `bitsandbytes`"), "{e}");

    let tmp = tempfile::tempdir().unwrap();
    let d = model_dir(&r["cases"]["gptoss-mxfp4"], tmp.path());
    let f = d.join("model.safetensors");
    let mut w = candle_core::safetensors::load(&f, &Device::Cpu).unwrap();
    w.remove("model.layers.1.mlp.experts.down_proj_scales")
        .unwrap();
    candle_core::safetensors::save(&w, &f).unwrap();
    let e = grpo_rollout::load(&d, DType::F32, &Device::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("`model.layers.1.mlp.experts.down_proj_scales` is missing"),
        "{e}"
    );

    let tmp = tempfile::tempdir().unwrap();
    let m = load_case(&r["cases"]["gptoss"], tmp.path());
    let e = gguf_refusal(&m, &tmp.path().join("x.gguf"));
    assert!(e.contains("gpt-oss has no GGUF form"), "{e}");
}

/// GLM's modules as PEFT sees them: gate and up are one `gate_up_proj` (naming either is an
/// error that says so), q, k, v apart (`qkv_proj` refused); no GGUF form.
#[test]
fn glm_refusals_are_named() {
    use grpo_rollout::lora::{LoraConfig, TargetModules};
    let r = reference();
    let tmp = tempfile::tempdir().unwrap();
    let m = load_case(&r["cases"]["glm4"], tmp.path());
    for bad in ["gate_proj", "qkv_proj"] {
        let cfg = LoraConfig {
            target_modules: TargetModules::Names(vec![bad.into()]),
            ..Default::default()
        };
        let mut model = m.model.clone();
        let e = grpo_rollout::lora::attach(&mut model, &cfg, 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains(bad) && e.contains("gate_up_proj"), "{e}");
    }
    let cfg = LoraConfig {
        target_modules: TargetModules::Names(vec!["gate_up_proj".into(), "q_proj".into()]),
        ..Default::default()
    };
    let mut model = m.model.clone();
    grpo_rollout::lora::attach(&mut model, &cfg, 0).unwrap();
    let l = &model.layers[1];
    assert!(l.q_proj.lora.is_some() && l.k_proj.lora.is_none());
    let (g, u) = (l.gate_proj.lora.as_ref(), l.up_proj.lora.as_ref());
    assert_eq!(g.unwrap().a.id(), u.unwrap().a.id());
    let m = load_case(&r["cases"]["glm"], tmp.path());
    let e = gguf_refusal(&m, &tmp.path().join("x.gguf"));
    assert!(e.contains("glm has no GGUF form"), "{e}");
}

/// OLMo 3 has no GGUF form here, and no `sliding_window = null` (its sliding layers come with
/// the window): both refused by name.
#[test]
fn olmo3_refusals_are_named() {
    let r = reference();
    let tmp = tempfile::tempdir().unwrap();
    let m = load_case(&r["cases"]["olmo3"], tmp.path());
    let e = gguf_refusal(&m, &tmp.path().join("x.gguf"));
    assert!(e.contains("OLMo 3 has no GGUF form"), "{e}");
    let mut case = r["cases"]["olmo3"].clone();
    case["config"] = serde_json::json!({"sliding_window": null});
    let tmp = tempfile::tempdir().unwrap();
    let e = grpo_rollout::load(&model_dir(&case, tmp.path()), DType::F32, &Device::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("sliding_window = null is not supported for olmo3"),
        "{e}"
    );
}

/// Seed-OSS as llama.cpp's `seed_oss` GGUF: q/k unpermuted with their biases, the MLP-input norm
/// as `post_attention_norm`; read back, the same model. Biases llama.cpp's graph lacks (o, MLP)
/// are refused by name. llama.cpp itself reads these files to transformers' log-probs (README).
#[test]
fn seed_oss_gguf_round_trips_and_refuses_what_llama_cpp_lacks() {
    let r = reference();
    let tmp = tempfile::tempdir().unwrap();
    let m = load_case(&r["cases"]["seedoss"], tmp.path());
    let (written, cfg, d) = through_gguf(&m, &r, tmp.path());
    assert!(d < 1e-5, "seed_oss through GGUF: {d}");
    assert_eq!(cfg.arch, Arch::SeedOss);
    assert!(cfg.attention_bias && !cfg.attention_out_bias);
    let has = |g: &str| written.iter().any(|(n, _)| n == g);
    assert!(has("blk.1.post_attention_norm.weight") && !has("blk.1.ffn_norm.weight"));
    for case in ["seedoss-out-bias", "seedoss-mlp-bias"] {
        let tmp = tempfile::tempdir().unwrap();
        let m = load_case(&r["cases"][case], tmp.path());
        let e = gguf_refusal(&m, &tmp.path().join("x.gguf"));
        assert!(
            e.contains("Seed-OSS with attention_out_bias or mlp_bias"),
            "{e}"
        );
    }
}

/// Arcee as llama.cpp's `arcee` GGUF: llama's tensors (q/k rows permuted) without `ffn_gate`,
/// the ReLU² llama.cpp fixes for it read back; read back, the same model. Biases, which
/// llama.cpp's arcee lacks, are refused by name, as is an activation llama.cpp would not run.
#[test]
fn arcee_gguf_round_trips_and_refuses_what_llama_cpp_lacks() {
    let r = reference();
    let tmp = tempfile::tempdir().unwrap();
    let m = load_case(&r["cases"]["arcee"], tmp.path());
    assert!(m.model.layers[0].gate_proj.is_absent());
    let (written, cfg, d) = through_gguf(&m, &r, tmp.path());
    assert!(d < 1e-5, "arcee through GGUF: {d}");
    assert_eq!(cfg.activation, grpo_rollout::config::Activation::Relu2);
    let has = |g: &str| written.iter().any(|(n, _)| n == g);
    assert!(has("blk.0.ffn_up.weight") && !has("blk.0.ffn_gate.weight"));
    let tmp = tempfile::tempdir().unwrap();
    let m = load_case(&r["cases"]["arcee-mlp-bias"], tmp.path());
    let e = gguf_refusal(&m, &tmp.path().join("x.gguf"));
    assert!(e.contains("Arcee with attention_bias or mlp_bias"), "{e}");
    let mut case = r["cases"]["arcee"].clone();
    case["config"] = serde_json::json!({"mlp_bias": false, "hidden_act": "silu"});
    let tmp = tempfile::tempdir().unwrap();
    let m = load_case(&case, tmp.path());
    let e = gguf_refusal(&m, &tmp.path().join("x.gguf"));
    assert!(
        e.contains("arcee with hidden_act Silu has no GGUF form"),
        "{e}"
    );
}

/// `model` with fresh `"all-linear"` adapters saved to `dir` in PEFT's format: the
/// `target_modules` the saved config names.
fn all_linear_saved(model: &grpo_rollout::Transformer, dir: &Path) -> Vec<String> {
    use grpo_rollout::lora::{LoraConfig, TargetModules};
    let cfg = LoraConfig {
        target_modules: TargetModules::Pattern("all-linear".into()),
        ..Default::default()
    };
    let mut model = model.clone();
    grpo_rollout::lora::attach(&mut model, &cfg, 0).unwrap();
    grpo_rollout::lora::save_peft(&model, &cfg, dir, "base").unwrap();
    let saved: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("adapter_config.json")).unwrap())
            .unwrap();
    saved["target_modules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect()
}

/// `"all-linear"` is saved as PEFT saves it: the names of the modules it matched, so Arcee's
/// adapter config names no `gate_proj` (its MLP has none), and a reload adapts the same maps.
#[test]
fn all_linear_is_saved_as_the_modules_it_matched() {
    let r = reference();
    let tmp = tempfile::tempdir().unwrap();
    let m = load_case(&r["cases"]["arcee"], tmp.path());
    let out = tmp.path().join("adapter");
    let names = all_linear_saved(&m.model, &out);
    assert_eq!(
        names,
        [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "up_proj",
            "down_proj"
        ]
    );
    let mut back = m.model.clone();
    grpo_rollout::lora::load_peft(&mut back, &out).unwrap();
    let l = &back.layers[1];
    assert!(l.up_proj.lora.is_some() && l.down_proj.lora.is_some() && l.q_proj.lora.is_some());
}

/// GLM-4.5's router offsets (`e_score_correction_bias`) choose the experts: without them the
/// log-probs move far from transformers'. They are a constant of the model: held in f32 in a
/// bf16 model, left out of full fine-tuning's variables, written back as read. The
/// checkpoints' next-token-prediction layer (a layer past `num_hidden_layers`) is skipped.
#[test]
fn glm4_moe_router_offsets_are_constants_that_choose() {
    use grpo_rollout::moe::MoeNames;
    let r = reference();
    let case = &r["cases"]["glm4moe-groups"];
    let tmp = tempfile::tempdir().unwrap();
    let dir = model_dir(case, tmp.path());
    // An MTP layer's tensors, as GLM-4.5's files hold them after the last decoder layer.
    let file = dir.join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&file, &Device::Cpu).unwrap();
    for name in ["eh_proj.weight", "self_attn.q_proj.weight", "enorm.weight"] {
        let t = Tensor::ones((4, 4), DType::F32, &Device::Cpu).unwrap();
        tensors.insert(format!("model.layers.3.{name}"), t);
    }
    candle_core::safetensors::save(&tensors, &file).unwrap();
    let m = grpo_rollout::load(&dir, DType::F32, &Device::Cpu).unwrap();
    let got: Vec<f64> = logprobs(&m.model, &r).iter().map(|x| *x as f64).collect();
    assert!(max_diff(&got, &want(case)) <= 1e-4);

    // Zero offsets: other experts chosen, other log-probs.
    let mut zeroed = m.model.clone();
    for l in zeroed.layers.iter_mut() {
        if let Some(moe) = l.moe.as_mut() {
            let b = moe.correction_bias.as_ref().unwrap();
            moe.correction_bias = Some(b.zeros_like().unwrap());
        }
    }
    let moved: Vec<f64> = logprobs(&zeroed, &r).iter().map(|x| *x as f64).collect();
    assert!(max_diff(&moved, &want(case)) > 0.05);

    // Full fine-tuning: every weight a variable but the offsets, which stay the model's.
    let names = MoeNames::of(Arch::Glm4Moe);
    let tm = grpo_rollout::policy::TrainableModel::full(&m.model).unwrap();
    assert!(tm.vars.iter().all(|(n, _)| !MoeNames::is_buffer(n)));
    assert!(tm.vars.iter().any(|(n, _)| n == &names.router(1)));
    let weights: std::collections::HashMap<String, Tensor> =
        tm.model.weights().into_iter().collect();
    let read = &tensors[&names.correction_bias(1)];
    let held = &weights[&names.correction_bias(1)];
    assert_eq!(
        held.to_vec1::<f32>().unwrap(),
        read.to_vec1::<f32>().unwrap()
    );
    assert_eq!(
        tm.vars.len() + 2,
        weights.len(),
        "two MoE layers' offsets are not variables"
    );

    // bf16: the weights rounded, the router's weight and offsets kept in f32 as transformers
    // keeps them, and saved so.
    let b = grpo_rollout::load(&dir, DType::BF16, &Device::Cpu).unwrap();
    let moe = b.model.layers[1].moe.as_ref().unwrap();
    assert_eq!(moe.router.weight.dtype(), DType::F32);
    assert_eq!(b.model.layers[1].q_proj.weight.dtype(), DType::BF16);
    let saved = tmp.path().join("bf16");
    grpo_rollout::save_hf_dir(&b.model, &b.tokenizer, &saved, DType::BF16).unwrap();
    let st = candle_core::safetensors::load(saved.join("model.safetensors"), &Device::Cpu).unwrap();
    assert_eq!(st[&names.router(1)].dtype(), DType::F32);
    assert_eq!(st[&names.correction_bias(1)].dtype(), DType::F32);
    assert_eq!(
        st["model.layers.1.self_attn.q_proj.weight"].dtype(),
        DType::BF16
    );
    assert_eq!(
        st[&names.router(1)].to_vec2::<f32>().unwrap(),
        tensors[&names.router(1)].to_vec2::<f32>().unwrap()
    );
    // Trained in bf16 with LoRA on the router: its adapter in f32 too, the forward runs.
    let cfg = grpo_rollout::lora::LoraConfig {
        target_modules: grpo_rollout::lora::TargetModules::Names(vec!["q_proj".into()]),
        target_parameters: vec!["gate.weight".into()],
        ..Default::default()
    };
    let tm = grpo_rollout::policy::TrainableModel::lora(&b.model, &cfg, 1).unwrap();
    let router = &tm.model.layers[1].moe.as_ref().unwrap().router;
    assert_eq!(router.lora.as_ref().unwrap().a.dtype(), DType::F32);
    let lp = logprobs(&tm.model, &r);
    assert!(lp.iter().all(|x| x.is_finite()));
    let offsets = moe.correction_bias.as_ref().unwrap();
    assert_eq!(offsets.dtype(), DType::F32);
    assert_eq!(
        offsets.to_vec1::<f32>().unwrap(),
        read.to_vec1::<f32>().unwrap()
    );
}

/// The error loading `case`'s model with `change` over its config.
fn load_error(case: &Value, change: Value) -> String {
    let mut case = case.clone();
    for (k, v) in change.as_object().unwrap() {
        case["config"][k] = v.clone();
    }
    let tmp = tempfile::tempdir().unwrap();
    grpo_rollout::load(&model_dir(&case, tmp.path()), DType::F32, &Device::Cpu)
        .err()
        .unwrap()
        .to_string()
}

/// GLM-4.5's routing groups must split the experts evenly and leave enough experts; its dense
/// layers are its first ones: each refused by name; it exports as GGUF. Its attention modules and
/// its experts' `target_parameters` take adapters.
#[test]
fn glm4_moe_refusals_are_named() {
    use grpo_rollout::lora::{LoraConfig, TargetModules};
    let r = reference();
    let refused = |change: serde_json::Value| load_error(&r["cases"]["glm4moe"], change);
    let e = refused(serde_json::json!({"n_group": 3}));
    assert!(e.contains("n_group = 3 must divide the 8 experts"), "{e}");
    let e = refused(serde_json::json!({"n_group": 2, "topk_group": 3}));
    assert!(
        e.contains("topk_group = 3 must be from 1 to n_group (2)"),
        "{e}"
    );
    let e = refused(serde_json::json!({"n_group": 8}));
    assert!(e.contains("leaves 1 expert(s) per group"), "{e}");
    let e = refused(serde_json::json!({"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3}));
    assert!(
        e.contains("num_experts_per_tok = 3 is more than the 2 experts"),
        "{e}"
    );

    let tmp = tempfile::tempdir().unwrap();
    let m = load_case(&r["cases"]["glm4moe"], tmp.path());
    let mut cfg = m.model.cfg.clone();
    cfg.moe.as_mut().unwrap().mlp_only_layers = vec![1];
    let e = cfg.validate().unwrap_err().to_string();
    assert!(e.contains("first `first_k_dense_replace`"), "{e}");
    // Attention modules and the experts' target_parameters take adapters.
    let cfg = LoraConfig {
        target_modules: TargetModules::Names(vec!["q_proj".into()]),
        target_parameters: vec!["mlp.experts.gate_up_proj".into()],
        ..Default::default()
    };
    let mut model = m.model.clone();
    grpo_rollout::lora::attach(&mut model, &cfg, 0).unwrap();
    let moe = model.layers[1].moe.as_ref().unwrap();
    assert!(moe.experts[0].gate_proj.lora.is_some() && moe.experts[0].down_proj.lora.is_none());
    assert!(moe.shared.as_ref().unwrap().0.gate_proj.lora.is_none());
    // As llama.cpp's glm4moe (its checks: tests/it/moe.rs, tests/it/gguf.rs).
    gguf_written(&m, &tmp.path().join("x.gguf"));
}

/// DeepSeek's latent attention: what it does not support is refused by name (key/value heads
/// other than the heads, values wider than the queries; it exports as GGUF); its LoRA default targets are
/// its query map and `kv_b_proj` (it has no `v_proj`); `q_a_proj` takes an adapter of its own.
#[test]
fn deepseek_v3_latent_attention_refusals_and_targets() {
    use grpo_rollout::lora::{LoraConfig, TargetModules};
    let r = reference();
    let refused = |change: serde_json::Value| load_error(&r["cases"]["deepseekv3"], change);
    let e = refused(serde_json::json!({"num_key_value_heads": 2}));
    assert!(
        e.contains("num_key_value_heads = 2 is not supported for deepseek_v3"),
        "{e}"
    );
    let e = refused(serde_json::json!({"v_head_dim": 20}));
    assert!(e.contains("v_head_dim (20) wider than a query head"), "{e}");

    let tmp = tempfile::tempdir().unwrap();
    let m = load_case(&r["cases"]["deepseekv3"], tmp.path());
    let cfg = &m.model.cfg;
    assert_eq!((cfg.head_dim, cfg.rotary_dim()), (16, 8));
    // As llama.cpp's deepseek2 (its checks and refusals: tests/it/moe.rs, tests/it/gguf.rs).
    gguf_written(&m, &tmp.path().join("x.gguf"));

    let tm =
        grpo_rollout::policy::TrainableModel::lora(&m.model, &LoraConfig::default(), 1).unwrap();
    let saved = tm.lora.as_ref().unwrap();
    assert_eq!(
        saved.target_modules,
        TargetModules::Names(vec!["q_b_proj".into(), "kv_b_proj".into()])
    );
    let cfg = LoraConfig {
        target_modules: TargetModules::Names(vec!["q_a_proj".into()]),
        ..Default::default()
    };
    let tm = grpo_rollout::policy::TrainableModel::lora(&m.model, &cfg, 1).unwrap();
    let names: Vec<&String> = tm.vars.iter().map(|v| &v.0).collect();
    assert_eq!(names.len(), 2 * 3, "{names:?}");
    assert!(
        names.iter().all(|n| n.contains("self_attn.q_a_proj.lora_")),
        "{names:?}"
    );
}

/// The log-probs of `prompts` sampled through `model`'s KV cache equal the full forward's over
/// prompt + completion (left-padded together).
fn assert_cached_equals_full(
    name: &str,
    model: &grpo_rollout::Transformer,
    tok: &grpo_rollout::Tokenizer,
) {
    // The longer prompt's prefill attends with each head's keys and values (over 16 new
    // positions, nothing cached), the shorter's in the latent's space.
    let prompts: Vec<Vec<u32>> = vec![(0..20).map(|i| 3 + 7 * i).collect(), vec![7, 8, 9]];
    let d = model.for_decoding().unwrap();
    let out = grpo_rollout::generate(&d, tok, &prompts, 1, &sampled_14()).unwrap();
    assert!(out.iter().all(|c| c.logprobs.len() == 14), "{name}");
    let worst = full_forward_gap(model, &prompts, &out);
    eprintln!("{name}: cached vs full {worst:e}");
    assert!(worst < 1e-4, "{name}: cached vs full {worst}");
}

/// DeepSeek's latent attention decodes over a cache of the latent — `kv_lora_rank +
/// qk_rope_head_dim` values per position and layer, not each head's key and value — with
/// `kv_b_proj` folded into the queries and the context: the sampled tokens' log-probs equal the
/// full forward's (which expands every head) for each variant (q_a or q_proj, interleaved or
/// rotate-half RoPE, YaRN's scale), with an unmerged PEFT adapter on `kv_b_proj` and with a
/// bias on it.
#[test]
fn latent_attention_decodes_over_a_latent_cache() {
    use grpo_rollout::mla::with_latent_cache;
    use grpo_rollout::model::{KvCache, padded_positions_and_bias};
    let r = reference();
    for name in [
        "deepseekv3",
        "deepseekv3-rotate-half",
        "deepseekv3-yarn",
        "deepseekv3-noq",
        "glm4moelite",
        "glm4moelite-rotate-half",
        "deepseekv2",
        "deepseekv2-yarn",
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let m = load_case(&r["cases"][name], tmp.path());
        // Each head's keys and values (the CPU's default), then the latent.
        assert_cached_equals_full(name, &m.model, &m.tokenizer);
        with_latent_cache(true, || {
            assert_cached_equals_full(name, &m.model, &m.tokenizer)
        });
        // The cache of one row of 5 tokens: the latent and the shared key per layer.
        let cfg = &m.model.cfg;
        let mla = cfg.mla.unwrap();
        let mut cache = KvCache::with_capacity(5);
        let ids = Tensor::new(&[[5u32, 6, 7, 8, 9]], &Device::Cpu).unwrap();
        let (pos, bias) =
            padded_positions_and_bias(&ids.ones_like().unwrap(), &Device::Cpu).unwrap();
        let d = m.model.for_decoding().unwrap();
        with_latent_cache(true, || {
            d.forward_hidden(&ids, &pos, &bias, Some(&mut cache))
        })
        .unwrap();
        let per_layer = mla.kv_lora_rank + mla.qk_rope_head_dim;
        assert_eq!(
            cache.bytes(),
            cfg.num_hidden_layers * 5 * per_layer * 4,
            "{name}"
        );
        assert_eq!(cache.bytes(), cfg.kv_cache_values_per_token(true) * 5 * 4);
        let mut heads = KvCache::with_capacity(5);
        d.forward_hidden(&ids, &pos, &bias, Some(&mut heads))
            .unwrap();
        assert_eq!(heads.bytes(), cfg.kv_cache_values_per_token(false) * 5 * 4);
        let per_head = 2 * cfg.num_attention_heads * mla.qk_head_dim();
        assert!(per_layer < per_head, "{name}: {per_layer} vs {per_head}");
    }
    // An adapter on kv_b_proj (PEFT's, `init_lora_weights = false`), not merged.
    let tmp = tempfile::tempdir().unwrap();
    let mut m = load_case(&r["cases"]["deepseekv3"], tmp.path());
    let dir = fixtures().join("peft-moe/deepseekv3-all-linear");
    grpo_rollout::lora::load_peft(&mut m.model, &dir).unwrap();
    assert!(m.model.layers.iter().all(|l| l.v_proj.lora.is_some()));
    with_latent_cache(true, || {
        assert_cached_equals_full("deepseekv3 + adapter", &m.model, &m.tokenizer)
    });
    // A bias on kv_b_proj: its key half drops out of the softmax, its value half is added.
    let mut m = load_case(&r["cases"]["glm4moelite"], tmp.path());
    for (i, l) in m.model.layers.iter_mut().enumerate() {
        let n = l.v_proj.weight.dim(0).unwrap();
        let b: Vec<f32> = (0..n)
            .map(|j| ((i * 31 + j * 7) % 13) as f32 / 13.0 - 0.5)
            .collect();
        l.v_proj.bias = Some(Tensor::from_vec(b, n, &Device::Cpu).unwrap());
    }
    with_latent_cache(true, || {
        assert_cached_equals_full("glm4moelite + kv_b bias", &m.model, &m.tokenizer)
    });
}

/// nanochat: its norms hold no weights (none read, saved or trained: the saved model has the
/// file's tensors and no more), its MLP's `fc1` / `fc2` are PEFT's module names (`"all-linear"`
/// saved as q, k, v, o, fc1, fc2; `up_proj` refused by name), and it has no GGUF form.
#[test]
fn nanochat_names_and_refusals() {
    use grpo_rollout::lora::{LoraConfig, TargetModules};
    use grpo_rollout::policy::TrainableModel;
    let r = reference();
    let tmp = tempfile::tempdir().unwrap();
    let m = load_case(&r["cases"]["nanochat-bias"], tmp.path());
    let names: Vec<String> = m.model.weights().into_iter().map(|(n, _)| n).collect();
    assert!(names.iter().all(|n| !n.contains("norm")), "{names:?}");
    assert!(names.contains(&"model.layers.1.mlp.fc2.weight".to_string()));
    assert_eq!(
        m.model.cfg.num_parameters(),
        m.model
            .weights()
            .iter()
            .map(|(_, t)| t.elem_count())
            .sum::<usize>()
    );
    // Full fine-tuning trains the file's tensors only.
    let full = TrainableModel::full(&m.model).unwrap();
    assert_eq!(full.vars.len(), names.len());
    let out = tmp.path().join("saved");
    grpo_rollout::save_hf_dir(&m.model, &m.tokenizer, &out, DType::F32).unwrap();
    let file = candle_core::safetensors::load(out.join("model.safetensors"), &Device::Cpu).unwrap();
    let src = candle_core::safetensors::load(
        fixtures().join("arch-nanochat-micro/model.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    let mut a: Vec<&String> = file.keys().collect();
    let mut b: Vec<&String> = src.keys().collect();
    a.sort();
    b.sort();
    assert_eq!(a, b);
    let back = grpo_rollout::load(&out, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(logprobs(&back.model, &r), logprobs(&m.model, &r));
    // LoRA: PEFT's names.
    let adapter = tmp.path().join("adapter");
    let targets = all_linear_saved(&m.model, &adapter);
    assert_eq!(
        targets,
        ["q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2"]
    );
    let keys =
        candle_core::safetensors::load(adapter.join("adapter_model.safetensors"), &Device::Cpu)
            .unwrap();
    assert!(
        keys.contains_key("base_model.model.model.layers.0.mlp.fc1.lora_A.weight"),
        "{:?}",
        keys.keys()
    );
    let mut back = m.model.clone();
    grpo_rollout::lora::load_peft(&mut back, &adapter).unwrap();
    assert!(back.layers[1].up_proj.lora.is_some() && back.layers[1].down_proj.lora.is_some());
    let named = LoraConfig {
        target_modules: TargetModules::Names(vec!["fc1".into(), "q_proj".into()]),
        ..Default::default()
    };
    let mut model = m.model.clone();
    grpo_rollout::lora::attach(&mut model, &named, 0).unwrap();
    assert!(model.layers[0].up_proj.lora.is_some() && model.layers[0].down_proj.lora.is_none());
    let wrong = LoraConfig {
        target_modules: TargetModules::Names(vec!["up_proj".into()]),
        ..Default::default()
    };
    let e = grpo_rollout::lora::attach(&mut m.model.clone(), &wrong, 0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("nanochat's MLP is `fc1`"), "{e}");
    let e = gguf_refusal(&m, &tmp.path().join("x.gguf"));
    assert!(e.contains("nanochat has no GGUF form"), "{e}");
}

/// PEFT's `"all-linear"` adapter on nanochat (q, k, v, o, fc1, fc2, every factor drawn:
/// `scripts/gen_nanochat_peft_reference.py`): loaded, the adapted log-probs equal PEFT's, far
/// from the base's; merged, `merge_and_unload()`'s.
#[test]
fn nanochat_peft_adapter_matches_peft() {
    let r = reference();
    let want: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("nanochat_peft_reference.json")).unwrap(),
    )
    .unwrap();
    let flat = |k: &str| -> Vec<f64> {
        serde_json::from_value::<Vec<Vec<f64>>>(want[k].clone())
            .unwrap()
            .concat()
    };
    let base = grpo_rollout::load(
        &fixtures().join("arch-nanochat-micro"),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let mut m = base.model.clone();
    grpo_rollout::lora::load_peft(&mut m, &fixtures().join("peft-nanochat")).unwrap();
    assert!(
        m.layers
            .iter()
            .all(|l| l.up_proj.lora.is_some() && l.down_proj.lora.is_some())
    );
    let lp = |m: &grpo_rollout::Transformer| -> Vec<f64> {
        logprobs(m, &r).iter().map(|x| *x as f64).collect()
    };
    let d = max_diff(&lp(&m), &flat("adapted"));
    assert!(d < 2e-5, "adapted: {d}");
    assert!(max_diff(&lp(&base.model), &flat("adapted")) > 1e-2);
    let merged = grpo_rollout::lora::merge(&m).unwrap();
    let d = max_diff(&lp(&merged), &flat("merged"));
    assert!(d < 2e-5, "merged: {d}");
}

/// A latent cache's rows kept, repeated and stacked (as generation drops finished rows, groups
/// share a prompt's prefill and episodes bring rows back) decode as caches of those rows alone.
#[test]
fn latent_cache_rows_keep_repeat_and_stack() {
    grpo_rollout::mla::with_latent_cache(true, latent_cache_rows);
}

fn latent_cache_rows() {
    use grpo_rollout::model::{KvCache, padded_positions_and_bias};
    let r = reference();
    let tmp = tempfile::tempdir().unwrap();
    let m = load_case(&r["cases"]["glm4moelite"], tmp.path());
    let d = m.model.for_decoding().unwrap();
    let dev = Device::Cpu;
    let prefill = |rows: &[[u32; 5]]| -> KvCache {
        let flat: Vec<u32> = rows.concat();
        let ids = Tensor::from_vec(flat, (rows.len(), 5), &dev).unwrap();
        let (pos, bias) = padded_positions_and_bias(&ids.ones_like().unwrap(), &dev).unwrap();
        let mut cache = KvCache::with_capacity(8);
        d.forward_hidden(&ids, &pos, &bias, Some(&mut cache))
            .unwrap();
        cache
    };
    let step = |mut cache: KvCache, toks: &[u32]| -> Vec<Vec<f32>> {
        let n = toks.len();
        let ids = Tensor::new(toks, &dev).unwrap().reshape((n, 1)).unwrap();
        let pos = Tensor::full(5u32, (n, 1), &dev).unwrap();
        let bias = Tensor::zeros((n, 1, 1, 6), DType::F32, &dev).unwrap();
        let h = d
            .forward_hidden(&ids, &pos, &bias, Some(&mut cache))
            .unwrap();
        h.squeeze(1).unwrap().to_vec2().unwrap()
    };
    let close = |x: &[Vec<f32>], y: &[Vec<f32>]| {
        let worst = x
            .iter()
            .flatten()
            .zip(y.iter().flatten())
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(worst < 1e-5, "{worst}");
    };
    let (a, b) = ([5u32, 6, 7, 8, 9], [11u32, 12, 13, 14, 15]);
    let alone_a = step(prefill(&[a]), &[4]);
    let alone_b = step(prefill(&[b]), &[3]);
    let mut both = prefill(&[a, b]);
    assert_eq!(
        both.bytes(),
        m.model.cfg.kv_cache_values_per_token(true) * 2 * 8 * 4
    );
    both.keep_rows(&Tensor::new(&[1u32], &dev).unwrap())
        .unwrap();
    close(&step(both, &[3]), &alone_b);
    let twice = prefill(&[a, b])
        .select_rows(&Tensor::new(&[0u32, 0], &dev).unwrap())
        .unwrap();
    close(
        &step(twice, &[4, 4]),
        &[alone_a[0].clone(), alone_a[0].clone()],
    );
    let stacked = KvCache::concat_rows(&[prefill(&[b]), prefill(&[a])], 8).unwrap();
    close(
        &step(stacked, &[3, 4]),
        &[alone_b[0].clone(), alone_a[0].clone()],
    );
    // The per-head cache of a dense family is left as it was: keys and values per KV head.
    let dense = load_case(&r["cases"]["arcee"], tmp.path());
    let cfg = &dense.model.cfg;
    assert_eq!(
        cfg.kv_cache_values_per_token(true),
        cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim
    );
}

/// Vision-language checkpoints as transformers saves them (`language_model.model.*` beside a
/// vision tower and projector: `fixtures/vl-*-micro`, `scripts/gen_vision_language_reference.py`)
/// load their language model — Gemma 3's `gemma3_text`, Mistral 3's `ministral3` with YaRN and
/// its top-level `tie_word_embeddings`, Gemma 4's `gemma4_text` (`model.language_model.*`) — with transformers' log-probs of the whole model on text;
/// saved, they are the whole checkpoint again (the vision tower and projector as read, the
/// language model under the checkpoint's names) with the same log-probs; Ministral 3 also as
/// llama.cpp's `mistral3` GGUF.
#[test]
fn vision_language_checkpoints_train_their_language_model() {
    let text = std::fs::read_to_string(fixtures().join("vision_language_reference.json")).unwrap();
    let r: Value = serde_json::from_str(&text).unwrap();
    let rows = serde_json::json!({"rows": r["rows"], "t": 39});
    for (name, arch) in [
        ("gemma3", Arch::Gemma3),
        ("mistral3", Arch::Ministral3),
        ("gemma4", Arch::Gemma4),
        ("qwen2_5_vl", Arch::Qwen2),
        ("qwen3_vl", Arch::Qwen3),
    ] {
        let dir = fixtures().join(format!("vl-{name}-micro"));
        let m = grpo_rollout::load(&dir, DType::F32, &Device::Cpu).unwrap();
        assert_eq!(m.model.cfg.arch, arch);
        assert_eq!(
            m.model.cfg.tie_word_embeddings,
            r["models"][name]["tied"].as_bool().unwrap()
        );
        let want = want(&r["models"][name]);
        let got: Vec<f64> = logprobs(&m.model, &rows)
            .iter()
            .map(|x| *x as f64)
            .collect();
        let d = max_diff(&got, &want);
        assert!(d < 2e-5, "{name}: {d}");
        assert!(want.iter().any(|x| *x < -7.0));
        // Saved: the whole checkpoint again — its config around the language model's, the
        // language model under the checkpoint's names, the vision tower and projector as read.
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("vl");
        grpo_rollout::save_hf_dir(&m.model, &m.tokenizer, &out, DType::F32).unwrap();
        let cj: Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap())
                .unwrap();
        let src: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(cj["model_type"], name);
        // Qwen's language models are classes of their own (`qwen3_vl_text`).
        let text_type = match name.starts_with("qwen") {
            true => format!("{name}_text"),
            false => arch.as_str().to_string(),
        };
        assert_eq!(cj["text_config"]["model_type"], text_type.as_str());
        if name.starts_with("qwen") {
            // The multimodal RoPE's sections written back as read.
            let rope = &cj["text_config"]["rope_parameters"];
            assert_eq!(*rope, src["text_config"]["rope_parameters"], "{name}");
        }
        assert_eq!(cj["vision_config"], src["vision_config"]);
        let back = grpo_rollout::load(&out, DType::F32, &Device::Cpu).unwrap();
        let again: Vec<f64> = logprobs(&back.model, &rows)
            .iter()
            .map(|x| *x as f64)
            .collect();
        assert!(max_diff(&again, &got) < 1e-6, "{name}");
        let (a, b) = (
            grpo_rollout::loader::read_safetensors(&dir, &Device::Cpu).unwrap(),
            grpo_rollout::loader::read_safetensors(&out, &Device::Cpu).unwrap(),
        );
        let mut names: Vec<&String> = b.keys().collect();
        names.sort();
        let mut want_names: Vec<&String> = a.keys().collect();
        want_names.sort();
        assert_eq!(names, want_names, "{name}");
        for (k, t) in &a {
            if !k.starts_with("language_model.") {
                let d = (t - &b[k]).unwrap().abs().unwrap().max_all().unwrap();
                assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0, "{k}");
            }
        }
        if arch == Arch::Ministral3 {
            let Some(RopeScaling::Yarn(y)) = &m.model.cfg.rope_scaling else {
                panic!("{:?}", m.model.cfg.rope_scaling)
            };
            assert_eq!(
                (
                    y.factor,
                    y.original_max_position_embeddings,
                    y.llama_4_scaling_beta
                ),
                (4.0, 48, Some(0.1))
            );
            let tc = &serde_json::from_str::<Value>(
                &std::fs::read_to_string(out.join("config.json")).unwrap(),
            )
            .unwrap()["text_config"];
            assert_eq!(tc["rope_scaling"]["llama_4_scaling_beta"], 0.1);
            // As llama.cpp's mistral3: the same config and log-probs.
            let (written, cfg, d) = through_gguf(&m, &rows, tmp.path());
            assert!(d < 1e-5, "{d}");
            assert_eq!(cfg.arch, Arch::Ministral3);
            assert_eq!(cfg.rope_scaling, m.model.cfg.rope_scaling);
            assert!(written.iter().any(|(n, _)| n == "blk.1.attn_q.weight"));
        }
    }
}

/// Qwen2.5-VL's released configs hold the language model's fields at the top (`rope_scaling`
/// `{"type": "mrope", "mrope_section": ...}`): the same model as with `text_config`, and saved
/// with a `text_config` as transformers 5 writes it.
#[test]
fn qwen2_5_vl_reads_its_released_config_layout() {
    let text = std::fs::read_to_string(fixtures().join("vision_language_reference.json")).unwrap();
    let r: Value = serde_json::from_str(&text).unwrap();
    let rows = serde_json::json!({"rows": r["rows"], "t": 39});
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    for e in std::fs::read_dir(fixtures().join("vl-qwen2_5_vl-micro")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), src.join(e.file_name())).unwrap();
    }
    let path = src.join("config.json");
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let mut t = c.as_object_mut().unwrap().remove("text_config").unwrap();
    let t = t.as_object_mut().unwrap();
    t.remove("model_type");
    let rope = t.remove("rope_parameters").unwrap();
    t.insert("rope_theta".into(), rope["rope_theta"].clone());
    t.insert(
        "rope_scaling".into(),
        serde_json::json!({"type": "mrope", "mrope_section": rope["mrope_section"]}),
    );
    c.as_object_mut().unwrap().extend(t.clone());
    std::fs::write(&path, c.to_string()).unwrap();
    let m = grpo_rollout::load(&src, DType::F32, &Device::Cpu).unwrap();
    let base = grpo_rollout::load(
        &fixtures().join("vl-qwen2_5_vl-micro"),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    assert_eq!(m.model.cfg, base.model.cfg);
    let got: Vec<f64> = logprobs(&m.model, &rows)
        .iter()
        .map(|x| *x as f64)
        .collect();
    assert!(max_diff(&got, &want(&r["models"]["qwen2_5_vl"])) < 2e-5);
    let out = tmp.path().join("out");
    grpo_rollout::save_hf_dir(&m.model, &m.tokenizer, &out, DType::F32).unwrap();
    let cj: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cj["text_config"]["model_type"], "qwen2_5_vl_text");
    assert_eq!(
        cj["text_config"]["rope_parameters"]["mrope_section"],
        rope["mrope_section"]
    );
    assert!(cj.get("hidden_size").is_none() && cj.get("rope_scaling").is_none());
    assert_eq!(cj["vision_config"], c["vision_config"]);
}

/// A vision-language checkpoint's processor files (`preprocessor_config.json`, ...) are written
/// back beside it, as read.
#[test]
fn vision_language_processor_files_are_written_back() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    for e in std::fs::read_dir(fixtures().join("vl-gemma3-micro")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), src.join(e.file_name())).unwrap();
    }
    let pre =
        r#"{"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 28, "width": 28}}"#;
    std::fs::write(src.join("preprocessor_config.json"), pre).unwrap();
    let m = grpo_rollout::load(&src, DType::F32, &Device::Cpu).unwrap();
    let out = tmp.path().join("out");
    grpo_rollout::save_hf_dir(&m.model, &m.tokenizer, &out, DType::BF16).unwrap();
    assert_eq!(
        std::fs::read_to_string(out.join("preprocessor_config.json")).unwrap(),
        pre
    );
    assert!(!out.join("processor_config.json").exists());
    let cj: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cj["torch_dtype"], "bfloat16");
}

/// A PEFT adapter trained on a vision-language model (`base_model.model.model.language_model.*`,
/// its `target_modules` a regex over the language model: `fixtures/vl-*-peft`) loads onto the
/// language model with PEFT's adapted log-probs; ours is saved under the same names and reads
/// back the same.
#[test]
fn vision_language_peft_adapters_match_peft() {
    let text = std::fs::read_to_string(fixtures().join("vision_language_reference.json")).unwrap();
    let r: Value = serde_json::from_str(&text).unwrap();
    let rows = serde_json::json!({"rows": r["rows"], "t": 39});
    for name in ["gemma3", "mistral3", "gemma4", "qwen2_5_vl", "qwen3_vl"] {
        let mut m = grpo_rollout::load(
            &fixtures().join(format!("vl-{name}-micro")),
            DType::F32,
            &Device::Cpu,
        )
        .unwrap();
        let cfg = grpo_rollout::lora::load_peft(
            &mut m.model,
            &fixtures().join(format!("vl-{name}-peft")),
        )
        .unwrap();
        let got: Vec<f64> = logprobs(&m.model, &rows)
            .iter()
            .map(|x| *x as f64)
            .collect();
        let want: Vec<f64> =
            serde_json::from_value::<Vec<Vec<f64>>>(r["models"][name]["adapted_logprobs"].clone())
                .unwrap()
                .concat();
        let d = max_diff(&got, &want);
        assert!(d < 2e-5, "{name}: {d}");
        assert!(max_diff(&want, &self::want(&r["models"][name])) > 0.05);
        let tmp = tempfile::tempdir().unwrap();
        grpo_rollout::lora::save_peft(&m.model, &cfg, tmp.path(), "base").unwrap();
        // Its targets: the language model's modules only (not the vision tower's q_proj).
        let ac: Value = serde_json::from_str(
            &std::fs::read_to_string(tmp.path().join("adapter_config.json")).unwrap(),
        )
        .unwrap();
        assert!(
            ac["target_modules"]
                .as_str()
                .is_some_and(|t| t.contains("language_model") && t.contains("q_proj")),
            "{}",
            ac["target_modules"]
        );
        let keys: Vec<String> = candle_core::safetensors::load(
            tmp.path().join("adapter_model.safetensors"),
            &Device::Cpu,
        )
        .unwrap()
        .into_keys()
        .collect();
        assert!(
            keys.iter()
                .all(|k| k.starts_with("base_model.model.model.language_model.layers.")),
            "{keys:?}"
        );
        let mut again = grpo_rollout::load(
            &fixtures().join(format!("vl-{name}-micro")),
            DType::F32,
            &Device::Cpu,
        )
        .unwrap();
        grpo_rollout::lora::load_peft(&mut again.model, tmp.path()).unwrap();
        let back: Vec<f64> = logprobs(&again.model, &rows)
            .iter()
            .map(|x| *x as f64)
            .collect();
        assert!(max_diff(&back, &got) < 1e-6, "{name}");
        // Our own adapter on named modules: saved as a pattern over the language model, read
        // back onto the same modules.
        let lcfg = grpo_rollout::lora::LoraConfig {
            target_modules: grpo_rollout::lora::TargetModules::Names(vec![
                "q_proj".into(),
                "v_proj".into(),
            ]),
            ..Default::default()
        };
        let fresh = grpo_rollout::load(
            &fixtures().join(format!("vl-{name}-micro")),
            DType::F32,
            &Device::Cpu,
        )
        .unwrap();
        let tm = grpo_rollout::policy::TrainableModel::lora(&fresh.model, &lcfg, 3).unwrap();
        let dir = tmp.path().join("ours");
        grpo_rollout::lora::save_peft(&tm.model, tm.lora.as_ref().unwrap(), &dir, "base").unwrap();
        let ac: Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("adapter_config.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(
            ac["target_modules"],
            r"model\.language_model\..*\.(?:q_proj|v_proj)"
        );
        let mut again = fresh.clone();
        grpo_rollout::lora::load_peft(&mut again.model, &dir).unwrap();
        let adapted = again
            .model
            .layers
            .iter()
            // (Gemma 4's layers without values of their own: no adapter on the absent map.)
            .filter(|l| l.q_proj.lora.is_some() && l.v_proj.lora.is_some() != l.v_proj.is_absent())
            .count();
        assert_eq!(adapted, again.model.layers.len());
    }
}

/// Ministral 3 past its pre-training length (where its queries' temperature grows) is refused
/// in one line naming it; without YaRN parameters it is refused too (transformers' class reads
/// them); a vision-language checkpoint quantized otherwise than FP8 is refused by its method.
#[test]
fn ministral3_refusals_are_named() {
    let m = grpo_rollout::load(
        &fixtures().join("vl-mistral3-micro"),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let rows: Vec<Vec<u32>> = vec![(3..60).collect()];
    let (ids, mask) = left_pad(&rows, 0, &Device::Cpu).unwrap();
    let e = m
        .model
        .completion_logprobs(&ids, &mask, 10, 1.0, false)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("original_max_position_embeddings (48")
            && e.contains("1 + 0.1 · ln(1 + ⌊position / 48⌋)"),
        "{e}"
    );
    let text = std::fs::read_to_string(fixtures().join("vl-mistral3-micro/config.json")).unwrap();
    let mut v: Value = serde_json::from_str(&text).unwrap();
    v["text_config"]["rope_parameters"] =
        serde_json::json!({"rope_type": "default", "rope_theta": 1e6});
    let e = ModelConfig::from_hf_json(&v).unwrap_err().to_string();
    assert!(
        e.contains("ministral3 with rope_parameters.rope_type other than yarn"),
        "{e}"
    );
    let mut v: Value = serde_json::from_str(&text).unwrap();
    v["quantization_config"] = serde_json::json!({"quant_method": "awq"});
    let e = ModelConfig::from_hf_json(&v).unwrap_err().to_string();
    assert!(
        e.contains("quant_method `awq` is not supported for ministral3"),
        "{e}"
    );
    // Without `rope_parameters`: Ministral3Config's YaRN defaults.
    let mut v: Value = serde_json::from_str(&text).unwrap();
    v["text_config"]
        .as_object_mut()
        .unwrap()
        .remove("rope_parameters");
    let c = ModelConfig::from_hf_json(&v).unwrap();
    let Some(RopeScaling::Yarn(y)) = c.rope_scaling else {
        panic!()
    };
    assert_eq!(
        (
            y.factor,
            y.original_max_position_embeddings,
            y.llama_4_scaling_beta,
            c.rope_theta
        ),
        (16.0, 16384, Some(0.1), 1e6)
    );
}
