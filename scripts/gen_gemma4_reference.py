#!/usr/bin/env python3
"""Gemma 4 micro models and transformers' values of them, for grpo-rollout/tests/it/gemma4.rs.

Two `Gemma4ForCausalLM` (`gemma4_text`) micro models, seeded weights (matrices std 0.25 —
q/k 0.5 so that positions matter, the per-layer gates 0.05 —, norms and `layer_scalar` around
1), the tokenizer of
fixtures/arch-deepseekv2-micro (300 tokens):

  * gemma4-micro: 6 layers (sliding and full alternating), window 12, the full layers 16 wide
    with one key/value head reused as values (`attention_k_eq_v`), their RoPE proportional (a
    quarter of the frequencies turning), the last two layers reusing layers 2's and 3's keys and
    values (`num_kv_shared_layers` 2, as llama.cpp pairs them too) with double-wide MLPs,
    per-layer inputs 4 wide, tied, logits soft-capped at 8;
  * gemma4-plain-micro: 4 layers (sliding, full, sliding, full), the full layers 16 wide with
    2 key/value heads and their own values, their RoPE default (base 10000, every frequency),
    no sharing, no per-layer inputs, untied;
  * gemma4-moe-micro: 3 layers (sliding, sliding, full), each with 4 experts (2 a token, 24 wide)
    beside its MLP (`enable_moe_block`, router scales drawn around 1), keys as values on the
    full layer, tied.

For each, into fixtures/gemma4_reference.json (float32, eager attention): the log-probs of the
last T tokens of two left-padded rows (per-row position ids), the gradient of their sum for a
few weights, and transformers' greedy continuation of a prompt (its KV cache); for the first
and the last, a PEFT 0.21 adapter on every linear map (`{name}-peft`, `all-linear`, random
factors) and the adapted log-probs.

    python3 scripts/gen_gemma4_reference.py grpo-rollout/tests/fixtures

Needs torch, transformers 5.2x (with `gemma4`) and peft.
"""
import json, os, sys

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from reference_common import copy_tokenizer, greedy, padded_logprobs, peft_adapter

ROWS = [[(5 * i * i + 3 * i + 7) % 290 + 3 for i in range(40)], [(11 * i + 4) % 290 + 3 for i in range(27)]]
T = 20
PROMPT = [4, 17, 99, 250, 31, 8, 140, 77, 5, 63, 12, 201, 45, 9, 180]
NEW = 14
GRADS = {
    "gemma4-micro": [
        "model.per_layer_projection_norm.weight",
        "model.layers.2.self_attn.k_norm.weight",
        "model.layers.3.self_attn.k_norm.weight",
        "model.layers.4.self_attn.q_norm.weight",
        "model.layers.5.post_per_layer_input_norm.weight",
        "model.layers.3.self_attn.k_proj.weight",
        "model.layers.1.per_layer_input_gate.weight",
    ],
    "gemma4-plain-micro": [
        "model.layers.1.self_attn.k_norm.weight",
        "model.layers.1.self_attn.v_proj.weight",
        "model.layers.0.post_feedforward_layernorm.weight",
    ],
    "gemma4-moe-micro": [
        "model.layers.0.router.proj.weight",
        "model.layers.1.router.scale",
        "model.layers.1.router.per_expert_scale",
        "model.layers.2.experts.down_proj",
        "model.layers.2.experts.gate_up_proj",
        "model.layers.2.pre_feedforward_layernorm_2.weight",
        "model.layers.2.post_feedforward_layernorm_1.weight",
        "model.layers.0.post_feedforward_layernorm_2.weight",
    ],
}
BASE = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, sliding_window=12, max_position_embeddings=128, bos_token_id=0, eos_token_id=2,
            pad_token_id=0)
MODELS = {
    "gemma4-micro": dict(
        num_hidden_layers=6, global_head_dim=16, num_global_key_value_heads=1, attention_k_eq_v=True,
        num_kv_shared_layers=2, hidden_size_per_layer_input=4, vocab_size_per_layer_input=300,
        use_double_wide_mlp=True, final_logit_softcapping=8.0, tie_word_embeddings=True,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention",
                     "sliding_attention", "full_attention"]),
    "gemma4-plain-micro": dict(
        num_hidden_layers=4, global_head_dim=16, attention_k_eq_v=False, num_kv_shared_layers=0,
        hidden_size_per_layer_input=0, tie_word_embeddings=False,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "gemma4-moe-micro": dict(
        num_hidden_layers=3, global_head_dim=16, num_global_key_value_heads=1, attention_k_eq_v=True,
        hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4, top_k_experts=2,
        moe_intermediate_size=24, tie_word_embeddings=True,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
}


def make(path, kw):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("gemma4_text", **{**BASE, **kw})
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1, 0.3)
            elif name.endswith("router.scale") or name.endswith("per_expert_scale"):
                p.uniform_(0.5, 1.5)
            elif "per_layer_input_gate" in name:
                # Small enough that GELU does not flush a branch to 0 (whose norm's gradient
                # would then be all rounding).
                p.normal_(0, 0.05)
            else:
                p.normal_(0, 0.5 if ("q_proj" in name or "k_proj" in name) else 0.25)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    copy_tokenizer(path)


def values(path, name):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    lp = padded_logprobs(model, ROWS, T)
    lp.sum().backward()
    params = dict(model.named_parameters())
    grads = {k: params[k].grad.flatten().tolist() for k in GRADS[name]}
    return {"logprobs": lp.tolist(), "grads": grads, "greedy": greedy(model, PROMPT, NEW)}


def main():
    fixtures = sys.argv[1]
    out = {"transformers": transformers.__version__, "rows": ROWS, "t": T, "prompt": PROMPT, "models": {}}
    for name, kw in MODELS.items():
        path = os.path.join(fixtures, name)
        make(path, kw)
        out["models"][name] = values(path, name)
        if name != "gemma4-plain-micro":
            # A PEFT adapter on every linear map (the per-layer-input maps, their model-level
            # projection and the router too), saved beside the model as `{name}-peft`.
            peft = os.path.join(fixtures, f"{name}-peft")
            out["models"][name]["peft_logprobs"] = peft_adapter(path, peft, ROWS, T)
    with open(os.path.join(fixtures, "gemma4_reference.json"), "w") as f:
        json.dump(out, f, indent=1)
    print("ok")


if __name__ == "__main__":
    main()
