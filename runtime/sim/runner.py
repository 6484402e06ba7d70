"""Runs one scenario's strategies on virtual time: the runtime's RolloutScheduler drives simulated
engines; training and weight sync are timed by the calibration.

Three loop shapes:
- rounds (sync, APRIL, large-N, draft reuse): `RolloutScheduler.run_round` → train → sync
  weights, colocated;
- tail batching: as rounds, but a short round's aborted groups become prompts of a later long round;
- bounded staleness (AReaL): no rounds; async_stream.py streams groups on the rollout GPUs while a
  trainer on its own GPUs trains, weight updates interrupt requests that resume at once, and η
  bounds how far generation may run ahead of the trainer.

With `dynamic_sampling` the reward model (reward_model.py) scores every sample and the DAPO
filter drops groups whose rewards all agree, so baselines refill as slime's do.

Why one module of about 440 lines: the three loop shapes share the scenario's build, its records and
its result summary (SimStrategyResult's dozen derived figures, which the report reads); the streaming
shape's loop itself lives in async_stream.py.
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
from rljob.runtime.rollout.sample import Group, Sample
from rljob.runtime.rollout.scoring import dynamic_sampling_filter
from rljob.runtime.rollout.scheduler import PromptSource, RolloutConfig, RolloutScheduler, RoundResult
from rljob.runtime.rollout.truncation import TruncationPolicy
from rljob.runtime.sim.engine import ResponseOracle, SimEngine
from rljob.runtime.sim.length_model import LengthModel, SimPrompt, SimPromptSource
from rljob.runtime.sim.reward_model import RewardModel
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
from rljob.runtime.sim.strategies import TailBatchingStrategy, build_sim_strategy
from rljob.runtime.sim.virtual_loop import run_virtual


@dataclass
class SimStepRecord:
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
    wasted_tokens: int  # filtered, discarded at collection, restarted or regenerated
    buffered_groups: int
    draft_tokens: int = 0  # accepted draft tokens (verified, not generated): not in tokens_generated
    discarded_tokens: int = 0  # running or surplus at collection, dropped (strategies without partials)
    dropped_groups: int = 0  # rejected by the DAPO filter
    trained_groups: int = 0
    distinct_prompts: int = 0  # prompts behind the trained groups (large-N splits one prompt)
    tail_share: float = 0.0  # share of the round's time after 90 % of its finished requests were done
    longest_over_median: float = 0.0  # longest ÷ median length of the requests finished in the round
    max_staleness: int = 0  # largest version gap of a trained sample

    @property
    def tokens_per_s(self) -> float:
        """This round's APRIL-fork `tokens_throughput`: generated tokens ÷ rollout time."""
        return self.tokens_generated / self.rollout_s if self.rollout_s else 0.0


@dataclass
class SimStrategyResult:
    """A strategy's run on a scenario, with the figures the report prints."""

    name: str
    kind: str
    engines: int
    gpus: int
    rollout_gpus: int
    ceiling_tokens_per_s: float  # bubble-free ceiling of the rollout engines
    records: list[SimStepRecord]
    warmup: int
    busy_seconds: float = 0.0
    retractions: int = 0
    prefill_tokens: int = 0
    draft_tokens: int = 0
    overlapped: bool = False  # rollout runs during training (async): time is wall time
    resumed_requests: int = 0  # async stream: interrupted by weight updates, resumed at once

    @property
    def measured(self) -> list[SimStepRecord]:
        return self.records[self.warmup:]

    def _sum(self, attr: str) -> float:
        return float(sum(getattr(r, attr) for r in self.measured))

    @property
    def rollout_seconds(self) -> float:
        return self._sum("step_s") if self.overlapped else self._sum("rollout_s")

    @property
    def rollout_throughput(self) -> float:
        """Rollout tokens per second (APRIL's metric: every generated token, aborted, filtered and
        discarded calls included; accepted draft tokens excluded), as a ratio of sums."""
        return self._sum("tokens_generated") / self.rollout_seconds if self.rollout_seconds else 0.0

    @property
    def mean_round_throughput(self) -> float:
        """Mean of the per-round `tokens_throughput` the APRIL fork logs (the pre-registered metric)."""
        if self.overlapped or not self.measured:
            return self.rollout_throughput
        return sum(r.tokens_per_s for r in self.measured) / len(self.measured)

    @property
    def trained_rollout_throughput(self) -> float:
        """Trained response tokens per second of rollout: the honest rollout metric."""
        return self._sum("trained_tokens") / self.rollout_seconds if self.rollout_seconds else 0.0

    @property
    def tail_share(self) -> float:
        """Mean share of round time spent on the last 10 % of requests (sync's tail)."""
        return self._sum("tail_share") / len(self.measured) if self.measured else 0.0

    @property
    def longest_over_median(self) -> float:
        return self._sum("longest_over_median") / len(self.measured) if self.measured else 0.0

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
            "mean_round_tokens_per_s": round(self.mean_round_throughput, 1),
            "trained_rollout_tokens_per_s": round(self.trained_rollout_throughput, 1),
            "dropped_groups": int(self._sum("dropped_groups")),
            "discarded_tokens": int(self._sum("discarded_tokens")),
            "tail_share_last_10pct": round(self.tail_share, 4),
            "longest_over_median": round(self.longest_over_median, 2),
            "max_staleness": max((r.max_staleness for r in self.measured), default=0),
            "resumed_requests": self.resumed_requests,
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
    rewards: RewardModel | None = None
    records: list[SimStepRecord] = field(default_factory=list)
    finished: list[tuple[float, int]] = field(default_factory=list)  # (virtual time, length units)
    stream_resumed: int = 0  # async stream: requests interrupted by a weight update and re-posted

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
    rewards = None
    if scenario.dynamic_sampling:
        rewards = RewardModel(law=cal.rewards[scenario.dataset], lengths=lengths, quantum=q, seed=scenario.seed)
    finished: list[tuple[float, int]] = []

    def score(sample: Sample) -> float:
        # Called as each sample finishes: the finish times give the round's tail statistics.
        finished.append((loop.time(), sample.response_length))
        return rewards.score(sample) if rewards is not None else 0.0

    scheduler = RolloutScheduler(engines, config, build_sim_strategy(spec, batch), source, score=score,
                                 truncation=truncation, group_filter=dynamic_sampling_filter if rewards else None,
                                 clock=loop.time)
    return _Sim(scenario, spec, engines, scheduler, rollout_gpus, train_gpus, ceiling * n_engines,
                rewards=rewards, finished=finished)


def tail_statistics(finished: list[tuple[float, int]], start: float, end: float) -> tuple[float, float]:
    """(share of [start, end] after 90 % of the finished requests were done, longest ÷ median length)."""
    if not finished or end <= start:
        return 0.0, 0.0
    times = sorted(t for t, _ in finished)
    lengths = sorted(n for _, n in finished)
    t90 = times[max(0, math.ceil(0.9 * len(times)) - 1)]
    median = lengths[len(lengths) // 2]
    return (end - t90) / (end - start), (lengths[-1] / median if median else 0.0)


def _draft_units(sim: _Sim) -> int:
    return sum(e.counters.draft_units for e in sim.engines)


async def _run_round(sim: _Sim, version: int) -> tuple[RoundResult, int, float, float]:
    """One scheduler round: the result, accepted draft units, tail share, longest ÷ median."""
    sim.finished.clear()
    drafts = _draft_units(sim)
    start = asyncio.get_running_loop().time()
    result = await sim.scheduler.run_round(version)
    tail, spread = tail_statistics(sim.finished, start, start + result.stats.rollout_seconds)
    return result, _draft_units(sim) - drafts, tail, spread


def _record(sim: _Sim, step: int, kind: str, result: RoundResult, trainer_version: int,
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
        step=step, round_kind=kind, rollout_s=st.rollout_seconds, train_s=train_s, sync_s=sync_s, step_s=step_s,
        tokens_generated=generated * q, trained_tokens=trained * q, off_policy_tokens=off * q,
        fork_off_policy_ratio=st.fork_off_policy_ratio, resumed_prefix_tokens=st.resumed_prefix_tokens * q,
        wasted_tokens=(st.wasted_tokens + st.discarded_stale_tokens + st.discarded_tokens + wasted) * q,
        buffered_groups=st.buffered_groups, draft_tokens=drafts * q, discarded_tokens=st.discarded_tokens * q,
        dropped_groups=st.dropped_groups, trained_groups=len(result.groups),
        distinct_prompts=len({g.prompt_index for g in result.groups}), tail_share=tail[0],
        longest_over_median=tail[1],
        max_staleness=max((s.staleness(trainer_version) for g in result.groups for s in g.samples), default=0),
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
        result, drafts, tail, spread = await _run_round(sim, step)
        train_s, sync_s = await _train_and_sync(sim, result.groups, step)
        step_s = result.stats.rollout_seconds + train_s + sync_s
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
    sim = _build(scenario, spec)
    if isinstance(spec, TailBatchingSpec):
        await _tail_batching_loop(sim)
    elif isinstance(spec, BoundedStalenessSpec):
        from rljob.runtime.sim.async_stream import run_stream  # imports this module's records

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
