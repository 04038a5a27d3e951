//! The transformer: a Llama-family decoder written on differentiable candle ops.
//!
//! Every op used has a backward: candle's own (matmul, index_select, ...) or, for RMSNorm, RoPE,
//! SiLU·mul and the attention softmax, our fused ops with a real backward ([`crate::fused`]: CPU
//! kernels, CUDA kernels, or compositions recomputed in backward), never candle-nn's fused
//! kernels, which cut the gradient (see docs/ARCHITECTURE.md). The same code serves training
//! (weights are candle `Var`s and record a graph), generation and the frozen reference (weights
//! are detached tensors). Frozen q/k/v and gate/up weights are stored packed ([`Packed`]), so a
//! pass over a KV cache runs each group as one product.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{D, DType, Device, Result, Tensor, bail};
use grpo_core::fused::Path;
use grpo_core::recompute::{GradSink, Recompute};

use crate::config::{Arch, ModelConfig};
use crate::lora::Lora;
use crate::moe::{Expert, Moe, MoeNames};

/// A large finite negative used for masked attention scores (never -inf: fully masked rows
/// must stay finite).
fn mask_value(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => -6.0e4,
        _ => -1.0e9,
    }
}

/// A linear map `y = x Wᵀ + b`, with an optional LoRA path `scale · B A x` (see [`Lora::forward`]).
#[derive(Debug, Clone)]
pub struct Linear {
    /// `(out, in)` weight.
    pub weight: Tensor,
    /// `(out,)` bias.
    pub bias: Option<Tensor>,
    /// Low-rank adapter, when this module is a LoRA target.
    pub lora: Option<Lora>,
    /// `weightᵀ` stored contiguous `(in, out)`, set by [`Transformer::for_decoding`]: for the
    /// few-row matmuls of decoding it is 2-3x faster than the transposed view.
    pub weight_t: Option<Tensor>,
}

impl Linear {
    /// The stand-in for a dense MLP map an MoE layer does not have (no elements; skipped by
    /// [`Transformer::weights`], adapters and packing).
    pub fn absent(dtype: DType, device: &Device) -> Result<Self> {
        Ok(Linear {
            weight: Tensor::zeros((0, 0), dtype, device)?,
            bias: None,
            lora: None,
            weight_t: None,
        })
    }

    /// Whether this is [`Self::absent`]'s stand-in.
    pub fn is_absent(&self) -> bool {
        self.weight.elem_count() == 0
    }
}

/// Up to this many rows, a matmul uses the stored transpose when there is one.
const DECODE_ROWS: usize = 512;

impl Linear {
    /// Applies the map to `(..., in)`. Rows `(N, in)` take no reshape (each reshape of a
    /// tracked tensor is a node whose backward costs a zeroed buffer and an add).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.rank() == 2 {
            return self.forward_rows(x);
        }
        let dims = x.dims().to_vec();
        let (lead, last) = dims.split_at(dims.len() - 1);
        let n: usize = lead.iter().product();
        let y = self.forward_rows(&x.reshape((n, last[0]))?)?;
        let mut shape = lead.to_vec();
        shape.push(self.weight.dim(0)?);
        y.reshape(shape)
    }

    /// `res + self(x)` for rows `x` `(N, in)` and `res` `(N, out)` (a residual add after the
    /// projection): one graph node without an adapter ([`crate::fused::affine`]).
    pub fn forward_residual(&self, res: &Tensor, x: &Tensor) -> Result<Tensor> {
        if self.lora.is_none()
            && x.rank() == 2
            && let Some(y) = crate::fused::affine(Some(res), x, &self.weight, self.bias.as_ref())?
        {
            return Ok(y);
        }
        res + self.forward(x)?
    }

    /// `x Wᵀ` of rows `(N, in)` (no bias, no adapter).
    fn product(&self, x2: &Tensor) -> Result<Tensor> {
        match &self.weight_t {
            Some(wt) if x2.dim(0)? <= DECODE_ROWS => crate::fused::matmul(x2, wt),
            _ => crate::fused::frozen_linear(x2, &self.weight),
        }
    }

    /// [`Self::forward`] on `(N, in)`.
    fn forward_rows(&self, x2: &Tensor) -> Result<Tensor> {
        if let Some(l) = &self.lora
            && let Some(y) = l.fused_projection(x2, &self.weight, self.bias.as_ref())?
        {
            return Ok(y);
        }
        if self.lora.is_none()
            && (self.bias.is_some() || self.weight.track_op())
            && let Some(y) = crate::fused::affine(None, x2, &self.weight, self.bias.as_ref())?
        {
            return Ok(y);
        }
        let xw = self.product(x2)?;
        let mut y = match &self.bias {
            Some(b) => xw.broadcast_add(b)?,
            None => xw.clone(),
        };
        if let Some(l) = &self.lora {
            y = (y + l.forward(x2, &xw, &self.weight)?)?;
        }
        Ok(y)
    }
}

/// RMSNorm `x / sqrt(mean(x²) + eps) · w`, computed in f32 (or f64) as transformers does.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    /// `(hidden,)` scale.
    pub weight: Tensor,
    /// Epsilon.
    pub eps: f64,
    /// Gemma's: the rows are scaled by `1 + weight`.
    pub unit_offset: bool,
    /// No norm at all: the rows pass as they are (OLMo 2's layers have no pre-norms; the
    /// weight is an empty placeholder, neither trained nor saved).
    pub identity: bool,
}

impl RmsNorm {
    /// Normalises over the last axis (fused on CPU, see [`crate::fused::rms_norm`]).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if self.identity {
            return Ok(x.clone());
        }
        crate::fused::rms_norm(x, &self.scale()?, self.eps)
    }

    /// `x + y` and its normalised rows ([`crate::fused::add_rms_norm`]).
    pub fn add_forward(&self, x: &Tensor, y: &Tensor) -> Result<(Tensor, Tensor)> {
        if self.identity {
            let s = (x + y)?;
            return Ok((s.clone(), s));
        }
        crate::fused::add_rms_norm(x, y, &self.scale()?, self.eps)
    }

    /// The norm with `f` applied to its weight.
    pub fn map(&self, f: &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<Self> {
        Ok(Self {
            weight: f(&self.weight)?,
            ..self.clone()
        })
    }

    /// What the normalised rows are multiplied by: the weight, or `1 + weight` (made per
    /// call, with the weight's gradient through it, on the weight's device).
    pub fn scale(&self) -> Result<Tensor> {
        match self.unit_offset {
            true => self.weight.affine(1.0, 1.0),
            false => Ok(self.weight.clone()),
        }
    }
}

/// Linear maps of the same input stored as one: the packed weight `(Σ out, in)` (and bias)
/// whose row blocks the parts' own weights are views of, so a pass over a KV cache runs q, k, v
/// as one product and the MLP's gate and up as another, at no memory cost. A part whose weight
/// or bias is later replaced (a trainable `Var`, merged adapters) makes the pack stale: it is
/// then not used, and [`Transformer::pack_projections`] packs again.
#[derive(Debug, Clone)]
pub struct Packed {
    /// The packed map (its `weight_t` set on the CPU by [`Transformer::for_decoding`]).
    pub linear: Linear,
    /// Output rows of each part, in order.
    pub sizes: Vec<usize>,
    /// The parts' weight and bias tensors that are views of the pack.
    ids: Vec<(candle_core::TensorId, Option<candle_core::TensorId>)>,
}

impl Packed {
    /// Packs `parts` (same input size, dtype and device) and makes their weights and biases
    /// views of the pack; `None` when a part's weight or bias is trainable (a `Var` changes in
    /// place, a view of a copy would not follow it).
    fn pack(parts: &mut [&mut Linear]) -> Result<Option<Self>> {
        let tracked =
            |l: &Linear| l.weight.is_variable() || l.bias.as_ref().is_some_and(|b| b.is_variable());
        if parts.len() < 2 || parts.iter().any(|l| tracked(l)) {
            return Ok(None);
        }
        // Parts that cannot share a storage (mixed types or devices, other input sizes) stay
        // apart.
        let w0 = &parts[0].weight;
        let alike = |t: &Tensor| t.dtype() == w0.dtype() && t.device().same_device(w0.device());
        let fits = parts.iter().all(|l| {
            alike(&l.weight)
                && l.weight.rank() == 2
                && l.weight.dim(1).ok() == w0.dim(1).ok()
                && l.bias.as_ref().is_none_or(alike)
        });
        if !fits {
            return Ok(None);
        }
        let weights: Vec<Tensor> = parts.iter().map(|l| l.weight.detach()).collect();
        let sizes = weights
            .iter()
            .map(|w| w.dim(0))
            .collect::<Result<Vec<_>>>()?;
        let weight = Tensor::cat(&weights, 0)?;
        let bias = if parts.iter().any(|l| l.bias.is_some()) {
            let b = parts
                .iter()
                .zip(&sizes)
                .map(|(l, &n)| match &l.bias {
                    Some(b) => Ok(b.detach()),
                    None => Tensor::zeros(n, weight.dtype(), weight.device()),
                })
                .collect::<Result<Vec<_>>>()?;
            Some(Tensor::cat(&b, 0)?)
        } else {
            None
        };
        let linear = Linear {
            weight,
            bias,
            lora: None,
            weight_t: None,
        };
        let mut packed = Self {
            linear,
            sizes,
            ids: Vec::new(),
        };
        packed.view_parts(parts)?;
        Ok(Some(packed))
    }

    /// Points the parts' weights (and biases, where they have one) at the pack's rows.
    fn view_parts(&mut self, parts: &mut [&mut Linear]) -> Result<()> {
        let mut at = 0;
        self.ids.clear();
        for (l, &n) in parts.iter_mut().zip(&self.sizes) {
            l.weight = self.linear.weight.narrow(0, at, n)?;
            if l.bias.is_some()
                && let Some(b) = &self.linear.bias
            {
                l.bias = Some(b.narrow(0, at, n)?);
            }
            l.weight_t = None;
            self.ids
                .push((l.weight.id(), l.bias.as_ref().map(|b| b.id())));
            at += n;
        }
        Ok(())
    }

    /// Whether `parts` still are views of this pack.
    fn holds(&self, parts: &[&Linear]) -> bool {
        parts.len() == self.ids.len()
            && parts
                .iter()
                .zip(&self.ids)
                .all(|(l, (w, b))| l.weight.id() == *w && l.bias.as_ref().map(|b| b.id()) == *b)
    }

    /// The parts' maps of rows `x` `(N, in)` side by side `(N, Σ out)`: one product, then each
    /// part's LoRA path on its columns.
    fn forward(&self, x: &Tensor, parts: &[&Linear]) -> Result<Tensor> {
        let xw = self.linear.product(x)?;
        let y = match &self.linear.bias {
            Some(b) => xw.broadcast_add(b)?,
            None => xw.clone(),
        };
        if parts.iter().all(|l| l.lora.is_none()) {
            return Ok(y);
        }
        let mut cols = Vec::with_capacity(parts.len());
        let mut at = 0;
        for (l, &n) in parts.iter().zip(&self.sizes) {
            let part = y.narrow(1, at, n)?;
            cols.push(match &l.lora {
                Some(lo) => (part + lo.forward(x, &xw.narrow(1, at, n)?, &l.weight)?)?,
                None => part,
            });
            at += n;
        }
        Tensor::cat(&cols, 1)
    }
}

/// One decoder layer's weights.
#[derive(Debug, Clone)]
pub struct Layer {
    /// Pre-attention norm.
    pub input_layernorm: RmsNorm,
    /// Query projection.
    pub q_proj: Linear,
    /// Key projection.
    pub k_proj: Linear,
    /// Value projection.
    pub v_proj: Linear,
    /// Output projection.
    pub o_proj: Linear,
    /// Qwen3's per-head query norm.
    pub q_norm: Option<RmsNorm>,
    /// Qwen3's per-head key norm.
    pub k_norm: Option<RmsNorm>,
    /// Pre-MLP norm (Gemma's `pre_feedforward_layernorm`).
    pub post_attention_layernorm: RmsNorm,
    /// Gemma's norm of the attention's output before its residual add (its
    /// `post_attention_layernorm`).
    pub attn_out_norm: Option<RmsNorm>,
    /// Gemma's norm of the MLP's output before its residual add (`post_feedforward_layernorm`).
    pub mlp_out_norm: Option<RmsNorm>,
    /// The MLP's gate activation.
    pub activation: crate::config::Activation,
    /// Granite's factor on each sublayer's output before its residual add.
    pub residual_scale: Option<f64>,
    /// MLP gate.
    pub gate_proj: Linear,
    /// MLP up.
    pub up_proj: Linear,
    /// MLP down.
    pub down_proj: Linear,
    /// q, k and v packed (see [`Packed`]).
    pub qkv: Option<Packed>,
    /// gate and up packed.
    pub gate_up: Option<Packed>,
    /// The mixture of experts in place of the MLP (gate, up and down then
    /// [`Linear::absent`]).
    pub moe: Option<Moe>,
    /// gpt-oss's learned sink of each attention head `(heads,)`
    /// ([`crate::fused::sink_attention`]).
    pub sinks: Option<Tensor>,
    /// DeepSeek's latent attention ([`crate::mla`]): then the q slot holds `q_proj` or
    /// `q_b_proj`, the k slot `kv_a_proj_with_mqa`, the v slot `kv_b_proj`.
    pub mla: Option<crate::mla::Mla>,
    /// Gemma 4's values RMS-normalised per head, without weight.
    pub v_norm: Option<RmsNorm>,
    /// Gemma 4's `attention_k_eq_v` layers: the values are the keys' projection (the v slot
    /// [`Linear::absent`]).
    pub v_from_k: bool,
    /// Gemma 4's KV-sharing layers: the layer whose keys and values this one attends over
    /// (its k and v slots [`Linear::absent`], no k norm).
    pub kv_source: Option<usize>,
    /// Gemma 4's per-layer-input branch after the MLP.
    pub per_layer: Option<crate::gemma4::PerLayerBranch>,
    /// Gemma 4's `layer_scalar` `(1,)`: the layer's output times it (a constant).
    pub layer_scalar: Option<Tensor>,
    /// Gemma 4's experts beside the MLP (`enable_moe_block`).
    pub experts: Option<crate::gemma4::ExpertBlock>,
    /// Hunyuan's q/k norms come after RoPE ([`crate::config::Arch::qk_norm_after_rope`]).
    pub norm_after_rope: bool,
    /// A recurrent token mixer in place of attention — Qwen3.5's linear attention
    /// ([`crate::delta`]), LFM2's short convolution ([`crate::shortconv`]): then the q, k, v
    /// and o slots are [`Linear::absent`].
    pub delta: Option<crate::delta::Mixer>,
    /// Qwen3.5's gated attention: `q_proj` holds each head's query rows, then (as many) the
    /// gate rows whose sigmoid scales the attention's output before `o_proj`
    /// ([`crate::layout`] reorders the files' per-head interleaving).
    pub attn_gate: bool,
}

impl Layer {
    /// The seven linear maps, read-only (same order as [`Self::linears_mut`]).
    pub fn linears(&self) -> [&Linear; 7] {
        [
            &self.q_proj,
            &self.k_proj,
            &self.v_proj,
            &self.o_proj,
            &self.gate_proj,
            &self.up_proj,
            &self.down_proj,
        ]
    }

    /// Every tensor of the layer that is a trainable candle `Var` (weights of a full fine-tune,
    /// LoRA factors of an adapter run).
    pub fn vars(&self) -> Vec<Tensor> {
        let mut out: Vec<Tensor> = Vec::new();
        let mut norms = vec![&self.input_layernorm, &self.post_attention_layernorm];
        norms.extend(self.q_norm.iter().chain(self.k_norm.iter()));
        norms.extend(self.attn_out_norm.iter().chain(self.mlp_out_norm.iter()));
        if let Some(m) = &self.mla {
            norms.push(&m.kv_a_norm);
            norms.extend(m.q_a.iter().map(|(_, n)| n));
        }
        norms.extend(self.per_layer.iter().map(|b| &b.norm));
        norms.extend(self.experts.iter().flat_map(|b| b.norms()));
        out.extend(norms.iter().map(|n| n.weight.clone()));
        out.extend(self.sinks.iter().cloned());
        if let Some(b) = &self.experts {
            out.push(b.router_scale.clone());
            out.extend(b.moe.expert_scale.iter().cloned());
        }
        if let Some(d) = &self.delta {
            out.extend(d.tensors().into_iter().map(|(_, t)| t.clone()));
        }
        for l in self.all_linears() {
            out.push(l.weight.clone());
            out.extend(l.bias.iter().cloned());
            if let Some(lo) = &l.lora {
                out.push(lo.a.clone());
                out.push(lo.b.clone());
            }
        }
        // Phi-3's fused modules give their parts one `A`: each variable once.
        let mut seen = std::collections::HashSet::new();
        out.retain(|t| t.is_variable() && seen.insert(t.id()));
        out
    }

    /// Every linear map of the layer: the seven, the experts' (with their router and shared
    /// expert), the latent attention's, Gemma 4's per-layer-input maps and experts.
    fn all_linears(&self) -> Vec<&Linear> {
        let moe = self.moe.iter().flat_map(Moe::linears);
        let mla = self.mla.iter().flat_map(crate::mla::Mla::linears);
        let branch = self.per_layer.iter().flat_map(|b| [&b.gate, &b.projection]);
        let experts = self.experts.iter().flat_map(|b| b.moe.linears());
        let delta = self.delta.iter().flat_map(|d| d.linears());
        self.linears()
            .into_iter()
            .chain(moe)
            .chain(mla)
            .chain(branch)
            .chain(experts)
            .chain(delta)
            .collect()
    }

    /// The layer's LoRA dropout streams (each once) with their current states.
    fn dropout_states(&self) -> Vec<crate::lora::DropoutState> {
        let mut out: Vec<crate::lora::DropoutState> = Vec::new();
        for l in self.all_linears() {
            if let Some(st) = l.lora.as_ref().and_then(|lo| lo.dropout_state())
                && !out.iter().any(|(r, _)| std::sync::Arc::ptr_eq(r, &st.0))
            {
                out.push(st);
            }
        }
        out
    }

    /// q `(B, L, heads, D)`, k and v `(B, L, kv_heads, D)` of normalised rows `h` `(B·L, H)`,
    /// as the projections lay them out (Qwen3's q/k norms applied, not yet rotated).
    fn projections(&self, c: &LayerCtx, h: &Tensor) -> Result<Projected> {
        if let Some(m) = &self.mla {
            let (q, k, v) =
                m.projections(&self.q_proj, &self.k_proj, &self.v_proj, h, c.b, c.l, c.nh)?;
            return Ok((q, k, v, None));
        }
        let (q, k) = (self.q_proj.forward(h)?, self.k_proj.forward(h)?);
        let v = match self.v_from_k {
            true => k.clone(),
            false => self.v_proj.forward(h)?,
        };
        // Qwen3.5's gate rows after the query rows.
        let (q, gate) = match self.attn_gate {
            true => {
                let w = c.nh * c.hd;
                (q.narrow(1, 0, w)?, Some(q.narrow(1, w, w)?))
            }
            false => (q, None),
        };
        let (q, k, v) = self.heads(c, &q, &k, &v)?;
        Ok((q, k, v, gate))
    }

    /// [`Self::projections`] of the q, k and v rows `(B·L, ·)`.
    fn heads(
        &self,
        c: &LayerCtx,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        // Per head (Qwen3, Gemma 3), or over all heads' width (OLMo 2), as the weight is long.
        let norm = |n: &Option<RmsNorm>, t: &Tensor, heads: usize| -> Result<Tensor> {
            let shape = (c.b, c.l, heads, c.hd);
            match n {
                Some(n) if heads > 1 && n.weight.dim(0)? == heads * c.hd => {
                    n.forward(t)?.reshape(shape)
                }
                Some(n) => n.forward(&t.reshape(shape)?),
                None => t.reshape(shape),
            }
        };
        // (Hunyuan's norms run after RoPE: [`Self::rotated`].)
        let (qn, kn) = match self.norm_after_rope {
            true => (&None, &None),
            false => (&self.q_norm, &self.k_norm),
        };
        let q = norm(qn, q, c.nh)?;
        let k = norm(kn, k, c.nkv)?;
        let v = norm(&self.v_norm, v, c.nkv)?;
        Ok((q, k, v))
    }

    /// q `(B, heads, L, D)` (rotated), k `(B, kv_heads, L, D)` (rotated), v `(B, kv_heads, L,
    /// D)` of rows `x` `(B·L, H)`.
    fn qkv(&self, c: &LayerCtx, x: &Tensor) -> Result<Projected> {
        if let Some(src) = self.kv_source {
            bail!("layer attends over layer {src}'s keys and values: it makes none of its own");
        }
        let h = self.input_layernorm.forward(x)?;
        if let Some((q, k, v)) = self.projected_heads(c, &h)? {
            return Ok((q, k, v, None));
        }
        let (q, k, v, gate) = self.projections(c, &h)?;
        // (B, L, heads, D) → rotated (B, heads, L, D).
        let q = self.rotated(&q, &self.q_norm, c)?;
        let k = self.rotated(&k, &self.k_norm, c)?;
        let v = v.transpose(1, 2)?.contiguous()?;
        Ok((q, k, v, gate))
    }

    /// Heads `t` `(B, L, heads, D)` rotated to `(B, heads, L, D)`, then normalised by `norm`
    /// where the norms come after RoPE (Hunyuan's).
    fn rotated(&self, t: &Tensor, norm: &Option<RmsNorm>, c: &LayerCtx) -> Result<Tensor> {
        let t = crate::fused::rope(t, &c.cos, &c.sin)?;
        match (self.norm_after_rope, norm) {
            (true, Some(n)) => n.forward(&t),
            _ => Ok(t),
        }
    }

    /// The queries alone `(B, heads, L, D)` (rotated) of normalised rows `h` `(B·L, H)`: a
    /// Gemma 4 layer that attends over another layer's keys and values.
    fn query(&self, c: &LayerCtx, h: &Tensor) -> Result<Tensor> {
        let q = self.q_proj.forward(h)?;
        let q = match &self.q_norm {
            Some(n) => n.forward(&q.reshape((c.b, c.l, c.nh, c.hd))?)?,
            None => q.reshape((c.b, c.l, c.nh, c.hd))?,
        };
        crate::fused::rope(&q, &c.cos, &c.sin)
    }

    /// Gemma 4's end of a layer: the per-layer-input branch (`input` `(B·L, width)`, this
    /// layer's), then `layer_scalar`.
    fn tail(&self, x: Tensor, input: Option<&Tensor>) -> Result<Tensor> {
        let x = match (&self.per_layer, input) {
            (Some(b), Some(input)) => b.forward(&x, input, &|t| self.act(t))?,
            (Some(_), None) => bail!("a per-layer-input layer ran without its input"),
            _ => x,
        };
        match &self.layer_scalar {
            Some(s) => x.broadcast_mul(s),
            None => Ok(x),
        }
    }

    /// [`Self::qkv`]'s q, k (rotated) and v as heads, each projection one graph node
    /// ([`crate::fused::project_heads`]) where that applies: a training graph off the CPU
    /// kernels' path, no adapters on q/k/v, no per-head q/k norms (Qwen3's sit between the
    /// product and RoPE). `None`: the caller composes.
    fn projected_heads(
        &self,
        c: &LayerCtx,
        h: &Tensor,
    ) -> Result<Option<(Tensor, Tensor, Tensor)>> {
        let attn = [&self.q_proj, &self.k_proj, &self.v_proj];
        if self.q_norm.is_some()
            || self.k_norm.is_some()
            || self.v_norm.is_some()
            || self.attn_gate
            || self.v_from_k
            || self.mla.is_some()
            || attn.iter().any(|l| l.lora.is_some())
        {
            return Ok(None);
        }
        let head = |l: &Linear, heads: usize, rot: Option<(&Tensor, &Tensor)>| {
            let dims = (c.b, c.l, heads, c.hd);
            crate::fused::project_heads(h, &l.weight, l.bias.as_ref(), dims, rot)
        };
        let rot = Some((&c.cos, &c.sin));
        let (Some(q), Some(k), Some(v)) = (
            head(&self.q_proj, c.nh, rot)?,
            head(&self.k_proj, c.nkv, rot)?,
            head(&self.v_proj, c.nkv, None)?,
        ) else {
            return Ok(None);
        };
        Ok(Some((q, k, v)))
    }

    /// The MLP of a training graph as two nodes ([`crate::fused::project_pair`]: gate and up
    /// side by side; [`crate::fused::down_silu`]: SiLU·mul, the down projection and the
    /// residual, the product not kept for backward) where they apply: off the CPU kernels'
    /// path, no adapters, no MLP biases. Returns the residual stream, or `None`: the caller
    /// composes.
    fn mlp_nodes(&self, x: &Tensor, h: &Tensor) -> Result<Option<Tensor>> {
        let mlp = [&self.gate_proj, &self.up_proj, &self.down_proj];
        if mlp.iter().any(|l| l.lora.is_some() || l.bias.is_some())
            || self.gate_proj.is_absent()
            || self.activation != crate::config::Activation::Silu
            || self.mlp_out_norm.is_some()
            || self.residual_scale.is_some()
        {
            return Ok(None);
        }
        let Some(gu) = crate::fused::project_pair(h, &self.gate_proj.weight, &self.up_proj.weight)?
        else {
            return Ok(None);
        };
        match crate::fused::down_silu(x, &gu, &self.down_proj.weight)? {
            Some(y) => Ok(Some(y)),
            None => {
                let act = crate::fused::silu_mul_packed(&gu)?;
                Ok(Some(self.down_proj.forward_residual(x, &act)?))
            }
        }
    }

    /// The rest of the layer after [`Self::qkv`]: attention over `k`, `v` (this call's
    /// positions, possibly after earlier ones), the residual, the MLP. Returns rows `(B·L, H)`.
    #[allow(clippy::too_many_arguments)]
    fn finish(
        &self,
        c: &LayerCtx,
        x: &Tensor,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        gate: Option<&Tensor>,
        input: Option<&Tensor>,
    ) -> Result<Tensor> {
        let y = self.finish_mlp(c, x, q, k, v, gate)?;
        self.tail(y, input)
    }

    /// A recurrent layer (Qwen3.5's linear attention, LFM2's convolution) on the residual
    /// stream `x` `(B·L, H)` (no cache): the mixer's output added, then the MLP.
    fn delta_layer(&self, c: &LayerCtx, d: &crate::delta::Mixer, x: &Tensor) -> Result<Tensor> {
        let h = self.input_layernorm.forward(x)?;
        let y = d.forward(&h, c.b, c.l, c.tokens.as_ref())?;
        self.mlp_residual(c, (x + y)?)
    }

    /// [`Self::finish`] up to Gemma 4's tail.
    fn finish_mlp(
        &self,
        c: &LayerCtx,
        x: &Tensor,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        gate: Option<&Tensor>,
    ) -> Result<Tensor> {
        // Grouped-query attention, k/v never repeated; context as rows (B·L, heads·D).
        let ctx = self.attention(c, q, k, v)?;
        let ctx = match &self.mla {
            Some(m) => m.values(&ctx, c.nh)?,
            None => ctx,
        };
        let ctx = gated(ctx, gate)?;
        let x = match (&self.attn_out_norm, self.residual_scale) {
            (None, None) => self.o_proj.forward_residual(x, &ctx)?,
            (n, _) => (x + self.sublayer_out(n, self.o_proj.forward(&ctx)?)?)?,
        };
        self.mlp_residual(c, x)
    }

    /// The MLP sublayer of the residual stream `x` `(B·L, H)`, with its residual add.
    fn mlp_residual(&self, c: &LayerCtx, x: Tensor) -> Result<Tensor> {
        let h = self.post_attention_layernorm.forward(&x)?;
        if let Some(m) = &self.moe {
            return &x + self.sublayer_out(&self.mlp_out_norm, self.moe_mlp(m, c, &h)?)?;
        }
        if let Some(y) = self.mlp_nodes(&x, &h)? {
            return Ok(y);
        }
        let act = self.mlp_act(&h)?;
        match (&self.mlp_out_norm, self.residual_scale) {
            (None, None) => self.down_proj.forward_residual(&x, &act),
            (n, _) => {
                let y = self.with_experts(&x, self.down_proj.forward(&act)?)?;
                &x + self.sublayer_out(n, y)?
            }
        }
    }

    /// The MLP's output `y` with Gemma 4's experts' beside it, of the residual stream `x`.
    fn with_experts(&self, x: &Tensor, y: Tensor) -> Result<Tensor> {
        match &self.experts {
            Some(b) => b.forward(x, &y, &|g, u| self.act_mul(g, u)),
            None => Ok(y),
        }
    }

    /// The attention of `q` over `k`, `v` ([`LayerCtx::attention`], or with this layer's
    /// sinks: [`crate::fused::sink_attention`]).
    fn attention(&self, c: &LayerCtx, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        match &self.sinks {
            Some(s) => crate::fused::sink_attention(q, k, v, &c.bias, c.scale, s),
            None => c.attention(q, k, v),
        }
    }

    /// A sublayer's output `y` as its residual add takes it: Gemma's / OLMo 2's output norm
    /// `n`, Granite's factor.
    fn sublayer_out(&self, n: &Option<RmsNorm>, y: Tensor) -> Result<Tensor> {
        let y = match n {
            Some(n) => n.forward(&y)?,
            None => y,
        };
        match self.residual_scale {
            Some(r) => y.affine(r, 0.0),
            None => Ok(y),
        }
    }

    /// The MLP's `act(gate) · up` (SiLU fused, see [`crate::fused::silu_mul`]).
    fn act_mul(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        match self.activation {
            crate::config::Activation::Silu => crate::fused::silu_mul(gate, up),
            // candle's `gelu` is the tanh approximation (`gelu_pytorch_tanh`).
            crate::config::Activation::GeluPytorchTanh => gate.gelu()? * up,
            crate::config::Activation::Relu2 => self.act(gate)? * up,
            crate::config::Activation::ClampedSwiglu { alpha, limit } => {
                clamped_swiglu(gate, up, alpha, limit)
            }
        }
    }

    /// The MLP's activated rows before `down` from unpacked maps: `act(gate) · up`, or
    /// `act(up)` for an MLP without gate (Arcee's).
    fn mlp_act(&self, h: &Tensor) -> Result<Tensor> {
        match self.gate_proj.is_absent() {
            true => self.act(&self.up_proj.forward(h)?),
            false => self.act_mul(&self.gate_proj.forward(h)?, &self.up_proj.forward(h)?),
        }
    }

    /// The activation alone, of an MLP without gate (Arcee's ReLU², `relu(x)²`).
    fn act(&self, x: &Tensor) -> Result<Tensor> {
        match self.activation {
            crate::config::Activation::Relu2 => x.relu()?.sqr(),
            crate::config::Activation::Silu => x.silu(),
            crate::config::Activation::GeluPytorchTanh => x.gelu(),
            crate::config::Activation::ClampedSwiglu { .. } => {
                candle_core::bail!("the clamped SwiGLU needs a gate")
            }
        }
    }

    /// [`Self::act_mul`] of gate and up side by side in `gu` `(rows, 2·inter)`.
    fn act_mul_packed(&self, gu: &Tensor) -> Result<Tensor> {
        match self.activation {
            crate::config::Activation::Silu => crate::fused::silu_mul_packed(gu),
            crate::config::Activation::GeluPytorchTanh
            | crate::config::Activation::Relu2
            | crate::config::Activation::ClampedSwiglu { .. } => {
                let last = gu.rank() - 1;
                let n = gu.dim(last)? / 2;
                self.act_mul(&gu.narrow(last, 0, n)?, &gu.narrow(last, n, n)?)
            }
        }
    }

    /// The mixture of experts of normalised rows `h` `(N, hidden)` ([`Moe::forward`] with
    /// this layer's activation), recording the load-balancing statistics where `c` says.
    fn moe_mlp(&self, m: &Moe, c: &LayerCtx, h: &Tensor) -> Result<Tensor> {
        m.forward(h, &|g, u| self.act_mul(g, u), c.aux.as_ref())
    }

    /// The layer in a pass over a KV cache (no graph: decoding, a prefill): `h` is this
    /// layer's input already normalised, `x` the residual stream. The new keys and values go
    /// into `cache` (rotated and transposed on the way in), the residual adds are fused with the
    /// norms after them, the last with `next` (the next layer's input norm, or the model's final
    /// norm); `input` is Gemma 4's per-layer input of the layer. Returns the residual stream and
    /// its `next`-normalised rows.
    #[allow(clippy::too_many_arguments)]
    fn cached(
        &self,
        c: &LayerCtx,
        x: &Tensor,
        h: &Tensor,
        cache: &mut KvCache,
        i: usize,
        past: usize,
        next: &RmsNorm,
        input: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor)> {
        let (x, d) = self.cached_mlp(c, x, h, cache, i, past)?;
        if self.per_layer.is_none() && self.layer_scalar.is_none() {
            return next.add_forward(&x, &d);
        }
        let x = self.tail((x + d)?, input)?;
        let h = next.forward(&x)?;
        Ok((x, h))
    }

    /// [`Self::cached`] up to the MLP: the residual stream after the attention and the MLP's
    /// output to add to it.
    fn cached_mlp(
        &self,
        c: &LayerCtx,
        x: &Tensor,
        h: &Tensor,
        cache: &mut KvCache,
        i: usize,
        past: usize,
    ) -> Result<(Tensor, Tensor)> {
        if let Some(d) = &self.delta {
            // A recurrent mixer: the cache holds its state.
            let (y, state) = d.run(h, c.b, c.l, c.tokens.as_ref(), cache.state(i)?.as_ref())?;
            cache.set_state(i, state)?;
            return self.cached_after(c, x, &y);
        }
        if let Some(src) = self.kv_source {
            // Gemma 4's KV sharing: the source layer has written this pass's keys already.
            let q = self.query(c, h)?;
            let (k, v) = cache.view(src, past + c.l)?;
            let ctx = self.attention(c, &q, &k, &v)?;
            return self.cached_rest(c, x, &ctx);
        }
        let attn = [&self.q_proj, &self.k_proj, &self.v_proj];
        // The cache kernel takes no soft cap (Gemma 2), no sinks (gpt-oss) and rotates before
        // any norm (Hunyuan's come after): their layers write the cache and attend apart.
        let pack = self
            .packed(&self.qkv, &attn)
            .filter(|_| c.softcap.is_none() && self.sinks.is_none() && !self.norm_after_rope);
        let mut gate = None;
        let ctx = match pack {
            Some(p) if self.q_norm.is_none() && self.k_norm.is_none() => {
                let shape = (c.b, c.l, c.nh + 2 * c.nkv, c.hd);
                match &p.linear.bias {
                    // The bias goes to the cache pass, which adds it as it reads q, k and v
                    // (one launch less per layer on a GPU); with adapters it stays before them.
                    Some(b) if attn.iter().all(|l| l.lora.is_none()) => {
                        let qkv = p.linear.product(h)?.reshape(shape)?;
                        cache.attend(i, past, &qkv, Some(b), c)?
                    }
                    _ => {
                        let qkv = p.forward(h, &attn)?.reshape(shape)?;
                        cache.attend(i, past, &qkv, None, c)?
                    }
                }
            }
            Some(p) => {
                // Qwen3 normalises q and k per head before rotating them: the pack's columns
                // taken apart, normalised and packed again for the one-kernel cache pass
                // (which also makes the step capturable as a CUDA graph).
                let y = p.forward(h, &attn)?;
                let (nq, nk) = (c.nh * c.hd, c.nkv * c.hd);
                let (q, k) = (y.narrow(1, 0, nq)?, y.narrow(1, nq, nk)?);
                let (q, k, v) = self.heads(c, &q, &k, &y.narrow(1, nq + nk, nk)?)?;
                cache.attend(i, past, &Tensor::cat(&[&q, &k, &v], 2)?, None, c)?
            }
            None => match &self.mla {
                // DeepSeek's latent attention: the cache holds the latent (on a GPU).
                Some(m) if crate::mla::latent_cache(h.device()) => m.cached_attention(
                    &self.q_proj,
                    &self.k_proj,
                    &self.v_proj,
                    h,
                    (c.b, c.l, c.nh, past),
                    (&c.cos, &c.sin, &c.bias, c.scale),
                    |rows| cache.write_latent(i, past, rows),
                )?,
                _ => {
                    let (q, k, v, g) = self.projections(c, h)?;
                    gate = g;
                    let q = self.rotated(&q, &self.q_norm, c)?;
                    let (k, v) = match self.norm_after_rope {
                        // Rotated and normalised before they are cached.
                        true => {
                            let k = self.rotated(&k, &self.k_norm, c)?;
                            let k = k.transpose(1, 2)?.contiguous()?;
                            cache.write(i, past, &k, &v, None)?
                        }
                        false => cache.write(i, past, &k, &v, Some((&c.cos, &c.sin)))?,
                    };
                    let ctx = self.attention(c, &q, &k, &v)?;
                    match &self.mla {
                        Some(m) => m.values(&ctx, c.nh)?,
                        None => ctx,
                    }
                }
            },
        };
        self.cached_rest(c, x, &gated(ctx, gate.as_ref())?)
    }

    /// [`Self::cached_mlp`] after the attention's context rows `ctx`.
    fn cached_rest(&self, c: &LayerCtx, x: &Tensor, ctx: &Tensor) -> Result<(Tensor, Tensor)> {
        let o = self.sublayer_out(&self.attn_out_norm, self.o_proj.forward(ctx)?)?;
        self.cached_after(c, x, &o)
    }

    /// [`Self::cached_rest`] after the token mixer's output `o`: its residual add and the MLP.
    fn cached_after(&self, c: &LayerCtx, x: &Tensor, o: &Tensor) -> Result<(Tensor, Tensor)> {
        let (x, h) = self.post_attention_layernorm.add_forward(x, o)?;
        if let Some(m) = &self.moe {
            let d = self.sublayer_out(&self.mlp_out_norm, self.moe_mlp(m, c, &h)?)?;
            return Ok((x, d));
        }
        let mlp = [&self.gate_proj, &self.up_proj];
        let act = match self.packed(&self.gate_up, &mlp) {
            Some(p) => self.act_mul_packed(&p.forward(&h, &mlp)?)?,
            None => self.mlp_act(&h)?,
        };
        let y = self.with_experts(&x, self.down_proj.forward(&act)?)?;
        let d = self.sublayer_out(&self.mlp_out_norm, y)?;
        Ok((x, d))
    }

    /// The whole layer as one graph node ([`LayerBlocks`]): recomputed in backward (gradient
    /// checkpointing) or a segment that keeps its own graph until its backward; either way its
    /// weights' gradients go to the blocks' sink during backward. With `collect`, also returns
    /// this call's keys and values; with `prefix`, attends over those earlier positions first.
    /// With `given` (a Gemma 4 KV-sharing layer), attends over those keys and values instead of
    /// its own; `input` is its per-layer input. Both are inputs of the node, as `prefix` is.
    #[allow(clippy::too_many_arguments)]
    fn as_block(
        &self,
        c: &LayerCtx,
        x: &Tensor,
        prefix: Option<&(Tensor, Tensor)>,
        given: Option<&(Tensor, Tensor)>,
        input: Option<&Tensor>,
        collect: bool,
        blocks: &LayerBlocks,
    ) -> Result<(Tensor, Option<(Tensor, Tensor)>)> {
        let layer = self.clone();
        let ctx = c.clone();
        let saved = self.dropout_states();
        // A node takes three inputs at most: x, then the prefix's pair (two, or packed into
        // one beside a per-layer input) or the given pair (packed), then the per-layer input.
        let pack_prefix = input.is_some();
        let shapes = |p: Option<&(Tensor, Tensor)>| -> Option<(Vec<usize>, Vec<usize>)> {
            p.map(|(k, v)| (k.dims().to_vec(), v.dims().to_vec()))
        };
        let (pre_shapes, giv_shapes) = (shapes(prefix), shapes(given));
        let has_input = input.is_some();
        let run = move |a: &[Tensor]| -> Result<Tensor> {
            let unpack = |t: &Tensor, (kd, vd): &(Vec<usize>, Vec<usize>)| -> Result<[Tensor; 2]> {
                let kn: usize = kd.iter().product();
                let vn: usize = vd.iter().product();
                Ok([
                    t.narrow(0, 0, kn)?.reshape(kd.as_slice())?,
                    t.narrow(0, kn, vn)?.reshape(vd.as_slice())?,
                ])
            };
            let mut at = 1;
            let pre: Option<[Tensor; 2]> = match (&pre_shapes, pack_prefix) {
                (Some(s), true) => {
                    at += 1;
                    Some(unpack(&a[1], s)?)
                }
                (Some(_), false) => {
                    at += 2;
                    Some([a[1].clone(), a[2].clone()])
                }
                (None, _) => None,
            };
            let giv: Option<[Tensor; 2]> = match &giv_shapes {
                Some(s) => {
                    at += 1;
                    Some(unpack(&a[at - 1], s)?)
                }
                None => None,
            };
            let inp = has_input.then(|| &a[at]);
            if let Some(d) = &layer.delta {
                return layer.delta_layer(&ctx, d, &a[0]);
            }
            // Recorded where a tape records (a taped block), plain candle ops otherwise.
            use grpo_core::tape::{cat, flatten_all};
            let (q, k, v, ka, va, gate) = match &giv {
                Some([gk, gv]) => {
                    let h = layer.input_layernorm.forward(&a[0])?;
                    let q = layer.query(&ctx, &h)?;
                    (q, gk.clone(), gv.clone(), gk.clone(), gv.clone(), None)
                }
                _ => {
                    let (q, k, v, gate) = layer.qkv(&ctx, &a[0])?;
                    let (ka, va) = match &pre {
                        Some([pk, pv]) => (cat(&[pk, &k], 2)?, cat(&[pv, &v], 2)?),
                        _ => (k.clone(), v.clone()),
                    };
                    (q, k, v, ka, va, gate)
                }
            };
            let y = layer.finish(&ctx, &a[0], &q, &ka, &va, gate.as_ref(), inp)?;
            if collect {
                cat(
                    &[&flatten_all(&y)?, &flatten_all(&k)?, &flatten_all(&v)?],
                    0,
                )
            } else {
                Ok(y)
            }
        };
        let op = if blocks.recompute {
            let op = Recompute::new("decoder_layer", move |a, replay| {
                if replay {
                    crate::moe::replaying(|| crate::lora::replay_dropout(&saved, || run(a)))?
                } else {
                    run(a)
                }
            });
            // Every op records: the recomputation is taped too (graph-node paths, no
            // zeroed buffer and add per edge).
            if self.tapeable(x) {
                op.with_taped_recompute()
            } else {
                op
            }
        } else if self.tapeable(x) {
            // Every op records on a tape: the backward walks it (no zeroed buffer and add per
            // graph edge, no copy per op).
            Recompute::taped("decoder_layer", move |a, _| run(a))
        } else {
            // Run once: dropout draws as the plain forward's.
            Recompute::segment("decoder_layer", move |a, _| run(a))
        }
        .with_params(self.vars(), blocks.sink.clone());
        let packed = |(k, v): &(Tensor, Tensor)| -> Result<Tensor> {
            Tensor::cat(&[k.flatten_all()?, v.flatten_all()?], 0)
        };
        let mut owned: Vec<Tensor> = Vec::new();
        let mut inputs = vec![x.clone()];
        match prefix {
            Some(p) if pack_prefix => inputs.push(packed(p)?),
            Some((k, v)) => inputs.extend([k.clone(), v.clone()]),
            None => {}
        }
        if let Some(g) = given {
            owned.push(packed(g)?);
        }
        inputs.extend(owned);
        inputs.extend(input.cloned());
        let refs: Vec<&Tensor> = inputs.iter().collect();
        let out = op.apply(&refs)?;
        if !collect {
            return Ok((out, None));
        }
        let n = c.b * c.l;
        let h = x.dim(1)?;
        let kv = c.b * c.nkv * c.l * c.hd;
        let shape = (c.b, c.nkv, c.l, c.hd);
        let y = out.narrow(0, 0, n * h)?.reshape((n, h))?;
        let k = out.narrow(0, n * h, kv)?.reshape(shape)?;
        let v = out.narrow(0, n * h + kv, kv)?.reshape(shape)?;
        Ok((y, Some((k, v))))
    }

    /// Whether each op of this layer's training forward on `x` records on a tape
    /// ([`grpo_core::tape`]): the graph-node path (off the CPU kernels' f32/f64 path, fused ops
    /// on), no adapters, no per-head q/k norms, no MLP or output-projection biases — the path
    /// of `projected_heads`, `mlp_nodes` and [`crate::fused::affine`].
    pub fn tapeable(&self, x: &Tensor) -> bool {
        grpo_core::fused::path(x) == grpo_core::fused::Path::Recompute
            && self.q_norm.is_none()
            && self.k_norm.is_none()
            && self.attn_out_norm.is_none()
            && self.mlp_out_norm.is_none()
            && self.residual_scale.is_none()
            && self.moe.is_none()
            && self.mla.is_none()
            && self.sinks.is_none()
            && self.delta.is_none()
            && !self.attn_gate
            && !self.input_layernorm.identity
            && self.activation == crate::config::Activation::Silu
            && !self.gate_proj.is_absent()
            && self.linears().iter().all(|l| l.lora.is_none())
            && [
                &self.o_proj,
                &self.gate_proj,
                &self.up_proj,
                &self.down_proj,
            ]
            .iter()
            .all(|l| l.bias.is_none())
    }

    /// `pack` when `parts` are still its views.
    fn packed<'a>(&self, pack: &'a Option<Packed>, parts: &[&Linear]) -> Option<&'a Packed> {
        pack.as_ref().filter(|p| p.holds(parts))
    }

    /// Packs q/k/v and gate/up where they are not packed (or the pack is stale) and no part is
    /// trainable.
    fn pack(&mut self) -> Result<()> {
        let attn = [&self.q_proj, &self.k_proj, &self.v_proj];
        // The latent attention's maps take different inputs: never packed; nor Gemma 4's
        // layers without values or keys of their own.
        if self.mla.is_none()
            && !self.v_from_k
            && self.kv_source.is_none()
            && self.delta.is_none()
            && !self.attn_gate
            && self.packed(&self.qkv, &attn).is_none()
        {
            self.qkv = Packed::pack(&mut [&mut self.q_proj, &mut self.k_proj, &mut self.v_proj])?;
        }
        let mlp = [&self.gate_proj, &self.up_proj];
        if self.moe.is_none()
            && !self.gate_proj.is_absent()
            && self.packed(&self.gate_up, &mlp).is_none()
        {
            self.gate_up = Packed::pack(&mut [&mut self.gate_proj, &mut self.up_proj])?;
        }
        Ok(())
    }

    /// Every linear map that can hold a LoRA adapter: the seven of [`Self::linears_mut`], the
    /// router and the experts' gate, up and down (PEFT's `target_parameters`), the shared
    /// expert's maps.
    pub fn adaptable_mut(&mut self) -> Vec<&mut Linear> {
        let Layer {
            q_proj,
            k_proj,
            v_proj,
            o_proj,
            gate_proj,
            up_proj,
            down_proj,
            moe,
            mla,
            ..
        } = self;
        let mut out = vec![
            q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj,
        ];
        if let Some((a, _)) = mla.as_mut().and_then(|m| m.q_a.as_mut()) {
            out.push(a);
        }
        if let Some(m) = moe.as_mut() {
            out.push(&mut m.router);
            for e in m.experts.iter_mut() {
                out.extend([&mut e.gate_proj, &mut e.up_proj, &mut e.down_proj]);
            }
            if let Some((e, g)) = m.shared.as_mut() {
                out.extend([&mut e.gate_proj, &mut e.up_proj, &mut e.down_proj]);
                out.extend(g.as_mut());
            }
        }
        out
    }

    /// Whether any map holds a LoRA adapter.
    pub fn has_adapters(&self) -> bool {
        self.all_linears().iter().any(|l| l.lora.is_some())
    }

    /// The seven linear maps (attention q, k, v, o; MLP gate, up, down).
    pub fn linears_mut(&mut self) -> [&mut Linear; 7] {
        [
            &mut self.q_proj,
            &mut self.k_proj,
            &mut self.v_proj,
            &mut self.o_proj,
            &mut self.gate_proj,
            &mut self.up_proj,
            &mut self.down_proj,
        ]
    }
}

/// Copies of a model's tensors on another device, by the source tensor
/// ([`Transformer::to_device_reusing`]).
#[derive(Debug, Default)]
pub struct DeviceCopies(HashMap<candle_core::TensorId, Tensor>);

impl DeviceCopies {
    /// How many tensors are held.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The ids of the copies held (a packed group's parts are views of its copied pack, made
    /// anew by each call: the copies, not the model's tensors, say what was moved).
    pub fn copy_ids(&self) -> std::collections::HashSet<candle_core::TensorId> {
        self.0.values().map(|t| t.id()).collect()
    }
}

/// Per-layer keys and values of the tokens seen so far, in preallocated buffers
/// `(B, kv_heads, capacity, head_dim)` that each decode step writes into in place (no copy of
/// the past per step). The buffers grow (doubling) when a forward needs more room.
///
/// Inference only: writes copy data without an autograd graph. `Clone` is a deep copy, since
/// the buffers are written in place.
#[derive(Debug, Default)]
pub struct KvCache {
    layers: Vec<(Tensor, Tensor)>,
    len: usize,
    reserve: usize,
    /// The cached length on the device, which a pass reads in place of `len` (a decode step
    /// captured in a CUDA graph, [`crate::graph`]); the attention bias then spans the capacity.
    pub(crate) past_at: Option<Tensor>,
    /// With `past_at`, for a sliding window: the cache positions `0..capacity` as `(1,
    /// capacity)` f32, from which the step makes the window's band on the device.
    pub(crate) key_index: Option<Tensor>,
}

impl Clone for KvCache {
    fn clone(&self) -> Self {
        let layers = self
            .layers
            .iter()
            .map(|(k, v)| (k.copy().expect("copy"), v.copy().expect("copy")))
            .collect();
        Self {
            layers,
            len: self.len,
            reserve: self.reserve,
            past_at: None,
            key_index: None,
        }
    }
}

impl KvCache {
    /// An empty cache whose first forward allocates room for `capacity` positions.
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            reserve: capacity,
            ..Self::default()
        }
    }

    /// Cached sequence length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Sets the cached length (a step replayed from a CUDA graph writes the cache without this
    /// host count seeing it).
    pub(crate) fn set_len(&mut self, len: usize) {
        self.len = len;
    }

    /// Positions the buffers hold room for (0 before the first forward).
    pub fn capacity(&self) -> usize {
        self.layers
            .iter()
            .find(|slot| !holds_state(slot))
            .and_then(|(k, _)| k.dim(2).ok())
            .unwrap_or(0)
    }

    /// Layer `i`'s linear-attention state (`None` before the first forward).
    fn state(&self, i: usize) -> Result<Option<crate::delta::DeltaState>> {
        match self.layers.get(i) {
            Some(s) if holds_state(s) => Ok(Some(s.clone())),
            Some(_) => bail!("KV cache: layer {i} holds keys and values, not a linear state"),
            None => Ok(None),
        }
    }

    /// Stores layer `i`'s linear-attention state (after its pass).
    fn set_state(&mut self, i: usize, state: crate::delta::DeltaState) -> Result<()> {
        match self.layers.len() {
            n if n == i => self.layers.push(state),
            n if n > i && holds_state(&self.layers[i]) => self.layers[i] = state,
            _ => bail!("KV cache: layer {i}'s state written out of order"),
        }
        Ok(())
    }

    /// True before the first forward.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes the buffers hold (all `capacity` positions of every layer).
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .flat_map(|(k, v)| [k, v])
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum()
    }

    /// Keeps (or repeats) batch rows: row `i` of the result is row `rows[i]` of this cache.
    pub fn select_rows(&self, rows: &Tensor) -> Result<Self> {
        let layers = self
            .layers
            .iter()
            .map(|(k, v)| Ok((k.index_select(rows, 0)?, v.index_select(rows, 0)?)))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            layers,
            len: self.len,
            reserve: self.reserve,
            past_at: None,
            key_index: None,
        })
    }

    /// [`Self::select_rows`] in place, a layer at a time: each layer's old buffers are let go
    /// of as its new ones are made, so a compaction holds one layer twice, not the whole cache.
    pub fn keep_rows(&mut self, rows: &Tensor) -> Result<()> {
        for (k, v) in self.layers.iter_mut() {
            *k = k.index_select(rows, 0)?;
            *v = v.index_select(rows, 0)?;
        }
        Ok(())
    }

    /// Stacks the rows of `parts` (in order) into one cache as long as the longest part: a
    /// shorter part's positions past its own length hold zeros, which the caller masks in
    /// those rows' attention bias. The buffers have room for `capacity` positions (at least the
    /// length). Used to bring back rows that left a batch at different decode steps.
    pub fn concat_rows(parts: &[KvCache], capacity: usize) -> Result<Self> {
        let Some(first) = parts.first() else {
            bail!("KV cache: nothing to concatenate");
        };
        let n_layers = first.layers.len();
        if let Some(p) = parts.iter().find(|p| p.layers.len() != n_layers) {
            bail!(
                "KV cache: parts hold {} and {} layers",
                n_layers,
                p.layers.len()
            );
        }
        let len = parts.iter().map(|p| p.len).max().unwrap_or(0);
        let cap = capacity.max(len);
        let pad = |t: &Tensor, have: usize| -> Result<Tensor> {
            let (b, h, _, d) = t.dims4()?;
            if d == 0 {
                // A latent cache's empty value buffer.
                return Tensor::zeros((b, h, cap, 0), t.dtype(), t.device());
            }
            let kept = t.narrow(2, 0, have)?;
            if have == cap {
                return kept.contiguous();
            }
            let zeros = Tensor::zeros((b, h, cap - have, d), t.dtype(), t.device())?;
            Tensor::cat(&[&kept, &zeros], 2)
        };
        let mut layers = Vec::with_capacity(n_layers);
        for i in 0..n_layers {
            let mut ks = Vec::with_capacity(parts.len());
            let mut vs = Vec::with_capacity(parts.len());
            for p in parts {
                let slot = &p.layers[i];
                // A linear layer's state has no positions: the rows' states stacked as they are.
                let (k, v) = match holds_state(slot) {
                    true => slot.clone(),
                    false => (pad(&slot.0, p.len)?, pad(&slot.1, p.len)?),
                };
                ks.push(k);
                vs.push(v);
            }
            layers.push((Tensor::cat(&ks, 0)?, Tensor::cat(&vs, 0)?));
        }
        Ok(Self {
            layers,
            len,
            reserve: first.reserve,
            past_at: None,
            key_index: None,
        })
    }

    /// Writes layer `i`'s new keys and values after the `past` cached positions: `k` and `v`
    /// as the projections give them, `(B, L, kv_heads, D)`, the keys rotated by `rope`'s cos /
    /// sin on the way in, if given ([`crate::fused::kv_write`]); returns views of all `past + L`
    /// of them.
    fn write(
        &mut self,
        i: usize,
        past: usize,
        k: &Tensor,
        v: &Tensor,
        rope: Option<(&Tensor, &Tensor)>,
    ) -> Result<(Tensor, Tensor)> {
        let (b, l, h, d) = k.dims4()?;
        let (kb, vb) = self.room(i, past, (b, h, l, d), d, k.dtype(), k.device())?;
        crate::fused::kv_write(kb, k, rope, past)?;
        crate::fused::kv_write(vb, v, None, past)?;
        Ok((kb.narrow(2, 0, past + l)?, vb.narrow(2, 0, past + l)?))
    }

    /// Layer `i`'s cached keys and values, the first `len` positions (a Gemma 4 layer that
    /// attends over another's).
    fn view(&self, i: usize, len: usize) -> Result<(Tensor, Tensor)> {
        let Some((k, v)) = self.layers.get(i) else {
            bail!("KV cache: layer {i} holds nothing yet");
        };
        Ok((k.narrow(2, 0, len)?, v.narrow(2, 0, len)?))
    }

    /// Writes layer `i`'s new rows of DeepSeek's latent cache after the `past` cached positions:
    /// `rows` `(B, L, 1, kv_lora_rank + qk_rope_head_dim)`, the latent beside the rotated shared
    /// key ([`crate::mla::Mla::cached_attention`]), in the layer's key buffer (its value buffer
    /// holds nothing: `(B, 1, capacity, 0)`); returns a view of all `past + L` of them.
    fn write_latent(&mut self, i: usize, past: usize, rows: &Tensor) -> Result<Tensor> {
        let (b, l, h, d) = rows.dims4()?;
        let (kb, _) = self.room(i, past, (b, h, l, d), 0, rows.dtype(), rows.device())?;
        crate::fused::kv_write(kb, rows, None, past)?;
        kb.narrow(2, 0, past + l)
    }

    /// Layer `i`'s pass after the packed q/k/v product `qkv` `(B, L, heads + 2·kv_heads, D)`
    /// (its bias `proj_bias` not yet added, when given): the new keys and values written after
    /// the `past` cached positions, the queries' attention over all of them
    /// ([`crate::fused::cached_attention`]); returns the context rows.
    fn attend(
        &mut self,
        i: usize,
        past: usize,
        qkv: &Tensor,
        proj_bias: Option<&Tensor>,
        c: &LayerCtx,
    ) -> Result<Tensor> {
        let dims = (c.b, c.nkv, c.l, c.hd);
        let at = self.past_at.clone();
        let (kb, vb) = self.room(i, past, dims, c.hd, qkv.dtype(), qkv.device())?;
        match at {
            Some(at) => crate::fused::cached_attention_at(
                qkv, proj_bias, kb, vb, &c.cos, &c.sin, &c.bias, &at, c.nh, c.scale,
            ),
            None => crate::fused::cached_attention(
                qkv, proj_bias, kb, vb, &c.cos, &c.sin, &c.bias, past, c.nh, c.scale,
            ),
        }
    }

    /// Layer `i`'s buffers with room for `L` positions after `past` (allocated at the first
    /// forward, doubled when full); `dims` = `(B, kv_heads, L, D)` of the keys, `dv` the
    /// values' width (0 in a latent cache: [`Self::write_latent`]).
    fn room(
        &mut self,
        i: usize,
        past: usize,
        dims: (usize, usize, usize, usize),
        dv: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<(&Tensor, &Tensor)> {
        let (b, h, l, d) = dims;
        let need = past + l;
        if self.layers.len() == i {
            if past != 0 {
                bail!("KV cache: layer {i} missing while {past} positions are cached");
            }
            let cap = self.reserve.max(need);
            let kb = Tensor::zeros((b, h, cap, d), dtype, device)?;
            let vb = Tensor::zeros((b, h, cap, dv), dtype, device)?;
            self.layers.push((kb, vb));
        }
        let (kb, vb) = &mut self.layers[i];
        if kb.dim(0)? != b {
            bail!("KV cache holds {} rows, the input has {b}", kb.dim(0)?);
        }
        if kb.dim(1)? != h || kb.dim(3)? != d || vb.dim(3)? != dv {
            bail!(
                "KV cache layer {i} holds keys {:?} and values {:?}, the pass writes ({h}, {d}) and \
                 ({h}, {dv})",
                (kb.dim(1)?, kb.dim(3)?),
                (vb.dim(1)?, vb.dim(3)?)
            );
        }
        if kb.dim(2)? < need {
            let cap = (2 * kb.dim(2)?).max(need);
            let grow = |old: &Tensor| -> Result<Tensor> {
                let (_, h, _, d) = old.dims4()?;
                let new = Tensor::zeros((b, h, cap, d), old.dtype(), old.device())?;
                if past > 0 && d > 0 {
                    new.slice_set(&old.narrow(2, 0, past)?.contiguous()?, 2, 0)?;
                }
                Ok(new)
            };
            *kb = grow(kb)?;
            *vb = grow(vb)?;
        }
        Ok((kb, vb))
    }
}

/// Whether a cache slot holds a linear-attention state ([`crate::delta::DeltaState`]: the
/// convolution's inputs `(B, kernel − 1, channels)`, 3-D) rather than keys and values (4-D).
fn holds_state((first, _): &(Tensor, Tensor)) -> bool {
    first.rank() == 3
}

/// The transformers names of a layer's MLP-input norm and of Gemma's sublayer-output norms
/// (our `post_attention_layernorm`, `attn_out_norm`, `mlp_out_norm`).
fn layer_norm_names(arch: Arch) -> [&'static str; 3] {
    match arch {
        Arch::Gemma2 | Arch::Gemma3 | Arch::Gemma4 => [
            "pre_feedforward_layernorm",
            "post_attention_layernorm",
            "post_feedforward_layernorm",
        ],
        Arch::Olmo2 | Arch::Olmo3 | Arch::Exaone4 => {
            ["", "post_attention_layernorm", "post_feedforward_layernorm"]
        }
        Arch::Glm4 => [
            "post_attention_layernorm",
            "post_self_attn_layernorm",
            "post_mlp_layernorm",
        ],
        _ => ["post_attention_layernorm", "", ""],
    }
}

/// What every layer of one forward call shares: shapes, RoPE tables of its positions, the
/// attention bias.
#[derive(Debug, Clone)]
struct LayerCtx {
    b: usize,
    l: usize,
    nh: usize,
    nkv: usize,
    hd: usize,
    cos: Tensor,
    sin: Tensor,
    bias: Tensor,
    scale: f64,
    /// Gemma 2's cap on the attention scores.
    softcap: Option<f64>,
    /// Where an MoE layer records its load-balancing statistics ([`crate::moe::AuxRows`]).
    aux: Option<crate::moe::AuxRows>,
    /// Qwen3.5's linear layers: 1 at each real token of this call, 0 at padding `(B·L, 1)`.
    tokens: Option<Tensor>,
}

/// A layer's q `(B, L, heads, D)`, k, v, and Qwen3.5's attention gate rows `(B·L, heads·D)`.
type Projected = (Tensor, Tensor, Tensor, Option<Tensor>);

/// The attention's context rows `ctx` `(B·L, heads·D)` scaled by `sigmoid(gate)` (Qwen3.5's
/// gated attention), or as they are.
fn gated(ctx: Tensor, gate: Option<&Tensor>) -> Result<Tensor> {
    match gate {
        Some(g) => ctx * crate::moe::sigmoid(g)?,
        None => Ok(ctx),
    }
}

/// 1 at each of the `l` query positions whose own key the attention bias `(·, 1, l, keys)`
/// leaves open (a real token), 0 where it is masked (padding), as `(b·l, 1)` f32: what a
/// linear-attention layer zeroes its padding by. The new positions are the bias's last `l`
/// keys.
fn token_mask(bias: &Tensor, b: usize, l: usize) -> Result<Tensor> {
    let keys = bias.dim(D::Minus1)?;
    let rows = bias.elem_count() / (l * keys);
    let own = bias
        .reshape((rows, l, keys))?
        .narrow(2, keys - l, l)?
        .to_dtype(DType::F32)?;
    let diag = own
        .broadcast_mul(&Tensor::eye(l, DType::F32, bias.device())?)?
        .sum(2)?;
    diag.ge(-1.0)?
        .to_dtype(DType::F32)?
        .broadcast_as((b, l))?
        .reshape((b * l, 1))
}

impl LayerCtx {
    /// The attention of `q` over `k`, `v` ([`crate::fused::causal_attention`], or with the
    /// scores soft-capped).
    fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        match self.softcap {
            Some(cap) => crate::fused::softcapped_attention(q, k, v, &self.bias, self.scale, cap),
            None => crate::fused::causal_attention(q, k, v, &self.bias, self.scale),
        }
    }
}

/// What a forward pass does with each layer's keys and values.
enum Kv<'a> {
    /// Nothing: attention over this call's tokens only.
    None,
    /// Append them to a generation cache (no graph) and attend over the whole cache.
    Cache(&'a mut KvCache),
    /// Also return them, `(B, kv_heads, L, D)` with their graph, one pair per layer.
    Collect(&'a mut Vec<(Tensor, Tensor)>),
    /// Attend over these earlier positions (one `(B, kv_heads, P, D)` pair per layer) first.
    Prefix(&'a [(Tensor, Tensor)]),
}

/// Whether trainers run a full fine-tune's decoder layers as blocks
/// ([`Transformer::enable_layer_segments`]): yes unless `GRPO_LAYER_SEGMENTS=0`. A layer whose
/// ops all record on a tape ([`Layer::tapeable`]) is a taped block everywhere; another one is a
/// segment on the CPU (6 % off the learner's peak at the same speed) and no block on a GPU,
/// where (an H100, 0.77B bf16, micro-batch 32 × 320 positions) segments raised the GRPO step's
/// peak by 1.4 GB and doubled the learner's backward — unless `GRPO_LAYER_SEGMENTS=1`.
pub fn layer_segments_wanted(_device: &Device) -> bool {
    std::env::var("GRPO_LAYER_SEGMENTS").as_deref() != Ok("0")
}

/// Whether a layer that cannot be taped runs without a block on `device`
/// ([`LayerBlocks::taped_only`]): on a GPU, unless `GRPO_LAYER_SEGMENTS=1`.
fn taped_only_on(device: &Device) -> bool {
    !device.is_cpu() && std::env::var("GRPO_LAYER_SEGMENTS").as_deref() != Ok("1")
}

/// How a training forward runs each decoder layer as one graph node
/// ([`Transformer::layer_blocks`]).
#[derive(Debug, Clone)]
pub struct LayerBlocks {
    /// Where the layers' weight gradients wait during backward ([`Transformer::backward`]
    /// merges them into the store).
    pub sink: Arc<GradSink>,
    /// Gradient checkpointing (the layer recomputed in backward) when true; a taped block or
    /// a segment (its tape or graph kept by the node, freed by its backward) when false.
    pub recompute: bool,
    /// Without `recompute`: a layer whose ops cannot all be taped runs as a plain graph rather
    /// than a segment.
    pub taped_only: bool,
}

/// The teacher of [`Transformer::distill_rows_with`].
#[derive(Clone, Copy)]
pub enum DistillTeacher<'a> {
    /// A local model and its hidden rows `(N, H)` (those that predict the same tokens).
    Local {
        /// The teacher.
        model: &'a Transformer,
        /// Its hidden rows.
        hidden: &'a Tensor,
    },
    /// A teacher on a server: its top-k and own-token log-probs at each row.
    Served(&'a grpo_core::distill::ServedRows),
}

impl std::fmt::Debug for DistillTeacher<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Local { hidden, .. } => write!(f, "DistillTeacher::Local({:?})", hidden.dims()),
            Self::Served(s) => write!(f, "DistillTeacher::Served({:?})", s.top_ids.dims()),
        }
    }
}

/// The decoder: embeddings, layers, final norm, output head.
#[derive(Debug, Clone)]
pub struct Transformer {
    /// Shape.
    pub cfg: ModelConfig,
    /// `(vocab, hidden)` token embeddings.
    pub embed_tokens: Tensor,
    /// Decoder layers.
    pub layers: Vec<Layer>,
    /// Final norm.
    pub norm: RmsNorm,
    /// `(vocab, hidden)` output head; `None` when tied to the embeddings.
    pub lm_head: Option<Tensor>,
    /// A sequence classifier's (reward model's) `score` head `(1, hidden)`, in place of the LM
    /// head (`cfg.sequence_classification`): see [`Self::sequence_scores`]; a token
    /// classifier's (process reward model's) `(num_labels, hidden)` (`cfg.token_classification`):
    /// see [`Self::token_logits`].
    pub score: Option<Tensor>,
    /// A token classifier's `score` bias `(num_labels,)` (transformers'
    /// `*ForTokenClassification` head is a linear layer with a bias).
    pub score_bias: Option<Tensor>,
    /// PEFT's trainable tokens (a LoRA config's `trainable_token_indices`): embedding rows
    /// replaced by values of their own, trained beside the adapters (and, with a tied head,
    /// the head's rows too). See [`Self::embedding_weight`].
    pub token_delta: Option<TokenDelta>,
    /// Set by [`Self::for_decoding`]: few-row logits are computed as `W · hᵀ` (the head's
    /// rows against the hidden states), which candle's gemm runs up to 2x faster than `h · Wᵀ`
    /// for a wide head.
    pub decoding: bool,
    /// When set, a training forward runs each decoder layer as one graph node: recomputed in
    /// backward (gradient checkpointing, [`Self::enable_gradient_checkpointing`]) or its graph
    /// kept in the node and freed by its backward ([`Self::enable_layer_segments`]).
    pub layer_blocks: Option<LayerBlocks>,
    /// A vision-language checkpoint's parts beside its language model (its config, vision
    /// tower and projector), kept to be written back with it ([`crate::loader::save_hf_dir`]).
    pub vision: Option<std::sync::Arc<crate::loader::VisionLanguage>>,
    /// RoPE `(max_positions, head_dim / 2)` cosine and sine tables (f32, no gradient).
    rope_cos: Tensor,
    rope_sin: Tensor,
    /// Gemma 3's sliding layers' tables ([`ModelConfig::local_rope_theta`]).
    rope_local: Option<(Tensor, Tensor)>,
    /// Gemma 4's full layers' tables `(max_positions, global_head_dim / 2)`.
    rope_global: Option<(Tensor, Tensor)>,
    /// Gemma 4's per-layer embeddings.
    pub per_layer: Option<crate::gemma4::PerLayerEmbedding>,
}

/// `l` with `f` applied to its tensors.
pub(crate) fn map_linear(l: &Linear, f: &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<Linear> {
    Ok(Linear {
        weight: f(&l.weight)?,
        bias: l.bias.as_ref().map(f).transpose()?,
        lora: l.lora.as_ref().map(|lo| lo.map_tensors(f)).transpose()?,
        // A mapped model is a new model: its decoding copies are made again if needed.
        weight_t: None,
    })
}

/// `parts` with `f` applied; with their current `pack`, `f` maps the pack once and the
/// parts are views of the result (a copy or a move of a packed model stays packed).
fn map_group<const N: usize>(
    pack: Option<&Packed>,
    parts: [&Linear; N],
    f: &dyn Fn(&Tensor) -> Result<Tensor>,
) -> Result<([Linear; N], Option<Packed>)> {
    let mut out = Vec::with_capacity(N);
    let Some(p) = pack else {
        for l in parts {
            out.push(map_linear(l, f)?);
        }
        return Ok((out.try_into().expect("N parts"), None));
    };
    let linear = Linear {
        weight: f(&p.linear.weight)?,
        bias: p.linear.bias.as_ref().map(f).transpose()?,
        lora: None,
        weight_t: None,
    };
    for l in parts {
        out.push(Linear {
            weight: l.weight.clone(),
            bias: l.bias.clone(),
            lora: l.lora.as_ref().map(|lo| lo.map_tensors(f)).transpose()?,
            weight_t: None,
        });
    }
    let id = |t: &Option<Tensor>| t.as_ref().map(Tensor::id);
    let kept = linear.weight.id() == p.linear.weight.id() && id(&linear.bias) == id(&p.linear.bias);
    let mut packed = Packed {
        linear,
        sizes: p.sizes.clone(),
        ids: p.ids.clone(),
    };
    // When `f` kept the pack (detaching a frozen model) the parts stay the same tensors.
    if !kept {
        packed.view_parts(&mut out.iter_mut().collect::<Vec<_>>())?;
    }
    Ok((out.try_into().expect("N parts"), Some(packed)))
}

/// Inverse RoPE frequencies, scaled as `cfg.rope_scaling` says (transformers'
/// `modeling_rope_utils`).
pub fn rope_inv_freq(cfg: &ModelConfig) -> Vec<f64> {
    use crate::config::RopeScaling;
    // With partial rotary embeddings the frequencies are those of a `rotary_dim`-wide head;
    // the other pairs ([`crate::layout`]'s order) do not turn (frequency 0: cos 1, sin 0).
    let half = cfg.rotary_dim() / 2;
    let dim = cfg.rotary_dim() as f64;
    let mut inv: Vec<f64> = (0..half)
        .map(|i| 1.0 / cfg.rope_theta.powf(2.0 * i as f64 / dim))
        .collect();
    let inv_scaled = |inv: &mut Vec<f64>| match &cfg.rope_scaling {
        None | Some(RopeScaling::Dynamic { .. }) => {}
        Some(RopeScaling::Linear { factor }) => inv.iter_mut().for_each(|f| *f /= factor),
        Some(RopeScaling::Llama3(s)) => {
            let old = s.original_max_position_embeddings as f64;
            let low_wavelen = old / s.low_freq_factor;
            let high_wavelen = old / s.high_freq_factor;
            for f in inv.iter_mut() {
                let wavelen = 2.0 * std::f64::consts::PI / *f;
                if wavelen > low_wavelen {
                    *f /= s.factor;
                } else if wavelen >= high_wavelen {
                    let smooth = (old / wavelen - s.low_freq_factor)
                        / (s.high_freq_factor - s.low_freq_factor);
                    *f = (1.0 - smooth) * *f / s.factor + smooth * *f;
                }
            }
        }
        Some(RopeScaling::Yarn(y)) => {
            // The dimension at which a frequency turns `rotations` times over the original
            // context; below `low` frequencies are kept (extrapolated), above `high` divided
            // by the factor (interpolated), a linear ramp between.
            let corr = |rotations: f64| {
                let ctx = y.original_max_position_embeddings as f64;
                dim * (ctx / (rotations * 2.0 * std::f64::consts::PI)).ln()
                    / (2.0 * cfg.rope_theta.ln())
            };
            let (mut low, mut high) = (corr(y.beta_fast), corr(y.beta_slow));
            if y.truncate {
                (low, high) = (low.floor(), high.ceil());
            }
            let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
            if low == high {
                high += 0.001;
            }
            for (i, f) in inv.iter_mut().enumerate() {
                let kept = 1.0 - ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                *f = *f / y.factor * (1.0 - kept) + *f * kept;
            }
        }
        // transformers: `1 / (short_factor · base^(2i/d))`, the product in f32.
        Some(RopeScaling::LongRope(l)) => {
            for (i, f) in inv.iter_mut().enumerate() {
                let base = cfg.rope_theta.powf(2.0 * i as f64 / dim) as f32;
                *f = 1.0 / (l.short_factor[i] as f32 * base) as f64;
            }
        }
    };
    inv_scaled(&mut inv);
    inv.resize(cfg.head_dim / 2, 0.0);
    inv
}

/// The factor on RoPE's cos and sin (YaRN's attention factor; 1 otherwise). nanochat normalises
/// q and k after rotating them, which takes the factor out again: 1 there (its q and k norms
/// run before RoPE here, the same up to the norm's epsilon).
pub fn rope_attention_factor(cfg: &ModelConfig) -> f64 {
    if cfg.arch.weightless_norms() {
        return 1.0;
    }
    match &cfg.rope_scaling {
        Some(crate::config::RopeScaling::Yarn(y)) => y.attention_factor,
        Some(crate::config::RopeScaling::LongRope(l)) => l.attention_factor,
        _ => 1.0,
    }
}

/// RoPE's cos and sin `(N, head_dim / 2)` (f32) of positions `pos` `(N,)` (u32), on its
/// device: the angle one f32 product of position and inverse frequency (as transformers
/// computes it), then cos and sin times the scaling's factor (in f32 too).
fn rope_cos_sin(cfg: &ModelConfig, pos: &Tensor) -> Result<(Tensor, Tensor)> {
    let inv = rope_inv_freq(cfg);
    let half = inv.len();
    let (cos, sin) = inv_freq_cos_sin(&inv, pos)?;
    let scale = rope_attention_factor(cfg) as f32 as f64;
    // nanochat's `rotate_half` flips the signs (`(x2, −x1)`): every position turns by −θ.
    let turn = match cfg.arch.inverse_rope() {
        true => -scale,
        false => scale,
    };
    let (cos, sin) = (cos.affine(scale, 0.0)?, sin.affine(turn, 0.0)?);
    // The pairs that do not rotate (partial rotary) pass unscaled: cos 1, sin 0.
    let turning = cfg.rotary_dim() / 2;
    if turning == half || scale == 1.0 {
        return Ok((cos, sin));
    }
    let n = pos.elem_count();
    let ones = Tensor::ones((n, half - turning), DType::F32, pos.device())?;
    Ok((
        Tensor::cat(&[&cos.narrow(1, 0, turning)?, &ones], 1)?,
        Tensor::cat(&[&sin.narrow(1, 0, turning)?, &ones.zeros_like()?], 1)?,
    ))
}

/// `sqrt(width)` rounded to `dtype`: the factor of transformers' scaled embeddings
/// (`Gemma3TextScaledWordEmbedding` and its Gemma 4 kin round it to the weights' dtype).
pub(crate) fn embedding_scale(width: usize, dtype: DType) -> Result<f64> {
    let s = (width as f64).sqrt() as f32;
    Tensor::new(&[s], &Device::Cpu)?
        .to_dtype(dtype)?
        .to_dtype(DType::F64)?
        .to_vec1::<f64>()
        .map(|v| v[0])
}

/// cos and sin `(N, inv.len())` (f32) of positions `pos` `(N,)` for the inverse frequencies
/// `inv`, the angle one f32 product (as transformers computes it); no scaling factor (Gemma 4's
/// full layers take these as they are).
fn inv_freq_cos_sin(inv: &[f64], pos: &Tensor) -> Result<(Tensor, Tensor)> {
    let inv: Vec<f32> = inv.iter().map(|f| *f as f32).collect();
    let half = inv.len();
    let inv = Tensor::from_vec(inv, (1, half), pos.device())?;
    let angle = pos
        .to_dtype(DType::F32)?
        .reshape((pos.elem_count(), 1))?
        .broadcast_mul(&inv)?;
    Ok((angle.cos()?, angle.sin()?))
}

/// `bias` `(B, 1, L, S)` of `L` queries after `earlier` cached positions with the sliding
/// window applied: keys `w` or more cache positions before a query masked (a host-made band,
/// uploaded: the eager passes').
fn window_band(bias: &Tensor, earlier: usize, l: usize, w: usize) -> Result<Tensor> {
    let s = bias.dim(candle_core::D::Minus1)?;
    let masked = mask_value(DType::F32) as f32;
    let band: Vec<f32> = (0..l * s)
        .map(|x| match earlier + x / s >= x % s + w {
            true => masked,
            false => 0.0,
        })
        .collect();
    let band = Tensor::from_vec(band, (1, 1, l, s), bias.device())?;
    bias.broadcast_add(&band.to_dtype(bias.dtype())?)
}

/// A captured decode step's attention bias `(n, 1, 1, cap)` with the sliding window applied:
/// the keys `w` or more cache positions before the query (at the cached length `at`, `(1,)`
/// u32) masked, from the positions `keys` `(1, cap)` f32, with device ops only (no upload: the
/// step is replayed as recorded). `bias + m · (mask − bias)`, `m` 1 on the masked keys: a key
/// masked twice stays at the mask value (an f16 bias does not overflow).
fn window_band_at(bias: &Tensor, at: &Tensor, keys: &Tensor, w: usize) -> Result<Tensor> {
    let dist = at
        .to_dtype(DType::F32)?
        .reshape((1, 1))?
        .broadcast_sub(keys)?;
    // Integral distances: relu(d − w + 1) − relu(d − w) is 1 for d ≥ w, 0 below.
    let w = w as f64;
    let m = (dist.affine(1.0, 1.0 - w)?.relu()? - dist.affine(1.0, -w)?.relu()?)?;
    let cap = keys.dim(1)?;
    let m = m.reshape((1, 1, 1, cap))?.to_dtype(bias.dtype())?;
    let toward = bias.affine(-1.0, mask_value(bias.dtype()))?;
    bias + toward.broadcast_mul(&m)?
}

/// The config Gemma 3's sliding layers rotate with: its local base, unscaled.
fn local_rope_config(cfg: &ModelConfig) -> Option<ModelConfig> {
    cfg.local_rope_theta.map(|theta| ModelConfig {
        rope_theta: theta,
        rope_scaling: None,
        ..cfg.clone()
    })
}

/// [`rope_cos_sin`] of every position up to `max_position_embeddings`, computed on the host.
fn rope_tables(cfg: &ModelConfig, device: &Device) -> Result<(Tensor, Tensor)> {
    // LongRoPE's short factors hold up to the pre-training length only, as does Ministral 3's
    // attention temperature of 1.
    let n = match &cfg.rope_scaling {
        Some(crate::config::RopeScaling::LongRope(l)) => cfg
            .max_position_embeddings
            .min(l.original_max_position_embeddings),
        Some(crate::config::RopeScaling::Yarn(y))
            if y.llama_4_scaling_beta.is_some_and(|b| b != 0.0) =>
        {
            cfg.max_position_embeddings
                .min(y.original_max_position_embeddings)
        }
        _ => cfg.max_position_embeddings,
    };
    let n = n.max(1) as u32;
    let (cos, sin) = rope_cos_sin(cfg, &Tensor::arange(0u32, n, &Device::Cpu)?)?;
    Ok((cos.to_device(device)?, sin.to_device(device)?))
}

/// Weights needed by name, in transformers' naming (`model.layers.0.self_attn.q_proj.weight`).
pub type WeightMap = HashMap<String, Tensor>;

/// PEFT's `TrainableTokensLayer` on the embedding: the rows `indices` of the embedding weight
/// read from `delta` `(indices, hidden)` instead (PEFT's `trainable_tokens_delta`, which holds
/// the rows' values, not a difference).
#[derive(Debug, Clone)]
pub struct TokenDelta {
    /// The token ids whose rows are trained.
    pub indices: Vec<u32>,
    /// Their rows `(indices.len(), hidden)`.
    pub delta: Tensor,
}

impl Transformer {
    /// Builds the model from a map of transformers-named weights. Every tensor is converted to
    /// `dtype` and moved to `device`; a missing or mis-shaped weight is an error naming it.
    pub fn from_weights(
        cfg: &ModelConfig,
        weights: &WeightMap,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        Self::build(cfg, &|name| weights.get(name).cloned(), dtype, device)
    }

    /// [`Self::from_weights`] in `like`'s config, dtypes and device: the weights of a model
    /// built from another's (trainable copies, a synced reference) keep an f32 head
    /// ([`Self::cast_head_to_f32`]) in f32, and a vision-language checkpoint's other parts.
    pub fn from_weights_like(like: &Transformer, weights: &WeightMap) -> Result<Self> {
        let mut m = Self::from_weights(&like.cfg, weights, like.dtype(), like.device())?;
        m.vision = like.vision.clone();
        let dt = like.head().dtype();
        if m.head().dtype() != dt {
            let name = match like.lm_head {
                Some(_) => "lm_head.weight",
                None => "model.embed_tokens.weight",
            };
            let t = weights
                .get(name)
                .ok_or_else(|| candle_core::Error::msg(format!("weight `{name}` is missing")))?;
            m.replace_head(t.to_dtype(dt)?.to_device(like.device())?)?;
        }
        Ok(m)
    }

    /// [`Self::from_weights`] that consumes the map: each weight is let go of as the model
    /// takes it, so packing a layer's projections frees the separate tensors as it goes (a load
    /// needs the model's memory plus one layer's, not twice the projections).
    pub fn from_weights_owned(
        cfg: &ModelConfig,
        weights: WeightMap,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let weights = std::cell::RefCell::new(weights);
        Self::build(
            cfg,
            &|name| weights.borrow_mut().remove(name),
            dtype,
            device,
        )
    }

    /// The model of the weights `take` hands out by name (each asked for once), each layer
    /// packed as soon as it is built.
    fn build(
        cfg: &ModelConfig,
        take: &dyn Fn(&str) -> Option<Tensor>,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        cfg.validate()?;
        // A weight of `shape`, in `dt` on the device.
        let checked_as = |name: &str, t: Tensor, shape: &[usize], dt: DType| -> Result<Tensor> {
            if t.dims() != shape {
                bail!(
                    "weight `{name}` has shape {:?}, expected {shape:?}",
                    t.dims()
                );
            }
            t.to_dtype(dt)?.to_device(device)
        };
        let checked = |name: &str, t: Tensor, shape: &[usize]| checked_as(name, t, shape, dtype);
        let get = |name: &str, shape: &[usize]| -> Result<Tensor> {
            let t = take(name)
                .ok_or_else(|| candle_core::Error::msg(format!("weight `{name}` is missing")))?;
            checked(name, t, shape)
        };
        let h = cfg.hidden_size;
        let linear = |p: &str, out: usize, inp: usize, bias: bool| -> Result<Linear> {
            Ok(Linear {
                weight: get(&format!("{p}.weight"), &[out, inp])?,
                // A bias the config does not declare is left out, as transformers leaves it.
                bias: match bias {
                    true => Some(get(&format!("{p}.bias"), &[out])?),
                    false => None,
                },
                lora: None,
                weight_t: None,
            })
        };
        // nanochat's norms hold no weights: a constant scale of ones, neither read, saved nor
        // trained.
        let norm = |name: &str, n: usize| -> Result<RmsNorm> {
            Ok(RmsNorm {
                weight: match cfg.arch.weightless_norms() {
                    true => Tensor::ones(n, dtype, device)?,
                    false => get(name, &[n])?,
                },
                eps: cfg.rms_norm_eps,
                unit_offset: cfg.unit_offset_norms(),
                identity: false,
            })
        };
        let olmo = cfg.arch.post_norms_only();
        // OLMo 2's missing pre-norms.
        let identity = || -> Result<RmsNorm> {
            Ok(RmsNorm {
                weight: Tensor::zeros(0, dtype, device)?,
                eps: cfg.rms_norm_eps,
                unit_offset: false,
                identity: true,
            })
        };
        let output_norms = cfg.arch.output_norms();
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let qkv_bias = cfg.attention_bias;
            // Gemma 4's layers differ in heads, in keys and values of their own, in MLP width.
            let (nkv, hd) = cfg.layer_heads(i);
            let (q, kv) = (cfg.num_attention_heads * hd, nkv * hd);
            let im = cfg.layer_intermediate(i);
            let kv_source = cfg.kv_source(i);
            let v_from_k = kv_source.is_none()
                && cfg
                    .gemma4
                    .as_ref()
                    .is_some_and(|g| g.k_eq_v && !cfg.windowed(i));
            let [mlp_norm, attn_out, mlp_out] = layer_norm_names(cfg.arch);
            let moe = match cfg.moe.as_ref().filter(|m| m.sparse(i)) {
                Some(m) => {
                    let names = MoeNames::of(cfg.arch);
                    // gpt-oss biases its router and experts.
                    let biased = cfg.arch.biased_experts();
                    // DeepSeek's router weight and offsets in f32 (f64 in an f64 model), as
                    // transformers keeps them (`_keep_in_fp32_modules_strict`).
                    let wide = |name: &str, shape: &[usize]| -> Result<Tensor> {
                        let t = take(name).ok_or_else(|| {
                            candle_core::Error::msg(format!("weight `{name}` is missing"))
                        })?;
                        let keep = match dtype {
                            DType::F64 => DType::F64,
                            _ => DType::F32,
                        };
                        checked_as(name, t, shape, keep)
                    };
                    let lin = |name: String, out: usize, inp: usize| -> Result<Linear> {
                        Ok(Linear {
                            weight: get(&name, &[out, inp])?,
                            bias: match biased {
                                true => Some(get(&MoeNames::bias_of(&name), &[out])?),
                                false => None,
                            },
                            lora: None,
                            weight_t: None,
                        })
                    };
                    let expert = |[g, u, d]: [String; 3], w: usize| -> Result<Expert> {
                        Ok(Expert {
                            gate_proj: lin(g, w, h)?,
                            up_proj: lin(u, w, h)?,
                            down_proj: lin(d, h, w)?,
                        })
                    };
                    let w = m.moe_intermediate_size;
                    Some(Moe {
                        router: match cfg.arch.deepseek_moe() {
                            true => Linear {
                                weight: wide(&names.router(i), &[m.num_experts, h])?,
                                bias: None,
                                lora: None,
                                weight_t: None,
                            },
                            false => lin(names.router(i), m.num_experts, h)?,
                        },
                        experts: (0..m.num_experts)
                            .map(|e| expert(names.expert(i, e), w))
                            .collect::<Result<_>>()?,
                        top_k: m.num_experts_per_tok,
                        norm_topk_prob: m.norm_topk_prob,
                        shared: match m.shared_expert_intermediate_size {
                            Some(s) => Some((
                                expert(names.shared(i), s)?,
                                match cfg.arch.gated_shared_expert() {
                                    true => Some(lin(names.shared_gate(i), 1, h)?),
                                    false => None,
                                },
                            )),
                            None => None,
                        },
                        routing: m.routing,
                        // GLM-4.5's offsets (LFM2-MoE's `expert_bias`), kept in f32 as
                        // transformers keeps them.
                        correction_bias: match m.routing {
                            crate::config::Routing::SigmoidGroups { .. }
                            | crate::config::Routing::Sigmoid {
                                expert_bias: true, ..
                            } => Some(wide(&names.correction_bias(i), &[m.num_experts])?),
                            _ => None,
                        },
                        expert_scale: None,
                    })
                }
                None => None,
            };
            // The dense MLP's maps (stand-ins in an MoE layer).
            // (Arcee's MLP has no gate.)
            let dense = |name: &str, out: usize, inp: usize| match moe.is_some()
                || (name == "gate_proj" && !cfg.arch.gated_mlp())
            {
                true => Linear::absent(dtype, device),
                false => linear(&format!("{p}.mlp.{name}"), out, inp, cfg.mlp_bias),
            };
            let a = format!("{p}.self_attn");
            // Qwen3.5's linear-attention layers: no attention maps.
            let linear_attn = cfg.linear_attention.as_ref().filter(|d| d.is_linear(i));
            let delta = match linear_attn {
                Some(d) => {
                    let l = format!("{p}.linear_attn");
                    let (c, vw, nv) = (d.conv_width(), d.values_width(), d.value_heads);
                    let lin = |n: &str, out: usize, inp: usize| {
                        linear(&format!("{l}.{n}"), out, inp, false)
                    };
                    Some(crate::delta::Mixer::Delta(Box::new(
                        crate::delta::GatedDelta {
                            in_proj_qkv: lin("in_proj_qkv", c, h)?,
                            in_proj_z: lin("in_proj_z", vw, h)?,
                            in_proj_b: lin("in_proj_b", nv, h)?,
                            in_proj_a: lin("in_proj_a", nv, h)?,
                            out_proj: lin("out_proj", h, vw)?,
                            conv: get(&format!("{l}.conv1d.weight"), &[c, 1, d.conv_kernel])?,
                            a_log: get(&format!("{l}.A_log"), &[nv])?,
                            dt_bias: get(&format!("{l}.dt_bias"), &[nv])?,
                            norm: get(&format!("{l}.norm.weight"), &[d.value_dim])?,
                            eps: cfg.rms_norm_eps,
                            cfg: d.clone(),
                        },
                    )))
                }
                // LFM2's short convolution.
                None => match cfg.short_conv.as_ref().filter(|c| c.is_conv(i)) {
                    Some(sc) => {
                        let l = format!("{p}.conv");
                        Some(crate::delta::Mixer::Conv(crate::shortconv::ShortConv {
                            in_proj: linear(&format!("{l}.in_proj"), 3 * h, h, sc.bias)?,
                            out_proj: linear(&format!("{l}.out_proj"), h, h, sc.bias)?,
                            conv: get(&format!("{l}.conv.weight"), &[h, 1, sc.kernel])?,
                            conv_bias: match sc.bias {
                                true => Some(get(&format!("{l}.conv.bias"), &[h])?),
                                false => None,
                            },
                        }))
                    }
                    None => None,
                },
            };
            let attn_gate = cfg.arch.qwen3_5() && delta.is_none();
            // DeepSeek's latent attention in the q, k, v slots ([`crate::mla`]);
            // `attention_bias` biases q_a, kv_a and o.
            let (q_proj, k_proj, v_proj, o_proj, mla) = match &cfg.mla {
                _ if delta.is_some() => (
                    Linear::absent(dtype, device)?,
                    Linear::absent(dtype, device)?,
                    Linear::absent(dtype, device)?,
                    Linear::absent(dtype, device)?,
                    None,
                ),
                Some(m) => {
                    let heads = cfg.num_attention_heads;
                    let bias = cfg.attention_bias;
                    // transformers builds these two norms with RMSNorm's default epsilon,
                    // not the config's.
                    let latent_norm = |name: String, n: usize| -> Result<RmsNorm> {
                        Ok(RmsNorm {
                            eps: crate::mla::NORM_EPS,
                            ..norm(&name, n)?
                        })
                    };
                    let q_a = match m.q_lora_rank {
                        Some(r) => Some((
                            linear(&format!("{a}.q_a_proj"), r, h, bias)?,
                            latent_norm(format!("{a}.q_a_layernorm.weight"), r)?,
                        )),
                        None => None,
                    };
                    let mla = crate::mla::Mla {
                        cfg: *m,
                        order: crate::mla::head_order_tensor(m, device)?,
                        rope_order: crate::mla::rope_order_tensor(m, device)?,
                        q_a,
                        kv_a_norm: latent_norm(
                            format!("{a}.kv_a_layernorm.weight"),
                            m.kv_lora_rank,
                        )?,
                    };
                    let q_in = m.q_lora_rank.unwrap_or(h);
                    let kv_a = m.kv_lora_rank + m.qk_rope_head_dim;
                    let kv_b = heads * (m.qk_nope_head_dim + m.v_head_dim);
                    (
                        linear(&format!("{a}.{}", mla.q_name()), q, q_in, false)?,
                        linear(&format!("{a}.kv_a_proj_with_mqa"), kv_a, h, bias)?,
                        linear(&format!("{a}.kv_b_proj"), kv_b, m.kv_lora_rank, false)?,
                        linear(&format!("{a}.o_proj"), h, heads * m.v_head_dim, bias)?,
                        Some(mla),
                    )
                }
                None => (
                    // Qwen3.5's gate rows after the query rows.
                    linear(
                        &format!("{a}.q_proj"),
                        q * (1 + usize::from(attn_gate)),
                        h,
                        qkv_bias,
                    )?,
                    match kv_source {
                        Some(_) => Linear::absent(dtype, device)?,
                        None => linear(&format!("{a}.k_proj"), kv, h, qkv_bias)?,
                    },
                    match kv_source.is_some() || v_from_k {
                        true => Linear::absent(dtype, device)?,
                        false => linear(&format!("{a}.v_proj"), kv, h, qkv_bias)?,
                    },
                    linear(&format!("{a}.o_proj"), h, q, cfg.o_proj_bias())?,
                    None,
                ),
            };
            let per_layer = match cfg.gemma4.as_ref().and_then(|g| g.per_layer_input) {
                Some((_, w)) => Some(crate::gemma4::PerLayerBranch {
                    gate: linear(&format!("{p}.per_layer_input_gate"), w, h, false)?,
                    projection: linear(&format!("{p}.per_layer_projection"), h, w, false)?,
                    norm: norm(&format!("{p}.post_per_layer_input_norm.weight"), h)?,
                }),
                None => None,
            };
            let experts = match cfg.gemma4.as_ref().and_then(|g| g.experts) {
                Some(e) => {
                    let plain = |name: &str, out: usize, inp: usize| -> Result<Linear> {
                        Ok(Linear {
                            weight: get(name, &[out, inp])?,
                            bias: None,
                            lora: None,
                            weight_t: None,
                        })
                    };
                    let (n, w) = (e.num_experts, e.width);
                    let experts = (0..n)
                        .map(|x| {
                            let [g, u, d] = crate::gemma4::expert_names(i, x);
                            Ok(Expert {
                                gate_proj: plain(&g, w, h)?,
                                up_proj: plain(&u, w, h)?,
                                down_proj: plain(&d, h, w)?,
                            })
                        })
                        .collect::<Result<Vec<_>>>()?;
                    Some(crate::gemma4::ExpertBlock {
                        moe: Moe {
                            router: plain(&format!("{p}.router.proj.weight"), n, h)?,
                            experts,
                            top_k: e.top_k,
                            norm_topk_prob: true,
                            shared: None,
                            routing: crate::config::Routing::Softmax,
                            correction_bias: None,
                            expert_scale: Some(get(&format!("{p}.router.per_expert_scale"), &[n])?),
                        },
                        router_scale: get(&format!("{p}.router.scale"), &[h])?,
                        router_norm: RmsNorm {
                            weight: Tensor::ones(h, dtype, device)?,
                            eps: cfg.rms_norm_eps,
                            unit_offset: false,
                            identity: false,
                        },
                        pre_norm: norm(&format!("{p}.pre_feedforward_layernorm_2.weight"), h)?,
                        post_norm: norm(&format!("{p}.post_feedforward_layernorm_2.weight"), h)?,
                        mlp_norm: norm(&format!("{p}.post_feedforward_layernorm_1.weight"), h)?,
                    })
                }
                None => None,
            };
            // transformers initialises a missing `layer_scalar` buffer to 1.
            let layer_scalar = match cfg.gemma4 {
                Some(_) => Some(match take(&format!("{p}.layer_scalar")) {
                    Some(t) => checked(&format!("{p}.layer_scalar"), t, &[1])?,
                    None => Tensor::ones(1, dtype, device)?,
                }),
                None => None,
            };
            layers.push(Layer {
                input_layernorm: match olmo {
                    true => identity()?,
                    false => norm(&format!("{p}.input_layernorm.weight"), h)?,
                },
                q_proj,
                k_proj,
                v_proj,
                o_proj,
                q_norm: match cfg.arch.attention() {
                    _ if delta.is_some() => None,
                    _ if cfg.head_qk_norm() => {
                        Some(norm(&format!("{p}.self_attn.q_norm.weight"), hd)?)
                    }
                    a if a.full_qk_norm() => {
                        Some(norm(&format!("{p}.self_attn.q_norm.weight"), q)?)
                    }
                    _ => None,
                },
                k_norm: match cfg.arch.attention() {
                    _ if kv_source.is_some() || delta.is_some() => None,
                    _ if cfg.head_qk_norm() => {
                        Some(norm(&format!("{p}.self_attn.k_norm.weight"), hd)?)
                    }
                    a if a.full_qk_norm() => {
                        Some(norm(&format!("{p}.self_attn.k_norm.weight"), kv)?)
                    }
                    _ => None,
                },
                post_attention_layernorm: match olmo {
                    true => identity()?,
                    false => norm(&format!("{p}.{mlp_norm}.weight"), h)?,
                },
                attn_out_norm: output_norms
                    .then(|| norm(&format!("{p}.{attn_out}.weight"), h))
                    .transpose()?,
                mlp_out_norm: output_norms
                    .then(|| norm(&format!("{p}.{mlp_out}.weight"), h))
                    .transpose()?,
                activation: cfg.activation,
                residual_scale: cfg.granite.map(|g| g.residual_multiplier),
                gate_proj: dense("gate_proj", im, h)?,
                up_proj: dense(cfg.arch.mlp_names()[0], im, h)?,
                down_proj: dense(cfg.arch.mlp_names()[1], h, im)?,
                qkv: None,
                gate_up: None,
                moe,
                sinks: match cfg.arch.attention_sinks() {
                    true => Some(get(
                        &format!("{p}.self_attn.sinks"),
                        &[cfg.num_attention_heads],
                    )?),
                    false => None,
                },
                mla,
                // Gemma 4's weightless value norm, on the layers with values of their own.
                v_norm: match cfg.gemma4.is_some() && kv_source.is_none() {
                    true => Some(RmsNorm {
                        weight: Tensor::ones(hd, dtype, device)?,
                        eps: cfg.rms_norm_eps,
                        unit_offset: false,
                        identity: false,
                    }),
                    false => None,
                },
                v_from_k,
                kv_source,
                per_layer,
                layer_scalar,
                experts,
                norm_after_rope: cfg.arch.qk_norm_after_rope(),
                delta,
                attn_gate,
            });
            if let Some(l) = layers.last_mut() {
                l.pack()?;
            }
        }
        let embed_tokens = get("model.embed_tokens.weight", &[cfg.vocab_size, h])?;
        // A classifier has no LM head (transformers' `*ForSequenceClassification` keeps none).
        let (lm_head, score, score_bias) = if cfg.sequence_classification {
            (None, Some(get("score.weight", &[1, h])?), None)
        } else if let Some(n) = cfg.token_classification {
            (
                None,
                Some(get("score.weight", &[n, h])?),
                Some(get("score.bias", &[n])?),
            )
        } else if cfg.tie_word_embeddings {
            (None, None, None)
        } else {
            (
                Some(get("lm_head.weight", &[cfg.vocab_size, h])?),
                None,
                None,
            )
        };
        let (rope_cos, rope_sin) = rope_tables(cfg, device)?;
        let rope_local = match local_rope_config(cfg) {
            Some(local) => Some(rope_tables(&local, device)?),
            None => None,
        };
        let rope_global = match &cfg.gemma4 {
            Some(g) => {
                let n = cfg.max_position_embeddings.max(1) as u32;
                let pos = Tensor::arange(0u32, n, &Device::Cpu)?;
                let (c, s) = inv_freq_cos_sin(&g.global_inv_freq(), &pos)?;
                Some((c.to_device(device)?, s.to_device(device)?))
            }
            None => None,
        };
        let per_layer = match cfg.gemma4.as_ref().and_then(|g| g.per_layer_input) {
            Some((vocab, w)) => {
                let n = cfg.num_hidden_layers * w;
                Some(crate::gemma4::PerLayerEmbedding {
                    embed: get("model.embed_tokens_per_layer.weight", &[vocab, n])?,
                    projection: linear("model.per_layer_model_projection", n, h, false)?,
                    norm: norm("model.per_layer_projection_norm.weight", w)?,
                    width: w,
                })
            }
            None => None,
        };
        Ok(Self {
            cfg: cfg.clone(),
            embed_tokens,
            layers,
            norm: norm("model.norm.weight", h)?,
            lm_head,
            score,
            score_bias,
            token_delta: None,
            decoding: false,
            layer_blocks: None,
            vision: None,
            rope_cos,
            rope_sin,
            rope_local,
            rope_global,
            per_layer,
        })
    }

    /// Stores each layer's q/k/v and gate/up weights packed ([`Packed`]; weights given as
    /// `Var`s stay as they are). Models are packed when built; a model whose weights were
    /// replaced since is packed again by this (and by [`Self::for_decoding`] and
    /// [`Self::snapshot_trainable`]). Packs that are already current are kept.
    pub fn pack_projections(&mut self) -> Result<()> {
        self.layers.iter_mut().try_for_each(Layer::pack)
    }

    /// All weights by transformers name (LoRA factors excluded; see [`crate::lora`]). The q/k/v
    /// and gate/up weights of a packed layer are views into their pack ([`Packed`]): what reads
    /// a tensor's storage whole (candle's `QTensor::quantize`; `copy` and `to_device` copy it
    /// whole) needs `.force_contiguous()` of them.
    pub fn weights(&self) -> Vec<(String, Tensor)> {
        let mut out = vec![(
            "model.embed_tokens.weight".to_string(),
            self.embed_tokens.clone(),
        )];
        let lin = |out: &mut Vec<(String, Tensor)>, p: String, l: &Linear| {
            out.push((format!("{p}.weight"), l.weight.clone()));
            if let Some(b) = &l.bias {
                out.push((format!("{p}.bias"), b.clone()));
            }
        };
        if let Some(e) = &self.per_layer {
            out.push((
                "model.embed_tokens_per_layer.weight".to_string(),
                e.embed.clone(),
            ));
            lin(
                &mut out,
                "model.per_layer_model_projection".to_string(),
                &e.projection,
            );
            out.push((
                "model.per_layer_projection_norm.weight".to_string(),
                e.norm.weight.clone(),
            ));
        }
        let [mlp_norm, attn_out, mlp_out] = layer_norm_names(self.cfg.arch);
        for (i, layer) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            if !layer.input_layernorm.identity {
                out.push((
                    format!("{p}.input_layernorm.weight"),
                    layer.input_layernorm.weight.clone(),
                ));
            }
            let a = format!("{p}.self_attn");
            match &layer.mla {
                _ if layer.delta.is_some() => {}
                Some(m) => {
                    if let Some((q_a, n)) = &m.q_a {
                        lin(&mut out, format!("{a}.q_a_proj"), q_a);
                        out.push((format!("{a}.q_a_layernorm.weight"), n.weight.clone()));
                    }
                    lin(&mut out, format!("{a}.{}", m.q_name()), &layer.q_proj);
                    lin(&mut out, format!("{a}.kv_a_proj_with_mqa"), &layer.k_proj);
                    out.push((
                        format!("{a}.kv_a_layernorm.weight"),
                        m.kv_a_norm.weight.clone(),
                    ));
                    lin(&mut out, format!("{a}.kv_b_proj"), &layer.v_proj);
                }
                None => {
                    lin(&mut out, format!("{a}.q_proj"), &layer.q_proj);
                    // Gemma 4's layers without keys or values of their own.
                    if !layer.k_proj.is_absent() {
                        lin(&mut out, format!("{a}.k_proj"), &layer.k_proj);
                    }
                    if !layer.v_proj.is_absent() {
                        lin(&mut out, format!("{a}.v_proj"), &layer.v_proj);
                    }
                }
            }
            match &layer.delta {
                Some(d) => {
                    let l = format!("{p}.{}", d.module());
                    for (n, x) in d.linear_names().iter().zip(d.linears()) {
                        lin(&mut out, format!("{l}.{n}"), x);
                    }
                    for (n, t) in d.tensors() {
                        out.push((format!("{l}.{n}"), t.clone()));
                    }
                }
                None => lin(&mut out, format!("{a}.o_proj"), &layer.o_proj),
            }
            if let Some(s) = &layer.sinks {
                out.push((format!("{p}.self_attn.sinks"), s.clone()));
            }
            if let Some(n) = &layer.q_norm {
                out.push((format!("{p}.self_attn.q_norm.weight"), n.weight.clone()));
            }
            if let Some(n) = &layer.k_norm {
                out.push((format!("{p}.self_attn.k_norm.weight"), n.weight.clone()));
            }
            if !layer.post_attention_layernorm.identity {
                out.push((
                    format!("{p}.{mlp_norm}.weight"),
                    layer.post_attention_layernorm.weight.clone(),
                ));
            }
            if let Some(n) = &layer.attn_out_norm {
                out.push((format!("{p}.{attn_out}.weight"), n.weight.clone()));
            }
            if let Some(n) = &layer.mlp_out_norm {
                out.push((format!("{p}.{mlp_out}.weight"), n.weight.clone()));
            }
            if let Some(b) = &layer.per_layer {
                lin(&mut out, format!("{p}.per_layer_input_gate"), &b.gate);
                lin(&mut out, format!("{p}.per_layer_projection"), &b.projection);
                out.push((
                    format!("{p}.post_per_layer_input_norm.weight"),
                    b.norm.weight.clone(),
                ));
            }
            if let Some(t) = &layer.layer_scalar {
                out.push((format!("{p}.layer_scalar"), t.clone()));
            }
            if let Some(b) = &layer.experts {
                out.push((
                    format!("{p}.router.proj.weight"),
                    b.moe.router.weight.clone(),
                ));
                out.push((format!("{p}.router.scale"), b.router_scale.clone()));
                if let Some(s) = &b.moe.expert_scale {
                    out.push((format!("{p}.router.per_expert_scale"), s.clone()));
                }
                for (x, e) in b.moe.experts.iter().enumerate() {
                    let names = crate::gemma4::expert_names(i, x);
                    for (n, l) in names.into_iter().zip(e.linears()) {
                        out.push((n, l.weight.clone()));
                    }
                }
                for (n, norm) in [
                    ("post_feedforward_layernorm_1", &b.mlp_norm),
                    ("pre_feedforward_layernorm_2", &b.pre_norm),
                    ("post_feedforward_layernorm_2", &b.post_norm),
                ] {
                    out.push((format!("{p}.{n}.weight"), norm.weight.clone()));
                }
            }
            let Some(m) = &layer.moe else {
                if !layer.gate_proj.is_absent() {
                    lin(&mut out, format!("{p}.mlp.gate_proj"), &layer.gate_proj);
                }
                let [up, down] = self.cfg.arch.mlp_names();
                lin(&mut out, format!("{p}.mlp.{up}"), &layer.up_proj);
                lin(&mut out, format!("{p}.mlp.{down}"), &layer.down_proj);
                continue;
            };
            let names = MoeNames::of(self.cfg.arch);
            let with_bias = |out: &mut Vec<(String, Tensor)>, name: String, l: &Linear| {
                let bias = l
                    .bias
                    .as_ref()
                    .map(|b| (MoeNames::bias_of(&name), b.clone()));
                out.push((name, l.weight.clone()));
                out.extend(bias);
            };
            with_bias(&mut out, names.router(i), &m.router);
            let mut expert = |n: [String; 3], e: &Expert| {
                for (name, l) in n.into_iter().zip(e.linears()) {
                    with_bias(&mut out, name, l);
                }
            };
            for (e, x) in m.experts.iter().enumerate() {
                expert(names.expert(i, e), x);
            }
            if let Some((x, g)) = &m.shared {
                expert(names.shared(i), x);
                if let Some(g) = g {
                    out.push((names.shared_gate(i), g.weight.clone()));
                }
            }
            if let Some(b) = &m.correction_bias {
                out.push((names.correction_bias(i), b.clone()));
            }
        }
        out.push(("model.norm.weight".to_string(), self.norm.weight.clone()));
        if let Some(h) = &self.lm_head {
            out.push(("lm_head.weight".to_string(), h.clone()));
        }
        if let Some(s) = &self.score {
            out.push(("score.weight".to_string(), s.clone()));
        }
        if let Some(b) = &self.score_bias {
            out.push(("score.bias".to_string(), b.clone()));
        }
        // nanochat's norms are constants of ones, not weights.
        if self.cfg.arch.weightless_norms() {
            out.retain(|(n, _)| !n.ends_with("norm.weight"));
        }
        out
    }

    /// Applies `f` to every weight tensor (and LoRA factor), returning a new model.
    /// A packed group's pack is mapped once and its parts made views of the result again.
    pub fn map_tensors(&self, f: &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<Self> {
        let lin = |l: &Linear| map_linear(l, f);
        let norm = |n: &RmsNorm| -> Result<RmsNorm> {
            Ok(RmsNorm {
                weight: f(&n.weight)?,
                eps: n.eps,
                unit_offset: n.unit_offset,
                identity: n.identity,
            })
        };
        let layers = self
            .layers
            .iter()
            .map(|l| {
                let attn = [&l.q_proj, &l.k_proj, &l.v_proj];
                let ([q_proj, k_proj, v_proj], qkv) = map_group(l.packed(&l.qkv, &attn), attn, f)?;
                let mlp = [&l.gate_proj, &l.up_proj];
                let ([gate_proj, up_proj], gate_up) =
                    map_group(l.packed(&l.gate_up, &mlp), mlp, f)?;
                Ok(Layer {
                    input_layernorm: norm(&l.input_layernorm)?,
                    q_proj,
                    k_proj,
                    v_proj,
                    o_proj: lin(&l.o_proj)?,
                    q_norm: l.q_norm.as_ref().map(norm).transpose()?,
                    k_norm: l.k_norm.as_ref().map(norm).transpose()?,
                    post_attention_layernorm: norm(&l.post_attention_layernorm)?,
                    attn_out_norm: l.attn_out_norm.as_ref().map(norm).transpose()?,
                    mlp_out_norm: l.mlp_out_norm.as_ref().map(norm).transpose()?,
                    activation: l.activation,
                    residual_scale: l.residual_scale,
                    gate_proj,
                    up_proj,
                    down_proj: lin(&l.down_proj)?,
                    qkv,
                    gate_up,
                    moe: l.moe.as_ref().map(|m| m.map(f)).transpose()?,
                    sinks: l.sinks.as_ref().map(f).transpose()?,
                    mla: l.mla.as_ref().map(|m| m.map(f)).transpose()?,
                    // The weightless value norm and the scalar are constants.
                    v_norm: l.v_norm.as_ref().map(norm).transpose()?,
                    v_from_k: l.v_from_k,
                    kv_source: l.kv_source,
                    per_layer: l.per_layer.as_ref().map(|b| b.map(f)).transpose()?,
                    layer_scalar: l.layer_scalar.as_ref().map(f).transpose()?,
                    experts: l.experts.as_ref().map(|b| b.map(f)).transpose()?,
                    norm_after_rope: l.norm_after_rope,
                    delta: l.delta.as_ref().map(|d| d.map(f)).transpose()?,
                    attn_gate: l.attn_gate,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            cfg: self.cfg.clone(),
            embed_tokens: f(&self.embed_tokens)?,
            layers,
            norm: norm(&self.norm)?,
            lm_head: self.lm_head.as_ref().map(f).transpose()?,
            score: self.score.as_ref().map(f).transpose()?,
            score_bias: self.score_bias.as_ref().map(f).transpose()?,
            token_delta: self
                .token_delta
                .as_ref()
                .map(|d| -> Result<TokenDelta> {
                    Ok(TokenDelta {
                        indices: d.indices.clone(),
                        delta: f(&d.delta)?,
                    })
                })
                .transpose()?,
            decoding: false,
            layer_blocks: None,
            vision: self.vision.clone(),
            rope_cos: self.rope_cos.clone(),
            rope_sin: self.rope_sin.clone(),
            rope_local: self.rope_local.clone(),
            rope_global: self.rope_global.clone(),
            per_layer: self.per_layer.as_ref().map(|e| e.map(f)).transpose()?,
        })
    }

    /// A detached copy on `device` (a generator on a device of its own, `rollout.device`).
    /// Tensors already moved by an earlier call with the same `copies` are reused when they
    /// are the same tensors (a LoRA run's frozen base: moved once, not at every policy
    /// update); `copies` then holds this call's tensors only. Trainable `Var`s are always
    /// moved, since they change in place. On the model's own device this is [`Self::detached`].
    pub fn to_device_reusing(&self, device: &Device, copies: &mut DeviceCopies) -> Result<Self> {
        if self.device().same_device(device) {
            return Ok(self.detached());
        }
        let old = std::mem::take(&mut copies.0);
        let kept = std::cell::RefCell::new(HashMap::new());
        let mv = |t: &Tensor| -> Result<Tensor> {
            if t.is_variable() {
                return t.detach().to_device(device);
            }
            let c = match old.get(&t.id()) {
                Some(c) => c.clone(),
                None => t.detach().to_device(device)?,
            };
            kept.borrow_mut().insert(t.id(), c.clone());
            Ok(c)
        };
        let mut m = self.map_tensors(&mv)?;
        m.rope_cos = mv(&self.rope_cos)?;
        m.rope_sin = mv(&self.rope_sin)?;
        m.rope_local = match &self.rope_local {
            Some((c, s)) => Some((mv(c)?, mv(s)?)),
            None => None,
        };
        copies.0 = kept.into_inner();
        Ok(m)
    }

    /// The same weights without autograd (shared storage): for generation and scoring.
    pub fn detached(&self) -> Self {
        self.map_tensors(&|t| Ok(t.detach()))
            .expect("detach cannot fail")
    }

    /// A detached copy for generation. On the CPU every linear layer also keeps its weight
    /// transposed and contiguous, which few-row decode matmuls run 2-3x faster on (one more copy
    /// of the layer weights), and the output head switches to `W · hᵀ` ([`Self::decoding`]).
    /// Transposes already made are kept (a server prepares its model once; generation calls
    /// this again for free). On other devices (CUDA: cuBLAS reads transposed operands in place)
    /// nothing is copied.
    pub fn for_decoding(&self) -> Result<Self> {
        self.for_decoding_reusing(None)
    }

    /// [`Self::for_decoding`] that also takes the transposes of `prev` (an earlier decoding
    /// copy) for every weight the two models share: a LoRA run's frozen base is transposed
    /// once, not at every policy update.
    pub fn for_decoding_reusing(&self, prev: Option<&Transformer>) -> Result<Self> {
        let mut m = self.detached();
        m.merge_token_delta()?;
        m.pack_projections()?;
        if !self.device().is_cpu() {
            return Ok(m);
        }
        let tr =
            |w: &Tensor, kept: &Option<Tensor>, old: Option<&Linear>| -> Result<Option<Tensor>> {
                if let Some(t) = kept {
                    return Ok(Some(t.detach()));
                }
                if let Some(o) = old
                    && let Some(t) = &o.weight_t
                    && o.weight.id() == w.id()
                {
                    return Ok(Some(t.clone()));
                }
                Ok(Some(w.t()?.contiguous()?))
            };
        for (i, (l, s)) in m.layers.iter_mut().zip(&self.layers).enumerate() {
            let prev_layer = prev.and_then(|p| p.layers.get(i));
            let old = prev_layer.map(|p| p.linears());
            // Packed parts run through their pack in a pass over a cache: no transposes of their
            // own. (After `pack_projections` every pack is current.)
            let (qkv, mlp) = (l.qkv.is_some(), l.gate_up.is_some());
            let packed = [qkv, qkv, qkv, false, mlp, mlp, false];
            for (j, (lin, s)) in l.linears_mut().into_iter().zip(s.linears()).enumerate() {
                lin.weight_t = if packed[j] {
                    None
                } else {
                    tr(&lin.weight, &s.weight_t, old.map(|o| o[j]))?
                };
            }
            // Qwen3.5's linear-attention maps.
            if let (Some(d), Some(sd)) = (l.delta.as_mut(), s.delta.as_ref()) {
                let old = prev_layer
                    .and_then(|p| p.delta.as_ref())
                    .map(|d| d.linears());
                for (j, (lin, src)) in d.linears_mut().into_iter().zip(sd.linears()).enumerate() {
                    lin.weight_t = tr(&lin.weight, &src.weight_t, old.as_ref().map(|o| o[j]))?;
                }
            }
            let olds = [prev_layer.map(|p| &p.qkv), prev_layer.map(|p| &p.gate_up)];
            for ((pack, src), old) in [&mut l.qkv, &mut l.gate_up]
                .into_iter()
                .zip([&s.qkv, &s.gate_up])
                .zip(olds)
            {
                let Some(p) = pack.as_mut() else {
                    continue;
                };
                // `self`'s transpose of this same pack, else `prev`'s (`tr` checks the weight).
                let kept = src
                    .as_ref()
                    .filter(|s| s.linear.weight.id() == p.linear.weight.id())
                    .and_then(|s| s.linear.weight_t.clone());
                let old = old.and_then(Option::as_ref).map(|o| &o.linear);
                p.linear.weight_t = tr(&p.linear.weight, &kept, old)?;
            }
        }
        m.decoding = true;
        Ok(m)
    }

    /// The same weights (shared, detached) with every LoRA adapter switched off: a LoRA run's
    /// frozen reference, as TRL gets it from peft's `disable_adapter()`, at no memory cost.
    pub fn without_adapters(&self) -> Self {
        let mut m = self.detached();
        m.token_delta = None;
        for l in m.layers.iter_mut() {
            for lin in l.adaptable_mut() {
                lin.lora = None;
            }
        }
        m
    }

    /// A deep copy without autograd: a frozen reference that later updates do not touch.
    pub fn snapshot(&self) -> Result<Self> {
        self.map_tensors(&|t| t.detach().force_contiguous())
    }

    /// Like [`Self::snapshot`], but copies only the trainable weights (candle `Var`s: every
    /// weight of a full fine-tune, only the LoRA factors of an adapter run) and shares the
    /// frozen ones, which nothing updates in place. This is what the learner publishes to the
    /// generator after each step: the generator never sees a half-updated weight, and with
    /// LoRA only the adapters are copied.
    ///
    /// The copies are packed ([`Self::pack_projections`]) as they are made, so the generator's
    /// packed q/k/v and gate/up cost no second copy.
    pub fn snapshot_trainable(&self) -> Result<Self> {
        let mut m = self.map_tensors(&|t| {
            if t.is_variable() {
                t.detach().force_contiguous()
            } else {
                Ok(t.detach())
            }
        })?;
        m.pack_projections()?;
        Ok(m)
    }

    /// [`Self::snapshot_trainable`] made on `device` (the generator's own device, or a second
    /// handle of the model's GPU): the trainable weights copied straight there from the
    /// variables, one copy and none left behind on the model's device; the frozen ones moved
    /// once and reused through `copies` (see [`Self::to_device_reusing`]). On the model's own
    /// device it is [`Self::snapshot_trainable`].
    pub fn snapshot_onto(&self, device: &Device, copies: &mut DeviceCopies) -> Result<Self> {
        if self.device().same_device(device) {
            return self.snapshot_trainable();
        }
        let mut m = self.to_device_reusing(device, copies)?;
        m.pack_projections()?;
        Ok(m)
    }

    /// Turns gradient checkpointing on (TRL's `gradient_checkpointing`): a training forward
    /// keeps only each decoder layer's input and output, and backward recomputes one layer at a
    /// time. Gradients are those of the plain forward (tested); use [`Self::backward`], which
    /// collects the recomputed layers' weight gradients.
    pub fn enable_gradient_checkpointing(&mut self) {
        let sink = match self.layer_blocks.take() {
            Some(b) => b.sink,
            None => GradSink::new(),
        };
        self.layer_blocks = Some(LayerBlocks {
            sink,
            recompute: true,
            taped_only: false,
        });
    }

    /// A training forward keeps each decoder layer's graph inside one node, which its backward
    /// differentiates and frees ([`grpo_core::recompute::Recompute::segment`]): the same
    /// activations and gradients as the plain forward, but each layer's activations are freed
    /// as soon as its weights' gradients exist, so a full fine-tune's backward never holds all
    /// activations and all weight gradients at once (candle's backward keeps the whole graph
    /// until it returns; PyTorch frees as it goes). Costs one copy of each layer's output.
    /// One backward per forward. No-op under gradient checkpointing, which already frees.
    ///
    /// A layer whose ops all record on a tape ([`Layer::tapeable`]) is a taped block instead
    /// ([`grpo_core::recompute::Recompute::taped`]): the same activations, freed the same way,
    /// and a backward that walks the tape — no zeroed buffer and add per graph edge, no copy of
    /// each op's output. On a GPU only those layers become blocks (`GRPO_LAYER_SEGMENTS=1`:
    /// every layer).
    pub fn enable_layer_segments(&mut self) {
        if self.layer_blocks.is_none() {
            self.layer_blocks = Some(LayerBlocks {
                sink: GradSink::new(),
                recompute: false,
                taped_only: taped_only_on(self.embed_tokens.device()),
            });
        }
    }

    /// `loss.backward()`, plus the weight gradients that checkpointed layers formed during it.
    pub fn backward(&self, loss: &Tensor) -> Result<GradStore> {
        Self::backward_through(loss, &[self])
    }

    /// [`Self::backward`] of a loss whose graph runs through several models (PPO's policy and
    /// value model): `loss.backward()`, plus the weight gradients each model's checkpointed
    /// layers formed during it.
    pub fn backward_through(loss: &Tensor, models: &[&Self]) -> Result<GradStore> {
        let sinks = models
            .iter()
            .filter_map(|m| m.layer_blocks.as_ref().map(|b| &b.sink));
        match loss.backward() {
            Ok(mut g) => {
                for sink in sinks {
                    sink.drain_into(&mut g)?;
                }
                Ok(g)
            }
            Err(e) => {
                for sink in sinks {
                    sink.clear();
                }
                Err(e)
            }
        }
    }

    /// Positions the RoPE tables hold (`max_position_embeddings`); a longer sequence has its
    /// cos and sin computed per call ([`Self::rope_at`]).
    pub fn max_positions(&self) -> usize {
        self.rope_cos.dim(0).unwrap_or(0)
    }

    /// RoPE's cos and sin `(N, head_dim / 2)` (f32) of positions `pos` `(N,)` past the tables,
    /// computed as the tables are. Dynamic NTK is refused there: transformers rescales its
    /// frequencies for such a length. `reach` is the sequence's length, for the message.
    pub fn rope_at(&self, pos: &Tensor, reach: usize) -> Result<(Tensor, Tensor)> {
        if let Some(crate::config::RopeScaling::Dynamic { .. }) = self.cfg.rope_scaling {
            bail!(
                "a sequence of {reach} positions is longer than the model's max_position_embeddings ({}, config.json), past which dynamic NTK RoPE rescales its frequencies (not supported)",
                self.max_positions()
            );
        }
        if let Some(crate::config::RopeScaling::Yarn(y)) = &self.cfg.rope_scaling
            && let Some(beta) = y.llama_4_scaling_beta.filter(|b| *b != 0.0)
        {
            bail!(
                "a sequence of {reach} positions is longer than the model's original_max_position_embeddings ({}, config.json), past which Ministral 3 scales its queries by 1 + {beta} · ln(1 + ⌊position / {}⌋) (not supported)",
                y.original_max_position_embeddings,
                y.original_max_position_embeddings
            );
        }
        if let Some(crate::config::RopeScaling::LongRope(l)) = &self.cfg.rope_scaling {
            bail!(
                "a sequence of {reach} positions is longer than the model's original_max_position_embeddings ({}, config.json), past which LongRoPE switches every position to its long factors (not supported)",
                l.original_max_position_embeddings
            );
        }
        rope_cos_sin(&self.cfg, pos)
    }

    /// Weight dtype (of the layers: the output head may be f32 beside them, see
    /// [`Self::cast_head_to_f32`]).
    pub fn dtype(&self) -> DType {
        self.norm.weight.dtype()
    }

    /// TRL's `cast_lm_head_to_fp32` (the ScaleRL recipe): the output head kept and computed in
    /// f32 — its weight converted once, the hidden states converted before each product — so
    /// the logits and log-probs of a half-precision model are formed in f32, in generation and
    /// in training alike. A tied head converts the shared embedding, whose lookups return the
    /// model's dtype. Trainable models take their variables from the converted weight, so a
    /// full fine-tuning run updates an f32 head. No-op for an f32 (or f64) model.
    pub fn cast_head_to_f32(&mut self) -> Result<()> {
        if matches!(self.dtype(), DType::F32 | DType::F64) {
            return Ok(());
        }
        match &mut self.lm_head {
            Some(h) => *h = h.to_dtype(DType::F32)?,
            None => self.embed_tokens = self.embed_tokens.to_dtype(DType::F32)?,
        }
        Ok(())
    }

    /// Replaces the output head's weight (the embedding when tied), keeping the given tensor's
    /// dtype: e.g. an f32 head computed outside the model.
    pub fn replace_head(&mut self, head: Tensor) -> Result<()> {
        if head.dims() != self.head().dims() {
            bail!(
                "replace_head: shape {:?}, the head's is {:?}",
                head.dims(),
                self.head().dims()
            );
        }
        match &mut self.lm_head {
            Some(h) => *h = head,
            None => self.embed_tokens = head,
        }
        Ok(())
    }

    /// Hidden rows in the head's dtype (f32 when the head was cast, else unchanged).
    fn for_head(&self, hidden: &Tensor) -> Result<Tensor> {
        let dt = self.head().dtype();
        if hidden.dtype() == dt {
            Ok(hidden.clone())
        } else {
            hidden.to_dtype(dt)
        }
    }

    /// Device of the weights.
    pub fn device(&self) -> &Device {
        self.embed_tokens.device()
    }

    /// The embedding weight `(vocab, hidden)` the forward reads: with trainable tokens
    /// ([`TokenDelta`]) their rows replaced by the trained values (PEFT's `index_copy`; the
    /// gradient reaches the trained rows only).
    pub fn embedding_weight(&self) -> Result<Tensor> {
        let Some(d) = &self.token_delta else {
            return Ok(self.embed_tokens.clone());
        };
        let n = d.indices.len();
        let idx = Tensor::from_vec(d.indices.clone(), n, self.embed_tokens.device())?;
        let base = self.embed_tokens.detach();
        let old = base.index_select(&idx, 0)?;
        base.index_add(&idx, &(d.delta.to_dtype(base.dtype())? - old)?, 0)
    }

    /// The output head weight the forward reads: the LM head, or the embedding it is tied to
    /// with its trainable tokens ([`Self::embedding_weight`]; PEFT ties them to the head too).
    pub fn head_weight(&self) -> Result<Tensor> {
        match &self.lm_head {
            Some(h) => Ok(h.clone()),
            None => self.embedding_weight(),
        }
    }

    /// Folds trainable tokens ([`TokenDelta`]) into the embedding (PEFT's merge): the same
    /// model without them.
    pub fn merge_token_delta(&mut self) -> Result<()> {
        if self.token_delta.is_some() {
            self.embed_tokens = self.embedding_weight()?.detach();
            self.token_delta = None;
        }
        Ok(())
    }

    /// Whether a decode step can be captured in a CUDA graph ([`crate::graph`]): every layer
    /// takes the one-kernel cache pass (packed q/k/v), whose launch reads the cached length
    /// from the device, and no layer routes through experts (which reads the routing on the
    /// host).
    pub fn graphable(&self) -> bool {
        // Gemma 4's layers differ in shape and read one another's cache: not captured (not
        // yet measured on a GPU).
        self.cfg.attn_logit_softcapping.is_none()
            && self.cfg.gemma4.is_none()
            && !self.cfg.recurrent()
            && self.layers.iter().all(|l| {
                l.moe.is_none()
                    && !l.norm_after_rope
                    && l.packed(&l.qkv, &[&l.q_proj, &l.k_proj, &l.v_proj])
                        .is_some()
            })
    }

    /// Output head weight `(vocab, hidden)` as stored (without trainable tokens; the forward
    /// reads [`Self::head_weight`]).
    pub fn head(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens)
    }

    /// Runs the decoder on `input_ids` `(B, L)` with position ids `positions` `(B, L)` and an
    /// additive attention bias `(B, 1, L, S)` (`S` = cached + new tokens), appending the new
    /// keys and values to `cache` when given. Returns final-normed hidden states `(B, L, H)`.
    /// An f16 model clamps an f32 bias to f16's range (−1e9 would be −inf there); a bias given
    /// in f16 is taken as it is, so clamp it first (`attention_mask_value(DType::F16)`).
    pub fn forward_hidden(
        &self,
        input_ids: &Tensor,
        positions: &Tensor,
        attn_bias: &Tensor,
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        let kv = match cache {
            Some(c) => Kv::Cache(c),
            None => Kv::None,
        };
        self.forward_kv(input_ids, positions, attn_bias, kv)
    }

    /// [`Self::forward_hidden`] with the keys and values handled as `kv` says.
    fn forward_kv(
        &self,
        input_ids: &Tensor,
        positions: &Tensor,
        attn_bias: &Tensor,
        mut kv: Kv<'_>,
    ) -> Result<Tensor> {
        let (b, l) = input_ids.dims2()?;
        let cfg = &self.cfg;
        let (nh, nkv, hd) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let dtype = self.dtype();
        // The RoPE tables hold `max_position_embeddings` positions; a longer sequence has its
        // cos and sin computed for its positions, as transformers computes them for any.
        let earlier = match &kv {
            Kv::Cache(c) => c.len(),
            Kv::Prefix(pre) => pre.first().map_or(Ok(0), |(k, _)| k.dim(2))?,
            Kv::None | Kv::Collect(_) => 0,
        };
        let pos = positions.flatten_all()?;
        let rows = |(cos, sin): (Tensor, Tensor)| -> Result<(Tensor, Tensor)> {
            Ok((
                cos.reshape((b, l, hd / 2))?.to_dtype(dtype)?,
                sin.reshape((b, l, hd / 2))?.to_dtype(dtype)?,
            ))
        };
        let within = earlier + l <= self.max_positions();
        let (cos, sin) = rows(match within {
            true => (
                self.rope_cos.index_select(&pos, 0)?,
                self.rope_sin.index_select(&pos, 0)?,
            ),
            false => self.rope_at(&pos, earlier + l)?,
        })?;
        // Gemma 3's sliding layers: their own base (the tables are there exactly when it is).
        let local = match &self.rope_local {
            Some((c, s)) if within => {
                Some(rows((c.index_select(&pos, 0)?, s.index_select(&pos, 0)?))?)
            }
            Some(_) => local_rope_config(cfg)
                .map(|local| rows(rope_cos_sin(&local, &pos)?))
                .transpose()?,
            None => None,
        };
        // The masks' −1e9 is −inf in f16: a row whose every key is masked (a left-padded
        // position) would turn NaN and spread to the real rows through its keys and values.
        // A bias given in f16 is taken as clamped already (a captured decode step's: the
        // clamp's scalar is an upload, which a CUDA graph capture refuses).
        let layer_bias = |bias: &Tensor| -> Result<Tensor> {
            match (dtype, bias.dtype()) {
                (DType::F16, DType::F16) => Ok(bias.clone()),
                (DType::F16, _) => bias.maximum(mask_value(DType::F16)),
                _ => Ok(bias.clone()),
            }?
            .to_dtype(dtype)
        };
        let ctx = LayerCtx {
            b,
            l,
            nh,
            nkv,
            hd,
            cos,
            sin,
            bias: layer_bias(attn_bias)?,
            scale: cfg.attention_scale(),
            softcap: cfg.attn_logit_softcapping,
            aux: match (&kv, cfg.moe.is_some()) {
                (Kv::Cache(_), _) | (_, false) => None,
                _ => crate::moe::current(),
            },
            tokens: match cfg.recurrent() {
                true => Some(token_mask(attn_bias, b, l)?),
                false => None,
            },
        };
        if cfg.recurrent() && matches!(kv, Kv::Collect(_) | Kv::Prefix(_)) {
            bail!(
                "a model with recurrent layers (Qwen3.5's linear attention, LFM2's convolutions) runs its prompts with their completions: it has no keys and values to share"
            );
        }
        // Variants of `ctx` for the layers that differ. SmolLM3's NoPE layers rotate by
        // nothing: cos 1 and sin 0 (x·1 − y·0 is x exactly), made on the device from the rows'
        // cos and sin so that a captured decode step holds them. Sliding-window layers: keys
        // `w` or more cache positions before the query masked too, as transformers' mask (its
        // positions are the padded sequence's, as the cache's are), and Gemma 3's local RoPE.
        let nope = |c: &LayerCtx| -> Result<LayerCtx> {
            Ok(LayerCtx {
                cos: c.cos.affine(0.0, 1.0)?,
                sin: c.sin.affine(0.0, 0.0)?,
                ..c.clone()
            })
        };
        let band = match (cfg.sliding_window, &kv) {
            // A captured decode step (one query row at the cached length `at`): its band made
            // on the device from the length, so that every replay masks for its own length.
            (
                Some(w),
                Kv::Cache(KvCache {
                    past_at: Some(at),
                    key_index: Some(keys),
                    ..
                }),
            ) => Some(window_band_at(attn_bias, at, keys, w)?),
            (Some(w), _) if earlier + l > w => Some(window_band(attn_bias, earlier, l, w)?),
            _ => None,
        };
        let windowed = match (band, &local) {
            (None, None) => None,
            (band, local) => {
                let (cos, sin) = local.clone().unwrap_or((ctx.cos.clone(), ctx.sin.clone()));
                Some(LayerCtx {
                    bias: band.as_ref().map_or(Ok(ctx.bias.clone()), layer_bias)?,
                    cos,
                    sin,
                    ..ctx.clone()
                })
            }
        };
        let any_nope = !cfg.nope_layers.is_empty();
        let nope_ctx = any_nope.then(|| nope(&ctx)).transpose()?;
        let nope_windowed = windowed
            .as_ref()
            .filter(|_| any_nope)
            .map(nope)
            .transpose()?;
        // Gemma 4's full layers: heads of their own, their RoPE's tables.
        let global = match (&cfg.gemma4, &self.rope_global) {
            (Some(g), Some((tc, ts))) => {
                let half = g.global_head_dim / 2;
                let (gc, gs) = match within {
                    true => (tc.index_select(&pos, 0)?, ts.index_select(&pos, 0)?),
                    false => inv_freq_cos_sin(&g.global_inv_freq(), &pos)?,
                };
                Some(LayerCtx {
                    nkv: g.global_kv_heads,
                    hd: g.global_head_dim,
                    cos: gc.reshape((b, l, half))?.to_dtype(dtype)?,
                    sin: gs.reshape((b, l, half))?.to_dtype(dtype)?,
                    ..ctx.clone()
                })
            }
            _ => None,
        };
        // Gemma 3's sliding layers have their own RoPE: `windowed` holds it.
        let ctx_of = |i: usize| -> &LayerCtx {
            if let Some(g) = global.as_ref().filter(|_| !cfg.windowed(i)) {
                return g;
            }
            let variant = match (cfg.uses_rope(i), cfg.windowed(i)) {
                (true, false) => None,
                (true, true) => windowed.as_ref(),
                (false, false) => nope_ctx.as_ref(),
                (false, true) => nope_windowed.as_ref().or(nope_ctx.as_ref()),
            };
            variant.unwrap_or(&ctx)
        };
        let past = match &kv {
            Kv::Cache(c) => c.len(),
            _ => 0,
        };

        // The residual stream as rows `(B·L, H)`: the projections need no reshape.
        let mut x = self
            .embedding_weight()?
            .index_select(&input_ids.flatten_all()?, 0)?;
        if cfg.arch.gemma() || cfg.arch == Arch::Gemma4 {
            // Gemma's embeddings times sqrt(hidden), the factor rounded to the weights' dtype
            // as transformers' `Gemma3TextScaledWordEmbedding` rounds it.
            let scale = embedding_scale(cfg.hidden_size, x.dtype())?;
            x = x.affine(scale, 0.0)?;
        }
        if let Some(g) = &cfg.granite {
            x = x.affine(g.embedding_multiplier, 0.0)?;
        }
        if x.dtype() != dtype {
            // A tied head cast to f32 (`cast_head_to_f32`): lookups keep the model's dtype.
            x = x.to_dtype(dtype)?;
        }
        if cfg.arch.weightless_norms() {
            // nanochat normalises the embeddings before the first layer (its final norm: no
            // weights).
            x = self.norm.forward(&x)?;
        }
        // Gemma 4's per-layer inputs, layer `i`'s its `i`-th `width` columns.
        let per_layer = match &self.per_layer {
            Some(e) => Some((e.forward(&input_ids.flatten_all()?, &x)?, e.width)),
            None => None,
        };
        let input_of = |i: usize| -> Result<Option<Tensor>> {
            per_layer
                .as_ref()
                .map(|(t, w)| t.narrow(1, i * w, *w))
                .transpose()
        };
        if let Kv::Cache(cache) = &mut kv {
            // A pass over a KV cache has no graph: each residual add runs with the norm after it.
            let Some(first) = self.layers.first() else {
                return self.norm.forward(&x)?.reshape((b, l, cfg.hidden_size));
            };
            let mut h = first.input_layernorm.forward(&x)?;
            for (i, layer) in self.layers.iter().enumerate() {
                let next = match self.layers.get(i + 1) {
                    Some(n) => &n.input_layernorm,
                    None => &self.norm,
                };
                let input = input_of(i)?;
                (x, h) = layer.cached(ctx_of(i), &x, &h, cache, i, past, next, input.as_ref())?;
            }
            cache.len = past + l;
            return h.reshape((b, l, cfg.hidden_size));
        }
        // Gemma 4's KV sharing: the keys and values (with any prefix's) of the layers others
        // attend over.
        let n = self.layers.len();
        let mut shared: Vec<Option<(Tensor, Tensor)>> = vec![None; n];
        let sources: Vec<usize> = self.layers.iter().filter_map(|l| l.kv_source).collect();
        for (i, layer) in self.layers.iter().enumerate() {
            let input = input_of(i)?;
            let given = match layer.kv_source {
                Some(src) => Some(shared[src].clone().ok_or_else(|| {
                    candle_core::Error::msg(format!(
                        "layer {i} attends over layer {src}'s keys and values, which this pass has not made"
                    ))
                })?),
                None => None,
            };
            let source = sources.contains(&i);
            if let Some(blocks) = &self.layer_blocks
                && !matches!(kv, Kv::Cache(_))
                && (x.track_op() || !layer.vars().is_empty())
                && (blocks.recompute || !blocks.taped_only || layer.tapeable(&x))
            {
                let prefix = match &kv {
                    Kv::Prefix(pre) if given.is_none() => Some(&pre[i]),
                    _ => None,
                };
                let collect = (matches!(kv, Kv::Collect(_)) && given.is_none()) || source;
                let (y, kvs) = layer.as_block(
                    ctx_of(i),
                    &x,
                    prefix,
                    given.as_ref(),
                    input.as_ref(),
                    collect,
                    blocks,
                )?;
                if let Some((k, v)) = &kvs
                    && source
                {
                    shared[i] = Some(match prefix {
                        Some((pk, pv)) => (Tensor::cat(&[pk, k], 2)?, Tensor::cat(&[pv, v], 2)?),
                        None => (k.clone(), v.clone()),
                    });
                }
                if let Kv::Collect(out) = &mut kv
                    && let Some(kvs) = given.or(kvs)
                {
                    out.push(kvs);
                }
                x = y;
                continue;
            }
            let c = ctx_of(i);
            if let Some(d) = &layer.delta {
                x = layer.delta_layer(c, d, &x)?;
                continue;
            }
            let (q, k, v, gate) = match given {
                Some((k, v)) => {
                    let q = layer.query(c, &layer.input_layernorm.forward(&x)?)?;
                    if let Kv::Collect(out) = &mut kv {
                        out.push((k.clone(), v.clone()));
                    }
                    (q, k, v, None)
                }
                None => {
                    let (q, k, v, gate) = layer.qkv(c, &x)?;
                    let (k, v) = match &mut kv {
                        Kv::Cache(_) => unreachable!("a pass over a cache takes the loop above"),
                        Kv::None => (k, v),
                        Kv::Collect(out) => {
                            out.push((k.clone(), v.clone()));
                            (k, v)
                        }
                        Kv::Prefix(pre) => {
                            let (pk, pv) = &pre[i];
                            (Tensor::cat(&[pk, &k], 2)?, Tensor::cat(&[pv, &v], 2)?)
                        }
                    };
                    (q, k, v, gate)
                }
            };
            if source {
                shared[i] = Some((k.clone(), v.clone()));
            }
            x = layer.finish(c, &x, &q, &k, &v, gate.as_ref(), input.as_ref())?;
        }
        self.norm.forward(&x)?.reshape((b, l, cfg.hidden_size))
    }

    /// Logits `(N, V)` of hidden states `(N, H)`.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        self.logits_with(hidden, &self.head_weight()?)
    }

    /// [`Self::logits`] with the head weight given ([`Self::head_weight`], formed once for the
    /// chunks of a pass: with trainable tokens it is a composition).
    fn logits_with(&self, hidden: &Tensor, head: &Tensor) -> Result<Tensor> {
        let hidden = &self.for_head(hidden)?;
        let logits = if self.decoding && hidden.dim(0)? <= DECODE_ROWS {
            head.matmul(&hidden.t()?.contiguous()?)?.t()?.contiguous()?
        } else {
            crate::fused::frozen_linear(hidden, head)?
        };
        LogitsOut::of(&self.cfg).apply(logits)
    }

    /// Full-sequence forward on a left-padded batch: `input_ids` `(B, L)` and
    /// `attention_mask` `(B, L)` (1 = token, 0 = padding). Returns hidden states `(B, L, H)`.
    pub fn forward_padded(&self, input_ids: &Tensor, attention_mask: &Tensor) -> Result<Tensor> {
        let (positions, bias) = padded_positions_and_bias(attention_mask, self.device())?;
        self.forward_hidden(input_ids, &positions, &bias, None)
    }

    /// The embedding (and an untied LM head) resized to `n` rows, as transformers'
    /// `resize_token_embeddings(n)` does with its default `mean_resizing`: rows past the old
    /// vocabulary start at the mean of the old rows (transformers draws them from a normal with
    /// that mean and 1e-9 times the rows' covariance: the mean to within ~1e-5 of a row's
    /// spread), and a smaller `n` drops the last rows. `cfg.vocab_size` becomes `n`. A
    /// sequence classifier's score head is unchanged.
    pub fn resize_token_embeddings(&mut self, n: usize) -> Result<()> {
        let old = self.cfg.vocab_size;
        if n == 0 {
            bail!("resize_token_embeddings: 0 rows");
        }
        if n == old {
            return Ok(());
        }
        let resize = |w: &Tensor| -> Result<Tensor> {
            if n < old {
                return w.narrow(0, 0, n)?.contiguous();
            }
            let mean = w
                .to_dtype(DType::F32)?
                .mean_keepdim(0)?
                .to_dtype(w.dtype())?
                .broadcast_as((n - old, w.dim(1)?))?;
            Tensor::cat(&[w, &mean], 0)
        };
        self.embed_tokens = resize(&self.embed_tokens)?;
        if let Some(h) = &self.lm_head {
            self.lm_head = Some(resize(h)?);
        }
        self.cfg.vocab_size = n;
        self.decoding = false;
        Ok(())
    }

    /// The model as a sequence classifier with one label (a reward model), as transformers'
    /// `AutoModelForSequenceClassification.from_pretrained(causal_lm, num_labels=1)` makes it:
    /// the LM head dropped, a new `score` head `(1, hidden)` drawn from N(0, r²) with `r` the
    /// config's `initializer_range` (transformers' default 0.02 when absent) and `seed`, in the
    /// model's dtype and device.
    /// A classifier is returned unchanged.
    pub fn into_sequence_classifier(mut self, seed: u64) -> Result<Self> {
        use rand::SeedableRng;
        use rand_distr::Distribution;
        if self.cfg.token_classification.is_some() {
            bail!("the model is a token classifier: it cannot become a sequence classifier");
        }
        if self.score.is_some() {
            return Ok(self);
        }
        let h = self.cfg.hidden_size;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let std = self.cfg.initializer_range.unwrap_or(0.02) as f32;
        let normal = rand_distr::Normal::new(0.0f32, std)
            .map_err(|e| candle_core::Error::msg(e.to_string()))?;
        let w: Vec<f32> = (0..h).map(|_| normal.sample(&mut rng)).collect();
        let score = Tensor::from_vec(w, (1, h), self.device())?.to_dtype(self.dtype())?;
        self.score = Some(score);
        self.lm_head = None;
        self.cfg.sequence_classification = true;
        Ok(self)
    }

    /// The model as a token classifier with `num_labels` labels (a process reward model), as
    /// transformers' `AutoModelForTokenClassification.from_pretrained(causal_lm, num_labels=n)`
    /// makes it: the LM head dropped, a new `score` head `(n, hidden)` drawn from N(0, r²)
    /// (`r` the config's `initializer_range`, 0.02 when absent; `seed`) and a zero bias, in the
    /// model's dtype and device. A token classifier with `n` labels is returned unchanged.
    pub fn into_token_classifier(mut self, num_labels: usize, seed: u64) -> Result<Self> {
        use rand::SeedableRng;
        use rand_distr::Distribution;
        match (
            self.cfg.token_classification,
            self.cfg.sequence_classification,
        ) {
            (Some(n), _) if n == num_labels => return Ok(self),
            (Some(n), _) => {
                bail!("the model is a token classifier with {n} labels, not {num_labels}")
            }
            (None, true) => {
                bail!("the model is a sequence classifier: it cannot become a token classifier")
            }
            (None, false) => {}
        }
        if num_labels == 0 {
            bail!("a token classifier needs at least one label");
        }
        let h = self.cfg.hidden_size;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let std = self.cfg.initializer_range.unwrap_or(0.02) as f32;
        let normal = rand_distr::Normal::new(0.0f32, std)
            .map_err(|e| candle_core::Error::msg(e.to_string()))?;
        let w: Vec<f32> = (0..num_labels * h)
            .map(|_| normal.sample(&mut rng))
            .collect();
        let score = Tensor::from_vec(w, (num_labels, h), self.device())?.to_dtype(self.dtype())?;
        self.score = Some(score);
        self.score_bias = Some(Tensor::zeros(num_labels, self.dtype(), self.device())?);
        self.lm_head = None;
        self.cfg.token_classification = Some(num_labels);
        Ok(self)
    }

    /// A token classifier's logits `(B, T, num_labels)` at every position of `rows` (token ids,
    /// right-padded here; right padding is never attended by the real tokens), with the graph
    /// (TRL's `PRMTrainer` trains on them). Positions past a row's end hold padding's logits.
    pub fn token_logits(&self, rows: &[&[u32]], pad: u32) -> Result<Tensor> {
        let (Some(score), Some(bias)) = (&self.score, &self.score_bias) else {
            bail!(
                "token_logits: the model has no token classification head (*ForTokenClassification)"
            )
        };
        let (h, b, t) = self.right_padded_hidden(rows, pad, "token_logits")?;
        let z =
            crate::fused::matmul(&h.to_dtype(score.dtype())?, &score.t()?)?.broadcast_add(bias)?;
        z.reshape((b, t, score.dim(0)?))
    }

    /// The hidden states `(B·T, H)` of `rows` right-padded with `pad` to the longest, `B` and
    /// `T`. Right padding is never attended by the real tokens (causal): every position is
    /// real, position ids 0..T, as transformers' are for right-padded rows. `what` names the
    /// caller in the error for an empty batch.
    fn right_padded_hidden(
        &self,
        rows: &[&[u32]],
        pad: u32,
        what: &str,
    ) -> Result<(Tensor, usize, usize)> {
        let b = rows.len();
        let t = rows.iter().map(|r| r.len()).max().unwrap_or(0);
        if b == 0 || t == 0 {
            bail!("{what}: {b} rows of at most {t} tokens");
        }
        let mut ids = Vec::with_capacity(b * t);
        for r in rows {
            ids.extend_from_slice(r);
            ids.extend(std::iter::repeat_n(pad, t - r.len()));
        }
        let dev = self.device();
        let input = Tensor::from_vec(ids, (b, t), dev)?;
        let mask = Tensor::ones((b, t), DType::U32, dev)?;
        let h = self
            .forward_padded(&input, &mask)?
            .reshape((b * t, self.cfg.hidden_size))?;
        Ok((h, b, t))
    }

    /// A sequence classifier's scores `(B,)` of `rows` (token ids, right-padded here with
    /// `pad`), each read at its last token that is not `pad`, as transformers'
    /// `*ForSequenceClassification` picks it (the rightmost non-pad position: with the pad id
    /// equal to EOS, a row ending in EOS is scored at the token before it, as TRL's reward
    /// models are). `pad = None` (no padding token) scores each row at its last token. The
    /// graph is kept: the scores train the head and the decoder (TRL's `RewardTrainer`).
    pub fn sequence_scores(&self, rows: &[&[u32]], pad: Option<u32>) -> Result<Tensor> {
        if self.score.is_none() || self.score_bias.is_some() {
            bail!("sequence_scores: the model has no score head (it is not a sequence classifier)")
        }
        let (h, b, t) = self.right_padded_hidden(rows, pad.unwrap_or(0), "sequence_scores")?;
        let at: Vec<u32> = rows
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let last = match pad {
                    Some(p) => r.iter().rposition(|&x| x != p).unwrap_or(0),
                    None => r.len().saturating_sub(1),
                };
                (i * t + last) as u32
            })
            .collect();
        self.score_rows(&h.index_select(&Tensor::from_vec(at, b, self.device())?, 0)?)
    }

    /// A sequence classifier's scores `(B, T)` at every position of `rows` (token ids,
    /// right-padded here with `pad` to the longest): the `score` head on each position's
    /// hidden state, with the graph. PPO's value model reads its estimate of each state there
    /// (TRL's `value_model.score(hidden_states[-1])`). Positions past a row's end hold padding's
    /// scores.
    pub fn position_scores(&self, rows: &[&[u32]], pad: u32) -> Result<Tensor> {
        if self.score.is_none() || self.score_bias.is_some() {
            bail!("position_scores: the model has no score head (it is not a sequence classifier)")
        }
        let (h, b, t) = self.right_padded_hidden(rows, pad, "position_scores")?;
        self.score_rows(&h)?.reshape((b, t))
    }

    /// Each row's final hidden states averaged over its tokens: `(B, H)` in f32, no graph (an
    /// embedding of the text, as sentence-transformers' mean pooling makes one; BCO's UDM
    /// classifier reads it). Rows are left-padded into one batch here; an empty row is refused.
    pub fn mean_hidden(&self, rows: &[&[u32]]) -> Result<Tensor> {
        let (b, l) = (rows.len(), rows.iter().map(|r| r.len()).max().unwrap_or(0));
        if b == 0 || rows.iter().any(|r| r.is_empty()) {
            bail!("mean_hidden: {b} rows, an empty row has no tokens to average");
        }
        let (mut ids, mut mask) = (Vec::with_capacity(b * l), Vec::with_capacity(b * l));
        for r in rows {
            ids.extend(std::iter::repeat_n(0u32, l - r.len()));
            ids.extend_from_slice(r);
            mask.extend((0..l).map(|j| u32::from(j >= l - r.len())));
        }
        let dev = self.device();
        let ids = Tensor::from_vec(ids, (b, l), dev)?;
        let mask = Tensor::from_vec(mask, (b, l), dev)?;
        let h = self
            .forward_padded(&ids, &mask)?
            .detach()
            .to_dtype(DType::F32)?;
        let m = mask.to_dtype(DType::F32)?;
        let sum = h.broadcast_mul(&m.unsqueeze(2)?)?.sum(1)?;
        sum.broadcast_div(&m.sum_keepdim(1)?)
    }

    /// A sequence classifier's `score` head over hidden rows `(N, H)`: `(N,)`, with the graph.
    pub fn score_rows(&self, h: &Tensor) -> Result<Tensor> {
        let Some(score) = &self.score else {
            bail!("the model has no score head (it is not a sequence classifier)")
        };
        crate::fused::matmul(&h.to_dtype(score.dtype())?, &score.t()?)?.squeeze(1)
    }

    /// Per-token log-probs of the last `logits_to_keep` tokens of each row of a left-padded
    /// batch, given everything before them, with logits divided by `temperature` first (as TRL
    /// does); also their entropies when `with_entropy`. Logits are formed and reduced a chunk
    /// of rows at a time. Returns `(B, logits_to_keep)` tensors (f32, or f64 for f64 models).
    pub fn completion_logprobs(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        logits_to_keep: usize,
        temperature: f64,
        with_entropy: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (h, targets, shape) = self.padded_rows(input_ids, attention_mask, logits_to_keep)?;
        self.target_logprobs(&h, &targets, shape, temperature, with_entropy)
    }

    /// [`Self::completion_logprobs`] with the position ids `(B, L)` and the additive attention
    /// bias `(B, 1, L, L)` given, e.g. [`packed_positions_and_bias`] for rows that hold several
    /// sequences: the log-prob of each of the last `logits_to_keep` tokens of each row given
    /// the positions before it that the bias lets it see.
    pub fn logprobs_with(
        &self,
        input_ids: &Tensor,
        positions: &Tensor,
        bias: &Tensor,
        logits_to_keep: usize,
        temperature: f64,
        with_entropy: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (h, targets, shape) = self.scored_rows(input_ids, positions, bias, logits_to_keep)?;
        self.target_logprobs(&h, &targets, shape, temperature, with_entropy)
    }

    /// [`Self::logprobs_with`] at temperature 1 with each token's entropy, whether it is the
    /// head's most likely token and the mean logit ([`TokenStats`]): TRL's metric inputs.
    pub fn logprobs_stats_with(
        &self,
        input_ids: &Tensor,
        positions: &Tensor,
        bias: &Tensor,
        logits_to_keep: usize,
    ) -> Result<TokenStats> {
        let (h, targets, shape) = self.scored_rows(input_ids, positions, bias, logits_to_keep)?;
        token_stats(self.target_stats(&h, &targets, shape, 1.0, true, true)?)
    }

    /// [`Self::completion_logprobs`] at temperature 1 with [`TokenStats`].
    pub fn completion_stats(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        logits_to_keep: usize,
    ) -> Result<TokenStats> {
        let (h, targets, shape) = self.padded_rows(input_ids, attention_mask, logits_to_keep)?;
        token_stats(self.target_stats(&h, &targets, shape, 1.0, true, true)?)
    }

    /// [`Self::completion_stats`] with `log Σ_v p_v²` of each token's distribution (no
    /// gradient): WPO's ingredients (`grpo_core::preference::wpo_pair_weights`) and the token
    /// metrics from one forward. All `(B, logits_to_keep)`.
    pub fn completion_stats_and_sum_sq(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        logits_to_keep: usize,
    ) -> Result<(TokenStats, Tensor)> {
        let (h, targets, shape) = self.padded_rows(input_ids, attention_mask, logits_to_keep)?;
        let stats = token_stats(self.target_stats(&h, &targets, shape, 1.0, true, true)?)?;
        let sum_sq = self.log_sum_sq_probs(&h)?.reshape(shape)?;
        Ok((stats, sum_sq))
    }

    /// The log-probs of a left-padded batch's last `logits_to_keep` tokens at `temperature`
    /// and `log Σ_v p_v²` of each of their distributions at that temperature, both without
    /// gradient, `(B, logits_to_keep)`: verl's old log-probs and `sum_pi_squared` for the
    /// optimal-token-baseline advantages.
    pub fn completion_logprobs_and_sum_sq(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        logits_to_keep: usize,
        temperature: f64,
    ) -> Result<(Tensor, Tensor)> {
        let (h, targets, shape) = self.padded_rows(input_ids, attention_mask, logits_to_keep)?;
        let h = h.detach();
        let (lp, _) = self.target_logprobs(&h, &targets, shape, temperature, false)?;
        let sum_sq = self.log_sum_sq_probs_at(&h, temperature)?.reshape(shape)?;
        Ok((lp.detach(), sum_sq))
    }

    /// The hidden rows `(B·t, H)` (with the graph) that predict the last `t` tokens of each row
    /// of a left-padded batch, those tokens `(B·t,)`, and `(B, t)`: one forward that both
    /// [`Self::rows_logprobs`] and [`Self::distill_rows`] read.
    pub fn completion_rows(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        t: usize,
    ) -> Result<(Tensor, Tensor, (usize, usize))> {
        self.padded_rows(input_ids, attention_mask, t)
    }

    /// The log-probs (and entropies) of `targets` under the rows `h` of
    /// [`Self::completion_rows`], as [`Self::completion_logprobs`] forms them.
    pub fn rows_logprobs(
        &self,
        h: &Tensor,
        targets: &Tensor,
        shape: (usize, usize),
        temperature: f64,
        with_entropy: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        self.target_logprobs(h, targets, shape, temperature, with_entropy)
    }

    /// [`Self::scored_rows`] of a left-padded batch (its positions and causal bias from the mask).
    fn padded_rows(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        logits_to_keep: usize,
    ) -> Result<(Tensor, Tensor, (usize, usize))> {
        let (positions, bias) = padded_positions_and_bias(attention_mask, self.device())?;
        let rows = self.aux_rows(attention_mask, None)?;
        crate::moe::with_rows(rows, || {
            self.scored_rows(input_ids, &positions, &bias, logits_to_keep)
        })
    }

    /// The weights of a batch's rows in the MoE load-balancing loss, when it is recorded
    /// ([`crate::moe::recording`]): the mask `(B, L)` flattened, each row times `times[b]`
    /// (a shared prompt's completions) where given.
    fn aux_rows(&self, mask: &Tensor, times: Option<&[u32]>) -> Result<Option<Tensor>> {
        if self.cfg.moe.is_none() || !crate::moe::is_recording() {
            return Ok(None);
        }
        let m = mask.to_dtype(DType::F32)?;
        let m = match times {
            Some(t) => {
                let t = Tensor::from_iter(t.iter().map(|&x| x as f32), mask.device())?;
                m.broadcast_mul(&t.unsqueeze(1)?)?
            }
            None => m,
        };
        Ok(Some(m.flatten_all()?))
    }

    /// `log Σ_v p_v²` of the next-token distribution at each hidden row `(N, H)`, `(N,)` in f32
    /// (f64 for f64 models), without gradient; the logits formed a chunk of rows at a time.
    pub fn log_sum_sq_probs(&self, h: &Tensor) -> Result<Tensor> {
        self.log_sum_sq_probs_at(h, 1.0)
    }

    /// [`Self::log_sum_sq_probs`] of the distribution at `temperature` (logits / T).
    pub fn log_sum_sq_probs_at(&self, h: &Tensor, temperature: f64) -> Result<Tensor> {
        let h = h.detach();
        let total = h.dim(0)?;
        let rows = grpo_core::logprobs::chunk_rows_on(self.cfg.vocab_size, h.device());
        let wide = match self.dtype() {
            DType::F64 => DType::F64,
            _ => DType::F32,
        };
        let mut out = Vec::new();
        let mut start = 0;
        while start < total {
            let n = rows.min(total - start);
            let z = self
                .logits(&h.narrow(0, start, n)?)?
                .detach()
                .to_dtype(wide)?;
            let z = if temperature == 1.0 {
                z
            } else {
                (z / temperature)?
            };
            let z = z.broadcast_sub(&z.max_keepdim(1)?)?;
            let once = z.exp()?.sum_keepdim(1)?.log()?;
            let twice = (&z * 2.0)?.exp()?.sum_keepdim(1)?.log()?;
            out.push((twice - (once * 2.0)?)?.squeeze(1)?);
            start += n;
        }
        if out.is_empty() {
            return Tensor::zeros(0, wide, h.device());
        }
        Tensor::cat(&out, 0)
    }

    /// The hidden rows `(B·t, H)` that predict the last `t` tokens of each row of a
    /// left-padded batch (`attention_mask` `(B, L)`), with the graph: what
    /// [`Self::distill_rows`] takes.
    pub fn completion_hidden(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        t: usize,
    ) -> Result<Tensor> {
        Ok(self.padded_rows(input_ids, attention_mask, t)?.0)
    }

    /// On-policy distillation (TRL's `DistillationTrainer`): at each hidden row of this model
    /// (the student, `h` `(N, H)`, with the graph) the divergence of its next-token
    /// distribution from `teacher`'s at its rows `teacher_h` (`grpo_core::distill`: a `beta`
    /// gives the full-vocabulary one, forward KL at 0, reverse KL at 1, the generalized JSD
    /// between; a [`grpo_core::distill::Divergence::TopK`] SDPO's top-k one; at `temperature`), and
    /// the student's entropy (no gradient); both `(N,)`, f32 (f64 for f64 models). Logits are
    /// formed a chunk of rows at a time; where the fused path recomputes, a chunk keeps only its
    /// hidden rows for backward. A teacher with a larger vocabulary is read over the student's
    /// (the padding rows past it are ignored, as TRL's projection does).
    pub fn distill_rows(
        &self,
        h: &Tensor,
        teacher: &Transformer,
        teacher_h: &Tensor,
        divergence: impl Into<grpo_core::distill::Divergence>,
        temperature: f64,
    ) -> Result<(Tensor, Tensor)> {
        self.distill_rows_with(
            h,
            DistillTeacher::Local {
                model: teacher,
                hidden: teacher_h,
            },
            None,
            divergence,
            temperature,
        )
    }

    /// [`Self::distill_rows`] against a local teacher or a teacher on a server (its top-k and
    /// own-token log-probs at each row, [`grpo_core::distill::ServedRows`]), with each row's own
    /// token `tokens` `(N,)` where the divergence needs it
    /// ([`grpo_core::distill::Divergence::Sparse`]'s sampled top-1 support).
    pub fn distill_rows_with(
        &self,
        h: &Tensor,
        teacher: DistillTeacher<'_>,
        tokens: Option<&Tensor>,
        divergence: impl Into<grpo_core::distill::Divergence>,
        temperature: f64,
    ) -> Result<(Tensor, Tensor)> {
        use grpo_core::distill::{ServedRows, TeacherRows};
        let divergence = divergence.into();
        let v = self.cfg.vocab_size;
        if let DistillTeacher::Local { model, .. } = teacher
            && model.cfg.vocab_size < v
        {
            bail!(
                "distillation: the teacher's vocabulary ({}) is smaller than the student's ({v})",
                model.cfg.vocab_size
            );
        }
        let total = h.dim(0)?;
        let rows = grpo_core::logprobs::chunk_rows_on(v, h.device());
        let head_w = self.head_weight()?;
        let (mut divs, mut ents) = (Vec::new(), Vec::new());
        let mut start = 0;
        while start < total {
            let n = rows.min(total - start);
            // A chunk's teacher: logits (N, V) or served rows.
            let (zt, served): (Option<Tensor>, Option<ServedRows>) = match teacher {
                DistillTeacher::Local { model, hidden } => (
                    Some(
                        model
                            .logits(&hidden.narrow(0, start, n)?.detach())?
                            .detach()
                            .narrow(1, 0, v)?,
                    ),
                    None,
                ),
                DistillTeacher::Served(s) => (None, Some(s.narrow(start, n)?)),
            };
            let toks = tokens.map(|t| t.narrow(0, start, n)).transpose()?;
            let hc = self.for_head(&h.narrow(0, start, n)?)?;
            let pair = move |z: &Tensor| -> Result<Tensor> {
                let div = match (&zt, &served) {
                    (Some(zt), _) => divergence.of_rows(
                        z,
                        TeacherRows::Logits(&zt.to_device(z.device())?),
                        toks.as_ref(),
                        temperature,
                    )?,
                    (None, Some(s)) => divergence.of_rows(
                        z,
                        TeacherRows::Served(&s.to_device(z.device())?),
                        toks.as_ref(),
                        temperature,
                    )?,
                    (None, None) => unreachable!("a chunk has one teacher"),
                };
                let ent = grpo_core::logprobs::entropy_from_logits(&(z.detach() / temperature)?)?
                    .to_dtype(div.dtype())?;
                Tensor::stack(&[div, ent], 1)
            };
            let out = if grpo_core::fused::path(&hc) == Path::Recompute && !self.decoding {
                let head = head_w.clone();
                Recompute::new("distill_head", move |a, _| {
                    pair(&crate::fused::frozen_linear(&a[0], &a[1])?)
                })
                .apply(&[&hc, &head])?
            } else {
                pair(&self.logits_with(&hc, &head_w)?)?
            };
            divs.push(out.narrow(1, 0, 1)?.squeeze(1)?);
            ents.push(out.narrow(1, 1, 1)?.squeeze(1)?.detach());
            start += n;
        }
        Ok((Tensor::cat(&divs, 0)?, Tensor::cat(&ents, 0)?))
    }

    /// The hidden rows `(B·t, H)` that predict the last `t` tokens of each row, those tokens
    /// `(B·t,)`, and `(B, t)`.
    fn scored_rows(
        &self,
        input_ids: &Tensor,
        positions: &Tensor,
        bias: &Tensor,
        t: usize,
    ) -> Result<(Tensor, Tensor, (usize, usize))> {
        let (b, l) = input_ids.dims2()?;
        if t == 0 || t >= l {
            bail!("logits_to_keep must be in 1..{l} (the sequence length), got {t}");
        }
        let hidden = self.forward_hidden(input_ids, positions, bias, None)?;
        let h = hidden
            .narrow(1, l - t - 1, t)?
            .reshape((b * t, self.cfg.hidden_size))?;
        let targets = input_ids.narrow(1, l - t, t)?.reshape(b * t)?;
        Ok((h, targets, (b, t)))
    }

    /// Log-probs (and entropies) of `targets` `(N,)` under the logits of hidden states `h`
    /// `(N, H)` divided by `temperature`, a chunk of rows at a time; returned as `shape`.
    fn target_logprobs(
        &self,
        h: &Tensor,
        targets: &Tensor,
        shape: (usize, usize),
        temperature: f64,
        with_entropy: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (lp, ent, _) =
            self.target_stats(h, targets, shape, temperature, with_entropy, false)?;
        Ok((lp, ent))
    }

    /// [`Self::target_logprobs`], and with `with_extras` two more per-token values without
    /// gradient from the same chunks of logits: whether the target is the head's most likely
    /// token (1.0 / 0.0) and the mean of the row's logits — TRL's `mean_token_accuracy` and
    /// `logits/*` inputs.
    fn target_stats(
        &self,
        h: &Tensor,
        targets: &Tensor,
        shape: (usize, usize),
        temperature: f64,
        with_entropy: bool,
        with_extras: bool,
    ) -> Result<StatsPass> {
        let with_top1 = with_extras;
        let total = h.dim(0)?;
        let rows = grpo_core::logprobs::chunk_rows_on(self.cfg.vocab_size, h.device());
        let head_w = self.head_weight()?;
        let (mut lps, mut ents, mut tops, mut means) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut start = 0;
        while start < total {
            let n = rows.min(total - start);
            let hc = self.for_head(&h.narrow(0, start, n)?)?;
            let tg = targets.narrow(0, start, n)?;
            if grpo_core::fused::path(&hc) == Path::Recompute && !self.decoding {
                // Head, log-softmax and entropy as one node that keeps only the hidden rows:
                // no (rows, vocab) logits, in any dtype, are stored for backward.
                let head = head_w.clone();
                let out = LogitsOut::of(&self.cfg);
                let out = Recompute::new("head_logprobs", move |a, recomputing| {
                    // The indicator has no gradient: zeros when backward recomputes.
                    let top1 = match (with_top1, recomputing) {
                        (false, _) => Top1::No,
                        (true, true) => Top1::Zeros,
                        (true, false) => Top1::Compute,
                    };
                    head_logprobs(&a[0], &a[1], &tg, temperature, with_entropy, top1, out)
                })
                .apply(&[&hc, &head])?;
                lps.push(out.narrow(1, 0, 1)?.squeeze(1)?);
                if with_entropy {
                    ents.push(out.narrow(1, 1, 1)?.squeeze(1)?);
                }
                if with_top1 {
                    let k = out.dim(1)? - 2;
                    tops.push(out.narrow(1, k, 1)?.squeeze(1)?.detach());
                    means.push(out.narrow(1, k + 1, 1)?.squeeze(1)?.detach());
                }
                start += n;
                continue;
            }
            let mut logits = self.logits_with(&hc, &head_w)?;
            if temperature != 1.0 && temperature > 0.0 {
                logits = (logits / temperature)?;
            }
            lps.push(grpo_core::logprobs::selective_log_softmax(&logits, &tg)?);
            if with_entropy {
                ents.push(grpo_core::logprobs::entropy_from_logits(&logits)?);
            }
            if with_top1 {
                tops.push(top1_of(&logits.detach(), &tg)?);
                means.push(logits.detach().to_dtype(DType::F32)?.mean(1)?);
            }
            start += n;
        }
        let lp = Tensor::cat(&lps, 0)?.reshape(shape)?;
        let cat = |v: &[Tensor]| -> Result<Tensor> { Tensor::cat(v, 0)?.reshape(shape) };
        let ent = match with_entropy {
            true => Some(cat(&ents)?),
            false => None,
        };
        let extras = match with_extras {
            true => Some((cat(&tops)?, cat(&means)?)),
            false => None,
        };
        Ok((lp, ent, extras))
    }

    /// [`Self::completion_logprobs`] for completions that share prompts, each prompt run once.
    ///
    /// `prompt_ids` / `prompt_mask` `(U, P)` are the distinct prompts, left-padded (every row
    /// has at least one real token); `prompt_of[i]` is the prompt of completion row `i`;
    /// `completion_ids` / `completion_mask` `(B, C)` are the completions, right-padded. The
    /// prompts' keys and values (with their autograd graph) are repeated to the completion rows
    /// and put before the completions' own, so gradients from all of a prompt's completions
    /// meet in its one forward pass. Returns the log-probs (and entropies) of the `C`
    /// completion tokens, `(B, C)`, equal to the full forward of each prompt + completion row
    /// up to float rounding. With G completions per prompt the prompt positions cost 1/G of
    /// the full forward's.
    #[allow(clippy::too_many_arguments)]
    pub fn shared_prompt_logprobs(
        &self,
        prompt_ids: &Tensor,
        prompt_mask: &Tensor,
        prompt_of: &[u32],
        completion_ids: &Tensor,
        completion_mask: &Tensor,
        temperature: f64,
        with_entropy: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (h, targets, shape) = self.shared_prompt_rows(
            prompt_ids,
            prompt_mask,
            prompt_of,
            completion_ids,
            completion_mask,
        )?;
        self.target_logprobs(&h, &targets, shape, temperature, with_entropy)
    }

    /// [`Self::shared_prompt_logprobs`] at temperature 1 with [`TokenStats`].
    pub fn shared_prompt_stats(
        &self,
        prompt_ids: &Tensor,
        prompt_mask: &Tensor,
        prompt_of: &[u32],
        completion_ids: &Tensor,
        completion_mask: &Tensor,
    ) -> Result<TokenStats> {
        let (h, targets, shape) = self.shared_prompt_rows(
            prompt_ids,
            prompt_mask,
            prompt_of,
            completion_ids,
            completion_mask,
        )?;
        token_stats(self.target_stats(&h, &targets, shape, 1.0, true, true)?)
    }

    /// The hidden rows that predict each completion token of [`Self::shared_prompt_logprobs`],
    /// its targets and the `(B, C)` shape.
    fn shared_prompt_rows(
        &self,
        prompt_ids: &Tensor,
        prompt_mask: &Tensor,
        prompt_of: &[u32],
        completion_ids: &Tensor,
        completion_mask: &Tensor,
    ) -> Result<(Tensor, Tensor, (usize, usize))> {
        let dev = self.device();
        let (u, p) = prompt_ids.dims2()?;
        let (b, c) = completion_ids.dims2()?;
        if prompt_of.len() != b || completion_mask.dims2()? != (b, c) {
            bail!(
                "shared_prompt_logprobs: {} prompt indices and a {:?} mask for {b} completion rows",
                prompt_of.len(),
                completion_mask.dims()
            );
        }
        if let Some(&bad) = prompt_of.iter().find(|&&g| g as usize >= u) {
            bail!("shared_prompt_logprobs: prompt index {bad} out of range (there are {u})");
        }
        if c == 0 || p == 0 {
            bail!("shared_prompt_logprobs needs at least one prompt and one completion position");
        }
        if self.cfg.recurrent() {
            // Linear-attention layers keep a state, not keys and values to share: each row
            // runs its prompt with its completion (the same log-probs, the prompt's cost per
            // row).
            let rows = Tensor::from_vec(prompt_of.to_vec(), b, dev)?;
            let joined = |prompt: &Tensor, completion: &Tensor| -> Result<Tensor> {
                let prompt = prompt.to_device(dev)?.index_select(&rows, 0)?;
                let completion = completion.to_device(dev)?.to_dtype(prompt.dtype())?;
                Tensor::cat(&[&prompt, &completion], 1)
            };
            let ids = joined(prompt_ids, completion_ids)?;
            let mask = joined(prompt_mask, completion_mask)?;
            return self.padded_rows(&ids, &mask, c);
        }
        let pmask = prompt_mask.to_dtype(DType::F32)?;
        let plen = pmask.sum_keepdim(1)?; // (U, 1)
        let lens: Vec<f32> = plen.squeeze(1)?.to_vec1()?;
        if let Some(g) = lens.iter().position(|&n| n < 0.5) {
            bail!("shared_prompt_logprobs: prompt row {g} has no real token");
        }
        // The prompts alone, collecting each layer's keys and values.
        let (ppos, pbias) = padded_positions_and_bias(prompt_mask, dev)?;
        let mut prefix = Vec::with_capacity(self.layers.len());
        // A prompt's rows count once per completion in the MoE load-balancing loss, as in the
        // padded rows that repeat them.
        let mut times = vec![0u32; u];
        for &g in prompt_of {
            times[g as usize] += 1;
        }
        let ph = crate::moe::with_rows(self.aux_rows(prompt_mask, Some(&times))?, || {
            self.forward_kv(prompt_ids, &ppos, &pbias, Kv::Collect(&mut prefix))
        })?;
        let rows = Tensor::from_vec(prompt_of.to_vec(), b, dev)?;
        let prefix = prefix
            .iter()
            .map(|(k, v)| {
                Ok((
                    k.contiguous()?.index_select(&rows, 0)?,
                    v.contiguous()?.index_select(&rows, 0)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        // The completions after them: positions continue each prompt's; a query sees its
        // prompt's real tokens and the real completion tokens up to itself.
        let of_row = |t: &Tensor| t.index_select(&rows, 0);
        let pos = of_row(&plen)?
            .broadcast_add(&Tensor::arange(0f32, c as f32, dev)?.unsqueeze(0)?)?
            .to_dtype(DType::U32)?;
        let prompt_blocked = (1.0 - of_row(&pmask)?)?
            .reshape((b, 1, 1, p))?
            .broadcast_as((b, 1, c, p))?;
        let cmask = completion_mask.to_dtype(DType::F32)?;
        let completion_blocked = causal_blocked(c, dev)?
            .reshape((1, 1, c, c))?
            .broadcast_add(&(1.0 - cmask)?.reshape((b, 1, 1, c))?)?
            .clamp(0.0, 1.0)?;
        let bias = Tensor::cat(&[&prompt_blocked.contiguous()?, &completion_blocked], 3)?
            .affine(mask_value(DType::F32), 0.0)?;
        let ch = crate::moe::with_rows(self.aux_rows(completion_mask, None)?, || {
            self.forward_kv(completion_ids, &pos, &bias, Kv::Prefix(&prefix))
        })?;
        // Token j is predicted from position j - 1: the prompt's last for j = 0.
        let hs = self.cfg.hidden_size;
        let last = ph
            .narrow(1, p - 1, 1)?
            .contiguous()?
            .index_select(&rows, 0)?;
        let h = if c > 1 {
            Tensor::cat(&[&last, &ch.narrow(1, 0, c - 1)?], 1)?
        } else {
            last
        }
        .reshape((b * c, hs))?;
        let targets = completion_ids.reshape(b * c)?;
        Ok((h, targets, (b, c)))
    }
}

/// Per-token values of a pass over completion tokens, each `(B, C)`: what TRL's trainers log
/// beside their losses.
#[derive(Debug, Clone)]
pub struct TokenStats {
    /// Log-probabilities (with the autograd graph).
    pub logps: Tensor,
    /// Entropy of the next-token distribution (no gradient).
    pub entropy: Tensor,
    /// 1.0 where the token is the most likely one, else 0.0 (no gradient).
    pub top1: Tensor,
    /// Mean of the row's logits (no gradient).
    pub mean_logits: Tensor,
}

/// A chunked head pass: log-probs, entropies if asked, and if asked the top-1 indicators with
/// the mean logits.
type StatsPass = (Tensor, Option<Tensor>, Option<(Tensor, Tensor)>);

/// The outputs of a stats pass, all present.
fn token_stats((lp, ent, extras): StatsPass) -> Result<TokenStats> {
    match (ent, extras) {
        (Some(entropy), Some((top1, mean_logits))) => Ok(TokenStats {
            logps: lp,
            entropy,
            top1,
            mean_logits,
        }),
        _ => bail!("token stats: entropy, top-1 and mean logits were asked for"),
    }
}

/// 1.0 where `targets` `(N,)` is the largest of its row of `logits` `(N, V)` (ties count),
/// 0.0 elsewhere, in f32.
fn top1_of(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let at = logits
        .contiguous()?
        .gather(&targets.unsqueeze(1)?.contiguous()?, 1)?
        .squeeze(1)?;
    at.ge(&logits.max(1)?)?.to_dtype(DType::F32)
}

/// What turns the head's products `z` into the model's logits: Granite's `logits_scaling`
/// divides, Gemma 2's `final_logit_softcapping` caps (`cap · tanh(z / cap)`); `z` elsewhere.
#[derive(Debug, Clone, Copy)]
struct LogitsOut {
    divide: Option<f64>,
    cap: Option<f64>,
}

impl LogitsOut {
    fn of(cfg: &ModelConfig) -> Self {
        Self {
            divide: cfg.granite.map(|g| g.logits_scaling).filter(|d| *d != 1.0),
            cap: cfg.final_logit_softcapping,
        }
    }

    fn apply(self, logits: Tensor) -> Result<Tensor> {
        let logits = match self.divide {
            Some(d) => (logits / d)?,
            None => logits,
        };
        match self.cap {
            Some(c) => (logits / c)?.tanh()? * c,
            None => Ok(logits),
        }
    }
}

/// Log-probs of `targets` under `h · headᵀ / temperature` (and entropies): `(N, 1)`, or `(N, 2)`
/// with the entropy in the second column.
fn head_logprobs(
    h: &Tensor,
    head: &Tensor,
    targets: &Tensor,
    temperature: f64,
    with_entropy: bool,
    top1: Top1,
    out: LogitsOut,
) -> Result<Tensor> {
    let mut logits = out.apply(crate::fused::frozen_linear(h, head)?)?;
    if temperature != 1.0 && temperature > 0.0 {
        logits = (logits / temperature)?;
    }
    let lp = grpo_core::logprobs::selective_log_softmax(&logits, targets)?;
    let mut cols = vec![lp.clone()];
    if with_entropy {
        cols.push(grpo_core::logprobs::entropy_from_logits(&logits)?);
    }
    match top1 {
        Top1::No => {}
        Top1::Zeros => {
            cols.push(lp.zeros_like()?);
            cols.push(lp.zeros_like()?);
        }
        Top1::Compute => {
            let z = logits.detach();
            cols.push(top1_of(&z, targets)?.to_dtype(lp.dtype())?);
            cols.push(z.to_dtype(DType::F32)?.mean(1)?.to_dtype(lp.dtype())?);
        }
    }
    match cols.len() {
        1 => lp.unsqueeze(1),
        _ => Tensor::stack(&cols, 1),
    }
}

/// Whether [`head_logprobs`] adds the top-1 and mean-logit columns, and how.
#[derive(Clone, Copy)]
enum Top1 {
    No,
    /// Zeros (a recomputation for backward: neither has a gradient).
    Zeros,
    Compute,
}

/// Position ids (each row counts from 0 at its first real token) and the additive causal +
/// padding bias `(B, 1, L, L)` for a left-padded batch, built with tensor ops on `device`
/// (nothing goes through the host).
pub fn padded_positions_and_bias(
    attention_mask: &Tensor,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let mask = attention_mask.to_device(device)?.to_dtype(DType::F32)?;
    let (b, l) = mask.dims2()?;
    // Real tokens count 0, 1, ...; padding takes id 0 (its outputs are never used).
    let pos = ((mask.cumsum(1)? - 1.0)? * &mask)?
        .relu()?
        .to_dtype(DType::U32)?;
    let padding = mask.eq(0.0)?.to_dtype(DType::F32)?.reshape((b, 1, 1, l))?;
    let bias = causal_blocked(l, device)?
        .reshape((1, 1, l, l))?
        .broadcast_add(&padding)?
        .clamp(0.0, 1.0)?
        .affine(mask_value(DType::F32), 0.0)?;
    Ok((pos, bias))
}

/// Position ids and the additive attention bias `(B, 1, L, L)` for rows that each hold several
/// sequences end to end (packed rows, TRL's padding-free batches): `seq_lengths[r]` are row
/// `r`'s sequence lengths in order; each sequence counts its positions from 0 and attends only
/// to its own earlier tokens, so it gets what it would get alone. Positions past a row's
/// sequences (right padding up to `l`) are one more sequence, whose outputs nothing reads.
pub fn packed_positions_and_bias(
    seq_lengths: &[Vec<usize>],
    l: usize,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let b = seq_lengths.len();
    let (mut pos, mut seg) = (Vec::with_capacity(b * l), Vec::with_capacity(b * l));
    for (r, lens) in seq_lengths.iter().enumerate() {
        let used: usize = lens.iter().sum();
        if used > l || lens.contains(&0) {
            bail!("packed row {r}: sequences of {lens:?} tokens in a row of {l}");
        }
        for (k, &n) in lens.iter().enumerate() {
            pos.extend(0..n as u32);
            seg.extend(std::iter::repeat_n(k as f32, n));
        }
        pos.extend(0..(l - used) as u32);
        seg.extend(std::iter::repeat_n(lens.len() as f32, l - used));
    }
    let pos = Tensor::from_vec(pos, (b, l), device)?;
    let seg = Tensor::from_vec(seg, (b, l), device)?;
    let other = seg
        .reshape((b, l, 1))?
        .broadcast_ne(&seg.reshape((b, 1, l))?)?
        .to_dtype(DType::F32)?;
    let bias = other
        .broadcast_add(&causal_blocked(l, device)?.reshape((1, l, l))?)?
        .clamp(0.0, 1.0)?
        .affine(mask_value(DType::F32), 0.0)?
        .reshape((b, 1, l, l))?;
    Ok((pos, bias))
}

/// `(L, L)` f32, 1 where query `i` may not see key `j` (a later one: `j > i`).
fn causal_blocked(l: usize, device: &Device) -> Result<Tensor> {
    let qi = Tensor::arange(0u32, l as u32, device)?.reshape((l, 1))?;
    let kj = Tensor::arange(0u32, l as u32, device)?.reshape((1, l))?;
    kj.broadcast_gt(&qi)?.to_dtype(DType::F32)
}

/// The mask value used for masked attention scores in `dtype`.
pub fn attention_mask_value(dtype: DType) -> f64 {
    mask_value(dtype)
}

/// gpt-oss's clamped SwiGLU of an expert's `gate` and `up` ([`crate::config::Activation`]):
/// `g = min(gate, limit)`, `u = clamp(up, −limit, limit)`, `(u + 1) · g · sigmoid(alpha · g)`,
/// as transformers' `GptOssExperts._apply_gate` (a clamped value passes no gradient).
pub fn clamped_swiglu(gate: &Tensor, up: &Tensor, alpha: f64, limit: f64) -> Result<Tensor> {
    let g = gate.minimum(limit)?;
    let u = up.clamp(-limit, limit)?;
    let sig = (g.affine(-alpha, 0.0)?.exp()? + 1.0)?.recip()?;
    (u + 1.0)? * (g * sig)?
}
