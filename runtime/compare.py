"""Side-by-side rollout comparison of strategies on one policy, and the bubble-free ceiling.

Used by `rljob run --compare-rounds` (the quickstart shows APRIL's speed-up in the same run) and
by benchmarks/rollout_throughput.py. Every strategy gets its own engine built from the same
weights and seed, its own prompt stream with the same seed, and its rounds are interleaved with
the other strategies' so machine noise hits all of them alike. No training happens here, but each
round is followed by a weight sync, so policy versions (and the off-policy ratio) advance as in training.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from rljob.runtime.batch_stats import summarize_batch
from rljob.runtime.engines.base import Engine, GenerateRequest, WeightUpdate
from rljob.runtime.engines.embedded import EmbeddedEngine, EngineStats
from rljob.runtime.rollout.scheduler import RolloutScheduler, RoundResult

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from rljob.runtime.runner import JobRunner

EngineFactory = Callable[[], Engine]


@dataclass(frozen=True)
class Variant:
    """One compared configuration: a strategy on engines with these options (named `name` in the rows)."""

    name: str
    strategy: str
    chunked_prefill_tokens: int = 0  # the embedded engines' chunked prefill budget (0: off)
    fill_engines: bool = False  # keep the engines' batches full to the end of a round (RolloutConfig)
    flush_cache: bool = True  # False: the engines keep interrupted rows across the weight sync (WeightUpdate)


@dataclass
class PhaseWork:
    """What the embedded engines of one strategy did in one phase of its rounds: the collection, or
    the overlap with training (async). From the engines' own counters (EngineStats), so a token counts
    when it is generated, not when its group returns."""

    wall_seconds: float = 0.0
    busy_seconds: float = 0.0  # inside engine steps
    decode_steps: int = 0
    tokens: int = 0  # generated, the first token of each prefill included

    def add(self, before: EngineStats, after: EngineStats, wall_seconds: float) -> None:
        """Count the work between two snapshots of the summed engine counters, `wall_seconds` apart."""
        self.wall_seconds += wall_seconds
        self.busy_seconds += after.busy_seconds - before.busy_seconds
        self.decode_steps += after.decode_steps - before.decode_steps
        self.tokens += after.generated_tokens - before.generated_tokens

    def summary(self) -> dict[str, float]:
        """Seconds, the engines' busy share, tokens per second and tokens per decode step (the rows a
        decode step ran: how full the batch was, over-counted by the prefills' first tokens)."""
        return {
            "seconds": self.wall_seconds,
            "busy_share": self.busy_seconds / self.wall_seconds if self.wall_seconds else 0.0,
            "tokens_per_s": self.tokens / self.wall_seconds if self.wall_seconds else 0.0,
            "tokens_per_decode_step": self.tokens / self.decode_steps if self.decode_steps else 0.0,
        }


def engine_totals(engines: list[Engine]) -> EngineStats:
    """The embedded engines' counters summed (other engines keep none here)."""
    total = EngineStats()
    for engine in engines:
        if isinstance(engine, EmbeddedEngine):
            total.busy_seconds += engine.stats.busy_seconds
            total.decode_steps += engine.stats.decode_steps
            total.generated_tokens += engine.stats.generated_tokens
    return total


@dataclass
class StrategyResult:
    """Totals of one strategy over the compared rounds."""

    strategy: str
    rounds: int = 0
    tokens: int = 0
    rollout_seconds: float = 0.0
    trained_tokens: int = 0
    off_policy_tokens: int = 0
    cut_samples: int = 0  # cut by the length threshold (RoundStats.cut_keys)
    partial_samples: int = 0  # still running at stop and not cut
    launched_samples: int = 0
    reward_sum: float = 0.0
    samples: int = 0
    round_seconds: list[float] = field(default_factory=list)
    round_tokens_per_s: list[float] = field(default_factory=list)
    collection: PhaseWork = field(default_factory=PhaseWork)
    overlap: PhaseWork = field(default_factory=PhaseWork)  # async only: generating while the trainer trains

    @property
    def tokens_per_s(self) -> float:
        """Every generated token per second of rollout (APRIL's metric)."""
        return self.tokens / self.rollout_seconds if self.rollout_seconds else 0.0

    @property
    def trained_tokens_per_s(self) -> float:
        """Response tokens of the returned groups per second of rollout (the honest metric)."""
        return self.trained_tokens / self.rollout_seconds if self.rollout_seconds else 0.0

    @property
    def step_seconds(self) -> float:
        """Mean rollout time of one round (the rollout part of a training step)."""
        return self.rollout_seconds / self.rounds if self.rounds else 0.0

    @property
    def off_policy_ratio(self) -> float:
        return self.off_policy_tokens / self.trained_tokens if self.trained_tokens else 0.0

    @property
    def truncation_rate(self) -> float:
        """Samples cut by the length threshold per launched sample (docs/metrics.md)."""
        return self.cut_samples / self.launched_samples if self.launched_samples else 0.0

    @property
    def partial_rate(self) -> float:
        """Samples still running at stop-upon-collection (not cut) per launched sample."""
        return self.partial_samples / self.launched_samples if self.launched_samples else 0.0

    def add(self, result: RoundResult, version: int) -> None:
        s = result.stats
        bs = summarize_batch(result.groups, version)
        self.rounds += 1
        self.tokens += s.tokens_generated
        self.rollout_seconds += s.generating_seconds  # the overlap with training included (async)
        self.round_seconds.append(s.generating_seconds)
        self.round_tokens_per_s.append(s.tokens_per_second)
        self.trained_tokens += bs.response_tokens
        self.off_policy_tokens += bs.off_policy_tokens
        self.cut_samples += len(s.cut_keys)
        self.partial_samples += len(s.unfinished_keys - s.cut_keys)
        self.launched_samples += s.launched_samples
        self.reward_sum += bs.reward_mean * bs.samples
        self.samples += bs.samples


async def measure_ceiling(engine: Engine, batch: int, tokens: int, prompt_ids: list[int]) -> float:
    """Steady full-batch decode rate: `batch` requests that all run exactly `tokens` tokens."""
    requests = [
        GenerateRequest(rid=f"ceiling.{i}.", input_ids=list(prompt_ids), max_new_tokens=tokens, stop_token_ids=[])
        for i in range(batch)
    ]
    await engine.generate(requests[0])  # warm-up: first call pays one-off allocation costs
    t0 = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(r) for r in requests))
    elapsed = time.perf_counter() - t0
    return sum(len(r.output_ids) for r in results) / elapsed


async def compare_rollouts(
    schedulers: dict[str, RolloutScheduler],
    rounds: int,
    warmup_rounds: int = 1,
    on_round: Callable[[str, int, RoundResult], None] = lambda _s, _i, _r: None,
    weights: torch.nn.Module | None = None,
    train_seconds: float = 0.0,
    kept_cache: frozenset[str] = frozenset(),
) -> dict[str, StrategyResult]:
    """Run `rounds` measured rounds per scheduler, interleaved; warm-up rounds are not counted
    (they also fill APRIL's buffer, which is its steady state).

    A strategy that overlaps training (async) keeps generating for `train_seconds` after each round:
    the train step of a trainer on hardware of its own (no training happens here), then the
    interruption; that time counts in its generating seconds.

    With `weights`, every round is followed by a weight sync of those (unchanged) weights under the
    next policy version, outside the measured rollout time: the version cadence of training, so the
    off-policy ratio is the one a training run with these strategies would see. The schedulers named in
    `kept_cache` sync with ``flush_cache`` False (their engines keep the interrupted rows).
    """
    results = {name: StrategyResult(strategy=name) for name in schedulers}
    for i in range(warmup_rounds + rounds):
        for name, scheduler in schedulers.items():
            started, before = time.perf_counter(), engine_totals(scheduler.engines)
            result = await scheduler.run_round(i)
            collected, between = time.perf_counter(), engine_totals(scheduler.engines)
            await scheduler.generate_during(asyncio.sleep(train_seconds))  # returns at once unless async
            ended, after = time.perf_counter(), engine_totals(scheduler.engines)
            on_round(name, i, result)
            if i >= warmup_rounds:
                results[name].add(result, i)
                results[name].collection.add(before, between, collected - started)
                if scheduler.strategy.overlaps_training:
                    results[name].overlap.add(between, after, ended - collected)
            if weights is not None:
                update = WeightUpdate(version=i + 1, module=weights, flush_cache=name not in kept_cache)
                await asyncio.gather(*(e.update_weights(update) for e in scheduler.engines))
    return results


def comparison_table(results: dict[str, StrategyResult], ceiling: float) -> list[dict[str, Any]]:
    """Rows for printing and JSON: per strategy throughput, step time, ratios."""
    sync = results.get("sync")
    rows: list[dict[str, Any]] = []
    for name, r in results.items():
        rows.append(
            {
                "strategy": name,
                "tokens_per_s": r.tokens_per_s,
                "trained_tokens_per_s": r.trained_tokens_per_s,
                "step_seconds": r.step_seconds,
                "off_policy_ratio": r.off_policy_ratio,
                "truncation_rate": r.truncation_rate,
                "partial_rate": r.partial_rate,
                "reward_mean": r.reward_sum / r.samples if r.samples else 0.0,
                "over_sync": r.tokens_per_s / sync.tokens_per_s if sync and sync.tokens_per_s else 0.0,
                "over_ceiling": r.tokens_per_s / ceiling if ceiling else 0.0,
                "trained_over_sync": (r.trained_tokens_per_s / sync.trained_tokens_per_s
                                      if sync and sync.trained_tokens_per_s else 0.0),
                "engine_collection": r.collection.summary(),
                **({"engine_overlap": r.overlap.summary()} if r.overlap.wall_seconds else {}),
            }
        )
    return rows


async def compare_strategies(
    runner: JobRunner,
    rounds: int,
    strategies: tuple[str, ...] = ("sync", "april"),
    warmup_rounds: int = 1,
    on_round: Callable[[str, int, RoundResult], None] = lambda _s, _i, _r: None,
    train_seconds: float = 0.0,
    variants: tuple[Variant, ...] = (),
) -> dict[str, Any]:
    """Rollout-only comparison of strategies on the runner's current policy, each on engines of its own
    (`train_seconds`: see compare_rollouts). `variants` adds configurations (engine options) beside the
    strategies, interleaved with them round by round."""
    from rljob.runtime import job_parts as parts

    job = runner.job
    model = cast("PreTrainedModel", runner.trainer.model)  # the policy, as loaded from Hugging Face
    engines: list[Engine] = []
    schedulers = {}
    for v in (*(Variant(name, name) for name in strategies), *variants):
        engine_set = parts.build_engines(job, model, detokenize=runner.tokenizer.decode, seeded=True,
                                         chunked_prefill_tokens=v.chunked_prefill_tokens)
        engines += engine_set
        schedulers[v.name] = parts.build_scheduler(
            job, engine_set, parts.build_prompts(job, runner.tokenizer), runner.policy.stop_token_ids,
            runner.scheduler.scoring.scorer, runner.scheduler.scoring.keep, strategy=v.strategy,
            fill_engines=v.fill_engines,
        )
    ceiling_engine = parts.build_engines(job, model, seeded=True)[0]
    engines.append(ceiling_engine)
    await asyncio.gather(*(e.start() for e in engines))
    try:
        results = await compare_rollouts(
            schedulers, rounds, warmup_rounds=warmup_rounds, on_round=on_round, weights=model,
            train_seconds=train_seconds,
            kept_cache=frozenset(v.name for v in variants if not v.flush_cache),
        )
        first = runner.prompts.records[0]
        prompt_ids = runner.prompts.renderer.render(first.prompt, first.messages).ids
        num_engines, batch = parts.embedded_engine_count(job)
        # One engine measured, scaled by the engine count: engines share nothing but the CPU.
        ceiling = num_engines * await measure_ceiling(
            ceiling_engine,
            batch=batch,
            tokens=max(8, runner.settings.max_new_tokens // 2),
            prompt_ids=prompt_ids,
        )
    finally:
        await asyncio.gather(*(e.close() for e in engines), return_exceptions=True)
    rows = comparison_table(results, ceiling)
    engine_stats = {name: [asdict(e.stats) for e in scheduler.engines if isinstance(e, EmbeddedEngine)]
                    for name, scheduler in schedulers.items()}
    return {
        "engine_stats": engine_stats,  # embedded engines' counters, warm-up rounds included
        "rounds": rounds,
        "warmup_rounds": warmup_rounds,
        "train_seconds": train_seconds,
        "ceiling_tokens_per_s": ceiling,
        "rows": rows,
        "results": {name: asdict(r) for name, r in results.items()},
    }
