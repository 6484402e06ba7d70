"""Batch statistics: exact off-policy share and staleness from per-token versions, lengths, rewards."""

from __future__ import annotations

import pytest

from rljob.runtime.batch_stats import BatchStats, percentile, summarize_batch
from rljob.runtime.rollout.sample import Group, Sample


def sample(index: int, segments: list[tuple[int, int]], reward: float | None = None) -> Sample:
    """A sample whose response was generated in `segments` of (tokens, policy version)."""
    s = Sample("g", index, prompt_ids=[1, 2, 3], answer="")
    for tokens, version in segments:
        s.append([7] * tokens, [-0.5] * tokens, version)
    s.reward = reward
    return s


def test_percentile_is_the_nearest_rank():
    assert percentile([], 50) == 0.0
    assert percentile([5], 99) == 5.0
    values = list(range(1, 101))  # 1..100
    assert percentile(values, 50) == 50.0 and percentile(values, 99) == 99.0 and percentile(values, 100) == 100.0
    assert percentile([3, 1, 2], 50) == 2.0  # order of the input does not matter


def test_an_empty_batch_has_zero_statistics():
    stats = summarize_batch([], policy_version=4)
    assert stats == BatchStats() and stats.off_policy_token_ratio == 0.0


def test_off_policy_tokens_and_staleness_are_counted_per_token():
    # Trained at version 3: a resumed sample with 4 tokens of version 1 and 2 of version 3, and a fresh
    # one of 6 tokens at version 3.
    resumed = sample(0, [(4, 1), (2, 3)], reward=1.0)
    fresh = sample(1, [(6, 3)], reward=0.0)
    stats = summarize_batch([Group("g", "p", [resumed, fresh])], policy_version=3)
    assert stats.samples == 2 and stats.response_tokens == 12
    assert stats.off_policy_tokens == 4 and stats.off_policy_token_ratio == pytest.approx(4 / 12)
    # Staleness: versions between the trainer and a sample's oldest token.
    assert stats.staleness == [2, 0] and stats.staleness_max == 2 and stats.staleness_mean == 1.0
    assert stats.version_span_mean == 1.5  # two versions in the resumed sample, one in the fresh one
    assert stats.reward_mean == 0.5


def test_lengths_and_an_unscored_sample():
    samples = [sample(i, [(n, 0)]) for i, n in enumerate([2, 4, 6, 8])]
    samples[0].reward = 1.0  # the others are unscored: they count as 0
    stats = summarize_batch([Group("g", "p", samples[:2]), Group("h", "p", samples[2:])], policy_version=0)
    assert stats.lengths == [2, 4, 6, 8] and stats.length_max == 8
    assert stats.length_mean == 5.0 and stats.length_std == pytest.approx(5 ** 0.5)
    assert stats.length_p50 == 4.0 and stats.length_p99 == 8.0
    assert stats.reward_mean == 0.25 and stats.off_policy_tokens == 0
