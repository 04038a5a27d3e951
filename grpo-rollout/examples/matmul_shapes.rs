//! Times candle matmuls of the shapes one decoder layer runs (a profiling aid):
//! `cargo run --release -p grpo-rollout --example matmul_shapes`.
use std::time::Instant;

use candle_core::{Device, Result, Tensor};

fn time(name: &str, reps: usize, f: &dyn Fn() -> Result<Tensor>) -> Result<()> {
    f()?;
    let t = Instant::now();
    for _ in 0..reps {
        f()?;
    }
    let us = t.elapsed().as_secs_f64() / reps as f64 * 1e6;
    println!("{name:<48} {us:>10.1} us");
    Ok(())
}

fn main() -> Result<()> {
    let d = Device::Cpu;
    // Training: B=32, L=80, nh=4, nkv=2, hd=64, H=256, I=768.
    let x = Tensor::randn(0f32, 1.0, (2560, 256), &d)?;
    let w = Tensor::randn(0f32, 1.0, (768, 256), &d)?;
    time("linear 2560x256 -> 768", 50, &|| x.matmul(&w.t()?))?;
    let q = Tensor::randn(0f32, 1.0, (32, 2, 160, 64), &d)?;
    let k = Tensor::randn(0f32, 1.0, (32, 2, 80, 64), &d)?;
    time("attn scores (32,2,160,64)x(32,2,64,80)", 50, &|| {
        q.matmul(&k.t()?)
    })?;
    let p = Tensor::randn(0f32, 1.0, (32, 2, 160, 80), &d)?;
    time("attn ctx (32,2,160,80)x(32,2,80,64)", 50, &|| p.matmul(&k))?;
    // Decode: 32 rows, S=50.
    let xd = Tensor::randn(0f32, 1.0, (32, 256), &d)?;
    time("decode linear 32x256 -> 768", 500, &|| xd.matmul(&w.t()?))?;
    let wt = w.t()?.contiguous()?;
    time("decode linear 32x256 -> 768 (W^T contiguous)", 500, &|| {
        xd.matmul(&wt)
    })?;
    let x1 = Tensor::randn(0f32, 1.0, (1, 256), &d)?;
    time("decode linear 1x256 -> 768", 500, &|| x1.matmul(&w.t()?))?;
    time("linear 2560x256 -> 768 (W^T contiguous)", 50, &|| {
        x.matmul(&wt)
    })?;
    let qd = Tensor::randn(0f32, 1.0, (32, 2, 2, 64), &d)?;
    let kd = Tensor::randn(0f32, 1.0, (32, 2, 50, 64), &d)?;
    time("decode scores (32,2,2,64)x(32,2,64,50)", 500, &|| {
        qd.matmul(&kd.t()?)
    })?;
    let e = Tensor::randn(0f32, 1.0, (2048, 256), &d)?;
    time("decode head 32x256 -> 2048", 500, &|| xd.matmul(&e.t()?))?;
    Ok(())
}
