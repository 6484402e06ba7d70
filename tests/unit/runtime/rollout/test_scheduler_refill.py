"""The scheduler's slime-compatible features, on simulated engines and virtual time: chunked
refill (launch K groups whenever fewer than N are viable), discard-at-collection for strategies
that keep no partials, and the two throughput metrics (generated vs trained tokens per second)."""

from __future__ import annotations

import asyncio

from rljob.runtime.rollout.sample import Group
from rljob.runtime.rollout.scheduler import RolloutConfig, RolloutScheduler, RoundStats
from rljob.runtime.rollout.strategy import AprilStrategy, Strategy
from rljob.runtime.sim.engine import ResponseOracle, SimEngine
from rljob.runtime.sim.length_model import LengthModel, SimPromptSource
from rljob.runtime.sim.scenario import EngineConstants, LengthLaw
from rljob.runtime.sim.virtual_loop import run_virtual

CONSTS = EngineConstants(
    fixed_step_s=0.005, per_seq_step_s=4e-5, kv_read_s_per_token=4.6e-8, prefill_s_per_token=1.5e-5,
    kv_capacity_tokens=200_000, admit_fraction=0.9, max_running_requests=256, abort_latency_s=0.05,
    weight_sync_s=2.0,
)
LAW = LengthLaw(median_tokens=300, sigma_between=0.5, sigma_within=0.5, runaway_share=0.01, prompt_tokens=4)
CAP, BATCH, G, ROUNDS = 2048, 4, 4, 5


def reject_every_third(group: Group) -> bool:
    """A deterministic stand-in for DAPO's filter: prompts 0, 3, 6, … have all-equal rewards."""
    return group.prompt_index % 3 != 0


def run(strategy: Strategy, group_filter=reject_every_third) -> tuple[list[RoundStats], list[int], RolloutScheduler]:
    """ROUNDS rounds on 2 engines: stats, groups launched per round, and the scheduler."""

    async def go() -> tuple[list[RoundStats], list[int], RolloutScheduler]:
        oracle = ResponseOracle(lengths=LengthModel(law=LAW, cap=CAP, seed=5), quantum=1, prompt_units=4)
        engines = [SimEngine(f"sim{i}", CONSTS, oracle) for i in range(2)]
        config = RolloutConfig(batch_size=BATCH, samples_per_prompt=G, max_response_length=CAP, max_staleness=100)
        loop = asyncio.get_running_loop()
        scheduler = RolloutScheduler(engines, config, strategy, SimPromptSource(prompt_units=4),
                                     score=lambda s: 1.0, group_filter=group_filter, clock=loop.time)
        stats, launched = [], []
        for version in range(ROUNDS):
            result = await scheduler.run_round(version)
            assert len(result.groups) == BATCH and all(g.finished and reject_every_third(g) for g in result.groups)
            assert result.stats.trained_tokens == sum(s.response_length for g in result.groups for s in g.samples)
            stats.append(result.stats)
            launched.append(scheduler.progress.launched_groups)
            for e in engines:
                assert (await e.load()).total == 0  # drained: discarded work is aborted, not left running
        return stats, launched, scheduler

    return run_virtual(go())[0]


def test_default_refill_launches_one_group_per_rejection():
    stats, launched, _ = run(Strategy())
    assert [n - s.filtered_groups for n, s in zip(launched, stats)] == [BATCH] * ROUNDS
    assert all(s.discarded_groups == 0 for s in stats)  # nothing is ever running at collection


def test_chunked_refill_launches_k_groups_whenever_fewer_than_n_are_viable():
    stats, launched, scheduler = run(Strategy(refill_granularity=BATCH))
    assert all(n % BATCH == 0 for n in launched)  # the first wave, then whole chunks of K = N
    assert sum(launched) > sum(BATCH + s.filtered_groups for s in stats)  # over-samples like slime's baseline
    # Without partial rollout, what still runs at collection is aborted and dropped, never buffered.
    assert sum(s.discarded_groups for s in stats) > 0 and len(scheduler.buffer) == 0
    for s in stats:  # every generated token is trained, filtered or discarded
        assert s.tokens_generated == s.trained_tokens + s.filtered_tokens + s.discarded_tokens
        assert s.trained_tokens_per_second < s.tokens_per_second or s.tokens_generated == s.trained_tokens


def test_april_with_chunked_refill_buffers_what_runs_at_collection():
    stats, launched, scheduler = run(AprilStrategy(over_sampling=2.0, refill_granularity=2 * BATCH))
    assert all(n % (2 * BATCH) == 0 for n in launched)
    assert all(s.discarded_groups == 0 for s in stats) and len(scheduler.buffer) > 0
    buffered = scheduler.buffer.token_count()
    assert sum(s.tokens_generated for s in stats) == sum(s.trained_tokens + s.filtered_tokens for s in stats) + buffered


def test_trained_rate_counts_only_returned_groups():
    stats, _, _ = run(Strategy(refill_granularity=BATCH))
    generated = sum(s.tokens_generated for s in stats)
    trained = sum(s.trained_tokens for s in stats)
    seconds = sum(s.rollout_seconds for s in stats)
    assert 0 < trained < generated
    assert all(abs(s.trained_tokens_per_second * s.rollout_seconds - s.trained_tokens) < 1e-6 for s in stats)
    assert trained / seconds < generated / seconds
