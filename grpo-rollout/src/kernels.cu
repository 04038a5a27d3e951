// CUDA kernels of the decoder's fused ops (grpo_rollout::fused), compiled at run time with
// NVRTC after grpo-core's prelude (types, conversions, reductions: grpo-core/src/cuda_prelude.cu).
// Each has the meaning of its CPU kernel and of its candle composition in fused.rs.

// ------------------------------------------------------------------ RMSNorm

// Elements of a row a thread keeps in registers (`rms_row`, `rms_bwd`, `add_rms_fwd`): rows up
// to ROW_REGS × the block's threads take one round of loads, every load issued before the first
// use, with the loop's arithmetic in the loop's order (the same bits).
#define ROW_REGS 8

// 1 / sqrt(mean(x²) + eps) of a row held in registers (`xa[k]` = element tid + k · blockDim),
// summed in the loop's order.
template <typename T>
__device__ __forceinline__ float regs_inv(const typename T::S* xa, int h, float eps, float* sh) {
    int tid = threadIdx.x, nt = blockDim.x;
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < ROW_REGS; ++k) {
        if (tid + k * nt < h) {
            float v = T::ld(xa[k]);
            ss += v * v;
        }
    }
    ss = block_sum(ss, sh);
    return 1.0f / sqrtf(ss / (float)h + eps);
}

// RMSNorm of a row held in registers (xa, wa as `regs_inv` lays them out) into `yr`.
template <typename T>
__device__ __forceinline__ void regs_rms(const typename T::S* xa, const typename T::S* wa,
                                         typename T::S* yr, int h, float eps, float* sh) {
    int tid = threadIdx.x, nt = blockDim.x;
    float inv = regs_inv<T>(xa, h, eps, sh);
#pragma unroll
    for (int k = 0; k < ROW_REGS; ++k) {
        int i = tid + k * nt;
        if (i < h) yr[i] = T::st(T::ld(T::st(T::ld(xa[k]) * inv)) * T::ld(wa[k]));
    }
}

// A block normalises one row of `h`: y = T(T(x · inv) · w), inv = 1 / sqrt(mean(x²) + eps) —
// the composition's two roundings to the storage type. Each thread reads only the elements it
// would write (so a row the same threads just wrote needs no barrier).
template <typename T>
__device__ void rms_row(const typename T::S* xr, const typename T::S* wr, typename T::S* yr,
                        int h, float eps, float* sh) {
    int tid = threadIdx.x, nt = blockDim.x;
    if (h <= ROW_REGS * nt) {
        typename T::S xa[ROW_REGS], wa[ROW_REGS];
#pragma unroll
        for (int k = 0; k < ROW_REGS; ++k) {
            int i = tid + k * nt;
            if (i < h) {
                xa[k] = xr[i];
                wa[k] = wr[i];
            }
        }
        regs_rms<T>(xa, wa, yr, h, eps, sh);
        return;
    }
    float ss = 0.0f;
    for (int i = threadIdx.x; i < h; i += blockDim.x) {
        float v = T::ld(xr[i]);
        ss += v * v;
    }
    ss = block_sum(ss, sh);
    float inv = 1.0f / sqrtf(ss / (float)h + eps);
    for (int i = threadIdx.x; i < h; i += blockDim.x)
        yr[i] = T::st(T::ld(T::st(T::ld(xr[i]) * inv)) * T::ld(wr[i]));
}

// One block per row.
template <typename T>
__device__ void rms_fwd(const typename T::S* x, long xo, const typename T::S* w, long wo,
                        typename T::S* y, int h, float eps) {
    __shared__ float sh[33];
    long r = blockIdx.x;
    rms_row<T>(x + xo + r * h, w + wo, y + r * h, h, eps, sh);
}

// Backward, rows split over the grid: dx (rows · h, into out[0..]) and one f32 partial of dw
// per block (`partial` is gridDim.x × h), summed in block order by `col_sum`.
// xhat = x·inv; dx = inv · (g·w − xhat · mean(g·w·xhat)); dw = Σ_rows g·xhat.
template <typename T>
__device__ void rms_bwd(const typename T::S* x, long xo, const typename T::S* w, long wo,
                        const typename T::S* g, long go, typename T::S* dx, float* partial,
                        int rows, int h, float eps) {
    __shared__ float sh[33];
    GPU_DYNAMIC_SHARED(pw);  // h floats
    const typename T::S* wr = w + wo;
    int tid = threadIdx.x, nt = blockDim.x;
    if (h <= ROW_REGS * nt) {
        // Rows that fit in registers: w and the dw partial held for the whole walk, each row's
        // x and g loaded once, the next row's loads issued before this row's reductions (the
        // kernel's time is otherwise its chain of memory latencies); the loop's arithmetic in
        // the loop's order below: the same bits.
        float wv[ROW_REGS], pr[ROW_REGS];
        typename T::S xa[ROW_REGS], ga[ROW_REGS], xn[ROW_REGS], gn[ROW_REGS];
#pragma unroll
        for (int k = 0; k < ROW_REGS; ++k) {
            int i = tid + k * nt;
            wv[k] = i < h ? T::ld(wr[i]) : 0.0f;
            pr[k] = 0.0f;
        }
        auto load = [&](typename T::S* xd, typename T::S* gd, int r) {
#pragma unroll
            for (int k = 0; k < ROW_REGS; ++k) {
                int i = tid + k * nt;
                if (r < rows && i < h) {
                    xd[k] = x[xo + (long)r * h + i];
                    gd[k] = g[go + (long)r * h + i];
                }
            }
        };
        load(xa, ga, blockIdx.x);
        for (int r = blockIdx.x; r < rows; r += gridDim.x) {
            load(xn, gn, r + gridDim.x);
            float inv = regs_inv<T>(xa, h, eps, sh);
            float dot = 0.0f;
#pragma unroll
            for (int k = 0; k < ROW_REGS; ++k)
                if (tid + k * nt < h) dot += T::ld(ga[k]) * wv[k] * T::ld(xa[k]) * inv;
            float mean = block_sum(dot, sh) / (float)h;
#pragma unroll
            for (int k = 0; k < ROW_REGS; ++k) {
                int i = tid + k * nt;
                if (i < h) {
                    float xh = T::ld(xa[k]) * inv, gv = T::ld(ga[k]);
                    pr[k] += gv * xh;
                    dx[(long)r * h + i] = T::st(inv * (gv * wv[k] - xh * mean));
                }
                xa[k] = xn[k];
                ga[k] = gn[k];
            }
        }
#pragma unroll
        for (int k = 0; k < ROW_REGS; ++k) {
            int i = tid + k * nt;
            if (i < h) partial[(long)blockIdx.x * h + i] = pr[k];
        }
        return;
    }
    for (int i = threadIdx.x; i < h; i += blockDim.x) pw[i] = 0.0f;
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const typename T::S* xr = x + xo + (long)r * h;
        const typename T::S* gr = g + go + (long)r * h;
        float ss = 0.0f;
        for (int i = threadIdx.x; i < h; i += blockDim.x) {
            float v = T::ld(xr[i]);
            ss += v * v;
        }
        ss = block_sum(ss, sh);
        float inv = 1.0f / sqrtf(ss / (float)h + eps);
        float dot = 0.0f;
        for (int i = threadIdx.x; i < h; i += blockDim.x)
            dot += T::ld(gr[i]) * T::ld(wr[i]) * T::ld(xr[i]) * inv;
        float mean = block_sum(dot, sh) / (float)h;
        for (int i = threadIdx.x; i < h; i += blockDim.x) {
            float xh = T::ld(xr[i]) * inv, gv = T::ld(gr[i]);
            pw[i] += gv * xh;
            dx[(long)r * h + i] = T::st(inv * (gv * T::ld(wr[i]) - xh * mean));
        }
    }
    for (int i = threadIdx.x; i < h; i += blockDim.x) partial[(long)blockIdx.x * h + i] = pw[i];
}

// out[oo + c] = Σ_b partial[b · cols + c] over `blocks` rows, in row order (deterministic).
template <typename T>
__device__ void col_sum(const float* partial, int blocks, int cols, typename T::S* out,
                        long oo) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    float s = 0.0f;
    for (int b = 0; b < blocks; ++b) s += partial[(long)b * cols + c];
    out[oo + c] = T::st(s);
}

// Residual add fused with the RMSNorm that follows it (inference: decoding, frozen passes).
// One block per row of `h`: s = T(x + r), y = T(T(s · inv) · w); out = [s (n), y (n)]. A row
// that fits is read once into registers (a decode step's rows are few: the kernel's time is
// its chain of memory latencies), with rms_row's arithmetic: the same bits.
template <typename T>
__device__ void add_rms_fwd(const typename T::S* x, long xo, const typename T::S* r, long ro,
                            const typename T::S* w, long wo, typename T::S* out, long n, int h,
                            float eps) {
    __shared__ float sh[33];
    long row = blockIdx.x;
    const typename T::S* xr = x + xo + row * h;
    const typename T::S* rr = r + ro + row * h;
    const typename T::S* wr = w + wo;
    typename T::S* sr = out + row * h;
    typename T::S* yr = out + n + row * h;
    int tid = threadIdx.x, nt = blockDim.x;
    if (h <= ROW_REGS * nt) {
        typename T::S xa[ROW_REGS], ra[ROW_REGS], wa[ROW_REGS];
#pragma unroll
        for (int k = 0; k < ROW_REGS; ++k) {
            int i = tid + k * nt;
            if (i < h) {
                xa[k] = xr[i];
                ra[k] = rr[i];
                wa[k] = wr[i];
            }
        }
        typename T::S sa[ROW_REGS];
#pragma unroll
        for (int k = 0; k < ROW_REGS; ++k) {
            int i = tid + k * nt;
            if (i < h) {
                sa[k] = T::st(T::ld(xa[k]) + T::ld(ra[k]));
                sr[i] = sa[k];
            }
        }
        regs_rms<T>(sa, wa, yr, h, eps, sh);
        return;
    }
    for (int i = tid; i < h; i += nt) sr[i] = T::st(T::ld(xr[i]) + T::ld(rr[i]));
    rms_row<T>(sr, wr, yr, h, eps, sh);
}

// ------------------------------------------------------------------ RoPE

// "Rotate half" rotary embedding fused with the head transpose. Forward: x (B, L, H, D) →
// out (B, H, L, D), rotation by +θ; inverse (its backward): x (B, H, L, D) → out (B, L, H, D),
// by −θ. cos, sin: (B, L, D/2). One thread per output pair (i, i + D/2).
template <typename T>
__device__ void rope(const typename T::S* x, long xo, const typename T::S* c, long co,
                     const typename T::S* s, long so, typename T::S* out, int b, int l, int h,
                     int d, int inverse) {
    int half = d / 2;
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    long total = (long)b * h * l * half;
    if (idx >= total) return;
    long r = idx / half;
    int i = (int)(idx % half);
    long bi, hi, li, src;
    if (inverse) {
        bi = r / ((long)l * h); hi = r % h; li = (r / h) % l;
        src = ((bi * h + hi) * l + li) * d;
    } else {
        bi = r / ((long)h * l); hi = (r / l) % h; li = r % l;
        src = ((bi * l + li) * h + hi) * d;
    }
    long t = (bi * l + li) * half + i;
    float cv = T::ld(c[co + t]), sv = T::ld(s[so + t]);
    if (inverse) sv = -sv;
    float x1 = T::ld(x[xo + src + i]), x2 = T::ld(x[xo + src + i + half]);
    out[r * d + i] = T::st(x1 * cv - x2 * sv);
    out[r * d + i + half] = T::st(x2 * cv + x1 * sv);
}

// A decode step's new keys or values written into a KV cache in place: x (B, L, G, D) (a
// projection's output) goes to cache (B, G, cap, D) at positions past .. past + L, keys rotated
// by θ (cos, sin: (B, L, D/2)), values copied (rotate = 0: the storage bits move unchanged).
// One thread per output pair (i, i + D/2).
template <typename T>
__device__ void kv_write(typename T::S* cache, long cap, const typename T::S* x, long xo,
                         const typename T::S* c, long co, const typename T::S* s, long so,
                         int b, int l, int g, int d, long past, int rotate) {
    int half = d / 2;
    long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long)b * l * g * half) return;
    long r = idx / half;
    int i = (int)(idx % half);
    long gi = r % g, li = (r / g) % l, bi = r / ((long)g * l);
    const typename T::S* src = x + xo + r * d;
    typename T::S* dst = cache + ((bi * g + gi) * cap + past + li) * d;
    if (rotate) {
        long t = (bi * l + li) * half + i;
        float cv = T::ld(c[co + t]), sv = T::ld(s[so + t]);
        float x1 = T::ld(src[i]), x2 = T::ld(src[i + half]);
        dst[i] = T::st(x1 * cv - x2 * sv);
        dst[i + half] = T::st(x2 * cv + x1 * sv);
    } else {
        dst[i] = src[i];
        dst[i + half] = src[i + half];
    }
}

// ------------------------------------------------------------------ SiLU · mul

// out (n = rows · cols, contiguous) = T(silu(a)) · u; a and u are rows of `cols` elements `as`
// and `us` apart (one row: the tensors are contiguous; gate and up halves of the packed MLP
// product: both rows 2·cols apart, up starting cols after gate).
template <typename T>
__device__ void silu_mul_fwd(const typename T::S* a, long ao, long as, const typename T::S* u,
                             long uo, long us, typename T::S* out, long n, long cols) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    long r = i / cols, c = i % cols;
    float av = T::ld(a[ao + r * as + c]);
    float silu = T::ld(T::st(av / (1.0f + expf(-av))));
    out[i] = T::st(silu * T::ld(u[uo + r * us + c]));
}

// out = [da (n), du (n)]: da = g·u·σ(a)·(1 + a·(1 − σ(a))), du = g·silu(a).
template <typename T>
__device__ void silu_mul_bwd(const typename T::S* a, long ao, const typename T::S* u, long uo,
                             const typename T::S* g, long go, typename T::S* out, long n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float av = T::ld(a[ao + i]), uv = T::ld(u[uo + i]), gv = T::ld(g[go + i]);
    float sg = 1.0f / (1.0f + expf(-av));
    out[i] = T::st(gv * uv * sg * (1.0f + av * (1.0f - sg)));
    out[n + i] = T::st(gv * av * sg);
}

// The backward of `silu(gate) · up` over packed rows gu = [gate | up] (rows, 2·cols): out rows
// [dgate | dup] in the same layout, the arithmetic of silu_mul_bwd.
template <typename T>
__device__ void silu_mul_packed_bwd(const typename T::S* gu, long guo, const typename T::S* g,
                                    long go, typename T::S* out, long rows, int cols) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * cols) return;
    long r = i / cols, c = i % cols, at = r * 2 * cols + c;
    float av = T::ld(gu[guo + at]), uv = T::ld(gu[guo + at + cols]), gv = T::ld(g[go + i]);
    float sg = 1.0f / (1.0f + expf(-av));
    out[at] = T::st(gv * uv * sg * (1.0f + av * (1.0f - sg)));
    out[at + cols] = T::st(gv * av * sg);
}

// ------------------------------------------------------------------ attention softmax

// One block per row of `s` scores (B, H, L, S): p = softmax(x · scale + bias), bias (B, 1, L, S).
template <typename T>
__device__ void softmax_fwd(const typename T::S* x, long xo, const typename T::S* m, long mo,
                            typename T::S* out, int h, int l, int s, float scale) {
    __shared__ float sh[33];
    long r = blockIdx.x;
    long bi = r / ((long)h * l), li = r % l;
    const typename T::S* xr = x + xo + r * s;
    const typename T::S* mr = m + mo + (bi * l + li) * s;
    typename T::S* orow = out + r * s;
    float mx = GPU_NEG_INF;
    for (int j = threadIdx.x; j < s; j += blockDim.x)
        mx = fmaxf(mx, T::ld(xr[j]) * scale + T::ld(mr[j]));
    mx = block_max(mx, sh);
    float sum = 0.0f;
    for (int j = threadIdx.x; j < s; j += blockDim.x)
        sum += expf(T::ld(xr[j]) * scale + T::ld(mr[j]) - mx);
    float inv = 1.0f / block_sum(sum, sh);
    for (int j = threadIdx.x; j < s; j += blockDim.x)
        orow[j] = T::st(expf(T::ld(xr[j]) * scale + T::ld(mr[j]) - mx) * inv);
}

// Backward per row: scale · p · (g − Σ_j p_j g_j).
template <typename T>
__device__ void softmax_bwd(const typename T::S* p, long po, const typename T::S* g, long go,
                            typename T::S* out, int s, float scale) {
    __shared__ float sh[33];
    long r = blockIdx.x;
    const typename T::S* pr = p + po + r * s;
    const typename T::S* gr = g + go + r * s;
    float dot = 0.0f;
    for (int j = threadIdx.x; j < s; j += blockDim.x) dot += T::ld(pr[j]) * T::ld(gr[j]);
    dot = block_sum(dot, sh);
    for (int j = threadIdx.x; j < s; j += blockDim.x)
        out[r * s + j] = T::st(scale * T::ld(pr[j]) * (T::ld(gr[j]) - dot));
}

// ------------------------------------------------------------------ attention (few queries)

// Grouped-query attention for a few query positions over many keys (decoding over a KV cache):
// one block per (batch, kv head, its query heads, query row), keys in tiles (`attend`).
// D ≤ 256, blockDim = ATTN_THREADS.
#define ATTN_MAX_D 256

// Keys and values of one (batch, kv head): rows `ks` / `vs` elements apart, unit stride along D
// (a KV cache's view).
template <typename T>
struct CacheRows {
    const typename T::S* k;
    long ks;
    const typename T::S* v;
    long vs;
    __device__ float key(long j, int e) const { return T::ld(k[j * ks + e]); }
    __device__ float value(long j, int e) const { return T::ld(v[j * vs + e]); }
    // Key j's stored row (every row here is stored).
    __device__ const typename T::S* stored_key(long j) const { return k + j * ks; }
    // Keys 0 .. stored() are read from memory as they are (`stored_value`: a plain load).
    __device__ long stored() const { return 1L << 62; }
    __device__ float stored_value(long j, int e) const { return value(j, e); }
};

// Element i of a projection's output row `x` with its bias `b` (null: none) added, rounded to
// the storage type as the separate add would store it.
template <typename T>
__device__ __forceinline__ float biased(const typename T::S* x, const typename T::S* b, long i) {
    return b ? T::ld(T::st(T::ld(x[i]) + T::ld(b[i]))) : T::ld(x[i]);
}

// Element `e` of row `x` (bias `b`, null: none) rotated by the table entries of its pair,
// rounded to the storage type: the value RoPE and the KV-cache writes store.
template <typename T>
__device__ __forceinline__ float rotated(const typename T::S* x, const typename T::S* c,
                                         const typename T::S* s, int e, int half,
                                         const typename T::S* b = nullptr) {
    int i = e < half ? e : e - half;
    float cv = T::ld(c[i]), sv = T::ld(s[i]);
    float x1 = biased<T>(x, b, i), x2 = biased<T>(x, b, i + half);
    return T::ld(T::st(e < half ? x1 * cv - x2 * sv : x2 * cv + x1 * sv));
}

// The cache's first `past` positions, then this step's keys (rotated on the fly) and values
// straight from the packed projections, `ns` elements per position (no block reads a position
// that this launch writes into the cache).
template <typename T>
struct PackedRows {
    CacheRows<T> cache;
    long past, ns;
    const typename T::S* kn;
    const typename T::S* vn;
    const typename T::S* c;  // this batch row's tables, half entries per position
    const typename T::S* s;
    int half;
    const typename T::S* kb;  // the key and value parts' biases (null: none)
    const typename T::S* vb;
    __device__ float key(long j, int e) const {
        if (j < past) return cache.key(j, e);
        long r = j - past;
        return rotated<T>(kn + r * ns, c + r * half, s + r * half, e, half, kb);
    }
    __device__ float value(long j, int e) const {
        return j < past ? cache.value(j, e) : biased<T>(vn + (j - past) * ns, vb, e);
    }
    // Key j's stored row, or null for this step's keys (rotated on the fly).
    __device__ const typename T::S* stored_key(long j) const {
        return j < past ? cache.stored_key(j) : nullptr;
    }
    __device__ long stored() const { return past; }
    __device__ float stored_value(long j, int e) const { return cache.value(j, e); }
};

// Keys per tile of `attend`.
#define ATTN_TILE 256

// 16 bytes loaded in one instruction: 8 bf16/f16 or 4 f32 values, or 4 f32 of shared memory.
struct alignas(16) Vec16 {
    unsigned u[4];
};
template <typename T>
union Lanes16 {
    Vec16 v;
    typename T::S s[16 / sizeof(typename T::S)];
};

// 16-byte loads of a key row in flight at once.
#define KEY_BATCH 4

// dot[h] += Σ_x qs[h][x] · key[x] for the heads below `heads`, x in order: the same arithmetic
// whether the key is read element by element (`kv.key`) or, for a stored row that allows it,
// in 16-byte loads (with the queries' rows in 16-byte shared loads).
template <typename T, int G, typename Rows>
__device__ __forceinline__ void score_key(float* dot, const float (*qs)[ATTN_MAX_D], int heads,
                                          const Rows& kv, long j, int d) {
    const int n = 16 / sizeof(typename T::S);
    const typename T::S* row = kv.stored_key(j);
    if (row && d % n == 0 && ((unsigned long long)row & 15) == 0) {
        // KEY_BATCH loads issued before the first product (each would otherwise wait for the
        // one before it: the heads' early exit keeps the compiler from hoisting them).
        for (int x0 = 0; x0 < d; x0 += KEY_BATCH * n) {
            Lanes16<T> kl[KEY_BATCH];
#pragma unroll
            for (int b = 0; b < KEY_BATCH; ++b)
                if (x0 + b * n < d) kl[b].v = *reinterpret_cast<const Vec16*>(row + x0 + b * n);
#pragma unroll
            for (int b = 0; b < KEY_BATCH; ++b) {
                int x = x0 + b * n;
                if (x >= d) break;
#pragma unroll
                for (int c = 0; c < n; c += 4) {
#pragma unroll
                    for (int h = 0; h < G; ++h) {
                        if (h >= heads) break;
                        Vec16 q = *reinterpret_cast<const Vec16*>(&qs[h][x + c]);
#pragma unroll
                        for (int u = 0; u < 4; ++u)
                            dot[h] += __uint_as_float(q.u[u]) * T::ld(kl[b].s[c + u]);
                    }
                }
            }
        }
        return;
    }
    for (int x = 0; x < d; ++x) {
        float k = kv.key(j, x);
#pragma unroll
        for (int h = 0; h < G; ++h)
            if (h < heads) dot[h] += qs[h][x] * k;
    }
}

// Values a thread loads before it uses the first of them (stored keys): one load's latency is
// hidden behind the others' instead of each waiting for the last.
#define GATHER_BATCH 8

// Output accumulation over a tile of `n` keys from j0: acc[h] is this thread's part of element
// e of head h, over the tile's keys kg, kg + groups, ... (the `groups` = blockDim / d threads
// of an element split its keys, each value read by one thread for every head); rescaled by the
// tile's correction first. A thread's keys are summed in order whatever the batching.
template <typename T, int G, typename Rows>
__device__ __forceinline__ void gather_values(float* acc, const float (*pr)[ATTN_TILE],
                                              const float* corr, const Rows& kv, long j0, int n,
                                              int e, int kg, int groups, int heads) {
#pragma unroll
    for (int h = 0; h < G; ++h)
        if (h < heads) acc[h] *= corr[h];
    long left = kv.stored() - j0;
    int stored = left <= 0 ? 0 : (left < n ? (int)left : n), jj = kg;
    for (; jj + (GATHER_BATCH - 1) * groups < stored; jj += GATHER_BATCH * groups) {
        float v[GATHER_BATCH];
#pragma unroll
        for (int u = 0; u < GATHER_BATCH; ++u) v[u] = kv.stored_value(j0 + jj + u * groups, e);
#pragma unroll
        for (int u = 0; u < GATHER_BATCH; ++u)
#pragma unroll
            for (int h = 0; h < G; ++h)
                if (h < heads) acc[h] += pr[h][jj + u * groups] * v[u];
    }
    for (; jj < n; jj += groups) {
        float v = kv.value(j0 + jj, e);
#pragma unroll
        for (int h = 0; h < G; ++h)
            if (h < heads) acc[h] += pr[h][jj] * v;
    }
}

// softmax(qs[h] · kᵀ + bias row) · v over keys 0..s into `orow + h·d` (d ≤ ATTN_MAX_D) for each
// of `heads` ≤ G query rows qs[h] (already scaled, in shared memory) that share one kv head:
// each key and value is read once for all of them. Keys go in tiles of ATTN_TILE: each thread
// scores its own keys of the tile for every head (a dot over d, no shuffles), warp w then takes
// heads w, w + warps, ... for the tile's maximum and probabilities (an online softmax across
// tiles), and each thread accumulates one element of the output for every head over its share
// of the tile's values (`groups` = ATTN_THREADS / d threads split an element's keys, each value
// read once for all heads); the shares are summed in a fixed order at the end. A head's
// arithmetic is the same, in the same order, whatever G and `heads` are. A key masked with −inf
// (f16's mask too) has no weight.
// Threads of an attention block: the launch's block size, whatever the number of keys.
#define ATTN_THREADS 256
static_assert(ATTN_THREADS <= ATTN_TILE, "attend sums the output shares through pr");
template <typename T, int G, typename Rows>
__device__ void attend(const float (*qs)[ATTN_MAX_D], int heads, const Rows& kv,
                       const typename T::S* br, int s, int d, typename T::S* orow) {
    alignas(16) __shared__ float pr[G][ATTN_TILE];
    __shared__ float mh[G], lh[G], corr[G];
    int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, w = tid >> 5, nw = nt >> 5;
    // Output element e of every head, over keys kg, kg + groups, ... of each tile (threads from
    // groups · d on own none).
    int groups = nt / d, e = tid % d, kg = tid / d;
    bool owner = tid < groups * d;
    if (tid < G) {
        mh[tid] = GPU_NEG_INF;
        lh[tid] = 0.0f;
    }
    float acc[G];
#pragma unroll
    for (int t = 0; t < G; ++t) acc[t] = 0.0f;
    for (int j0 = 0; j0 < s; j0 += ATTN_TILE) {
        int n = s - j0 < ATTN_TILE ? s - j0 : ATTN_TILE;
        for (int jj = tid; jj < n; jj += nt) {
            long j = j0 + jj;
            float dot[G];
#pragma unroll
            for (int h = 0; h < G; ++h) dot[h] = 0.0f;
            score_key<T, G>(dot, qs, heads, kv, j, d);
            float bj = T::ld(br[j]);
#pragma unroll
            for (int h = 0; h < G; ++h)
                if (h < heads) pr[h][jj] = dot[h] + bj;
        }
        __syncthreads();
        for (int h = w; h < heads; h += nw) {
            float mx = GPU_NEG_INF;
            for (int jj = lane; jj < n; jj += 32) mx = fmaxf(mx, pr[h][jj]);
            float mn = fmaxf(mh[h], warp_max(mx));
            float sum = 0.0f;
            for (int jj = lane; jj < n; jj += 32) {
                float sc = pr[h][jj];
                float p = sc == GPU_NEG_INF ? 0.0f : expf(sc - mn);
                pr[h][jj] = p;
                sum += p;
            }
            sum = warp_sum(sum);
            __syncwarp();
            if (lane == 0) {
                float c = mh[h] == GPU_NEG_INF ? 0.0f : expf(mh[h] - mn);
                corr[h] = c;
                lh[h] = lh[h] * c + sum;
                mh[h] = mn;
            }
        }
        __syncthreads();
        if (owner) gather_values<T, G>(acc, pr, corr, kv, j0, n, e, kg, groups, heads);
        __syncthreads();  // the tile's readers are done with pr before the next tile
    }
    // The shares of each element, through pr (ATTN_THREADS ≤ ATTN_TILE), summed in share order.
    if (owner) {
#pragma unroll
        for (int h = 0; h < G; ++h)
            if (h < heads) pr[h][tid] = acc[h];
    }
    __syncthreads();
    for (int i = tid; i < heads * d; i += nt) {
        int h = i / d, x = i % d;
        float sum = 0.0f;
        for (int g = 0; g < groups; ++g) sum += pr[h][g * d + x];
        orow[(long)h * d + x] = T::st(sum / lh[h]);
    }
}

// Query heads one attention block serves: those of a kv head (grouped-query attention),
// ATTN_GROUP at a time, so that each key and value is read once for them.
#define ATTN_GROUP 8

// The block of an attention launch of B · G · chunks · L blocks: batch row, kv head, its first
// query head h0 and how many it serves, query position.
struct GroupBlock {
    long bi;
    int g, h0, heads, i;
};
__device__ __forceinline__ GroupBlock group_block(int nh, int nkv, int l) {
    int grp = nh / nkv, chunks = (grp + ATTN_GROUP - 1) / ATTN_GROUP;
    long blk = blockIdx.x;
    GroupBlock at;
    at.i = (int)(blk % l);
    int ch = (int)((blk / l) % chunks);
    at.g = (int)((blk / ((long)l * chunks)) % nkv);
    at.bi = blk / ((long)l * chunks * nkv);
    at.h0 = at.g * grp + ch * ATTN_GROUP;
    at.heads = grp - ch * ATTN_GROUP < ATTN_GROUP ? grp - ch * ATTN_GROUP : ATTN_GROUP;
    return at;
}

// q (B, H, L, D) contiguous; k, v (B, G, S, D) with element strides (kb, kg, ks) and (vb, vg, vs)
// and unit stride along D; bias (B, 1, L, S); out rows (B·L, H·D); d ≤ ATTN_MAX_D. One block
// per (batch, kv head, up to ATTN_GROUP of its query heads, query row).
template <typename T>
__device__ void attention_rows(const typename T::S* q, long qo, const typename T::S* k, long ko,
                               long kb, long kg, long ks, const typename T::S* v, long vo,
                               long vb, long vg, long vs, const typename T::S* bias, long bo,
                               typename T::S* out, int nh, int nkv, int l, int s, int d,
                               float scale) {
    alignas(16) __shared__ float qs[ATTN_GROUP][ATTN_MAX_D];
    GroupBlock at = group_block(nh, nkv, l);
    long bi = at.bi;
    int g = at.g, i = at.i;
    for (int h = 0; h < at.heads; ++h) {
        const typename T::S* qr = q + qo + ((bi * nh + at.h0 + h) * l + i) * d;
        for (int t = threadIdx.x; t < d; t += blockDim.x) qs[h][t] = T::ld(qr[t]) * scale;
    }
    __syncthreads();
    CacheRows<T> kv = {k + ko + bi * kb + g * kg, ks, v + vo + bi * vb + g * vg, vs};
    attend<T, ATTN_GROUP>(qs, at.heads, kv, bias + bo + (bi * l + i) * s, s, d,
                          out + (bi * l + i) * ((long)nh * d) + (long)at.h0 * d);
}

// A pass over a KV cache after the packed q/k/v product, in one launch: RoPE on the queries, the
// new keys (rotated) and values written into the caches, attention over past + L positions — what
// rope, two kv_writes and attention_rows do, to the same bits. qkv (B, L, H + 2G, D) contiguous
// (q heads, then k, then v); caches (B, G, cap, D) whole contiguous buffers; cos, sin (B, L, D/2);
// bias (B, 1, L, ·) with rows `bstride` apart, of which the first past + L are read; out rows
// (B·L, H·D). One block per (batch, kv head, up to ATTN_GROUP of its query heads, query row),
// reading each cached key and value once for those heads; the block of a kv head's first query
// heads also writes its row for its query position. d ≤ ATTN_MAX_D. `pastp`, when not null,
// holds the cached length in device memory and takes the place of `past` (a decode step
// replayed from a CUDA graph, whose arguments are fixed at its capture). `pb`, when not null, is
// the packed projection's bias ((H + 2G)·D), added to q, k and v as they are read (rounded as
// the separate add would store them): one launch less per layer.
template <typename T>
__device__ void cached_attention(const typename T::S* qkv, long qo, typename T::S* kc,
                                 typename T::S* vc, long cap, const typename T::S* c, long co,
                                 const typename T::S* sn, long so, const typename T::S* bias,
                                 long bo, long bstride, typename T::S* out, int nh, int nkv,
                                 int l, long past, const unsigned* pastp, int d, float scale,
                                 const typename T::S* pb) {
    alignas(16) __shared__ float qs[ATTN_GROUP][ATTN_MAX_D];
    if (pastp) {  // a length past the capacity (never written so) is kept inside the cache
        past = (long)*pastp;
        if (past > cap - l) past = cap - l > 0 ? cap - l : 0;
    }
    GroupBlock at = group_block(nh, nkv, l);
    long bi = at.bi;
    int g = at.g, i = at.i, h0 = at.h0, heads = at.heads, half = d / 2;
    long ns = (long)(nh + 2 * nkv) * d, s = past + l;
    const typename T::S* kb = pb ? pb + (long)(nh + g) * d : nullptr;
    const typename T::S* vb = pb ? pb + (long)(nh + nkv + g) * d : nullptr;
    const typename T::S* row = qkv + qo + (bi * l + i) * ns;
    const typename T::S* ct = c + co + (bi * l + i) * half;
    const typename T::S* st = sn + so + (bi * l + i) * half;
    for (int h = 0; h < heads; ++h)
        for (int t = threadIdx.x; t < d; t += blockDim.x)
            qs[h][t] = rotated<T>(row + (long)(h0 + h) * d, ct, st, t, half,
                                  pb ? pb + (long)(h0 + h) * d : nullptr) *
                       scale;
    if (h0 == g * (nh / nkv)) {  // the block of the kv head's first query heads
        long at = ((bi * nkv + g) * cap + past + i) * d;
        for (int t = threadIdx.x; t < d; t += blockDim.x) {
            kc[at + t] = T::st(rotated<T>(row + (long)(nh + g) * d, ct, st, t, half, kb));
            const typename T::S* vr = row + (long)(nh + nkv + g) * d;
            vc[at + t] = vb ? T::st(biased<T>(vr, vb, t)) : vr[t];
        }
    }
    __syncthreads();
    const typename T::S* base = qkv + qo + bi * l * ns;
    PackedRows<T> kv = {
        {kc + (bi * nkv + g) * cap * d, d, vc + (bi * nkv + g) * cap * d, d},
        past,
        ns,
        base + (long)(nh + g) * d,
        base + (long)(nh + nkv + g) * d,
        c + co + bi * l * half,
        sn + so + bi * l * half,
        half,
        kb,
        vb};
    attend<T, ATTN_GROUP>(qs, heads, kv, bias + bo + (bi * l + i) * bstride, (int)s, d,
                          out + (bi * l + i) * ((long)nh * d) + (long)h0 * d);
}

// ------------------------------------------------------------------ entry points

#define S_OF(T) T::S
#define ATTENTION_ROWS(T, N)                                                                \
    extern "C" __global__ void attention_rows_##N(                                          \
        const S_OF(T) * q, long qo, const S_OF(T) * k, long ko, long kb, long kg, long ks,  \
        const S_OF(T) * v, long vo, long vb, long vg, long vs, const S_OF(T) * bias,        \
        long bo, S_OF(T) * out, int nh, int nkv, int l, int s, int d, float scale) {        \
        attention_rows<T>(q, qo, k, ko, kb, kg, ks, v, vo, vb, vg, vs, bias, bo, out, nh,   \
                          nkv, l, s, d, scale);                                             \
    }
#define CACHED_ATTENTION(T, N)                                                              \
    extern "C" __global__ void cached_attention_##N(                                        \
        const S_OF(T) * qkv, long qo, S_OF(T) * kc, S_OF(T) * vc, long cap,                 \
        const S_OF(T) * c, long co, const S_OF(T) * s, long so, const S_OF(T) * bias,       \
        long bo, long bstride, S_OF(T) * out, int nh, int nkv, int l, long past,            \
        const unsigned* pastp, int d, float scale, const S_OF(T) * pb) {                    \
        cached_attention<T>(qkv, qo, kc, vc, cap, c, co, s, so, bias, bo, bstride, out,     \
                            nh, nkv, l, past, pastp, d, scale, pb);                         \
    }
#define GRPO_KERNELS(T, N)                                                                   \
    extern "C" __global__ void rms_fwd_##N(const S_OF(T) * x, long xo, const S_OF(T) * w,   \
                                           long wo, S_OF(T) * y, int h, float eps) {        \
        rms_fwd<T>(x, xo, w, wo, y, h, eps);                                                 \
    }                                                                                        \
    extern "C" __global__ void rms_bwd_##N(const S_OF(T) * x, long xo, const S_OF(T) * w,   \
                                           long wo, const S_OF(T) * g, long go,             \
                                           S_OF(T) * dx, float* partial, int rows, int h,   \
                                           float eps) {                                      \
        rms_bwd<T>(x, xo, w, wo, g, go, dx, partial, rows, h, eps);                          \
    }                                                                                        \
    extern "C" __global__ void col_sum_##N(const float* partial, int blocks, int cols,      \
                                           S_OF(T) * out, long oo) {                         \
        col_sum<T>(partial, blocks, cols, out, oo);                                          \
    }                                                                                        \
    extern "C" __global__ void add_rms_fwd_##N(const S_OF(T) * x, long xo,                 \
                                               const S_OF(T) * r, long ro,                   \
                                               const S_OF(T) * w, long wo, S_OF(T) * out,   \
                                               long n, int h, float eps) {                   \
        add_rms_fwd<T>(x, xo, r, ro, w, wo, out, n, h, eps);                                 \
    }                                                                                        \
    extern "C" __global__ void kv_write_##N(S_OF(T) * cache, long cap, const S_OF(T) * x,   \
                                            long xo, const S_OF(T) * c, long co,             \
                                            const S_OF(T) * s, long so, int b, int l, int g, \
                                            int d, long past, int rotate) {                  \
        kv_write<T>(cache, cap, x, xo, c, co, s, so, b, l, g, d, past, rotate);              \
    }                                                                                        \
    extern "C" __global__ void rope_##N(const S_OF(T) * x, long xo, const S_OF(T) * c,      \
                                        long co, const S_OF(T) * s, long so, S_OF(T) * out, \
                                        int b, int l, int h, int d, int inverse) {           \
        rope<T>(x, xo, c, co, s, so, out, b, l, h, d, inverse);                              \
    }                                                                                        \
    extern "C" __global__ void silu_mul_fwd_##N(const S_OF(T) * a, long ao, long as,        \
                                                const S_OF(T) * u, long uo, long us,         \
                                                S_OF(T) * out, long n, long cols) {          \
        silu_mul_fwd<T>(a, ao, as, u, uo, us, out, n, cols);                                 \
    }                                                                                        \
    extern "C" __global__ void silu_mul_bwd_##N(const S_OF(T) * a, long ao,                 \
                                                const S_OF(T) * u, long uo,                  \
                                                const S_OF(T) * g, long go, S_OF(T) * out,  \
                                                long n) {                                    \
        silu_mul_bwd<T>(a, ao, u, uo, g, go, out, n);                                        \
    }                                                                                        \
    extern "C" __global__ void silu_mul_packed_bwd_##N(const S_OF(T) * gu, long guo,        \
                                                       const S_OF(T) * g, long go,          \
                                                       S_OF(T) * out, long rows, int cols) { \
        silu_mul_packed_bwd<T>(gu, guo, g, go, out, rows, cols);                             \
    }                                                                                        \
    extern "C" __global__ void softmax_fwd_##N(const S_OF(T) * x, long xo,                  \
                                               const S_OF(T) * m, long mo, S_OF(T) * out,   \
                                               int h, int l, int s, float scale) {           \
        softmax_fwd<T>(x, xo, m, mo, out, h, l, s, scale);                                   \
    }                                                                                        \
    extern "C" __global__ void softmax_bwd_##N(const S_OF(T) * p, long po,                  \
                                               const S_OF(T) * g, long go, S_OF(T) * out,   \
                                               int s, float scale) {                         \
        softmax_bwd<T>(p, po, g, go, out, s, scale);                                         \
    }                                                                                        \
    ATTENTION_ROWS(T, N)                                                                     \
    CACHED_ATTENTION(T, N)

GRPO_KERNELS(F32, f32)
GRPO_KERNELS(BF16, bf16)
GRPO_KERNELS(F16, f16)

// ------------------------------------------------------------------ sampling

// One decode step's sampling, one block per row, with the meaning of grpo_rollout::sample's
// DeviceSampler (and of the host sampler): logit bias, repetition penalty, stop ids suppressed
// before min_new_tokens, temperature, top-k and top-p thresholds found by BISECTIONS halvings
// of the value range, min-p, then the first token whose cumulative weight exceeds u · Σw
// (capped at the last token of positive weight). The recorded log-prob is
// log_softmax(raw / t) at the token. logits (n, ≥ v) rows of stride `ld`; bias, stop (v) and
// seen (n, v) f32 are read when their flag is set; su (n, 2) f32 = (suppress, u) per row.
// out (n, 2) f32 = (token, recorded log-prob); ids (n) u32 = token.
#define SAMPLE_BISECTIONS 48

struct SampleParams {
    float t, rp, top_p, min_p;
    int greedy, top_k, v, has_bias, has_seen, has_stop;
};

template <typename T>
__device__ __forceinline__ float sample_logit(const typename T::S* xr, const float* bias,
                                              const float* seen_r, const float* stop,
                                              bool suppress, const SampleParams& p, int j) {
    float l = T::ld(xr[j]);
    if (p.has_bias) l += bias[j];
    if (p.has_seen && seen_r[j] != 0.0f) l = l < 0.0f ? l * p.rp : l / p.rp;
    if (p.has_stop && suppress && stop[j] != 0.0f) l = GPU_NEG_INF;
    return l / p.t;
}

// Threads of a sampling block (the launch's block size): many, so that each pass over a row
// of the vocabulary is a few loads deep per thread.
#define SAMPLE_THREADS 1024

template <typename T>
__device__ void sample_rows(const typename T::S* x, long xo, long ld, const float* bias,
                            const float* seen, const float* stop, const float* su, float* out,
                            unsigned* ids, SampleParams p) {
    __shared__ float sh[33];
    __shared__ float seg[SAMPLE_THREADS];
    __shared__ int found;
    long r = blockIdx.x;
    int v = p.v, tid = threadIdx.x, nt = blockDim.x;
    const typename T::S* xr = x + xo + r * ld;
    const float* seen_r = seen + (p.has_seen ? r * v : 0);
    bool suppress = su[2 * r] != 0.0f;
    float u = su[2 * r + 1];
#define L(j) sample_logit<T>(xr, bias, seen_r, stop, suppress, p, (j))

    // One read of the row for the recorded log-prob's normaliser, logsumexp(raw / t) (a running
    // maximum and sum per thread), and for m = max l with its first index (greedy's pick).
    float mraw = GPU_NEG_INF, sraw = 0.0f, m = GPU_NEG_INF;
    int mi = v;
    for (int j = tid; j < v; j += nt) {
        float raw = T::ld(xr[j]) / p.t;
        if (raw > mraw) {
            sraw = sraw * expf(mraw - raw) + 1.0f;
            mraw = raw;
        } else if (raw != GPU_NEG_INF) {
            sraw += expf(raw - mraw);
        }
        float l = L(j);
        if (l > m) {
            m = l;
            mi = j;
        }
    }
    float mall = block_max(mraw, sh);
    float lse = logf(block_sum(mraw == GPU_NEG_INF ? 0.0f : sraw * expf(mraw - mall), sh)) + mall;
    float mt = m;
    m = block_max(m, sh);
    int token = 0;
    if (p.greedy) {
        float first = mt == m ? (float)mi : (float)v;
        first = -block_max(-first, sh);
        token = first < (float)v ? (int)first : 0;
    } else {
        // top-k: the largest threshold that keeps at least k tokens (ties kept).
        float kth = GPU_NEG_INF;
        if (p.top_k > 0 && p.top_k < v) {
            float lo = m;
            for (int j = tid; j < v; j += nt) {
                float l = L(j);
                if (l != GPU_NEG_INF) lo = fminf(lo, l);
            }
            lo = -block_max(-lo, sh);
            float hi = m + 1.0f;
            for (int it = 0; it < SAMPLE_BISECTIONS; ++it) {
                float mid = (lo + hi) * 0.5f, c = 0.0f;
                for (int j = tid; j < v; j += nt) c += L(j) >= mid ? 1.0f : 0.0f;
                if (block_sum(c, sh) >= (float)p.top_k) lo = mid; else hi = mid;
            }
            kth = lo;
        }
        // Each weight computed once per token (the same arithmetic as written out in place).
        auto W0 = [&](int j) {
            float l = L(j);
            return l < kth ? 0.0f : expf(l - m);
        };
        float sp = 1.0f, floor_p = 0.0f;  // top-p keeps w / sp ≥ floor_p
        if (p.top_p < 1.0f) {
            float s = 0.0f, mx = 0.0f;
            for (int j = tid; j < v; j += nt) {
                float w = W0(j);
                s += w;
                mx = fmaxf(mx, w);
            }
            s = block_sum(s, sh);
            float lo = 0.0f, hi = block_max(mx, sh) / s;
            // lo: the mass strictly above it reaches top_p; hi: it does not (the floor).
            for (int it = 0; it < SAMPLE_BISECTIONS; ++it) {
                float mid = (lo + hi) * 0.5f, c = 0.0f;
                for (int j = tid; j < v; j += nt) {
                    float pj = W0(j) / s;
                    if (pj > mid) c += pj;
                }
                if (block_sum(c, sh) >= p.top_p) lo = mid; else hi = mid;
            }
            sp = s;
            floor_p = hi;
        }
        auto W1 = [&](int j) {
            float w = W0(j);
            return w / sp < floor_p ? 0.0f : w;
        };
        float floor_m = 0.0f;
        if (p.min_p > 0.0f) {
            float mx = 0.0f;
            for (int j = tid; j < v; j += nt) mx = fmaxf(mx, W1(j));
            floor_m = block_max(mx, sh) * p.min_p;
        }
        auto W = [&](int j) {
            float w = W1(j);
            return w < floor_m ? 0.0f : w;
        };
        // The draw: each thread sums a contiguous segment; a scan of the segment sums finds
        // the segment where the cumulative weight passes u · Σw, its thread walks it.
        int per = (v + nt - 1) / nt, a = tid * per, b = a + per < v ? a + per : v;
        float mine = 0.0f;
        int last = -1;
#pragma unroll 4
        for (int j = a; j < b; ++j) {
            float w = W(j);
            mine += w;
            if (w > 0.0f) last = j;
        }
        last = (int)block_max((float)last, sh);
        seg[tid] = mine;
        __syncthreads();
        for (int off = 1; off < nt; off <<= 1) {  // inclusive scan of the segment sums
            float add = tid >= off ? seg[tid - off] : 0.0f;
            __syncthreads();
            seg[tid] += add;
            __syncthreads();
        }
        float total = seg[nt - 1], target = u * total;
        float before = tid > 0 ? seg[tid - 1] : 0.0f;
        if (tid == 0) found = -1;
        __syncthreads();
        if (before <= target && target < seg[tid] && a < b) {
            float c = before;
            int pick = b - 1;
            for (int j = a; j < b; ++j) {
                c += W(j);
                if (c > target) {
                    pick = j;
                    break;
                }
            }
            found = pick;  // segments are disjoint: at most one thread writes
        }
        __syncthreads();
        token = found < 0 ? last : (found > last ? last : found);
        if (token < 0) token = 0;
    }
    if (tid == 0) {
        out[2 * r] = (float)token;
        out[2 * r + 1] = T::ld(xr[token]) / p.t - lse;
        ids[r] = (unsigned)token;
    }
#undef L
}

#define SAMPLE_KERNEL(T, N)                                                                  \
    extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)                             \
        sample_rows_##N(const T::S* x, long xo, long ld, const float* bias,                  \
                        const float* seen, const float* stop, const float* su, float* out,   \
                        unsigned* ids, SampleParams p) {                                     \
        sample_rows<T>(x, xo, ld, bias, seen, stop, su, out, ids, p);                        \
    }
SAMPLE_KERNEL(F32, f32)
SAMPLE_KERNEL(BF16, bf16)
SAMPLE_KERNEL(F16, f16)
