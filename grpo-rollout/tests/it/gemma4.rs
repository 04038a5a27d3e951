//! Gemma 4 (`gemma4_text`) against transformers.
//!
//! Reference values: `fixtures/gemma4_reference.json`, written with the micro models
//! `fixtures/gemma4-micro` (6 layers: keys reused as values on the full layers, the last two
//! layers reusing layers 2's and 3's keys and values with double-wide MLPs, per-layer inputs,
//! proportional RoPE on the full layers, tied, logits soft-capped) and
//! `fixtures/gemma4-plain-micro` (4 layers: the full layers with their own values and default
//! RoPE, no sharing, no per-layer inputs, untied) by `scripts/gen_gemma4_reference.py`
//! (transformers 5.24, float32, eager attention): log-probs of the last `t` tokens of two
//! left-padded rows (per-row position ids), the gradient of their sum for a few weights, a
//! greedy continuation.
#![allow(clippy::unwrap_used, missing_docs)]

use crate::common;

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use common::{fixtures, max_diff_f64 as max_diff, padded_logprobs as logprobs, to_f64, var_grad};
use grpo_rollout::config::Arch;
use serde_json::Value;

fn reference() -> Value {
    common::reference("gemma4_reference.json")
}

const MODELS: [&str; 3] = ["gemma4-micro", "gemma4-plain-micro", "gemma4-moe-micro"];

fn load(name: &str, dtype: DType) -> grpo_rollout::LoadedModel {
    grpo_rollout::load(&fixtures().join(name), dtype, &Device::Cpu).unwrap()
}

fn want_logprobs(r: &Value, name: &str) -> Vec<f64> {
    serde_json::from_value::<Vec<Vec<f64>>>(r["models"][name]["logprobs"].clone())
        .unwrap()
        .concat()
}

#[test]
fn config_reads_every_gemma4_field() {
    let m = load("gemma4-micro", DType::F32);
    let c = &m.model.cfg;
    assert_eq!(c.arch, Arch::Gemma4);
    let g = c.gemma4.as_ref().unwrap();
    assert_eq!((g.global_head_dim, g.global_kv_heads), (16, 1));
    assert!(g.k_eq_v && g.double_wide_mlp);
    assert_eq!(g.kv_shared_layers, 2);
    assert_eq!(g.per_layer_input, Some((300, 4)));
    assert_eq!(g.global_rope_fraction, 0.25);
    assert_eq!(
        (c.sliding_window, c.sliding_layers.clone()),
        (Some(12), vec![0, 2, 4])
    );
    assert_eq!(c.final_logit_softcapping, Some(8.0));
    assert_eq!(c.attention_scale(), 1.0);
    let sources: Vec<_> = (0..6).map(|i| c.kv_source(i)).collect();
    assert_eq!(sources, [None, None, None, None, Some(2), Some(3)]);
    assert_eq!(c.layer_intermediate(4), 96);
    assert_eq!(c.layer_heads(3), (1, 16));
    assert_eq!(c.layer_heads(2), (2, 8));
    // What the model holds, as transformers counts it (the scalars are buffers).
    let held: usize = m
        .model
        .weights()
        .iter()
        .filter(|(n, _)| !n.ends_with("layer_scalar"))
        .map(|(_, t)| t.elem_count())
        .sum();
    assert_eq!(c.num_parameters(), held);
    // The KV cache: the sliding layers' 2 heads × 8 and the full layers' one head × 16, keys
    // and values, on the 4 layers that make theirs (the sharing ones cache nothing).
    assert_eq!(c.kv_cache_values_per_token(false), 4 * 2 * 16);
    let l = 6;
    let ids = Tensor::new(&[[5u32, 9, 13, 21, 34, 55]], &Device::Cpu).unwrap();
    let pos = Tensor::arange(0u32, l as u32, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let bias: Vec<f32> = (0..l * l)
        .map(|x| if x % l > x / l { -1e9 } else { 0.0 })
        .collect();
    let bias = Tensor::from_vec(bias, (1, 1, l, l), &Device::Cpu).unwrap();
    let mut cache = grpo_rollout::model::KvCache::with_capacity(l);
    m.model
        .forward_hidden(&ids, &pos, &bias, Some(&mut cache))
        .unwrap();
    assert_eq!(cache.bytes(), l * c.kv_cache_values_per_token(false) * 4);
    // Multiply-adds per row: sliding layers q, k, v, o and the MLP (7,680), full ones with one
    // key head as values (9,216), the sharing ones without k and v and twice as wide (11,264,
    // 13,312), each layer's per-layer-input maps (256), their model-level projection (768).
    let per_row = 2 * 7_680 + 2 * 9_216 + 11_264 + 13_312 + 6 * 256 + 768;
    assert_eq!(c.matmul_flops(1, 0, 0), 2.0 * per_row as f64);
    // Attention: q·k and p·v over each layer's query width (32 sliding, 64 full).
    assert_eq!(c.matmul_flops(0, 1, 0), 4.0 * (3 * 32 + 3 * 64) as f64);
}

#[test]
fn logprobs_match_transformers() {
    let r = reference();
    for name in MODELS {
        let m = load(name, DType::F32);
        let d = max_diff(&logprobs_f64(&m.model, &r), &want_logprobs(&r, name));
        assert!(d < 2e-4, "{name}: {d}");
        // bf16 weights: within bf16's reach of transformers' f32 (0.21, 0.13, 0.10 here;
        // transformers' own bf16 is 0.71, 0.096, 0.097 from it: these unscaled scores are
        // sensitive).
        let m = load(name, DType::BF16);
        let d = max_diff(&logprobs_f64(&m.model, &r), &want_logprobs(&r, name));
        assert!(d < 0.25, "{name} bf16: {d}");
    }
}

/// The gradient of the log-probs' sum reaches the weights as transformers' does: through the
/// shared keys and values into the layers that made them, through the per-layer inputs into
/// their table's projection and norm — with and without gradient checkpointing.
#[test]
fn gradients_match_transformers_with_and_without_checkpointing() {
    let r = reference();
    for name in MODELS {
        for checkpointing in [false, true] {
            let base = load(name, DType::F32).model;
            let mut tm = grpo_rollout::TrainableModel::full(&base).unwrap();
            if checkpointing {
                tm.model.enable_gradient_checkpointing();
            }
            let loss = logprobs(&tm.model, &r).sum_all().unwrap();
            let grads = tm.model.backward(&loss).unwrap();
            let want = r["models"][name]["grads"].as_object().unwrap();
            let grad = |weight: &str| var_grad(&tm, &grads, weight);
            for (weight, g) in want {
                let g: Vec<f64> = serde_json::from_value(g.clone()).unwrap();
                // The files' fused experts: the model's per-expert maps, stacked (gate rows,
                // then up rows).
                let got: Vec<f64> = match weight.rsplit_once(".experts.") {
                    Some((layer, fused)) => (0..4)
                        .flat_map(|x| match fused {
                            "gate_up_proj" => [
                                grad(&format!("{layer}.experts.{x}.gate_proj.weight")),
                                grad(&format!("{layer}.experts.{x}.up_proj.weight")),
                            ]
                            .concat(),
                            _ => grad(&format!("{layer}.experts.{x}.{fused}.weight")),
                        })
                        .collect(),
                    None => grad(weight),
                };
                let scale = g.iter().fold(0f64, |m, x| m.max(x.abs()));
                let d = max_diff(&got, &g);
                assert!(
                    d <= 1e-4 * scale.max(1.0),
                    "{name} {weight} (checkpointing {checkpointing}): {d} of {scale}"
                );
            }
        }
    }
}

/// Greedy decoding over the KV cache (the sharing layers reading their sources' cache) gives
/// transformers' continuation.
#[test]
fn greedy_decoding_matches_transformers() {
    let r = reference();
    let prompt: Vec<u32> = serde_json::from_value(r["prompt"].clone()).unwrap();
    for name in MODELS {
        let m = load(name, DType::F32);
        let want: Vec<u32> = serde_json::from_value(r["models"][name]["greedy"].clone()).unwrap();
        assert_eq!(common::greedy(&m, &prompt, want.len()), want, "{name}");
    }
}

/// Saved and read back, the model is the same: the tensors transformers names (no `v_proj`
/// where keys are values, no k/v maps on the sharing layers, the scalars, the per-layer
/// tables) and a config.json transformers reads to the same fields.
#[test]
fn saves_and_reads_back_the_same() {
    let dir = tempfile::tempdir().unwrap();
    for name in MODELS {
        let m = load(name, DType::F32);
        let out = dir.path().join(name);
        grpo_rollout::save_hf_dir(&m.model, &m.tokenizer, &out, DType::F32).unwrap();
        let back = grpo_rollout::load(&out, DType::F32, &Device::Cpu).unwrap();
        assert_eq!(back.model.cfg, m.model.cfg, "{name}");
        let a: std::collections::BTreeMap<_, _> = m.model.weights().into_iter().collect();
        let b: std::collections::BTreeMap<_, _> = back.model.weights().into_iter().collect();
        assert_eq!(
            a.keys().collect::<Vec<_>>(),
            b.keys().collect::<Vec<_>>(),
            "{name}"
        );
        for (k, t) in &a {
            let d = (t - &b[k])
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert_eq!(d, 0.0, "{name} {k}");
        }
        // The original file's names, all of them, and its tensors.
        let file = |d: &Path| {
            candle_core::safetensors::load(d.join("model.safetensors"), &Device::Cpu).unwrap()
        };
        let (src, saved) = (file(&fixtures().join(name)), file(&out));
        let mut names: Vec<&String> = saved.keys().collect();
        names.sort();
        let mut want: Vec<&String> = src.keys().collect();
        want.sort();
        assert_eq!(names, want, "{name}");
        for (k, t) in &src {
            let d = (t - &saved[k])
                .unwrap()
                .abs()
                .unwrap()
                .flatten_all()
                .unwrap();
            let d = d.max(0).unwrap().to_scalar::<f32>().unwrap();
            assert_eq!(d, 0.0, "{name} {k}");
        }
    }
}

type Edit = dyn Fn(&mut serde_json::Map<String, Value>);

fn with_config(name: &str, edit: &dyn Fn(&mut serde_json::Map<String, Value>)) -> String {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().join(name);
    std::fs::create_dir_all(&d).unwrap();
    for e in std::fs::read_dir(fixtures().join(name)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), d.join(e.file_name())).unwrap();
    }
    let path = d.join("config.json");
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(cfg.as_object_mut().unwrap());
    std::fs::write(&path, cfg.to_string()).unwrap();
    match grpo_rollout::load(&d, DType::F32, &Device::Cpu) {
        Ok(_) => String::new(),
        Err(e) => e.to_string(),
    }
}

#[test]
fn refusals_name_the_field() {
    let cases: Vec<(&str, Box<Edit>)> = vec![
        (
            "enable_moe_block",
            Box::new(|c| {
                c.insert("enable_moe_block".into(), true.into());
            }),
        ),
        (
            "rope_parameters.full_attention.rope_type `yarn`",
            Box::new(|c| {
                c["rope_parameters"]["full_attention"]["rope_type"] = "yarn".into();
            }),
        ),
        (
            "rope_parameters.sliding_attention.rope_type `linear`",
            Box::new(|c| {
                c["rope_parameters"]["sliding_attention"]["rope_type"] = "linear".into();
            }),
        ),
        (
            "per_layer_config.0",
            Box::new(|c| {
                c["per_layer_config"]["0"] = serde_json::json!({"head_dim": 16});
            }),
        ),
        (
            "use_bidirectional_attention",
            Box::new(|c| {
                c.insert("use_bidirectional_attention".into(), "all".into());
            }),
        ),
        (
            "num_kv_shared_layers",
            Box::new(|c| {
                c.insert("num_kv_shared_layers".into(), 6.into());
            }),
        ),
        (
            "sliding_window = null",
            Box::new(|c| {
                c.insert("sliding_window".into(), Value::Null);
            }),
        ),
    ];
    for (key, edit) in cases {
        let e = with_config("gemma4-micro", &*edit);
        assert!(e.contains(key), "{key}: {e}");
    }
    // A sharing layer's missing weights are named (the file has no k_proj on layer 4).
    let e = with_config("gemma4-micro", &|c| {
        c.insert("num_kv_shared_layers".into(), 0.into());
    });
    assert!(e.contains("model.layers.4.self_attn.k_proj.weight"), "{e}");
}

fn logprobs_f64(m: &grpo_rollout::Transformer, r: &Value) -> Vec<f64> {
    to_f64(&logprobs(m, r))
}

/// Written as llama.cpp's `gemma4` (per-layer key/value heads and MLP widths, the full layers'
/// head width and RoPE apart from the sliding ones', `rope_freqs.weight` for the proportional
/// RoPE, the fused experts and their scales) and read back: the same model. llama.cpp's own
/// converter's files of the micro models (`scripts/gen_gemma4_gguf_fixtures.py`) read as the
/// Hugging Face directories.
#[test]
fn gguf_round_trips_and_reads_llama_cpps_files() {
    let r = reference();
    let dir = tempfile::tempdir().unwrap();
    for name in MODELS {
        let m = load(name, DType::F32);
        let path = dir.path().join(format!("{name}.gguf"));
        grpo_rollout::gguf::save_gguf(
            &m.model,
            &m.tokenizer,
            &path,
            grpo_rollout::gguf::GgufType::F32,
            name,
        )
        .unwrap();
        let mut files = vec![path];
        if name != "gemma4-plain-micro" {
            files.push(fixtures().join(format!("{name}-llama.gguf")));
        }
        let want = logprobs_f64(&m.model, &r);
        for f in files {
            let back = grpo_rollout::load(&f, DType::F32, &Device::Cpu).unwrap();
            let (a, b) = (&back.model.cfg, &m.model.cfg);
            assert_eq!(a.gemma4, b.gemma4, "{f:?}");
            assert_eq!(
                (
                    a.sliding_window,
                    &a.sliding_layers,
                    a.head_dim,
                    a.num_key_value_heads
                ),
                (
                    b.sliding_window,
                    &b.sliding_layers,
                    b.head_dim,
                    b.num_key_value_heads
                ),
                "{f:?}"
            );
            assert_eq!(
                (
                    a.rope_theta,
                    a.final_logit_softcapping,
                    a.tie_word_embeddings
                ),
                (
                    b.rope_theta,
                    b.final_logit_softcapping,
                    b.tie_word_embeddings
                ),
                "{f:?}"
            );
            let d = max_diff(&logprobs_f64(&back.model, &r), &want);
            assert!(d < 1e-6, "{f:?}: {d}");
        }
    }
}

/// What llama.cpp's gemma4 computes otherwise is refused by name: KV sharing it pairs
/// differently (it reads a sharing full layer's keys from the last layer with its own, a
/// sliding one's from the layer before that).
#[test]
fn gguf_refuses_what_llama_cpp_pairs_otherwise() {
    let mut c =
        grpo_rollout::init::preset_config(grpo_rollout::init::Preset::Tiny, Arch::Gemma4, 64, 1, 0);
    // Sliding, full, full, sliding, sliding, full: layer 4 reuses layer 3's keys in
    // transformers, layer 2's in llama.cpp.
    c.num_hidden_layers = 6;
    c.sliding_layers = vec![0, 3, 4];
    c.gemma4.as_mut().unwrap().kv_shared_layers = 2;
    let m = grpo_rollout::init::random_weights(&c, 1, DType::F32, &Device::Cpu).unwrap();
    let tok = load("gemma4-micro", DType::F32).tokenizer;
    let dir = tempfile::tempdir().unwrap();
    let e = grpo_rollout::gguf::save_gguf(
        &m,
        &tok,
        &dir.path().join("m.gguf"),
        grpo_rollout::gguf::GgufType::F32,
        "m",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("layer 4 reuses layer Some(3)"), "{e}");
}

/// A PEFT adapter on every linear map (`all-linear`: Gemma 4's per-layer-input maps, their
/// model-level projection and the experts' router too; `fixtures/*-peft`, random factors) loads
/// onto the model with PEFT's adapted log-probs, and merges into the same model; our own
/// `all-linear` adapts the same modules and names them as PEFT does.
#[test]
fn peft_all_linear_adapters_match_peft() {
    let r = reference();
    for name in ["gemma4-micro", "gemma4-moe-micro"] {
        let mut m = load(name, DType::F32);
        let peft = fixtures().join(format!("{name}-peft"));
        grpo_rollout::lora::load_peft(&mut m.model, &peft).unwrap();
        let want: Vec<f64> =
            serde_json::from_value::<Vec<Vec<f64>>>(r["models"][name]["peft_logprobs"].clone())
                .unwrap()
                .concat();
        let got = logprobs_f64(&m.model, &r);
        let d = max_diff(&got, &want);
        assert!(d < 2e-4, "{name}: {d}");
        let base = load(name, DType::F32);
        assert!(max_diff(&logprobs_f64(&base.model, &r), &want) > 1e-3);
        // Merged: the same model, its adapters folded in (f32 rounding of the sums: 2.3e-5).
        let merged = grpo_rollout::lora::merge(&m.model).unwrap();
        assert!(!merged.layers.iter().any(|l| l.has_adapters()));
        assert!(max_diff(&logprobs_f64(&merged, &r), &got) < 1e-4, "{name}");
        // Ours: the same modules, saved under PEFT's names.
        let lcfg = grpo_rollout::lora::LoraConfig {
            target_modules: grpo_rollout::lora::TargetModules::Pattern("all-linear".into()),
            ..Default::default()
        };
        let tm = grpo_rollout::TrainableModel::lora(&base.model, &lcfg, 3).unwrap();
        let dir = tempfile::tempdir().unwrap();
        grpo_rollout::lora::save_peft(&tm.model, tm.lora.as_ref().unwrap(), dir.path(), "base")
            .unwrap();
        let read = |d: &Path| -> Vec<String> {
            let v: Value = serde_json::from_str(
                &std::fs::read_to_string(d.join("adapter_config.json")).unwrap(),
            )
            .unwrap();
            let mut t: Vec<String> = serde_json::from_value(v["target_modules"].clone()).unwrap();
            t.sort();
            t
        };
        let peft_dir = fixtures().join(format!("{name}-peft"));
        assert_eq!(read(dir.path()), read(&peft_dir), "{name}");
        let keys = |d: &Path| -> Vec<String> {
            let t =
                candle_core::safetensors::load(d.join("adapter_model.safetensors"), &Device::Cpu)
                    .unwrap();
            let mut k: Vec<String> = t.keys().cloned().collect();
            k.sort();
            k
        };
        assert_eq!(keys(dir.path()), keys(&peft_dir), "{name}");
    }
}
