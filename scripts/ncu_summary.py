"""Sums Nsight Compute's kernel durations (`ncu --metrics gpu__time_duration.sum --csv`) by
kernel name and prints a markdown table (scripts/bench-gpu-speed.sh --profile).

usage: python3 ncu_summary.py NCU_CSV decode [BENCH_JSONL] # per decode step, beside its wall time
       python3 ncu_summary.py NCU_CSV learner              # totals of a learner's forward + backward
"""
import collections, csv, json, sys

SCALE = {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0, "second": 1e3}


def durations(path):
    """(total ms, launches) by kernel name, or None when ncu wrote nothing."""
    try:
        rows = list(csv.reader(l for l in open(path) if l.startswith('"')))
    except OSError:
        return None
    if not rows:
        return None
    head, body = rows[0], rows[1:]
    ki, mi, vi, ui = (head.index(k) for k in ("Kernel Name", "Metric Name", "Metric Value", "Metric Unit"))
    tot, cnt = collections.Counter(), collections.Counter()
    for r in body:
        if r[mi] != "gpu__time_duration.sum":
            continue
        name = r[ki].split("(")[0].split("<")[0][:60]
        tot[name] += float(r[vi].replace(",", "")) * SCALE.get(r[ui], 1e-6)
        cnt[name] += 1
    return tot, cnt


def main():
    path, mode = sys.argv[1], sys.argv[2]
    got = durations(path)
    if got is None:
        print(f"**profile ({mode}): ncu wrote no rows**")
        return
    tot, cnt = got
    if mode == "decode":
        try:
            lines = [l for l in open(sys.argv[3]) if l.startswith("{")] if len(sys.argv) > 3 else []
        except OSError:
            lines = []
        wall = json.loads(lines[-1]).get("decode_ms_per_step") if lines else None
        # One sampling kernel per decode step counts the steps timed.
        steps = sum(c for n, c in cnt.items() if n.startswith("sample_rows")) or 8
        print(f"| kernel (ncu, {steps} decode steps) | launches per step | device ms per step |")
        print("|---|---|---|")
        for name, t in tot.most_common(15):
            print(f"| {name} | {cnt[name] / steps:.1f} | {t / steps:.3f} |")
        busy = sum(tot.values()) / steps
        w = "?" if wall is None else f"{wall:.3f}"
        print(f"| **all kernels** | {sum(cnt.values()) / steps:.1f} | **{busy:.3f}** (wall {w} ms/step) |")
    else:
        all_ms = sum(tot.values())
        print("| kernel (ncu, learner forward + backward, 2 runs + matmul peak) | launches | device ms | share |")
        print("|---|---|---|---|")
        for name, t in tot.most_common(20):
            print(f"| {name} | {cnt[name]} | {t:.2f} | {100 * t / all_ms:.1f} % |")
        print(f"| **all kernels** | {sum(cnt.values())} | **{all_ms:.2f}** | |")


main()
