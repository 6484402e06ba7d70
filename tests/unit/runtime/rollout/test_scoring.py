"""GroupScoring and the DAPO filter the runtime and the simulator share (rollout/scoring.py)."""

from __future__ import annotations

import pytest

from rljob.runtime.rollout.sample import Group, Sample, SampleStatus
from rljob.runtime.rollout.scoring import GroupScoring, dynamic_sampling_filter


def group(rewards: list[float | None], statuses: list[SampleStatus] | None = None) -> Group:
    statuses = statuses or [SampleStatus.COMPLETED] * len(rewards)
    samples = [Sample(group_id="g", index=i, prompt_ids=[0], answer="", reward=r, status=st)
               for i, (r, st) in enumerate(zip(rewards, statuses, strict=True))]
    return Group(group_id="g", prompt_text="", samples=samples)


@pytest.mark.parametrize(
    ("rewards", "kept"),
    [
        ([1.0, 0.0, 1.0], True),
        ([1.0, 1.0, 1.0], False),
        ([0.0, 0.0, 0.0], False),
        ([0.5, 0.5 + 1e-12, 0.5], False),  # within the tolerance: no learning signal
        ([0.5, 0.5 + 1e-6, 0.5], True),
    ],
)
def test_dynamic_sampling_filter_keeps_only_groups_with_disagreeing_rewards(rewards, kept):
    assert dynamic_sampling_filter(group(rewards)) is kept


async def test_reward_scores_only_finished_unrewarded_samples():
    seen: list[int] = []

    def score(sample: Sample) -> float:
        seen.append(sample.index)
        return 10.0 + sample.index

    g = group([None, 3.0, None], [SampleStatus.COMPLETED, SampleStatus.TRUNCATED, SampleStatus.ABORTED])
    await GroupScoring(score=score).reward(g)
    assert seen == [0]
    assert [s.reward for s in g.samples] == [10.0, 3.0, None]


async def test_a_group_scorer_replaces_the_per_sample_score():
    async def scorer(g: Group, samples: list[Sample]) -> list[float]:
        return [float(len(samples))] * len(samples)

    g = group([None, None])
    await GroupScoring(score=lambda _s: -1.0, scorer=scorer).reward(g)
    assert g.rewards() == [2.0, 2.0]


def test_scoring_needs_a_reward_and_keeps_every_group_without_a_filter():
    with pytest.raises(ValueError, match="score function or a scorer"):
        GroupScoring()
    assert GroupScoring(score=lambda _s: 0.0).kept(group([1.0, 1.0]))
    assert not GroupScoring(score=lambda _s: 0.0, keep=dynamic_sampling_filter).kept(group([1.0, 1.0]))
