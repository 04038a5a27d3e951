//! Qwen3.5 (`qwen3_5_text`) as llama.cpp's `qwen35` holds it, its mixture of experts
//! (`qwen3_5_moe_text`) as `qwen35moe` (the experts as the other MoE families'): the
//! linear-attention layers under its `ssm_*` names, `A` as `−exp(A_log)`, the convolution
//! `(channels, kernel)`, the value heads tiled rather than grouped by key head, the `1 + w` norms
//! as `1 + w` (the gated norm of the linear layers as its plain `w`); hyper-parameters under
//! `{arch}.ssm.*`.

use std::collections::HashMap;

use candle_core::quantized::gguf_file::Value;
use candle_core::{Result, Tensor, bail};

use super::{as_u64, err};
use crate::config::{Arch, ModelConfig};
use crate::delta::DeltaConfig;

/// A layer's tensors whose names differ from the other families': transformers' (after
/// `model.layers.{i}.`), llama.cpp's (after `blk.{i}.`).
const TENSORS: [(&str, &str); 10] = [
    ("linear_attn.in_proj_qkv.weight", "attn_qkv.weight"),
    ("linear_attn.in_proj_z.weight", "attn_gate.weight"),
    ("linear_attn.in_proj_b.weight", "ssm_beta.weight"),
    ("linear_attn.in_proj_a.weight", "ssm_alpha.weight"),
    ("linear_attn.A_log", "ssm_a"),
    ("linear_attn.dt_bias", "ssm_dt.bias"),
    ("linear_attn.conv1d.weight", "ssm_conv1d.weight"),
    ("linear_attn.norm.weight", "ssm_norm.weight"),
    ("linear_attn.out_proj.weight", "ssm_out.weight"),
    (
        "post_attention_layernorm.weight",
        "post_attention_norm.weight",
    ),
];

/// llama.cpp's name of a transformers tensor (`to_gguf`), or transformers' of a llama.cpp one;
/// the names Qwen3.5 (`arch`) shares with the other families as theirs.
pub(super) fn tensor_name(name: &str, to_gguf: bool, arch: Arch) -> Option<String> {
    if let Some(n) = super::layer_name_by(&TENSORS, name, to_gguf) {
        return Some(n);
    }
    match to_gguf {
        true => super::gguf_tensor_name(name, arch),
        false => super::hf_tensor_name(name, arch),
    }
}

/// The linear-attention fields from `{arch}.ssm.*` and `{arch}.attention.recurrent_layers` (else
/// `full_attention_interval`, llama.cpp's fallback), for the model's first `layers` layers.
pub(super) fn delta_config(
    md: &HashMap<String, Value>,
    arch: &str,
    layers: usize,
) -> Result<DeltaConfig> {
    let req = |k: &str| -> Result<usize> {
        md.get(&format!("{arch}.{k}"))
            .and_then(as_u64)
            .filter(|x| *x > 0)
            .map(|x| x as usize)
            .ok_or_else(|| {
                err(format!(
                    "metadata `{arch}.{k}` is missing or not a positive integer"
                ))
            })
    };
    let value_heads = req("ssm.time_step_rank")?;
    let inner = req("ssm.inner_size")?;
    if !inner.is_multiple_of(value_heads) {
        bail!(
            "metadata `{arch}.ssm.inner_size` = {inner} is not a multiple of `{arch}.ssm.time_step_rank` = {value_heads}"
        );
    }
    let linear = match md.get(&format!("{arch}.attention.recurrent_layers")) {
        Some(Value::Array(a)) => {
            if a.len() < layers {
                bail!(
                    "metadata `{arch}.attention.recurrent_layers` has {} entries, the model {layers} layers",
                    a.len()
                );
            }
            let mut out = Vec::new();
            for (i, x) in a.iter().take(layers).enumerate() {
                match x {
                    Value::Bool(true) => out.push(i),
                    Value::Bool(false) => {}
                    other => bail!(
                        "metadata `{arch}.attention.recurrent_layers[{i}]` must be a bool, not {other:?}"
                    ),
                }
            }
            out
        }
        _ => {
            let every = md
                .get(&format!("{arch}.full_attention_interval"))
                .and_then(as_u64)
                .unwrap_or(4)
                .max(1) as usize;
            (0..layers)
                .filter(|i| !(i + 1).is_multiple_of(every))
                .collect()
        }
    };
    let d = DeltaConfig {
        layers: linear,
        key_heads: req("ssm.group_count")?,
        value_heads,
        key_dim: req("ssm.state_size")?,
        value_dim: inner / value_heads,
        conv_kernel: req("ssm.conv_kernel")?,
    };
    d.validate()?;
    Ok(d)
}

/// What llama.cpp's `qwen35` / `qwen35moe` computes as transformers does, or an error naming what it does not.
pub(super) fn exportable(cfg: &ModelConfig, d: &DeltaConfig) -> Result<()> {
    if d.value_dim != d.key_dim {
        bail!(
            "Qwen3.5 with linear_value_head_dim {} ≠ linear_key_head_dim {} has no GGUF form (llama.cpp's qwen35 reads one head width for both): export it as safetensors",
            d.value_dim,
            d.key_dim
        );
    }
    if cfg.attention_bias || cfg.mlp_bias {
        bail!(
            "Qwen3.5 with attention_bias or mlp_bias has no GGUF form here (llama.cpp's qwen35 is checked without biases): export it as safetensors"
        );
    }
    if cfg.rope_scaling.is_some() {
        bail!(
            "Qwen3.5 with RoPE scaling has no GGUF form here (llama.cpp's qwen35 is checked with the default RoPE only): export it as safetensors"
        );
    }
    Ok(())
}

/// The `{arch}.*` keys of the linear layers and the rotary part: the rotary pairs split into
/// MRoPE sections as transformers' defaults do (text positions are the same in every section,
/// so the split changes nothing here).
pub(super) fn metadata(cfg: &ModelConfig, d: &DeltaConfig, arch: &str) -> Vec<(String, Value)> {
    let u = |x: usize| Value::U32(x as u32);
    let pairs = cfg.rotary_dim() / 2;
    let t = pairs.div_ceil(3);
    let h = (pairs - t).div_ceil(2);
    let sections = [t, h, pairs - t - h, 0]
        .into_iter()
        .map(|x| Value::I32(x as i32))
        .collect();
    let recurrent = (0..cfg.num_hidden_layers)
        .map(|i| Value::Bool(d.layers.contains(&i)))
        .collect();
    let mut md = vec![
        ("rope.dimension_count", u(cfg.rotary_dim())),
        ("rope.dimension_sections", Value::Array(sections)),
        ("ssm.conv_kernel", u(d.conv_kernel)),
        ("ssm.state_size", u(d.key_dim)),
        ("ssm.group_count", u(d.key_heads)),
        ("ssm.time_step_rank", u(d.value_heads)),
        ("ssm.inner_size", u(d.value_heads * d.value_dim)),
        ("attention.recurrent_layers", Value::Array(recurrent)),
    ];
    // The interval too where the layers follow one (llama.cpp's fallback for the list).
    if let Some(every) = (1..=cfg.num_hidden_layers).find(|k| {
        (0..cfg.num_hidden_layers).all(|i| d.layers.contains(&i) != (i + 1).is_multiple_of(*k))
    }) {
        md.push(("full_attention_interval", u(every)));
    }
    md.into_iter()
        .map(|(k, v)| (format!("{arch}.{k}"), v))
        .collect()
}

/// Moves the value heads along dimension `dim` (of `heads · width` entries) between
/// transformers' order, grouped by key head (`to_tiled`: from it), and llama.cpp's, tiled over
/// the key heads.
fn value_heads(
    t: &Tensor,
    dim: usize,
    d: &DeltaConfig,
    width: usize,
    to_tiled: bool,
) -> Result<Tensor> {
    let per = d.value_heads / d.key_heads;
    if per == 1 {
        return Ok(t.clone());
    }
    if dim == 1 {
        return value_heads(&t.t()?, 0, d, width, to_tiled)?
            .t()?
            .contiguous();
    }
    let dims = t.dims().to_vec();
    let rest: usize = dims[1..].iter().product();
    let (a, b) = match to_tiled {
        true => (d.key_heads, per),
        false => (per, d.key_heads),
    };
    t.reshape((a, b, width * rest))?
        .transpose(0, 1)?
        .contiguous()?
        .reshape(dims)
}

/// The value rows of a `(2 · keys + values, …)` tensor (q, k, v) moved, q and k kept.
fn qkv_rows(t: &Tensor, d: &DeltaConfig, to_tiled: bool) -> Result<Tensor> {
    let qk = 2 * d.key_heads * d.key_dim;
    let v = t.narrow(0, qk, t.dim(0)? - qk)?;
    Tensor::cat(
        &[
            &t.narrow(0, 0, qk)?,
            &value_heads(&v, 0, d, d.value_dim, to_tiled)?,
        ],
        0,
    )
}

/// A tensor read from a `qwen35` file (`name`, llama.cpp's) in transformers' form.
pub(super) fn from_gguf(name: &str, t: Tensor, d: &DeltaConfig) -> Result<Tensor> {
    convert(name, t, d, false)
}

/// A transformers-form tensor as a `qwen35` file holds it (`name`, llama.cpp's).
pub(super) fn to_gguf(name: &str, t: Tensor, d: &DeltaConfig) -> Result<Tensor> {
    convert(name, t, d, true)
}

fn convert(name: &str, t: Tensor, d: &DeltaConfig, to_gguf: bool) -> Result<Tensor> {
    let part = name.rsplit_once(".ssm_").map(|(_, p)| p);
    let t = match part {
        // A = −exp(A_log), per value head.
        Some("a") => {
            let t = match to_gguf {
                true => t.exp()?.neg()?,
                false => t.neg()?.log()?,
            };
            value_heads(&t, 0, d, 1, to_gguf)?
        }
        Some("dt.bias" | "beta.weight" | "alpha.weight") => value_heads(&t, 0, d, 1, to_gguf)?,
        // `(channels, 1, kernel)` in transformers, `(channels, kernel)` in llama.cpp.
        Some("conv1d.weight") => {
            let (c, k) = (t.dim(0)?, t.dims().last().copied().unwrap_or(1));
            let t = qkv_rows(&t.reshape((c, k))?, d, to_gguf)?;
            match to_gguf {
                true => t,
                false => t.reshape((c, 1, k))?,
            }
        }
        Some("out.weight") => value_heads(&t, 1, d, d.value_dim, to_gguf)?,
        Some("norm.weight") => t,
        _ if name.ends_with(".attn_qkv.weight") => qkv_rows(&t, d, to_gguf)?,
        _ if name.ends_with(".attn_gate.weight") => value_heads(&t, 0, d, d.value_dim, to_gguf)?,
        // The `1 + w` norms (layers', q/k, final).
        _ if name.ends_with("norm.weight") => t.affine(1.0, if to_gguf { 1.0 } else { -1.0 })?,
        _ => t,
    };
    Ok(t)
}
