//! Adapters written by Python peft: every supported option reproduces peft's log-probs, adapted
//! and merged; every other option is refused by name; training with the options saves adapters
//! that load back the same.
//!
//! Fixtures: `fixtures/peft/CASE/` (adapter_config.json + adapter_model.safetensors written by
//! peft's `save_pretrained`) and `fixtures/peft/reference.json` (peft's log-probs with the
//! adapter and after `merge_and_unload()`), made by `scripts/gen_peft_fixtures.py` on the base
//! `fixtures/bench-qwen2-micro` (a tiny qwen2 whose q/k/v have biases).
#![allow(clippy::unwrap_used, missing_docs)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use grpo_rollout::generate::left_pad;
use grpo_rollout::lora::{self, Layers, LoraConfig, TargetModules};
use grpo_rollout::model::Transformer;
use grpo_rollout::policy::TrainableModel;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn reference() -> serde_json::Value {
    let text = std::fs::read_to_string(fixtures().join("peft/reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn base() -> Transformer {
    grpo_rollout::load(
        &fixtures().join("bench-qwen2-micro"),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap()
    .model
}

/// Log-probs of the reference rows' last `t` tokens (temperature 1).
fn logprobs(m: &Transformer, reference: &serde_json::Value) -> Vec<f64> {
    let rows: Vec<Vec<u32>> = serde_json::from_value(reference["rows"].clone()).unwrap();
    let t = reference["t"].as_u64().unwrap() as usize;
    let (ids, mask) = left_pad(&rows, 0, &Device::Cpu).unwrap();
    let (lp, _) = m.completion_logprobs(&ids, &mask, t, 1.0, false).unwrap();
    let v: Vec<f32> = lp.flatten_all().unwrap().to_vec1().unwrap();
    v.into_iter().map(f64::from).collect()
}

fn max_diff(a: &[f64], b: &serde_json::Value) -> f64 {
    let b: Vec<Vec<f64>> = serde_json::from_value(b.clone()).unwrap();
    let b: Vec<f64> = b.into_iter().flatten().collect();
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// Loads `peft/CASE` onto the base: its log-probs equal peft's, adapted and merged (≤ 1e-4),
/// and the adapter visibly changes the model.
fn case(name: &str) -> LoraConfig {
    let reference = reference();
    let want = &reference["cases"][name];
    let mut m = base();
    let cfg = lora::load_peft(&mut m, &fixtures().join("peft").join(name)).unwrap();
    let adapted = logprobs(&m, &reference);
    let moved = max_diff(&adapted, &reference["base"]);
    let d = max_diff(&adapted, &want["adapted"]);
    let merged = logprobs(&lora::merge(&m).unwrap(), &reference);
    let dm = max_diff(&merged, &want["merged"]);
    eprintln!("{name}: |ours - peft| adapted {d:e}, merged {dm:e}; |adapted - base| {moved:.3}");
    assert!(moved > 0.05, "{name}: the adapter should change the model");
    assert!(
        d <= 1e-4,
        "{name}: adapted log-probs differ from peft's by {d:e}"
    );
    assert!(
        dm <= 1e-4,
        "{name}: merged log-probs differ from peft's by {dm:e}"
    );
    cfg
}

#[test]
fn plain_lora_matches_peft() {
    case("plain");
}

#[test]
fn rslora_matches_peft() {
    assert!(case("rslora").use_rslora);
}

#[test]
fn dora_matches_peft() {
    assert!(case("dora").use_dora);
}

#[test]
fn dora_with_all_linear_rslora_and_rank_pattern_matches_peft() {
    case("dora_all_linear");
}

#[test]
fn bias_lora_only_matches_peft() {
    assert_eq!(case("bias_lora_only").bias, "lora_only");
}

#[test]
fn bias_all_matches_peft() {
    assert_eq!(case("bias_all").bias, "all");
}

#[test]
fn lora_bias_matches_peft() {
    assert!(case("lora_bias").lora_bias);
}

#[test]
fn all_linear_matches_peft() {
    case("all_linear");
}

#[test]
fn rank_and_alpha_patterns_match_peft() {
    let cfg = case("patterns");
    assert_eq!(cfg.rank_pattern.len(), 2);
    assert_eq!(cfg.alpha_pattern.len(), 2);
}

#[test]
fn layers_to_transform_matches_peft() {
    assert_eq!(
        case("layers_list").layers_to_transform,
        Some(Layers::Many(vec![1]))
    );
    assert_eq!(case("layers_int").layers_to_transform, Some(Layers::One(0)));
}

#[test]
fn regex_target_modules_and_exclude_modules_match_peft() {
    assert!(matches!(
        case("regex").target_modules,
        TargetModules::Pattern(_)
    ));
    assert!(case("exclude").exclude_modules.is_some());
}

/// A copy of the `plain` fixture with `edit` applied to its config.
fn edited(tmp: &Path, edit: &dyn Fn(&mut serde_json::Map<String, serde_json::Value>)) -> PathBuf {
    let src = fixtures().join("peft/plain");
    let dir = tmp.to_path_buf();
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(
        src.join("adapter_model.safetensors"),
        dir.join("adapter_model.safetensors"),
    )
    .unwrap();
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("adapter_config.json")).unwrap())
            .unwrap();
    edit(v.as_object_mut().unwrap());
    std::fs::write(dir.join("adapter_config.json"), v.to_string()).unwrap();
    dir
}

#[test]
fn unsupported_peft_options_are_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let cases: Vec<(&str, serde_json::Value)> = vec![
        ("use_qalora", serde_json::json!(true)),
        ("layer_replication", serde_json::json!([[0, 1], [0, 2]])),
        ("modules_to_save", serde_json::json!(["lm_head"])),
        ("fan_in_fan_out", serde_json::json!(true)),
        ("init_lora_weights", serde_json::json!("pissa")),
        ("init_lora_weights", serde_json::json!("olora")),
        // This model has no experts (a mixture of experts takes them: tests/it/moe.rs).
        (
            "target_parameters",
            serde_json::json!(["mlp.experts.gate_up_proj"]),
        ),
        (
            "trainable_token_indices",
            serde_json::json!({"lm_head": [3, 4]}),
        ),
        ("alora_invocation_tokens", serde_json::json!([7])),
        ("use_bdlora", serde_json::json!({"nblocks": 2})),
        ("a_future_option", serde_json::json!(1)),
        ("layers_pattern", serde_json::json!("h")),
        ("target_modules", serde_json::json!(["q_proj", "lm_head"])),
        (
            "target_modules",
            serde_json::json!("model\\.embed_tokens|.*q_proj"),
        ),
        ("rank_pattern", serde_json::json!({"q_proj(": 2})),
        ("bias", serde_json::json!("some")),
    ];
    for (i, (key, value)) in cases.into_iter().enumerate() {
        let dir = edited(&tmp.path().join(i.to_string()), &|o| {
            o.insert(key.to_string(), value.clone());
        });
        // One line (a backtrace may follow when RUST_BACKTRACE is set).
        let err = lora::load_peft(&mut base(), &dir).unwrap_err().to_string();
        let line = err.lines().next().unwrap();
        assert!(
            line.contains(key) && line.contains("adapter_config.json"),
            "{key} = {value}: {err}"
        );
    }
    // Options that only choose how training starts are accepted.
    for (key, value) in [
        ("init_lora_weights", serde_json::json!("gaussian")),
        ("init_lora_weights", serde_json::json!(false)),
        ("loftq_config", serde_json::json!({"loftq_bits": 4})),
        ("megatron_core", serde_json::json!("megatron.core")),
    ] {
        let dir = edited(&tmp.path().join("ok"), &|o| {
            o.insert(key.to_string(), value.clone());
        });
        lora::load_peft(&mut base(), &dir).unwrap_or_else(|e| panic!("{key}: {e}"));
    }
    // A tensor the adapter should not hold (a full copy of a norm) is named, and so is a saved
    // (resized) embedding of the wrong width.
    for (key, shape, want) in [
        (
            "base_model.model.model.norm.weight",
            vec![32usize],
            "model.norm.weight",
        ),
        (
            "base_model.model.model.embed_tokens.weight",
            vec![300, 31],
            "saved embedding has shape",
        ),
    ] {
        let dir = edited(&tmp.path().join("extra"), &|_| {});
        let mut t =
            candle_core::safetensors::load(dir.join("adapter_model.safetensors"), &Device::Cpu)
                .unwrap();
        t.insert(
            key.into(),
            Tensor::zeros(shape, DType::F32, &Device::Cpu).unwrap(),
        );
        candle_core::safetensors::save(&t, dir.join("adapter_model.safetensors")).unwrap();
        let err = lora::load_peft(&mut base(), &dir).unwrap_err().to_string();
        assert!(
            err.contains(want) && err.contains("adapter_model.safetensors"),
            "{err}"
        );
    }
}

/// Sets every trainable tensor to pseudo-random values (B non-zero), as training would.
fn perturb(tm: &TrainableModel) {
    for (k, (name, v)) in tm.vars.iter().enumerate() {
        let n = v.elem_count();
        let r: Vec<f32> = (0..n)
            .map(|i| (((i * 7919 + k * 104_729) % 1000) as f32 / 1000.0 - 0.5) * 0.4)
            .collect();
        let r = Tensor::from_vec(r, v.shape(), &Device::Cpu).unwrap();
        let new = if name.ends_with("lora_magnitude_vector") || name.ends_with(".bias") {
            (v.as_tensor() + r).unwrap()
        } else {
            r
        };
        v.set(&new).unwrap();
    }
}

fn train_round_trip(name: &str, cfg: LoraConfig, expect: &[&str]) {
    let reference = reference();
    let base = base();
    let tm = TrainableModel::lora(&base, &cfg, 7).unwrap();
    // At init the adapted model equals the base (B = 0, magnitudes = ‖W‖, biases unchanged).
    let d0 = max_diff(&logprobs(&tm.model, &reference), &reference["base"]);
    assert!(d0 < 1e-5, "init differs from the base by {d0:e}");
    for want in expect {
        assert!(
            tm.vars.iter().any(|(k, _)| k.ends_with(want)),
            "no trainable `{want}`"
        );
    }
    perturb(&tm);
    // Every trainable tensor gets a finite non-zero gradient; the frozen weights none.
    let rows: Vec<Vec<u32>> = serde_json::from_value(reference["rows"].clone()).unwrap();
    let (ids, mask) = left_pad(&rows, 0, &Device::Cpu).unwrap();
    let (lp, _) = tm
        .model
        .completion_logprobs(&ids, &mask, 6, 1.0, false)
        .unwrap();
    let grads = lp.sum_all().unwrap().backward().unwrap();
    for (name, v) in &tm.vars {
        let g: Vec<f32> = grads
            .get(v.as_tensor())
            .unwrap_or_else(|| panic!("no gradient for {name}"))
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert!(
            g.iter().all(|x| x.is_finite()) && g.iter().any(|&x| x != 0.0),
            "{name}"
        );
    }
    let adapted = tm.model.detached();
    let want = logprobs(&adapted, &reference);
    let tmp = tempfile::tempdir().unwrap();
    lora::save_peft(&adapted, &cfg, tmp.path(), "bench-qwen2-micro").unwrap();
    // `GRPO_PEFT_CHECK_DIR=D` keeps the adapter and our log-probs in D/NAME for
    // `scripts/gen_peft_fixtures.py check D/NAME`, which compares them with peft's.
    if let Ok(d) = std::env::var("GRPO_PEFT_CHECK_DIR") {
        let out = Path::new(&d).join(name);
        lora::save_peft(&adapted, &cfg, &out, "bench-qwen2-micro").unwrap();
        let merged = logprobs(&lora::merge(&adapted).unwrap(), &reference);
        let j = serde_json::json!({"adapted": want, "merged": merged});
        std::fs::write(out.join("grpo_logprobs.json"), j.to_string()).unwrap();
    }
    let saved: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(tmp.path().join("adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(saved["use_rslora"], cfg.use_rslora);
    assert_eq!(saved["use_dora"], cfg.use_dora);
    assert_eq!(saved["bias"], cfg.bias.as_str());
    assert_eq!(saved["lora_bias"], cfg.lora_bias);
    assert_eq!(saved["rank_pattern"], serde_json::json!(cfg.rank_pattern));
    assert_eq!(saved["alpha_pattern"], serde_json::json!(cfg.alpha_pattern));
    assert_eq!(
        saved["layers_to_transform"],
        serde_json::json!(cfg.layers_to_transform)
    );
    let mut reloaded = base.clone();
    let back = lora::load_peft(&mut reloaded, tmp.path()).unwrap();
    let back_targets = back.target_modules.clone();
    // "all-linear" is saved as the names it stands for, as peft does.
    let expected_targets = match &cfg.target_modules {
        TargetModules::Pattern(p) if p == lora::ALL_LINEAR => {
            TargetModules::Names(lora::TARGET_MODULES.map(String::from).to_vec())
        }
        t => t.clone(),
    };
    assert_eq!(back_targets, expected_targets);
    assert_eq!(
        LoraConfig {
            target_modules: cfg.target_modules.clone(),
            ..back
        },
        cfg
    );
    let got = logprobs(&reloaded, &reference);
    assert_eq!(got, want, "identical log-probs after the round trip");
    let merged = logprobs(&lora::merge(&reloaded).unwrap(), &reference);
    let dm = merged
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(dm < 1e-5, "merged differs from adapted by {dm:e}");
}

#[test]
fn training_with_rslora_dora_patterns_and_layers_round_trips() {
    train_round_trip(
        "dora_rslora_patterns",
        LoraConfig {
            r: 4,
            lora_alpha: 8.0,
            lora_dropout: 0.1,
            target_modules: TargetModules::Pattern(lora::ALL_LINEAR.into()),
            use_rslora: true,
            use_dora: true,
            bias: "lora_only".into(),
            rank_pattern: BTreeMap::from([
                ("q_proj".into(), 2),
                ("layers\\.1\\.mlp\\.down_proj".into(), 6),
            ]),
            alpha_pattern: BTreeMap::from([("v_proj".into(), 3.0)]),
            layers_to_transform: Some(Layers::Many(vec![1])),
            ..LoraConfig::default()
        },
        &["lora_magnitude_vector", "q_proj.base_layer.bias"],
    );
}

#[test]
fn training_with_lora_bias_bias_all_and_exclude_round_trips() {
    train_round_trip(
        "lora_bias_bias_all_exclude",
        LoraConfig {
            r: 4,
            lora_alpha: 8.0,
            target_modules: TargetModules::Names(vec![
                "q_proj".into(),
                "k_proj".into(),
                "v_proj".into(),
            ]),
            exclude_modules: Some(TargetModules::Names(vec![
                "model.layers.0.self_attn.k_proj".into(),
            ])),
            lora_bias: true,
            bias: "all".into(),
            layers_to_transform: Some(Layers::One(0)),
            ..LoraConfig::default()
        },
        &[
            "q_proj.lora_B.bias",
            "q_proj.base_layer.bias",
            "k_proj.bias",
            "v_proj.bias",
        ],
    );
}

#[test]
fn bad_configs_name_the_field() {
    for (cfg, field) in [
        (
            LoraConfig {
                lora_bias: true,
                use_dora: true,
                ..LoraConfig::default()
            },
            "lora_bias",
        ),
        (
            LoraConfig {
                bias: "every".into(),
                ..LoraConfig::default()
            },
            "lora.bias",
        ),
        (
            LoraConfig {
                target_modules: TargetModules::Pattern(".*q_proj".into()),
                layers_to_transform: Some(Layers::One(0)),
                ..LoraConfig::default()
            },
            "layers_to_transform",
        ),
        (
            LoraConfig {
                target_modules: TargetModules::Names(vec!["lm_head".into()]),
                ..LoraConfig::default()
            },
            "target_modules",
        ),
        (
            LoraConfig {
                rank_pattern: BTreeMap::from([("q_proj".into(), 0)]),
                ..LoraConfig::default()
            },
            "rank_pattern",
        ),
    ] {
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains(field), "{field}: {err}");
    }
    // `lora_bias` cannot be merged into a layer without a bias (the MLP of qwen2), as in peft.
    let cfg = LoraConfig {
        target_modules: TargetModules::Names(vec!["up_proj".into()]),
        lora_bias: true,
        ..LoraConfig::default()
    };
    let tm = TrainableModel::lora(&base(), &cfg, 0).unwrap();
    let err = lora::merge(&tm.model).unwrap_err().to_string();
    assert!(
        err.contains("lora_bias") && err.contains("up_proj"),
        "{err}"
    );
    // A target that matches no module of this model.
    let cfg = LoraConfig {
        layers_to_transform: Some(Layers::One(9)),
        ..LoraConfig::default()
    };
    let err = TrainableModel::lora(&base(), &cfg, 0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("no module"), "{err}");
}
