//! Gemma 4's text model ([`crate::config::Arch::Gemma4`], `gemma4_text`): what its layers have
//! beyond Gemma 3's, as transformers' `Gemma4TextModel` computes it.
//!
//! - Sliding and full layers with heads of their own: the full layers' width and key/value
//!   heads from `per_layer_config` (transformers' per-layer overrides; older configs:
//!   `global_head_dim`, `num_global_key_value_heads`), their RoPE `proportional` (the first
//!   `partial_rotary_factor` of each head's frequencies turn, as a head of the full width's
//!   would, the others not at all).
//! - `attention_k_eq_v`: the full layers have no `v_proj`; their values are the keys' projection
//!   (before the key norm and RoPE).
//! - Values RMS-normalised per head without weight; q and k per head with weights; scores
//!   unscaled.
//! - `num_kv_shared_layers`: the last layers have no keys and values of their own: each attends
//!   over those of the last earlier layer of its kind ([`Gemma4Config::kv_source`]).
//! - Per-layer embeddings (`hidden_size_per_layer_input`): a second embedding table
//!   `(vocab_size_per_layer_input, layers · width)` and a projection of the embeddings give each
//!   layer a `width`-wide input, which gates a residual branch after its MLP
//!   ([`PerLayerEmbedding`]).
//! - `use_double_wide_mlp`: the KV-sharing layers' MLPs twice `intermediate_size` wide.
//! - `enable_moe_block` (gemma-4-26B-A4B): beside each layer's MLP a mixture of experts on the
//!   same residual stream, routed by a router with a norm and scales of its own, the two
//!   outputs normalised apart and summed ([`ExpertBlock`]).
//! - A scalar per layer (`layer_scalar`, a buffer of the checkpoint) on its output.

use candle_core::{Result, Tensor, bail};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::model::{Linear, RmsNorm};

/// The Gemma 4 fields of a [`crate::config::ModelConfig`] (whose `head_dim`,
/// `num_key_value_heads` and `rope_theta` are the sliding layers').
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Gemma4Config {
    /// The full-attention layers' head width.
    pub global_head_dim: usize,
    /// The full-attention layers' key/value heads.
    pub global_kv_heads: usize,
    /// The full layers' RoPE base.
    pub global_rope_theta: f64,
    /// The share of each full-layer head's frequencies that turn (`partial_rotary_factor` of
    /// a `proportional` RoPE; 1 for `default`).
    pub global_rope_fraction: f64,
    /// The full layers' frequency divisor (`factor` of a `proportional` RoPE).
    pub global_rope_factor: f64,
    /// The full layers' values are their keys' projection (`attention_k_eq_v`).
    pub k_eq_v: bool,
    /// The last layers that reuse earlier layers' keys and values (`num_kv_shared_layers`).
    pub kv_shared_layers: usize,
    /// Per-layer embeddings: `(vocab_size_per_layer_input, hidden_size_per_layer_input)`.
    pub per_layer_input: Option<(usize, usize)>,
    /// The KV-sharing layers' MLPs are twice as wide (`use_double_wide_mlp`).
    pub double_wide_mlp: bool,
    /// The experts beside every layer's MLP (`enable_moe_block`).
    #[serde(default)]
    pub experts: Option<Gemma4Experts>,
}

/// Gemma 4's mixture of experts (`enable_moe_block`): `num_experts` experts
/// `moe_intermediate_size` wide, `top_k_experts` per token.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Gemma4Experts {
    /// Experts per layer.
    pub num_experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Each expert's MLP width.
    pub width: usize,
}

/// What the sliding layers are given by `per_layer_config`: their own width and heads.
const LAYER_OVERRIDES: [&str; 2] = ["head_dim", "num_key_value_heads"];

impl Gemma4Config {
    /// Reads the Gemma 4 fields of a `gemma4_text` config; `full` lists the full-attention
    /// layers, `head_dim` / `kv_heads` are the sliding layers'.
    pub fn from_hf_json(
        v: &Value,
        num_layers: usize,
        full: &[usize],
        head_dim: usize,
        kv_heads: usize,
    ) -> Result<Self> {
        let flag = |k: &str| -> Result<bool> {
            match v.get(k) {
                None | Some(Value::Null) => Ok(false),
                Some(x) => x.as_bool().ok_or_else(|| {
                    candle_core::Error::msg(format!("field `{k}` must be true or false, not {x}"))
                }),
            }
        };
        let count = |k: &str, default: usize| -> Result<usize> {
            match v.get(k) {
                None | Some(Value::Null) => Ok(default),
                Some(x) => x.as_u64().map(|x| x as usize).ok_or_else(|| {
                    candle_core::Error::msg(format!(
                        "field `{k}` must be a non-negative integer, not {x}"
                    ))
                }),
            }
        };
        let experts = match flag("enable_moe_block")? {
            false => None,
            true => {
                let need = |k: &str| -> Result<usize> {
                    match count(k, 0)? {
                        0 => bail!("enable_moe_block = true needs `{k}` (a positive integer)"),
                        n => Ok(n),
                    }
                };
                let e = Gemma4Experts {
                    num_experts: need("num_experts")?,
                    top_k: need("top_k_experts")?,
                    width: need("moe_intermediate_size")?,
                };
                if e.top_k > e.num_experts {
                    bail!(
                        "top_k_experts = {} is more than num_experts = {}",
                        e.top_k,
                        e.num_experts
                    );
                }
                Some(e)
            }
        };
        if let Some(b) = v
            .get("use_bidirectional_attention")
            .filter(|b| !b.is_null())
            && b.as_str() != Some("vision")
        {
            bail!(
                "use_bidirectional_attention = {b} is not supported for gemma4_text (a causal language model: null or \"vision\", which text alone never meets)"
            );
        }
        let k_eq_v = flag("attention_k_eq_v")?;
        // The full layers' overrides: `per_layer_config` (transformers 5.2x), else the older
        // top-level fields, whose defaults transformers applies when neither is there.
        let (global_head_dim, global_kv_heads) = match v.get("per_layer_config") {
            Some(Value::Object(o)) => {
                let mut found: Option<(usize, usize)> = None;
                for (k, over) in o {
                    let Some(i) = k.parse::<usize>().ok().filter(|i| *i < num_layers) else {
                        bail!(
                            "per_layer_config key `{k}` must be a layer index below {num_layers}"
                        );
                    };
                    let Value::Object(over) = over else {
                        bail!("per_layer_config.{k} must be an object, not {over}");
                    };
                    if let Some(x) = over.keys().find(|x| !LAYER_OVERRIDES.contains(&x.as_str())) {
                        bail!(
                            "per_layer_config.{k}.{x} is not supported (a layer may override head_dim and num_key_value_heads)"
                        );
                    }
                    let get = |x: &str, default: usize| -> Result<usize> {
                        match over.get(x) {
                            None => Ok(default),
                            Some(n) => n.as_u64().filter(|n| *n > 0).map(|n| n as usize).ok_or_else(
                                || candle_core::Error::msg(format!("per_layer_config.{k}.{x} must be a positive integer, not {n}")),
                            ),
                        }
                    };
                    let this = (
                        get("head_dim", head_dim)?,
                        get("num_key_value_heads", kv_heads)?,
                    );
                    if !full.contains(&i) {
                        if this != (head_dim, kv_heads) {
                            bail!(
                                "per_layer_config.{k} overrides a sliding layer: only the full-attention layers may have heads of their own"
                            );
                        }
                        continue;
                    }
                    match found {
                        Some(f) if f != this => bail!(
                            "per_layer_config.{k} gives full layer {i} heads {this:?} (head_dim, num_key_value_heads), another full layer {f:?}: the full layers must agree"
                        ),
                        _ => found = Some(this),
                    }
                }
                // A full layer the mapping leaves out keeps the sliding layers' heads.
                match (found, full.iter().all(|i| o.contains_key(&i.to_string()))) {
                    (Some(f), true) => f,
                    (None, _) => (head_dim, kv_heads),
                    (Some(_), false) => bail!(
                        "per_layer_config overrides some full-attention layers and not others: the full layers must agree"
                    ),
                }
            }
            Some(Value::Null) | None => (
                count("global_head_dim", 512)?,
                match (k_eq_v, v.get("num_global_key_value_heads")) {
                    (true, Some(n)) if !n.is_null() => count("num_global_key_value_heads", 0)?,
                    _ => kv_heads,
                },
            ),
            Some(x) => bail!("field `per_layer_config` must be an object, not {x}"),
        };
        if global_head_dim == 0 || global_kv_heads == 0 || !global_head_dim.is_multiple_of(2) {
            bail!(
                "the full layers' head_dim {global_head_dim} and num_key_value_heads {global_kv_heads} must be positive, the width even"
            );
        }
        // RoPE: one set per layer type.
        let params = v.get("rope_parameters").filter(|p| !p.is_null());
        let full_rope = params.and_then(|p| p.get("full_attention"));
        let (global_rope_theta, global_rope_fraction, global_rope_factor) = match full_rope {
            None => (1_000_000.0, 0.25, 1.0),
            Some(p) => {
                let num = |k: &str, default: f64| -> Result<f64> {
                    match p.get(k) {
                        None | Some(Value::Null) => Ok(default),
                        Some(x) => x.as_f64().ok_or_else(|| {
                            candle_core::Error::msg(format!(
                                "rope_parameters.full_attention.{k} must be a number, not {x}"
                            ))
                        }),
                    }
                };
                let theta = num("rope_theta", 1_000_000.0)?;
                match p
                    .get("rope_type")
                    .and_then(Value::as_str)
                    .unwrap_or("default")
                {
                    "default" => (theta, 1.0, 1.0),
                    "proportional" => {
                        let f = num("partial_rotary_factor", 1.0)?;
                        if !(0.0..=1.0).contains(&f) {
                            bail!(
                                "rope_parameters.full_attention.partial_rotary_factor = {f} must be between 0 and 1"
                            );
                        }
                        (theta, f, num("factor", 1.0)?)
                    }
                    other => bail!(
                        "rope_parameters.full_attention.rope_type `{other}` is not supported for gemma4_text (default or proportional)"
                    ),
                }
            }
        };
        let kv_shared_layers = count("num_kv_shared_layers", 0)?;
        // Absent: the class default (256); null, as the larger models write it: none.
        let width = match v.get("hidden_size_per_layer_input") {
            Some(Value::Null) => 0,
            _ => count("hidden_size_per_layer_input", 256)?,
        };
        let per_layer_input = match width {
            0 => None,
            w => Some((count("vocab_size_per_layer_input", 262_144)?, w)),
        };
        let g = Gemma4Config {
            global_head_dim,
            global_kv_heads,
            global_rope_theta,
            global_rope_fraction,
            global_rope_factor,
            k_eq_v,
            kv_shared_layers,
            per_layer_input,
            double_wide_mlp: flag("use_double_wide_mlp")?,
            experts,
        };
        let sliding: Vec<usize> = (0..num_layers).filter(|i| !full.contains(i)).collect();
        g.check_sharing(num_layers, &sliding)?;
        Ok(g)
    }

    /// Refuses a KV sharing transformers cannot run: all layers sharing, or a kind of layer
    /// among the sharing ones with no earlier layer of its kind.
    pub fn check_sharing(&self, num_layers: usize, sliding: &[usize]) -> Result<()> {
        if self.kv_shared_layers == 0 {
            return Ok(());
        }
        if self.kv_shared_layers >= num_layers {
            bail!(
                "num_kv_shared_layers = {} leaves no layer with keys and values of its own ({num_layers} layers)",
                self.kv_shared_layers
            );
        }
        for i in num_layers - self.kv_shared_layers..num_layers {
            if self.kv_source(num_layers, sliding, i).is_none() {
                bail!(
                    "num_kv_shared_layers = {}: layer {i} has no earlier layer of its kind whose keys and values it could reuse",
                    self.kv_shared_layers
                );
            }
        }
        Ok(())
    }

    /// The first layer that reuses another's keys and values.
    pub fn first_shared(&self, num_layers: usize) -> usize {
        num_layers.saturating_sub(self.kv_shared_layers)
    }

    /// The layer whose keys and values layer `i` attends over, when it has none of its own:
    /// the last layer of its kind (sliding or full, `sliding` listing the sliding layers)
    /// before the first sharing one.
    pub fn kv_source(&self, num_layers: usize, sliding: &[usize], i: usize) -> Option<usize> {
        let first = self.first_shared(num_layers);
        if i < first {
            return None;
        }
        let kind = sliding.contains(&i);
        (0..first).rev().find(|j| sliding.contains(j) == kind)
    }

    /// The full layers' RoPE inverse frequencies `(global_head_dim / 2,)`: a head of the full
    /// width's, the first `fraction` of them turning, the rest 0 (transformers'
    /// `_compute_proportional_rope_parameters`).
    pub fn global_inv_freq(&self) -> Vec<f64> {
        let d = self.global_head_dim;
        // transformers: `int(fraction * head_dim // 2)`.
        let turning = ((self.global_rope_fraction * d as f64) / 2.0).floor() as usize;
        (0..d / 2)
            .map(|i| match i < turning {
                true => {
                    // The exponent in f32, as torch computes it.
                    let e = (2 * i) as f32 / d as f32;
                    1.0 / self.global_rope_theta.powf(e as f64) / self.global_rope_factor
                }
                false => 0.0,
            })
            .collect()
    }

    /// The config's Gemma 4 fields as transformers writes them (into `obj`); `full` lists
    /// the full-attention layers, `head_dim`/`kv_heads` are the sliding ones'.
    pub fn write_hf_json(
        &self,
        obj: &mut serde_json::Map<String, Value>,
        full: &[usize],
        sliding_theta: f64,
    ) {
        let over = serde_json::json!({
            "head_dim": self.global_head_dim,
            "num_key_value_heads": self.global_kv_heads,
        });
        let per_layer: serde_json::Map<String, Value> =
            full.iter().map(|i| (i.to_string(), over.clone())).collect();
        obj.insert("per_layer_config".into(), Value::Object(per_layer));
        let full_rope = match self.global_rope_fraction == 1.0 && self.global_rope_factor == 1.0 {
            true => {
                serde_json::json!({"rope_type": "default", "rope_theta": self.global_rope_theta})
            }
            false => {
                let mut p = serde_json::json!({
                    "rope_type": "proportional",
                    "rope_theta": self.global_rope_theta,
                    "partial_rotary_factor": self.global_rope_fraction,
                });
                // transformers reads a `factor` but its validation does not know it: written
                // only when it divides.
                if self.global_rope_factor != 1.0 {
                    p["factor"] = self.global_rope_factor.into();
                }
                p
            }
        };
        obj.insert(
            "rope_parameters".into(),
            serde_json::json!({
                "full_attention": full_rope,
                "sliding_attention": {"rope_type": "default", "rope_theta": sliding_theta},
            }),
        );
        obj.remove("rope_theta");
        obj.insert("attention_k_eq_v".into(), self.k_eq_v.into());
        obj.insert("num_kv_shared_layers".into(), self.kv_shared_layers.into());
        let (vocab, width) = self.per_layer_input.unwrap_or((0, 0));
        obj.insert("hidden_size_per_layer_input".into(), width.into());
        if self.per_layer_input.is_some() {
            obj.insert("vocab_size_per_layer_input".into(), vocab.into());
        }
        obj.insert("use_double_wide_mlp".into(), self.double_wide_mlp.into());
        obj.insert("enable_moe_block".into(), self.experts.is_some().into());
        if let Some(e) = &self.experts {
            obj.insert("num_experts".into(), e.num_experts.into());
            obj.insert("top_k_experts".into(), e.top_k.into());
            obj.insert("moe_intermediate_size".into(), e.width.into());
        }
    }
}

/// A layer's per-layer-input branch: `x + norm(projection(gelu(gate(x)) · input))`.
#[derive(Debug, Clone)]
pub struct PerLayerBranch {
    /// `per_layer_input_gate` `(width, hidden)`.
    pub gate: Linear,
    /// `per_layer_projection` `(hidden, width)`.
    pub projection: Linear,
    /// `post_per_layer_input_norm` `(hidden,)`.
    pub norm: RmsNorm,
}

impl PerLayerBranch {
    /// The residual stream `x` `(N, hidden)` after the branch, `input` `(N, width)` this
    /// layer's per-layer input; `act` the model's activation.
    pub fn forward(
        &self,
        x: &Tensor,
        input: &Tensor,
        act: &dyn Fn(&Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let g = (act(&self.gate.forward(x)?)? * input)?;
        x + self.norm.forward(&self.projection.forward(&g)?)?
    }

    /// The branch's tensors with `f` applied.
    pub fn map(&self, f: &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<Self> {
        Ok(Self {
            gate: crate::model::map_linear(&self.gate, f)?,
            projection: crate::model::map_linear(&self.projection, f)?,
            norm: self.norm.map(f)?,
        })
    }
}

/// A layer's experts beside its MLP (`enable_moe_block`): of the residual stream `x` after the
/// attention, the router reads `norm(x) · scale / √hidden` (`norm` without weight), the experts
/// `pre_feedforward_layernorm_2(x)`; the MLP's output `y` and theirs are normalised apart
/// (`post_feedforward_layernorm_1`, `_2`) and summed.
#[derive(Debug, Clone)]
pub struct ExpertBlock {
    /// The router (`router.proj`) and the experts, each chosen weight times its
    /// `router.per_expert_scale` ([`crate::moe::Moe::expert_scale`]).
    pub moe: crate::moe::Moe,
    /// `router.scale` `(hidden,)`.
    pub router_scale: Tensor,
    /// The router's norm (no weight).
    pub router_norm: RmsNorm,
    /// `pre_feedforward_layernorm_2`.
    pub pre_norm: RmsNorm,
    /// `post_feedforward_layernorm_2`.
    pub post_norm: RmsNorm,
    /// `post_feedforward_layernorm_1` (of the MLP's output).
    pub mlp_norm: RmsNorm,
}

impl ExpertBlock {
    /// The sum of the MLP's output `y` `(N, hidden)` and the experts' of the residual stream
    /// `x` `(N, hidden)`, each normalised; `act` the gate activation.
    pub fn forward(
        &self,
        x: &Tensor,
        y: &Tensor,
        act: &dyn Fn(&Tensor, &Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let hidden = x.dim(1)? as f64;
        let routed = self
            .router_norm
            .forward(x)?
            .broadcast_mul(&self.router_scale)?
            .affine(hidden.powf(-0.5), 0.0)?;
        let e = self
            .moe
            .forward_routed(&self.pre_norm.forward(x)?, &routed, act, None)?;
        self.mlp_norm.forward(y)? + self.post_norm.forward(&e)?
    }

    /// Its trained norms' weights (the router's has none).
    pub fn norms(&self) -> [&RmsNorm; 3] {
        [&self.pre_norm, &self.post_norm, &self.mlp_norm]
    }

    /// The tensors with `f` applied.
    pub fn map(&self, f: &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<Self> {
        Ok(Self {
            moe: self.moe.map(f)?,
            router_scale: f(&self.router_scale)?,
            router_norm: self.router_norm.map(f)?,
            pre_norm: self.pre_norm.map(f)?,
            post_norm: self.post_norm.map(f)?,
            mlp_norm: self.mlp_norm.map(f)?,
        })
    }
}

/// The model's names of layer `i`'s expert `x`'s gate, up and down (its files hold them fused:
/// [`FUSED_EXPERTS`]).
pub fn expert_names(i: usize, x: usize) -> [String; 3] {
    ["gate_proj", "up_proj", "down_proj"]
        .map(|n| format!("model.layers.{i}.experts.{x}.{n}.weight"))
}

/// The files' fused experts of a layer, after `model.layers.{i}.experts.`: `gate_up_proj`
/// `(experts, 2 · width, hidden)` (each expert's gate rows, then its up rows) and `down_proj`
/// `(experts, hidden, width)`.
pub const FUSED_EXPERTS: [&str; 2] = ["gate_up_proj", "down_proj"];

/// Gemma 4's fused experts (as its files hold them) under the model's names, one gate, up and
/// down per expert ([`expert_names`]); a tensor of the wrong shape is an error naming it.
pub fn split_experts(
    cfg: &crate::config::ModelConfig,
    weights: &mut crate::model::WeightMap,
) -> Result<()> {
    let Some(e) = cfg.gemma4.as_ref().and_then(|g| g.experts) else {
        return Ok(());
    };
    let (n, w, h) = (e.num_experts, e.width, cfg.hidden_size);
    for i in 0..cfg.num_hidden_layers {
        let [gu, d] = FUSED_EXPERTS.map(|f| format!("model.layers.{i}.experts.{f}"));
        for (key, shape) in [(&gu, [n, 2 * w, h]), (&d, [n, h, w])] {
            if let Some(t) = weights.get(key)
                && t.dims() != shape
            {
                bail!(
                    "weight `{key}` has shape {:?}, expected {shape:?} (config.json's num_experts, moe_intermediate_size, hidden_size)",
                    t.dims()
                );
            }
        }
        let (gate_up, down) = (weights.remove(&gu), weights.remove(&d));
        crate::layout::insert_experts(weights, &|x| expert_names(i, x), n, w, gate_up, down)?;
    }
    Ok(())
}

/// The inverse of [`split_experts`]: each layer's experts fused, in the place of its first
/// expert's gate.
pub fn fuse_experts(
    cfg: &crate::config::ModelConfig,
    weights: Vec<(String, Tensor)>,
) -> Result<Vec<(String, Tensor)>> {
    let Some(e) = cfg.gemma4.as_ref().and_then(|g| g.experts) else {
        return Ok(weights);
    };
    let mut map: std::collections::HashMap<String, Tensor> = weights.iter().cloned().collect();
    let mut out = Vec::with_capacity(weights.len());
    for (k, _) in &weights {
        let Some(t) = map.remove(k) else {
            continue; // an expert's part, fused already
        };
        let layer = (0..cfg.num_hidden_layers).find(|i| *k == expert_names(*i, 0)[0]);
        let Some(i) = layer else {
            out.push((k.clone(), t));
            continue;
        };
        let mut take = |name: &str| -> Result<Tensor> {
            match name == k {
                true => Ok(t.clone()),
                false => map
                    .remove(name)
                    .ok_or_else(|| candle_core::Error::msg(format!("weight `{name}` is missing"))),
            }
        };
        let mut gate_up = Vec::with_capacity(e.num_experts);
        let mut down = Vec::with_capacity(e.num_experts);
        for x in 0..e.num_experts {
            let [g, u, d] = expert_names(i, x);
            gate_up.push(Tensor::cat(&[take(&g)?, take(&u)?], 0)?);
            down.push(take(&d)?);
        }
        let [gu, d] = FUSED_EXPERTS.map(|f| format!("model.layers.{i}.experts.{f}"));
        out.push((gu, Tensor::stack(&gate_up, 0)?));
        out.push((d, Tensor::stack(&down, 0)?));
    }
    Ok(out)
}

/// The model's per-layer embeddings: each token's per-layer inputs, from a table of their own
/// and a projection of the (scaled) embeddings.
#[derive(Debug, Clone)]
pub struct PerLayerEmbedding {
    /// `embed_tokens_per_layer` `(vocab_size_per_layer_input, layers · width)`.
    pub embed: Tensor,
    /// `per_layer_model_projection` `(layers · width, hidden)`.
    pub projection: Linear,
    /// `per_layer_projection_norm` `(width,)`.
    pub norm: RmsNorm,
    /// Each layer's input width.
    pub width: usize,
}

impl PerLayerEmbedding {
    /// Every layer's input `(N, layers · width)` (layer `i`'s are columns `i·width..`) of the
    /// tokens `ids` `(N,)` whose scaled embeddings are `x` `(N, hidden)`:
    /// `(norm(projection(x) / √hidden) + table[ids] · √width) / √2`.
    pub fn forward(&self, ids: &Tensor, x: &Tensor) -> Result<Tensor> {
        let n = x.dim(0)?;
        let layers = self.embed.dim(1)? / self.width;
        let hidden = x.dim(1)? as f64;
        let tok = self.embed.index_select(ids, 0)?;
        // transformers rounds the table's scale to its dtype.
        let scale = crate::model::embedding_scale(self.width, self.embed.dtype())?;
        let tok = tok.affine(scale, 0.0)?;
        let proj = self.projection.forward(x)?.affine(hidden.powf(-0.5), 0.0)?;
        let proj = self
            .norm
            .forward(&proj.reshape((n, layers, self.width))?)?
            .reshape((n, layers * self.width))?;
        (proj + tok.to_dtype(x.dtype())?)? * std::f64::consts::FRAC_1_SQRT_2
    }

    /// The tensors with `f` applied.
    pub fn map(&self, f: &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<Self> {
        Ok(Self {
            embed: f(&self.embed)?,
            projection: crate::model::map_linear(&self.projection, f)?,
            norm: self.norm.map(f)?,
            width: self.width,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(v: Value) -> Result<Gemma4Config> {
        Gemma4Config::from_hf_json(&v, 6, &[2, 5], 8, 2)
    }

    #[test]
    fn full_layers_take_their_heads_from_either_layout() {
        let a = cfg(serde_json::json!({
            "per_layer_config": {"2": {"head_dim": 16, "num_key_value_heads": 1},
                                 "5": {"head_dim": 16, "num_key_value_heads": 1}},
            "hidden_size_per_layer_input": 0,
        }))
        .unwrap();
        assert_eq!((a.global_head_dim, a.global_kv_heads), (16, 1));
        assert_eq!(a.per_layer_input, None);
        // The older layout: the kv heads only with k_eq_v, as transformers applies them.
        let b = cfg(
            serde_json::json!({"global_head_dim": 16, "num_global_key_value_heads": 1,
            "attention_k_eq_v": true}),
        )
        .unwrap();
        assert_eq!((b.global_head_dim, b.global_kv_heads), (16, 1));
        assert_eq!(b.per_layer_input, Some((262_144, 256)));
        let n = cfg(serde_json::json!({"hidden_size_per_layer_input": null})).unwrap();
        assert_eq!(n.per_layer_input, None);
        let c = cfg(serde_json::json!({"global_head_dim": 16, "num_global_key_value_heads": 1}))
            .unwrap();
        assert_eq!((c.global_head_dim, c.global_kv_heads), (16, 2));
        // transformers' default full width.
        assert_eq!(cfg(serde_json::json!({})).unwrap().global_head_dim, 512);
    }

    #[test]
    fn refusals_name_their_field() {
        for (v, key) in [
            (
                serde_json::json!({"enable_moe_block": true}),
                "enable_moe_block",
            ),
            (
                serde_json::json!({"per_layer_config": {"0": {"head_dim": 16}}}),
                "per_layer_config.0",
            ),
            (
                serde_json::json!({"per_layer_config": {"2": {"sliding_window": 4}}}),
                "per_layer_config.2.sliding_window",
            ),
            (
                serde_json::json!({"per_layer_config": {"2": {"head_dim": 16}, "5": {"head_dim": 32}}}),
                "per_layer_config.",
            ),
            (
                serde_json::json!({"rope_parameters": {"full_attention": {"rope_type": "yarn"}}}),
                "rope_type `yarn`",
            ),
            (
                serde_json::json!({"num_kv_shared_layers": 6}),
                "num_kv_shared_layers",
            ),
            (
                serde_json::json!({"use_bidirectional_attention": "all"}),
                "use_bidirectional_attention",
            ),
        ] {
            let e = cfg(v).unwrap_err().to_string();
            assert!(e.contains(key), "{e}");
        }
    }

    #[test]
    fn sharing_layers_reuse_the_last_earlier_layer_of_their_kind() {
        let g = cfg(serde_json::json!({"num_kv_shared_layers": 2})).unwrap();
        let sliding = [0, 1, 3, 4];
        let src: Vec<_> = (0..6).map(|i| g.kv_source(6, &sliding, i)).collect();
        assert_eq!(src, [None, None, None, None, Some(3), Some(2)]);
        // Layers 3..6 share: layer 5 (full) finds layer 2, layers 3 and 4 (sliding) layer 1.
        let g = cfg(serde_json::json!({"num_kv_shared_layers": 3})).unwrap();
        let src: Vec<_> = (0..6).map(|i| g.kv_source(6, &sliding, i)).collect();
        assert_eq!(src, [None, None, None, Some(1), Some(1), Some(2)]);
        // Sharing from layer 2 on: no full layer before it.
        let e = Gemma4Config::from_hf_json(
            &serde_json::json!({"num_kv_shared_layers": 4}),
            6,
            &[2, 5],
            8,
            2,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("layer 2 has no earlier layer"), "{e}");
    }

    #[test]
    fn proportional_rope_turns_the_first_frequencies_of_a_full_width_head() {
        let g = cfg(serde_json::json!({"global_head_dim": 16})).unwrap();
        let inv = g.global_inv_freq();
        assert_eq!(inv.len(), 8);
        // 0.25 of 16 → 2 turning frequencies, exponents over the full width.
        assert_eq!(inv[0], 1.0);
        assert!((inv[1] - 1e6f64.powf(-2.0 / 16.0)).abs() < 1e-12);
        assert!(inv[2..].iter().all(|f| *f == 0.0));
    }
}
