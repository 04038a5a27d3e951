"""A real Open Reward Standard server (the `openreward` SDK's `Server`) with two small
environments, for `scripts/check_ors.sh`: the same tasks, prompts, tools and rewards as the
loopback server of `tests/tests/ors_environment.rs`, so that test's assertions run against the
SDK's own server too.

  arith       tasks {a, b}; tools `add` (x + y as text), `submit` (reward 1 when the answer is
              a + b else 0, finished), `boom` (raises); score_group: 1 for a candidate whose
              last assistant text holds a + b, else 0
  arithfinal  the same tasks; tool `add`; a @terminal tool `answer` that grades a plain answer

Run: python scripts/ors_arith_server.py PORT   (needs `pip install openreward`)
"""

import sys

from pydantic import BaseModel

from openreward.environments import Environment, Server, TextBlock, ToolOutput, terminal, tool


TASKS = {
    "train": [{"a": 2 + i, "b": 3 * i + 1, "level": "easy" if i < 3 else "hard"} for i in range(6)],
    "test": [{"a": 40, "b": 2, "level": "easy"}],
}


class AddInput(BaseModel):
    x: int
    y: int


class Answer(BaseModel):
    answer: str


class Arith(Environment):
    def __init__(self, task_spec={}, secrets={}):
        super().__init__(task_spec, secrets)
        self.secret = secrets.get("token")

    @classmethod
    def list_splits(cls):
        return list(TASKS)

    @classmethod
    def list_tasks(cls, split):
        return TASKS[split]

    def get_prompt(self):
        a, b = self.task_spec["a"], self.task_spec["b"]
        text = f"What is {a} + {b}? Use the `add` tool, then give the result to `submit`."
        if self.secret:
            text += f" (token {self.secret})"
        return [TextBlock(text=text)]

    @tool
    def add(self, args: AddInput) -> ToolOutput:
        """Adds two integers."""
        return ToolOutput(blocks=[TextBlock(text=str(args.x + args.y))])

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


class ArithFinal(Environment):
    @classmethod
    def list_splits(cls):
        return list(TASKS)

    @classmethod
    def list_tasks(cls, split):
        return TASKS[split]

    def get_prompt(self):
        a, b = self.task_spec["a"], self.task_spec["b"]
        return [TextBlock(text=f"What is {a} + {b}? Answer with the number.")]

    @tool
    def add(self, args: AddInput) -> ToolOutput:
        """Adds two integers."""
        return ToolOutput(blocks=[TextBlock(text=str(args.x + args.y))])

    @terminal
    @tool
    def answer(self, args: Answer) -> ToolOutput:
        """Grades the final answer."""
        right = args.answer.strip() == str(self.task_spec["a"] + self.task_spec["b"])
        return ToolOutput(blocks=[TextBlock(text="graded")], reward=1.0 if right else 0.0, finished=True)


if __name__ == "__main__":
    Server([Arith, ArithFinal]).run(host="127.0.0.1", port=int(sys.argv[1]))
