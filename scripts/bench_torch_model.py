#!/usr/bin/env python3
"""PyTorch side of `grpo-cli bench-model`: the same workload on the same weights.

    python3 scripts/bench_torch_model.py MODEL_DIR [--batch 32 --new-tokens 64 --prompt-len 16
        --seq-len 80 --reps 3 --device cpu|cuda|cuda:N --dtype f32|bf16|f16]

Generation: HF `generate` on 4 prompts x (batch/4) samples, `prompt_len` prompt tokens, exactly
`new_tokens` new tokens (min_new_tokens), temperature 1; then the prefill alone (one new token),
so that `decode_ms_per_step` = (whole - prefill) / (new_tokens - 1). Forward + backward: the
mean log-prob of the last half of batch x seq_len tokens, backward through every weight. The
matrix work is counted as `ModelConfig::matmul_flops` counts it, and the matrix peak is the best
of 20 square products on the same device and dtype (1024 on the CPU, 8192 on a GPU).
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
p.add_argument("--prompt-len", type=int, default=16)
p.add_argument("--seq-len", type=int, default=80)
p.add_argument("--reps", type=int, default=3)
p.add_argument("--device", default="cpu")
p.add_argument("--dtype", default="f32", choices=["f32", "bf16", "f16"])
a = p.parse_args()
assert a.new_tokens >= 2, "--new-tokens must be at least 2"

dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[a.dtype]
dev = torch.device(a.device)


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype).to(dev)
cfg = model.config
vocab = cfg.vocab_size
prompts = torch.tensor([[(i * 31 + j * 7 + 5) % vocab for j in range(a.prompt_len)] for i in range(4)])
prompts = prompts.repeat_interleave(a.batch // 4, dim=0).to(dev)
model.eval()


def time_generation(n):
    times = []
    for r in range(a.reps + 1):
        sync()
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
                                 temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=n,
                                 min_new_tokens=n, pad_token_id=0)
        sync()
        dt = time.perf_counter() - t
        assert out.shape[1] == a.prompt_len + n
        if r > 0:
            times.append(dt)
    return times


gen = time_generation(a.new_tokens)
pre = time_generation(1)

model.train()
ids = torch.tensor([[((i * a.seq_len + j) * 2654435761 % 2**32 >> 7) % vocab for j in range(a.seq_len)]
                    for i in range(a.batch)]).to(dev)
t_keep = a.seq_len // 2
fb = []
for r in range(a.reps + 1):
    sync()
    t = time.perf_counter()
    logits = model(input_ids=ids).logits[:, -t_keep - 1:-1, :]
    lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, -t_keep:].unsqueeze(-1)).squeeze(-1)
    (-lp.mean()).backward()
    sync()
    dt = time.perf_counter() - t
    model.zero_grad()
    if r > 0:
        fb.append(dt)

# ModelConfig::matmul_flops: projections per row, the full L x L attention products, the head
# on the scored rows; backward twice the forward.
h = cfg.hidden_size
head_dim = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
q = cfg.num_attention_heads * head_dim
kv = cfg.num_key_value_heads * head_dim
per_row = h * q + 2 * h * kv + q * h + 3 * h * cfg.intermediate_size
rows, pairs, head_rows = a.batch * a.seq_len, a.batch * a.seq_len ** 2, a.batch * t_keep
fwd = (2 * rows * per_row * cfg.num_hidden_layers + 4 * pairs * q * cfg.num_hidden_layers
       + 2 * head_rows * h * vocab)
fb_gflop = 3 * fwd / 1e9

n = 1024 if dev.type == "cpu" else 8192
x = torch.randn(n, n, device=dev).to(dtype)
y = torch.randn(n, n, device=dev).to(dtype)
x @ y
sync()
best = float("inf")
for _ in range(20):
    t = time.perf_counter()
    x @ y
    sync()
    best = min(best, time.perf_counter() - t)
mm = 2 * n ** 3 / best / 1e9

g = statistics.median(gen)
pf = statistics.median(pre)
f = statistics.median(fb)
batch = prompts.shape[0]
print(json.dumps({"impl": "torch", "torch": torch.__version__, "device": a.device, "dtype": a.dtype,
                  "threads": torch.get_num_threads(),
                  "generate_s_median": g, "generate_s_all": gen,
                  "generate_tokens_per_s": batch * a.new_tokens / g,
                  "prefill_s_median": pf, "prefill_tokens_per_s": batch * a.prompt_len / pf,
                  "decode_ms_per_step": (g - pf) / (a.new_tokens - 1) * 1e3,
                  "fwd_bwd_s_median": f, "fwd_bwd_s_all": fb,
                  "fwd_bwd_gflop": fb_gflop, "fwd_bwd_gflop_per_s": fb_gflop / f,
                  "fwd_bwd_tflop_per_s": fb_gflop / f / 1e3,
                  "matmul_gflop_per_s": mm, "fwd_bwd_matmul_fraction": fb_gflop / f / mm}))
