"""The async strategy on the real embedded engine with a tiny random transformer: the engines keep
generating while a (stand-in) training step runs, the weight sync interrupts them mid-response, the
next round resumes each response under the new weights, and every token carries the version that
generated it.

The stand-in training step ends on observed events (the overlap finished a group ahead and the engine
holds a response mid-way), never after a fixed time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from rljob.runtime.engines.base import WeightUpdate
from rljob.runtime.rollout.decisions import ahead_launches
from rljob.runtime.rollout.round import RoundResult
from rljob.runtime.rollout.scheduler import RolloutScheduler
from rljob.runtime.rollout.strategy import AprilStrategy, AsyncStrategy, make_strategy
from tests.helpers.tiny_model import build_tiny_model
from tests.unit.runtime.rollout.test_scheduler import Ledger, RecordingEngine, assert_conserved, make_scheduler

DEADLINE_S = 120.0
# Batches kept ahead by the schedulers whose stand-in step waits for `overlap_done`. With the default
# one, the engine may rightly run dry during the step: when the round's over-sampled surplus has
# finished before the step starts, a batch is done ahead and nothing is launched, so no response is
# ever mid-way (clean-clone run 59 of docs/development.md hung so). Four batches (48 samples, for an
# engine of 32 slots) keep it full until the condition is seen.
AHEAD_BATCHES = 4.0


def async_scheduler(engine: RecordingEngine, staleness: int) -> RolloutScheduler:
    """A scheduler of async APRIL (over-sampling 2) that keeps the engine busy through every step."""
    return make_scheduler(AsyncStrategy(over_sampling=2.0, ahead_batches=AHEAD_BATCHES), [engine], staleness=staleness)


async def until(condition: Callable[[], bool], what: str) -> str:
    """The stand-in training step: returns once `condition` holds (generous deadline)."""
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"not observed within {DEADLINE_S:.0f} s: {what}"
        await asyncio.sleep(0.01)
    return "trained"


def overlap_done(scheduler: RolloutScheduler, result: RoundResult) -> Callable[[], bool]:
    """A group finished ahead, and a response is mid-way on an engine (so the sync interrupts it)."""
    stats = result.stats
    engines = [e for e in scheduler.engines if isinstance(e, RecordingEngine)]
    return lambda: stats.surplus_groups >= 1 and any(e.mid_response() for e in engines)


@pytest.fixture
async def engine():
    e = RecordingEngine(build_tiny_model(seed=1), max_batch_size=32, seed=0)
    await e.start()
    yield e
    await e.close()


async def async_step(scheduler: RolloutScheduler, version: int, ledger: Ledger) -> RoundResult:
    """One step of the runner's loop: sync weights `version`, collect, 'train' while generating ahead."""
    for e in scheduler.engines:
        if e.weight_version != version:
            await e.update_weights(WeightUpdate(version=version, module=e.model))
    result = await scheduler.run_round(version)
    assert len(result.groups) == scheduler.config.batch_size
    assert await scheduler.generate_during(until(overlap_done(scheduler, result), "a group done ahead")) == "trained"
    for e in scheduler.engines:
        assert (await e.load()).total == 0, "engine not drained before the weight sync"
    ledger.trained += result.groups
    ledger.generated_tokens += result.stats.tokens_generated
    ledger.discarded_tokens += result.stats.regenerated_tokens
    return result


def test_make_strategy_knows_async() -> None:
    strategy = make_strategy("async", over_sampling=1.5)
    assert isinstance(strategy, AsyncStrategy) and strategy.overlaps_training and strategy.keeps_partials
    assert strategy.launch_target(8) == 12
    assert strategy.ahead_target(8) == 8  # one batch ahead by default, whatever the over-sampling
    assert AsyncStrategy(ahead_batches=1.5).ahead_target(8) == 12
    assert not AprilStrategy().overlaps_training
    with pytest.raises(ValueError, match="sync, april, async"):
        make_strategy("fully-async")


@pytest.mark.parametrize(("in_flight", "done_ahead", "target", "launches"), [
    (0, 0, 8, 8),  # engines empty: fill them
    (5, 0, 8, 3),
    (5, 3, 8, 0),  # a batch's worth of work kept: nothing more
    (2, 9, 8, 0),  # more done ahead than the target (surplus of the round itself): never negative
])
def test_ahead_launches_keep_target_groups_in_flight_or_done(in_flight, done_ahead, target, launches) -> None:
    assert ahead_launches(in_flight, done_ahead, target) == launches


async def test_engines_generate_during_training_and_the_sync_interrupts_mid_response(engine):
    scheduler = async_scheduler(engine, staleness=2)
    ledger = Ledger()
    first = await async_step(scheduler, 0, ledger)
    s = first.stats
    assert s.overlap_tokens > 0 and s.overlap_seconds > 0, "nothing generated while training"
    assert s.surplus_groups >= 1 and s.tokens_per_second > 0
    # Interrupted mid-response: unfinished samples with tokens of version 0 wait in the buffer.
    partials = [smp for g in scheduler.buffer for smp in g.samples if not smp.status.finished and smp.response_ids]
    assert partials, "the sync interrupted no request mid-response"
    before = {(p.group_id, p.index): (list(p.response_ids), list(p.versions)) for p in partials}
    assert all(set(v) == {0} for _, v in before.values())
    # The trainer stepped: version 1. The next round resumes each interrupted response from its prefix.
    engine.requests.clear()
    await engine.update_weights(WeightUpdate(version=1, module=build_tiny_model(seed=2)))
    await async_step(scheduler, 1, ledger)
    mixed = 0
    for p in partials:
        ids, versions = before[(p.group_id, p.index)]
        assert p.response_ids[: len(ids)] == ids and p.versions[: len(ids)] == versions
        resumed = [r for r in engine.requests if r.rid.startswith(f"r2.{p.group_id}.s{p.index}.")]
        if resumed:
            assert resumed[0].input_ids == p.prompt_ids + ids, "the resume did not continue the prefix"
            # Exactly: every token after the prefix came from version 1 (until the next interruption).
            assert set(p.versions[len(ids):]) <= {1}
            mixed += len(p.versions) > len(ids)
        assert len(p.versions) == len(p.response_ids) == len(p.logprobs)
    assert mixed >= 1, "no response carries tokens of two versions"
    assert_conserved(scheduler, ledger)


def kept_ahead(scheduler: RolloutScheduler, result: RoundResult, ahead: list[int]) -> Callable[[], bool]:
    """The stand-in training step's condition (the engine generated since the step began, and a group is
    done ahead or nothing is left in flight), noting at every poll how many groups are in flight or done
    ahead. Without the first part, a round whose last harvest brought its surplus group in ended the step
    at once, before the groups launched ahead had a token (overlap_tokens 0)."""
    engine = scheduler.engines[0]
    began_at = engine.stats.generated_tokens  # type: ignore[attr-defined]

    def condition() -> bool:
        ahead.append(scheduler.progress.in_flight_groups + result.stats.surplus_groups)
        generated = engine.stats.generated_tokens > began_at  # type: ignore[attr-defined]
        return generated and (result.stats.surplus_groups >= 1 or scheduler.progress.in_flight_groups == 0)
    return condition


async def test_the_work_kept_ahead_while_the_trainer_trains_is_one_batch(engine):
    # What generates while step v trains is trained at v + 1 at the earliest, which takes one batch: the
    # groups in flight plus those done ahead stay within a batch (or within what was still in flight at
    # collection, which runs on), though the round itself over-samples (target 5 for a batch of 4). As a
    # step starts, fewer than a batch are done ahead (the round's surplus), so groups are in flight or
    # launched: the engine has work through every step, and kept_ahead waits for its tokens.
    scheduler = make_scheduler(AsyncStrategy(over_sampling=1.25), [engine], batch=4, staleness=2)
    launched_ahead = 0
    for v in range(4):
        await engine.update_weights(WeightUpdate(version=v, module=engine.model))
        result = await scheduler.run_round(v)
        assert scheduler.strategy.launch_target(4) == 5
        bound = max(4, scheduler.progress.in_flight_groups)
        launched = scheduler.progress.launched_groups
        ahead: list[int] = []
        await scheduler.generate_during(until(kept_ahead(scheduler, result, ahead), "a group done ahead"))
        assert max(ahead) <= bound, f"step {v}: {max(ahead)} groups kept ahead, more than {bound}"
        launched_ahead += scheduler.progress.launched_groups - launched
        assert result.stats.overlap_tokens > 0
    assert launched_ahead > 0, "nothing was launched while the trainer trained: the bound was never reached"


async def test_async_conserves_every_token_over_several_steps(engine):
    scheduler = async_scheduler(engine, staleness=2)
    ledger = Ledger()
    overlap = 0
    for v in range(4):
        result = await async_step(scheduler, v, ledger)
        s = result.stats
        overlap += s.overlap_tokens
        # The round's own ledger balances, its overlap included.
        assert (s.buffer_tokens_before + s.tokens_generated == s.trained_tokens + s.buffer_tokens_after
                + s.regenerated_tokens + s.filtered_tokens + s.discarded_tokens)
        for g in result.groups:
            for smp in g.samples:
                assert smp.status.finished and smp.reward is not None
                assert all(v - 2 <= tv <= v for tv in smp.versions), (v, set(smp.versions))
    assert overlap > 0
    assert_conserved(scheduler, ledger)


async def test_staleness_bound_zero_regenerates_every_group_done_ahead(engine):
    # η = 0: a group finished while the trainer trained at v is one version old at v + 1, over the
    # bound: it is regenerated (counted), never trained.
    scheduler = async_scheduler(engine, staleness=0)
    ledger = Ledger()
    regenerated = 0
    for v in range(3):
        result = await async_step(scheduler, v, ledger)
        regenerated += result.stats.regenerated_samples
        for g in result.groups:
            for smp in g.samples:
                assert set(smp.versions) <= {v}, f"trained at {v} with tokens of versions {set(smp.versions)}"
    assert regenerated > 0 and ledger.discarded_tokens > 0, "the bound was never exercised"
    assert_conserved(scheduler, ledger)


async def test_run_round_refuses_to_start_while_the_last_round_still_generates(engine):
    scheduler = make_scheduler(AsyncStrategy(over_sampling=2.0), [engine])
    result = await scheduler.run_round(0)
    with pytest.raises(RuntimeError, match="generate_during"):
        await scheduler.run_round(1)
    await scheduler.generate_during(until(lambda: True, "nothing"))
    assert (await engine.load()).total == 0
    assert result.stats.buffer_tokens_after == scheduler.buffer.token_count()


async def test_a_failed_training_step_stops_the_overlap_and_leaves_nothing_running(engine):
    scheduler = make_scheduler(AsyncStrategy(over_sampling=2.0), [engine])
    result = await scheduler.run_round(0)

    async def failing() -> None:
        await until(lambda: result.stats.overlap_tokens > 0 or scheduler.progress.tokens > 0, "tokens")
        raise RuntimeError("trainer out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        await scheduler.generate_during(failing())
    await until(lambda: engine.current_load().total == 0, "engine idle after the failure")
