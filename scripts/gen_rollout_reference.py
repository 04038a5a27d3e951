#!/usr/bin/env python3
"""Reference log-probs from transformers for grpo-rollout's parity tests.

For each model directory given, runs transformers (float32, eager attention) on a left-padded
batch with per-row position ids (0 at each row's first real token) and writes the log-probs of
the last T tokens under logits / temperature, as grpo-rollout's completion_logprobs computes.

    python3 scripts/gen_rollout_reference.py OUT.json NAME=DIR [NAME=DIR ...]

The test regenerates the `init-model` directories itself (same preset, arch and seed) and
reads the make_tiny_model.py one from grpo-rollout/tests/fixtures/.
"""
import json
import sys

import torch
from transformers import AutoModelForCausalLM

ROWS = [[5, 9, 2, 33, 7, 12, 40, 3], [8, 3, 20, 11, 6], [17, 6, 50, 4, 9, 1, 2]]
T = 4
TEMPERATURE = 0.7


def reference(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    pad = 0
    length = max(len(r) for r in ROWS)
    ids = torch.tensor([[pad] * (length - len(r)) + r for r in ROWS])
    mask = torch.tensor([[0] * (length - len(r)) + [1] * len(r) for r in ROWS])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    logits = logits[:, -T - 1 : -1, :] / TEMPERATURE
    lp = torch.log_softmax(logits.double(), -1).gather(-1, ids[:, -T:].unsqueeze(-1)).squeeze(-1)
    return lp.tolist()


def main():
    out = {"rows": ROWS, "t": T, "temperature": TEMPERATURE, "models": {}}
    for arg in sys.argv[2:]:
        name, path = arg.split("=", 1)
        out["models"][name] = reference(path)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
