"""Make a small random GLM-4.7-Flash-shaped causal LM (`glm4_moe_lite`: DeepSeek's multi-head
latent attention with GLM-4.7-Flash's head shapes — q_lora_rank 768, kv_lora_rank 512, 192 + 64
query/key dims, 256 value dims — on 4 layers of 16 heads, the first dense, the others 8 experts
of which 2 a token and a shared one) in Hugging Face format, for timing the latent KV cache
against each head's (`GRPO_MLA_CACHE=latent|heads`).

usage: python3 make_mla_model.py OUT --tokenizer DIR   (DIR: a model directory whose
tokenizer.json / tokenizer_config.json are copied, e.g. one make_tiny_model.py made)
"""
import argparse, json, os, shutil

import torch
from transformers import AutoConfig, AutoModelForCausalLM

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--tokenizer", required=True)
p.add_argument("--layers", type=int, default=4)
p.add_argument("--heads", type=int, default=16)
p.add_argument("--seed", type=int, default=0)
a = p.parse_args()

with open(os.path.join(a.tokenizer, "config.json")) as f:
    vocab = json.load(f)["vocab_size"]
cfg = AutoConfig.for_model(
    "glm4_moe_lite", vocab_size=vocab, hidden_size=1024, intermediate_size=2048,
    num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.heads,
    q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
    moe_intermediate_size=256, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    mlp_layer_types=["dense"] + ["sparse"] * (a.layers - 1), max_position_embeddings=4096,
    tie_word_embeddings=False)
torch.manual_seed(a.seed)
model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
model.save_pretrained(a.out)
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(a.tokenizer, f), a.out)
print(sum(p.numel() for p in model.parameters()))
