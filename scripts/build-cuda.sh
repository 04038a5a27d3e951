#!/usr/bin/env bash
# Builds `grpo-cli` with `--features cuda` on a machine that has no CUDA toolkit and no GPU, and packs
# it to travel to a lent GPU machine (NVIDIA driver >= 580 / CUDA 13.0, H100/H200 = compute capability 90).
#
#   scripts/build-cuda.sh [OUT_DIR]        run from the project root; OUT_DIR default: .gpu
#
# CUDA 13.0's compiler, headers and libraries come from PyPI wheels into /tmp/cudaenv and are laid out
# as a CUDA root in /tmp/cudaroot (with a link-time stub of libcuda.so, since no wheel ships one).
# A cold build takes about 30 minutes on 2 cores (candle-kernels' nvcc work is ~17 of them); later
# builds reuse CARGO_TARGET_DIR (default /tmp/cuda-target). The packed binary is xz'd (~15 MB) so it
# fits the 64 MiB a device call may carry; run-gpu.sh unpacks it on the GPU machine and finds the
# CUDA 13 libraries of that machine's torch venv (/opt/torch/.venv) and the driver's libcuda.so.1.
set -euo pipefail
SRC="$(pwd)"; OUT="${1:-$SRC/.gpu}"
VENV=/tmp/cudaenv; ROOT=/tmp/cudaroot
[[ -f "$SRC/Cargo.toml" ]] || { echo "build-cuda.sh: run it from the project root" >&2; exit 2; }

if [[ ! -x "$ROOT/bin/nvcc" ]]; then
    [[ -x "$VENV/bin/pip" ]] || python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 \
        nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-nvrtc==13.0.88 nvidia-curand==10.4.0.35 \
        nvidia-cublas==13.0.2.14
    CU13="$(ls -d "$VENV"/lib/python3*/site-packages/nvidia/cu13)"
    rm -rf "$ROOT"; cp -al "$CU13" "$ROOT"; ln -s lib "$ROOT/lib64"
    for f in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libnvrtc.so.13; do
        ln -sf "$f" "$ROOT/lib/${f%%.so*}.so"
    done
    (cd "$SRC" && cargo fetch -q)
    ver="$(grep -A1 '^name = "cudarc"' "$SRC/Cargo.lock" | sed -n 's/^version = "\(.*\)"/\1/p')"
    reg="$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-"$ver" | head -n 1)"
    mkdir -p "$ROOT/lib/stubs"
    # Link-time stand-in for the driver library: one dummy per cu* symbol cudarc binds.
    grep -oE '^pub unsafe fn cu[A-Za-z0-9_]+' "$reg/src/driver/sys/mod.rs" | awk '{print $4}' | sort -u \
        | sed 's/.*/int &(void) { return 999; }/' > "$ROOT/lib/stubs/libcuda_stub.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$ROOT/lib/stubs/libcuda.so" "$ROOT/lib/stubs/libcuda_stub.c"
fi

export CUDA_ROOT="$ROOT" CUDA_PATH="$ROOT" CUDA_HOME="$ROOT" CUDA_TOOLKIT_ROOT_DIR="$ROOT"
export PATH="$ROOT/bin:$PATH" LIBRARY_PATH="$ROOT/lib:$ROOT/lib/stubs" CUDA_COMPUTE_CAP=90
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/tmp/cuda-target}"
cargo build --release -p grpo-cli --features cuda
# The kernels compile at first use on the GPU: compile them now with the same NVRTC (and ptxas),
# so that a compile error, a spill or a block over 48 KiB of shared memory shows here.
if [[ -x "$VENV/bin/python" ]]; then "$VENV/bin/python" "$SRC/scripts/nvrtc_check.py" --arch 90; fi

mkdir -p "$OUT"
cp "$CARGO_TARGET_DIR/release/grpo-cli" "$OUT/grpo-cli-cuda"; strip "$OUT/grpo-cli-cuda"
(cd "$OUT" && sha256sum grpo-cli-cuda > grpo-cli-cuda.sha256 && xz -T2 -6 -f grpo-cli-cuda)
# Which source the binary is: the commit, and the files that differed from it at build time.
if git -C "$SRC" rev-parse -q HEAD >/dev/null 2>&1; then
    { git -C "$SRC" rev-parse HEAD; git -C "$SRC" status --porcelain --untracked-files=no; } > "$OUT/built-from.txt"
fi
cp "$SRC/scripts/run-gpu.sh" "$SRC/bench/trl_grpo_bench_gpu.py" "$SRC/bench/make_tiny_model.py" \
    "$SRC/bench/make_mla_model.py" "$OUT/"
if [[ "$OUT" == "$SRC/.gpu" ]] && [[ -d "$SRC/.git" ]]; then
    mkdir -p "$SRC/.git/info"; grep -qxF '/.gpu/' "$SRC/.git/info/exclude" 2>/dev/null || echo '/.gpu/' >> "$SRC/.git/info/exclude"
fi
ls -la "$OUT"
