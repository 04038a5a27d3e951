//! Qwen3.5's linear-attention layers ([`crate::config::Arch::Qwen3_5`], `qwen3_5_text`): the
//! gated delta rule as transformers' `Qwen3_5GatedDeltaNet` computes it.
//!
//! A linear layer keeps, per value head, a state `S` `(key_dim, value_dim)` in place of a KV
//! cache. Its input rows (padding positions zeroed) go through `in_proj_qkv`, a causal
//! depthwise convolution over the last `linear_conv_kernel_dim` positions and SiLU, and split
//! into q, k (L2-normalised, q also scaled by `key_dim^-1/2`) and v; `in_proj_b` gives each
//! value head a write strength `β = sigmoid(b)`, `in_proj_a` its decay `g = −exp(A_log) ·
//! softplus(a + dt_bias)`. Each position then decays the state by `exp(g)`, writes
//! `k ⊗ β (v − Sᵀk)` into it (the delta rule) and reads `o = Sᵀq`. The output rows are
//! RMS-normalised per head, times the norm's weight and `silu(z)` (`in_proj_z`), and go
//! through `out_proj`. Key heads serve `linear_num_value_heads / linear_num_key_heads`
//! consecutive value heads each.
//!
//! Training runs the rule a chunk of positions at a time ([`chunked_rule`]): within a chunk
//! its products are matrix products, the unit lower-triangular system of the delta rule
//! inverted by doubling (`log2(chunk)` steps of two products each); the state passes from
//! chunk to chunk. Every step is a candle op: autograd gives the backward on every device.
//! Generation keeps each row's state and its last `kernel − 1` convolution inputs
//! ([`crate::model::KvCache`]); a decode step is a chunk of one position.

use candle_core::{D, DType, Result, Tensor, bail};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::model::Linear;

/// The longest chunk of [`chunked_rule`] (transformers' `chunk_size`).
pub const CHUNK: usize = 64;

/// The linear-attention fields of a [`crate::config::ModelConfig`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeltaConfig {
    /// The layers with linear attention (`layer_types` `linear_attention`); the others have
    /// gated full attention.
    pub layers: Vec<usize>,
    /// `linear_num_key_heads`.
    pub key_heads: usize,
    /// `linear_num_value_heads` (a multiple of the key heads).
    pub value_heads: usize,
    /// `linear_key_head_dim`.
    pub key_dim: usize,
    /// `linear_value_head_dim`.
    pub value_dim: usize,
    /// `linear_conv_kernel_dim`.
    pub conv_kernel: usize,
}

impl DeltaConfig {
    /// Reads the fields of a `qwen3_5_text` config (transformers' defaults where absent:
    /// every 4th layer full, `full_attention_interval`).
    pub fn from_hf_json(v: &Value, num_layers: usize) -> Result<Self> {
        let num = |k: &str, default: usize| -> Result<usize> {
            match v.get(k) {
                None | Some(Value::Null) => Ok(default),
                Some(x) => x
                    .as_u64()
                    .filter(|n| *n > 0)
                    .map(|n| n as usize)
                    .ok_or_else(|| {
                        candle_core::Error::msg(format!(
                            "field `{k}` must be a positive integer, not {x}"
                        ))
                    }),
            }
        };
        let layers = match layers_of_type(v, num_layers, "linear_attention")? {
            Some(l) => l,
            None => {
                let every = num("full_attention_interval", 4)?;
                (0..num_layers)
                    .filter(|i| !(i + 1).is_multiple_of(every))
                    .collect()
            }
        };
        let cfg = Self {
            layers,
            key_heads: num("linear_num_key_heads", 16)?,
            value_heads: num("linear_num_value_heads", 32)?,
            key_dim: num("linear_key_head_dim", 128)?,
            value_dim: num("linear_value_head_dim", 128)?,
            conv_kernel: num("linear_conv_kernel_dim", 4)?,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks that the key heads divide the value heads.
    pub fn validate(&self) -> Result<()> {
        if !self.value_heads.is_multiple_of(self.key_heads) {
            bail!(
                "linear_num_value_heads = {} is not a multiple of linear_num_key_heads = {}",
                self.value_heads,
                self.key_heads
            );
        }
        Ok(())
    }

    /// Writes the fields into a config object (the inverse of [`Self::from_hf_json`]).
    pub fn write_hf_json(&self, obj: &mut serde_json::Map<String, Value>, num_layers: usize) {
        let types: Vec<&str> = (0..num_layers)
            .map(|i| match self.is_linear(i) {
                true => "linear_attention",
                false => "full_attention",
            })
            .collect();
        obj.insert("layer_types".into(), serde_json::json!(types));
        obj.insert("linear_num_key_heads".into(), self.key_heads.into());
        obj.insert("linear_num_value_heads".into(), self.value_heads.into());
        obj.insert("linear_key_head_dim".into(), self.key_dim.into());
        obj.insert("linear_value_head_dim".into(), self.value_dim.into());
        obj.insert("linear_conv_kernel_dim".into(), self.conv_kernel.into());
    }

    /// Whether layer `i` has linear attention.
    pub fn is_linear(&self, i: usize) -> bool {
        self.layers.contains(&i)
    }

    /// The width of q and of k (all key heads).
    pub fn keys_width(&self) -> usize {
        self.key_heads * self.key_dim
    }

    /// The width of v, z and the output (all value heads).
    pub fn values_width(&self) -> usize {
        self.value_heads * self.value_dim
    }

    /// The convolution's channels: q, k and v side by side.
    pub fn conv_width(&self) -> usize {
        2 * self.keys_width() + self.values_width()
    }

    /// Parameters of one linear-attention token mixer (`hidden` wide).
    pub fn parameters(&self, hidden: usize) -> usize {
        let (c, vw, nv) = (self.conv_width(), self.values_width(), self.value_heads);
        hidden * (c + vw + 2 * nv) + vw * hidden + c * self.conv_kernel + 2 * nv + self.value_dim
    }
}

/// The names of a linear layer's maps after `model.layers.{i}.linear_attn.`, in
/// [`GatedDelta::linears`]' order.
pub const LINEAR_NAMES: [&str; 5] = [
    "in_proj_qkv",
    "in_proj_z",
    "in_proj_b",
    "in_proj_a",
    "out_proj",
];

/// One linear-attention token mixer's weights.
#[derive(Debug, Clone)]
pub struct GatedDelta {
    /// q, k, v before the convolution `(2 · keys + values, hidden)`.
    pub in_proj_qkv: Linear,
    /// The output gate `(values, hidden)`.
    pub in_proj_z: Linear,
    /// The write strengths `(value_heads, hidden)`.
    pub in_proj_b: Linear,
    /// The decays `(value_heads, hidden)`.
    pub in_proj_a: Linear,
    /// `(hidden, values)`.
    pub out_proj: Linear,
    /// The depthwise convolution `(channels, 1, kernel)`, as the files hold it.
    pub conv: Tensor,
    /// `A_log` `(value_heads,)`.
    pub a_log: Tensor,
    /// `dt_bias` `(value_heads,)`.
    pub dt_bias: Tensor,
    /// The gated norm's weight `(value_dim,)`.
    pub norm: Tensor,
    /// The norm's epsilon (`rms_norm_eps`).
    pub eps: f64,
    /// The shapes.
    pub cfg: DeltaConfig,
}

/// A linear layer's cached state for generation: the last `kernel − 1` convolution inputs `(B,
/// kernel − 1, channels)` (in the model's dtype) and the delta rule's state `(B, value_heads,
/// key_dim, value_dim)` (f32).
pub type DeltaState = (Tensor, Tensor);

impl GatedDelta {
    /// The five linear maps, in [`LINEAR_NAMES`]' order.
    pub fn linears(&self) -> [&Linear; 5] {
        [
            &self.in_proj_qkv,
            &self.in_proj_z,
            &self.in_proj_b,
            &self.in_proj_a,
            &self.out_proj,
        ]
    }

    /// The five linear maps, mutable.
    pub fn linears_mut(&mut self) -> [&mut Linear; 5] {
        [
            &mut self.in_proj_qkv,
            &mut self.in_proj_z,
            &mut self.in_proj_b,
            &mut self.in_proj_a,
            &mut self.out_proj,
        ]
    }

    /// The tensors besides the linear maps, by their names after `linear_attn.`.
    pub fn tensors(&self) -> [(&'static str, &Tensor); 4] {
        [
            ("conv1d.weight", &self.conv),
            ("A_log", &self.a_log),
            ("dt_bias", &self.dt_bias),
            ("norm.weight", &self.norm),
        ]
    }

    /// The mixer with `f` applied to every tensor.
    pub fn map(&self, f: &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<Self> {
        let lin = |l: &Linear| crate::model::map_linear(l, f);
        Ok(Self {
            in_proj_qkv: lin(&self.in_proj_qkv)?,
            in_proj_z: lin(&self.in_proj_z)?,
            in_proj_b: lin(&self.in_proj_b)?,
            in_proj_a: lin(&self.in_proj_a)?,
            out_proj: lin(&self.out_proj)?,
            conv: f(&self.conv)?,
            a_log: f(&self.a_log)?,
            dt_bias: f(&self.dt_bias)?,
            norm: f(&self.norm)?,
            eps: self.eps,
            cfg: self.cfg.clone(),
        })
    }

    /// The mixer's output rows `(B·L, hidden)` for normalised input rows `h` `(B·L, hidden)`
    /// of `b` rows of `l` positions after `past` (a generation cache's state; `None`: zeros),
    /// with the state after the pass. `tokens` `(B·L, 1)` is 1 at real tokens and 0 at padding
    /// (`None`: all real).
    pub fn run(
        &self,
        h: &Tensor,
        b: usize,
        l: usize,
        tokens: Option<&Tensor>,
        past: Option<&DeltaState>,
    ) -> Result<(Tensor, DeltaState)> {
        let c = &self.cfg;
        let dtype = h.dtype();
        let work = working(dtype);
        // Padding positions zeroed: they then neither write the state nor reach the
        // convolution of later positions.
        let h = padding_zeroed(h, tokens)?;
        let qkv = self
            .in_proj_qkv
            .forward(&h)?
            .reshape((b, l, c.conv_width()))?;
        let z = self.in_proj_z.forward(&h)?;
        let beta = crate::moe::sigmoid(&self.in_proj_b.forward(&h)?.to_dtype(work)?)?;
        let a = self.in_proj_a.forward(&h)?.to_dtype(work)?;
        let dt = self.dt_bias.to_dtype(work)?;
        let g = softplus(&a.broadcast_add(&dt)?)?
            .broadcast_mul(&self.a_log.to_dtype(work)?.exp()?)?
            .neg()?;
        // The causal convolution over the earlier inputs (the cache's, or zeros).
        let (conv, kept) = causal_conv(&qkv, past.map(|(c, _)| c), &self.conv)?;
        let initial = past.map(|(_, s)| s.clone());
        let mixed = conv.silu()?;
        let (kw, vw) = (c.keys_width(), c.values_width());
        let heads = |t: Tensor, n: usize, d: usize| t.reshape((b, l, n, d));
        let q = heads(mixed.narrow(2, 0, kw)?, c.key_heads, c.key_dim)?;
        let k = heads(mixed.narrow(2, kw, kw)?, c.key_heads, c.key_dim)?;
        let v = heads(mixed.narrow(2, 2 * kw, vw)?, c.value_heads, c.value_dim)?;
        let g = g.reshape((b, l, c.value_heads))?;
        let beta = beta.reshape((b, l, c.value_heads))?;
        // A decode step: one position of the recurrence.
        let (o, last) = match l {
            1 => recurrent_step(&q, &k, &v, &g, &beta, initial.as_ref())?,
            _ => chunked_rule(&q, &k, &v, &g, &beta, initial.as_ref())?,
        };
        let state = (kept, last);
        // The gated norm per head: RMS in f32, the weight in the model's dtype, `silu(z)`.
        let o = o
            .to_dtype(dtype)?
            .reshape((b * l * c.value_heads, c.value_dim))?;
        let of = o.to_dtype(work)?;
        let ms = of.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = of
            .broadcast_div(&(ms + self.eps)?.sqrt()?)?
            .to_dtype(dtype)?
            .broadcast_mul(&self.norm)?;
        let gate = z
            .reshape((b * l * c.value_heads, c.value_dim))?
            .to_dtype(work)?
            .silu()?;
        let y = (normed.to_dtype(work)? * gate)?
            .to_dtype(dtype)?
            .reshape((b * l, vw))?;
        Ok((self.out_proj.forward(&y)?, state))
    }
}

/// Rows `h` `(B·L, width)` with the padding rows zeroed (`tokens` `(B·L, 1)`: 1 at real tokens;
/// `None`: all real), as transformers' `apply_mask_to_padding_states` zeroes them before a
/// recurrent mixer.
pub(crate) fn padding_zeroed(h: &Tensor, tokens: Option<&Tensor>) -> Result<Tensor> {
    match tokens {
        Some(m) => h.broadcast_mul(&m.to_dtype(h.dtype())?),
        None => Ok(h.clone()),
    }
}

/// A causal depthwise convolution of `x` `(B, L, channels)` after `past` (the last `kernel −
/// 1` inputs `(B, kernel − 1, channels)` of a generation cache; `None`: zeros) with `weight`
/// `(channels, 1, kernel)`, as the files hold it: the output `(B, L, channels)` and the last
/// `kernel − 1` inputs to keep.
pub(crate) fn causal_conv(
    x: &Tensor,
    past: Option<&Tensor>,
    weight: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let (b, l, channels) = x.dims3()?;
    let kernel = weight.dim(2)?;
    let past = match past {
        Some(p) => p.clone(),
        None => Tensor::zeros((b, kernel - 1, channels), x.dtype(), x.device())?,
    };
    let padded = Tensor::cat(&[&past, x], 1)?;
    let w = weight.reshape((channels, kernel))?;
    let mut conv = padded
        .narrow(1, 0, l)?
        .broadcast_mul(&w.narrow(1, 0, 1)?.t()?)?;
    for j in 1..kernel {
        let tap = w.narrow(1, j, 1)?.t()?;
        conv = (conv + padded.narrow(1, j, l)?.broadcast_mul(&tap)?)?;
    }
    Ok((conv, padded.narrow(1, l, kernel - 1)?.contiguous()?))
}

/// The dtype the rule and the gated norm compute in: f32 (f64 in an f64 model).
fn working(dtype: DType) -> DType {
    match dtype {
        DType::F64 => DType::F64,
        _ => DType::F32,
    }
}

/// `log(1 + exp(x))`, without overflow: `relu(x) + log(1 + exp(−|x|))`.
fn softplus(x: &Tensor) -> Result<Tensor> {
    x.relu()? + (x.abs()?.neg()?.exp()? + 1.0)?.log()?
}

/// `x / sqrt(Σ x² + 1e-6)` over the last axis (FLA's and transformers' L2 norm).
fn l2norm(x: &Tensor) -> Result<Tensor> {
    x.broadcast_div(&(x.sqr()?.sum_keepdim(D::Minus1)? + 1e-6)?.sqrt()?)
}

/// The gated delta rule over `q`, `k` `(B, L, key_heads, Dk)`, `v` `(B, L, value_heads, Dv)`,
/// decays `g` and strengths `beta` `(B, L, value_heads)`, from `initial` `(B, value_heads, Dk,
/// Dv)` (else zeros): q and k are L2-normalised, q scaled by `Dk^-1/2`, everything in f32.
/// Returns the outputs `(B, L, value_heads, Dv)` (f32) and the final state.
///
/// A chunk of `C` positions (a power of two, at most [`CHUNK`]) at a time, as transformers'
/// `torch_chunk_gated_delta_rule`: with `Γ` the decays' running sum in the chunk, `D_ij =
/// exp(Γ_i − Γ_j)` (`j ≤ i`), the strictly lower `T = (β k kᵀ) ∘ D`, the chunk's new values
/// `U = (I + T)⁻¹ (β v)` and state reads `W = (I + T)⁻¹ (β k ∘ exp Γ)`; then per chunk, from
/// the state `S`: `V = U − W S`, `o = (q ∘ exp Γ) S + ((q kᵀ) ∘ D) V`, `S ← exp(Γ_C) S + (k ∘
/// exp(Γ_C − Γ))ᵀ V`.
pub fn chunked_rule(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    initial: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let (b, l, _, dk) = q.dims4()?;
    let (_, _, nv, dv) = v.dims4()?;
    let dev = q.device().clone();
    let work = working(q.dtype());
    let f32 = |t: &Tensor| t.to_dtype(work);
    let (q, k) = normalized(q, k, nv)?;
    // (B, H, L, ·) and the chunk length: the smallest power of two that holds `l`, up to 64.
    let c = l.next_power_of_two().min(CHUNK);
    let n = l.div_ceil(c);
    let pad = n * c - l;
    let heads_first = |t: Tensor| -> Result<Tensor> {
        let t = t.transpose(1, 2)?.contiguous()?;
        match pad {
            0 => Ok(t),
            p => t.pad_with_zeros(2, 0, p),
        }
    };
    let q = heads_first(q)?;
    let k = heads_first(k)?;
    let v = heads_first(f32(v)?)?;
    let beta = heads_first(f32(beta)?.unsqueeze(3)?)?;
    let g = heads_first(f32(g)?.unsqueeze(3)?)?;
    // (B·H, N, C, ·): candle's products take up to two batch axes.
    let chunks = |t: Tensor| -> Result<Tensor> {
        let d = t.dim(3)?;
        t.reshape((b * nv, n, c, d))
    };
    let (q, k, v, beta, g) = (
        chunks(q)?,
        chunks(k)?,
        chunks(v)?,
        chunks(beta)?,
        chunks(g)?,
    );
    // Γ: the decays' running sum within each chunk `(B·H, N, C, 1)`.
    let cum = g.cumsum(2)?;
    let lower = Tensor::from_vec(
        (0..c * c)
            .map(|x| u8::from(x % c <= x / c) as f32)
            .collect::<Vec<f32>>(),
        (c, c),
        &dev,
    )?
    .to_dtype(work)?;
    // D_ij = exp(Γ_i − Γ_j) for j ≤ i, 0 above (the difference clamped there first: it can be
    // large and positive).
    let diff = cum.broadcast_sub(&cum.transpose(2, 3)?)?;
    let decay = diff.minimum(0.0)?.exp()?.broadcast_mul(&lower)?;
    let k_beta = k.broadcast_mul(&beta)?;
    let v_beta = v.broadcast_mul(&beta)?;
    let kt = k.transpose(2, 3)?.contiguous()?;
    let strict = lower.broadcast_sub(&Tensor::eye(c, work, &dev)?)?;
    let t = k_beta.matmul(&kt)?.mul(&decay)?.broadcast_mul(&strict)?;
    let inv = unit_lower_inverse(&t, c, work)?;
    let exp_cum = cum.exp()?;
    let u = inv.matmul(&v_beta)?;
    let w = inv.matmul(&k_beta.broadcast_mul(&exp_cum)?)?;
    let attn = q.matmul(&kt)?.mul(&decay)?;
    let q_dec = q.broadcast_mul(&exp_cum)?;
    let last = cum.narrow(2, c - 1, 1)?;
    let k_dec = k.broadcast_mul(&last.broadcast_sub(&cum)?.exp()?)?;
    let chunk_decay = last.exp()?; // (B·H, N, 1, 1)
    let mut s = match initial {
        Some(s) => f32(s)?.reshape((b * nv, dk, dv))?,
        None => Tensor::zeros((b * nv, dk, dv), work, &dev)?,
    };
    let mut outs = Vec::with_capacity(n);
    for i in 0..n {
        let at = |t: &Tensor| -> Result<Tensor> { t.narrow(1, i, 1)?.squeeze(1) };
        let vn = (at(&u)? - at(&w)?.matmul(&s)?)?;
        let o = (at(&q_dec)?.matmul(&s)? + at(&attn)?.matmul(&vn)?)?;
        outs.push(o);
        let kd = at(&k_dec)?.transpose(1, 2)?.contiguous()?;
        s = (s.broadcast_mul(&at(&chunk_decay)?)? + kd.matmul(&vn)?)?;
    }
    let o = Tensor::cat(&outs, 1)?
        .narrow(1, 0, l)?
        .reshape((b, nv, l, dv))?;
    Ok((
        o.transpose(1, 2)?.contiguous()?,
        s.reshape((b, nv, dk, dv))?,
    ))
}

/// q and k `(B, L, key_heads, Dk)` as the rule reads them, in its working dtype: L2-normalised
/// (q also scaled by `Dk^-1/2`), each key head spread over the `nv / key_heads` consecutive
/// value heads it serves: `(B, L, nv, Dk)`.
fn normalized(q: &Tensor, k: &Tensor, nv: usize) -> Result<(Tensor, Tensor)> {
    let (b, l, nk, dk) = q.dims4()?;
    if !nv.is_multiple_of(nk) {
        bail!("gated delta rule: {nv} value heads are not a multiple of {nk} key heads");
    }
    let work = working(q.dtype());
    let spread = |t: &Tensor| -> Result<Tensor> {
        let t = l2norm(&t.to_dtype(work)?)?;
        match nv / nk {
            1 => Ok(t),
            r => t
                .unsqueeze(3)?
                .broadcast_as((b, l, nk, r, dk))?
                .reshape((b, l, nv, dk)),
        }
    };
    Ok(((spread(q)? * (dk as f64).powf(-0.5))?, spread(k)?))
}

/// [`chunked_rule`] for one position (a decode step), as transformers'
/// `torch_recurrent_gated_delta_rule`: the state decayed by `exp(g)`, `β (v − Sᵀk)` written
/// along `k`, `Sᵀq` read. Same arguments and results, `L` = 1.
pub fn recurrent_step(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    initial: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let (b, _, nv, dv) = v.dims4()?;
    let dk = q.dim(3)?;
    let work = working(q.dtype());
    let (q, k) = normalized(q, k, nv)?;
    // (B, H, 1, ·) rows and (B, H, 1, 1) scalars.
    let rows = |t: Tensor| t.transpose(1, 2)?.contiguous();
    let scalars = |t: &Tensor| t.to_dtype(work)?.reshape((b, nv, 1, 1));
    let (q, k, v) = (rows(q)?, rows(k)?, rows(v.to_dtype(work)?)?);
    let s = match initial {
        Some(s) => s.to_dtype(work)?,
        None => Tensor::zeros((b, nv, dk, dv), work, q.device())?,
    };
    let s = s.broadcast_mul(&scalars(g)?.exp()?)?;
    let delta = (v - k.matmul(&s)?)?.broadcast_mul(&scalars(beta)?)?;
    let s = (s + k.transpose(2, 3)?.matmul(&delta)?)?;
    let o = q.matmul(&s)?.transpose(1, 2)?.contiguous()?;
    Ok((o, s))
}

/// `(I + T)⁻¹` of strictly lower-triangular `T` `(…, C, C)` (`C` a power of two) by doubling:
/// with `M` the inverse of `T`'s diagonal blocks of size `s`, the blocks of size `2s` are
/// inverted by `M − M T_s M`, `T_s` holding the entries of `T` that join two `s`-blocks into
/// one `2s`-block (`[[M₁, 0], [−M₂ T₂₁ M₁, M₂]]`).
fn unit_lower_inverse(t: &Tensor, c: usize, work: DType) -> Result<Tensor> {
    let dev = t.device();
    let mut m = Tensor::eye(c, work, dev)?
        .broadcast_as(t.shape())?
        .contiguous()?;
    let mut s = 1;
    while s < c {
        let mask: Vec<f32> = (0..c * c)
            .map(|x| {
                let (i, j) = (x / c, x % c);
                let joins = i / (2 * s) == j / (2 * s) && i / s != j / s && i > j;
                u8::from(joins) as f32
            })
            .collect();
        let mask = Tensor::from_vec(mask, (c, c), dev)?.to_dtype(work)?;
        let ts = t.broadcast_mul(&mask)?;
        m = (&m - m.matmul(&ts)?.matmul(&m)?)?;
        s *= 2;
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The rule one position at a time ([`recurrent_step`] over the sequence).
    fn recurrent(q: &Tensor, k: &Tensor, v: &Tensor, g: &Tensor, beta: &Tensor) -> Result<Tensor> {
        let mut s = None;
        let mut outs = Vec::new();
        for t in 0..q.dim(1)? {
            let at = |x: &Tensor| x.narrow(1, t, 1);
            let (o, next) =
                recurrent_step(&at(q)?, &at(k)?, &at(v)?, &at(g)?, &at(beta)?, s.as_ref())?;
            outs.push(o);
            s = Some(next);
        }
        Tensor::cat(&outs, 1)
    }

    #[test]
    fn chunks_equal_the_recurrence_across_chunk_boundaries() -> Result<()> {
        let dev = Device::Cpu;
        let (b, nk, nv, dk, dv) = (2, 2, 4, 8, 4);
        for l in [1, 5, 64, 70, 130] {
            let q = Tensor::randn(0f32, 1.0, (b, l, nk, dk), &dev)?;
            let k = Tensor::randn(0f32, 1.0, (b, l, nk, dk), &dev)?;
            let v = Tensor::randn(0f32, 1.0, (b, l, nv, dv), &dev)?;
            let g = (Tensor::rand(0f32, 1.0, (b, l, nv), &dev)? * -0.3)?;
            let beta = Tensor::rand(0f32, 1.0, (b, l, nv), &dev)?;
            let (o, _) = chunked_rule(&q, &k, &v, &g, &beta, None)?;
            let r = recurrent(&q, &k, &v, &g, &beta)?;
            let d = (o - r)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(d < 2e-5, "length {l}: {d}");
        }
        Ok(())
    }

    #[test]
    fn a_state_carries_a_sequence_split_in_two() -> Result<()> {
        let dev = Device::Cpu;
        let (b, l, nk, nv, dk, dv) = (2, 90, 1, 2, 4, 4);
        let q = Tensor::randn(0f32, 1.0, (b, l, nk, dk), &dev)?;
        let k = Tensor::randn(0f32, 1.0, (b, l, nk, dk), &dev)?;
        let v = Tensor::randn(0f32, 1.0, (b, l, nv, dv), &dev)?;
        let g = (Tensor::rand(0f32, 1.0, (b, l, nv), &dev)? * -0.5)?;
        let beta = Tensor::rand(0f32, 1.0, (b, l, nv), &dev)?;
        let (whole, s_whole) = chunked_rule(&q, &k, &v, &g, &beta, None)?;
        let part = |t: &Tensor, a: usize, n: usize| t.narrow(1, a, n);
        let (first, s) = chunked_rule(
            &part(&q, 0, 37)?,
            &part(&k, 0, 37)?,
            &part(&v, 0, 37)?,
            &part(&g, 0, 37)?,
            &part(&beta, 0, 37)?,
            None,
        )?;
        let (second, s2) = chunked_rule(
            &part(&q, 37, 53)?,
            &part(&k, 37, 53)?,
            &part(&v, 37, 53)?,
            &part(&g, 37, 53)?,
            &part(&beta, 37, 53)?,
            Some(&s),
        )?;
        let joined = Tensor::cat(&[first, second], 1)?;
        let d = (joined - whole)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(d < 2e-5, "{d}");
        let ds = (s2 - s_whole)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(ds < 2e-5, "{ds}");
        Ok(())
    }
}

/// The layers `layer_types` (one per layer, each `recurrent` or `full_attention`) names
/// `recurrent`, or `None` without the field.
pub(crate) fn layers_of_type(
    v: &Value,
    num_layers: usize,
    recurrent: &str,
) -> Result<Option<Vec<usize>>> {
    let Some(t) = v.get("layer_types").filter(|t| !t.is_null()) else {
        return Ok(None);
    };
    let Some(t) = t.as_array().filter(|t| t.len() >= num_layers) else {
        bail!(
            "field `layer_types` must list `{recurrent}` or `full_attention` for each of the {num_layers} layers"
        );
    };
    let mut out = Vec::new();
    for (i, x) in t.iter().take(num_layers).enumerate() {
        match x.as_str() {
            Some(k) if k == recurrent => out.push(i),
            Some("full_attention") => {}
            _ => {
                bail!("field `layer_types[{i}]` must be `{recurrent}` or `full_attention`, not {x}")
            }
        }
    }
    Ok(Some(out))
}

/// A recurrent layer's token mixer, in place of attention: Qwen3.5's gated delta rule or
/// LFM2's gated short convolution ([`crate::shortconv`]). Its cache slot is a [`DeltaState`]
/// (a convolution's last inputs first).
#[derive(Debug, Clone)]
pub enum Mixer {
    /// Qwen3.5's linear attention (`linear_attn`).
    Delta(Box<GatedDelta>),
    /// LFM2's short convolution (`conv`).
    Conv(crate::shortconv::ShortConv),
}

impl Mixer {
    /// The module's name in the files (`model.layers.{i}.linear_attn` / `.conv`).
    pub fn module(&self) -> &'static str {
        match self {
            Mixer::Delta(_) => "linear_attn",
            Mixer::Conv(_) => "conv",
        }
    }

    /// The linear maps' names after [`Self::module`], in [`Self::linears`]' order.
    pub fn linear_names(&self) -> &'static [&'static str] {
        match self {
            Mixer::Delta(_) => &LINEAR_NAMES,
            Mixer::Conv(_) => &crate::shortconv::LINEAR_NAMES,
        }
    }

    /// The linear maps.
    pub fn linears(&self) -> Vec<&Linear> {
        match self {
            Mixer::Delta(d) => d.linears().to_vec(),
            Mixer::Conv(c) => c.linears().to_vec(),
        }
    }

    /// The linear maps, mutable.
    pub fn linears_mut(&mut self) -> Vec<&mut Linear> {
        match self {
            Mixer::Delta(d) => d.linears_mut().into_iter().collect(),
            Mixer::Conv(c) => c.linears_mut().into_iter().collect(),
        }
    }

    /// The tensors besides the linear maps, by their names after [`Self::module`].
    pub fn tensors(&self) -> Vec<(&'static str, &Tensor)> {
        match self {
            Mixer::Delta(d) => d.tensors().to_vec(),
            Mixer::Conv(c) => c.tensors(),
        }
    }

    /// The mixer with `f` applied to every tensor.
    pub fn map(&self, f: &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<Self> {
        Ok(match self {
            Mixer::Delta(d) => Mixer::Delta(Box::new(d.map(f)?)),
            Mixer::Conv(c) => Mixer::Conv(c.map(f)?),
        })
    }

    /// The output rows `(B·L, hidden)` of normalised rows `h` `(B·L, hidden)` of `b` rows of
    /// `l` positions from zero state; `tokens` `(B·L, 1)` is 1 at real tokens and 0 at padding.
    pub fn forward(
        &self,
        h: &Tensor,
        b: usize,
        l: usize,
        tokens: Option<&Tensor>,
    ) -> Result<Tensor> {
        Ok(self.run(h, b, l, tokens, None)?.0)
    }

    /// [`Self::forward`] continuing a generation cache's state, with the state after.
    pub fn run(
        &self,
        h: &Tensor,
        b: usize,
        l: usize,
        tokens: Option<&Tensor>,
        past: Option<&DeltaState>,
    ) -> Result<(Tensor, DeltaState)> {
        match self {
            Mixer::Delta(d) => d.run(h, b, l, tokens, past),
            Mixer::Conv(c) => {
                let (y, kept) = c.run(h, b, l, tokens, past.map(|(conv, _)| conv))?;
                // The cache slot's placeholder carried along (made once, at the prefill).
                let placeholder = match past {
                    Some((_, p)) => p.clone(),
                    None => crate::shortconv::no_state(b, h.device())?,
                };
                Ok((y, (kept, placeholder)))
            }
        }
    }
}
