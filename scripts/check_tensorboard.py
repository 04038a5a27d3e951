#!/usr/bin/env python3
"""Print the scalars of TensorBoard event files, read with TensorBoard's EventAccumulator.

Usage: check_tensorboard.py DIR

Every directory under DIR (DIR included) that holds event files (names containing
"tfevents") is read as one run. For each scalar tag, prints the number of
(step, value) points and the last one. Exits 1 if no scalar is found, 2 if the
tensorboard package is missing.
"""

import os
import sys

try:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
except ImportError:
    print("check_tensorboard.py: the tensorboard package is missing (pip install tensorboard)", file=sys.stderr)
    sys.exit(2)


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    root = sys.argv[1]
    total = 0
    for run_dir, _, files in sorted(os.walk(root)):
        if not any("tfevents" in name for name in files):
            continue
        acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})  # 0 = keep all points
        acc.Reload()
        tags = sorted(acc.Tags()["scalars"])
        print(f"{run_dir}: {len(tags)} scalar tags")
        for tag in tags:
            events = acc.Scalars(tag)
            last = events[-1]
            print(f"  {tag}: {len(events)} points, last step {last.step} value {last.value!r}")
            total += len(events)
    if total == 0:
        print(f"no scalars found under {root}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
