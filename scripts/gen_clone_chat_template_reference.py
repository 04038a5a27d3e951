#!/usr/bin/env python3
"""Reference values for `model.chat_template_path` given a model directory (TRL's
`clone_chat_template`), from transformers' tokenizers (no torch needed).

    python3 -m venv ~/trl-venv && ~/trl-venv/bin/pip install transformers tokenizers jinja2
    ~/trl-venv/bin/python scripts/gen_clone_chat_template_reference.py

Writes, under grpo-rollout/tests/fixtures/:
  * clone-source/: a tokenizer (bench-qwen2-micro's vocabulary) whose chat template ends turns
    with a token `<|eot|>` the target lacks, and which adds `<think>`, `</think>` (not special)
    and `<|tool_call|>` (special) beside tokens the target has.
  * clone_chat_template_reference.json: what TRL 1.16's `clone_chat_template(model,
    tokenizer, "clone-source")` does to bench-qwen2-micro's tokenizer, step by step as its
    code does it (the model half, `resize_token_embeddings(len(vocab), pad_to_multiple_of=64)`,
    is only the size here): the ids of the added tokens, the EOS, the vocabulary and embedding
    size, the `<extra_id_N>` fillers, and a conversation rendered and tokenised with the
    cloned template.
"""
import json
import os
import shutil

from tokenizers import AddedToken
from transformers import AutoTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "..", "grpo-rollout", "tests", "fixtures")
TARGET = os.path.join(FIX, "bench-qwen2-micro")
SOURCE = os.path.join(FIX, "clone-source")

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
    "<think>\n</think>\n{% endif %}{{ m['content'] }}<|eot|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_source():
    os.makedirs(SOURCE, exist_ok=True)
    with open(os.path.join(TARGET, "tokenizer.json")) as f:
        tj = json.load(f)
    new = [("<think>", False), ("</think>", False), ("<|tool_call|>", True), ("<|eot|>", True)]
    next_id = max(a["id"] for a in tj["added_tokens"]) + len(tj["model"]["vocab"]) + 5
    for i, (content, special) in enumerate(new):
        tj["added_tokens"].append(
            {
                "id": next_id + i,
                "content": content,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": not special,
                "special": special,
            }
        )
    with open(os.path.join(SOURCE, "tokenizer.json"), "w") as f:
        json.dump(tj, f, ensure_ascii=False)
    with open(os.path.join(TARGET, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    cfg["eos_token"] = "<|eot|>"
    cfg["chat_template"] = TEMPLATE
    with open(os.path.join(SOURCE, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)
    # transformers 5 reads a directory's chat_template.jinja before tokenizer_config.json's.
    with open(os.path.join(SOURCE, "chat_template.jinja"), "w") as f:
        f.write(TEMPLATE)


def main():
    write_source()
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    source = AutoTokenizer.from_pretrained(SOURCE)
    # TRL 1.16 chat_template_utils.clone_chat_template, tokenizer half:
    tokenizer.chat_template = source.get_chat_template()
    added_tokens = [t for t in source.added_tokens_decoder.values() if t.content not in tokenizer.vocab]
    tokenizer.add_tokens(added_tokens)
    tokenizer.eos_token = source.eos_token
    multiple = 64
    embedding = (len(tokenizer.vocab) + multiple - 1) // multiple * multiple
    idx = 0
    while embedding > len(tokenizer.vocab):
        dummy = AddedToken(f"<extra_id_{idx}>")
        if tokenizer.add_tokens(dummy) == 1:
            added_tokens.append(dummy)
        idx += 1
    assert len(tokenizer.vocab) == embedding
    added_ids = tokenizer.convert_tokens_to_ids([t.content for t in added_tokens])
    messages = [
        {"role": "user", "content": "hi <|tool_call|> there"},
        {"role": "assistant", "content": "hello"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    special = {t.content: t.special for t in tokenizer.added_tokens_decoder.values()}
    ref = {
        "added_ids": added_ids,
        "added_contents": [t.content for t in added_tokens],
        "special": {c: special[c] for c in ["<think>", "</think>", "<|tool_call|>", "<|eot|>"]},
        "eos_token": tokenizer.eos_token,
        "eos_token_id": tokenizer.eos_token_id,
        "vocab_size": len(tokenizer.vocab),
        "embedding_rows": embedding,
        "text": text,
        "ids": ids,
        "decoded_skip_special": tokenizer.decode(ids, skip_special_tokens=True),
    }
    with open(os.path.join(FIX, "clone_chat_template_reference.json"), "w") as f:
        json.dump(ref, f, indent=1, ensure_ascii=False)
    print(json.dumps(ref, ensure_ascii=False))


if __name__ == "__main__":
    main()
