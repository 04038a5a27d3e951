#!/usr/bin/env python3
"""A Qwen3.5 micro model and transformers' values of it, for grpo-rollout/tests/it/qwen3_5.rs.

`Qwen3_5ForCausalLM` (`qwen3_5_text`), 4 layers (gated delta-net linear attention, gated full
attention, linear, full), weights std 0.25, norms drawn around their identity (the zero-centred
`1 + w` norms around 0, the gated norm around 1), `A_log` and `dt_bias` as transformers
initialises them, 2 key heads serving 4 value heads in the linear layers, RoPE on a quarter of
each head (`partial_rotary_factor` 0.25), tied, the tokenizer of fixtures/arch-deepseekv2-micro;
into fixtures/qwen3_5-micro and fixtures/qwen3_5_reference.json (float32, eager attention): the
log-probs of the last T tokens of two left-padded rows longer than one 64-token chunk (per-row
position ids), the gradient of their sum for one weight of each kind, a greedy continuation
(transformers' cache: recurrent and convolution states, keys and values).

    python3 scripts/gen_qwen3_5_reference.py grpo-rollout/tests/fixtures

Needs torch and transformers 5.2x.
"""
import json, os, sys

import torch
import transformers
import transformers.models.qwen3_5.modeling_qwen3_5 as M
from transformers import AutoConfig, AutoModelForCausalLM

from reference_common import copy_tokenizer, gated_delta_in_float64, greedy, padded_logprobs, peft_adapter

ROWS = [[(5 * i * i + 3 * i + 7) % 290 + 3 for i in range(90)], [(11 * i + 4) % 290 + 3 for i in range(57)]]
T = 40
PROMPT = [4, 17, 99, 250, 31, 8, 140, 77, 5, 63, 12, 201, 45, 9, 180]
NEW = 14
GRADS = [
    "model.layers.0.linear_attn.A_log", "model.layers.0.linear_attn.dt_bias",
    "model.layers.0.linear_attn.conv1d.weight", "model.layers.0.linear_attn.norm.weight",
    "model.layers.2.linear_attn.in_proj_b.weight", "model.layers.0.linear_attn.in_proj_qkv.weight",
    "model.layers.1.self_attn.q_norm.weight", "model.layers.1.self_attn.q_proj.weight",
    "model.layers.3.input_layernorm.weight",
]


def save_random(cfg, path):
    """A model of `cfg` with weights std 0.25 (the convolution 0.4), norms drawn around their
    identity (the zero-centred `1 + w` norms around 0, the gated norm around 1), `A_log` and
    `dt_bias` as transformers initialises them (seed 0), saved at `path` with the micro models'
    tokenizer."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.normal_(1, 0.3)
            elif "norm" in name:
                p.normal_(0, 0.3)
            elif name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.01, 16).log())
            elif name.endswith("dt_bias"):
                p.normal_(1, 0.3)
            elif "conv1d" in name:
                p.normal_(0, 0.4)
            else:
                p.normal_(0, 0.25)
    model.save_pretrained(path)
    copy_tokenizer(path)


def main():
    fixtures = sys.argv[1]
    path = os.path.join(fixtures, "qwen3_5-micro")
    cfg = AutoConfig.for_model(
        "qwen3_5_text", vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, tie_word_embeddings=True, bos_token_id=0, eos_token_id=2, pad_token_id=0,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [1, 1, 0], "mrope_interleaved": True})
    save_random(cfg, path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    lp = padded_logprobs(model, ROWS, T)
    lp.sum().backward()
    params = dict(model.named_parameters())
    grads = {k: params[k].grad.flatten().tolist() for k in GRADS}
    out = greedy(model, PROMPT, NEW)
    # The adapter's factors scaled by 0.3: its log-probs stay near the base model's scale.
    peft_lp = peft_adapter(path, path + "-peft", ROWS, T, scale=0.3)
    # transformers' own bfloat16 run of the padded rows, against its float32 one.
    mb = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager").eval()
    with torch.no_grad():
        bf16 = (padded_logprobs(mb, ROWS, T) - lp.detach()).abs().max().item()
    # Each row alone in float64 throughout.
    gated_delta_in_float64(M, "Qwen3_5")
    m64 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="eager").eval()
    alone64 = []
    for r in ROWS:
        lp64 = padded_logprobs(m64, [r], T)[0]
        lp64.sum().backward()
        alone64.append(lp64.tolist())
    p64 = dict(m64.named_parameters())
    grads64 = {k: p64[k].grad.flatten().tolist() for k in GRADS}
    ref = {"transformers": transformers.__version__, "rows": ROWS, "t": T, "prompt": PROMPT,
           "logprobs": lp.tolist(), "grads": grads, "greedy": out, "peft_logprobs": peft_lp,
           "bf16_deviation": bf16, "alone_f64": alone64, "grads_f64": grads64}
    with open(os.path.join(fixtures, "qwen3_5_reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
    print("ok", out, bf16)


if __name__ == "__main__":
    main()
