#!/usr/bin/env python3
"""Reference scores of TRL's reward functions (`trl.rewards`, trl 1.16) for the built-ins
`think_format`, `repetition_penalty`, `cosine_scaled` and `reasoning_accuracy`.

Writes tests/tests/data/trl_rewards_reference.json: random and hand-made completions with what
TRL's own `think_format_reward`, `get_repetition_penalty_reward`, `get_cosine_scaled_reward`
and `reasoning_accuracy_reward` return for them. The correctness cases use `\\boxed{}`
integer answers, where TRL's math_verify and grpo-rewards' accuracy comparison agree, so the
comparison checks the schedules, the delimiters and the formats themselves.

    pip install trl==1.16.0 math-verify
    python3 scripts/gen_trl_rewards_reference.py
"""
import json
import pathlib
import random

from trl.rewards import (
    get_cosine_scaled_reward,
    get_repetition_penalty_reward,
    reasoning_accuracy_reward,
    think_format_reward,
)

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests/tests/data/trl_rewards_reference.json"


def msg(text):
    return [{"role": "assistant", "content": text}]


def main():
    rng = random.Random(0)
    pieces = ["<think>", "</think>", "a", "\n", " ", "answer", "<think", "think>", "</think", "x\ny"]
    think = [
        "<think>\nThis is my reasoning.\n</think>\nThis is my answer.",
        "<think>\nThis is my reasoning.\nThis is my answer.",
        "<think></think>",
        " <think>r</think>a",
        "<think>r</think>a<think>b</think>",
        "<think>r<think></think>",
        "<think>r</think></think>",
        "",
        "</think>",
    ]
    for _ in range(300):
        think.append("".join(rng.choice(pieces) for _ in range(rng.randint(0, 6))))
    think_scores = think_format_reward([msg(t) for t in think])

    repetition = []
    for _ in range(300):
        n = rng.randint(1, 4)
        penalty = rng.choice([-1.0, -0.5, -0.25, 0.0])
        ids = [rng.randint(1, rng.randint(1, 6)) for _ in range(rng.randint(0, 20))]
        score = get_repetition_penalty_reward(ngram_size=n, max_penalty=penalty)([ids])[0]
        repetition.append({"ids": ids, "ngram_size": n, "max_penalty": penalty, "score": score})

    cosine = []
    for _ in range(200):
        max_len = rng.randint(1, 40)
        values = {
            "min_value_wrong": rng.choice([-1.0, -0.8]),
            "max_value_wrong": rng.choice([-0.5, -0.2]),
            "min_value_correct": rng.choice([0.5, 0.3]),
            "max_value_correct": rng.choice([1.0, 2.0]),
        }
        answer = rng.randint(0, 20)
        said = answer if rng.random() < 0.5 else answer + rng.randint(1, 3)
        text = rng.choice(["", "So ", "The answer is "]) + "\\boxed{%d}" % said
        length = rng.randint(0, 2 * max_len)
        f = get_cosine_scaled_reward(max_len=max_len, **values)
        score = f([msg(text)], [str(answer)], [[1] * length])[0]
        cosine.append({"max_len": max_len, **values, "completion": text, "solution": str(answer),
                       "length": length, "score": score})

    reasoning = []
    delimiter_sets = [None, ["</think>"], ["</reasoning>", "</think>"], ["END"]]
    for _ in range(200):
        answer = rng.randint(0, 20)
        inner = rng.choice(["", "partial \\boxed{%d} " % answer, "hmm \\boxed{%d} " % (answer + 1)])
        end = rng.choice(["</think>", "</reasoning>", "END", ""])
        tail = rng.choice(["\\boxed{%d}" % answer, "\\boxed{%d}" % (answer + 2), "no answer", ""])
        text = "<think>" + inner + end + " The final answer is " + tail
        if rng.random() < 0.3:
            text += " </think> \\boxed{%d}" % rng.choice([answer, answer + 1])
        delimiters = rng.choice(delimiter_sets)
        score = reasoning_accuracy_reward([msg(text)], [str(answer)], reasoning_delimiters=delimiters)[0]
        reasoning.append({"completion": text, "solution": str(answer),
                          "reasoning_delimiters": delimiters or ["</think>"], "score": score})

    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "think_format": [{"completion": t, "score": s} for t, s in zip(think, think_scores)],
        "repetition_penalty": repetition,
        "cosine_scaled": cosine,
        "reasoning_accuracy": reasoning,
    }, indent=0) + "\n")
    print("wrote", OUT)


if __name__ == "__main__":
    main()
