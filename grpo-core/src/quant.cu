// CUDA kernel of grpo_core::quant — the nearest entry of a 256-entry code to each value of a
// block divided by the block's largest magnitude (the 8-bit optimizer states' quantizer) —
// compiled at run time with NVRTC after the prelude (cuda_prelude.cu). One thread per value,
// blocks of 256 threads (one quantization block each); the same search as `quant::nearest`
// and the same sign rule as `quant::quantize_value`
// (the first entry not below the value, then the nearer of it and the one before, a tie to
// the lower), so the bytes equal the CPU's.

__device__ unsigned char nearest_code(const float* c, float y) {
    int lo = 0, hi = 256;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (c[mid] < y)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == 0) return 0;
    if (lo == 256) return 255;
    return (unsigned char)(c[lo] - y < y - c[lo - 1] ? lo : lo - 1);
}

// quant::quantize_value: the nearest entry, except that a nonzero value keeps its sign and
// never becomes 0.
__device__ unsigned char quantize_value(const float* c, float y) {
    int i = nearest_code(c, y);
    if (y > 0.0f && c[i] <= 0.0f && i + 1 < 256) return (unsigned char)(i + 1);
    if (y < 0.0f && c[i] >= 0.0f && i > 0) return (unsigned char)(i - 1);
    return (unsigned char)i;
}

// x: (blocks, 256) f32; absmax: (blocks,) f32; code: (256,) f32 sorted; out: (blocks, 256).
extern "C" __global__ void quantize_code_f32(const float* x, long xo, const float* absmax,
                                             long ao, const float* code, long co,
                                             unsigned char* out, long n) {
    __shared__ float c[256];
    for (int i = threadIdx.x; i < 256; i += blockDim.x) c[i] = code[co + i];
    __syncthreads();
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    // The smallest normal float: a block of zeros quantizes to the code's 0.
    float inv = 1.0f / fmaxf(absmax[ao + i / 256], 1.17549435e-38f);
    // The product rounded once, as the CPU's: NVRTC would otherwise fuse it into the search's
    // differences (`c[lo] - y` as one fma), which can pick the other neighbour at a near-tie.
    out[i] = quantize_value(c, __fmul_rn(x[xo + i], inv));
}

// quant::dequantize: out[i] = code[bytes[i]] · absmax[i / 256], f32; one thread per value.
extern "C" __global__ void dequantize_code_f32(const unsigned char* q, long qo,
                                               const float* absmax, long ao, const float* code,
                                               long co, float* out, long n) {
    __shared__ float c[256];
    for (int i = threadIdx.x; i < 256; i += blockDim.x) c[i] = code[co + i];
    __syncthreads();
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = c[q[qo + i]] * absmax[ao + i / 256];
}
