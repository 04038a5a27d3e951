"""Reference values of the model merges (grpo-rollout/tests/it/merge.rs): mergekit's own
`run_merge` on three tiny Qwen2 directories whose weights follow a formula the test repeats
(`w[m][name][j] = 0.1·sin(1.3·m + 0.7·j + 0.013·Σ bytes(name))`, m = 1, 2, 3; two layers), one merge
per method in float32 — linear with a gradient weight, task_arithmetic with λ, ties with a
gradient density, dare_ties at density 1 (deterministic), slerp with filtered gradients —
printing each merged tensor's sum and sum of squares. Run with torch, safetensors and
mergekit installed:

    HF_HUB_OFFLINE=1 python scripts/check_merge.py
"""
import json, math, os, sys, tempfile

import torch
from safetensors.torch import save_file
from mergekit.config import MergeConfiguration
from mergekit.merge import MergeOptions, run_merge
from safetensors.torch import load_file

H, I, L, V = 4, 8, 2, 8
SHAPES = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
for i in range(L):
    p = f"model.layers.{i}."
    SHAPES.update({
        p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
        p + "self_attn.q_proj.weight": (H, H), p + "self_attn.q_proj.bias": (H,),
        p + "self_attn.k_proj.weight": (H, H), p + "self_attn.k_proj.bias": (H,),
        p + "self_attn.v_proj.weight": (H, H), p + "self_attn.v_proj.bias": (H,),
        p + "self_attn.o_proj.weight": (H, H),
        p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H), p + "mlp.down_proj.weight": (H, I),
    })
CONFIG = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": H,
          "intermediate_size": I, "num_hidden_layers": L, "num_attention_heads": 2,
          "num_key_value_heads": 2, "vocab_size": V, "tie_word_embeddings": True,
          "torch_dtype": "float32", "rms_norm_eps": 1e-6, "max_position_embeddings": 64}


def weights(m):
    out = {}
    for name, shape in SHAPES.items():
        n = math.prod(shape)
        v = [0.1 * math.sin(1.3 * m + 0.7 * j + 0.013 * sum(map(ord, name))) for j in range(n)]
        out[name] = torch.tensor(v, dtype=torch.float32).reshape(shape)
    return out


CONFIGS = {
    "linear": "merge_method: linear\nmodels:\n  - model: M1\n    parameters: {weight: 0.7}\n  - model: M2\n    parameters: {weight: 0.5}\n  - model: M3\n    parameters: {weight: [0.1, 1.0]}\ndtype: float32\n",
    "task_arithmetic": "merge_method: task_arithmetic\nbase_model: M1\nmodels:\n  - model: M2\n    parameters: {weight: 0.6}\n  - model: M3\n    parameters: {weight: -0.4}\nparameters: {lambda: 0.8}\ndtype: float32\n",
    "ties": "merge_method: ties\nbase_model: M1\nmodels:\n  - model: M1\n  - model: M2\n    parameters: {weight: 0.6, density: [1.0, 0.7, 0.1]}\n  - model: M3\n    parameters: {weight: 0.4, density: 0.5}\ndtype: float32\n",
    "dare_ties": "merge_method: dare_ties\nbase_model: M1\nmodels:\n  - model: M2\n    parameters: {weight: 0.6}\n  - model: M3\n    parameters: {weight: 0.4}\nparameters: {normalize: true}\ndtype: float32\n",
    "slerp": "merge_method: slerp\nbase_model: M1\nmodels:\n  - model: M1\n  - model: M2\nparameters:\n  t:\n    - filter: self_attn\n      value: [0, 0.5, 0.3, 0.7, 1]\n    - filter: mlp\n      value: [1, 0.5, 0.7, 0.3, 0]\n    - value: 0.5\ndtype: float32\n",
}

import yaml
root = tempfile.mkdtemp()
for m in (1, 2, 3):
    d = os.path.join(root, f"m{m}")
    os.makedirs(d)
    save_file(weights(m), os.path.join(d, "model.safetensors"))
    json.dump(CONFIG, open(os.path.join(d, "config.json"), "w"))
for method, text in CONFIGS.items():
    for m in (1, 2, 3):
        text = text.replace(f"M{m}", os.path.join(root, f"m{m}"))
    out = os.path.join(root, f"out-{method}")
    run_merge(MergeConfiguration.model_validate(yaml.safe_load(text)), out_path=out,
              options=MergeOptions(copy_tokenizer=False, write_model_card=False, allow_crimes=True))
    merged = {}
    for f in os.listdir(out):
        if f.endswith(".safetensors"):
            merged.update(load_file(os.path.join(out, f)))
    print(method, json.dumps({k: [merged[k].double().sum().item(), (merged[k].double() ** 2).sum().item()] for k in sorted(merged)}))
