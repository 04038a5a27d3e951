//! CUDA kernels of our own, for the fused ops here ([`HEAD`]: log-softmax + gather, entropy)
//! and in grpo-rollout (the decoder's ops): how they are compiled, loaded and launched.
//!
//! Each set of kernels ([`Kernels`]) is CUDA C++ source that is compiled at run time with
//! NVRTC, after a shared prelude (`cuda_prelude.cu`: storage types, conversions, block
//! reductions), once per process and GPU, for that GPU's compute capability, and launched by
//! the `cuda_fwd` of the same custom ops that run the CPU kernels. They take f32, bf16 and f16
//! storage and compute in f32.
//!
//! Why NVRTC rather than nvcc at build time: the kernels are built for the GPU the binary finds
//! (no compute capability fixed at build time), and the build needs nothing beyond what
//! candle's CUDA backend needs (candle links NVRTC already). The cost is a compilation of about
//! a second at first use. When the compilation or the loading of the module fails (a driver
//! older than the PTX NVRTC writes, say), the ops say so once on stderr and run their candle
//! compositions (the [`crate::recompute`] path); `GRPO_CUDA_KERNELS=0` chooses that path on
//! purpose, `GRPO_CUDA_KERNELS=-attention,-sample` for some ops alone
//! ([`crate::fused::parse_kernel_switch`]).
//!
//! Launching a kernel and allocating the uninitialised buffer it fills are `unsafe` in cudarc;
//! each such block says why it holds.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use candle_core::backend::BackendStorage;
pub use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
pub use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::cudarc::driver::{CudaFunction, CudaSlice, DeviceRepr, DriverError};
use candle_core::cuda_backend::cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaDevice, CudaStorage, DType, Device, Layout, Result, Shape, Tensor};

/// The prelude every kernel source is compiled after.
pub const PRELUDE: &str = include_str!("cuda_prelude.cu");

/// A set of kernels: one NVRTC program, one CUDA module.
#[derive(Debug)]
pub struct Kernels {
    /// The module's name (unique per set).
    pub name: &'static str,
    /// The CUDA C++ source (compiled after [`PRELUDE`]).
    pub source: &'static str,
    /// A kernel of the set, loaded when the module is first compiled to prove the driver takes
    /// it.
    pub probe: &'static str,
}

/// The kernels of [`crate::fused`]: log-softmax + gather and entropy, forward and backward.
pub static HEAD: Kernels = Kernels {
    name: "grpo_head",
    source: include_str!("head.cu"),
    probe: "lsg_fwd_f32",
};

/// The kernel of [`crate::quant`]: the 8-bit optimizer states' nearest-code quantizer.
pub static QUANT: Kernels = Kernels {
    name: "grpo_quant",
    source: include_str!("quant.cu"),
    probe: "quantize_code_f32",
};

type PtxCache = HashMap<(&'static str, usize), std::result::Result<&'static str, String>>;

/// `GRPO_CUDA_KERNELS=0` (every kernel off; see [`crate::fused::parse_kernel_switch`]).
fn off() -> bool {
    crate::fused::cuda_kernels_off()
}

/// Compiles `k` (after the prelude) for `arch` (`compute_90`, ...) with NVRTC; the PTX.
pub fn compile(k: &Kernels, arch: &str) -> std::result::Result<String, String> {
    let opts = CompileOptions {
        arch: Some(Box::leak(arch.to_string().into_boxed_str())),
        options: vec!["--std=c++17".into()],
        name: Some(format!("{}.cu", k.name)),
        ..Default::default()
    };
    compile_ptx_with_opts(format!("{PRELUDE}\n{}", k.source), opts)
        .map(|p| p.to_src())
        .map_err(|e| format!("{e:?}"))
}

/// The PTX of `k` for the GPU `dev`, compiled and loaded at first use.
fn ptx(k: &'static Kernels, dev: &CudaDevice) -> std::result::Result<&'static str, String> {
    static CACHE: OnceLock<Mutex<PtxCache>> = OnceLock::new();
    let ordinal = dev.cuda_stream().context().ordinal();
    let mut cache = CACHE
        .get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .expect("ptx cache poisoned");
    cache
        .entry((k.name, ordinal))
        .or_insert_with(|| {
            let (major, minor) = dev
                .cuda_stream()
                .context()
                .compute_capability()
                .map_err(|e| format!("{e:?}"))?;
            let arch = format!("compute_{major}{minor}");
            let loaded = compile(k, &arch).and_then(|src| {
                // Load the module now, so that a driver that cannot take it is found here.
                dev.get_or_load_custom_func(k.probe, k.name, &src)
                    .map(|_| src)
                    .map_err(|e| format!("loading the module: {e}"))
            });
            let src = loaded.inspect_err(|e| {
                let first = e.lines().next().unwrap_or("");
                eprintln!(
                    "grpo: the CUDA kernels `{}` are not available for {arch} ({first}); \
                     running the candle compositions instead",
                    k.name
                );
            })?;
            Ok(Box::leak(src.into_boxed_str()))
        })
        .clone()
}

/// Whether the kernels `k` run on `dev` (compiled, loaded, not switched off); compiles them at
/// first ask.
pub fn available(k: &'static Kernels, dev: &Device) -> bool {
    match dev {
        Device::Cuda(cd) => !off() && ptx(k, cd).is_ok(),
        _ => false,
    }
}

/// Whether an op on `t` takes a kernel of `k`: a CUDA tensor of f32, bf16 or f16 with the
/// kernels available.
pub fn takes(k: &'static Kernels, t: &Tensor) -> bool {
    matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16) && available(k, t.device())
}

/// Why the kernels `k` are not available on `dev`, if they are not (`grpo-cli check`).
pub fn compile_status(k: &'static Kernels, dev: &Device) -> std::result::Result<(), String> {
    match dev {
        Device::Cuda(cd) => ptx(k, cd).map(|_| ()),
        _ => Err("not a CUDA device".into()),
    }
}

/// Kernel handles by (set, device ordinal, kernel, dtype): a launch looks one up instead of
/// asking the driver again.
type FuncCache = HashMap<(&'static str, usize, &'static str, DType), CudaFunction>;

static FUNCS: OnceLock<Mutex<FuncCache>> = OnceLock::new();

/// The kernel `name` of `k` for storage `dtype` (`{name}_f32`, `_bf16`, `_f16`) on `dev`.
pub fn func(
    k: &'static Kernels,
    dev: &CudaDevice,
    name: &'static str,
    dtype: DType,
) -> Result<CudaFunction> {
    let key = (k.name, dev.cuda_stream().context().ordinal(), name, dtype);
    let funcs = FUNCS.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(f) = funcs.lock().expect("kernel cache poisoned").get(&key) {
        return Ok(f.clone());
    }
    let ptx = ptx(k, dev).map_err(|e| candle_core::Error::Msg(format!("CUDA kernels: {e}")))?;
    let suffix = match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        d => candle_core::bail!("{name}: no CUDA kernel for {d:?}"),
    };
    let f = dev
        .get_or_load_custom_func(&format!("{name}_{suffix}"), k.name, ptx)?
        .into_cuda_function();
    funcs
        .lock()
        .expect("kernel cache poisoned")
        .insert(key, f.clone());
    Ok(f)
}

/// A launch's driver result as a candle result.
pub fn launched<T>(r: std::result::Result<T, DriverError>) -> Result<()> {
    r.w().map(|_| ())
}

/// Launches kernel `$name` of the set `$k` (for `$dtype`) on `$dev`'s stream with the
/// arguments in order (references to values that live past the launch statement). A grid of 0
/// blocks (an empty tensor) launches nothing. The caller's crate must allow `unsafe_code`: the
/// launch is an `unsafe` block there.
#[macro_export]
macro_rules! cuda_launch {
    ($k:expr, $dev:expr, $name:expr, $dtype:expr, $cfg:expr, [$($arg:expr),* $(,)?]) => {{
        let cfg: $crate::cuda::LaunchConfig = $cfg;
        if cfg.grid_dim.0 > 0 {
            let f = $crate::cuda::func($k, $dev, $name, $dtype)?;
            let stream = $dev.cuda_stream();
            let mut b = stream.launch_builder(&f);
            $( $crate::cuda::PushKernelArg::arg(&mut b, $arg); )*
            // SAFETY: the arguments are those of the kernel's signature in its .cu source, in
            // order and type, and every buffer holds the elements the kernel reads or writes
            // for this launch configuration (the caller checked the shapes).
            $crate::cuda::launched(unsafe { b.launch(cfg) })?;
        }
    }};
}

/// Dispatches `$f::<T>(...)` on a storage dtype (f32, bf16, f16); another dtype is an error
/// naming `$name`.
#[macro_export]
macro_rules! cuda_typed {
    ($dtype:expr, $name:expr, $f:ident($($arg:expr),*)) => {
        match $dtype {
            candle_core::DType::F32 => $f::<f32>($($arg),*),
            candle_core::DType::BF16 => $f::<half::bf16>($($arg),*),
            candle_core::DType::F16 => $f::<half::f16>($($arg),*),
            d => candle_core::bail!("{}: no CUDA kernel for {d:?}", $name),
        }
    };
}

/// The storage types the kernels take.
pub trait Elem: CudaDType + DeviceRepr + candle_core::WithDType {}
impl Elem for f32 {}
impl Elem for half::bf16 {}
impl Elem for half::f16 {}

/// The storage a kernel filled, and its shape.
pub fn done<T: Elem>(
    out: CudaSlice<T>,
    dev: &CudaDevice,
    shape: impl Into<Shape>,
) -> Result<(CudaStorage, Shape)> {
    Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), shape.into()))
}

/// An uninitialised device buffer of `n` elements that a kernel then writes in full.
pub fn alloc<T: DeviceRepr>(dev: &CudaDevice, n: usize) -> Result<CudaSlice<T>> {
    // SAFETY: every caller launches a kernel that writes all `n` elements before anything
    // reads them (at least one element is allocated, so that an empty tensor has a buffer).
    unsafe { dev.alloc::<T>(n.max(1)) }
}

/// Storage slice and start offset of a contiguous input.
pub fn input<'a, T: CudaDType>(
    s: &'a CudaStorage,
    l: &Layout,
    op: &str,
) -> Result<(&'a CudaSlice<T>, i64)> {
    match l.contiguous_offsets() {
        Some((a, _)) => Ok((s.as_cuda_slice::<T>()?, a as i64)),
        None => candle_core::bail!("{op}: input must be contiguous"),
    }
}

/// Blocks of `per` threads for `n` items (at least one).
pub fn blocks(n: usize, per: usize) -> u32 {
    n.div_ceil(per).max(1) as u32
}

/// A one-dimensional launch configuration.
pub fn cfg(grid: u32, block: u32, smem: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: smem,
    }
}

/// Threads per block for a reduction over rows of `n`: a multiple of 32, at most 256.
pub fn row_threads(n: usize) -> u32 {
    (n.div_ceil(32) * 32).clamp(32, 256) as u32
}

// ------------------------------------------------------------------ the head's kernels

/// Rows and vocabulary of `(N, V)` logits.
fn rows_vocab(l: &Layout, op: &str) -> Result<(usize, usize)> {
    match l.dims() {
        [n, v] => Ok((*n, *v)),
        d => candle_core::bail!("{op}: expected (rows, vocab), got {d:?}"),
    }
}

/// `u32` token ids and their offset.
fn ids<'a>(
    t: &'a CudaStorage,
    lt: &Layout,
    n: usize,
    op: &str,
) -> Result<(&'a CudaSlice<u32>, i64)> {
    if t.dtype() != DType::U32 || lt.shape().elem_count() != n {
        candle_core::bail!(
            "{op}: {n} u32 targets expected, got {:?} {:?}",
            t.dtype(),
            lt.dims()
        );
    }
    input::<u32>(t, lt, op)
}

/// `f32` per-row gradients and their offset.
fn row_grads<'a>(
    g: &'a CudaStorage,
    lg: &Layout,
    n: usize,
    op: &str,
) -> Result<(&'a CudaSlice<f32>, i64)> {
    if g.dtype() != DType::F32 || lg.shape().elem_count() != n {
        candle_core::bail!(
            "{op}: {n} f32 row gradients expected, got {:?} {:?}",
            g.dtype(),
            lg.dims()
        );
    }
    input::<f32>(g, lg, op)
}

fn lsg_fwd_t<T: Elem>(
    x: &CudaStorage,
    lx: &Layout,
    t: &CudaStorage,
    lt: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let dev = &x.device;
    let (n, v) = rows_vocab(lx, "log_softmax_gather")?;
    let (xs, xo) = input::<T>(x, lx, "log_softmax_gather")?;
    let (ts, to) = ids(t, lt, n, "log_softmax_gather")?;
    let out = alloc::<f32>(dev, n)?;
    let vi = v as i32;
    let c = cfg(n as u32, row_threads(v), 0);
    cuda_launch!(
        &HEAD,
        dev,
        "lsg_fwd",
        T::DTYPE,
        c,
        [xs, &xo, ts, &to, &out, &vi]
    );
    done(out, dev, n)
}

/// `log_softmax(x)[t]` per row on CUDA: f32 `(N,)`.
pub fn lsg_fwd(
    x: &CudaStorage,
    lx: &Layout,
    t: &CudaStorage,
    lt: &Layout,
) -> Result<(CudaStorage, Shape)> {
    cuda_typed!(x.dtype(), "log_softmax_gather", lsg_fwd_t(x, lx, t, lt))
}

fn lsg_bwd_t<T: Elem>(
    x: &CudaStorage,
    lx: &Layout,
    t: &CudaStorage,
    lt: &Layout,
    g: &CudaStorage,
    lg: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let dev = &x.device;
    let (n, v) = rows_vocab(lx, "log_softmax_gather_bwd")?;
    let (xs, xo) = input::<T>(x, lx, "log_softmax_gather_bwd")?;
    let (ts, to) = ids(t, lt, n, "log_softmax_gather_bwd")?;
    let (gs, go) = row_grads(g, lg, n, "log_softmax_gather_bwd")?;
    let out = alloc::<T>(dev, n * v)?;
    let vi = v as i32;
    let c = cfg(n as u32, row_threads(v), 0);
    cuda_launch!(
        &HEAD,
        dev,
        "lsg_bwd",
        T::DTYPE,
        c,
        [xs, &xo, ts, &to, gs, &go, &out, &vi]
    );
    done(out, dev, (n, v))
}

/// The backward of [`lsg_fwd`]: `g · (onehot(t) − softmax(x))`, `(N, V)` in the logits' dtype.
pub fn lsg_bwd(
    x: &CudaStorage,
    lx: &Layout,
    t: &CudaStorage,
    lt: &Layout,
    g: &CudaStorage,
    lg: &Layout,
) -> Result<(CudaStorage, Shape)> {
    cuda_typed!(
        x.dtype(),
        "log_softmax_gather_bwd",
        lsg_bwd_t(x, lx, t, lt, g, lg)
    )
}

fn ent_fwd_t<T: Elem>(x: &CudaStorage, lx: &Layout) -> Result<(CudaStorage, Shape)> {
    let dev = &x.device;
    let (n, v) = rows_vocab(lx, "entropy")?;
    let (xs, xo) = input::<T>(x, lx, "entropy")?;
    let out = alloc::<f32>(dev, n)?;
    let vi = v as i32;
    let c = cfg(n as u32, row_threads(v), 0);
    cuda_launch!(&HEAD, dev, "ent_fwd", T::DTYPE, c, [xs, &xo, &out, &vi]);
    done(out, dev, n)
}

/// The entropy of the softmax per row on CUDA: f32 `(N,)`.
pub fn ent_fwd(x: &CudaStorage, lx: &Layout) -> Result<(CudaStorage, Shape)> {
    cuda_typed!(x.dtype(), "entropy", ent_fwd_t(x, lx))
}

fn ent_bwd_t<T: Elem>(
    x: &CudaStorage,
    lx: &Layout,
    g: &CudaStorage,
    lg: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let dev = &x.device;
    let (n, v) = rows_vocab(lx, "entropy_bwd")?;
    let (xs, xo) = input::<T>(x, lx, "entropy_bwd")?;
    let (gs, go) = row_grads(g, lg, n, "entropy_bwd")?;
    let out = alloc::<T>(dev, n * v)?;
    let vi = v as i32;
    let c = cfg(n as u32, row_threads(v), 0);
    cuda_launch!(
        &HEAD,
        dev,
        "ent_bwd",
        T::DTYPE,
        c,
        [xs, &xo, gs, &go, &out, &vi]
    );
    done(out, dev, (n, v))
}

/// The backward of [`ent_fwd`]: `−g · p · (log p + H)`, `(N, V)` in the logits' dtype.
pub fn ent_bwd(
    x: &CudaStorage,
    lx: &Layout,
    g: &CudaStorage,
    lg: &Layout,
) -> Result<(CudaStorage, Shape)> {
    cuda_typed!(x.dtype(), "entropy_bwd", ent_bwd_t(x, lx, g, lg))
}

/// What the kernels of ours loaded so far take per thread, and the context's stack limit: the
/// driver reserves local memory (stack and spills) for every thread the GPU can hold at once,
/// sized by the largest need of any kernel launched, so one kernel that spills costs device
/// memory for the whole run. Lines for `grpo-cli check`; empty where nothing was loaded.
pub fn kernel_resources(dev: &CudaDevice) -> Vec<String> {
    use candle_core::cuda_backend::cudarc::driver::{result, sys};
    let mut rows: Vec<(i32, i32, String)> = FUNCS
        .get()
        .and_then(|m| m.lock().ok())
        .map(|m| {
            m.iter()
                .map(|((set, _, name, dt), f)| {
                    (
                        f.local_size_bytes().unwrap_or(-1),
                        f.num_regs().unwrap_or(-1),
                        format!("{set}/{name} {dt:?}"),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    if rows.is_empty() {
        return Vec::new();
    }
    rows.sort();
    let mut out = Vec::new();
    if let Some((local, regs, name)) = rows.last() {
        out.push(format!(
            "our kernels ({} loaded): the most local memory per thread {local} bytes ({name}, {regs} registers)",
            rows.len()
        ));
    }
    if dev.cuda_stream().context().bind_to_thread().is_ok()
        && let Ok(stack) = result::ctx::get_limit(sys::CUlimit::CU_LIMIT_STACK_SIZE)
    {
        out.push(format!("context stack limit: {stack} bytes per thread"));
    }
    out
}

/// The device's default memory pool (cudarc allocates with `cuMemAllocAsync` from it), with
/// its context bound to this thread.
fn default_pool(
    dev: &CudaDevice,
) -> Option<candle_core::cuda_backend::cudarc::driver::sys::CUmemoryPool> {
    use candle_core::cuda_backend::cudarc::driver::result;
    let ctx = dev.cuda_stream().context().clone();
    ctx.bind_to_thread().ok()?;
    // SAFETY: the device handle is the context's own; the pool is the driver's default one.
    unsafe { result::device::get_default_mem_pool(ctx.cu_device()) }.ok()
}

/// Whether `GRPO_CUDA_POOL=sync` asks for the driver's own pool behaviour (read once).
pub fn pool_released_at_syncs() -> bool {
    static SYNC: OnceLock<bool> = OnceLock::new();
    *SYNC.get_or_init(|| std::env::var("GRPO_CUDA_POOL").as_deref() == Ok("sync"))
}

/// Keeps freed memory in the device's pool across synchronisations. The driver's default
/// release threshold is 0: at every stream, event or context synchronisation the pool hands
/// all its unused memory back, and the next allocations map it again through the driver — a
/// learner that reads its loss after each micro-batch, or a decode loop that reads its
/// sampled ids every step, pays that on each (the host stalls in `cuMemAllocAsync`). With the
/// threshold at its maximum the pool keeps what it has, as torch's caching allocator does;
/// [`trim_pool`] gives the unused part back where a phase ends, so that one phase's free
/// blocks do not add to the next one's peak. `GRPO_CUDA_POOL=sync` keeps the driver's
/// default (for comparison).
pub fn keep_pool_across_syncs(dev: &CudaDevice) {
    use candle_core::cuda_backend::cudarc::driver::sys;
    if pool_released_at_syncs() {
        return;
    }
    let Some(pool) = default_pool(dev) else {
        return;
    };
    let mut max = u64::MAX;
    // SAFETY: the release threshold is a 64-bit value (CUDA driver API).
    let _ = unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut max as *mut u64).cast(),
        )
    };
}

/// The pool's release threshold, bytes (`None` where the driver does not answer).
pub fn pool_release_threshold(dev: &CudaDevice) -> Option<u64> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let pool = default_pool(dev)?;
    let mut v: u64 = 0;
    // SAFETY: the release threshold is a 64-bit value (CUDA driver API).
    unsafe {
        sys::cuMemPoolGetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut v as *mut u64).cast(),
        )
    }
    .result()
    .ok()?;
    Some(v)
}

/// Gives the pool's unused memory back to the driver (after waiting for the device, so that
/// the frees queued so far count). Called where a phase ends: a generation, an optimizer step.
pub fn trim_pool(dev: &CudaDevice) {
    use candle_core::cuda_backend::cudarc::driver::result;
    if dev.cuda_stream().synchronize().is_err() {
        return;
    }
    let Some(pool) = default_pool(dev) else {
        return;
    };
    // SAFETY: the pool is the device's default one, alive as long as its context.
    let _ = unsafe { result::mem_pool::trim_to(pool, 0) };
}

/// The device's default memory pool, where cudarc's stream-ordered allocations come from:
/// bytes `[in use now, in use at most, reserved now, reserved at most]`, the maxima since the
/// previous call (each call resets them), so that a log line per phase gives that phase's
/// peak of live tensors (in use) and the pool's footprint around it (reserved: what nvidia-smi
/// counts). `None` where the driver does not answer.
pub fn pool_usage(dev: &CudaDevice) -> Option<[u64; 4]> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    use sys::CUmemPool_attribute as A;
    let pool = default_pool(dev)?;
    let get = |a: A| -> Option<u64> {
        let mut v: u64 = 0;
        // SAFETY: these four attributes are 64-bit values (CUDA driver API).
        unsafe { sys::cuMemPoolGetAttribute(pool, a, (&mut v as *mut u64).cast()) }
            .result()
            .ok()?;
        Some(v)
    };
    let out = [
        get(A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
        get(A::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
        get(A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
        get(A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
    ];
    for a in [
        A::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
        A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
    ] {
        let mut zero: u64 = 0;
        // SAFETY: the high-water attributes may only be set to 0 (a reset).
        let _ = unsafe { sys::cuMemPoolSetAttribute(pool, a, (&mut zero as *mut u64).cast()) };
    }
    Some(out)
}

/// [`crate::quant`]'s nearest-code bytes on CUDA: rows `(blocks, 256)` f32, their maxima
/// `(blocks, 1)` f32 and the code `(256,)` f32 in; u8 `(blocks, 256)` out.
pub fn quantize_code(
    x: &CudaStorage,
    lx: &Layout,
    a: &CudaStorage,
    la: &Layout,
    c: &CudaStorage,
    lc: &Layout,
) -> Result<(CudaStorage, Shape)> {
    code_kernel::<f32, u8>("quantize", "quantize_code", (x, lx), (a, la), (c, lc))
}

/// [`crate::quant`]'s lookup on CUDA: bytes `(blocks · 256,)` u8, block maxima `(blocks,)` f32
/// and the code `(256,)` f32 in; `code[byte] · absmax[block]` f32 out.
pub fn dequantize_code(
    q: &CudaStorage,
    lq: &Layout,
    a: &CudaStorage,
    la: &Layout,
    c: &CudaStorage,
    lc: &Layout,
) -> Result<(CudaStorage, Shape)> {
    code_kernel::<u8, f32>("dequantize", "dequantize_code", (q, lq), (a, la), (c, lc))
}

/// Launches a kernel of [`QUANT`] over `values` (blocks of 256, one thread each) with their
/// blocks' `scales` and the 256-entry `code`: an output of the values' shape, in `O`.
fn code_kernel<I: CudaDType + DeviceRepr, O: CudaDType + DeviceRepr>(
    op: &str,
    kernel: &'static str,
    (v, lv): (&CudaStorage, &Layout),
    (a, la): (&CudaStorage, &Layout),
    (c, lc): (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Shape)> {
    let dev = &v.device;
    let n = lv.shape().elem_count();
    if la.shape().elem_count() * crate::quant::BLOCK != n || lc.shape().elem_count() != 256 {
        candle_core::bail!(
            "{op}: expected blocks of 256 values, a scale per block and a code of 256, got {:?}, {:?}, {:?}",
            lv.dims(),
            la.dims(),
            lc.dims()
        );
    }
    let (vs, vo) = input::<I>(v, lv, op)?;
    let (as_, ao) = input::<f32>(a, la, op)?;
    let (cs, co) = input::<f32>(c, lc, op)?;
    let out = alloc::<O>(dev, n)?;
    let nl = n as i64;
    let block = crate::quant::BLOCK;
    let c = cfg(blocks(n, block), block as u32, 0);
    cuda_launch!(
        &QUANT,
        dev,
        kernel,
        DType::F32,
        c,
        [vs, &vo, as_, &ao, cs, &co, &out, &nl]
    );
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev.clone()),
        lv.shape().clone(),
    ))
}
