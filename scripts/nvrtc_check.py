"""Compile every CUDA kernel set of grpo-rs as the binary does at first use, without a GPU.

Each set (grpo-core/src/head.cu, quant.cu; grpo-rollout/src/kernels.cu, flash.cu) is compiled
after the shared prelude (grpo-core/src/cuda_prelude.cu) by NVRTC with the options
`grpo_core::cuda::compile` passes (`--std=c++17`, the GPU's virtual architecture), and the PTX
is assembled by ptxas for the same GPU, which prints each kernel's registers, spills and
shared memory. Exit status 1 when a set does not compile, a kernel spills, or a block's
static shared memory passes 48 KiB.

NVRTC and ptxas come from CUDA's PyPI wheels (no GPU or driver needed):

    python3 -m venv /tmp/nvrtc && /tmp/nvrtc/bin/pip install nvidia-cuda-nvrtc==13.0.88 \\
        nvidia-cuda-nvcc==13.0.88
    /tmp/nvrtc/bin/python scripts/nvrtc_check.py [--arch 90] [--verbose]
"""
import argparse, ctypes, glob, os, re, subprocess, sys, tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETS = [
    ("grpo_head", "grpo-core/src/head.cu"),
    ("grpo_quant", "grpo-core/src/quant.cu"),
    ("grpo_decoder", "grpo-rollout/src/kernels.cu"),
    ("grpo_flash", "grpo-rollout/src/flash.cu"),
]


def cuda_dir():
    import nvidia  # the wheels' namespace package

    for base in nvidia.__path__:
        for d in sorted(glob.glob(os.path.join(base, "cu*"))):
            if glob.glob(os.path.join(d, "lib", "libnvrtc.so*")):
                return d
    sys.exit("error: no libnvrtc in this Python's nvidia wheels (pip install nvidia-cuda-nvrtc)")


def nvrtc_ptx(lib, name, source, arch):
    prog = ctypes.c_void_p()
    check = lambda rc, what: rc == 0 or sys.exit(f"error: {what} returned {rc}")
    check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(),
                                 0, None, None), "nvrtcCreateProgram")
    opts = [b"--std=c++17", f"--gpu-architecture=compute_{arch}".encode()]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        return None, log.value.decode(errors="replace")
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(prog, ptx)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return ptx.value.decode(), log.value.decode(errors="replace")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="90", help="compute capability, e.g. 80, 90 (default 90)")
    p.add_argument("--verbose", action="store_true", help="every kernel's ptxas line")
    a = p.parse_args()
    cu = cuda_dir()
    # NVRTC opens its builtins library by name at compile time: loaded first, it is found.
    for b in sorted(glob.glob(os.path.join(cu, "lib", "libnvrtc-builtins.so*"))):
        ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(sorted(glob.glob(os.path.join(cu, "lib", "libnvrtc.so*")))[0])
    ptxas = os.path.join(cu, "bin", "ptxas")
    prelude = open(os.path.join(ROOT, "grpo-core/src/cuda_prelude.cu")).read()
    failed = False
    for name, path in SETS:
        src = prelude + "\n" + open(os.path.join(ROOT, path)).read()
        ptx, log = nvrtc_ptx(lib, name, src, a.arch)
        if ptx is None:
            print(f"FAIL {name} ({path}): NVRTC:\n{log}")
            failed = True
            continue
        if not os.path.exists(ptxas):
            print(f"ok   {name}: NVRTC compiled (no ptxas beside it: pip install nvidia-cuda-nvcc)")
            continue
        with tempfile.TemporaryDirectory() as d:
            f = os.path.join(d, f"{name}.ptx")
            open(f, "w").write(ptx)
            r = subprocess.run([ptxas, f"-arch=sm_{a.arch}", "-v", "-o", os.devnull, f],
                               capture_output=True, text=True)
        if r.returncode != 0:
            print(f"FAIL {name}: ptxas:\n{r.stderr}")
            failed = True
            continue
        kernels, worst = 0, []
        for fn, body in re.findall(r"Compiling entry function '(\w+)'.*?\n(.*?)(?=ptxas info\s+: Compiling|\Z)",
                                   r.stderr, re.S):
            kernels += 1
            regs = int((re.search(r"Used (\d+) registers", body) or [0, 0])[1])
            smem = int((re.search(r"(\d+) bytes smem", body) or [0, 0])[1])
            spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", body)
            spills = spill and (int(spill[1]) or int(spill[2]))
            bad = spills or smem > 48 * 1024
            if bad or a.verbose:
                print(f"  {'FAIL' if bad else 'ok  '} {fn}: {regs} registers, {smem} B shared"
                      + (f", spills {spill[1]}/{spill[2]} B" if spills else ""))
            failed |= bool(bad)
            worst.append((regs, fn))
        top = max(worst) if worst else (0, "-")
        print(f"ok   {name}: {kernels} kernels for sm_{a.arch}; most registers {top[0]} ({top[1]})")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
