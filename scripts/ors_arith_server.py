"""A real Open Reward Standard server (the `openreward` SDK's `Server`) with four small
environments, for `scripts/check_ors.sh`: the same tasks, prompts, tools and rewards as the
loopback server of `tests/tests/it/ors_environment.rs`, so that test's assertions run against the
SDK's own server too.

  arith       tasks {a, b}; tools `add` (x + y as text), `submit` (reward 1 when the answer is
              a + b else 0, finished), `boom` (raises); score_group: 1 for a candidate whose
              last assistant text holds a + b, else 0
  arithfinal  the same tasks; tool `add`; a @terminal tool `answer` that grades a plain answer
              (1 when its last integer is a + b, else 0)
  chat        arithfinal whose prompt is a conversation (get_messages: system, user, an
              assistant turn with reasoning and a tool call, a user turn with its result)
  draw        arithfinal whose prompt starts with the session's draw number (the draw
              sessions opened before it, plus one): every session a prompt of its own

Run: python scripts/ors_arith_server.py PORT   (needs `pip install openreward`)
     python scripts/ors_arith_server.py PORT --tasks 500 --seed 1 --max 9
         (a train split of 500 random additions of numbers in 1..max instead of the tests' six tasks)
"""

import argparse
import random
import re

from pydantic import BaseModel

from openreward.environments import (
    Environment,
    Message,
    ReasoningBlock,
    Server,
    TextBlock,
    ToolCallBlock,
    ToolOutput,
    ToolResultBlock,
    terminal,
    tool,
)


TASKS = {
    "train": [{"a": 2 + i, "b": 3 * i + 1, "level": "easy" if i < 3 else "hard"} for i in range(6)],
    "test": [{"a": 40, "b": 2, "level": "easy"}],
}


class AddInput(BaseModel):
    x: int
    y: int


class Answer(BaseModel):
    answer: str


class Additions(Environment):
    """The tasks and the `add` tool the environments share."""

    @classmethod
    def list_splits(cls):
        return list(TASKS)

    @classmethod
    def list_tasks(cls, split):
        return TASKS[split]

    @tool
    def add(self, args: AddInput) -> ToolOutput:
        """Adds two integers."""
        return ToolOutput(blocks=[TextBlock(text=str(args.x + args.y))])


class Arith(Additions):
    def __init__(self, task_spec={}, secrets={}):
        super().__init__(task_spec, secrets)
        self.secret = secrets.get("token")

    def get_prompt(self):
        a, b = self.task_spec["a"], self.task_spec["b"]
        text = f"What is {a} + {b}? Use the `add` tool, then give the result to `submit`."
        if self.secret:
            text += f" (token {self.secret})"
        return [TextBlock(text=text)]

    @tool
    def submit(self, args: Answer) -> ToolOutput:
        """Submits the final answer."""
        right = args.answer.strip() == str(self.task_spec["a"] + self.task_spec["b"])
        return ToolOutput(
            blocks=[TextBlock(text="correct" if right else "wrong")],
            reward=1.0 if right else 0.0,
            finished=True,
        )

    @tool
    def boom(self) -> ToolOutput:
        """Always fails."""
        raise RuntimeError("boom")

    async def score_group(self, candidates):
        want = str(self.task_spec["a"] + self.task_spec["b"])
        scores = []
        for c in candidates:
            texts = [b.text for m in c.messages if m.role == "assistant" for b in m.blocks if b.type == "text"]
            scores.append(1.0 if texts and want in texts[-1] else 0.0)
        return scores


class ArithFinal(Additions):
    def get_prompt(self):
        a, b = self.task_spec["a"], self.task_spec["b"]
        return [TextBlock(text=f"What is {a} + {b}? Answer with the number.")]

    @terminal
    @tool
    def answer(self, args: Answer) -> ToolOutput:
        """Grades the final answer."""
        numbers = re.findall(r"-?\d+", args.answer)
        right = bool(numbers) and numbers[-1] == str(self.task_spec["a"] + self.task_spec["b"])
        return ToolOutput(blocks=[TextBlock(text="graded")], reward=1.0 if right else 0.0, finished=True)


class Draw(ArithFinal):
    draws = 0

    def __init__(self, task_spec={}, secrets={}):
        super().__init__(task_spec, secrets)
        Draw.draws += 1
        self.draw = Draw.draws

    def get_prompt(self):
        a, b = self.task_spec["a"], self.task_spec["b"]
        return [TextBlock(text=f"Draw {self.draw}: what is {a} + {b}? Answer with the number.")]


class Chat(ArithFinal):
    def get_messages(self):
        a, b = self.task_spec["a"], self.task_spec["b"]
        return [
            Message(role="system", blocks=[TextBlock(text="You add numbers.")]),
            Message(role="user", blocks=[TextBlock(text=f"a = {a}, b = {b}.")]),
            Message(
                role="assistant",
                blocks=[
                    ReasoningBlock(text="easy"),
                    TextBlock(text="Let me add."),
                    ToolCallBlock(id="c1", name="add", input={"x": a, "y": b}),
                ],
            ),
            Message(
                role="user",
                blocks=[
                    ToolResultBlock(tool_call_id="c1", blocks=[TextBlock(text=str(a + b))]),
                    TextBlock(text="What is a + b?"),
                ],
            ),
        ]

    def get_prompt(self):
        from openreward.environments.utils import flatten_messages

        return flatten_messages(self.get_messages())


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("port", type=int)
    ap.add_argument("--tasks", type=int, default=0, help="random additions in train")
    ap.add_argument("--max", type=int, default=99, help="the largest operand")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.tasks:
        rng = random.Random(args.seed)
        TASKS["train"] = [
            {"a": rng.randint(1, args.max), "b": rng.randint(1, args.max), "level": "random"}
            for _ in range(args.tasks)
        ]
    Server([Arith, ArithFinal, Chat, Draw]).run(host="127.0.0.1", port=args.port)
