#!/usr/bin/env python3
"""PEFT adapters on mixture-of-experts weights (`target_parameters`) for grpo-rollout/tests/moe.rs.

For the MoE micro models of scripts/gen_arch_reference.py, peft (LoraConfig with
`target_parameters`, PEFT's ParamWrapper on transformers 5's stacked experts) adapts the
attention's `q_proj` and the experts' `gate_up_proj` and `down_proj` (both: PEFT nests them,
`experts.base_layer.lora_*` holding gate_up_proj's) — one of them alone for three of the models —
with every factor drawn (`init_lora_weights=False`, so that B is not zero). Writes each adapter
to fixtures/peft-moe/<case>/ and, in fixtures/moe_peft_reference.json, the log-probs of the
last T tokens of gen_arch_reference.py's left-padded rows, adapted and merged
(`merge_and_unload`).

    python3 scripts/gen_moe_peft_reference.py grpo-rollout/tests/fixtures
"""
import json
import os
import shutil
import sys

import peft
import torch
import transformers
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gen_arch_reference import ROWS, T, rows_logprobs  # noqa: E402

BOTH = ["gate_up_proj", "down_proj"]
CASES = {
    "qwen3moe-experts": ("arch-qwen3moe-micro", "mlp.experts", BOTH),
    "qwen2moe-experts": ("arch-qwen2moe-micro", "mlp.experts", BOTH),
    "mixtral-experts": ("arch-mixtral-micro", "mlp.experts", BOTH),
    "mixtral-down": ("arch-mixtral-micro", "mlp.experts", ["down_proj"]),
    "olmoe-gate-up": ("arch-olmoe-micro", "mlp.experts", ["gate_up_proj"]),
    "granitemoe-experts": ("arch-granitemoe-micro", "block_sparse_moe.experts", BOTH),
    "gptoss-experts": ("arch-gptoss-micro", "mlp.experts", BOTH),
    "gptoss-gate-up": ("arch-gptoss-micro", "mlp.experts", ["gate_up_proj"]),
}


def main():
    fixtures = sys.argv[1]
    root = os.path.join(fixtures, "peft-moe")
    shutil.rmtree(root, ignore_errors=True)
    out = {"transformers": transformers.__version__, "peft": peft.__version__, "rows": ROWS, "t": T,
           "cases": {}}
    for case, (model, block, params) in CASES.items():
        torch.manual_seed(1)
        base = AutoModelForCausalLM.from_pretrained(os.path.join(fixtures, model), dtype=torch.float32,
                                                    attn_implementation="eager")
        cfg = LoraConfig(r=2, lora_alpha=3, target_modules=["q_proj"],
                         target_parameters=[f"{block}.{p}" for p in params], init_lora_weights=False)
        pm = get_peft_model(base, cfg)
        with torch.no_grad():
            for name, p in pm.named_parameters():
                if "lora_" in name:
                    p.normal_(0, 0.3)
        pm.eval()
        adapted = rows_logprobs(pm)
        d = os.path.join(root, case)
        pm.save_pretrained(d)
        merged = rows_logprobs(pm.merge_and_unload())
        out["cases"][case] = {"model": model, "adapter": f"peft-moe/{case}", "adapted": adapted,
                              "merged": merged}
    with open(os.path.join(fixtures, "moe_peft_reference.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
