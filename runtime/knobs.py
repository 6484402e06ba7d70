"""Partial-rollout knobs that may change while a job runs (autotuner, operator, user).

The runner polls its knob sources at every round boundary and applies a change before the next
round starts, so a round always runs with one consistent set of knobs, and each step's metrics
record the values in force.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from rljob.api import knob_limits as limits
from rljob.runtime.rollout.scheduler import RolloutScheduler


@dataclass(frozen=True)
class KnobValues:
    """New values; None leaves a knob unchanged."""

    over_sampling: float | None = None
    truncation_k: float | None = None
    truncation_max_tokens: int | None = None
    source: str = ""
    reason: str = ""


class KnobSource(Protocol):
    """Something that may have new knob values at a round boundary (file, RLJob status, local tuner)."""

    def poll(self) -> KnobValues | None: ...


def apply_knobs(scheduler: RolloutScheduler, knobs: KnobValues) -> list[str]:
    """Install new knob values on the scheduler; returns a description of each change made."""
    changes = []
    strategy = scheduler.strategy
    if knobs.over_sampling is not None and hasattr(strategy, "over_sampling"):
        if strategy.over_sampling != knobs.over_sampling:
            changes.append(f"over_sampling {strategy.over_sampling:g} -> {knobs.over_sampling:g}")
            strategy.over_sampling = max(limits.OVER_SAMPLING_MIN, knobs.over_sampling)
    t = scheduler.truncation
    if knobs.truncation_k is not None and t.k != knobs.truncation_k:
        changes.append(f"truncation_k {t.k:g} -> {knobs.truncation_k:g}")
        t.k = knobs.truncation_k
        if t.mode == "none":
            t.mode = "sigma"
    if knobs.truncation_max_tokens is not None and t.max_tokens != knobs.truncation_max_tokens:
        changes.append(f"truncation_max_tokens {t.max_tokens} -> {knobs.truncation_max_tokens}")
        t.max_tokens = knobs.truncation_max_tokens
        t.mode = "tokens"
    return changes


def knob_values(scheduler: RolloutScheduler) -> dict[str, float]:
    """The partial-rollout knob values in force (exported with every step)."""
    knobs = {
        "over_sampling": float(getattr(scheduler.strategy, "over_sampling", 1.0)),
        "max_staleness": float(scheduler.config.max_staleness),
        "truncation_k": float(scheduler.truncation.k) if scheduler.truncation.mode == "sigma" else 0.0,
    }
    knobs["segment_cap_tokens"] = float(scheduler.segment_cap() or 0)
    # With the cap at this floor a lower threshold cuts nothing more (the autotuner's truncation loop stops).
    knobs["segment_cap_floor_tokens"] = float(scheduler.segment_cap_floor())
    return knobs
