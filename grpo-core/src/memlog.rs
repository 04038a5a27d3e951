//! `GRPO_MEMLOG=1`: one line on stderr per phase of a run with the memory in use — on a GPU
//! the device's (`cuMemGetInfo`: total − free, what nvidia-smi shows, after a synchronisation),
//! on the CPU the process's resident set — so that a run shows where its peak comes from: the
//! loaded policy, the reference, the decoding copy, a generation, each micro-batch's forward
//! (its graph alive) and backward (its gradients), the optimizer update. On a GPU each line also
//! gives the allocation pool's peak of live tensors since the previous line, and its reserve.

use std::sync::OnceLock;

use candle_core::Device;

const MIB: f64 = 1024.0 * 1024.0;

/// Whether `GRPO_MEMLOG` is set to something other than `0` (read once).
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("GRPO_MEMLOG").is_ok_and(|v| !v.is_empty() && v != "0" && v != "false")
    })
}

/// Memory in use, MiB: the whole GPU's for a CUDA device (after waiting for its stream), the
/// process's resident set on the CPU; `None` where it cannot be read.
pub fn used_mib(dev: &Device) -> Option<f64> {
    match dev {
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => {
            dev.synchronize().ok()?;
            let (free, total) = d.cuda_stream().context().mem_get_info().ok()?;
            Some(total.saturating_sub(free) as f64 / MIB)
        }
        Device::Cpu => {
            let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
            let pages: f64 = statm.split_whitespace().nth(1)?.parse().ok()?;
            Some(pages * 4096.0 / MIB)
        }
        #[allow(unreachable_patterns)]
        _ => None,
    }
}

/// Prints `memlog <MiB> <phase>` when [`enabled`]; on a GPU also the allocation pool's bytes
/// in use now and at most since the previous line (the phase's peak of live tensors), and
/// what the pool reserved (now, at most).
pub fn log(phase: &str, dev: &Device) {
    if !enabled() {
        return;
    }
    let Some(m) = used_mib(dev) else { return };
    let pool = pool_line(dev);
    eprintln!("memlog {m:>9.0} MiB  {phase}{pool}");
}

/// Where a phase of a run ends (a generation, an optimizer step) or a large buffer was just
/// replaced (a decode batch's KV cache after finished rows left it): on a GPU the allocation
/// pool gives its unused memory back to the driver, so the next phase's peak does not sit on
/// this one's free blocks (the pool keeps them across a phase's own synchronisations:
/// `grpo_core::cuda::keep_pool_across_syncs`). Nothing on the CPU.
pub fn release_unused(dev: &Device) {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = dev {
        crate::cuda::trim_pool(d);
    }
    let _ = dev;
}

/// On a GPU, the allocation pool's peaks since the previous call (this one or [`log`]'s),
/// MiB: `(live tensors at most, reserved at most)`; `None` on the CPU.
pub fn pool_peaks_mib(dev: &Device) -> Option<(f64, f64)> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = dev {
        let [_, used_hi, _, res_hi] = crate::cuda::pool_usage(d)?;
        return Some((used_hi as f64 / MIB, res_hi as f64 / MIB));
    }
    let _ = dev;
    None
}

#[cfg(feature = "cuda")]
fn pool_line(dev: &Device) -> String {
    match dev {
        Device::Cuda(d) => match crate::cuda::pool_usage(d) {
            Some([used, used_hi, res, res_hi]) => format!(
                "  (pool: in use {:.0}, peak {:.0}; reserved {:.0}, peak {:.0} MiB)",
                used as f64 / MIB,
                used_hi as f64 / MIB,
                res as f64 / MIB,
                res_hi as f64 / MIB
            ),
            None => String::new(),
        },
        _ => String::new(),
    }
}

#[cfg(not(feature = "cuda"))]
fn pool_line(_: &Device) -> String {
    String::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_reading_follows_an_allocation() {
        let before = used_mib(&Device::Cpu).unwrap();
        let big = vec![1u8; 256 << 20];
        let after = used_mib(&Device::Cpu).unwrap();
        assert!(after - before > 200.0, "{before} → {after}");
        drop(big);
    }
}
