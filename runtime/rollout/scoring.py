"""What the round does with a finished group besides generating it: reward it, then keep or filter it.

The scheduler is handed a `GroupScoring` built from the job's spec (the job's reward as a
`GroupScorer`, DAPO's `dynamic_sampling_filter` when the algorithm asks for it), so it never calls
back into whoever built it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from rljob.runtime.algorithms.advantages import dynamic_sampling_keep
from rljob.runtime.rollout.sample import Group, Sample

ScoreFn = Callable[[Sample], float]
# Rewards of some finished samples of one group, in their order; may call user code (async, batched).
GroupScorer = Callable[[Group, list[Sample]], Awaitable[list[float]]]
GroupFilter = Callable[[Group], bool]


def dynamic_sampling_filter(group: Group) -> bool:
    """DAPO dynamic sampling on a rewarded group: keep it only when its rewards disagree
    (`algorithms.advantages.dynamic_sampling_keep`, with its tolerance)."""
    return dynamic_sampling_keep(group.rewards())


@dataclass(frozen=True)
class GroupScoring:
    """The reward of a group's finished samples and the filter on finished groups."""

    score: ScoreFn | None = None  # rewards one sample synchronously
    scorer: GroupScorer | None = None  # when given, replaces `score`: a group's samples at once
    keep: GroupFilter | None = None  # None keeps every group

    def __post_init__(self) -> None:
        if self.score is None and self.scorer is None:
            raise ValueError("the rollout scheduler needs a score function or a scorer")

    async def reward(self, group: Group) -> None:
        """Reward the finished, not yet rewarded samples of `group`."""
        pending = [s for s in group.samples if s.status.finished and s.reward is None]
        if not pending:
            return
        if self.scorer is not None:
            rewards = await self.scorer(group, pending)
        else:
            assert self.score is not None  # __post_init__ requires one of the two
            rewards = [self.score(s) for s in pending]
        for sample, reward in zip(pending, rewards, strict=True):
            sample.reward = float(reward)

    def kept(self, group: Group) -> bool:
        """Whether the filter keeps a finished, rewarded group."""
        return self.keep is None or self.keep(group)
