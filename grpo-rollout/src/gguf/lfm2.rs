//! LFM2 (`lfm2`) as llama.cpp's `lfm2` holds it, LFM2-MoE as its `lfm2moe` (the experts as the
//! other MoE families', the router's offsets `exp_probs_b`, `leading_dense_block_count`, a
//! sigmoid `expert_gating_func`): the convolution layers' maps under `shortconv.*` (the
//! convolution `(channels, kernel)`), the final norm as `token_embd_norm`,
//! `attention.head_count_kv` per layer (0: a convolution layer), `shortconv.l_cache`; no biases
//! on the convolutions (llama.cpp's graph has none).

use std::collections::HashMap;

use candle_core::quantized::gguf_file::Value;
use candle_core::{Result, Tensor, bail};

use super::{as_u64, err};
use crate::config::{Arch, ModelConfig, Routing};
use crate::shortconv::ShortConvConfig;

/// A layer's tensors whose names differ from the other families': the model's (after
/// `model.layers.{i}.`), llama.cpp's (after `blk.{i}.`).
const TENSORS: [(&str, &str); 3] = [
    ("conv.in_proj.weight", "shortconv.in_proj.weight"),
    ("conv.out_proj.weight", "shortconv.out_proj.weight"),
    ("conv.conv.weight", "shortconv.conv.weight"),
];

/// llama.cpp's name of a model tensor (`to_gguf`), or the model's of a llama.cpp one; the names
/// LFM2 shares with the other families as theirs.
pub(super) fn tensor_name(name: &str, to_gguf: bool, arch: Arch) -> Option<String> {
    match (name, to_gguf) {
        ("model.norm.weight", true) => return Some("token_embd_norm.weight".into()),
        ("token_embd_norm.weight", false) => return Some("model.norm.weight".into()),
        _ => {}
    }
    if let Some(n) = super::layer_name_by(&TENSORS, name, to_gguf) {
        return Some(n);
    }
    match to_gguf {
        true => super::gguf_tensor_name(name, arch),
        false => super::hf_tensor_name(name, arch),
    }
}

/// The key/value heads of the attention layers and the convolution layers (those with 0) from
/// `{arch}.attention.head_count_kv` (one count per layer, or one for all: no convolutions), and
/// the convolutions' shape.
pub(super) fn layers(
    md: &HashMap<String, Value>,
    arch: &str,
    layers: usize,
) -> Result<(usize, ShortConvConfig)> {
    let key = |k: &str| format!("{arch}.{k}");
    let counts: Vec<usize> = match md.get(&key("attention.head_count_kv")) {
        Some(Value::Array(a)) => a
            .iter()
            .take(layers)
            .map(|x| as_u64(x).map(|x| x as usize))
            .collect::<Option<_>>()
            .ok_or_else(|| {
                err(format!(
                    "metadata `{}` must list integers",
                    key("attention.head_count_kv")
                ))
            })?,
        Some(x) => vec![
            as_u64(x).ok_or_else(|| {
                err("metadata `lfm2.attention.head_count_kv` must be an integer or a list")
            })? as usize;
            layers
        ],
        None => bail!("metadata `lfm2.attention.head_count_kv` is missing"),
    };
    let kv: Vec<usize> = counts.iter().copied().filter(|c| *c > 0).collect();
    let Some(&heads) = kv.first() else {
        bail!(
            "metadata `{}`: no attention layer",
            key("attention.head_count_kv")
        );
    };
    if kv.iter().any(|c| *c != heads) {
        bail!(
            "metadata `{}` = {counts:?}: attention layers with different key/value heads are not supported",
            key("attention.head_count_kv")
        );
    }
    let kernel = md
        .get(&key("shortconv.l_cache"))
        .and_then(as_u64)
        .ok_or_else(|| {
            err(format!(
                "metadata `{}` is missing or not an integer",
                key("shortconv.l_cache")
            ))
        })? as usize;
    let conv = ShortConvConfig {
        layers: (0..layers).filter(|i| counts.get(*i) == Some(&0)).collect(),
        kernel,
        bias: false,
    };
    Ok((heads, conv))
}

/// What llama.cpp's `lfm2` computes as transformers does, or an error naming what it does not.
pub(super) fn exportable(cfg: &ModelConfig, c: &ShortConvConfig) -> Result<()> {
    if c.bias || cfg.attention_bias || cfg.mlp_bias {
        bail!(
            "LFM2 with conv_bias (or attention / MLP biases) has no GGUF form (llama.cpp's lfm2 adds no biases): export it as safetensors"
        );
    }
    if cfg.rope_scaling.is_some() {
        bail!(
            "LFM2 with RoPE scaling has no GGUF form here (llama.cpp's lfm2 is checked with the default RoPE only): export it as safetensors"
        );
    }
    // llama.cpp's lfm2moe: dense layers first, the chosen weights always renormalised, never
    // scaled, the offsets required.
    if let Some(m) = &cfg.moe {
        let lead = m.mlp_only_layers.len();
        if m.mlp_only_layers != (0..lead).collect::<Vec<_>>() {
            bail!(
                "LFM2-MoE with dense layers {:?} not first has no GGUF form (llama.cpp's lfm2moe reads leading_dense_block_count): export it as safetensors",
                m.mlp_only_layers
            );
        }
        let ok = matches!(
            m.routing,
            Routing::Sigmoid {
                routed_scaling_factor,
                expert_bias: true,
            } if routed_scaling_factor == 1.0
        );
        if !ok || !m.norm_topk_prob {
            bail!(
                "LFM2-MoE with routed_scaling_factor ≠ 1, norm_topk_prob = false or use_expert_bias = false has no GGUF form (llama.cpp's lfm2moe renormalises, reads no scale and requires the offsets): export it as safetensors"
            );
        }
    }
    Ok(())
}

/// The `{arch}.*` keys: the key/value heads per layer (0 on a convolution layer), the
/// convolution's taps, the vocabulary's size; LFM2-MoE's leading dense layers and sigmoid
/// gating.
pub(super) fn metadata(cfg: &ModelConfig, c: &ShortConvConfig, arch: &str) -> Vec<(String, Value)> {
    let kv = (0..cfg.num_hidden_layers)
        .map(|i| {
            Value::U32(match c.is_conv(i) {
                true => 0,
                false => cfg.num_key_value_heads as u32,
            })
        })
        .collect();
    let mut md = vec![
        ("attention.head_count_kv", Value::Array(kv)),
        ("shortconv.l_cache", Value::U32(c.kernel as u32)),
        ("vocab_size", Value::U32(cfg.vocab_size as u32)),
    ];
    if let Some(m) = &cfg.moe {
        let lead = m.mlp_only_layers.len() as u32;
        md.push(("leading_dense_block_count", Value::U32(lead)));
        md.push(("expert_gating_func", Value::U32(super::GATING_SIGMOID)));
    }
    md.into_iter()
        .map(|(k, v)| (format!("{arch}.{k}"), v))
        .collect()
}

/// The convolution `(channels, 1, kernel)` as llama.cpp holds it, `(channels, kernel)`
/// (`to_gguf`), or back.
pub(super) fn conv(t: Tensor, to_gguf: bool) -> Result<Tensor> {
    let (c, k) = (t.dim(0)?, t.dims().last().copied().unwrap_or(1));
    match to_gguf {
        true => t.reshape((c, k)),
        false => t.reshape((c, 1, k)),
    }
}
