//! candle's f32 CPU matmul rate (GFLOP/s) on the shapes our models run: decode (32 rows), the
//! training forward (32 × 80 rows) and a square reference. Compare with
//! `python -c` torch on the same shapes (printed command) to see how far candle's `gemm` is from
//! the machine's BLAS.
//!
//!     cargo run --release -p grpo-tests --example matmul_bench
#![allow(clippy::unwrap_used, missing_docs)]

use std::time::Instant;

use candle_core::{DType, Device, Tensor};

fn main() {
    let dev = Device::Cpu;
    let shapes: &[(usize, usize, usize, &str)] = &[
        (32, 256, 8192, "tiny decode, output head"),
        (32, 256, 768, "tiny decode, MLP up"),
        (32, 512, 1536, "small decode, MLP up"),
        (2560, 256, 768, "tiny train, MLP up"),
        (2560, 512, 1536, "small train, MLP up"),
        (1024, 1024, 1024, "square"),
    ];
    for &(m, k, n, what) in shapes {
        let a = Tensor::randn(0f32, 1.0, (m, k), &dev).unwrap();
        let b = Tensor::randn(0f32, 1.0, (k, n), &dev).unwrap();
        let flops = 2.0 * (m * k * n) as f64;
        let reps = ((2e9 / flops) as usize).clamp(3, 2000);
        let _ = a.matmul(&b).unwrap();
        let mut times = Vec::new();
        for _ in 0..5 {
            let t0 = Instant::now();
            for _ in 0..reps {
                let c = a.matmul(&b).unwrap();
                assert_eq!(c.dtype(), DType::F32);
            }
            times.push(t0.elapsed().as_secs_f64() / reps as f64);
        }
        times.sort_by(f64::total_cmp);
        println!(
            "{m:>5}x{k:<5}x{n:<6} {:>7.1} GFLOP/s  ({what})",
            flops / times[2] / 1e9
        );
    }
}
