//! Flash attention on CUDA for training and prefill lengths (`flash.cu`): the forward runs an
//! online softmax over key tiles on the tensor cores and keeps, per query row, only its maximum
//! and `1 / Σ` (the stats); the backward recomputes the probabilities tile by tile from them,
//! in two kernels (dq; dk and dv) that need no atomics, so gradients are deterministic. No
//! `(B, H, L, S)` tensor exists in either pass. bf16 and f16 storage, head dimensions 64 and
//! 128, GPUs of compute capability 8.0 and later (the source refuses to compile for older ones,
//! and [`crate::fused::attention`] then keeps the recomputed composition).
//!
//! [`crate::fused::attention`] takes this path for a CUDA attention with a graph, or over more
//! query rows than the decode kernel takes; `GRPO_CUDA_KERNELS=-flash_attention` switches it
//! off.
#![allow(unsafe_code)]

use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::CudaSlice;
use candle_core::{CudaStorage, DType, Device, Layout, Result, Shape, Tensor};
use grpo_core::cuda::{Elem, Kernels, alloc, cfg, done, input};
use grpo_core::cuda_launch;

/// The flash attention kernels.
pub static FLASH: Kernels = Kernels {
    name: "grpo_flash",
    source: include_str!("flash.cu"),
    probe: "flash_fwd_d64_bf16",
};

/// Query rows per block of the forward and dq kernels, keys per block of dk/dv (`FA_BR`,
/// `FA_BC` in flash.cu); threads per block (`FA_THREADS`).
const ROWS: usize = 64;
const THREADS: u32 = 128;

/// Why the flash kernels are not available on `dev`, if they are not (`grpo-cli check`).
pub fn compile_status(dev: &Device) -> std::result::Result<(), String> {
    grpo_core::cuda::compile_status(&FLASH, dev)
}

/// Whether an attention over `q` `(B, H, L, D)`, `k`, `v` `(B, G, S, D)` and `bias` takes the
/// flash kernels: one CUDA dtype of bf16 or f16 for all four, D of 64 or 128, unit stride
/// along D, the kernels available (compiled at the first ask).
pub fn takes(q: &Tensor, k: &Tensor, v: &Tensor, bias: &Tensor) -> bool {
    let dt = q.dtype();
    let unit = |t: &Tensor| t.rank() == 4 && t.stride()[3] == 1;
    matches!(dt, DType::BF16 | DType::F16)
        && [k, v, bias].iter().all(|t| t.dtype() == dt)
        && matches!(q.dims().get(3), Some(64 | 128))
        && unit(q)
        && unit(k)
        && unit(v)
        && grpo_core::cuda::takes(&FLASH, q)
}

/// The attention op: forward on CUDA, its backward the two gradient kernels.
pub struct FlashAttention {
    bias: Tensor,
    scale: f64,
    causal: bool,
    /// The forward's per-row stats `(B, H, L, 2)`, kept for the backward.
    stats: Mutex<Option<Arc<CudaSlice<f32>>>>,
}

impl std::fmt::Debug for FlashAttention {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlashAttention")
            .field("bias", &self.bias.dims())
            .field("scale", &self.scale)
            .field("causal", &self.causal)
            .finish_non_exhaustive()
    }
}

impl FlashAttention {
    /// The op for an additive `bias` `(B, 1, L, S)` (no gradient) and score `scale`; with
    /// `causal` the bias masks every key after each query's position (see [`attention`]).
    pub fn new(bias: &Tensor, scale: f64, causal: bool) -> Result<Self> {
        Ok(Self {
            bias: bias.contiguous()?.detach(),
            scale,
            causal,
            stats: Mutex::new(None),
        })
    }
}

/// Shapes of one call, checked.
#[derive(Clone, Copy)]
struct Dims {
    b: usize,
    nh: usize,
    nkv: usize,
    l: usize,
    s: usize,
    d: usize,
}

fn dims(lq: &Layout, lk: &Layout, lv: &Layout, bias: &Tensor) -> Result<Dims> {
    let (b, nh, l, d) = lq.shape().dims4()?;
    let (kb, nkv, s, kd) = lk.shape().dims4()?;
    if kb != b || kd != d || lv.dims() != lk.dims() || nkv == 0 || !nh.is_multiple_of(nkv) {
        candle_core::bail!(
            "flash attention: q {:?}, k {:?}, v {:?} do not fit (B, H, L, D), (B, G, S, D)",
            lq.dims(),
            lk.dims(),
            lv.dims()
        );
    }
    if d != 64 && d != 128 {
        candle_core::bail!("flash attention: head dimension {d} (64 or 128)");
    }
    if bias.dims() != [b, 1, l, s] {
        candle_core::bail!(
            "flash attention: bias must be ({b}, 1, {l}, {s}), got {:?}",
            bias.dims()
        );
    }
    Ok(Dims {
        b,
        nh,
        nkv,
        l,
        s,
        d,
    })
}

/// Offset and `(batch, head, row)` strides of a 4-d view with unit stride along D.
fn view(l: &Layout, what: &str) -> Result<[i64; 4]> {
    let st = l.stride();
    if st.len() != 4 || st[3] != 1 {
        candle_core::bail!("flash attention: {what} needs unit stride along the head dimension");
    }
    Ok([
        l.start_offset() as i64,
        st[0] as i64,
        st[1] as i64,
        st[2] as i64,
    ])
}

/// The kernel `{part}_d{D}` (`part`: flash_fwd, flash_dq, flash_dkv).
fn kernel(part: &str, d: usize) -> &'static str {
    match (part, d) {
        ("flash_fwd", 64) => "flash_fwd_d64",
        ("flash_fwd", _) => "flash_fwd_d128",
        ("flash_dq", 64) => "flash_dq_d64",
        ("flash_dq", _) => "flash_dq_d128",
        ("flash_dkv", 64) => "flash_dkv_d64",
        _ => "flash_dkv_d128",
    }
}

/// The CUDA storage behind a tensor's storage guard.
fn on_cuda<'a>(st: &'a candle_core::Storage, what: &str) -> Result<&'a CudaStorage> {
    match st {
        candle_core::Storage::Cuda(cs) => Ok(cs),
        _ => candle_core::bail!("flash attention: {what} must be on the CUDA device"),
    }
}

/// The inputs every flash kernel reads: q, k, v views and the bias, as launch arguments.
struct Inputs<'a, T> {
    q: &'a CudaSlice<T>,
    k: &'a CudaSlice<T>,
    v: &'a CudaSlice<T>,
    vq: [i64; 4],
    vk: [i64; 4],
    vv: [i64; 4],
    /// Elements (8, 2 or 1) that divide every row start: 16-byte, 32-bit or 16-bit loads.
    align: i32,
}

fn inputs<'a, T: Elem>(
    s: [(&'a CudaStorage, &Layout); 3],
    extra_offsets: &[i64],
) -> Result<Inputs<'a, T>> {
    let [vq, vk, vv] = [view(s[0].1, "q")?, view(s[1].1, "k")?, view(s[2].1, "v")?];
    let starts = || {
        [vq, vk, vv]
            .into_iter()
            .flatten()
            .chain(extra_offsets.iter().copied())
    };
    let align = match () {
        _ if starts().all(|x| x % 8 == 0) => 8,
        _ if starts().all(|x| x % 2 == 0) => 2,
        _ => 1,
    };
    Ok(Inputs {
        q: s[0].0.as_cuda_slice::<T>()?,
        k: s[1].0.as_cuda_slice::<T>()?,
        v: s[2].0.as_cuda_slice::<T>()?,
        vq,
        vk,
        vv,
        align,
    })
}

fn forward_t<T: Elem>(
    op: &FlashAttention,
    s: [(&CudaStorage, &Layout); 3],
) -> Result<(CudaStorage, Shape)> {
    let dev = &s[0].0.device;
    let m = dims(s[0].1, s[1].1, s[2].1, &op.bias)?;
    let a = inputs::<T>(s, &[])?;
    let (bst, bl) = op.bias.storage_and_layout();
    let bias = on_cuda(&bst, "the bias")?.as_cuda_slice::<T>()?;
    let bo = bl.start_offset() as i64;
    let out = alloc::<T>(dev, m.b * m.l * m.nh * m.d)?;
    let stats = alloc::<f32>(dev, m.b * m.nh * m.l * 2)?;
    let [nh, nkv, l, sl] = [m.nh, m.nkv, m.l, m.s].map(|x| x as i32);
    let (sc, causal) = (op.scale as f32, i32::from(op.causal));
    let ([qo, qb, qh, qr], [ko, kb, kg, kr], [vo, vb, vg, vr]) = (a.vq, a.vk, a.vv);
    let c = cfg((m.b * m.nh * m.l.div_ceil(ROWS)) as u32, THREADS, 0);
    cuda_launch!(
        &FLASH,
        dev,
        kernel("flash_fwd", m.d),
        T::DTYPE,
        c,
        [
            a.q, &qo, &qb, &qh, &qr, a.k, &ko, &kb, &kg, &kr, a.v, &vo, &vb, &vg, &vr, bias, &bo,
            &out, &stats, &nh, &nkv, &l, &sl, &sc, &a.align, &causal
        ]
    );
    *op.stats.lock().expect("flash stats poisoned") = Some(Arc::new(stats));
    done(out, dev, (m.b * m.l, m.nh * m.d))
}

/// Which gradient a [`FlashGrad`] forms.
#[derive(Clone, Copy, PartialEq)]
enum Part {
    /// dq `(B, H, L, D)`.
    Dq,
    /// dk and dv `(2, B, G, S, D)`.
    Dkv,
}

/// One of the backward's kernels, applied to (q, k, v).
struct FlashGrad {
    part: Part,
    bias: Tensor,
    scale: f64,
    causal: bool,
    stats: Arc<CudaSlice<f32>>,
    /// The context's gradient, rows `(B·L, H·D)` contiguous.
    dout: Tensor,
    /// `Σ_e dout · out` per row and head, `(B, L, H)` f32 contiguous.
    delta: Tensor,
}

fn grad_t<T: Elem>(
    op: &FlashGrad,
    s: [(&CudaStorage, &Layout); 3],
) -> Result<(CudaStorage, Shape)> {
    let dev = &s[0].0.device;
    let m = dims(s[0].1, s[1].1, s[2].1, &op.bias)?;
    let (gst, gl) = op.dout.storage_and_layout();
    let (dst, dl) = op.delta.storage_and_layout();
    let (bst, bl) = op.bias.storage_and_layout();
    let go = gl.start_offset();
    let a = inputs::<T>(s, &[go as i64])?;
    let dout = on_cuda(&gst, "the gradient")?
        .as_cuda_slice::<T>()?
        .slice(go..);
    let delta = on_cuda(&dst, "delta")?
        .as_cuda_slice::<f32>()?
        .slice(dl.start_offset()..);
    let bias = on_cuda(&bst, "the bias")?.as_cuda_slice::<T>()?;
    let bo = bl.start_offset() as i64;
    let [nh, nkv, l, sl] = [m.nh, m.nkv, m.l, m.s].map(|x| x as i32);
    let (sc, causal) = (op.scale as f32, i32::from(op.causal));
    let ([qo, qb, qh, qr], [ko, kb, kg, kr], [vo, vb, vg, vr]) = (a.vq, a.vk, a.vv);
    let stats = &*op.stats;
    let (name, n, grid, shape): (_, _, _, Shape) = match op.part {
        Part::Dq => (
            kernel("flash_dq", m.d),
            m.b * m.nh * m.l * m.d,
            m.b * m.nh * m.l.div_ceil(ROWS),
            (m.b, m.nh, m.l, m.d).into(),
        ),
        Part::Dkv => (
            kernel("flash_dkv", m.d),
            2 * m.b * m.nkv * m.s * m.d,
            m.b * m.nkv * m.s.div_ceil(ROWS),
            (2, m.b, m.nkv, m.s, m.d).into(),
        ),
    };
    let out = alloc::<T>(dev, n)?;
    let c = cfg(grid as u32, THREADS, 0);
    cuda_launch!(
        &FLASH,
        dev,
        name,
        T::DTYPE,
        c,
        [
            a.q, &qo, &qb, &qh, &qr, a.k, &ko, &kb, &kg, &kr, a.v, &vo, &vb, &vg, &vr, bias, &bo,
            &dout, stats, &delta, &out, &nh, &nkv, &l, &sl, &sc, &a.align, &causal
        ]
    );
    done(out, dev, shape)
}

/// The CPU refusal and the CUDA forward of a flash op over (q, k, v): `$run::<T>(self, [(q,
/// lq), (k, lk), (v, lv)])` for the two storage types the kernels take.
macro_rules! cuda_only {
    ($run:ident) => {
        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &Layout,
            _: &candle_core::CpuStorage,
            _: &Layout,
            _: &candle_core::CpuStorage,
            _: &Layout,
        ) -> Result<(candle_core::CpuStorage, Shape)> {
            candle_core::bail!("flash attention runs on CUDA only")
        }
        fn cuda_fwd(
            &self,
            q: &CudaStorage,
            lq: &Layout,
            k: &CudaStorage,
            lk: &Layout,
            v: &CudaStorage,
            lv: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let s = [(q, lq), (k, lk), (v, lv)];
            match q.dtype() {
                DType::BF16 => $run::<half::bf16>(self, s),
                DType::F16 => $run::<half::f16>(self, s),
                d => candle_core::bail!("flash attention: no kernel for {d:?} (bf16 or f16)"),
            }
        }
    };
}

impl candle_core::CustomOp3 for FlashAttention {
    fn name(&self) -> &'static str {
        "flash_attention"
    }
    cuda_only!(forward_t);
    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let stats = self
            .stats
            .lock()
            .expect("flash stats poisoned")
            .clone()
            .ok_or_else(|| candle_core::Error::Msg("flash attention: no forward stats".into()))?;
        let (b, nh, l, d) = q.dims4()?;
        let dout = grad.contiguous()?;
        let delta = dout.apply_op2_no_bwd(&res.contiguous()?, &FlashDelta { b, nh, l, d })?;
        let grad_op = |part| FlashGrad {
            part,
            bias: self.bias.clone(),
            scale: self.scale,
            causal: self.causal,
            stats: stats.clone(),
            dout: dout.clone(),
            delta: delta.clone(),
        };
        let (q, k, v) = (q.detach(), k.detach(), v.detach());
        let dq = q.apply_op3(&k, &v, grad_op(Part::Dq))?;
        let dkv = q.apply_op3(&k, &v, grad_op(Part::Dkv))?;
        Ok((Some(dq), Some(dkv.get(0)?), Some(dkv.get(1)?)))
    }
}

/// The backward's `delta`, `Σ_e dout · out` per row and head: rows `(B·L, H·D)` of the
/// context's gradient and of the context → `(B, L, H)` f32, one kernel (candle's two casts,
/// product and sum were four launches and three f32 copies of the context).
struct FlashDelta {
    b: usize,
    nh: usize,
    l: usize,
    d: usize,
}

fn delta_t<T: Elem>(
    op: &FlashDelta,
    g: &CudaStorage,
    lg: &Layout,
    o: &CudaStorage,
    lo: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let n = op.b * op.l * op.nh;
    let want = [op.b * op.l, op.nh * op.d];
    if lg.dims() != want || lo.dims() != want {
        candle_core::bail!(
            "flash attention delta: gradient {:?} and context {:?}, want {want:?}",
            lg.dims(),
            lo.dims()
        );
    }
    let dev = &g.device;
    let (gs, go) = input::<T>(g, lg, "flash attention delta")?;
    let (os, oo) = input::<T>(o, lo, "flash attention delta")?;
    let out = alloc::<f32>(dev, n)?;
    let (ni, di) = (n as i64, op.d as i32);
    let c = cfg((n * 32).div_ceil(256) as u32, 256, 0);
    cuda_launch!(
        &FLASH,
        dev,
        "flash_delta",
        T::DTYPE,
        c,
        [gs, &go, os, &oo, &out, &ni, &di]
    );
    done(out, dev, (op.b, op.l, op.nh))
}

impl candle_core::CustomOp2 for FlashDelta {
    fn name(&self) -> &'static str {
        "flash_attention_delta"
    }
    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("flash attention runs on CUDA only")
    }
    fn cuda_fwd(
        &self,
        g: &CudaStorage,
        lg: &Layout,
        o: &CudaStorage,
        lo: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        match g.dtype() {
            DType::BF16 => delta_t::<half::bf16>(self, g, lg, o, lo),
            DType::F16 => delta_t::<half::f16>(self, g, lg, o, lo),
            d => candle_core::bail!("flash attention delta: no kernel for {d:?}"),
        }
    }
}

impl candle_core::CustomOp3 for FlashGrad {
    fn name(&self) -> &'static str {
        match self.part {
            Part::Dq => "flash_attention_dq",
            Part::Dkv => "flash_attention_dkv",
        }
    }
    cuda_only!(grad_t);
}

/// `softmax(q kᵀ · scale + bias) v` with the flash kernels: context rows `(B·L, H·D)`, with a
/// backward when q, k or v carry a graph. See [`takes`] for what it accepts. With `causal`
/// the caller promises that the bias masks every key after each query's position (the queries
/// being the last L of the S positions, as a decoder's passes are), and key tiles above the
/// diagonal are skipped: the same values on every row with a visible key; a row whose every
/// key is masked (a left-padded position, never read) is not the composition's average then.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    bias: &Tensor,
    scale: f64,
    causal: bool,
) -> Result<Tensor> {
    grpo_core::tape::apply_op3(q, k, v, FlashAttention::new(bias, scale, causal)?)
}
