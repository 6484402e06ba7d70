"""Retries of a job's apply: without end, with capped exponential backoff, counted so that they are reported.

An apply fails while the API server, an admission webhook or a quota refuses (or cannot be reached).
None of these is the job's fault and each may last longer than any fixed number of retries, so a
failed apply is retried forever: the delay doubles from `base_s` up to `cap_s` (a long outage costs
one attempt per job and `cap_s`, and the job is applied at most `cap_s` after it ends).

The operator's own retry loop does this, not kopf's handler retries: kopf keeps its retry state in
annotations on the RLJob, and while the API server is unreachable it cannot write them, so it drops
the handler (seen in tests/integration/test_operator_outage.py: one attempt, then none until its watch
re-listed). The failures are counted here, per job, in this process, so the count also survives to be
reported once the apply goes through (the ChildrenApplied condition and an `AppliedAfterRetries` Event).
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """Capped exponential backoff: `base_s`, 2·`base_s`, 4·`base_s`, …, never more than `cap_s`."""

    base_s: float = 5.0
    cap_s: float = 60.0

    def __post_init__(self) -> None:
        if self.base_s <= 0 or self.cap_s < self.base_s:
            raise ValueError(f"backoff needs 0 < base ({self.base_s}) <= cap ({self.cap_s})")

    def delay(self, failures: int) -> float:
        """Seconds to wait after the `failures`-th consecutive failure (1-based)."""
        if failures < 1:
            return 0.0
        # min() before the power would overflow: 2**failures grows without bound during a long outage.
        doublings = min(failures - 1, 62)
        return min(self.cap_s, self.base_s * 2.0**doublings)

    @classmethod
    def from_env(cls) -> Backoff:
        """RLJOB_APPLY_BACKOFF_SECONDS (first delay, default 5), RLJOB_APPLY_BACKOFF_CAP_SECONDS (default 60)."""
        return cls(
            base_s=float(os.environ.get("RLJOB_APPLY_BACKOFF_SECONDS", "5")),
            cap_s=float(os.environ.get("RLJOB_APPLY_BACKOFF_CAP_SECONDS", "60")),
        )


@dataclass(frozen=True)
class Failures:
    """Consecutive failed applies of one job: how many, since when, the last error, when to try again.

    Times are time.monotonic() seconds; `next_at` is infinite while an attempt is in flight.
    """

    count: int
    since: float
    last_error: str
    next_at: float

    def summary(self, now: float) -> str:
        """`N failed attempts over S s (last: error)`, for the condition and the Event."""
        return f"{self.count} failed attempt{'s' if self.count != 1 else ''} over {now - self.since:.0f} s (last: {self.last_error})"


class ApplyRetries:
    """Consecutive apply failures per job (namespace, name) in this operator process; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failures: dict[tuple[str, str], Failures] = {}

    def failed(self, job: tuple[str, str], error: str, backoff: Backoff) -> Failures:
        """Count one more failure of `job`'s apply and schedule its next attempt after `backoff`'s delay."""
        now = time.monotonic()
        with self._lock:
            old = self._failures.get(job)
            count, since = (1, now) if old is None else (old.count + 1, old.since)
            failures = Failures(count, since, error, now + backoff.delay(count))
            self._failures[job] = failures
            return failures

    def take_due(self) -> list[tuple[str, str]]:
        """The jobs whose next attempt is due, marked in flight (not due again until failed() or succeeded())."""
        now = time.monotonic()
        with self._lock:
            due = [job for job, f in self._failures.items() if f.next_at <= now]
            for job in due:
                f = self._failures[job]
                self._failures[job] = Failures(f.count, f.since, f.last_error, math.inf)
            return due

    def pending(self, job: tuple[str, str]) -> Failures | None:
        """The failures since `job`'s last successful apply (None: its last apply succeeded)."""
        with self._lock:
            return self._failures.get(job)

    def succeeded(self, job: tuple[str, str]) -> None:
        """Forget `job`'s failures: its apply went through."""
        with self._lock:
            self._failures.pop(job, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._failures)
