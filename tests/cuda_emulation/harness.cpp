// Runs one kernel of grpo-rollout/src/kernels.cu, grpo-core/src/head.cu or quant.cu (after
// grpo-core/src/cuda_prelude.cu, as NVRTC compiles them) under the host emulation (emu.h),
// launched as grpo-rollout/src/cuda.rs and grpo-core/src/cuda.rs launch it, on inputs read from
// files; the Rust test tests/tests/cuda_kernels_emulated.rs writes the inputs and checks the
// output against the CPU compositions.
//
//   harness OP DTYPE DIR ARGS...     inputs DIR/in0.f32, DIR/in1.f32, ... (raw little-endian
//                                    f32, converted to DTYPE); output DIR/out.f32 (as f32)
#include "emu.h"
#include "cuda_prelude.cu"
#include "kernels.cu"
#include "head.cu"
#include "flash.cu"
#include "quant.cu"

#include <cstdio>
#include <cstdlib>
#include <string>

static std::string dir;

static std::vector<float> read_f32(int i) {
    std::string p = dir + "/in" + std::to_string(i) + ".f32";
    FILE* f = std::fopen(p.c_str(), "rb");
    if (!f) {
        std::fprintf(stderr, "harness: cannot open %s\n", p.c_str());
        std::exit(2);
    }
    std::vector<float> v;
    float x;
    while (std::fread(&x, 4, 1, f) == 1) v.push_back(x);
    std::fclose(f);
    return v;
}

// Whether input i was given (optional inputs).
static bool has_input(int i) {
    std::string p = dir + "/in" + std::to_string(i) + ".f32";
    FILE* f = std::fopen(p.c_str(), "rb");
    if (f) std::fclose(f);
    return f != nullptr;
}

// A kernel's output buffer as the GPU gives it (uninitialised: cudarc's `alloc`), every bit
// set — NaN in f32, bf16 and f16, 0xffffffff as an index — so that an element the kernel
// does not write shows in the output rather than passing as zero.
template <typename V>
static std::vector<V> poisoned(long n) {
    std::vector<V> v((size_t)n);
    std::memset(v.data(), 0xff, v.size() * sizeof(V));
    return v;
}

template <typename T>
static std::vector<typename T::S> to_storage(const std::vector<float>& v) {
    std::vector<typename T::S> s(v.size());
    for (size_t i = 0; i < v.size(); ++i) s[i] = T::st(v[i]);
    return s;
}

template <typename T>
static void write_out(const std::vector<typename T::S>& s) {
    std::string p = dir + "/out.f32";
    FILE* f = std::fopen(p.c_str(), "wb");
    for (auto x : s) {
        float v = T::ld(x);
        std::fwrite(&v, 4, 1, f);
    }
    std::fclose(f);
}

static unsigned row_threads(long n) {
    long t = (n + 31) / 32 * 32;
    return (unsigned)(t < 32 ? 32 : (t > 256 ? 256 : t));
}

static unsigned blocks(long n, long per) {
    long b = (n + per - 1) / per;
    return (unsigned)(b < 1 ? 1 : b);
}

template <typename T, typename K>
static int run(const std::string& op, char** a, K k) {
    typedef typename T::S S;
    if (op == "rms_fwd") {  // rows h eps
        long rows = atol(a[0]), h = atol(a[1]);
        float eps = atof(a[2]);
        auto x = to_storage<T>(read_f32(0)), w = to_storage<T>(read_f32(1));
        auto y = poisoned<S>(rows * h);
        emu_launch(k.rms_fwd, rows, row_threads(h), 0, x.data(), 0L, w.data(), 0L, y.data(),
                   (int)h, eps);
        write_out<T>(y);
    } else if (op == "rms_bwd") {  // rows h eps blocks
        long rows = atol(a[0]), h = atol(a[1]), nblk = atol(a[3]);
        float eps = atof(a[2]);
        auto x = to_storage<T>(read_f32(0)), w = to_storage<T>(read_f32(1)),
             g = to_storage<T>(read_f32(2));
        long n = rows * h;
        auto out = poisoned<S>(n + h);
        auto partial = poisoned<float>(nblk * h);
        emu_launch(k.rms_bwd, nblk, row_threads(h), h * 4, x.data(), 0L, w.data(), 0L, g.data(),
                   0L, out.data(), partial.data(), (int)rows, (int)h, eps);
        emu_launch(k.col_sum, blocks(h, 256), 256, 0, partial.data(), (int)nblk, (int)h,
                   out.data(), n);
        write_out<T>(out);
    } else if (op == "add_rms") {  // rows h eps
        long rows = atol(a[0]), h = atol(a[1]);
        float eps = atof(a[2]);
        auto x = to_storage<T>(read_f32(0)), r = to_storage<T>(read_f32(1)),
             w = to_storage<T>(read_f32(2));
        long n = rows * h;
        auto out = poisoned<S>(2 * n);
        emu_launch(k.add_rms, rows, row_threads(h), 0, x.data(), 0L, r.data(), 0L, w.data(), 0L,
                   out.data(), n, (int)h, eps);
        write_out<T>(out);
    } else if (op == "kv_write") {  // b l g d cap past rotate: in0 cache, in1 x, in2 cos, in3 sin
        int b = atoi(a[0]), l = atoi(a[1]), g = atoi(a[2]), d = atoi(a[3]);
        long cap = atol(a[4]), past = atol(a[5]);
        int rotate = atoi(a[6]);
        auto cache = to_storage<T>(read_f32(0)), x = to_storage<T>(read_f32(1)),
             c = to_storage<T>(read_f32(2)), s = to_storage<T>(read_f32(3));
        emu_launch(k.kv_write, blocks((long)b * l * g * (d / 2), 256), 256, 0, cache.data(), cap,
                   x.data(), 0L, c.data(), 0L, s.data(), 0L, b, l, g, d, past, rotate);
        write_out<T>(cache);
    } else if (op == "lsg_fwd" || op == "lsg_bwd" || op == "ent_fwd" || op == "ent_bwd") {
        // n v: in0 logits (n, v), in1 targets (n, as floats), in2 row gradients (n)
        long n = atol(a[0]);
        int v = atoi(a[1]);
        auto x = to_storage<T>(read_f32(0));
        auto tf = read_f32(1);
        auto g = read_f32(2);
        std::vector<unsigned> t(tf.size());
        for (size_t i = 0; i < tf.size(); ++i) t[i] = (unsigned)tf[i];
        unsigned threads = row_threads(v);
        if (op == "lsg_fwd" || op == "ent_fwd") {
            auto out = poisoned<float>(n);
            if (op == "lsg_fwd")
                emu_launch(k.lsg_fwd, (unsigned)n, threads, 0, x.data(), 0L, t.data(), 0L,
                           out.data(), v);
            else
                emu_launch(k.ent_fwd, (unsigned)n, threads, 0, x.data(), 0L, out.data(), v);
            write_out<F32>(out);
        } else {
            auto out = poisoned<S>(n * v);
            if (op == "lsg_bwd")
                emu_launch(k.lsg_bwd, (unsigned)n, threads, 0, x.data(), 0L, t.data(), 0L,
                           g.data(), 0L, out.data(), v);
            else
                emu_launch(k.ent_bwd, (unsigned)n, threads, 0, x.data(), 0L, g.data(), 0L,
                           out.data(), v);
            write_out<T>(out);
        }
    } else if (op == "sample") {
        // n v ld t rp top_p min_p greedy top_k has_bias has_seen has_stop:
        // in0 logits (n, ld), in1 bias (v), in2 seen (n, v), in3 stop (v), in4 su (n, 2)
        long n = atol(a[0]), ld = atol(a[2]);
        SampleParams p;
        p.v = atoi(a[1]);
        p.t = atof(a[3]);
        p.rp = atof(a[4]);
        p.top_p = atof(a[5]);
        p.min_p = atof(a[6]);
        p.greedy = atoi(a[7]);
        p.top_k = atoi(a[8]);
        p.has_bias = atoi(a[9]);
        p.has_seen = atoi(a[10]);
        p.has_stop = atoi(a[11]);
        auto x = to_storage<T>(read_f32(0));
        auto bias = read_f32(1), seen = read_f32(2), stop = read_f32(3), su = read_f32(4);
        auto out = poisoned<float>(2 * n);
        auto ids = poisoned<unsigned>(n);
        emu_launch(k.sample, (unsigned)n, SAMPLE_THREADS, 0, x.data(), 0L, ld, bias.data(), seen.data(),
                   stop.data(), su.data(), out.data(), ids.data(), p);
        for (long r = 0; r < n; ++r)
            if ((float)ids[r] != out[2 * r]) {
                std::fprintf(stderr, "harness: row %ld: ids and out disagree\n", r);
                return 4;
            }
        write_out<F32>(out);
    } else if (op == "rope") {  // b l h d inverse
        int b = atoi(a[0]), l = atoi(a[1]), h = atoi(a[2]), d = atoi(a[3]), inv = atoi(a[4]);
        auto x = to_storage<T>(read_f32(0)), c = to_storage<T>(read_f32(1)),
             s = to_storage<T>(read_f32(2));
        auto out = poisoned<S>(x.size());
        emu_launch(k.rope, blocks((long)b * h * l * (d / 2), 256), 256, 0, x.data(), 0L, c.data(),
                   0L, s.data(), 0L, out.data(), b, l, h, d, inv);
        write_out<T>(out);
    } else if (op == "silu_fwd") {
        auto x = to_storage<T>(read_f32(0)), u = to_storage<T>(read_f32(1));
        long n = x.size();
        auto out = poisoned<S>(n);
        emu_launch(k.silu_fwd, blocks(n, 256), 256, 0, x.data(), 0L, 0L, u.data(), 0L, 0L,
                   out.data(), n, n);
        write_out<T>(out);
    } else if (op == "silu_packed") {  // rows cols: in0 (rows, 2·cols) = [gate | up] per row
        long rows = atol(a[0]), cols = atol(a[1]);
        auto gu = to_storage<T>(read_f32(0));
        long n = rows * cols;
        auto out = poisoned<S>(n);
        emu_launch(k.silu_fwd, blocks(n, 256), 256, 0, gu.data(), 0L, 2 * cols, gu.data(), cols,
                   2 * cols, out.data(), n, cols);
        write_out<T>(out);
    } else if (op == "silu_bwd") {
        auto x = to_storage<T>(read_f32(0)), u = to_storage<T>(read_f32(1)),
             g = to_storage<T>(read_f32(2));
        long n = x.size();
        auto out = poisoned<S>(2 * n);
        emu_launch(k.silu_bwd, blocks(n, 256), 256, 0, x.data(), 0L, u.data(), 0L, g.data(), 0L,
                   out.data(), n);
        write_out<T>(out);
    } else if (op == "silu_packed_bwd") {  // rows cols: in0 [gate | up] (rows, 2·cols), in1 g
        long rows = atol(a[0]), cols = atol(a[1]);
        auto gu = to_storage<T>(read_f32(0)), g = to_storage<T>(read_f32(1));
        auto out = poisoned<S>(2 * rows * cols);
        emu_launch(k.silu_packed_bwd, blocks(rows * cols, 256), 256, 0, gu.data(), 0L, g.data(),
                   0L, out.data(), rows, (int)cols);
        write_out<T>(out);
    } else if (op == "softmax_fwd") {  // b h l s scale
        int b = atoi(a[0]), h = atoi(a[1]), l = atoi(a[2]), s = atoi(a[3]);
        float scale = atof(a[4]);
        auto x = to_storage<T>(read_f32(0)), m = to_storage<T>(read_f32(1));
        auto out = poisoned<S>(x.size());
        emu_launch(k.softmax_fwd, (unsigned)(b * h * l), row_threads(s), 0, x.data(), 0L, m.data(),
                   0L, out.data(), h, l, s, scale);
        write_out<T>(out);
    } else if (op == "softmax_bwd") {  // rows s scale
        long rows = atol(a[0]);
        int s = atoi(a[1]);
        float scale = atof(a[2]);
        auto p = to_storage<T>(read_f32(0)), g = to_storage<T>(read_f32(1));
        auto out = poisoned<S>(p.size());
        emu_launch(k.softmax_bwd, (unsigned)rows, row_threads(s), 0, p.data(), 0L, g.data(), 0L,
                   out.data(), s, scale);
        write_out<T>(out);
    } else if (op == "attention") {  // b nh nkv l s d cap scale: k, v (b, nkv, cap, d), first s
        int b = atoi(a[0]), nh = atoi(a[1]), nkv = atoi(a[2]), l = atoi(a[3]), s = atoi(a[4]),
            d = atoi(a[5]), cap = atoi(a[6]);
        float scale = atof(a[7]);
        auto q = to_storage<T>(read_f32(0)), kc = to_storage<T>(read_f32(1)),
             vc = to_storage<T>(read_f32(2)), bias = to_storage<T>(read_f32(3));
        auto out = poisoned<S>((long)b * l * nh * d);
        long kb = (long)nkv * cap * d, kg = (long)cap * d, ks = d;
        int grp = nh / nkv, chunks = (grp + ATTN_GROUP - 1) / ATTN_GROUP;
        emu_launch(k.attention, (unsigned)(b * nkv * chunks * l),
                   ATTN_THREADS, 0, q.data(), 0L, kc.data(), 0L,
                   kb, kg, ks, vc.data(), 0L, kb, kg, ks, bias.data(), 0L, out.data(), nh, nkv, l,
                   s, d, scale);
        write_out<T>(out);
    } else if (op == "cached_attention") {
        // b nh nkv l past d cap scale [graphed]: in0 qkv (b, l, nh + 2·nkv, d), in1 k cache,
        // in2 v cache (b, nkv, cap, d), in3 cos, in4 sin (b, l, d/2), in5 bias (b, 1, l,
        // past + l), or with `graphed` = 1 (b, 1, l, cap) with the cached length read from
        // device memory (the argument `past` given as 0), as a captured decode
        // step launches it; in6, when given, the packed projection's bias ((nh + 2·nkv)·d),
        // added as q, k, v are read; out = [context (b·l, nh·d), k cache, v cache]
        int b = atoi(a[0]), nh = atoi(a[1]), nkv = atoi(a[2]), l = atoi(a[3]), d = atoi(a[5]);
        long past = atol(a[4]), cap = atol(a[6]);
        float scale = atof(a[7]);
        bool graphed = a[8] && atoi(a[8]) == 1;  // argv ends with a null pointer
        auto qkv = to_storage<T>(read_f32(0)), kc = to_storage<T>(read_f32(1)),
             vc = to_storage<T>(read_f32(2)), c = to_storage<T>(read_f32(3)),
             sn = to_storage<T>(read_f32(4)), bias = to_storage<T>(read_f32(5));
        std::vector<S> pb;
        if (has_input(6)) pb = to_storage<T>(read_f32(6));
        auto out = poisoned<S>((long)b * l * nh * d);
        long s = past + l;
        unsigned past_at = (unsigned)past;
        int grp = nh / nkv, chunks = (grp + ATTN_GROUP - 1) / ATTN_GROUP;
        emu_launch(k.cached_attention,
                   (unsigned)(b * nkv * chunks * l), ATTN_THREADS, 0, qkv.data(), 0L,
                   kc.data(), vc.data(), cap, c.data(), 0L, sn.data(), 0L, bias.data(), 0L,
                   graphed ? cap : s, out.data(), nh, nkv, l, graphed ? 0L : past,
                   graphed ? (const unsigned*)&past_at : (const unsigned*)nullptr, d, scale,
                   pb.empty() ? (const S*)nullptr : (const S*)pb.data());
        out.insert(out.end(), kc.begin(), kc.end());
        out.insert(out.end(), vc.begin(), vc.end());
        write_out<T>(out);
    } else {
        std::fprintf(stderr, "harness: unknown op %s\n", op.c_str());
        return 2;
    }
    return 0;
}

static void write_f32(const std::vector<float>& v) {
    std::string p = dir + "/out.f32";
    FILE* f = std::fopen(p.c_str(), "wb");
    std::fwrite(v.data(), 4, v.size(), f);
    std::fclose(f);
}

// Flash attention (flash.cu), launched as grpo-rollout/src/cuda.rs launches it:
//   flash_fwd b nh nkv l s d cap scale align causal: in0 q (b, nh, l, d), in1 k, in2 v (b, nkv, cap, d)
//     of which the first s rows count, in3 bias (b, 1, l, s); out = [context (b·l, nh·d),
//     stats (b, nh, l, 2)]
//   flash_bwd (the same arguments): in4 dout (b·l, nh·d); runs the forward, delta's kernel (over
//     the rounded context), then dq and dk/dv; out = [dq, dk, dv]
template <typename T, int D>
static int run_flash_d(const std::string& op, char** a, decltype(&flash_fwd_d64_bf16) fwd,
                       decltype(&flash_dq_d64_bf16) dqk, decltype(&flash_dkv_d64_bf16) dkvk,
                       decltype(&flash_delta_bf16) deltak) {
    typedef typename T::S S;
    int b = atoi(a[0]), nh = atoi(a[1]), nkv = atoi(a[2]), l = atoi(a[3]), s = atoi(a[4]),
        cap = atoi(a[6]), align = atoi(a[8]), causal = atoi(a[9]);
    float scale = atof(a[7]);
    auto q = to_storage<T>(read_f32(0)), k = to_storage<T>(read_f32(1)),
         v = to_storage<T>(read_f32(2)), bias = to_storage<T>(read_f32(3));
    long qb = (long)nh * l * D, qh = (long)l * D, kb = (long)nkv * cap * D, kg = (long)cap * D;
    auto out = poisoned<S>((long)b * l * nh * D);
    auto stats = poisoned<float>((long)b * nh * l * 2);
    unsigned qtiles = (l + FA_BR - 1) / FA_BR, ktiles = (s + FA_BC - 1) / FA_BC;
    emu_launch(fwd, b * nh * qtiles, FA_THREADS, 0, q.data(), 0L, qb, qh, (long)D, k.data(), 0L,
               kb, kg, (long)D, v.data(), 0L, kb, kg, (long)D, bias.data(), 0L, out.data(),
               stats.data(), nh, nkv, l, s, scale, align, causal);
    std::vector<float> res;
    if (op == "flash_fwd") {
        for (auto x : out) res.push_back(T::ld(x));
        res.insert(res.end(), stats.begin(), stats.end());
        write_f32(res);
        return 0;
    }
    auto dout = to_storage<T>(read_f32(4));
    long nd = (long)b * l * nh;
    auto delta = poisoned<float>(nd);
    emu_launch(deltak, (unsigned)((nd * 32 + 255) / 256), 256, 0, dout.data(), 0L, out.data(), 0L,
               delta.data(), nd, D);
    auto dq = poisoned<S>(q.size());
    auto dkv = poisoned<S>(2L * b * nkv * s * D);
    emu_launch(dqk, b * nh * qtiles, FA_THREADS, 0, q.data(), 0L, qb, qh, (long)D, k.data(), 0L,
               kb, kg, (long)D, v.data(), 0L, kb, kg, (long)D, bias.data(), 0L, dout.data(),
               stats.data(), delta.data(), dq.data(), nh, nkv, l, s, scale, align, causal);
    emu_launch(dkvk, b * nkv * ktiles, FA_THREADS, 0, q.data(), 0L, qb, qh, (long)D, k.data(),
               0L, kb, kg, (long)D, v.data(), 0L, kb, kg, (long)D, bias.data(), 0L, dout.data(),
               stats.data(), delta.data(), dkv.data(), nh, nkv, l, s, scale, align, causal);
    for (auto x : dq) res.push_back(T::ld(x));
    for (auto x : dkv) res.push_back(T::ld(x));
    write_f32(res);
    return 0;
}

template <typename T>
static int run_flash(const std::string& op, char** a, bool bf16) {
    int d = atoi(a[5]);
    if (d == 64)
        return bf16 ? run_flash_d<T, 64>(op, a, flash_fwd_d64_bf16, flash_dq_d64_bf16,
                                         flash_dkv_d64_bf16, flash_delta_bf16)
                    : run_flash_d<T, 64>(op, a, flash_fwd_d64_f16, flash_dq_d64_f16,
                                         flash_dkv_d64_f16, flash_delta_f16);
    if (d == 128)
        return bf16 ? run_flash_d<T, 128>(op, a, flash_fwd_d128_bf16, flash_dq_d128_bf16,
                                          flash_dkv_d128_bf16, flash_delta_bf16)
                    : run_flash_d<T, 128>(op, a, flash_fwd_d128_f16, flash_dq_d128_f16,
                                          flash_dkv_d128_f16, flash_delta_f16);
    std::fprintf(stderr, "harness: flash attention has no kernel for head dimension %d\n", d);
    return 2;
}

#define KERNELS_OF(N)                                                                      \
    struct Kernels_##N {                                                                   \
        decltype(&rms_fwd_##N) rms_fwd = &rms_fwd_##N;                                     \
        decltype(&rms_bwd_##N) rms_bwd = &rms_bwd_##N;                                     \
        decltype(&col_sum_##N) col_sum = &col_sum_##N;                                     \
        decltype(&rope_##N) rope = &rope_##N;                                              \
        decltype(&add_rms_fwd_##N) add_rms = &add_rms_fwd_##N;                             \
        decltype(&kv_write_##N) kv_write = &kv_write_##N;                                  \
        decltype(&silu_mul_fwd_##N) silu_fwd = &silu_mul_fwd_##N;                          \
        decltype(&silu_mul_bwd_##N) silu_bwd = &silu_mul_bwd_##N;                          \
        decltype(&silu_mul_packed_bwd_##N) silu_packed_bwd = &silu_mul_packed_bwd_##N;    \
        decltype(&softmax_fwd_##N) softmax_fwd = &softmax_fwd_##N;                         \
        decltype(&softmax_bwd_##N) softmax_bwd = &softmax_bwd_##N;                         \
        decltype(&attention_rows_##N) attention = &attention_rows_##N;                     \
        decltype(&cached_attention_##N) cached_attention = &cached_attention_##N;          \
        decltype(&lsg_fwd_##N) lsg_fwd = &lsg_fwd_##N;                                     \
        decltype(&sample_rows_##N) sample = &sample_rows_##N;                              \
        decltype(&lsg_bwd_##N) lsg_bwd = &lsg_bwd_##N;                                     \
        decltype(&ent_fwd_##N) ent_fwd = &ent_fwd_##N;                                     \
        decltype(&ent_bwd_##N) ent_bwd = &ent_bwd_##N;                                     \
    };

KERNELS_OF(f32)
KERNELS_OF(bf16)
KERNELS_OF(f16)

// Two faulty kernels the tests feed to the emulation to show that it catches what a GPU would
// get wrong: each thread reads its neighbour's shared slot with no barrier after the writes
// (a race), and each thread reads a dynamic shared slot nobody wrote (stale memory).
__global__ void probe_race(float* out) {
    __shared__ float slot[64];
    unsigned t = threadIdx.x;
    slot[t] = (float)t;
    out[t] = slot[(t + 1) % blockDim.x];
}
__global__ void probe_unwritten(float* out) {
    GPU_DYNAMIC_SHARED(slot);
    unsigned t = threadIdx.x;
    if (t > 0) slot[t] = (float)t;
    __syncthreads();
    out[t] = slot[t] + slot[0];
}

// Block 1 reads what block 0 of the same launch writes.
__global__ void probe_blocks(float* out) {
    if (threadIdx.x != 0) return;
    if (blockIdx.x == 0) out[0] = 1.0f;
    else out[1] = out[0];
}

// Each thread copies its right neighbour's element: the last reads past the buffer.
__global__ void probe_overflow(float* out, const float* in) {
    unsigned t = threadIdx.x;
    out[t] = in[t + 1];
}

// A warp reduction after half the warp has returned.
__global__ void probe_exited(float* out) {
    unsigned t = threadIdx.x;
    if (t % 32 >= 16) return;
    out[t] = warp_sum(1.0f);
}

int main(int argc, char** argv) {
    if (argc < 4) {
        std::fprintf(stderr, "usage: harness OP DTYPE DIR ARGS...\n");
        return 2;
    }
    std::string op = argv[1], dt = argv[2];
    dir = argv[3];
    char** a = argv + 4;
    if (op == "probe_overflow") {
        std::vector<float> out(64), in(64, 1.0f);
        emu_launch(probe_overflow, 1, 64, 0, out.data(), (const float*)in.data());
        write_out<F32>(out);
        return 0;
    }
    if (op.rfind("probe_", 0) == 0) {
        std::vector<float> out(64);
        auto probe = op == "probe_race"        ? probe_race
                     : op == "probe_unwritten" ? probe_unwritten
                     : op == "probe_blocks"    ? probe_blocks
                                               : probe_exited;
        emu_launch(probe, op == "probe_blocks" ? 2 : 1, 64, 64 * 4, out.data());
        write_out<F32>(out);
        return 0;
    }
    if (op == "quantize_code") {
        // blocks: in0 values (blocks, 256), in1 block maxima (blocks), in2 code (256); the
        // bytes out as floats.
        long blocks = atol(a[0]);
        auto x = read_f32(0), am = read_f32(1), code = read_f32(2);
        auto out = poisoned<unsigned char>(blocks * 256);
        emu_launch(quantize_code_f32, (unsigned)blocks, 256, 0, (const float*)x.data(), 0L,
                   (const float*)am.data(), 0L, (const float*)code.data(), 0L, out.data(),
                   blocks * 256);
        write_out<F32>(std::vector<float>(out.begin(), out.end()));
        return 0;
    }
    if (op == "dequantize_code") {
        // blocks: in0 bytes (blocks · 256, as floats), in1 block maxima, in2 code (256).
        long blocks = atol(a[0]);
        auto qf = read_f32(0), am = read_f32(1), code = read_f32(2);
        std::vector<unsigned char> q(qf.begin(), qf.end());
        auto out = poisoned<float>(blocks * 256);
        emu_launch(dequantize_code_f32, (unsigned)blocks, 256, 0, (const unsigned char*)q.data(),
                   0L, (const float*)am.data(), 0L, (const float*)code.data(), 0L, out.data(),
                   blocks * 256);
        write_out<F32>(out);
        return 0;
    }
    if (op.rfind("flash_", 0) == 0) {
        if (dt == "bf16") return run_flash<BF16>(op, a, true);
        if (dt == "f16") return run_flash<F16>(op, a, false);
        std::fprintf(stderr, "harness: flash attention takes bf16 or f16, not %s\n", dt.c_str());
        return 2;
    }
    if (dt == "f32") return run<F32>(op, a, Kernels_f32{});
    if (dt == "bf16") return run<BF16>(op, a, Kernels_bf16{});
    if (dt == "f16") return run<F16>(op, a, Kernels_f16{});
    std::fprintf(stderr, "harness: unknown dtype %s\n", dt.c_str());
    return 2;
}
