"""Every simulator strategy on a small scenario: what each one changes, checked on its records.

Virtual time makes every figure deterministic for a seed; comparisons between strategies are on
simulated seconds, never on wall-clock time.
"""

from __future__ import annotations

import statistics

import pytest

from rljob.runtime.rollout.sample import Sample, SampleStatus
from rljob.runtime.sim.length_model import LengthModel
from rljob.runtime.sim.reward_model import RewardModel
from rljob.runtime.sim.records import SimStrategyResult
from rljob.runtime.sim.runner import simulate_strategy, tail_statistics
from rljob.runtime.sim.scenario import (
    AprilSpec,
    BoundedStalenessSpec,
    DraftReuseSpec,
    LargeGroupSpec,
    LengthLaw,
    RewardLaw,
    StrategySpec,
    SyncSpec,
    TailBatchingSpec,
)
from tests.helpers.sim_scenarios import small_scenario


def run(spec: StrategySpec, **update: object) -> SimStrategyResult:
    return simulate_strategy(small_scenario(**update), spec)


def test_tail_batching_defers_aborted_prompts_to_long_rounds_and_stays_on_policy():
    result = run(TailBatchingSpec(kind="tail-batching", over_sampling=1.5, predicted_long_share=0.2), steps=8)
    kinds = [r.round_kind for r in result.records]
    assert "short" in kinds and "long" in kinds
    assert result.off_policy_share == 0.0  # deferred prompts restart from scratch under current weights
    assert sum(r.wasted_tokens for r in result.records) > 0  # the aborted short-round work is thrown away
    assert all(r.trained_groups == 8 for r in result.records)


def test_tail_batching_with_dynamic_sampling_replaces_rejected_long_prompts():
    # A long round whose deferred prompts were rejected by the filter tops up with fresh prompts.
    result = run(TailBatchingSpec(kind="tail-batching", over_sampling=1.5, predicted_long_share=0.2), steps=8,
                 dynamic_sampling=True)
    assert "long" in [r.round_kind for r in result.records]
    assert sum(r.dropped_groups for r in result.records) > 0
    assert all(r.trained_groups == 8 for r in result.records)


def test_large_group_splits_one_prompt_across_sub_groups():
    result = run(LargeGroupSpec(kind="large-group", samples_per_prompt=16, samples_per_round_factor=2.0))
    for r in result.records:
        assert r.trained_groups == 4 * r.distinct_prompts  # 16 samples = 4 sub-groups of G = 4 per prompt
        assert r.trained_groups == 16  # twice the baseline's samples per round
    assert result.off_policy_share == 0.0


def test_draft_reuse_counts_accepted_draft_tokens_apart_from_generated_ones():
    result = run(DraftReuseSpec(kind="draft-reuse", accepted_prefix=0.5, epochs_in_run=2.0))
    first_epoch, later = result.records[:3], result.records[3:]
    assert all(r.draft_tokens == 0 for r in first_epoch)  # nothing to reuse yet
    assert all(r.draft_tokens > 0 for r in later)
    for r in result.records:  # synchronous, no filter: every token is trained, drafted or generated
        assert r.trained_tokens == r.tokens_generated + r.draft_tokens
    assert result.draft_tokens == sum(r.draft_tokens for r in result.records)


def test_bounded_staleness_eta_zero_is_synchronous():
    result = run(BoundedStalenessSpec(kind="bounded-staleness", eta=0, trainer_gpu_share=0.25))
    assert result.off_policy_share == 0.0 and result.resumed_requests == 0
    assert all(r.max_staleness == 0 for r in result.records)


def test_bounded_staleness_streams_through_training_and_resumes_interrupted_requests():
    eta0 = run(BoundedStalenessSpec(kind="bounded-staleness", eta=0, trainer_gpu_share=0.25))
    eta2 = run(BoundedStalenessSpec(kind="bounded-staleness", eta=2, trainer_gpu_share=0.25))
    assert all(r.max_staleness <= 2 for r in eta2.records)  # η bounds every trained sample
    assert eta2.resumed_requests > 0  # weight updates interrupted requests, which resumed at once
    assert eta2.off_policy_share > 0.0  # resumed samples carry tokens of two versions
    # Generation overlaps training, so a trained batch takes less simulated wall time.
    assert eta2.step_seconds < eta0.step_seconds


def test_slime_baseline_refills_in_chunks_filters_and_discards_at_collection():
    base = run(SyncSpec(kind="sync", refill_factor=1.0), dynamic_sampling=True)
    assert sum(r.dropped_groups for r in base.records) > 0
    assert sum(r.discarded_tokens for r in base.records) > 0
    assert base.trained_rollout_throughput < base.rollout_throughput  # the paper's metric counts waste
    assert 0.0 < base.tail_share < 1.0 and base.longest_over_median >= 1.0
    april = run(AprilSpec(kind="april", refill_factor=2.0), dynamic_sampling=True)
    assert sum(r.discarded_tokens for r in april.records) == 0  # APRIL keeps its partials
    assert april.trained_rollout_throughput > base.trained_rollout_throughput


def test_tail_statistics_of_a_round():
    # Nine requests done by t = 1, the tenth at t = 10: the last 10 % took 90 % of the round.
    finished = [(1.0, 100)] * 9 + [(10.0, 1000)]
    share, spread = tail_statistics(finished, 0.0, 10.0)
    assert share == pytest.approx(0.9) and spread == pytest.approx(10.0)


LAW = LengthLaw(median_tokens=6000, sigma_between=0.4, sigma_within=0.4, prompt_tokens=100)


def make_rewards(**law: float) -> RewardModel:
    reward_law = RewardLaw(**{"pass_rate_mean": 0.6, **law})
    return RewardModel(law=reward_law, lengths=LengthModel(law=LAW, cap=16384, seed=1), quantum=1, seed=1)


def test_pass_rates_have_the_registered_mean_and_fall_with_difficulty():
    rewards = make_rewards(pass_rate_spread=1.0, difficulty_correlation=0.8)
    uids = range(4000)
    rates = [rewards.pass_rate(u) for u in uids]
    assert statistics.fmean(rates) == pytest.approx(0.6, abs=0.03)
    difficulty = [rewards.lengths.difficulty(u) for u in uids]
    assert statistics.correlation(difficulty, rates) < -0.5
    flat = make_rewards(pass_rate_spread=0.0)
    assert {round(flat.pass_rate(u), 9) for u in range(50)} == {0.6}


def test_shorter_samples_are_more_often_correct_and_capped_ones_never():
    rewards = make_rewards(pass_rate_spread=0.0, length_correlation=1.0)

    def sample(i: int, tokens: int, status: SampleStatus = SampleStatus.COMPLETED) -> Sample:
        s = Sample(group_id=f"g{i}", index=0, prompt_ids=[7, 0], answer="", response_ids=[0] * tokens,
                   versions=[0] * tokens, status=status)
        return s

    median = int(6000 * 2.718281828 ** rewards.lengths.difficulty(7))
    assert rewards.score(sample(1, median // 3)) == 1.0  # quantile < 0.6: correct when λ = 1
    assert rewards.score(sample(2, median * 3)) == 0.0
    assert rewards.score(sample(3, 16384, SampleStatus.TRUNCATED)) == 0.0
