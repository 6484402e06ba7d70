"""Rollout strategies: how many groups a round launches and what happens to the unfinished ones.

The scheduler (scheduler.py) owns the mechanics (launch, harvest, abort, drain, buffer); a strategy
only answers the questions that differ between strategies, so new ones (the simulator's tail
batching, bounded-staleness async, large-N sampling) plug in without touching the mechanics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Strategy:
    """Synchronous baseline: launch exactly the groups needed and wait for all of them."""

    name: str = "sync"
    # None: top up one group per rejected one, up to the launch target (the project's default).
    # K: whenever fewer than batch_size groups are viable (accepted + in flight), launch K more at
    # once, as slime does with `--over-sampling-batch-size` (K = N for its baseline, N' for APRIL).
    refill_granularity: int | None = None

    def launch_target(self, batch_size: int) -> int:
        """Viable groups to keep launched (accepted + in flight) while collecting `batch_size`."""
        return batch_size

    def refill_groups(self, batch_size: int) -> int | None:
        """Groups launched per top-up in chunked mode, or None for one-by-one top-ups."""
        del batch_size
        return self.refill_granularity

    def ahead_target(self, batch_size: int) -> int:
        """Groups to keep in flight or done ahead while the trainer trains (only asked of strategies
        that overlap training): one batch."""
        return batch_size

    @property
    def keeps_partials(self) -> bool:
        """Whether groups still unfinished (or surplus) at collection are buffered (True) or
        aborted and discarded (False, slime's baseline; their tokens are counted as discarded)."""
        return False

    @property
    def truncates(self) -> bool:
        """Whether the segment cap (length truncation) applies."""
        return False

    @property
    def overlaps_training(self) -> bool:
        """Whether the engines keep generating while the trainer trains (the round's groups still in
        flight at collection run on, and more are launched, until the weight sync interrupts them)."""
        return False


@dataclass
class AprilStrategy(Strategy):
    """APRIL: over-sample groups, stop upon collection, abort the rest, resume them next round."""

    name: str = "april"
    over_sampling: float = 2.0

    def launch_target(self, batch_size: int) -> int:
        return max(batch_size, math.ceil(self.over_sampling * batch_size))

    @property
    def keeps_partials(self) -> bool:
        return True

    @property
    def truncates(self) -> bool:
        return True


@dataclass
class AsyncStrategy(AprilStrategy):
    """Asynchronous APRIL: APRIL's round, and the engines keep generating while the trainer trains.

    The groups still in flight when the batch is collected keep generating under the weights they
    started with, and more are launched so that `ahead_target` groups are in flight or done ahead.
    When the trainer has stepped, the weight sync interrupts them (abort, drain); they resume next
    round under the new weights, so one response carries tokens of several versions, each stamped
    with its own. `maxStaleness` is enforced when a group is accepted (decisions.classify).
    """

    name: str = "async"
    # Batches of work kept in flight or done ahead while the trainer trains. One: what generates while
    # step v trains is trained at v + 1 at the earliest, v + 1 takes one batch, and its own round
    # over-samples again. More waits longer in the pool, where it ages past maxStaleness and is thrown
    # away (benchmarks/async_ahead.py measures one batch against the over-sampled target).
    ahead_batches: float = 1.0

    def ahead_target(self, batch_size: int) -> int:
        return max(1, math.ceil(self.ahead_batches * batch_size))

    @property
    def overlaps_training(self) -> bool:
        return True


STRATEGY_NAMES = ("sync", "april", "async")


def make_strategy(name: str, over_sampling: float = 2.0) -> Strategy:
    """Strategy from its config name (`sync`, `april` or `async`)."""
    if name == "sync":
        return Strategy()
    if name == "april":
        return AprilStrategy(over_sampling=over_sampling)
    if name == "async":
        return AsyncStrategy(over_sampling=over_sampling)
    raise ValueError(f"unknown rollout strategy {name!r}: use one of {', '.join(STRATEGY_NAMES)}")
