"""The simulator's extra strategies, as runtime Strategy subclasses, and the spec → strategy map.

`sync`, `april` and `async` are the runtime's own classes, unchanged. The others answer the same
questions (how many groups to launch, whether the segment cap applies); what they change beyond
that lives outside the scheduler, in the sim loop that drives it (runner.py):

- tail batching: the loop turns a short round's aborted groups back into prompts for long rounds;
- bounded staleness: not rounds at all; async_stream.py streams groups while a trainer trains
  (the strategy object only names it);
- large groups: the prompt stream repeats each prompt across sub-groups;
- draft reuse: the engines credit the accepted draft prefix at verification cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rljob.runtime.rollout.strategy import AprilStrategy, AsyncStrategy, Strategy
from rljob.runtime.sim.scenario import (
    AprilSpec,
    AsyncSpec,
    BoundedStalenessSpec,
    DraftReuseSpec,
    LargeGroupSpec,
    StrategySpec,
    SyncSpec,
    TailBatchingSpec,
)


@dataclass
class TailBatchingStrategy(Strategy):
    """RollPacker tail batching: short rounds over-provision and keep the first finishers; a long
    round (set by the loop) launches exactly its batch of deferred long prompts."""

    name: str = "tail-batching"
    over_sampling: float = 1.25
    long_round: bool = False

    def launch_target(self, batch_size: int) -> int:
        return batch_size if self.long_round else max(batch_size, math.ceil(self.over_sampling * batch_size))

    @property
    def keeps_partials(self) -> bool:
        """Aborted groups go to the buffer, where the loop turns them back into long prompts."""
        return True


@dataclass
class BoundedStalenessStrategy(AprilStrategy):
    """AReaL-style asynchronous rollout, streamed by async_stream.py (no rounds)."""

    name: str = "async-eta"
    eta: int = 2


def _refill(spec: SyncSpec | AprilSpec, batch_size: int) -> int | None:
    return None if spec.refill_factor is None else max(1, math.ceil(spec.refill_factor * batch_size))


def build_sim_strategy(spec: StrategySpec, batch_size: int) -> Strategy:
    """The runtime Strategy object a strategy spec runs with (batch_size N sizes chunked refills)."""
    if isinstance(spec, AprilSpec):
        return AprilStrategy(name=spec.name, over_sampling=spec.over_sampling,
                             refill_granularity=_refill(spec, batch_size))
    if isinstance(spec, AsyncSpec):  # the runtime's own: the sim loop runs it as the runner does
        return AsyncStrategy(name=spec.name, over_sampling=spec.over_sampling)
    if isinstance(spec, SyncSpec):
        return Strategy(name=spec.name, refill_granularity=_refill(spec, batch_size))
    if isinstance(spec, TailBatchingSpec):
        return TailBatchingStrategy(name=spec.name, over_sampling=spec.over_sampling)
    if isinstance(spec, BoundedStalenessSpec):
        return BoundedStalenessStrategy(name=spec.name, over_sampling=spec.over_sampling, eta=spec.eta)
    if isinstance(spec, LargeGroupSpec | DraftReuseSpec):
        return Strategy(name=spec.name)
    raise TypeError(f"no strategy for {spec!r}")
