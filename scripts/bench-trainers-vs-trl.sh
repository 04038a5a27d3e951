#!/usr/bin/env bash
# SFT, DPO, reward-model, ORPO and CPO steps against TRL 1.16's SFTTrainer, DPOTrainer,
# RewardTrainer and experimental ORPOTrainer / CPOTrainer,
# in one run on this machine (CPU, float32): the same model directory, the same rows
# (bench/trl_trainers_bench.py --write-data), batches of 8, AdamW at 1e-5, no checkpointing.
#
#   scripts/bench-trainers-vs-trl.sh MODEL_DIR [--steps N] [--rounds R]
#
# For each trainer it runs grpo-cli and TRL alternately R times (default 2) and prints the
# medians of seconds per step (the first step of each run left out) and their ratio (ours / TRL:
# below 1 is faster); TRAINERS="orpo cpo" picks some. Needs the release build (`cargo build --release -p grpo-cli`) and a Python
# with torch and TRL (PYTHON, default ~/trl-venv/bin/python; see bench/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
steps=6
rounds=2
model=""
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) steps=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    *) model=$1; shift ;;
  esac
done
[ -n "$model" ] || { echo "usage: scripts/bench-trainers-vs-trl.sh MODEL_DIR [--steps N] [--rounds R]" >&2; exit 2; }
PY=${PYTHON:-$HOME/trl-venv/bin/python}
BIN=target/release/grpo-cli
[ -x "$BIN" ] || { echo "error: $BIN missing: run cargo build --release -p grpo-cli" >&2; exit 2; }
[ -x "$PY" ] || { echo "error: $PY missing: see bench/README.md" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PY" bench/trl_trainers_bench.py --write-data "$work/data"

ours_once() {  # trainer data -> median s/step of our run
  local t=$1 data=$2 out="$work/run-$1-$RANDOM"
  cat > "$work/$t.toml" <<EOF
algorithm = "$t"
output_dir = "$out"
[model]
path = "$model"
[data]
path = ["$data"]
[optim]
learning_rate = 1e-5
[train]
max_steps = $steps
prompts_per_step = 8
per_device_train_batch_size = 8
save_steps = 0
EOF
  "$BIN" "$t" --config "$work/$t.toml" > /dev/null 2>&1
  "$PY" - "$out/metrics.jsonl" <<'PYEOF'
import json, statistics, sys
t = [json.loads(l)["step_time"] for l in open(sys.argv[1])]
print(statistics.median(t[1:] or t))
PYEOF
}

printf "%-8s %12s %12s %8s\n" trainer "ours s/step" "TRL s/step" ratio
for t in ${TRAINERS:-sft dpo reward orpo cpo}; do
  data="$work/data/pairs.jsonl"
  [ "$t" = sft ] && data="$work/data/sft.jsonl"
  ours=(); theirs=()
  for _ in $(seq "$rounds"); do
    ours+=("$(ours_once "$t" "$data")")
    theirs+=("$("$PY" bench/trl_trainers_bench.py "$model" "$t" "$data" --steps "$steps" 2>/dev/null \
      | tail -n 1 | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["s_per_step_median"])')")
  done
  "$PY" - "$t" "${ours[*]}" "${theirs[*]}" <<'PYEOF'
import statistics, sys
t, o, h = sys.argv[1], [float(x) for x in sys.argv[2].split()], [float(x) for x in sys.argv[3].split()]
a, b = statistics.median(o), statistics.median(h)
print(f"{t:<8} {a:12.4f} {b:12.4f} {a / b:8.2f}")
PYEOF
done
