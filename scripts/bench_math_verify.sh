#!/usr/bin/env bash
# math_verify's speed: `grpo-cli score` with the `math_verify` reward over the committed
# reference cases (tests/tests/data/math_verify_reference.json), beside TRL's own
# `accuracy_reward` on the same cases when TRL_PYTHON has trl and math-verify. Medians of 3.
#
#   cargo build --release -p grpo-cli
#   TRL_PYTHON=/path/to/python bash scripts/bench_math_verify.sh [MODEL_DIR]
#
# MODEL_DIR gives the tokenizer (any model directory; default: a tiny one made here).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bin="$root/target/release/grpo-cli"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
model="${1:-}"
if [ -z "$model" ]; then
  model="$work/model"
  "$bin" init-model --out "$model" --preset tiny >/dev/null
fi
python3 - "$root/tests/tests/data/math_verify_reference.json" "$work/rows.jsonl" <<'PY'
import json, sys
cases = json.load(open(sys.argv[1]))["cases"]
with open(sys.argv[2], "w") as f:
    for c in cases:
        row = {"prompt": "q", "completion": [{"role": "assistant", "content": c["completion"]}],
               "solution": c["solution"]}
        f.write(json.dumps(row) + "\n")
PY
printf '[model]\npath = "%s"\n[[rewards]]\ntype = "math_verify"\n' "$model" > "$work/rewards.toml"
times=()
for _ in 1 2 3; do
  start=$(date +%s.%N)
  "$bin" score --config "$work/rewards.toml" --data "$work/rows.jsonl" --json > "$work/summary.json"
  end=$(date +%s.%N)
  times+=("$(echo "$end - $start" | bc)")
done
median=$(printf '%s\n' "${times[@]}" | sort -n | sed -n 2p)
echo "grpo-cli score: $(wc -l < "$work/rows.jsonl") completions in ${median} s (median of 3, whole process)"
cat "$work/summary.json"; echo
py="${TRL_PYTHON:-python3}"
if "$py" -c "import trl.rewards, math_verify" 2>/dev/null; then
  "$py" - "$root/tests/tests/data/math_verify_reference.json" <<'PY' 2>/dev/null
import json, sys, time
from trl.rewards import accuracy_reward
cases = json.load(open(sys.argv[1]))["cases"]
comps = [[{"role": "assistant", "content": c["completion"]}] for c in cases]
sols = [c["solution"] for c in cases]
times = []
for _ in range(3):
    t = time.perf_counter()
    accuracy_reward(comps, sols)
    times.append(time.perf_counter() - t)
print(f"TRL accuracy_reward: {len(cases)} completions in {sorted(times)[1]:.2f} s (median of 3, the call alone)")
PY
else
  echo "TRL side skipped: $py has no trl + math_verify (TRL_PYTHON)"
fi
