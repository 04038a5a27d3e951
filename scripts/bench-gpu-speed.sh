#!/usr/bin/env bash
# GPU speed of one model in one run on one NVIDIA GPU (the figures docs/GPU_SPEED.md tracks):
# `grpo-cli check` in f32 and bf16 first (a failure is said above the table), then `grpo-cli bench-model`
# with our CUDA kernels, without the flash attention kernels alone (GRPO_CUDA_KERNELS=-flash_attention:
# training-length attention as the recomputed composition) and without any (GRPO_CUDA_KERNELS=0), and
# PyTorch on the same weights (scripts/bench_torch_model.py), each one JSON line; prints decode
# ms/step, prefill tokens/s, learner TFLOP/s and its share of the matmul peak as a markdown table.
#
#   scripts/bench-gpu-speed.sh [--model m770|m319|m29|DIR] [--dtype bf16|f32] [--batch 128]
#                              [--new-tokens 256] [--prompt-len 64] [--seq-len 320] [--reps 3]
#                              [--sanitize] [--profile] [--out DIR]
#
# --sanitize also runs `check --device cuda` under compute-sanitizer's memcheck and racecheck
# (out-of-bounds accesses and shared-memory races in our kernels), where the machine has it.
# --profile also times every kernel of a few decode steps with Nsight Compute (ncu, duration
# only) and prints the device time per step by kernel beside the step's wall time: a step whose
# kernels take much less than its wall time is waiting for the host (launches), not the GPU;
# and every kernel of a learner forward + backward (batch 8), summed by name: which products,
# which of our kernels and which of candle's elementwise ops hold the learner's time.
# Always: decode at batch 8 beside batch `--batch` (about the same ms/step = launch-bound).
#
# Run it on the GPU machine from the project root with .gpu/ as scripts/build-cuda.sh packs it
# (run-gpu.sh, the xz'd CUDA binary, make_tiny_model.py) and a Python with torch and transformers
# (PYTHON, default /opt/torch/.venv/bin/python). m770 / m319 / m29 are made on the spot (the
# models of scripts/bench-gpu-vs-trl.sh); a directory is taken as it is.
set -euo pipefail
model=m770 dtype=bf16 batch=128 new=256 plen=64 slen=320 reps=3 sanitize=0 profile=0
out=${OUT:-/tmp/bench-gpu-speed}
while [ $# -gt 0 ]; do
  case "$1" in
    --model) model=$2; shift 2 ;;
    --dtype) dtype=$2; shift 2 ;;
    --batch) batch=$2; shift 2 ;;
    --new-tokens) new=$2; shift 2 ;;
    --prompt-len) plen=$2; shift 2 ;;
    --seq-len) slen=$2; shift 2 ;;
    --reps) reps=$2; shift 2 ;;
    --sanitize) sanitize=1; shift ;;
    --profile) profile=1; shift ;;
    --out) out=$2; shift 2 ;;
    *) echo "bench-gpu-speed.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
here="$(cd "$(dirname "$0")/.." && pwd)"
gpu="${GPU_DIR:-$here/.gpu}"
PY=${PYTHON:-/opt/torch/.venv/bin/python}
[ -x "$gpu/run-gpu.sh" ] || { echo "error: $gpu/run-gpu.sh missing: run scripts/build-cuda.sh first" >&2; exit 2; }
mkdir -p "$out"
case "$model" in
  m29) args="--hidden 512 --layers 8 --heads 8 --kv-heads 4 --vocab 8192" ;;
  m319) args="--hidden 1024 --layers 24 --heads 16 --kv-heads 8 --vocab 16384" ;;
  m770) args="--hidden 1536 --layers 28 --heads 12 --kv-heads 2 --vocab 16384" ;;
  *) args="" ;;
esac
if [ -n "$args" ]; then
  dir="$out/models/$model"
  # shellcheck disable=SC2086
  [ -f "$dir/config.json" ] || "$PY" "$gpu/make_tiny_model.py" "$dir" $args >/dev/null
else
  dir="$model"
fi

checks=""
for dt in f32 bf16; do
  echo "== grpo-cli check --device cuda --dtype $dt"
  bash "$gpu/run-gpu.sh" check --device cuda --dtype "$dt" 2>&1 | tee "$out/check-$dt.txt" \
    || checks="$checks check --dtype $dt FAILED;"
done

if [ "$sanitize" = 1 ]; then
  san=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1 || true)
  if [ -z "$san" ]; then
    checks="$checks compute-sanitizer not found;"
  else
    for tool in memcheck racecheck; do
      echo "== compute-sanitizer --tool $tool grpo-cli check --device cuda"
      # run-gpu.sh execs the binary, so the sanitizer follows it.
      "$san" --tool "$tool" --error-exitcode 3 bash "$gpu/run-gpu.sh" check --device cuda \
        > "$out/sanitize-$tool.txt" 2>&1 || checks="$checks compute-sanitizer $tool FAILED;"
      tail -n 3 "$out/sanitize-$tool.txt"
    done
  fi
fi

flags=(--batch "$batch" --new-tokens "$new" --prompt-len "$plen" --seq-len "$slen" --reps "$reps"
       --device cuda --dtype "$dtype")
run() { # name command...
  local name=$1; shift
  if "$@" > "$out/$name.jsonl" 2> "$out/$name.err"; then :; else
    echo "{\"failed\": \"$(tail -n 1 "$out/$name.err" | tr -d '"' | cut -c1-80)\"}" > "$out/$name.jsonl"
  fi
}
run kernels bash "$gpu/run-gpu.sh" bench-model --model "$dir" "${flags[@]}"
run no_flash env GRPO_CUDA_KERNELS=-flash_attention bash "$gpu/run-gpu.sh" bench-model --model "$dir" "${flags[@]}"
run compositions env GRPO_CUDA_KERNELS=0 bash "$gpu/run-gpu.sh" bench-model --model "$dir" "${flags[@]}"
run torch "$PY" "$here/scripts/bench_torch_model.py" "$dir" "${flags[@]}"
small=(--batch 8 --new-tokens "$new" --prompt-len "$plen" --reps "$reps" --device cuda --dtype "$dtype")
run kernels_b8 bash "$gpu/run-gpu.sh" bench-model --model "$dir" --phase generate "${small[@]}"

prof=""
if [ "$profile" = 1 ]; then
  ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1 || true)
  if [ -z "$ncu" ]; then
    prof="ncu not found"
  else
    # Skip the prefill and the first decode steps by launch count (about 10 launches per layer
    # and 40 more per step, over-counted), then time the launches of about 8 steps.
    layers=$(sed -n 's/.*"num_hidden_layers": *\([0-9]*\).*/\1/p' "$dir/config.json")
    per=$(( 10 * ${layers:-28} + 40 ))
    echo "== ncu: kernel durations of 8 decode steps"
    "$ncu" --target-processes all --clock-control none --metrics gpu__time_duration.sum --csv \
      --launch-skip $(( 12 * per )) --launch-count $(( 8 * per )) \
      bash "$gpu/run-gpu.sh" bench-model --model "$dir" --phase generate --reps 1 \
      --batch "$batch" --new-tokens 32 --prompt-len "$plen" --device cuda --dtype "$dtype" \
      > "$out/ncu.csv" 2> "$out/ncu.err" || prof="ncu failed: $(tail -n 1 "$out/ncu.err")"
    # The learner: every kernel of a forward + backward at batch 8 (its warm-up run and one
    # timed run, and the matmul-peak products of bench-model), summed by kernel name.
    echo "== ncu: kernel durations of the learner's forward + backward (batch 8)"
    "$ncu" --target-processes all --clock-control none --metrics gpu__time_duration.sum --csv \
      bash "$gpu/run-gpu.sh" bench-model --model "$dir" --phase fwd-bwd --reps 1 \
      --batch 8 --seq-len "$slen" --device cuda --dtype "$dtype" \
      > "$out/ncu-learner.csv" 2> "$out/ncu-learner.err" || prof="$prof; ncu (learner) failed"
  fi
fi

echo
[ -n "$checks" ] && echo "**$checks see $out/check-*.txt**" && echo
echo "| $model $dtype, batch $batch, $plen + $new tokens; learner $batch x $slen | decode ms/step | of which layers / head / sampling ms | prefill tokens/s | learner TFLOP/s (forward s of fwd+bwd s) | share of matmul peak |"
echo "|---|---|---|---|---|---|"
for name in kernels no_flash compositions torch kernels_b8; do
  "$PY" - "$out/$name.jsonl" "$name" <<'EOF'
import json, sys
lines = [l for l in open(sys.argv[1]) if l.startswith("{")]
d = json.loads(lines[-1]) if lines else {"failed": "no output"}
label = {"kernels": "grpo-rs, our CUDA kernels",
         "no_flash": "grpo-rs, GRPO_CUDA_KERNELS=-flash_attention", "compositions": "grpo-rs, GRPO_CUDA_KERNELS=0",
         "torch": "PyTorch (transformers)",
         "kernels_b8": "grpo-rs, our CUDA kernels, batch 8 (decode only)"}[sys.argv[2]]
if "failed" in d:
    print(f"| {label} | failed: {d['failed']} | | | | |")
else:
    f = lambda k, p: "—" if d.get(k) is None else f"{d[k]:.{p}f}"
    print(f"| {label} | {f('decode_ms_per_step', 2)} | "
          f"{f('decode_layers_ms', 2)} / {f('decode_head_ms', 2)} / {f('decode_sample_ms', 2)} | "
          f"{f('prefill_tokens_per_s', 0)} | {f('fwd_bwd_tflop_per_s', 2)} "
          f"({f('fwd_s_median', 3)} of {f('fwd_bwd_s_median', 3)}) | "
          f"{f('fwd_bwd_matmul_fraction', 3)} |")
EOF
done

if [ "$profile" = 1 ]; then
  echo
  if [ -n "$prof" ]; then echo "**profile: $prof**"; else
  "$PY" "$here/scripts/ncu_summary.py" "$out/ncu.csv" decode "$out/kernels.jsonl"
  echo
  "$PY" "$here/scripts/ncu_summary.py" "$out/ncu-learner.csv" learner
  fi
fi
