"""Group-normalised advantages (GRPO, and DAPO which uses the same estimator) and the DAPO filter.

Each sample's advantage is its reward relative to the other samples of the same prompt:
A_i = (r_i - mean(r)) / (std(r) + eps). std is the unbiased (Bessel-corrected) estimate, as in
the GRPO reference implementations. DAPO's dynamic sampling drops groups whose rewards all agree
(they carry zero advantage and only dilute the batch); the rollout scheduler applies that filter
with `dynamic_sampling_keep` while harvesting (through `rollout.scoring.dynamic_sampling_filter`, which the
simulator uses too), so the trainer never sees such groups under DAPO.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

ADVANTAGE_EPS = 1e-6


def group_advantages(
    rewards: Sequence[float], include: Sequence[bool] | None = None, eps: float = ADVANTAGE_EPS
) -> list[float]:
    """(r - mean) / (std + eps) over the included samples; excluded samples get advantage 0.

    `include` lets a caller leave samples out of the group statistics. The trainer does not: under
    off-policy mode `mask` too, every sample's reward stays in the baseline and only the loss of
    stale tokens is masked, because dropping the stale samples of a resumed group (often all but its
    one straggler) would zero the straggler's advantage and bias training against long answers.
    With fewer than two included samples every advantage is 0 (no baseline to compare against).
    """
    flags = list(include) if include is not None else [True] * len(rewards)
    if len(flags) != len(rewards):
        raise ValueError(f"{len(rewards)} rewards but {len(flags)} include flags")
    kept = [r for r, keep in zip(rewards, flags) if keep]
    if len(kept) < 2:
        return [0.0] * len(rewards)
    mean = sum(kept) / len(kept)
    std = math.sqrt(sum((r - mean) ** 2 for r in kept) / (len(kept) - 1))
    return [(r - mean) / (std + eps) if keep else 0.0 for r, keep in zip(rewards, flags)]


def dynamic_sampling_keep(group_rewards: Sequence[float], tol: float = 1e-9) -> bool:
    """DAPO dynamic sampling: keep a group only when its rewards are not all equal."""
    if not group_rewards:
        return False
    return max(group_rewards) - min(group_rewards) > tol
