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

/// Whether a KV cache on `device` holds DeepSeek's latent ([`Mla::cached_attention`]) or each
/// head's key and value (as the training forward makes them). The latent is 10-85× smaller and,
/// a decode step being bound by reading on a GPU, the faster there; its attention does ~2.25×
/// the products (GLM-4.7-Flash: 576-wide keys and values against 256), which bind on the CPU.
/// So: the latent on a GPU, each head's on the CPU; `GRPO_MLA_CACHE=latent|heads` sets it for
/// the process, [`with_latent_cache`] for a thread.
pub fn latent_cache(device: &candle_core::Device) -> bool {
    if let Some(on) = LATENT.with(|c| c.get()) {
        return on;
    }
    static ENV: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    let env = *ENV.get_or_init(|| match std::env::var("GRPO_MLA_CACHE").as_deref() {
        Ok("latent") => Some(true),
        Ok("heads") => Some(false),
        _ => None,
    });
    env.unwrap_or(!device.is_cpu())
}

thread_local! {
    static LATENT: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` with [`latent_cache`] answering `on` on this thread (tests, `grpo-cli check`).
pub fn with_latent_cache<T>(on: bool, f: impl FnOnce() -> T) -> T {
    let prev = LATENT.with(|c| c.replace(Some(on)));
    let out = f();
    LATENT.with(|c| c.set(prev));
    out
}

/// Most new positions of a pass over an empty KV cache that attend in the latent's space; a
/// longer one (a prefill) attends with each head's keys and values
/// ([`Mla::cached_attention`]).
pub const EXPANDED_PREFILL_ROWS: usize = 16;

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

    /// The query rows `(B·L, heads · (qk_nope_head_dim + qk_rope_head_dim))` of normalised rows
    /// `h`, each head `[nope | rope]` as transformers lays it out.
    fn queries(&self, q: &Linear, h: &Tensor) -> Result<Tensor> {
        match &self.q_a {
            Some((a, norm)) => q.forward(&norm.forward(&a.forward(h)?)?),
            None => q.forward(h),
        }
    }

    /// The normalised latent `(B·L, kv_lora_rank)` and the shared key's rotated part, not yet
    /// rotated, `(B·L, qk_rope_head_dim)`, of normalised rows `h`.
    fn latent(&self, kv_a: &Linear, h: &Tensor) -> Result<(Tensor, Tensor)> {
        let m = &self.cfg;
        let kv = kv_a.forward(h)?;
        let latent = self
            .kv_a_norm
            .forward(&kv.narrow(1, 0, m.kv_lora_rank)?.contiguous()?)?;
        Ok((latent, kv.narrow(1, m.kv_lora_rank, m.qk_rope_head_dim)?))
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
        let (latent, k_rot) = self.latent(kv_a, h)?;
        self.heads(&self.queries(q, h)?, kv_b, &latent, &k_rot, (b, l, heads))
    }

    /// [`Self::projections`] of the query rows, the latent and the shared key's rotated part.
    fn heads(
        &self,
        q: &Tensor,
        kv_b: &Linear,
        latent: &Tensor,
        k_rot: &Tensor,
        (b, l, heads): (usize, usize, usize),
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let m = &self.cfg;
        let (n, r, dv, dq) = (
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.v_head_dim,
            m.qk_head_dim(),
        );
        let q = q.reshape((b, l, heads, dq))?;
        let k_rot = k_rot
            .reshape((b, l, 1, r))?
            .broadcast_as((b, l, heads, r))?;
        let kv = kv_b.forward(latent)?.reshape((b, l, heads, n + dv))?;
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
    /// the rotated shared key side by side — where the per-head keys and values take
    /// `2 · heads · D` (GLM-4.7-Flash: 576 against 10,240). A few new positions (decoding)
    /// attend over the cache in the latent's space: `kv_b_proj`'s key half folded into the
    /// queries (`q_nope · W_UK` per head), the cache's rows both the keys and the values of one
    /// shared head ([`crate::fused::causal_attention`], the rotated part's share of each value
    /// dropped), then `kv_b_proj`'s value half per head; an adapter on `kv_b_proj` is merged for
    /// the pass, its bias needs only its value half (a key bias adds one constant per query row,
    /// which softmax drops; the weights sum to 1). A prefill (more than
    /// [`EXPANDED_PREFILL_ROWS`] new positions, nothing cached) attends with each head's keys
    /// and values as the training forward makes them — fewer products than the latent form at
    /// these lengths — and caches the latent beside.
    ///
    /// `h` `(B·L, hidden)` normalised rows; `cos`, `sin` the model's RoPE tables of the `L` new
    /// positions (their first `qk_rope_head_dim / 2` columns are the rotated pairs', by
    /// [`head_order`]); `bias` `(B, 1, L, S)`; `write(rows)` stores the new positions' rows
    /// `(B, L, 1, kv_lora_rank + qk_rope_head_dim)` after the `past` cached ones and returns all
    /// `S` of them, `(B, 1, S, ·)`. Returns the context rows `(B·L, heads · v_head_dim)`, as
    /// `o_proj` takes them.
    #[allow(clippy::too_many_arguments)]
    pub fn cached_attention(
        &self,
        q: &Linear,
        kv_a: &Linear,
        kv_b: &Linear,
        h: &Tensor,
        (b, l, heads, past): (usize, usize, usize, usize),
        (cos, sin, bias, scale): (&Tensor, &Tensor, &Tensor, f64),
        write: impl FnOnce(&Tensor) -> Result<Tensor>,
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
        let last = cos.rank() - 1;
        let cos_r = cos.narrow(last, 0, r / 2)?.contiguous()?;
        let sin_r = sin.narrow(last, 0, r / 2)?.contiguous()?;
        let qs = self.queries(q, h)?;
        let (latent, k_raw) = self.latent(kv_a, h)?;
        // The new rows: the latent beside the rotated shared key, (B, L, 1, c + r).
        let k_rot = rope_layout(k_raw.reshape((b, l, 1, r))?)?.contiguous()?;
        let k_rot = crate::fused::rope(&k_rot, &cos_r, &sin_r)?.transpose(1, 2)?;
        let rows = Tensor::cat(&[&latent.reshape((b, l, 1, c))?, &k_rot], 3)?;
        let cached = write(&rows)?;
        if past == 0 && l > EXPANDED_PREFILL_ROWS {
            let (q, k, v) = self.heads(&qs, kv_b, &latent, &k_raw, (b, l, heads))?;
            let q = crate::fused::rope(&q, cos, sin)?;
            let k = crate::fused::rope(&k, cos, sin)?;
            let v = v.transpose(1, 2)?.contiguous()?;
            let ctx = crate::fused::causal_attention(&q, &k, &v, bias, scale)?;
            return self.values(&ctx, heads);
        }
        let qs = qs.reshape((b, l, heads, n + r))?;
        let q_rot = rope_layout(qs.narrow(3, n, r)?)?.contiguous()?;
        let q_rot = crate::fused::rope(&q_rot, &cos_r, &sin_r)?;
        let (w, w_bias) = match &kv_b.lora {
            Some(a) => a.merged(&kv_b.weight, kv_b.bias.as_ref())?,
            None => (kv_b.weight.clone(), kv_b.bias.clone()),
        };
        let w = w.reshape((heads, n + dv, c))?;
        // Each head's nope query in the latent's space: (heads, B·L, n) · W_UK (heads, n, c).
        let per_head = qs
            .narrow(3, 0, n)?
            .contiguous()?
            .reshape((b * l, heads, n))?
            .transpose(0, 1)?
            .contiguous()?;
        let q_lat = crate::fused::matmul(&per_head, &w.narrow(1, 0, n)?)?
            .reshape((heads, b, l, c))?
            .transpose(0, 1)?;
        let q_all = Tensor::cat(&[&q_lat, &q_rot], 3)?;
        let ctx = crate::fused::causal_attention(&q_all, &cached, &cached, bias, scale)?;
        // Each head's weighted latent (heads, B·L, c), then W_UV per head.
        let ctx = ctx
            .reshape((b * l, heads, c + r))?
            .narrow(2, 0, c)?
            .transpose(0, 1)?
            .contiguous()?;
        let out = crate::fused::matmul(&ctx, &w.narrow(1, n, dv)?.t()?)?
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
