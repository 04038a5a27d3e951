// CUDA kernels of grpo_core::fused — log_softmax + gather and the entropy of the softmax, each
// with its backward — compiled at run time with NVRTC after the prelude (cuda_prelude.cu). One
// block per row of logits (rows, V) in the storage type T; per-row results and their incoming
// gradients are f32 (the dtype log-probs are computed in); the gradients to the logits are T.
// Each has the meaning of its CPU kernel in fused.rs.

// (max, log Σ exp(x − max)) of a row, every thread getting both.
template <typename T>
__device__ void row_max_lse(const typename T::S* xr, int v, float* sh, float* m, float* lse) {
    float mx = GPU_NEG_INF;
    for (int j = threadIdx.x; j < v; j += blockDim.x) mx = fmaxf(mx, T::ld(xr[j]));
    mx = block_max(mx, sh);
    float s = 0.0f;
    for (int j = threadIdx.x; j < v; j += blockDim.x) s += expf(T::ld(xr[j]) - mx);
    *m = mx;
    *lse = logf(block_sum(s, sh));
}

// out[r] = x[r, t[r]] − max − lse.
template <typename T>
__device__ void lsg_fwd(const typename T::S* x, long xo, const unsigned* t, long to, float* out,
                        int v) {
    __shared__ float sh[33];
    long r = blockIdx.x;
    const typename T::S* xr = x + xo + r * v;
    float m, lse;
    row_max_lse<T>(xr, v, sh, &m, &lse);
    unsigned id = t[to + r];
    // An id outside the vocabulary gives NaN (the CPU kernel refuses it; checking here would
    // cost a copy to the host).
    if (threadIdx.x == 0) out[r] = id < (unsigned)v ? T::ld(xr[id]) - m - lse : nanf("");
}

// dx[r, j] = g[r] · (onehot(t[r])_j − softmax(x[r])_j).
template <typename T>
__device__ void lsg_bwd(const typename T::S* x, long xo, const unsigned* t, long to,
                        const float* g, long go, typename T::S* dx, int v) {
    __shared__ float sh[33];
    long r = blockIdx.x;
    const typename T::S* xr = x + xo + r * v;
    float m, lse;
    row_max_lse<T>(xr, v, sh, &m, &lse);
    float gr = g[go + r], shift = m + lse;
    unsigned id = t[to + r];
    for (int j = threadIdx.x; j < v; j += blockDim.x) {
        float d = -gr * expf(T::ld(xr[j]) - shift);
        if ((unsigned)j == id) d += gr;
        dx[r * v + j] = T::st(d);
    }
}

// H = lse − Σ p·(x − m), p = softmax(x).
template <typename T>
__device__ void ent_fwd(const typename T::S* x, long xo, float* out, int v) {
    __shared__ float sh[33];
    long r = blockIdx.x;
    const typename T::S* xr = x + xo + r * v;
    float m, lse;
    row_max_lse<T>(xr, v, sh, &m, &lse);
    float px = 0.0f;
    for (int j = threadIdx.x; j < v; j += blockDim.x) {
        float s = T::ld(xr[j]) - m;
        px += expf(s - lse) * s;
    }
    px = block_sum(px, sh);
    if (threadIdx.x == 0) out[r] = lse - px;
}

// dH/dx_j = −p_j (log p_j + H).
template <typename T>
__device__ void ent_bwd(const typename T::S* x, long xo, const float* g, long go,
                        typename T::S* dx, int v) {
    __shared__ float sh[33];
    long r = blockIdx.x;
    const typename T::S* xr = x + xo + r * v;
    float m, lse;
    row_max_lse<T>(xr, v, sh, &m, &lse);
    float h = 0.0f;
    for (int j = threadIdx.x; j < v; j += blockDim.x) {
        float lp = T::ld(xr[j]) - m - lse;
        h -= expf(lp) * lp;
    }
    h = block_sum(h, sh);
    float gr = g[go + r];
    for (int j = threadIdx.x; j < v; j += blockDim.x) {
        float lp = T::ld(xr[j]) - m - lse;
        dx[r * v + j] = T::st(-gr * expf(lp) * (lp + h));
    }
}

#define HEAD_KERNELS(T, N)                                                                   \
    extern "C" __global__ void lsg_fwd_##N(const T::S* x, long xo, const unsigned* t,       \
                                           long to, float* out, int v) {                     \
        lsg_fwd<T>(x, xo, t, to, out, v);                                                    \
    }                                                                                        \
    extern "C" __global__ void lsg_bwd_##N(const T::S* x, long xo, const unsigned* t,       \
                                           long to, const float* g, long go, T::S* dx,       \
                                           int v) {                                          \
        lsg_bwd<T>(x, xo, t, to, g, go, dx, v);                                              \
    }                                                                                        \
    extern "C" __global__ void ent_fwd_##N(const T::S* x, long xo, float* out, int v) {     \
        ent_fwd<T>(x, xo, out, v);                                                           \
    }                                                                                        \
    extern "C" __global__ void ent_bwd_##N(const T::S* x, long xo, const float* g, long go, \
                                           T::S* dx, int v) {                                \
        ent_bwd<T>(x, xo, g, go, dx, v);                                                     \
    }

HEAD_KERNELS(F32, f32)
HEAD_KERNELS(BF16, bf16)
HEAD_KERNELS(F16, f16)
