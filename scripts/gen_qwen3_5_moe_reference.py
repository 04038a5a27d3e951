#!/usr/bin/env python3
"""A Qwen3.5 MoE micro model and transformers' values of it, for grpo-rollout/tests/it/qwen3_5.rs.

`Qwen3_5MoeForCausalLM` (`qwen3_5_moe_text`), 4 layers (gated full attention, linear attention,
linear, full), an MoE MLP in every layer: 4 experts of which 2 chosen per token (a softmax
router, the chosen weights renormalised) and a shared expert weighted by
`sigmoid(shared_expert_gate · h)`; untied; weights as gen_qwen3_5_reference.py draws them
(std 0.25: the routing far from uniform), the tokenizer of fixtures/arch-deepseekv2-micro; into
fixtures/qwen3_5_moe-micro (its files hold each expert's maps apart, as transformers writes
them) and fixtures/qwen3_5_moe_reference.json (float32, eager attention): the log-probs of the
last T tokens of the left-padded rows of gen_qwen3_5_reference.py, the gradient of their sum for
one weight of each kind (the experts' as transformers holds them fused: `gate_up_proj`
`(experts, 2 · width, hidden)`, gate rows first, and `down_proj`), the load-balancing loss
(`output_router_logits`, the attention mask given) and its router gradients, a greedy
continuation, each row alone in float64 throughout with its gradients, transformers' own bf16
deviation, a PEFT `all-linear` adapter's log-probs (fixtures/qwen3_5_moe-micro-peft).

    python3 scripts/gen_qwen3_5_moe_reference.py grpo-rollout/tests/fixtures

Needs torch, transformers 5.2x and peft.
"""
import json, os, sys

import torch
import transformers
import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as M
from transformers import AutoConfig, AutoModelForCausalLM

from gen_qwen3_5_reference import PROMPT, NEW, ROWS, T, save_random
from reference_common import gated_delta_in_float64, greedy, padded, padded_logprobs, peft_adapter

GRADS = [
    "model.layers.1.linear_attn.A_log", "model.layers.2.linear_attn.in_proj_qkv.weight",
    "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.gate.weight",
    "model.layers.1.mlp.shared_expert_gate.weight", "model.layers.2.mlp.shared_expert.down_proj.weight",
    "model.layers.0.mlp.experts.gate_up_proj", "model.layers.3.mlp.experts.down_proj",
    "model.layers.3.post_attention_layernorm.weight",
]


def grads_of(model):
    params = dict(model.named_parameters())
    return {k: params[k].grad.flatten().tolist() for k in GRADS}


def main():
    fixtures = sys.argv[1]
    path = os.path.join(fixtures, "qwen3_5_moe-micro")
    cfg = AutoConfig.for_model(
        "qwen3_5_moe_text", vocab_size=300, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, linear_conv_kernel_dim=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40,
        router_aux_loss_coef=0.02, tie_word_embeddings=False, bos_token_id=0, eos_token_id=2, pad_token_id=0,
        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [1, 1, 0], "mrope_interleaved": True})
    save_random(cfg, path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager").eval()
    lp = padded_logprobs(model, ROWS, T)
    lp.sum().backward()
    grads = grads_of(model)
    out = greedy(model, PROMPT, NEW)
    # The load-balancing loss over the padded rows (what TRL adds times router_aux_loss_coef).
    model.zero_grad()
    model.train()
    ids, mask, pos = padded(ROWS)
    aux = model(input_ids=ids, attention_mask=mask, position_ids=pos, output_router_logits=True).aux_loss
    aux.backward()
    params = dict(model.named_parameters())
    aux_grads = {str(i): params[f"model.layers.{i}.mlp.gate.weight"].grad.flatten().tolist() for i in range(4)}
    peft_lp = peft_adapter(path, path + "-peft", ROWS, T, scale=0.3)
    mb = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager", experts_implementation="eager").eval()
    with torch.no_grad():
        bf16 = (padded_logprobs(mb, ROWS, T) - lp.detach()).abs().max().item()
    gated_delta_in_float64(M, "Qwen3_5Moe")
    m64 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager").eval()
    alone64 = []
    for r in ROWS:
        lp64 = padded_logprobs(m64, [r], T)[0]
        lp64.sum().backward()
        alone64.append(lp64.tolist())
    ref = {"transformers": transformers.__version__, "rows": ROWS, "t": T, "prompt": PROMPT,
           "logprobs": lp.tolist(), "grads": grads, "greedy": out, "aux_loss": aux.item(),
           "aux_grads": aux_grads, "peft_logprobs": peft_lp, "bf16_deviation": bf16,
           "alone_f64": alone64, "grads_f64": grads_of(m64)}
    with open(os.path.join(fixtures, "qwen3_5_moe_reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
    print("ok", out, aux.item(), bf16)


if __name__ == "__main__":
    main()
