//! The MoE load-balancing loss (`grpo_rollout::moe::AuxCollector`) against transformers'
//! `aux_loss` and its gradient (`fixtures/moe_aux_reference.json`, written by
//! `scripts/gen_moe_aux_reference.py` with the MoE micro models of
//! `scripts/gen_arch_reference.py`): plain, gradient-checkpointed (the layers' recomputation
//! counts nothing twice) and with layer segments; and the shared-prompt path against padded rows
//! that repeat each prompt.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use grpo_rollout::generate::left_pad;
use grpo_rollout::moe::{AuxCollector, MoeNames, recording};
use grpo_rollout::policy::TrainableModel;
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// The micro fixtures' byte-level tokenizer.
fn micro_tokenizer() -> grpo_rollout::Tokenizer {
    grpo_rollout::load(
        &fixtures().join("arch-qwen2moe-micro"),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap()
    .tokenizer
}

fn reference() -> Value {
    let text = std::fs::read_to_string(fixtures().join("moe_aux_reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn flat(v: &Value) -> Vec<f64> {
    serde_json::from_value::<Vec<Vec<f64>>>(v.clone())
        .unwrap()
        .concat()
}

fn values(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// `0 · Σ lp` as a product with a zero tensor (candle's backward skips an `affine` by 0, and
/// everything under it).
fn zero_times(lp: &Tensor) -> Tensor {
    let zero = Tensor::zeros((), lp.dtype(), lp.device()).unwrap();
    lp.sum_all().unwrap().broadcast_mul(&zero).unwrap()
}

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f64, f64::max)
}

/// The aux loss recorded over the padded rows and the gradients of `scale · aux` by var name
/// (the log-probs enter the loss times 0: only the aux gradient is left).
fn aux_of(
    tm: &TrainableModel,
    ids: &Tensor,
    mask: &Tensor,
    scale: f64,
) -> (f64, std::collections::HashMap<String, Vec<f64>>) {
    let c = AuxCollector::new(scale);
    let (lp, _) = recording(Some(c.clone()), || {
        tm.model.completion_logprobs(ids, mask, 24, 1.0, false)
    })
    .unwrap();
    let loss = zero_times(&lp);
    let grads = tm.model.backward(&loss).unwrap();
    let by_name = tm
        .vars
        .iter()
        .filter_map(|(n, v)| grads.get(v.as_tensor()).map(|g| (n.clone(), values(g))))
        .collect();
    (c.loss(), by_name)
}

#[test]
fn load_balancing_loss_and_gradient_match_transformers() {
    let r = reference();
    let rows: Vec<Vec<u32>> = serde_json::from_value(r["rows"].clone()).unwrap();
    let (ids, mask) = left_pad(&rows, 0, &Device::Cpu).unwrap();
    // Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, Granite MoE, gpt-oss (its router biased).
    assert_eq!(r["cases"].as_object().unwrap().len(), 6);
    for (name, case) in r["cases"].as_object().unwrap() {
        let m = grpo_rollout::load(&fixtures().join(name), DType::F32, &Device::Cpu).unwrap();
        let names = MoeNames::of(m.model.cfg.arch);
        let moe_layers: Vec<usize> = (0..m.model.layers.len())
            .filter(|&i| m.model.layers[i].moe.is_some())
            .collect();
        for mode in ["plain", "checkpointing", "segments"] {
            let mut tm = TrainableModel::full(&m.model).unwrap();
            match mode {
                "checkpointing" => tm.model.enable_gradient_checkpointing(),
                "segments" => tm.model.enable_layer_segments(),
                _ => {}
            }
            let (aux, grads) = aux_of(&tm, &ids, &mask, 1.0);
            let want = case["aux_loss"].as_f64().unwrap();
            assert!(
                (aux - want).abs() < 1e-5 * want,
                "{name} {mode}: aux {aux} vs transformers {want}"
            );
            let g = &case["grads"];
            let mut checked = 0;
            for &i in &moe_layers {
                let want = flat(&g[format!("{i}.router")]);
                let got = &grads[&names.router(i)];
                let scale = want.iter().fold(0f64, |m, x| m.max(x.abs()));
                let d = max_diff(got, &want);
                assert!(
                    scale > 0.0 && d < 1e-4 * scale,
                    "{name} {mode} layer {i} router: {d} (scale {scale})"
                );
                checked += 1;
            }
            // Through the routers' inputs into the attention below them.
            let want = flat(&g["0.q_proj"]);
            let got = &grads["model.layers.0.self_attn.q_proj.weight"];
            let scale = want.iter().fold(0f64, |m, x| m.max(x.abs()));
            let d = max_diff(got, &want);
            assert!(
                scale > 0.0 && d < 1e-4 * scale,
                "{name} {mode} q_proj: {d} (scale {scale})"
            );
            assert_eq!(checked, g.as_object().unwrap().len() - 1);
            eprintln!(
                "{name} {mode}: aux {aux:.6} (transformers {want_aux:.6})",
                want_aux = case["aux_loss"]
            );
        }
        // The factor scales the gradient, not the loss.
        let tm = TrainableModel::full(&m.model).unwrap();
        let (a1, g1) = aux_of(&tm, &ids, &mask, 1.0);
        let (a2, g2) = aux_of(&tm, &ids, &mask, 0.25);
        assert!((a1 - a2).abs() < 1e-12);
        let k = names.router(moe_layers[0]);
        let twice: Vec<f64> = g2[&k].iter().map(|x| 4.0 * x).collect();
        assert!(max_diff(&twice, &g1[&k]) < 1e-6);
    }
}

/// Shared prompts count each prompt once per completion, as the padded rows repeating it do.
#[test]
fn shared_prompts_count_as_repeated_rows() {
    let m = grpo_rollout::load(
        &fixtures().join("arch-qwen3moe-micro"),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let prompts: Vec<Vec<u32>> = vec![(3..14).collect(), (40..47).collect()];
    let comps: Vec<Vec<u32>> = vec![
        vec![60, 61, 62, 63],
        vec![70, 71],
        vec![80, 81, 82],
        vec![90, 91, 92, 93],
        vec![100],
    ];
    let prompt_of = [0u32, 0, 1, 1, 1];
    let dev = Device::Cpu;
    let tm = TrainableModel::full(&m.model).unwrap();
    let name = MoeNames::of(m.model.cfg.arch).router(0);
    // Padded: each row its prompt then its completion (right-padded), left-padded overall.
    let cmax = comps.iter().map(Vec::len).max().unwrap();
    let rows: Vec<Vec<u32>> = comps
        .iter()
        .zip(prompt_of)
        .map(|(c, g)| [prompts[g as usize].clone(), c.clone()].concat())
        .collect();
    let (ids, mask) = left_pad(&rows, 0, &dev).unwrap();
    let c = AuxCollector::new(1.0);
    let (lp, _) = recording(Some(c.clone()), || {
        tm.model.completion_logprobs(&ids, &mask, 1, 1.0, false)
    })
    .unwrap();
    let g = tm.model.backward(&zero_times(&lp)).unwrap();
    let var = |n: &str| tm.vars.iter().find(|(k, _)| k == n).unwrap().1.clone();
    let padded = (c.loss(), values(g.get(var(&name).as_tensor()).unwrap()));
    // Shared.
    let (pids, pmask) = left_pad(&prompts, 0, &dev).unwrap();
    let mut cids = Vec::new();
    let mut cm = Vec::new();
    for co in &comps {
        for j in 0..cmax {
            cids.push(co.get(j).copied().unwrap_or(0));
            cm.push(u32::from(j < co.len()));
        }
    }
    let cids = Tensor::from_vec(cids, (comps.len(), cmax), &dev).unwrap();
    let cm = Tensor::from_vec(cm, (comps.len(), cmax), &dev).unwrap();
    let c = AuxCollector::new(1.0);
    let (lp, _) = recording(Some(c.clone()), || {
        tm.model
            .shared_prompt_logprobs(&pids, &pmask, &prompt_of, &cids, &cm, 1.0, false)
    })
    .unwrap();
    let g = tm.model.backward(&zero_times(&lp)).unwrap();
    let shared = (c.loss(), values(g.get(var(&name).as_tensor()).unwrap()));
    assert!(
        (padded.0 - shared.0).abs() < 1e-6,
        "{} vs {}",
        padded.0,
        shared.0
    );
    let d = max_diff(&padded.1, &shared.1);
    assert!(d < 1e-6, "router gradient: {d}");
    // Without a collector nothing is recorded and the gradient is the log-probs' alone (0).
    let (lp, _) = tm
        .model
        .completion_logprobs(&ids, &mask, 1, 1.0, false)
        .unwrap();
    let g = tm.model.backward(&zero_times(&lp)).unwrap();
    let none = values(g.get(var(&name).as_tensor()).unwrap());
    assert!(none.iter().all(|x| *x == 0.0));
}

/// Each MoE family as llama.cpp's GGUF (`qwen3moe`, `qwen2moe`, Mixtral as `llama` with
/// experts, `olmoe`, `granitemoe` with Granite's scalars, `qwen35moe`): the experts stacked as
/// `ffn_{gate,up,down}_exps`, the router `ffn_gate_inp`, Qwen2-MoE's and Qwen3.5's shared expert
/// `ffn_*_shexp` and its gate; read back, the same model and config. Quantised, the routers stay
/// f32 (as llama.cpp's converter and llama-quantize keep them).
#[test]
fn moe_gguf_round_trips() {
    use grpo_rollout::gguf::{GgufType, load_gguf, save_gguf};
    use grpo_rollout::init::{Preset, preset_config, random_weights};
    let tmp = tempfile::tempdir().unwrap();
    let rows: Vec<Vec<u32>> = vec![(5..40).collect(), (100..121).collect()];
    let (ids, mask) = left_pad(&rows, 0, &Device::Cpu).unwrap();
    let tok = micro_tokenizer();
    for arch in [
        grpo_rollout::Arch::Qwen3Moe,
        grpo_rollout::Arch::Qwen2Moe,
        grpo_rollout::Arch::Mixtral,
        grpo_rollout::Arch::Olmoe,
        grpo_rollout::Arch::GraniteMoe,
        grpo_rollout::Arch::Qwen3_5Moe,
    ] {
        let mut c = preset_config(Preset::Small, arch, 300, 2, 0);
        c.tie_word_embeddings = false;
        // llama.cpp's olmoe has no grouped-query heads.
        if arch == grpo_rollout::Arch::Olmoe {
            c.num_key_value_heads = c.num_attention_heads;
        }
        let m = random_weights(&c, 9, DType::F32, &Device::Cpu).unwrap();
        let path = tmp.path().join(format!("{}.gguf", arch.as_str()));
        let written = save_gguf(&m, &tok, &path, GgufType::F32, "m").unwrap();
        let names: Vec<&str> = written.iter().map(|(n, _)| n.as_str()).collect();
        for n in [
            "blk.0.ffn_gate_inp.weight",
            "blk.0.ffn_gate_exps.weight",
            "blk.3.ffn_down_exps.weight",
        ] {
            assert!(names.contains(&n), "{arch:?}: {names:?}");
        }
        assert!(!names.iter().any(|n| n.contains("experts")), "{names:?}");
        let shared = names.contains(&"blk.0.ffn_gate_inp_shexp.weight");
        assert_eq!(shared, arch.gated_shared_expert());
        let (cfg, weights, _) = load_gguf(&path, DType::F32, &Device::Cpu).unwrap();
        assert_eq!(cfg.arch, arch);
        assert_eq!(cfg.moe, c.moe, "{arch:?}");
        let back =
            grpo_rollout::Transformer::from_weights(&cfg, &weights, DType::F32, &Device::Cpu)
                .unwrap();
        let lp = |t: &grpo_rollout::Transformer| {
            values(
                &t.completion_logprobs(&ids, &mask, 16, 1.0, false)
                    .unwrap()
                    .0,
            )
        };
        let d = max_diff(&lp(&back), &lp(&m));
        assert!(d < 1e-5, "{arch:?}: {d}");
        let q8 = save_gguf(&m, &tok, &tmp.path().join("q8.gguf"), GgufType::Q8_0, "m").unwrap();
        for (n, t) in &q8 {
            if n.contains(".ffn_gate_inp") {
                assert_eq!(t, "F32", "{arch:?} {n}");
            }
        }
        assert!(q8.iter().any(|(_, t)| t == "Q8_0"));
    }
}

/// DeepSeek's families as llama.cpp's `deepseek2` (DeepSeek-V3 with groups and with YaRN,
/// DeepSeek-V2's softmax router, GLM-4.7-Flash with and without `rope_interleave`) and GLM-4.5
/// as `glm4moe` (q/k norms, half of each head rotating): `kv_b_proj` split into `attn_k_b` /
/// `attn_v_b`, the router's offsets as `exp_probs_b`, the leading dense layer, the shared
/// experts; read back, the same config (the RoPE pairs as llama.cpp rotates them) and
/// log-probs.
#[test]
fn deepseek_gguf_round_trips() {
    use grpo_rollout::Arch;
    use grpo_rollout::config::{ModelConfig, RopeScaling, Routing, YarnRopeScaling};
    use grpo_rollout::gguf::{GgufType, load_gguf, save_gguf};
    use grpo_rollout::init::{Preset, preset_config, random_weights};
    let tmp = tempfile::tempdir().unwrap();
    let rows: Vec<Vec<u32>> = vec![(5..40).collect(), (100..121).collect()];
    let (ids, mask) = left_pad(&rows, 0, &Device::Cpu).unwrap();
    let tok = micro_tokenizer();
    type Edit = Box<dyn Fn(&mut ModelConfig)>;
    let yarn = YarnRopeScaling {
        factor: 4.0,
        original_max_position_embeddings: 16,
        beta_fast: 32.0,
        beta_slow: 1.0,
        truncate: true,
        attention_factor: 1.0,
        mscale_all_dim: Some(0.707),
        llama_4_scaling_beta: None,
    };
    let cases: Vec<(Arch, Edit)> = vec![
        (Arch::DeepseekV3, Box::new(|_| {})),
        (
            Arch::DeepseekV3,
            Box::new(move |c| c.rope_scaling = Some(RopeScaling::Yarn(yarn))),
        ),
        (
            Arch::DeepseekV2,
            Box::new(|c| {
                let m = c.moe.as_mut().unwrap();
                m.routing = Routing::Greedy {
                    n_group: 1,
                    topk_group: 1,
                    routed_scaling_factor: 1.5,
                    group_limited: false,
                };
                m.norm_topk_prob = false;
            }),
        ),
        (Arch::Glm4MoeLite, Box::new(|_| {})),
        (
            Arch::Glm4MoeLite,
            Box::new(|c| c.mla.as_mut().unwrap().rope_interleave = false),
        ),
        (
            Arch::Glm4Moe,
            Box::new(|c| {
                c.use_qk_norm = true;
                c.partial_rotary_factor = Some(0.5);
            }),
        ),
    ];
    for (i, (arch, edit)) in cases.into_iter().enumerate() {
        let mut c = preset_config(Preset::Small, arch, 300, 2, 0);
        c.tie_word_embeddings = false;
        c.attention_bias = arch == Arch::Glm4Moe;
        edit(&mut c);
        // Weights far from uniform routing; the routers' offsets away from 0.
        let m = random_weights(&c, 9, DType::F32, &Device::Cpu)
            .unwrap()
            .map_tensors(&|t| match (t.dtype(), t.rank()) {
                (DType::F32, 1) => {
                    t.affine(1.0, 0.0)? + t.ones_like()?.cumsum(0)?.affine(0.01, -0.03)?
                }
                (DType::F32, _) => t.affine(8.0, 0.0),
                _ => Ok(t.clone()),
            })
            .unwrap();
        let path = tmp.path().join(format!("{i}.gguf"));
        let written = save_gguf(&m, &tok, &path, GgufType::F32, "m").unwrap();
        let names: Vec<&str> = written.iter().map(|(n, _)| n.as_str()).collect();
        let mut want = vec![
            "blk.0.ffn_gate.weight",
            "blk.1.ffn_gate_inp.weight",
            "blk.1.ffn_gate_exps.weight",
            "blk.1.ffn_up_shexp.weight",
        ];
        if c.mla.is_some() {
            want.extend(["blk.0.attn_kv_a_mqa.weight", "blk.0.attn_kv_a_norm.weight"]);
            want.extend(["blk.0.attn_k_b.weight", "blk.0.attn_v_b.weight"]);
        } else {
            want.extend(["blk.0.attn_q.bias", "blk.0.attn_k_norm.weight"]);
            want.push("blk.0.post_attention_norm.weight");
        }
        if arch != Arch::DeepseekV2 {
            want.push("blk.1.exp_probs_b.bias");
        }
        for n in want {
            assert!(names.contains(&n), "{arch:?}: {n} not in {names:?}");
        }
        assert!(!names.iter().any(|n| n.contains("kv_b")), "{names:?}");
        assert!(!names.contains(&"blk.0.ffn_gate_inp.weight"));
        let (cfg, weights, _) = load_gguf(&path, DType::F32, &Device::Cpu).unwrap();
        let mut expect = c.clone();
        if let Some(m) = expect.mla.as_mut() {
            m.rope_interleave = true;
        }
        // (GLM-4.7-Flash's file is DeepSeek-V3's.)
        if arch == Arch::Glm4MoeLite {
            expect.arch = Arch::DeepseekV3;
        }
        assert_eq!(cfg.arch, expect.arch);
        assert_eq!(cfg.moe, expect.moe, "{arch:?}");
        assert_eq!(cfg.mla, expect.mla, "{arch:?}");
        assert_eq!(cfg.rope_scaling, expect.rope_scaling, "{arch:?}");
        assert_eq!(
            (cfg.head_dim, cfg.num_key_value_heads, cfg.use_qk_norm),
            (
                expect.head_dim,
                expect.num_key_value_heads,
                expect.use_qk_norm
            )
        );
        assert_eq!(cfg.rotary_dim(), expect.rotary_dim());
        let back =
            grpo_rollout::Transformer::from_weights(&cfg, &weights, DType::F32, &Device::Cpu)
                .unwrap();
        let lp = |t: &grpo_rollout::Transformer| {
            values(
                &t.completion_logprobs(&ids, &mask, 16, 1.0, false)
                    .unwrap()
                    .0,
            )
        };
        let (a, b) = (lp(&m), lp(&back));
        let d = max_diff(&a, &b);
        assert!(d < 1e-5, "{arch:?} case {i}: {d}");
        // Not a trivially equal pair: the completion is far from uniform.
        assert!(a.iter().any(|x| *x < -7.0), "{a:?}");
    }
}

/// What llama.cpp's `deepseek2` / `glm4moe` compute otherwise is refused by name on export:
/// biases on the latent attention, DeepSeek-V2's group-limited routing, a dense layer after an
/// MoE one, no shared experts, linear RoPE scaling, YaRN without `mscale_all_dim`, and the
/// layer count llama.cpp takes for DeepSeek-V2-Lite with a low-rank q.
#[test]
fn deepseek_gguf_refusals_are_named() {
    use grpo_rollout::Arch;
    use grpo_rollout::config::{ModelConfig, RopeScaling, YarnRopeScaling};
    use grpo_rollout::init::{Preset, preset_config, random_weights};
    let tmp = tempfile::tempdir().unwrap();
    let tok = micro_tokenizer();
    let refusal = |arch: Arch, edit: &dyn Fn(&mut ModelConfig)| -> String {
        let mut c = preset_config(Preset::Tiny, arch, 300, 2, 0);
        c.attention_bias = false;
        edit(&mut c);
        let m = random_weights(&c, 9, DType::F32, &Device::Cpu).unwrap();
        grpo_rollout::gguf::save_gguf(
            &m,
            &tok,
            &tmp.path().join("x.gguf"),
            grpo_rollout::gguf::GgufType::F32,
            "x",
        )
        .map(|_| "written".to_string())
        .unwrap_or_else(|e| e.to_string())
    };
    assert_eq!(refusal(Arch::DeepseekV3, &|_| {}), "written");
    let e = refusal(Arch::DeepseekV3, &|c| c.attention_bias = true);
    assert!(
        e.contains("attention_bias") && e.contains("deepseek2"),
        "{e}"
    );
    let e = refusal(Arch::DeepseekV2, &|_| {});
    assert!(e.contains("group_limited_greedy (1 of 2 groups)"), "{e}");
    let e = refusal(Arch::Glm4MoeLite, &|c| {
        c.moe.as_mut().unwrap().mlp_only_layers = vec![1]
    });
    assert!(e.contains("dense layers [1]"), "{e}");
    let e = refusal(Arch::Glm4Moe, &|c| {
        c.moe.as_mut().unwrap().shared_expert_intermediate_size = None
    });
    assert!(e.contains("without shared experts"), "{e}");
    let e = refusal(Arch::DeepseekV3, &|c| {
        c.rope_scaling = Some(RopeScaling::Linear { factor: 2.0 })
    });
    assert!(e.contains("RoPE scaling Linear"), "{e}");
    let e = refusal(Arch::DeepseekV3, &|c| {
        c.rope_scaling = Some(RopeScaling::Yarn(YarnRopeScaling {
            factor: 4.0,
            original_max_position_embeddings: 16,
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: true,
            attention_factor: 1.0 + 0.1 * 4f64.ln(),
            mscale_all_dim: None,
            llama_4_scaling_beta: None,
        }))
    });
    assert!(e.contains("mscale_all_dim None"), "{e}");
    let e = refusal(Arch::DeepseekV3, &|c| c.num_hidden_layers = 27);
    assert!(e.contains("27 layers and q_lora_rank"), "{e}");
}

/// What the MoE families do not support is refused by name: GGUF of what llama.cpp computes
/// otherwise (dense layers among the MoE ones, another renormalisation); LoRA on the attention
/// and on Qwen2-MoE's shared expert works and leaves the experts frozen.
#[test]
fn moe_refusals_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let gguf = |m: &grpo_rollout::LoadedModel, model: &grpo_rollout::Transformer| {
        grpo_rollout::gguf::save_gguf(
            model,
            &m.tokenizer,
            &tmp.path().join("x.gguf"),
            grpo_rollout::gguf::GgufType::F32,
            "x",
        )
        .unwrap_err()
        .to_string()
    };
    let q3 = grpo_rollout::load(
        &fixtures().join("arch-qwen3moe-micro"),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let e = gguf(&q3, &q3.model);
    assert!(
        e.contains("mlp_only_layers [1]") && e.contains("every layer"),
        "{e}"
    );
    let ol = grpo_rollout::load(
        &fixtures().join("arch-olmoe-micro"),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let e = gguf(&ol, &ol.model);
    assert!(
        e.contains("num_key_value_heads = 2") && e.contains("olmoe"),
        "{e}"
    );
    let m = grpo_rollout::load(
        &fixtures().join("arch-qwen2moe-micro"),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let mut renorm = m.model.clone();
    renorm.cfg.moe.as_mut().unwrap().norm_topk_prob = true;
    let e = gguf(&m, &renorm);
    assert!(
        e.contains("norm_topk_prob = true") && e.contains("qwen2_moe"),
        "{e}"
    );
    use grpo_rollout::lora::{LoraConfig, TargetModules};
    // Qwen2-MoE's shared expert and its gate are linear modules PEFT adapts: "all-linear" takes
    // them in beside the attention, `gate_proj` names the shared expert's only.
    let lc = LoraConfig {
        target_modules: TargetModules::Pattern("all-linear".into()),
        ..Default::default()
    };
    let tm = TrainableModel::lora(&m.model, &lc, 1).unwrap();
    let names: Vec<&String> = tm.vars.iter().map(|v| &v.0).collect();
    assert_eq!(names.len(), 2 * 8 * 2, "{names:?}");
    for key in [
        "model.layers.1.mlp.shared_expert.down_proj.lora_A.weight",
        "model.layers.0.mlp.shared_expert_gate.lora_B.weight",
    ] {
        assert!(names.iter().any(|n| n.ends_with(key)), "{key}: {names:?}");
    }
    let lc = LoraConfig {
        target_modules: TargetModules::Names(vec!["q_proj".into(), "gate_proj".into()]),
        ..Default::default()
    };
    let tm = TrainableModel::lora(&m.model, &lc, 1).unwrap();
    let names: Vec<&String> = tm.vars.iter().map(|v| &v.0).collect();
    assert_eq!(names.len(), 2 * 2 * 2, "{names:?}");
    assert!(
        names
            .iter()
            .all(|n| n.contains("q_proj") || n.contains("mlp.shared_expert.gate_proj.lora")),
        "{names:?}"
    );
    // Qwen3-MoE's experts are fused by transformers 5 on load: as peft 0.21 converts the
    // names, `gate_proj` alone is an error, `gate_proj` with `up_proj` adapts the experts'
    // gate_up_proj at twice the rank (not the dense layer's MLP).
    let m = grpo_rollout::load(
        &fixtures().join("arch-qwen3moe-micro"),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let lc = LoraConfig {
        target_modules: TargetModules::Names(vec!["gate_proj".into()]),
        ..Default::default()
    };
    let e = TrainableModel::lora(&m.model, &lc, 1)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`gate_proj` cannot be adapted without `up_proj` on qwen3_moe"),
        "{e}"
    );
    let lc = LoraConfig {
        target_modules: TargetModules::Names(vec!["gate_proj".into(), "up_proj".into()]),
        ..Default::default()
    };
    let tm = TrainableModel::lora(&m.model, &lc, 1).unwrap();
    let names: Vec<&String> = tm.vars.iter().map(|v| &v.0).collect();
    assert!(
        names.iter().all(|n| n.contains("mlp.experts.")),
        "{names:?}"
    );
    let l0 = &tm.model.layers[0].moe.as_ref().unwrap().experts[0];
    assert_eq!(l0.gate_proj.lora.as_ref().unwrap().a.dim(0).unwrap(), 16);
    assert!(tm.model.layers[1].gate_proj.lora.is_none());
}

fn peft_reference() -> Value {
    let text = std::fs::read_to_string(fixtures().join("moe_peft_reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn rows_logprobs(m: &grpo_rollout::Transformer, r: &Value) -> Vec<f64> {
    let rows: Vec<Vec<u32>> = serde_json::from_value(r["rows"].clone()).unwrap();
    let (ids, mask) = left_pad(&rows, 0, &Device::Cpu).unwrap();
    let t = r["t"].as_u64().unwrap() as usize;
    values(&m.completion_logprobs(&ids, &mask, t, 1.0, false).unwrap().0)
}

/// A reference case's base model, the same with the case's PEFT adapter loaded, the
/// adapter's config and directory.
fn with_peft_adapter(
    case: &Value,
) -> (
    grpo_rollout::LoadedModel,
    grpo_rollout::Transformer,
    grpo_rollout::lora::LoraConfig,
    std::path::PathBuf,
) {
    let base = grpo_rollout::load(
        &fixtures().join(case["model"].as_str().unwrap()),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let dir = fixtures().join(case["adapter"].as_str().unwrap());
    let mut m = base.model.clone();
    let cfg = grpo_rollout::lora::load_peft(&mut m, &dir).unwrap();
    (base, m, cfg, dir)
}

/// The adapted model `m`'s log-probs equal PEFT's (`case["adapted"]`), far from the base's,
/// and merged they equal PEFT's `merge_and_unload()`'s (`case["merged"]`). Returns the adapted
/// log-probs.
fn assert_as_peft(
    name: &str,
    case: &Value,
    r: &Value,
    base: &grpo_rollout::Transformer,
    m: &grpo_rollout::Transformer,
) -> Vec<f64> {
    let want = |k: &str| -> Vec<f64> {
        serde_json::from_value::<Vec<Vec<f64>>>(case[k].clone())
            .unwrap()
            .concat()
    };
    let adapted = rows_logprobs(m, r);
    let d = max_diff(&adapted, &want("adapted"));
    eprintln!("{name}: adapted {d:e}");
    assert!(d < 2e-5, "{name}: adapted {d}");
    // The adapter moves them by far more than the tolerance.
    assert!(max_diff(&rows_logprobs(base, r), &want("adapted")) > 1e-2);
    let merged = grpo_rollout::lora::merge(m).unwrap();
    let d = max_diff(&rows_logprobs(&merged, r), &want("merged"));
    assert!(d < 2e-5, "{name}: merged {d}");
    adapted
}

/// PEFT's adapters on the experts' stacked weights (`target_parameters`: PEFT's ParamWrapper on
/// transformers 5's `gate_up_proj` / `down_proj`, nested when both; one alone on Mixtral and
/// OLMoE), beside `q_proj` or `"all-linear"` (Qwen2-MoE's and GLM-4.5's shared experts, Qwen2-MoE's
/// shared-expert gate, GLM-4.5's dense layer), for each MoE family
/// (`scripts/gen_moe_peft_reference.py`): loaded,
/// the adapted log-probs equal PEFT's, merged its `merge_and_unload()`'s; saved again, the
/// same tensors under the same keys and the same `target_parameters`.
#[test]
fn peft_expert_adapters_match_peft() {
    let r = peft_reference();
    let cases = r["cases"].as_object().unwrap();
    assert_eq!(cases.len(), 18);
    for (name, case) in cases {
        let (base, m, cfg, dir) = with_peft_adapter(case);
        assert!(!cfg.target_parameters.is_empty(), "{name}");
        assert_as_peft(name, case, &r, &base.model, &m);
        // Saved again: PEFT's keys, tensors and targets.
        let tmp = tempfile::tempdir().unwrap();
        grpo_rollout::lora::save_peft(&m, &cfg, tmp.path(), "base").unwrap();
        let theirs =
            candle_core::safetensors::load(dir.join("adapter_model.safetensors"), &Device::Cpu)
                .unwrap();
        let ours = candle_core::safetensors::load(
            tmp.path().join("adapter_model.safetensors"),
            &Device::Cpu,
        )
        .unwrap();
        let mut keys: Vec<&String> = ours.keys().collect();
        keys.sort();
        let mut want_keys: Vec<&String> = theirs.keys().collect();
        want_keys.sort();
        assert_eq!(keys, want_keys, "{name}");
        for (k, t) in &theirs {
            assert_eq!(values(&ours[k]), values(t), "{name}: {k}");
        }
        let saved: Value = serde_json::from_str(
            &std::fs::read_to_string(tmp.path().join("adapter_config.json")).unwrap(),
        )
        .unwrap();
        let peft: Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("adapter_config.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(
            saved["target_parameters"], peft["target_parameters"],
            "{name}"
        );
        // PEFT saves the modules "all-linear" matched (here with the full names its
        // target_parameters pass writes): the same maps by their last name.
        let last = |v: &Value| {
            let mut names: Vec<String> = v
                .as_array()
                .unwrap()
                .iter()
                .map(|n| n.as_str().unwrap().rsplit('.').next().unwrap().to_string())
                .collect();
            names.sort();
            names.dedup();
            names
        };
        assert_eq!(
            last(&saved["target_modules"]),
            last(&peft["target_modules"]),
            "{name}"
        );

        // The config as the user wrote it (before peft's conversion), trained fresh: peft's
        // adapters, key for key and shape for shape, and peft's converted config saved.
        let asked = &case["asked"];
        let user = grpo_rollout::lora::LoraConfig {
            r: 2,
            lora_alpha: 3.0,
            target_modules: serde_json::from_value(asked["target_modules"].clone()).unwrap(),
            target_parameters: serde_json::from_value(asked["target_parameters"].clone()).unwrap(),
            ..Default::default()
        };
        let tm = TrainableModel::lora(&base.model, &user, 1).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        grpo_rollout::lora::save_peft(&tm.model, tm.lora.as_ref().unwrap(), tmp.path(), "base")
            .unwrap();
        let fresh = candle_core::safetensors::load(
            tmp.path().join("adapter_model.safetensors"),
            &Device::Cpu,
        )
        .unwrap();
        let mut keys: Vec<(&String, Vec<usize>)> =
            fresh.iter().map(|(k, t)| (k, t.dims().to_vec())).collect();
        keys.sort();
        let mut want: Vec<(&String, Vec<usize>)> =
            theirs.iter().map(|(k, t)| (k, t.dims().to_vec())).collect();
        want.sort();
        assert_eq!(keys, want, "{name}: trained from {asked}");
        let saved: Value = serde_json::from_str(
            &std::fs::read_to_string(tmp.path().join("adapter_config.json")).unwrap(),
        )
        .unwrap();
        let set = |v: &Value| {
            let mut names: Vec<String> = v
                .as_array()
                .map(|a| a.iter().map(|n| n.as_str().unwrap().to_string()).collect())
                .unwrap_or_default();
            names.sort();
            names
        };
        assert_eq!(
            set(&saved["target_parameters"]),
            set(&peft["target_parameters"]),
            "{name}"
        );
        assert_eq!(
            last(&saved["target_modules"]),
            last(&peft["target_modules"]),
            "{name}"
        );
        for k in ["rank_pattern", "alpha_pattern"] {
            let as_f64 = |v: &Value| -> std::collections::BTreeMap<String, f64> {
                serde_json::from_value(v.clone()).unwrap_or_default()
            };
            assert_eq!(as_f64(&saved[k]), as_f64(&peft[k]), "{name}: {k}");
        }
    }
}

/// Training adapters on the experts: each expert's `A` and `B` (gate and up sharing one `A`)
/// are trainable variables beside the attention's; a backward through the adapted model
/// reaches every expert that took rows; what PEFT's ParamWrapper refuses is refused here too.
#[test]
fn expert_adapters_train_per_expert() {
    use grpo_rollout::lora::{LoraConfig, TargetModules};
    let m = grpo_rollout::load(
        &fixtures().join("arch-mixtral-micro"),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let lc = LoraConfig {
        target_modules: TargetModules::Names(vec![]),
        target_parameters: vec!["gate_up_proj".into(), "experts.down_proj".into()],
        r: 2,
        ..Default::default()
    };
    let tm = TrainableModel::lora(&m.model, &lc, 3).unwrap();
    // 2 layers × 4 experts × (A and two Bs of gate_up, A and B of down).
    assert_eq!(tm.vars.len(), 2 * 4 * 5);
    let rows: Vec<Vec<u32>> = vec![(5..40).collect(), (100..121).collect()];
    let (ids, mask) = left_pad(&rows, 0, &Device::Cpu).unwrap();
    let (lp, _) = tm
        .model
        .completion_logprobs(&ids, &mask, 16, 1.0, false)
        .unwrap();
    let g = tm.model.backward(&lp.sum_all().unwrap()).unwrap();
    let mut moved = 0;
    for (n, v) in &tm.vars {
        let grad = g.get(v.as_tensor()).map(values).unwrap_or_default();
        // B starts at 0, so A's gradient is 0 at first; every B of an expert with rows moves.
        if n.ends_with("lora_B.weight") && grad.iter().any(|x| *x != 0.0) {
            moved += 1;
        }
    }
    assert!(
        moved >= 2 * 3 * 3,
        "{moved} of the experts' B factors got a gradient"
    );
    for (what, lc) in [
        (
            "lora_dropout != 0",
            LoraConfig {
                target_parameters: vec!["down_proj".into()],
                lora_dropout: 0.1,
                ..Default::default()
            },
        ),
        (
            "use_dora",
            LoraConfig {
                target_parameters: vec!["down_proj".into()],
                use_dora: true,
                ..Default::default()
            },
        ),
        (
            "`mlp.experts.w1`",
            LoraConfig {
                target_parameters: vec!["mlp.experts.w1".into()],
                ..Default::default()
            },
        ),
    ] {
        let e = TrainableModel::lora(&m.model, &lc, 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains(what), "{e}");
    }
    // A dense model has no experts to match.
    let dense = grpo_rollout::load(
        &fixtures().join("arch-mistral-micro"),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let lc = LoraConfig {
        target_modules: TargetModules::Names(vec![]),
        target_parameters: vec!["down_proj".into()],
        ..Default::default()
    };
    let e = TrainableModel::lora(&dense.model, &lc, 1)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no experts' weight of this mistral model matches"),
        "{e}"
    );
}

/// Adapters PEFT wrote before transformers 5 fused the experts (per-expert factors under the
/// transformers 4 names, `target_modules` the MLP's), which peft 0.21 converts on load: loaded
/// here, PEFT's log-probs adapted and merged; the converted config's `target_parameters` (gate
/// and up at twice the rank); saved again (in transformers 5's stacked layout) and reloaded,
/// the same log-probs.
#[test]
fn peft_v4_expert_adapters_load_as_peft_converts_them() {
    let r = peft_reference();
    let cases = r["v4_cases"].as_object().unwrap();
    assert_eq!(cases.len(), 2);
    for (name, case) in cases {
        let (base, m, cfg, _) = with_peft_adapter(case);
        let mut params = cfg.target_parameters.clone();
        params.sort();
        assert_eq!(params, ["down_proj", "gate_up_proj"], "{name}");
        assert_eq!(cfg.rank_pattern[r".*\.gate_up_proj"], 4, "{name}");
        let adapted = assert_as_peft(name, case, &r, &base.model, &m);
        let tmp = tempfile::tempdir().unwrap();
        grpo_rollout::lora::save_peft(&m, &cfg, tmp.path(), "base").unwrap();
        let mut again = base.model.clone();
        grpo_rollout::lora::load_peft(&mut again, tmp.path()).unwrap();
        assert!(
            max_diff(&rows_logprobs(&again, &r), &adapted) < 1e-6,
            "{name}"
        );
    }
}
