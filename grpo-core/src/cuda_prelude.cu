// What every CUDA kernel source of grpo-rs starts with (grpo_core::cuda prepends it): storage
// types and their conversions, and block reductions. Sources are compiled at run time with
// NVRTC for the device's own architecture; arithmetic is in f32 whatever the storage type.
//
// No header is needed: storage types are `float` and the raw bits of bf16 / f16 (`unsigned
// short`), converted below. The sources also compile as host C++ under an emulation of the CUDA
// built-ins (tests/cuda_emulation), which is how they are tested on machines without a GPU;
// GPU_HOST_EMULATION marks what the emulation defines instead.

typedef unsigned short bits16;

#ifndef GPU_HOST_EMULATION
#define GPU_NEG_INF (-__int_as_float(0x7f800000))
#define GPU_DYNAMIC_SHARED(name) extern __shared__ float name[]
__device__ __forceinline__ float gpu_f16_to_f32(bits16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ bits16 gpu_f32_to_f16(float f) {
    bits16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#endif

struct F32 {
    typedef float S;
    static __device__ __forceinline__ float ld(float v) { return v; }
    static __device__ __forceinline__ float st(float v) { return v; }
};

struct BF16 {
    typedef bits16 S;
    static __device__ __forceinline__ float ld(bits16 v) {
        return __uint_as_float(((unsigned int)v) << 16);
    }
    // Round to nearest even, NaN kept a (quiet) NaN: what the half crate and torch do.
    static __device__ __forceinline__ bits16 st(float f) {
        unsigned int u = __float_as_uint(f);
        if ((u & 0x7fffffffu) > 0x7f800000u) return (bits16)((u >> 16) | 0x40u);
        u += 0x7fffu + ((u >> 16) & 1u);
        return (bits16)(u >> 16);
    }
};

struct F16 {
    typedef bits16 S;
    static __device__ __forceinline__ float ld(bits16 v) { return gpu_f16_to_f32(v); }
    static __device__ __forceinline__ bits16 st(float f) { return gpu_f32_to_f16(f); }
};

// ------------------------------------------------------------------ reductions

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block; every thread gets the result. `sh` holds 33 floats.
__device__ float block_sum(float v, float* sh) {
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();  // an earlier call's readers are done with sh
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    if (wid == 0) {
        float t = lane < nw ? sh[lane] : 0.0f;
        t = warp_sum(t);
        if (lane == 0) sh[32] = t;
    }
    __syncthreads();
    return sh[32];
}

__device__ float block_max(float v, float* sh) {
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    if (wid == 0) {
        float t = lane < nw ? sh[lane] : GPU_NEG_INF;
        for (int o = 16; o > 0; o >>= 1) t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, o));
        if (lane == 0) sh[32] = t;
    }
    __syncthreads();
    return sh[32];
}

