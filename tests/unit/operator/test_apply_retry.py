"""Apply retries: capped exponential backoff, the per-job failure count, and how the status reports them."""

from __future__ import annotations

import math

import pytest

from rljob.api.status import RLJobStatus
from rljob.operator.apply_retry import ApplyRetries, Backoff
from rljob.operator.lifecycle import ApplyResult
from tests.unit.operator.test_lifecycle import _obs, _run, _spec


def test_backoff_doubles_up_to_its_cap_and_never_overflows() -> None:
    backoff = Backoff(base_s=5, cap_s=60)
    assert [backoff.delay(n) for n in range(0, 7)] == [0, 5, 10, 20, 40, 60, 60]
    assert backoff.delay(10_000) == 60  # an outage of days: still the cap
    with pytest.raises(ValueError, match="base"):
        Backoff(base_s=10, cap_s=5)


def test_backoff_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLJOB_APPLY_BACKOFF_SECONDS", "2")
    monkeypatch.setenv("RLJOB_APPLY_BACKOFF_CAP_SECONDS", "30")
    assert Backoff.from_env() == Backoff(2, 30)


def test_failures_are_counted_scheduled_taken_once_and_forgotten_on_success() -> None:
    retries, job = ApplyRetries(), ("ns", "demo")
    now_due = Backoff(base_s=1e-9, cap_s=1e-9)  # due at once: the schedule itself is the backoff's
    first = retries.failed(job, "refused", now_due)
    assert first.count == 1 and retries.pending(job) == first
    second = retries.failed(job, "timed out", now_due)
    assert second.count == 2 and second.since == first.since and second.last_error == "timed out"
    assert retries.take_due() == [job]
    assert retries.take_due() == [], "an attempt in flight is not taken twice"
    assert math.isinf(retries.pending(job).next_at)
    later = retries.failed(job, "refused", Backoff(base_s=3600, cap_s=3600))
    assert later.count == 3 and retries.take_due() == [], "not due before its delay"
    assert "3 failed attempts over" in later.summary(later.since + 200) and "(last: refused)" in later.summary(0)
    retries.succeeded(job)
    assert retries.pending(job) is None and len(retries) == 0


def test_the_condition_names_the_attempt_and_the_retries_an_apply_needed() -> None:
    refused = ApplyResult(1, error="Job demo-trainer: HTTP 403: exceeded quota", attempt=3)
    cond = _run(_spec(), RLJobStatus(), _obs(), applied=refused).status.condition("ChildrenApplied")
    assert cond.reason == "ApplyFailed" and "exceeded quota (attempt 3; retried" in cond.message
    ok = ApplyResult(1, attempt=4, retried="3 failed attempts over 35 s (last: refused)")
    cond = _run(_spec(), RLJobStatus(), _obs(), applied=ok).status.condition("ChildrenApplied")
    assert cond.reason == "Applied" and cond.message.endswith("applied after 3 failed attempts over 35 s (last: refused)")
