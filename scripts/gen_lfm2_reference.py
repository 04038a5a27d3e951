#!/usr/bin/env python3
"""An LFM2 micro model and transformers' values of it, for grpo-rollout/tests/it/lfm2.rs.

`Lfm2ForCausalLM` (`lfm2`, Liquid AI's LFM2-350M … 2.6B), 4 layers (a gated short
convolution, attention, convolution, attention: `layer_types`), the convolution with a bias
(`conv_bias`) and a kernel of 3 (`conv_L_cache`), the MLP's width adjusted as LFM2's configs
ask (`block_auto_adjust_ff_dim`: two thirds of `intermediate_size`, rounded up to
`block_multiple_of`), weights std 0.25, norms drawn around 1, tied, the tokenizer of
fixtures/arch-deepseekv2-micro; into fixtures/lfm2-micro and fixtures/lfm2_reference.json
(float32, eager attention): the log-probs of the last T tokens of two left-padded rows
(per-row position ids), the gradient of their sum for one weight of each kind, a greedy
continuation (transformers' cache: convolution states, keys and values), the padded rows'
log-probs and gradients in float64 and each row alone (padding reaches a biased convolution:
`in_proj`'s bias makes `B · x` of a zeroed padding position nonzero), a PEFT `all-linear`
adapter's log-probs (fixtures/lfm2-micro-peft); and fixtures/lfm2-plain-micro, the same model
without biases (seed 1), for the GGUF fixture.

    python3 scripts/gen_lfm2_reference.py grpo-rollout/tests/fixtures

Needs torch, transformers 5.2x and peft.
"""
import json, os, sys

import torch
import transformers
import transformers.models.lfm2.modeling_lfm2 as M
from transformers import AutoConfig, AutoModelForCausalLM

from reference_common import copy_tokenizer, greedy, in_float64, padded_logprobs, peft_adapter

ROWS = [[(5 * i * i + 3 * i + 7) % 290 + 3 for i in range(40)], [(11 * i + 4) % 290 + 3 for i in range(27)]]
T = 20
PROMPT = [4, 17, 99, 250, 31, 8, 140, 77, 5, 63, 12, 201, 45, 9, 180]
NEW = 14
GRADS = [
    "model.layers.0.conv.conv.weight", "model.layers.0.conv.conv.bias", "model.layers.2.conv.in_proj.weight",
    "model.layers.2.conv.out_proj.bias", "model.layers.1.self_attn.q_layernorm.weight",
    "model.layers.1.self_attn.out_proj.weight", "model.layers.3.feed_forward.w1.weight",
    "model.layers.3.operator_norm.weight", "model.layers.0.ffn_norm.weight", "model.embedding_norm.weight",
]


def save_random(cfg, path, seed):
    """A model of `cfg`, weights std 0.25 and norms around 1 (`seed`), saved at `path` with
    the micro models' tokenizer."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1, 0.3) if "norm" in name else p.normal_(0, 0.25)
    model.save_pretrained(path)
    copy_tokenizer(path)


def main():
    fixtures = sys.argv[1]
    path = os.path.join(fixtures, "lfm2-micro")
    cfg = AutoConfig.for_model(
        "lfm2", vocab_size=300, hidden_size=32, intermediate_size=60, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, norm_eps=1e-5, conv_bias=True, conv_L_cache=3,
        block_multiple_of=16, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True,
        layer_types=["conv", "full_attention", "conv", "full_attention"], tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    save_random(cfg, path, 0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    lp = padded_logprobs(model, ROWS, T)
    lp.sum().backward()
    params = dict(model.named_parameters())
    grads = {k: params[k].grad.flatten().tolist() for k in GRADS}
    peft_lp = peft_adapter(path, path + "-peft", ROWS, T, scale=0.3)
    # Each row alone in float64 throughout (its RMSNorms and softmax switched to float64).
    in_float64(M, ["eager_attention_forward"], [M.Lfm2RMSNorm])
    m64 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="eager").eval()
    lp64 = padded_logprobs(m64, ROWS, T)
    lp64.sum().backward()
    with torch.no_grad():
        alone64 = [padded_logprobs(m64, [r], T)[0].tolist() for r in ROWS]
    p64 = dict(m64.named_parameters())
    grads64 = {k: p64[k].grad.flatten().tolist() for k in GRADS}
    ref = {"transformers": transformers.__version__, "rows": ROWS, "t": T, "prompt": PROMPT,
           "logprobs": lp.tolist(), "grads": grads, "greedy": greedy(model, PROMPT, NEW),
           "peft_logprobs": peft_lp, "logprobs_f64": lp64.tolist(), "grads_f64": grads64,
           "alone_f64": alone64,
           "mlp_width": model.model.layers[0].feed_forward.w1.weight.shape[0]}
    with open(os.path.join(fixtures, "lfm2_reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
    # The same without biases (as LFM2's releases; llama.cpp's lfm2 has none), for the GGUF
    # fixture of scripts/gen_recurrent_gguf_fixtures.py.
    plain = os.path.join(fixtures, "lfm2-plain-micro")
    cfg.conv_bias = False
    save_random(cfg, plain, 1)
    print("ok", ref["greedy"], ref["mlp_width"])


if __name__ == "__main__":
    main()
