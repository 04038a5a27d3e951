"""What PyTorch keeps for backward per position and decoder layer (the reference for
`grpo-rollout/tests/recompute.rs`'s activation test).

A small Qwen2 (hidden 64, MLP 192, 4 heads on 2 kv heads, vocabulary 128, tied head, q/k/v
biases) in bf16 with transformers' default attention (sdpa), full and with peft LoRA adapters
(r 4 on all seven projections): the bytes of every tensor autograd saves during a forward and a
completion log-prob (log-softmax + gather of the last 30 of 40 positions, batch 4), counted once
per storage, weights excluded (`torch.autograd.graph.saved_tensors_hooks`). The difference
between 4 and 2 layers, over 2 layers and 160 positions and 2 bytes, is the number of bf16 values
kept per position and layer.

usage: python3 scripts/gen_activation_reference.py [OUT_JSON]
"""
import json, sys
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

B, L, T = 4, 40, 30


def saved_bytes(layers, lora):
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=192,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=True,
                      attn_implementation="sdpa")
    m = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    if lora:
        from peft import LoraConfig, get_peft_model
        m = get_peft_model(m, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    weights = {p.data_ptr() for p in m.parameters()}
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.long)
    saved = {}

    def pack(t):
        if t.data_ptr() not in weights and t.numel() > 0:
            st = t.untyped_storage()
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = m(input_ids=ids, attention_mask=mask).logits[:, -T - 1:-1, :].float()
        torch.log_softmax(logits, -1).gather(-1, ids[:, -T:, None])
    return sum(saved.values())


def per_position_layer(lora):
    return (saved_bytes(4, lora) - saved_bytes(2, lora)) / 2 / (B * L) / 2


out = sys.argv[1] if len(sys.argv) > 1 else "grpo-rollout/tests/fixtures/activation_reference.json"
ref = {
    "torch": torch.__version__,
    "config": {"hidden": 64, "intermediate": 192, "heads": 4, "kv_heads": 2, "vocab": 128,
               "batch": B, "positions": L, "completion": T, "dtype": "bf16", "lora_r": 4},
    "full_values_per_position_layer": per_position_layer(False),
    "lora_values_per_position_layer": per_position_layer(True),
}
json.dump(ref, open(out, "w"), indent=1)
print(json.dumps(ref))
