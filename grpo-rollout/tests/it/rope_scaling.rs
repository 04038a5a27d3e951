//! RoPE scaling (linear, dynamic, YaRN, Llama 3) against transformers.
//!
//! Reference values: `fixtures/rope_reference.json`, written with the one-layer model
//! `fixtures/rope-qwen2-micro` by `scripts/gen_rope_reference.py` (transformers 5.24):
//!   * `frequencies`: transformers' `ROPE_INIT_FUNCTIONS[rope_type](config)` (inverse
//!     frequencies, cos/sin factor) for configs in transformers 4's `rope_scaling` layout
//!     (`type` or `rope_type`), each scaling's optional keys set and unset;
//!   * `logprobs`: that model with each `rope_scaling` in its config.json, log-probs of the last
//!     `t` tokens of left-padded rows (40 and 27 tokens) longer than the scaled configs' original
//!     context (16), float32, eager attention, per-row position ids.
//!
//! And positions past `max_position_embeddings` (where the RoPE tables end), which transformers
//! computes as any other.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use grpo_rollout::config::{ModelConfig, RopeScaling};
use grpo_rollout::generate::left_pad;
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn reference() -> Value {
    let text = std::fs::read_to_string(fixtures().join("rope_reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The reference's left-padded rows (ids, mask) and how many last tokens are scored.
fn reference_batch(r: &Value) -> (candle_core::Tensor, candle_core::Tensor, usize) {
    let rows: Vec<Vec<u32>> = serde_json::from_value(r["rows"].clone()).unwrap();
    let (ids, mask) = left_pad(&rows, 0, &Device::Cpu).unwrap();
    (ids, mask, r["t"].as_u64().unwrap() as usize)
}

#[test]
fn frequencies_and_attention_factor_match_transformers() {
    let r = reference();
    let cases = r["frequencies"].as_array().unwrap();
    assert!(cases.len() >= 8);
    let mut kinds = std::collections::BTreeSet::new();
    for case in cases {
        let cfg = ModelConfig::from_hf_json(&case["config"]).unwrap();
        let what = case["config"]["rope_scaling"].to_string();
        kinds.insert(match cfg.rope_scaling {
            Some(RopeScaling::Llama3(_)) => "llama3",
            Some(RopeScaling::Linear { .. }) => "linear",
            Some(RopeScaling::Dynamic { .. }) => "dynamic",
            Some(RopeScaling::LongRope(_)) => "longrope",
            Some(RopeScaling::Yarn(_)) => "yarn",
            None => "none",
        });
        let want: Vec<f64> = serde_json::from_value(case["inv_freq"].clone()).unwrap();
        let got = grpo_rollout::model::rope_inv_freq(&cfg);
        assert_eq!(got.len(), want.len(), "{what}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            // transformers computes in f32 (a few roundings: ≈ 3e-7 seen), here in f64.
            assert!(
                (g - w).abs() <= 1e-6 * w.abs(),
                "{what}: inv_freq[{i}] {g} vs {w}"
            );
        }
        let af = case["attention_factor"].as_f64().unwrap();
        let got = grpo_rollout::model::rope_attention_factor(&cfg);
        assert!(
            (got - af).abs() <= 1e-12,
            "{what}: attention factor {got} vs {af}"
        );
        // What the config writes back reads back the same.
        let back = ModelConfig::from_hf_json(&cfg.to_hf_json()).unwrap();
        assert_eq!(back.rope_scaling, cfg.rope_scaling, "{what}");
    }
    assert_eq!(
        kinds.len(),
        4,
        "llama3, linear, dynamic and yarn cases: {kinds:?}"
    );
}

/// A copy of the micro model with `rope_scaling` in its config.json (as the script wrote it).
fn model_with(scaling: &Value, dir: &Path) -> PathBuf {
    let d = dir.join("m");
    std::fs::create_dir_all(&d).unwrap();
    for e in std::fs::read_dir(fixtures().join("rope-qwen2-micro")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), d.join(e.file_name())).unwrap();
    }
    let path = d.join("config.json");
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    if !scaling.is_null() {
        let o = cfg.as_object_mut().unwrap();
        o.remove("rope_parameters");
        o.insert("rope_theta".into(), 10000.0.into());
        o.insert("rope_scaling".into(), scaling.clone());
    }
    std::fs::write(&path, cfg.to_string()).unwrap();
    d
}

#[test]
fn logprobs_match_transformers_under_each_scaling() {
    let r = reference();
    let (ids, mask, t) = reference_batch(&r);
    let cases = r["logprobs"].as_object().unwrap();
    assert!(cases.len() >= 5);
    let mut seen = Vec::new();
    for (name, case) in cases {
        let tmp = tempfile::tempdir().unwrap();
        let dir = model_with(&case["rope_scaling"], tmp.path());
        let m = grpo_rollout::load(&dir, DType::F32, &Device::Cpu).unwrap();
        let (lp, _) = m
            .model
            .completion_logprobs(&ids, &mask, t, 1.0, false)
            .unwrap();
        let got: Vec<Vec<f32>> = lp.to_vec2().unwrap();
        let want: Vec<Vec<f64>> = serde_json::from_value(case["logprobs"].clone()).unwrap();
        let mut max = 0f64;
        for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
            max = max.max((*g as f64 - w).abs());
        }
        eprintln!("{name}: max |ours - transformers| = {max:e}");
        assert!(max <= 1e-4, "{name}: max |ours - transformers| = {max:e}");
        seen.push((name.clone(), want));
    }
    // The cases differ from the unscaled model by far more than the tolerance (dynamic aside:
    // within the context it is the unscaled RoPE), so the test sees the scaling.
    let plain = &seen.iter().find(|(n, _)| n == "default").unwrap().1;
    for (name, want) in &seen {
        let d = want
            .iter()
            .flatten()
            .zip(plain.iter().flatten())
            .map(|(a, b)| (a - b).abs())
            .fold(0f64, f64::max);
        match name.as_str() {
            "default" | "dynamic" => assert!(d < 1e-9, "{name}: {d}"),
            _ => assert!(d > 0.05, "{name}: {d}"),
        }
    }
}

#[test]
fn unsupported_scalings_are_refused_by_name() {
    let base = |scaling: Value| {
        serde_json::json!({
            "model_type": "qwen2", "vocab_size": 10, "hidden_size": 16, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "rope_scaling": scaling,
        })
    };
    let e = ModelConfig::from_hf_json(&base(serde_json::json!({"rope_type": "proportional"})))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`proportional`") && e.contains("longrope"),
        "{e}"
    );
    let e = ModelConfig::from_hf_json(&base(serde_json::json!({"rope_type": "longrope"})))
        .unwrap_err()
        .to_string();
    assert!(e.contains("rope_scaling.short_factor is missing"), "{e}");
    let e = ModelConfig::from_hf_json(&base(serde_json::json!({"type": "linear"})))
        .unwrap_err()
        .to_string();
    assert!(e.contains("rope_scaling.factor is missing"), "{e}");
    let e = ModelConfig::from_hf_json(&base(
        serde_json::json!({"rope_type": "default", "partial_rotary_factor": 0.5}),
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("partial_rotary_factor"), "{e}");
    // YaRN without `original_max_position_embeddings`: transformers takes
    // `max_position_embeddings` (Qwen2Config's 32768 when absent).
    let c = ModelConfig::from_hf_json(&base(
        serde_json::json!({"rope_type": "yarn", "factor": 2.0}),
    ))
    .unwrap();
    match c.rope_scaling {
        Some(RopeScaling::Yarn(y)) => {
            assert_eq!(y.original_max_position_embeddings, 32768);
            assert!((y.attention_factor - (0.1 * 2f64.ln() + 1.0)).abs() < 1e-15);
        }
        other => panic!("{other:?}"),
    }
}

/// [`model_with`] with `max_position_embeddings` set to `n` (the RoPE tables' length).
fn model_with_tables(scaling: &Value, dir: &Path, n: usize) -> grpo_rollout::LoadedModel {
    let d = model_with(scaling, dir);
    let path = d.join("config.json");
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    cfg["max_position_embeddings"] = n.into();
    std::fs::write(&path, cfg.to_string()).unwrap();
    let m = grpo_rollout::load(&d, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(m.model.max_positions(), n);
    m
}

/// Past `max_position_embeddings` transformers computes RoPE for any position; so do we, and
/// to the bit as the tables hold it (the same f32 product, cos and sin).
#[test]
fn positions_past_the_tables_are_computed_as_in_the_tables() {
    let r = reference();
    let (ids, mask, t) = reference_batch(&r);
    let lp = |m: &grpo_rollout::LoadedModel| -> Vec<f32> {
        let (lp, _) = m
            .model
            .completion_logprobs(&ids, &mask, t, 1.0, false)
            .unwrap();
        lp.flatten_all().unwrap().to_vec1().unwrap()
    };
    for name in ["default", "linear", "yarn", "yarn-legacy"] {
        let case = &r["logprobs"][name];
        let tmp = tempfile::tempdir().unwrap();
        // Rows of 40 positions: 24 in the tables, the rest computed.
        let short = lp(&model_with_tables(
            &case["rope_scaling"],
            &tmp.path().join("a"),
            24,
        ));
        let long = lp(&model_with_tables(
            &case["rope_scaling"],
            &tmp.path().join("b"),
            256,
        ));
        assert_eq!(short, long, "{name}");
        let want: Vec<f64> = serde_json::from_value::<Vec<Vec<f64>>>(case["logprobs"].clone())
            .unwrap()
            .concat();
        for (g, w) in short.iter().zip(&want) {
            assert!((*g as f64 - w).abs() <= 1e-4, "{name}: {g} vs {w}");
        }
    }
    // Dynamic NTK rescales past the context in transformers: refused there, in one line.
    let tmp = tempfile::tempdir().unwrap();
    let m = model_with_tables(
        &serde_json::json!({"rope_type": "dynamic", "factor": 2.0}),
        tmp.path(),
        24,
    );
    let e = m
        .model
        .completion_logprobs(&ids, &mask, t, 1.0, false)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("max_position_embeddings (24") && e.contains("dynamic NTK"),
        "{e}"
    );
}

/// A generation that runs past the tables samples the same tokens as with longer tables, eager
/// and with the decode step replayed as a GPU replays it (a replay stops at the tables' end:
/// `GraphStep::fits`; the eager step then computes the positions).
#[test]
fn a_generation_past_the_tables_samples_as_with_longer_tables() {
    use grpo_rollout::graph::{captures, replayed_on_the_host};
    let yarn = serde_json::json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16});
    let tmp = tempfile::tempdir().unwrap();
    let short = model_with_tables(&yarn, &tmp.path().join("a"), 24);
    let long = model_with_tables(&yarn, &tmp.path().join("b"), 256);
    let prompts: Vec<Vec<u32>> = vec![(0..20).map(|i| 3 + i).collect(), vec![7, 8, 9]];
    let params = grpo_rollout::SamplingParams {
        max_new_tokens: 12,
        min_new_tokens: 12,
        seed: 1,
        ..Default::default()
    };
    let run = |m: &grpo_rollout::LoadedModel| {
        let d = m.model.for_decoding().unwrap();
        grpo_rollout::generate(&d, &m.tokenizer, &prompts, 2, &params)
            .unwrap()
            .into_iter()
            .map(|c| c.token_ids)
            .collect::<Vec<_>>()
    };
    let want = run(&long);
    assert_eq!(run(&short), want);
    let before = captures();
    assert_eq!(replayed_on_the_host(|| run(&short)), want);
    assert!(captures() > before, "no step was replayed");
}

/// Linear scaling and YaRN (transformers' default attention factor: the one llama.cpp applies)
/// are written as llama.cpp's `rope.scaling.*` and read back with transformers' log-probs; a
/// YaRN attention factor llama.cpp cannot take is refused by name, nothing written.
#[test]
fn gguf_takes_linear_scaling_and_yarn() {
    let r = reference();
    let (ids, mask, t) = reference_batch(&r);
    let lp = |m: &grpo_rollout::model::Transformer| -> Vec<f32> {
        let (lp, _) = m.completion_logprobs(&ids, &mask, t, 1.0, false).unwrap();
        lp.flatten_all().unwrap().to_vec1().unwrap()
    };
    for case in ["linear", "yarn"] {
        let tmp = tempfile::tempdir().unwrap();
        let scaling = r["logprobs"][case]["rope_scaling"].clone();
        let m = grpo_rollout::load(&model_with(&scaling, tmp.path()), DType::F32, &Device::Cpu)
            .unwrap();
        let path = tmp.path().join(format!("{case}.gguf"));
        grpo_rollout::gguf::save_gguf(
            &m.model,
            &m.tokenizer,
            &path,
            grpo_rollout::gguf::GgufType::F32,
            "t",
        )
        .unwrap();
        let back = grpo_rollout::load(&path, DType::F32, &Device::Cpu).unwrap();
        assert_eq!(
            back.model.cfg.rope_scaling, m.model.cfg.rope_scaling,
            "{case}"
        );
        let want: Vec<f64> =
            serde_json::from_value::<Vec<Vec<f64>>>(r["logprobs"][case]["logprobs"].clone())
                .unwrap()
                .concat();
        for (g, w) in lp(&back.model).iter().zip(&want) {
            assert!((*g as f64 - w).abs() <= 1e-4, "{case}: {g} vs {w}");
        }
    }
    let tmp = tempfile::tempdir().unwrap();
    let yarn = serde_json::json!({"rope_type": "yarn", "factor": 4.0,
        "original_max_position_embeddings": 16, "attention_factor": 1.3});
    let m = grpo_rollout::load(&model_with(&yarn, tmp.path()), DType::F32, &Device::Cpu).unwrap();
    let path = tmp.path().join("yarn.gguf");
    let e = grpo_rollout::gguf::save_gguf(
        &m.model,
        &m.tokenizer,
        &path,
        grpo_rollout::gguf::GgufType::F32,
        "t",
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("attention factor 1.3") && e.contains("safetensors"),
        "{e}"
    );
    assert!(!path.exists());
}
