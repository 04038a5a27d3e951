//! Blockwise 8-bit quantization, as bitsandbytes' 8-bit optimizers keep Adam's moments
//! (transformers' `optim = "adamw_8bit"`): a tensor is cut into blocks of [`BLOCK`] values,
//! each block stored as its largest magnitude (f32) and one byte per value — the index of the
//! entry of a 256-entry code nearest to the value divided by that magnitude. The codes are
//! bitsandbytes' "dynamic" maps ([`dynamic_map`]: a decimal exponent and a linear fraction, dense
//! near 0), signed for the first moment and unsigned for the second.
//!
//! [`quantize`] and [`dequantize`] take and give candle tensors and run where they live: the
//! dequantization is a lookup ([`Tensor::index_select`]) and a product, the block maxima a
//! reduction; the nearest-code search is an op of its own (a table of bounds and rayon on the
//! CPU, a binary search per value in a kernel on CUDA), the same bytes on both. The lookup is an
//! op of its own too (one pass, on the CPU and in a kernel).

use crate::fused::slice;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};

/// Values per block (bitsandbytes' optimizers use 256).
pub const BLOCK: usize = 256;

/// bitsandbytes' `create_dynamic_map(signed, max_exponent_bits = 7, total_bits = 8)`, sorted:
/// for each exponent `e` in −6..=0, the midpoints of `linspace(0.1, 1, k + 1)` times `10^e`
/// (`k = 2^(e+6)` signed, with their negatives, `2^(e+7)` unsigned), then 0 and 1. The values
/// are bitsandbytes' own, to the bit ([`SIGNED`], [`UNSIGNED`]): torch's vectorized f32
/// `linspace` rounds some midpoints one unit in the last place away from a plain loop's (the
/// tests rebuild the maps from the definition within that).
pub fn dynamic_map(signed: bool) -> Vec<f32> {
    match signed {
        true => SIGNED.to_vec(),
        false => UNSIGNED.to_vec(),
    }
}

/// The index of the entry of `code` (sorted) nearest to `y`; a tie goes to the lower entry.
/// The CUDA kernel (`quant.cu`) is the same search.
pub fn nearest(code: &[f32], y: f32) -> u8 {
    let (mut lo, mut hi) = (0usize, code.len());
    while lo < hi {
        let mid = (lo + hi) / 2;
        if code[mid] < y {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    let i = match lo {
        0 => 0,
        l if l == code.len() => l - 1,
        l if code[l] - y < y - code[l - 1] => l,
        l => l - 1,
    };
    i as u8
}

/// [`nearest`]'s first step (the first entry not below `y`) from a table of the lower bound of
/// every range of floats that share their top 16 bits (sign, exponent, 7 fraction bits): the
/// code's entries are at least 0.8 % apart relatively, so a range holds at most a boundary or
/// two and a step or two from the table's entry finds it — the same index as the binary
/// search (tested on every range's ends and random values), without its eight unpredictable
/// branches. The CPU's op uses it ([`quantize`] of 8 M values: 163 → 40 ms on 2 cores); the
/// CUDA kernel searches.
struct Bounds {
    code: Vec<f32>,
    first: Vec<u16>,
}

impl Bounds {
    fn new(code: &[f32]) -> Self {
        let lower_bound = |y: f32| code.partition_point(|c| *c < y) as u16;
        let first = (0u32..1 << 16)
            .map(|b| {
                // The range's smallest value: the lowest bits for a positive float, the
                // highest for a negative one.
                let lo = b << 16;
                let y = match b >> 15 {
                    0 => f32::from_bits(lo),
                    _ => f32::from_bits(lo | 0xffff),
                };
                lower_bound(y)
            })
            .collect();
        Self {
            code: code.to_vec(),
            first,
        }
    }

    /// The bounds of `code`, built once per code (the two maps) and kept.
    fn of(code: &[f32]) -> std::sync::Arc<Bounds> {
        use std::sync::{Arc, Mutex, OnceLock};
        static CACHE: OnceLock<Mutex<Vec<Arc<Bounds>>>> = OnceLock::new();
        let cache = CACHE.get_or_init(|| Mutex::new(Vec::new()));
        let mut c = cache.lock().unwrap_or_else(|e| e.into_inner());
        let same = |b: &Bounds| {
            b.code.len() == code.len()
                && b.code
                    .iter()
                    .zip(code)
                    .all(|(x, y)| x.to_bits() == y.to_bits())
        };
        if let Some(b) = c.iter().find(|b| same(b)) {
            return b.clone();
        }
        let b = Arc::new(Bounds::new(code));
        c.push(b.clone());
        b
    }

    /// [`nearest`] of `y`.
    fn nearest(&self, y: f32) -> u8 {
        if y.is_nan() {
            // The search's answer: no entry compares below NaN.
            return 0;
        }
        let code = &self.code;
        let mut lo = self.first[(y.to_bits() >> 16) as usize] as usize;
        while lo < code.len() && code[lo] < y {
            lo += 1;
        }
        let i = match lo {
            0 => 0,
            l if l == code.len() => l - 1,
            l if code[l] - y < y - code[l - 1] => l,
            l => l - 1,
        };
        i as u8
    }

    /// [`quantize_value`] of `y`.
    fn quantize_value(&self, y: f32) -> u8 {
        sign_kept(&self.code, y, self.nearest(y) as usize)
    }
}

/// The byte a value `y` (already divided by its block's maximum) is stored as: the nearest
/// entry of `code`, except that a nonzero value never becomes 0 or changes sign — it takes the
/// nearest entry of its own sign. bitsandbytes' CUDA kernel keeps the first moment's sign so;
/// for the second moment it matters more: a value rounded to 0 while the first moment is not
/// makes a later step's denominator `sqrt(v)` nearly 0 and the update up to ~1,000 times too
/// large (seen with a gradient 100 times below its block's largest; bitsandbytes' CPU table
/// rounds such values up to the entry near 1.5e-5 instead).
pub fn quantize_value(code: &[f32], y: f32) -> u8 {
    sign_kept(code, y, nearest(code, y) as usize)
}

/// Entry `i` (the nearest to `y`), or its neighbour of `y`'s sign when `i` is 0 or of the
/// other sign.
fn sign_kept(code: &[f32], y: f32, i: usize) -> u8 {
    let i = if y > 0.0 && code[i] <= 0.0 && i + 1 < code.len() {
        i + 1
    } else if y < 0.0 && code[i] >= 0.0 && i > 0 {
        i - 1
    } else {
        i
    };
    i as u8
}

/// The smallest block maximum divided by (a block of zeros then quantizes to the code's 0).
const TINY: f32 = f32::MIN_POSITIVE;

/// A tensor quantized in blocks.
#[derive(Debug, Clone)]
pub struct Blockwise {
    /// One byte per value, the last block padded with zeros: u8 `(blocks · BLOCK,)`.
    pub codes: Tensor,
    /// Each block's largest magnitude: f32 `(blocks,)`.
    pub absmax: Tensor,
}

impl Blockwise {
    /// Zeros for `n` values on `device` (bitsandbytes' initial state: code 0, maximum 0).
    pub fn zeros(n: usize, device: &candle_core::Device) -> Result<Self> {
        let blocks = n.div_ceil(BLOCK);
        Ok(Self {
            codes: Tensor::zeros(blocks * BLOCK, DType::U8, device)?,
            absmax: Tensor::zeros(blocks, DType::F32, device)?,
        })
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.codes.elem_count() + 4 * self.absmax.elem_count()
    }
}

/// Quantizes `x` (any shape and float dtype, computed in f32) with `code` (f32 `(256,)`, sorted,
/// on `x`'s device): `x / max|block|` to the nearest code entry.
pub fn quantize(x: &Tensor, code: &Tensor) -> Result<Blockwise> {
    let n = x.elem_count();
    let blocks = n.div_ceil(BLOCK);
    let flat = x.flatten_all()?.to_dtype(DType::F32)?;
    let padded = match blocks * BLOCK - n {
        0 => flat,
        pad => Tensor::cat(&[flat, Tensor::zeros(pad, DType::F32, x.device())?], 0)?,
    };
    let rows = padded.reshape((blocks, BLOCK))?;
    let absmax = rows.abs()?.max_keepdim(1)?;
    let codes = match kernel_here(x.device()) {
        true => rows.apply_op3_no_bwd(&absmax, code, &NearestCode)?,
        // A GPU without our kernel (switched off, or it did not compile): the same search on
        // the CPU, the same bytes.
        false => {
            let cpu = candle_core::Device::Cpu;
            rows.to_device(&cpu)?
                .apply_op3_no_bwd(
                    &absmax.to_device(&cpu)?,
                    &code.to_device(&cpu)?,
                    &NearestCode,
                )?
                .to_device(x.device())?
        }
    };
    Ok(Blockwise {
        codes: codes.flatten_all()?,
        absmax: absmax.flatten_all()?,
    })
}

/// Whether the nearest-code search runs where `device` is: the CPU, or a GPU whose kernel is
/// available and, at its first use on that GPU, gave the CPU's bytes ([`device_mismatches`];
/// the first-use self-check, skipped under `GRPO_CUDA_SELFCHECK=0` or while `grpo-cli check`
/// runs). A GPU without it quantizes on the CPU.
fn kernel_here(device: &candle_core::Device) -> bool {
    match device {
        candle_core::Device::Cpu => true,
        #[cfg(feature = "cuda")]
        d @ candle_core::Device::Cuda(_) => {
            use std::collections::HashMap;
            use std::sync::{Mutex, OnceLock};
            static CHECKED: OnceLock<Mutex<HashMap<usize, bool>>> = OnceLock::new();
            if !crate::cuda::available(&crate::cuda::QUANT, d) {
                return false;
            }
            if !crate::selfcheck::enabled() {
                return true;
            }
            let candle_core::DeviceLocation::Cuda { gpu_id } = d.location() else {
                return false;
            };
            let checked = CHECKED.get_or_init(|| Mutex::new(HashMap::new()));
            if let Some(ok) = checked.lock().ok().and_then(|c| c.get(&gpu_id).copied()) {
                return ok;
            }
            let ok = match device_mismatches(d) {
                Ok(0) => true,
                Ok(n) => {
                    eprintln!(
                        "warning: the 8-bit optimizer state's CUDA kernels gave {n} values unlike the CPU's on cuda:{gpu_id}; quantizing on the CPU"
                    );
                    false
                }
                Err(e) => {
                    eprintln!(
                        "warning: the 8-bit optimizer state's CUDA quantizer failed on cuda:{gpu_id} ({}); quantizing on the CPU",
                        e.to_string().lines().next().unwrap_or("")
                    );
                    false
                }
            };
            if let Ok(mut c) = checked.lock() {
                c.insert(gpu_id, ok);
            }
            ok
        }
        _ => false,
    }
}

/// How many bytes the nearest-code op on `device` gives unlike the CPU's, on three blocks of
/// both maps (values over seven decades and of both signs, a block of zeros), and how many
/// values its lookup of the CPU's bytes gives unlike the CPU's: 0 when the device's quantizer
/// and lookup are right (`grpo-cli check` reports it).
pub fn device_mismatches(device: &candle_core::Device) -> Result<usize> {
    let cpu = candle_core::Device::Cpu;
    let vals: Vec<f32> = (0..3 * BLOCK)
        .map(|i| match i / BLOCK {
            0 => ((i * 7919 + 5) % 2001) as f32 / 1000.0 - 1.0,
            1 => (((i * 104_729) % 4001) as f32 / 2000.0 - 1.0) * 10f32.powi((i % 8) as i32 - 7),
            _ => 0.0,
        })
        .collect();
    let rows = Tensor::from_vec(vals, (3, BLOCK), &cpu)?;
    let absmax = rows.abs()?.max_keepdim(1)?;
    let mut differ = 0;
    for signed in [true, false] {
        let code = Tensor::new(dynamic_map(signed).as_slice(), &cpu)?;
        let x = if signed { rows.clone() } else { rows.abs()? };
        let want: Vec<u8> = x
            .apply_op3_no_bwd(&absmax, &code, &NearestCode)?
            .flatten_all()?
            .to_vec1()?;
        let got: Vec<u8> = x
            .to_device(device)?
            .apply_op3_no_bwd(
                &absmax.to_device(device)?,
                &code.to_device(device)?,
                &NearestCode,
            )?
            .flatten_all()?
            .to_vec1()?;
        differ += want.iter().zip(&got).filter(|(a, b)| a != b).count();
        let bytes = Tensor::from_vec(want, 3 * BLOCK, &cpu)?;
        let maxima = absmax.flatten_all()?;
        let want: Vec<u32> = bytes
            .apply_op3_no_bwd(&maxima, &code, &Lookup)?
            .to_vec1::<f32>()?
            .iter()
            .map(|x| x.to_bits())
            .collect();
        let got: Vec<u32> = bytes
            .to_device(device)?
            .apply_op3_no_bwd(
                &maxima.to_device(device)?,
                &code.to_device(device)?,
                &Lookup,
            )?
            .to_vec1::<f32>()?
            .iter()
            .map(|x| x.to_bits())
            .collect();
        differ += want.iter().zip(&got).filter(|(a, b)| a != b).count();
    }
    Ok(differ)
}

/// The f32 values of `q` in `shape`: `code[byte] · max|block|`.
pub fn dequantize(q: &Blockwise, code: &Tensor, shape: &Shape) -> Result<Tensor> {
    let blocks = q.absmax.dim(0)?;
    if kernel_here(q.codes.device()) {
        // One pass (the composition below takes three, and a u32 copy of the bytes).
        return q
            .codes
            .apply_op3_no_bwd(&q.absmax, code, &Lookup)?
            .narrow(0, 0, shape.elem_count())?
            .reshape(shape);
    }
    // As u32: candle's lookup reads an index equal to its type's maximum (byte 255, the code's
    // 1.0) as "none" and gives 0.
    code.index_select(&q.codes.to_dtype(DType::U32)?, 0)?
        .reshape((blocks, BLOCK))?
        .broadcast_mul(&q.absmax.unsqueeze(1)?)?
        .flatten_all()?
        .narrow(0, 0, shape.elem_count())?
        .reshape(shape)
}

/// `(bytes (blocks · BLOCK,) u8, absmax (blocks,) f32, code (256,) f32)` → `code[byte] ·
/// absmax[block]`, f32 `(blocks · BLOCK,)`: [`dequantize`] on the CPU and on a GPU with our
/// kernel, the same products as the composition.
struct Lookup;

impl CustomOp3 for Lookup {
    fn name(&self) -> &'static str {
        "dequantize-lookup"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let bytes = slice::<u8>(s1, l1, "dequantize (bytes)")?;
        let absmax = slice::<f32>(s2, l2, "dequantize (block maxima)")?;
        let code = slice::<f32>(s3, l3, "dequantize (code)")?;
        let out = per_block(bytes, absmax, |b, a| code[b as usize] * a);
        Ok((CpuStorage::F32(out), l1.shape().clone()))
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
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::dequantize_code(s1, l1, s2, l2, s3, l3)
    }
}

/// `(rows (blocks, BLOCK) f32, absmax (blocks, 1) f32, code (256,) f32)` → the nearest code
/// entry of each `row / max(absmax, TINY)` ([`quantize_value`]): u8 `(blocks, BLOCK)`.
struct NearestCode;

/// `f(value, its block's scale)` for every value, blocks in parallel (rayon).
fn per_block<I: Copy + Sync, O: Copy + Default + Send>(
    values: &[I],
    scales: &[f32],
    f: impl Fn(I, f32) -> O + Sync,
) -> Vec<O> {
    use rayon::prelude::*;
    let mut out = vec![O::default(); values.len()];
    out.par_chunks_mut(BLOCK)
        .zip(values.par_chunks(BLOCK))
        .zip(scales.par_iter())
        .for_each(|((o, vs), &a)| {
            for (o, &v) in o.iter_mut().zip(vs) {
                *o = f(v, a);
            }
        });
    out
}

impl CustomOp3 for NearestCode {
    fn name(&self) -> &'static str {
        "quantize-nearest-code"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = slice::<f32>(s1, l1, "quantize (values)")?;
        let absmax = slice::<f32>(s2, l2, "quantize (block maxima)")?;
        let code = slice::<f32>(s3, l3, "quantize (code)")?;
        let bounds = Bounds::of(code);
        let inv: Vec<f32> = absmax.iter().map(|a| 1.0 / a.max(TINY)).collect();
        let out = per_block(x, &inv, |v, inv| bounds.quantize_value(v * inv));
        Ok((CpuStorage::U8(out), l1.shape().clone()))
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
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::quantize_code(s1, l1, s2, l2, s3, l3)
    }
}

/// bitsandbytes' signed dynamic map (`create_dynamic_map(signed=True)`), sorted: the first
/// moment's code.
#[rustfmt::skip]
pub const SIGNED: [f32; 256] = [
    -9.9296874e-01, -9.789063e-01, -9.6484375e-01, -9.507812e-01, -9.3671876e-01, -9.2265624e-01,
    -9.085938e-01, -8.9453125e-01, -8.804687e-01, -8.6640626e-01, -8.5234374e-01, -8.382813e-01,
    -8.2421875e-01, -8.101562e-01, -7.9609376e-01, -7.8203124e-01, -7.679688e-01, -7.5390625e-01,
    -7.398437e-01, -7.2578126e-01, -7.117188e-01, -6.976563e-01, -6.8359375e-01, -6.695312e-01,
    -6.5546876e-01, -6.414063e-01, -6.273438e-01, -6.1328125e-01, -5.992187e-01, -5.8515626e-01,
    -5.710938e-01, -5.570313e-01, -5.4296875e-01, -5.289062e-01, -5.148437e-01, -5.0078124e-01,
    -4.867187e-01, -4.7265625e-01, -4.5859373e-01, -4.4453126e-01, -4.3046874e-01, -4.1640624e-01,
    -4.0234375e-01, -3.8828123e-01, -3.7421876e-01, -3.6015624e-01, -3.4609374e-01, -3.3203125e-01,
    -3.1796873e-01, -3.0390626e-01, -2.8984374e-01, -2.7578127e-01, -2.6171875e-01, -2.4765624e-01,
    -2.3359375e-01, -2.1953125e-01, -2.0546874e-01, -1.9140625e-01, -1.7734376e-01, -1.6328125e-01,
    -1.4921875e-01, -1.3515624e-01, -1.2109375e-01, -1.07031256e-01, -9.859375e-02, -9.578126e-02,
    -9.2968754e-02, -9.015625e-02, -8.734375e-02, -8.453125e-02, -8.171876e-02, -7.890625e-02,
    -7.609375e-02, -7.328125e-02, -7.0468746e-02, -6.7656256e-02, -6.484375e-02, -6.203125e-02,
    -5.9218753e-02, -5.640625e-02, -5.359375e-02, -5.078125e-02, -4.796875e-02, -4.515625e-02,
    -4.2343747e-02, -3.953125e-02, -3.6718752e-02, -3.390625e-02, -3.109375e-02, -2.8281251e-02,
    -2.546875e-02, -2.265625e-02, -1.9843752e-02, -1.703125e-02, -1.421875e-02, -1.140625e-02,
    -9.71875e-03, -9.156249e-03, -8.59375e-03, -8.03125e-03, -7.46875e-03, -6.90625e-03,
    -6.34375e-03, -5.78125e-03, -5.2187503e-03, -4.6562497e-03, -4.09375e-03, -3.5312497e-03,
    -2.96875e-03, -2.40625e-03, -1.84375e-03, -1.2812499e-03, -9.437501e-04, -8.3125e-04,
    -7.1875006e-04, -6.062501e-04, -4.9375003e-04, -3.8125002e-04, -2.6875004e-04, -1.5625001e-04,
    -8.875e-05, -6.625e-05, -4.375e-05, -2.1249998e-05, -7.75e-06, -3.2500002e-06,
    -5.5000004e-07, 0.0e+00, 5.5000004e-07, 3.2500002e-06, 7.75e-06, 2.1249998e-05,
    4.375e-05, 6.625e-05, 8.875e-05, 1.5625001e-04, 2.6875004e-04, 3.8125002e-04,
    4.9375003e-04, 6.062501e-04, 7.1875006e-04, 8.3125e-04, 9.437501e-04, 1.2812499e-03,
    1.84375e-03, 2.40625e-03, 2.96875e-03, 3.5312497e-03, 4.09375e-03, 4.6562497e-03,
    5.2187503e-03, 5.78125e-03, 6.34375e-03, 6.90625e-03, 7.46875e-03, 8.03125e-03,
    8.59375e-03, 9.156249e-03, 9.71875e-03, 1.140625e-02, 1.421875e-02, 1.703125e-02,
    1.9843752e-02, 2.265625e-02, 2.546875e-02, 2.8281251e-02, 3.109375e-02, 3.390625e-02,
    3.6718752e-02, 3.953125e-02, 4.2343747e-02, 4.515625e-02, 4.796875e-02, 5.078125e-02,
    5.359375e-02, 5.640625e-02, 5.9218753e-02, 6.203125e-02, 6.484375e-02, 6.7656256e-02,
    7.0468746e-02, 7.328125e-02, 7.609375e-02, 7.890625e-02, 8.171876e-02, 8.453125e-02,
    8.734375e-02, 9.015625e-02, 9.2968754e-02, 9.578126e-02, 9.859375e-02, 1.07031256e-01,
    1.2109375e-01, 1.3515624e-01, 1.4921875e-01, 1.6328125e-01, 1.7734376e-01, 1.9140625e-01,
    2.0546874e-01, 2.1953125e-01, 2.3359375e-01, 2.4765624e-01, 2.6171875e-01, 2.7578127e-01,
    2.8984374e-01, 3.0390626e-01, 3.1796873e-01, 3.3203125e-01, 3.4609374e-01, 3.6015624e-01,
    3.7421876e-01, 3.8828123e-01, 4.0234375e-01, 4.1640624e-01, 4.3046874e-01, 4.4453126e-01,
    4.5859373e-01, 4.7265625e-01, 4.867187e-01, 5.0078124e-01, 5.148437e-01, 5.289062e-01,
    5.4296875e-01, 5.570313e-01, 5.710938e-01, 5.8515626e-01, 5.992187e-01, 6.1328125e-01,
    6.273438e-01, 6.414063e-01, 6.5546876e-01, 6.695312e-01, 6.8359375e-01, 6.976563e-01,
    7.117188e-01, 7.2578126e-01, 7.398437e-01, 7.5390625e-01, 7.679688e-01, 7.8203124e-01,
    7.9609376e-01, 8.101562e-01, 8.2421875e-01, 8.382813e-01, 8.5234374e-01, 8.6640626e-01,
    8.804687e-01, 8.9453125e-01, 9.085938e-01, 9.2265624e-01, 9.3671876e-01, 9.507812e-01,
    9.6484375e-01, 9.789063e-01, 9.9296874e-01, 1.0e+00,
];

/// bitsandbytes' unsigned dynamic map (`create_dynamic_map(signed=False)`), sorted: the
/// second moment's code.
#[rustfmt::skip]
pub const UNSIGNED: [f32; 256] = [
    0.0e+00, 3.2500003e-07, 7.75e-07, 2.1249998e-06, 4.3749997e-06, 6.625e-06,
    8.874999e-06, 1.5624999e-05, 2.6875001e-05, 3.8125e-05, 4.9374998e-05, 6.0625003e-05,
    7.1875e-05, 8.312499e-05, 9.4375e-05, 1.28125e-04, 1.84375e-04, 2.4062501e-04,
    2.9687502e-04, 3.5312498e-04, 4.0937503e-04, 4.6562502e-04, 5.2187504e-04, 5.78125e-04,
    6.34375e-04, 6.9062505e-04, 7.46875e-04, 8.031251e-04, 8.5937505e-04, 9.15625e-04,
    9.7187504e-04, 1.140625e-03, 1.421875e-03, 1.703125e-03, 1.984375e-03, 2.265625e-03,
    2.5468748e-03, 2.828125e-03, 3.1093748e-03, 3.3906251e-03, 3.671875e-03, 3.953125e-03,
    4.2343745e-03, 4.515625e-03, 4.7968747e-03, 5.078125e-03, 5.359375e-03, 5.6406246e-03,
    5.921875e-03, 6.2031248e-03, 6.484375e-03, 6.7656254e-03, 7.0468746e-03, 7.328125e-03,
    7.6093744e-03, 7.890625e-03, 8.171875e-03, 8.453124e-03, 8.734375e-03, 9.015624e-03,
    9.2968745e-03, 9.578126e-03, 9.859375e-03, 1.0703126e-02, 1.2109376e-02, 1.3515624e-02,
    1.4921876e-02, 1.6328124e-02, 1.7734377e-02, 1.9140625e-02, 2.0546874e-02, 2.1953126e-02,
    2.3359375e-02, 2.4765624e-02, 2.6171876e-02, 2.7578129e-02, 2.8984373e-02, 3.0390626e-02,
    3.1796873e-02, 3.3203125e-02, 3.4609374e-02, 3.6015626e-02, 3.742188e-02, 3.8828123e-02,
    4.0234376e-02, 4.1640624e-02, 4.3046873e-02, 4.4453125e-02, 4.5859374e-02, 4.7265626e-02,
    4.867187e-02, 5.0078124e-02, 5.1484372e-02, 5.2890625e-02, 5.4296877e-02, 5.570313e-02,
    5.7109382e-02, 5.8515627e-02, 5.9921872e-02, 6.1328124e-02, 6.273438e-02, 6.414063e-02,
    6.554688e-02, 6.695312e-02, 6.8359375e-02, 6.976563e-02, 7.117188e-02, 7.2578125e-02,
    7.398438e-02, 7.539063e-02, 7.679688e-02, 7.820313e-02, 7.960938e-02, 8.1015624e-02,
    8.242188e-02, 8.382813e-02, 8.5234374e-02, 8.6640626e-02, 8.804687e-02, 8.945312e-02,
    9.0859376e-02, 9.226563e-02, 9.367188e-02, 9.5078126e-02, 9.648438e-02, 9.789063e-02,
    9.9296875e-02, 1.03515625e-01, 1.1054687e-01, 1.1757813e-01, 1.2460937e-01, 1.3164061e-01,
    1.3867188e-01, 1.4570314e-01, 1.5273437e-01, 1.5976563e-01, 1.6679686e-01, 1.7382812e-01,
    1.8085939e-01, 1.8789062e-01, 1.9492188e-01, 2.0195311e-01, 2.0898438e-01, 2.1601564e-01,
    2.2304687e-01, 2.3007813e-01, 2.3710936e-01, 2.4414062e-01, 2.5117186e-01, 2.5820312e-01,
    2.6523438e-01, 2.722656e-01, 2.7929688e-01, 2.8632814e-01, 2.9335937e-01, 3.003906e-01,
    3.0742186e-01, 3.1445312e-01, 3.214844e-01, 3.2851562e-01, 3.3554685e-01, 3.425781e-01,
    3.4960938e-01, 3.5664064e-01, 3.6367187e-01, 3.707031e-01, 3.7773436e-01, 3.8476562e-01,
    3.917969e-01, 3.9882812e-01, 4.0585935e-01, 4.128906e-01, 4.1992188e-01, 4.2695314e-01,
    4.3398437e-01, 4.410156e-01, 4.4804686e-01, 4.5507812e-01, 4.621094e-01, 4.6914062e-01,
    4.7617185e-01, 4.832031e-01, 4.9023438e-01, 4.972656e-01, 5.042969e-01, 5.113281e-01,
    5.1835936e-01, 5.253906e-01, 5.324218e-01, 5.3945315e-01, 5.4648435e-01, 5.535157e-01,
    5.605469e-01, 5.6757814e-01, 5.746094e-01, 5.816406e-01, 5.886719e-01, 5.957031e-01,
    6.027344e-01, 6.0976565e-01, 6.1679685e-01, 6.238282e-01, 6.308594e-01, 6.3789064e-01,
    6.449219e-01, 6.519531e-01, 6.589844e-01, 6.660156e-01, 6.730469e-01, 6.8007815e-01,
    6.8710935e-01, 6.941407e-01, 7.011719e-01, 7.0820314e-01, 7.152344e-01, 7.222656e-01,
    7.292969e-01, 7.363281e-01, 7.433594e-01, 7.5039065e-01, 7.5742185e-01, 7.644532e-01,
    7.714844e-01, 7.785156e-01, 7.855469e-01, 7.925781e-01, 7.996094e-01, 8.066406e-01,
    8.136718e-01, 8.2070315e-01, 8.2773435e-01, 8.347657e-01, 8.417969e-01, 8.488281e-01,
    8.558594e-01, 8.628906e-01, 8.699219e-01, 8.769531e-01, 8.839843e-01, 8.9101565e-01,
    8.9804685e-01, 9.050782e-01, 9.121094e-01, 9.191406e-01, 9.261719e-01, 9.332031e-01,
    9.402344e-01, 9.472656e-01, 9.542968e-01, 9.6132815e-01, 9.6835935e-01, 9.753907e-01,
    9.824219e-01, 9.894531e-01, 9.964844e-01, 1.0e+00,
];

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The maps from their definition (f64 arithmetic), against the tables: within 2 units in
    /// the last place.
    #[test]
    fn the_tables_are_the_dynamic_maps() {
        for signed in [true, false] {
            let mut data: Vec<f64> = Vec::new();
            for i in 0..7i32 {
                let items = if signed {
                    (1usize << i) + 1
                } else {
                    (1usize << (i + 1)) + 1
                };
                let b: Vec<f64> = (0..items)
                    .map(|k| 0.1 + 0.9 * k as f64 / (items - 1) as f64)
                    .collect();
                for w in b.windows(2) {
                    let mean = 10f64.powi(i - 6) * (w[0] + w[1]) / 2.0;
                    data.push(mean);
                    if signed {
                        data.push(-mean);
                    }
                }
            }
            data.extend([0.0, 1.0]);
            data.sort_by(f64::total_cmp);
            for (t, d) in dynamic_map(signed).iter().zip(&data) {
                let ulp = f32::EPSILON * t.abs().max(f32::MIN_POSITIVE);
                assert!((*t as f64 - d).abs() <= 2.0 * ulp as f64, "{t} vs {d}");
            }
        }
    }

    #[test]
    fn the_maps_are_sorted_256_entries_with_0_and_1() {
        for signed in [true, false] {
            let m = dynamic_map(signed);
            assert_eq!(m.len(), 256);
            assert!(m.windows(2).all(|w| w[0] < w[1]), "strictly increasing");
            assert!(m.contains(&0.0) && *m.last().unwrap() == 1.0);
            // Signed: 127 negative entries; unsigned: none.
            let neg = m.iter().filter(|v| **v < 0.0).count();
            assert_eq!(neg, if signed { 127 } else { 0 });
            // The smallest positive entry: 10^-6 times the first midpoint of linspace(0.1, 1,
            // 2) signed, of linspace(0.1, 1, 3) unsigned.
            let first = m.iter().copied().find(|v| *v > 0.0).unwrap();
            let want = if signed { 0.55e-6 } else { 0.325e-6 };
            assert!((first - want).abs() < 1e-12, "{first}");
        }
    }

    #[test]
    fn nearest_is_the_closest_entry() {
        let code = dynamic_map(true);
        for k in 0..20_000 {
            let y = -1.2 + 2.4 * (k as f32) / 20_000.0;
            let i = nearest(&code, y) as usize;
            let best = code
                .iter()
                .map(|c| (c - y).abs())
                .fold(f32::INFINITY, f32::min);
            assert_eq!((code[i] - y).abs(), best, "y = {y}");
        }
        // Each entry is its own nearest.
        for (i, c) in code.iter().enumerate() {
            assert_eq!(nearest(&code, *c) as usize, i);
        }
    }

    #[test]
    fn the_bounds_table_finds_what_the_search_finds() {
        use rand::{Rng, SeedableRng};
        for signed in [true, false] {
            let code = dynamic_map(signed);
            let bounds = Bounds::new(&code);
            let check = |y: f32| {
                assert_eq!(
                    bounds.nearest(y),
                    nearest(&code, y),
                    "{y:e} ({:#x})",
                    y.to_bits()
                );
                assert_eq!(bounds.quantize_value(y), quantize_value(&code, y), "{y:e}");
            };
            // Every range's two ends, and values around every entry and midpoint.
            for b in 0u32..1 << 16 {
                check(f32::from_bits(b << 16));
                check(f32::from_bits((b << 16) | 0xffff));
            }
            for w in code.windows(2) {
                let mid = (w[0] + w[1]) / 2.0;
                for y in [w[0], w[1], mid, mid.next_up(), mid.next_down()] {
                    check(y);
                }
            }
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
            for _ in 0..200_000 {
                check(rng.random_range(-1.0f32..=1.0));
                check(f32::from_bits(rng.random::<u32>()));
            }
        }
    }

    #[test]
    fn a_nonzero_value_keeps_its_sign_and_is_never_zero() {
        for signed in [true, false] {
            let code = dynamic_map(signed);
            for y in [1e-9f32, 1e-7, 1e-30, -1e-9, -1e-7] {
                if !signed && y < 0.0 {
                    continue;
                }
                let c = code[quantize_value(&code, y) as usize];
                assert!(c != 0.0 && c.signum() == y.signum(), "{y} -> {c}");
            }
            assert_eq!(code[quantize_value(&code, 0.0) as usize], 0.0);
            // Elsewhere the nearest entry.
            for y in [0.3f32, 0.01, 1.0] {
                assert_eq!(quantize_value(&code, y), nearest(&code, y));
            }
        }
    }

    #[test]
    fn a_round_trip_keeps_each_block_within_its_code_spacing() {
        let dev = Device::Cpu;
        let code_v = dynamic_map(true);
        let code = Tensor::new(code_v.as_slice(), &dev).unwrap();
        // 3 blocks and a part (the last padded), values over five decades, a block of zeros.
        let n = 3 * BLOCK + 79;
        let vals: Vec<f32> = (0..n)
            .map(|i| match i / BLOCK {
                1 => 0.0,
                _ => ((i as f32 * 0.37).sin()) * 10f32.powi((i % 5) as i32 - 3),
            })
            .collect();
        let x = Tensor::from_vec(vals.clone(), (n / 7, 7), &dev).unwrap();
        let q = quantize(&x, &code).unwrap();
        assert_eq!(q.codes.dims(), &[4 * BLOCK]);
        assert_eq!(q.absmax.dims(), &[4]);
        let back = dequantize(&q, &code, x.shape()).unwrap();
        assert_eq!(back.dims(), x.dims());
        let back: Vec<f32> = back.flatten_all().unwrap().to_vec1().unwrap();
        let absmax: Vec<f32> = q.absmax.to_vec1().unwrap();
        for (i, (a, b)) in vals.iter().zip(&back).enumerate() {
            let m = absmax[i / BLOCK];
            // The largest gap between neighbouring entries is below 0.0079 (near ±1).
            assert!(
                (a - b).abs() <= 0.008 * m,
                "{i}: {a} vs {b} (block max {m})"
            );
        }
        // The block of zeros stays zeros, and each block's maximum is stored exactly.
        assert!(back[BLOCK..2 * BLOCK].iter().all(|v| *v == 0.0));
        assert_eq!(absmax[1], 0.0);
        let max0 = vals[..BLOCK].iter().fold(0f32, |m, v| m.max(v.abs()));
        assert_eq!(absmax[0], max0);
        // A value equal to its block maximum comes back exactly (the code holds 1.0).
        let top = vals[..BLOCK].iter().position(|v| *v == max0).unwrap();
        assert_eq!(back[top], max0);
    }

    #[test]
    fn the_cpu_agrees_with_itself() {
        assert_eq!(device_mismatches(&Device::Cpu).unwrap(), 0);
    }

    /// The CPU's one-pass lookup gives the composition's values (the path on other devices).
    #[test]
    fn the_lookup_equals_the_composition() {
        let dev = Device::Cpu;
        let code = Tensor::new(dynamic_map(true).as_slice(), &dev).unwrap();
        let x = Tensor::from_vec(
            (0..1000)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.3)
                .collect::<Vec<_>>(),
            1000,
            &dev,
        )
        .unwrap();
        let q = quantize(&x, &code).unwrap();
        let fast: Vec<f32> = dequantize(&q, &code, x.shape()).unwrap().to_vec1().unwrap();
        let composed: Vec<f32> = code
            .index_select(&q.codes.to_dtype(DType::U32).unwrap(), 0)
            .unwrap()
            .reshape((4, BLOCK))
            .unwrap()
            .broadcast_mul(&q.absmax.unsqueeze(1).unwrap())
            .unwrap()
            .flatten_all()
            .unwrap()
            .narrow(0, 0, 1000)
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(fast, composed);
    }

    #[test]
    fn zeros_dequantize_to_zero() {
        let dev = Device::Cpu;
        let code = Tensor::new(dynamic_map(false).as_slice(), &dev).unwrap();
        let q = Blockwise::zeros(300, &dev).unwrap();
        assert_eq!(q.bytes(), 512 + 8);
        let v = dequantize(&q, &code, &Shape::from(300)).unwrap();
        assert_eq!(v.sum_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
    }
}
