#!/usr/bin/env python3
"""Checks that Python peft loads an adapter grpo-rs saved, the way we define it.

    ~/trl-venv/bin/python scripts/check_peft_adapter.py BASE_MODEL_DIR ADAPTER_DIR

Loads BASE + ADAPTER with `PeftModel.from_pretrained` (reporting any missing/unexpected-key
warning), merges the same adapter by hand from adapter_model.safetensors (W + lora_alpha/r · B·A),
and prints the max log-prob difference between the two (expected: rounding, ~1e-6) and between
the adapted and the base model (expected: clearly non-zero after training).
"""
import json
import sys
import warnings

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

base_dir, ad = sys.argv[1], sys.argv[2]
load = lambda: AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    pm = PeftModel.from_pretrained(load(), ad)
bad = [str(x.message) for x in w if "missing" in str(x.message).lower() or "unexpected" in str(x.message).lower()]
vocab = pm.config.vocab_size
ids = torch.tensor([[(i * 37 + 5) % vocab for i in range(12)]])
lsm = lambda m: torch.log_softmax(m(input_ids=ids).logits, -1)
sd = load_file(f"{ad}/adapter_model.safetensors")
cfg = json.load(open(f"{ad}/adapter_config.json"))
# The hand merge below is plain LoRA; adapters with other options are compared with peft by
# scripts/gen_peft_fixtures.py check.
others = [k for k in ("use_rslora", "use_dora", "lora_bias", "rank_pattern", "alpha_pattern") if cfg.get(k)]
if others or cfg.get("bias", "none") != "none":
    sys.exit(f"{ad}: uses {others or ['bias']}: the hand merge here is plain LoRA; use scripts/gen_peft_fixtures.py check")
scale = cfg["lora_alpha"] / cfg["r"]
manual = load()
msd = manual.state_dict()
n = 0
for k, a in sd.items():
    if "lora_A" in k:
        b = sd[k.replace("lora_A", "lora_B")]
        msd[k.replace("base_model.model.", "").replace(".lora_A.weight", ".weight")] += scale * (b @ a)
        n += 1
manual.load_state_dict(msd)
with torch.no_grad():
    a, m, b = lsm(pm), lsm(manual), lsm(load())
print(json.dumps({"adapted_modules": n, "load_warnings": bad,
                  "max_abs_peft_vs_manual_merge": (a - m).abs().max().item(),
                  "max_abs_adapted_vs_base": (a - b).abs().max().item()}))
sys.exit(1 if bad or (a - m).abs().max().item() > 1e-4 else 0)
