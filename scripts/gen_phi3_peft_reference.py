#!/usr/bin/env python3
"""PEFT adapters on Phi-3's fused modules, with peft's log-probs, for
grpo-rollout/tests/it/architectures.rs.

The base is grpo-rollout/tests/fixtures/arch-phi3-micro with the `phi3-longrope-partial`
config of scripts/gen_arch_reference.py (LongRoPE, three quarters of each head rotating), so
that `qkv_proj`'s q and k rows are the ones the model reorders. For each case the adapter is
built with `get_peft_model`, every adapter tensor set to random values (lora_B non-zero, DoRA
magnitudes and lora_B biases moved), saved with `save_pretrained` under
`fixtures/peft-phi3/CASE/`, reloaded with `PeftModel.from_pretrained`, and the log-probs of the
arch reference's rows (last T tokens, left-padded, float32) written to
`fixtures/peft-phi3/reference.json`, adapted and after `merge_and_unload()`.

    python3 scripts/gen_phi3_peft_reference.py
    python3 scripts/gen_phi3_peft_reference.py check ADAPTER_DIR   # peft's log-probs of an adapter we saved

With FAMILY=glm4 the same for GLM-4-0414's fused `gate_up_proj` (q, k, v apart, their rows in
the interleaved order the model reorders): the base arch-glm4-micro with the
`glm4-three-quarters` config, adapters under `fixtures/peft-glm4/`.
"""
import json
import os
import shutil
import sys
import tempfile
import warnings

import peft
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gen_arch_reference import rows_logprobs as logprobs  # noqa: E402  (its rows and T)
from gen_peft_fixtures import randomize  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "grpo-rollout", "tests", "fixtures")
GLM = os.environ.get("FAMILY") == "glm4"
MODEL = "arch-glm4-micro" if GLM else "arch-phi3-micro"
OUT = os.path.join(ROOT, "peft-glm4" if GLM else "peft-phi3")
with open(os.path.join(ROOT, "arch_reference.json")) as f:
    ARCH = json.load(f)
CHANGE = ARCH["cases"]["glm4-three-quarters" if GLM else "phi3-longrope-partial"]["config"]
COMMON = dict(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0)
CASES = {
    "all_linear": dict(target_modules="all-linear"),
    "dora_fused": dict(target_modules=["qkv_proj", "gate_up_proj"], use_dora=True),
    "patterns": dict(target_modules=["qkv_proj", "down_proj"], use_rslora=True,
                               rank_pattern={"qkv_proj": 2}, alpha_pattern={"down_proj": 3}),
}
if GLM:
    CASES = {
        "all_linear": dict(target_modules="all-linear"),
        "dora_fused": dict(target_modules=["q_proj", "k_proj", "gate_up_proj"], use_dora=True),
        "patterns": dict(target_modules=["k_proj", "gate_up_proj", "down_proj"], use_rslora=True,
                         rank_pattern={"gate_up_proj": 2}, alpha_pattern={"down_proj": 3}),
    }


def base_dir(tmp):
    d = os.path.join(tmp, "base")
    shutil.copytree(os.path.join(ROOT, MODEL), d, dirs_exist_ok=True)
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(CHANGE)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return d


def base(tmp):
    return AutoModelForCausalLM.from_pretrained(base_dir(tmp), dtype=torch.float32, attn_implementation="eager").eval()


def load_adapted(tmp, path):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        pm = PeftModel.from_pretrained(base(tmp), path).eval()
    bad = [str(x.message) for x in w if "missing" in str(x.message).lower() or "unexpected" in str(x.message).lower()]
    return pm, bad


def generate():
    ref = {"peft": peft.__version__, "transformers": transformers.__version__, "config": CHANGE, "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        ref["base"] = logprobs(base(tmp))
        for i, (name, kw) in enumerate(CASES.items()):
            model = get_peft_model(base(tmp), LoraConfig(**{**COMMON, **kw}))
            randomize(model, 200 + i)
            path = os.path.join(OUT, name)
            model.save_pretrained(path)
            os.remove(os.path.join(path, "README.md"))
            cfg_path = os.path.join(path, "adapter_config.json")
            with open(cfg_path) as f:
                saved = json.load(f)
            saved["base_model_name_or_path"] = MODEL
            with open(cfg_path, "w") as f:
                json.dump(saved, f, indent=2, sort_keys=True)
            pm, bad = load_adapted(tmp, path)
            if bad:
                sys.exit(f"{name}: peft warned on load: {bad}")
            adapted = logprobs(pm)
            merged = logprobs(pm.merge_and_unload())
            gap = max(abs(a - b) for ra, rb in zip(adapted, ref["base"]) for a, b in zip(ra, rb))
            print(f"{name}: max |adapted - base| = {gap:.3f}")
            ref["cases"][name] = {"adapted": adapted, "merged": merged}
    with open(os.path.join(OUT, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1)


def check(path):
    with tempfile.TemporaryDirectory() as tmp:
        pm, bad = load_adapted(tmp, path)
        print(json.dumps({"adapted": logprobs(pm), "merged": logprobs(pm.merge_and_unload()), "warnings": bad}))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "check":
        check(sys.argv[2])
    else:
        generate()
