#!/usr/bin/env python3
"""The TRL side of `scripts/bench-trainers-vs-trl.sh`: seconds per optimizer step of TRL 1.16's
SFTTrainer, DPOTrainer, RewardTrainer or experimental ORPOTrainer / CPOTrainer on a model directory, over the rows that
`--write-data` writes (the same file `grpo-cli` reads).

    python bench/trl_trainers_bench.py MODEL_DIR sft|dpo|reward|orpo|cpo DATA.jsonl [--steps N] [--batch B]
    python bench/trl_trainers_bench.py --write-data OUT_DIR [--rows N]

Prints one JSON line: {"trainer", "steps", "s_per_step_median", "s_per_step_all"}. The first step
(allocations, compilation of nothing) is excluded from the median. CPU, float32, eager attention,
AdamW at 1e-5, no checkpointing.
"""
import argparse
import json
import os
import statistics
import time

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]


def write_data(out_dir, rows):
    os.makedirs(out_dir, exist_ok=True)
    sft, pairs = [], []
    for i in range(rows):
        a, b = WORDS[i % 12], WORDS[(i * 5) % 12]
        prompt = f"Write about {a} and {b} number {i}:"
        good = " " + " ".join(WORDS[(i + k) % 12] for k in range(24)) + "."
        bad = " " + " ".join(WORDS[(i * 7 + k) % 12] for k in range(20)) + "!"
        sft.append({"prompt": prompt, "completion": good})
        pairs.append({"prompt": prompt, "chosen": good, "rejected": bad})
    for name, data in [("sft.jsonl", sft), ("pairs.jsonl", pairs)]:
        with open(os.path.join(out_dir, name), "w") as f:
            for r in data:
                f.write(json.dumps(r) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?")
    ap.add_argument("trainer", nargs="?", choices=["sft", "dpo", "reward", "orpo", "cpo"])
    ap.add_argument("data", nargs="?")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--write-data")
    ap.add_argument("--rows", type=int, default=64)
    a = ap.parse_args()
    if a.write_data:
        write_data(a.write_data, a.rows)
        return

    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(a.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    data = load_dataset("json", data_files=a.data, split="train")
    common = dict(
        output_dir="/tmp/trl-trainers-bench",
        per_device_train_batch_size=a.batch,
        max_steps=a.steps,
        learning_rate=1e-5,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        seed=0,
        gradient_checkpointing=False,
    )
    if a.trainer == "reward":
        model = AutoModelForSequenceClassification.from_pretrained(a.model, num_labels=1, dtype=torch.float32, attn_implementation="eager")
        model.config.pad_token_id = tok.pad_token_id
        trainer = RewardTrainer(model=model, args=RewardConfig(**common), train_dataset=data, processing_class=tok)
    else:
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32, attn_implementation="eager")
        if a.trainer == "sft":
            trainer = SFTTrainer(model=model, args=SFTConfig(**common), train_dataset=data, processing_class=tok)
        elif a.trainer == "orpo":
            from trl.experimental.orpo import ORPOConfig, ORPOTrainer

            trainer = ORPOTrainer(model=model, args=ORPOConfig(**common), train_dataset=data, processing_class=tok)
        elif a.trainer == "cpo":
            from trl.experimental.cpo import CPOConfig, CPOTrainer

            trainer = CPOTrainer(model=model, args=CPOConfig(**common), train_dataset=data, processing_class=tok)
        else:
            trainer = DPOTrainer(model=model, args=DPOConfig(**common), train_dataset=data, processing_class=tok)

    times = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t)

    trainer.add_callback(Clock())
    trainer.train()
    print(json.dumps({
        "trainer": a.trainer,
        "steps": len(times),
        "s_per_step_median": statistics.median(times[1:] or times),
        "s_per_step_all": times,
    }))


if __name__ == "__main__":
    main()
