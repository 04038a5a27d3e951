//! The first-use self-check of our CUDA kernels.
//!
//! A kernel set (the head's here, the decoder's and flash attention in grpo-rollout) is run once
//! per GPU and dtype, at the first op that would take it, on small inputs against its candle
//! composition — values and gradients. An op whose kernel disagrees (or fails to launch) is
//! switched off for that dtype ([`crate::fused::switch_off_cuda_op`]) with one line on stderr,
//! and runs its composition from then on: a kernel that is wrong on some GPU costs speed, never
//! a run's results. `grpo-cli check --device cuda` reports the kernels as they are, with this
//! check off ([`set_enabled`]). `GRPO_CUDA_SELFCHECK=0` skips it.
//!
//! The checks are ordinary device-generic code: on the CPU they compare the CPU kernels with
//! the same compositions, which is how the tests run them.

use std::cell::{Cell, RefCell};
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

use candle_core::{DType, Device, Result, Tensor, Var};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};

/// One comparison of a kernel with its composition.
#[derive(Debug, Clone)]
pub struct Finding {
    /// What was compared (for messages and `grpo-cli check`'s table).
    pub what: String,
    /// The ops whose kernels the comparison ran (switched off when it fails).
    pub ops: &'static [&'static str],
    /// The largest difference relative to the reference's size, or why it could not be
    /// measured (a launch that failed).
    pub diff: std::result::Result<f64, String>,
    /// The largest allowed [`Finding::diff`].
    pub limit: f64,
}

impl Finding {
    /// A finding from a comparison's result, allowed [`tolerance`]`(dtype)`.
    pub fn new(
        what: impl Into<String>,
        ops: &'static [&'static str],
        dtype: DType,
        diff: Result<f64>,
    ) -> Self {
        Self {
            what: what.into(),
            ops,
            diff: diff.map_err(|e| e.to_string().lines().next().unwrap_or("").to_string()),
            limit: tolerance(dtype),
        }
    }

    /// Whether the kernel agreed (a NaN difference does not).
    pub fn ok(&self) -> bool {
        matches!(self.diff, Ok(d) if d <= self.limit)
    }
}

/// The difference allowed between a kernel and its composition: 1e-4 in f32 and f64, 2e-2 in
/// bf16 and f16 (the precision `grpo-cli check` holds the device to).
pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 | DType::F64 => 1e-4,
        _ => 2e-2,
    }
}

/// The largest absolute difference of `got` from `want` over the largest magnitude in `want`
/// (at least 1); NaN when either holds a NaN (a reduction's `max` would pass over it).
pub fn rel_diff(want: &Tensor, got: &Tensor) -> Result<f64> {
    let a = want.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
    let b = got.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
    let diff: Vec<f64> = (&a - &b)?.abs()?.flatten_all()?.to_vec1()?;
    let size: Vec<f64> = a.abs()?.flatten_all()?.to_vec1()?;
    let worst = diff.into_iter().fold(0.0, worse);
    let size = size.into_iter().fold(1.0, worse);
    Ok(worst / size)
}

/// The larger of two differences; NaN when either is (`f64::max` would drop a NaN).
pub fn worse(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.max(b)
    }
}

/// `f` on `inputs` (each a fresh variable) with the loss `Σ f(x)·dout`: the output and each
/// input's gradient, in input order.
pub fn value_and_grads(
    inputs: &[Tensor],
    dout: &Tensor,
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
) -> Result<Vec<Tensor>> {
    let vars = inputs
        .iter()
        .map(Var::from_tensor)
        .collect::<Result<Vec<_>>>()?;
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&ts)?;
    let grads = (&y * dout.to_dtype(y.dtype())?.to_device(y.device())?)?
        .sum_all()?
        .backward()?;
    let mut out = vec![y];
    for v in &vars {
        out.push(
            grads
                .get(v.as_tensor())
                .cloned()
                .ok_or_else(|| candle_core::Error::msg("no gradient reached an input"))?,
        );
    }
    Ok(out)
}

/// The worst [`rel_diff`] of two lists of tensors, pairwise.
pub fn rel_diff_all(want: &[Tensor], got: &[Tensor]) -> Result<f64> {
    if want.len() != got.len() {
        candle_core::bail!("{} results against {}", got.len(), want.len());
    }
    want.iter()
        .zip(got)
        .try_fold(0.0, |w, (a, b)| Ok(worse(w, rel_diff(a, b)?)))
}

thread_local! {
    /// The checks' draws: seeded, so a check's inputs are the same on every run and machine (an
    /// unlucky draw must not switch a sound kernel off, nor fail `grpo-cli check` now and then).
    static DRAWS: RefCell<ChaCha8Rng> = RefCell::new(ChaCha8Rng::seed_from_u64(SEED));
}

const SEED: u64 = 0x6772_706f;

/// Restarts this thread's draws for [`randn`] from the fixed seed: a check set calls it first,
/// so its inputs do not depend on what ran before it on the thread.
pub fn reseed() {
    DRAWS.with(|r| *r.borrow_mut() = ChaCha8Rng::seed_from_u64(SEED));
}

/// Standard normal values of `shape` in `dtype` on `device`, drawn on the CPU from this
/// thread's seeded generator (see [`reseed`]).
pub fn randn(shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
    let n = shape.iter().product();
    let v: Vec<f32> = DRAWS.with(|r| {
        let mut r = r.borrow_mut();
        (0..n).map(|_| StandardNormal.sample(&mut *r)).collect()
    });
    Tensor::from_vec(v, shape, &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(device)
}

fn switch() -> &'static AtomicBool {
    static ON: OnceLock<AtomicBool> = OnceLock::new();
    ON.get_or_init(|| AtomicBool::new(std::env::var("GRPO_CUDA_SELFCHECK").as_deref() != Ok("0")))
}

/// Whether [`guard`] checks kernel sets (default yes; `GRPO_CUDA_SELFCHECK=0` or
/// `set_enabled(false)` skips it).
pub fn enabled() -> bool {
    switch().load(Ordering::Relaxed)
}

/// Turns the first-use self-check on or off for the whole process (`grpo-cli check` turns it
/// off to report the kernels themselves).
pub fn set_enabled(on: bool) {
    switch().store(on, Ordering::Relaxed);
}

thread_local! {
    /// Set while this thread runs a self-check: the ops it calls take their kernels unchecked.
    static CHECKING: Cell<bool> = const { Cell::new(false) };
}

/// (set, device, dtype) already checked.
type Checked = HashSet<(&'static str, String, DType)>;

/// Runs `findings` for the kernel set `set` on `device` in `dtype` unless that was done
/// already in this process (or the check is off, or this thread is inside a check); switches
/// off the ops of every finding that fails and says so on stderr. Other threads asking for the
/// same set wait until it is done.
pub fn guard(
    set: &'static str,
    device: &Device,
    dtype: DType,
    findings: fn(&Device, DType) -> Vec<Finding>,
) {
    if !enabled() || CHECKING.with(Cell::get) {
        return;
    }
    static DONE: OnceLock<Mutex<Checked>> = OnceLock::new();
    let mut done = DONE
        .get_or_init(|| Mutex::new(HashSet::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if !done.insert((set, format!("{:?}", device.location()), dtype)) {
        return;
    }
    CHECKING.with(|c| c.set(true));
    let found = findings(device, dtype);
    CHECKING.with(|c| c.set(false));
    drop(done);
    for line in apply(&found, dtype) {
        eprintln!("{line}");
    }
}

/// Switches off the ops of each failing finding for `dtype`; one line per failure, naming
/// the op, the difference and the way out.
pub fn apply(findings: &[Finding], dtype: DType) -> Vec<String> {
    let mut lines = Vec::new();
    for f in findings.iter().filter(|f| !f.ok()) {
        for op in f.ops {
            crate::fused::switch_off_cuda_op(op, dtype);
        }
        let why = match &f.diff {
            Ok(d) => format!(
                "differs from its composition by {d:.2e} (limit {:.0e})",
                f.limit
            ),
            Err(e) => format!("failed: {e}"),
        };
        lines.push(format!(
            "grpo: our CUDA kernel for {} ({dtype:?}, {}) {why}; running the composition \
             instead (grpo-cli check --device cuda shows every kernel)",
            f.ops.join(", "),
            f.what,
        ));
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    fn findings(_: &Device, dtype: DType) -> Vec<Finding> {
        vec![
            Finding::new("good", &["rope"], dtype, Ok(1e-7)),
            Finding::new("off by a lot", &["rms_norm"], dtype, Ok(0.5)),
            Finding::new("nan", &["silu_mul"], dtype, Ok(f64::NAN)),
            Finding::new(
                "launch",
                &["kv_write"],
                dtype,
                Err(candle_core::Error::msg(
                    "too many resources requested\nmore",
                )),
            ),
        ]
    }

    #[test]
    fn failing_findings_switch_their_ops_off_for_their_dtype_only() {
        let lines = apply(&findings(&Device::Cpu, DType::F16), DType::F16);
        assert_eq!(lines.len(), 3, "{lines:?}");
        assert!(lines[0].contains("rms_norm") && lines[0].contains("5.00e-1"));
        assert!(lines[1].contains("silu_mul") && lines[1].contains("NaN"));
        assert!(lines[2].ends_with("shows every kernel)") && lines[2].contains("too many"));
        assert!(!lines[2].contains("more"));
        use crate::fused::cuda_op_on;
        for op in ["rms_norm", "silu_mul", "kv_write"] {
            assert!(!cuda_op_on(op, DType::F16), "{op}");
            assert!(cuda_op_on(op, DType::BF16), "{op}");
        }
        assert!(cuda_op_on("rope", DType::F16));
        let off = crate::fused::switched_off_cuda_ops();
        assert!(off.contains(&("kv_write", DType::F16)));
    }

    #[test]
    fn guard_checks_a_set_once_per_device_and_dtype_and_not_from_inside() {
        use std::sync::atomic::AtomicUsize;
        static RUNS: AtomicUsize = AtomicUsize::new(0);
        fn counting(device: &Device, dtype: DType) -> Vec<Finding> {
            RUNS.fetch_add(1, Ordering::SeqCst);
            // A nested ask from inside the check does not run it again (nor deadlock).
            guard("test_set", device, dtype, counting);
            vec![Finding::new("fine", &["entropy"], dtype, Ok(0.0))]
        }
        guard("test_set", &Device::Cpu, DType::F64, counting);
        guard("test_set", &Device::Cpu, DType::F64, counting);
        assert_eq!(RUNS.load(Ordering::SeqCst), 1);
        guard("test_set", &Device::Cpu, DType::U8, counting);
        assert_eq!(RUNS.load(Ordering::SeqCst), 2);
        assert!(crate::fused::cuda_op_on("entropy", DType::F64));
    }

    /// The checks' inputs are the same whatever ran before on the thread: a check's outcome
    /// must not depend on a draw.
    #[test]
    fn draws_restart_from_the_seed() -> Result<()> {
        reseed();
        let a = randn(&[3, 5], DType::F32, &Device::Cpu)?;
        let b = randn(&[3, 5], DType::F32, &Device::Cpu)?;
        reseed();
        let c = randn(&[3, 5], DType::F32, &Device::Cpu)?;
        assert_eq!(rel_diff(&a, &c)?, 0.0);
        assert!(rel_diff(&a, &b)? > 0.1);
        // Standard normal: mean near 0 and variance near 1 over many draws.
        let v: Vec<f32> = randn(&[20_000], DType::F32, &Device::Cpu)?.to_vec1()?;
        let mean = v.iter().sum::<f32>() / v.len() as f32;
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / v.len() as f32;
        assert!(
            mean.abs() < 0.03 && (var - 1.0).abs() < 0.05,
            "{mean} {var}"
        );
        Ok(())
    }

    #[test]
    fn rel_diff_is_relative_and_sees_nan() -> Result<()> {
        let d = &Device::Cpu;
        let a = Tensor::new(&[4f32, -2.0], d)?;
        let b = Tensor::new(&[4.5f32, -2.0], d)?;
        assert!((rel_diff(&a, &b)? - 0.125).abs() < 1e-12);
        let small = Tensor::new(&[0.1f32], d)?;
        assert!((rel_diff(&small, &Tensor::new(&[0.3f32], d)?)? - 0.2).abs() < 1e-6);
        let nan = Tensor::new(&[f32::NAN, 1.0], d)?;
        assert!(rel_diff(&nan, &nan)?.is_nan());
        assert!(!Finding::new("x", &[], DType::F32, rel_diff(&nan, &a)).ok());
        Ok(())
    }
}
