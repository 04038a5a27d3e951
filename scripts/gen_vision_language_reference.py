#!/usr/bin/env python3
"""Vision-language micro checkpoints (Gemma 3's `gemma3`, Mistral 3's `mistral3` with a
Ministral 3 language model, Gemma 4's `gemma4` without its audio tower, Qwen2.5-VL's
`qwen2_5_vl` and Qwen3-VL's `qwen3_vl`) and transformers' log-probs of their language model, for
grpo-rollout/tests/it/architectures.rs.

Each model is made with transformers 5 (`AutoModelForImageTextToText`, random weights std 0.2,
norms jittered) and saved as transformers saves it — `language_model.model.*` beside a vision
tower and projector — into grpo-rollout/tests/fixtures/vl-{gemma3,mistral3,gemma4,qwen2_5_vl,qwen3_vl}-micro with the
fixtures' byte-level tokenizer. Gemma 3's text layers slide over a window of 8; Mistral 3's
language model is `ministral3` (YaRN factor 4 over a pre-training length of 48, its attention
temperature beta 0.1, `tie_word_embeddings` true at the top and false in `text_config`: the top
wins). Gemma 4's (`model.language_model.*`) has 4 layers, the last two reusing the first two's
keys and values, keys as values on its full layers, per-layer inputs. Qwen2.5-VL's is saved
with its language model under a causal LM's names (`model.layers.*`) beside `visual.*`, as
transformers 5 writes it; its multimodal RoPE sections, as Qwen3-VL's interleaved ones, turn
text alike on all three axes. transformers' log-probs of two 40-token rows, input ids only (no image), go to
fixtures/vision_language_reference.json, with a PEFT adapter on each language model (q, v and
down of every layer, random factors, as PEFT saves it: fixtures/vl-{name}-peft) and the adapted
model's log-probs.

    python3 scripts/gen_vision_language_reference.py grpo-rollout/tests/fixtures

Needs torch, transformers 5, safetensors, peft.
"""
import json
import os
import shutil
import sys

import torch
from transformers import AutoConfig, AutoModelForImageTextToText

FIX = sys.argv[1]
ROWS = [list(range(3, 43)), [(7 * i * i + 3 * i + 11) % 290 + 3 for i in range(40)]]

CONFIGS = {
    "gemma3": dict(
        text_config=dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=8,
                         max_position_embeddings=128),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=14),
        mm_tokens_per_image=4, image_token_index=299, boi_token_index=297, eoi_token_index=298),
    "mistral3": dict(
        text_config=dict(model_type="ministral3", vocab_size=300, hidden_size=32,
                         intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, max_position_embeddings=192,
                         tie_word_embeddings=False,
                         rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=4.0,
                                              original_max_position_embeddings=48, beta_fast=32.0,
                                              beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                                              llama_4_scaling_beta=0.1)),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=14, head_dim=8),
        image_token_index=299, spatial_merge_size=1, tie_word_embeddings=True),
    "gemma4": dict(
        text_config=dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=8,
                         max_position_embeddings=128, global_head_dim=16, num_global_key_value_heads=1,
                         attention_k_eq_v=True, num_kv_shared_layers=2, hidden_size_per_layer_input=4,
                         vocab_size_per_layer_input=300,
                         layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                      "full_attention"]),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=2, head_dim=8),
        audio_config=None, image_token_id=299, boi_token_id=297, eoi_token_id=298),
    "qwen2_5_vl": dict(
        text_config=dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "type": "mrope",
                                          "mrope_section": [1, 1, 2]}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           fullatt_block_indexes=[0], window_size=28, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2),
        image_token_id=299, video_token_id=298, vision_start_token_id=296, vision_end_token_id=297),
    "qwen3_vl": dict(
        text_config=dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                         bos_token_id=0, eos_token_id=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [1, 1, 2],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           deepstack_visual_indexes=[0], patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, num_position_embeddings=16),
        image_token_id=299, video_token_id=298, vision_start_token_id=296, vision_end_token_id=297),
}

ref = {"rows": ROWS, "models": {}}
for name, kw in CONFIGS.items():
    cfg = AutoConfig.for_model(name, **kw)
    torch.manual_seed(0)
    m = AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
            elif "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    out = os.path.join(FIX, f"vl-{name}-micro")
    shutil.rmtree(out, ignore_errors=True)
    m.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(FIX, "arch-deepseekv2-micro", f), out)
    lps = []
    with torch.no_grad():
        for row in ROWS:
            lp = torch.log_softmax(m(input_ids=torch.tensor([row])).logits[0].double(), -1)
            lps.append([lp[j - 1, t].item() for j, t in enumerate(row) if j > 0])
    tied = m.lm_head.weight.data_ptr() == m.get_input_embeddings().weight.data_ptr()
    # A PEFT adapter on the language model (random A and B), saved as PEFT saves it
    # (`base_model.model.model.language_model.*`), and the adapted model's log-probs.
    from peft import LoraConfig, get_peft_model
    lcfg = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                      target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)")
    torch.manual_seed(1)
    pm = get_peft_model(m, lcfg).eval()
    adapter = os.path.join(FIX, f"vl-{name}-peft")
    shutil.rmtree(adapter, ignore_errors=True)
    pm.save_pretrained(adapter)
    os.remove(os.path.join(adapter, "README.md"))
    alps = []
    with torch.no_grad():
        for row in ROWS:
            lp = torch.log_softmax(pm(input_ids=torch.tensor([row])).logits[0].double(), -1)
            alps.append([lp[j - 1, t].item() for j, t in enumerate(row) if j > 0])
    ref["models"][name] = {"logprobs": lps, "tied": tied, "adapted_logprobs": alps}
    print(name, "tied", tied)
json.dump(ref, open(os.path.join(FIX, "vision_language_reference.json"), "w"), indent=1)
