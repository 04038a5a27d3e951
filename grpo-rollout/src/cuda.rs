//! The decoder's fused ops on CUDA: launchers of the kernels in `kernels.cu` ([`DECODER`]),
//! called by the `cuda_fwd` of the same custom ops that run the CPU kernels
//! ([`crate::fused`]). How kernels are compiled (NVRTC at first use, for the GPU found), loaded,
//! cached and launched, and what happens when they cannot be, is [`grpo_core::cuda`]'s part.
//!
//! Launching a kernel is `unsafe` in cudarc; [`grpo_core::cuda_launch`] says why each launch
//! holds.
#![allow(unsafe_code)]

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::DevicePtr;
use candle_core::{CudaStorage, DType, Device, Layout, Result, Shape, Tensor};
use grpo_core::cuda::{Elem, Kernels, LaunchConfig, alloc, blocks, cfg, done, input, row_threads};
use grpo_core::{cuda_launch, cuda_typed};

use crate::fused::{DEVICE_ATTENTION_MAX_D, MAX_DEVICE_HIDDEN};

/// Query heads of one kv head that a block of `attention_rows` and `cached_attention` serves
/// (`ATTN_GROUP` in kernels.cu).
const ATTN_GROUP: usize = 8;

/// The decoder's kernels.
pub static DECODER: Kernels = Kernels {
    name: "grpo_decoder",
    source: include_str!("kernels.cu"),
    probe: "rms_fwd_f32",
};

/// Whether a fused op on `t` takes its CUDA kernel: a CUDA tensor of f32, bf16 or f16 with
/// the kernels available (compiled at the first ask).
pub fn takes(t: &Tensor) -> bool {
    grpo_core::cuda::takes(&DECODER, t)
}

/// Why the decoder's kernels are not available on `dev`, if they are not (`grpo-cli check`).
pub fn compile_status(dev: &Device) -> std::result::Result<(), String> {
    grpo_core::cuda::compile_status(&DECODER, dev)
}

/// The CUDA storage behind a tensor's storage guard; `what` names it in the error.
fn on_cuda<'a>(st: &'a candle_core::Storage, what: &str) -> Result<&'a CudaStorage> {
    match st {
        candle_core::Storage::Cuda(cs) => Ok(cs),
        _ => candle_core::bail!("{what} must be on the CUDA device"),
    }
}

// ------------------------------------------------------------------ RMSNorm

fn rms_fwd_t<T: Elem>(
    x: &CudaStorage,
    lx: &Layout,
    w: &CudaStorage,
    lw: &Layout,
    eps: f64,
) -> Result<(CudaStorage, Shape)> {
    let dev = &x.device;
    let h = lx.dims().last().copied().unwrap_or(1);
    if lw.shape().elem_count() != h {
        candle_core::bail!(
            "rms_norm: weight of {} for hidden size {h}",
            lw.shape().elem_count()
        );
    }
    let rows = lx.shape().elem_count() / h.max(1);
    let (xs, xo) = input::<T>(x, lx, "rms_norm")?;
    let (ws, wo) = input::<T>(w, lw, "rms_norm")?;
    let out = alloc::<T>(dev, rows * h)?;
    let (hi, eps) = (h as i32, eps as f32);
    let c = cfg(rows as u32, row_threads(h), 0);
    cuda_launch!(
        &DECODER,
        dev,
        "rms_fwd",
        T::DTYPE,
        c,
        [xs, &xo, ws, &wo, &out, &hi, &eps]
    );
    done(out, dev, lx.shape().clone())
}

/// RMSNorm forward on CUDA.
pub fn rms_fwd(
    x: &CudaStorage,
    lx: &Layout,
    w: &CudaStorage,
    lw: &Layout,
    eps: f64,
) -> Result<(CudaStorage, Shape)> {
    cuda_typed!(x.dtype(), "rms_norm", rms_fwd_t(x, lx, w, lw, eps))
}

#[allow(clippy::too_many_arguments)]
fn rms_bwd_t<T: Elem>(
    x: &CudaStorage,
    lx: &Layout,
    w: &CudaStorage,
    lw: &Layout,
    g: &CudaStorage,
    lg: &Layout,
    eps: f64,
) -> Result<(CudaStorage, Shape)> {
    let dev = &x.device;
    let h = lx.dims().last().copied().unwrap_or(1);
    if h > MAX_DEVICE_HIDDEN {
        candle_core::bail!("rms_norm backward: hidden size {h} above {MAX_DEVICE_HIDDEN}");
    }
    let n = lx.shape().elem_count();
    let rows = n / h.max(1);
    let (xs, xo) = input::<T>(x, lx, "rms_norm_bwd")?;
    let (ws, wo) = input::<T>(w, lw, "rms_norm_bwd")?;
    let (gs, go) = input::<T>(g, lg, "rms_norm_bwd")?;
    let nblk = rows.clamp(1, 256);
    let out = alloc::<T>(dev, n + h)?;
    let partial = alloc::<f32>(dev, nblk * h)?;
    let (ri, hi, eps) = (rows as i32, h as i32, eps as f32);
    let c = cfg(nblk as u32, row_threads(h), (h * 4) as u32);
    cuda_launch!(
        &DECODER,
        dev,
        "rms_bwd",
        T::DTYPE,
        c,
        [xs, &xo, ws, &wo, gs, &go, &out, &partial, &ri, &hi, &eps]
    );
    let (nb, oo) = (nblk as i32, n as i64);
    let c = cfg(blocks(h, 256), 256, 0);
    cuda_launch!(
        &DECODER,
        dev,
        "col_sum",
        T::DTYPE,
        c,
        [&partial, &nb, &hi, &out, &oo]
    );
    done(out, dev, n + h)
}

/// RMSNorm backward on CUDA: `[dx, dw]` flat, as the CPU kernel returns them.
pub fn rms_bwd(
    x: &CudaStorage,
    lx: &Layout,
    w: &CudaStorage,
    lw: &Layout,
    g: &CudaStorage,
    lg: &Layout,
    eps: f64,
) -> Result<(CudaStorage, Shape)> {
    cuda_typed!(
        x.dtype(),
        "rms_norm_bwd",
        rms_bwd_t(x, lx, w, lw, g, lg, eps)
    )
}

fn add_rms_t<T: Elem>(
    x: &CudaStorage,
    lx: &Layout,
    r: &CudaStorage,
    lr: &Layout,
    w: &CudaStorage,
    lw: &Layout,
    eps: f64,
) -> Result<(CudaStorage, Shape)> {
    let dev = &x.device;
    let h = lx.dims().last().copied().unwrap_or(1);
    let n = lx.shape().elem_count();
    if lr.shape().elem_count() != n || lw.shape().elem_count() != h {
        candle_core::bail!(
            "add_rms_norm: x {:?}, residual {:?}, weight {:?}",
            lx.dims(),
            lr.dims(),
            lw.dims()
        );
    }
    let rows = n / h.max(1);
    let (xs, xo) = input::<T>(x, lx, "add_rms_norm")?;
    let (rs, ro) = input::<T>(r, lr, "add_rms_norm")?;
    let (ws, wo) = input::<T>(w, lw, "add_rms_norm")?;
    let out = alloc::<T>(dev, 2 * n)?;
    let (ni, hi, eps) = (n as i64, h as i32, eps as f32);
    let c = cfg(rows as u32, row_threads(h), 0);
    cuda_launch!(
        &DECODER,
        dev,
        "add_rms_fwd",
        T::DTYPE,
        c,
        [xs, &xo, rs, &ro, ws, &wo, &out, &ni, &hi, &eps]
    );
    done(out, dev, 2 * n)
}

/// The residual add and the RMSNorm after it on CUDA: `[x + r, rms_norm(x + r)]` flat.
pub fn add_rms_fwd(
    x: &CudaStorage,
    lx: &Layout,
    r: &CudaStorage,
    lr: &Layout,
    w: &CudaStorage,
    lw: &Layout,
    eps: f64,
) -> Result<(CudaStorage, Shape)> {
    cuda_typed!(
        x.dtype(),
        "add_rms_norm",
        add_rms_t(x, lx, r, lr, w, lw, eps)
    )
}

#[allow(clippy::too_many_arguments)]
fn kv_write_t<T: Elem>(
    cache: &mut CudaStorage,
    lc: &Layout,
    x: &CudaStorage,
    lx: &Layout,
    rot: Option<(&Tensor, &Tensor)>,
    past: usize,
) -> Result<()> {
    let dev = x.device.clone();
    let (b, l, g, d, cap) = crate::fused::kv_write_dims(lc, lx, past)?;
    if lc.contiguous_offsets() != Some((0, b * g * cap * d)) {
        candle_core::bail!("kv_write: the cache must be a whole contiguous buffer");
    }
    let (xs, xo) = input::<T>(x, lx, "kv_write")?;
    let half = d / 2;
    let tables = match rot {
        Some((c, s)) => {
            if c.elem_count() != b * l * half || s.elem_count() != b * l * half {
                candle_core::bail!("kv_write: tables must be (B, L, D/2) = ({b}, {l}, {half})");
            }
            Some((c.storage_and_layout(), s.storage_and_layout()))
        }
        None => None,
    };
    let [bi, li, gi, di] = [b as i32, l as i32, g as i32, d as i32];
    let (capi, pasti) = (cap as i64, past as i64);
    let c = cfg(blocks(b * l * g * half, 256), 256, 0);
    let cs = cache.as_cuda_slice_mut::<T>()?;
    match &tables {
        Some(((cst, cl), (sst, sl))) => {
            let (cts, cto) = input::<T>(
                on_cuda(cst, "kv_write: the RoPE tables")?,
                cl,
                "kv_write cos",
            )?;
            let (sts, sto) = input::<T>(
                on_cuda(sst, "kv_write: the RoPE tables")?,
                sl,
                "kv_write sin",
            )?;
            let rotate = 1i32;
            cuda_launch!(
                &DECODER,
                &dev,
                "kv_write",
                T::DTYPE,
                c,
                [
                    cs, &capi, xs, &xo, cts, &cto, sts, &sto, &bi, &li, &gi, &di, &pasti, &rotate
                ]
            );
        }
        None => {
            // No tables are read without rotation; x stands in for them.
            let rotate = 0i32;
            cuda_launch!(
                &DECODER,
                &dev,
                "kv_write",
                T::DTYPE,
                c,
                [
                    cs, &capi, xs, &xo, xs, &xo, xs, &xo, &bi, &li, &gi, &di, &pasti, &rotate
                ]
            );
        }
    }
    Ok(())
}

/// New keys (rotated) or values `(B, L, G, D)` written into a `(B, G, cap, D)` cache at
/// `past`, on CUDA.
pub fn kv_write(
    cache: &mut CudaStorage,
    lc: &Layout,
    x: &CudaStorage,
    lx: &Layout,
    rot: Option<(&Tensor, &Tensor)>,
    past: usize,
) -> Result<()> {
    cuda_typed!(
        x.dtype(),
        "kv_write",
        kv_write_t(cache, lc, x, lx, rot, past)
    )
}

// ------------------------------------------------------------------ RoPE

fn rope_t<T: Elem>(
    x: &CudaStorage,
    lx: &Layout,
    c: &CudaStorage,
    lc: &Layout,
    s: &CudaStorage,
    ls: &Layout,
    inverse: bool,
) -> Result<(CudaStorage, Shape)> {
    let dev = &x.device;
    let (b, a1, a2, d) = lx.shape().dims4()?;
    let (l, h) = if inverse { (a2, a1) } else { (a1, a2) };
    let half = d / 2;
    if lc.shape().elem_count() != b * l * half || ls.shape().elem_count() != b * l * half {
        candle_core::bail!("rope: tables must be (B, L, D/2) = ({b}, {l}, {half})");
    }
    let (xs, xo) = input::<T>(x, lx, "rope")?;
    let (cs, co) = input::<T>(c, lc, "rope")?;
    let (ss, so) = input::<T>(s, ls, "rope")?;
    let out = alloc::<T>(dev, b * l * h * d)?;
    let [bi, li, hi, di, inv] = [b as i32, l as i32, h as i32, d as i32, inverse as i32];
    let c = cfg(blocks(b * h * l * half, 256), 256, 0);
    cuda_launch!(
        &DECODER,
        dev,
        "rope",
        T::DTYPE,
        c,
        [xs, &xo, cs, &co, ss, &so, &out, &bi, &li, &hi, &di, &inv]
    );
    let shape: Shape = if inverse { (b, l, h, d) } else { (b, h, l, d) }.into();
    done(out, dev, shape)
}

/// RoPE (or, with `inverse`, its backward) on CUDA.
pub fn rope(
    x: &CudaStorage,
    lx: &Layout,
    c: &CudaStorage,
    lc: &Layout,
    s: &CudaStorage,
    ls: &Layout,
    inverse: bool,
) -> Result<(CudaStorage, Shape)> {
    cuda_typed!(x.dtype(), "rope", rope_t(x, lx, c, lc, s, ls, inverse))
}

// ------------------------------------------------------------------ SiLU · mul

fn silu_fwd_t<T: Elem>(
    a: &CudaStorage,
    la: &Layout,
    u: &CudaStorage,
    lu: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let dev = &a.device;
    let n = la.shape().elem_count();
    if lu.shape().elem_count() != n {
        candle_core::bail!("silu_mul: gate and up differ in size");
    }
    let (as_, ao) = input::<T>(a, la, "silu_mul")?;
    let (us, uo) = input::<T>(u, lu, "silu_mul")?;
    let out = alloc::<T>(dev, n)?;
    // One row of n: both inputs contiguous.
    let (ni, row) = (n as i64, 0i64);
    let c = cfg(blocks(n, 256), 256, 0);
    cuda_launch!(
        &DECODER,
        dev,
        "silu_mul_fwd",
        T::DTYPE,
        c,
        [as_, &ao, &row, us, &uo, &row, &out, &ni, &ni]
    );
    done(out, dev, la.shape().clone())
}

fn silu_packed_t<T: Elem>(gu: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
    let dev = &gu.device;
    let (rows, cols) = crate::fused::packed_halves(l)?;
    let (gs, go) = input::<T>(gu, l, "silu_mul_packed")?;
    let n = rows * cols;
    let out = alloc::<T>(dev, n)?;
    let (ni, ci, stride, uo) = (n as i64, cols as i64, 2 * cols as i64, go + cols as i64);
    let c = cfg(blocks(n, 256), 256, 0);
    cuda_launch!(
        &DECODER,
        dev,
        "silu_mul_fwd",
        T::DTYPE,
        c,
        [gs, &go, &stride, gs, &uo, &stride, &out, &ni, &ci]
    );
    done(out, dev, (rows, cols))
}

/// `silu(gate) · up` of rows `[gate | up]` (the packed MLP product) on CUDA.
pub fn silu_mul_packed(gu: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
    cuda_typed!(gu.dtype(), "silu_mul_packed", silu_packed_t(gu, l))
}

/// `silu(gate) · up` on CUDA.
pub fn silu_mul_fwd(
    a: &CudaStorage,
    la: &Layout,
    u: &CudaStorage,
    lu: &Layout,
) -> Result<(CudaStorage, Shape)> {
    cuda_typed!(a.dtype(), "silu_mul", silu_fwd_t(a, la, u, lu))
}

fn silu_bwd_t<T: Elem>(
    a: &CudaStorage,
    la: &Layout,
    u: &CudaStorage,
    lu: &Layout,
    g: &CudaStorage,
    lg: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let dev = &a.device;
    let n = la.shape().elem_count();
    let (as_, ao) = input::<T>(a, la, "silu_mul_bwd")?;
    let (us, uo) = input::<T>(u, lu, "silu_mul_bwd")?;
    let (gs, go) = input::<T>(g, lg, "silu_mul_bwd")?;
    let out = alloc::<T>(dev, 2 * n)?;
    let ni = n as i64;
    let c = cfg(blocks(n, 256), 256, 0);
    cuda_launch!(
        &DECODER,
        dev,
        "silu_mul_bwd",
        T::DTYPE,
        c,
        [as_, &ao, us, &uo, gs, &go, &out, &ni]
    );
    done(out, dev, 2 * n)
}

fn silu_packed_bwd_t<T: Elem>(
    gu: &CudaStorage,
    lgu: &Layout,
    g: &CudaStorage,
    lg: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let dev = &gu.device;
    let (rows, cols) = crate::fused::packed_halves(lgu)?;
    if lg.dims() != [rows, cols] {
        candle_core::bail!(
            "silu_mul_packed backward: gradient {:?} for rows {:?}",
            lg.dims(),
            lgu.dims()
        );
    }
    let (gus, guo) = input::<T>(gu, lgu, "silu_mul_packed_bwd")?;
    let (gs, go) = input::<T>(g, lg, "silu_mul_packed_bwd")?;
    let out = alloc::<T>(dev, 2 * rows * cols)?;
    let (ri, ci) = (rows as i64, cols as i32);
    let c = cfg(blocks(rows * cols, 256), 256, 0);
    cuda_launch!(
        &DECODER,
        dev,
        "silu_mul_packed_bwd",
        T::DTYPE,
        c,
        [gus, &guo, gs, &go, &out, &ri, &ci]
    );
    done(out, dev, (rows, 2 * cols))
}

/// The backward of `silu(gate) · up` over packed rows `[gate | up]` on CUDA, given the
/// product's gradient `(rows, I)`: `[dgate | dup]` `(rows, 2·I)`.
pub fn silu_mul_packed_bwd(
    gu: &CudaStorage,
    lgu: &Layout,
    g: &CudaStorage,
    lg: &Layout,
) -> Result<(CudaStorage, Shape)> {
    cuda_typed!(
        gu.dtype(),
        "silu_mul_packed_bwd",
        silu_packed_bwd_t(gu, lgu, g, lg)
    )
}

/// The backward of `silu(gate) · up` on CUDA: `[dgate, dup]` flat.
pub fn silu_mul_bwd(
    a: &CudaStorage,
    la: &Layout,
    u: &CudaStorage,
    lu: &Layout,
    g: &CudaStorage,
    lg: &Layout,
) -> Result<(CudaStorage, Shape)> {
    cuda_typed!(a.dtype(), "silu_mul_bwd", silu_bwd_t(a, la, u, lu, g, lg))
}

// ------------------------------------------------------------------ attention softmax

fn softmax_fwd_t<T: Elem>(
    x: &CudaStorage,
    lx: &Layout,
    m: &CudaStorage,
    lm: &Layout,
    scale: f64,
) -> Result<(CudaStorage, Shape)> {
    let dev = &x.device;
    let (b, h, l, s) = lx.shape().dims4()?;
    if lm.dims() != [b, 1, l, s] {
        candle_core::bail!(
            "attention_softmax: bias must be ({b}, 1, {l}, {s}), got {:?}",
            lm.dims()
        );
    }
    let (xs, xo) = input::<T>(x, lx, "attention_softmax")?;
    let (ms, mo) = input::<T>(m, lm, "attention_softmax")?;
    let out = alloc::<T>(dev, b * h * l * s)?;
    let (hi, li, si, sc) = (h as i32, l as i32, s as i32, scale as f32);
    let c = cfg((b * h * l) as u32, row_threads(s), 0);
    cuda_launch!(
        &DECODER,
        dev,
        "softmax_fwd",
        T::DTYPE,
        c,
        [xs, &xo, ms, &mo, &out, &hi, &li, &si, &sc]
    );
    done(out, dev, lx.shape().clone())
}

/// The attention softmax on CUDA.
pub fn softmax_fwd(
    x: &CudaStorage,
    lx: &Layout,
    m: &CudaStorage,
    lm: &Layout,
    scale: f64,
) -> Result<(CudaStorage, Shape)> {
    cuda_typed!(
        x.dtype(),
        "attention_softmax",
        softmax_fwd_t(x, lx, m, lm, scale)
    )
}

fn softmax_bwd_t<T: Elem>(
    p: &CudaStorage,
    lp: &Layout,
    g: &CudaStorage,
    lg: &Layout,
    scale: f64,
) -> Result<(CudaStorage, Shape)> {
    let dev = &p.device;
    let s = lp.dims().last().copied().unwrap_or(1);
    let n = lp.shape().elem_count();
    let (ps, po) = input::<T>(p, lp, "attention_softmax_bwd")?;
    let (gs, go) = input::<T>(g, lg, "attention_softmax_bwd")?;
    let out = alloc::<T>(dev, n)?;
    let (si, sc) = (s as i32, scale as f32);
    let c = cfg((n / s.max(1)) as u32, row_threads(s), 0);
    cuda_launch!(
        &DECODER,
        dev,
        "softmax_bwd",
        T::DTYPE,
        c,
        [ps, &po, gs, &go, &out, &si, &sc]
    );
    done(out, dev, lp.shape().clone())
}

/// The attention softmax's backward on CUDA.
pub fn softmax_bwd(
    p: &CudaStorage,
    lp: &Layout,
    g: &CudaStorage,
    lg: &Layout,
    scale: f64,
) -> Result<(CudaStorage, Shape)> {
    cuda_typed!(
        p.dtype(),
        "attention_softmax_bwd",
        softmax_bwd_t(p, lp, g, lg, scale)
    )
}

// ------------------------------------------------------------------ attention (few queries)

/// Offset and `(batch, head, position)` strides of a `(B, G, S, D)` key or value view with
/// unit stride along `D`.
fn kv_view(l: &Layout, what: &str) -> Result<(i64, [i64; 3])> {
    let st = l.stride();
    if l.dims().len() != 4 || st[3] != 1 {
        candle_core::bail!("attention: {what} needs unit stride along the head dimension");
    }
    Ok((
        l.start_offset() as i64,
        [st[0] as i64, st[1] as i64, st[2] as i64],
    ))
}

/// Threads of a grouped attention block (the kernels' ATTN_THREADS: their output elements are
/// shared out over that many).
const ATTN_THREADS: u32 = 256;

/// The launch of a grouped attention (`attention_rows`, `cached_attention`) over
/// `[B, H, G, L, S, D]`: one block of ATTN_THREADS per (row, kv head, up to ATTN_GROUP of its
/// query heads, query position).
fn grouped_launch([b, nh, nkv, l]: [usize; 4]) -> LaunchConfig {
    let chunks = (nh / nkv).div_ceil(ATTN_GROUP);
    cfg((b * nkv * chunks * l) as u32, ATTN_THREADS, 0)
}

#[allow(clippy::too_many_arguments)]
fn attention_rows_t<T: Elem>(
    q: &CudaStorage,
    lq: &Layout,
    k: &CudaStorage,
    lk: &Layout,
    v: &CudaStorage,
    lv: &Layout,
    bias: &Tensor,
    scale: f64,
) -> Result<(CudaStorage, Shape)> {
    let dev = &q.device;
    let (b, nh, l, d) = lq.shape().dims4()?;
    let (kb_, nkv, s, kd) = lk.shape().dims4()?;
    if kb_ != b || kd != d || lv.dims() != lk.dims() || nkv == 0 || nh % nkv != 0 {
        candle_core::bail!(
            "attention: q {:?}, k {:?}, v {:?} do not fit",
            lq.dims(),
            lk.dims(),
            lv.dims()
        );
    }
    if d > DEVICE_ATTENTION_MAX_D {
        candle_core::bail!("attention: head dimension {d} above {DEVICE_ATTENTION_MAX_D}");
    }
    if bias.dims() != [b, 1, l, s] {
        candle_core::bail!(
            "attention: bias must be ({b}, 1, {l}, {s}), got {:?}",
            bias.dims()
        );
    }
    let (qs, qo) = input::<T>(q, lq, "attention")?;
    let (ko, [kb, kg, ks]) = kv_view(lk, "k")?;
    let (vo, [vb, vg, vs]) = kv_view(lv, "v")?;
    let kst = k.as_cuda_slice::<T>()?;
    let vst = v.as_cuda_slice::<T>()?;
    let (bst, bl) = bias.storage_and_layout();
    let (bss, bo) = input::<T>(on_cuda(&bst, "attention: the bias")?, bl, "attention bias")?;
    let out = alloc::<T>(dev, b * l * nh * d)?;
    let [nhi, nkvi, li, si, di] = [nh as i32, nkv as i32, l as i32, s as i32, d as i32];
    let sc = scale as f32;
    let (name, c) = ("attention_rows", grouped_launch([b, nh, nkv, l]));
    cuda_launch!(
        &DECODER,
        dev,
        name,
        T::DTYPE,
        c,
        [
            qs, &qo, kst, &ko, &kb, &kg, &ks, vst, &vo, &vb, &vg, &vs, bss, &bo, &out, &nhi, &nkvi,
            &li, &si, &di, &sc
        ]
    );
    done(out, dev, (b * l, nh * d))
}

/// Attention of a few query rows over (possibly strided) keys and values, on CUDA: context
/// rows `(B·L, H·D)`. Forward only (decoding, frozen passes).
#[allow(clippy::too_many_arguments)]
pub fn attention_rows(
    q: &CudaStorage,
    lq: &Layout,
    k: &CudaStorage,
    lk: &Layout,
    v: &CudaStorage,
    lv: &Layout,
    bias: &Tensor,
    scale: f64,
) -> Result<(CudaStorage, Shape)> {
    cuda_typed!(
        q.dtype(),
        "attention",
        attention_rows_t(q, lq, k, lk, v, lv, bias, scale)
    )
}

/// What [`cached_attention`] reads besides the packed projections and the caches.
#[derive(Debug, Clone)]
pub struct CachedAttention<'a> {
    /// RoPE tables of the new positions, `(B, L, D/2)`.
    pub cos: &'a Tensor,
    /// See `cos`.
    pub sin: &'a Tensor,
    /// `(B, 1, L, past + L)` additive mask; with `past_at`, `(B, 1, L, cap)`, of which the
    /// first `past + L` columns are read.
    pub bias: &'a Tensor,
    /// Positions already cached.
    pub past: usize,
    /// The cached length as a `(1,)` u32 tensor on the device, read by the kernel in place of
    /// `past` (a decode step captured in a CUDA graph: its launch arguments are fixed).
    pub past_at: Option<&'a Tensor>,
    /// Query heads.
    pub heads: usize,
    /// Score scale.
    pub scale: f64,
    /// The packed projection's bias `((heads + 2·kv heads)·D,)`, contiguous, added to q, k and
    /// v as the kernel reads them (in place of a separate add).
    pub proj_bias: Option<&'a Tensor>,
}

#[allow(clippy::too_many_arguments)]
fn cached_attention_t<T: Elem>(
    qkv: &CudaStorage,
    lq: &Layout,
    kc: &CudaStorage,
    lk: &Layout,
    vc: &CudaStorage,
    lv: &Layout,
    a: &CachedAttention<'_>,
) -> Result<(CudaStorage, Shape)> {
    let dev = &qkv.device;
    let (b, l, heads, d) = lq.shape().dims4()?;
    let nh = a.heads;
    let (cb, nkv, cap, cd) = lk.shape().dims4()?;
    let fits = heads == nh + 2 * nkv && cb == b && cd == d && lv.dims() == lk.dims();
    if !fits || nkv == 0 || !nh.is_multiple_of(nkv) || d % 2 != 0 || d > DEVICE_ATTENTION_MAX_D {
        candle_core::bail!(
            "cached_attention: packed q/k/v {:?} with {nh} query heads against caches {:?}",
            lq.dims(),
            lk.dims()
        );
    }
    let whole = b * nkv * cap * d;
    if lk.contiguous_offsets() != Some((0, whole)) || lv.contiguous_offsets() != Some((0, whole)) {
        candle_core::bail!("cached_attention: the caches must be whole contiguous buffers");
    }
    // With the length on the device, the bias spans the cache and the launch is sized for a
    // full one (the same graph serves every step).
    let s = match a.past_at {
        Some(_) => cap,
        None => a.past + l,
    };
    if cap < s || a.bias.dims() != [b, 1, l, s] {
        candle_core::bail!(
            "cached_attention: {s} positions in a cache of {cap}, bias {:?}",
            a.bias.dims()
        );
    }
    let half = d / 2;
    if a.cos.elem_count() != b * l * half || a.sin.elem_count() != b * l * half {
        candle_core::bail!("cached_attention: tables must be (B, L, D/2) = ({b}, {l}, {half})");
    }
    let (qs, qo) = input::<T>(qkv, lq, "cached_attention")?;
    // The caches are written in place (rows past .. past + L), as kv_write writes them: a KV
    // cache's buffers are its own and nothing reads them while a pass runs on this stream.
    let ks = kc.as_cuda_slice::<T>()?;
    let vs = vc.as_cuda_slice::<T>()?;
    let (cst, cl) = a.cos.storage_and_layout();
    let (sst, sl) = a.sin.storage_and_layout();
    let (bst, bl) = a.bias.storage_and_layout();
    let what = "cached_attention: the RoPE tables and the bias";
    let (cs, co) = input::<T>(on_cuda(&cst, what)?, cl, "cached_attention cos")?;
    let (ss, so) = input::<T>(on_cuda(&sst, what)?, sl, "cached_attention sin")?;
    let (bs, bo) = input::<T>(on_cuda(&bst, what)?, bl, "cached_attention bias")?;
    let out = alloc::<T>(dev, b * l * nh * d)?;
    let [nhi, nkvi, li, di] = [nh as i32, nkv as i32, l as i32, d as i32];
    let (capi, sc, bstride) = (cap as i64, a.scale as f32, s as i64);
    let (name, c) = ("cached_attention", grouped_launch([b, nh, nkv, l]));
    // The length as an argument, or (a captured step's) the device address that holds it, the
    // argument then 0; a null address otherwise.
    let stream = dev.cuda_stream();
    let held = match a.past_at {
        Some(p) => {
            if p.dtype() != DType::U32 || p.layout().contiguous_offsets() != Some((0, 1)) {
                candle_core::bail!("cached_attention: the cached length must be a fresh (1,) u32");
            }
            Some(p.storage_and_layout().0)
        }
        None => None,
    };
    let at = match &held {
        Some(st) => Some(
            on_cuda(st, "cached_attention: the cached length")?
                .as_cuda_slice::<u32>()?
                .device_ptr(&stream),
        ),
        None => None,
    };
    let (pasti, past_ptr) = match &at {
        Some((ptr, _)) => (0i64, *ptr),
        None => (a.past as i64, 0),
    };
    let pb_held = match a.proj_bias {
        Some(pb) => {
            if pb.dtype() != T::DTYPE || pb.layout().contiguous_offsets() != Some((0, heads * d)) {
                candle_core::bail!(
                    "cached_attention: the projection bias must be a fresh contiguous ({}) {:?}",
                    heads * d,
                    T::DTYPE
                );
            }
            Some(pb.storage_and_layout().0)
        }
        None => None,
    };
    let pb_at = match &pb_held {
        Some(st) => Some(
            on_cuda(st, "cached_attention: the projection bias")?
                .as_cuda_slice::<T>()?
                .device_ptr(&stream),
        ),
        None => None,
    };
    let pb_ptr = pb_at.as_ref().map_or(0, |(p, _)| *p);
    cuda_launch!(
        &DECODER,
        dev,
        name,
        T::DTYPE,
        c,
        [
            qs, &qo, ks, vs, &capi, cs, &co, ss, &so, bs, &bo, &bstride, &out, &nhi, &nkvi, &li,
            &pasti, &past_ptr, &di, &sc, &pb_ptr
        ]
    );
    drop(at);
    drop(pb_at);
    done(out, dev, (b * l, nh * d))
}

/// A pass over a KV cache after the packed q/k/v product, one launch: `qkv` `(B, L, H + 2G, D)`
/// gives the queries (rotated here), and the new keys (rotated) and values, which go into the
/// `(B, G, cap, D)` caches at `past`; returns the context rows `(B·L, H·D)` over all `past + L`
/// positions. What `rope`, two `kv_write`s and `attention_rows` compute, to the bit.
pub fn cached_attention(
    qkv: &CudaStorage,
    lq: &Layout,
    kc: &CudaStorage,
    lk: &Layout,
    vc: &CudaStorage,
    lv: &Layout,
    a: &CachedAttention<'_>,
) -> Result<(CudaStorage, Shape)> {
    cuda_typed!(
        qkv.dtype(),
        "cached_attention",
        cached_attention_t(qkv, lq, kc, lk, vc, lv, a)
    )
}

// ------------------------------------------------------------------ sampling

/// The sampling kernel's parameters (`SampleParams` in kernels.cu, field for field).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct SampleParams {
    /// Temperature divisor (1 when greedy).
    pub t: f32,
    /// Repetition penalty.
    pub rp: f32,
    /// Nucleus mass (1 = off).
    pub top_p: f32,
    /// min-p (0 = off).
    pub min_p: f32,
    /// 1: argmax.
    pub greedy: i32,
    /// top-k (0 = off).
    pub top_k: i32,
    /// Vocabulary (columns sampled from).
    pub v: i32,
    /// Whether the bias, seen-token and stop-id inputs are read.
    pub has_bias: i32,
    /// See `has_bias`.
    pub has_seen: i32,
    /// See `has_bias`.
    pub has_stop: i32,
}

// SAFETY: a `repr(C)` struct of 4-byte scalars, laid out as the C struct the kernel takes by
// value.
unsafe impl candle_core::cuda_backend::cudarc::driver::DeviceRepr for SampleParams {}

/// One decode step's sampling on CUDA, as `grpo_rollout::sample::DeviceSampler` samples:
/// inputs `logits` `(n, ≥ v)` and `su` `(n, 2)` f32 (suppress flag, uniform draw) per row;
/// `bias`, `stop` `(1, v)` and `seen` `(n, v)` f32 when present. Output `(n, 2)` f32: the token
/// and its recorded log-prob.
#[derive(Debug, Clone)]
pub struct SampleOp {
    /// Logit bias.
    pub bias: Option<Tensor>,
    /// Tokens seen per row (repetition penalty).
    pub seen: Option<Tensor>,
    /// Stop ids suppressed in rows flagged in `su`.
    pub stop: Option<Tensor>,
    /// The knobs.
    pub params: SampleParams,
}

impl candle_core::CustomOp2 for SampleOp {
    fn name(&self) -> &'static str {
        "sample_rows"
    }
    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("sample_rows: the sampling kernel runs on CUDA only")
    }
    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        lx: &Layout,
        su: &CudaStorage,
        lsu: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        cuda_typed!(x.dtype(), "sample_rows", sample_t(self, x, lx, su, lsu))
    }
}

/// Threads of a sampling block: `SAMPLE_THREADS` in kernels.cu (its shared scan's size and
/// the kernel's launch bound).
const SAMPLE_THREADS: u32 = 1024;

fn sample_t<T: Elem>(
    op: &SampleOp,
    x: &CudaStorage,
    lx: &Layout,
    su: &CudaStorage,
    lsu: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let dev = &x.device;
    let (n, ld) = lx.shape().dims2()?;
    let v = op.params.v as usize;
    if v == 0 || v > ld || lsu.dims() != [n, 2] || su.dtype() != candle_core::DType::F32 {
        candle_core::bail!(
            "sample_rows: logits {:?}, draws {:?} for a vocabulary of {v}",
            lx.dims(),
            lsu.dims()
        );
    }
    let (xs, xo) = input::<T>(x, lx, "sample_rows")?;
    let (sus, suo) = input::<f32>(su, lsu, "sample_rows")?;
    if suo != 0 {
        candle_core::bail!("sample_rows: the draws must start their buffer");
    }
    // The optional inputs: f32, contiguous from offset 0 (as the sampler makes them); an
    // absent one is never read, and `su` stands in for its pointer.
    let guards: Vec<_> = [&op.bias, &op.seen, &op.stop]
        .iter()
        .map(|t| t.as_ref().map(|t| t.storage_and_layout()))
        .collect();
    let mut ptrs = Vec::with_capacity(3);
    for (g, want) in guards.iter().zip([v, n * v, v]) {
        ptrs.push(match g {
            Some((st, l)) => {
                let (s, o) = input::<f32>(on_cuda(st, "sample_rows: an input")?, l, "sample_rows")?;
                if o != 0 || l.shape().elem_count() != want {
                    candle_core::bail!("sample_rows: an input of {:?}", l.dims());
                }
                s
            }
            None => sus,
        });
    }
    let out = alloc::<f32>(dev, 2 * n)?;
    let ids = alloc::<u32>(dev, n)?;
    let ldi = ld as i64;
    let p = op.params;
    cuda_launch!(
        &DECODER,
        dev,
        "sample_rows",
        T::DTYPE,
        cfg(n as u32, SAMPLE_THREADS, 0),
        [
            xs, &xo, &ldi, ptrs[0], ptrs[1], ptrs[2], sus, &out, &ids, &p
        ]
    );
    done(out, dev, (n, 2))
}
