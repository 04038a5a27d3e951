#!/usr/bin/env python3
"""Checks that TRL 1.16's experimental GKD divergence (`GKDTrainer.generalized_jsd_loss`) gives,
token by token, the reference values grpo-core/tests/it/distill.rs holds for
`grpo_core::distill::generalized_jsd` (temperature 1; β = 0 forward KL, 1 reverse KL, 0.5 the
generalized JSD). Exits 1 on a difference above 1e-12.

    ~/trl-venv/bin/python scripts/check_gkd_divergence.py
"""
import sys

import torch
from trl.experimental.gkd import GKDTrainer

ZS = [[1.0, -0.5, 2.0, 0.25], [0.0, 0.3, -1.2, 0.7]]
ZT = [[0.5, 0.5, 1.0, -1.0], [2.0, -0.3, 0.1, 0.0]]
# (beta, per-token divergence) as in grpo-core/tests/it/distill.rs at temperature 1.
WANT = [
    (0.0, [0.26227706769212694, 0.6866542310841767]),
    (1.0, [0.18136907776095612, 0.7488973969327894]),
    (0.5, [0.05119939648467496, 0.16711741524248208]),
]


def main():
    zs = torch.tensor([ZS], dtype=torch.float64)
    zt = torch.tensor([ZT], dtype=torch.float64)
    worst = 0.0
    for beta, want in WANT:
        for i, w in enumerate(want):
            got = GKDTrainer.generalized_jsd_loss(zs[:, i : i + 1], zt[:, i : i + 1], beta=beta, reduction="sum").item()
            worst = max(worst, abs(got - w))
            print(f"beta {beta} token {i}: TRL GKD {got!r}, grpo-core reference {w!r}")
    print(f"largest difference {worst:.2e}")
    sys.exit(0 if worst <= 1e-12 else 1)


if __name__ == "__main__":
    main()
