"""Runs one scenario's strategies on virtual time: the runtime's RolloutScheduler drives simulated
engines; training and weight sync are timed by the calibration.

Three loop shapes, all calling the unchanged `RolloutScheduler.run_round`:
- rounds (sync, APRIL, large-N, draft reuse): round → train → sync weights, colocated;
- tail batching: as rounds, but a short round's aborted groups become prompts of a later long round;
- bounded staleness (AReaL): rounds run back to back while a trainer on its own GPUs trains the
  previous batches; each weight update interrupts generation; rounds may run at most `eta`
  versions ahead of the trainer, and the scheduler's staleness bound is `eta`.
"""

from __future__ import annotations

import asyncio
import bisect
import math
import random
from collections import deque
from dataclasses import dataclass, field
from statistics import NormalDist

from rljob.runtime.engines.base import WeightUpdate
from rljob.runtime.rollout.sample import Group
from rljob.runtime.rollout.scheduler import RolloutConfig, RolloutScheduler, RoundResult
from rljob.runtime.rollout.truncation import TruncationPolicy
from rljob.runtime.sim.engine import ResponseOracle, SimEngine
from rljob.runtime.sim.length_model import LengthModel, SimPrompt, SimPromptSource
from rljob.runtime.sim.scenario import (
    AprilSpec,
    BoundedStalenessSpec,
    DraftReuseSpec,
    EngineConstants,
    LargeGroupSpec,
    Scenario,
    StrategySpec,
    TailBatchingSpec,
    engine_constants,
    load_calibration,
    train_seconds,
)
from rljob.runtime.sim.strategies import TailBatchingStrategy, build_strategy
from rljob.runtime.sim.virtual_loop import run_virtual


@dataclass
class StepRecord:
    """One training step of a simulated run (tokens are real tokens, not quanta)."""

    step: int
    round_kind: str
    rollout_s: float
    train_s: float
    sync_s: float
    step_s: float
    tokens_generated: int
    trained_tokens: int
    off_policy_tokens: int
    fork_off_policy_ratio: float
    resumed_prefix_tokens: int
    wasted_tokens: int
    buffered_groups: int


@dataclass
class StrategyResult:
    """A strategy's run on a scenario, with the figures the report prints."""

    name: str
    kind: str
    engines: int
    gpus: int
    rollout_gpus: int
    ceiling_tokens_per_s: float  # bubble-free ceiling of the rollout engines
    records: list[StepRecord]
    warmup: int
    busy_seconds: float = 0.0
    retractions: int = 0
    prefill_tokens: int = 0
    draft_tokens: int = 0
    overlapped: bool = False  # rollout runs during training (async): time is wall time

    @property
    def measured(self) -> list[StepRecord]:
        return self.records[self.warmup:]

    def _sum(self, attr: str) -> float:
        return float(sum(getattr(r, attr) for r in self.measured))

    @property
    def rollout_seconds(self) -> float:
        return self._sum("step_s") if self.overlapped else self._sum("rollout_s")

    @property
    def rollout_throughput(self) -> float:
        """Rollout tokens per second (APRIL's metric: every generated token, aborted calls included)."""
        return self._sum("tokens_generated") / self.rollout_seconds if self.rollout_seconds else 0.0

    @property
    def ceiling_share(self) -> float:
        return self.rollout_throughput / self.ceiling_tokens_per_s if self.ceiling_tokens_per_s else 0.0

    @property
    def bubble_share(self) -> float:
        """Share of the bubble-free ceiling's token rate not achieved during rollout."""
        return max(0.0, 1.0 - self.ceiling_share)

    @property
    def off_policy_share(self) -> float:
        trained = self._sum("trained_tokens")
        return self._sum("off_policy_tokens") / trained if trained else 0.0

    @property
    def step_seconds(self) -> float:
        return self._sum("step_s") / len(self.measured) if self.measured else 0.0

    @property
    def trained_throughput(self) -> float:
        """Trained response tokens per wall-clock second (end to end)."""
        total = self._sum("step_s")
        return self._sum("trained_tokens") / total if total else 0.0

    @property
    def wasted_share(self) -> float:
        generated = self._sum("tokens_generated")
        return self._sum("wasted_tokens") / generated if generated else 0.0

    def summary(self) -> dict[str, float | int | str]:
        return {
            "strategy": self.name, "kind": self.kind, "gpus": self.gpus, "rollout_gpus": self.rollout_gpus,
            "engines": self.engines, "rollout_tokens_per_s": round(self.rollout_throughput, 1),
            "rollout_tokens_per_s_per_gpu": round(self.rollout_throughput / self.rollout_gpus, 1),
            "ceiling_tokens_per_s": round(self.ceiling_tokens_per_s, 1),
            "ceiling_share": round(self.ceiling_share, 4), "bubble_share": round(self.bubble_share, 4),
            "off_policy_share": round(self.off_policy_share, 4),
            "fork_off_policy_ratio": round(sum(r.fork_off_policy_ratio for r in self.measured)
                                           / max(1, len(self.measured)), 4),
            "step_seconds": round(self.step_seconds, 2),
            "trained_tokens_per_s": round(self.trained_throughput, 1),
            "wasted_share": round(self.wasted_share, 4), "kv_retractions": self.retractions,
            "prefill_tokens": self.prefill_tokens, "draft_tokens": self.draft_tokens,
        }


def engine_ceiling(c: EngineConstants, in_flight_context: float, quantum: int = 1) -> float:
    """Bubble-free decode ceiling of one engine, tokens/s (PM §4.1): Θ(B*) = B*/(a + B*·c̄)."""
    del quantum
    b_star = min(c.max_running_requests, c.kv_capacity_tokens / in_flight_context)
    c_bar = c.per_seq_step_s + c.kv_read_s_per_token * in_flight_context
    return b_star / (c.fixed_step_s + b_star * c_bar)


@dataclass
class _Sim:
    """Everything one strategy's run needs, built fresh so runs share no state but the prompts."""

    scenario: Scenario
    spec: StrategySpec
    engines: list[SimEngine]
    scheduler: RolloutScheduler
    rollout_gpus: int
    train_gpus: int
    ceiling: float
    records: list[StepRecord] = field(default_factory=list)

    @property
    def q(self) -> int:
        return self.scenario.token_quantum


def _build(scenario: Scenario, spec: StrategySpec) -> _Sim:
    cal = load_calibration()
    law = cal.datasets[scenario.dataset]
    q = scenario.token_quantum
    consts = engine_constants(scenario)
    lengths = LengthModel(law=law, cap=scenario.max_response_length, seed=scenario.seed)
    _, ctx_ss = lengths.moments(prompt_tokens=law.prompt_tokens)
    prompt_units = max(2, math.ceil(law.prompt_tokens / q))
    oracle = ResponseOracle(lengths=lengths, quantum=q, prompt_units=prompt_units,
                            draft_accept=spec.accepted_prefix if isinstance(spec, DraftReuseSpec) else 0.0)
    k = scenario.tensor_parallel
    rollout_gpus, train_gpus = scenario.gpus, scenario.gpus
    if isinstance(spec, BoundedStalenessSpec):
        train_gpus = max(k, round(scenario.gpus * spec.trainer_gpu_share / k) * k)
        rollout_gpus = scenario.gpus - train_gpus
        if rollout_gpus < k:
            raise ValueError(f"{spec.name}: trainer_gpu_share leaves no GPU for rollout at {scenario.gpus} GPUs")
    n_engines = rollout_gpus // k
    ceiling = engine_ceiling(consts, ctx_ss)
    engines = [SimEngine(f"sim{i}", consts, oracle, ceiling=ceiling) for i in range(n_engines)]

    samples, batch, repeat, dataset_size = scenario.samples_per_prompt, scenario.groups_per_engine * n_engines, 1, None
    if isinstance(spec, LargeGroupSpec):  # N samples of one prompt, split into sub-groups of G
        repeat = max(1, spec.samples_per_prompt // samples)
        prompts = max(1, round(spec.samples_per_round_factor * batch / repeat))
        batch = prompts * repeat
    if isinstance(spec, DraftReuseSpec):
        dataset_size = max(batch, round(scenario.steps * batch / spec.epochs_in_run))
    source = SimPromptSource(prompt_units=prompt_units, dataset_size=dataset_size, repeat=repeat)
    truncation = None
    if isinstance(spec, AprilSpec) and spec.truncation.mode != "none":
        t = spec.truncation
        truncation = TruncationPolicy(mode=t.mode, k=t.k,
                                      max_tokens=None if t.max_tokens is None else max(1, t.max_tokens // q))
    config = RolloutConfig(
        batch_size=batch, samples_per_prompt=samples, max_response_length=math.ceil(scenario.max_response_length / q),
        max_staleness=spec.eta if isinstance(spec, BoundedStalenessSpec) else scenario.max_staleness,
    )
    loop = asyncio.get_running_loop()
    scheduler = RolloutScheduler(engines, config, build_strategy(spec), source, score=lambda s: 0.0,
                                 truncation=truncation, clock=loop.time)
    return _Sim(scenario, spec, engines, scheduler, rollout_gpus, train_gpus, ceiling * n_engines)


def _record(sim: _Sim, step: int, kind: str, result: RoundResult, trainer_version: int,
            train_s: float, sync_s: float, step_s: float, wasted: int = 0) -> StepRecord:
    q = sim.q
    trained = sum(s.response_length for g in result.groups for s in g.samples)
    # A sample's versions never decrease (segments are appended in time order): bisect, don't scan.
    off = sum(bisect.bisect_left(s.versions, trainer_version) for g in result.groups for s in g.samples)
    st = result.stats
    return StepRecord(
        step=step, round_kind=kind, rollout_s=st.rollout_seconds, train_s=train_s, sync_s=sync_s, step_s=step_s,
        tokens_generated=st.tokens_generated * q, trained_tokens=trained * q, off_policy_tokens=off * q,
        fork_off_policy_ratio=st.fork_off_policy_ratio, resumed_prefix_tokens=st.resumed_prefix_tokens * q,
        wasted_tokens=(st.wasted_tokens + st.discarded_stale_tokens + wasted) * q, buffered_groups=st.buffered_groups,
    )


def _batch_tokens(sim: _Sim, groups: list[Group]) -> int:
    return sum(len(s.prompt_ids) + s.response_length for g in groups for s in g.samples) * sim.q


async def _sync_weights(sim: _Sim, version: int) -> float:
    loop = asyncio.get_running_loop()
    t = loop.time()
    await asyncio.gather(*(e.update_weights(WeightUpdate(version=version)) for e in sim.engines))
    return loop.time() - t


async def _train_and_sync(sim: _Sim, groups: list[Group], version: int) -> tuple[float, float]:
    train_s = train_seconds(sim.scenario, _batch_tokens(sim, groups), sim.train_gpus)
    await asyncio.sleep(train_s)
    return train_s, await _sync_weights(sim, version + 1)


async def _rounds_loop(sim: _Sim) -> None:
    for step in range(sim.scenario.steps):
        result = await sim.scheduler.run_round(step)
        train_s, sync_s = await _train_and_sync(sim, result.groups, step)
        step_s = result.stats.rollout_seconds + train_s + sync_s
        sim.records.append(_record(sim, step, "round", result, step, train_s, sync_s, step_s))


class _ListSource:
    """Serves deferred long prompts to a long round."""

    def __init__(self, prompts: deque[SimPrompt]):
        self.prompts = prompts

    def next_prompt(self) -> SimPrompt:
        return self.prompts.popleft()


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


async def _tail_batching_loop(sim: _Sim) -> None:
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
        scheduler.prompts = _ListSource(long_prompts) if strategy.long_round else short_source
        result = await scheduler.run_round(step)
        wasted = 0
        while (group := scheduler.buffer.pop_oldest()) is not None:  # deferred, restarted on-policy later
            wasted += sum(s.response_length for s in group.samples)
            long_prompts.append(SimPrompt(index=group.prompt_index, text=group.prompt_text, answer="",
                                          prompt_ids=list(group.samples[0].prompt_ids)))
        train_s, sync_s = await _train_and_sync(sim, result.groups, step)
        step_s = result.stats.rollout_seconds + train_s + sync_s
        kind = "long" if strategy.long_round else "short"
        sim.records.append(_record(sim, step, kind, result, step, train_s, sync_s, step_s, wasted))


async def _bounded_staleness_loop(sim: _Sim) -> None:
    spec = sim.spec
    assert isinstance(spec, BoundedStalenessSpec)
    loop = asyncio.get_running_loop()
    batches: asyncio.Queue[RoundResult] = asyncio.Queue()
    trained = asyncio.Condition()
    state = {"version": 0}
    steps = sim.scenario.steps

    async def rollout() -> None:
        for produced in range(steps):
            async with trained:  # at most eta versions ahead of the trainer
                await trained.wait_for(lambda: produced - state["version"] <= spec.eta)
            await batches.put(await sim.scheduler.run_round(state["version"]))

    async def trainer() -> None:
        last = loop.time()
        for step in range(steps):
            result = await batches.get()
            version = state["version"]
            train_s = train_seconds(sim.scenario, _batch_tokens(sim, result.groups), sim.train_gpus)
            await asyncio.sleep(train_s)
            sync_s = await _sync_weights(sim, version + 1)
            async with trained:
                state["version"] = version + 1
                trained.notify_all()
            now = loop.time()
            sim.records.append(_record(sim, step, "async", result, version, train_s, sync_s, now - last))
            last = now

    producer = asyncio.ensure_future(rollout())
    await trainer()
    producer.cancel()
    await asyncio.gather(producer, return_exceptions=True)


async def _simulate(scenario: Scenario, spec: StrategySpec) -> StrategyResult:
    sim = _build(scenario, spec)
    if isinstance(spec, TailBatchingSpec):
        await _tail_batching_loop(sim)
    elif isinstance(spec, BoundedStalenessSpec):
        await _bounded_staleness_loop(sim)
    else:
        await _rounds_loop(sim)
    counters = [e.counters for e in sim.engines]
    q = scenario.token_quantum
    return StrategyResult(
        name=spec.name, kind=spec.kind, engines=len(sim.engines), gpus=scenario.gpus, rollout_gpus=sim.rollout_gpus,
        ceiling_tokens_per_s=sim.ceiling, records=sim.records, warmup=scenario.warmup_steps,
        busy_seconds=sum(c.busy_seconds for c in counters), retractions=sum(c.retractions for c in counters),
        prefill_tokens=sum(c.prefill_units for c in counters) * q, draft_tokens=sum(c.draft_units for c in counters) * q,
        overlapped=isinstance(spec, BoundedStalenessSpec),
    )


def simulate_strategy(scenario: Scenario, spec: StrategySpec) -> StrategyResult:
    """Simulate one strategy of `scenario` on a fresh virtual-time loop."""
    result, _ = run_virtual(_simulate(scenario, spec))
    return result


def simulate(scenario: Scenario) -> list[StrategyResult]:
    """Simulate every strategy of `scenario`, in order."""
    return [simulate_strategy(scenario, spec) for spec in scenario.strategies]
