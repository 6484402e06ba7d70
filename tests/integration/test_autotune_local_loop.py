"""The local autotuner closing the loop on the real rollout scheduler (embedded engine, tiny random model).

This is the plant the operator's autotuner controls, without Prometheus or a cluster: the segment
cap starts far too small, so the threshold cuts most samples; the tuner must bring the truncation
rate into the band within a bounded number of rounds, moving one bounded step at a time. Over-sampling
is pinned (its bounds are one value) so the goodput search does not move it here.

The per-round rate of this small plant is bimodal: a round that fills from resumed partials cuts
nothing (their remaining tails fit the cap), the next one cuts a third. Which rounds do depends on the
machine's speed (when the round's last group lands), so the law judges each setting on at least three
rounds (`settleRounds`), as a job should on a noisy signal; with one round it chased the noise under
load (clean-clone run 21). Settling is judged on the mean of six rounds.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from rljob.api.spec import RLJobSpec
from rljob.runtime.engines.base import WeightUpdate
from rljob.runtime.engines.embedded import EmbeddedEngine
from rljob.runtime.knob_sources import LocalAutotuner
from rljob.runtime.knobs import apply_knobs, knob_values
from rljob.runtime.step_record import StepRecord
from rljob.runtime.rollout.scheduler import RolloutConfig, RolloutScheduler
from rljob.runtime.rollout.strategy import AprilStrategy
from rljob.runtime.rollout.truncation import TruncationPolicy
from rljob.runtime.step_record import step_record

from tests.helpers.tiny_model import build_tiny_model

CAP = 48
BAND = (0.15, 0.25)
MAX_ROUNDS = 40


@dataclass
class Prompt:
    index: int
    text: str
    answer: str
    prompt_ids: list[int]


class Prompts:
    """Fresh prompts of three tokens (the tiny model's vocabulary)."""

    def __init__(self) -> None:
        self.served = 0

    def next_prompt(self) -> Prompt:
        self.served += 1
        i = self.served
        return Prompt(index=i, text=f"p{i}", answer="0", prompt_ids=[10 + i % 50, 20 + i % 7, 30])


@pytest.fixture
async def engine() -> AsyncIterator[EmbeddedEngine]:
    e = EmbeddedEngine(build_tiny_model(seed=1), max_batch_size=64, seed=0)
    await e.start()
    yield e
    await e.close()


def spec() -> RLJobSpec:
    return RLJobSpec.model_validate(
        {
            "model": {"builtin": "tiny-arith"},
            "data": {"synthetic": {}},
            "rollout": {"maxResponseLength": CAP, "partial": {"overSampling": 1.5,
                                                            "truncation": {"mode": "tokens", "maxTokens": 2}}},
            "autotune": {"mode": "Apply", "local": True, "intervalSeconds": 1, "windowSeconds": 60,
                         "cooldownSeconds": 0, "settleRounds": 3, "hysteresis": 0.02,
                         "truncationBand": {"low": BAND[0], "high": BAND[1]},
                         "truncationTokens": {"min": 2, "max": CAP, "maxStep": 6},
                         "overSampling": {"min": 1.5, "max": 1.5, "maxStep": 0.25}},
        }
    )


async def test_local_autotuner_brings_truncation_into_band(engine: EmbeddedEngine) -> None:
    job = spec()
    scheduler = RolloutScheduler(
        [engine],
        RolloutConfig(batch_size=6, samples_per_prompt=4, max_response_length=CAP, temperature=1.0,
                      # A large staleness bound keeps the cap floor (48 / 25 -> 2 tokens) out of the way.
                      max_staleness=24, stop_token_ids=list(range(8))),
        AprilStrategy(over_sampling=job.rollout.partial.over_sampling),
        Prompts(),
        score=lambda s: 0.0,
        truncation=TruncationPolicy(mode="tokens", max_tokens=job.rollout.partial.truncation.max_tokens),
    )
    clock = {"t": 0.0}
    tuner = LocalAutotuner(job, clock=lambda: clock["t"])
    records: list[StepRecord] = []
    caps: list[float] = []
    for version in range(MAX_ROUNDS):
        values = tuner.poll()
        if values is not None:
            apply_knobs(scheduler, values)
        knobs = knob_values(scheduler)
        caps.append(knobs["segment_cap_tokens"])
        await engine.update_weights(WeightUpdate(version=version, module=engine.model))
        result = await scheduler.run_round(version)
        rec = step_record(version + 1, version, result, None, {"rollout": result.stats.rollout_seconds}, knobs, 0.0, None)
        records.append(rec)
        tuner.observe(rec)
        clock["t"] += 5.0
        # Settled: six rounds on the same knobs whose mean rate is in the band (±0.05 of round noise).
        last = records[-6:]
        mean = sum(r.round.truncation_rate for r in last) / len(last)
        if len(last) == 6 and all(r.knobs == rec.knobs for r in last) and BAND[0] - 0.05 <= mean <= BAND[1] + 0.05:
            break
    rates = [round(r.round.truncation_rate, 2) for r in records]
    assert records[0].round.truncation_rate > BAND[1] + 0.1, f"must start above the band: {rates}"
    assert len(records) < MAX_ROUNDS, f"did not settle in the band within {MAX_ROUNDS} rounds: rates {rates}, caps {caps}"
    # Every change was one bounded step, and the knobs each round ran with are those in the record.
    steps = [b - a for a, b in itertools.pairwise(caps) if b != a]
    assert steps and all(0 < abs(s) <= 6 for s in steps), steps
    assert all(r.knobs["segment_cap_tokens"] == c for r, c in zip(records, caps))
