#!/usr/bin/env bash
# The GPU comparison against TRL in one run on one NVIDIA GPU: for each workload row, our CUDA
# build (`grpo-cli bench --device cuda`, with and without gradient checkpointing) and TRL's
# GRPOTrainer (bench/trl_grpo_bench_gpu.py) on the same model files, one after the other. Prints
# step time (median over the steps after the first) and peak GPU memory (nvidia-smi's
# memory.used sampled every 200 ms, the maximum during the run) as a markdown table.
#
#   scripts/bench-gpu-vs-trl.sh [--steps N] [--rows quick|all|NAME,NAME,...] [--budget SECONDS]
#                               [--sides both|ours|trl] [--overlap | --overlap-rows NAME,...]
#                               [--optim8 NAME,...] [--out DIR]
#
# --rows takes workload names from the table below (in the order given); --budget stops starting
# runs once that many seconds have passed (a run is also cut at what is left: its cell then says
# `timed out`) — for a lent GPU whose time is counted. --overlap adds our run at
# `pipeline.max_staleness = 1` (the next step's generation overlapping the learner's step);
# --overlap-rows on the workloads named only.
# --optim8 adds, on the workloads named, our run with gradient checkpointing and
# `optim.optim = "adamw_8bit"` (bitsandbytes' 8-bit AdamW: the memory floor of a full fine-tune).
#
# Run it on the GPU machine from a directory that holds what scripts/build-cuda.sh packs
# (.gpu/: run-gpu.sh, the xz'd CUDA binary, make_tiny_model.py, trl_grpo_bench_gpu.py) with a
# Python that has torch, transformers, trl and datasets (PYTHON, default /opt/torch/.venv/bin/python).
# Model directories are made on the spot with make_tiny_model.py (29M, 319M, 0.77B).
set -euo pipefail
steps=6
rows=all
budget=0
sides=both
overlap=0
optim8=""
out=${OUT:-/tmp/bench-gpu}
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) steps=$2; shift 2 ;;
    --rows) rows=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --budget) budget=$2; shift 2 ;;
    --sides) sides=$2; shift 2 ;;
    --overlap) overlap=1; shift ;;
    --overlap-rows) overlap=",$2,"; shift 2 ;;
    --optim8) optim8=",$2,"; shift 2 ;;
    *) echo "bench-gpu-vs-trl.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
start=$SECONDS
here="$(cd "$(dirname "$0")/.." && pwd)"
gpu="${GPU_DIR:-$here/.gpu}"
PY=${PYTHON:-/opt/torch/.venv/bin/python}
[ -x "$gpu/run-gpu.sh" ] || { echo "error: $gpu/run-gpu.sh missing: run scripts/build-cuda.sh first" >&2; exit 2; }
command -v nvidia-smi >/dev/null || { echo "error: nvidia-smi not found: this needs an NVIDIA GPU" >&2; exit 2; }
mkdir -p "$out"
models="$out/models"
mk() { # name hidden layers heads kv vocab
  [ -f "$models/$1/config.json" ] || "$PY" "$gpu/make_tiny_model.py" "$models/$1" --hidden "$2" \
    --layers "$3" --heads "$4" --kv-heads "$5" --vocab "$6" >/dev/null
}
mk m29 512 8 8 4 8192
mk m319 1024 24 16 8 16384
mk m770 1536 28 12 2 16384

# Peak of nvidia-smi's memory.used (MiB) while "$@" runs; the command's stdout goes to $log.
peak_of() {
  local log=$1; shift
  local smi="$log.smi"
  local rc=0
  local limit=()
  if [ "$budget" != 0 ]; then
    local left=$((start + budget - SECONDS))
    if [ "$left" -lt 20 ]; then peak="-"; echo "skipped: out of budget" > "$log.err"; return 3; fi
    limit=(timeout "$left")
  fi
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$smi" &
  local spid=$!
  ${limit[@]+"${limit[@]}"} "$@" > "$log" 2> "$log.err" || rc=$?
  [ "$rc" = 124 ] && echo "timed out (budget)" >> "$log.err"
  kill "$spid" 2>/dev/null; wait "$spid" 2>/dev/null || true
  peak=$(sort -n "$smi" | tail -n 1)
  return $rc
}
field() { # key file
  "$PY" -c 'import json,sys; l=[x for x in open(sys.argv[2]) if x.startswith("{")]; print(json.loads(l[-1]).get(sys.argv[1], "nan") if l else "nan")' "$1" "$2"
}

# name model dtype prompts g tokens micro-batch lora-r
all_rows=(
  "29M-f32-4x8x64 m29 f32 4 8 64 0 0"
  "319M-bf16-4x8x64 m319 bf16 4 8 64 0 0"
  "319M-f32-4x8x64 m319 f32 4 8 64 0 0"
  "319M-bf16-lora16-4x8x64 m319 bf16 4 8 64 0 16"
  "319M-bf16-8x16x256-mb32 m319 bf16 8 16 256 32 0"
  "0.77B-bf16-8x16x256-mb32 m770 bf16 8 16 256 32 0"
  "0.77B-bf16-lora16-8x16x256-mb32 m770 bf16 8 16 256 32 16"
)
case "$rows" in
  all) ;;
  quick) all_rows=("${all_rows[@]:0:2}") ;;
  *) picked=()
     IFS=, read -r -a names <<< "$rows"
     for n in "${names[@]}"; do
       hit=""
       for r in "${all_rows[@]}"; do [ "${r%% *}" = "$n" ] && hit=$r; done
       [ -n "$hit" ] || { echo "bench-gpu-vs-trl.sh: --rows: no workload named $n" >&2; exit 2; }
       picked+=("$hit")
     done
     all_rows=("${picked[@]}") ;;
esac

table="| workload | grpo-rs s/step | grpo-rs peak MiB | grpo-rs + checkpointing s/step | peak MiB | TRL s/step | TRL peak MiB |"
sep="|---|---|---|---|---|---|---|"
if [ "$overlap" != 0 ]; then
  table="$table grpo-rs, max_staleness 1 s/step | peak MiB |"
  sep="$sep---|---|"
fi
if [ -n "$optim8" ]; then
  table="$table grpo-rs + checkpointing + adamw_8bit s/step | peak MiB |"
  sep="$sep---|---|"
fi
table="$table\n$sep"
for row in "${all_rows[@]}"; do
  read -r name model dtype prompts g tokens mb lora <<< "$row"
  ours=(bench --model "$models/$model" --device cuda --dtype "$dtype" --steps "$steps"
        --prompts "$prompts" --generations "$g" --completion-length "$tokens")
  trl=("$PY" "$gpu/trl_grpo_bench_gpu.py" "$models/$model" --steps "$steps" --dtype "$dtype"
       --prompts "$prompts" --g "$g" --completion "$tokens")
  [ "$mb" != 0 ] && { ours+=(--micro-batch "$mb"); trl+=(--mb "$mb"); }
  [ "$lora" != 0 ] && { ours+=(--lora-r "$lora"); trl+=(--lora-r "$lora"); }
  cells=()
  for ck in no yes; do
    [ "$sides" = trl ] && { cells+=("-" "-"); continue; }
    extra=(); [ "$ck" = yes ] && extra=(--gradient-checkpointing)
    log="$out/$name-ours-ckpt-$ck.jsonl"
    if peak_of "$log" bash "$gpu/run-gpu.sh" "${ours[@]}" "${extra[@]}"; then
      cells+=("$(field step_s_median "$log")" "$peak")
    else
      cells+=("failed: $(tail -n 1 "$log.err" | cut -c1-60)" "$peak")
    fi
  done
  log="$out/$name-trl.jsonl"
  if [ "$sides" = ours ]; then
    cells+=("-" "-")
  elif peak_of "$log" "${trl[@]}"; then
    cells+=("$(field step_s_median "$log")" "$peak")
  else
    cells+=("failed: $(tail -n 1 "$log.err" | cut -c1-60)" "$peak")
  fi
  line="| $name | ${cells[0]} | ${cells[1]} | ${cells[2]} | ${cells[3]} | ${cells[4]} | ${cells[5]} |"
  if [ "$overlap" != 0 ]; then
    log="$out/$name-ours-staleness-1.jsonl"
    if [ "$sides" = trl ] || { [ "$overlap" != 1 ] && [ "${overlap#*,$name,}" = "$overlap" ]; }; then
      line="$line - | - |"
    elif peak_of "$log" bash "$gpu/run-gpu.sh" "${ours[@]}" --max-staleness 1; then
      line="$line $(field step_s_median "$log") | $peak |"
    else
      line="$line failed: $(tail -n 1 "$log.err" | cut -c1-60) | $peak |"
    fi
  fi
  if [ -n "$optim8" ]; then
    log="$out/$name-ours-ckpt-adamw8bit.jsonl"
    if [ "$sides" = trl ] || [ "${optim8#*,$name,}" = "$optim8" ]; then
      line="$line - | - |"
    elif peak_of "$log" bash "$gpu/run-gpu.sh" "${ours[@]}" --gradient-checkpointing --optim adamw_8bit; then
      line="$line $(field step_s_median "$log") | $peak |"
    else
      line="$line failed: $(tail -n 1 "$log.err" | cut -c1-60) | $peak |"
    fi
  fi
  echo "$line"
  table="$table\n$line"
  printf '%b\n' "$table" > "$out/table.md"
done
echo
printf '%b\n' "$table" | tee "$out/table.md"
