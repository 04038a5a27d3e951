//! How a family's checkpoint lays its weights out, against the model's own layout: the model
//! keeps q, k, v and gate, up as separate maps (packed again for speed: [`crate::model::Packed`])
//! and each head's dimensions in the order its fused RoPE kernels rotate (pairs `head_dim / 2`
//! apart). Files are read and written in the family's layout:
//!
//! * Phi-3 stores q, k, v as one `qkv_proj` (rows q, then k, then v) and gate, up as one
//!   `gate_up_proj` (gate rows first): split on load ([`from_hf`]), joined on save ([`to_hf`]);
//!   PEFT adapters on those modules likewise ([`crate::lora`]).
//! * Partial rotary embeddings (`partial_rotary_factor`): transformers rotates the first
//!   `r` dimensions of a head, pairing `i` with `i + r/2`, and passes the rest. The model
//!   reorders each head of q and k (the same way for both, so every score `q·k` is unchanged)
//!   to `[rotated 0..r/2, passed first half, rotated r/2..r, passed second half]`: the rotated
//!   pairs are then `head_dim / 2` apart, the passed ones pair among themselves with frequency
//!   0 (cos 1, sin 0), and every RoPE path — the fused CPU op, the CUDA kernels, CUDA graphs —
//!   serves it unchanged.
//! * An interleaved RoPE (ERNIE 4.5, GLM: pairs `(2i, 2i + 1)`, GLM's over the first half of
//!   each head) is reordered the same way, to the model's pairs `(i, i + head_dim / 2)`.
//! * GLM stores gate and up as one `gate_up_proj` (gate rows first), as Phi-3 does.
//! * Granite MoE stores each layer's experts fused: `block_sparse_moe.input_linear.weight`
//!   `(experts, 2 · width, hidden)` (each expert's gate rows, then its up rows),
//!   `output_linear.weight` `(experts, hidden, width)` and the router as `router.layer.weight`;
//!   the model holds one gate, up and down per expert ([`crate::moe::MoeNames`]).
//! * gpt-oss stores each layer's experts fused and transposed: `mlp.experts.gate_up_proj`
//!   `(experts, hidden, 2 · width)` whose columns alternate gate, up (`gate_up_proj_bias`
//!   likewise), `down_proj` `(experts, width, hidden)`, `down_proj_bias`; OpenAI's own
//!   checkpoints hold the two weights MXFP4-quantized instead (`*_blocks`, `*_scales`,
//!   [`dequantize_mxfp4`]), read into the model's dtype and written back dense, as
//!   transformers dequantizes them.
//! * Gemma 4's experts are fused as Granite MoE's, `experts.gate_up_proj` and
//!   `experts.down_proj` ([`crate::gemma4::split_experts`]).
//! * Hunyuan names its per-head q/k norms `query_layernorm` / `key_layernorm`; LFM2 its norms
//!   `operator_norm`, `ffn_norm`, `q_layernorm`, `k_layernorm`, `embedding_norm`, its MLP
//!   `feed_forward.w1` / `w3` / `w2` (its experts' likewise; their router's offsets `expert_bias`) and
//!   its attention's output `out_proj` (`renames`).
//! * Qwen3.5's gated attention: its `q_proj` gives each head's query rows, then that head's
//!   gate rows; the model holds all query rows (reordered for its partial rotary embeddings),
//!   then all gate rows ([`q_rows`]).

use candle_core::{Result, Tensor, bail};

use crate::config::{Arch, ModelConfig};
use crate::model::WeightMap;

/// For each of the model's head dimensions, the transformers dimension it holds (`None` when
/// every dimension rotates in rotate-half pairs: the orders agree). An interleaved RoPE
/// ([`Arch::interleaved_rope`]) pairs `(2i, 2i + 1)`: the model holds `2i` at `i` and `2i + 1`
/// at `i + head_dim / 2` (llama.cpp's un-permutation).
pub fn rotary_order(cfg: &ModelConfig) -> Option<Vec<usize>> {
    // DeepSeek's latent attention orders its heads as it makes them ([`crate::mla`]).
    if cfg.mla.is_some() {
        return None;
    }
    let (hd, r) = (cfg.head_dim, cfg.rotary_dim());
    let (hr, hp) = (r / 2, (hd - r) / 2);
    if cfg.arch.interleaved_rope() {
        // The rotated pairs' first dimensions, the passed first half, the pairs' second
        // dimensions, the passed second half (GLM rotates the first `r` dimensions).
        let mut order: Vec<usize> = (0..hr).map(|i| 2 * i).collect();
        order.extend(r..r + hp);
        order.extend((0..hr).map(|i| 2 * i + 1));
        order.extend(r + hp..hd);
        return Some(order);
    }
    if r == hd {
        return None;
    }
    let mut order: Vec<usize> = (0..hr).collect();
    order.extend(r..r + hp);
    order.extend(hr..r);
    order.extend(r + hp..hd);
    Some(order)
}

/// Rows `(heads · head_dim, …)` (a q or k weight, bias, LoRA `B` or DoRA magnitude) from
/// transformers' head order to the model's (`to_model`) or back.
pub fn reorder_heads(cfg: &ModelConfig, t: &Tensor, to_model: bool) -> Result<Tensor> {
    let Some(order) = rotary_order(cfg) else {
        return Ok(t.clone());
    };
    let hd = cfg.head_dim;
    let rows = t.dim(0)?;
    if !rows.is_multiple_of(hd) {
        bail!("{rows} rows are not whole heads of {hd}");
    }
    let index: Vec<u32> = match to_model {
        true => order.iter().map(|&i| i as u32).collect(),
        false => {
            let mut inv = vec![0u32; hd];
            for (j, &i) in order.iter().enumerate() {
                inv[i] = j as u32;
            }
            inv
        }
    };
    let index = Tensor::from_vec(index, hd, t.device())?;
    let mut shape = t.dims().to_vec();
    let (heads, rest): (usize, Vec<usize>) = (rows / hd, shape[1..].to_vec());
    let mut split = vec![heads, hd];
    split.extend(&rest);
    let out = t.reshape(split)?.index_select(&index, 1)?;
    shape[0] = rows;
    out.reshape(shape)
}

/// A map that a family's files store fused: its group, its name, and its parts' names and
/// rows, in order.
#[derive(Debug, Clone)]
pub struct Fused {
    /// `self_attn` or `mlp`.
    pub group: &'static str,
    /// The fused map's name (`qkv_proj`).
    pub name: &'static str,
    /// The model's maps it holds, with their output rows.
    pub parts: Vec<(&'static str, usize)>,
}

/// The fused maps of `cfg`'s family (Phi-3's `qkv_proj` and `gate_up_proj`, GLM's
/// `gate_up_proj`; none elsewhere).
pub fn fused_parts(cfg: &ModelConfig) -> Vec<Fused> {
    let q = cfg.num_attention_heads * cfg.head_dim;
    let kv = cfg.num_key_value_heads * cfg.head_dim;
    let im = cfg.intermediate_size;
    let gate_up = Fused {
        group: "mlp",
        name: "gate_up_proj",
        parts: vec![("gate_proj", im), ("up_proj", im)],
    };
    match cfg.arch {
        Arch::Phi3 => vec![
            Fused {
                group: "self_attn",
                name: "qkv_proj",
                parts: vec![("q_proj", q), ("k_proj", kv), ("v_proj", kv)],
            },
            gate_up,
        ],
        a if a.glm() => vec![gate_up],
        _ => Vec::new(),
    }
}

/// Whether the model reorders q and k ([`rotary_order`]) as maps of their own, not as parts
/// of a fused one (ERNIE 4.5, GLM; Phi-3's are in `qkv_proj`), or holds Qwen3.5's gate rows
/// apart ([`q_rows`]).
pub fn qk_reordered_apart(cfg: &ModelConfig) -> bool {
    (rotary_order(cfg).is_some() || cfg.arch.qwen3_5())
        && !fused_parts(cfg)
            .iter()
            .any(|f| f.parts.iter().any(|(p, _)| rotated(p)))
}

/// Rows of a q map (weight, bias, LoRA `B`, DoRA magnitude) from transformers' order to the
/// model's (`to_model`) or back: [`reorder_heads`], and for Qwen3.5's gated attention the
/// files' per-head `[query rows, gate rows]` to the model's `[all query rows, all gate rows]`.
pub fn q_rows(cfg: &ModelConfig, t: &Tensor, to_model: bool) -> Result<Tensor> {
    if !cfg.arch.qwen3_5() {
        return reorder_heads(cfg, t, to_model);
    }
    let (nh, hd) = (cfg.num_attention_heads, cfg.head_dim);
    let rows = t.dim(0)?;
    if rows != 2 * nh * hd {
        bail!(
            "{rows} rows are not the {nh} heads' query and gate rows (2 × {nh} × {hd}, config.json's heads)"
        );
    }
    let rest: Vec<usize> = t.dims()[1..].to_vec();
    let shaped = |lead: &[usize]| -> Vec<usize> { lead.iter().chain(&rest).copied().collect() };
    if to_model {
        let per_head = t.reshape(shaped(&[nh, 2, hd]))?;
        let part = |j: usize| -> Result<Tensor> {
            per_head
                .narrow(1, j, 1)?
                .contiguous()?
                .reshape(shaped(&[nh * hd]))
        };
        let q = reorder_heads(cfg, &part(0)?, true)?;
        return Tensor::cat(&[q, part(1)?], 0);
    }
    let q = reorder_heads(cfg, &t.narrow(0, 0, nh * hd)?.contiguous()?, false)?;
    let gate = t.narrow(0, nh * hd, nh * hd)?.contiguous()?;
    let heads = |x: Tensor| x.reshape(shaped(&[nh, 1, hd]));
    Tensor::cat(&[heads(q)?, heads(gate)?], 1)?.reshape(shaped(&[2 * nh * hd]))
}

/// Whether a part's rows are reordered for partial rotary embeddings (q and k, and the
/// weights of their norms, which scale each head dimension: GLM-4.5's `use_qk_norm`).
pub fn rotated(part: &str) -> bool {
    matches!(part, "q_proj" | "k_proj" | "q_norm" | "k_norm")
}

impl Fused {
    /// The rows of `t` `(Σ rows, …)` (a fused weight, bias, LoRA `B`, DoRA magnitude) as its
    /// parts', in the model's layout (q and k reordered for partial rotary). `what` names `t` in
    /// the error of a wrong size.
    pub fn split(
        &self,
        cfg: &ModelConfig,
        t: &Tensor,
        what: &str,
    ) -> Result<Vec<(&'static str, Tensor)>> {
        let total: usize = self.parts.iter().map(|p| p.1).sum();
        if t.dim(0).ok() != Some(total) {
            bail!(
                "{what} has shape {:?}, expected {total} rows (config.json's heads and sizes)",
                t.dims()
            );
        }
        let mut at = 0;
        let mut out = Vec::with_capacity(self.parts.len());
        for &(part, n) in &self.parts {
            let piece = t.narrow(0, at, n)?.contiguous()?;
            out.push((
                part,
                match rotated(part) {
                    true => reorder_heads(cfg, &piece, true)?,
                    false => piece,
                },
            ));
            at += n;
        }
        Ok(out)
    }

    /// The parts' tensors (in [`Self::parts`]' order, the model's layout) joined as the family's
    /// files hold them (the inverse of [`Self::split`]).
    pub fn join(&self, cfg: &ModelConfig, parts: &[Tensor]) -> Result<Tensor> {
        let rows = self
            .parts
            .iter()
            .zip(parts)
            .map(|(&(part, _), t)| match rotated(part) {
                true => reorder_heads(cfg, t, false),
                false => Ok(t.clone()),
            })
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&rows, 0)
    }
}

/// `weights` as read from a checkpoint of `cfg`'s family, in the model's layout: fused maps
/// split, q and k reordered for partial rotary embeddings. A fused weight of the wrong shape is
/// an error naming it.
pub fn from_hf(cfg: &ModelConfig, mut weights: WeightMap) -> Result<WeightMap> {
    if cfg.arch == Arch::GraniteMoe {
        split_granite_experts(cfg, &mut weights)?;
    }
    if cfg.arch == Arch::GptOss {
        split_gpt_oss_experts(cfg, &mut weights)?;
    }
    crate::gemma4::split_experts(cfg, &mut weights)?;
    if !renames(cfg.arch).is_empty() {
        weights = weights
            .into_iter()
            .map(|(k, t)| (renamed(cfg.arch, &k, true), t))
            .collect();
    }
    split_fused_experts(cfg, &mut weights)?;
    let fused = fused_parts(cfg);
    for i in 0..cfg.num_hidden_layers {
        for f in &fused {
            for kind in ["weight", "bias"] {
                let key = format!("model.layers.{i}.{}.{}.{kind}", f.group, f.name);
                let Some(t) = weights.remove(&key) else {
                    continue;
                };
                for (part, piece) in f.split(cfg, &t, &format!("weight `{key}`"))? {
                    weights.insert(format!("model.layers.{i}.{}.{part}.{kind}", f.group), piece);
                }
            }
        }
        // Separate q and k (a family whose fused maps, if any, hold neither: GLM) reordered
        // here.
        if qk_reordered_apart(cfg) {
            for part in ["q_proj", "k_proj", "q_norm", "k_norm"] {
                for kind in ["weight", "bias"] {
                    let key = format!("model.layers.{i}.self_attn.{part}.{kind}");
                    if let Some(t) = weights.remove(&key) {
                        let t = match part {
                            "q_proj" => q_rows(cfg, &t, true),
                            _ => reorder_heads(cfg, &t, true),
                        }
                        .map_err(|e| candle_core::Error::msg(format!("weight `{key}`: {e}")))?;
                        weights.insert(key, t);
                    }
                }
            }
        }
    }
    Ok(weights)
}

/// The model's weights ([`crate::Transformer::weights`]) in `cfg`'s family layout, as its
/// checkpoints store them (the inverse of [`from_hf`]).
pub fn to_hf(cfg: &ModelConfig, weights: Vec<(String, Tensor)>) -> Result<Vec<(String, Tensor)>> {
    let weights = match cfg.arch {
        Arch::GraniteMoe => fuse_granite_experts(cfg, weights)?,
        Arch::GptOss => fuse_gpt_oss_experts(cfg, weights)?,
        Arch::Gemma4 => crate::gemma4::fuse_experts(cfg, weights)?,
        a if !renames(a).is_empty() => weights
            .into_iter()
            .map(|(k, t)| (renamed(cfg.arch, &k, false), t))
            .collect(),
        _ => weights,
    };
    let reorder = rotary_order(cfg).is_some() || cfg.arch.qwen3_5();
    let fused = fused_parts(cfg);
    if !reorder && fused.is_empty() {
        return Ok(weights);
    }
    let mut map: std::collections::HashMap<String, Tensor> = weights.iter().cloned().collect();
    let mut out = Vec::with_capacity(weights.len());
    for (k, _) in &weights {
        // Taken already: a part of a fused map written with its first part.
        if !map.contains_key(k) {
            continue;
        }
        let part_of = |k: &str| {
            let (layer, rest) = k.strip_prefix("model.layers.")?.split_once('.')?;
            let (group, rest) = rest.split_once('.')?;
            let (part, kind) = rest.split_once('.')?;
            Some((
                layer.to_string(),
                group.to_string(),
                part.to_string(),
                kind.to_string(),
            ))
        };
        let Some((layer, group, part, kind)) = part_of(k) else {
            out.push((k.clone(), map.remove(k).expect("checked above")));
            continue;
        };
        let fetch = |map: &mut std::collections::HashMap<String, Tensor>, part: &str| {
            let key = format!("model.layers.{layer}.{group}.{part}.{kind}");
            let t = map
                .remove(&key)
                .ok_or_else(|| candle_core::Error::msg(format!("weight `{key}` is missing")))?;
            Ok::<_, candle_core::Error>((key, t))
        };
        match fused
            .iter()
            .find(|f| f.group == group && f.parts.iter().any(|p| p.0 == part))
        {
            Some(f) => {
                let mut rows = Vec::new();
                for (p, _) in &f.parts {
                    rows.push(fetch(&mut map, p)?.1);
                }
                out.push((
                    format!("model.layers.{layer}.{group}.{}.{kind}", f.name),
                    f.join(cfg, &rows)?,
                ));
            }
            None => {
                let (key, t) = fetch(&mut map, &part)?;
                let t = match reorder && rotated(&part) {
                    true if group == "self_attn" && part == "q_proj" => q_rows(cfg, &t, false)?,
                    true => reorder_heads(cfg, &t, false)?,
                    false => t,
                };
                out.push((key, t));
            }
        }
    }
    Ok(out)
}

/// The parts of a family's tensor names that its files and the model name apart: (the files',
/// the model's).
fn renames(arch: Arch) -> &'static [(&'static str, &'static str)] {
    match arch {
        // Hunyuan's per-head q/k norms.
        Arch::HunyuanDense => &[
            (".self_attn.query_layernorm.", ".self_attn.q_norm."),
            (".self_attn.key_layernorm.", ".self_attn.k_norm."),
        ],
        // LFM2's norms, MLP (its experts' and their router's offsets too) and attention output.
        a if a.lfm2() => &[
            (".operator_norm.", ".input_layernorm."),
            (".ffn_norm.", ".post_attention_layernorm."),
            (".self_attn.out_proj.", ".self_attn.o_proj."),
            (".self_attn.q_layernorm.", ".self_attn.q_norm."),
            (".self_attn.k_layernorm.", ".self_attn.k_norm."),
            ("model.embedding_norm.", "model.norm."),
            (".feed_forward.", ".mlp."),
            (".mlp.expert_bias", ".mlp.gate.e_score_correction_bias"),
            (".w1.", ".gate_proj."),
            (".w3.", ".up_proj."),
            (".w2.", ".down_proj."),
        ],
        _ => &[],
    }
}

/// A tensor's name in the model's naming (`to_model`) from its files', or back: every pair of
/// the family's table of renamed parts in turn (in reverse order going back).
pub fn renamed(arch: Arch, name: &str, to_model: bool) -> String {
    let pairs = renames(arch);
    let mut name = name.to_string();
    for i in 0..pairs.len() {
        let (from, to) = match to_model {
            true => pairs[i],
            false => (pairs[pairs.len() - 1 - i].1, pairs[pairs.len() - 1 - i].0),
        };
        if name.contains(from) {
            name = name.replace(from, to);
        }
    }
    name
}

/// The parts' rows alternating, row `i` of part `j` at `i · parts + j` (gpt-oss's fused
/// `gate_up_proj` outputs: gate, up, gate, up, …); every part `(rows, …)` of one shape.
pub fn interleave_rows(parts: &[Tensor]) -> Result<Tensor> {
    let t = Tensor::stack(parts, 1)?;
    let mut dims = t.dims().to_vec();
    dims[0] *= parts.len();
    dims.remove(1);
    t.reshape(dims)
}

/// Part `j` of `n` taken out of rows [`interleave_rows`] made, contiguous.
pub fn deinterleave_rows(t: &Tensor, n: usize, j: usize) -> Result<Tensor> {
    let mut dims = t.dims().to_vec();
    dims[0] /= n;
    dims.insert(1, n);
    t.reshape(dims)?.narrow(1, j, 1)?.squeeze(1)?.contiguous()
}

/// The config fields a fused experts tensor's shape comes from.
const EXPERT_FIELDS: &str = "config.json's num_local_experts, intermediate_size, hidden_size";

/// The tensor `key` taken out of `weights` (`None` when absent), or an error naming it when its
/// shape is not `shape` (a fused experts tensor: Granite MoE's, gpt-oss's).
fn take_experts(weights: &mut WeightMap, key: &str, shape: &[usize]) -> Result<Option<Tensor>> {
    let Some(t) = weights.remove(key) else {
        return Ok(None);
    };
    if t.dims() != shape {
        bail!(
            "weight `{key}` has shape {:?}, expected {shape:?} ({EXPERT_FIELDS})",
            t.dims()
        );
    }
    Ok(Some(t))
}

/// A layer's experts as transformers 5 holds them in memory and may save them — fused,
/// `experts.gate_up_proj` `(experts, 2 · width, hidden)` (each expert's gate rows, then its
/// up rows) and `experts.down_proj` `(experts, hidden, width)` — as the model's one gate, up
/// and down per expert (the families whose files otherwise hold each expert apart: the Qwens',
/// OLMoE's, DeepSeek's, GLM-4.5's, LFM2-MoE's). A tensor of the wrong shape is an error naming
/// it.
fn split_fused_experts(cfg: &ModelConfig, weights: &mut WeightMap) -> Result<()> {
    let Some(m) = &cfg.moe else {
        return Ok(());
    };
    if matches!(cfg.arch, Arch::GraniteMoe | Arch::GptOss) {
        return Ok(());
    }
    let names = crate::moe::MoeNames::of(cfg.arch);
    let (e, w, h) = (m.num_experts, m.moe_intermediate_size, cfg.hidden_size);
    for i in (0..cfg.num_hidden_layers).filter(|i| m.sparse(*i)) {
        let block = names.experts_module(i);
        let gate_up = take_experts(weights, &format!("{block}.gate_up_proj"), &[e, 2 * w, h])?;
        let down = take_experts(weights, &format!("{block}.down_proj"), &[e, h, w])?;
        insert_experts(weights, &|x| names.expert(i, x), e, w, gate_up, down)?;
    }
    Ok(())
}

/// A layer's `e` fused experts — `gate_up` `(e, 2 · w, hidden)` (each expert's gate rows,
/// then its up rows), `down` `(e, hidden, w)`, either absent — into `weights` one gate, up and
/// down per expert, under `names(expert)`.
pub(crate) fn insert_experts(
    weights: &mut WeightMap,
    names: &dyn Fn(usize) -> [String; 3],
    e: usize,
    w: usize,
    gate_up: Option<Tensor>,
    down: Option<Tensor>,
) -> Result<()> {
    for x in 0..e {
        let [g, u, d] = names(x);
        if let Some(t) = &gate_up {
            let t = t.get(x)?;
            weights.insert(g, t.narrow(0, 0, w)?.contiguous()?);
            weights.insert(u, t.narrow(0, w, w)?.contiguous()?);
        }
        if let Some(t) = &down {
            weights.insert(d, t.get(x)?.contiguous()?);
        }
    }
    Ok(())
}

/// Granite MoE's file names of layer `i`'s fused experts and router.
fn granite_files(i: usize) -> [String; 3] {
    ["input_linear", "output_linear", "router.layer"]
        .map(|n| format!("model.layers.{i}.block_sparse_moe.{n}.weight"))
}

/// Granite MoE's fused experts and router (as its files hold them) under the model's names,
/// one gate, up and down per expert. A tensor of the wrong shape is an error naming it.
fn split_granite_experts(cfg: &ModelConfig, weights: &mut WeightMap) -> Result<()> {
    let Some(m) = &cfg.moe else {
        return Ok(());
    };
    let names = crate::moe::MoeNames::of(cfg.arch);
    let (e, w, h) = (m.num_experts, m.moe_intermediate_size, cfg.hidden_size);
    for i in 0..cfg.num_hidden_layers {
        let [input, output, router] = granite_files(i);
        let mut take = |key: &str, shape: &[usize]| take_experts(weights, key, shape);
        let gate_up = take(&input, &[e, 2 * w, h])?;
        let down = take(&output, &[e, h, w])?;
        if let Some(r) = take(&router, &[e, h])? {
            weights.insert(names.router(i), r);
        }
        insert_experts(weights, &|x| names.expert(i, x), e, w, gate_up, down)?;
    }
    Ok(())
}

/// The inverse of [`split_granite_experts`]: each layer's experts fused where its router was
/// (the model lists the router first), the rest in order.
fn fuse_granite_experts(
    cfg: &ModelConfig,
    weights: Vec<(String, Tensor)>,
) -> Result<Vec<(String, Tensor)>> {
    let Some(m) = &cfg.moe else {
        return Ok(weights);
    };
    let names = crate::moe::MoeNames::of(cfg.arch);
    let all: std::collections::HashMap<&str, &Tensor> =
        weights.iter().map(|(k, t)| (k.as_str(), t)).collect();
    let mut map: std::collections::HashMap<String, Tensor> = weights.iter().cloned().collect();
    let mut layer_of = std::collections::HashMap::new();
    for i in 0..cfg.num_hidden_layers {
        layer_of.insert(names.router(i), i);
        for x in 0..m.num_experts {
            for n in names.expert(i, x) {
                map.remove(&n);
            }
        }
    }
    let mut out = Vec::with_capacity(map.len());
    for (k, _) in &weights {
        let Some(t) = map.remove(k) else {
            continue; // an expert's part: fused with its router
        };
        let Some(&i) = layer_of.get(k) else {
            out.push((k.clone(), t));
            continue;
        };
        let part = |x: usize, j: usize| -> Result<Tensor> {
            let n = &names.expert(i, x)[j];
            all.get(n.as_str())
                .map(|t| (*t).clone())
                .ok_or_else(|| candle_core::Error::msg(format!("weight `{n}` is missing")))
        };
        let mut gate_up = Vec::with_capacity(m.num_experts);
        let mut down = Vec::with_capacity(m.num_experts);
        for x in 0..m.num_experts {
            gate_up.push(Tensor::cat(&[part(x, 0)?, part(x, 1)?], 0)?);
            down.push(part(x, 2)?);
        }
        let [input, output, router] = granite_files(i);
        out.push((router, t));
        out.push((input, Tensor::stack(&gate_up, 0)?));
        out.push((output, Tensor::stack(&down, 0)?));
    }
    Ok(out)
}

/// A fine-grained FP8 weight (`quantization_config.quant_method = "fp8"`: DeepSeek-V3's
/// checkpoints, the Qwen3 and Ministral 3 FP8 uploads) in `dtype`: `weight` `(…, N, K)` F8E4M3
/// times its `weight_scale_inv` — one value per `block` `(bn, bk)` tile, `(…, ⌈N/bn⌉, ⌈K/bk⌉)`
/// (the last tiles may be partial), or one for the whole weight — in f32, then cast, as
/// transformers' `dequantize=True` reads it. E8M0 scales stored as u8 are `2^(s − 127)`. Without
/// a block size (the config's `weight_block_size` null) the tiles are derived from the scale
/// grid, which must then divide the weight. Runs on the tensors' device (the loader's CPU).
pub fn dequantize_fp8(
    weight: &Tensor,
    scale: &Tensor,
    block: Option<(usize, usize)>,
    dtype: candle_core::DType,
    what: &str,
) -> Result<Tensor> {
    use candle_core::DType;
    if weight.dtype() != DType::F8E4M3 || weight.rank() < 2 {
        bail!(
            "{what}: an FP8 weight must be float8_e4m3 of rank 2 or more, not {:?} {:?}",
            weight.dtype(),
            weight.dims()
        );
    }
    let w = weight.to_dtype(DType::F32)?;
    let s = match scale.dtype() {
        DType::U8 => {
            let lut = Tensor::new(e8m0_powers().as_slice(), scale.device())?;
            lut.index_select(&scale.flatten_all()?.to_dtype(DType::U32)?, 0)?
                .reshape(scale.dims())?
        }
        _ => scale.to_dtype(DType::F32)?,
    };
    let out = if s.elem_count() == 1 {
        w.broadcast_mul(&s.flatten_all()?.reshape(())?)?
    } else {
        let r = w.rank();
        let (n, k) = (w.dim(r - 2)?, w.dim(r - 1)?);
        if s.rank() != r || s.dims()[..r - 2] != w.dims()[..r - 2] {
            bail!(
                "{what}: scales of shape {:?} do not fit an FP8 weight of shape {:?}",
                s.dims(),
                w.dims()
            );
        }
        let (sn, sk) = (s.dim(r - 2)?, s.dim(r - 1)?);
        let (bn, bk) = match block {
            Some(b) => b,
            None if n.is_multiple_of(sn) && k.is_multiple_of(sk) => (n / sn, k / sk),
            None => bail!(
                "{what}: a scale grid {sn} × {sk} does not divide the weight {n} × {k} and the config names no weight_block_size"
            ),
        };
        if bn == 0 || bk == 0 || n.div_ceil(bn) != sn || k.div_ceil(bk) != sk {
            bail!(
                "{what}: FP8 weight {n} × {k} in blocks of {bn} × {bk} needs {} × {} scales, not {sn} × {sk}",
                n.div_ceil(bn.max(1)),
                k.div_ceil(bk.max(1))
            );
        }
        let index = |len: usize, b: usize| -> Result<Tensor> {
            let i: Vec<u32> = (0..len).map(|x| (x / b) as u32).collect();
            Tensor::new(i.as_slice(), w.device())
        };
        let full = s
            .index_select(&index(n, bn)?, r - 2)?
            .index_select(&index(k, bk)?, r - 1)?;
        (w * full)?
    };
    out.to_dtype(dtype)
}

/// A checkpoint's tensors with every FP8 weight dequantized by its `*_scale_inv` sibling
/// ([`dequantize_fp8`], the scales and any static `activation_scale` / `input_scale` dropped); the
/// others pass unchanged.
pub fn dequantize_fp8_weights(
    mut weights: WeightMap,
    block: Option<(usize, usize)>,
    dtype: candle_core::DType,
) -> Result<WeightMap> {
    let names: Vec<String> = weights
        .iter()
        .filter(|(_, t)| t.dtype() == candle_core::DType::F8E4M3)
        .map(|(n, _)| n.clone())
        .collect();
    for name in names {
        let scale_name = format!("{name}_scale_inv");
        let Some(scale) = weights.remove(&scale_name) else {
            bail!("weight `{name}` is FP8 but `{scale_name}` is missing");
        };
        let w = weights.remove(&name).expect("listed above");
        let t = dequantize_fp8(&w, &scale, block, dtype, &format!("weight `{name}`"))?;
        weights.insert(name, t);
    }
    weights.retain(|n, _| {
        !(n.ends_with("_scale_inv")
            || n.ends_with(".activation_scale")
            || n.ends_with(".input_scale"))
    });
    Ok(weights)
}

/// The scale of each E8M0 code `e` (MX formats' shared exponents): `2^(e − 127)` exactly, the
/// f32 of exponent field `e` (0: 2^-127, a subnormal; 255: infinity, as torch's `exp2` gives).
fn e8m0_powers() -> Vec<f32> {
    (0u32..256)
        .map(|e| match e {
            0 => f32::from_bits(1 << 22),
            255 => f32::INFINITY,
            e => f32::from_bits(e << 23),
        })
        .collect()
}

/// The 16 values of an FP4 (E2M1) code: sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
const FP4_E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// MXFP4 weights in `dtype`, as transformers' `convert_moe_packed_tensors` reads them (before
/// its transpose): `blocks` `(…, G, 16)` u8 hold two FP4 codes a byte (the low nibble first),
/// 32 values per group; `scales` `(…, G)` u8 each group's power of two, `2^(s − 127)` (E8M0).
/// Returns `(…, G · 32)`. Each leading index is done apart, in f32 and then cast (an expert at
/// a time: the intermediates stay small; every value is exact in bf16 too), with candle ops on
/// the tensors' device. `what` names the weight in errors.
pub fn dequantize_mxfp4(
    blocks: &Tensor,
    scales: &Tensor,
    dtype: candle_core::DType,
    what: &str,
) -> Result<Tensor> {
    use candle_core::{D, DType};
    let (bd, sd) = (blocks.dims(), scales.dims());
    if blocks.dtype() != DType::U8 || scales.dtype() != DType::U8 {
        bail!(
            "{what}: MXFP4 blocks and scales must be uint8, not {:?} and {:?}",
            blocks.dtype(),
            scales.dtype()
        );
    }
    if bd.len() < 2 || bd[bd.len() - 1] != 16 || bd[..bd.len() - 1] != *sd {
        bail!(
            "{what}: MXFP4 blocks of shape {bd:?} do not fit scales of shape {sd:?} (blocks (…, G, 16), scales (…, G))"
        );
    }
    let dev = blocks.device();
    let lut = Tensor::new(&FP4_E2M1, dev)?;
    let pow2 = Tensor::new(e8m0_powers().as_slice(), dev)?;
    let one = |b: &Tensor, s: &Tensor| -> Result<Tensor> {
        let shape = b.dims().to_vec();
        let x = b.to_dtype(DType::F32)?;
        let hi = (&x / 16.0)?.floor()?;
        let lo = (&x - (&hi * 16.0)?)?;
        let code = |c: &Tensor| -> Result<Tensor> {
            lut.index_select(&c.flatten_all()?.to_dtype(DType::U32)?, 0)?
                .reshape(shape.as_slice())
        };
        let v = Tensor::stack(&[code(&lo)?, code(&hi)?], D::Minus1)?;
        let mut wide = shape.clone();
        wide[shape.len() - 1] = 32;
        let v = v.reshape(wide)?;
        let sc = pow2
            .index_select(&s.flatten_all()?.to_dtype(DType::U32)?, 0)?
            .reshape(s.dims())?
            .unsqueeze(D::Minus1)?;
        let v = v.broadcast_mul(&sc)?;
        let mut flat = shape[..shape.len() - 2].to_vec();
        flat.push(shape[shape.len() - 2] * 32);
        v.reshape(flat)?.to_dtype(dtype)
    };
    if bd.len() == 2 {
        return one(blocks, scales);
    }
    let parts = (0..bd[0])
        .map(|i| one(&blocks.get(i)?, &scales.get(i)?))
        .collect::<Result<Vec<_>>>()?;
    Tensor::stack(&parts, 0)
}

/// gpt-oss's file names of layer `i`'s fused experts: `[gate_up, gate_up bias, down, down
/// bias]` under `mlp.experts.`.
fn gpt_oss_files(i: usize) -> [String; 4] {
    [
        "gate_up_proj",
        "gate_up_proj_bias",
        "down_proj",
        "down_proj_bias",
    ]
    .map(|n| format!("model.layers.{i}.mlp.experts.{n}"))
}

/// gpt-oss's fused experts (dense or MXFP4) under the model's names, one gate, up and down
/// (weights `(out, in)` and biases) per expert; MXFP4 read into the dtype of the file's expert
/// biases (bf16 in OpenAI's: the dense experts of a 20B model would not fit a GPU in f32). A
/// tensor of the wrong shape is an error naming it and the config fields it should match.
fn split_gpt_oss_experts(cfg: &ModelConfig, weights: &mut WeightMap) -> Result<()> {
    let Some(m) = &cfg.moe else {
        return Ok(());
    };
    let names = crate::moe::MoeNames::of(cfg.arch);
    let (e, w, h) = (m.num_experts, m.moe_intermediate_size, cfg.hidden_size);
    for i in 0..cfg.num_hidden_layers {
        let [gate_up, gate_up_bias, down, down_bias] = gpt_oss_files(i);
        let into = weights
            .get(&gate_up_bias)
            .map_or(candle_core::DType::BF16, |b| b.dtype());
        let take = take_experts;
        // Both weights as `(experts, out, in)`: MXFP4 blocks hold them so already, the dense
        // files transposed.
        let weight = |weights: &mut WeightMap,
                      key: &str,
                      out: usize,
                      inp: usize|
         -> Result<Option<Tensor>> {
            if let Some(t) = take(weights, key, &[e, inp, out])? {
                return Ok(Some(t.transpose(1, 2)?));
            }
            let (bk, sk) = (format!("{key}_blocks"), format!("{key}_scales"));
            if !inp.is_multiple_of(32) {
                if weights.contains_key(&bk) {
                    bail!(
                        "weight `{bk}`: MXFP4 needs an input width that is a multiple of 32, not {inp} ({EXPERT_FIELDS})"
                    );
                }
                return Ok(None);
            }
            let blocks = take(weights, &bk, &[e, out, inp / 32, 16])?;
            let scales = take(weights, &sk, &[e, out, inp / 32])?;
            match (blocks, scales) {
                (Some(b), Some(s)) => Ok(Some(dequantize_mxfp4(
                    &b,
                    &s,
                    into,
                    &format!("weight `{bk}`"),
                )?)),
                (None, None) => Ok(None),
                (Some(_), None) => bail!("weight `{sk}` is missing (its `{bk}` is there)"),
                (None, Some(_)) => bail!("weight `{bk}` is missing (its `{sk}` is there)"),
            }
        };
        let gu = weight(weights, &gate_up, 2 * w, h)?
            .map(|t| t.contiguous())
            .transpose()?;
        let dn = weight(weights, &down, h, w)?;
        let gub = take(weights, &gate_up_bias, &[e, 2 * w])?;
        let db = take(weights, &down_bias, &[e, h])?;
        let router = names.router(i);
        let file_router = format!("model.layers.{i}.mlp.router");
        for kind in ["weight", "bias"] {
            if let Some(t) = weights.remove(&format!("{file_router}.{kind}")) {
                let key = match kind {
                    "weight" => router.clone(),
                    _ => crate::moe::MoeNames::bias_of(&router),
                };
                weights.insert(key, t);
            }
        }
        for x in 0..e {
            let [g, u, d] = names.expert(i, x);
            // Rows 2j (gate) and 2j + 1 (up) of the fused map.
            let pair = |t: &Tensor, j: usize| deinterleave_rows(&t.get(x)?, 2, j);
            if let Some(t) = &gu {
                weights.insert(g.clone(), pair(t, 0)?);
                weights.insert(u.clone(), pair(t, 1)?);
            }
            if let Some(t) = &gub {
                weights.insert(crate::moe::MoeNames::bias_of(&g), pair(t, 0)?);
                weights.insert(crate::moe::MoeNames::bias_of(&u), pair(t, 1)?);
            }
            if let Some(t) = &dn {
                weights.insert(d.clone(), t.get(x)?.contiguous()?);
            }
            if let Some(t) = &db {
                weights.insert(crate::moe::MoeNames::bias_of(&d), t.get(x)?.contiguous()?);
            }
        }
    }
    Ok(())
}

/// The inverse of [`split_gpt_oss_experts`] (written dense, as transformers saves a
/// dequantized model): each layer's experts fused after its router (the model lists the
/// router first), the router under its file name, the rest in order.
fn fuse_gpt_oss_experts(
    cfg: &ModelConfig,
    weights: Vec<(String, Tensor)>,
) -> Result<Vec<(String, Tensor)>> {
    use crate::moe::MoeNames;
    let Some(m) = &cfg.moe else {
        return Ok(weights);
    };
    let names = MoeNames::of(cfg.arch);
    let mut map: std::collections::HashMap<String, Tensor> = weights.iter().cloned().collect();
    let mut layer_of = std::collections::HashMap::new();
    for i in 0..cfg.num_hidden_layers {
        layer_of.insert(names.router(i), i);
    }
    let mut out = Vec::with_capacity(weights.len());
    for (k, _) in &weights {
        if !map.contains_key(k) {
            continue; // an expert's part or the router's bias: written with the router
        }
        let Some(&i) = layer_of.get(k) else {
            out.push((k.clone(), map.remove(k).expect("checked above")));
            continue;
        };
        let mut fetch = |n: &str| -> Result<Tensor> {
            map.remove(n)
                .ok_or_else(|| candle_core::Error::msg(format!("weight `{n}` is missing")))
        };
        let router = names.router(i);
        out.push((
            format!("model.layers.{i}.mlp.router.weight"),
            fetch(&router)?,
        ));
        out.push((
            format!("model.layers.{i}.mlp.router.bias"),
            fetch(&MoeNames::bias_of(&router))?,
        ));
        let (mut gate_up, mut gate_up_bias, mut down, mut down_bias) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for x in 0..m.num_experts {
            let [g, u, d] = names.expert(i, x);
            // Gate and up rows interleaved: (width, 2, …) flattened.
            let interleave = |a: Tensor, b: Tensor| interleave_rows(&[a, b]);
            let gu = interleave(fetch(&g)?, fetch(&u)?)?;
            gate_up.push(gu.t()?);
            gate_up_bias.push(interleave(
                fetch(&MoeNames::bias_of(&g))?,
                fetch(&MoeNames::bias_of(&u))?,
            )?);
            down.push(fetch(&d)?.t()?);
            down_bias.push(fetch(&MoeNames::bias_of(&d))?);
        }
        let [gu, gub, dn, db] = gpt_oss_files(i);
        out.push((gu, Tensor::stack(&gate_up, 0)?.contiguous()?));
        out.push((gub, Tensor::stack(&gate_up_bias, 0)?));
        out.push((dn, Tensor::stack(&down, 0)?.contiguous()?));
        out.push((db, Tensor::stack(&down_bias, 0)?));
    }
    Ok(out)
}
