//! `grpo-cli check`: a self-test of this build on a device, printed as a table.
//!
//! Every fused op against its plain composition (values and gradients) on the device and
//! dtype asked for, the CPU's kernels also on the device-generic path the GPU takes; a small
//! model's log-probs on the device against the CPU's; gradient checkpointing against the plain
//! backward; a few optimizer steps that must lower a loss; greedy generation against the CPU's;
//! regex-constrained sampling, device sampler against host sampler.
//! It is how a user verifies a GPU install (`grpo-cli check --device cuda --dtype bf16`).

use crate::first_line;
use std::path::PathBuf;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use grpo_core::selfcheck::{randn, rel_diff, rel_diff_all, worse};
use grpo_rollout::fused;
use grpo_rollout::init::{Preset, init_model_dir};
use grpo_rollout::policy::TrainableModel;
use grpo_rollout::{Arch, SamplingParams, Transformer};

use grpo_trainer::optim::{AdamW, AdamWParams, accumulate};

/// A generation decoded with CUDA graphs against the same without: the log-probs of the tokens
/// both chose, per row up to their first difference (f32 must agree throughout; half precision
/// may part ways after a near-tie). Fails when no step was captured or the first replay's check
/// against the eager step switched graphs off.
fn graph_check(
    model: &Transformer,
    tokenizer: &grpo_rollout::Tokenizer,
    prompts: &[Vec<u32>],
    dtype: DType,
    tol: f64,
) -> Result<(f64, f64)> {
    let p = SamplingParams {
        max_new_tokens: 24,
        min_new_tokens: 24,
        temperature: 0.0,
        ..SamplingParams::default()
    };
    let prompts = &prompts[..prompts.len().min(2)];
    grpo_rollout::graph::set_enabled(false);
    let eager = grpo_rollout::generate(model, tokenizer, prompts, 4, &p);
    grpo_rollout::graph::set_enabled(true);
    let before = grpo_rollout::graph::captures();
    let graphed = grpo_rollout::generate(model, tokenizer, prompts, 4, &p)?;
    let eager = eager?;
    if grpo_rollout::graph::captures() == before {
        anyhow::bail!(
            "no decode step was captured (stderr says why; last capture: {})",
            grpo_rollout::graph::last_capture_nodes()
        );
    }
    // A first replay that differed from the eager step switched graphs off (and the eager
    // results stood): that is a failure of the graphs, whatever the tokens say.
    if !grpo_rollout::graph::enabled(model.device()) {
        anyhow::bail!(
            "graphs were switched off during the generation (stderr says why; last capture: {})",
            grpo_rollout::graph::last_capture_nodes()
        );
    }
    let mut worst = 0f64;
    for (a, b) in eager.iter().zip(&graphed) {
        let same = a
            .token_ids
            .iter()
            .zip(&b.token_ids)
            .take_while(|(x, y)| x == y)
            .count();
        if b.token_ids.len() != 24 || (matches!(dtype, DType::F32) && same < 24) {
            anyhow::bail!(
                "graphed tokens {:?} against eager {:?}",
                b.token_ids,
                a.token_ids
            );
        }
        for i in 0..same {
            worst = worse(worst, f64::from((a.logprobs[i] - b.logprobs[i]).abs()));
        }
    }
    Ok((worst, tol))
}

/// A sampled generation through the KV cache (eager, no graphs) against the full forward over
/// prompt + completion: the log-probs of the tokens it chose (the cache pass's layout of its own
/// — DeepSeek's latent, a sliding window's band, sinks — against the training forward's).
fn cache_check(
    model: &Transformer,
    tokenizer: &grpo_rollout::Tokenizer,
    prompts: &[Vec<u32>],
    tol: f64,
) -> Result<(f64, f64)> {
    let n = 24;
    let p = SamplingParams {
        max_new_tokens: n,
        min_new_tokens: n,
        temperature: 1.0,
        seed: 5,
        ..SamplingParams::default()
    };
    let prompts = &prompts[..prompts.len().min(2)];
    let graphs = grpo_rollout::graph::enabled(model.device());
    grpo_rollout::graph::set_enabled(false);
    let out = grpo_rollout::generate(model, tokenizer, prompts, 1, &p);
    grpo_rollout::graph::set_enabled(graphs);
    let out = out?;
    let rows: Vec<Vec<u32>> = prompts
        .iter()
        .zip(&out)
        .map(|(p, c)| [p.as_slice(), &c.token_ids].concat())
        .collect();
    let (ids, mask) = grpo_rollout::generate::left_pad(&rows, 0, model.device())?;
    let full: Vec<Vec<f32>> = model
        .completion_logprobs(&ids, &mask, n, 1.0, false)?
        .0
        .to_dtype(DType::F32)?
        .to_vec2()?;
    let mut worst = 0f64;
    for (c, f) in out.iter().zip(&full) {
        if c.logprobs.len() != n {
            anyhow::bail!("{} tokens generated of {n}", c.logprobs.len());
        }
        for (a, b) in c.logprobs.iter().zip(f) {
            worst = worse(worst, f64::from((a - b).abs()));
        }
    }
    Ok((worst, tol))
}

/// One row of the table.
#[derive(Debug, Clone)]
pub struct CheckRow {
    /// What was checked.
    pub name: String,
    /// Passed.
    pub ok: bool,
    /// The measured difference (or the failure).
    pub detail: String,
}

/// Runs every check on `device` in `dtype`; returns the rows (all run, failures included).
pub fn run_checks(device: &Device, dtype: DType) -> Result<Vec<CheckRow>> {
    let mut rows = Vec::new();
    let tol = match dtype {
        DType::F32 | DType::F64 => 1e-4,
        _ => 2e-2,
    };
    let mut push = |name: String, r: Result<(f64, f64)>| {
        rows.push(match r {
            Ok((d, limit)) => CheckRow {
                ok: d <= limit,
                detail: format!("max diff {d:.2e} (limit {limit:.0e})"),
                name,
            },
            Err(e) => CheckRow {
                ok: false,
                detail: first_line(&e.to_string()),
                name,
            },
        });
    };
    let saved_mode = (grpo_core::fused::enabled(), false);
    // `check` reports the kernels as they are: the first-use self-check would switch a wrong
    // one off before its row ran.
    let _selfcheck = SelfCheckOff::new();
    // On CPU f32 the kernels run by default; the device-generic path is checked as well.
    let kernels = device.is_cpu() && matches!(dtype, DType::F32 | DType::F64);
    let paths: &[(&str, bool)] = if kernels {
        &[("kernel", false), ("recompute", true)]
    } else {
        &[("fused", false)]
    };
    for &(label, force) in paths {
        for (name, r) in op_checks(device, dtype, force) {
            push(
                format!("{name} ({label}) vs composition"),
                r.map(|d| (d, tol)),
            );
        }
    }
    grpo_core::fused::set_enabled(saved_mode.0);
    // The comparisons the first-use self-check runs before our CUDA kernels serve an op (here
    // with the self-check off, so the kernels themselves are measured).
    let mut found = grpo_rollout::selfcheck::findings(device, dtype);
    found.extend(grpo_core::logprobs::head_findings(device, dtype));
    for f in found {
        push(
            f.what,
            f.diff.map(|d| (d, f.limit)).map_err(anyhow::Error::msg),
        );
    }

    let dir = std::env::temp_dir().join(format!("grpo-check-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    init_model_dir(&dir, Preset::Tiny, Arch::Qwen2, 7).context("writing the check model")?;
    let guard = RemoveOnDrop(dir.clone());
    let cpu = grpo_rollout::load(&dir, DType::F32, &Device::Cpu)?;
    let dev = grpo_rollout::load(&dir, dtype, device)?;
    let rows_ids: Vec<Vec<u32>> = vec![vec![5, 9, 2, 33, 7, 12, 40, 3], vec![8, 3, 20, 11, 44]];
    push(
        format!("log-probs on {} vs cpu f32", device_name(device)),
        (|| {
            let a = logprobs(&cpu.model, &rows_ids)?;
            let b = logprobs(&dev.model, &rows_ids)?;
            Ok((max_diff(&a, &b)?, tol))
        })(),
    );
    push(
        format!(
            "log-probs with an f32 head (cast_lm_head_to_fp32) on {} vs cpu f32",
            device_name(device)
        ),
        (|| {
            let mut m = dev.model.clone();
            m.cast_head_to_f32()?;
            let a = logprobs(&cpu.model, &rows_ids)?;
            let b = logprobs(&m, &rows_ids)?;
            Ok((max_diff(&a, &b)?, tol))
        })(),
    );
    if !device.is_cpu() {
        // rollout.device: the CPU model copied to the device, twice; the second copy reuses
        // every frozen tensor of the first, and both give the CPU's log-probs.
        push(
            format!(
                "copy to {} (rollout.device) vs cpu f32",
                device_name(device)
            ),
            (|| {
                // The frozen weights (a LoRA run's base): trainable `Var`s cross at every
                // publish by design, so the model is detached first.
                let frozen = cpu.model.detached();
                let mut copies = grpo_rollout::model::DeviceCopies::default();
                let a = frozen.to_device_reusing(device, &mut copies)?;
                let held = copies.copy_ids();
                let b = frozen.to_device_reusing(device, &mut copies)?;
                anyhow::ensure!(
                    !held.is_empty() && copies.copy_ids() == held,
                    "the second copy moved the weights again"
                );
                drop(a);
                let want = logprobs(&cpu.model, &rows_ids)?;
                let got = logprobs(&b, &rows_ids)?;
                Ok((max_diff(&want, &got)?, 1e-4))
            })(),
        );
    }
    push(
        "gradient checkpointing vs plain backward".into(),
        checkpoint_check(&dev.model, &rows_ids).map(|d| (d, tol)),
    );
    push(
        "layer blocks (taped where every op records) vs plain backward".into(),
        taped_check(&dev.model, &rows_ids).map(|d| (d, tol)),
    );
    // A model with head dimension 64 over rows longer than a decode pass: on CUDA in bf16/f16
    // its attention runs the flash kernels (causal), in the frozen pass and with a graph.
    let wide = dir.join("hd64");
    let (wide_cpu, wide_dev) = (|| -> Result<_> {
        let mut cfg = cpu.model.cfg.clone();
        (cfg.hidden_size, cfg.num_attention_heads) = (128, 2);
        (cfg.num_key_value_heads, cfg.head_dim) = (1, 64);
        let m = grpo_rollout::init::random_weights(&cfg, 11, DType::F32, &Device::Cpu)?;
        grpo_rollout::loader::save_hf_dir(&m, &cpu.tokenizer, &wide, DType::F32)?;
        Ok((
            grpo_rollout::load(&wide, DType::F32, &Device::Cpu)?,
            grpo_rollout::load(&wide, dtype, device)?,
        ))
    })()
    .context("writing the head-dim-64 check model")?;
    // 100 positions: two blocks of 64 query rows, so the causal flash kernels skip a key tile;
    // the second row left-padded by 31.
    let long_rows: Vec<Vec<u32>> = vec![
        (0..100).map(|i| (i * 37 + 5) % 500 + 3).collect(),
        (0..69).map(|i| (i * 11 + 2) % 500 + 3).collect(),
    ];
    push(
        format!(
            "log-probs over 100 positions, head dim 64 (flash attention on CUDA bf16/f16), on {} vs cpu f32",
            device_name(device)
        ),
        (|| {
            let a = logprobs(&wide_cpu.model, &long_rows)?;
            let b = logprobs(&wide_dev.model, &long_rows)?;
            Ok((max_diff(&a, &b)?, tol))
        })(),
    );
    push(
        format!(
            "packed rows (SFT packing: 60 + 40 positions, kept apart) vs each alone, head dim 64, on {}",
            device_name(device)
        ),
        packed_check(&wide_dev.model, &long_rows[0][..60], &long_rows[1][..40]).map(|d| (d, tol)),
    );
    push(
        "gradient checkpointing vs plain backward, head dim 64 over 100 positions".into(),
        checkpoint_check(&wide_dev.model, &long_rows).map(|d| (d, tol)),
    );
    push(
        "layer blocks vs plain backward, head dim 64 over 100 positions".into(),
        taped_check(&wide_dev.model, &long_rows).map(|d| (d, tol)),
    );
    // The architectures with pieces of their own, head dim 64: Mistral's sliding window (20
    // positions, shorter than the rows and than a generation), SmolLM3's NoPE layer, Gemma 3's
    // everything (1 + w norms, output norms, GELU-tanh, scaled embeddings, a sliding layer
    // with its own RoPE base beside a full one), OLMo 2's output norms without pre-norms,
    // Phi-3's fused files with three quarters of each head rotating and a window, Gemma 2's
    // soft caps (scores and logits) beside a sliding layer, Granite's four multipliers, the
    // mixtures of experts (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral, OLMoE, Granite
    // MoE), ERNIE 4.5's interleaved RoPE, EXAONE 4's sliding layer beside a NoPE global one,
    // gpt-oss's attention sinks, biased experts and clamped SwiGLU beside a sliding layer,
    // GLM-4.5's and DeepSeek-V3's grouped sigmoid routers and shared experts, DeepSeek's latent
    // attention (its values zero-padded: DeepSeek-V3; as wide as the queries: GLM-4.7-Flash),
    // Ministral 3's YaRN, Gemma 4's per-kind heads, shared keys and values and per-layer inputs.
    // Log-probs over 100 positions against the CPU, gradient checkpointing, a generation
    // through the KV cache against the full forward, and one with CUDA graphs against one
    // without where the steps are captured (a replay makes the window's band on the device,
    // from the cached length).
    let special = Arch::ALL
        .into_iter()
        .filter(|a| !matches!(a, Arch::Llama | Arch::Qwen2 | Arch::Qwen3));
    for arch in special {
        let name = arch.as_str();
        let loaded = (|| -> Result<_> {
            let mut cfg = wide_cpu.model.cfg.clone();
            cfg.arch = arch;
            cfg.num_hidden_layers = 2;
            cfg.attention_bias = false;
            let g = grpo_rollout::init::preset_config(Preset::Tiny, arch, 2, 1, 0);
            (cfg.activation, cfg.query_pre_attn_scalar) = (g.activation, g.query_pre_attn_scalar);
            cfg.local_rope_theta = g.local_rope_theta;
            cfg.partial_rotary_factor = g.partial_rotary_factor;
            // Ministral 3's YaRN (its attention temperature is 1 within 16,384 positions).
            if arch == Arch::Ministral3 {
                cfg.rope_scaling = g.rope_scaling.clone();
            }
            (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) =
                (g.attn_logit_softcapping, g.final_logit_softcapping);
            // Four experts, two per token, at this width (Qwen2-MoE's shared expert too).
            cfg.moe = g.moe.map(|mut m| {
                m.moe_intermediate_size = match arch.experts_mlp_wide() {
                    true => cfg.intermediate_size,
                    false => cfg.intermediate_size / 2,
                };
                m.mlp_only_layers.clear();
                if m.shared_expert_intermediate_size.is_some() {
                    m.shared_expert_intermediate_size = Some(cfg.intermediate_size);
                }
                m
            });
            // DeepSeek's latent attention at this head size: half of each query head rotating,
            // every head its own key and value.
            cfg.mla = g.mla.map(|mut m| {
                (m.qk_nope_head_dim, m.qk_rope_head_dim) = (cfg.head_dim / 2, cfg.head_dim / 2);
                m.v_head_dim = match arch {
                    Arch::DeepseekV3 | Arch::DeepseekV2 => cfg.head_dim / 2,
                    _ => cfg.head_dim,
                };
                m.q_lora_rank = m.q_lora_rank.map(|_| cfg.hidden_size / 2);
                m.kv_lora_rank = cfg.hidden_size / 2;
                m
            });
            if cfg.mla.is_some() {
                cfg.num_key_value_heads = cfg.num_attention_heads;
            }
            cfg.granite = g.granite.map(|mut s| {
                s.attention_multiplier = 1.0 / (cfg.head_dim as f64).sqrt();
                s
            });
            // EXAONE 4's global layer rotates nothing (NoPE), its sliding one does.
            cfg.nope_layers = match arch {
                Arch::SmolLM3 | Arch::Exaone4 => vec![1],
                _ => vec![],
            };
            cfg.sliding_window = matches!(
                arch,
                Arch::Mistral
                    | Arch::Gemma2
                    | Arch::Gemma3
                    | Arch::Phi3
                    | Arch::Exaone4
                    | Arch::GptOss
                    | Arch::Olmo3
                    | Arch::Gemma4
            )
            .then_some(20);
            cfg.sliding_layers = match arch {
                Arch::Gemma2 | Arch::Gemma3 | Arch::Exaone4 | Arch::GptOss | Arch::Olmo3 => {
                    vec![0]
                }
                _ => vec![],
            };
            // Gemma 4: sliding, full, sliding, full, the last two reusing the first two's keys
            // and values; the full layers twice as wide, keys as their values; per-layer inputs.
            cfg.gemma4 = g.gemma4.map(|mut x| {
                cfg.num_hidden_layers = 4;
                cfg.sliding_layers = vec![0, 2];
                x.global_head_dim = 2 * cfg.head_dim;
                x.kv_shared_layers = 2;
                x.per_layer_input = Some((cfg.vocab_size, 8));
                x
            });
            // Qwen3.5: a linear-attention layer before a gated full one; LFM2: a convolution
            // before attention.
            cfg.linear_attention = g.linear_attention.map(|mut d| {
                d.layers = vec![0];
                d
            });
            cfg.short_conv = g.short_conv.map(|mut c| {
                c.layers = vec![0];
                c
            });
            let mut m = grpo_rollout::init::random_weights(&cfg, 13, DType::F32, &Device::Cpu)?;
            if arch == Arch::Gemma4 {
                // Gemma 4 scales no scores and adds each per-layer branch normalised: at
                // their initial norms (1) a bf16 rounding moves the log-probs by tenths
                // (transformers' own random model too, 0.19 over 100 positions). Norms as a
                // trained model's temper both: q and k by head_dim^-1/4, the branch by 0.1
                // (transformers' model so: 0.013, as Gemma 3's).
                for l in m.layers.iter_mut() {
                    for n in l.q_norm.iter_mut().chain(l.k_norm.iter_mut()) {
                        let d = n.weight.dim(0)? as f64;
                        n.weight = n.weight.affine(d.powf(-0.25), 0.0)?;
                    }
                    if let Some(b) = l.per_layer.as_mut() {
                        b.norm.weight = b.norm.weight.affine(0.1, 0.0)?;
                    }
                }
            }
            let d = dir.join(name);
            grpo_rollout::loader::save_hf_dir(&m, &cpu.tokenizer, &d, DType::F32)?;
            Ok((
                grpo_rollout::load(&d, DType::F32, &Device::Cpu)?,
                // An MoE layer's top-k choice flips where two experts nearly tie: in bf16 or
                // f16 some of 200 tokens always route apart from f32, so its rows run in f32
                // (the dtypes' kernels are the dense rows').
                grpo_rollout::load(&d, if arch.moe() { DType::F32 } else { dtype }, device)?,
            ))
        })();
        let (a_cpu, a_dev) = match loaded {
            Ok(m) => m,
            Err(e) => {
                push(format!("{name}: the check model"), Err(e));
                continue;
            }
        };
        push(
            format!(
                "{name} log-probs over 100 positions on {}{} vs cpu f32",
                device_name(device),
                if arch.moe() { " f32" } else { "" }
            ),
            (|| {
                let a = logprobs(&a_cpu.model, &long_rows)?;
                let b = logprobs(&a_dev.model, &long_rows)?;
                Ok((max_diff(&a, &b)?, tol))
            })(),
        );
        push(
            format!("{name} gradient checkpointing vs plain backward over 100 positions"),
            checkpoint_check(&a_dev.model, &long_rows).map(|d| (d, tol)),
        );
        // DeepSeek's latent attention: its cache in both forms (the latent, each head's keys and
        // values), whatever the device's default.
        let forms: &[Option<(bool, &str)>] = match a_dev.model.cfg.mla {
            Some(_) => &[
                Some((true, " (the latent)")),
                Some((false, " (each head's)")),
            ],
            None => &[None],
        };
        for form in forms {
            let run = || cache_check(&a_dev.model, &a_dev.tokenizer, &rows_ids, tol);
            push(
                format!(
                    "{name} generation through the KV cache{} vs the full forward",
                    form.map_or("", |f| f.1)
                ),
                match form {
                    Some((latent, _)) => grpo_rollout::mla::with_latent_cache(*latent, run),
                    None => run(),
                },
            );
        }
        // Experts (their routing read on the host), DeepSeek's latent attention and Gemma 2's
        // capped scores keep their decode steps eager: no graph to check.
        let graphed = a_dev.model.for_decoding().map(|d| d.graphable());
        if !device.is_cpu() && !matches!(graphed, Ok(false)) {
            push(
                format!("{name} generation past the window, CUDA graphs vs eager"),
                graph_check(&a_dev.model, &a_dev.tokenizer, &rows_ids, dtype, tol),
            );
        }
    }
    // On-policy distillation: the head-dim-64 model teaches the check model (same vocabulary).
    push(
        format!(
            "distillation divergence (generalized JSD, beta 0.5) and its gradient norm on {} vs cpu f32",
            device_name(device)
        ),
        (|| {
            let a = distill_check(&cpu.model, &wide_cpu.model, &rows_ids, 0.5.into())?;
            let b = distill_check(&dev.model, &wide_dev.model, &rows_ids, 0.5.into())?;
            Ok((
                (a.0 - b.0).abs().max((a.1 - b.1).abs() / a.1.max(1e-6)),
                tol,
            ))
        })(),
    );
    // SDPO's top-k divergence: the student's top 8 (k arg-max passes), with a tail bucket.
    push(
        format!(
            "SDPO top-k divergence (k 8, tail bucket) and its gradient norm on {} vs cpu f32",
            device_name(device)
        ),
        (|| {
            let topk = grpo_core::distill::Divergence::TopK {
                k: 8,
                beta: 0.5,
                add_tail: true,
            };
            let a = distill_check(&cpu.model, &wide_cpu.model, &rows_ids, topk)?;
            let b = distill_check(&dev.model, &wide_dev.model, &rows_ids, topk)?;
            Ok((
                (a.0 - b.0).abs().max((a.1 - b.1).abs() / a.1.max(1e-6)),
                tol,
            ))
        })(),
    );
    // TRL's `loss_top_k` supports: the teacher's top token (forward KL) and the top-1 support
    // of the teacher's and the student's arg-max tokens, with a tail bucket; in f32 also the
    // union of both top 4 at β 0.5, renormalised. (In bf16 a wider support is not compared:
    // the random models' near-equal logits round to ties that reorder their top 4, so the CPU
    // and the device select different tokens — SDPO's top 4 differs by 10% the same way.)
    push(
        format!(
            "sparse distillation supports (top-1{}) and their gradient norms on {} vs cpu f32",
            if tol < 1e-3 { ", top-4 union" } else { "" },
            device_name(device)
        ),
        (|| {
            use grpo_core::distill::{Divergence, ReverseTop1};
            let mut worst: f64 = 0.0;
            let mut cases = vec![(1, 0.0, true), (1, 0.5, true)];
            if tol < 1e-3 {
                cases.push((4, 0.5, false));
            }
            for (k, beta, add_tail) in cases {
                let div = Divergence::Sparse {
                    k,
                    beta,
                    add_tail,
                    reverse: ReverseTop1::Argmax,
                };
                let a = distill_check(&cpu.model, &wide_cpu.model, &rows_ids, div)?;
                let b = distill_check(&dev.model, &wide_dev.model, &rows_ids, div)?;
                worst = worst
                    .max((a.0 - b.0).abs())
                    .max((a.1 - b.1).abs() / a.1.max(1e-6));
            }
            Ok((worst, tol))
        })(),
    );
    // GOLD's ULD: two tokenisations of one text (the teacher's tokens each covering two of the
    // student's), byte-aligned and merged, sorted L1 and the hybrid loss (the sort's order is
    // found on the CPU, the gather on the device).
    push(
        format!(
            "GOLD ULD loss (byte-aligned, hybrid) and its gradient norm on {} vs cpu f32",
            device_name(device)
        ),
        (|| {
            let a = uld_check(&cpu.model, &wide_cpu.model, &rows_ids[0])?;
            let b = uld_check(&dev.model, &wide_dev.model, &rows_ids[0])?;
            Ok((
                (a.0 - b.0).abs().max((a.1 - b.1).abs() / a.1.max(1e-6)),
                tol,
            ))
        })(),
    );
    push(
        format!(
            "ORPO and SimPO losses (f64 odds) and their gradient norms on {} vs cpu f32",
            device_name(device)
        ),
        (|| {
            let a = pair_check(&cpu.model, &rows_ids)?;
            let b = pair_check(&dev.model, &rows_ids)?;
            let rel = |x: f64, y: f64| (x - y).abs() / x.abs().max(1e-6);
            Ok((
                rel(a[0], b[0]).max(rel(a[1], b[1])).max(rel(a[2], b[2])),
                tol,
            ))
        })(),
    );
    push(
        format!(
            "reward-model scores (score head) on {} vs cpu f32",
            device_name(device)
        ),
        (|| {
            let refs: Vec<&[u32]> = rows_ids.iter().map(Vec::as_slice).collect();
            let a = cpu.model.clone().into_sequence_classifier(3)?;
            let b = dev.model.clone().into_sequence_classifier(3)?;
            let (x, y) = (
                a.sequence_scores(&refs, Some(0))?,
                b.sequence_scores(&refs, Some(0))?,
            );
            Ok((max_diff(&x, &y)? / max_abs(&x)?.max(1e-3), tol))
        })(),
    );
    if device.is_cuda() {
        push(
            "8-bit optimizer state (optim = adamw_8bit): quantizer bytes and lookup values on the device vs cpu"
                .into(),
            grpo_core::quant::device_mismatches(device)
                .map(|n| (n as f64, 0.0))
                .map_err(anyhow::Error::from),
        );
    }
    push(
        "8 AdamW steps lower the loss".into(),
        training_check(&dev.model, &rows_ids, false),
    );
    push(
        "8 steps of the 8-bit AdamW (optim = adamw_8bit) lower the loss".into(),
        training_check(&dev.model, &rows_ids, true),
    );
    push(
        "matrix products from two threads at once through one device handle vs the same \
         products alone"
            .into(),
        concurrent_products_check([device, device], dtype).map(|d| (d, tol)),
    );
    if let Some(ordinal) = cuda_ordinal(device) {
        // The overlapped generator's own handle of this GPU (`max_staleness >= 1`): the
        // policy published onto it (a full fine-tune's variables and a frozen base), its
        // log-probs there, and products from the two handles' threads at once.
        let second = grpo_rollout::DeviceSpec::Cuda(ordinal).device();
        push(
            "policy published onto a second handle of the GPU (the overlapped generator's) vs \
             cpu f32"
                .into(),
            (|| {
                let second = second.clone().map_err(anyhow::Error::msg)?;
                let tm = TrainableModel::full(&dev.model)?;
                let mut copies = grpo_rollout::model::DeviceCopies::default();
                let published = tm.model.snapshot_onto(&second, &mut copies)?;
                anyhow::ensure!(
                    published.device().same_device(&second),
                    "the published copy is not on the second handle"
                );
                // Written after publishing: the published copy must not see it.
                for (_, v) in &tm.vars {
                    v.set(&v.as_tensor().zeros_like()?)?;
                }
                let want = logprobs(&cpu.model, &rows_ids)?;
                let got = logprobs(&published, &rows_ids)?;
                Ok((max_diff(&want, &got)?, tol))
            })(),
        );
        push(
            "matrix products from two threads at once, each through its own handle of the GPU \
             (the overlapped generator's), vs the same products alone"
                .into(),
            (|| {
                let second = second.clone().map_err(anyhow::Error::msg)?;
                Ok((concurrent_products_check([device, &second], dtype)?, tol))
            })(),
        );
    }
    push(
        format!("greedy generation on {} vs cpu f32", device_name(device)),
        (|| {
            let p = SamplingParams {
                max_new_tokens: 12,
                min_new_tokens: 12,
                temperature: 0.0,
                ..SamplingParams::default()
            };
            let prompts = vec![rows_ids[0].clone()];
            let a = grpo_rollout::generate(&cpu.model, &cpu.tokenizer, &prompts, 1, &p)?;
            let b = grpo_rollout::generate(&dev.model, &dev.tokenizer, &prompts, 1, &p)?;
            let (a, b) = (&a[0].token_ids, &b[0].token_ids);
            let same = a.iter().zip(b).take_while(|(x, y)| x == y).count();
            if b.len() != 12 {
                anyhow::bail!("generated {} tokens, asked for 12", b.len());
            }
            // Half precision may part ways after a near-tie; f32 must agree throughout.
            let need = if matches!(dtype, DType::F32 | DType::F64) {
                12
            } else {
                1
            };
            Ok(((12 - same) as f64, (12 - need) as f64))
        })(),
    );
    push(
        format!(
            "regex-constrained sampling on {}, 4 rows: every completion matches; the device \
             sampler draws the host sampler's tokens (rows that differ)",
            device_name(device)
        ),
        (|| {
            let pattern = "[0-9]{2,6}( [0-9]{1,3})?";
            let p = SamplingParams {
                max_new_tokens: 24,
                seed: 7,
                regex: Some(pattern.into()),
                ..SamplingParams::default()
            };
            let prompts = vec![rows_ids[0].clone()];
            let sample = |on_device: bool| {
                grpo_rollout::generate::with_device_sampling(on_device, || {
                    grpo_rollout::generate(&dev.model, &dev.tokenizer, &prompts, 4, &p)
                })
            };
            let (a, b) = (sample(true)?, sample(false)?);
            let full = regex::Regex::new(&format!("^(?:{pattern})$"))?;
            if let Some(c) = a.iter().chain(&b).find(|c| !full.is_match(&c.text)) {
                anyhow::bail!("{:?} does not match {pattern}", c.text);
            }
            let differ = a
                .iter()
                .zip(&b)
                .filter(|(x, y)| x.token_ids != y.token_ids)
                .count();
            // Half-precision logits may part the two samplers' sums at a boundary.
            let limit = if matches!(dtype, DType::F32 | DType::F64) {
                0.0
            } else {
                1.0
            };
            Ok((differ as f64, limit))
        })(),
    );
    if device.is_cuda() {
        push(
            "decode steps replayed from CUDA graphs vs eager steps, greedy, 8 rows x 24 tokens: \
             log-probs of the same tokens"
                .into(),
            graph_check(&dev.model, &dev.tokenizer, &rows_ids, dtype, tol),
        );
    }
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        let statuses = [
            ("decoder", grpo_rollout::cuda::compile_status(device)),
            (
                "log-probs, entropy",
                grpo_core::cuda::compile_status(&grpo_core::cuda::HEAD, device),
            ),
            (
                "flash attention, sm_80 and later",
                grpo_rollout::flash::compile_status(device),
            ),
        ];
        if let Device::Cuda(d) = device {
            rows.push(pool_row(d));
        }
        for (which, status) in statuses {
            let name = format!("our CUDA kernels ({which}) compiled and loaded");
            rows.push(match status {
                Ok(()) => CheckRow {
                    name,
                    ok: true,
                    detail: if std::env::var("GRPO_CUDA_KERNELS").as_deref() == Ok("0") {
                        "GRPO_CUDA_KERNELS=0: the ops above ran the compositions".into()
                    } else {
                        "the ops above ran them".into()
                    },
                },
                Err(e) => CheckRow {
                    name,
                    ok: false,
                    detail: first_line(&e),
                },
            });
        }
    }
    drop(guard);
    Ok(rows)
}

/// The allocation pool keeps a freed block across a synchronisation and gives it back where a
/// phase ends (`grpo_core::cuda::keep_pool_across_syncs`, `trim_pool`): 64 MiB allocated,
/// freed, the device waited for, then the phase ended; the pool's unused reserve read at each.
#[cfg(feature = "cuda")]
fn pool_row(d: &candle_core::CudaDevice) -> CheckRow {
    use grpo_core::cuda::{pool_release_threshold, pool_released_at_syncs, pool_usage, trim_pool};
    const BLOCK: u64 = 64 << 20;
    let name = "allocation pool: a freed block kept across a synchronisation, returned where a \
                phase ends"
        .to_string();
    let device = Device::Cuda(d.clone());
    let unused = || pool_usage(d).map(|[used, _, reserved, _]| reserved.saturating_sub(used));
    let measured = (|| -> Result<(u64, u64)> {
        drop(Tensor::zeros((BLOCK / 4) as usize, DType::F32, &device)?);
        device.synchronize()?;
        let kept = unused().context("the driver does not report the pool")?;
        trim_pool(d);
        let left = unused().context("the driver does not report the pool")?;
        Ok((kept, left))
    })();
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    match measured {
        Err(e) => CheckRow {
            name,
            ok: false,
            detail: first_line(&e.to_string()),
        },
        Ok((kept, left)) if pool_released_at_syncs() => CheckRow {
            name,
            ok: true,
            detail: format!(
                "GRPO_CUDA_POOL=sync: the driver's default (unused after the sync {:.0} MiB, \
                 after the phase end {:.0} MiB)",
                mib(kept),
                mib(left)
            ),
        },
        Ok((kept, left)) => {
            let threshold = pool_release_threshold(d);
            CheckRow {
                name,
                ok: threshold == Some(u64::MAX) && kept >= BLOCK && left < BLOCK,
                detail: format!(
                    "release threshold {}; unused after the sync {:.0} MiB (want >= 64), after \
                     the phase end {:.0} MiB (want < 64)",
                    match threshold {
                        Some(u64::MAX) => "max".to_string(),
                        Some(t) => t.to_string(),
                        None => "unknown".into(),
                    },
                    mib(kept),
                    mib(left)
                ),
            }
        }
    }
}

/// The first-use self-check off until dropped (then as it was).
struct SelfCheckOff(bool);

impl SelfCheckOff {
    fn new() -> Self {
        let was = grpo_core::selfcheck::enabled();
        grpo_core::selfcheck::set_enabled(false);
        Self(was)
    }
}

impl Drop for SelfCheckOff {
    fn drop(&mut self) {
        grpo_core::selfcheck::set_enabled(self.0);
    }
}

struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The ordinal of a CUDA device (`None` on the CPU).
fn cuda_ordinal(d: &Device) -> Option<usize> {
    match d.location() {
        candle_core::DeviceLocation::Cuda { gpu_id } => Some(gpu_id),
        _ => None,
    }
}

fn device_name(d: &Device) -> String {
    match d {
        Device::Cpu => "cpu".into(),
        Device::Cuda(_) => "cuda".into(),
        _ => format!("{d:?}"),
    }
}

/// The largest absolute difference; NaN when either side has a NaN (a reduction's `max`
/// would pass over it and call two NaN tensors equal).
fn max_diff(a: &Tensor, b: &Tensor) -> Result<f64> {
    let a = a.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
    let b = b.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
    let d: Vec<f64> = (a - b)?.abs()?.flatten_all()?.to_vec1()?;
    Ok(d.into_iter().fold(0.0, worse))
}

fn max_abs(a: &Tensor) -> Result<f64> {
    max_diff(a, &a.zeros_like()?)
}

type OpFn<'a> = Box<dyn Fn(&[Tensor]) -> candle_core::Result<Tensor> + 'a>;

/// Each op on the current fused path (or the forced recompute path) against the composition:
/// the largest difference of values and gradients, relative to the gradients' size.
fn op_checks(
    device: &Device,
    dtype: DType,
    force_recompute: bool,
) -> Vec<(&'static str, Result<f64>)> {
    let mut out = Vec::new();
    let mk = || -> Result<Vec<(&'static str, Vec<Tensor>, OpFn<'static>)>> {
        let d = device;
        let (b, l, s, nh, nkv, hd) = (2, 6, 9, 4, 2, 8);
        let ang = randn(&[b, l, hd / 2], DType::F32, d)?;
        let (cos, sin) = (ang.cos()?.to_dtype(dtype)?, ang.sin()?.to_dtype(dtype)?);
        let mut bias = vec![0f32; b * l * s];
        for r in 0..b {
            for i in 0..l {
                for j in 0..s {
                    if j > s - l + i || j < r {
                        bias[(r * l + i) * s + j] = -1e9;
                    }
                }
            }
        }
        let bias = Tensor::from_vec(bias, (b, 1, l, s), d)?.to_dtype(dtype)?;
        let bias2 = bias.clone();
        let wf = randn(&[24, 16], dtype, d)?;
        let ids = Tensor::new(&[3u32, 0, 39, 7, 7, 12], d)?;
        let ids2 = ids.clone();
        Ok(vec![
            (
                "rms_norm",
                vec![randn(&[7, 16], dtype, d)?, (randn(&[16], dtype, d)? + 1.0)?],
                Box::new(|t: &[Tensor]| fused::rms_norm(&t[0], &t[1], 1e-6)),
            ),
            (
                "rope",
                vec![randn(&[b, l, nh, hd], dtype, d)?],
                Box::new(move |t: &[Tensor]| fused::rope(&t[0], &cos, &sin)),
            ),
            (
                "silu_mul",
                vec![randn(&[9, 12], dtype, d)?, randn(&[9, 12], dtype, d)?],
                Box::new(|t: &[Tensor]| fused::silu_mul(&t[0], &t[1])),
            ),
            (
                "attention",
                vec![
                    randn(&[b, nh, l, hd], dtype, d)?,
                    randn(&[b, nkv, s, hd], dtype, d)?,
                    randn(&[b, nkv, s, hd], dtype, d)?,
                ],
                Box::new(move |t: &[Tensor]| fused::attention(&t[0], &t[1], &t[2], &bias, 0.35)),
            ),
            (
                "attention_softmax",
                vec![randn(&[b, nh, l, s], dtype, d)?],
                Box::new(move |t: &[Tensor]| fused::attention_softmax(&t[0], &bias2, 0.35)),
            ),
            (
                "frozen_linear",
                vec![randn(&[7, 16], dtype, d)?],
                Box::new(move |t: &[Tensor]| fused::frozen_linear(&t[0], &wf)),
            ),
            (
                "log_softmax_gather",
                vec![randn(&[6, 40], dtype, d)?],
                Box::new(move |t: &[Tensor]| {
                    grpo_core::logprobs::selective_log_softmax(&t[0], &ids)
                }),
            ),
            (
                "entropy",
                vec![randn(&[6, 40], dtype, d)?],
                Box::new(move |t: &[Tensor]| {
                    let _ = &ids2;
                    grpo_core::logprobs::entropy_from_logits(&t[0])
                }),
            ),
        ])
    };
    let cases = match mk() {
        Ok(c) => c,
        Err(e) => return vec![("setup", Err(e))],
    };
    for (name, inputs, f) in cases {
        let r = (|| -> Result<f64> {
            let run =
                |inputs: &[Tensor], r: Option<&Tensor>| -> Result<(Tensor, Vec<Tensor>, Tensor)> {
                    let vars: Vec<Var> = inputs
                        .iter()
                        .map(Var::from_tensor)
                        .collect::<candle_core::Result<_>>()?;
                    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
                    let y = f(&ts)?;
                    let r = match r {
                        Some(r) => r.clone(),
                        None => randn(y.dims(), y.dtype(), y.device())?,
                    };
                    let g = (&y * &r)?.sum_all()?.backward()?;
                    let grads = vars
                        .iter()
                        .map(|v| {
                            g.get(v.as_tensor())
                                .cloned()
                                .ok_or_else(|| anyhow::anyhow!("no gradient reached an input"))
                        })
                        .collect::<Result<_>>()?;
                    Ok((y, grads, r))
                };
            grpo_core::fused::set_enabled(false);
            let (y0, g0, r) = run(&inputs, None)?;
            grpo_core::fused::set_enabled(true);
            grpo_core::fused::set_force_recompute(force_recompute);
            let res = run(&inputs, Some(&r));
            grpo_core::fused::set_force_recompute(false);
            let (y1, g1, _) = res?;
            Ok(worse(rel_diff(&y0, &y1)?, rel_diff_all(&g0, &g1)?))
        })();
        out.push((name, r));
    }
    out
}

fn padded(rows: &[Vec<u32>], device: &Device) -> Result<(Tensor, Tensor)> {
    Ok(grpo_rollout::generate::left_pad(rows, 0, device)?)
}

fn logprobs(m: &Transformer, rows: &[Vec<u32>]) -> Result<Tensor> {
    let (ids, mask) = padded(rows, m.device())?;
    Ok(m.completion_logprobs(&ids, &mask, 4, 1.0, false)?.0)
}

fn nll(m: &Transformer, rows: &[Vec<u32>]) -> Result<Tensor> {
    let (ids, mask) = padded(rows, m.device())?;
    let (lp, ent) = m.completion_logprobs(&ids, &mask, 4, 1.0, true)?;
    let ent = ent.context("entropy")?;
    Ok((lp.mean_all()?.neg()? + (ent.mean_all()? * 0.01)?)?)
}

/// Largest gradient difference (relative) between a checkpointed and a plain backward.
/// Two sequences in one packed row (each on its own positions, attending to itself) give the
/// log-probs each gives alone: the largest difference.
fn packed_check(m: &Transformer, a: &[u32], b: &[u32]) -> Result<f64> {
    let dev = m.device();
    let alone = |s: &[u32]| -> Result<Tensor> {
        let ids = Tensor::new(s, dev)?.unsqueeze(0)?;
        let mask = Tensor::ones((1, s.len()), DType::U32, dev)?;
        Ok(m.completion_logprobs(&ids, &mask, s.len() - 1, 1.0, false)?
            .0)
    };
    let l = a.len() + b.len();
    let ids: Vec<u32> = a.iter().chain(b).copied().collect();
    let ids = Tensor::new(ids.as_slice(), dev)?.unsqueeze(0)?;
    let lens = [vec![a.len(), b.len()]];
    let (pos, bias) = grpo_rollout::model::packed_positions_and_bias(&lens, l, dev)?;
    let (packed, _) = m.logprobs_with(&ids, &pos, &bias, l - 1, 1.0, false)?;
    // Position j predicts token j + 1: a's tokens 1.., then (after the boundary) b's.
    let da = max_diff(&packed.narrow(1, 0, a.len() - 1)?, &alone(a)?)?;
    let db = max_diff(&packed.narrow(1, a.len(), b.len() - 1)?, &alone(b)?)?;
    Ok(da.max(db))
}

fn checkpoint_check(base: &Transformer, rows: &[Vec<u32>]) -> Result<f64> {
    blocks_check(base, rows, true)
}

/// Like [`checkpoint_check`] for layer blocks without recomputation
/// (`Transformer::enable_layer_segments`: taped blocks where every op of a layer records, as
/// on a GPU's path; segments elsewhere on the CPU).
fn taped_check(base: &Transformer, rows: &[Vec<u32>]) -> Result<f64> {
    blocks_check(base, rows, false)
}

/// The largest gradient difference between a plain backward and one through layer blocks
/// (recomputed with `ckpt`, else taped or segments). Fails when a layer whose ops should all
/// record on a tape fell back (a segment, or a recomputation under a local graph).
fn blocks_check(base: &Transformer, rows: &[Vec<u32>], ckpt: bool) -> Result<f64> {
    let before = grpo_core::recompute::tape_fallbacks();
    let d = blocks_diff(base, rows, ckpt)?;
    anyhow::ensure!(
        grpo_core::recompute::tape_fallbacks() == before,
        "a decoder layer's tape was incomplete (it ran without one)"
    );
    Ok(d)
}

fn blocks_diff(base: &Transformer, rows: &[Vec<u32>], ckpt: bool) -> Result<f64> {
    let grads = |blocks: bool| -> Result<Vec<Tensor>> {
        let mut tm = TrainableModel::full(base)?;
        if blocks && ckpt {
            tm.model.enable_gradient_checkpointing();
        } else if blocks {
            tm.model.enable_layer_segments();
        }
        let g = tm.model.backward(&nll(&tm.model, rows)?)?;
        tm.vars
            .iter()
            .map(|(n, v)| {
                g.get(v.as_tensor())
                    .cloned()
                    .with_context(|| format!("no gradient for {n}"))
            })
            .collect()
    };
    let (a, b) = (grads(false)?, grads(true)?);
    // Each weight's difference relative to its own largest gradient, floored at a tenth of the
    // largest gradient of all: a weight whose gradient is a near-cancelling sum (a k bias: a
    // shift of every key that softmax all but ignores) is rounding noise in half precision,
    // whichever order the two backwards sum in.
    let maxima = a.iter().map(max_abs).collect::<Result<Vec<f64>>>()?;
    let scale = maxima.iter().copied().fold(0f64, f64::max);
    let mut worst = 0f64;
    for ((x, y), m) in a.iter().zip(&b).zip(maxima) {
        worst = worse(worst, max_diff(x, y)? / m.max(0.1 * scale).max(1e-3));
    }
    Ok(worst)
}

/// The mean distillation divergence `div` of `student` from `teacher` over `rows` (every token
/// after the first) and the norm of its gradient over the student's weights.
fn distill_check(
    student: &Transformer,
    teacher: &Transformer,
    rows: &[Vec<u32>],
    div: grpo_core::distill::Divergence,
) -> Result<(f64, f64)> {
    let s = TrainableModel::full(student)?;
    let (ids, mask) = padded(rows, student.device())?;
    let t = ids.dim(1)? - 1;
    let h = s.model.completion_hidden(&ids, &mask, t)?;
    let td = teacher.device();
    let th = teacher.completion_hidden(&ids.to_device(td)?, &mask.to_device(td)?, t)?;
    let (div, _) = s.model.distill_rows(&h, teacher, &th, div, 1.0)?;
    let loss = div.mean_all()?;
    let grads = s.model.backward(&loss)?;
    let norm = grad_norm(&s, &grads)?;
    Ok((loss.to_dtype(DType::F64)?.to_scalar::<f64>()?, norm))
}

/// GOLD's ULD loss of `student` against `teacher` on `row` (tokens 1..7 for the student, every
/// other one for the teacher, each of its tokens two of the student's bytes-wise), the sorted
/// and the hybrid (ids below 64 shared) losses summed, and the norm of its gradient.
fn uld_check(student: &Transformer, teacher: &Transformer, row: &[u32]) -> Result<(f64, f64)> {
    use grpo_core::uld::{Hybrid, UldConfig, UldSide, VocabMatch, uld_loss};
    let s = TrainableModel::full(student)?;
    let rows = vec![row.to_vec()];
    let side = |m: &Transformer, ids: Vec<u32>, width: usize| -> Result<UldSide> {
        let (x, mask) = padded(&rows, m.device())?;
        let t = x.dim(1)? - 1;
        let h = m.completion_hidden(&x, &mask, t)?;
        let n = ids.len();
        Ok(UldSide {
            logits: m.logits(&h.narrow(0, 0, n + 1)?)?,
            offsets: (0..n).map(|k| (width * k, width * k + width)).collect(),
            ids,
        })
    };
    let st = side(&s.model, row[1..7].to_vec(), 2)?;
    let te = side(teacher, row[1..7].iter().step_by(2).copied().collect(), 4)?;
    let te = UldSide {
        logits: te.logits.detach(),
        ..te
    };
    let shared: Vec<u32> = (0..64).collect();
    let hybrid = Hybrid {
        vocab: VocabMatch {
            teacher: shared.clone(),
            student: shared,
        },
        beta: 0.5,
        weights: None,
    };
    let plain = uld_loss(&[(st.clone(), te.clone())], &UldConfig::default())?.loss;
    let cfg = UldConfig {
        hybrid: Some(hybrid),
        ..UldConfig::default()
    };
    let loss = (plain + uld_loss(&[(st, te)], &cfg)?.loss)?;
    let grads = s.model.backward(&loss)?;
    let norm = grad_norm(&s, &grads)?;
    Ok((loss.to_dtype(DType::F64)?.to_scalar::<f64>()?, norm))
}

/// ORPO's loss (the first row as chosen, the second as rejected, token-averaged log-probs),
/// SimPO's with a behaviour-cloning term, and the norm of the ORPO loss's gradient.
fn pair_check(m: &Transformer, rows: &[Vec<u32>]) -> Result<[f64; 3]> {
    let s = TrainableModel::full(m)?;
    let lp = logprobs(&s.model, rows)?;
    let avg = lp.mean(1)?;
    let (c, r) = (avg.narrow(0, 0, 1)?, avg.narrow(0, 1, 1)?);
    let nll = lp.narrow(0, 0, 1)?.mean_all()?.neg()?;
    let orpo = grpo_core::preference::orpo_loss(&c, &r, &nll, 0.1)?.loss;
    let cfg = grpo_core::preference::CpoConfig {
        loss_type: grpo_core::preference::CpoLossType::Simpo,
        beta: 2.0,
        ..Default::default()
    };
    let simpo = grpo_core::preference::cpo_loss(&c, &r, &nll, &cfg)?.loss;
    let grads = s.model.backward(&orpo)?;
    let norm = grad_norm(&s, &grads)?;
    let f = |t: &Tensor| -> Result<f64> { Ok(t.to_dtype(DType::F64)?.to_scalar::<f64>()?) };
    Ok([f(&orpo)?, f(&simpo)?, norm])
}

/// The global norm of `grads` over the trainable weights of `m`.
fn grad_norm(m: &TrainableModel, grads: &candle_core::backprop::GradStore) -> Result<f64> {
    let mut sq = 0.0;
    for (_, v) in &m.vars {
        if let Some(g) = grads.get(v.as_tensor()) {
            sq += g
                .to_dtype(DType::F64)?
                .sqr()?
                .sum_all()?
                .to_scalar::<f64>()?;
        }
    }
    Ok(sq.sqrt())
}

/// Loss after 8 AdamW steps on one batch, as a fraction of the first loss (must be < 0.9);
/// with `eight_bit`, the moments in bitsandbytes' 8-bit state (`optim = "adamw_8bit"`: the
/// device's quantizer and lookups).
fn training_check(base: &Transformer, rows: &[Vec<u32>], eight_bit: bool) -> Result<(f64, f64)> {
    let tm = TrainableModel::full(base)?;
    let params = AdamWParams {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
    };
    let mut opt = AdamW::new(tm.vars.clone(), params)?;
    if eight_bit {
        opt = opt.with_8bit_states(|_| false)?;
        anyhow::ensure!(opt.state_bytes() > 0, "no optimizer state");
    }
    let mut first = None;
    let mut last = 0.0;
    for _ in 0..8 {
        let loss = nll(&tm.model, rows)?;
        last = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        first.get_or_insert(last);
        let g = tm.model.backward(&loss)?;
        let mut acc = std::collections::HashMap::new();
        accumulate(&mut acc, &tm.vars, &g)?;
        opt.step(&acc, 3e-3)?;
    }
    let first = first.unwrap_or(1.0);
    Ok((last / first, 0.9))
}

/// Matrix products issued from two threads at once against the same products alone: the
/// largest difference relative to the largest product. With `max_staleness >= 1` on one GPU
/// the generator and the learner run their products concurrently, each thread on its own
/// per-thread stream, through the one cuBLAS handle candle keeps per device; cuBLAS promises
/// correct results from one handle shared by threads, and this checks it on the shapes where
/// it splits the inner dimension (a long `k`, few rows and columns) and so uses its workspace.
/// `devices` are the two threads' devices: the same one twice, or two handles of one GPU.
fn concurrent_products_check(devices: [&Device; 2], dtype: DType) -> Result<f64> {
    let shapes = [(32usize, 16384usize, 32usize), (64, 8192, 128)];
    let mut pairs = Vec::new();
    for (&(m, k, n), device) in shapes.iter().zip(devices) {
        let a = randn(&[m, k], dtype, device)?;
        let b = randn(&[k, n], dtype, device)?;
        let alone = a.matmul(&b)?;
        device.synchronize()?;
        pairs.push((a, b, alone));
    }
    let worst = std::thread::scope(|s| -> Result<f64> {
        let runs: Vec<_> = pairs
            .iter()
            .map(|(a, b, alone)| {
                s.spawn(move || -> Result<(f64, f64)> {
                    // Kept on the device until the end: no synchronisation between the products.
                    let mut diffs = Vec::new();
                    for _ in 0..64 {
                        let y = a.matmul(b)?;
                        diffs.push((y - alone)?.abs()?.max_all()?.to_dtype(DType::F32)?);
                    }
                    let worst = Tensor::stack(&diffs, 0)?.max_all()?.to_scalar::<f32>()?;
                    let size = alone
                        .abs()?
                        .max_all()?
                        .to_dtype(DType::F32)?
                        .to_scalar::<f32>()?;
                    Ok((f64::from(worst), f64::from(size).max(1e-6)))
                })
            })
            .collect();
        let mut worst = 0.0;
        for r in runs {
            let (d, size) = r
                .join()
                .map_err(|_| anyhow::anyhow!("a product thread panicked"))??;
            worst = worse(worst, d / size);
        }
        Ok(worst)
    })?;
    Ok(worst)
}

/// What the device holds besides the checks' results, printed under the table: on CUDA, what
/// our kernels take per thread (the driver reserves local memory for every resident thread by
/// the largest need), the decode steps captured as CUDA graphs and the last one's nodes by
/// kind, and the memory in use outside the allocation pool (context, modules, local memory,
/// libraries' workspaces). Nothing on the CPU.
pub fn device_notes(device: &Device) -> Vec<String> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        let mut out = grpo_core::cuda::kernel_resources(d);
        if grpo_rollout::graph::captures() > 0 {
            out.push(format!(
                "decode steps captured as CUDA graphs: {}; the last one's nodes: {}",
                grpo_rollout::graph::captures(),
                grpo_rollout::graph::last_capture_nodes()
            ));
        }
        if let (Some([_, _, reserved, _]), Ok((free, total))) = (
            grpo_core::cuda::pool_usage(d),
            candle_core::cuda_backend::cudarc::driver::result::mem_get_info(),
        ) {
            let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
            let used = (total - free) as u64;
            out.push(format!(
                "device memory in use {:.0} MiB, of which the allocation pool {:.0} MiB: {:.0} MiB \
                 outside it (context, modules, local memory, workspaces)",
                mib(used),
                mib(reserved),
                mib(used.saturating_sub(reserved))
            ));
        }
        return out;
    }
    let _ = device;
    Vec::new()
}

/// Prints the table; true when every check passed.
pub fn print_table(rows: &[CheckRow]) -> bool {
    let w = rows.iter().map(|r| r.name.len()).max().unwrap_or(10);
    println!("{:<w$}  {:<4}  detail", "check", "ok");
    for r in rows {
        println!(
            "{:<w$}  {:<4}  {}",
            r.name,
            if r.ok { "ok" } else { "FAIL" },
            r.detail
        );
    }
    let failed = rows.iter().filter(|r| !r.ok).count();
    println!("{} passed, {failed} failed", rows.len() - failed);
    failed == 0
}
