// A host emulation of the CUDA built-ins that grpo-rollout/src/kernels.cu uses, so that the
// kernels' own source runs, unchanged, on a machine without a GPU: every thread of a block is a
// fiber, `__syncthreads` waits for the block, a warp shuffle is an exchange through memory
// between two waits for the warp, `__shared__` variables are statics (blocks run one after
// another), and the grid is walked block by block. Slow, and exact about what a kernel
// computes for given indices — which is what it is for. Three GPU faults show: a race (the
// tests run each kernel twice, threads and blocks taken first to last and then last to first
// — `GPU_EMU_ORDER=reverse` — and require the same bits: a thread reading what another writes
// without a barrier between, a block reading what another block of the launch writes, or
// shared memory read before the block wrote it, differ), a read of dynamic shared memory
// before any write (it starts as NaN), and a warp-wide exchange that not all 32 lanes reach
// (an error).
#pragma once
#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <vector>

#define GPU_HOST_EMULATION 1
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define GPU_NEG_INF (-INFINITY)
#define GPU_DYNAMIC_SHARED(name) float* name = emu_dynamic_shared.data()

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
// Set by the scheduler before it switches to a thread, so a thread reads its own.
inline dim3 threadIdx, blockIdx, blockDim, gridDim;

inline std::vector<float> emu_dynamic_shared;
inline std::vector<float> emu_shuffle;

// Each CUDA thread of the running block is a fiber (ucontext) on the one host thread; a
// synchronisation point switches back to the scheduler, which resumes the waiting threads
// when everyone the point waits for has arrived: the whole block for __syncthreads, the
// thread's warp for a shuffle. A point nobody can complete (a barrier in divergent code) is
// reported as a deadlock.
enum EmuState { EMU_RUNNABLE, EMU_AT_BLOCK, EMU_AT_WARP, EMU_DONE };
struct EmuThread {
    ucontext_t ctx;
    std::vector<char> stack;
    EmuState state;
};
inline std::vector<EmuThread> emu_threads;
inline ucontext_t emu_scheduler;
inline unsigned emu_current = 0;

inline void emu_wait(EmuState why) {
    emu_threads[emu_current].state = why;
    swapcontext(&emu_threads[emu_current].ctx, &emu_scheduler);
}

inline void __syncthreads() { emu_wait(EMU_AT_BLOCK); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu_wait(EMU_AT_WARP); }

inline float __shfl_xor_sync(unsigned, float v, int offset) {
    unsigned t = threadIdx.x, w = t >> 5, lane = t & 31;
    emu_shuffle[t] = v;
    emu_wait(EMU_AT_WARP);
    float r = emu_shuffle[(w << 5) | (lane ^ (unsigned)offset)];
    emu_wait(EMU_AT_WARP);
    return r;
}

inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}

// A product rounded to nearest, never fused into a following add (nor is any product here:
// ISO C++ mode does not contract, and x86-64 has no fma without -mfma).
inline float __fmul_rn(float a, float b) { return a * b; }

// IEEE half precision through the compiler's _Float16 (round to nearest even, as cvt.rn).
inline float gpu_f16_to_f32(unsigned short h) {
    _Float16 v;
    std::memcpy(&v, &h, 2);
    return (float)v;
}
inline unsigned short gpu_f32_to_f16(float f) {
    _Float16 v = (_Float16)f;
    unsigned short h;
    std::memcpy(&h, &v, 2);
    return h;
}

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.f32 for the calling warp: d (16×8, f32) +=
// a (16×16) · b (16×8), each lane holding the fragments the PTX ISA lays out (groupID gr =
// lane / 4, tg = lane % 4; a0 = (gr, 2tg..2tg+1), a1 = (gr+8, 2tg..), a2 = (gr, 2tg+8..), a3 =
// (gr+8, 2tg+8..); b0 = (k 2tg..2tg+1, n gr), b1 = (k 2tg+8.., n gr); d0, d1 = (gr, 2tg..),
// d2, d3 = (gr+8, 2tg..); the lower element of a pair in the lower 16 bits). The lanes' registers
// meet in memory between two waits for the warp; products are exact in f32 and summed in k order.
inline std::vector<unsigned> emu_mma_regs;  // six per thread: a0..a3, b0, b1
template <typename T>
inline void emu_mma_16816(float* d, const unsigned* a, const unsigned* b) {
    unsigned t = threadIdx.x, w0 = t & ~31u, lane = t & 31;
    unsigned* mine = &emu_mma_regs[6 * t];
    for (int i = 0; i < 4; ++i) mine[i] = a[i];
    mine[4] = b[0];
    mine[5] = b[1];
    emu_wait(EMU_AT_WARP);
    auto half = [](unsigned reg, int hi) { return T::ld((unsigned short)(hi ? reg >> 16 : reg & 0xffffu)); };
    auto A = [&](int r, int c) {
        unsigned owner = w0 + (r & 7) * 4 + ((c & 7) >> 1);
        return half(emu_mma_regs[6 * owner + (r >> 3) + 2 * (c >> 3)], c & 1);
    };
    auto B = [&](int k, int n) {
        unsigned owner = w0 + n * 4 + ((k & 7) >> 1);
        return half(emu_mma_regs[6 * owner + 4 + (k >> 3)], k & 1);
    };
    int gr = (int)(lane >> 2), tg = (int)(lane & 3);
    for (int i = 0; i < 4; ++i) {
        int r = gr + (i >= 2 ? 8 : 0), n = 2 * tg + (i & 1);
        float acc = 0.0f;
        for (int k = 0; k < 16; ++k) acc += A(r, k) * B(k, n);
        d[i] += acc;
    }
    emu_wait(EMU_AT_WARP);
}

// The kernel and its arguments, for the fibers' entry point.
inline void (*emu_body)(void*) = nullptr;
inline void* emu_body_arg = nullptr;
inline void emu_entry() {
    emu_body(emu_body_arg);
    emu_threads[emu_current].state = EMU_DONE;
}

// The order in which the scheduler resumes the runnable threads between two synchronisation
// points, and runs the grid's blocks: by index, or (GPU_EMU_ORDER=reverse) last first. A
// kernel whose output depends on it has a race on a GPU; the tests run every kernel both ways
// and require the same bits.
inline const bool emu_reverse = [] {
    const char* o = std::getenv("GPU_EMU_ORDER");
    return o != nullptr && std::strcmp(o, "reverse") == 0;
}();

// Runs the block `blockIdx` with `blockDim.x` fibers until all are done.
inline void emu_run_block() {
    unsigned n = blockDim.x;
    emu_threads.resize(n);
    for (unsigned t = 0; t < n; ++t) {
        EmuThread& th = emu_threads[t];
        // 16 KiB per fiber: AddressSanitizer clears the shadow of the whole stack being switched
        // to at every swapcontext, a fifth of the emulation's time with 64 KiB stacks. A kernel
        // frame that outgrew it would write past the vector, which AddressSanitizer reports.
        th.stack.resize(1 << 14);
        th.state = EMU_RUNNABLE;
        getcontext(&th.ctx);
        th.ctx.uc_stack.ss_sp = th.stack.data();
        th.ctx.uc_stack.ss_size = th.stack.size();
        th.ctx.uc_link = &emu_scheduler;
        makecontext(&th.ctx, emu_entry, 0);
    }
    for (;;) {
        bool ran = false;
        for (unsigned i = 0; i < n; ++i) {
            unsigned t = emu_reverse ? n - 1 - i : i;
            if (emu_threads[t].state != EMU_RUNNABLE) continue;
            emu_current = t;
            threadIdx.x = t;
            swapcontext(&emu_scheduler, &emu_threads[t].ctx);
            ran = true;
        }
        // Release every warp whose live lanes all wait at a shuffle.
        bool released = false;
        for (unsigned w = 0; w < (n + 31) / 32; ++w) {
            unsigned lo = w * 32, hi = lo + 32 < n ? lo + 32 : n, at = 0, live = 0;
            for (unsigned t = lo; t < hi; ++t) {
                if (emu_threads[t].state != EMU_DONE) ++live;
                if (emu_threads[t].state == EMU_AT_WARP) ++at;
            }
            if (live > 0 && at == live) {
                // Every `_sync` built-in here names the whole warp (mask 0xffffffff); on a GPU a
                // lane that has returned, or is missing from a partial last warp, never
                // arrives, and the result is undefined.
                if (live != 32) {
                    std::fprintf(stderr,
                                 "emulation: block %u warp %u: a warp-wide exchange with %u of 32 "
                                 "lanes present\n",
                                 blockIdx.x, w, live);
                    std::exit(3);
                }
                for (unsigned t = lo; t < hi; ++t)
                    if (emu_threads[t].state == EMU_AT_WARP) emu_threads[t].state = EMU_RUNNABLE;
                released = true;
            }
        }
        if (released) continue;
        unsigned live = 0, at = 0;
        for (auto& th : emu_threads) {
            if (th.state != EMU_DONE) ++live;
            if (th.state == EMU_AT_BLOCK) ++at;
        }
        if (live == 0) return;
        if (at == live) {
            for (auto& th : emu_threads) th.state = EMU_RUNNABLE;
            continue;
        }
        if (!ran) {
            std::fprintf(stderr, "emulation: deadlock in block %u (a barrier not every thread reaches)\n",
                         blockIdx.x);
            std::exit(3);
        }
    }
}

template <typename F>
void emu_trampoline(void* f) {
    (*static_cast<F*>(f))();
}

// Runs `kernel<<<grid, block, smem>>>(args...)`.
template <typename... P, typename... A>
void emu_launch(void (*kernel)(P...), unsigned grid, unsigned block, size_t smem, A... args) {
    gridDim.x = grid;
    blockDim.x = block;
    emu_dynamic_shared.resize(smem / sizeof(float) + 1);
    emu_shuffle.assign(block, 0.0f);
    emu_mma_regs.assign(6 * block, 0u);
    auto call = [&]() { kernel(static_cast<P>(args)...); };
    emu_body = &emu_trampoline<decltype(call)>;
    emu_body_arg = &call;
    for (unsigned i = 0; i < grid; ++i) {
        blockIdx.x = emu_reverse ? grid - 1 - i : i;
        // Dynamic shared memory starts as NaN in every block (on a GPU it holds whatever the
        // block before left), so a read before a write shows in the output. (Static `__shared__`
        // arrays keep the previous block's values — which differ between the two orders: GCC
        // does not let a template's statics be placed where they could be reset.)
        std::fill(emu_dynamic_shared.begin(), emu_dynamic_shared.end(), std::nanf(""));
        emu_run_block();
    }
}
