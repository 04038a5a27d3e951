//! Log-probabilities of chosen tokens and entropies, from logits, in row chunks.
//!
//! The vocabulary axis is last: `logits` is `(..., V)` (usually `(B, T, V)`), `targets` is
//! `(...)`. Both functions work on blocks of rows so that at most one chunk's `(rows, V)`
//! temporaries exist beside the logits, never a second full `(B, T, V)` tensor. Half-precision
//! logits are widened to f32 inside each chunk (the result is f32); f32 and f64 keep their dtype.
//! On CPU f32/f64 each chunk goes through a fused kernel with its own backward
//! ([`crate::fused`]); elsewhere (CUDA, half precision) each chunk is a differentiable
//! composition of candle ops run as one [`crate::recompute`] node, which keeps only the chunk
//! for backward (no f32 widening of the logits is stored); `GRPO_FUSED=0` keeps the plain
//! composition. The paths agree to rounding (tested).

use candle_core::{D, DType, Result, Tensor};

use crate::fused::Path;
use crate::recompute::Recompute;
use crate::selfcheck::{Finding, randn, rel_diff_all, value_and_grads};

/// Upper bound on the elements of one chunk's `(rows, V)` temporaries (16 MiB of f32).
pub const CHUNK_ELEMENTS: usize = 1 << 22;

/// [`CHUNK_ELEMENTS`] on a GPU (128 MiB of f32): there a chunk costs the same few kernel
/// launches (each ≈ 10 µs of host time) whatever its size, so small chunks leave the GPU
/// waiting for the host (a 32 × 256-token micro-batch at vocabulary 16384 is 32 chunks of
/// [`CHUNK_ELEMENTS`], 4 of these).
pub const DEVICE_CHUNK_ELEMENTS: usize = 1 << 25;

/// Rows per chunk of `(rows, V)` logits for a vocabulary of `v` on `device`.
pub fn chunk_rows_on(v: usize, device: &candle_core::Device) -> usize {
    let elements = if device.is_cpu() {
        CHUNK_ELEMENTS
    } else {
        DEVICE_CHUNK_ELEMENTS
    };
    (elements / v.max(1)).max(1)
}

fn compute_dtype(dtype: DType) -> DType {
    match dtype {
        DType::F64 => DType::F64,
        _ => DType::F32,
    }
}

/// Flattens `(..., V)` to `(N, V)`; returns the leading shape too.
fn rows(logits: &Tensor) -> Result<(Tensor, Vec<usize>, usize)> {
    let dims = logits.dims();
    let Some((&v, lead)) = dims.split_last() else {
        candle_core::bail!("logits must have at least one dimension (the vocabulary)")
    };
    let n: usize = lead.iter().product();
    Ok((logits.reshape((n, v))?, lead.to_vec(), v))
}

/// `log softmax(logits)[target]` at every position: `(..., V)` and `(...)` → `(...)`.
///
/// Computed as `x[target] − logsumexp(x)` per row, in chunks of rows (see the module docs), so
/// the full log-softmax is never materialised. `targets` holds integer token ids (u32 or i64).
///
/// ```
/// use candle_core::{Device, Tensor};
/// let logits = Tensor::new(&[[0f32, 0.0], [1.0, 0.0]], &Device::Cpu)?;
/// let targets = Tensor::new(&[1u32, 0], &Device::Cpu)?;
/// let lp = grpo_core::logprobs::selective_log_softmax(&logits, &targets)?.to_vec1::<f32>()?;
/// assert!((lp[0] - 0.5f32.ln()).abs() < 1e-6);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn selective_log_softmax(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    selective_log_softmax_chunked(logits, targets, None)
}

/// [`selective_log_softmax`] with an explicit number of rows per chunk (`None`: as many rows as
/// fit in [`CHUNK_ELEMENTS`]).
pub fn selective_log_softmax_chunked(
    logits: &Tensor,
    targets: &Tensor,
    rows_per_chunk: Option<usize>,
) -> Result<Tensor> {
    let (x, lead, v) = rows(logits)?;
    if targets.dims() != lead.as_slice() {
        candle_core::bail!(
            "targets must have the shape of logits without the vocabulary axis: logits {:?}, targets {:?}",
            logits.dims(),
            targets.dims()
        );
    }
    let n = x.dim(0)?;
    let ids = targets.reshape((n, 1))?.contiguous()?;
    let dtype = compute_dtype(logits.dtype());
    let step = rows_per_chunk
        .unwrap_or_else(|| chunk_rows_on(v, logits.device()))
        .max(1);
    let mut parts = Vec::with_capacity(n.div_ceil(step));
    let mut start = 0;
    while start < n {
        let len = step.min(n - start);
        let chunk = x.narrow(0, start, len)?;
        let ids_chunk = ids.narrow(0, start, len)?;
        let u32_ids = ids_chunk.dtype() == DType::U32;
        parts.push(
            match crate::fused::head_path("log_softmax_gather", &chunk, u32_ids) {
                Path::Kernel => {
                    crate::fused::log_softmax_gather(&chunk, &ids_chunk.flatten_all()?)?
                        .unsqueeze(1)?
                }
                Path::Composed => lsg_composed(&chunk, &ids_chunk, dtype)?,
                Path::Recompute => Recompute::new("log_softmax_gather", move |a, _| {
                    lsg_composed(&a[0], &ids_chunk, dtype)
                })
                .apply(&[&chunk])?,
            },
        );
        start += len;
    }
    let out = if parts.is_empty() {
        Tensor::zeros((0, 1), dtype, logits.device())?
    } else {
        Tensor::cat(&parts, 0)?
    };
    out.reshape(lead)
}

/// Entropy `−Σ p log p` of the softmax at every position: `(..., V)` → `(...)`, in chunks of
/// rows. Computed as `logsumexp(x) − Σ softmax(x)·x`.
///
/// ```
/// use candle_core::{Device, Tensor};
/// let logits = Tensor::new(&[[0f32, 0.0, 0.0, 0.0]], &Device::Cpu)?;
/// let h = grpo_core::logprobs::entropy_from_logits(&logits)?.to_vec1::<f32>()?;
/// assert!((h[0] - 4f32.ln()).abs() < 1e-6);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn entropy_from_logits(logits: &Tensor) -> Result<Tensor> {
    entropy_from_logits_chunked(logits, None)
}

/// [`entropy_from_logits`] with an explicit number of rows per chunk.
pub fn entropy_from_logits_chunked(
    logits: &Tensor,
    rows_per_chunk: Option<usize>,
) -> Result<Tensor> {
    let (x, lead, v) = rows(logits)?;
    let n = x.dim(0)?;
    let dtype = compute_dtype(logits.dtype());
    let step = rows_per_chunk
        .unwrap_or_else(|| chunk_rows_on(v, logits.device()))
        .max(1);
    let mut parts = Vec::with_capacity(n.div_ceil(step));
    let mut start = 0;
    while start < n {
        let len = step.min(n - start);
        let chunk = x.narrow(0, start, len)?;
        parts.push(match crate::fused::head_path("entropy", &chunk, true) {
            Path::Kernel => crate::fused::entropy(&chunk)?.unsqueeze(1)?,
            Path::Composed => entropy_composed(&chunk, dtype)?,
            Path::Recompute => {
                Recompute::new("entropy", move |a, _| entropy_composed(&a[0], dtype))
                    .apply(&[&chunk])?
            }
        });
        start += len;
    }
    let out = if parts.is_empty() {
        Tensor::zeros((0, 1), dtype, logits.device())?
    } else {
        Tensor::cat(&parts, 0)?
    };
    out.reshape(lead)
}

/// `log softmax(x)[id]` of a `(rows, V)` chunk and `(rows, 1)` ids as a composition, in
/// `dtype` → `(rows, 1)`.
fn lsg_composed(chunk: &Tensor, ids: &Tensor, dtype: DType) -> Result<Tensor> {
    let chunk = chunk.to_dtype(dtype)?;
    let max = chunk.max_keepdim(D::Minus1)?.detach();
    let shifted = chunk.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    let picked = shifted.contiguous()?.gather(ids, D::Minus1)?;
    picked - lse
}

/// The softmax entropy of a `(rows, V)` chunk as a composition, in `dtype` → `(rows, 1)`.
fn entropy_composed(chunk: &Tensor, dtype: DType) -> Result<Tensor> {
    let chunk = chunk.to_dtype(dtype)?;
    let max = chunk.max_keepdim(D::Minus1)?.detach();
    let shifted = chunk.broadcast_sub(&max)?;
    let e = shifted.exp()?;
    let z = e.sum_keepdim(D::Minus1)?;
    // H = log Z − Σ e·s / Z, with s the shifted logits (the shift cancels).
    let expected = (e * &shifted)?.sum_keepdim(D::Minus1)?.div(&z)?;
    z.log()? - expected
}

/// The head's kernels (log-softmax + gather, entropy; forward and backward) against their
/// compositions on `device` in `dtype`, for the first-use self-check
/// ([`crate::selfcheck::guard`]): rows of a ragged vocabulary (1000 + 3), scaled logits. The
/// public functions run as they route (the kernels on a GPU; on the CPU its own kernels in
/// f32, the recomputed composition in half precision).
pub fn head_findings(device: &candle_core::Device, dtype: DType) -> Vec<Finding> {
    crate::selfcheck::reseed();
    let (n, v) = (9, 1003);
    let case = || -> Result<(Tensor, Tensor, Tensor)> {
        let x = (randn(&[n, v], DType::F32, device)? * 4.0)?.to_dtype(dtype)?;
        let ids: Vec<u32> = (0..n as u32).map(|r| (r * 211 + 5) % v as u32).collect();
        let ids = Tensor::from_vec(ids, n, device)?;
        let dout = randn(&[n, 1], DType::F32, device)?;
        Ok((x, ids, dout))
    };
    let lsg = (|| {
        let (x, ids, dout) = case()?;
        let cd = compute_dtype(dtype);
        let ids2 = ids.reshape((n, 1))?;
        let want = value_and_grads(std::slice::from_ref(&x), &dout, |t| {
            lsg_composed(&t[0], &ids2, cd)
        })?;
        let got = value_and_grads(&[x], &dout, |t| {
            selective_log_softmax(&t[0], &ids)?.unsqueeze(1)
        })?;
        rel_diff_all(&want, &got)
    })();
    let ent = (|| {
        let (x, _, dout) = case()?;
        let cd = compute_dtype(dtype);
        let want = value_and_grads(std::slice::from_ref(&x), &dout, |t| {
            entropy_composed(&t[0], cd)
        })?;
        let got = value_and_grads(&[x], &dout, |t| entropy_from_logits(&t[0])?.unsqueeze(1))?;
        rel_diff_all(&want, &got)
    })();
    vec![
        Finding::new(
            "log-softmax + gather vs composition, values and gradients",
            &["log_softmax_gather"],
            dtype,
            lsg,
        ),
        Finding::new(
            "entropy vs composition, values and gradients",
            &["entropy"],
            dtype,
            ent,
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn head_kernels_agree_with_their_compositions() {
        // On the CPU the fused CPU kernels (f32) and their recomputed paths (bf16) run.
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let found = head_findings(&Device::Cpu, dtype);
            assert_eq!(found.len(), 2);
            for f in &found {
                assert!(f.ok(), "{dtype:?} {}: {:?}", f.what, f.diff);
            }
        }
    }

    #[test]
    fn chunks_hold_at_most_the_budget_and_at_least_a_row() {
        let d = Device::Cpu;
        assert_eq!(chunk_rows_on(16384, &d), CHUNK_ELEMENTS / 16384);
        assert!(chunk_rows_on(1000, &d) * 1000 <= CHUNK_ELEMENTS);
        assert_eq!(chunk_rows_on(CHUNK_ELEMENTS * 3, &d), 1);
        assert_eq!(chunk_rows_on(0, &d), CHUNK_ELEMENTS);
    }

    #[test]
    fn chunking_does_not_change_values() {
        let d = Device::Cpu;
        let logits = Tensor::randn(0f32, 3.0, (3, 5, 11), &d).unwrap();
        let targets =
            Tensor::new(&[[0u32, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 0, 1, 2, 3]], &d).unwrap();
        let whole = selective_log_softmax(&logits, &targets).unwrap();
        for rows in [1, 2, 4, 7, 15, 100] {
            let c = selective_log_softmax_chunked(&logits, &targets, Some(rows)).unwrap();
            let diff = (c - &whole).unwrap().abs().unwrap().max_all().unwrap();
            assert!(diff.to_scalar::<f32>().unwrap() < 1e-6);
            let h = entropy_from_logits_chunked(&logits, Some(rows)).unwrap();
            let h0 = entropy_from_logits(&logits).unwrap();
            let diff = (h - h0).unwrap().abs().unwrap().max_all().unwrap();
            assert!(diff.to_scalar::<f32>().unwrap() < 1e-6);
        }
        assert_eq!(whole.dims(), &[3, 5]);
    }

    #[test]
    fn half_precision_logits_give_f32() {
        let d = Device::Cpu;
        let logits = Tensor::new(&[[1f32, 2.0, 3.0]], &d)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let t = Tensor::new(&[2u32], &d).unwrap();
        let lp = selective_log_softmax(&logits, &t).unwrap();
        assert_eq!(lp.dtype(), DType::F32);
        let expect = 3.0 - (1f32.exp() + 2f32.exp() + 3f32.exp()).ln();
        assert!((lp.to_vec1::<f32>().unwrap()[0] - expect).abs() < 1e-5);
    }

    #[test]
    fn shape_mismatch_is_an_error() {
        let d = Device::Cpu;
        let logits = Tensor::zeros((2, 3, 4), DType::F32, &d).unwrap();
        let t = Tensor::zeros((2, 2), DType::U32, &d).unwrap();
        let e = selective_log_softmax(&logits, &t).unwrap_err().to_string();
        assert!(e.contains("targets"), "{e}");
    }
}
