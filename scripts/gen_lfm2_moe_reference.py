#!/usr/bin/env python3
"""An LFM2-MoE micro model and transformers' values of it, for grpo-rollout/tests/it/lfm2.rs.

`Lfm2MoeForCausalLM` (`lfm2_moe`, Liquid AI's LFM2-8B-A1B), 4 layers (a short convolution,
attention, convolution, attention), the first with LFM2's dense MLP (`num_dense_layers` 1), the
others with 4 experts of which 2 are chosen by `sigmoid(logit) + expert_bias` (offsets drawn std
0.1), renormalised and scaled by 1.5 (`routed_scaling_factor`); no biases (as LFM2's releases);
weights as gen_lfm2_reference.py draws them, tied; into fixtures/lfm2_moe-micro (its files hold
each expert's `w1` / `w3` / `w2`, as transformers writes them) and
fixtures/lfm2_moe_reference.json (eager attention): the log-probs of the last T tokens of the
left-padded rows of gen_lfm2_reference.py (float32; and float64 with its RMSNorms and softmax
in float64), the gradients of their sum for one weight of each kind (the experts' fused as
transformers holds them: `gate_up_proj` `(experts, 2 · width, hidden)`, gate rows first, and
`down_proj`), a greedy continuation, a PEFT `all-linear` adapter's log-probs
(fixtures/lfm2_moe-micro-peft).

    python3 scripts/gen_lfm2_moe_reference.py grpo-rollout/tests/fixtures

Needs torch, transformers 5.2x and peft.
"""
import json, os, sys

import torch
import transformers
import transformers.models.lfm2_moe.modeling_lfm2_moe as M
from transformers import AutoConfig, AutoModelForCausalLM

from gen_lfm2_reference import NEW, PROMPT, ROWS, T, save_random
from reference_common import greedy, in_float64, padded_logprobs, peft_adapter

GRADS = [
    "model.layers.0.conv.in_proj.weight", "model.layers.0.feed_forward.w1.weight",
    "model.layers.1.feed_forward.gate.weight", "model.layers.1.feed_forward.experts.gate_up_proj",
    "model.layers.3.feed_forward.experts.down_proj", "model.layers.3.self_attn.k_layernorm.weight",
]


def grads_of(model):
    params = dict(model.named_parameters())
    return {k: params[k].grad.flatten().tolist() for k in GRADS}


def main():
    fixtures = sys.argv[1]
    path = os.path.join(fixtures, "lfm2_moe-micro")
    cfg = AutoConfig.for_model(
        "lfm2_moe", vocab_size=300, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        norm_eps=1e-5, conv_bias=False, conv_L_cache=3, num_dense_layers=1, num_experts=4,
        num_experts_per_tok=2, use_expert_bias=True, routed_scaling_factor=1.5, norm_topk_prob=True,
        layer_types=["conv", "full_attention", "conv", "full_attention"], tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    save_random(cfg, path, 0)
    # The routers' offsets (buffers, never trained): drawn so that they change choices.
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(2)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.normal_(0, 0.1)
    model.save_pretrained(path)
    load = dict(attn_implementation="eager", experts_implementation="eager")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **load).eval()
    lp = padded_logprobs(model, ROWS, T)
    lp.sum().backward()
    grads = grads_of(model)
    out = greedy(model, PROMPT, NEW)
    peft_lp = peft_adapter(path, path + "-peft", ROWS, T, scale=0.3)
    in_float64(M, ["eager_attention_forward"], [M.Lfm2MoeRMSNorm])
    m64 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, **load).eval()
    lp64 = padded_logprobs(m64, ROWS, T)
    lp64.sum().backward()
    ref = {"transformers": transformers.__version__, "rows": ROWS, "t": T, "prompt": PROMPT,
           "logprobs": lp.tolist(), "grads": grads, "greedy": out, "peft_logprobs": peft_lp,
           "logprobs_f64": lp64.tolist(), "grads_f64": grads_of(m64)}
    with open(os.path.join(fixtures, "lfm2_moe_reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
    print("ok", out)


if __name__ == "__main__":
    main()
