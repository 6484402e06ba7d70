"""The one staleness rule (rollout/staleness.py) and its callers: scheduler, trainer, batch statistics."""

from __future__ import annotations

import pytest

from rljob.runtime.batch_stats import summarize_batch
from rljob.runtime.rollout.sample import Group, Sample
from rljob.runtime.rollout.staleness import (
    is_stale,
    over_bound,
    sample_staleness,
    stale_flags,
    stale_token_count,
    token_staleness,
)


@pytest.mark.parametrize(
    ("token_version", "policy_version", "staleness", "stale"),
    [(5, 5, 0, False), (4, 5, 1, True), (0, 3, 3, True), (6, 5, -1, False)],  # last: an engine ahead
)
def test_a_tokens_staleness_and_whether_it_is_stale(token_version, policy_version, staleness, stale):
    assert token_staleness(token_version, policy_version) == staleness
    assert is_stale(token_version, policy_version) is stale


@pytest.mark.parametrize(
    ("versions", "policy_version", "max_staleness", "staleness", "over"),
    [
        ([], 7, 0, 0, False),  # nothing generated yet
        ([3, 3, 3], 3, 0, 0, False),
        ([2, 3], 3, 0, 1, True),  # max_staleness 0: any older token is over the bound
        ([1, 2, 3], 3, 2, 2, False),  # exactly at the bound: kept
        ([0, 2, 3], 3, 2, 3, True),
        ([3, 1, 3], 3, 1, 2, True),  # the oldest token counts, wherever it is (a lagging engine)
    ],
)
def test_a_samples_staleness_is_its_oldest_tokens(versions, policy_version, max_staleness, staleness, over):
    assert sample_staleness(versions, policy_version) == staleness
    assert over_bound(versions, policy_version, max_staleness) is over
    sample = Sample(group_id="g", index=0, prompt_ids=[1], answer="", response_ids=[0] * len(versions),
                    logprobs=[0.0] * len(versions), versions=list(versions))
    assert sample.staleness(policy_version) == staleness


def test_stale_tokens_are_the_ones_an_older_policy_generated():
    versions = [1, 1, 2, 3, 2]
    assert stale_flags(versions, 3) == [True, True, True, False, True]
    assert stale_token_count(versions, 3) == 4
    assert stale_token_count(versions, 1) == 0


def test_batch_statistics_use_the_rule():
    def sample(i: int, versions: list[int]) -> Sample:
        return Sample(group_id="g", index=i, prompt_ids=[1], answer="", response_ids=[9] * len(versions),
                      logprobs=[0.0] * len(versions), versions=versions, reward=1.0)

    stats = summarize_batch([Group("g", "p", [sample(0, [1, 2, 3]), sample(1, [3, 3]), sample(2, [])])], 3)
    assert stats.off_policy_tokens == 2  # the tokens of versions 1 and 2
    assert stats.staleness == [2, 0, 0]
    assert stats.staleness_max == 2
