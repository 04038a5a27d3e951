#!/usr/bin/env python3
"""Adapters written by Python peft, with the log-probs peft computes, for grpo-rollout's tests.

    python3 scripts/gen_peft_fixtures.py                  # rewrites grpo-rollout/tests/fixtures/peft/
    python3 scripts/gen_peft_fixtures.py check ADAPTER_DIR  # peft's log-probs for an adapter we saved

The base model is grpo-rollout/tests/fixtures/bench-qwen2-micro (a tiny random qwen2: q/k/v
carry biases). For each case below the script builds the adapter with `get_peft_model`, sets
every adapter tensor to random values (lora_B non-zero, DoRA magnitudes and trained biases moved
off their initial values), saves it with `save_pretrained` under `peft/CASE/`, reloads it with
`PeftModel.from_pretrained` and writes to `peft/reference.json` the log-probs of the last T tokens
of a left-padded batch (the snippet of scripts/gen_rollout_reference.py, temperature 1) for the
base, the adapted model and the model after `merge_and_unload()`.

`check` loads ADAPTER_DIR (written by grpo-rs) onto the same base with peft and prints the
adapted and merged log-probs as JSON, plus any load warning. When ADAPTER_DIR holds
grpo_logprobs.json (the tests that train with every option write it when run as
`GRPO_PEFT_CHECK_DIR=D cargo test -p grpo-rollout --test it peft::training`), it prints the largest
difference between peft's log-probs and ours instead, and exits 1 above 1e-4.
"""
import json
import os
import sys
import warnings

import peft
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "grpo-rollout", "tests", "fixtures")
BASE = os.path.join(ROOT, "bench-qwen2-micro")
OUT = os.path.join(ROOT, "peft")
ROWS = [[5, 9, 2, 33, 7, 12, 40, 3], [8, 3, 20, 11, 6], [17, 6, 50, 4, 9, 1, 2]]
T = 6

COMMON = dict(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0)
CASES = {
    "plain": dict(target_modules=["q_proj", "v_proj"]),
    "rslora": dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], use_rslora=True),
    "dora": dict(target_modules=["q_proj", "v_proj", "o_proj", "down_proj"], use_dora=True, lora_dropout=0.1),
    "bias_lora_only": dict(target_modules=["q_proj", "o_proj", "up_proj"], bias="lora_only"),
    "bias_all": dict(target_modules=["q_proj", "up_proj"], bias="all"),
    "lora_bias": dict(target_modules=["q_proj", "k_proj", "v_proj"], lora_bias=True),
    "all_linear": dict(target_modules="all-linear", r=2, lora_alpha=5),
    "patterns": dict(
        target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"],
        rank_pattern={"q_proj": 2, "model.layers.1.mlp.down_proj": 6},
        alpha_pattern={"v_proj": 3, r"layers\.0\.mlp\.gate_proj": 16},
        use_rslora=True,
    ),
    "layers_list": dict(target_modules=["q_proj", "v_proj", "up_proj"], layers_to_transform=[1], layers_pattern="layers"),
    "layers_int": dict(target_modules=["k_proj", "gate_proj"], layers_to_transform=0),
    "regex": dict(target_modules=r".*layers\.0\.(self_attn\.[qv]_proj|mlp\.up_proj)"),
    "exclude": dict(target_modules="all-linear", exclude_modules=["o_proj", "model.layers.0.mlp.down_proj"]),
    "dora_all_linear": dict(target_modules="all-linear", use_dora=True, use_rslora=True, rank_pattern={"gate_proj": 2}),
}


def base():
    return AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32, attn_implementation="eager").eval()


def logprobs(model):
    length = max(len(r) for r in ROWS)
    ids = torch.tensor([[0] * (length - len(r)) + r for r in ROWS])
    mask = torch.tensor([[0] * (length - len(r)) + [1] * len(r) for r in ROWS])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    logits = logits[:, -T - 1 : -1, :]
    lp = torch.log_softmax(logits.double(), -1).gather(-1, ids[:, -T:].unsqueeze(-1)).squeeze(-1)
    return lp.tolist()


def randomize(model, seed):
    """Moves every trainable adapter tensor off its initial value, as training would."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            noise = torch.randn(p.shape, generator=g)
            if "lora_magnitude_vector" in name:
                p.mul_(1.0 + 0.3 * noise)
            elif "lora_A" in name or "lora_B" in name:
                p.copy_(0.3 * noise)
            else:  # biases trained with bias="all" / "lora_only"
                p.add_(0.5 * noise)


def load_adapted(path):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        pm = PeftModel.from_pretrained(base(), path).eval()
    bad = [str(x.message) for x in w if "missing" in str(x.message).lower() or "unexpected" in str(x.message).lower()]
    return pm, bad


def generate():
    torch.manual_seed(0)
    ref = {
        "peft": peft.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "rows": ROWS,
        "t": T,
        "base": logprobs(base()),
        "cases": {},
    }
    for i, (name, kw) in enumerate(CASES.items()):
        cfg = LoraConfig(**{**COMMON, **kw})
        model = get_peft_model(base(), cfg)
        randomize(model, 100 + i)
        path = os.path.join(OUT, name)
        model.save_pretrained(path)
        os.remove(os.path.join(path, "README.md"))
        # The base's path on this machine means nothing elsewhere.
        cfg_path = os.path.join(path, "adapter_config.json")
        with open(cfg_path) as f:
            saved = json.load(f)
        saved["base_model_name_or_path"] = "bench-qwen2-micro"
        with open(cfg_path, "w") as f:
            json.dump(saved, f, indent=2, sort_keys=True)
        pm, bad = load_adapted(path)
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
    pm, bad = load_adapted(path)
    out = {"load_warnings": bad, "adapted": logprobs(pm)}
    out["merged"] = logprobs(pm.merge_and_unload())
    ours = os.path.join(path, "grpo_logprobs.json")
    worst = 0.0
    if os.path.exists(ours):  # written next to the adapter by grpo-rollout's tests/it/peft.rs
        with open(ours) as f:
            g = json.load(f)
        for k in ("adapted", "merged"):
            flat = [x for row in out[k] for x in row]
            d = max(abs(a - b) for a, b in zip(flat, g[k]))
            out[f"max_abs_{k}_peft_vs_grpo"] = d
            worst = max(worst, d)
    print(json.dumps({k: v for k, v in out.items() if k not in ("adapted", "merged")} if os.path.exists(ours) else out))
    sys.exit(1 if bad or worst > 1e-4 else 0)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "check":
        check(sys.argv[2])
    else:
        generate()
