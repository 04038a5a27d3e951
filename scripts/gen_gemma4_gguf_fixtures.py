#!/usr/bin/env python3
"""llama.cpp's own GGUF files of the Gemma 4 micro models, for grpo-rollout/tests/it/gemma4.rs.

Runs llama.cpp's `convert_hf_to_gguf.py` (from a llama.cpp checkout, `--llama-cpp DIR`) on
fixtures/gemma4-micro and fixtures/gemma4-moe-micro (made by gen_gemma4_reference.py) and writes
fixtures/gemma4-micro-llama.gguf and fixtures/gemma4-moe-micro-llama.gguf (f32). The micro
models' tokenizer is a byte-level BPE, which llama.cpp's Gemma 4 converter does not read (it
expects Gemma's own vocabulary): its vocabulary step is the generic `gpt2` one here, the rest
of the conversion as llama.cpp runs it.

    python3 scripts/gen_gemma4_gguf_fixtures.py --llama-cpp /path/to/llama.cpp grpo-rollout/tests/fixtures

Needs torch, transformers 5, and the llama.cpp checkout's Python requirements (its gguf-py).
"""
import argparse, os

from reference_common import llama_cpp_converter

ap = argparse.ArgumentParser()
ap.add_argument("--llama-cpp", required=True)
ap.add_argument("fixtures")
a = ap.parse_args()
convert = llama_cpp_converter(a.llama_cpp)
import conversion.gemma as gemma  # noqa: E402 (importable once the converter is set up)

gemma.Gemma4Model.set_vocab = lambda self: self._set_vocab_gpt2()
for name in ("gemma4-micro", "gemma4-moe-micro"):
    convert(os.path.join(a.fixtures, name), os.path.join(a.fixtures, f"{name}-llama.gguf"))
