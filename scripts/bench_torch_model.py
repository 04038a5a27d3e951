#!/usr/bin/env python3
"""PyTorch side of `grpo-cli bench-model`: the same workload on the same weights.

    python3 scripts/bench_torch_model.py MODEL_DIR [--batch 32 --new-tokens 64 --seq-len 80 --reps 3]

Generation: HF `generate` on 4 prompts x (batch/4) samples, 16 prompt tokens, exactly
`new_tokens` new tokens (min_new_tokens), temperature 1. Forward + backward: the mean log-prob
of the last half of batch x seq_len tokens, backward through every weight.
"""
import argparse
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

p = argparse.ArgumentParser()
p.add_argument("model")
p.add_argument("--batch", type=int, default=32)
p.add_argument("--new-tokens", type=int, default=64)
p.add_argument("--seq-len", type=int, default=80)
p.add_argument("--reps", type=int, default=3)
a = p.parse_args()

model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
vocab = model.config.vocab_size
prompts = torch.tensor([[(i * 31 + j * 7 + 5) % vocab for j in range(16)] for i in range(4)])
prompts = prompts.repeat_interleave(a.batch // 4, dim=0)
gen = []
model.eval()
for r in range(a.reps + 1):
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
                             temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=a.new_tokens,
                             min_new_tokens=a.new_tokens, pad_token_id=0)
    dt = time.perf_counter() - t
    assert out.shape[1] == 16 + a.new_tokens
    if r > 0:
        gen.append(dt)

model.train()
ids = torch.tensor([[((i * a.seq_len + j) * 2654435761 % 2**32 >> 7) % vocab for j in range(a.seq_len)]
                    for i in range(a.batch)])
t_keep = a.seq_len // 2
fb = []
for r in range(a.reps + 1):
    t = time.perf_counter()
    logits = model(input_ids=ids).logits[:, -t_keep - 1:-1, :]
    lp = torch.log_softmax(logits, -1).gather(-1, ids[:, -t_keep:].unsqueeze(-1)).squeeze(-1)
    (-lp.mean()).backward()
    dt = time.perf_counter() - t
    model.zero_grad()
    if r > 0:
        fb.append(dt)
g = statistics.median(gen)
print(json.dumps({"impl": "torch", "torch": torch.__version__, "threads": torch.get_num_threads(),
                  "generate_s_median": g, "generate_s_all": gen,
                  "generate_tokens_per_s": a.batch * a.new_tokens / g,
                  "fwd_bwd_s_median": statistics.median(fb), "fwd_bwd_s_all": fb}))
