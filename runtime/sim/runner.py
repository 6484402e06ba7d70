"""Runs one scenario's strategies on virtual time: the runtime's RolloutScheduler drives simulated
engines; training and weight sync are timed by the calibration.

Three loop shapes:
- rounds (sync, APRIL, async, large-N, draft reuse): `RolloutScheduler.run_round` → train → sync
  weights, as the runtime's JobRunner does; under `async` (the runtime's AsyncStrategy) the engines
  keep generating while the trainer trains (`generate_during`) on GPUs of its own;
- tail batching: as rounds, but a short round's aborted groups become prompts of a later long round;
- bounded staleness (AReaL): no rounds; async_stream.py streams groups on the rollout GPUs while a
  trainer on its own GPUs trains, weight updates interrupt requests that resume at once, and η
  bounds how far generation may run ahead of the trainer.

With `dynamic_sampling` the reward model (reward_model.py) scores every sample and the DAPO
filter drops groups whose rewards all agree, so baselines refill as slime's do.

A run's build is sim/build.py, its records and result summary sim/records.py; the streaming shape's
loop lives in async_stream.py.
"""

from __future__ import annotations

import asyncio
import bisect
import math
import random
from collections import deque
from statistics import NormalDist

from rljob.runtime.rollout.sample import Group
from rljob.runtime.rollout.scheduler import PromptSource, RoundResult
from rljob.runtime.sim.async_stream import run_stream
from rljob.runtime.sim.build import SimRun, build_run
from rljob.runtime.sim.length_model import LengthModel, SimPrompt, SimPromptSource
from rljob.runtime.sim.records import SimStepRecord, SimStrategyResult
from rljob.runtime.sim.scenario import (
    BoundedStalenessSpec,
    Scenario,
    StrategySpec,
    TailBatchingSpec,
)
from rljob.runtime.sim.strategies import TailBatchingStrategy
from rljob.runtime.sim.virtual_loop import run_virtual


def tail_statistics(finished: list[tuple[float, int]], start: float, end: float) -> tuple[float, float]:
    """(share of [start, end] after 90 % of the finished requests were done, longest ÷ median length)."""
    if not finished or end <= start:
        return 0.0, 0.0
    times = sorted(t for t, _ in finished)
    lengths = sorted(n for _, n in finished)
    t90 = times[max(0, math.ceil(0.9 * len(times)) - 1)]
    median = lengths[len(lengths) // 2]
    return (end - t90) / (end - start), (lengths[-1] / median if median else 0.0)


def _draft_units(sim: SimRun) -> int:
    return sum(e.counters.draft_units for e in sim.engines)


async def _run_round(sim: SimRun, version: int) -> tuple[RoundResult, int, float, float]:
    """One scheduler round: the result, accepted draft units, tail share, longest ÷ median."""
    sim.finished.clear()
    drafts = _draft_units(sim)
    start = asyncio.get_running_loop().time()
    result = await sim.scheduler.run_round(version)
    tail, spread = tail_statistics(sim.finished, start, start + result.stats.rollout_seconds)
    return result, _draft_units(sim) - drafts, tail, spread


def _record(sim: SimRun, step: int, kind: str, result: RoundResult, trainer_version: int,
            train_s: float, sync_s: float, step_s: float, wasted: int = 0, drafts: int = 0,
            tail: tuple[float, float] = (0.0, 0.0)) -> SimStepRecord:
    q = sim.q
    trained = sum(s.response_length for g in result.groups for s in g.samples)
    # A sample's versions never decrease (segments are appended in time order): bisect, don't scan.
    off = sum(bisect.bisect_left(s.versions, trainer_version) for g in result.groups for s in g.samples)
    st = result.stats
    # Accepted draft tokens came back as output tokens but were verified, not generated.
    generated = st.tokens_generated - drafts
    return SimStepRecord(
        step=step, round_kind=kind, rollout_s=st.generating_seconds, train_s=train_s, sync_s=sync_s, step_s=step_s,
        tokens_generated=generated * q, trained_tokens=trained * q, off_policy_tokens=off * q,
        fork_off_policy_ratio=st.fork_off_policy_ratio, resumed_prefix_tokens=st.resumed_prefix_tokens * q,
        wasted_tokens=(st.filtered_tokens + st.regenerated_tokens + st.discarded_tokens + wasted) * q,
        buffered_groups=st.buffered_groups, draft_tokens=drafts * q, discarded_tokens=st.discarded_tokens * q,
        dropped_groups=st.filtered_groups, trained_groups=len(result.groups),
        distinct_prompts=len({g.prompt_index for g in result.groups}), tail_share=tail[0],
        longest_over_median=tail[1],
        max_staleness=max((s.staleness(trainer_version) for g in result.groups for s in g.samples), default=0),
        buffer_tokens=st.buffer_tokens_after * q, overlap_tokens=st.overlap_tokens * q,
        multi_version_samples=sum(1 for g in result.groups for s in g.samples if s.versions and
                                  s.versions[0] != s.versions[-1]),
    )


async def _train_and_sync(sim: SimRun, groups: list[Group], version: int) -> tuple[float, float]:
    train_s = sim.train_seconds(groups)
    await asyncio.sleep(train_s)
    return train_s, await sim.sync_weights(version + 1)


async def _rounds_loop(sim: SimRun) -> None:
    """Round, train, sync, as the runtime's JobRunner steps: under a strategy that overlaps training
    (async) `generate_during` keeps the engines generating while the trainer trains and interrupts
    them when it is done, so the weight sync lands on idle engines (runtime/runner.py)."""
    loop = asyncio.get_running_loop()
    for step in range(sim.scenario.steps):
        result, drafts, tail, spread = await _run_round(sim, step)
        train_s = sim.train_seconds(result.groups)
        t0 = loop.time()
        await sim.scheduler.generate_during(asyncio.sleep(train_s))
        train_wall = loop.time() - t0  # train_s, plus the abort and drain of an async overlap
        sync_s = await sim.sync_weights(step + 1)
        step_s = result.stats.rollout_seconds + train_wall + sync_s
        sim.records.append(_record(sim, step, "round", result, step, train_s, sync_s, step_s,
                                   drafts=drafts, tail=(tail, spread)))


class _ListSource:
    """Serves deferred long prompts to a long round; once they run out (the DAPO filter rejected
    some and the round needs replacements), fresh prompts from `fallback`."""

    def __init__(self, prompts: deque[SimPrompt], fallback: PromptSource):
        self.prompts = prompts
        self.fallback = fallback

    def next_prompt(self) -> SimPrompt:
        return self.prompts.popleft() if self.prompts else self.fallback.next_prompt()  # type: ignore[return-value]


class _PredictingSource:
    """RollPacker's length prediction: prompts predicted long skip the short rounds."""

    def __init__(self, base: SimPromptSource, lengths: LengthModel, noise: float, share: float,
                 long_prompts: deque[SimPrompt], seed: int):
        self.base, self.lengths, self.noise, self.long_prompts = base, lengths, noise, long_prompts
        spread = math.hypot(lengths.law.sigma_between, noise)
        self.threshold = spread * NormalDist().inv_cdf(1.0 - share) if share > 0 else math.inf
        self.rng = random.Random(seed)

    def next_prompt(self) -> SimPrompt:
        while True:
            prompt = self.base.next_prompt()
            score = self.lengths.difficulty(prompt.prompt_ids[0]) + self.rng.gauss(0.0, self.noise)
            if score <= self.threshold:
                return prompt
            self.long_prompts.append(prompt)


async def _tail_batching_loop(sim: SimRun) -> None:
    spec = sim.spec
    assert isinstance(spec, TailBatchingSpec)
    scheduler = sim.scheduler
    strategy = scheduler.strategy
    assert isinstance(strategy, TailBatchingStrategy)
    long_prompts: deque[SimPrompt] = deque()
    short_source = scheduler.prompts
    if spec.predictor_noise is not None:
        oracle = sim.engines[0].oracle
        short_source = _PredictingSource(scheduler.prompts, oracle.lengths, spec.predictor_noise,  # type: ignore[arg-type]
                                         spec.predicted_long_share, long_prompts, sim.scenario.seed)
    batch = scheduler.config.batch_size
    for step in range(sim.scenario.steps):
        strategy.long_round = len(long_prompts) >= batch
        scheduler.prompts = _ListSource(long_prompts, short_source) if strategy.long_round else short_source
        result, drafts, tail, spread = await _run_round(sim, step)
        wasted = 0
        while (group := scheduler.buffer.pop_oldest()) is not None:  # deferred, restarted on-policy later
            wasted += sum(s.response_length for s in group.samples)
            long_prompts.append(SimPrompt(index=group.prompt_index, text=group.prompt_text, answer="",
                                          prompt_ids=list(group.samples[0].prompt_ids)))
        train_s, sync_s = await _train_and_sync(sim, result.groups, step)
        step_s = result.stats.rollout_seconds + train_s + sync_s
        kind = "long" if strategy.long_round else "short"
        sim.records.append(_record(sim, step, kind, result, step, train_s, sync_s, step_s, wasted,
                                   drafts=drafts, tail=(tail, spread)))


async def _simulate(scenario: Scenario, spec: StrategySpec) -> SimStrategyResult:
    sim = build_run(scenario, spec)
    if isinstance(spec, TailBatchingSpec):
        await _tail_batching_loop(sim)
    elif isinstance(spec, BoundedStalenessSpec):
        await run_stream(sim)
    else:
        await _rounds_loop(sim)
    counters = [e.counters for e in sim.engines]
    q = scenario.token_quantum
    return SimStrategyResult(
        name=spec.name, kind=spec.kind, engines=len(sim.engines), gpus=scenario.gpus, rollout_gpus=sim.rollout_gpus,
        ceiling_tokens_per_s=sim.ceiling, records=sim.records, warmup=scenario.warmup_steps,
        busy_seconds=sum(c.busy_seconds for c in counters), retractions=sum(c.retractions for c in counters),
        prefill_tokens=sum(c.prefill_units for c in counters) * q, draft_tokens=sum(c.draft_units for c in counters) * q,
        overlapped=isinstance(spec, BoundedStalenessSpec), resumed_requests=sim.stream_resumed,
    )


def simulate_strategy(scenario: Scenario, spec: StrategySpec) -> SimStrategyResult:
    """Simulate one strategy of `scenario` on a fresh virtual-time loop."""
    result, _ = run_virtual(_simulate(scenario, spec))
    return result


def simulate(scenario: Scenario) -> list[SimStrategyResult]:
    """Simulate every strategy of `scenario`, in order."""
    return [simulate_strategy(scenario, spec) for spec in scenario.strategies]
