#!/usr/bin/env python3
"""PEFT adapters on mixture-of-experts weights (`target_parameters`) for grpo-rollout/tests/it/moe.rs.

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

Also (`v4_cases`) adapters in the per-expert layout PEFT wrote before transformers 5, which
peft 0.21 converts on load (Mixtral's, and Qwen3-MoE's with its dense layer's MLP factors).

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
    "deepseekv3-all-linear": ("arch-deepseekv3-micro", "mlp.experts", []),
    "deepseekv3-noq-attention": ("arch-deepseekv3-noq-micro", "mlp.experts", ["down_proj"]),
    "deepseekv2-mlp-names": ("arch-deepseekv2-micro", "mlp.experts", []),
})
TARGETS = {
    "qwen2moe-all-linear": "all-linear",
    "glm4moe-all-linear": "all-linear",
    "mixtral-all-linear": "all-linear",
    "qwen3moe-mlp-names": ["q_proj", "gate_proj", "up_proj", "down_proj"],
    "olmoe-regex": r".*\.(q_proj|gate|down_proj)",
    "deepseekv3-all-linear": "all-linear",
    "deepseekv3-noq-attention": ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
    "deepseekv2-mlp-names": ["q_proj", "gate", "gate_proj", "up_proj", "down_proj"],
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
    out["v4_cases"] = {case: v4_case(fixtures, root, case, model) for case, model in V4_CASES.items()}
    with open(os.path.join(fixtures, "moe_peft_reference.json"), "w") as f:
        json.dump(out, f)


# Adapters as PEFT wrote them before transformers 5 fused the experts: per-expert factors under
# the transformers 4 names (Mixtral's `block_sparse_moe.experts.{e}.w1`, ...), `target_modules`
# the MLP's names (and on Qwen3-MoE its dense layer's MLP factors, which peft 0.21's converted
# config no longer targets). peft 0.21 converts them on load.
V4_CASES = {"mixtral-v4": "arch-mixtral-micro", "qwen3moe-v4": "arch-qwen3moe-micro"}


def v4_case(fixtures, root, case, model):
    from safetensors.torch import save_file
    from peft import PeftModel
    base = AutoModelForCausalLM.from_pretrained(os.path.join(fixtures, model), dtype=torch.float32,
                                                attn_implementation="eager")
    cfg = base.config
    mixtral = cfg.model_type == "mixtral"
    names = ["w1", "w3", "w2"] if mixtral else ["gate_proj", "up_proj", "down_proj"]
    block = "block_sparse_moe" if mixtral else "mlp"
    h, r = cfg.hidden_size, 2
    w = cfg.intermediate_size if mixtral else cfg.moe_intermediate_size
    experts = cfg.num_local_experts if mixtral else cfg.num_experts
    g = torch.Generator().manual_seed(0)
    draw = lambda *shape: torch.randn(*shape, generator=g) * 0.3  # noqa: E731
    sd = {}
    for i in range(cfg.num_hidden_layers):
        p = f"base_model.model.model.layers.{i}"
        if i in (getattr(cfg, "mlp_only_layers", None) or []):
            im = cfg.intermediate_size
            for n, (o, inp) in zip(["gate_proj", "up_proj", "down_proj"], [(im, h), (im, h), (h, im)]):
                sd[f"{p}.mlp.{n}.lora_A.weight"], sd[f"{p}.mlp.{n}.lora_B.weight"] = draw(r, inp), draw(o, r)
            continue
        for e in range(experts):
            for n, (o, inp) in zip(names, [(w, h), (w, h), (h, w)]):
                q = f"{p}.{block}.experts.{e}.{n}"
                sd[f"{q}.lora_A.weight"], sd[f"{q}.lora_B.weight"] = draw(r, inp), draw(o, r)
    d = os.path.join(root, case)
    os.makedirs(d, exist_ok=True)
    save_file(sd, os.path.join(d, "adapter_model.safetensors"))
    with open(os.path.join(d, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": 3,
                   "target_modules": names, "lora_dropout": 0.0, "bias": "none",
                   "base_model_name_or_path": None}, f, indent=1)
    pm = PeftModel.from_pretrained(base, d)
    pm.eval()
    adapted = rows_logprobs(pm)
    merged = rows_logprobs(pm.merge_and_unload())
    return {"model": model, "adapter": f"peft-moe/{case}", "adapted": adapted, "merged": merged}


if __name__ == "__main__":
    main()
