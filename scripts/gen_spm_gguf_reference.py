#!/usr/bin/env python3
"""A SentencePiece-vocabulary GGUF (as llama.cpp writes Llama 2 / Mistral / TinyLlama files) and
llama.cpp's own tokenisation of it, for grpo-rollout/tests/it/gguf_spm.rs.

Trains a small SentencePiece BPE model (byte fallback, `[INST]` / `[/INST]` as control tokens)
on the repository's README, writes it with a one-layer random llama model as
grpo-rollout/tests/fixtures/spm-llama-micro.gguf (`tokenizer.ggml.model = llama`: tokens,
scores, token types; BOS added), then records, for a list of texts, the ids llama.cpp gives
(`Llama(vocab_only=True).tokenize(text, add_bos=True, special=True)`), the text it decodes
them back to, and the log-probs llama.cpp's model gives a completion (f32 KV cache).

    python3 scripts/gen_spm_gguf_reference.py grpo-rollout/tests/fixtures

Needs `pip install sentencepiece gguf numpy llama-cpp-python` (llama-cpp-python builds llama.cpp).
"""
import io
import json
import os
import sys

import numpy as np
import sentencepiece as spm
from gguf import GGUFWriter, GGMLQuantizationType
from gguf.constants import TokenType

HERE = os.path.dirname(os.path.abspath(__file__))

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  two leading spaces and   three inside",
    "line one\nline two\n\nafter a blank line",
    "naïve café — 中文 ☃ 🙂",
    "[INST] What is 2 + 2? [/INST] Four.",
    "<s>[INST] hi [/INST]",
    "grpo-cli train --config configs/demo.toml",
    "12345 67890",
    "",
]
PROMPT = "[INST] What does the GRPO trainer do? [/INST]"
COMPLETION = " It samples a group of completions per prompt and learns from their rewards."


def train_spm():
    with open(os.path.join(HERE, "..", "README.md"), encoding="utf-8") as f:
        lines = [l for l in f.read().split("\n") if l.strip()]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, model_type="bpe", vocab_size=900,
        byte_fallback=True, character_coverage=0.9995, control_symbols=["[INST]", "[/INST]"],
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def write_gguf(sp, path):
    n = sp.get_piece_size()
    tokens, scores, types = [], [], []
    for i in range(n):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            types.append(TokenType.UNKNOWN)
        elif sp.is_control(i):
            types.append(TokenType.CONTROL)
        elif sp.is_byte(i):
            types.append(TokenType.BYTE)
        elif sp.is_unused(i):
            types.append(TokenType.UNUSED)
        else:
            types.append(TokenType.NORMAL)
    w = GGUFWriter(path, "llama")
    hidden, heads, kv, inter = 32, 4, 2, 64
    w.add_name("spm-llama-micro")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(1)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(hidden // heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(0)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
    rng = np.random.default_rng(0)
    d = hidden // heads

    def t(name, shape, std=0.2):
        w.add_tensor(name, (rng.standard_normal(shape) * std).astype(np.float32))

    t("token_embd.weight", (n, hidden), 0.5)
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    t("output.weight", (n, hidden), 0.5)
    w.add_tensor("blk.0.attn_norm.weight", np.ones(hidden, dtype=np.float32))
    t("blk.0.attn_q.weight", (heads * d, hidden), 0.5)
    t("blk.0.attn_k.weight", (kv * d, hidden), 0.5)
    t("blk.0.attn_v.weight", (kv * d, hidden))
    t("blk.0.attn_output.weight", (hidden, heads * d))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
    t("blk.0.ffn_gate.weight", (inter, hidden))
    t("blk.0.ffn_up.weight", (inter, hidden))
    t("blk.0.ffn_down.weight", (hidden, inter))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    fixtures = sys.argv[1]
    path = os.path.join(fixtures, "spm-llama-micro.gguf")
    sp = train_spm()
    write_gguf(sp, path)
    from llama_cpp import Llama
    vocab = Llama(model_path=path, vocab_only=True, verbose=False)
    cases = []
    for text in TEXTS:
        ids = vocab.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        back = vocab.detokenize(ids[1:]).decode("utf-8", errors="replace")
        cases.append({"text": text, "ids": ids, "decoded": back})
    m = Llama(model_path=path, n_ctx=256, logits_all=True, verbose=False, n_threads=2,
              type_k=0, type_v=0)  # f32 KV cache
    p = m.tokenize(PROMPT.encode(), add_bos=True, special=True)
    c = m.tokenize(COMPLETION.encode(), add_bos=False, special=False)
    # llama.cpp tokenises the completion alone as a fresh text (its leading space kept).
    m.reset()
    m.eval(p + c)
    logits = np.array(m.scores[: len(p) + len(c)], dtype=np.float64)
    logits -= logits.max(-1, keepdims=True)
    lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    lps = [float(lp[len(p) - 1 + i, tok]) for i, tok in enumerate(c)]
    out = {"llama_cpp": __import__("llama_cpp").__version__, "texts": cases,
           "prompt": PROMPT, "completion": COMPLETION, "prompt_ids": p, "completion_ids": c,
           "logprobs": lps}
    with open(os.path.join(fixtures, "spm_gguf_reference.json"), "w") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)


if __name__ == "__main__":
    main()
