#!/usr/bin/env python3
"""Checks a GGUF file in real llama.cpp (llama-cpp-python) against grpo-rs.

    python scripts/check_gguf_llama_cpp.py FILE.gguf [--prompt P] [--completion C] [--kv-f16] [--n-ctx N]

Loads FILE with llama.cpp, compares its tokenisation of a few texts with ours, and the log-probs
of the completion's tokens given the prompt (llama.cpp's logits, log-softmaxed here) with
`grpo-cli logprobs --json` on the same file. Prints one JSON line; exit code 1 when the token ids
differ. Needs `pip install llama-cpp-python numpy` (it builds llama.cpp: ~20 min on 2 cores) and
the release binary (`cargo build --release -p grpo-cli`). The KV cache is f32 unless --kv-f16
(llama.cpp's default f16 cache alone moves log-probs by ~1e-4).
"""
import argparse, json, subprocess, sys

import numpy as np
from llama_cpp import Llama

ap = argparse.ArgumentParser()
ap.add_argument("gguf")
ap.add_argument("--prompt", default="The capital of France is")
ap.add_argument("--completion", default=" Paris. It is a big city.")
ap.add_argument("--kv-f16", action="store_true")
ap.add_argument("--bin", default="target/release/grpo-cli")
# llama.cpp picks LongRoPE's long factors when its context passes the pre-training length:
# a context within it compares with transformers' (and our) short factors.
ap.add_argument("--n-ctx", type=int, default=512)
a = ap.parse_args()


def ours(prompt, completion):
    out = subprocess.run([a.bin, "logprobs", "--model", a.gguf, "--prompt", prompt,
                          "--completion", completion, "--json"], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


texts = ["What is 3 + 4? The answer is 7.", "  spaces\tand\nlines 12345", "<|im_start|>user\nhi<|im_end|>"]
vocab = Llama(model_path=a.gguf, vocab_only=True, verbose=False)
tok_ok = all(vocab.tokenize(t.encode(), add_bos=False, special=True) == ours("x", t)["token_ids"] for t in texts)
prompt_ids = ours("x", a.prompt)["token_ids"]
mine = ours(a.prompt, a.completion)
del vocab
kv = {} if a.kv_f16 else dict(type_k=0, type_v=0)
m = Llama(model_path=a.gguf, n_ctx=a.n_ctx, logits_all=True, verbose=False, n_threads=2, **kv)
ids = prompt_ids + mine["token_ids"]
m.eval(ids)
s = np.array(m.scores[: len(ids)], dtype=np.float64)
s -= s.max(1, keepdims=True)
s -= np.log(np.exp(s).sum(1, keepdims=True))
lp = np.array([s[len(prompt_ids) + j - 1, t] for j, t in enumerate(mine["token_ids"])])
d = np.abs(lp - np.array(mine["logprobs"]))
print(json.dumps({"file": a.gguf, "tokenisation_matches": tok_ok, "max_abs_diff": float(d.max()),
                  "mean_abs_diff": float(d.mean()), "kv_cache": "f16" if a.kv_f16 else "f32"}))
sys.exit(0 if tok_ok else 1)
