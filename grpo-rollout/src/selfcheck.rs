//! The decoder's kernels against their compositions: what the first-use self-check
//! ([`grpo_core::selfcheck`]) runs once per GPU and dtype before the decoder's CUDA kernels
//! and flash attention serve any op, and what `grpo-cli check` prints.
//!
//! Each [`Finding`] names the ops whose kernels it ran; on a GPU those are our CUDA kernels,
//! on the CPU the CPU kernels (f32) or the recomputed compositions (bf16, f16) — the same
//! comparisons, which is how the tests run them.

use candle_core::{DType, Device, Result, Tensor};
use grpo_core::selfcheck::{Finding, randn, rel_diff, rel_diff_all, value_and_grads, worse};

use crate::fused;
use crate::generate::SamplingParams;

/// Every comparison, in the order `grpo-cli check` prints them.
pub fn findings(device: &Device, dtype: DType) -> Vec<Finding> {
    grpo_core::selfcheck::reseed();
    let d = device;
    let mut out = vec![
        Finding::new(
            "rms_norm vs composition, values and gradients",
            &["rms_norm"],
            dtype,
            rms_norm(d, dtype),
        ),
        Finding::new(
            "rope vs composition, values and gradients",
            &["rope"],
            dtype,
            rope(d, dtype),
        ),
        Finding::new(
            "SiLU·mul vs composition, values and gradients; of packed gate/up rows, and back",
            &["silu_mul"],
            dtype,
            silu_mul(d, dtype),
        ),
        Finding::new(
            "attention softmax vs composition, values and gradients",
            &["attention_softmax"],
            dtype,
            attention_softmax(d, dtype),
        ),
        Finding::new(
            "attention over a cache view (decode) vs composition",
            &["attention"],
            dtype,
            decode_attention(d, dtype),
        ),
    ];
    // Training lengths: the flash kernels where they run, else the recomputed composition
    // around the softmax kernel.
    let long_ops: &'static [&'static str] = if flash_runs(d, dtype) {
        &["flash_attention"]
    } else {
        &["attention_softmax"]
    };
    out.push(Finding::new(
        "attention at training lengths (flash kernels on CUDA bf16/f16), head dims 64 and 128, \
         plain and causal, values and gradients vs f32 composition",
        long_ops,
        dtype,
        long_attention(d, dtype),
    ));
    out.extend([
        Finding::new(
            "residual add + rms_norm (decode) vs composition",
            &["add_rms_norm"],
            dtype,
            add_rms_norm(d, dtype),
        ),
        Finding::new(
            "KV-cache writes, keys rotated (decode) vs composition",
            &["kv_write"],
            dtype,
            kv_write(d, dtype),
        ),
        Finding::new(
            "cache pass after packed q/k/v: bias, rope, cache writes, attention (decode) vs composition",
            &["cached_attention"],
            dtype,
            cached_attention(d, dtype),
        ),
    ]);
    let sampled = sampling(d, dtype);
    out.push(Finding {
        what: "sampling with every filter (kernel on CUDA) vs tensor-op sampler, tokens differing"
            .into(),
        ops: &["sample"],
        diff: sampled.map_err(|e| e.to_string().lines().next().unwrap_or("").to_string()),
        limit: 0.0,
    });
    out
}

/// Whether attention at training lengths takes the flash kernels on `d` in `dt`.
#[cfg(feature = "cuda")]
fn flash_runs(d: &Device, dt: DType) -> bool {
    matches!(dt, DType::BF16 | DType::F16) && grpo_core::cuda::available(&crate::flash::FLASH, d)
}

#[cfg(not(feature = "cuda"))]
fn flash_runs(_: &Device, _: DType) -> bool {
    false
}

/// The compositions' side: fused ops off would be a process-wide switch, so the reference
/// calls the `*_composed` functions directly.
fn rms_norm(d: &Device, dt: DType) -> Result<f64> {
    let x = randn(&[7, 96], dt, d)?;
    let w = (randn(&[96], dt, d)? + 1.0)?;
    let dout = randn(&[7, 96], DType::F32, d)?;
    let inputs = [x, w];
    let want = value_and_grads(&inputs, &dout, |t| {
        fused::rms_norm_composed(&t[0], &t[1], 1e-6)
    })?;
    let got = value_and_grads(&inputs, &dout, |t| fused::rms_norm(&t[0], &t[1], 1e-6))?;
    rel_diff_all(&want, &got)
}

fn rope(d: &Device, dt: DType) -> Result<f64> {
    let (b, l, nh, hd) = (2, 6, 4, 64);
    let ang = randn(&[b, l, hd / 2], DType::F32, d)?;
    let (cos, sin) = (ang.cos()?.to_dtype(dt)?, ang.sin()?.to_dtype(dt)?);
    let x = randn(&[b, l, nh, hd], dt, d)?;
    let y = fused::rope_composed(&x, &cos, &sin)?;
    let dout = randn(y.dims(), DType::F32, d)?;
    let want = value_and_grads(std::slice::from_ref(&x), &dout, |t| {
        fused::rope_composed(&t[0], &cos, &sin)
    })?;
    let got = value_and_grads(&[x], &dout, |t| fused::rope(&t[0], &cos, &sin))?;
    rel_diff_all(&want, &got)
}

fn silu_mul(d: &Device, dt: DType) -> Result<f64> {
    let (g, u) = (randn(&[9, 300], dt, d)?, randn(&[9, 300], dt, d)?);
    let dout = randn(&[9, 300], DType::F32, d)?;
    let inputs = [g, u];
    let want = value_and_grads(&inputs, &dout, |t| fused::silu_mul_composed(&t[0], &t[1]))?;
    let got = value_and_grads(&inputs, &dout, |t| fused::silu_mul(&t[0], &t[1]))?;
    let gu = Tensor::cat(&inputs, 1)?;
    let packed = fused::silu_mul_packed(&gu)?;
    // The backward over packed rows (the training MLP's node): [dgate | dup].
    let dpacked = fused::silu_mul_packed_backward(&gu, &dout.to_dtype(dt)?)?;
    let dwant = Tensor::cat(&[&want[1], &want[2]], 1)?;
    Ok(worse(
        worse(rel_diff_all(&want, &got)?, rel_diff(&want[0], &packed)?),
        rel_diff(&dwant, &dpacked)?,
    ))
}

/// A bias of `(b, 1, l, s)`: row r left-padded by r positions, causal over the last `l`.
fn decoder_bias(
    b: usize,
    l: usize,
    s: usize,
    masked: f32,
    d: &Device,
    dt: DType,
) -> Result<Tensor> {
    let bias: Vec<f32> = (0..b)
        .flat_map(|r| {
            (0..l).flat_map(move |i| {
                (0..s).map(move |j| if j < r || j > s - l + i { masked } else { 0.0 })
            })
        })
        .collect();
    Tensor::from_vec(bias, (b, 1, l, s), d)?.to_dtype(dt)
}

fn attention_softmax(d: &Device, dt: DType) -> Result<f64> {
    let (b, nh, l, s) = (2, 4, 6, 9);
    let bias = decoder_bias(b, l, s, -1e9, d, dt)?;
    let x = randn(&[b, nh, l, s], dt, d)?;
    let dout = randn(&[b, nh, l, s], DType::F32, d)?;
    let want = value_and_grads(std::slice::from_ref(&x), &dout, |t| {
        fused::attention_softmax_composed(&t[0], &bias, 0.35)
    })?;
    let got = value_and_grads(&[x], &dout, |t| {
        fused::attention_softmax(&t[0], &bias, 0.35)
    })?;
    rel_diff_all(&want, &got)
}

/// Attention as plain candle ops (k and v repeated per query head), `(b·l, nh·d)`.
fn attention_reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    bias: &Tensor,
    scale: f64,
) -> Result<Tensor> {
    let (b, nh, l, d) = q.dims4()?;
    let (_, nkv, s, _) = k.dims4()?;
    let rep = |t: &Tensor| -> Result<Tensor> {
        t.unsqueeze(2)?
            .expand((b, nkv, nh / nkv, s, d))?
            .reshape((b, nh, s, d))
    };
    let (k, v) = (rep(k)?, rep(v)?);
    let scores = q.contiguous()?.matmul(&k.t()?.contiguous()?)?;
    let p = fused::attention_softmax_composed(&scores, bias, scale)?;
    let ctx = p.matmul(&v.contiguous()?)?;
    ctx.transpose(1, 2)?.reshape((b * l, nh * d))
}

/// One query row per sequence over a strided view of a KV cache (a decode step, no graph).
fn decode_attention(d: &Device, dt: DType) -> Result<f64> {
    let (b, nh, nkv, hd, cap, s) = (3, 6, 2, 64, 40, 29);
    let q = randn(&[b, nh, 1, hd], dt, d)?;
    let kc = randn(&[b, nkv, cap, hd], dt, d)?;
    let vc = randn(&[b, nkv, cap, hd], dt, d)?;
    let (k, v) = (kc.narrow(2, 0, s)?, vc.narrow(2, 0, s)?);
    let bias = decoder_bias(b, 1, s, -1e9, d, dt)?;
    let scale = 1.0 / (hd as f64).sqrt();
    let want = attention_reference(&q, &k, &v, &bias, scale)?;
    let got = fused::attention(&q, &k, &v, &bias, scale)?;
    rel_diff(&want, &got)
}

/// Attention over 70 and 33 positions (partial tiles; grouped heads; causal, left-padded
/// rows) with a graph, as training runs it — on a GPU in bf16/f16 the flash kernels —
/// against the f32 reference on the CPU: the context and the q, k, v gradients. Rows with no
/// visible key (padding) are left out, their gradient zero as in the model: their values mean
/// nothing, and half precision's mask values make them differ.
fn long_attention(d: &Device, dt: DType) -> Result<f64> {
    let cpu = Device::Cpu;
    let masked = crate::model::attention_mask_value(dt) as f32;
    let mut worst = 0f64;
    for (b, nh, nkv, l, hd) in [(2, 4, 2, 70, 64), (2, 6, 2, 33, 128)] {
        // Row r's first 3·r positions are padding.
        let bias: Vec<f32> = (0..b)
            .flat_map(|r| {
                (0..l).flat_map(move |i| {
                    (0..l).map(move |j| if j > i || j < r * 3 { masked } else { 0.0 })
                })
            })
            .collect();
        let bias = Tensor::from_vec(bias, (b, 1, l, l), &cpu)?;
        let live: Vec<f32> = (0..b * l)
            .map(|row| if row % l < (row / l) * 3 { 0.0 } else { 1.0 })
            .collect();
        let live = Tensor::from_vec(live, (b * l, 1), &cpu)?;
        // Scores of a trained model's size (std 0.5).
        let inputs = [
            (randn(&[b, nh, l, hd], DType::F32, &cpu)? * 0.5)?,
            randn(&[b, nkv, l, hd], DType::F32, &cpu)?,
            randn(&[b, nkv, l, hd], DType::F32, &cpu)?,
        ];
        let dout = randn(&[b * l, nh * hd], DType::F32, &cpu)?.broadcast_mul(&live)?;
        let scale = 1.0 / (hd as f64).sqrt();
        let want = value_and_grads(&inputs, &dout, |t| {
            attention_reference(&t[0], &t[1], &t[2], &bias, scale)?.broadcast_mul(&live)
        })?;
        let on_dev = inputs
            .iter()
            .map(|t| t.to_dtype(dt)?.to_device(d))
            .collect::<Result<Vec<_>>>()?;
        let (bias, live) = (
            bias.to_dtype(dt)?.to_device(d)?,
            live.to_dtype(dt)?.to_device(d)?,
        );
        for causal in [false, true] {
            let got = value_and_grads(&on_dev, &dout, |t| {
                let y = match causal {
                    false => fused::attention(&t[0], &t[1], &t[2], &bias, scale)?,
                    true => fused::causal_attention(&t[0], &t[1], &t[2], &bias, scale)?,
                };
                y.broadcast_mul(&live)
            })?;
            worst = worse(worst, rel_diff_all(&want, &got)?);
        }
    }
    Ok(worst)
}

/// The fused residual add + RMSNorm of a decode step against the add and the composition.
fn add_rms_norm(d: &Device, dt: DType) -> Result<f64> {
    let (x, r) = (randn(&[5, 96], dt, d)?, randn(&[5, 96], dt, d)?);
    let w = randn(&[96], dt, d)?;
    let (s0, y0) = fused::add_rms_norm_composed(&x, &r, &w, 1e-6)?;
    let (s1, y1) = fused::add_rms_norm(&x, &r, &w, 1e-6)?;
    Ok(worse(rel_diff(&s0, &s1)?, rel_diff(&y0, &y1)?))
}

/// A decode step's key and value writes into a KV cache against the composition's rotate,
/// transpose and copy; positions before the written ones must not move.
fn kv_write(d: &Device, dt: DType) -> Result<f64> {
    let (b, l, g, hd, cap, past) = (2, 3, 2, 16, 9, 4);
    let x = randn(&[b, l, g, hd], dt, d)?;
    let ang = randn(&[b, l, hd / 2], DType::F32, d)?;
    let (c, s) = (ang.cos()?.to_dtype(dt)?, ang.sin()?.to_dtype(dt)?);
    let mut worst = 0f64;
    for rot in [Some((&c, &s)), None] {
        let before = randn(&[b, g, cap, hd], dt, d)?;
        let want = before.copy()?;
        fused::kv_write_composed(&want, &x, rot, past)?;
        let got = before.copy()?;
        fused::kv_write(&got, &x, rot, past)?;
        worst = worse(worst, rel_diff(&want, &got)?);
        let moved = rel_diff(&before.narrow(2, 0, past)?, &got.narrow(2, 0, past)?)?;
        if moved != 0.0 {
            candle_core::bail!("a write changed a cached position before it");
        }
    }
    Ok(worst)
}

/// A layer's pass over a KV cache after the packed q/k/v product (on a GPU one kernel, which
/// also adds the product's bias) against the compositions of the bias add, RoPE, the cache
/// writes and attention: the context and both caches.
fn cached_attention(d: &Device, dt: DType) -> Result<f64> {
    let (b, nh, nkv, l, hd, cap, past) = (3, 6, 2, 2, 64, 40, 27);
    let s = past + l;
    let raw = randn(&[b, l, nh + 2 * nkv, hd], dt, d)?;
    let pb = randn(&[(nh + 2 * nkv) * hd], dt, d)?;
    let qkv = raw.broadcast_add(&pb.reshape((nh + 2 * nkv, hd))?)?;
    let ang = randn(&[b, l, hd / 2], DType::F32, d)?;
    let (c, sn) = (ang.cos()?.to_dtype(dt)?, ang.sin()?.to_dtype(dt)?);
    let bias = decoder_bias(b, l, s, -1e9, d, dt)?;
    let scale = 1.0 / (hd as f64).sqrt();
    let (kc, vc) = (
        randn(&[b, nkv, cap, hd], dt, d)?,
        randn(&[b, nkv, cap, hd], dt, d)?,
    );
    let (wk, wv) = (kc.copy()?, vc.copy()?);
    let q = fused::rope_composed(&qkv.narrow(2, 0, nh)?, &c, &sn)?;
    fused::kv_write_composed(&wk, &qkv.narrow(2, nh, nkv)?, Some((&c, &sn)), past)?;
    fused::kv_write_composed(&wv, &qkv.narrow(2, nh + nkv, nkv)?, None, past)?;
    let (k, v) = (wk.narrow(2, 0, s)?, wv.narrow(2, 0, s)?);
    let want = attention_reference(&q, &k, &v, &bias, scale)?;
    let (gk, gv) = (kc.copy()?, vc.copy()?);
    let got = fused::cached_attention(&raw, Some(&pb), &gk, &gv, &c, &sn, &bias, past, nh, scale)?;
    Ok(worse(
        rel_diff(&want, &got)?,
        worse(rel_diff(&wk, &gk)?, rel_diff(&wv, &gv)?),
    ))
}

/// One decode step's sampling with every filter on (top-k, top-p, min-p, a repetition
/// penalty, suppressed stop ids): the sampler's one-kernel path on a GPU against its
/// tensor-op path (which `top_logprobs` selects), on the same logits and draws. Tokens that
/// differ, plus one if a recorded log-prob differs by more than 1e-3.
fn sampling(d: &Device, dt: DType) -> Result<f64> {
    use crate::sample::DeviceSampler;
    let (n, v) = (16, 500);
    let logits = (randn(&[n, v], DType::F32, d)? * 3.0)?.to_dtype(dt)?;
    let prompts: Vec<Vec<u32>> = (0..n as u32).map(|r| vec![r, 7, 8]).collect();
    let rows: Vec<&[u32]> = prompts.iter().map(|p| p.as_slice()).collect();
    let u: Vec<f32> = (0..n).map(|r| (r as f32 * 0.618).fract()).collect();
    let suppress: Vec<bool> = (0..n).map(|r| r % 2 == 0).collect();
    let params = SamplingParams {
        top_k: 40,
        top_p: 0.9,
        min_p: 0.01,
        repetition_penalty: 1.2,
        min_new_tokens: 2,
        ..SamplingParams::default()
    };
    let run = |top_logprobs: usize| -> Result<Vec<(u32, f32)>> {
        let p = SamplingParams {
            top_logprobs,
            ..params.clone()
        };
        let mut s = DeviceSampler::new(&p, v, &[1, 2], &rows, d)?;
        let (_, picks) = s.step(&logits, &u, &suppress, None)?;
        Ok(picks.into_iter().map(|(t, lp, _)| (t, lp)).collect())
    };
    let (a, b) = (run(0)?, run(1)?);
    let differ = a.iter().zip(&b).filter(|(x, y)| x.0 != y.0).count();
    let lp = a
        .iter()
        .zip(&b)
        .map(|(x, y)| f64::from((x.1 - y.1).abs()))
        .fold(0.0, worse);
    Ok(differ as f64 + if lp > 1e-3 { 1.0 } else { 0.0 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_agrees_with_its_composition_on_the_cpu() {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let found = findings(&Device::Cpu, dtype);
            assert_eq!(found.len(), 10);
            for f in &found {
                assert!(f.ok(), "{dtype:?} {}: {:?}", f.what, f.diff);
            }
        }
    }
}
