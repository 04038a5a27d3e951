#!/usr/bin/env python3
"""Reference values from transformers for grpo-rollout's scoring models (feature `rewards`).

    ~/trl-venv/bin/python scripts/gen_scoring_reference.py

Writes, under grpo-rollout/tests/fixtures/:
  * scoring_reference.json: for the committed tiny model `bench-qwen2-micro`, the
    `inverse_loss` and `coverage_ce` rewards of a few prompt/completion/answer triples; for the
    two tiny reward models below, their `reward_model` scores.
  * tiny-qwen2-rm/, tiny-llama-rm/: random Qwen2ForSequenceClassification (pad_token_id 0) and
    LlamaForSequenceClassification (pad_token_id None) checkpoints with bench-qwen2-micro's
    tokenizer (≈ 100 KB each). Rerunning with the same seed rewrites the same weights.

Conventions (grpo_rollout::scoring): texts are encoded without special tokens; a pair is the
prompt's ids then the completion's ids. inverse_loss = mean log p(completion | prompt)
(= −mean NLL), 0 for an empty completion; with an empty prompt the first completion token is
the context. coverage_ce = −CE(logits of the completion alone at 0..min_len, answer tokens)
× min(1, n/m), 0 when min_len = 0. reward_model as TRL scores it: prompt + completion,
right-padded, add_special_tokens=False, logits[:, 0] at the last non-pad token
(transformers' rule); with no pad_token_id each text is scored alone (transformers refuses
batches then).
"""
import json
import os
import shutil

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForSequenceClassification,
    Qwen2Config,
    Qwen2ForSequenceClassification,
)

FIX = os.path.join(os.path.dirname(__file__), "..", "grpo-rollout", "tests", "fixtures")
LM = os.path.join(FIX, "bench-qwen2-micro")

TRIPLES = [
    ["What is 2 + 2?", " The answer is 4.", "4"],
    ["Q: name a colour.\nA:", " blue and green", "red"],
    ["Hello", "", "something"],  # empty completion: both rewards 0
    ["Count:", " one", " one two three four five"],  # completion shorter than the answer
    ["", "just a completion here", "just a"],  # empty prompt
    [
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
        "Hello! How can I help?<|im_end|>",
        "Hello! How may I help you today?",
    ],
]

RM_TEXTS = [
    ["What is 2 + 2?", " The answer is 4."],
    ["Tell me a story.", " Once upon a time there was a small model that learned to count."],
    ["Hi", "!"],
    ["Ends with the pad token:", " yes<|endoftext|>"],
    ["", "only a completion"],
]


def ids(tok, text):
    return tok(text, add_special_tokens=False).input_ids


def lm_reference():
    tok = AutoTokenizer.from_pretrained(LM)
    model = AutoModelForCausalLM.from_pretrained(LM, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    rows = []
    for prompt, completion, answer in TRIPLES:
        p, c, a = ids(tok, prompt), ids(tok, completion), ids(tok, answer)
        # inverse_loss
        if len(c) == 0:
            inv = 0.0
        else:
            ctx, scored = (p, c) if p else (c[:1], c[1:])
            seq = torch.tensor([ctx + scored])
            with torch.no_grad():
                logits = model(input_ids=seq).logits[0].double()
            lp = torch.log_softmax(logits[len(ctx) - 1 : -1], -1).gather(-1, torch.tensor(scored)[:, None])
            inv = lp.mean().item()
        # coverage_ce
        m = min(len(c), len(a))
        if m == 0:
            cov = 0.0
        else:
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([c])).logits[0, :m].double()
            ce = -torch.log_softmax(logits, -1).gather(-1, torch.tensor(a[:m])[:, None]).mean().item()
            cov = -ce * min(1.0, len(c) / len(a))
        rows.append(
            {
                "prompt": prompt,
                "completion": completion,
                "answer": answer,
                "prompt_ids": p,
                "completion_ids": c,
                "answer_ids": a,
                "inverse_loss": inv,
                "coverage_ce": cov,
            }
        )
    return rows


def make_rm(name, cls, cfg_cls, pad, seed):
    torch.manual_seed(seed)
    cfg = cfg_cls(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        num_labels=1,
        pad_token_id=pad,
        tie_word_embeddings=False,
    )
    model = cls(cfg)
    with torch.no_grad():
        # Scores of order 1, so that 1e-4 is a meaningful tolerance.
        model.score.weight.normal_(0.0, 1.0)
        for p in model.model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.1)
    model.eval()
    out = os.path.join(FIX, name)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(os.path.join(LM, f), os.path.join(out, f))
    return model, out


def rm_reference(model, out):
    tok = AutoTokenizer.from_pretrained(out)
    texts = [p + c for p, c in RM_TEXTS]
    with torch.no_grad():
        if model.config.pad_token_id is not None:
            inputs = tok(texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
            scores = model(**inputs).logits[:, 0].tolist()
        else:
            scores = [model(input_ids=torch.tensor([ids(tok, t)])).logits[0, 0].item() for t in texts]
    return scores


def main():
    torch.set_num_threads(2)
    ref = {"lm": "bench-qwen2-micro", "triples": lm_reference(), "rm_texts": RM_TEXTS, "reward_models": {}}
    for name, cls, cfg_cls, pad, seed in [
        ("tiny-qwen2-rm", Qwen2ForSequenceClassification, Qwen2Config, 0, 1),
        ("tiny-llama-rm", LlamaForSequenceClassification, LlamaConfig, None, 2),
    ]:
        model, out = make_rm(name, cls, cfg_cls, pad, seed)
        ref["reward_models"][name] = rm_reference(model, out)
    with open(os.path.join(FIX, "scoring_reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
