//! DeepSeek's multi-head latent attention (DeepSeek-V3, GLM-4.7-Flash: [`MlaConfig`]) as the
//! decoder layer's q, k and v heads, so that every attention path of the model — the training
//! passes, gradient checkpointing, the KV cache — serves it unchanged:
//!
//! * q from `q_proj` (or `q_b_proj(q_a_layernorm(q_a_proj(h)))`), each head
//!   `qk_nope_head_dim + qk_rope_head_dim` wide;
//! * one latent per token from `kv_a_proj_with_mqa`: its first `kv_lora_rank` dimensions,
//!   normalised by `kv_a_layernorm`, give each head's key part without RoPE and its value
//!   through `kv_b_proj`; its last `qk_rope_head_dim` are the key's rotated part, the same for
//!   every head;
//! * each query and key head reordered to the model's RoPE layout (the rotated pairs
//!   `head_dim / 2` apart, the others paired at frequency 0: [`crate::layout`]), the same order
//!   for both so every score is transformers'; the values padded with zeros to a query head's
//!   width, the attention's output cut back to `v_head_dim` before `o_proj`.
//!
//! The layer holds `q_proj` / `q_b_proj` in its q slot, `kv_a_proj_with_mqa` in its k slot and
//! `kv_b_proj` in its v slot ([`crate::model::Layer`]); this module holds the rest.

use candle_core::{Result, Tensor};

use crate::config::MlaConfig;
use crate::model::{Linear, RmsNorm};

/// The epsilon of `q_a_layernorm` and `kv_a_layernorm`: transformers builds them with its
/// RMSNorm's default, whatever the config's `rms_norm_eps` (GLM-4.7-Flash's 1e-5).
pub const NORM_EPS: f64 = 1e-6;

/// A layer's latent-attention parts beyond its q, k and v slots.
#[derive(Debug, Clone)]
pub struct Mla {
    /// The shape.
    pub cfg: MlaConfig,
    /// [`head_order`] as `u32` indices on the model's device (made once, not per forward).
    pub order: Tensor,
    /// [`rope_order`] as `u32` indices on the model's device, with `rope_interleave` (the
    /// identity otherwise: `None`).
    pub rope_order: Option<Tensor>,
    /// `q_a_proj` `(q_lora_rank, hidden)` and `q_a_layernorm` (with `q_lora_rank`).
    pub q_a: Option<(Linear, RmsNorm)>,
    /// `kv_a_layernorm` over the latent.
    pub kv_a_norm: RmsNorm,
}

/// For each of a query / key head's dimensions in the model's layout, the transformers
/// dimension it holds (heads laid out `[nope | rope]`): the rotated pairs' first dimensions,
/// the first half of the others, the pairs' second dimensions, the second half of the others.
/// The pairs are `(n + i, n + i + r/2)`, or `(n + 2i, n + 2i + 1)` with `rope_interleave`.
pub fn head_order(m: &MlaConfig) -> Vec<usize> {
    let (n, r) = (m.qk_nope_head_dim, m.qk_rope_head_dim);
    let (first, second): (Vec<usize>, Vec<usize>) = match m.rope_interleave {
        true => (0..r / 2).map(|i| (n + 2 * i, n + 2 * i + 1)).unzip(),
        false => (0..r / 2).map(|i| (n + i, n + r / 2 + i)).unzip(),
    };
    let mut order = first;
    order.extend(0..n / 2);
    order.extend(second);
    order.extend(n / 2..n);
    order
}

/// [`head_order`] as the `u32` index tensor the projections select with.
pub fn head_order_tensor(m: &MlaConfig, device: &candle_core::Device) -> Result<Tensor> {
    let order: Vec<u32> = head_order(m).into_iter().map(|i| i as u32).collect();
    let n = order.len();
    Tensor::from_vec(order, n, device)
}

/// For each dimension of the rotated part alone (`qk_rope_head_dim` wide, as the latent cache
/// holds it), the dimension of transformers' rotated part it holds: the pairs' first dimensions,
/// then their second ones (RoPE's rotate-half layout). The identity without `rope_interleave`.
pub fn rope_order(m: &MlaConfig) -> Vec<usize> {
    let r = m.qk_rope_head_dim;
    match m.rope_interleave {
        true => (0..r / 2)
            .map(|i| 2 * i)
            .chain((0..r / 2).map(|i| 2 * i + 1))
            .collect(),
        false => (0..r).collect(),
    }
}

/// [`rope_order`] as a `u32` index tensor, `None` where it is the identity.
pub fn rope_order_tensor(m: &MlaConfig, device: &candle_core::Device) -> Result<Option<Tensor>> {
    if !m.rope_interleave {
        return Ok(None);
    }
    let order: Vec<u32> = rope_order(m).into_iter().map(|i| i as u32).collect();
    let n = order.len();
    Tensor::from_vec(order, n, device).map(Some)
}

impl Mla {
    /// The map that makes the query heads (`q_b_proj` after `q_a_proj`, or `q_proj`) and its
    /// PEFT name.
    pub fn q_name(&self) -> &'static str {
        match self.q_a {
            Some(_) => "q_b_proj",
            None => "q_proj",
        }
    }

    /// q `(B, L, heads, D)`, k and v `(B, L, heads, D)` (`D` a query head's width; v zero-padded
    /// to it) of normalised rows `h` `(B·L, hidden)`, in the model's head layout, not rotated:
    /// `q` the layer's q map, `kv_a` its `kv_a_proj_with_mqa`, `kv_b` its `kv_b_proj`.
    #[allow(clippy::too_many_arguments)]
    pub fn projections(
        &self,
        q: &Linear,
        kv_a: &Linear,
        kv_b: &Linear,
        h: &Tensor,
        b: usize,
        l: usize,
        heads: usize,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let m = &self.cfg;
        let (n, r, dv, dq) = (
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.v_head_dim,
            m.qk_head_dim(),
        );
        let q = match &self.q_a {
            Some((a, norm)) => q.forward(&norm.forward(&a.forward(h)?)?)?,
            None => q.forward(h)?,
        };
        let q = q.reshape((b, l, heads, dq))?;
        let kv = kv_a.forward(h)?;
        let latent = self
            .kv_a_norm
            .forward(&kv.narrow(1, 0, m.kv_lora_rank)?.contiguous()?)?;
        let k_rot = kv
            .narrow(1, m.kv_lora_rank, r)?
            .reshape((b, l, 1, r))?
            .broadcast_as((b, l, heads, r))?;
        let kv = kv_b.forward(&latent)?.reshape((b, l, heads, n + dv))?;
        let k = Tensor::cat(&[&kv.narrow(3, 0, n)?, &k_rot.contiguous()?], 3)?;
        let v = kv.narrow(3, n, dv)?;
        let v = match dq > dv {
            true => {
                let pad = Tensor::zeros((b, l, heads, dq - dv), v.dtype(), v.device())?;
                Tensor::cat(&[&v, &pad], 3)?
            }
            false => v.contiguous()?,
        };
        Ok((
            q.index_select(&self.order, 3)?,
            k.index_select(&self.order, 3)?,
            v,
        ))
    }

    /// A pass over a KV cache that holds the latent (the absorbed form of DeepSeek's paper):
    /// per token and layer `kv_lora_rank + qk_rope_head_dim` values — the normalised latent and
    /// the rotated shared key — where the per-head keys and values take `2 · heads · D`
    /// (GLM-4.7-Flash: 576 against 10,240). `kv_b_proj`'s key half is folded into the queries
    /// (`q_nope · W_UK` per head: a query in the latent's space) and its value half applied to
    /// each head's attention-weighted latent, so the scores and the context are those of the
    /// per-head form up to rounding; an adapter on `kv_b_proj` is merged for the pass, its bias
    /// needs only its value half (a key bias adds one constant per query row, which softmax
    /// drops; the weights sum to 1).
    ///
    /// `h` `(B·L, hidden)` normalised rows; `cos`, `sin` the model's RoPE tables of the `L` new
    /// positions (their first `qk_rope_head_dim / 2` columns are the rotated pairs', by
    /// [`head_order`]); `bias` `(B, 1, L, S)`; `write(k_rot, latent, cos, sin)` stores the new
    /// shared keys `(B, L, 1, r)` (rotated by the tables it is given) and latents `(B, L, 1,
    /// kv_lora_rank)` after the cached ones and returns all `S` of each, `(B, 1, S, ·)`. Returns
    /// the context rows `(B·L, heads · v_head_dim)`, as `o_proj` takes them.
    #[allow(clippy::too_many_arguments)]
    pub fn cached_attention(
        &self,
        q: &Linear,
        kv_a: &Linear,
        kv_b: &Linear,
        h: &Tensor,
        (b, l, heads): (usize, usize, usize),
        (cos, sin, bias, scale): (&Tensor, &Tensor, &Tensor, f64),
        write: impl FnOnce(&Tensor, &Tensor, &Tensor, &Tensor) -> Result<(Tensor, Tensor)>,
    ) -> Result<Tensor> {
        let m = &self.cfg;
        let (n, r, dv, c) = (
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.v_head_dim,
            m.kv_lora_rank,
        );
        let rope_layout = |t: Tensor| -> Result<Tensor> {
            match &self.rope_order {
                Some(o) => t.contiguous()?.index_select(o, 3),
                None => Ok(t),
            }
        };
        let q = match &self.q_a {
            Some((a, norm)) => q.forward(&norm.forward(&a.forward(h)?)?)?,
            None => q.forward(h)?,
        };
        let q = q.reshape((b, l, heads, n + r))?;
        let q_nope = q.narrow(3, 0, n)?;
        let q_rot = rope_layout(q.narrow(3, n, r)?)?.contiguous()?;
        let kv = kv_a.forward(h)?;
        let latent = self
            .kv_a_norm
            .forward(&kv.narrow(1, 0, c)?.contiguous()?)?
            .reshape((b, l, 1, c))?;
        let k_rot = rope_layout(kv.narrow(1, c, r)?.reshape((b, l, 1, r))?)?.contiguous()?;
        let last = cos.rank() - 1;
        let cos = cos.narrow(last, 0, r / 2)?.contiguous()?;
        let sin = sin.narrow(last, 0, r / 2)?.contiguous()?;
        let (keys, latents) = write(&k_rot, &latent, &cos, &sin)?;
        let s = keys.dim(2)?;
        // The queries: rotated part (B, 1, heads·L, r); nope part through W_UK per head into
        // the latent's space, (B, 1, heads·L, c).
        let q_rot = crate::fused::rope(&q_rot, &cos, &sin)?.reshape((b, 1, heads * l, r))?;
        let (w, w_bias) = match &kv_b.lora {
            Some(a) => a.merged(&kv_b.weight, kv_b.bias.as_ref())?,
            None => (kv_b.weight.clone(), kv_b.bias.clone()),
        };
        let w = w.reshape((heads, n + dv, c))?;
        let per_head = q_nope
            .contiguous()?
            .reshape((b * l, heads, n))?
            .transpose(0, 1)?
            .contiguous()?;
        let q_lat = per_head
            .matmul(&w.narrow(1, 0, n)?)?
            .reshape((heads, b, l, c))?
            .transpose(0, 1)?
            .contiguous()?
            .reshape((b, 1, heads * l, c))?;
        let scores = (q_lat.matmul(&latents.t()?)? + q_rot.matmul(&keys.t()?)?)?;
        let p = crate::fused::attention_softmax(&scores.reshape((b, heads, l, s))?, bias, scale)?;
        // Each head's weighted latent (B, 1, heads·L, c), then W_UV per head.
        let ctx = p
            .reshape((b, 1, heads * l, s))?
            .matmul(&latents)?
            .reshape((b, heads, l, c))?
            .transpose(0, 1)?
            .contiguous()?
            .reshape((heads, b * l, c))?;
        let w_uv = w.narrow(1, n, dv)?;
        let out = ctx
            .matmul(&w_uv.t()?)?
            .transpose(0, 1)?
            .contiguous()?
            .reshape((b * l, heads * dv))?;
        match w_bias {
            Some(bias) => {
                let bias = bias.reshape((heads, n + dv))?.narrow(1, n, dv)?;
                out.broadcast_add(&bias.contiguous()?.reshape(heads * dv)?)
            }
            None => Ok(out),
        }
    }

    /// The attention's output rows `(B·L, heads · D)` cut to each head's value width
    /// `(B·L, heads · v_head_dim)`, as `o_proj` takes them.
    pub fn values(&self, ctx: &Tensor, heads: usize) -> Result<Tensor> {
        let (rows, _) = ctx.dims2()?;
        let (dq, dv) = (self.cfg.qk_head_dim(), self.cfg.v_head_dim);
        if dq == dv {
            return Ok(ctx.clone());
        }
        ctx.reshape((rows, heads, dq))?
            .narrow(2, 0, dv)?
            .reshape((rows, heads * dv))
    }

    /// The linear maps and norms' weights it holds beyond the layer's slots.
    pub fn linears(&self) -> Vec<&Linear> {
        self.q_a.iter().map(|(a, _)| a).collect()
    }

    pub(crate) fn map(&self, f: &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<Self> {
        let norm = |n: &RmsNorm| -> Result<RmsNorm> {
            Ok(RmsNorm {
                weight: f(&n.weight)?,
                ..n.clone()
            })
        };
        Ok(Mla {
            cfg: self.cfg,
            order: f(&self.order)?,
            rope_order: self.rope_order.as_ref().map(f).transpose()?,
            q_a: match &self.q_a {
                Some((a, n)) => Some((crate::model::map_linear(a, f)?, norm(n)?)),
                None => None,
            },
            kv_a_norm: norm(&self.kv_a_norm)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The order pairs each rotated dimension with its partner `head_dim / 2` later and keeps
    /// every dimension once.
    #[test]
    fn head_order_pairs_rotated_dimensions_half_a_head_apart() {
        for interleave in [false, true] {
            let m = MlaConfig {
                q_lora_rank: None,
                kv_lora_rank: 4,
                qk_nope_head_dim: 6,
                qk_rope_head_dim: 4,
                v_head_dim: 4,
                rope_interleave: interleave,
            };
            let o = head_order(&m);
            let mut sorted = o.clone();
            sorted.sort();
            assert_eq!(sorted, (0..10).collect::<Vec<_>>());
            let half = 5;
            let pairs: Vec<(usize, usize)> = (0..2).map(|i| (o[i], o[half + i])).collect();
            match interleave {
                true => assert_eq!(pairs, [(6, 7), (8, 9)]),
                false => assert_eq!(pairs, [(6, 8), (7, 9)]),
            }
            assert_eq!(&o[2..5], &[0, 1, 2]);
            assert_eq!(&o[7..10], &[3, 4, 5]);
        }
    }
}
