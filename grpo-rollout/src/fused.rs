//! The decoder's hot elementwise ops, each as a fused CPU kernel with a real backward and as
//! the plain composition of candle ops it replaces.
//!
//! [`rms_norm`], [`rope`], [`silu_mul`], [`attention_softmax`], [`attention`] and
//! [`frozen_linear`] pick the fused CPU kernel on CPU f32/f64 ([`grpo_core::fused::path`]);
//! on every other device and dtype (CUDA, bf16, f16) the composition runs as one
//! [`grpo_core::recompute`] node that keeps only the op's inputs for backward, so the GPU path
//! stores what the CPU path stores; `GRPO_FUSED=0` selects the plain compositions. The `*_composed` functions are public
//! so that tests (and anyone curious) can compare the two: same values to rounding, same
//! gradients. See `grpo_core::fused` for why these exist.

use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, CustomOp3, D, DType, Layout, Result, Shape, Tensor,
};
use grpo_core::float_dispatch;
use grpo_core::fused::{
    Float, Path, REDUCE_BLOCK_ROWS, applies, cst, enabled, fmax, min_rows, path, slice,
};
use grpo_core::recompute::Recompute;
use grpo_core::tape;
use rayon::prelude::*;

/// [`path`], except that on a CUDA device whose kernels are available ([`crate::cuda`]) the
/// fused op takes its CUDA kernel where the CPU would take its CPU kernel.
fn route(op: &str, t: &Tensor) -> Path {
    match path(t) {
        Path::Recompute if cuda_kernel(op, t) => Path::Kernel,
        p => p,
    }
}

/// Whether our CUDA kernel of `op` runs for `t`: kernels on, `op` not switched off for its
/// dtype, `t` on a GPU that took the decoder's kernels — and, at the first ask for a GPU and
/// dtype, the self-check ([`crate::selfcheck`]) found the kernel equal to its composition.
pub(crate) fn cuda_kernel(op: &str, t: &Tensor) -> bool {
    grpo_core::fused::kernels_on()
        && grpo_core::fused::cuda_op_on(op, t.dtype())
        && cuda_takes(t)
        && {
            self_checked(t);
            grpo_core::fused::cuda_op_on(op, t.dtype())
        }
}

#[cfg(feature = "cuda")]
fn self_checked(t: &Tensor) {
    grpo_core::selfcheck::guard(
        "grpo_decoder",
        t.device(),
        t.dtype(),
        crate::selfcheck::findings,
    );
}

#[cfg(not(feature = "cuda"))]
fn self_checked(_: &Tensor) {}

#[cfg(feature = "cuda")]
fn cuda_takes(t: &Tensor) -> bool {
    crate::cuda::takes(t)
}

#[cfg(not(feature = "cuda"))]
fn cuda_takes(_: &Tensor) -> bool {
    false
}

/// Forwards a custom op's `cuda_fwd` to its kernel in [`crate::cuda`].
macro_rules! cuda_op {
    (1, $f:expr) => {
        #[cfg(feature = "cuda")]
        fn cuda_fwd(
            &self,
            s1: &candle_core::CudaStorage,
            l1: &Layout,
        ) -> Result<(candle_core::CudaStorage, Shape)> {
            #[allow(clippy::redundant_closure_call)]
            ($f)(self, s1, l1)
        }
    };
    (2, $f:expr) => {
        #[cfg(feature = "cuda")]
        fn cuda_fwd(
            &self,
            s1: &candle_core::CudaStorage,
            l1: &Layout,
            s2: &candle_core::CudaStorage,
            l2: &Layout,
        ) -> Result<(candle_core::CudaStorage, Shape)> {
            #[allow(clippy::redundant_closure_call)]
            ($f)(self, s1, l1, s2, l2)
        }
    };
    (3, $f:expr) => {
        #[cfg(feature = "cuda")]
        fn cuda_fwd(
            &self,
            s1: &candle_core::CudaStorage,
            l1: &Layout,
            s2: &candle_core::CudaStorage,
            l2: &Layout,
            s3: &candle_core::CudaStorage,
            l3: &Layout,
        ) -> Result<(candle_core::CudaStorage, Shape)> {
            #[allow(clippy::redundant_closure_call)]
            ($f)(self, s1, l1, s2, l2, s3, l3)
        }
    };
}

fn last_dim(l: &Layout) -> usize {
    l.dims().last().copied().unwrap_or(1)
}

// ---------------------------------------------------------------- RMSNorm

/// RMSNorm over the last axis, `x / sqrt(mean(x²) + eps) · w`, computed in f32 for half
/// precision inputs as transformers does.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let h = x.dims().last().copied().unwrap_or(1);
    let p = match route("rms_norm", x) {
        // The CUDA backward keeps a weight-gradient partial of `h` floats in shared memory.
        Path::Kernel if !x.device().is_cpu() && h > MAX_DEVICE_HIDDEN => Path::Recompute,
        p => p,
    };
    match p {
        Path::Kernel if x.dtype() == w.dtype() => {
            tape::apply_op2(&x.contiguous()?, &w.contiguous()?, RmsNormOp { eps })
        }
        Path::Recompute => {
            Recompute::new("rms_norm", move |a, _| rms_norm_composed(&a[0], &a[1], eps))
                .apply(&[x, w])
        }
        _ => rms_norm_composed(x, w, eps),
    }
}

/// Largest hidden size the RMSNorm kernels take on a GPU (larger: the composition): the
/// backward keeps a weight-gradient partial of this many f32 in shared memory, beside its block
/// reduction's 132 bytes: together at most the 48 KiB a launch gets without an opt-in.
pub(crate) const MAX_DEVICE_HIDDEN: usize = 12 * 1024 - 64;
const _: () = assert!(MAX_DEVICE_HIDDEN * 4 + 33 * 4 <= 48 * 1024);

/// [`rms_norm`] as a composition of candle ops.
pub fn rms_norm_composed(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let wide = if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let xf = x.to_dtype(wide)?;
    let var = xf.sqr()?.mean_keepdim(D::Minus1)?;
    let inv = (var + eps)?.sqrt()?.recip()?;
    let normed = xf.broadcast_mul(&inv)?.to_dtype(dtype)?;
    normed.broadcast_mul(w)
}

#[derive(Debug, Clone, Copy)]
struct RmsNormOp {
    eps: f64,
}

/// Backward of RMSNorm: inputs `(x, w, grad)`, output `[dx (x's elements), dw (h)]` flat.
#[derive(Debug, Clone, Copy)]
struct RmsNormBwd {
    eps: f64,
}

fn inv_rms<T: Float>(row: &[T], eps: f64) -> T {
    let ms = row.iter().map(|&v| v * v).sum::<T>() / cst::<T>(row.len() as f64);
    T::one() / (ms + cst(eps)).sqrt()
}

fn rms_fwd<T: Float>(
    x: &CpuStorage,
    lx: &Layout,
    w: &CpuStorage,
    lw: &Layout,
    eps: f64,
) -> Result<(CpuStorage, Shape)> {
    let h = last_dim(lx);
    let x = slice::<T>(x, lx, "rms_norm")?;
    let w = slice::<T>(w, lw, "rms_norm")?;
    if w.len() != h {
        candle_core::bail!(
            "rms_norm: weight has {} elements, hidden size is {h}",
            w.len()
        );
    }
    let mut out = vec![T::zero(); x.len()];
    out.par_chunks_mut(h)
        .zip(x.par_chunks(h))
        .with_min_len(min_rows(h))
        .for_each(|(o, row)| {
            let inv = inv_rms(row, eps);
            for ((o, &xv), &wv) in o.iter_mut().zip(row).zip(w) {
                *o = xv * inv * wv;
            }
        });
    Ok((T::to_cpu_storage_owned(out), lx.shape().clone()))
}

fn rms_bwd<T: Float>(
    x: &CpuStorage,
    lx: &Layout,
    w: &CpuStorage,
    lw: &Layout,
    g: &CpuStorage,
    lg: &Layout,
    eps: f64,
) -> Result<(CpuStorage, Shape)> {
    let h = last_dim(lx);
    let x = slice::<T>(x, lx, "rms_norm_bwd")?;
    let w = slice::<T>(w, lw, "rms_norm_bwd")?;
    let g = slice::<T>(g, lg, "rms_norm_bwd")?;
    let n = x.len();
    let mut out = vec![T::zero(); n + h];
    let (dx, dw) = out.split_at_mut(n);
    let block = REDUCE_BLOCK_ROWS * h;
    // Per block of rows: dx rows, and the block's partial dw (summed below in block order).
    let partials: Vec<Vec<T>> = dx
        .par_chunks_mut(block)
        .zip(x.par_chunks(block).zip(g.par_chunks(block)))
        .map(|(dxb, (xb, gb))| {
            let mut pw = vec![T::zero(); h];
            for ((dxr, xr), gr) in dxb.chunks_mut(h).zip(xb.chunks(h)).zip(gb.chunks(h)) {
                let inv = inv_rms(xr, eps);
                // xhat = x·inv; dxhat = g·w; dx = inv·(dxhat − xhat·mean(dxhat·xhat)).
                let mut dot = T::zero();
                for i in 0..h {
                    let xh = xr[i] * inv;
                    pw[i] += gr[i] * xh;
                    dot += gr[i] * w[i] * xh;
                }
                let mean = dot / cst::<T>(h as f64);
                for i in 0..h {
                    dxr[i] = inv * (gr[i] * w[i] - xr[i] * inv * mean);
                }
            }
            pw
        })
        .collect();
    for p in partials {
        for (d, v) in dw.iter_mut().zip(p) {
            *d += v;
        }
    }
    Ok((T::to_cpu_storage_owned(out), (n + h).into()))
}

impl CustomOp2 for RmsNormOp {
    fn name(&self) -> &'static str {
        "rms_norm"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        float_dispatch!(s1.dtype(), self.name(), rms_fwd(s1, l1, s2, l2, self.eps))
    }
    cuda_op!(2, |o: &Self, s1, l1, s2, l2| crate::cuda::rms_fwd(
        s1, l1, s2, l2, o.eps
    ));
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        if !tape::needs_grad(x) && !tape::needs_grad(w) {
            return Ok((None, None));
        }
        let flat = x.apply_op3_no_bwd(w, &grad.contiguous()?, &RmsNormBwd { eps: self.eps })?;
        let n = x.elem_count();
        let dx = flat.narrow(0, 0, n)?.reshape(x.shape())?;
        let dw = flat.narrow(0, n, w.elem_count())?.reshape(w.shape())?;
        // Only inputs in the graph get a gradient (a frozen weight must not).
        Ok((
            tape::needs_grad(x).then_some(dx),
            tape::needs_grad(w).then_some(dw),
        ))
    }
}

impl CustomOp3 for RmsNormBwd {
    fn name(&self) -> &'static str {
        "rms_norm_bwd"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        float_dispatch!(
            s1.dtype(),
            self.name(),
            rms_bwd(s1, l1, s2, l2, s3, l3, self.eps)
        )
    }
    cuda_op!(3, |o: &Self, s1, l1, s2, l2, s3, l3| crate::cuda::rms_bwd(
        s1, l1, s2, l2, s3, l3, o.eps
    ));
}

// ---------------------------------------------------------------- residual add + RMSNorm

/// The residual add and the RMSNorm after it, `(x + r, rms_norm(x + r, w))`, for passes
/// without a graph (decoding, frozen models): one kernel (CPU f32/f64, CUDA) where the
/// composition makes the sum and then normalises it. With an input in a graph, or another
/// dtype or device, the add and [`rms_norm`].
pub fn add_rms_norm(x: &Tensor, r: &Tensor, w: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let h = x.dims().last().copied().unwrap_or(1);
    let tracked = tape::needs_grad(x) || tape::needs_grad(r) || tape::needs_grad(w);
    let fits = x.dtype() == r.dtype()
        && x.dtype() == w.dtype()
        && x.dims() == r.dims()
        && w.elem_count() == h
        && (x.device().is_cpu() || h <= MAX_DEVICE_HIDDEN);
    if tracked || !fits || route("add_rms_norm", x) != Path::Kernel {
        let sum = (x + r)?;
        let y = rms_norm(&sum, w, eps)?;
        return Ok((sum, y));
    }
    let out =
        x.contiguous()?
            .apply_op3_no_bwd(&r.contiguous()?, &w.contiguous()?, &AddRmsOp { eps })?;
    let n = x.elem_count();
    Ok((
        out.narrow(0, 0, n)?.reshape(x.shape())?,
        out.narrow(0, n, n)?.reshape(x.shape())?,
    ))
}

/// [`add_rms_norm`] as a composition of candle ops.
pub fn add_rms_norm_composed(
    x: &Tensor,
    r: &Tensor,
    w: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let sum = (x + r)?;
    let y = rms_norm_composed(&sum, w, eps)?;
    Ok((sum, y))
}

/// Forward of [`add_rms_norm`]: inputs `(x, r, w)`, output `[x + r, normed]` flat.
#[derive(Debug, Clone, Copy)]
struct AddRmsOp {
    eps: f64,
}

fn add_rms_cpu<T: Float>(
    x: &CpuStorage,
    lx: &Layout,
    r: &CpuStorage,
    lr: &Layout,
    w: &CpuStorage,
    lw: &Layout,
    eps: f64,
) -> Result<(CpuStorage, Shape)> {
    let h = last_dim(lx);
    let x = slice::<T>(x, lx, "add_rms_norm")?;
    let r = slice::<T>(r, lr, "add_rms_norm")?;
    let w = slice::<T>(w, lw, "add_rms_norm")?;
    if r.len() != x.len() || w.len() != h {
        candle_core::bail!(
            "add_rms_norm: {} and {} elements with a weight of {} for hidden size {h}",
            x.len(),
            r.len(),
            w.len()
        );
    }
    let n = x.len();
    let mut out = vec![T::zero(); 2 * n];
    let (sum, normed) = out.split_at_mut(n);
    sum.par_chunks_mut(h)
        .zip(normed.par_chunks_mut(h))
        .zip(x.par_chunks(h).zip(r.par_chunks(h)))
        .with_min_len(min_rows(h))
        .for_each(|((s, y), (xr, rr))| {
            for ((s, &a), &b) in s.iter_mut().zip(xr).zip(rr) {
                *s = a + b;
            }
            // The arithmetic of the RMSNorm kernel, on the sum.
            let inv = inv_rms(s, eps);
            for ((y, &sv), &wv) in y.iter_mut().zip(s.iter()).zip(w) {
                *y = sv * inv * wv;
            }
        });
    Ok((T::to_cpu_storage_owned(out), (2 * n).into()))
}

impl CustomOp3 for AddRmsOp {
    fn name(&self) -> &'static str {
        "add_rms_norm"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        float_dispatch!(
            s1.dtype(),
            self.name(),
            add_rms_cpu(s1, l1, s2, l2, s3, l3, self.eps)
        )
    }
    cuda_op!(3, |o: &Self, s1, l1, s2, l2, s3, l3| {
        crate::cuda::add_rms_fwd(s1, l1, s2, l2, s3, l3, o.eps)
    });
}

// ---------------------------------------------------------------- KV-cache writes

/// Writes a step's new keys (`rot = Some((cos, sin))`: rotated, as [`rope`] rotates them) or
/// values (`None`) `x` `(B, L, G, D)`, a projection's output, into a KV cache buffer
/// `(B, G, capacity, D)` at positions `past .. past + L`, in place and without a graph: one
/// kernel (CPU f32/f64, CUDA) where the composition rotates, transposes, copies and writes.
pub fn kv_write(
    cache: &Tensor,
    x: &Tensor,
    rot: Option<(&Tensor, &Tensor)>,
    past: usize,
) -> Result<()> {
    let x = x.detach();
    let same = cache.dtype() == x.dtype()
        && rot.is_none_or(|(c, s)| c.dtype() == x.dtype() && s.dtype() == x.dtype());
    if same && cache.is_contiguous() && x.rank() == 4 && route("kv_write", &x) == Path::Kernel {
        let op = KvWriteOp {
            rot: match rot {
                Some((c, s)) => Some((c.contiguous()?, s.contiguous()?)),
                None => None,
            },
            past,
        };
        return cache.inplace_op2(&x.contiguous()?, &op);
    }
    let y = match rot {
        Some((c, s)) => rope(&x, c, s)?,
        None => x.transpose(1, 2)?.contiguous()?,
    };
    cache.slice_set(&y.detach(), 2, past)
}

/// A pass over a KV cache after the packed q/k/v product: `qkv` `(B, L, H + 2G, D)` holds the
/// queries (heads `0..H`), the new keys and the new values of this call's positions as the
/// projections give them (not yet rotated); the keys (rotated) and values go into the caches
/// `(B, G, capacity, D)` at `past` ([`kv_write`]) and the queries (rotated, [`rope`]) attend
/// over all `past + L` positions ([`causal_attention`]: `bias` `(B, 1, L, past + L)` is a
/// decoder's causal mask). Returns the context rows `(B·L, H·D)`. No graph.
///
/// `proj_bias` `((H + 2G)·D,)`, when given, is `qkv`'s projection bias, not yet added: it is
/// added in `qkv`'s dtype, as a separate add would (the CUDA kernel adds it as it reads q, k
/// and v: one launch less per layer of a decode step).
///
/// On CUDA, for up to 16 query rows, this is one kernel (the three ops are four launches);
/// elsewhere it is those ops on views of `qkv`.
#[allow(clippy::too_many_arguments)]
pub fn cached_attention(
    qkv: &Tensor,
    proj_bias: Option<&Tensor>,
    k_cache: &Tensor,
    v_cache: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    bias: &Tensor,
    past: usize,
    heads: usize,
    scale: f64,
) -> Result<Tensor> {
    let qkv = qkv.detach();
    let (_, l, total, _) = qkv.dims4()?;
    if total <= heads || !(total - heads).is_multiple_of(2) {
        candle_core::bail!(
            "cached_attention: {total} packed heads cannot be {heads} query heads and k, v heads"
        );
    }
    let nkv = (total - heads) / 2;
    let pb = proj_bias.map(|b| proj_bias_of(b, &qkv)).transpose()?;
    if cache_pass_kernel(&qkv, &[k_cache, v_cache, cos, sin, bias])?
        && pb.as_ref().is_none_or(|b| b.dtype() == qkv.dtype())
    {
        let op = CachedAttentionOp {
            cos: cos.contiguous()?,
            sin: sin.contiguous()?,
            bias: bias.contiguous()?.detach(),
            past,
            past_at: None,
            heads,
            scale,
            proj_bias: pb,
        };
        return qkv.contiguous()?.apply_op3_no_bwd(k_cache, v_cache, &op);
    }
    let qkv = match &pb {
        Some(b) => qkv.broadcast_add(&b.reshape((total, qkv.dim(3)?))?)?,
        None => qkv,
    };
    let q = rope(&qkv.narrow(2, 0, heads)?, cos, sin)?;
    kv_write(k_cache, &qkv.narrow(2, heads, nkv)?, Some((cos, sin)), past)?;
    kv_write(v_cache, &qkv.narrow(2, heads + nkv, nkv)?, None, past)?;
    let k = k_cache.narrow(2, 0, past + l)?;
    let v = v_cache.narrow(2, 0, past + l)?;
    causal_attention(&q, &k, &v, bias, scale)
}

/// [`cached_attention`] with the cached length read from the device (`past_at`, a `(1,)` u32
/// tensor) and a `bias` `(B, 1, L, capacity)` of which the first `past + L` columns count:
/// the launch is the same at every step, so a decode step captured in a CUDA graph replays it
/// ([`crate::graph`]). On the CPU the length is read and the bias cut to it (the tests of
/// the captured step); on a GPU without the kernel, an error.
#[allow(clippy::too_many_arguments)]
pub fn cached_attention_at(
    qkv: &Tensor,
    proj_bias: Option<&Tensor>,
    k_cache: &Tensor,
    v_cache: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    bias: &Tensor,
    past_at: &Tensor,
    heads: usize,
    scale: f64,
) -> Result<Tensor> {
    let qkv = qkv.detach();
    let l = qkv.dim(1)?;
    let pb = proj_bias.map(|b| proj_bias_of(b, &qkv)).transpose()?;
    if !cache_pass_kernel(&qkv, &[k_cache, v_cache, cos, sin, bias])?
        || pb.as_ref().is_some_and(|b| b.dtype() != qkv.dtype())
    {
        if qkv.device().is_cpu() {
            // The same step on the host (the CPU tests of the captured step): the length read,
            // the bias cut to it, the pass as `cached_attention` runs it.
            let past = past_at.flatten_all()?.to_vec1::<u32>()?[0] as usize;
            let bias = bias.narrow(3, 0, past + l)?;
            return cached_attention(
                &qkv,
                pb.as_ref(),
                k_cache,
                v_cache,
                cos,
                sin,
                &bias,
                past,
                heads,
                scale,
            );
        }
        candle_core::bail!("cached_attention_at: the length on the device needs the CUDA kernel");
    }
    let op = CachedAttentionOp {
        cos: cos.contiguous()?,
        sin: sin.contiguous()?,
        bias: bias.contiguous()?.detach(),
        past: 0,
        past_at: Some(past_at.clone()),
        heads,
        scale,
        proj_bias: pb,
    };
    qkv.contiguous()?.apply_op3_no_bwd(k_cache, v_cache, &op)
}

/// Whether the cache pass over `qkv` `(B, L, heads, D)` runs the CUDA kernel: off the CPU, up to
/// 16 query rows, a supported head dim, `others` (caches, tables, bias) in `qkv`'s dtype, the
/// kernel on.
fn cache_pass_kernel(qkv: &Tensor, others: &[&Tensor]) -> Result<bool> {
    let (_, l, _, d) = qkv.dims4()?;
    Ok(!qkv.device().is_cpu()
        && l <= DEVICE_ATTENTION_ROWS
        && d <= DEVICE_ATTENTION_MAX_D
        && others.iter().all(|t| t.dtype() == qkv.dtype())
        && route("cached_attention", qkv) == Path::Kernel)
}

/// [`cached_attention`]'s CUDA kernel (the caches, its second and third inputs, are written).
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct CachedAttentionOp {
    cos: Tensor,
    sin: Tensor,
    bias: Tensor,
    past: usize,
    past_at: Option<Tensor>,
    heads: usize,
    scale: f64,
    proj_bias: Option<Tensor>,
}

/// A packed projection's bias for the cache pass over `qkv` `(B, L, H + 2G, D)`: `((H + 2G)·D,)`
/// contiguous and detached, or the one-line refusal.
fn proj_bias_of(b: &Tensor, qkv: &Tensor) -> Result<Tensor> {
    let (_, _, total, d) = qkv.dims4()?;
    if b.elem_count() != total * d {
        candle_core::bail!(
            "cached_attention: a projection bias of {:?} for {total} packed heads of {d}",
            b.dims()
        );
    }
    b.detach().flatten_all()?.contiguous()
}

impl CustomOp3 for CachedAttentionOp {
    fn name(&self) -> &'static str {
        "cached_attention"
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("cached_attention: the CPU runs the composition")
    }
    cuda_op!(3, |o: &Self, s1, l1, s2, l2, s3, l3| {
        let a = crate::cuda::CachedAttention {
            cos: &o.cos,
            sin: &o.sin,
            bias: &o.bias,
            past: o.past,
            past_at: o.past_at.as_ref(),
            heads: o.heads,
            scale: o.scale,
            proj_bias: o.proj_bias.as_ref(),
        };
        crate::cuda::cached_attention(s1, l1, s2, l2, s3, l3, &a)
    });
}

/// [`kv_write`] as a composition of candle ops.
pub fn kv_write_composed(
    cache: &Tensor,
    x: &Tensor,
    rot: Option<(&Tensor, &Tensor)>,
    past: usize,
) -> Result<()> {
    let y = match rot {
        Some((c, s)) => rope_composed(x, c, s)?,
        None => x.transpose(1, 2)?.contiguous()?,
    };
    cache.slice_set(&y.detach(), 2, past)
}

/// `(b, l, g, d, capacity)` of a [`kv_write`] of `x` `(B, L, G, D)` into a cache `(B, G, cap,
/// D)` at `past`, or the one-line refusal (shared by the CPU and CUDA kernels).
pub(crate) fn kv_write_dims(
    lc: &Layout,
    lx: &Layout,
    past: usize,
) -> Result<(usize, usize, usize, usize, usize)> {
    let (b, l, g, d) = lx.shape().dims4()?;
    let (cb, cg, cap, cd) = lc.shape().dims4()?;
    if (cb, cg, cd) != (b, g, d) || past + l > cap || d % 2 != 0 {
        candle_core::bail!(
            "kv_write: {:?} at position {past} into a cache {:?}",
            lx.dims(),
            lc.dims()
        );
    }
    Ok((b, l, g, d, cap))
}

#[derive(Debug, Clone)]
struct KvWriteOp {
    rot: Option<(Tensor, Tensor)>,
    past: usize,
}

fn kv_write_cpu<T: Float>(
    cache: &mut [T],
    lc: &Layout,
    x: &CpuStorage,
    lx: &Layout,
    rot: Option<(&[T], &[T])>,
    past: usize,
) -> Result<()> {
    let (b, l, g, d, cap) = kv_write_dims(lc, lx, past)?;
    let Some((c0, c1)) = lc.contiguous_offsets() else {
        candle_core::bail!("kv_write: the cache must be contiguous");
    };
    let cache = &mut cache[c0..c1];
    let x = slice::<T>(x, lx, "kv_write")?;
    let half = d / 2;
    if let Some((c, s)) = rot
        && (c.len() != b * l * half || s.len() != b * l * half)
    {
        candle_core::bail!("kv_write: tables must be (B, L, D/2) = ({b}, {l}, {half})");
    }
    // Per (batch, kv head): its cache rows past .. past + L.
    cache
        .par_chunks_mut(cap * d)
        .enumerate()
        .for_each(|(bg, rows)| {
            let (bi, gi) = (bg / g, bg % g);
            for li in 0..l {
                let src = &x[((bi * l + li) * g + gi) * d..][..d];
                let dst = &mut rows[(past + li) * d..][..d];
                match rot {
                    Some((c, s)) => {
                        let t = (bi * l + li) * half;
                        let (cr, sr) = (&c[t..t + half], &s[t..t + half]);
                        for i in 0..half {
                            let (x1, x2) = (src[i], src[i + half]);
                            dst[i] = x1 * cr[i] - x2 * sr[i];
                            dst[i + half] = x2 * cr[i] + x1 * sr[i];
                        }
                    }
                    None => dst.copy_from_slice(src),
                }
            }
        });
    Ok(())
}

fn kv_write_run<T: Float + 'static>(
    op: &KvWriteOp,
    cache: &mut [T],
    lc: &Layout,
    x: &CpuStorage,
    lx: &Layout,
) -> Result<()> {
    match &op.rot {
        Some((c, s)) => {
            let (c, s) = (
                cpu_slice::<T>(c, "kv_write cos")?,
                cpu_slice::<T>(s, "kv_write sin")?,
            );
            kv_write_cpu(cache, lc, x, lx, Some((&c, &s)), op.past)
        }
        None => kv_write_cpu(cache, lc, x, lx, None, op.past),
    }
}

impl candle_core::InplaceOp2 for KvWriteOp {
    fn name(&self) -> &'static str {
        "kv_write"
    }
    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<()> {
        match s1 {
            CpuStorage::F32(c) => kv_write_run::<f32>(self, c, l1, s2, l2),
            CpuStorage::F64(c) => kv_write_run::<f64>(self, c, l1, s2, l2),
            other => candle_core::bail!(
                "kv_write: fused kernel needs f32 or f64, got {:?}",
                other.dtype()
            ),
        }
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<()> {
        let rot = self.rot.as_ref().map(|(c, s)| (c, s));
        crate::cuda::kv_write(s1, l1, s2, l2, rot, self.past)
    }
}

// ---------------------------------------------------------------- RoPE

/// Rotary embeddings ("rotate half" layout) fused with the head transpose: `x` `(B, L, H, D)`
/// (as a projection's output is laid out) and per-token tables `cos`, `sin` `(B, L, D/2)` give
/// `(B, H, L, D)`, contiguous.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    match route("rope", x) {
        Path::Kernel if x.dtype() == cos.dtype() && x.dtype() == sin.dtype() => tape::apply_op3(
            &x.contiguous()?,
            &cos.contiguous()?,
            &sin.contiguous()?,
            RopeOp { inverse: false },
        ),
        Path::Recompute => {
            let (cos, sin) = (cos.detach(), sin.detach());
            Recompute::new("rope", move |a, _| rope_composed(&a[0], &cos, &sin)).apply(&[x])
        }
        _ => rope_composed(x, cos, sin),
    }
}

/// [`rope`] as a composition of candle ops.
pub fn rope_composed(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (b, l, _, d) = x.dims4()?;
    let x = x.transpose(1, 2)?.contiguous()?;
    let cos = cos.reshape((b, 1, l, d / 2))?;
    let sin = sin.reshape((b, 1, l, d / 2))?;
    let half = d / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let o1 = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
    let o2 = (x2.broadcast_mul(&cos)? + x1.broadcast_mul(&sin)?)?;
    Tensor::cat(&[o1, o2], D::Minus1)
}

/// Forward (`(B, L, H, D)` → `(B, H, L, D)`, rotate by +θ) or, with `inverse`, its backward
/// (`(B, H, L, D)` → `(B, L, H, D)`, rotate by −θ).
#[derive(Debug, Clone, Copy)]
struct RopeOp {
    inverse: bool,
}

fn rope_run<T: Float>(
    x: &CpuStorage,
    lx: &Layout,
    c: &CpuStorage,
    lc: &Layout,
    s: &CpuStorage,
    ls: &Layout,
    inverse: bool,
) -> Result<(CpuStorage, Shape)> {
    let (b, a1, a2, d) = lx.shape().dims4()?;
    // Forward: input (B, L, H, D). Inverse: input (B, H, L, D).
    let (l, h) = if inverse { (a2, a1) } else { (a1, a2) };
    let x = slice::<T>(x, lx, "rope")?;
    let c = slice::<T>(c, lc, "rope")?;
    let s = slice::<T>(s, ls, "rope")?;
    let half = d / 2;
    if c.len() != b * l * half || s.len() != b * l * half {
        candle_core::bail!("rope: tables must be (B, L, D/2) = ({b}, {l}, {half})");
    }
    let sign = if inverse { -T::one() } else { T::one() };
    let mut out = vec![T::zero(); x.len()];
    // Output rows: forward (B, H, L) rows of D; inverse (B, L, H) rows of D.
    out.par_chunks_mut(d)
        .enumerate()
        .with_min_len(min_rows(d))
        .for_each(|(r, o)| {
            let (bi, hi, li) = if inverse {
                (r / (l * h), r % h, (r / h) % l)
            } else {
                (r / (h * l), (r / l) % h, r % l)
            };
            let src = if inverse {
                ((bi * h + hi) * l + li) * d
            } else {
                ((bi * l + li) * h + hi) * d
            };
            let src = &x[src..src + d];
            let t = (bi * l + li) * half;
            let (cr, sr) = (&c[t..t + half], &s[t..t + half]);
            for i in 0..half {
                let (x1, x2) = (src[i], src[i + half]);
                let (cv, sv) = (cr[i], sign * sr[i]);
                o[i] = x1 * cv - x2 * sv;
                o[i + half] = x2 * cv + x1 * sv;
            }
        });
    let shape: Shape = if inverse { (b, l, h, d) } else { (b, h, l, d) }.into();
    Ok((T::to_cpu_storage_owned(out), shape))
}

impl CustomOp3 for RopeOp {
    fn name(&self) -> &'static str {
        "rope"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        float_dispatch!(
            s1.dtype(),
            self.name(),
            rope_run(s1, l1, s2, l2, s3, l3, self.inverse)
        )
    }
    cuda_op!(3, |o: &Self, s1, l1, s2, l2, s3, l3| crate::cuda::rope(
        s1, l1, s2, l2, s3, l3, o.inverse
    ));
    fn bwd(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        if !tape::needs_grad(x) {
            return Ok((None, None, None));
        }
        let dx = grad.contiguous()?.apply_op3_no_bwd(
            cos,
            sin,
            &RopeOp {
                inverse: !self.inverse,
            },
        )?;
        Ok((Some(dx), None, None))
    }
}

// ---------------------------------------------------------------- SiLU · mul

/// The gated MLP's `silu(gate) · up`.
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    match route("silu_mul", gate) {
        Path::Kernel if gate.dtype() == up.dtype() && gate.dims() == up.dims() => {
            tape::apply_op2(&gate.contiguous()?, &up.contiguous()?, SiluMulOp)
        }
        Path::Recompute => {
            Recompute::new("silu_mul", |a, _| silu_mul_composed(&a[0], &a[1])).apply(&[gate, up])
        }
        _ => silu_mul_composed(gate, up),
    }
}

/// [`silu_mul`] as a composition of candle ops.
pub fn silu_mul_composed(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    gate.silu()? * up
}

/// [`silu_mul`] of the packed MLP product's rows `[gate | up]` `(N, 2·I)` → `(N, I)`: one
/// kernel reading both halves in place (CPU f32/f64, CUDA) when nothing is tracked; otherwise
/// [`silu_mul`] of the two halves.
pub fn silu_mul_packed(gu: &Tensor) -> Result<Tensor> {
    let (_, cols) = packed_halves(gu.layout())?;
    if !tape::needs_grad(gu) && route("silu_mul", gu) == Path::Kernel {
        return gu.contiguous()?.apply_op1_no_bwd(&SiluMulPacked);
    }
    silu_mul(&gu.narrow(1, 0, cols)?, &gu.narrow(1, cols, cols)?)
}

/// `(rows, I)` of packed `[gate | up]` rows `(rows, 2·I)`.
pub(crate) fn packed_halves(l: &Layout) -> Result<(usize, usize)> {
    match l.dims() {
        &[rows, two] if two % 2 == 0 => Ok((rows, two / 2)),
        d => candle_core::bail!("silu_mul_packed: expected rows [gate | up] (N, 2·I), got {d:?}"),
    }
}

#[derive(Debug, Clone, Copy)]
struct SiluMulPacked;

fn silu_packed_fwd<T: Float>(gu: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
    let (rows, cols) = packed_halves(l)?;
    let gu = slice::<T>(gu, l, "silu_mul_packed")?;
    let mut out = vec![T::zero(); rows * cols];
    let per = (ELEMENTWISE_TASK / cols.max(1)).max(1);
    out.par_chunks_mut(per * cols)
        .zip(gu.par_chunks(per * 2 * cols))
        .for_each(|(o, x)| {
            for (o, x) in o.chunks_mut(cols).zip(x.chunks(2 * cols)) {
                let (a, u) = x.split_at(cols);
                for ((o, &av), &uv) in o.iter_mut().zip(a).zip(u) {
                    *o = av / (T::one() + (-av).exp()) * uv;
                }
            }
        });
    Ok((T::to_cpu_storage_owned(out), (rows, cols).into()))
}

impl CustomOp1 for SiluMulPacked {
    fn name(&self) -> &'static str {
        "silu_mul_packed"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        float_dispatch!(s.dtype(), self.name(), silu_packed_fwd(s, l))
    }
    cuda_op!(1, |_: &Self, s, l| crate::cuda::silu_mul_packed(s, l));
}

#[derive(Debug, Clone, Copy)]
struct SiluMulOp;

/// Backward: inputs `(gate, up, grad)`, output `[dgate, dup]` flat.
#[derive(Debug, Clone, Copy)]
struct SiluMulBwd;

/// Elements per rayon task for purely elementwise kernels.
const ELEMENTWISE_TASK: usize = 8192;

fn silu_fwd<T: Float>(
    a: &CpuStorage,
    la: &Layout,
    u: &CpuStorage,
    lu: &Layout,
) -> Result<(CpuStorage, Shape)> {
    let a = slice::<T>(a, la, "silu_mul")?;
    let u = slice::<T>(u, lu, "silu_mul")?;
    let mut out = vec![T::zero(); a.len()];
    out.par_chunks_mut(ELEMENTWISE_TASK)
        .zip(
            a.par_chunks(ELEMENTWISE_TASK)
                .zip(u.par_chunks(ELEMENTWISE_TASK)),
        )
        .for_each(|(o, (a, u))| {
            for ((o, &av), &uv) in o.iter_mut().zip(a).zip(u) {
                *o = av / (T::one() + (-av).exp()) * uv;
            }
        });
    Ok((T::to_cpu_storage_owned(out), la.shape().clone()))
}

fn silu_bwd<T: Float>(
    a: &CpuStorage,
    la: &Layout,
    u: &CpuStorage,
    lu: &Layout,
    g: &CpuStorage,
    lg: &Layout,
) -> Result<(CpuStorage, Shape)> {
    let a = slice::<T>(a, la, "silu_mul_bwd")?;
    let u = slice::<T>(u, lu, "silu_mul_bwd")?;
    let g = slice::<T>(g, lg, "silu_mul_bwd")?;
    let n = a.len();
    let mut out = vec![T::zero(); 2 * n];
    let (da, du) = out.split_at_mut(n);
    let k = ELEMENTWISE_TASK;
    da.par_chunks_mut(k)
        .zip(du.par_chunks_mut(k))
        .zip(a.par_chunks(k).zip(u.par_chunks(k)).zip(g.par_chunks(k)))
        .for_each(|((da, du), ((a, u), g))| {
            for i in 0..a.len() {
                let s = T::one() / (T::one() + (-a[i]).exp());
                let silu = a[i] * s;
                // d silu / da = s · (1 + a · (1 − s)).
                da[i] = g[i] * u[i] * s * (T::one() + a[i] * (T::one() - s));
                du[i] = g[i] * silu;
            }
        });
    Ok((T::to_cpu_storage_owned(out), (2 * n).into()))
}

impl CustomOp2 for SiluMulOp {
    fn name(&self) -> &'static str {
        "silu_mul"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        float_dispatch!(s1.dtype(), self.name(), silu_fwd(s1, l1, s2, l2))
    }
    cuda_op!(2, |_: &Self, s1, l1, s2, l2| crate::cuda::silu_mul_fwd(
        s1, l1, s2, l2
    ));
    fn bwd(
        &self,
        a: &Tensor,
        u: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        if !tape::needs_grad(a) && !tape::needs_grad(u) {
            return Ok((None, None));
        }
        let flat = a.apply_op3_no_bwd(u, &grad.contiguous()?, &SiluMulBwd)?;
        let n = a.elem_count();
        let da = flat.narrow(0, 0, n)?.reshape(a.shape())?;
        let du = flat.narrow(0, n, n)?.reshape(u.shape())?;
        Ok((
            tape::needs_grad(a).then_some(da),
            tape::needs_grad(u).then_some(du),
        ))
    }
}

impl CustomOp3 for SiluMulBwd {
    fn name(&self) -> &'static str {
        "silu_mul_bwd"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        float_dispatch!(s1.dtype(), self.name(), silu_bwd(s1, l1, s2, l2, s3, l3))
    }
    cuda_op!(3, |_: &Self, s1, l1, s2, l2, s3, l3| {
        crate::cuda::silu_mul_bwd(s1, l1, s2, l2, s3, l3)
    });
}

// ---------------------------------------------------------------- attention softmax

/// Attention probabilities `softmax(scores · scale + bias)` over the last axis: `scores`
/// `(B, H, L, S)`, `bias` `(B, 1, L, S)` (the additive causal + padding mask, no gradient).
pub fn attention_softmax(scores: &Tensor, bias: &Tensor, scale: f64) -> Result<Tensor> {
    match route("attention_softmax", scores) {
        Path::Kernel if scores.dtype() == bias.dtype() => tape::apply_op2(
            &scores.contiguous()?,
            &bias.contiguous()?,
            SoftmaxOp { scale },
        ),
        Path::Recompute => {
            let bias = bias.detach();
            Recompute::new("attention_softmax", move |a, _| {
                attention_softmax_composed(&a[0], &bias, scale)
            })
            .apply(&[scores])
        }
        _ => attention_softmax_composed(scores, bias, scale),
    }
}

/// [`attention_softmax`] as a composition of candle ops.
pub fn attention_softmax_composed(scores: &Tensor, bias: &Tensor, scale: f64) -> Result<Tensor> {
    let x = (scores * scale)?.broadcast_add(bias)?;
    let m = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&m)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

/// Softmax of one row in place (the maximum subtracted first).
fn softmax_in_place<T: Float>(row: &mut [T]) {
    let mx = row.iter().fold(T::neg_infinity(), |m, &x| fmax(m, x));
    let mut sum = T::zero();
    for x in row.iter_mut() {
        *x = (*x - mx).exp();
        sum += *x;
    }
    let inv = T::one() / sum;
    for x in row.iter_mut() {
        *x *= inv;
    }
}

/// Softmax backward of one row in place: `g ← scale · p ⊙ (g − Σ_j p_j g_j)`.
fn softmax_grad_in_place<T: Float>(p: &[T], g: &mut [T], scale: T) {
    let dot: T = p.iter().zip(g.iter()).map(|(&a, &b)| a * b).sum();
    for (g, &pv) in g.iter_mut().zip(p) {
        *g = scale * pv * (*g - dot);
    }
}

#[derive(Debug, Clone, Copy)]
struct SoftmaxOp {
    scale: f64,
}

/// Backward: inputs `(probs, grad)`, output `scale · p · (g − Σ g·p)`.
#[derive(Debug, Clone, Copy)]
struct SoftmaxBwd {
    scale: f64,
}

fn softmax_fwd<T: Float>(
    x: &CpuStorage,
    lx: &Layout,
    m: &CpuStorage,
    lm: &Layout,
    scale: f64,
) -> Result<(CpuStorage, Shape)> {
    let (b, h, l, s) = lx.shape().dims4()?;
    let (mb, one, ml, ms) = lm.shape().dims4()?;
    if (mb, one, ml, ms) != (b, 1, l, s) {
        candle_core::bail!(
            "attention_softmax: bias must be ({b}, 1, {l}, {s}), got {:?}",
            lm.dims()
        );
    }
    let x = slice::<T>(x, lx, "attention_softmax")?;
    let m = slice::<T>(m, lm, "attention_softmax")?;
    let scale = cst::<T>(scale);
    let mut out = vec![T::zero(); x.len()];
    out.par_chunks_mut(s)
        .zip(x.par_chunks(s))
        .enumerate()
        .with_min_len(min_rows(s))
        .for_each(|(r, (o, xr))| {
            let (bi, li) = (r / (h * l), r % l);
            let mr = &m[(bi * l + li) * s..(bi * l + li + 1) * s];
            for ((o, &xv), &mv) in o.iter_mut().zip(xr).zip(mr) {
                *o = xv * scale + mv;
            }
            softmax_in_place(o);
        });
    Ok((T::to_cpu_storage_owned(out), lx.shape().clone()))
}

fn softmax_bwd<T: Float>(
    p: &CpuStorage,
    lp: &Layout,
    g: &CpuStorage,
    lg: &Layout,
    scale: f64,
) -> Result<(CpuStorage, Shape)> {
    let s = last_dim(lp);
    let p = slice::<T>(p, lp, "attention_softmax_bwd")?;
    let g = slice::<T>(g, lg, "attention_softmax_bwd")?;
    let scale = cst::<T>(scale);
    let mut out = g.to_vec();
    out.par_chunks_mut(s)
        .zip(p.par_chunks(s))
        .with_min_len(min_rows(s))
        .for_each(|(o, pr)| softmax_grad_in_place(pr, o, scale));
    Ok((T::to_cpu_storage_owned(out), lp.shape().clone()))
}

impl CustomOp2 for SoftmaxOp {
    fn name(&self) -> &'static str {
        "attention_softmax"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        float_dispatch!(
            s1.dtype(),
            self.name(),
            softmax_fwd(s1, l1, s2, l2, self.scale)
        )
    }
    cuda_op!(2, |o: &Self, s1, l1, s2, l2| crate::cuda::softmax_fwd(
        s1, l1, s2, l2, o.scale
    ));
    fn bwd(
        &self,
        x: &Tensor,
        _m: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        if !tape::needs_grad(x) {
            return Ok((None, None));
        }
        let d = res.apply_op2_no_bwd(&grad.contiguous()?, &SoftmaxBwd { scale: self.scale })?;
        Ok((Some(d), None))
    }
}

impl CustomOp2 for SoftmaxBwd {
    fn name(&self) -> &'static str {
        "attention_softmax_bwd"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        float_dispatch!(
            s1.dtype(),
            self.name(),
            softmax_bwd(s1, l1, s2, l2, self.scale)
        )
    }
    cuda_op!(2, |o: &Self, s1, l1, s2, l2| crate::cuda::softmax_bwd(
        s1, l1, s2, l2, o.scale
    ));
}

// ---------------------------------------------------------------- attention

/// Grouped-query attention `softmax(q kᵀ · scale + bias) v` per head, fused: `q`
/// `(B, H, L, D)`, `k` and `v` `(B, G, S, D)` with `H` a multiple of `G` (query head `h` reads
/// kv head `h / (H / G)`; `k` and `v` may be strided views, as a KV cache's are), `bias`
/// `(B, 1, L, S)` (the additive causal + padding mask, no gradient). Returns the context as
/// rows `(B·L, H·D)`, ready for the output projection.
///
/// The kernel runs one (batch, head) problem per task with two matrix products and a softmax
/// in a scratch buffer; its backward recomputes the probabilities instead of keeping them.
/// In the autograd graph it is one node where the composition has ten (each of which costs a
/// zeroed buffer and an add in candle's backward).
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, bias: &Tensor, scale: f64) -> Result<Tensor> {
    attention_with(q, k, v, bias, scale, false)
}

/// [`attention`] for a decoder's causal bias: `bias` masks every key after each query's
/// position, the queries being the last `L` of the `S` positions (training passes, a prefill
/// after cached positions). The flash kernels then skip the key tiles above the diagonal;
/// every row with a visible key gets what [`attention`] gives, while a row whose every key is
/// masked (a left-padded position, whose outputs nothing reads) may differ.
pub fn causal_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    bias: &Tensor,
    scale: f64,
) -> Result<Tensor> {
    attention_with(q, k, v, bias, scale, true)
}

fn attention_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    bias: &Tensor,
    scale: f64,
    causal: bool,
) -> Result<Tensor> {
    let same = q.dtype() == k.dtype() && q.dtype() == v.dtype() && q.dtype() == bias.dtype();
    if let Some(ctx) = flash(q, k, v, bias, scale, causal)? {
        return Ok(ctx);
    }
    let p = match route("attention", q) {
        // On a GPU the kernel is a forward for a few query rows (decoding); longer passes and
        // training take the flash kernels above where they apply (bf16 / f16, sm_80+), else
        // the recomputed composition, whose products run on cuBLAS.
        Path::Kernel if !q.device().is_cpu() => {
            let tracked = tape::needs_grad(q) || tape::needs_grad(k) || tape::needs_grad(v);
            let (l, d) = (q.dim(2)?, q.dim(3)?);
            let unit = |t: &Tensor| t.rank() == 4 && t.stride()[3] == 1;
            if !tracked
                && l <= DEVICE_ATTENTION_ROWS
                && d <= DEVICE_ATTENTION_MAX_D
                && unit(k)
                && unit(v)
            {
                Path::Kernel
            } else {
                Path::Recompute
            }
        }
        p => p,
    };
    match p {
        Path::Kernel if same => tape::apply_op3(
            &q.contiguous()?,
            k,
            v,
            AttentionOp {
                bias: bias.contiguous()?.detach(),
                scale,
            },
        ),
        // Scores and probabilities exist during the forward and, recomputed, during this
        // node's backward only: the graph keeps q, k, v and the context.
        Path::Recompute => {
            let bias = bias.detach();
            Recompute::new("attention", move |a, _| {
                attention_composed(&a[0], &a[1], &a[2], &bias, scale)
            })
            .apply(&[q, k, v])
        }
        _ => attention_composed(q, k, v, bias, scale),
    }
}

/// [`attention`] on the flash kernels (`crate::flash`) where they take it: on CUDA in bf16 /
/// f16 with head dimension 64 or 128 and compute capability 8.0 or later, for a pass with a
/// graph (training) or over more query rows than the decode kernel takes (prefill, frozen
/// passes). `None` elsewhere.
#[cfg(feature = "cuda")]
fn flash(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    bias: &Tensor,
    scale: f64,
    causal: bool,
) -> Result<Option<Tensor>> {
    let tracked = tape::needs_grad(q) || tape::needs_grad(k) || tape::needs_grad(v);
    let long = tracked || q.dim(2)? > DEVICE_ATTENTION_ROWS;
    if long && crate::flash::takes(q, k, v, bias) && cuda_kernel("flash_attention", q) {
        return crate::flash::attention(q, k, v, bias, scale, causal).map(Some);
    }
    Ok(None)
}

#[cfg(not(feature = "cuda"))]
fn flash(
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
    _: f64,
    _: bool,
) -> Result<Option<Tensor>> {
    Ok(None)
}

/// Most query rows per sequence for which a GPU runs the attention kernel (a decode step has
/// one); longer queries (prefill, training) take the flash kernels or the composition.
const DEVICE_ATTENTION_ROWS: usize = 16;

/// Largest head dimension of the GPU attention kernel (`ATTN_MAX_D` in kernels.cu).
pub(crate) const DEVICE_ATTENTION_MAX_D: usize = 256;

/// [`attention`] as a composition of candle ops (the query heads that share a kv head folded
/// into the row axis, so k and v are never repeated).
pub fn attention_composed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    bias: &Tensor,
    scale: f64,
) -> Result<Tensor> {
    grouped_attention(q, k, v, |scores| attention_softmax(scores, bias, scale))
}

/// Attention with the scores soft-capped (Gemma 2's `attn_logit_softcapping`):
/// `softmax(cap · tanh(q kᵀ · scale / cap) + bias) v`, shapes as [`attention`]'s. No fused
/// kernel takes the cap: on a training graph it is one recomputed node (scores and
/// probabilities not kept for backward; `GRPO_FUSED=0` composes), elsewhere the composition.
pub fn softcapped_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    bias: &Tensor,
    scale: f64,
    cap: f64,
) -> Result<Tensor> {
    let tracked = tape::needs_grad(q) || tape::needs_grad(k) || tape::needs_grad(v);
    if tracked && path(q) != Path::Composed {
        let bias = bias.detach();
        return Recompute::new("softcapped_attention", move |a, _| {
            softcapped_attention_composed(&a[0], &a[1], &a[2], &bias, scale, cap)
        })
        .apply(&[q, k, v]);
    }
    softcapped_attention_composed(q, k, v, bias, scale, cap)
}

/// [`softcapped_attention`] as a composition of candle ops.
pub fn softcapped_attention_composed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    bias: &Tensor,
    scale: f64,
    cap: f64,
) -> Result<Tensor> {
    grouped_attention(q, k, v, |scores| {
        let capped = ((scores * (scale / cap))?.tanh()? * cap)?;
        attention_softmax_composed(&capped, bias, 1.0)
    })
}

/// Attention with a learned sink per head (gpt-oss's `self_attn.sinks`, `(H,)`): each query
/// row's softmax takes one more logit, its head's sink, whose probability is then dropped —
/// `softmax([q kᵀ · scale + bias, s_h])[..S] v`, as transformers' eager gpt-oss attention —
/// so a row may give less than all of its weight to the values. Shapes as [`attention`]'s.
/// No fused kernel takes the sinks: on a training graph it is one recomputed node (scores and
/// probabilities not kept for backward; the sinks get their gradient through it;
/// `GRPO_FUSED=0` composes), elsewhere the composition.
pub fn sink_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    bias: &Tensor,
    scale: f64,
    sinks: &Tensor,
) -> Result<Tensor> {
    let tracked = [q, k, v, sinks].iter().any(|t| tape::needs_grad(t));
    if tracked && path(q) != Path::Composed {
        // A recomputed node takes up to three inputs: v and the sinks travel as one flat
        // tensor (a copy of v), taken apart inside.
        let bias = bias.detach();
        let (vshape, n) = (v.dims().to_vec(), v.elem_count());
        let vs = Tensor::cat(&[&v.flatten_all()?, &sinks.to_dtype(v.dtype())?], 0)?;
        return Recompute::new("sink_attention", move |a, _| {
            let v = a[2].narrow(0, 0, n)?.reshape(vshape.as_slice())?;
            let sinks = a[2].narrow(0, n, a[2].dim(0)? - n)?;
            sink_attention_composed(&a[0], &a[1], &v, &bias, scale, &sinks)
        })
        .apply(&[q, k, &vs]);
    }
    sink_attention_composed(q, k, v, bias, scale, sinks)
}

/// [`sink_attention`] as a composition of candle ops.
pub fn sink_attention_composed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    bias: &Tensor,
    scale: f64,
    sinks: &Tensor,
) -> Result<Tensor> {
    let (b, nh, l, _) = q.dims4()?;
    grouped_attention(q, k, v, |scores| {
        let s = scores.dim(3)?;
        let x = (scores * scale)?.broadcast_add(bias)?;
        let sink = sinks
            .to_dtype(x.dtype())?
            .reshape((1, nh, 1, 1))?
            .broadcast_as((b, nh, l, 1))?;
        let x = Tensor::cat(&[&x, &sink], D::Minus1)?;
        let m = x.max_keepdim(D::Minus1)?.detach();
        let e = x.broadcast_sub(&m)?.exp()?;
        e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?
            .narrow(D::Minus1, 0, s)
    })
}

/// Grouped-query attention with the probabilities `probs` makes of the scores `(B, H, L, S)`:
/// the context as rows `(B·L, H·D)`.
fn grouped_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    probs: impl Fn(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let (b, nh, l, d) = q.dims4()?;
    let (_, nkv, s, _) = k.dims4()?;
    let rep = nh / nkv;
    let qg = q.reshape((b, nkv, rep * l, d))?;
    let scores = matmul(&qg, &k.t()?)?.reshape((b, nh, l, s))?;
    let p = probs(&scores)?.reshape((b, nkv, rep * l, s))?;
    let ctx = matmul(&p, v)?.reshape((b, nh, l, d))?;
    ctx.transpose(1, 2)?.reshape((b * l, nh * d))
}

#[derive(Debug, Clone)]
struct AttentionOp {
    bias: Tensor,
    scale: f64,
}

/// Offset and strides of a 4-d layout.
#[derive(Clone, Copy)]
struct View4 {
    off: usize,
    st: [usize; 4],
}

impl View4 {
    fn of(l: &Layout) -> Result<Self> {
        let st = l.stride();
        if st.len() != 4 {
            candle_core::bail!("attention: expected a 4-d tensor, got {:?}", l.dims());
        }
        Ok(Self {
            off: l.start_offset(),
            st: [st[0], st[1], st[2], st[3]],
        })
    }
    /// Offset of `[b, h, 0, 0]`.
    fn at(&self, b: usize, h: usize) -> usize {
        self.off + b * self.st[0] + h * self.st[1]
    }
    /// The `(L, D)` matrix at `[b, h]` of `data` (or its transpose).
    fn mat<'a, T>(&self, data: &'a [T], b: usize, h: usize, transposed: bool) -> Mat<'a, T> {
        let (rs, cs) = if transposed {
            (self.st[3], self.st[2])
        } else {
            (self.st[2], self.st[3])
        };
        Mat {
            data: &data[self.at(b, h)..],
            rs,
            cs,
        }
    }
}

/// A matrix inside a slice: its elements are `data[i·rs + j·cs]` for `i < rows`, `j < cols`.
struct Mat<'a, T> {
    data: &'a [T],
    rs: usize,
    cs: usize,
}

/// `dst (m×n) = beta · lhs (m×k) · rhs (k×n)`, plus `dst` when `accumulate`; `dst`'s elements
/// are `dst[i·dst_rs + j]`. Single-threaded: the attention kernels run one problem per task.
fn mm<T: Float + 'static>(
    dims: (usize, usize, usize),
    dst: &mut [T],
    dst_rs: usize,
    accumulate: bool,
    lhs: Mat<'_, T>,
    rhs: Mat<'_, T>,
    beta: T,
) {
    mm_par(dims, dst, dst_rs, accumulate, lhs, rhs, beta, 1);
}

/// [`mm`] on `threads` threads (rayon's pool when more than one). Every index the product
/// touches is checked to lie inside its slice.
#[allow(unsafe_code)]
#[allow(clippy::too_many_arguments)]
fn mm_par<T: Float + 'static>(
    (m, n, k): (usize, usize, usize),
    dst: &mut [T],
    dst_rs: usize,
    accumulate: bool,
    lhs: Mat<'_, T>,
    rhs: Mat<'_, T>,
    beta: T,
    threads: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    let last = |rows: usize, cols: usize, rs: usize, cs: usize| {
        (rows.max(1) - 1) * rs + (cols.max(1) - 1) * cs
    };
    assert!(
        last(m, n, dst_rs, 1) < dst.len(),
        "attention: product outside its output"
    );
    if k > 0 {
        assert!(
            last(m, k, lhs.rs, lhs.cs) < lhs.data.len(),
            "attention: lhs out of range"
        );
        assert!(
            last(k, n, rhs.rs, rhs.cs) < rhs.data.len(),
            "attention: rhs out of range"
        );
    }
    // SAFETY: the asserts above keep every read inside `lhs` / `rhs` and every write inside
    // `dst`, which the borrow rules keep apart from them; the strides are non-negative.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            accumulate,
            lhs.data.as_ptr(),
            lhs.cs as isize,
            lhs.rs as isize,
            rhs.data.as_ptr(),
            rhs.cs as isize,
            rhs.rs as isize,
            T::one(),
            beta,
            false,
            false,
            false,
            if threads > 1 {
                gemm::Parallelism::Rayon(threads)
            } else {
                gemm::Parallelism::None
            },
        );
    }
}

/// `Σ a_i b_i` in eight interleaved partial sums (which the compiler vectorises; one running
/// sum would be a serial chain of scalar additions).
fn dot8<T: Float>(a: &[T], b: &[T]) -> T {
    let mut acc = [T::zero(); 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: T = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(&x, &y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().copied().sum::<T>() + tail
}

/// Shapes of an attention call, checked.
struct AttnDims {
    b: usize,
    nh: usize,
    nkv: usize,
    l: usize,
    s: usize,
    d: usize,
}

fn attn_dims(lq: &Layout, lk: &Layout, lv: &Layout, bias_len: usize) -> Result<AttnDims> {
    let (b, nh, l, d) = lq.shape().dims4()?;
    let (kb, nkv, s, kd) = lk.shape().dims4()?;
    if lv.dims() != lk.dims() || kb != b || kd != d || nkv == 0 || nh % nkv != 0 {
        candle_core::bail!(
            "attention: q {:?}, k {:?}, v {:?} do not fit (B, H, L, D), (B, G, S, D) with G dividing H",
            lq.dims(),
            lk.dims(),
            lv.dims()
        );
    }
    if bias_len != b * l * s {
        candle_core::bail!("attention: bias must be ({b}, 1, {l}, {s}) ({bias_len} elements)");
    }
    Ok(AttnDims {
        b,
        nh,
        nkv,
        l,
        s,
        d,
    })
}

/// The inputs of one attention call.
struct AttnInputs<'a, T> {
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    vq: View4,
    vk: View4,
    vv: View4,
    bias: &'a [T],
    dm: AttnDims,
    scale: T,
}

impl<T: Float + 'static> AttnInputs<'_, T> {
    fn q(&self, b: usize, h: usize) -> Mat<'_, T> {
        self.vq.mat(self.q, b, h, false)
    }
    fn k(&self, b: usize, g: usize, transposed: bool) -> Mat<'_, T> {
        self.vk.mat(self.k, b, g, transposed)
    }
    fn v(&self, b: usize, g: usize, transposed: bool) -> Mat<'_, T> {
        self.vv.mat(self.v, b, g, transposed)
    }

    /// `probs (L×S) = softmax(scale · q_h k_gᵀ + bias_b)`.
    fn probs(&self, probs: &mut [T], b: usize, h: usize) {
        let AttnDims {
            nh, nkv, l, s, d, ..
        } = self.dm;
        let g = h / (nh / nkv);
        mm(
            (l, s, d),
            probs,
            s,
            false,
            self.q(b, h),
            self.k(b, g, true),
            self.scale,
        );
        for (i, row) in probs.chunks_mut(s).enumerate() {
            let br = &self.bias[(b * l + i) * s..(b * l + i + 1) * s];
            for (x, &m) in row.iter_mut().zip(br) {
                *x += m;
            }
            softmax_in_place(row);
        }
    }

    /// One query (a decode step) of head `h`, with k and v rows contiguous: plain loops (a
    /// matrix product per head costs more to set up than it computes here).
    fn decode_head(&self, out: &mut [T], probs: &mut [T], b: usize, h: usize) {
        let AttnDims { nh, nkv, s, d, .. } = self.dm;
        let g = h / (nh / nkv);
        let q = &self.q[self.vq.at(b, h)..][..d];
        let (ko, vo) = (self.vk.at(b, g), self.vv.at(b, g));
        let (krs, vrs) = (self.vk.st[2], self.vv.st[2]);
        let bias = &self.bias[b * s..(b + 1) * s];
        for (j, p) in probs.iter_mut().enumerate() {
            let kr = &self.k[ko + j * krs..][..d];
            *p = dot8(q, kr) * self.scale + bias[j];
        }
        softmax_in_place(probs);
        out.fill(T::zero());
        for (j, &w) in probs.iter().enumerate() {
            let vr = &self.v[vo + j * vrs..][..d];
            for (o, &x) in out.iter_mut().zip(vr) {
                *o += w * x;
            }
        }
    }

    /// The context rows `(B·L, H·D)`, one batch row per task.
    fn forward(&self) -> Vec<T> {
        let AttnDims {
            b,
            nh,
            nkv,
            l,
            s,
            d,
        } = self.dm;
        let rep = nh / nkv;
        let mut out = vec![T::zero(); b * l * nh * d];
        let rows_contiguous = self.vq.st[3] == 1 && self.vk.st[3] == 1 && self.vv.st[3] == 1;
        if l == 1 && rows_contiguous {
            out.par_chunks_mut(nh * d).enumerate().for_each_init(
                || vec![T::zero(); s],
                |probs, (bi, row)| {
                    for (h, o) in row.chunks_mut(d).enumerate() {
                        self.decode_head(o, probs, bi, h);
                    }
                },
            );
            return out;
        }
        out.par_chunks_mut(l * nh * d).enumerate().for_each_init(
            || vec![T::zero(); l * s],
            |probs, (bi, rows)| {
                for h in 0..nh {
                    self.probs(probs, bi, h);
                    let p = Mat {
                        data: &probs[..],
                        rs: s,
                        cs: 1,
                    };
                    mm(
                        (l, d, s),
                        &mut rows[h * d..],
                        nh * d,
                        false,
                        p,
                        self.v(bi, h / rep, false),
                        T::one(),
                    );
                }
            },
        );
        out
    }

    /// Gradients `(dq (B, H, L, D), dk, dv (B, G, S, D))` from the context rows' gradient
    /// `go`; the probabilities are recomputed.
    fn backward(&self, go: &[T]) -> (Vec<T>, Vec<T>, Vec<T>) {
        let AttnDims {
            b,
            nh,
            nkv,
            l,
            s,
            d,
        } = self.dm;
        let rep = nh / nkv;
        let sc = self.scale;
        let mut dq = vec![T::zero(); b * nh * l * d];
        let mut dk = vec![T::zero(); b * nkv * s * d];
        let mut dv = vec![T::zero(); b * nkv * s * d];
        dq.par_chunks_mut(nh * l * d)
            .zip(dk.par_chunks_mut(nkv * s * d))
            .zip(dv.par_chunks_mut(nkv * s * d))
            .enumerate()
            .for_each_init(
                || (vec![T::zero(); l * s], vec![T::zero(); l * s]),
                |(probs, dp), (bi, ((dq, dk), dv))| {
                    for h in 0..nh {
                        let (g, r) = (h / rep, h % rep);
                        self.probs(probs, bi, h);
                        let go_h = || Mat {
                            data: &go[bi * l * nh * d + h * d..],
                            rs: nh * d,
                            cs: 1,
                        };
                        // dP = dO · vᵀ
                        mm(
                            (l, s, d),
                            dp,
                            s,
                            false,
                            go_h(),
                            self.v(bi, g, true),
                            T::one(),
                        );
                        // dS = scale · P ⊙ (dP − Σ_j P·dP)
                        for (pr, gr) in probs.chunks(s).zip(dp.chunks_mut(s)) {
                            softmax_grad_in_place(pr, gr, sc);
                        }
                        let ds = |t: bool| Mat {
                            data: &dp[..],
                            rs: if t { 1 } else { s },
                            cs: if t { s } else { 1 },
                        };
                        // dQ_h = dS · k
                        mm(
                            (l, d, s),
                            &mut dq[h * l * d..],
                            d,
                            false,
                            ds(false),
                            self.k(bi, g, false),
                            T::one(),
                        );
                        // dK_g += dSᵀ · q_h; dV_g += Pᵀ · dO
                        let kv = g * s * d;
                        mm(
                            (s, d, l),
                            &mut dk[kv..],
                            d,
                            r > 0,
                            ds(true),
                            self.q(bi, h),
                            T::one(),
                        );
                        let pt = Mat {
                            data: &probs[..],
                            rs: 1,
                            cs: s,
                        };
                        mm((s, d, l), &mut dv[kv..], d, r > 0, pt, go_h(), T::one());
                    }
                },
            );
        (dq, dk, dv)
    }
}

fn cpu_slice<T: Float>(t: &Tensor, what: &str) -> Result<Vec<T>> {
    let (st, l) = t.storage_and_layout();
    match &*st {
        candle_core::Storage::Cpu(cs) => Ok(slice::<T>(cs, l, what)?.to_vec()),
        _ => candle_core::bail!("{what}: the fused kernel needs CPU tensors"),
    }
}

#[allow(clippy::too_many_arguments)]
fn attn_inputs<'a, T: Float + 'static>(
    q: &'a CpuStorage,
    lq: &Layout,
    k: &'a CpuStorage,
    lk: &Layout,
    v: &'a CpuStorage,
    lv: &Layout,
    bias: &'a [T],
    scale: f64,
) -> Result<AttnInputs<'a, T>> {
    Ok(AttnInputs {
        dm: attn_dims(lq, lk, lv, bias.len())?,
        vq: View4::of(lq)?,
        vk: View4::of(lk)?,
        vv: View4::of(lv)?,
        q: q.as_slice::<T>()?,
        k: k.as_slice::<T>()?,
        v: v.as_slice::<T>()?,
        bias,
        scale: cst::<T>(scale),
    })
}

fn attn_fwd<T: Float + 'static>(
    op: &AttentionOp,
    s: (
        &CpuStorage,
        &Layout,
        &CpuStorage,
        &Layout,
        &CpuStorage,
        &Layout,
    ),
) -> Result<(CpuStorage, Shape)> {
    // A copy of the bias (B·L·S elements, small next to the products) keeps its lock short.
    let bias = cpu_slice::<T>(&op.bias, "attention bias")?;
    let a = attn_inputs::<T>(s.0, s.1, s.2, s.3, s.4, s.5, &bias, op.scale)?;
    let out = a.forward();
    let shape: Shape = (a.dm.b * a.dm.l, a.dm.nh * a.dm.d).into();
    Ok((T::to_cpu_storage_owned(out), shape))
}

fn attn_bwd<T: Float + 'static>(
    op: &AttentionOp,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    grad: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let bias = cpu_slice::<T>(&op.bias, "attention bias")?;
    let go = cpu_slice::<T>(&grad.contiguous()?, "attention backward")?;
    let (sq, lq) = q.storage_and_layout();
    let (sk, lk) = k.storage_and_layout();
    let (sv, lv) = v.storage_and_layout();
    let (
        candle_core::Storage::Cpu(sq),
        candle_core::Storage::Cpu(sk),
        candle_core::Storage::Cpu(sv),
    ) = (&*sq, &*sk, &*sv)
    else {
        candle_core::bail!("attention backward needs CPU tensors");
    };
    let a = attn_inputs::<T>(sq, lq, sk, lk, sv, lv, &bias, op.scale)?;
    if go.len() != a.dm.b * a.dm.l * a.dm.nh * a.dm.d {
        candle_core::bail!("attention backward: a gradient of {} elements", go.len());
    }
    let (dq, dk, dv) = a.backward(&go);
    let AttnDims {
        b,
        nh,
        nkv,
        l,
        s,
        d,
    } = a.dm;
    let dev = q.device();
    Ok((
        Tensor::from_vec(dq, (b, nh, l, d), dev)?,
        Tensor::from_vec(dk, (b, nkv, s, d), dev)?,
        Tensor::from_vec(dv, (b, nkv, s, d), dev)?,
    ))
}

impl CustomOp3 for AttentionOp {
    fn name(&self) -> &'static str {
        "attention"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        float_dispatch!(
            s1.dtype(),
            self.name(),
            attn_fwd(self, (s1, l1, s2, l2, s3, l3))
        )
    }
    cuda_op!(3, |o: &Self, s1, l1, s2, l2, s3, l3| {
        crate::cuda::attention_rows(s1, l1, s2, l2, s3, l3, &o.bias, o.scale)
    });
    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dq, dk, dv) = float_dispatch!(q.dtype(), self.name(), attn_bwd(self, q, k, v, grad))?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

// ---------------------------------------------------------------- matmul operands

/// Whether candle's CUDA matmul (cuBLAS through `gemm_config`) takes an operand with these
/// dims and strides: its last two axes row-major with packed rows or column-major with packed
/// columns (a size-1 axis takes any stride), and at most two batch axes that one stride walks.
/// The CPU's matmul takes any strides, so a row view of a wider tensor (the last position of
/// each sequence, a column block of a packed projection) works there and fails on a GPU.
pub fn cublas_layout_ok(dims: &[usize], stride: &[usize]) -> bool {
    let n = dims.len();
    if n < 2 {
        return false;
    }
    let (r, c) = (dims[n - 2], dims[n - 1]);
    let (s2, s1) = (stride[n - 2], stride[n - 1]);
    let plain = (s1 == 1 || c == 1) && (s2 == c || r == 1);
    let transposed = (s1 == r || c == 1) && (s2 == 1 || r == 1);
    let batch = match (&dims[..n - 2], &stride[..n - 2]) {
        ([], _) | ([_], _) => true,
        ([d0, d1], [s0, s1b]) => *s0 == s1b * d1 || *d0 == 1 || *d1 == 1,
        _ => false,
    };
    (plain || transposed) && batch
}

/// `a.matmul(b)` with each operand copied to a contiguous layout first where candle's CUDA
/// matmul would refuse its strides ([`cublas_layout_ok`]); on every device, so the CPU tests
/// run the same operands a GPU gets.
pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let ready = |t: &Tensor| -> Result<Tensor> {
        if cublas_layout_ok(t.dims(), t.stride()) {
            Ok(t.clone())
        } else {
            t.contiguous()
        }
    };
    ready(a)?.matmul(&ready(b)?)
}

/// `Σ_rows g` of rows `(N, out)` (a bias's gradient). On CUDA the product `1ᵀ g`: cuBLAS reads
/// the rows once with f32 accumulation, where candle's `sum(0)` gives each column a block that
/// walks the rows at a stride of the row (`fast_sum`, ≈ 18 µs a call at 2,560 rows on an
/// H100). On the CPU candle's sum: its bf16 product accumulates in bf16 (a near-cancelling
/// bias gradient lost a tenth of its value over 200 rows in `check --dtype bf16`).
fn row_sums(g: &Tensor) -> Result<Tensor> {
    if g.device().is_cpu() {
        return g.sum(0);
    }
    let n = g.dim(0)?;
    Tensor::ones((1, n), g.dtype(), g.device())?
        .matmul(&g.contiguous()?)?
        .squeeze(0)
}

// ---------------------------------------------------------------- affine nodes

/// `x Wᵀ [+ b]` of the slots `[x, w, b]` given a node's inputs `a`.
fn linear_rows(s: &[Slot], a: &[Tensor]) -> Result<Tensor> {
    let (x, w) = (s[0].get(a).expect("x"), s[1].get(a).expect("w"));
    let y = matmul(&x, &w.t()?)?;
    match s[2].get(a) {
        Some(b) => y.broadcast_add(&b),
        None => Ok(y),
    }
}

/// [`linear_rows`]' backward for the output gradient `g` `(N, out)`: `dx = g W`, `dW = gᵀ x`,
/// `db = Σ_rows g` into `out` for the slots that are inputs.
fn linear_rows_grads(
    s: &[Slot],
    a: &[Tensor],
    g: &Tensor,
    out: &mut [Option<Tensor>],
) -> Result<()> {
    let (x, w) = (s[0].get(a).expect("x"), s[1].get(a).expect("w"));
    if let Slot::In(i) = s[0] {
        out[i] = Some(matmul(g, &w)?);
    }
    if let Slot::In(i) = s[1] {
        out[i] = Some(matmul(&g.t()?, &x)?);
    }
    if let Slot::In(i) = s[2] {
        out[i] = Some(row_sums(g)?);
    }
    Ok(())
}

/// An argument of a projection node ([`affine`], [`project_heads`]): an input of the node (it
/// carries a graph; its index among the node's inputs), a constant, or absent.
#[derive(Clone)]
enum Slot {
    In(usize),
    Const(Tensor),
    Absent,
}

impl Slot {
    /// The slots of `args` in order, and the node's inputs (the tracked ones).
    fn of<'a>(args: &[Option<&'a Tensor>]) -> (Vec<&'a Tensor>, Vec<Slot>) {
        let mut inputs = Vec::new();
        let slots = args
            .iter()
            .map(|t| match t {
                None => Slot::Absent,
                Some(t) if tape::needs_grad(t) => {
                    inputs.push(*t);
                    Slot::In(inputs.len() - 1)
                }
                Some(t) => Slot::Const(t.detach()),
            })
            .collect();
        (inputs, slots)
    }

    /// The slot's tensor given the node's inputs `a`.
    fn get(&self, a: &[Tensor]) -> Option<Tensor> {
        match self {
            Slot::In(i) => Some(a[*i].clone()),
            Slot::Const(t) => Some(t.clone()),
            Slot::Absent => None,
        }
    }
}

/// `[res +] x Wᵀ [+ b]` for rows `x` `(N, in)` as one graph node that keeps only its inputs
/// and its output, where the composition also keeps the product before the bias and before
/// the residual add (each output-sized) until backward ends. Its backward: `dres = g`,
/// `dx = g W`, `dW = gᵀ x`, `db = Σ_rows g`, for those that carry a graph (at most three:
/// a full fine-tune's o/down projection with a bias composes). A trainable `W` alone (no
/// residual, no bias) is a node too: candle's `x.matmul(&w.t())` is two, the transpose's
/// backward adding a transposed (strided) weight-sized gradient into a zeroed buffer. `None`
/// where it does not apply (fused ops off, inside a recomputed block, the CPU kernels' path —
/// CPU f32/f64 —, a frozen `W` with nothing to fuse — [`frozen_linear`] —, more than three
/// tracked inputs): the caller composes. Same values and gradients as the composition
/// (tests).
pub fn affine(
    res: Option<&Tensor>,
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
) -> Result<Option<Tensor>> {
    // Where the CPU kernels run (CPU f32/f64) candle's product and add are kept: the node's
    // output copy cost ≈ 3 % of a CPU step there (measured), and a GPU is where memory counts.
    let nothing = res.is_none() && b.is_none() && !tape::needs_grad(w);
    if nothing || x.rank() != 2 || path(x) != Path::Recompute {
        return Ok(None);
    }
    // Slots in order res, x, w, b.
    let (inputs, slots) = Slot::of(&[res, Some(x), Some(w), b]);
    if inputs.is_empty() || inputs.len() > 3 {
        return Ok(None);
    }
    let get = Slot::get;
    let fwd_slots = slots.clone();
    let forward = move |a: &[Tensor], _: bool| -> Result<Tensor> {
        let y = linear_rows(&fwd_slots[1..], a)?;
        match get(&fwd_slots[0], a) {
            Some(r) => y + r,
            None => Ok(y),
        }
    };
    let backward = move |a: &[Tensor], g: &Tensor| -> Result<Vec<Option<Tensor>>> {
        let mut out: Vec<Option<Tensor>> = vec![None; a.len()];
        if let Slot::In(i) = slots[0] {
            out[i] = Some(g.clone());
        }
        linear_rows_grads(&slots[1..], a, g, &mut out)?;
        Ok(out)
    };
    Recompute::explicit("affine", forward, backward)
        .apply(&inputs)
        .map(Some)
}

/// Rows `x` `(B·L, in)` through a q, k or v projection `x Wᵀ [+ b]`, as heads `(B, H, L, D)`
/// (`dims` = `(B, L, H, D)`), rotated by RoPE when `rot` = `(cos, sin)` is given (q, k) or just
/// laid out as heads (v): one graph node, where the composition is three or four (the product,
/// a reshape, RoPE or a transpose and its copy), keeps the projection's output until backward
/// ends (RoPE's input) and adds an output-sized gradient into a zeroed buffer at each of them.
/// Its backward: the heads' gradient back through RoPE (or the layout) to `gy` `(B·L, H·D)`,
/// then `dx = gy W`, `dW = gyᵀ x`, `db = Σ_rows gy`, for those that carry a graph. `None` where
/// it does not apply (as [`affine`]: the CPU kernels' path, fused ops off, inside a recomputed
/// block, no tracked input): the caller composes. Same values and gradients as the composition
/// (tests).
pub fn project_heads(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    dims: (usize, usize, usize, usize),
    rot: Option<(&Tensor, &Tensor)>,
) -> Result<Option<Tensor>> {
    let (bsz, l, h, d) = dims;
    if x.rank() != 2 || path(x) != Path::Recompute || x.dim(0)? != bsz * l || w.dim(0)? != h * d {
        return Ok(None);
    }
    // Slots in order x, w, b.
    let (inputs, slots) = Slot::of(&[Some(x), Some(w), b]);
    if inputs.is_empty() {
        return Ok(None);
    }
    let rot_f = rot.map(|(c, s)| (c.detach(), s.detach()));
    let rot_b = rot_f.clone();
    let fwd_slots = slots.clone();
    let forward = move |a: &[Tensor], _: bool| -> Result<Tensor> {
        let y = linear_rows(&fwd_slots, a)?.reshape((bsz, l, h, d))?;
        match &rot_f {
            Some((c, s)) => rope(&y, c, s),
            None => y.transpose(1, 2)?.contiguous(),
        }
    };
    let backward = move |a: &[Tensor], g: &Tensor| -> Result<Vec<Option<Tensor>>> {
        let mut out: Vec<Option<Tensor>> = vec![None; a.len()];
        let gy = match &rot_b {
            Some((c, s)) => rope_inverse(g, c, s)?,
            None => g.transpose(1, 2)?.contiguous()?,
        }
        .reshape((bsz * l, h * d))?;
        linear_rows_grads(&slots, a, &gy, &mut out)?;
        Ok(out)
    };
    Recompute::explicit("project_heads", forward, backward)
        .apply(&inputs)
        .map(Some)
}

/// The gated MLP's input side as one graph node: rows `x` `(N, in)` through the gate and up
/// projections (`w1`, `w2`, no biases) side by side, `[x W1ᵀ | x W2ᵀ]` `(N, 2·I)` — one product
/// of the two weights stacked (a weight-sized copy per call), where the composition is two
/// nodes. Its backward: `dx = g [W1; W2]`, and `gᵀ x` split by rows into the two weights'
/// gradients. `None` where [`affine`] would not apply: the caller composes.
pub fn project_pair(x: &Tensor, w1: &Tensor, w2: &Tensor) -> Result<Option<Tensor>> {
    if x.rank() != 2 || path(x) != Path::Recompute || w1.dims() != w2.dims() {
        return Ok(None);
    }
    let (inputs, slots) = Slot::of(&[Some(x), Some(w1), Some(w2)]);
    if inputs.is_empty() {
        return Ok(None);
    }
    let rows = w1.dim(0)?;
    let fwd_slots = slots.clone();
    let stacked = |s: &[Slot], a: &[Tensor]| -> Result<Tensor> {
        let (w1, w2) = (s[1].get(a).expect("w1"), s[2].get(a).expect("w2"));
        Tensor::cat(&[&w1, &w2], 0)
    };
    let forward = move |a: &[Tensor], _: bool| -> Result<Tensor> {
        let x = fwd_slots[0].get(a).expect("x");
        matmul(&x, &stacked(&fwd_slots, a)?.t()?)
    };
    let backward = move |a: &[Tensor], g: &Tensor| -> Result<Vec<Option<Tensor>>> {
        let mut out: Vec<Option<Tensor>> = vec![None; a.len()];
        let x = slots[0].get(a).expect("x");
        if let Slot::In(i) = slots[0] {
            out[i] = Some(matmul(g, &stacked(&slots, a)?)?);
        }
        if matches!(slots[1], Slot::In(_)) || matches!(slots[2], Slot::In(_)) {
            let dw = matmul(&g.t()?, &x)?;
            for (k, at) in [(1, 0), (2, rows)] {
                if let Slot::In(i) = slots[k] {
                    out[i] = Some(dw.narrow(0, at, rows)?);
                }
            }
        }
        Ok(out)
    };
    Recompute::explicit("project_pair", forward, backward)
        .apply(&inputs)
        .map(Some)
}

/// The gated MLP's output side as one graph node: `res + (silu(gate) · up) Wᵀ` of packed rows
/// `gu` = `[gate | up]` `(N, 2·I)` ([`project_pair`]'s output) and the down projection `w`
/// (no bias), the residual `res` `(N, out)`. The product `silu(gate) · up` is not kept for
/// backward (the composition keeps it, `I` values per row): the backward forms it again from
/// `gu` (one elementwise kernel), then `dres = g`, `dW = gᵀ act`, `dgu` = SiLU·mul's backward
/// of `g W`. `None` where [`affine`] would not apply: the caller composes.
pub fn down_silu(res: &Tensor, gu: &Tensor, w: &Tensor) -> Result<Option<Tensor>> {
    if gu.rank() != 2 || path(gu) != Path::Recompute {
        return Ok(None);
    }
    let (_, cols) = packed_halves(gu.layout())?;
    if w.dims() != [res.dim(1)?, cols] {
        return Ok(None);
    }
    let (inputs, slots) = Slot::of(&[Some(res), Some(gu), Some(w)]);
    if inputs.is_empty() {
        return Ok(None);
    }
    let fwd_slots = slots.clone();
    let forward = move |a: &[Tensor], _: bool| -> Result<Tensor> {
        let (r, gu, w) = (
            fwd_slots[0].get(a).expect("res"),
            fwd_slots[1].get(a).expect("gu"),
            fwd_slots[2].get(a).expect("w"),
        );
        matmul(&silu_mul_packed(&gu)?, &w.t()?)? + r
    };
    let backward = move |a: &[Tensor], g: &Tensor| -> Result<Vec<Option<Tensor>>> {
        let mut out: Vec<Option<Tensor>> = vec![None; a.len()];
        let (gu, w) = (slots[1].get(a).expect("gu"), slots[2].get(a).expect("w"));
        if let Slot::In(i) = slots[0] {
            out[i] = Some(g.clone());
        }
        if let Slot::In(i) = slots[2] {
            out[i] = Some(matmul(&g.t()?, &silu_mul_packed(&gu)?)?);
        }
        if let Slot::In(i) = slots[1] {
            out[i] = Some(silu_mul_packed_backward(&gu, &matmul(g, &w)?)?);
        }
        Ok(out)
    };
    Recompute::explicit("down_silu", forward, backward)
        .apply(&inputs)
        .map(Some)
}

/// The backward of [`silu_mul_packed`]: `[dgate | dup]` `(N, 2·I)` of packed rows `gu` and the
/// product's gradient `g` `(N, I)`, no graph. Our CUDA kernel where `silu_mul` runs one, else
/// candle ops in the rows' dtype, those candle's autograd of [`silu_mul_composed`] runs (so
/// the CPU's half-precision path rounds as it did with the composition).
pub(crate) fn silu_mul_packed_backward(gu: &Tensor, g: &Tensor) -> Result<Tensor> {
    let (_, cols) = packed_halves(gu.layout())?;
    if !gu.device().is_cpu() && route("silu_mul", gu) == Path::Kernel && gu.dtype() == g.dtype() {
        return gu
            .contiguous()?
            .apply_op2_no_bwd(&g.contiguous()?, &SiluMulPackedBwd);
    }
    let a = gu.narrow(1, 0, cols)?;
    let u = gu.narrow(1, cols, cols)?;
    let g = g.to_dtype(gu.dtype())?;
    let silu = a.silu()?;
    let sg = (a.neg()?.exp()? + 1.0)?.recip()?;
    let silu_grad = ((&sg * (1.0 - &silu)?)? + &silu)?;
    let da = ((&g * &u)? * silu_grad)?;
    let du = (&g * &silu)?;
    Tensor::cat(&[&da, &du], 1)
}

/// [`silu_mul_packed_backward`]'s CUDA kernel (inputs: the packed rows, the gradient).
#[derive(Debug, Clone, Copy)]
struct SiluMulPackedBwd;

impl CustomOp2 for SiluMulPackedBwd {
    fn name(&self) -> &'static str {
        "silu_mul_packed_bwd"
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("silu_mul_packed_bwd: the CPU runs the composition")
    }
    cuda_op!(2, |_: &Self, s1, l1, s2, l2| {
        crate::cuda::silu_mul_packed_bwd(s1, l1, s2, l2)
    });
}

/// RoPE's backward: the gradient `g` `(B, H, L, D)` of rotated heads back to the unrotated
/// `(B, L, H, D)` layout (a rotation by −θ): our kernel where [`rope`] runs it, else candle ops.
pub(crate) fn rope_inverse(g: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    if route("rope", g) == Path::Kernel && g.dtype() == cos.dtype() && g.dtype() == sin.dtype() {
        return g.contiguous()?.apply_op3_no_bwd(
            &cos.contiguous()?,
            &sin.contiguous()?,
            &RopeOp { inverse: true },
        );
    }
    let (b, _, l, d) = g.dims4()?;
    let half = d / 2;
    let cos = cos.reshape((b, 1, l, half))?;
    let sin = sin.reshape((b, 1, l, half))?;
    let g1 = g.narrow(D::Minus1, 0, half)?;
    let g2 = g.narrow(D::Minus1, half, half)?;
    let o1 = (g1.broadcast_mul(&cos)? + g2.broadcast_mul(&sin)?)?;
    let o2 = (g2.broadcast_mul(&cos)? - g1.broadcast_mul(&sin)?)?;
    Tensor::cat(&[o1, o2], D::Minus1)?
        .transpose(1, 2)?
        .contiguous()
}

// ---------------------------------------------------------------- frozen linear

/// `x · wᵀ` for rows `x` `(N, in)` and a weight `w` `(out, in)`. When `x` carries a graph and
/// `w` does not (a frozen weight: LoRA's base layers, a frozen output head), this is one node
/// whose backward forms only `x`'s gradient: candle's matmul backward also forms the gradient
/// of a weight nobody asked for (as many products as the forward, and a weight-sized buffer
/// per layer kept to the end of backward). Otherwise it is candle's matmul.
pub fn frozen_linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let frozen = tape::needs_grad(x) && !tape::needs_grad(w) && x.rank() == 2 && enabled();
    if frozen && applies(x) && x.dtype() == w.dtype() {
        tape::apply_op1(&x.contiguous()?, FrozenLinear { w: w.detach() })
    } else if frozen {
        // Every other device and dtype: candle's matmul forward, a backward of one product.
        let (wf, wb) = (w.detach(), w.detach());
        Recompute::explicit(
            "frozen_linear",
            move |a, _| matmul(&a[0], &wf.t()?),
            move |_, grad| Ok(vec![Some(matmul(grad, &wb)?)]),
        )
        .apply(&[x])
    } else {
        matmul(x, &w.t()?)
    }
}

#[derive(Debug, Clone)]
struct FrozenLinear {
    w: Tensor,
}

fn frozen_fwd<T: Float + 'static>(
    w: &Tensor,
    x: &CpuStorage,
    lx: &Layout,
) -> Result<(CpuStorage, Shape)> {
    let (n, k) = lx.shape().dims2()?;
    let (st, lw) = w.storage_and_layout();
    let candle_core::Storage::Cpu(ws) = &*st else {
        candle_core::bail!("frozen_linear: the weight must be on the CPU like its input");
    };
    let (out, wk) = lw.shape().dims2()?;
    if wk != k {
        candle_core::bail!("frozen_linear: rows of {k} features against a ({out}, {wk}) weight");
    }
    let x = slice::<T>(x, lx, "frozen_linear")?;
    let wd = &ws.as_slice::<T>()?[lw.start_offset()..];
    let (w0, w1) = (lw.stride()[0], lw.stride()[1]);
    let mut y = vec![T::zero(); n * out];
    let lhs = Mat {
        data: x,
        rs: k,
        cs: 1,
    };
    // wᵀ (in × out): element (i, o) is w[o, i].
    let rhs = Mat {
        data: wd,
        rs: w1,
        cs: w0,
    };
    let threads = rayon::current_num_threads();
    mm_par((n, out, k), &mut y, out, false, lhs, rhs, T::one(), threads);
    Ok((T::to_cpu_storage_owned(y), (n, out).into()))
}

impl CustomOp1 for FrozenLinear {
    fn name(&self) -> &'static str {
        "frozen_linear"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        float_dispatch!(s.dtype(), self.name(), frozen_fwd(&self.w, s, l))
    }
    fn bwd(&self, _x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(grad.matmul(&self.w)?))
    }
}
