#!/usr/bin/env python3
"""A Hunyuan dense micro model and transformers' values of it, for grpo-rollout/tests/it/hunyuan.rs.

`HunYuanDenseV1ForCausalLM` (`hunyuan_v1_dense`), 3 layers, weights std 0.25 (q/k 0.5), the
per-head q/k norms (after RoPE) drawn around 1 so that their order against RoPE shows, its
RoPE as the released configs hold it (`rope_type` dynamic with a fixed NTK `alpha` of 1000,
base 10000), tied, the tokenizer of fixtures/arch-deepseekv2-micro; into
fixtures/hunyuan-micro and fixtures/hunyuan_reference.json (float32, eager attention): the
log-probs of the last T tokens of two left-padded rows (per-row position ids), the gradient of
their sum for the q/k norms of layer 1, a greedy continuation (transformers' KV cache).

    python3 scripts/gen_hunyuan_reference.py grpo-rollout/tests/fixtures

Needs torch and transformers 5.2x.
"""
import json, os, sys

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from reference_common import copy_tokenizer, greedy, padded_logprobs

ROWS = [[(5 * i * i + 3 * i + 7) % 290 + 3 for i in range(40)], [(11 * i + 4) % 290 + 3 for i in range(27)]]
T = 20
PROMPT = [4, 17, 99, 250, 31, 8, 140, 77, 5, 63, 12, 201, 45, 9, 180]
NEW = 14
GRADS = ["model.layers.1.self_attn.query_layernorm.weight", "model.layers.1.self_attn.key_layernorm.weight"]


def main():
    fixtures = sys.argv[1]
    path = os.path.join(fixtures, "hunyuan-micro")
    cfg = AutoConfig.for_model(
        "hunyuan_v1_dense", vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=2, pad_token_id=0,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0, "factor": 1.0})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1, 0.3)
            else:
                p.normal_(0, 0.5 if ("q_proj" in name or "k_proj" in name) else 0.25)
    model.save_pretrained(path)
    copy_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    lp = padded_logprobs(model, ROWS, T)
    lp.sum().backward()
    params = dict(model.named_parameters())
    grads = {k: params[k].grad.flatten().tolist() for k in GRADS}
    ref = {"transformers": transformers.__version__, "rows": ROWS, "t": T, "prompt": PROMPT,
           "logprobs": lp.tolist(), "grads": grads, "greedy": greedy(model, PROMPT, NEW),
           "rope": type(model.model.rotary_emb).__name__ + ":" + model.model.rotary_emb.rope_type}
    with open(os.path.join(fixtures, "hunyuan_reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
    print("ok", ref["greedy"], ref["rope"])


if __name__ == "__main__":
    main()
