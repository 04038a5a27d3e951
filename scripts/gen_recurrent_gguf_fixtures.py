#!/usr/bin/env python3
"""llama.cpp's own GGUF files of the recurrent micro models, for grpo-rollout/tests/it/qwen3_5.rs
and grpo-rollout/tests/it/lfm2.rs.

Runs llama.cpp's `convert_hf_to_gguf.py` (from a llama.cpp checkout, `--llama-cpp DIR`) on
fixtures/qwen3_5-micro and fixtures/qwen3_5_moe-micro (made by gen_qwen3_5_reference.py and
gen_qwen3_5_moe_reference.py; `--no-mtp`: they have no next-token-prediction layer) and
fixtures/lfm2-plain-micro (gen_lfm2_reference.py) and writes `{name}-llama.gguf` (f32) beside
each. The micro models' tokenizer is a plain byte-level BPE, whose hash llama.cpp's converter
does not know: its pre-tokenizer is named `gpt-2` here, the rest of the conversion as llama.cpp
runs it.

    python3 scripts/gen_recurrent_gguf_fixtures.py --llama-cpp /path/to/llama.cpp grpo-rollout/tests/fixtures

Needs torch, transformers 5, and the llama.cpp checkout's Python requirements (its gguf-py).
"""
import argparse, os

from reference_common import llama_cpp_converter

ap = argparse.ArgumentParser()
ap.add_argument("--llama-cpp", required=True)
ap.add_argument("fixtures")
a = ap.parse_args()
convert = llama_cpp_converter(a.llama_cpp)
for name, flags in [("qwen3_5-micro", ["--no-mtp"]), ("qwen3_5_moe-micro", ["--no-mtp"]), ("lfm2-plain-micro", [])]:
    convert(os.path.join(a.fixtures, name), os.path.join(a.fixtures, f"{name}-llama.gguf"), *flags)
