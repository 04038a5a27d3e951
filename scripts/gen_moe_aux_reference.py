#!/usr/bin/env python3
"""Reference load-balancing losses from transformers for grpo-rollout/tests/it/moe.rs.

For the MoE micro models of scripts/gen_arch_reference.py (arch-qwen3moe-micro,
arch-qwen2moe-micro, arch-mixtral-micro, arch-olmoe-micro, arch-granitemoe-micro, arch-gptoss-micro — its
biased router's logits) and the same left-padded rows: transformers' `aux_loss`
(`output_router_logits=True`, the attention mask given: what TRL's GRPOTrainer adds to its loss
times `router_aux_loss_coef`), and its gradient with respect to each MoE layer's router and to
layer 0's q_proj (float32, eager attention, per-row position ids).

    python3 scripts/gen_moe_aux_reference.py grpo-rollout/tests/fixtures
"""
import json
import os
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gen_arch_reference import ROWS  # noqa: E402

MODELS = ["arch-qwen3moe-micro", "arch-qwen2moe-micro", "arch-mixtral-micro", "arch-olmoe-micro",
          "arch-granitemoe-micro", "arch-gptoss-micro"]


def main():
    fixtures = sys.argv[1]
    length = max(len(r) for r in ROWS)
    ids = torch.tensor([[0] * (length - len(r)) + r for r in ROWS])
    mask = torch.tensor([[0] * (length - len(r)) + [1] * len(r) for r in ROWS])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = {"transformers": transformers.__version__, "rows": ROWS, "cases": {}}
    for name in MODELS:
        model = AutoModelForCausalLM.from_pretrained(os.path.join(fixtures, name), dtype=torch.float32,
                                                     attn_implementation="eager")
        model.train()
        aux = model(input_ids=ids, attention_mask=mask, position_ids=pos, output_router_logits=True).aux_loss
        aux.backward()
        grads = {}
        for pname, p in model.named_parameters():
            router = (pname.endswith("mlp.gate.weight") or pname.endswith("block_sparse_moe.router.weight")
                      or pname.endswith("mlp.router.weight"))
            if router or pname == "model.layers.0.self_attn.q_proj.weight":
                layer = pname.split(".")[2]
                key = "q_proj" if "q_proj" in pname else "router"
                grads[f"{layer}.{key}"] = p.grad.tolist()
        out["cases"][name] = {"aux_loss": aux.item(), "grads": grads}
    with open(os.path.join(fixtures, "moe_aux_reference.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
