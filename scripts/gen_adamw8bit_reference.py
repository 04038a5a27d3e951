#!/usr/bin/env python3
"""Reference values for `optim = "adamw_8bit"`, computed with bitsandbytes' AdamW (optim_bits
8: what transformers' `optim="adamw_8bit"` builds) on the CPU.

bitsandbytes quantizes differently by device: its CUDA kernel takes the nearest entry of the
code (a binary search) and keeps the first moment's sign; its CPU backend looks values up in a
65,536-bin table, which is coarser near 0 (values below ~1.5e-5 of their block's maximum share
a bin). grpo-rs takes the nearest entry, and a nonzero value keeps its sign and never becomes 0
(`grpo_core::quant::quantize_value`). So that the reference checks bitsandbytes' update and
its state layout rather than the two quantizers' rounding, the CPU backend's blockwise
quantizer is replaced here by that nearest-entry rule (written with torch.searchsorted); the
dequantization, the update and the block maxima are bitsandbytes' own.

Writes grpo-cli/trainer/tests/fixtures/adamw8bit_reference.json: bitsandbytes' two dynamic
maps, and three AdamW steps on a (33, 128) f32 parameter (4,224 values: 8-bit state, 16.5
blocks of 256) and a (10, 30) one (300 values: below bitsandbytes' min_8bit_size of 4,096,
32-bit state) — the parameters after the last step, and the 8-bit state's bytes and block
maxima. Parameters and gradients come from an integer formula that the Rust test repeats
exactly (no transcendental functions, so no libm differences).

    pip install torch bitsandbytes==0.50.2
    python3 scripts/gen_adamw8bit_reference.py   # from the repository root
"""
import json
import pathlib

import bitsandbytes as bnb
import bitsandbytes.backends.cpu.ops as cpu_ops
import bitsandbytes.functional as F
import torch

OUT = pathlib.Path(__file__).resolve().parent.parent / (
    "grpo-cli/trainer/tests/fixtures/adamw8bit_reference.json"
)
LR, BETAS, EPS, WD, STEPS = 1e-3, (0.9, 0.999), 1e-8, 0.01, 3


def initial(n, salt):
    """(i·7919 + salt) mod 2001 − 1000, over 1000: exact in f32 on both sides."""
    return torch.tensor([((i * 7919 + salt) % 2001 - 1000) / 1000.0 for i in range(n)],
                        dtype=torch.float32)


def grad(n, step, salt):
    """Gradients of step `step` (1-based): a spread of magnitudes, a few large ones per block."""
    vals = []
    for i in range(n):
        u = ((i * 104729 + step * 7727 + salt) % 4001 - 2000) / 2000.0
        scale = 10.0 if (i * 31 + step) % 97 == 0 else 0.01 * (1 + (i % 5))
        vals.append(u * scale)
    return torch.tensor(vals, dtype=torch.float32)


def nearest_quantize(a_fp32, code, absmax_out, out_uint8, blocksize):
    """Blockwise: the nearest code entry to each value over its block's maximum (a tie to the
    lower entry), a nonzero value kept nonzero and of its sign."""
    n = a_fp32.numel()
    blocks = -(-n // blocksize)
    flat = torch.cat([a_fp32.reshape(-1).float(), torch.zeros(blocks * blocksize - n)])
    rows = flat.view(blocks, blocksize)
    amax = rows.abs().amax(1)
    inv = 1.0 / torch.clamp(amax, min=torch.finfo(torch.float32).tiny)
    y = rows * inv[:, None]
    lo = torch.searchsorted(code, y.contiguous(), right=False)
    hi = lo.clamp(1, 255)
    idx = torch.where(code[hi] - y < y - code[hi - 1], hi, hi - 1)
    idx = torch.where(lo == 0, torch.zeros_like(idx), idx)
    idx = torch.where(lo == 256, torch.full_like(idx, 255), idx)
    c = code[idx]
    idx = torch.where((y > 0) & (c <= 0), idx + 1, idx)
    idx = torch.where((y < 0) & (c >= 0), idx - 1, idx)
    out_uint8.copy_(idx.reshape(-1)[:n].to(torch.uint8).view_as(out_uint8))
    absmax_out.copy_(amax)


def main():
    cpu_ops._quant_blockwise_fp32_direct = nearest_quantize
    shapes = {"big": ((33, 128), 11), "small": ((10, 30), 23)}
    params = {k: torch.nn.Parameter(initial(s[0] * s[1], salt).reshape(s))
              for k, (s, salt) in shapes.items()}
    opt = bnb.optim.AdamW(list(params.values()), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                          optim_bits=8)
    for step in range(1, STEPS + 1):
        for k, (s, salt) in shapes.items():
            params[k].grad = grad(s[0] * s[1], step, salt).reshape(s)
        opt.step()
    big = opt.state[params["big"]]
    assert big["state1"].dtype == torch.uint8, "the big parameter has 8-bit state"
    assert opt.state[params["small"]]["state1"].dtype == torch.float32
    out = {
        "lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": WD, "steps": STEPS,
        "signed_map": F.create_dynamic_map(signed=True).tolist(),
        "unsigned_map": F.create_dynamic_map(signed=False).tolist(),
        "params": {k: {"shape": list(s), "salt": salt,
                       "final": params[k].detach().flatten().tolist()}
                   for k, (s, salt) in shapes.items()},
        "big_state": {
            "m_codes": big["state1"].flatten().tolist(),
            "v_codes": big["state2"].flatten().tolist(),
            "m_absmax": big["absmax1"].tolist(),
            "v_absmax": big["absmax2"].tolist(),
        },
    }
    OUT.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
