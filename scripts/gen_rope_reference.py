#!/usr/bin/env python3
"""Reference RoPE scaling from transformers for grpo-rollout/tests/it/rope_scaling.rs.

Two parts, written to one JSON file:
  * `frequencies`: for each config (llama3, linear, dynamic, yarn in its variants), the inverse
    frequencies and the cos/sin factor of transformers' `ROPE_INIT_FUNCTIONS[rope_type]`.
  * `logprobs`: a one-layer Qwen2 written here (grpo-rollout/tests/fixtures/rope-qwen2-micro:
    seeded weights, q and k large enough that positions matter; bench-qwen2-micro's tokenizer)
    with each `rope_scaling` written into a copy of its config.json: log-probs of the last T
    tokens of left-padded rows longer than the scaled configs' original context (float32, eager
    attention, per-row position ids), as grpo-rollout's completion_logprobs computes them.

    python3 scripts/gen_rope_reference.py grpo-rollout/tests/fixtures
"""
import copy
import json
import os
import shutil
import sys
import tempfile

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER = os.path.join(HERE, "..", "grpo-rollout", "tests", "fixtures", "bench-qwen2-micro")

# (model_type, head_dim, rope_theta, max_position_embeddings, rope_scaling as a config holds it)
FREQUENCY_CASES = [
    ("llama", 64, 500000.0, 131072, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    ("llama", 128, 10000.0, 8192, {"type": "linear", "factor": 4.0}),
    ("qwen2", 64, 1000000.0, 32768, {"rope_type": "dynamic", "factor": 2.0}),
    # Qwen2.5's long-context layout (transformers 4 `type`).
    ("qwen2", 128, 1000000.0, 131072, {"type": "yarn", "factor": 4.0,
                                        "original_max_position_embeddings": 32768}),
    # Qwen3's.
    ("qwen3", 128, 1000000.0, 131072, {"rope_type": "yarn", "factor": 4.0,
                                        "original_max_position_embeddings": 32768}),
    ("qwen3", 64, 10000.0, 4096, {"rope_type": "yarn", "factor": 2.5, "original_max_position_embeddings": 512,
                                   "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False}),
    ("llama", 96, 10000.0, 16384, {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048,
                                    "mscale": 1.0, "mscale_all_dim": 0.707}),
    ("qwen2", 32, 10000.0, 1024, {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 256,
                                   "attention_factor": 1.25}),
]

# Rows of 40 and 27 tokens: beyond the original context (16) of the scaled logprob cases.
ROWS = [[(7 * i + 3) % 300 for i in range(40)], [(11 * i + 5) % 300 for i in range(27)]]
T = 8
LOGPROB_CASES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.5},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn-legacy": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16,
                    "beta_fast": 8.0, "beta_slow": 0.5, "attention_factor": 1.3},
}


def config_dict(model_type, head_dim, theta, max_pos, scaling):
    heads = 4
    d = {"model_type": model_type, "vocab_size": 300, "hidden_size": heads * head_dim,
         "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": heads,
         "num_key_value_heads": 2, "head_dim": head_dim, "max_position_embeddings": max_pos,
         "rope_theta": theta, "rope_scaling": scaling}
    return d


def frequencies():
    out = []
    for model_type, head_dim, theta, max_pos, scaling in FREQUENCY_CASES:
        d = config_dict(model_type, head_dim, theta, max_pos, dict(scaling))
        kw = copy.deepcopy({k: v for k, v in d.items() if k != "model_type"})
        cfg = AutoConfig.for_model(model_type, **kw)
        kind = cfg.rope_parameters["rope_type"]
        inv, factor = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
        out.append({"config": d, "inv_freq": inv.double().tolist(), "attention_factor": float(factor)})
    return out


def logprobs(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    length = max(len(r) for r in ROWS)
    ids = torch.tensor([[0] * (length - len(r)) + r for r in ROWS])
    mask = torch.tensor([[0] * (length - len(r)) + [1] * len(r) for r in ROWS])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    logits = logits[:, -T - 1 : -1, :]
    lp = torch.log_softmax(logits.double(), -1).gather(-1, ids[:, -T:].unsqueeze(-1)).squeeze(-1)
    return lp.tolist()


def micro_model(path):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("qwen2", vocab_size=300, hidden_size=64, intermediate_size=96,
                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=256, rope_theta=10000.0,
                               tie_word_embeddings=True, eos_token_id=2, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.5 if ("q_proj" in name or "k_proj" in name) else 0.1)
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TOKENIZER, f), path)


def main():
    fixtures = sys.argv[1]
    micro = os.path.join(fixtures, "rope-qwen2-micro")
    micro_model(micro)
    out = {"transformers": transformers.__version__, "frequencies": frequencies(),
           "rows": ROWS, "t": T, "logprobs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, scaling in LOGPROB_CASES.items():
            d = os.path.join(tmp, name)
            shutil.copytree(micro, d)
            with open(os.path.join(d, "config.json")) as f:
                cfg = json.load(f)
            if scaling is not None:
                cfg.pop("rope_parameters", None)
                cfg["rope_theta"] = 10000.0
                cfg["rope_scaling"] = copy.deepcopy(scaling)
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump(cfg, f, indent=1)
            out["logprobs"][name] = {"rope_scaling": scaling, "logprobs": logprobs(d)}
    with open(os.path.join(fixtures, "rope_reference.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
