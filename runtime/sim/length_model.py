"""Response lengths (perf_model.md §2.3) and the simulated prompt stream.

log L = μ(t) + u_j + ε_ij with prompt difficulty u_j ~ N(0, σ_b²), sample noise ε_ij ~ N(0, σ_w²),
a runaway share that runs to the cap, and μ drifting with the policy version t.

A resumed sample is not given a stored length: its remaining length is drawn from the law
conditioned on the tokens it already has (L > already). For a process that decides to abort
independently of a sample's future length this has exactly the distribution of a length drawn once
at the start, and it needs no per-sample state on the engines.

Token counts inside the simulator are in units of `quantum` tokens (a KV page), so the
scheduler's per-token lists stay small; costs are converted back to tokens by the engine.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from statistics import NormalDist

from rljob.runtime.sim.scenario import LengthLaw

_STD_NORMAL = NormalDist()


@dataclass
class LengthModel:
    """Draws total response lengths in tokens for one dataset and response cap."""

    law: LengthLaw
    cap: int
    seed: int = 0
    rng: random.Random = field(init=False)
    _difficulty: dict[int, float] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed * 7919 + 1)

    def difficulty(self, uid: int) -> float:
        """u_j of prompt `uid`: fixed per prompt and seed, so every strategy sees the same prompts."""
        u = self._difficulty.get(uid)
        if u is None:
            u = random.Random(self.seed * 1_000_003 + uid).gauss(0.0, self.law.sigma_between)
            self._difficulty[uid] = u
        return u

    def mu(self, version: int) -> float:
        return math.log(self.law.median_tokens) + self.law.drift_per_100_steps * version / 100.0

    def draw_total(self, uid: int, already: int, version: int) -> int:
        """Total length (tokens) of a response to prompt `uid` that already has `already` tokens."""
        if already >= self.cap:
            return self.cap
        m = self.mu(version) + self.difficulty(uid)
        s = self.law.sigma_within
        if already <= 0:
            survive = 1.0
        elif s == 0.0:  # degenerate law (tests): every response has length exp(m)
            survive = 1.0 if already < math.exp(m) else 0.0
        else:
            survive = 0.5 * math.erfc((math.log(already) - m) / (s * math.sqrt(2.0)))
        p_run = self.law.runaway_share
        denominator = p_run + (1.0 - p_run) * survive
        if denominator <= 0.0:  # far beyond the bulk and no runaway mass: it ends now
            return already + 1
        if self.rng.random() < p_run / denominator:
            return self.cap
        # Inverse-survival sampling of the bulk conditioned on L > already.
        tail = max(survive * (1.0 - self.rng.random()), 1e-300)
        total = math.exp(m - s * _STD_NORMAL.inv_cdf(tail))
        return min(self.cap, max(already + 1, math.ceil(total)))

    def moments(self, n: int = 20_000, prompt_tokens: int = 0) -> tuple[float, float]:
        """Monte-Carlo E[L] and in-flight context p + E[L²]/(2E[L]) (PM §4.1), at version 0."""
        rng_state = self.rng.getstate()
        lengths = [self.draw_total(uid=-1 - (i % 997), already=0, version=0) for i in range(n)]
        self.rng.setstate(rng_state)
        mean = sum(lengths) / n
        second = sum(x * x for x in lengths) / n
        return mean, prompt_tokens + second / (2.0 * mean)


@dataclass
class SimPrompt:
    """A prompt as the scheduler reads it. Token ids are dummies except the first two, which carry
    the prompt's identity to the simulated engines: [uid, epoch, 0, 0, ...]."""

    index: int
    text: str
    answer: str
    prompt_ids: list[int]


@dataclass
class SimPromptSource:
    """The data stream. `dataset_size` makes it finite (epochs repeat prompts: draft reuse);
    `repeat` serves each prompt that many times in a row (large-N groups split into sub-groups)."""

    prompt_units: int
    dataset_size: int | None = None
    repeat: int = 1
    served: int = 0

    def next_prompt(self) -> SimPrompt:
        position = self.served // self.repeat
        self.served += 1
        uid, epoch = (position, 0) if self.dataset_size is None else divmod(position, self.dataset_size)[::-1]
        prompt = SimPrompt(
            index=position, text=f"prompt {uid}", answer="",
            prompt_ids=[uid, epoch] + [0] * max(0, self.prompt_units - 2),
        )
        return prompt


def decode_identity(input_ids: list[int]) -> tuple[int, int]:
    """(uid, epoch) of a simulated request."""
    return input_ids[0], input_ids[1]
