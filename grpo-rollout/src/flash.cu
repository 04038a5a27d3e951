// Flash attention for training and prefill lengths on the tensor cores (sm_80 and later):
// softmax(q kᵀ · scale + bias) v per head, grouped-query heads read in place, with bf16 / f16
// storage, products as mma.sync m16n8k16 with f32 accumulation, and the softmax in f32. Neither
// pass keeps a (L, S) tensor: the forward runs an online softmax over key tiles and keeps per
// query row its maximum and 1 / Σ (the `stats`); the backward recomputes the probabilities from
// them, tile by tile.
//
// Layouts (element offsets and strides; unit stride along D everywhere):
//   q (B, H, L, D) by strides (qb, qh, qr); k, v (B, G, S, D) by (kb, kg, kr), (vb, vg, vr);
//   bias (B, 1, L, S) contiguous (the additive causal + padding mask); out rows (B·L, H·D);
//   stats (B, H, L, 2) f32 = (row maximum, 1 / Σ exp); dout like out; delta (B, L, H) f32 =
//   Σ_e dout · out per row and head; dq (B, H, L, D); dkv (2, B, G, S, D) = [dk, dv].
// `align` (8, 2 or 1 elements) divides every row start's element offset: 16-byte, 32-bit or
// 16-bit loads.
//
// Work split. Forward and dq: one block of four warps per (batch, head, 64 query rows), each warp
// 16 rows, the key tiles of 64 walked in shared memory. dk/dv: one block per (batch, kv head, 64
// keys), each warp 16 keys, walking the group's query heads 16 query rows at a time; no atomics,
// so the backward is deterministic.
//
// Fragments are those of the PTX ISA for mma.m16n8k16 (groupID gr = lane / 4, tg = lane % 4):
// A (16×16, row-major) a0 = (gr, 2tg..2tg+1), a1 = (gr+8, 2tg..), a2 = (gr, 2tg+8..), a3 =
// (gr+8, 2tg+8..); B (16×8) b0 = (k 2tg..2tg+1, n gr), b1 = (k 2tg+8.., n gr); C/D (16×8 f32)
// c0, c1 = (gr, 2tg..2tg+1), c2, c3 = (gr+8, 2tg..). Two adjacent C tiles are, rounded, the A
// fragment of the next product (probabilities times values) without a trip through memory.

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "flash attention needs the tensor-core mma of sm_80 or later"
#endif

#define FA_BR 64       // query rows per block (forward, dq)
#define FA_BC 64       // keys per block (dk/dv) and per shared tile
#define FA_BQ 16       // query rows per step of the dk/dv kernel
#define FA_PAD 8       // halves of padding per shared row: conflict-free fragment loads
#define FA_THREADS 128 // four warps

// Every kernel's first arguments: q, k, v views and the bias (see the layouts above).
#define FA_ARGS                                                                               \
    const bits16 *q, long qo, long qb, long qh, long qr, const bits16 *k, long ko, long kb,  \
        long kg, long kr, const bits16 *v, long vo, long vb, long vg, long vr,              \
        const bits16 *bias, long bo
#define FA_PASS q, qo, qb, qh, qr, k, ko, kb, kg, kr, v, vo, vb, vg, vr, bias, bo

#ifndef GPU_HOST_EMULATION
template <typename T>
struct Mma;
// d (16×8 f32) += a (16×16) · b (16×8) for the warp, a and b of storage type TY.
#define FA_MMA(T, TY)                                                                         \
    template <>                                                                               \
    struct Mma<T> {                                                                           \
        static __device__ __forceinline__ void run(float* d, const unsigned* a,               \
                                                   const unsigned* b) {                       \
            asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TY "." TY                   \
                         ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"       \
                         : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                     \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1])); \
        }                                                                                     \
    };
FA_MMA(BF16, "bf16")
FA_MMA(F16, "f16")
#else
template <typename T>
struct Mma {
    static void run(float* d, const unsigned* a, const unsigned* b) { emu_mma_16816<T>(d, a, b); }
};
#endif

__device__ __forceinline__ unsigned fa_ld32(const bits16* p) {
    return *reinterpret_cast<const unsigned*>(p);
}
__device__ __forceinline__ unsigned fa_pair(bits16 lo, bits16 hi) {
    return (unsigned)lo | ((unsigned)hi << 16);
}
template <typename T>
__device__ __forceinline__ unsigned fa_round2(float lo, float hi) {
    return fa_pair(T::st(lo), T::st(hi));
}
__device__ __forceinline__ float fa_xor_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float fa_xor_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Rows r0..r0+n-1 (of `total`) of a matrix whose rows are `rs` elements apart into shared rows;
// rows past `total` are zeros (so that a product never meets stale values). Shared rows start
// 16-byte aligned (the arrays are `alignas(16)` and (D + FA_PAD) · 2 bytes is a multiple of 16).
struct alignas(16) FaU4 {
    unsigned x, y, z, w;
};
template <int D>
__device__ __forceinline__ void fa_load(bits16 (*dst)[D + FA_PAD], const bits16* src, long rs,
                                        int r0, int n, int total, int align) {
    if (align == 8) {
        for (int i = threadIdx.x; i < n * (D / 8); i += blockDim.x) {
            int r = i / (D / 8), c = (i % (D / 8)) * 8;
            FaU4 w = {0u, 0u, 0u, 0u};
            if (r0 + r < total)
                w = *reinterpret_cast<const FaU4*>(src + (long)(r0 + r) * rs + c);
            *reinterpret_cast<FaU4*>(&dst[r][c]) = w;
        }
        return;
    }
    for (int i = threadIdx.x; i < n * (D / 2); i += blockDim.x) {
        int r = i / (D / 2), c = (i % (D / 2)) * 2;
        unsigned w = 0;
        if (r0 + r < total) {
            const bits16* p = src + (long)(r0 + r) * rs + c;
            w = align == 2 ? fa_ld32(p) : fa_pair(p[0], p[1]);
        }
        *reinterpret_cast<unsigned*>(&dst[r][c]) = w;
    }
}

// A fragment of the 16×16 block at (r0, c0) of a shared row-major matrix.
template <int W>
__device__ __forceinline__ void fa_frag_a(unsigned* a, const bits16 (*m)[W], int r0, int c0) {
    int gr = (threadIdx.x & 31) >> 2, tg = threadIdx.x & 3;
    a[0] = fa_ld32(&m[r0 + gr][c0 + 2 * tg]);
    a[1] = fa_ld32(&m[r0 + gr + 8][c0 + 2 * tg]);
    a[2] = fa_ld32(&m[r0 + gr][c0 + 2 * tg + 8]);
    a[3] = fa_ld32(&m[r0 + gr + 8][c0 + 2 * tg + 8]);
}

// B fragment whose element (k, n) is m[n0 + n][k0 + k]: B is the transpose of the shared rows
// n0..n0+7 (keys as columns of q kᵀ).
template <int W>
__device__ __forceinline__ void fa_frag_bt(unsigned* b, const bits16 (*m)[W], int n0, int k0) {
    int gr = (threadIdx.x & 31) >> 2, tg = threadIdx.x & 3;
    b[0] = fa_ld32(&m[n0 + gr][k0 + 2 * tg]);
    b[1] = fa_ld32(&m[n0 + gr][k0 + 2 * tg + 8]);
}

// B fragment whose element (k, n) is m[k0 + k][n0 + n]: the shared rows k0..k0+15 as they are
// (values as the right factor of p v).
template <int W>
__device__ __forceinline__ void fa_frag_b(unsigned* b, const bits16 (*m)[W], int k0, int n0) {
    int gr = (threadIdx.x & 31) >> 2, tg = threadIdx.x & 3;
    b[0] = fa_pair(m[k0 + 2 * tg][n0 + gr], m[k0 + 2 * tg + 1][n0 + gr]);
    b[1] = fa_pair(m[k0 + 2 * tg + 8][n0 + gr], m[k0 + 2 * tg + 9][n0 + gr]);
}

// Two adjacent 16×8 C tiles as the 16×16 A fragment of the next product, rounded to T.
template <typename T>
__device__ __forceinline__ void fa_a_of_c(unsigned* a, const float* c0, const float* c1) {
    a[0] = fa_round2<T>(c0[0], c0[1]);
    a[1] = fa_round2<T>(c0[2], c0[3]);
    a[2] = fa_round2<T>(c1[0], c1[1]);
    a[3] = fa_round2<T>(c1[2], c1[3]);
}

// C tile element e of a thread: row offset (0 or 8) and column offset within the 16×8 tile.
__device__ __forceinline__ int fa_row(int e) { return ((threadIdx.x & 31) >> 2) + (e >> 1) * 8; }
__device__ __forceinline__ int fa_col(int e) { return 2 * (threadIdx.x & 3) + (e & 1); }

// A tile of the bias: `R` query rows from r0 (of l) by FA_BC keys from j0 (of s), loaded with
// the key and value tiles (coalesced, off the products' critical path) where each score read
// its own element from global memory after the products. Outside the bias: 0 (never used).
#define FA_BPAD 8
template <int R>
__device__ __forceinline__ void fa_load_bias(bits16 (*dst)[FA_BC + FA_BPAD], const bits16* bb,
                                             int r0, int j0, int l, int s) {
    for (int i = threadIdx.x; i < R * FA_BC; i += blockDim.x) {
        int r = i / FA_BC, c = i % FA_BC, row = r0 + r, key = j0 + c;
        dst[r][c] = row < l && key < s ? bb[(long)row * s + key] : (bits16)0;
    }
}

// The scores of query rows r0.. (tile rows; row rr0.. of the bias tile `sb` loaded from j0)
// against keys j0 + kc0..: scale, bias; keys past `s` −inf.
template <typename T, int N>
__device__ __forceinline__ void fa_scores(float (*sc)[4], const bits16 (*sb)[FA_BC + FA_BPAD],
                                          int rr0, int kc0, int r0, int j0, int l, int s,
                                          float scale) {
    #pragma unroll
    for (int t = 0; t < N; ++t)
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
            int kc = kc0 + t * 8 + fa_col(e);
            int row = r0 + fa_row(e), key = j0 + kc;
            float b = row < l && key < s ? T::ld(sb[rr0 + fa_row(e)][kc]) : 0.0f;
            sc[t][e] = key < s ? sc[t][e] * scale + b : GPU_NEG_INF;
        }
}

// Causal skipping. With `causal` the bias masks every key after each query's position (the
// queries are the last l of the s positions), so a key tile wholly after the last row of a
// block of FA_BR query rows carries no weight for any of them and is skipped: the forward and
// dq walk keys below `fa_keys_end`, dk/dv start at the first block of rows that reaches its
// tile. All three make the same choice per (block of rows, key tile). A row whose every key
// is masked (a left-padded position) then averages the keys up to its block's diagonal rather
// than all of them; nothing reads such a row.
__device__ __forceinline__ int fa_keys_end(int q0, int l, int s, int causal) {
    long end = (long)(s - l) + q0 + FA_BR;
    return causal && end < s ? (int)end : s;
}
__device__ __forceinline__ int fa_rows_start(int j0, int l, int s, int causal) {
    int need = j0 - (s - l) - (FA_BR - 1);  // the first block start c with s - l + c + FA_BR > j0
    return causal && need > 0 ? (need + FA_BR - 1) / FA_BR * FA_BR : 0;
}

// The block of a forward or dq launch: (batch, head, 64 query rows from q0); its kv head, and
// the first of the 16 rows of this thread's warp.
struct FaRows {
    long bi;
    int hd, g, warp, q0, r0;
};
__device__ __forceinline__ FaRows fa_rows(int nh, int nkv, int l) {
    int tiles = (l + FA_BR - 1) / FA_BR;
    long blk = blockIdx.x;
    FaRows at;
    at.hd = (int)((blk / tiles) % nh);
    at.bi = blk / ((long)tiles * nh);
    at.g = at.hd / (nh / nkv);
    at.warp = threadIdx.x >> 5;
    at.q0 = (int)(blk % tiles) * FA_BR;
    at.r0 = at.q0 + at.warp * 16;
    return at;
}

template <typename T, int D>
__device__ void flash_fwd(FA_ARGS, bits16* out, float* stats, int nh, int nkv, int l, int s,
                          float scale, int align, int causal) {
    alignas(16) __shared__ bits16 sk[FA_BC][D + FA_PAD];
    alignas(16) __shared__ bits16 sv[FA_BC][D + FA_PAD];
    alignas(16) __shared__ bits16 sb[FA_BR][FA_BC + FA_BPAD];
    FaRows at = fa_rows(nh, nkv, l);
    long bi = at.bi;
    int hd = at.hd, g = at.g, warp = at.warp, q0 = at.q0, r0 = at.r0;
    // The block's query rows pass through shared memory into each warp's A fragments.
    fa_load<D>(sk, q + qo + bi * qb + hd * qh, qr, q0, FA_BR, l, align);
    __syncthreads();
    unsigned qf[D / 16][4];
    #pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) fa_frag_a(qf[kk], sk, warp * 16, kk * 16);
    __syncthreads();
    float o[D / 8][4];
    #pragma unroll
    for (int t = 0; t < D / 8; ++t)
        #pragma unroll
        for (int e = 0; e < 4; ++e) o[t][e] = 0.0f;
    float m[2] = {GPU_NEG_INF, GPU_NEG_INF}, ls[2] = {0.0f, 0.0f};
    const bits16* kh = k + ko + bi * kb + g * kg;
    const bits16* vh = v + vo + bi * vb + g * vg;
    const bits16* bb = bias + bo + bi * (long)l * s;
    for (int j0 = 0, end = fa_keys_end(q0, l, s, causal); j0 < end; j0 += FA_BC) {
        fa_load<D>(sk, kh, kr, j0, FA_BC, s, align);
        fa_load<D>(sv, vh, vr, j0, FA_BC, s, align);
        fa_load_bias<FA_BR>(sb, bb, q0, j0, l, s);
        __syncthreads();
        float sc[FA_BC / 8][4];
        #pragma unroll
        for (int t = 0; t < FA_BC / 8; ++t) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) sc[t][e] = 0.0f;
            #pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                unsigned b[2];
                fa_frag_bt(b, sk, t * 8, kk * 16);
                Mma<T>::run(sc[t], qf[kk], b);
            }
        }
        fa_scores<T, FA_BC / 8>(sc, sb, warp * 16, 0, r0, j0, l, s, scale);
        // Online softmax per row (the four threads of a group hold one row's columns).
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            float mx = GPU_NEG_INF;
            #pragma unroll
            for (int t = 0; t < FA_BC / 8; ++t) mx = fmaxf(mx, fmaxf(sc[t][2 * h], sc[t][2 * h + 1]));
            float mn = fmaxf(m[h], fa_xor_max(mx));
            float base = mn == GPU_NEG_INF ? 0.0f : mn;
            float corr = expf(m[h] - base);
            m[h] = mn;
            ls[h] *= corr;
            #pragma unroll
            for (int t = 0; t < D / 8; ++t) {
                o[t][2 * h] *= corr;
                o[t][2 * h + 1] *= corr;
            }
            #pragma unroll
            for (int t = 0; t < FA_BC / 8; ++t)
                #pragma unroll
                for (int e = 2 * h; e < 2 * h + 2; ++e) {
                    sc[t][e] = expf(sc[t][e] - base);
                    ls[h] += sc[t][e];
                }
        }
        #pragma unroll
        for (int kk = 0; kk < FA_BC / 16; ++kk) {
            unsigned a[4];
            fa_a_of_c<T>(a, sc[2 * kk], sc[2 * kk + 1]);
            #pragma unroll
            for (int t = 0; t < D / 8; ++t) {
                unsigned b[2];
                fa_frag_b(b, sv, kk * 16, t * 8);
                Mma<T>::run(o[t], a, b);
            }
        }
        __syncthreads();
    }
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        float total = fa_xor_sum(ls[h]);
        float inv = total > 0.0f ? 1.0f / total : 0.0f;
        int row = r0 + fa_row(2 * h);
        if (row >= l) continue;
        bits16* orow = out + (bi * l + row) * ((long)nh * D) + (long)hd * D;
        #pragma unroll
        for (int t = 0; t < D / 8; ++t) {
            int c = t * 8 + fa_col(2 * h);
            orow[c] = T::st(o[t][2 * h] * inv);
            orow[c + 1] = T::st(o[t][2 * h + 1] * inv);
        }
        if ((threadIdx.x & 3) == 0) {
            float* st = stats + (((bi * nh + hd) * l) + row) * 2;
            st[0] = m[h];
            st[1] = inv;
        }
    }
}

// dq = scale · Σ_keys dS k with dS = P ∘ (dout vᵀ − delta), P recomputed from the stats.
template <typename T, int D>
__device__ void flash_dq(FA_ARGS, const bits16* dout,
                         const float* stats, const float* delta, bits16* dq, int nh, int nkv,
                         int l, int s, float scale, int align, int causal) {
    alignas(16) __shared__ bits16 sk[FA_BC][D + FA_PAD];
    alignas(16) __shared__ bits16 sv[FA_BC][D + FA_PAD];
    alignas(16) __shared__ bits16 sb[FA_BR][FA_BC + FA_BPAD];
    FaRows at = fa_rows(nh, nkv, l);
    long bi = at.bi;
    int hd = at.hd, g = at.g, warp = at.warp, q0 = at.q0, r0 = at.r0;
    fa_load<D>(sk, q + qo + bi * qb + hd * qh, qr, q0, FA_BR, l, align);
    fa_load<D>(sv, dout + bi * (long)l * nh * D + (long)hd * D, (long)nh * D, q0, FA_BR, l, align);
    __syncthreads();
    unsigned qf[D / 16][4], df[D / 16][4];
    #pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        fa_frag_a(qf[kk], sk, warp * 16, kk * 16);
        fa_frag_a(df[kk], sv, warp * 16, kk * 16);
    }
    __syncthreads();
    float mrow[2], inv[2], del[2];
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        int row = r0 + fa_row(2 * h);
        bool in = row < l;
        const float* st = stats + (((bi * nh + hd) * l) + (in ? row : 0)) * 2;
        mrow[h] = in ? st[0] : 0.0f;
        inv[h] = in ? st[1] : 0.0f;
        del[h] = in ? delta[(bi * l + row) * nh + hd] : 0.0f;
    }
    float acc[D / 8][4];
    #pragma unroll
    for (int t = 0; t < D / 8; ++t)
        #pragma unroll
        for (int e = 0; e < 4; ++e) acc[t][e] = 0.0f;
    const bits16* kh = k + ko + bi * kb + g * kg;
    const bits16* vh = v + vo + bi * vb + g * vg;
    const bits16* bb = bias + bo + bi * (long)l * s;
    for (int j0 = 0, end = fa_keys_end(q0, l, s, causal); j0 < end; j0 += FA_BC) {
        fa_load<D>(sk, kh, kr, j0, FA_BC, s, align);
        fa_load<D>(sv, vh, vr, j0, FA_BC, s, align);
        fa_load_bias<FA_BR>(sb, bb, q0, j0, l, s);
        __syncthreads();
        // 32 keys at a time keeps the scores and their gradient in registers.
        for (int half = 0; half < FA_BC; half += 32) {
            float sc[4][4], dp[4][4];
            #pragma unroll
            for (int t = 0; t < 4; ++t) {
                #pragma unroll
                for (int e = 0; e < 4; ++e) sc[t][e] = dp[t][e] = 0.0f;
                #pragma unroll
                for (int kk = 0; kk < D / 16; ++kk) {
                    unsigned b[2];
                    fa_frag_bt(b, sk, half + t * 8, kk * 16);
                    Mma<T>::run(sc[t], qf[kk], b);
                    fa_frag_bt(b, sv, half + t * 8, kk * 16);
                    Mma<T>::run(dp[t], df[kk], b);
                }
            }
            fa_scores<T, 4>(sc, sb, warp * 16, half, r0, j0, l, s, scale);
            #pragma unroll
            for (int t = 0; t < 4; ++t)
                #pragma unroll
                for (int e = 0; e < 4; ++e) {
                    int h = e >> 1;
                    // A row that saw no key (inv 0) has no weight anywhere (and no −inf − −inf).
                    float p = inv[h] > 0.0f ? expf(sc[t][e] - mrow[h]) * inv[h] : 0.0f;
                    sc[t][e] = p * (dp[t][e] - del[h]);
                }
            #pragma unroll
            for (int kk = 0; kk < 2; ++kk) {
                unsigned a[4];
                fa_a_of_c<T>(a, sc[2 * kk], sc[2 * kk + 1]);
                #pragma unroll
                for (int t = 0; t < D / 8; ++t) {
                    unsigned b[2];
                    fa_frag_b(b, sk, half + kk * 16, t * 8);
                    Mma<T>::run(acc[t], a, b);
                }
            }
        }
        __syncthreads();
    }
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        int row = r0 + fa_row(2 * h);
        if (row >= l) continue;
        bits16* drow = dq + ((bi * nh + hd) * l + row) * (long)D;
        #pragma unroll
        for (int t = 0; t < D / 8; ++t) {
            int c = t * 8 + fa_col(2 * h);
            drow[c] = T::st(acc[t][2 * h] * scale);
            drow[c + 1] = T::st(acc[t][2 * h + 1] * scale);
        }
    }
}

// One 16-row step of dk/dv (the rows c0.. of one query head, already in sq, sd, the stats and
// the bias tile sb): the warp's 16 keys' dk and dv accumulate Σ dSᵀ q and Σ Pᵀ dout.
template <typename T, int D>
__device__ __forceinline__ void fa_dkv_step(float (*dk)[4], float (*dv)[4],
                                            const bits16 (*sk)[D + FA_PAD],
                                            const bits16 (*sv)[D + FA_PAD],
                                            const bits16 (*sq)[D + FA_PAD],
                                            const bits16 (*sd)[D + FA_PAD], const float* sm,
                                            const float* si, const float* sdel,
                                            const bits16 (*sb)[FA_BC + FA_BPAD], int j0, int kw,
                                            int c0, int l, int s, float scale) {
    // Sᵀ = k qᵀ and dPᵀ = v doutᵀ for the warp's 16 keys × 16 query rows.
    float st[2][4], dp[2][4];
    #pragma unroll
    for (int n = 0; n < 2; ++n)
        #pragma unroll
        for (int e = 0; e < 4; ++e) st[n][e] = dp[n][e] = 0.0f;
    #pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        unsigned ak[4], av[4];
        fa_frag_a(ak, sk, kw, kk * 16);
        fa_frag_a(av, sv, kw, kk * 16);
        #pragma unroll
        for (int n = 0; n < 2; ++n) {
            unsigned b[2];
            fa_frag_bt(b, sq, n * 8, kk * 16);
            Mma<T>::run(st[n], ak, b);
            fa_frag_bt(b, sd, n * 8, kk * 16);
            Mma<T>::run(dp[n], av, b);
        }
    }
    #pragma unroll
    for (int n = 0; n < 2; ++n)
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
            int key = j0 + kw + fa_row(e), c = n * 8 + fa_col(e), row = c0 + c;
            float p = 0.0f;
            if (key < s && row < l && si[c] > 0.0f) {
                float x = st[n][e] * scale + T::ld(sb[c][kw + fa_row(e)]);
                p = expf(x - sm[c]) * si[c];
            }
            st[n][e] = p;
            dp[n][e] = p * (dp[n][e] - sdel[c]);
        }
    unsigned pa[4], da[4];
    fa_a_of_c<T>(pa, st[0], st[1]);
    fa_a_of_c<T>(da, dp[0], dp[1]);
    #pragma unroll
    for (int t = 0; t < D / 8; ++t) {
        unsigned b[2];
        fa_frag_b(b, sd, 0, t * 8);
        Mma<T>::run(dv[t], pa, b);
        fa_frag_b(b, sq, 0, t * 8);
        Mma<T>::run(dk[t], da, b);
    }
}

// dk = scale · Σ dSᵀ q and dv = Σ Pᵀ dout over the group's query heads and every query row, for
// 64 keys per block (16 per warp), query rows walked 16 at a time. With head dim 128 and
// 16-byte rows the next step's query and gradient rows, bias tile and stats are loaded into
// registers while this step computes (a step's loads were otherwise its whole latency: 4 warps
// a block, 2 blocks per SM); the same values reach shared memory either way: the same bits.
template <typename T, int D>
__device__ void flash_dkv(FA_ARGS, const bits16* dout,
                          const float* stats, const float* delta, bits16* dkv, int nh, int nkv,
                          int l, int s, float scale, int align, int causal) {
    alignas(16) __shared__ bits16 sk[FA_BC][D + FA_PAD];
    alignas(16) __shared__ bits16 sv[FA_BC][D + FA_PAD];
    alignas(16) __shared__ bits16 sq[FA_BQ][D + FA_PAD];
    alignas(16) __shared__ bits16 sd[FA_BQ][D + FA_PAD];
    __shared__ float sm[FA_BQ], si[FA_BQ], sdel[FA_BQ];
    alignas(16) __shared__ bits16 sb[FA_BQ][FA_BC + FA_BPAD];
    int tiles = (s + FA_BC - 1) / FA_BC;
    long blk = blockIdx.x;
    int tile = (int)(blk % tiles), g = (int)((blk / tiles) % nkv);
    long bi = blk / ((long)tiles * nkv);
    int grp = nh / nkv, warp = threadIdx.x >> 5;
    int j0 = tile * FA_BC, kw = warp * 16;  // the warp's keys: j0 + kw ..
    fa_load<D>(sk, k + ko + bi * kb + g * kg, kr, j0, FA_BC, s, align);
    fa_load<D>(sv, v + vo + bi * vb + g * vg, vr, j0, FA_BC, s, align);
    float dk[D / 8][4], dv[D / 8][4];
    #pragma unroll
    for (int t = 0; t < D / 8; ++t)
        #pragma unroll
        for (int e = 0; e < 4; ++e) dk[t][e] = dv[t][e] = 0.0f;
    const bits16* bb = bias + bo + bi * (long)l * s;
    int start = fa_rows_start(j0, l, s, causal);
    int per = start < l ? (l - start + FA_BQ - 1) / FA_BQ : 0;  // steps per query head
    // Head dim 128 only: at 64 the registers the prefetch holds took the kernel from 125 to 231
    // registers (ptxas), halving the blocks an SM keeps; at 128 it stays at 2 blocks per SM.
    if (D == 128 && align == 8) {
        // Chunks of 16 bytes per thread for 16 rows of q and of dout; bias elements per thread.
        const int PF = (FA_BQ * (D / 8) + FA_THREADS - 1) / FA_THREADS;
        const int PB = (FA_BQ * FA_BC + FA_THREADS - 1) / FA_THREADS;
        FaU4 pq[PF], pd[PF];
        bits16 pb[PB];
        float pm = 0.0f, pi = 0.0f, pdel = 0.0f;
        int tid = threadIdx.x;
        auto fetch = [&](int t) {
            int hd = g * grp + t / per, c0 = start + (t % per) * FA_BQ;
            const bits16* qhd = q + qo + bi * qb + hd * qh;
            const bits16* dhd = dout + bi * (long)l * nh * D + (long)hd * D;
            #pragma unroll
            for (int x = 0; x < PF; ++x) {
                int i = tid + x * FA_THREADS, r = i / (D / 8), c = (i % (D / 8)) * 8;
                bool in = i < FA_BQ * (D / 8) && c0 + r < l;
                pq[x] = pd[x] = FaU4{0u, 0u, 0u, 0u};
                if (in) {
                    pq[x] = *reinterpret_cast<const FaU4*>(qhd + (long)(c0 + r) * qr + c);
                    pd[x] = *reinterpret_cast<const FaU4*>(dhd + (long)(c0 + r) * nh * D + c);
                }
            }
            #pragma unroll
            for (int x = 0; x < PB; ++x) {
                int i = tid + x * FA_THREADS, r = i / FA_BC, c = i % FA_BC;
                int row = c0 + r, key = j0 + c;
                pb[x] = i < FA_BQ * FA_BC && row < l && key < s ? bb[(long)row * s + key]
                                                                 : (bits16)0;
            }
            if (tid < FA_BQ) {
                int c = c0 + tid;
                bool in = c < l;
                const float* st = stats + (((bi * nh + hd) * l) + (in ? c : 0)) * 2;
                pm = in ? st[0] : 0.0f;
                pi = in ? st[1] : 0.0f;
                pdel = in ? delta[(bi * l + c) * nh + hd] : 0.0f;
            }
        };
        int steps = per * grp;
        if (steps > 0) fetch(0);
        for (int t = 0; t < steps; ++t) {
            __syncthreads();  // the previous step's readers are done with the shared rows
            #pragma unroll
            for (int x = 0; x < PF; ++x) {
                int i = tid + x * FA_THREADS, r = i / (D / 8), c = (i % (D / 8)) * 8;
                if (i < FA_BQ * (D / 8)) {
                    *reinterpret_cast<FaU4*>(&sq[r][c]) = pq[x];
                    *reinterpret_cast<FaU4*>(&sd[r][c]) = pd[x];
                }
            }
            #pragma unroll
            for (int x = 0; x < PB; ++x) {
                int i = tid + x * FA_THREADS;
                if (i < FA_BQ * FA_BC) sb[i / FA_BC][i % FA_BC] = pb[x];
            }
            if (tid < FA_BQ) {
                sm[tid] = pm;
                si[tid] = pi;
                sdel[tid] = pdel;
            }
            __syncthreads();
            if (t + 1 < steps) fetch(t + 1);
            fa_dkv_step<T, D>(dk, dv, sk, sv, sq, sd, sm, si, sdel, sb, j0, kw,
                              start + (t % per) * FA_BQ, l, s, scale);
        }
    } else {
        for (int hd = g * grp; hd < (g + 1) * grp; ++hd) {
            const bits16* qhd = q + qo + bi * qb + hd * qh;
            const bits16* dhd = dout + bi * (long)l * nh * D + (long)hd * D;
            for (int c0 = start; c0 < l; c0 += FA_BQ) {
                __syncthreads();  // the previous step's readers are done with the shared rows
                fa_load<D>(sq, qhd, qr, c0, FA_BQ, l, align);
                fa_load<D>(sd, dhd, (long)nh * D, c0, FA_BQ, l, align);
                fa_load_bias<FA_BQ>(sb, bb, c0, j0, l, s);
                if (threadIdx.x < FA_BQ) {
                    int c = c0 + threadIdx.x;
                    bool in = c < l;
                    const float* st = stats + (((bi * nh + hd) * l) + (in ? c : 0)) * 2;
                    sm[threadIdx.x] = in ? st[0] : 0.0f;
                    si[threadIdx.x] = in ? st[1] : 0.0f;
                    sdel[threadIdx.x] = in ? delta[(bi * l + c) * nh + hd] : 0.0f;
                }
                __syncthreads();
                fa_dkv_step<T, D>(dk, dv, sk, sv, sq, sd, sm, si, sdel, sb, j0, kw, c0, l, s,
                                  scale);
            }
        }
    }
    // dv follows dk: B·G·S·D elements further (the grid is B · G · tiles blocks).
    long plane = (long)(gridDim.x / ((unsigned)tiles * nkv)) * nkv * s * D;
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
        int key = j0 + kw + fa_row(e);
        if (key >= s) continue;
        #pragma unroll
        for (int t = 0; t < D / 8; ++t) {
            int c = t * 8 + fa_col(e);
            long at = ((bi * nkv + g) * s + key) * (long)D + c;
            dkv[at] = T::st(dk[t][e] * scale);
            dkv[at + plane] = T::st(dv[t][e]);
        }
    }
}

// delta[w] = Σ_e dout[w·D + e] · out[w·D + e] in f32, w = (row, head) of rows (B·L, H·D)
// contiguous — the (B, L, H) sums the dq and dk/dv kernels read. One warp per w.
template <typename T>
__device__ void flash_delta(const bits16* dout, long go, const bits16* out, long oo,
                            float* delta, long n, int d) {
    long w = ((long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (w >= n) return;  // a whole warp: w is the warp's
    const bits16* g = dout + go + w * d;
    const bits16* o = out + oo + w * d;
    float acc = 0.0f;
    for (int e = lane; e < d; e += 32) acc += T::ld(g[e]) * T::ld(o[e]);
    acc = warp_sum(acc);
    if (lane == 0) delta[w] = acc;
}

// ------------------------------------------------------------------ entry points

#define FLASH_KERNELS(T, N, D)                                                                \
    extern "C" __global__ void flash_fwd_d##D##_##N(FA_ARGS, bits16* out, float* stats,      \
                                                     int nh, int nkv, int l, int s,          \
                                                     float scale, int align, int causal) {   \
        flash_fwd<T, D>(FA_PASS, out, stats, nh, nkv, l, s, scale, align, causal);            \
    }                                                                                         \
    extern "C" __global__ void flash_dq_d##D##_##N(                                           \
        FA_ARGS, const bits16* dout, const float* stats, const float* delta, bits16* dq,     \
        int nh, int nkv, int l, int s, float scale, int align, int causal) {                  \
        flash_dq<T, D>(FA_PASS, dout, stats, delta, dq, nh, nkv, l, s, scale, align, causal); \
    }                                                                                         \
    extern "C" __global__ void flash_dkv_d##D##_##N(                                          \
        FA_ARGS, const bits16* dout, const float* stats, const float* delta, bits16* dkv,    \
        int nh, int nkv, int l, int s, float scale, int align, int causal) {                  \
        flash_dkv<T, D>(FA_PASS, dout, stats, delta, dkv, nh, nkv, l, s, scale, align,        \
                        causal);                                                              \
    }

FLASH_KERNELS(BF16, bf16, 64)
FLASH_KERNELS(BF16, bf16, 128)
FLASH_KERNELS(F16, f16, 64)
FLASH_KERNELS(F16, f16, 128)

#define FLASH_DELTA(T, N)                                                                     \
    extern "C" __global__ void flash_delta_##N(const bits16* dout, long go, const bits16* out, \
                                               long oo, float* delta, long n, int d) {        \
        flash_delta<T>(dout, go, out, oo, delta, n, d);                                       \
    }
FLASH_DELTA(BF16, bf16)
FLASH_DELTA(F16, f16)
