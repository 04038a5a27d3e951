//! Fused CPU kernels: the shared plumbing, and the switch that turns them off.
//!
//! A composition of candle ops makes one pass over memory (and one allocation, and in the
//! backward one more node with its own zero-filled gradient buffer) per op. For the few ops that
//! dominate a small model's step we write fused kernels as candle `CustomOp`s **with a real
//! backward**: [`crate::logprobs`] here, RMSNorm / RoPE / SiLU·mul / attention softmax in
//! grpo-rollout. They run on CPU tensors of f32 or f64; on any other device or dtype the callers
//! use the plain composition, which candle's CUDA backend covers. Every fused op is tested
//! against its composition (values and gradients).
//!
//! Kernels split work by rows over rayon's pool; reductions across rows (a weight's gradient)
//! are summed in a fixed block order, so results do not depend on thread scheduling.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Mutex, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout, Result, Tensor, WithDType};
use rayon::prelude::*;

const MODE_OFF: u8 = 0;
const MODE_ON: u8 = 1;
const MODE_RECOMPUTE: u8 = 2;

fn mode() -> &'static AtomicU8 {
    static MODE: OnceLock<AtomicU8> = OnceLock::new();
    MODE.get_or_init(|| {
        AtomicU8::new(match std::env::var("GRPO_FUSED").as_deref() {
            Ok("0") | Ok("false") => MODE_OFF,
            Ok("recompute") => MODE_RECOMPUTE,
            _ => MODE_ON,
        })
    })
}

/// Which implementation an op takes for a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// A fused CPU kernel with its own backward (CPU, f32/f64).
    Kernel,
    /// The composition on detached inputs as one graph node that keeps only its inputs
    /// ([`crate::recompute`]): every other device and dtype (CUDA, bf16, f16).
    Recompute,
    /// The plain differentiable composition (every intermediate kept for backward).
    Composed,
}

/// Whether fused ops are used (default yes; `GRPO_FUSED=0` in the environment or
/// [`set_enabled`]`(false)` selects the plain compositions, e.g. to compare speed or memory).
pub fn enabled() -> bool {
    mode().load(Ordering::Relaxed) != MODE_OFF
}

/// Turns the fused ops on or off for the whole process.
pub fn set_enabled(on: bool) {
    mode().store(if on { MODE_ON } else { MODE_OFF }, Ordering::Relaxed);
}

/// Forces the device-generic [`Path::Recompute`] everywhere, CPU f32 included (what
/// `GRPO_FUSED=recompute` does): how the CPU tests and `grpo-cli check` run the GPU's path.
pub fn set_force_recompute(on: bool) {
    mode().store(if on { MODE_RECOMPUTE } else { MODE_ON }, Ordering::Relaxed);
}

/// The path an op on `t` takes: [`Path::Kernel`] on CPU f32/f64, [`Path::Recompute`] on other
/// devices and dtypes, [`Path::Composed`] when fused ops are off or while a recomputed block
/// runs its backward (its local graph lives for that block only).
pub fn path(t: &Tensor) -> Path {
    if !enabled() {
        Path::Composed
    } else if applies(t) {
        Path::Kernel
    } else if crate::recompute::in_recompute() {
        Path::Composed
    } else {
        Path::Recompute
    }
}

/// The ops that have a CUDA kernel of ours, by the names `GRPO_CUDA_KERNELS` and the
/// first-use self-check ([`crate::selfcheck`]) use.
pub const CUDA_OPS: [&str; 12] = [
    "rms_norm",
    "rope",
    "silu_mul",
    "attention_softmax",
    "attention",
    "flash_attention",
    "add_rms_norm",
    "kv_write",
    "cached_attention",
    "sample",
    "log_softmax_gather",
    "entropy",
];

/// What `GRPO_CUDA_KERNELS` says about our CUDA kernels: `(all off, ops switched off)`.
/// Unset or empty: all on. `0` / `false`: all off (the candle compositions run). A
/// comma-separated list of op names each prefixed with `-` switches those ops off alone
/// (`-attention,-sample`), to tell which kernel a problem on a GPU comes from. Op names:
/// [`CUDA_OPS`]. Anything else is an error naming the value.
pub fn parse_kernel_switch(v: &str) -> std::result::Result<(bool, Vec<String>), String> {
    let v = v.trim();
    match v {
        "" | "1" | "true" => return Ok((false, Vec::new())),
        "0" | "false" => return Ok((true, Vec::new())),
        _ => {}
    }
    let mut off = Vec::new();
    for item in v.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        match item.strip_prefix('-') {
            Some(op) if CUDA_OPS.contains(&op) => off.push(op.to_string()),
            _ => {
                return Err(format!(
                    "GRPO_CUDA_KERNELS={v}: `{item}` is not `-OP` with OP one of {}",
                    CUDA_OPS.join(", ")
                ));
            }
        }
    }
    Ok((false, off))
}

/// `GRPO_CUDA_KERNELS`, parsed once (a value [`parse_kernel_switch`] refuses is said once on
/// stderr and switches every kernel off).
fn env_switch() -> &'static (bool, Vec<String>) {
    static SWITCH: OnceLock<(bool, Vec<String>)> = OnceLock::new();
    SWITCH.get_or_init(|| {
        let v = std::env::var("GRPO_CUDA_KERNELS").unwrap_or_default();
        parse_kernel_switch(&v).unwrap_or_else(|e| {
            eprintln!("grpo: {e}; running the candle compositions instead");
            (true, Vec::new())
        })
    })
}

/// Whether `GRPO_CUDA_KERNELS` switches every CUDA kernel off.
pub fn cuda_kernels_off() -> bool {
    env_switch().0
}

/// (op, dtype) pairs switched off while the process runs ([`switch_off_cuda_op`]).
fn switched() -> &'static Mutex<Vec<(&'static str, DType)>> {
    static OFF: OnceLock<Mutex<Vec<(&'static str, DType)>>> = OnceLock::new();
    OFF.get_or_init(|| Mutex::new(Vec::new()))
}

/// Set once anything is in [`switched`]: the common case reads one atomic.
static ANY_SWITCHED: AtomicBool = AtomicBool::new(false);

/// Switches the CUDA kernel of `op` off for tensors of `dtype` for the rest of the process
/// (the op runs its composition): what the first-use self-check does with a kernel that
/// disagrees with its composition on the GPU found. An `op` outside [`CUDA_OPS`] is ignored.
pub fn switch_off_cuda_op(op: &str, dtype: DType) {
    let Some(&name) = CUDA_OPS.iter().find(|o| **o == op) else {
        return;
    };
    let mut off = switched().lock().unwrap_or_else(|e| e.into_inner());
    if !off.contains(&(name, dtype)) {
        off.push((name, dtype));
    }
    ANY_SWITCHED.store(true, Ordering::Release);
}

/// The (op, dtype) pairs [`switch_off_cuda_op`] switched off, in the order it did.
pub fn switched_off_cuda_ops() -> Vec<(&'static str, DType)> {
    switched().lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Whether our CUDA kernel of `op` may run on tensors of `dtype`: neither `GRPO_CUDA_KERNELS`
/// ([`parse_kernel_switch`]) nor [`switch_off_cuda_op`] switched it off.
pub fn cuda_op_on(op: &str, dtype: DType) -> bool {
    let (all_off, off) = env_switch();
    let switched_off = || {
        ANY_SWITCHED.load(Ordering::Acquire)
            && switched()
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .any(|(o, d)| *o == op && *d == dtype)
    };
    !*all_off && !off.iter().any(|o| o == op) && !switched_off()
}

/// The path of the head's ops (log-softmax + gather, entropy: `op`) on a chunk of logits `t`:
/// [`path`], except that on a CUDA device whose kernels are available (`cuda::HEAD`)
/// they take the CUDA kernels where the CPU takes its own (`u32_ids`: the targets are u32 ids,
/// what the gather kernel reads; entropy passes `true`).
pub fn head_path(op: &str, t: &Tensor, u32_ids: bool) -> Path {
    match path(t) {
        Path::Recompute if u32_ids && kernels_on() && head_on_device(op, t) => Path::Kernel,
        p => p,
    }
}

/// Whether the head's CUDA kernel of `op` takes `t`: on, available, and (at the first ask for
/// this GPU and dtype) found equal to the composition by the self-check.
#[cfg(feature = "cuda")]
fn head_on_device(op: &str, t: &Tensor) -> bool {
    let dt = t.dtype();
    cuda_op_on(op, dt) && crate::cuda::takes(&crate::cuda::HEAD, t) && {
        crate::selfcheck::guard("grpo_head", t.device(), dt, crate::logprobs::head_findings);
        cuda_op_on(op, dt)
    }
}

#[cfg(not(feature = "cuda"))]
fn head_on_device(_: &str, _: &Tensor) -> bool {
    false
}

/// True when fused kernels are on and not forced to the recompute path: what a device's own
/// kernels (grpo-rollout's CUDA kernels) check before they take an op.
pub fn kernels_on() -> bool {
    mode().load(Ordering::Relaxed) == MODE_ON
}

/// True when a fused CPU kernel can take `t`: fused ops on (not forced to recompute), CPU, f32
/// or f64.
pub fn applies(t: &Tensor) -> bool {
    mode().load(Ordering::Relaxed) == MODE_ON
        && t.device().is_cpu()
        && matches!(t.dtype(), DType::F32 | DType::F64)
}

/// The element types the kernels are written for (f32 and f64).
pub trait Float: WithDType + num_traits::Float + Send + Sync + std::iter::Sum {}
impl Float for f32 {}
impl Float for f64 {}

/// The contiguous elements of a CPU storage under `layout` (an error names `op` otherwise).
pub fn slice<'a, T: WithDType>(s: &'a CpuStorage, l: &Layout, op: &str) -> Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&s.as_slice::<T>()?[a..b]),
        None => candle_core::bail!("{op}: input must be contiguous"),
    }
}

/// Converts an `f64` constant to `T`.
pub fn cst<T: Float>(v: f64) -> T {
    T::from_f64(v)
}

/// The larger of two values (NaN-ignoring, as `f32::max`).
pub fn fmax<T: Float>(a: T, b: T) -> T {
    num_traits::Float::max(a, b)
}

/// Rows per rayon task: enough work per task that scheduling stays negligible.
pub fn min_rows(row_len: usize) -> usize {
    (4096 / row_len.max(1)).max(1)
}

/// Rows per block for reductions across rows (fixed, so the summation order is too).
pub const REDUCE_BLOCK_ROWS: usize = 64;

/// `(Δlogits)` of the `log_softmax + gather` kernel: `g·(onehot(t) − softmax(x))` per row.
#[derive(Debug, Clone, Copy)]
struct LogSoftmaxGather;

/// Backward of [`LogSoftmaxGather`]: inputs `(logits (N, V), targets (N), grad (N))`.
#[derive(Debug, Clone, Copy)]
struct LogSoftmaxGatherBwd;

/// Entropy of the softmax per row.
#[derive(Debug, Clone, Copy)]
struct Entropy;

/// Backward of [`Entropy`]: inputs `(logits (N, V), grad (N))`.
#[derive(Debug, Clone, Copy)]
struct EntropyBwd;

fn target_ids(s: &CpuStorage, l: &Layout) -> Result<Vec<usize>> {
    Ok(match s.dtype() {
        DType::U32 => slice::<u32>(s, l, "targets")?
            .iter()
            .map(|&t| t as usize)
            .collect(),
        DType::I64 => slice::<i64>(s, l, "targets")?
            .iter()
            .map(|&t| t.max(0) as usize)
            .collect(),
        DType::U8 => slice::<u8>(s, l, "targets")?
            .iter()
            .map(|&t| t as usize)
            .collect(),
        d => candle_core::bail!("targets must be integer token ids, got {d:?}"),
    })
}

/// `(max, log Σ exp(x − max))` of a row.
fn max_lse<T: Float>(row: &[T]) -> (T, T) {
    let m = row.iter().copied().fold(T::neg_infinity(), fmax);
    let s: T = row.iter().map(|&v| (v - m).exp()).sum();
    (m, s.ln())
}

fn two_dims(l: &Layout, op: &str) -> Result<(usize, usize)> {
    match l.dims() {
        [n, v] => Ok((*n, *v)),
        d => candle_core::bail!("{op}: expected (rows, vocab), got {d:?}"),
    }
}

/// Calls `$f::<f32>(args)` or `$f::<f64>(args)` by `$dtype`; any other dtype is an error
/// naming the op `$op`. Shared by the fused kernels here and in grpo-rollout.
#[macro_export]
macro_rules! float_dispatch {
    ($dtype:expr, $op:expr, $f:ident ( $($arg:expr),* )) => {
        match $dtype {
            candle_core::DType::F32 => $f::<f32>($($arg),*),
            candle_core::DType::F64 => $f::<f64>($($arg),*),
            d => candle_core::bail!("{}: fused kernel needs f32 or f64, got {d:?}", $op),
        }
    };
}

fn lsg_fwd<T: Float>(
    x: &CpuStorage,
    lx: &Layout,
    t: &CpuStorage,
    lt: &Layout,
) -> Result<(CpuStorage, candle_core::Shape)> {
    let (n, v) = two_dims(lx, "log_softmax_gather")?;
    let x = slice::<T>(x, lx, "log_softmax_gather")?;
    let ids = target_ids(t, lt)?;
    if ids.len() != n {
        candle_core::bail!("log_softmax_gather: {} targets for {n} rows", ids.len());
    }
    if let Some(&bad) = ids.iter().find(|&&i| i >= v) {
        candle_core::bail!("log_softmax_gather: target id {bad} out of range for vocab {v}");
    }
    let out: Vec<T> = x
        .par_chunks(v)
        .zip(ids.par_iter())
        .with_min_len(min_rows(v))
        .map(|(row, &id)| {
            let (m, lse) = max_lse(row);
            row[id] - m - lse
        })
        .collect();
    Ok((T::to_cpu_storage_owned(out), n.into()))
}

fn lsg_bwd<T: Float>(
    x: &CpuStorage,
    lx: &Layout,
    t: &CpuStorage,
    lt: &Layout,
    g: &CpuStorage,
    lg: &Layout,
) -> Result<(CpuStorage, candle_core::Shape)> {
    let (n, v) = two_dims(lx, "log_softmax_gather_bwd")?;
    let x = slice::<T>(x, lx, "log_softmax_gather_bwd")?;
    let ids = target_ids(t, lt)?;
    let g = slice::<T>(g, lg, "log_softmax_gather_bwd")?;
    let mut out = vec![T::zero(); n * v];
    out.par_chunks_mut(v)
        .zip(x.par_chunks(v))
        .zip(ids.par_iter().zip(g.par_iter()))
        .with_min_len(min_rows(v))
        .for_each(|((o, row), (&id, &gr))| {
            let (m, lse) = max_lse(row);
            let shift = m + lse;
            for (o, &xv) in o.iter_mut().zip(row) {
                *o = -gr * (xv - shift).exp();
            }
            o[id] += gr;
        });
    Ok((T::to_cpu_storage_owned(out), (n, v).into()))
}

fn ent_fwd<T: Float>(x: &CpuStorage, lx: &Layout) -> Result<(CpuStorage, candle_core::Shape)> {
    let (n, v) = two_dims(lx, "entropy")?;
    let x = slice::<T>(x, lx, "entropy")?;
    let out: Vec<T> = x
        .par_chunks(v)
        .with_min_len(min_rows(v))
        .map(|row| {
            let (m, lse) = max_lse(row);
            // H = lse' − Σ p·(x − m) with lse' = log Σ exp(x − m).
            let px: T = row
                .iter()
                .map(|&xv| {
                    let s = xv - m;
                    (s - lse).exp() * s
                })
                .sum();
            lse - px
        })
        .collect();
    Ok((T::to_cpu_storage_owned(out), n.into()))
}

fn ent_bwd<T: Float>(
    x: &CpuStorage,
    lx: &Layout,
    g: &CpuStorage,
    lg: &Layout,
) -> Result<(CpuStorage, candle_core::Shape)> {
    let (n, v) = two_dims(lx, "entropy_bwd")?;
    let x = slice::<T>(x, lx, "entropy_bwd")?;
    let g = slice::<T>(g, lg, "entropy_bwd")?;
    let mut out = vec![T::zero(); n * v];
    out.par_chunks_mut(v)
        .zip(x.par_chunks(v))
        .zip(g.par_iter())
        .with_min_len(min_rows(v))
        .for_each(|((o, row), &gr)| {
            let (m, lse) = max_lse(row);
            // log p_j = x_j − m − lse; H = −Σ p log p; dH/dx_j = −p_j (log p_j + H).
            let mut h = T::zero();
            for (o, &xv) in o.iter_mut().zip(row) {
                let lp = xv - m - lse;
                *o = lp;
                h -= lp.exp() * lp;
            }
            for o in o.iter_mut() {
                let lp = *o;
                *o = -gr * lp.exp() * (lp + h);
            }
        });
    Ok((T::to_cpu_storage_owned(out), (n, v).into()))
}

impl candle_core::CustomOp2 for LogSoftmaxGather {
    fn name(&self) -> &'static str {
        "log_softmax_gather"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, candle_core::Shape)> {
        float_dispatch!(s1.dtype(), self.name(), lsg_fwd(s1, l1, s2, l2))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
        crate::cuda::lsg_fwd(s1, l1, s2, l2)
    }
    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        if !logits.track_op() {
            return Ok((None, None));
        }
        let d = logits.apply_op3_no_bwd(targets, &grad.contiguous()?, &LogSoftmaxGatherBwd)?;
        Ok((Some(d), None))
    }
}

impl candle_core::CustomOp3 for LogSoftmaxGatherBwd {
    fn name(&self) -> &'static str {
        "log_softmax_gather_bwd"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, candle_core::Shape)> {
        float_dispatch!(s1.dtype(), self.name(), lsg_bwd(s1, l1, s2, l2, s3, l3))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
        crate::cuda::lsg_bwd(s1, l1, s2, l2, s3, l3)
    }
}

impl candle_core::CustomOp1 for Entropy {
    fn name(&self) -> &'static str {
        "entropy"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, candle_core::Shape)> {
        float_dispatch!(s.dtype(), self.name(), ent_fwd(s, l))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
        crate::cuda::ent_fwd(s, l)
    }
    fn bwd(&self, logits: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        if !logits.track_op() {
            return Ok(None);
        }
        Ok(Some(
            logits.apply_op2_no_bwd(&grad.contiguous()?, &EntropyBwd)?,
        ))
    }
}

impl candle_core::CustomOp2 for EntropyBwd {
    fn name(&self) -> &'static str {
        "entropy_bwd"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, candle_core::Shape)> {
        float_dispatch!(s1.dtype(), self.name(), ent_bwd(s1, l1, s2, l2))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
        crate::cuda::ent_bwd(s1, l1, s2, l2)
    }
}

/// Fused `log_softmax(x)[t]` of `(N, V)` f32/f64 CPU logits and `(N,)` ids → `(N,)`, with a
/// backward to the logits. Callers check [`applies`] first.
pub fn log_softmax_gather(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    logits
        .contiguous()?
        .apply_op2(&targets.contiguous()?, LogSoftmaxGather)
}

/// Fused entropy of the softmax of `(N, V)` f32/f64 CPU logits → `(N,)`, with a backward.
pub fn entropy(logits: &Tensor) -> Result<Tensor> {
    logits.contiguous()?.apply_op1(Entropy)
}

#[cfg(test)]
mod switch_tests {
    use super::parse_kernel_switch;

    #[test]
    fn the_cuda_kernel_switch_reads_all_none_or_some() {
        assert_eq!(parse_kernel_switch(""), Ok((false, vec![])));
        assert_eq!(parse_kernel_switch("1"), Ok((false, vec![])));
        assert_eq!(parse_kernel_switch("0"), Ok((true, vec![])));
        assert_eq!(parse_kernel_switch("false"), Ok((true, vec![])));
        assert_eq!(
            parse_kernel_switch(" -attention, -sample "),
            Ok((false, vec!["attention".to_string(), "sample".to_string()]))
        );
        let e = parse_kernel_switch("-attention,rope").unwrap_err();
        assert!(
            e.starts_with("GRPO_CUDA_KERNELS=-attention,rope: `rope` is not `-OP`"),
            "{e}"
        );
        assert!(parse_kernel_switch("-flash").is_err());
        assert_eq!(
            parse_kernel_switch("-flash_attention"),
            Ok((false, vec!["flash_attention".to_string()]))
        );
    }
}
