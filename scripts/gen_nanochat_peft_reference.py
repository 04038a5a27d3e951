#!/usr/bin/env python3
"""A PEFT adapter on nanochat for grpo-rollout/tests/it/architectures.rs.

peft adapts the micro nanochat model of scripts/gen_arch_reference.py (arch-nanochat-micro:
q/k/v/o biased) with `target_modules="all-linear"` — q_proj, k_proj, v_proj, o_proj and its
MLP's fc1, fc2 — every factor drawn (`init_lora_weights=False`, so that B is not zero), and
writes the adapter to fixtures/peft-nanochat/ and, in fixtures/nanochat_peft_reference.json, the
log-probs of the last T tokens of gen_arch_reference.py's left-padded rows, adapted and merged
(`merge_and_unload`).

    python3 scripts/gen_nanochat_peft_reference.py grpo-rollout/tests/fixtures
"""
import json
import os
import sys

import peft
import torch
import transformers
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gen_arch_reference import ROWS, T, rows_logprobs  # noqa: E402


def main():
    fixtures = sys.argv[1]
    base = os.path.join(fixtures, "arch-nanochat-micro")
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    cfg = LoraConfig(r=2, lora_alpha=3, target_modules="all-linear", init_lora_weights=False)
    pm = get_peft_model(model, cfg)
    pm.eval()
    out_dir = os.path.join(fixtures, "peft-nanochat")
    pm.save_pretrained(out_dir)
    adapted = rows_logprobs(pm)
    merged = rows_logprobs(pm.merge_and_unload())
    ref = {"transformers": transformers.__version__, "peft": peft.__version__, "rows": ROWS, "t": T,
           "model": "arch-nanochat-micro", "adapter": "peft-nanochat", "adapted": adapted, "merged": merged}
    with open(os.path.join(fixtures, "nanochat_peft_reference.json"), "w") as f:
        json.dump(ref, f, indent=1)


if __name__ == "__main__":
    main()
