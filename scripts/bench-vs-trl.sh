#!/usr/bin/env bash
# The GRPO step benchmark against TRL, in one run on this machine (bench/README.md).
#
#   scripts/bench-vs-trl.sh [--steps N] [--rounds R] [MODEL_DIR...]
#
# For each model directory (default: ~/bench-models/tiny-qwen2 and ~/bench-models/small-qwen2)
# it runs `grpo-cli bench` and bench/trl_grpo_bench.py alternately R times (default 2)
# and prints both medians and their ratio (ours / TRL: below 1 is faster), plus the machine's
# f32 matmul rate (torch, 1024^3, all cores) measured in the same run. Needs the release build
# (`cargo build --release -p grpo-cli`) and the TRL venv (PYTHON, default ~/trl-venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
steps=6
rounds=2
models=()
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) steps=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    *) models+=("$1"); shift ;;
  esac
done
[ ${#models[@]} -eq 0 ] && models=("$HOME/bench-models/tiny-qwen2" "$HOME/bench-models/small-qwen2")
PY=${PYTHON:-$HOME/trl-venv/bin/python}
BIN=target/release/grpo-cli
TRL=${TRL_BENCH:-bench/trl_grpo_bench.py}
[ -x "$BIN" ] || { echo "error: $BIN missing: run cargo build --release -p grpo-cli" >&2; exit 2; }
[ -x "$PY" ] || { echo "error: $PY missing: see bench/README.md" >&2; exit 2; }
[ -f "$TRL" ] || { echo "error: $TRL missing" >&2; exit 2; }

gflops=$("$PY" - <<'PYEOF'
import time, torch
a = torch.randn(1024, 1024); b = torch.randn(1024, 1024)
for _ in range(3): a @ b
best = min((lambda t: (a @ b, time.perf_counter() - t)[1])(time.perf_counter()) for _ in range(20))
print(f"{2 * 1024**3 / best / 1e9:.1f}")
PYEOF
)
echo "f32 matmul (torch, 1024^3, $(nproc) cores): $gflops GFLOP/s"
for m in "${models[@]}"; do
  [ -d "$m" ] || { echo "error: model directory $m missing (bench/make_tiny_model.py)" >&2; exit 2; }
  ours=(); trl=()
  for r in $(seq "$rounds"); do
    ours+=("$("$BIN" bench --model "$m" --steps "$steps" | tail -1)")
    # TRL's peak RSS from /usr/bin/time (its bench does not report memory).
    tf=$(mktemp)
    if [ -x /usr/bin/time ]; then
      line=$(/usr/bin/time -f '%M' -o "$tf" "$PY" "$TRL" "$m" --steps "$steps" 2>/dev/null | tail -1)
    else
      line=$("$PY" "$TRL" "$m" --steps "$steps" 2>/dev/null | tail -1); echo 0 > "$tf"
    fi
    trl+=("$(python3 -c 'import json, sys; d = json.loads(sys.argv[1]); d["peak_rss_mib"] = int(sys.argv[2]) / 1024; print(json.dumps(d))' "$line" "$(tail -1 "$tf")")")
    rm -f "$tf"
  done
  OURS="$(printf '%s\n' "${ours[@]}")" TRLS="$(printf '%s\n' "${trl[@]}")" python3 - "$m" <<'PYEOF'
import json, os, statistics, sys
ours = [json.loads(l) for l in os.environ["OURS"].splitlines() if l.strip()]
trl = [json.loads(l) for l in os.environ["TRLS"].splitlines() if l.strip()]
o = statistics.median(x["step_s_median"] for x in ours)
t = statistics.median(x["step_s_median"] for x in trl)
ph = {k: round(statistics.median(x[k] for x in ours), 3) for k in ("generate_s_median", "train_s_median")}
print(f"{os.path.basename(sys.argv[1].rstrip('/'))}: grpo-rs {o:.3f} s/step {ph}, TRL {t:.3f} s/step, "
      f"ratio {o / t:.2f} ({'faster' if o < t else 'slower'}); "
      f"peak RSS grpo-rs {max(x.get('peak_rss_mib', 0) for x in ours):.0f} MiB, "
      f"TRL {max(x.get('peak_rss_mib', 0) for x in trl):.0f} MiB")
PYEOF
done
