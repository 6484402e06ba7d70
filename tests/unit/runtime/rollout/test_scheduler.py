"""Rollout scheduler on the real embedded engine with a tiny random transformer.

Random weights with eight stop tokens out of 128 give geometric response lengths: most samples
stop early, a few run to the cap — the long tail APRIL is about.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest

from rljob.runtime.engines.base import EngineError, GenerateRequest, GenerateResult, WeightUpdate
from rljob.runtime.engines.embedded import EmbeddedEngine
from rljob.runtime.rollout.sample import Group, SampleStatus
from rljob.runtime.rollout.scheduler import RolloutConfig, RolloutScheduler
from rljob.runtime.rollout.scoring import dynamic_sampling_filter
from rljob.runtime.rollout.strategy import AprilStrategy, Strategy
from rljob.runtime.rollout.truncation import TruncationPolicy
from tests.helpers.tiny_model import build_tiny_model

STOP = list(range(8))
CAP = 48


@dataclass
class Prompt:
    index: int
    text: str
    answer: str
    prompt_ids: list[int]


@dataclass
class Prompts:
    served: int = 0

    def next_prompt(self) -> Prompt:
        self.served += 1
        i = self.served
        return Prompt(index=i, text=f"p{i}", answer=str(i % 2), prompt_ids=[10 + i % 50, 20 + i % 7, 30])


class RecordingEngine(EmbeddedEngine):
    """The real embedded engine, remembering every request it was given (for budget checks)."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.requests: list[GenerateRequest] = []
        self.peak_load = 0  # most requests running or waiting at once

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.requests.append(request)
        self.peak_load = max(self.peak_load, self.current_load().total + 1)
        return await super().generate(request)

    def mid_response(self) -> int:
        """Sequences running with at least one token out: what an abort now interrupts mid-response."""
        return sum(1 for s in self._running if s.finish_reason is None and s.output_ids)


class DownEngine(EmbeddedEngine):
    """The real embedded engine with its workers gone: every generate fails and health is False."""

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        raise EngineError("connection refused (the worker is down)")

    async def health(self) -> bool:
        return False


@dataclass
class Ledger:
    """Every group ever trained, so tests can check nothing is lost or duplicated."""

    trained: list[Group] = field(default_factory=list)
    generated_tokens: int = 0
    discarded_tokens: int = 0


def make_scheduler(
    strategy: Strategy, engines: list[EmbeddedEngine], batch: int = 4, staleness: int = 2, truncation=None,
    fill_engines: bool = False,
) -> RolloutScheduler:
    config = RolloutConfig(
        batch_size=batch, samples_per_prompt=3, max_response_length=CAP, temperature=1.0,
        max_staleness=staleness, stop_token_ids=STOP, fill_engines=fill_engines,
    )
    return RolloutScheduler(engines, config, strategy, Prompts(), score=lambda s: float(len(s.response_ids) % 2),
                            truncation=truncation)


@pytest.fixture
async def engine():
    e = RecordingEngine(build_tiny_model(seed=1), max_batch_size=32, seed=0)
    await e.start()
    yield e
    await e.close()


async def run_rounds(scheduler: RolloutScheduler, versions: list[int], ledger: Ledger) -> None:
    for v in versions:
        for engine in scheduler.engines:
            if engine.weight_version != v and await engine.health():
                await engine.update_weights(WeightUpdate(version=v, module=engine.model))
        result = await scheduler.run_round(v)
        assert len(result.groups) == scheduler.config.batch_size
        assert [g.prompt_index for g in result.groups] == sorted(g.prompt_index for g in result.groups)
        for g in result.groups:
            assert len(g.samples) == scheduler.config.samples_per_prompt
            assert all(s.status.finished and s.reward is not None for s in g.samples)
        ledger.trained += result.groups
        ledger.generated_tokens += result.stats.tokens_generated
        ledger.discarded_tokens += result.stats.regenerated_tokens


def assert_conserved(scheduler: RolloutScheduler, ledger: Ledger) -> None:
    """Every generated token is in a trained sample, a buffered sample, or was discarded as stale."""
    trained_ids = [g.group_id for g in ledger.trained]
    buffered_ids = [g.group_id for g in scheduler.buffer]
    assert len(set(trained_ids)) == len(trained_ids), "a group was trained twice"
    assert not set(trained_ids) & set(buffered_ids), "a trained group is still buffered"
    held = sum(s.response_length for g in ledger.trained for s in g.samples)
    held += sum(s.response_length for g in scheduler.buffer for s in g.samples)
    assert held + ledger.discarded_tokens == ledger.generated_tokens


async def test_sync_round_waits_for_every_group(engine):
    scheduler = make_scheduler(Strategy(), [engine])
    ledger = Ledger()
    await run_rounds(scheduler, [0, 1], ledger)
    assert len(scheduler.buffer) == 0
    assert engine.stats.finished["abort"] == 0
    assert_conserved(scheduler, ledger)


async def test_april_buffers_partials_and_loses_nothing(engine):
    scheduler = make_scheduler(AprilStrategy(over_sampling=2.0), [engine])
    ledger = Ledger()
    first = await scheduler.run_round(0)
    ledger.trained += first.groups
    ledger.generated_tokens += first.stats.tokens_generated
    assert first.stats.launched_samples >= 8 * 3 - 3  # 2x over-sampling of 4 groups of 3
    assert len(scheduler.buffer) > 0, "nothing left in flight at collection: the test lost its tail"
    # No length threshold: every unfinished sample was still running at stop, none was cut.
    assert first.stats.partial_samples > 0 and 0 < first.stats.partial_rate <= 1
    assert first.stats.truncation_rate == 0.0 and not first.stats.cut_keys
    assert (await engine.load()).total == 0, "engine not drained after stop-upon-collection"
    await run_rounds(scheduler, [1, 2, 3], ledger)
    assert_conserved(scheduler, ledger)


async def test_fill_engines_keeps_the_batch_full_and_loses_nothing(engine):
    """APRIL's launch target (8 groups of 3 = 24 samples) leaves 8 of the engine's 32 slots idle; with
    `fill_engines` the scheduler launches whole groups into the free slots whenever it harvests, never
    more than the batch holds, and the extra groups are buffered like any partial: nothing is lost."""
    scheduler = make_scheduler(AprilStrategy(over_sampling=2.0), [engine], fill_engines=True)
    ledger = Ledger()
    first = await scheduler.run_round(0)
    ledger.trained += first.groups
    ledger.generated_tokens += first.stats.tokens_generated
    assert first.stats.launched_samples > 8 * 3, "no group beyond the launch target: the batch was not filled"
    assert engine.peak_load <= engine.max_batch_size
    assert scheduler.pool.requests == [0] and (await engine.load()).total == 0
    await run_rounds(scheduler, [1, 2, 3], ledger)
    assert scheduler.pool.requests == [0]
    assert_conserved(scheduler, ledger)


async def test_resumed_sample_continues_where_it_stopped(engine):
    scheduler = make_scheduler(AprilStrategy(over_sampling=3.0), [engine])
    await scheduler.run_round(0)
    partial = next(s for g in scheduler.buffer for s in g.samples if s.status == SampleStatus.ABORTED and s.response_ids)
    before_ids, before_versions = list(partial.response_ids), list(partial.versions)
    assert set(before_versions) == {0}
    engine.requests.clear()
    await engine.update_weights(WeightUpdate(version=1, module=build_tiny_model(seed=2)))
    await scheduler.run_round(1)
    request = next(r for r in engine.requests if r.rid.startswith(f"r2.{partial.group_id}.s{partial.index}."))
    assert request.input_ids == partial.prompt_ids + before_ids
    assert request.max_new_tokens == CAP - len(before_ids)
    assert partial.response_ids[: len(before_ids)] == before_ids
    assert partial.versions[: len(before_versions)] == before_versions
    assert set(partial.versions[len(before_versions):]) <= {1}
    assert len(partial.versions) == len(partial.response_ids) == len(partial.logprobs) <= CAP


async def test_staleness_bound_regenerates_old_samples(engine):
    scheduler = make_scheduler(AprilStrategy(over_sampling=3.0), [engine], staleness=0)
    ledger = Ledger()
    for v in range(3):
        await run_rounds(scheduler, [v], ledger)
        for g in ledger.trained[-scheduler.config.batch_size:]:
            for s in g.samples:
                assert set(s.versions) <= {v}, f"trained at {v} with tokens of versions {set(s.versions)}"
    assert ledger.discarded_tokens > 0, "no buffered sample went stale: the bound was never exercised"
    assert_conserved(scheduler, ledger)


async def test_staleness_within_bound_of_one(engine):
    scheduler = make_scheduler(AprilStrategy(over_sampling=3.0), [engine], staleness=1)
    for v in range(4):
        await engine.update_weights(WeightUpdate(version=v, module=engine.model))
        result = await scheduler.run_round(v)
        for g in result.groups:
            for s in g.samples:
                assert s.staleness(v) <= 1


async def test_segment_cap_cuts_long_samples(engine):
    truncation = TruncationPolicy(mode="tokens", max_tokens=6)
    scheduler = make_scheduler(AprilStrategy(over_sampling=2.0), [engine], staleness=8, truncation=truncation)
    ledger = Ledger()
    sizes = []
    for v in range(6):
        await run_rounds(scheduler, [v], ledger)
        sizes.append(len(scheduler.buffer))
    # Far too low a cap: the first round fills the buffer, then backpressure stops its growth.
    target = scheduler.strategy.launch_target(scheduler.config.batch_size)
    assert max(sizes[1:]) <= sizes[0] + target, sizes
    # Capped launches ask for at most 6 tokens; only a group cut earlier in the SAME round may
    # continue uncapped (when the round would otherwise open fresh prompts to reach N).
    rids = {r.rid for r in engine.requests}
    for r in engine.requests:
        if r.max_new_tokens > 6:
            rnd, gid, s, seg, _ = r.rid.split(".")
            assert f"{rnd}.{gid}.{s}.{int(seg) - 1}." in rids, r.rid
    assert sum(r.max_new_tokens <= 6 for r in engine.requests) > len(engine.requests) / 2
    assert any(s.segments > 1 for g in ledger.trained for s in g.samples), "no sample was resumed after a cut"
    assert_conserved(scheduler, ledger)


async def test_cut_by_the_threshold_and_running_at_stop_are_counted_apart(engine):
    """Truncation rate: cut by the segment cap; partial rate: unfinished at stop and never cut. Each
    launched sample counts in at most one, and their union is every sample that ended unfinished."""
    truncation = TruncationPolicy(mode="tokens", max_tokens=16)
    scheduler = make_scheduler(AprilStrategy(over_sampling=3.0), [engine], staleness=8, truncation=truncation)
    seen_cut = seen_partial = False
    for v in range(4):
        for e in scheduler.engines:
            await e.update_weights(WeightUpdate(version=v, module=e.model))
        stats = (await scheduler.run_round(v)).stats
        n = stats.launched_samples
        assert stats.truncation_rate == pytest.approx(len(stats.cut_keys) / n)
        assert stats.partial_rate == pytest.approx(len(stats.unfinished_keys - stats.cut_keys) / n)
        assert stats.truncation_rate + stats.partial_rate <= 1.0
        assert stats.partial_samples == len(stats.unfinished_keys)
        seen_cut |= stats.truncation_rate > 0
        seen_partial |= stats.partial_rate > 0
    assert seen_cut, "a 16-token cap on geometric lengths up to 48 cut nothing"
    assert seen_partial, "3x over-sampling left nothing running at stop"


async def test_round_finishes_even_when_the_cap_cuts_every_sample(engine):
    import asyncio

    truncation = TruncationPolicy(mode="tokens", max_tokens=1)
    scheduler = make_scheduler(AprilStrategy(over_sampling=1.5), [engine], staleness=100, truncation=truncation)
    ledger = Ledger()
    for v in range(3):
        await asyncio.wait_for(run_rounds(scheduler, [v], ledger), timeout=120)
    assert len(scheduler.buffer) <= 2 * scheduler.strategy.launch_target(scheduler.config.batch_size)
    assert_conserved(scheduler, ledger)


async def test_segment_cap_never_below_what_the_staleness_bound_allows(engine):
    # With maxStaleness 2 a sample gets 3 rounds; a 6-token cap could never finish a 48-token one.
    truncation = TruncationPolicy(mode="tokens", max_tokens=6)
    scheduler = make_scheduler(AprilStrategy(over_sampling=2.0), [engine], staleness=2, truncation=truncation)
    await run_rounds(scheduler, [0, 1], Ledger())
    first_segments = [r for r in engine.requests if r.rid.endswith(".1.")]
    assert max(r.max_new_tokens for r in first_segments) == 16  # ceil(48 / 3), not 6


async def test_dynamic_sampling_drops_uniform_groups(engine):
    scheduler = make_scheduler(AprilStrategy(over_sampling=2.0), [engine])
    scheduler.scoring = replace(scheduler.scoring, keep=dynamic_sampling_filter)  # what DAPO jobs run
    result = await scheduler.run_round(0)
    for g in result.groups:
        assert max(g.rewards()) != min(g.rewards())
    assert result.stats.filtered_groups >= 0
    assert result.stats.filtered_tokens == 0 or result.stats.filtered_groups > 0


async def test_a_reward_that_is_always_zero_stops_the_round_with_reward_collapse(engine):
    """Every group scores alike, so dynamic sampling rejects them all: past the bound the round raises
    instead of sampling for ever, and says what to check."""
    from rljob.runtime.rollout.round import RewardCollapse

    scheduler = make_scheduler(AprilStrategy(over_sampling=2.0), [engine])
    scheduler.scoring = replace(scheduler.scoring, score=lambda _s: 0.0, keep=dynamic_sampling_filter)
    scheduler.config.max_consecutive_rejections = 10
    with pytest.raises(RewardCollapse, match=r"rejected 10 groups in a row \(the last one's rewards: \[0.0\]\)"):
        await scheduler.run_round(0)
    assert scheduler.rejections_in_a_row == 10


async def test_an_accepted_group_resets_the_rejection_count(engine):
    scheduler = make_scheduler(AprilStrategy(over_sampling=2.0), [engine])
    scheduler.scoring = replace(scheduler.scoring, keep=dynamic_sampling_filter)
    scheduler.rejections_in_a_row = 5  # as if earlier rounds had rejected five
    await scheduler.run_round(0)
    assert scheduler.rejections_in_a_row < 5


async def test_unservable_request_fails_fast_instead_of_retrying(engine):
    import asyncio

    from rljob.runtime.engines.base import InvalidRequestError

    scheduler = make_scheduler(Strategy(), [engine])
    scheduler.config.max_response_length = 10_000  # beyond the tiny model's 512-token context
    with pytest.raises(InvalidRequestError, match="maxResponseLength"):
        await asyncio.wait_for(scheduler.run_round(0), timeout=30)


async def test_staleness_bound_is_enforced_at_acceptance():
    # Engine 0 missed every weight sync: it still serves version 0 while the policy is at 5. Its
    # groups finish inside this round, so the buffer-side check never sees them; acceptance must.
    lagging = RecordingEngine(build_tiny_model(seed=1), max_batch_size=32, seed=0)
    current = RecordingEngine(build_tiny_model(seed=1), max_batch_size=32, seed=1)
    for e in (lagging, current):
        await e.start()
    try:
        await current.update_weights(WeightUpdate(version=5, module=current.model))
        scheduler = make_scheduler(Strategy(), [lagging, current], batch=4, staleness=2)
        result = await scheduler.run_round(5)
        for g in result.groups:
            for s in g.samples:
                assert s.status.finished and s.reward is not None
                assert set(s.versions) <= {5}, f"trained tokens of versions {set(s.versions)} at 5"
        # Sync strategy, least-loaded placement: groups 1 and 3 of 4 went to the lagging engine.
        assert result.stats.stale_at_acceptance_samples == 2 * 3
        assert result.stats.regenerated_samples == 2 * 3 and result.stats.regenerated_tokens > 0
        assert len(lagging.requests) == 2 * 3, "a group was sent back to the lagging engine"
    finally:
        for e in (lagging, current):
            await e.close()


async def test_only_lagging_engines_fail_the_round_with_a_clear_error(engine):
    import asyncio

    from rljob.runtime.rollout.scheduler import StaleEnginesError

    scheduler = make_scheduler(Strategy(), [engine], batch=2, staleness=1)  # engine at version 0
    with pytest.raises(StaleEnginesError, match="maxStaleness=1"):
        await asyncio.wait_for(scheduler.run_round(3), timeout=60)


async def test_group_scorer_rewards_whole_groups(engine):
    calls: list[tuple[str, int]] = []

    async def scorer(group: Group, samples: list) -> list[float]:
        calls.append((group.group_id, len(samples)))
        return [float(s.index) for s in samples]

    scheduler = make_scheduler(Strategy(), [engine], batch=3)
    scheduler.scoring = replace(scheduler.scoring, scorer=scorer)
    result = await scheduler.run_round(0)
    assert sorted(calls) == sorted((g.group_id, 3) for g in result.groups)
    assert all(s.reward == float(s.index) for g in result.groups for s in g.samples)


async def test_recover_brings_back_an_engine_that_only_serves_older_weights(engine):
    import asyncio

    # The whole fleet came back behind (the SGLang case: restarted workers serve their start-up weights):
    # without recover this is test_only_lagging_engines_fail_the_round_with_a_clear_error.
    calls: list[int] = []

    async def catch_up() -> bool:
        calls.append(engine.weight_version)
        await engine.update_weights(WeightUpdate(version=3, module=engine.model))
        return True

    scheduler = make_scheduler(Strategy(), [engine], batch=2, staleness=1)
    scheduler.pool.recover = catch_up
    result = await asyncio.wait_for(scheduler.run_round(3), timeout=60)
    assert calls == [0], "one catch-up, while the engine still served version 0"
    assert result.stats.stale_at_acceptance_samples > 0, "the engine never served the old weights: nothing tested"
    assert {v for g in result.groups for s in g.samples for v in s.versions} == {3}


async def test_waiting_for_an_engine_has_a_deadline_that_names_the_setting():
    import asyncio

    from rljob.runtime.rollout.scheduler import EngineWaitTimeout

    engine = DownEngine(build_tiny_model(seed=1), max_batch_size=8, seed=0)
    await engine.start()
    recovers: list[bool] = []

    async def nothing_to_catch_up() -> bool:
        recovers.append(False)
        return False

    try:
        scheduler = make_scheduler(Strategy(), [engine], batch=2)
        scheduler.config.engine_wait_timeout_s = 1.0
        scheduler.pool.recover = nothing_to_catch_up
        with pytest.raises(EngineWaitTimeout, match="rollout.engineWaitTimeoutSeconds"):
            await asyncio.wait_for(scheduler.run_round(0), timeout=60)
        assert recovers, "recover was never asked while no engine could generate"
    finally:
        await engine.close()
