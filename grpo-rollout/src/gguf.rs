//! GGUF (llama.cpp) files: weights dequantised to our layout, tokenizer and chat template from
//! the metadata.
//!
//! What is read:
//! - `general.architecture` (`llama` — Mistral's and, with experts, Mixtral's files too —,
//!   `qwen2`, `qwen3`, `smollm3`, `phi3`, `granite`, `gemma2`, `gemma3`, `olmo2`, `qwen3moe`,
//!   `qwen2moe`, `olmoe`, `granitemoe`, `ernie4_5`, `glm4`, `glm4moe`, `deepseek2`, `mistral3`,
//!   `seed_oss`, `arcee`, `gemma4`, `hunyuan-dense`, `qwen35`, `qwen35moe`, `lfm2`, `lfm2moe`) and the `{arch}.*` hyper-parameters into a [`ModelConfig`], with what llama.cpp
//!   fixes per architecture (Gemma's sliding layers and attention scale, SmolLM3's NoPE layers,
//!   the experts' renormalisation, DeepSeek's router and latent widths, Gemma 4's KV-sharing
//!   pairs; Gemma 4's per-layer keys read as the `config.json` they stand for);
//!   the vocabulary size comes from
//!   `token_embd.weight`, biases and tied embeddings from which tensors are present (no
//!   `output.weight` = tied). Gemma's norm weights are `1 + w` in the file, `w` here.
//! - every tensor, dequantised with candle's [`QTensor::dequantize`], renamed from llama.cpp's
//!   names (`blk.0.attn_q.weight`) to transformers' (`model.layers.0.self_attn.q_proj.weight`).
//!   llama.cpp's converter permutes the rows of the `llama` / `smollm3` Q and K projections (weights and
//!   biases) for its interleaved RoPE; we undo that so the weights fit the "rotate half" RoPE
//!   of transformers (and of our model). `qwen2` / `qwen3` files are not permuted.
//! - `tokenizer.ggml.*` into a byte-level BPE `tokenizers::Tokenizer` (`tokenizer.ggml.model =
//!   gpt2`), with the pre-tokenizer named by `tokenizer.ggml.pre`, control tokens as special
//!   added tokens, and `tokenizer.chat_template`.
//!
//!
//! What is written ([`save_gguf`]): the same, the other way round, so that llama.cpp loads it
//! and [`load_gguf`] reads back the same model.
//!
//! [`QTensor::dequantize`]: candle_core::quantized::QTensor::dequantize

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{Read, Seek};
use std::path::Path;

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Result, Tensor, bail};
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::config::{Arch, Llama3RopeScaling, ModelConfig, RopeScaling};
use crate::model::WeightMap;
use crate::tokenizer::Tokenizer;

mod lfm2;
mod qwen35;

fn err(msg: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::msg(msg.to_string())
}

/// Reads a GGUF file: config, transformers-named weights (dequantised, converted to `dtype`, on
/// `device`) and tokenizer.
pub fn load_gguf(
    path: &Path,
    dtype: DType,
    device: &Device,
) -> Result<(ModelConfig, WeightMap, Tokenizer)> {
    let ctx = |e: candle_core::Error| err(format!("{}: {e}", path.display()));
    let mut file = File::open(path).map_err(|e| err(format!("{}: {e}", path.display())))?;
    let content = Content::read(&mut file).map_err(ctx)?;
    let mut cfg = config_from_gguf(&content).map_err(ctx)?;
    if content.tensor_infos.contains_key("rope_freqs.weight") {
        let factors: Vec<f32> = content
            .tensor(&mut file, "rope_freqs.weight", &Device::Cpu)
            .and_then(|q| q.dequantize(&Device::Cpu))
            .and_then(|t| t.flatten_all()?.to_vec1())
            .map_err(ctx)?;
        if let Some(g) = cfg.gemma4.as_mut() {
            // Gemma 4's full layers' proportional RoPE.
            (g.global_rope_fraction, g.global_rope_factor) =
                gemma4_rope_from_freqs(&factors, g.global_head_dim).map_err(ctx)?;
        } else if cfg.rope_scaling.is_some() {
            return Err(ctx(err(
                "both `rope_freqs.weight` and a `rope.scaling.type`: one RoPE scaling expected",
            )));
        } else {
            cfg.rope_scaling = Some(RopeScaling::Llama3(
                llama3_scaling_from_rope_freqs(&factors, cfg.rope_theta, cfg.head_dim)
                    .map_err(ctx)?,
            ));
        }
    }
    // Phi-3's LongRoPE: its short and long factors as tensors.
    if content.tensor_infos.contains_key(ROPE_SHORT) {
        let mut read = |name: &str| -> Result<Vec<f64>> {
            let v: Vec<f32> = content
                .tensor(&mut file, name, &Device::Cpu)
                .and_then(|q| q.dequantize(&Device::Cpu))
                .and_then(|t| t.flatten_all()?.to_vec1())
                .map_err(|e| err(format!("tensor `{name}`: {e}")))?;
            Ok(v.into_iter().map(f64::from).collect())
        };
        let (short, long) = (
            read(ROPE_SHORT).map_err(ctx)?,
            read(ROPE_LONG).map_err(ctx)?,
        );
        let key = |k: &str| format!("{}.{k}", cfg.arch.as_str());
        let md = &content.metadata;
        let attention_factor = md
            .get(&key("rope.scaling.attn_factor"))
            .and_then(as_f64)
            .unwrap_or(1.0);
        let original = md
            .get(&key("rope.scaling.original_context_length"))
            .and_then(as_u64)
            .map_or(cfg.max_position_embeddings, |x| x as usize);
        cfg.rope_scaling = Some(RopeScaling::LongRope(crate::config::LongRopeScaling {
            short_factor: short,
            long_factor: long,
            factor: None,
            attention_factor,
            attention_factor_given: true,
            original_max_position_embeddings: original,
        }));
        cfg.validate().map_err(ctx)?;
    }
    let weights = read_weights(&content, &mut file, &cfg, dtype, device).map_err(ctx)?;
    let weights = crate::layout::from_hf(&cfg, weights).map_err(ctx)?;
    let tokenizer = tokenizer_from_metadata(&content.metadata).map_err(ctx)?;
    Ok((cfg, weights, tokenizer))
}

/// llama.cpp's tensors of Phi-3's LongRoPE factors.
const ROPE_SHORT: &str = "rope_factors_short.weight";
const ROPE_FREQS: &str = "rope_freqs.weight";
const ROPE_LONG: &str = "rope_factors_long.weight";

/// Any integer-typed metadata value as `u64` (files differ in the width they use).
fn as_u64(v: &Value) -> Option<u64> {
    match v {
        Value::U8(x) => Some(*x as u64),
        Value::U16(x) => Some(*x as u64),
        Value::U32(x) => Some(*x as u64),
        Value::U64(x) => Some(*x),
        Value::I8(x) => u64::try_from(*x).ok(),
        Value::I16(x) => u64::try_from(*x).ok(),
        Value::I32(x) => u64::try_from(*x).ok(),
        Value::I64(x) => u64::try_from(*x).ok(),
        _ => None,
    }
}

/// A float metadata value as `f64`. An `f32` is widened through its shortest decimal form, so
/// `1e-5` stored as f32 reads back as `1e-5`, the value of the original `config.json`.
fn as_f64(v: &Value) -> Option<f64> {
    match v {
        Value::F32(x) => format!("{x}").parse().ok(),
        Value::F64(x) => Some(*x),
        other => as_u64(other).map(|x| x as f64),
    }
}

fn as_str(v: &Value) -> Option<&str> {
    match v {
        Value::String(s) => Some(s.as_str()),
        _ => None,
    }
}

fn as_bool(v: &Value) -> Option<bool> {
    match v {
        Value::Bool(b) => Some(*b),
        _ => None,
    }
}

fn md_u32(md: &HashMap<String, Value>, key: &str) -> Option<u32> {
    md.get(key).and_then(as_u64).map(|x| x as u32)
}

/// Builds the [`ModelConfig`] from a GGUF header (metadata and tensor shapes).
pub fn config_from_gguf(content: &Content) -> Result<ModelConfig> {
    let md = &content.metadata;
    let arch_name = md
        .get("general.architecture")
        .and_then(as_str)
        .ok_or_else(|| err("metadata `general.architecture` is missing"))?;
    // Gemma 4's per-layer keys: read as the config.json they stand for.
    if arch_name == "gemma4" {
        return gemma4_config(content);
    }
    let key = |k: &str| format!("{arch_name}.{k}");
    let experts = md.get(&key("expert_count")).and_then(as_u64).unwrap_or(0) as usize;
    // llama.cpp writes Mistral models as `llama`, Mixtral as `llama` with experts; its MoE
    // Qwens are `qwen3moe` and `qwen2moe`.
    let arch = match arch_name {
        "llama" if experts > 0 => Ok(Arch::Mixtral),
        "qwen3moe" => Ok(Arch::Qwen3Moe),
        "qwen2moe" => Ok(Arch::Qwen2Moe),
        "gemma3" => Ok(Arch::Gemma3),
        "glm4moe" => Ok(Arch::Glm4Moe),
        "hunyuan-dense" => Ok(Arch::HunyuanDense),
        "qwen35" => Ok(Arch::Qwen3_5),
        "qwen35moe" => Ok(Arch::Qwen3_5Moe),
        "lfm2moe" => Ok(Arch::Lfm2Moe),
        // Ministral 3 (its YaRN and attention temperature), or Mistral Small 3.1's plain
        // Mistral layers, as llama.cpp's converter writes both.
        "mistral3" => match md.get("mistral3.rope.scaling.type").and_then(as_str) {
            Some("yarn") => Ok(Arch::Ministral3),
            _ => Ok(Arch::Mistral),
        },
        // DeepSeek-V3's sigmoid router (GLM-4.7-Flash's too), or DeepSeek-V2's softmax.
        "deepseek2" => match deepseek2_sigmoid(content)? {
            true => Ok(Arch::DeepseekV3),
            false => Ok(Arch::DeepseekV2),
        },
        "qwen3_moe" | "qwen2_moe" | "mixtral" | "gemma3_text" => Err(()),
        // Our names that are not llama.cpp's (or families it does not share with us).
        name => Arch::parse(name).map_err(|_| ()).and_then(|a| match a {
            Arch::Mistral
            | Arch::Exaone4
            | Arch::GptOss
            | Arch::Glm
            | Arch::Olmo3
            | Arch::Glm4Moe
            | Arch::DeepseekV3
            | Arch::Glm4MoeLite
            | Arch::DeepseekV2
            | Arch::NanoChat
            | Arch::Ministral3
            | Arch::Gemma4
            | Arch::HunyuanDense
            | Arch::Qwen3_5
            | Arch::Qwen3_5Moe
            | Arch::Lfm2Moe => Err(()),
            a => Ok(a),
        }),
    }
    .ok()
    .ok_or_else(|| {
        err(format!(
            "GGUF architecture `{arch_name}` is not supported (supported: llama (with experts: Mixtral), qwen2, qwen3, qwen3moe, qwen2moe, olmoe, olmo2, gemma2, gemma3, gemma4, smollm3, phi3, granite, granitemoe, ernie4_5, glm4, glm4moe, deepseek2, mistral3, seed_oss, arcee, hunyuan-dense, qwen35, qwen35moe, lfm2, lfm2moe)"
        ))
    })?;
    let req = |k: &str| -> Result<usize> {
        md.get(&key(k))
            .and_then(as_u64)
            .map(|x| x as usize)
            .ok_or_else(|| {
                err(format!(
                    "metadata `{}` is missing or not an integer",
                    key(k)
                ))
            })
    };
    let hidden_size = req("embedding_length")?;
    let num_attention_heads = req("attention.head_count")?;
    // LFM2's per layer (0 on its convolution layers).
    let lfm2 = match arch {
        a if a.lfm2() => Some(lfm2::layers(md, arch_name, req("block_count")?)?),
        _ => None,
    };
    let num_key_value_heads = match &lfm2 {
        Some((kv, _)) => *kv,
        None => md
            .get(&key("attention.head_count_kv"))
            .and_then(as_u64)
            .map_or(num_attention_heads, |x| x as usize),
    };
    let head_dim = md
        .get(&key("attention.key_length"))
        .and_then(as_u64)
        .map_or(hidden_size / num_attention_heads.max(1), |x| x as usize);
    let embed = content
        .tensor_infos
        .get("token_embd.weight")
        .ok_or_else(|| err("tensor `token_embd.weight` is missing"))?;
    let vocab_size = embed.shape.dims().first().copied().unwrap_or(0);
    // llama.cpp's linear scaling is transformers' (every frequency divided by the factor);
    // its YaRN on the families where llama.cpp computes transformers' ([`yarn_family`],
    // DeepSeek's [`deepseek2_rope`]); LongRoPE from its tensors (`load_gguf`).
    let rope_scaling = match md.get(&key("rope.scaling.type")).and_then(as_str) {
        None | Some("none") => None,
        Some(kind) if arch.mla() => deepseek2_rope(md, kind, &key)?,
        Some("yarn") if arch == Arch::Ministral3 => Some(mistral3_yarn(md, &key)?),
        Some("linear") => Some(RopeScaling::Linear {
            factor: scaling_factor(md, &key, "linear RoPE scaling")?,
        }),
        Some("yarn") if yarn_family(arch) => Some(generic_yarn(md, &key)?),
        Some(kind) => bail!(
            "RoPE scaling `{kind}` ({}) is not supported (supported: none, linear; yarn for llama, qwen2, qwen3, qwen3moe, qwen2moe, deepseek2)",
            key("rope.scaling.type")
        ),
    };
    let has = |name: &str| content.tensor_infos.contains_key(name);
    // GLM-4.5's and GLM-4.7-Flash's next-token-prediction layers follow the model's
    // (`nextn_predict_layers`): not read.
    let num_hidden_layers = req("block_count")?.saturating_sub(
        md.get(&key("nextn_predict_layers"))
            .and_then(as_u64)
            .unwrap_or(0) as usize,
    );
    let float = |k: &str| md.get(&key(k)).and_then(as_f64);
    // Gemma's window and soft caps as llama.cpp reads them (Gemma 2's defaults: a window of
    // 4096, caps of 50 and 30; Gemma 3's window is required and its logits uncapped).
    let sliding_window = match arch {
        Arch::Phi3 | Arch::Gemma2 | Arch::Gemma3 => md
            .get(&key("attention.sliding_window"))
            .and_then(as_u64)
            .or((arch == Arch::Gemma2).then_some(4096))
            .filter(|w| *w > 0)
            .map(|w| w as usize),
        _ => None,
    };
    if arch.gemma() && sliding_window.is_none() {
        bail!(
            "metadata `{}` is 0: Gemma without its sliding window is not supported",
            key("attention.sliding_window")
        );
    }
    if arch == Arch::Gemma3 && float("final_logit_softcapping").is_some_and(|c| c != 0.0) {
        bail!(
            "metadata `{}`: Gemma 3 with capped logits is not supported (llama.cpp's sliding-window gemma3 does not cap them)",
            key("final_logit_softcapping")
        );
    }
    let mut cfg = ModelConfig {
        arch,
        vocab_size,
        hidden_size,
        // (Qwen3.5's MoE files have no dense width: the experts'.)
        intermediate_size: match arch {
            Arch::Qwen3_5Moe => md
                .get(&key("feed_forward_length"))
                .and_then(as_u64)
                .map_or(req("expert_feed_forward_length")?, |x| x as usize),
            _ => req("feed_forward_length")?,
        },
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        rms_norm_eps: md
            .get(&key("attention.layer_norm_rms_epsilon"))
            .and_then(as_f64)
            .unwrap_or(1e-6),
        rope_theta: md
            .get(&key("rope.freq_base"))
            .and_then(as_f64)
            .unwrap_or(10_000.0),
        // Llama 3's: `load_gguf` reads it from `rope_freqs.weight`.
        rope_scaling,
        max_position_embeddings: md
            .get(&key("context_length"))
            .and_then(as_u64)
            .map_or(4096, |x| x as usize),
        tie_word_embeddings: !has("output.weight"),
        attention_bias: match arch {
            Arch::Qwen2 => true,
            _ => has("blk.0.attn_q.bias"),
        },
        mlp_bias: has("blk.0.ffn_gate.bias") || has("blk.0.ffn_up.bias"),
        attention_out_bias: arch == Arch::SeedOss && has("blk.0.attn_output.bias"),
        use_qk_norm: false,
        mla: None,
        gemma4: None,
        linear_attention: None,
        short_conv: lfm2.map(|(_, c)| c),
        // llama.cpp's experts: in every layer, renormalised as its architecture fixes it.
        moe: match arch.moe() {
            true => Some(crate::config::MoeConfig {
                num_experts: experts,
                num_experts_per_tok: req("expert_used_count")?,
                moe_intermediate_size: match arch.experts_mlp_wide() {
                    true => req("feed_forward_length")?,
                    false => req("expert_feed_forward_length")?,
                },
                norm_topk_prob: llama_cpp_renormalises(arch),
                decoder_sparse_step: 1,
                mlp_only_layers: Vec::new(),
                shared_expert_intermediate_size: match arch {
                    Arch::Qwen2Moe | Arch::Qwen3_5Moe => {
                        Some(req("expert_shared_feed_forward_length")?)
                    }
                    _ => None,
                },
                router_aux_loss_coef: arch.default_router_aux_loss_coef(),
                routing: crate::config::Routing::Softmax,
            }),
            false => None,
        },
        bos_token_id: md_u32(md, "tokenizer.ggml.bos_token_id"),
        eos_token_ids: md_u32(md, "tokenizer.ggml.eos_token_id")
            .into_iter()
            .collect(),
        pad_token_id: md_u32(md, "tokenizer.ggml.padding_token_id"),
        sequence_classification: false,
        token_classification: None,
        initializer_range: None,
        sliding_window,
        sliding_layers: match arch.gemma() {
            true => llama_cpp_sliding_layers(arch, num_hidden_layers),
            false => Vec::new(),
        },
        // llama.cpp's smollm3: RoPE skipped on every 4th layer.
        nope_layers: match arch {
            Arch::SmolLM3 => crate::config::nope_every(req("block_count")?, 4),
            _ => Vec::new(),
        },
        // llama.cpp fixes the activation per architecture (Arcee's ReLU² without gate).
        activation: match arch {
            a if a.gemma() => crate::config::Activation::GeluPytorchTanh,
            Arch::Arcee => crate::config::Activation::Relu2,
            _ => Default::default(),
        },
        query_pre_attn_scalar: arch.gemma().then(|| {
            llama_cpp_query_scalar(
                arch,
                num_hidden_layers,
                hidden_size,
                num_attention_heads,
                head_dim,
            )
        }),
        // Gemma 3's sliding layers rotate with a base of their own (llama.cpp's fixed 10000
        // where the file does not say).
        local_rope_theta: (arch == Arch::Gemma3)
            .then(|| float("rope.freq_base_swa").unwrap_or(10_000.0)),
        // Phi-3's and GLM-4's rotary dimensions (`rope.dimension_count`, fewer than a head's:
        // Phi-4-mini, GLM-4-0414's half).
        partial_rotary_factor: match (arch, md.get(&key("rope.dimension_count")).and_then(as_u64)) {
            (Arch::Phi3 | Arch::Glm4, Some(r)) if r as usize != head_dim => {
                Some(r as f64 / head_dim as f64)
            }
            _ => None,
        },
        attn_logit_softcapping: (arch == Arch::Gemma2)
            .then(|| float("attn_logit_softcapping").unwrap_or(50.0)),
        final_logit_softcapping: (arch == Arch::Gemma2)
            .then(|| float("final_logit_softcapping").unwrap_or(30.0)),
        granite: match arch {
            Arch::Granite | Arch::GraniteMoe => {
                let f = |k: &str| -> Result<f64> {
                    md.get(&key(k))
                        .and_then(as_f64)
                        .ok_or_else(|| err(format!("metadata `{}` is missing (Granite)", key(k))))
                };
                Some(crate::config::GraniteScalars {
                    embedding_multiplier: f("embedding_scale")?,
                    attention_multiplier: f("attention.scale")?,
                    residual_multiplier: f("residual_scale")?,
                    logits_scaling: f("logit_scale")?,
                })
            }
            _ => None,
        },
    };
    if arch.deepseek_moe() {
        deepseek_fields(content, &key, &mut cfg)?;
    }
    // LFM2-MoE's leading dense layers and sigmoid router with offsets (llama.cpp always
    // renormalises and reads no scale for it).
    if let Some(m) = cfg.moe.as_mut().filter(|_| arch == Arch::Lfm2Moe) {
        let lead = md
            .get(&key("leading_dense_block_count"))
            .and_then(as_u64)
            .unwrap_or(0) as usize;
        m.mlp_only_layers = (0..lead).collect();
        m.router_aux_loss_coef = 0.0;
        m.routing = crate::config::Routing::Sigmoid {
            routed_scaling_factor: 1.0,
            expert_bias: true,
        };
    }
    // Qwen3.5's linear layers; its rotary part (a quarter of a head in its releases).
    if arch.qwen3_5() {
        cfg.linear_attention = Some(qwen35::delta_config(md, arch_name, num_hidden_layers)?);
        cfg.partial_rotary_factor = Some(
            md.get(&key("rope.dimension_count"))
                .and_then(as_u64)
                .map_or(0.25, |r| r as f64 / head_dim as f64),
        );
    }
    cfg.validate()?;
    Ok(cfg)
}

/// llama.cpp's `expert_gating_func` values (`LLAMA_EXPERT_GATING_FUNC_TYPE_*`).
const GATING_SOFTMAX: u32 = 1;
const GATING_SIGMOID: u32 = 2;

/// Whether a `deepseek2` file's router is a sigmoid (DeepSeek-V3, Kimi K2, GLM-4.7-Flash) rather
/// than a softmax (DeepSeek-V2): its `expert_gating_func`, else llama.cpp's fallback for files
/// written before that key (GLM-4.7-Flash's 47 / 48 layers and 154,880 tokens: sigmoid; any
/// other: softmax).
fn deepseek2_sigmoid(content: &Content) -> Result<bool> {
    let md = &content.metadata;
    match md.get("deepseek2.expert_gating_func").and_then(as_u64) {
        Some(g) if g == GATING_SIGMOID as u64 => Ok(true),
        Some(g) if g == GATING_SOFTMAX as u64 => Ok(false),
        Some(g) => bail!(
            "metadata `deepseek2.expert_gating_func` = {g} is not supported (1: softmax, 2: sigmoid)"
        ),
        None => {
            let layers = md.get("deepseek2.block_count").and_then(as_u64);
            let vocab = content
                .tensor_infos
                .get("token_embd.weight")
                .and_then(|t| t.shape.dims().first().copied());
            Ok(matches!(layers, Some(47 | 48)) && vocab == Some(154_880))
        }
    }
}

/// A `deepseek2` file's RoPE scaling as llama.cpp computes it, in transformers' terms: YaRN
/// with `rope.scaling.yarn_log_multiplier` (its converter's `0.1 · mscale_all_dim`) scales the
/// scores by `mscale(factor, mscale_all_dim)²` and leaves cos and sin unscaled (llama.cpp's
/// deepseek2 takes `mscale` equal to `mscale_all_dim`), with its fixed betas 32 and 1. Without
/// the multiplier, or with linear scaling, llama.cpp scales the scores by a factor transformers
/// does not: refused.
fn deepseek2_rope(
    md: &HashMap<String, Value>,
    kind: &str,
    key: &dyn Fn(&str) -> String,
) -> Result<Option<RopeScaling>> {
    if kind != "yarn" {
        bail!(
            "metadata `{}` = {kind}: llama.cpp's deepseek2 with this RoPE scaling scales the attention scores as transformers does not (supported: none, yarn)",
            key("rope.scaling.type")
        );
    }
    let float = |k: &str| md.get(&key(k)).and_then(as_f64);
    let (factor, original) = yarn_lengths(md, key)?;
    let Some(log_mul) = float("rope.scaling.yarn_log_multiplier").filter(|m| *m != 0.0) else {
        bail!(
            "metadata `{}` is missing: llama.cpp's deepseek2 YaRN without it scales the scores by the RoPE factor's square, which transformers does not",
            key("rope.scaling.yarn_log_multiplier")
        );
    };
    Ok(Some(RopeScaling::Yarn(crate::config::YarnRopeScaling {
        factor,
        original_max_position_embeddings: original as usize,
        beta_fast: 32.0,
        beta_slow: 1.0,
        truncate: true,
        attention_factor: 1.0,
        // llama.cpp divides the converter's 0.1 back out (the f32 product's rounding taken off
        // at 6 significant digits).
        mscale_all_dim: format!("{:.5e}", log_mul / 0.1).parse().ok(),
        llama_4_scaling_beta: None,
    })))
}

/// A RoPE scaling's `rope.scaling.factor` (positive), or an error naming the key and `what`.
fn scaling_factor(
    md: &HashMap<String, Value>,
    key: &dyn Fn(&str) -> String,
    what: &str,
) -> Result<f64> {
    md.get(&key("rope.scaling.factor"))
        .and_then(as_f64)
        .filter(|f| *f > 0.0)
        .ok_or_else(|| {
            err(format!(
                "metadata `{}` is missing for {what}",
                key("rope.scaling.factor")
            ))
        })
}

/// YaRN's factor (`rope.scaling.factor`) and pre-training length
/// (`rope.scaling.original_context_length`, else the context length) of a GGUF file.
fn yarn_lengths(md: &HashMap<String, Value>, key: &dyn Fn(&str) -> String) -> Result<(f64, u64)> {
    let factor = scaling_factor(md, key, "YaRN")?;
    let original = md
        .get(&key("rope.scaling.original_context_length"))
        .or_else(|| md.get(&key("context_length")))
        .and_then(as_u64)
        .ok_or_else(|| {
            err(format!(
                "metadata `{}` is missing for YaRN",
                key("rope.scaling.original_context_length")
            ))
        })?;
    Ok((factor, original))
}

/// YaRN's `mscale(factor, m)` = `0.1 · m · ln(factor) + 1` (1 at factor ≤ 1), as transformers
/// and llama.cpp compute it.
fn yarn_mscale(factor: f64, m: f64) -> f64 {
    match factor <= 1.0 {
        true => 1.0,
        false => 0.1 * m * factor.ln() + 1.0,
    }
}

/// Ministral 3's YaRN as llama.cpp's `mistral3` reads it: the factor, the pre-training length,
/// its betas (`rope.scaling.yarn_beta_fast` / `_slow`, default 32 / 1), cos and sin times
/// `mscale(factor, 1) / mscale(factor, yarn_log_multiplier)` (its converter writes
/// `mscale_all_dim` there, unscaled; transformers' ratio with `mscale` 1), the scores' scale
/// unchanged, and the attention temperature `attention.temperature_scale` (transformers'
/// `llama_4_scaling_beta`) past the pre-training length.
fn mistral3_yarn(md: &HashMap<String, Value>, key: &dyn Fn(&str) -> String) -> Result<RopeScaling> {
    let float = |k: &str| md.get(&key(k)).and_then(as_f64);
    let (factor, original) = yarn_lengths(md, key)?;
    let all = float("rope.scaling.yarn_log_multiplier").filter(|m| *m != 0.0);
    let mscale = |m: f64| yarn_mscale(factor, m);
    Ok(RopeScaling::Yarn(crate::config::YarnRopeScaling {
        factor,
        original_max_position_embeddings: original as usize,
        beta_fast: float("rope.scaling.yarn_beta_fast").unwrap_or(32.0),
        beta_slow: float("rope.scaling.yarn_beta_slow").unwrap_or(1.0),
        truncate: true,
        attention_factor: mscale(1.0) / all.map_or(1.0, mscale),
        mscale_all_dim: all,
        llama_4_scaling_beta: Some(float("attention.temperature_scale").unwrap_or(0.0)),
    }))
}

/// YaRN's `{arch}.*` keys: the type, factor and pre-training length, and what each family's
/// llama.cpp graph reads beside them — DeepSeek's `yarn_log_multiplier` (0.1 · mscale_all_dim;
/// [`deepseek_exportable`] checked the rest), Ministral 3's betas, multiplier (mscale_all_dim)
/// and attention temperature ([`mistral3_yarn`]), nothing for the [`yarn_family`], which takes
/// transformers' defaults. A YaRN llama.cpp would compute otherwise is refused by name.
fn yarn_metadata(
    cfg: &ModelConfig,
    y: &crate::config::YarnRopeScaling,
    arch: &str,
    a: &dyn Fn(&str) -> String,
) -> Result<Vec<(String, Value)>> {
    let f = |x: f64| Value::F32(x as f32);
    let extra = if cfg.mla.is_some() {
        vec![(
            a("rope.scaling.yarn_log_multiplier"),
            f(0.1 * y.mscale_all_dim.unwrap_or(0.0)),
        )]
    } else if cfg.arch == Arch::Ministral3 {
        let m = |all: f64| yarn_mscale(y.factor, all);
        let theirs = m(1.0) / y.mscale_all_dim.map_or(1.0, m);
        if !y.truncate || (y.attention_factor - theirs).abs() >= 1e-9 {
            bail!(
                "ministral3 with YaRN attention factor {} (mscale other than 1) or truncate {} has no GGUF form (llama.cpp's mistral3 takes mscale 1, truncated): export it as safetensors",
                y.attention_factor,
                y.truncate
            );
        }
        vec![
            (a("rope.scaling.yarn_beta_fast"), f(y.beta_fast)),
            (a("rope.scaling.yarn_beta_slow"), f(y.beta_slow)),
            (
                a("rope.scaling.yarn_log_multiplier"),
                f(y.mscale_all_dim.unwrap_or(0.0)),
            ),
            (
                a("attention.temperature_scale"),
                f(y.llama_4_scaling_beta.unwrap_or(0.0)),
            ),
        ]
    } else if yarn_family(cfg.arch) {
        if y.mscale_all_dim.is_some()
            || (y.attention_factor - yarn_default_attention(y.factor)).abs() >= 1e-9
            || (y.beta_fast, y.beta_slow, y.truncate) != (32.0, 1.0, true)
        {
            bail!(
                "YaRN with attention factor {} (default {}), mscale_all_dim {:?}, betas {} / {}, truncate {} has no GGUF form (llama.cpp's {arch} takes the default factor, betas 32 / 1, truncated): export the model as safetensors",
                y.attention_factor,
                yarn_default_attention(y.factor),
                y.mscale_all_dim,
                y.beta_fast,
                y.beta_slow,
                y.truncate
            );
        }
        Vec::new()
    } else {
        bail!(
            "YaRN RoPE scaling is written to GGUF for llama, Mistral, Mixtral, the Qwens and DeepSeek's latent attention only (llama.cpp's YaRN of {} is not checked against transformers'): export the model as safetensors",
            cfg.arch.as_str()
        );
    };
    let mut md = vec![
        (a("rope.scaling.type"), Value::String("yarn".into())),
        (a("rope.scaling.factor"), f(y.factor)),
        (
            a("rope.scaling.original_context_length"),
            Value::U32(y.original_max_position_embeddings as u32),
        ),
    ];
    md.extend(extra);
    Ok(md)
}

/// The families whose llama.cpp graph applies YaRN as transformers does (its RoPE with the
/// YaRN ramp and `0.1 ln(factor) + 1` on cos and sin, the scores' scale unchanged): llama
/// (Mistral, Mixtral), the Qwens. (DeepSeek's latent attention: [`deepseek2_rope`].)
fn yarn_family(arch: Arch) -> bool {
    matches!(
        arch,
        Arch::Llama
            | Arch::Mistral
            | Arch::Mixtral
            | Arch::Qwen2
            | Arch::Qwen3
            | Arch::Qwen3Moe
            | Arch::Qwen2Moe
    )
}

/// YaRN as llama.cpp computes it for a [`yarn_family`]: the factor, the pre-training length
/// (`rope.scaling.original_context_length`, else the context length), betas 32 and 1 (it reads
/// none from the file), cos and sin times `0.1 ln(factor) + 1` — transformers' defaults.
/// A `yarn_log_multiplier` (DeepSeek's attention scaling) is refused.
fn generic_yarn(md: &HashMap<String, Value>, key: &dyn Fn(&str) -> String) -> Result<RopeScaling> {
    let float = |k: &str| md.get(&key(k)).and_then(as_f64);
    let (factor, original) = yarn_lengths(md, key)?;
    if float("rope.scaling.yarn_log_multiplier").is_some_and(|m| m != 0.0) {
        bail!(
            "metadata `{}`: YaRN with a log multiplier scales the attention as no transformers model of this family does (not supported)",
            key("rope.scaling.yarn_log_multiplier")
        );
    }
    Ok(RopeScaling::Yarn(crate::config::YarnRopeScaling {
        factor,
        original_max_position_embeddings: original as usize,
        beta_fast: 32.0,
        beta_slow: 1.0,
        truncate: true,
        attention_factor: yarn_default_attention(factor),
        mscale_all_dim: None,
        llama_4_scaling_beta: None,
    }))
}

/// transformers' default YaRN factor on cos and sin, `0.1 ln(factor) + 1` (1 at factor ≤ 1),
/// as llama.cpp's RoPE applies it.
fn yarn_default_attention(factor: f64) -> f64 {
    yarn_mscale(factor, 1.0)
}

/// The fields of DeepSeek's mixture of experts (`deepseek2`, `glm4moe`) and latent attention
/// (`deepseek2`) that the generic reading leaves out: the leading dense layers, the shared
/// experts' width, the router (sigmoid with groups and offsets, or DeepSeek-V2's softmax), the
/// latent's ranks and head widths (llama.cpp's `key_length` / `value_length` are the latent's,
/// `*_mla` a head's), GLM-4.5's q/k norms and partial rotary.
fn deepseek_fields(
    content: &Content,
    key: &dyn Fn(&str) -> String,
    cfg: &mut ModelConfig,
) -> Result<()> {
    let md = &content.metadata;
    let has = |name: &str| content.tensor_infos.contains_key(name);
    let int = |k: &str| md.get(&key(k)).and_then(as_u64).map(|x| x as usize);
    let req = |k: &str| int(k).ok_or_else(|| err(format!("metadata `{}` is missing", key(k))));
    let float = |k: &str| md.get(&key(k)).and_then(as_f64);
    let norm = md
        .get(&key("expert_weights_norm"))
        .and_then(as_bool)
        .unwrap_or(false);
    let scale = float("expert_weights_scale").unwrap_or(1.0);
    let (groups, used) = match (int("expert_group_count"), int("expert_group_used_count")) {
        (Some(g), Some(u)) if g > 1 => (g, u),
        _ => (1, 1),
    };
    let dense = int("leading_dense_block_count").unwrap_or(0);
    let shared = int("expert_shared_count").unwrap_or(0);
    let Some(moe) = cfg.moe.as_mut() else {
        bail!("metadata `{}` is missing", key("expert_count"));
    };
    moe.mlp_only_layers = (0..dense.min(cfg.num_hidden_layers)).collect();
    moe.shared_expert_intermediate_size =
        Some(shared * moe.moe_intermediate_size).filter(|w| *w > 0);
    moe.norm_topk_prob = norm;
    // transformers' DeepSeek families compute no load-balancing loss.
    moe.router_aux_loss_coef = 0.0;
    moe.routing = match cfg.arch {
        Arch::DeepseekV2 => {
            if groups > 1 {
                bail!(
                    "metadata `{}` = {groups} with a softmax router: llama.cpp chooses groups by their two best experts, DeepSeek-V2 by its best (not supported)",
                    key("expert_group_count")
                );
            }
            if norm {
                bail!(
                    "metadata `{}` = true with a softmax router: DeepSeek-V2 never renormalises the chosen experts' weights (not supported)",
                    key("expert_weights_norm")
                );
            }
            crate::config::Routing::Greedy {
                n_group: 1,
                topk_group: 1,
                routed_scaling_factor: scale,
                group_limited: false,
            }
        }
        _ => crate::config::Routing::SigmoidGroups {
            n_group: groups,
            topk_group: used,
            routed_scaling_factor: scale,
        },
    };
    if cfg.arch == Arch::Glm4Moe {
        cfg.use_qk_norm = has("blk.0.attn_q_norm.weight");
        cfg.partial_rotary_factor = int("rope.dimension_count")
            .filter(|r| *r != cfg.head_dim)
            .map(|r| r as f64 / cfg.head_dim as f64);
        return Ok(());
    }
    // The latent attention. Files from before llama.cpp's absorbed form hold `attn_kv_b` and
    // a head's widths as `key_length` / `value_length`.
    let rope = req("rope.dimension_count")?;
    let kv_lora_rank = req("attention.kv_lora_rank")?;
    let (head_dim, v_head_dim) = match has("blk.0.attn_kv_b.weight") {
        true => (req("attention.key_length")?, req("attention.value_length")?),
        false => (
            req("attention.key_length_mla")?,
            req("attention.value_length_mla")?,
        ),
    };
    if head_dim <= rope {
        bail!(
            "metadata: a head's key width {head_dim} must exceed `{}` = {rope}",
            key("rope.dimension_count")
        );
    }
    cfg.num_key_value_heads = cfg.num_attention_heads;
    cfg.head_dim = head_dim;
    cfg.mla = Some(crate::config::MlaConfig {
        q_lora_rank: match has("blk.0.attn_q_a.weight") {
            true => Some(req("attention.q_lora_rank")?),
            false => None,
        },
        kv_lora_rank,
        qk_nope_head_dim: head_dim - rope,
        qk_rope_head_dim: rope,
        v_head_dim,
        // llama.cpp's deepseek2 rotates adjacent pairs, as DeepSeek's checkpoints hold them.
        rope_interleave: true,
    });
    Ok(())
}

/// Llama 3 RoPE scaling recovered from llama.cpp's `rope_freqs.weight`: the factor by which
/// each of the `head_dim / 2` RoPE frequencies is divided (`convert_hf_to_gguf.py` writes
/// `1` for high frequencies, `factor` for low ones and a smooth blend between).
///
/// Every Llama 3.x release uses `low_freq_factor = 1`, `high_freq_factor = 4`; the factor is
/// the largest value and the original context length is solved from a blended frequency
/// (8192 when there is none). The result is checked to reproduce every factor of the file
/// (relative error 1e-3), else this fails rather than guess.
pub fn llama3_scaling_from_rope_freqs(
    factors: &[f32],
    rope_theta: f64,
    head_dim: usize,
) -> Result<Llama3RopeScaling> {
    let half = head_dim / 2;
    if factors.len() != half {
        bail!(
            "rope_freqs.weight has {} values, expected head_dim / 2 = {half}",
            factors.len()
        );
    }
    let factor = factors.iter().copied().fold(1f32, f32::max) as f64;
    let freq = |i: usize| 1.0 / rope_theta.powf(2.0 * i as f64 / head_dim as f64);
    let (low, high) = (1.0, 4.0);
    let mut old = 8192.0;
    if factor > 1.0 {
        let interior = factors
            .iter()
            .enumerate()
            .find(|(_, r)| (**r as f64) > 1.0 + 1e-4 && (**r as f64) < factor * (1.0 - 1e-4));
        if let Some((i, r)) = interior {
            // 1/r = (1 - s)/factor + s with s = (old / wavelen - low) / (high - low).
            let s = (1.0 / *r as f64 - 1.0 / factor) / (1.0 - 1.0 / factor);
            let wavelen = 2.0 * std::f64::consts::PI / freq(i);
            old = ((s * (high - low) + low) * wavelen).round();
        }
    }
    let scaling = Llama3RopeScaling {
        factor,
        low_freq_factor: low,
        high_freq_factor: high,
        original_max_position_embeddings: old as usize,
    };
    let want = rope_freqs(&scaling, rope_theta, head_dim);
    for (i, (r, w)) in factors.iter().zip(&want).enumerate() {
        let (r, w) = (*r as f64, *w as f64);
        if (r - w).abs() > 1e-3 * w {
            bail!(
                "rope_freqs.weight[{i}] = {r} does not fit Llama 3 RoPE scaling ({scaling:?} gives {w}): unsupported RoPE scaling"
            );
        }
    }
    Ok(scaling)
}

/// The transformers name of a llama.cpp tensor name in a file of `arch`, or `None` if it is not
/// one we know. Gemma's and OLMo 2's norms of the sublayers' outputs are llama.cpp's
/// `post_attention_norm` and `post_ffw_norm`; Gemma's MLP-input norm (`ffn_norm` elsewhere:
/// `post_attention_layernorm`) is its `pre_feedforward_layernorm`.
pub fn hf_tensor_name(gguf_name: &str, arch: Arch) -> Option<String> {
    let fixed = match gguf_name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(n) = fixed {
        return Some(n.to_string());
    }
    let rest = gguf_name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (module, suffix) = rest.rsplit_once('.')?;
    if suffix != "weight" && suffix != "bias" {
        return None;
    }
    // DeepSeek-V3's router offsets (a buffer in transformers).
    if (module, suffix) == ("exp_probs_b", "bias") {
        return Some(format!(
            "model.layers.{layer}.mlp.gate.e_score_correction_bias"
        ));
    }
    let hf = match module {
        "attn_norm" => "input_layernorm",
        // DeepSeek's latent attention (`attn_k_b` / `attn_v_b` are joined into `kv_b_proj`
        // by [`read_weights`]).
        "attn_q_a" => "self_attn.q_a_proj",
        "attn_q_a_norm" => "self_attn.q_a_layernorm",
        "attn_q_b" => "self_attn.q_b_proj",
        "attn_kv_a_mqa" => "self_attn.kv_a_proj_with_mqa",
        "attn_kv_a_norm" => "self_attn.kv_a_layernorm",
        "attn_kv_b" => "self_attn.kv_b_proj",
        "attn_qkv" => "self_attn.qkv_proj",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_norm" if arch.gemma() => "pre_feedforward_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "post_attention_norm" if output_norms(arch) => "post_attention_layernorm",
        "post_ffw_norm" if output_norms(arch) => "post_feedforward_layernorm",
        // GLM-4-0414's sublayer-output norms; Seed-OSS's MLP-input norm.
        "post_attention_norm" if arch == Arch::Glm4 => "post_self_attn_layernorm",
        "post_attention_norm" if matches!(arch, Arch::SeedOss | Arch::Glm4Moe) => {
            "post_attention_layernorm"
        }
        "post_ffw_norm" if arch == Arch::Glm4 => "post_mlp_layernorm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        // Mixtures of experts (Qwen's names; the loader renames Mixtral's and splits the
        // stacked experts).
        "ffn_gate_inp" => "mlp.gate",
        "ffn_gate_exps" => "mlp.experts.gate_proj",
        "ffn_up_exps" => "mlp.experts.up_proj",
        "ffn_down_exps" => "mlp.experts.down_proj",
        // DeepSeek's `n_shared_experts` as one MLP (`shared_experts`).
        "ffn_gate_shexp" if arch.deepseek_moe() => "mlp.shared_experts.gate_proj",
        "ffn_up_shexp" if arch.deepseek_moe() => "mlp.shared_experts.up_proj",
        "ffn_down_shexp" if arch.deepseek_moe() => "mlp.shared_experts.down_proj",
        "ffn_gate_shexp" => "mlp.shared_expert.gate_proj",
        "ffn_up_shexp" => "mlp.shared_expert.up_proj",
        "ffn_down_shexp" => "mlp.shared_expert.down_proj",
        "ffn_gate_inp_shexp" => "mlp.shared_expert_gate",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{suffix}"))
}

/// A layer tensor's llama.cpp name (`to_gguf`, after `blk.{i}.`) from transformers' (after
/// `model.layers.{i}.`), or back, by a family's `table` of (transformers', llama.cpp's) names;
/// `None` for a name the table does not hold.
fn layer_name_by(table: &[(&str, &str)], name: &str, to_gguf: bool) -> Option<String> {
    let (from, to) = match to_gguf {
        true => ("model.layers.", "blk."),
        false => ("blk.", "model.layers."),
    };
    let (layer, part) = name.strip_prefix(from)?.split_once('.')?;
    layer.parse::<usize>().ok()?;
    let (hf, g) = table
        .iter()
        .find(|(hf, g)| part == if to_gguf { *hf } else { *g })?;
    Some(format!("{to}{layer}.{}", if to_gguf { g } else { hf }))
}

/// Undoes llama.cpp's Q/K row permutation (`convert_hf_to_gguf.py`'s `LlamaModel.permute`).
///
/// llama.cpp views the rows of each head as `(2, head_dim / 2)` and stores them transposed,
/// `(head_dim / 2, 2)`, interleaving the two RoPE halves. Here the stored rows are viewed as
/// `(n_head, head_dim / 2, 2)` and swapped back. Works on a weight `(rows, cols)` or a bias
/// `(rows,)`; `n_head` is the number of heads of this projection (the KV heads for K).
pub fn unpermute_qk(t: &Tensor, n_head: usize) -> Result<Tensor> {
    swap_head_halves(t, n_head, true)
}

/// Views each head's rows as `(half, 2)` (`stored`, llama.cpp's layout) or `(2, half)` and
/// transposes them to the other layout.
fn swap_head_halves(t: &Tensor, n_head: usize, stored: bool) -> Result<Tensor> {
    let dims = t.dims().to_vec();
    let rows = dims.first().copied().unwrap_or(0);
    if n_head == 0 || !rows.is_multiple_of(2 * n_head) {
        bail!(
            "cannot (un-)permute {dims:?} for {n_head} heads: rows must be a multiple of 2 × heads"
        );
    }
    let half = rows / n_head / 2;
    let cols: usize = dims[1..].iter().product();
    let view = if stored {
        t.reshape((n_head, half, 2, cols))?
    } else {
        t.reshape((n_head, 2, half, cols))?
    };
    view.transpose(1, 2)?.contiguous()?.reshape(dims)
}

fn read_weights<R: Read + Seek>(
    content: &Content,
    reader: &mut R,
    cfg: &ModelConfig,
    dtype: DType,
    device: &Device,
) -> Result<WeightMap> {
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let mut out = WeightMap::new();
    // DeepSeek's routers and their offsets stay in f32, as transformers keeps them.
    let dtype_of = |hf: &str| match crate::moe::MoeNames::kept_in_f32(cfg.arch, hf) {
        true if dtype != DType::F64 => DType::F32,
        _ => dtype,
    };
    for name in names {
        if [ROPE_FREQS, ROPE_SHORT, ROPE_LONG].contains(&name.as_str()) {
            continue; // read into the config's RoPE scaling
        }
        if name.ends_with(".attn_k_b.weight") || name.ends_with(".attn_v_b.weight") {
            continue; // joined into `kv_b_proj` below
        }
        let layer = name
            .strip_prefix("blk.")
            .and_then(|r| r.split('.').next())
            .and_then(|i| i.parse::<usize>().ok());
        if layer.is_some_and(|i| i >= cfg.num_hidden_layers) {
            continue; // a next-token-prediction layer
        }
        let mut hf = match cfg.arch {
            Arch::Gemma4 => gemma4_tensor_name(name, false),
            a if a.qwen3_5() => qwen35::tensor_name(name, false, a),
            a if a.lfm2() => lfm2::tensor_name(name, false, a),
            a => hf_tensor_name(name, a),
        }
        .ok_or_else(|| err(format!("tensor `{name}` has no transformers name")))?;
        // Phi-3's and GLM-4's `ffn_up` holds gate and up (`gate_up_proj`).
        if (cfg.arch == Arch::Phi3 || cfg.arch.glm()) && hf.contains(".mlp.up_proj.") {
            hf = hf.replace(".mlp.up_proj.", ".mlp.gate_up_proj.");
        }
        let q = content
            .tensor(reader, name, &Device::Cpu)
            .map_err(|e| err(format!("tensor `{name}`: {e}")))?;
        let mut t = q.dequantize(&Device::Cpu)?;
        // An MoE layer's stacked experts, one tensor each (Mixtral under its own names).
        if let Some(m) = &cfg.moe {
            let names = crate::moe::MoeNames::of(cfg.arch);
            let layer = || -> Result<usize> {
                name.split('.')
                    .nth(1)
                    .and_then(|i| i.parse().ok())
                    .ok_or_else(|| err(format!("tensor `{name}`: no layer index")))
            };
            let part = ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]
                .iter()
                .position(|p| name.contains(&format!(".{p}.")));
            if let Some(j) = part {
                let (i, e) = (layer()?, m.num_experts);
                if t.rank() != 3 || t.dim(0)? != e {
                    bail!(
                        "tensor `{name}` has shape {:?}, expected {e} stacked experts",
                        t.dims()
                    );
                }
                for x in 0..e {
                    let n = names.expert(i, x)[j].clone();
                    out.insert(n, t.get(x)?.to_dtype(dtype)?.to_device(device)?);
                }
                continue;
            }
            if name.contains(".ffn_gate_inp.") {
                hf = names.router(layer()?);
            } else if name.contains(".ffn_gate_inp_shexp.") {
                t = t.reshape((1, t.elem_count()))?;
            }
        }
        // Gemma's norms scale by `1 + w`: llama.cpp's files hold `1 + w`, transformers' `w`.
        if cfg.arch.gemma() && name.ends_with("norm.weight") {
            t = t.affine(1.0, -1.0)?;
        }
        if let Some(d) = &cfg.linear_attention {
            t = qwen35::from_gguf(name, t, d).map_err(|e| err(format!("tensor `{name}`: {e}")))?;
        }
        if name.ends_with(".shortconv.conv.weight") {
            t = lfm2::conv(t, false)?;
        }
        if cfg.arch.llama_like() {
            if hf.contains(".self_attn.q_proj.") {
                t = unpermute_qk(&t, cfg.num_attention_heads)?;
            } else if hf.contains(".self_attn.k_proj.") {
                t = unpermute_qk(&t, cfg.num_key_value_heads)?;
            }
        }
        let dt = dtype_of(&hf);
        out.insert(hf, t.to_dtype(dt)?.to_device(device)?);
    }
    if let Some(m) = &cfg.mla {
        for i in 0..cfg.num_hidden_layers {
            let hf = format!("model.layers.{i}.self_attn.kv_b_proj.weight");
            if out.contains_key(&hf) {
                continue; // a file from before the split
            }
            let mut part = |p: &str| -> Result<Tensor> {
                let name = format!("blk.{i}.attn_{p}_b.weight");
                content
                    .tensor(reader, &name, &Device::Cpu)
                    .and_then(|q| q.dequantize(&Device::Cpu))
                    .map_err(|e| err(format!("tensor `{name}`: {e}")))
            };
            let kv_b = join_kv_b(&part("k")?, &part("v")?, m, cfg.num_attention_heads)?;
            out.insert(hf, kv_b.to_dtype(dtype)?.to_device(device)?);
        }
    }
    // A sigmoid router's offsets, zero where the file has none (llama.cpp's are optional).
    if let Some(m) = &cfg.moe
        && matches!(
            m.routing,
            crate::config::Routing::SigmoidGroups { .. }
                | crate::config::Routing::Sigmoid {
                    expert_bias: true,
                    ..
                }
        )
    {
        let names = crate::moe::MoeNames::of(cfg.arch);
        for i in (0..cfg.num_hidden_layers).filter(|i| m.sparse(*i)) {
            let hf = names.correction_bias(i);
            let dt = dtype_of(&hf);
            if let std::collections::hash_map::Entry::Vacant(e) = out.entry(hf) {
                e.insert(Tensor::zeros(m.num_experts, dt, device)?);
            }
        }
    }
    Ok(out)
}

/// `kv_b_proj` `(heads · (nope + v), kv_lora_rank)` from llama.cpp's `attn_k_b`
/// `(heads, kv_lora_rank, nope)` (each head's key rows transposed) and `attn_v_b`
/// `(heads, v, kv_lora_rank)`: each head's key rows, then its value rows.
pub fn join_kv_b(
    k_b: &Tensor,
    v_b: &Tensor,
    m: &crate::config::MlaConfig,
    heads: usize,
) -> Result<Tensor> {
    let (r, nope, v) = (m.kv_lora_rank, m.qk_nope_head_dim, m.v_head_dim);
    if k_b.dims() != [heads, r, nope] || v_b.dims() != [heads, v, r] {
        bail!(
            "attn_k_b {:?} / attn_v_b {:?}: expected {:?} and {:?} ({heads} heads, kv_lora_rank {r}, nope {nope}, v {v})",
            k_b.dims(),
            v_b.dims(),
            [heads, r, nope],
            [heads, v, r]
        );
    }
    Tensor::cat(&[&k_b.transpose(1, 2)?, v_b], 1)?.reshape((heads * (nope + v), r))
}

/// llama.cpp's `attn_k_b` and `attn_v_b` of a `kv_b_proj` weight (the inverse of [`join_kv_b`]).
pub fn split_kv_b(
    kv_b: &Tensor,
    m: &crate::config::MlaConfig,
    heads: usize,
) -> Result<(Tensor, Tensor)> {
    let (r, nope, v) = (m.kv_lora_rank, m.qk_nope_head_dim, m.v_head_dim);
    let t = kv_b.reshape((heads, nope + v, r))?;
    Ok((
        t.narrow(1, 0, nope)?.transpose(1, 2)?.contiguous()?,
        t.narrow(1, nope, v)?.contiguous()?,
    ))
}

/// GPT-2's reversible map from bytes to printable characters, in which byte-level BPE
/// vocabularies are spelled (`Ġ` is the space).
fn byte_alphabet() -> [char; 256] {
    let mut table = ['\0'; 256];
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut next = 256u32;
    for b in 0..256u32 {
        let c = if printable(b) {
            b
        } else {
            let c = next;
            next += 1;
            c
        };
        table[b as usize] = char::from_u32(c).unwrap_or('\0');
    }
    table
}

const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen3.5's: Qwen2's with combining marks (`\p{M}`) inside words.
const QWEN35_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The pre-tokenizer for llama.cpp's `tokenizer.ggml.pre`, as in the model's own
/// `tokenizer.json` (and llama.cpp's `llama-vocab.cpp`); plus whether to NFC-normalise first.
fn pre_tokenizer(pre: &str) -> Result<(PreTokenizerWrapper, bool)> {
    let byte_level =
        |use_regex: bool| PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, use_regex));
    let split = |re: &str| -> Result<PreTokenizerWrapper> {
        let s = Split::new(
            SplitPattern::Regex(re.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| err(format!("pre-tokenizer regex: {e}")))?;
        Ok(PreTokenizerWrapper::Split(s))
    };
    Ok(match pre {
        "default" | "gpt-2" | "gpt2" => (byte_level(true), false),
        // SmolLM / SmolLM2: digits one by one, then GPT-2's split.
        "smollm" => (
            PreTokenizerWrapper::Sequence(Sequence::new(vec![
                PreTokenizerWrapper::Digits(Digits::new(true)),
                byte_level(true),
            ])),
            false,
        ),
        // (LFM2's, Pixtral's and Falcon-H1's too, as llama.cpp reads them.)
        "llama3" | "llama-v3" | "llama-bpe" | "smaug-bpe" | "falcon3" | "dbrx" | "lfm2"
        | "pixtral" | "falcon-h1" => (
            PreTokenizerWrapper::Sequence(Sequence::new(vec![
                split(LLAMA3_SPLIT)?,
                byte_level(false),
            ])),
            false,
        ),
        "qwen2" | "deepseek-r1-qwen" => (
            PreTokenizerWrapper::Sequence(Sequence::new(vec![
                split(QWEN2_SPLIT)?,
                byte_level(false),
            ])),
            true,
        ),
        "qwen35" => (
            PreTokenizerWrapper::Sequence(Sequence::new(vec![
                split(QWEN35_SPLIT)?,
                byte_level(false),
            ])),
            true,
        ),
        other => bail!(
            "tokenizer.ggml.pre `{other}` is not supported (supported: default, gpt2, smollm, llama-bpe/llama3/lfm2, qwen2, qwen35)"
        ),
    })
}

/// Whether llama.cpp tokenises with `ignore_merges` under the pre-tokenizer `pre` (its Llama 3
/// group).
fn ignores_merges(pre: &str) -> bool {
    matches!(
        pre,
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "lfm2" | "pixtral" | "falcon-h1"
    )
}

fn string_list<'a>(md: &'a HashMap<String, Value>, key: &str) -> Result<Vec<&'a str>> {
    let v = md
        .get(key)
        .ok_or_else(|| err(format!("metadata `{key}` is missing")))?;
    let Value::Array(items) = v else {
        bail!("metadata `{key}` is not an array")
    };
    items
        .iter()
        .map(|x| as_str(x).ok_or_else(|| err(format!("metadata `{key}` holds a non-string"))))
        .collect()
}

/// The byte-level BPE of a `gpt2` vocabulary: tokens (respelled into the byte alphabet where a
/// file spells one otherwise), merges, the pre-tokenizer `tokenizer.ggml.pre` names.
fn byte_level_tokenizer(
    md: &HashMap<String, Value>,
    tokens: &[&str],
    table: &[char],
    spelled: &dyn Fn(&str) -> bool,
) -> Result<tokenizers::Tokenizer> {
    let merges = string_list(md, "tokenizer.ggml.merges")?;
    // A token that is not spelled in the byte alphabet (a literal space, say) is respelled.
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let key = if spelled(t) {
                t.to_string()
            } else {
                t.bytes().map(|b| table[b as usize]).collect()
            };
            (key, i as u32)
        })
        .collect();
    let merges = merges
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| {
                    err(format!(
                        "merge `{m}` is not two tokens separated by a space"
                    ))
                })
        })
        .collect::<Result<Vec<_>>>()?;
    let pre = md
        .get("tokenizer.ggml.pre")
        .and_then(as_str)
        .unwrap_or("default");
    let (pre_tok, nfc) = pre_tokenizer(pre)?;
    // llama.cpp takes a piece that is a token whole, merges or not, for Llama 3's split (as
    // Llama 3's `tokenizer.json` does: `ignore_merges`).
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(ignores_merges(pre))
        .build()
        .map_err(|e| err(format!("BPE: {e}")))?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    inner.with_pre_tokenizer(Some(pre_tok));
    if nfc {
        inner.with_normalizer(Some(tokenizers::normalizers::NFC));
    }
    inner.with_decoder(Some(tokenizers::decoders::byte_level::ByteLevel::default()));
    Ok(inner)
}

/// A SentencePiece vocabulary (`tokenizer.ggml.model = llama`: Llama 2, Mistral, TinyLlama
/// files) as llama.cpp tokenises it: spaces are `▁`, one is put before the text and after each
/// special token (`tokenizer.ggml.add_space_prefix`, default on), the best-scoring adjacent
/// pair is merged first (BPE merges ranked by the score of the token they make, as
/// transformers derives them from a SentencePiece vocabulary), and characters outside the
/// vocabulary fall back to their `<0xXX>` byte tokens.
fn sentencepiece_tokenizer(
    md: &HashMap<String, Value>,
    tokens: &[&str],
    token_types: &[i64],
) -> Result<tokenizers::Tokenizer> {
    use tokenizers::decoders::{
        DecoderWrapper, byte_fallback::ByteFallback, fuse::Fuse, sequence::Sequence as Decoders,
        strip::Strip,
    };
    use tokenizers::normalizers::{Prepend, Replace, Sequence as Normalizers};
    let scores: Vec<f64> = match md.get("tokenizer.ggml.scores") {
        Some(Value::Array(a)) => a.iter().map(|x| as_f64(x).unwrap_or(0.0)).collect(),
        _ => bail!(
            "metadata `tokenizer.ggml.scores` is missing (a SentencePiece vocabulary needs it)"
        ),
    };
    if scores.len() != tokens.len() {
        bail!(
            "metadata `tokenizer.ggml.scores` has {} entries for {} tokens",
            scores.len(),
            tokens.len()
        );
    }
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.to_string(), i as u32))
        .collect();
    // Every split of a token into two tokens is a merge, ranked by the token's score (then
    // the longer left part first), each token's splits in vocabulary order.
    let mut merges: Vec<(f64, usize, usize, usize, usize)> = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        if token_types.get(i).is_some_and(|ty| *ty != 1) {
            continue; // only normal tokens are made by merging
        }
        let mut local = Vec::new();
        for (cut, _) in t.char_indices().skip(1) {
            let (l, r) = (&t[..cut], &t[cut..]);
            if let (Some(&a), Some(&b)) = (vocab.get(l), vocab.get(r)) {
                local.push((a as usize, b as usize, l.chars().count(), r.chars().count()));
            }
        }
        local.sort_by_key(|&(a, b, _, _)| (a, b));
        merges.extend(
            local
                .into_iter()
                .map(|(a, b, la, lb)| (scores[i], la, lb, a, b)),
        );
    }
    merges.sort_by(|x, y| y.0.total_cmp(&x.0).then(y.1.cmp(&x.1)).then(y.2.cmp(&x.2)));
    let merges: Vec<(String, String)> = merges
        .into_iter()
        .map(|(_, _, _, a, b)| (tokens[a].to_string(), tokens[b].to_string()))
        .collect();
    let unk = token_types
        .iter()
        .position(|ty| *ty == 2)
        .and_then(|i| tokens.get(i));
    let mut bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(u) = unk {
        bpe = bpe.unk_token(u.to_string());
    }
    let bpe = bpe.build().map_err(|e| err(format!("BPE: {e}")))?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    let prefix = md
        .get("tokenizer.ggml.add_space_prefix")
        .and_then(as_bool)
        .unwrap_or(true);
    // As normalizers, which run on each stretch of text between special tokens: llama.cpp puts
    // its space before every such stretch, even one that starts with a space (Metaspace's
    // prepend would not).
    let space = Replace::new(" ", "▁").map_err(|e| err(format!("normalizer: {e}")))?;
    let mut norms = vec![space.into()];
    if prefix {
        norms.insert(0, Prepend::new("▁".into()).into());
    }
    inner.with_normalizer(Some(Normalizers::new(norms)));
    let mut decoders: Vec<DecoderWrapper> = vec![
        Replace::new("▁", " ")
            .map_err(|e| err(format!("decoder: {e}")))?
            .into(),
        ByteFallback::default().into(),
        Fuse::default().into(),
    ];
    if prefix {
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    inner.with_decoder(Some(Decoders::new(decoders)));
    Ok(inner)
}

/// Builds the tokenizer (byte-level BPE, or a SentencePiece vocabulary; special tokens, chat
/// template) from GGUF metadata.
pub fn tokenizer_from_metadata(md: &HashMap<String, Value>) -> Result<Tokenizer> {
    let model = md
        .get("tokenizer.ggml.model")
        .and_then(as_str)
        .unwrap_or("");
    let sentencepiece = match model {
        "gpt2" => false,
        "llama" => true,
        other => bail!(
            "tokenizer.ggml.model `{other}` is not supported: byte-level BPE (`gpt2`) and SentencePiece (`llama`) vocabularies load from GGUF; use the Hugging Face directory"
        ),
    };
    let tokens = string_list(md, "tokenizer.ggml.tokens")?;
    let token_types: Vec<i64> = match md.get("tokenizer.ggml.token_type") {
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| match x {
                Value::I32(v) => *v as i64,
                other => as_u64(other).map_or(1, |v| v as i64),
            })
            .collect(),
        _ => Vec::new(),
    };
    let table = byte_alphabet();
    let alphabet: HashSet<char> = table.iter().copied().collect();
    // Byte-level tokens are spelled in the byte alphabet; a SentencePiece vocabulary as it is.
    let spelled = |t: &str| sentencepiece || t.chars().all(|c| alphabet.contains(&c));
    let mut inner = match sentencepiece {
        true => sentencepiece_tokenizer(md, &tokens, &token_types)?,
        false => byte_level_tokenizer(md, &tokens, &table, &spelled)?,
    };

    // Control tokens (type 3) are special; user-defined ones (type 4, like `<think>`) are matched
    // whole but not special. A control token not spelled in the byte alphabet is a llama.cpp
    // mislabel and is left out.
    let mut special = Vec::new();
    let mut user = Vec::new();
    for (t, ty) in tokens.iter().zip(&token_types) {
        match ty {
            3 if spelled(t) => {
                special.push(AddedToken::from(t.to_string(), true).normalized(false))
            }
            4 if spelled(t) => user.push(AddedToken::from(t.to_string(), false).normalized(false)),
            _ => {}
        }
    }
    inner.add_special_tokens(&special);
    inner.add_tokens(&user);

    let token_of = |key: &str| -> Option<(u32, String)> {
        let id = md_u32(md, key)?;
        tokens.get(id as usize).map(|t| (id, t.to_string()))
    };
    let bos = token_of("tokenizer.ggml.bos_token_id");
    let eos = token_of("tokenizer.ggml.eos_token_id");
    let flag = |k: &str, default: bool| md.get(k).and_then(as_bool).unwrap_or(default);
    // llama.cpp adds BOS to a SentencePiece vocabulary's text unless the file says otherwise.
    let (add_bos, add_eos) = (
        flag("tokenizer.ggml.add_bos_token", sentencepiece),
        flag("tokenizer.ggml.add_eos_token", false),
    );
    let with_bos = bos.as_ref().filter(|_| add_bos);
    let with_eos = eos.as_ref().filter(|_| add_eos);
    if with_bos.is_some() || with_eos.is_some() {
        let mut single = Vec::new();
        let mut pair = Vec::new();
        let mut specials = Vec::new();
        if let Some((id, t)) = with_bos {
            single.push(t.clone());
            pair.push(t.clone());
            specials.push((t.clone(), *id));
        }
        single.push("$A".to_string());
        pair.push("$A".to_string());
        if let Some((id, t)) = with_eos {
            single.push(t.clone());
            pair.push(t.clone());
            specials.push((t.clone(), *id));
        }
        if let Some((_, t)) = with_bos {
            pair.push(format!("{t}:1"));
        }
        pair.push("$B:1".to_string());
        if let Some((_, t)) = with_eos {
            pair.push(format!("{t}:1"));
        }
        let post = TemplateProcessing::builder()
            .try_single(single)
            .and_then(|b| b.try_pair(pair))
            .map_err(|e| err(format!("post-processor: {e}")))?
            .special_tokens(specials)
            .build()
            .map_err(|e| err(format!("post-processor: {e}")))?;
        inner.with_post_processor(Some(post));
    }

    let mut eos_token_ids: Vec<u32> = [
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ]
    .iter()
    .filter_map(|k| md_u32(md, k))
    .collect();
    eos_token_ids.sort_unstable();
    eos_token_ids.dedup();
    let pad_token_id = md_u32(md, "tokenizer.ggml.padding_token_id")
        .or_else(|| eos.as_ref().map(|(id, _)| *id))
        .unwrap_or(0);
    Ok(Tokenizer {
        inner,
        chat_template: md
            .get("tokenizer.chat_template")
            .and_then(as_str)
            .map(str::to_string),
        bos_token: bos.map(|(_, t)| t),
        eos_token: eos.map(|(_, t)| t),
        eos_token_ids,
        pad_token_id,
        chat_template_kwargs: serde_json::Map::new(),
    })
}

// ---------------------------------------------------------------------------------------------
// Writing.

/// Weight types of [`save_gguf`]: plain floats, or llama.cpp block quantisations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufType {
    /// 32-bit floats.
    F32,
    /// 16-bit floats.
    F16,
    /// bfloat16.
    BF16,
    /// 8-bit blocks of 32 (`Q8_0`).
    Q8_0,
    /// 4-bit blocks of 32 (`Q4_0`).
    Q4_0,
    /// 4-bit k-quant super-blocks of 256 (`Q4_K`).
    Q4K,
}

impl GgufType {
    /// Reads `f32`, `f16`, `bf16`, `q8_0`, `q4_0`, `q4_k`.
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "f32" => Self::F32,
            "f16" => Self::F16,
            "bf16" => Self::BF16,
            "q8_0" => Self::Q8_0,
            "q4_0" => Self::Q4_0,
            "q4_k" | "q4_k_m" | "q4_k_s" => Self::Q4K,
            o => bail!("unknown GGUF type `{o}`, expected f32, f16, bf16, q8_0, q4_0 or q4_k"),
        })
    }

    fn ggml(self) -> GgmlDType {
        match self {
            Self::F32 => GgmlDType::F32,
            Self::F16 => GgmlDType::F16,
            Self::BF16 => GgmlDType::BF16,
            Self::Q8_0 => GgmlDType::Q8_0,
            Self::Q4_0 => GgmlDType::Q4_0,
            Self::Q4K => GgmlDType::Q4K,
        }
    }

    /// llama.cpp's `general.file_type` (`LlamaFileType`).
    fn file_type(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q8_0 => 7,
            Self::Q4K => 14, // MOSTLY_Q4_K_S: every matrix Q4_K (or its fallback)
            Self::BF16 => 32,
        }
    }
}

/// Whether `arch`'s layers normalise each sublayer's output (Gemma's and OLMo 2's
/// `post_attention_layernorm` and `post_feedforward_layernorm`).
fn output_norms(arch: Arch) -> bool {
    arch.gemma() || arch == Arch::Olmo2
}

/// The llama.cpp name of a transformers tensor name of an `arch` model (the inverse of
/// [`hf_tensor_name`]).
pub fn gguf_tensor_name(hf: &str, arch: Arch) -> Option<String> {
    let fixed = match hf {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(n) = fixed {
        return Some(n.to_string());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (module, suffix) = rest.rsplit_once('.')?;
    if module == "mlp.gate" && suffix == "e_score_correction_bias" {
        return Some(format!("blk.{layer}.exp_probs_b.bias"));
    }
    let g = match module {
        "input_layernorm" => "attn_norm",
        "self_attn.q_a_proj" => "attn_q_a",
        "self_attn.q_a_layernorm" => "attn_q_a_norm",
        "self_attn.q_b_proj" => "attn_q_b",
        "self_attn.kv_a_proj_with_mqa" => "attn_kv_a_mqa",
        "self_attn.kv_a_layernorm" => "attn_kv_a_norm",
        // Written split, as `attn_k_b` and `attn_v_b` ([`split_kv_b`]).
        "self_attn.kv_b_proj" => "attn_kv_b",
        "self_attn.qkv_proj" => "attn_qkv",
        "mlp.gate_up_proj" => "ffn_up",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        // (Hunyuan's files name them so.)
        "self_attn.q_norm" | "self_attn.query_layernorm" => "attn_q_norm",
        "self_attn.k_norm" | "self_attn.key_layernorm" => "attn_k_norm",
        "post_attention_layernorm"
            if output_norms(arch) || matches!(arch, Arch::SeedOss | Arch::Glm4Moe) =>
        {
            "post_attention_norm"
        }
        "post_attention_layernorm" => "ffn_norm",
        "pre_feedforward_layernorm" if arch.gemma() => "ffn_norm",
        "post_feedforward_layernorm" if output_norms(arch) => "post_ffw_norm",
        "post_self_attn_layernorm" if arch == Arch::Glm4 => "post_attention_norm",
        "post_mlp_layernorm" if arch == Arch::Glm4 => "post_ffw_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        // Mixtures of experts: the router, the experts stacked ([`stack_experts`]), Qwen2-MoE's
        // shared expert and its gate.
        "mlp.gate" | "block_sparse_moe.gate" => "ffn_gate_inp",
        "mlp.experts.gate_proj"
        | "block_sparse_moe.experts.w1"
        | "block_sparse_moe.experts.gate_proj" => "ffn_gate_exps",
        "mlp.experts.up_proj"
        | "block_sparse_moe.experts.w3"
        | "block_sparse_moe.experts.up_proj" => "ffn_up_exps",
        "mlp.experts.down_proj"
        | "block_sparse_moe.experts.w2"
        | "block_sparse_moe.experts.down_proj" => "ffn_down_exps",
        "mlp.shared_expert.gate_proj" | "mlp.shared_experts.gate_proj" => "ffn_gate_shexp",
        "mlp.shared_expert.up_proj" | "mlp.shared_experts.up_proj" => "ffn_up_shexp",
        "mlp.shared_expert.down_proj" | "mlp.shared_experts.down_proj" => "ffn_down_shexp",
        "mlp.shared_expert_gate" => "ffn_gate_inp_shexp",
        _ => return None,
    };
    Some(format!("blk.{layer}.{g}.{suffix}"))
}

/// Whether llama.cpp renormalises the chosen experts' weights for an MoE architecture: fixed
/// per architecture (it reads no `expert_weights_norm` there), always for `qwen3moe` and
/// Mixtral's `llama`, never for `qwen2moe` and `olmoe`.
fn llama_cpp_renormalises(arch: Arch) -> bool {
    !matches!(arch, Arch::Qwen2Moe | Arch::Olmoe)
}

/// llama.cpp's sliding-window layers of Gemma, fixed by the architecture (its
/// `set_swa_pattern`): Gemma 2 every other layer from the first, Gemma 3 all but every 6th. As
/// [`ModelConfig::sliding_layers`] holds them: empty when every layer slides.
fn llama_cpp_sliding_layers(arch: Arch, layers: usize) -> Vec<usize> {
    let every = if arch == Arch::Gemma2 { 2 } else { 6 };
    let s: Vec<usize> = (0..layers)
        .filter(|i| !(i + 1).is_multiple_of(every))
        .collect();
    if s.len() == layers { Vec::new() } else { s }
}

/// The `query_pre_attn_scalar` llama.cpp's Gemma attention implies: it scales the queries by
/// `(hidden / heads)^-1/2` (integer division) for the 27B sizes it knows by their layer count
/// (Gemma 2's 46, Gemma 3's 62), by `head_dim^-1/2` otherwise; it reads no key for it.
fn llama_cpp_query_scalar(
    arch: Arch,
    layers: usize,
    hidden: usize,
    heads: usize,
    head_dim: usize,
) -> f64 {
    let big = if arch == Arch::Gemma2 { 46 } else { 62 };
    match layers == big {
        true => (hidden / heads.max(1)) as f64,
        false => head_dim as f64,
    }
}

/// What llama.cpp computes of a Gemma 2 / Gemma 3 model as transformers does, or an error
/// naming what it does not: its fixed sliding-window layers and attention scale
/// ([`llama_cpp_sliding_layers`], [`llama_cpp_query_scalar`]), GELU-tanh, Gemma 2's soft caps
/// (always applied) and tied embeddings (it has no `output.weight`), Gemma 3 without caps and
/// with its fixed local RoPE base of 10000.
fn gemma_exportable(cfg: &ModelConfig) -> Result<()> {
    let (name, llama) = match cfg.arch {
        Arch::Gemma2 => ("Gemma 2", "gemma2"),
        _ => ("Gemma 3", "gemma3"),
    };
    let n = cfg.num_hidden_layers;
    let pattern = llama_cpp_sliding_layers(cfg.arch, n);
    let slides = |i: usize| pattern.is_empty() || pattern.contains(&i);
    if cfg.sliding_window.is_none() || (0..n).any(|i| cfg.windowed(i) != slides(i)) {
        let ours: Vec<usize> = (0..n).filter(|i| cfg.windowed(*i)).collect();
        let theirs: Vec<usize> = (0..n).filter(|i| slides(*i)).collect();
        bail!(
            "{name} with sliding-window layers {ours:?} has no GGUF form (llama.cpp's {llama} slides on layers {theirs:?}): export it as safetensors"
        );
    }
    let scalar = cfg.query_pre_attn_scalar.unwrap_or(cfg.head_dim as f64);
    let theirs = llama_cpp_query_scalar(
        cfg.arch,
        n,
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.head_dim,
    );
    if (scalar - theirs).abs() > 1e-9 {
        bail!(
            "{name} with query_pre_attn_scalar = {scalar} has no GGUF form (llama.cpp's {llama} with {n} layers scales the queries by {theirs}^-1/2): export it as safetensors"
        );
    }
    if cfg.activation != crate::config::Activation::GeluPytorchTanh {
        bail!(
            "{name} with hidden_activation {:?} has no GGUF form (llama.cpp's {llama} uses gelu_pytorch_tanh): export it as safetensors",
            cfg.activation
        );
    }
    match cfg.arch {
        Arch::Gemma2 => {
            if cfg.attn_logit_softcapping.is_none() || cfg.final_logit_softcapping.is_none() {
                bail!(
                    "Gemma 2 without attn_logit_softcapping or final_logit_softcapping has no GGUF form (llama.cpp's gemma2 always caps both): export it as safetensors"
                );
            }
            if !cfg.tie_word_embeddings {
                bail!(
                    "Gemma 2 with tie_word_embeddings = false has no GGUF form (llama.cpp's gemma2 reads the embeddings as its output): export it as safetensors"
                );
            }
        }
        _ => {
            if let Some(c) = cfg.attn_logit_softcapping.or(cfg.final_logit_softcapping) {
                bail!(
                    "Gemma 3 with a soft cap ({c}) has no GGUF form (llama.cpp's gemma3 caps nothing): export it as safetensors"
                );
            }
            if cfg.local_rope_theta != Some(10_000.0) {
                bail!(
                    "Gemma 3 with rope_local_base_freq = {:?} has no GGUF form (llama.cpp's gemma3 fixes it at 10000): export it as safetensors",
                    cfg.local_rope_theta
                );
            }
        }
    }
    Ok(())
}

/// What llama.cpp computes of an MoE model ([`ModelConfig::moe`]) as transformers does, or an
/// error naming what it does not: experts in every layer, OLMoE without grouped-query heads,
/// and its fixed renormalisation of the chosen experts' weights
/// ([`llama_cpp_renormalises`]).
fn moe_exportable(cfg: &ModelConfig, m: &crate::config::MoeConfig) -> Result<()> {
    // DeepSeek's families: [`deepseek_exportable`]; LFM2-MoE's: `lfm2::exportable`.
    if cfg.arch.deepseek_moe() || cfg.arch == Arch::Lfm2Moe {
        return Ok(());
    }
    if !(0..cfg.num_hidden_layers).all(|i| m.sparse(i)) {
        bail!(
            "llama.cpp's {} has experts in every layer; this model's mlp_only_layers {:?} / decoder_sparse_step {} make some dense: export it as safetensors",
            cfg.arch.as_str(),
            m.mlp_only_layers,
            m.decoder_sparse_step
        );
    }
    // llama.cpp's olmoe normalises k over `hidden_size`: all heads, no grouped-query ones.
    if cfg.arch == Arch::Olmoe && cfg.num_key_value_heads != cfg.num_attention_heads {
        bail!(
            "llama.cpp's olmoe reads k_norm over all {} heads; this model has num_key_value_heads = {}: export it as safetensors",
            cfg.num_attention_heads,
            cfg.num_key_value_heads
        );
    }
    let llama_cpp_norm = llama_cpp_renormalises(cfg.arch);
    if m.norm_topk_prob != llama_cpp_norm {
        bail!(
            "llama.cpp's {} {} the chosen experts' weights; this model has norm_topk_prob = {}: export it as safetensors",
            cfg.arch.as_str(),
            if llama_cpp_norm {
                "renormalises"
            } else {
                "does not renormalise"
            },
            m.norm_topk_prob
        );
    }
    Ok(())
}

/// A tensor name [`save_gguf`] writes as it is (after this prefix): llama.cpp's own.
const GGUF_NAMED: &str = "gguf:";

/// What llama.cpp's `deepseek2` (DeepSeek-V2/V3, GLM-4.7-Flash) and `glm4moe` (GLM-4.5) compute
/// of a model as transformers does, or an error naming what they do not: dense layers only
/// before the first MoE one (`leading_dense_block_count`), shared experts (both graphs add
/// them unconditionally), no MLP biases; DeepSeek-V2's groups chosen by their best expert
/// (llama.cpp sums the best two); for the latent attention no biases on `q_a_proj`,
/// `kv_a_proj_with_mqa`, `o_proj` (`attention_bias`), RoPE unscaled or YaRN with
/// `mscale_all_dim` and cos/sin unscaled (llama.cpp takes `mscale` equal to it) and its fixed
/// betas 32 and 1, and not the layer counts at which llama.cpp takes a file for DeepSeek-V2-Lite
/// and reads no `q_lora_rank` (26, 27; 48 with 128,256 tokens).
fn deepseek_exportable(cfg: &ModelConfig) -> Result<()> {
    let name = cfg.arch.as_str();
    let Some(m) = &cfg.moe else {
        bail!("{name} without experts has no GGUF form here: export it as safetensors");
    };
    let dense: Vec<usize> = (0..cfg.num_hidden_layers)
        .filter(|i| !m.sparse(*i))
        .collect();
    if dense.iter().enumerate().any(|(j, i)| j != *i) {
        bail!(
            "{name} with dense layers {dense:?} has no GGUF form (llama.cpp makes only the first `leading_dense_block_count` layers dense): export it as safetensors"
        );
    }
    if m.shared_expert_intermediate_size
        .is_none_or(|s| !s.is_multiple_of(m.moe_intermediate_size))
    {
        bail!(
            "{name} without shared experts (n_shared_experts = 0) has no GGUF form (llama.cpp's graph always adds them): export it as safetensors"
        );
    }
    if cfg.mlp_bias {
        bail!(
            "{name} with mlp_bias has no GGUF form (llama.cpp's has no MLP biases): export it as safetensors"
        );
    }
    if let crate::config::Routing::Greedy {
        n_group,
        topk_group,
        group_limited: true,
        ..
    } = m.routing
        && n_group > 1
        && topk_group < n_group
    {
        bail!(
            "deepseek_v2 with topk_method = group_limited_greedy ({topk_group} of {n_group} groups) has no GGUF form (llama.cpp chooses groups by their two best experts' sum, DeepSeek-V2 by its best): export it as safetensors"
        );
    }
    let Some(mla) = &cfg.mla else {
        return Ok(());
    };
    if cfg.attention_bias {
        bail!(
            "{name} with attention_bias has no GGUF form (llama.cpp's deepseek2 has no biases on q_a_proj, kv_a_proj_with_mqa and o_proj): export it as safetensors"
        );
    }
    let n = cfg.num_hidden_layers;
    if mla.q_lora_rank.is_some() && (n == 26 || n == 27 || (n == 48 && cfg.vocab_size == 128_256)) {
        bail!(
            "{name} with {n} layers and q_lora_rank has no GGUF form (llama.cpp takes a deepseek2 file of {n} layers for DeepSeek-V2-Lite and reads no q_lora_rank): export it as safetensors"
        );
    }
    match &cfg.rope_scaling {
        None => Ok(()),
        Some(RopeScaling::Yarn(y))
            if y.mscale_all_dim.is_some()
                && (y.attention_factor - 1.0).abs() < 1e-9
                && (y.beta_fast, y.beta_slow, y.truncate) == (32.0, 1.0, true) =>
        {
            Ok(())
        }
        Some(RopeScaling::Yarn(y)) => bail!(
            "{name} with YaRN (attention factor {}, mscale_all_dim {:?}, betas {} / {}) has no GGUF form (llama.cpp's deepseek2 needs mscale_all_dim, mscale equal to it, betas 32 / 1): export it as safetensors",
            y.attention_factor,
            y.mscale_all_dim,
            y.beta_fast,
            y.beta_slow
        ),
        Some(s) => bail!(
            "{name} with RoPE scaling {s:?} has no GGUF form (llama.cpp's deepseek2 then scales the scores as transformers does not): export it as safetensors"
        ),
    }
}

/// The `{arch}.*` keys of DeepSeek's mixture of experts as llama.cpp reads them: the leading
/// dense layers, the shared experts' count, the router's function, scale, renormalisation and
/// groups (written only where they restrict the choice).
fn deepseek_moe_metadata(
    cfg: &ModelConfig,
    m: &crate::config::MoeConfig,
    shared: Option<usize>,
    a: &dyn Fn(&str) -> String,
) -> Vec<(String, Value)> {
    let u = |x: usize| Value::U32(x as u32);
    let dense = (0..cfg.num_hidden_layers)
        .take_while(|i| !m.sparse(*i))
        .count();
    let (gating, scale, groups) = match m.routing {
        crate::config::Routing::Greedy {
            routed_scaling_factor,
            ..
        } => (GATING_SOFTMAX, routed_scaling_factor, None),
        crate::config::Routing::SigmoidGroups {
            n_group,
            topk_group,
            routed_scaling_factor,
        } => (
            GATING_SIGMOID,
            routed_scaling_factor,
            (n_group > 1 && topk_group < n_group).then_some((n_group, topk_group)),
        ),
        crate::config::Routing::Softmax => (GATING_SOFTMAX, 1.0, None),
        crate::config::Routing::Sigmoid {
            routed_scaling_factor,
            ..
        } => (GATING_SIGMOID, routed_scaling_factor, None),
    };
    let mut md = vec![
        (a("leading_dense_block_count"), u(dense)),
        (
            a("expert_shared_count"),
            u(shared.unwrap_or(0) / m.moe_intermediate_size.max(1)),
        ),
        (a("expert_weights_scale"), Value::F32(scale as f32)),
        (a("expert_weights_norm"), Value::Bool(m.norm_topk_prob)),
        (a("expert_gating_func"), Value::U32(gating)),
    ];
    if let Some((g, used)) = groups {
        md.push((a("expert_group_count"), u(g)));
        md.push((a("expert_group_used_count"), u(used)));
    }
    md
}

/// A latent-attention model's tensors as llama.cpp's deepseek2 holds them: `kv_b_proj` split
/// into `attn_k_b` and `attn_v_b` ([`split_kv_b`]); without `rope_interleave` the rotated rows
/// of the queries and of the shared key reordered into the adjacent pairs llama.cpp rotates.
fn mla_tensors(
    cfg: &ModelConfig,
    m: &crate::config::MlaConfig,
    weights: Vec<(String, Tensor)>,
) -> Result<Vec<(String, Tensor)>> {
    let heads = cfg.num_attention_heads;
    let r = m.qk_rope_head_dim;
    // The last `r` rows of each of `n` blocks, from rotate-half pairs to adjacent ones.
    let pair = |t: &Tensor, n: usize| -> Result<Tensor> {
        if m.rope_interleave {
            return Ok(t.clone());
        }
        let rows = t.dim(0)? / n;
        let blocks = t.reshape((n, rows, ()))?;
        let rot = permute_qk(
            &blocks
                .narrow(1, rows - r, r)?
                .contiguous()?
                .reshape((n * r, ()))?,
            n,
        )?;
        Tensor::cat(
            &[&blocks.narrow(1, 0, rows - r)?, &rot.reshape((n, r, ()))?],
            1,
        )?
        .reshape(t.dims())
    };
    let mut out = Vec::with_capacity(weights.len() + cfg.num_hidden_layers);
    for (name, t) in weights {
        if let Some(layer) = name.strip_suffix(".self_attn.kv_b_proj.weight") {
            let i = layer.rsplit('.').next().unwrap_or("0");
            let (k, v) = split_kv_b(&t, m, heads)?;
            out.push((format!("{GGUF_NAMED}blk.{i}.attn_k_b.weight"), k));
            out.push((format!("{GGUF_NAMED}blk.{i}.attn_v_b.weight"), v));
        } else if name.ends_with(".self_attn.q_proj.weight")
            || name.ends_with(".self_attn.q_b_proj.weight")
        {
            out.push((name, pair(&t, heads)?));
        } else if name.ends_with(".self_attn.kv_a_proj_with_mqa.weight") {
            out.push((name, pair(&t, 1)?));
        } else {
            out.push((name, t));
        }
    }
    Ok(out)
}

/// An MoE model's tensors with each layer's experts stacked, `(experts, out, in)` under the
/// name without the expert index (`model.layers.3.mlp.experts.gate_proj.weight`), as llama.cpp's
/// `ffn_{gate,up,down}_exps` hold them; Qwen2-MoE's shared-expert gate `(1, hidden)` as the
/// vector llama.cpp reads. The others pass unchanged.
fn stack_experts(weights: Vec<(String, Tensor)>) -> Result<Vec<(String, Tensor)>> {
    // In order; a stack's place is its first expert's, filled when all are seen.
    let mut out: Vec<(String, Option<Tensor>)> = Vec::new();
    let mut stacks: HashMap<String, (usize, Vec<(usize, Tensor)>)> = HashMap::new();
    for (name, t) in weights {
        let expert = name.split_once(".experts.").and_then(|(head, rest)| {
            let (e, tail) = rest.split_once('.')?;
            Some((format!("{head}.experts.{tail}"), e.parse::<usize>().ok()?))
        });
        match expert {
            Some((stacked, e)) => {
                let slot = stacks.entry(stacked.clone()).or_insert_with(|| {
                    out.push((stacked, None));
                    (out.len() - 1, Vec::new())
                });
                slot.1.push((e, t));
            }
            None if name.ends_with(".mlp.shared_expert_gate.weight") => {
                out.push((name, Some(t.flatten_all()?)));
            }
            None => out.push((name, Some(t))),
        }
    }
    for (_, (at, mut parts)) in stacks {
        parts.sort_by_key(|(e, _)| *e);
        let ts: Vec<Tensor> = parts.into_iter().map(|(_, t)| t).collect();
        out[at].1 = Some(Tensor::stack(&ts, 0)?);
    }
    out.into_iter()
        .map(|(n, t)| {
            t.map(|t| (n, t))
                .ok_or_else(|| err("an empty expert stack"))
        })
        .collect()
}

/// llama.cpp's Q/K row permutation for its interleaved RoPE (`convert_hf_to_gguf.py`'s
/// `LlamaModel.permute`): each head's rows `(2, head_dim / 2)` stored as `(head_dim / 2, 2)`.
/// [`unpermute_qk`] undoes it.
pub fn permute_qk(t: &Tensor, n_head: usize) -> Result<Tensor> {
    swap_head_halves(t, n_head, false)
}

/// llama.cpp's `tokenizer.ggml.pre` for a tokenizer's pre-tokenizer, when it is one llama.cpp
/// implements the same way (GPT-2's byte-level split, SmolLM's digits + GPT-2, Llama 3's and
/// Qwen2's regex splits).
pub fn gguf_pre_tokenizer(tokenizer: &tokenizers::Tokenizer) -> Result<&'static str> {
    let v = serde_json::to_value(tokenizer.get_pre_tokenizer())
        .map_err(|e| err(format!("pre-tokenizer: {e}")))?;
    let byte_level = |x: &serde_json::Value, regex: bool| {
        x["type"] == "ByteLevel"
            && x["add_prefix_space"] != true
            && x["use_regex"].as_bool().unwrap_or(true) == regex
    };
    let items = match v["type"].as_str() {
        Some("Sequence") => v["pretokenizers"].as_array().cloned().unwrap_or_default(),
        _ => vec![v.clone()],
    };
    let name = match items.as_slice() {
        [b] if byte_level(b, true) => Some("gpt-2"),
        [d, b]
            if d["type"] == "Digits" && d["individual_digits"] == true && byte_level(b, true) =>
        {
            Some("smollm")
        }
        [s, b] if s["type"] == "Split" && byte_level(b, false) => {
            match s["pattern"]["Regex"].as_str() {
                Some(LLAMA3_SPLIT) => Some("llama-bpe"),
                Some(QWEN2_SPLIT) => Some("qwen2"),
                Some(QWEN35_SPLIT) => Some("qwen35"),
                _ => None,
            }
        }
        _ => None,
    };
    name.ok_or_else(|| {
        err(format!(
            "the tokenizer's pre-tokenizer has no llama.cpp equivalent (supported: GPT-2 byte-level, SmolLM, Llama 3, Qwen2, Qwen3.5, SentencePiece-style `▁` spaces with byte fallback): {}",
            v.to_string().chars().take(200).collect::<String>()
        ))
    })
}

/// Whether `tokenizer` is a SentencePiece-style BPE (byte fallback, spaces spelled `▁` by its
/// normalizer or a `Metaspace` pre-tokenizer: Llama 2, Mistral, Phi-3, TinyLlama), and then
/// whether it puts a `▁` before the text (llama.cpp's `add_space_prefix`).
pub fn sentencepiece_style(tokenizer: &tokenizers::Tokenizer) -> Option<bool> {
    let model = serde_json::to_value(tokenizer.get_model()).ok()?;
    if model["type"] != "BPE" || model["byte_fallback"] != true {
        return None;
    }
    let norm = serde_json::to_value(tokenizer.get_normalizer()).unwrap_or_default();
    let pre = serde_json::to_value(tokenizer.get_pre_tokenizer()).unwrap_or_default();
    let flat = |v: &serde_json::Value, key: &str| -> Vec<serde_json::Value> {
        match v[key].as_array() {
            Some(items) => items.clone(),
            None if v.is_null() => Vec::new(),
            None => vec![v.clone()],
        }
    };
    let norms = flat(&norm, "normalizers");
    let pres = flat(&pre, "pretokenizers");
    let replaces = norms
        .iter()
        .any(|n| n["type"] == "Replace" && n["content"] == "▁" && n["pattern"]["String"] == " ");
    let metaspace = pres.iter().find(|p| p["type"] == "Metaspace");
    if !replaces && metaspace.is_none() {
        return None;
    }
    let prepends = norms
        .iter()
        .any(|n| n["type"] == "Prepend" && n["prepend"] == "▁");
    let meta_prepends = metaspace.is_some_and(|m| {
        m["prepend_scheme"]
            .as_str()
            .map_or(m["add_prefix_space"] == true, |s| s != "never")
    });
    Some(prepends || meta_prepends)
}

/// SentencePiece scores for a BPE vocabulary: each token made by a merge scores minus the rank
/// of the first merge that makes it (llama.cpp merges the best-scored pair first, as BPE the
/// lowest-ranked), the others 0.
fn merge_scores(
    model: &serde_json::Value,
    id_of: &dyn Fn(&str) -> Option<u32>,
    n: usize,
) -> Vec<f32> {
    let mut scores = vec![0f32; n];
    let mut seen = vec![false; n];
    let merges = model["merges"].as_array().cloned().unwrap_or_default();
    for (rank, m) in merges.iter().enumerate() {
        let pair = match m {
            serde_json::Value::String(s) => s
                .split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string())),
            serde_json::Value::Array(p) => Some((
                p.first()
                    .and_then(|x| x.as_str())
                    .unwrap_or_default()
                    .to_string(),
                p.get(1)
                    .and_then(|x| x.as_str())
                    .unwrap_or_default()
                    .to_string(),
            )),
            _ => None,
        };
        let Some((a, b)) = pair else { continue };
        if let Some(id) = id_of(&format!("{a}{b}")).map(|i| i as usize)
            && id < n
            && !seen[id]
        {
            seen[id] = true;
            scores[id] = -(rank as f32) - 1.0;
        }
    }
    scores
}

/// The GGUF metadata of a tokenizer (`tokenizer.ggml.*`, `tokenizer.chat_template`) for a model
/// of `n_vocab` embedding rows (missing ids are filled with unused `[PAD{i}]` tokens).
fn tokenizer_metadata(tok: &Tokenizer, cfg: &ModelConfig) -> Result<Vec<(String, Value)>> {
    let inner = &tok.inner;
    let n_vocab = cfg.vocab_size;
    let vocab = inner.get_vocab(true);
    if let Some((t, id)) = vocab.iter().find(|(_, id)| **id as usize >= n_vocab) {
        bail!("token `{t}` has id {id}, outside the model's {n_vocab} embedding rows");
    }
    let mut tokens: Vec<Option<String>> = vec![None; n_vocab];
    for (t, id) in &vocab {
        tokens[*id as usize] = Some(t.clone());
    }
    let added = inner.get_added_tokens_decoder();
    let model = serde_json::to_value(inner.get_model())
        .map_err(|e| err(format!("tokenizer model: {e}")))?;
    let spm = sentencepiece_style(inner);
    let unk = model["unk_token"].as_str();
    // SentencePiece's byte tokens, `<0x00>` .. `<0xFF>`.
    let byte_token = |t: &str| {
        t.len() == 6
            && t.starts_with("<0x")
            && t.ends_with('>')
            && t[3..5].chars().all(|c| c.is_ascii_hexdigit())
    };
    let mut types = Vec::with_capacity(n_vocab);
    let tokens: Vec<Value> = tokens
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            let ty = match (&t, added.get(&(i as u32))) {
                (None, _) => 5,                                                   // unused
                (Some(_), Some(a)) if a.special => 3,                             // control
                (Some(_), Some(_)) => 4,                                          // user-defined
                (Some(t), None) if spm.is_some() && Some(t.as_str()) == unk => 2, // unknown
                (Some(t), None) if spm.is_some() && byte_token(t) => 6,           // byte
                _ => 1,                                                           // normal
            };
            types.push(Value::I32(ty));
            Value::String(t.unwrap_or_else(|| format!("[PAD{i}]")))
        })
        .collect();
    let mut md = match spm {
        Some(prefix) => sentencepiece_vocab(tok, &model, tokens, types, prefix),
        None => byte_level_vocab(tok, &model, tokens, types)?,
    };
    md.extend(special_token_metadata(tok, cfg));
    Ok(md)
}

/// The vocabulary keys of a byte-level BPE tokenizer: llama.cpp's `gpt2` model, its tokens,
/// types, merges and pre-tokenizer.
fn byte_level_vocab(
    tok: &Tokenizer,
    model: &serde_json::Value,
    tokens: Vec<Value>,
    types: Vec<Value>,
) -> Result<Vec<(String, Value)>> {
    let inner = &tok.inner;
    if model["type"] != "BPE" {
        bail!(
            "only BPE tokenizers (byte-level, or SentencePiece-style with byte fallback) can be written to GGUF (this one is {})",
            model["type"]
        );
    }
    let merges: Vec<Value> = model["merges"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|m| match m {
                    serde_json::Value::String(s) => Some(s.clone()),
                    serde_json::Value::Array(p) => {
                        Some(format!("{} {}", p.first()?.as_str()?, p.get(1)?.as_str()?))
                    }
                    _ => None,
                })
                .map(Value::String)
                .collect()
        })
        .unwrap_or_default();
    if merges.is_empty() {
        bail!("the tokenizer has no BPE merges (llama.cpp refuses an empty merge list)");
    }
    let pre = gguf_pre_tokenizer(inner)?;
    let s = |k: &str| format!("tokenizer.ggml.{k}");
    Ok(vec![
        (s("model"), Value::String("gpt2".into())),
        (s("pre"), Value::String(pre.into())),
        (s("tokens"), Value::Array(tokens)),
        (s("token_type"), Value::Array(types)),
        (s("merges"), Value::Array(merges)),
    ])
}

/// The vocabulary keys of a SentencePiece-style tokenizer: llama.cpp's `llama` model, the
/// tokens with scores from the merges' ranks ([`merge_scores`]) and their types (byte,
/// unknown, control), `add_space_prefix`, the unknown token; no merges, no pre-tokenizer.
fn sentencepiece_vocab(
    tok: &Tokenizer,
    model: &serde_json::Value,
    tokens: Vec<Value>,
    types: Vec<Value>,
    prefix: bool,
) -> Vec<(String, Value)> {
    let id_of = |t: &str| tok.inner.token_to_id(t);
    let scores = merge_scores(model, &id_of, tokens.len())
        .into_iter()
        .map(Value::F32)
        .collect();
    let s = |k: &str| format!("tokenizer.ggml.{k}");
    let mut md = vec![
        (s("model"), Value::String("llama".into())),
        (s("tokens"), Value::Array(tokens)),
        (s("scores"), Value::Array(scores)),
        (s("token_type"), Value::Array(types)),
        (s("add_space_prefix"), Value::Bool(prefix)),
    ];
    if let Some(u) = model["unk_token"].as_str().and_then(id_of) {
        md.push((s("unknown_token_id"), Value::U32(u)));
    }
    md
}

/// The keys of the special tokens, whatever the vocabulary: BOS / EOS / padding ids, whether
/// encoding adds BOS / EOS (seen from what the tokenizer does), and the chat template.
fn special_token_metadata(tok: &Tokenizer, cfg: &ModelConfig) -> Vec<(String, Value)> {
    let inner = &tok.inner;
    let id_of = |t: &Option<String>| t.as_deref().and_then(|t| inner.token_to_id(t));
    let bos = cfg.bos_token_id.or_else(|| id_of(&tok.bos_token));
    let eos = id_of(&tok.eos_token).or_else(|| tok.eos_token_ids.first().copied());
    let probe = |special: bool| {
        inner
            .encode("a", special)
            .map(|e| e.get_ids().to_vec())
            .unwrap_or_default()
    };
    let (with, without) = (probe(true), probe(false));
    let add_bos = bos.is_some() && with.len() > without.len() && with.first().copied() == bos;
    let add_eos = eos.is_some() && with.len() > without.len() && with.last().copied() == eos;
    let s = |k: &str| format!("tokenizer.ggml.{k}");
    let mut md = vec![
        (s("add_bos_token"), Value::Bool(add_bos)),
        (s("add_eos_token"), Value::Bool(add_eos)),
        (s("padding_token_id"), Value::U32(tok.pad_token_id)),
        // llama.cpp defaults missing BOS/EOS ids to 11: always write them (EOS stands in for
        // BOS).
        (s("bos_token_id"), Value::U32(bos.or(eos).unwrap_or(0))),
    ];
    if let Some(e) = eos {
        md.push((s("eos_token_id"), Value::U32(e)));
    }
    if let Some(t) = &tok.chat_template {
        md.push(("tokenizer.chat_template".into(), Value::String(t.clone())));
    }
    md
}

/// Llama 3 RoPE scaling as llama.cpp's `rope_freqs.weight`: the factor dividing each of the
/// `head_dim / 2` frequencies (what [`llama3_scaling_from_rope_freqs`] reads back).
pub fn rope_freqs(s: &Llama3RopeScaling, rope_theta: f64, head_dim: usize) -> Vec<f32> {
    let old = s.original_max_position_embeddings as f64;
    let (low_wavelen, high_wavelen) = (old / s.low_freq_factor, old / s.high_freq_factor);
    (0..head_dim / 2)
        .map(|i| {
            let freq = 1.0 / rope_theta.powf(2.0 * i as f64 / head_dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            let f = if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                s.factor
            } else {
                let sm =
                    (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
                1.0 / ((1.0 - sm) / s.factor + sm)
            };
            f as f32
        })
        .collect()
}

/// Writes `model` and `tokenizer` as a llama.cpp GGUF file: llama.cpp's tensor names and
/// `{arch}.*` metadata, llama's Q/K rows permuted for its RoPE, the tokenizer and chat template
/// in `tokenizer.*`, tied embeddings as a missing `output.weight` (OLMo 2's written, as llama.cpp
/// requires it), Gemma's norm weights as `1 + w`. Matrices get `ty`; norms,
/// biases and `rope_freqs` stay f32 (as llama.cpp needs). A matrix whose rows do not split into
/// `ty`'s blocks falls back as llama-quantize does (q4_k → q5_0 → f16; q8_0/q4_0 → f16). With
/// 4-bit types the embedding (and output) matrices are stored q8_0, as llama.cpp keeps them at
/// higher precision. Returns `(tensor name, type written)` per tensor.
pub fn save_gguf(
    model: &crate::model::Transformer,
    tokenizer: &Tokenizer,
    path: &Path,
    ty: GgufType,
    name: &str,
) -> Result<Vec<(String, String)>> {
    if model.score.is_some() {
        bail!(
            "{}: a sequence classifier (reward model) or token classifier (process reward model) has no GGUF form here; export it as a Hugging Face directory (--format hf)",
            path.display()
        );
    }
    let cfg = &model.cfg;
    if let Some(d) = &cfg.linear_attention {
        qwen35::exportable(cfg, d)?;
    }
    if let Some(c) = &cfg.short_conv {
        lfm2::exportable(cfg, c)?;
    }
    // llama.cpp's names: Mistral's layers are `llama` (which has no sliding window: within it
    // nothing differs); `smollm3` skips RoPE on every 4th layer, a step no key can change.
    // Mixtral's too (llama with experts).
    let arch = match cfg.arch {
        Arch::Mistral | Arch::Mixtral => "llama",
        Arch::Qwen3Moe => "qwen3moe",
        Arch::Qwen2Moe => "qwen2moe",
        Arch::Gemma3 => "gemma3",
        Arch::Glm4Moe => "glm4moe",
        Arch::Ministral3 => "mistral3",
        Arch::Gemma4 => "gemma4",
        // Its NTK alpha is in the base already (`rope.freq_base`), as llama.cpp's converter
        // writes it.
        Arch::HunyuanDense => "hunyuan-dense",
        Arch::Lfm2Moe => "lfm2moe",
        Arch::Qwen3_5 => "qwen35",
        Arch::Qwen3_5Moe => "qwen35moe",
        a if a.mla() => "deepseek2",
        a => a.as_str(),
    };
    if cfg.arch.gemma() {
        gemma_exportable(cfg)?;
    }
    if cfg.arch.deepseek_moe() {
        deepseek_exportable(cfg)?;
    }
    if cfg.gemma4.is_some() {
        gemma4_exportable(cfg)?;
    }
    if cfg.arch == Arch::HunyuanDense && (cfg.attention_bias || cfg.mlp_bias) {
        bail!(
            "Hunyuan with attention_bias or mlp_bias has no GGUF form (llama.cpp's hunyuan-dense has no biases): export it as safetensors"
        );
    }
    if cfg.arch == Arch::Exaone4 {
        bail!(
            "EXAONE 4 has no GGUF form here (llama.cpp's exaone4 is not checked against transformers'): export it as safetensors"
        );
    }
    if cfg.arch == Arch::Olmo3 {
        bail!(
            "OLMo 3 has no GGUF form here (its sliding layers and per-layer-type RoPE are not checked against llama.cpp's): export it as safetensors"
        );
    }
    if cfg.arch == Arch::Glm {
        bail!(
            "glm has no GGUF form here (llama.cpp's chatglm is not checked against transformers'; GLM-4-0414's glm4 is written): export it as safetensors"
        );
    }
    if cfg.arch == Arch::NanoChat {
        bail!(
            "nanochat has no GGUF form (llama.cpp has no architecture with its weightless norms, its norm of the embeddings and its q/k norms after RoPE): export it as safetensors"
        );
    }
    if cfg.arch == Arch::GptOss {
        bail!(
            "gpt-oss has no GGUF form here (llama.cpp's gpt-oss holds its experts as MXFP4 with its own tensor layout, which this writer does not produce): export it as safetensors"
        );
    }
    // llama.cpp's gemma and olmo2 graphs add no biases; its olmo2 reads a head as hidden / heads.
    if output_norms(cfg.arch) && (cfg.attention_bias || cfg.mlp_bias) {
        bail!(
            "{} with attention_bias or mlp_bias has no GGUF form (llama.cpp's has no biases there): export it as safetensors",
            cfg.arch.as_str()
        );
    }
    // llama.cpp fixes each architecture's activation: another one would run as that one.
    let fixed = match cfg.arch {
        Arch::Arcee => crate::config::Activation::Relu2,
        _ => crate::config::Activation::Silu,
    };
    if !cfg.arch.gemma() && cfg.arch != Arch::Gemma4 && cfg.activation != fixed {
        bail!(
            "{} with hidden_act {:?} has no GGUF form (llama.cpp's runs {fixed:?} there): export it as safetensors",
            cfg.arch.as_str(),
            cfg.activation
        );
    }
    if cfg.arch == Arch::Arcee && (cfg.attention_bias || cfg.mlp_bias) {
        bail!(
            "Arcee with attention_bias or mlp_bias has no GGUF form (llama.cpp's arcee has no biases): export it as safetensors"
        );
    }
    if cfg.arch == Arch::SeedOss && (cfg.attention_out_bias || cfg.mlp_bias) {
        bail!(
            "Seed-OSS with attention_out_bias or mlp_bias has no GGUF form (llama.cpp's seed_oss has no o_proj or MLP biases): export it as safetensors"
        );
    }
    if cfg.arch == Arch::Ernie45 && cfg.attention_bias {
        bail!(
            "ERNIE 4.5 with use_bias has no GGUF form (llama.cpp's ernie4_5 adds no o_proj or MLP biases): export it as safetensors"
        );
    }
    if cfg.arch == Arch::Olmo2 && cfg.num_attention_heads * cfg.head_dim != cfg.hidden_size {
        bail!(
            "OLMo 2 with {} heads × head_dim {} ≠ hidden_size {} has no GGUF form (llama.cpp's olmo2 needs them equal): export it as safetensors",
            cfg.num_attention_heads,
            cfg.head_dim,
            cfg.hidden_size
        );
    }
    if let Some(m) = &cfg.moe {
        moe_exportable(cfg, m)?;
    }
    // llama.cpp's phi3 reads q, k and v as views of one product at offsets of the hidden size.
    if cfg.arch == Arch::Phi3 && cfg.num_attention_heads * cfg.head_dim != cfg.hidden_size {
        bail!(
            "Phi-3 with {} heads × head_dim {} ≠ hidden_size {} has no GGUF form (llama.cpp's phi3 needs them equal): export it as safetensors",
            cfg.num_attention_heads,
            cfg.head_dim,
            cfg.hidden_size
        );
    }
    if cfg.arch == Arch::SmolLM3
        && cfg.nope_layers != crate::config::nope_every(cfg.num_hidden_layers, 4)
    {
        bail!(
            "SmolLM3 with NoPE layers {:?} has no GGUF form (llama.cpp's smollm3 skips RoPE on every 4th layer): export it as safetensors",
            cfg.nope_layers
        );
    }
    let a = |k: &str| format!("{arch}.{k}");
    let u = |x: usize| Value::U32(x as u32);
    // llama.cpp's deepseek2 attends as one shared head over the latent and the rotated key
    // (`key_length` / `value_length`); a head's own widths are the `*_mla` keys.
    let (kv_heads, key_length, value_length) = match &cfg.mla {
        Some(m) => (1, m.kv_lora_rank + m.qk_rope_head_dim, m.kv_lora_rank),
        None => (cfg.num_key_value_heads, cfg.head_dim, cfg.head_dim),
    };
    let mut md: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        ("general.type".into(), Value::String("model".into())),
        ("general.name".into(), Value::String(name.into())),
        ("general.file_type".into(), Value::U32(ty.file_type())),
        ("general.quantization_version".into(), Value::U32(2)),
        (a("context_length"), u(cfg.max_position_embeddings)),
        (a("embedding_length"), u(cfg.hidden_size)),
        (a("block_count"), u(cfg.num_hidden_layers)),
        (a("feed_forward_length"), u(cfg.intermediate_size)),
        (a("attention.head_count"), u(cfg.num_attention_heads)),
        (a("attention.head_count_kv"), u(kv_heads)),
        (a("attention.key_length"), u(key_length)),
        (a("attention.value_length"), u(value_length)),
        (a("rope.freq_base"), Value::F32(cfg.rope_theta as f32)),
        (
            a("attention.layer_norm_rms_epsilon"),
            Value::F32(cfg.rms_norm_eps as f32),
        ),
    ];
    match &cfg.rope_scaling {
        Some(RopeScaling::Linear { factor }) => {
            md.push((a("rope.scaling.type"), Value::String("linear".into())));
            md.push((a("rope.scaling.factor"), Value::F32(*factor as f32)));
        }
        // Phi-3's: the factors as tensors (below), llama.cpp's attention factor and
        // pre-training length as keys.
        Some(RopeScaling::LongRope(l)) if cfg.arch == Arch::Phi3 => {
            md.push((
                a("rope.scaling.attn_factor"),
                Value::F32(l.attention_factor as f32),
            ));
            md.push((
                a("rope.scaling.original_context_length"),
                u(l.original_max_position_embeddings),
            ));
        }
        Some(RopeScaling::LongRope(_)) => {
            bail!(
                "LongRoPE scaling is written to GGUF for phi3 only: export the model as safetensors"
            )
        }
        Some(RopeScaling::Yarn(y)) => md.extend(yarn_metadata(cfg, y, arch, &a)?),
        // Dynamic NTK changes nothing within the context length (llama.cpp has none);
        // Llama 3's goes in `rope_freqs.weight` below.
        Some(RopeScaling::Dynamic { .. } | RopeScaling::Llama3(_)) | None => {}
    }
    if cfg.arch.llama_like() {
        md.push((a("rope.dimension_count"), u(cfg.head_dim)));
        md.push((a("vocab_size"), u(cfg.vocab_size)));
    }
    // Granite's scalars under llama.cpp's names (its logit scale divides, as transformers').
    if let Some(g) = &cfg.granite {
        for (k, x) in [
            ("embedding_scale", g.embedding_multiplier),
            ("residual_scale", g.residual_multiplier),
            ("attention.scale", g.attention_multiplier),
            ("logit_scale", g.logits_scaling),
        ] {
            md.push((a(k), Value::F32(x as f32)));
        }
    }
    if let Some(m) = &cfg.moe {
        md.push((a("expert_count"), u(m.num_experts)));
        md.push((a("expert_used_count"), u(m.num_experts_per_tok)));
        if !cfg.arch.experts_mlp_wide() {
            md.push((a("expert_feed_forward_length"), u(m.moe_intermediate_size)));
        }
        match (cfg.arch.deepseek_moe(), m.shared_expert_intermediate_size) {
            (false, Some(s)) => md.push((a("expert_shared_feed_forward_length"), u(s))),
            (false, None) => {}
            (true, s) => md.extend(deepseek_moe_metadata(cfg, m, s, &a)),
        }
    }
    if let Some(m) = &cfg.mla {
        md.push((a("vocab_size"), u(cfg.vocab_size)));
        // 0 for one `q_proj` (DeepSeek-V2-Lite's): llama.cpp requires the key but at the layer
        // counts it takes for DeepSeek-V2-Lite.
        md.push((a("attention.q_lora_rank"), u(m.q_lora_rank.unwrap_or(0))));
        md.push((a("attention.kv_lora_rank"), u(m.kv_lora_rank)));
        md.push((
            a("attention.key_length_mla"),
            u(m.qk_nope_head_dim + m.qk_rope_head_dim),
        ));
        md.push((a("attention.value_length_mla"), u(m.v_head_dim)));
        md.push((a("rope.dimension_count"), u(m.qk_rope_head_dim)));
    }
    if cfg.arch == Arch::Glm4Moe {
        md.push((a("rope.dimension_count"), u(cfg.rotary_dim())));
    }
    // Gemma's window (its layers fixed by llama.cpp: [`gemma_exportable`]) and Gemma 2's caps.
    if cfg.arch.gemma() {
        md.push((
            a("attention.sliding_window"),
            u(cfg.sliding_window.unwrap_or(0)),
        ));
    }
    for (k, c) in [
        ("attn_logit_softcapping", cfg.attn_logit_softcapping),
        ("final_logit_softcapping", cfg.final_logit_softcapping),
    ] {
        if let Some(c) = c {
            md.push((a(k), Value::F32(c as f32)));
        }
    }
    if cfg.arch == Arch::Glm4 {
        // Partial rotary: the first `rotary_dim` of each head, adjacent pairs as transformers'
        // (the q/k rows in transformers' order, as llama.cpp's converter keeps them).
        md.push((a("rope.dimension_count"), u(cfg.rotary_dim())));
    }
    if cfg.arch == Arch::Phi3 {
        // Partial rotary: the first `rotary_dim` of each head (llama.cpp's NEOX pairs, as
        // transformers'); the window as its converter writes it (0: none).
        md.push((a("rope.dimension_count"), u(cfg.rotary_dim())));
        md.push((
            a("attention.sliding_window"),
            u(cfg.sliding_window.unwrap_or(0)),
        ));
    }
    if let Some(g) = &cfg.gemma4 {
        gemma4_metadata(cfg, g, &mut md);
    }
    if let Some(d) = &cfg.linear_attention {
        md.extend(qwen35::metadata(cfg, d, arch));
    }
    // (LFM2's per-layer key/value heads in place of the one count.)
    if let Some(c) = &cfg.short_conv {
        let kv = format!("{arch}.attention.head_count_kv");
        md.retain(|(k, _)| *k != kv);
        md.extend(lfm2::metadata(cfg, c, arch));
    }
    md.extend(tokenizer_metadata(tokenizer, cfg)?);

    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut written = Vec::new();
    let cpu = Device::Cpu;
    // The family's file layout (Phi-3's fused maps, q/k heads in transformers' order), an MoE
    // layer's experts stacked as llama.cpp holds them.
    // (Granite MoE's: the model's per-expert names, stacked below, not its fused files'.)
    let weights = match cfg.arch {
        Arch::GraniteMoe | Arch::Lfm2 | Arch::Lfm2Moe => model.weights(),
        _ => crate::layout::to_hf(cfg, model.weights())?,
    };
    let mut weights = match cfg.moe.is_some() {
        true => stack_experts(weights)?,
        false => weights,
    };
    // llama.cpp's olmo2 requires `output.weight`: tied embeddings written twice.
    if cfg.arch == Arch::Olmo2 && model.lm_head.is_none() {
        weights.push(("lm_head.weight".into(), model.embed_tokens.clone()));
    }
    let weights = match &cfg.mla {
        Some(m) => mla_tensors(cfg, m, weights)?,
        None => weights,
    };
    for (hf, t) in weights {
        let g = match (hf.strip_prefix(GGUF_NAMED), cfg.arch) {
            (Some(g), _) => Some(g.to_string()),
            (None, Arch::Gemma4) => gemma4_tensor_name(&hf, true),
            (None, a) if a.qwen3_5() => qwen35::tensor_name(&hf, true, a),
            (None, a) if a.lfm2() => lfm2::tensor_name(&hf, true, a),
            (None, a) => gguf_tensor_name(&hf, a),
        }
        .ok_or_else(|| err(format!("tensor `{hf}` has no llama.cpp name")))?;
        // A storage of its own: packed weights are views, and quantizing reads the storage whole.
        let mut t = t
            .detach()
            .to_device(&cpu)?
            .to_dtype(DType::F32)?
            .force_contiguous()?;
        // Gemma's `1 + w` norms as llama.cpp holds them (their `1 + w`).
        if cfg.arch.gemma() && g.ends_with("norm.weight") {
            t = t.affine(1.0, 1.0)?;
        }
        if let Some(d) = &cfg.linear_attention {
            t = qwen35::to_gguf(&g, t, d)?;
        }
        if g.ends_with(".shortconv.conv.weight") {
            t = lfm2::conv(t, true)?;
        }
        if cfg.arch.llama_like() {
            if g.contains(".attn_q.") {
                t = permute_qk(&t, cfg.num_attention_heads)?;
            } else if g.contains(".attn_k.") {
                t = permute_qk(&t, cfg.num_key_value_heads)?;
            }
        }
        // (Qwen3.5's convolution in f32, as llama.cpp's converter and its `ssm_conv` keep it;
        // the routers too, as llama.cpp's converter and llama-quantize keep them.)
        let want = if t.rank() < 2
            || g.ends_with(".ssm_conv1d.weight")
            || g.ends_with(".shortconv.conv.weight")
            || g.ends_with(".ffn_gate_inp.weight")
            || g.ends_with(".ffn_gate_inp_shexp.weight")
        {
            GgmlDType::F32
        } else if matches!(ty, GgufType::Q4_0 | GgufType::Q4K)
            && (g == "token_embd.weight" || g == "output.weight")
        {
            GgmlDType::Q8_0
        } else {
            ty.ggml()
        };
        let cols = t.dims().last().copied().unwrap_or(1);
        let fits = |d: GgmlDType| cols.is_multiple_of(d.block_size());
        let chosen = if fits(want) {
            want
        } else if want == GgmlDType::Q4K && fits(GgmlDType::Q5_0) {
            GgmlDType::Q5_0
        } else {
            GgmlDType::F16
        };
        let q = QTensor::quantize(&t, chosen).map_err(|e| err(format!("tensor `{g}`: {e}")))?;
        written.push((g.clone(), format!("{chosen:?}")));
        tensors.push((g, q));
    }
    if let Some(g) = &cfg.gemma4 {
        let f = gemma4_rope_freqs(g);
        let n = f.len();
        let t = Tensor::from_vec(f, n, &cpu)?;
        tensors.push((ROPE_FREQS.into(), QTensor::quantize(&t, GgmlDType::F32)?));
        written.push((ROPE_FREQS.into(), "F32".into()));
    } else if let (Arch::Llama | Arch::Mistral, Some(RopeScaling::Llama3(s))) =
        (cfg.arch, &cfg.rope_scaling)
    {
        let f = rope_freqs(s, cfg.rope_theta, cfg.head_dim);
        let n = f.len();
        let t = Tensor::from_vec(f, n, &cpu)?;
        tensors.push((
            "rope_freqs.weight".into(),
            QTensor::quantize(&t, GgmlDType::F32)?,
        ));
        written.push(("rope_freqs.weight".into(), "F32".into()));
    } else if let Some(RopeScaling::LongRope(l)) = &cfg.rope_scaling {
        for (name, f) in [(ROPE_LONG, &l.long_factor), (ROPE_SHORT, &l.short_factor)] {
            let f: Vec<f32> = f.iter().map(|x| *x as f32).collect();
            let n = f.len();
            let t = Tensor::from_vec(f, n, &cpu)?;
            tensors.push((name.into(), QTensor::quantize(&t, GgmlDType::F32)?));
            written.push((name.into(), "F32".into()));
        }
    } else if let Some(RopeScaling::Llama3(_)) = cfg.rope_scaling {
        bail!(
            "Llama 3 RoPE scaling is only written for the llama architecture (llama.cpp reads rope_freqs for llama only)"
        );
    }
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| err(format!("{}: {e}", dir.display())))?;
    }
    let mut f = std::io::BufWriter::new(
        File::create(path).map_err(|e| err(format!("{}: {e}", path.display())))?,
    );
    candle_core::quantized::gguf_file::write(&mut f, &md_refs, &t_refs)
        .map_err(|e| err(format!("{}: {e}", path.display())))?;
    std::io::Write::flush(&mut f).map_err(|e| err(format!("{}: {e}", path.display())))?;
    Ok(written)
}

/// Gemma 4's tensors: the transformers name (after `model.layers.{i}.` for a layer's; the
/// experts fused as the files hold them) and llama.cpp's (after `blk.{i}.`), as llama.cpp's
/// converter maps them.
const GEMMA4_TENSORS: [(&str, &str); 25] = [
    ("input_layernorm.weight", "attn_norm.weight"),
    ("self_attn.q_proj.weight", "attn_q.weight"),
    ("self_attn.k_proj.weight", "attn_k.weight"),
    ("self_attn.v_proj.weight", "attn_v.weight"),
    ("self_attn.o_proj.weight", "attn_output.weight"),
    ("self_attn.q_norm.weight", "attn_q_norm.weight"),
    ("self_attn.k_norm.weight", "attn_k_norm.weight"),
    (
        "post_attention_layernorm.weight",
        "post_attention_norm.weight",
    ),
    ("pre_feedforward_layernorm.weight", "ffn_norm.weight"),
    ("post_feedforward_layernorm.weight", "post_ffw_norm.weight"),
    ("mlp.gate_proj.weight", "ffn_gate.weight"),
    ("mlp.up_proj.weight", "ffn_up.weight"),
    ("mlp.down_proj.weight", "ffn_down.weight"),
    ("per_layer_input_gate.weight", "inp_gate.weight"),
    ("per_layer_projection.weight", "proj.weight"),
    ("post_per_layer_input_norm.weight", "post_norm.weight"),
    ("layer_scalar", "layer_output_scale.weight"),
    ("router.proj.weight", "ffn_gate_inp.weight"),
    ("router.scale", "ffn_gate_inp.scale"),
    ("router.per_expert_scale", "ffn_down_exps.scale"),
    ("experts.gate_up_proj", "ffn_gate_up_exps.weight"),
    ("experts.down_proj", "ffn_down_exps.weight"),
    (
        "post_feedforward_layernorm_1.weight",
        "post_ffw_norm_1.weight",
    ),
    (
        "pre_feedforward_layernorm_2.weight",
        "pre_ffw_norm_2.weight",
    ),
    (
        "post_feedforward_layernorm_2.weight",
        "post_ffw_norm_2.weight",
    ),
];

/// Gemma 4's model-level tensors: transformers' name, llama.cpp's.
const GEMMA4_GLOBAL: [(&str, &str); 6] = [
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
    (
        "model.embed_tokens_per_layer.weight",
        "per_layer_token_embd.weight",
    ),
    (
        "model.per_layer_model_projection.weight",
        "per_layer_model_proj.weight",
    ),
    (
        "model.per_layer_projection_norm.weight",
        "per_layer_proj_norm.weight",
    ),
];

/// llama.cpp's name of a Gemma 4 tensor (`to_gguf`) or transformers' of a llama.cpp one.
fn gemma4_tensor_name(name: &str, to_gguf: bool) -> Option<String> {
    let global = GEMMA4_GLOBAL
        .iter()
        .find(|(hf, g)| name == if to_gguf { *hf } else { *g });
    if let Some((hf, g)) = global {
        return Some(if to_gguf { g } else { hf }.to_string());
    }
    layer_name_by(&GEMMA4_TENSORS, name, to_gguf)
}

/// The layer llama.cpp's gemma4 reads a KV-sharing layer's keys and values from: the last
/// layer with its own if this one is full, the one before it if sliding (it holds the released
/// models' pattern).
fn llama_cpp_kv_source(cfg: &ModelConfig, i: usize) -> Option<usize> {
    let first = cfg.gemma4.as_ref()?.first_shared(cfg.num_hidden_layers);
    (i >= first).then(|| first.saturating_sub(if cfg.windowed(i) { 2 } else { 1 }))
}

/// What llama.cpp's gemma4 computes of a Gemma 4 model as transformers does, or an error naming
/// what it does not: biases, another activation, KV sharing its fixed pairing reads otherwise.
fn gemma4_exportable(cfg: &ModelConfig) -> Result<()> {
    if cfg.attention_bias || cfg.mlp_bias {
        bail!(
            "Gemma 4 with attention_bias has no GGUF form (llama.cpp's gemma4 adds no biases): export it as safetensors"
        );
    }
    if cfg.activation != crate::config::Activation::GeluPytorchTanh {
        bail!(
            "Gemma 4 with hidden_activation {:?} has no GGUF form (llama.cpp's gemma4 runs gelu_pytorch_tanh): export it as safetensors",
            cfg.activation
        );
    }
    for i in 0..cfg.num_hidden_layers {
        if cfg.kv_source(i) != llama_cpp_kv_source(cfg, i) {
            bail!(
                "Gemma 4 whose layer {i} reuses layer {:?}'s keys and values has no GGUF form (llama.cpp's gemma4 reads layer {:?}'s: the last layer with keys of its own for a full layer, the one before it for a sliding one): export it as safetensors",
                cfg.kv_source(i),
                llama_cpp_kv_source(cfg, i)
            );
        }
    }
    Ok(())
}

/// Gemma 4's metadata in place of the generic keys it overrides (per-layer MLP widths and
/// key/value heads, the full layers' head width and RoPE, the sliding ones' apart), as
/// llama.cpp's converter writes it.
fn gemma4_metadata(
    cfg: &ModelConfig,
    g: &crate::gemma4::Gemma4Config,
    md: &mut Vec<(String, Value)>,
) {
    let a = |k: &str| format!("gemma4.{k}");
    let u = |x: usize| Value::U32(x as u32);
    let n = cfg.num_hidden_layers;
    let overridden = [
        "feed_forward_length",
        "attention.head_count_kv",
        "attention.key_length",
        "attention.value_length",
        "rope.freq_base",
    ]
    .map(a);
    md.retain(|(k, _)| !overridden.contains(k));
    let widths: Vec<usize> = (0..n).map(|i| cfg.layer_intermediate(i)).collect();
    let ff = match widths.iter().all(|w| *w == cfg.intermediate_size) {
        true => u(cfg.intermediate_size),
        false => Value::Array(widths.into_iter().map(u).collect()),
    };
    let kv: Vec<Value> = (0..n).map(|i| u(cfg.layer_heads(i).0)).collect();
    let pattern: Vec<Value> = (0..n).map(|i| Value::Bool(cfg.windowed(i))).collect();
    md.extend([
        (a("feed_forward_length"), ff),
        (a("attention.head_count_kv"), Value::Array(kv)),
        (a("attention.key_length"), u(g.global_head_dim)),
        (a("attention.value_length"), u(g.global_head_dim)),
        (a("attention.key_length_swa"), u(cfg.head_dim)),
        (a("attention.value_length_swa"), u(cfg.head_dim)),
        (a("rope.dimension_count"), u(g.global_head_dim)),
        (a("rope.dimension_count_swa"), u(cfg.head_dim)),
        (a("rope.freq_base"), Value::F32(g.global_rope_theta as f32)),
        (a("rope.freq_base_swa"), Value::F32(cfg.rope_theta as f32)),
        (
            a("attention.sliding_window"),
            u(cfg.sliding_window.unwrap_or(0)),
        ),
        (a("attention.sliding_window_pattern"), Value::Array(pattern)),
        (a("attention.shared_kv_layers"), u(g.kv_shared_layers)),
        (
            a("embedding_length_per_layer_input"),
            u(g.per_layer_input.map_or(0, |(_, w)| w)),
        ),
    ]);
    if let Some(e) = &g.experts {
        md.extend([
            (a("expert_count"), u(e.num_experts)),
            (a("expert_used_count"), u(e.top_k)),
            (a("expert_feed_forward_length"), u(e.width)),
        ]);
    }
}

/// Gemma 4's `rope_freqs.weight` (the full layers' only): llama.cpp turns frequency `i` of a
/// full-width head by `1 / factor_i`, so the turning ones get the RoPE's divisor and the others
/// 1e30 (no turn), as its converter writes them for `proportional`.
fn gemma4_rope_freqs(g: &crate::gemma4::Gemma4Config) -> Vec<f32> {
    g.global_inv_freq()
        .iter()
        .map(|f| match *f == 0.0 {
            true => 1e30,
            false => g.global_rope_factor as f32,
        })
        .collect()
}

/// The share of each full-layer head's frequencies that turn and their divisor, from a
/// `rope_freqs.weight` of `gemma4_rope_freqs`'s form; an error naming it otherwise.
fn gemma4_rope_from_freqs(factors: &[f32], head_dim: usize) -> Result<(f64, f64)> {
    if factors.len() != head_dim / 2 {
        bail!(
            "rope_freqs.weight has {} values, expected the full layers' head width / 2 = {}",
            factors.len(),
            head_dim / 2
        );
    }
    let turning = factors.iter().take_while(|f| **f < 1e20).count();
    let factor = factors.first().copied().unwrap_or(1.0) as f64;
    if factors[..turning].iter().any(|f| *f as f64 != factor)
        || factors[turning..].iter().any(|f| *f < 1e20)
    {
        bail!(
            "rope_freqs.weight is not a proportional RoPE (equal factors, then 1e30): unsupported for gemma4"
        );
    }
    Ok((2.0 * turning as f64 / head_dim as f64, factor))
}

/// A Gemma 4 GGUF header as the `config.json` transformers writes for the same model, read by
/// [`ModelConfig::from_hf_json`]: llama.cpp's per-layer keys to transformers' fields (the full
/// layers' RoPE fraction and divisor come from `rope_freqs.weight`: [`load_gguf`]).
fn gemma4_config(content: &Content) -> Result<ModelConfig> {
    let md = &content.metadata;
    let key = |k: &str| format!("gemma4.{k}");
    let get = |k: &str| md.get(&key(k));
    let req = |k: &str| -> Result<usize> {
        get(k).and_then(as_u64).map(|x| x as usize).ok_or_else(|| {
            err(format!(
                "metadata `{}` is missing or not an integer",
                key(k)
            ))
        })
    };
    // A scalar, or one value per layer.
    let per_layer = |k: &str, n: usize| -> Result<Vec<usize>> {
        match get(k) {
            Some(Value::Array(a)) if a.len() == n => a
                .iter()
                .map(|x| {
                    as_u64(x)
                        .map(|x| x as usize)
                        .ok_or_else(|| err(format!("metadata `{}` holds a non-integer", key(k))))
                })
                .collect(),
            Some(Value::Array(a)) => bail!(
                "metadata `{}` has {} values for {n} layers",
                key(k),
                a.len()
            ),
            _ => Ok(vec![req(k)?; n]),
        }
    };
    let has = |name: &str| content.tensor_infos.contains_key(name);
    let n = req("block_count")?;
    let sliding: Vec<bool> = match get("attention.sliding_window_pattern") {
        Some(Value::Array(a)) if a.len() == n => {
            a.iter().map(|x| as_bool(x) == Some(true)).collect()
        }
        _ => bail!(
            "metadata `{}` is missing or not one bool per layer",
            key("attention.sliding_window_pattern")
        ),
    };
    let (Some(s), true) = (sliding.iter().position(|s| *s), sliding.contains(&false)) else {
        bail!(
            "metadata `{}`: Gemma 4 needs sliding and full layers",
            key("attention.sliding_window_pattern")
        );
    };
    let kv = per_layer("attention.head_count_kv", n)?;
    let ff = per_layer("feed_forward_length", n)?;
    let shared = get("attention.shared_kv_layers")
        .and_then(as_u64)
        .unwrap_or(0) as usize;
    let first_shared = n.saturating_sub(shared);
    let base_ff = ff.iter().copied().min().unwrap_or(0);
    let double_wide = ff
        .iter()
        .enumerate()
        .any(|(i, w)| i >= first_shared && *w == 2 * base_ff);
    let (vocab, hidden) = match content.tensor_infos.get("token_embd.weight") {
        Some(t) => match t.shape.dims() {
            [v, h] => (*v, *h),
            d => bail!("tensor `token_embd.weight` has shape {d:?}"),
        },
        None => bail!("tensor `token_embd.weight` is missing"),
    };
    let width = get("embedding_length_per_layer_input")
        .and_then(as_u64)
        .unwrap_or(0) as usize;
    let pl_vocab = content
        .tensor_infos
        .get("per_layer_token_embd.weight")
        .and_then(|t| t.shape.dims().first().copied())
        .unwrap_or(vocab);
    // A full layer with keys of its own tells whether its values are its keys.
    let own_full = (0..first_shared).find(|i| !sliding[*i]);
    let k_eq_v = own_full.is_some_and(|i| !has(&format!("blk.{i}.attn_v.weight")));
    let float = |k: &str| get(k).and_then(as_f64);
    let full_layers: Vec<usize> = (0..n).filter(|i| !sliding[*i]).collect();
    let global_head_dim = req("attention.key_length")?;
    let per_layer_config: serde_json::Map<String, serde_json::Value> = full_layers
        .iter()
        .map(|i| {
            (
                i.to_string(),
                serde_json::json!({"head_dim": global_head_dim, "num_key_value_heads": kv[*i]}),
            )
        })
        .collect();
    let types: Vec<&str> = sliding
        .iter()
        .map(|s| match s {
            true => "sliding_attention",
            false => "full_attention",
        })
        .collect();
    let experts = get("expert_count").and_then(as_u64).unwrap_or(0);
    let mut v = serde_json::json!({
        "model_type": "gemma4_text",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": base_ff,
        "num_hidden_layers": n,
        "num_attention_heads": req("attention.head_count")?,
        "num_key_value_heads": kv[s],
        "head_dim": req("attention.key_length_swa")?,
        "rms_norm_eps": float("attention.layer_norm_rms_epsilon").unwrap_or(1e-6),
        "max_position_embeddings": get("context_length").and_then(as_u64).unwrap_or(131_072),
        "tie_word_embeddings": !has("output.weight"),
        "sliding_window": req("attention.sliding_window")?,
        "layer_types": types,
        "per_layer_config": per_layer_config,
        "attention_k_eq_v": k_eq_v,
        "num_kv_shared_layers": shared,
        "hidden_size_per_layer_input": width,
        "vocab_size_per_layer_input": pl_vocab,
        "use_double_wide_mlp": double_wide,
        "final_logit_softcapping": float("final_logit_softcapping").filter(|c| *c != 0.0),
        "enable_moe_block": experts > 0,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": float("rope.freq_base_swa").unwrap_or(10_000.0)},
            // The fraction and divisor are read from `rope_freqs.weight`.
            "full_attention": {"rope_type": "default", "rope_theta": float("rope.freq_base").unwrap_or(1_000_000.0)},
        },
        "bos_token_id": md_u32(md, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": md_u32(md, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": md_u32(md, "tokenizer.ggml.padding_token_id"),
    });
    if experts > 0 {
        v["num_experts"] = experts.into();
        v["top_k_experts"] = req("expert_used_count")?.into();
        v["moe_intermediate_size"] = req("expert_feed_forward_length")?.into();
    }
    let cfg = ModelConfig::from_hf_json(&v)?;
    for i in 0..n {
        if cfg.kv_source(i) != llama_cpp_kv_source(&cfg, i) {
            bail!(
                "layer {i} of this gemma4 file reuses layer {:?}'s keys and values in llama.cpp, layer {:?}'s in transformers: unsupported",
                llama_cpp_kv_source(&cfg, i),
                cfg.kv_source(i)
            );
        }
    }
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

    /// The pieces' character spans.
    fn pieces(pre: &str, text: &str) -> Vec<(usize, usize)> {
        let (p, _) = pre_tokenizer(pre).unwrap();
        let mut s = PreTokenizedString::from(text);
        p.pre_tokenize(&mut s).unwrap();
        s.get_splits(OffsetReferential::Original, OffsetType::Char)
            .into_iter()
            .map(|(_, span, _)| span)
            .collect()
    }

    /// Qwen3.5's split keeps a letter's combining marks in its word (Qwen2's cuts them off), and
    /// a tokenizer with that split is written as `qwen35`.
    #[test]
    fn qwen35_pre_tokenizer_keeps_combining_marks_in_words() {
        let text = "cafe\u{301} ok";
        assert_eq!(pieces("qwen35", text), [(0, 5), (5, 8)]);
        assert_eq!(pieces("qwen2", text), [(0, 4), (4, 5), (5, 8)]);
        let (p, _) = pre_tokenizer("qwen35").unwrap();
        let mut t = tokenizers::Tokenizer::new(BPE::default());
        t.with_pre_tokenizer(Some(p));
        assert_eq!(gguf_pre_tokenizer(&t).unwrap(), "qwen35");
    }

    /// LFM2's GGUF files name Llama 3's split `lfm2` (llama.cpp reads it as Llama 3's).
    #[test]
    fn lfm2_pre_tokenizer_is_llama3s() {
        let text = "Hello world's 12345 numbers\n  and   spaces";
        assert_eq!(pieces("lfm2", text), pieces("llama-bpe", text));
    }

    /// Under Llama 3's split a piece that is a token is taken whole even where the merges
    /// cannot make it (llama.cpp's and Llama 3's `ignore_merges`); under GPT-2's the merges rule.
    #[test]
    fn llama3_split_takes_whole_tokens_past_the_merges() {
        let table = byte_alphabet();
        let spell = |t: &str| t.bytes().map(|b| table[b as usize]).collect::<String>();
        let mut tokens: Vec<String> = (0u8..=255).map(|b| table[b as usize].to_string()).collect();
        tokens.push(spell("ab"));
        tokens.push(spell("abc"));
        let list = |v: Vec<String>| Value::Array(v.into_iter().map(Value::String).collect());
        let ids = |pre: &str| {
            let md: HashMap<String, Value> = [
                ("tokenizer.ggml.model", Value::String("gpt2".into())),
                ("tokenizer.ggml.pre", Value::String(pre.into())),
                ("tokenizer.ggml.tokens", list(tokens.clone())),
                ("tokenizer.ggml.merges", list(vec!["a b".into()])),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
            let t = tokenizer_from_metadata(&md).unwrap();
            t.encode("abc", false).unwrap()
        };
        assert_eq!(ids("llama-bpe"), vec![257]);
        assert_eq!(ids("gpt2"), vec![256, 99]);
    }
}
