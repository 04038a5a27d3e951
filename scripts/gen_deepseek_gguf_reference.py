#!/usr/bin/env python3
"""GGUF files of DeepSeek's families written by llama.cpp's own converter, with transformers'
log-probs of the models they came from, for grpo-rollout/tests/gguf_deepseek.rs.

Two random micro models are made with transformers (weights std 0.25, so that the routers
choose far from uniformly): a DeepSeek-V3 (`deepseek_v3`: low-rank q, latent attention, YaRN
with mscale = mscale_all_dim = 0.707, 8 experts in 4 groups of which 2 are taken, sigmoid router
with offsets, the first layer dense, one shared expert) and a GLM-4.5 (`glm4_moe`: q/k/v biases,
q/k norms, half of each head rotating, a next-token-prediction layer). Each is converted with
llama.cpp's `convert_hf_to_gguf.py` (f32) into grpo-rollout/tests/fixtures/{NAME}-llama-micro.gguf
(`deepseek2` and `glm4moe`), and transformers' log-probs of two token rows are written to
{NAME}_gguf_reference.json. The converter cannot name the fixtures' small byte-level tokenizer,
so it is told it is GPT-2's (which it is).

    python3 scripts/gen_deepseek_gguf_reference.py grpo-rollout/tests/fixtures --llama-cpp DIR

DIR: a llama.cpp source tree (convert_hf_to_gguf.py, gguf-py). Needs torch, transformers 5,
safetensors, numpy. Then, from a Python with llama-cpp-python (any directory),

    python3 scripts/gen_deepseek_gguf_reference.py grpo-rollout/tests/fixtures --add-llama-cpp

adds llama.cpp's own log-probs of the same rows (f32 KV cache) to each JSON.
"""
import argparse
import json
import os
import runpy
import shutil
import sys
import tempfile

ROWS = [list(range(3, 35)), [7, 250, 11, 42, 199, 5, 5, 5, 120, 64, 33, 290, 18, 77, 140, 9,
                             2, 61, 222, 13, 100, 101, 102, 45, 46, 47, 280, 6, 8, 10, 12, 14]]

COMMON = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
              tie_word_embeddings=False, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=2,
              pad_token_id=0)
MODELS = {
    "deepseekv3": ("deepseek_v3", dict(
        q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16,
        first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        norm_topk_prob=True, attention_bias=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                             original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0,
                             mscale=0.707, mscale_all_dim=0.707)),
        # What DeepSeek-V3's own config.json holds and transformers 5 does not write back.
        dict(scoring_func="sigmoid")),
    "glm4moe": ("glm4_moe", dict(
        head_dim=16, num_key_value_heads=2, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, moe_intermediate_size=16, first_k_dense_replace=1, n_group=1,
        topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True, attention_bias=True,
        use_qk_norm=True, num_nextn_predict_layers=1,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)),
        dict()),
}

ap = argparse.ArgumentParser()
ap.add_argument("fixtures")
ap.add_argument("--llama-cpp")
ap.add_argument("--add-llama-cpp", action="store_true")
a = ap.parse_args()


def add_llama_cpp():
    import numpy as np
    from llama_cpp import Llama
    for name in MODELS:
        ref_path = os.path.join(a.fixtures, f"{name}_gguf_reference.json")
        ref = json.load(open(ref_path))
        m = Llama(model_path=os.path.join(a.fixtures, f"{name}-llama-micro.gguf"), n_ctx=128,
                  logits_all=True, verbose=False, n_threads=2, type_k=0, type_v=0)
        out = []
        for row in ROWS:
            m.reset()
            m.eval(row)
            s = np.array(m.scores[: len(row)], dtype=np.float64)
            s -= s.max(1, keepdims=True)
            s -= np.log(np.exp(s).sum(1, keepdims=True))
            out.append([float(s[j - 1, t]) for j, t in enumerate(row) if j > 0])
        ref["llama_cpp_logprobs"] = out
        json.dump(ref, open(ref_path, "w"), indent=1)
        print(name, "llama.cpp log-probs added")


def make():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    here = os.path.dirname(os.path.abspath(__file__))
    tok_dir = os.path.join(a.fixtures, "arch-deepseekv2-micro")
    sys.path[:0] = [a.llama_cpp, os.path.join(a.llama_cpp, "gguf-py")]
    import conversion.base as base
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    import conversion.glm as glm
    for c in vars(glm).values():
        if isinstance(c, type) and issubclass(c, base.TextModel) and "set_vocab" in c.__dict__:
            c.set_vocab = lambda self: self._set_vocab_gpt2()
    for name, (model_type, kw, extra) in MODELS.items():
        cfg = AutoConfig.for_model(model_type, **{**COMMON, **kw})
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        with torch.no_grad():
            for n, p in m.named_parameters():
                if p.dim() >= 2:
                    p.normal_(0, 0.25)
                elif "norm" in n:
                    p.add_(torch.randn_like(p) * 0.1)
                else:
                    p.normal_(0, 0.1)
            for n, b in m.named_buffers():
                if "e_score_correction_bias" in n:
                    b.normal_(0, 0.1)
        with tempfile.TemporaryDirectory() as d:
            m.save_pretrained(d)
            cj = json.load(open(os.path.join(d, "config.json")))
            cj.update(extra)
            json.dump(cj, open(os.path.join(d, "config.json"), "w"), indent=2)
            for f in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(os.path.join(tok_dir, f), d)
            out = os.path.join(a.fixtures, f"{name}-llama-micro.gguf")
            sys.argv = ["convert_hf_to_gguf.py", d, "--outfile", out, "--outtype", "f32"]
            runpy.run_path(os.path.join(a.llama_cpp, "convert_hf_to_gguf.py"), run_name="__main__")
        lps = []
        with torch.no_grad():
            for row in ROWS:
                lp = torch.log_softmax(m(torch.tensor([row])).logits[0].double(), -1)
                lps.append([lp[j - 1, t].item() for j, t in enumerate(row) if j > 0])
        ref = {"model_type": model_type, "config": cfg.to_dict(), "rows": ROWS,
               "transformers_logprobs": lps}
        json.dump(ref, open(os.path.join(a.fixtures, f"{name}_gguf_reference.json"), "w"),
                  indent=1, default=str)
        print(name, "written")


if a.add_llama_cpp:
    add_llama_cpp()
else:
    if not a.llama_cpp:
        sys.exit("--llama-cpp DIR is required (a llama.cpp source tree)")
    make()
