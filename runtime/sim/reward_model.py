"""Simulated rewards: binary correctness per sample, correlated with length, for DAPO filtering.

A prompt's pass rate is q_j = Φ(a + s·(−ρ·u_j/σ_b + √(1−ρ²)·η_j)): prompts the length law makes
longer (difficulty u_j) pass less often, with correlation ρ, and s spreads pass rates across prompts
(s = 0: every prompt passes at the mean rate). `a` is set so that E[q_j] = pass_rate_mean
(E[Φ(a + sZ)] = Φ(a/√(1+s²))).

Within a prompt, a sample of length L is correct with probability (1−λ)·q_j + λ·1[F_j(L) < q_j],
where F_j is the prompt's length CDF: shorter answers are more often right, and the mean stays q_j.
A sample that reached the response cap has no final answer and is wrong.

Everything is a pure function of (seed, prompt, group, sample index, length), so a score does
not depend on the order in which samples finish, and every strategy sees the same rewards.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from statistics import NormalDist

from rljob.runtime.rollout.sample import Sample, SampleStatus
from rljob.runtime.sim.length_model import LengthModel
from rljob.runtime.sim.scenario import RewardLaw

_STD = NormalDist()


@dataclass
class RewardModel:
    """Scores simulated samples (lengths in quanta of `quantum` tokens)."""

    law: RewardLaw
    lengths: LengthModel
    quantum: int
    seed: int = 0
    _pass_rates: dict[int, float] = field(default_factory=dict, init=False, repr=False)

    def pass_rate(self, uid: int) -> float:
        """q_j of prompt `uid` (memoised: a pure function of seed and prompt)."""
        q = self._pass_rates.get(uid)
        if q is None:
            q = self._pass_rates[uid] = self._compute_pass_rate(uid)
        return q

    def _compute_pass_rate(self, uid: int) -> float:
        law, s = self.law, self.law.pass_rate_spread
        p = min(max(law.pass_rate_mean, 1e-9), 1 - 1e-9)
        a = _STD.inv_cdf(p) * math.sqrt(1.0 + s * s)
        sigma_b = self.lengths.law.sigma_between
        u = self.lengths.difficulty(uid) / sigma_b if sigma_b > 0 else 0.0
        rho = law.difficulty_correlation if sigma_b > 0 else 0.0
        eta = _STD.inv_cdf(_uniform(f"pass:{self.seed}:{uid}"))
        return _STD.cdf(a + s * (-rho * u + math.sqrt(1.0 - rho * rho) * eta))

    def length_quantile(self, uid: int, tokens: int, version: int) -> float:
        """F_j(L): where a response of `tokens` tokens falls in its prompt's length law."""
        m = self.lengths.mu(version) + self.lengths.difficulty(uid)
        s = self.lengths.law.sigma_within
        if s <= 0.0:
            return 0.5
        return _STD.cdf((math.log(max(tokens, 1)) - m) / s)

    def score(self, sample: Sample) -> float:
        """1.0 for a correct answer, 0.0 otherwise."""
        tokens = sample.response_length * self.quantum
        if sample.status == SampleStatus.TRUNCATED or tokens >= self.lengths.cap:
            return 0.0
        uid = sample.prompt_ids[0]
        q = self.pass_rate(uid)
        version = sample.versions[-1] if sample.versions else 0
        lam = self.law.length_correlation
        p_correct = (1.0 - lam) * q + lam * (1.0 if self.length_quantile(uid, tokens, version) < q else 0.0)
        draw = _uniform(f"ok:{self.seed}:{sample.group_id}:{sample.index}:{tokens}")
        return 1.0 if draw < p_correct else 0.0


def _uniform(key: str) -> float:
    """A stable uniform in (0, 1) from a key: no RNG object per call, same value in every process."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") + 0.5) / 2**64

