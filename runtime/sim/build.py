"""Builds one simulated strategy run (`SimRun`): engines on the calibration's constants, the runtime's
RolloutScheduler over them, the prompt source, truncation and, with dynamic sampling, the reward model.
Every loop shape (sim/runner.py, sim/async_stream.py) drives a `SimRun`."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

from rljob.runtime.engines.base import WeightUpdate
from rljob.runtime.rollout.sample import Group, Sample
from rljob.runtime.rollout.scheduler import RolloutConfig, RolloutScheduler
from rljob.runtime.rollout.scoring import dynamic_sampling_filter
from rljob.runtime.rollout.truncation import TruncationPolicy
from rljob.runtime.sim.engine import ResponseOracle, SimEngine
from rljob.runtime.sim.length_model import LengthModel, SimPromptSource
from rljob.runtime.sim.records import SimStepRecord
from rljob.runtime.sim.reward_model import RewardModel
from rljob.runtime.sim.scenario import (
    AprilSpec,
    AsyncSpec,
    BoundedStalenessSpec,
    DraftReuseSpec,
    EngineConstants,
    LargeGroupSpec,
    Scenario,
    StrategySpec,
    engine_constants,
    load_calibration,
    train_seconds,
)
from rljob.runtime.sim.strategies import build_sim_strategy


def engine_ceiling(c: EngineConstants, in_flight_context: float) -> float:
    """Bubble-free decode ceiling of one engine, tokens/s (PM §4.1): Θ(B*) = B*/(a + B*·c̄)."""
    b_star = min(c.max_running_requests, c.kv_capacity_tokens / in_flight_context)
    c_bar = c.per_seq_step_s + c.kv_read_s_per_token * in_flight_context
    return b_star / (c.fixed_step_s + b_star * c_bar)


def trainer_share(scenario: Scenario, spec: StrategySpec) -> float | None:
    """The trainer's share of the GPUs when it has GPUs of its own, None when it trains on the rollout GPUs.

    A strategy that overlaps generation with training (bounded staleness, async) needs its own trainer
    GPUs: its own share if it sets one, else the scenario's. In a disaggregated scenario
    (`colocated: false`, the layout of rljob on a cluster) every strategy gets the scenario's split.
    """
    own = spec.trainer_gpu_share if isinstance(spec, BoundedStalenessSpec | AsyncSpec) else None
    if own is not None:
        return own
    if not scenario.colocated or isinstance(spec, AsyncSpec):
        return scenario.trainer_gpu_share
    return None


@dataclass
class SimRun:
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

    def batch_tokens(self, groups: list[Group]) -> int:
        """Prompt and response tokens of a trained batch (what training time scales with)."""
        return sum(len(s.prompt_ids) + s.response_length for g in groups for s in g.samples) * self.q

    def train_seconds(self, groups: list[Group]) -> float:
        """Trainer time for one step over `groups` on this run's trainer GPUs: the strategy's own measured
        GPU-seconds per step if it has them (async), else the scenario's (scenario.train_seconds)."""
        own = self.spec.train_gpu_seconds_per_step if isinstance(self.spec, AsyncSpec) else None
        if own is not None:
            return own / self.train_gpus
        return train_seconds(self.scenario, self.batch_tokens(groups), self.train_gpus)

    async def sync_weights(self, version: int) -> float:
        """Push `version` to every engine at once; the virtual seconds it took."""
        loop = asyncio.get_running_loop()
        t = loop.time()
        await asyncio.gather(*(e.update_weights(WeightUpdate(version=version)) for e in self.engines))
        return loop.time() - t


def build_run(scenario: Scenario, spec: StrategySpec) -> SimRun:
    """A fresh run of `spec` on `scenario`: its engines, scheduler, prompts and (with dynamic sampling) rewards."""
    cal = load_calibration()
    law = cal.datasets[scenario.dataset]
    if scenario.median_tokens is not None:
        law = law.model_copy(update={"median_tokens": scenario.median_tokens})
    q = scenario.token_quantum
    consts = engine_constants(scenario)
    lengths = LengthModel(law=law, cap=scenario.max_response_length, seed=scenario.seed)
    _, ctx_ss = lengths.moments(prompt_tokens=law.prompt_tokens)
    prompt_units = max(2, math.ceil(law.prompt_tokens / q))
    oracle = ResponseOracle(lengths=lengths, quantum=q, prompt_units=prompt_units,
                            draft_accept=spec.accepted_prefix if isinstance(spec, DraftReuseSpec) else 0.0)
    k = scenario.tensor_parallel
    rollout_gpus, train_gpus = scenario.gpus, scenario.gpus
    if (share := trainer_share(scenario, spec)) is not None:
        train_gpus = max(k, round(scenario.gpus * share / k) * k)
        rollout_gpus = scenario.gpus - train_gpus
        if rollout_gpus < k:
            raise ValueError(f"{spec.name}: trainer_gpu_share leaves no GPU for rollout at {scenario.gpus} GPUs")
    n_engines = rollout_gpus // k
    ceiling = engine_ceiling(consts, ctx_ss)
    engines = [SimEngine(f"sim{i}", consts, oracle, ceiling=ceiling) for i in range(n_engines)]

    batch = scenario.rollout_batch_size or scenario.groups_per_engine * n_engines
    samples, repeat, dataset_size = scenario.samples_per_prompt, 1, None
    if isinstance(spec, LargeGroupSpec):  # N samples of one prompt, split into sub-groups of G
        repeat = max(1, spec.samples_per_prompt // samples)
        prompts = max(1, round(spec.samples_per_round_factor * batch / repeat))
        batch = prompts * repeat
    if isinstance(spec, DraftReuseSpec):
        dataset_size = max(batch, round(scenario.steps * batch / spec.epochs_in_run))
    source = SimPromptSource(prompt_units=prompt_units, dataset_size=dataset_size, repeat=repeat)
    truncation = None
    if isinstance(spec, AprilSpec | AsyncSpec) and spec.truncation.mode != "none":
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
    return SimRun(scenario, spec, engines, scheduler, rollout_gpus, train_gpus, ceiling * n_engines,
                rewards=rewards, finished=finished)
