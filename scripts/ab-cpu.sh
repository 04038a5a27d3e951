#!/usr/bin/env bash
# Two builds of grpo-cli against each other on this machine, in A B B A rounds (each build runs
# first in half of them, so a drift of the machine's speed does not favour one), reading a
# figure from the JSON line each run prints. Prints each run, then the medians, their ratio and
# in how many rounds B was faster.
#
#   scripts/ab-cpu.sh A_BIN B_BIN ROUNDS FIELD -- ARGS...
#   scripts/ab-cpu.sh /tmp/old/grpo-cli target/release/grpo-cli 8 generate_s_median -- \
#       bench-model --model /tmp/bench-models/small-qwen2 --phase generate --reps 3
set -euo pipefail
[[ $# -ge 6 && "$5" == "--" ]] || { sed -n 2,9p "$0" | sed 's/^# \{0,1\}//'; exit 2; }
A="$1"; B="$2"; ROUNDS="$3"; FIELD="$4"; shift 5
for bin in "$A" "$B"; do [[ -x "$bin" ]] || { echo "ab-cpu.sh: $bin is not an executable" >&2; exit 2; }; done
runs="$(mktemp)"; trap 'rm -f "$runs"' EXIT
figure() {
    "$1" "${@:2}" 2>/dev/null | python3 -c '
import json, sys
field = sys.argv[1]
rows = [json.loads(l) for l in sys.stdin if l.startswith("{")]
if not rows or rows[-1].get(field) is None:
    sys.exit(f"ab-cpu.sh: no {field} in the run'"'"'s last JSON line")
print(rows[-1][field])' "$FIELD"
}
for i in $(seq "$ROUNDS"); do
    if (( i % 2 )); then order="A B"; else order="B A"; fi
    for side in $order; do
        if [[ $side == A ]]; then bin="$A"; else bin="$B"; fi
        v="$(figure "$bin" "$@")"
        echo "$i $side $v" | tee -a "$runs"
    done
done
python3 - "$runs" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
a = {r[0]: float(r[2]) for r in rows if r[1] == "A"}
b = {r[0]: float(r[2]) for r in rows if r[1] == "B"}
ma, mb = statistics.median(a.values()), statistics.median(b.values())
faster = sum(b[k] < a[k] for k in a)
print(f"median A {ma:.4g}  B {mb:.4g}  B/A {mb / ma:.3f}  B lower in {faster} of {len(a)} rounds")
PY
