//! `GRPO_MEMLOG=1`: one line on stderr per phase of a run with the memory in use — on a GPU
//! the device's (`cuMemGetInfo`: total − free, what nvidia-smi shows, after a synchronisation),
//! on the CPU the process's resident set — so that a run shows where its peak comes from: the
//! loaded policy, the reference, the decoding copy, a generation, each micro-batch's forward
//! (its graph alive) and backward (its gradients), the optimizer update.

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

/// Prints `memlog <MiB> <phase>` when [`enabled`].
pub fn log(phase: &str, dev: &Device) {
    if enabled()
        && let Some(m) = used_mib(dev)
    {
        eprintln!("memlog {m:>9.0} MiB  {phase}");
    }
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
