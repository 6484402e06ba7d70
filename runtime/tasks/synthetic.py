"""The "arith-chain" task: a verifiable prompt whose answer length has a long tail.

A prompt `n%d=` asks for n mod d by repeated subtraction. The response writes every
intermediate value, zero-padded to three digits, each followed by `-d` while d still fits,
then the final answer:

    prompt   "23%7="
    response "016-7 009-7 002 #### 2"   (then EOS)

Repeating the divisor keeps every operand of a step at a fixed distance behind it, so each
step is a local, digit-wise computation a tiny model learns in a few hundred updates; with the
divisor only in the prompt it would first have to learn to find it there, which took a tiny
model thousands of updates.

The number of steps k = n // d is drawn from a truncated power law P(k) ∝ k^-alpha on
1..max_steps, so most responses are short (~10-40 tokens) and a few are long (~180 tokens):
exactly the tail that stalls a synchronous rollout. Errors compound per step, so long chains
are also the hard ones. Every problem is a pure function of (seed, index).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from itertools import accumulate

TASK_NAME = "arith-chain"
ANSWER_MARKER = "####"


@dataclass(frozen=True)
class Problem:
    """One prompt with its reference answer and the full reference response (no EOS)."""

    index: int
    prompt: str
    answer: str
    solution: str
    steps: int


@dataclass(frozen=True)
class ArithChainTask:
    """Deterministic generator of arith-chain problems."""

    seed: int = 0
    max_steps: int = 30
    alpha: float = 1.0
    min_divisor: int = 2
    max_divisor: int = 9

    def __post_init__(self) -> None:
        if self.max_steps < 1 or not 2 <= self.min_divisor <= self.max_divisor:
            raise ValueError("arith-chain needs max_steps >= 1 and 2 <= min_divisor <= max_divisor")
        if self.max_steps * self.max_divisor + self.max_divisor - 1 > 999:
            raise ValueError("arith-chain values must fit in three digits; lower max_steps")

    def _step_weights(self) -> list[float]:
        return list(accumulate(k ** -self.alpha for k in range(1, self.max_steps + 1)))

    def problem(self, index: int) -> Problem:
        """The problem at position index of this task's infinite deterministic sequence."""
        rng = random.Random(self.seed * 1_000_003 + index)
        steps = rng.choices(range(1, self.max_steps + 1), cum_weights=self._step_weights())[0]
        divisor = rng.randint(self.min_divisor, self.max_divisor)
        remainder = rng.randrange(divisor)
        n = steps * divisor + remainder
        return Problem(
            index=index,
            prompt=f"{n}%{divisor}=",
            answer=str(remainder),
            solution=solve(n, divisor),
            steps=steps,
        )

    def problems(self, count: int, start: int = 0) -> list[Problem]:
        """Problems start..start+count-1."""
        return [self.problem(i) for i in range(start, start + count)]


def solve(n: int, divisor: int) -> str:
    """The reference response for `n%divisor=`: the subtraction chain, then `#### remainder`."""
    values = list(range(n - divisor, -1, -divisor))
    chain = " ".join(f"{v:03d}-{divisor}" if v >= divisor else f"{v:03d}" for v in values)
    answer = f"{ANSWER_MARKER} {n % divisor}"
    return f"{chain} {answer}" if chain else answer
