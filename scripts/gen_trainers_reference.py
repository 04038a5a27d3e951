#!/usr/bin/env python3
"""Reference values from TRL 1.16, transformers and PEFT themselves: three steps of TRL's
SFTTrainer (prompt/completion rows, conversations, assistant_only_loss), DPOTrainer, KTOTrainer,
RewardTrainer and the experimental ORPOTrainer, CPOTrainer and TPOTrainer
(grpo-cli/tests/it/trl_trainers.rs), the DistillationTrainer's divergence
(grpo-rollout/tests/it/distill.rs) and PEFT adapters with trainable tokens, also of a resized
vocabulary (grpo-rollout/tests/it/trainable_tokens.rs).

    python3 -m venv ~/trl-venv
    ~/trl-venv/bin/pip install torch trl==1.16.0 peft accelerate datasets
    ~/trl-venv/bin/python scripts/gen_trainers_reference.py            # everything
    ~/trl-venv/bin/python scripts/gen_trainers_reference.py orpo_cpo   # ORPO and CPO only
    ~/trl-venv/bin/python scripts/gen_trainers_reference.py sft        # the three SFT runs only
    ~/trl-venv/bin/python scripts/gen_trainers_reference.py dpo        # the DPO run only
    ~/trl-venv/bin/python scripts/gen_trainers_reference.py kto        # the KTO run only

Writes, under grpo-rollout/tests/fixtures/:
  * micro-teacher/: a second random Qwen2ForCausalLM with bench-qwen2-micro's config and
    tokenizer (seed 11), the teacher of the distillation reference.
  * peft-trainable-tokens/: a PEFT LoRA adapter (q_proj, v_proj, r 2) with
    `trainable_token_indices = [3, 7]` on bench-qwen2-micro, its factors and token rows set to
    seeded random values.
  * reward_pairs.jsonl, sft_rows.jsonl, sft_chat.jsonl, kto_rows.jsonl, pairs_chat.jsonl,
    pairs_merge.jsonl, triples.jsonl: the rows.
  * trainers_reference.json (also "sft", "sft_chat", "sft_assistant_only", "dpo", "kto", "orpo",
    "orpo_chat", "orpo_bos_merge", "cpo", "cpo_simpo", "cpo_alphapo", "tpo", "tpo_l": each
    step's metrics as TRL logs them, same settings as "reward"):
    - "reward": TRL's RewardTrainer on tiny-qwen2-rm (a Qwen2ForSequenceClassification,
      pad_token_id 0) over reward_pairs.jsonl (4 pairs, one batch per step, AdamW lr 1e-3
      constant, max_grad_norm 1, 3 steps): each step's loss, accuracy, margin, min/mean/max
      reward, num_tokens and grad_norm as TRL logs them;
    - "distill": TRL's `_chunked_divergence_loss` (the DistillationTrainer's loss) between
      bench-qwen2-micro (student) and micro-teacher on fixed rows (left-padded prompts, right
      padded completions), for several beta and temperatures: the mean divergence over the
      completion tokens and the student's mean entropy;
    - "peft": the adapted model's logits (PEFT, eager attention) on fixed rows, and after
      `merge_and_unload`.
"""
import json
import os
import shutil

import torch
from datasets import Dataset
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer
from trl.trainer.distillation_trainer import _chunked_divergence_loss

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "..", "grpo-rollout", "tests", "fixtures")
LM = os.path.join(FIX, "bench-qwen2-micro")
RM = os.path.join(FIX, "tiny-qwen2-rm")
TEACHER = os.path.join(FIX, "micro-teacher")
ADAPTER = os.path.join(FIX, "peft-trainable-tokens")

PAIRS = [
    {"prompt": "What is 2 + 2?", "chosen": " The answer is 4.", "rejected": " Five.", "margin": 0.5},
    {"prompt": "Name a colour:", "chosen": " blue", "rejected": " a number", "margin": 0.0},
    {"prompt": "Say hi.", "chosen": " Hello there!", "rejected": " no", "margin": 1.0},
    {"prompt": "Count:", "chosen": " one two three", "rejected": " three", "margin": 0.25},
]


def common_args(cls, out_dir, **kw):
    return cls(
        output_dir=out_dir,
        per_device_train_batch_size=4,
        max_steps=3,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        seed=0,
        **kw,
    )


def reward_reference(out_dir):
    with open(os.path.join(FIX, "reward_pairs.jsonl"), "w") as f:
        for p in PAIRS:
            f.write(json.dumps(p) + "\n")
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(RM, dtype=torch.float32, attn_implementation="eager")
    tok = AutoTokenizer.from_pretrained(RM)
    args = common_args(RewardConfig, out_dir)
    trainer = RewardTrainer(model=model, args=args, train_dataset=Dataset.from_list(PAIRS), processing_class=tok)
    trainer.train()
    keys = ["loss", "accuracy", "margin", "min_reward", "mean_reward", "max_reward", "num_tokens", "grad_norm"]
    steps = [{k: float(h[k]) for k in keys if k in h} for h in trainer.state.log_history if "loss" in h]
    return steps


SFT_ROWS = [
    {"prompt": "What is 2 + 2?", "completion": " The answer is 4."},
    {"prompt": "Name a colour:", "completion": " blue"},
    {"prompt": "Say hi.", "completion": " Hello there!"},
    {"prompt": "Count:", "completion": " one two three"},
]


SFT_KEYS = ["loss", "grad_norm", "num_tokens", "entropy", "mean_token_accuracy"]


def sft_reference(out_dir):
    """TRL's SFTTrainer on bench-qwen2-micro over sft_rows.jsonl (prompt/completion, the loss
    on the completion tokens), 3 steps of one batch."""
    with open(os.path.join(FIX, "sft_rows.jsonl"), "w") as f:
        for r in SFT_ROWS:
            f.write(json.dumps(r) + "\n")
    model = AutoModelForCausalLM.from_pretrained(LM, dtype=torch.float32, attn_implementation="eager")
    tok = AutoTokenizer.from_pretrained(LM)
    args = common_args(SFTConfig, out_dir)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(SFT_ROWS), processing_class=tok)
    trainer.train()
    return [{k: float(h[k]) for k in SFT_KEYS if k in h} for h in trainer.state.log_history if "loss" in h]


CHAT_ROWS = [
    {"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]},
    {"messages": [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."},
                  {"role": "user", "content": "Bye."}, {"role": "assistant", "content": "See you."}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Colour?"},
                  {"role": "assistant", "content": "Blue."}]},
    {"messages": [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "one two three"}]},
]


def sft_chat_reference(out_dir):
    """TRL's SFTTrainer on conversations (`messages`, rendered by the chat template, every token
    trained: TRL's default), 3 steps of one batch."""
    with open(os.path.join(FIX, "sft_chat.jsonl"), "w") as f:
        for r in CHAT_ROWS:
            f.write(json.dumps(r) + "\n")
    model = AutoModelForCausalLM.from_pretrained(LM, dtype=torch.float32, attn_implementation="eager")
    tok = AutoTokenizer.from_pretrained(LM)
    args = common_args(SFTConfig, out_dir)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(CHAT_ROWS), processing_class=tok)
    trainer.train()
    return [{k: float(h[k]) for k in SFT_KEYS if k in h} for h in trainer.state.log_history if "loss" in h]


def sft_assistant_only_reference(out_dir):
    """TRL's SFTTrainer on the same conversations with `assistant_only_loss` (the assistant
    tokens marked by the `{% generation %}` blocks of chatml_generation.jinja, given as
    `chat_template_path`), 3 steps of one batch."""
    model = AutoModelForCausalLM.from_pretrained(LM, dtype=torch.float32, attn_implementation="eager")
    tok = AutoTokenizer.from_pretrained(LM)
    args = common_args(
        SFTConfig,
        out_dir,
        assistant_only_loss=True,
        chat_template_path=os.path.join(FIX, "chatml_generation.jinja"),
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(CHAT_ROWS), processing_class=tok)
    trainer.train()
    return [{k: float(h[k]) for k in SFT_KEYS if k in h} for h in trainer.state.log_history if "loss" in h]


def dpo_reference(out_dir):
    """TRL's DPOTrainer (sigmoid, beta 0.1) on bench-qwen2-micro over reward_pairs.jsonl's
    prompt/chosen/rejected, the reference a frozen copy, 3 steps of one batch."""
    rows = [{k: p[k] for k in ["prompt", "chosen", "rejected"]} for p in PAIRS]
    model = AutoModelForCausalLM.from_pretrained(LM, dtype=torch.float32, attn_implementation="eager")
    tok = AutoTokenizer.from_pretrained(LM)
    args = common_args(DPOConfig, out_dir, beta=0.1)
    trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)
    trainer.train()
    keys = ["loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
            "logps/chosen", "logps/rejected", "entropy", "logits/chosen", "logits/rejected", "mean_token_accuracy"]
    return [{k: float(h[k]) for k in keys if k in h} for h in trainer.state.log_history if "loss" in h]


PAIR_KEYS = [
    "loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
    "logps/chosen", "logps/rejected", "nll_loss",
]


def pair_reference(out_dir, trainer_cls, config_cls, rows, keys, bos=None, **kw):
    """TRL's experimental ORPOTrainer or CPOTrainer on bench-qwen2-micro (no reference model),
    3 steps of one batch with `common_args`; `bos`: the tokenizer's BOS token."""
    model = AutoModelForCausalLM.from_pretrained(LM, dtype=torch.float32, attn_implementation="eager")
    tok = AutoTokenizer.from_pretrained(LM)
    if bos is not None:
        tok.bos_token = bos
    args = common_args(config_cls, out_dir, **kw)
    trainer = trainer_cls(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)
    trainer.train()
    return [{k: float(h[k]) for k in keys if k in h} for h in trainer.state.log_history if "loss" in h]


def orpo_cpo_references():
    """ORPO (beta 0.1) and CPO (sigmoid; simpo with the BC term; alphapo) on reward_pairs.jsonl's
    prompt/chosen/rejected, and ORPO on sft_chat-style conversations (pairs_chat.jsonl)."""
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    rows = [{k: p[k] for k in ["prompt", "chosen", "rejected"]} for p in PAIRS]
    with open(os.path.join(FIX, "pairs_chat.jsonl"), "w") as f:
        for r in PAIRS_CHAT:
            f.write(json.dumps(r) + "\n")
    orpo_keys = PAIR_KEYS + ["log_odds_ratio", "log_odds_chosen"]
    with open(os.path.join(FIX, "pairs_merge.jsonl"), "w") as f:
        for r in PAIRS_MERGE:
            f.write(json.dumps(r) + "\n")
    # The merge rows really exercise TRL's "last prompt token merged" rule.
    tok = AutoTokenizer.from_pretrained(LM)
    p, a = PAIRS_MERGE[0]["prompt"], PAIRS_MERGE[0]["chosen"]
    ids = tok(p, add_special_tokens=False)["input_ids"]
    assert tok(p + a, add_special_tokens=False)["input_ids"][: len(ids)] != ids
    return {
        "orpo_bos_merge": pair_reference(
            "/tmp/trl-orpo-bos-ref", ORPOTrainer, ORPOConfig, PAIRS_MERGE, orpo_keys,
            bos="<|im_start|>", beta=0.1, max_length=14,
        ),
        "orpo": pair_reference("/tmp/trl-orpo-ref", ORPOTrainer, ORPOConfig, rows, orpo_keys, beta=0.1),
        "orpo_chat": pair_reference("/tmp/trl-orpo-chat-ref", ORPOTrainer, ORPOConfig, PAIRS_CHAT, orpo_keys, beta=0.25),
        "cpo": pair_reference("/tmp/trl-cpo-ref", CPOTrainer, CPOConfig, rows, PAIR_KEYS, beta=0.1),
        "cpo_simpo": pair_reference(
            "/tmp/trl-cpo-simpo-ref", CPOTrainer, CPOConfig, rows, PAIR_KEYS,
            loss_type="simpo", beta=2.0, simpo_gamma=0.5, cpo_alpha=0.5,
        ),
        "cpo_alphapo": pair_reference(
            "/tmp/trl-cpo-alphapo-ref", CPOTrainer, CPOConfig, rows, PAIR_KEYS,
            loss_type="alphapo", beta=2.5, alpha=0.25,
        ),
        **tpo_references(),
    }


TRIPLES = [
    {"prompt": "What is 2 + 2?", "chosen": " The answer is 4.", "rejected": " Five.", "reference": " 4, since 2 + 2 = 4."},
    {"prompt": "Name a colour:", "chosen": " blue", "rejected": " a number", "reference": " Blue."},
    {"prompt": "Say hi.", "chosen": " Hello there!", "rejected": " no", "reference": " Hi!"},
    {"prompt": "Count:", "chosen": " one two three", "rejected": " three", "reference": " one, two, three"},
]


def tpo_references():
    """TRL's experimental TPOTrainer on triples.jsonl (prompt, chosen, rejected, reference): the
    sigmoid loss with the gold NLL (beta 0.1), and TPO-L with label smoothing (beta 2,
    tpo_l_gamma 0.5, tpo_alpha 0.5)."""
    from trl.experimental.tpo import TPOConfig, TPOTrainer

    with open(os.path.join(FIX, "triples.jsonl"), "w") as f:
        for r in TRIPLES:
            f.write(json.dumps(r) + "\n")
    keys = ["loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected"]
    return {
        "tpo": pair_reference("/tmp/trl-tpo-ref", TPOTrainer, TPOConfig, TRIPLES, keys, beta=0.1),
        "tpo_l": pair_reference(
            "/tmp/trl-tpo-l-ref", TPOTrainer, TPOConfig, TRIPLES, keys,
            loss_type="tpo-l", beta=2.0, tpo_l_gamma=0.5, tpo_alpha=0.5, label_smoothing=0.1,
        ),
    }


# Prompts whose last token merges into the chosen completion ("s" + "e" -> "se"), a chosen
# completion that already ends with the EOS text, and sides cut at max_length = 14.
PAIRS_MERGE = [
    {"prompt": "The colour s", "chosen": "e is nice.", "rejected": "o what"},
    {"prompt": "The colour r", "chosen": "ed<|im_end|>", "rejected": "e is red and blue and green"},
    {"prompt": "Say hi.", "chosen": " Hello there!", "rejected": " no"},
    {"prompt": "Count:", "chosen": " one two three", "rejected": " three"},
]


PAIRS_CHAT = [
    {
        "prompt": [{"role": "user", "content": "What is 2 + 2?"}],
        "chosen": [{"role": "assistant", "content": "The answer is 4."}],
        "rejected": [{"role": "assistant", "content": "Five."}],
    },
    {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
        "chosen": [{"role": "assistant", "content": "Blue."}],
        "rejected": [{"role": "assistant", "content": "I cannot say."}],
    },
    {
        "prompt": [{"role": "user", "content": "Say hi."}],
        "chosen": [{"role": "assistant", "content": "Hello there!"}],
        "rejected": [{"role": "assistant", "content": "no"}],
    },
    {
        "prompt": [{"role": "user", "content": "Count to three."}],
        "chosen": [{"role": "assistant", "content": "one two three"}],
        "rejected": [{"role": "assistant", "content": "three"}],
    },
]


KTO_ROWS = [
    {"prompt": "What is 2 + 2?", "completion": " The answer is 4.", "label": True},
    {"prompt": "Name a colour:", "completion": " a number", "label": False},
    {"prompt": "Say hi.", "completion": " Hello there!", "label": True},
    {"prompt": "Count:", "completion": " three", "label": False},
]


def kto_reference(out_dir):
    """TRL's KTOTrainer (kto loss, beta 0.1, its default sequential order: each row's KL
    completion is the row before it's) on bench-qwen2-micro over kto_rows.jsonl, 3 steps of
    one batch."""
    with open(os.path.join(FIX, "kto_rows.jsonl"), "w") as f:
        for r in KTO_ROWS:
            f.write(json.dumps(r) + "\n")
    model = AutoModelForCausalLM.from_pretrained(LM, dtype=torch.float32, attn_implementation="eager")
    tok = AutoTokenizer.from_pretrained(LM)
    args = common_args(KTOConfig, out_dir, beta=0.1)
    trainer = KTOTrainer(model=model, args=args, train_dataset=Dataset.from_list(KTO_ROWS), processing_class=tok)
    trainer.train()
    keys = ["loss", "grad_norm", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
            "logps/rejected", "entropy", "logits/chosen", "logits/rejected"]
    return [{k: float(h[k]) for k in keys if k in h} for h in trainer.state.log_history if "loss" in h]


def distill_reference():
    torch.manual_seed(11)
    cfg = AutoModelForCausalLM.from_pretrained(LM).config
    teacher = AutoModelForCausalLM.from_config(cfg)
    if os.path.exists(TEACHER):
        shutil.rmtree(TEACHER)
    teacher.save_pretrained(TEACHER)
    tok = AutoTokenizer.from_pretrained(LM)
    tok.save_pretrained(TEACHER)
    student = AutoModelForCausalLM.from_pretrained(LM, dtype=torch.float32, attn_implementation="eager")
    teacher = AutoModelForCausalLM.from_pretrained(TEACHER, dtype=torch.float32, attn_implementation="eager")
    rows = [([5, 9, 12], [33, 7, 2]), ([8, 3, 20, 11, 44], [40, 12])]
    p = max(len(a) for a, _ in rows)
    c = max(len(b) for _, b in rows)
    ids, att, cmask = [], [], []
    for a, b in rows:
        ids.append([0] * (p - len(a)) + a + b + [0] * (c - len(b)))
        att.append([0] * (p - len(a)) + [1] * (len(a) + len(b)) + [0] * (c - len(b)))
        cmask.append([1] * len(b) + [0] * (c - len(b)))
    ids, att, cmask = torch.tensor(ids), torch.tensor(att), torch.tensor(cmask)

    def hidden(m):
        out = m.model(input_ids=ids, attention_mask=att)
        return out.last_hidden_state[:, p - 1 : p + c - 1, :]

    cases = []
    for beta, t in [(0.0, 1.0), (1.0, 1.0), (0.5, 1.0), (0.25, 0.7)]:
        with torch.no_grad():
            loss, ent, n = _chunked_divergence_loss(
                hidden(student),
                hidden(teacher),
                student.lm_head.weight,
                teacher.lm_head.weight,
                cmask,
                beta,
                temperature=t,
            )
        cases.append({"beta": beta, "temperature": t, "loss": float(loss), "entropy": float(ent / n)})
    return {"rows": [[a, b] for a, b in rows], "cases": cases}


def peft_reference():
    torch.manual_seed(5)
    base = AutoModelForCausalLM.from_pretrained(LM, dtype=torch.float32, attn_implementation="eager")
    cfg = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], trainable_token_indices=[3, 7])
    model = get_peft_model(base, cfg)
    with torch.no_grad():
        for n, prm in model.named_parameters():
            if prm.requires_grad:
                prm.copy_(torch.randn_like(prm) * 0.3)
    if os.path.exists(ADAPTER):
        shutil.rmtree(ADAPTER)
    model.save_pretrained(ADAPTER)
    # Keep the fixture small and free of this machine's paths.
    os.remove(os.path.join(ADAPTER, "README.md"))
    cfg_path = os.path.join(ADAPTER, "adapter_config.json")
    with open(cfg_path) as f:
        adapter_cfg = json.load(f)
    adapter_cfg["base_model_name_or_path"] = "bench-qwen2-micro"
    with open(cfg_path, "w") as f:
        json.dump(adapter_cfg, f, indent=2)
    rows = [[5, 3, 12, 40, 11], [7, 9, 2, 3, 1]]
    ids = torch.tensor(rows)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    base2 = AutoModelForCausalLM.from_pretrained(LM, dtype=torch.float32, attn_implementation="eager")
    merged = PeftModel.from_pretrained(base2, ADAPTER).merge_and_unload()
    with torch.no_grad():
        merged_logits = merged(input_ids=ids).logits
    # A vocabulary resized to 320 before the adapter (TRL's clone_chat_template with LoRA): PEFT
    # saves the resized embedding (and the tied head's copies) with the adapter.
    torch.manual_seed(6)
    base3 = AutoModelForCausalLM.from_pretrained(LM, dtype=torch.float32, attn_implementation="eager")
    base3.resize_token_embeddings(320)
    cfg3 = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], trainable_token_indices=[300, 305])
    model3 = get_peft_model(base3, cfg3)
    with torch.no_grad():
        for n, prm in model3.named_parameters():
            if prm.requires_grad:
                prm.copy_(torch.randn_like(prm) * 0.3)
    resized = ADAPTER + "-resized"
    if os.path.exists(resized):
        shutil.rmtree(resized)
    model3.save_pretrained(resized)
    os.remove(os.path.join(resized, "README.md"))
    with open(os.path.join(resized, "adapter_config.json")) as f:
        c3 = json.load(f)
    c3["base_model_name_or_path"] = "bench-qwen2-micro"
    with open(os.path.join(resized, "adapter_config.json"), "w") as f:
        json.dump(c3, f, indent=2)
    rows3 = [[5, 300, 12, 305, 11], [319, 9, 2, 3, 1]]
    model3.eval()
    with torch.no_grad():
        logits3 = model3(input_ids=torch.tensor(rows3)).logits
    return {
        "rows": rows,
        "logits": logits.tolist(),
        "merged_logits": merged_logits.tolist(),
        "resized_rows": rows3,
        "resized_logits": logits3.tolist(),
    }


def main():
    import sys

    path = os.path.join(FIX, "trainers_reference.json")
    # Runs that can be regenerated alone, merged into the existing file.
    parts = {
        "sft": lambda: {
            "sft": sft_reference("/tmp/trl-sft-ref"),
            "sft_chat": sft_chat_reference("/tmp/trl-sft-chat-ref"),
            "sft_assistant_only": sft_assistant_only_reference("/tmp/trl-sft-ao-ref"),
        },
        "dpo": lambda: {"dpo": dpo_reference("/tmp/trl-dpo-ref")},
        "kto": lambda: {"kto": kto_reference("/tmp/trl-kto-ref")},
        "orpo_cpo": orpo_cpo_references,
    }
    if sys.argv[1:]:
        if len(sys.argv) != 2 or sys.argv[1] not in parts:
            sys.exit(f"usage: gen_trainers_reference.py [{' | '.join(parts)}]")
        with open(path) as f:
            out = json.load(f)
        new = parts[sys.argv[1]]()
        out.update(new)
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        print(json.dumps(new, indent=1))
        return
    out = {
        "reward": reward_reference("/tmp/trl-reward-ref"),
        "sft": sft_reference("/tmp/trl-sft-ref"),
        "sft_chat": sft_chat_reference("/tmp/trl-sft-chat-ref"),
        "sft_assistant_only": sft_assistant_only_reference("/tmp/trl-sft-ao-ref"),
        "dpo": dpo_reference("/tmp/trl-dpo-ref"),
        "kto": kto_reference("/tmp/trl-kto-ref"),
        **orpo_cpo_references(),
        "distill": distill_reference(),
        "peft": peft_reference(),
        "versions": {
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "trl": __import__("trl").__version__,
            "peft": __import__("peft").__version__,
        },
    }
    with open(os.path.join(FIX, "trainers_reference.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: out[k] for k in ["reward", "sft", "sft_chat", "sft_assistant_only", "dpo", "kto", "versions"]}, indent=1))
    print(json.dumps(out["distill"]["cases"]))


if __name__ == "__main__":
    main()
