#!/usr/bin/env python3
"""A fine-grained FP8 micro checkpoint (`quantization_config.quant_method = "fp8"`, as DeepSeek-V3's
and the Qwen3 / Ministral 3 FP8 uploads hold their weights) and transformers' log-probs of it, for
grpo-rollout/tests/it/model.rs.

A random qwen3 micro model (transformers 5, weights std 0.25) has every decoder-layer matrix
quantized to float8_e4m3fn in 16 × 16 tiles, each with its `weight_scale_inv` (the tile's
max |w| / 448), embeddings and head left dense (`modules_to_not_convert`), written to
grpo-rollout/tests/fixtures/fp8-qwen3-micro; transformers loads it with
`FineGrainedFP8Config(dequantize=True)` and its log-probs of two rows go to
fixtures/fp8_reference.json.

    python3 scripts/gen_fp8_reference.py grpo-rollout/tests/fixtures

Needs torch, transformers 5, safetensors.
"""
import json, os, shutil, sys, torch
from safetensors.torch import save_file, load_file
from transformers import AutoConfig, AutoModelForCausalLM, FineGrainedFP8Config
FIX = sys.argv[1]
out = os.path.join(FIX, "fp8-qwen3-micro"); B = 16
cfg = AutoConfig.for_model("qwen3", vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False,
    bos_token_id=0, eos_token_id=2, pad_token_id=0)
torch.manual_seed(0)
m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
with torch.no_grad():
    for n, p in m.named_parameters():
        if p.dim() >= 2: p.normal_(0, 0.25)
m.save_pretrained(out)
sd = load_file(os.path.join(out, "model.safetensors"))
q = {}
for k, w in sd.items():
    if w.dim() == 2 and ".layers." in k:
        n, kk = w.shape
        s = torch.zeros((n + B - 1) // B, (kk + B - 1) // B)
        for i in range(s.shape[0]):
            for j in range(s.shape[1]):
                s[i, j] = w[i*B:(i+1)*B, j*B:(j+1)*B].abs().max() / 448.0
        full = s.repeat_interleave(B, 0)[:n].repeat_interleave(B, 1)[:, :kk]
        q[k] = (w / full).to(torch.float8_e4m3fn)
        q[k + "_scale_inv"] = s
    else:
        q[k] = w
save_file(q, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
c = json.load(open(os.path.join(out, "config.json")))
c["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [B, B],
                            "modules_to_not_convert": ["lm_head"]}
json.dump(c, open(os.path.join(out, "config.json"), "w"), indent=2)
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(FIX, "arch-deepseekv2-micro", f), out)
rows = [list(range(3, 35)), [(7*i*i + 3*i + 11) % 290 + 3 for i in range(32)]]
mt = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, quantization_config=FineGrainedFP8Config(dequantize=True)).eval()
print(type(mt.model.layers[0].self_attn.q_proj), mt.model.layers[0].self_attn.q_proj.weight.dtype)
lps = []
with torch.no_grad():
    for r in rows:
        lp = torch.log_softmax(mt(torch.tensor([r])).logits[0].double(), -1)
        lps.append([lp[j-1, t].item() for j, t in enumerate(r) if j > 0])
json.dump({"rows": rows, "logprobs": lps}, open(os.path.join(FIX, "fp8_reference.json"), "w"))
print("ok", min(min(x) for x in lps))
