#!/usr/bin/env python3
"""PEFT adapters on mixture-of-experts weights (`target_parameters`) for grpo-rollout/tests/moe.rs.

For the MoE micro models of scripts/gen_arch_reference.py, peft (LoraConfig with
`target_parameters`, PEFT's ParamWrapper on transformers 5's stacked experts) adapts the
attention's `q_proj` and the experts' `gate_up_proj` and `down_proj` (both: PEFT nests them,
`experts.base_layer.lora_*` holding gate_up_proj's) — one of them alone for three of the models —
(and other `target_modules`: "all-linear", the MLP's names, a regular expression, which peft
0.21 turns into the experts' and the router's `target_parameters` where transformers 5 fuses the
experts on load; a Qwen2-MoE router's `gate.weight`) with every factor drawn (`init_lora_weights=False`, so that B is not zero). Writes each adapter
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
    "glm4moe-experts": ("arch-glm4moe-micro", "mlp.experts", BOTH),
}
# Cases with other `target_modules` (or none: the router's `gate.weight` as a parameter). On
# the families transformers 5 converts on load (Qwen3-MoE, OLMoE, GLM-4.5, Mixtral) peft turns
# the router's and the experts' module names into `target_parameters` (gate_up_proj at twice the
# rank); "all-linear" on Qwen2-MoE (not converted) takes in its shared expert and its gate.
CASES.update({
    "qwen2moe-all-linear": ("arch-qwen2moe-micro", "mlp.experts", ["down_proj"]),
    "glm4moe-all-linear": ("arch-glm4moe-micro", "mlp.experts", ["gate_up_proj"]),
    "qwen3moe-mlp-names": ("arch-qwen3moe-micro", "mlp.experts", []),
    "mixtral-all-linear": ("arch-mixtral-micro", "mlp.experts", []),
    "olmoe-regex": ("arch-olmoe-micro", "mlp.experts", []),
    "qwen2moe-router": ("arch-qwen2moe-micro", "mlp", ["gate.weight"]),
})
TARGETS = {
    "qwen2moe-all-linear": "all-linear",
    "glm4moe-all-linear": "all-linear",
    "mixtral-all-linear": "all-linear",
    "qwen3moe-mlp-names": ["q_proj", "gate_proj", "up_proj", "down_proj"],
    "olmoe-regex": r".*\.(q_proj|gate|down_proj)",
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
        cfg = LoraConfig(r=2, lora_alpha=3, target_modules=TARGETS.get(case, ["q_proj"]),
                         target_parameters=[f"{block}.{p}" for p in params] or None, init_lora_weights=False)
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
        # The config as the user wrote it, before peft's conversion.
        asked = {"target_modules": TARGETS.get(case, ["q_proj"]),
                 "target_parameters": [f"{block}.{p}" for p in params]}
        out["cases"][case] = {"model": model, "adapter": f"peft-moe/{case}", "adapted": adapted,
                              "merged": merged, "asked": asked}
    with open(os.path.join(fixtures, "moe_peft_reference.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
