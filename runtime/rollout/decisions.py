"""The round's decisions as pure functions: what to launch next, and where a finished group goes.

The scheduler (scheduler.py) does the I/O (tasks, engines, the buffer) and asks these functions what
to do; they read only counts and flags, so every case is a row of a table in
tests/unit/runtime/rollout/test_decisions.py.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RoundCounts:
    """The groups of the running round, by where they stand (the inputs of the launch decision)."""

    batch_size: int  # groups the round returns
    target: int  # viable groups to keep launched (Strategy.launch_target)
    accepted: int = 0  # finished, rewarded, kept: trained this step
    in_flight: int = 0  # launched, not yet harvested
    cut: int = 0  # harvested unfinished (segment cap) or surplus: bound for the buffer
    retry: int = 0  # engine failed, or over the staleness bound at acceptance: relaunch at once
    buffered: int = 0  # groups in the partial buffer (earlier rounds' cut groups)


class Launch(enum.Enum):
    """Which group the next launch takes."""

    RETRY = "retry"  # the oldest group waiting for a retry, segment-capped
    CONTINUE_CUT = "continue-cut"  # this round's oldest cut group, without the segment cap
    NEXT = "next"  # the oldest buffered group, else a fresh prompt


def next_launch(c: RoundCounts) -> Launch | None:
    """One-by-one top-up (Strategy.refill_groups is None): the next group to launch, or None when enough are.

    Groups cut by the segment cap count against the launch target. When the target is spent and fewer
    than N groups can still finish, fresh prompts replace the cut ones (that is what truncation is
    for) -- unless the buffer with this round's cuts already holds a round's worth: then the round
    continues its own cut groups without the cap, so a cap set far too low can neither grow the buffer
    without bound nor stall the round (back-pressure).
    """
    viable = c.accepted + c.in_flight
    if viable >= c.batch_size and viable + c.cut >= c.target:
        return None
    if c.retry:
        return Launch.RETRY
    if c.cut and viable + c.cut >= c.target and c.buffered + c.cut >= c.target:
        return Launch.CONTINUE_CUT
    return Launch.NEXT


def chunk_launches(c: RoundCounts, chunk: int) -> int:
    """Chunked top-up (slime's loop): how many groups to launch now, each a retry if one waits, else next.

    The first top-up of a round launches the whole launch target; afterwards, whenever rejections
    leave fewer than N groups viable, another `chunk` at once (so a baseline with chunk = N
    over-samples too, and discards what is left at collection).
    """
    step = max(1, chunk)
    first = c.target if not (c.in_flight or c.accepted or c.cut) else 0
    missing = c.batch_size - (c.accepted + c.in_flight + first)
    return first + (step * math.ceil(missing / step) if missing > 0 else 0)


def ahead_launches(in_flight: int, done_ahead: int, target: int) -> int:
    """While the trainer trains (Strategy.overlaps_training): how many groups to launch now.

    `target` groups (Strategy.ahead_target: one batch) are kept in flight or done ahead (finished,
    waiting for the next step), so groups done ahead never pile up faster than the steps take them.
    """
    return max(0, target - in_flight - done_ahead)


def fill_launches(capacity: int | None, requests: int, samples_per_prompt: int) -> int:
    """Extra groups to launch on an engine with `capacity` batch slots and `requests` samples in flight
    (the `fill_engines` option): as many whole groups as its free slots hold, none when it cannot tell.

    Without it the batch empties at the end of an APRIL round: the launch target is spent, the engine's
    queue runs dry, and every slot a finished sample frees idles until the batch is collected. The extra
    groups are aborted at collection and buffered like any partial, and the next round launches from the
    buffer first, so the buffer stays bounded: a round that finds more than its launch target buffered
    launches only from it and shrinks it by the batch it returns.
    """
    if capacity is None:
        return 0
    return max(0, capacity - requests) // max(1, samples_per_prompt)


class Outcome(enum.Enum):
    """Where a harvested group goes."""

    RETRY = "retry"  # unfinished because its engine failed: relaunched at once on a healthy engine
    CUT = "cut"  # unfinished (segment cap, abort): buffered, resumed next round
    REGENERATE = "regenerate"  # finished, but samples over the staleness bound: reset them, relaunch
    FILTERED = "filtered"  # finished, rejected by the group filter (DAPO dynamic sampling)
    ACCEPTED = "accepted"  # finished and kept: trained this step
    SURPLUS = "surplus"  # finished and kept, but the batch is full: buffered


@dataclass(frozen=True)
class Harvest:
    """What the scheduler knows of a group whose task returned."""

    finished: bool  # every sample completed or truncated
    engine_failed: bool = False
    over_bound: bool = False  # some sample over the staleness bound (only asked of finished groups)
    kept: bool = True  # the group filter's verdict (only asked of finished groups within the bound)


def classify(h: Harvest, accepted: int, batch_size: int) -> Outcome:
    """Where a harvested group goes, `accepted` groups of `batch_size` being collected already.

    An engine failure is retried now on a healthy engine; a segment cut waits for the next round, or
    truncation would not shorten this one.
    """
    if not h.finished:
        return Outcome.RETRY if h.engine_failed else Outcome.CUT
    if h.over_bound:
        return Outcome.REGENERATE
    if not h.kept:
        return Outcome.FILTERED
    return Outcome.ACCEPTED if accepted < batch_size else Outcome.SURPLUS
