"""A TRL `environment_factory` class that owns its data: each instance draws its own sum at
`reset`, so the run needs no dataset (configs/quiz.toml)."""

import random


class Quiz:
    # One seeded stream for every instance: a run draws the same tasks each time.
    _rng = random.Random(0)

    def reset(self, **kwargs):
        self.a, self.b = Quiz._rng.randint(1, 9), Quiz._rng.randint(1, 9)
        self.said = None
        return f"What is {self.a} + {self.b}? Answer with `answer`."

    def answer(self, value: int) -> str:
        """Answers the question.

        Args:
            value: the sum
        """
        self.said = value
        return "right" if value == self.a + self.b else "wrong"

    def get_reward(self) -> float:
        return 1.0 if self.said == self.a + self.b else 0.0
