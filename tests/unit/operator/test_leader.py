"""Leader election: renew failures of every kind are retried, and a leader that cannot renew steps down.

The step-down rule is pure (lease timing, last renewal, now) and is tested with plain numbers; the
renew loop runs its real threads against an in-memory Lease API that raises the errors a real client
raises (urllib3's, the kubernetes client's ApiException, KubeError, a bug's), with an injected clock
that only the test moves.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable
from typing import Any

import pytest
import urllib3.exceptions
from kubernetes.client.exceptions import ApiException

from rljob.common.kube import Kube, KubeError
from rljob.operator.leader import LeaderElector, LeaseTiming, must_step_down, renew_budget_s

WAIT_S = 30.0  # generous: the loops run on a shared, slow machine


class FakeClock:
    """A monotonic clock that moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


class LeaseApi(Kube):
    """One Lease held in memory, with the API server's optimistic concurrency on resourceVersion.

    `fail` (when set) is called before every request and may raise or block, standing in for a
    broken network or API server. Every request's timeout and every outcome are recorded.
    """

    def __init__(self) -> None:
        super().__init__(api=None)  # type: ignore[arg-type]
        self.lease: dict[str, Any] | None = None
        self.version = 0
        self.fail: Callable[[str], None] | None = None
        self.timeouts: list[float] = []
        self.failures = 0
        self.puts = 0
        self.failed = threading.Event()
        self.renewed_after_failure = threading.Event()
        self._lock = threading.Lock()

    def request(self, method: str, path: str, body: Any = None, *, timeout: float = 30.0, **_: Any) -> dict[str, Any]:
        self.timeouts.append(timeout)
        if self.fail is not None:
            try:
                self.fail(method)
            except BaseException:
                with self._lock:
                    self.failures += 1
                self.failed.set()
                raise
        with self._lock:
            if method == "GET":
                if self.lease is None:
                    raise KubeError(404, {"message": "not found"})
                return copy.deepcopy(self.lease)
            if method == "POST" and self.lease is not None:
                raise KubeError(409, {"message": "exists"})
            if method == "PUT" and body["metadata"].get("resourceVersion") != str(self.version):
                raise KubeError(409, {"message": "conflict"})
            self.version += 1
            self.lease = {**copy.deepcopy(body), "metadata": {**body["metadata"], "resourceVersion": str(self.version)}}
            if method == "PUT":
                self.puts += 1
                if self.failures:
                    self.renewed_after_failure.set()
            return copy.deepcopy(self.lease)


TIMING = LeaseTiming(lease_s=15, renew_deadline_s=10, renew_s=5)


def elector(api: LeaseApi, clock: FakeClock) -> LeaderElector:
    # Real seconds between attempts are short so the loops turn quickly; the deadline is on `clock`.
    return LeaderElector(
        api, namespace="ns", name="lease", identity="me",
        timing=LeaseTiming(lease_s=15, renew_deadline_s=10, renew_s=0.01), retry_s=0.01, clock=clock,
    )


def test_step_down_only_once_the_renew_deadline_has_passed() -> None:
    assert not must_step_down(TIMING, last_renewed=100.0, now=100.0)
    assert not must_step_down(TIMING, last_renewed=100.0, now=109.9)
    assert must_step_down(TIMING, last_renewed=100.0, now=110.0)
    assert must_step_down(TIMING, last_renewed=100.0, now=500.0)
    assert renew_budget_s(TIMING, last_renewed=100.0, now=104.0) == pytest.approx(6.0)


def test_timing_derives_the_deadline_and_a_request_timeout_well_inside_the_lease() -> None:
    timing = LeaseTiming.derived(lease_s=15, renew_s=5)
    assert timing.renew_deadline_s == pytest.approx(10.0)  # client-go's 10 s of 15
    # A GET and a PUT, twice, fit inside the deadline, which ends before the lease does.
    assert 4 * timing.request_timeout_s <= timing.renew_deadline_s < timing.lease_s
    assert LeaseTiming.derived(lease_s=15, renew_s=5, renew_deadline_s=12).renew_deadline_s == 12


@pytest.mark.parametrize(
    ("lease_s", "deadline_s", "renew_s", "field"),
    [(15, 15, 5, "lease_s"), (15, 20, 5, "lease_s"), (15, 10, 10, "renew_deadline_s"), (15, 10, 0, "renew_s")],
)
def test_inconsistent_timing_is_refused_naming_the_field(
    lease_s: float, deadline_s: float, renew_s: float, field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        LeaseTiming(lease_s=lease_s, renew_deadline_s=deadline_s, renew_s=renew_s)


def test_every_lease_call_carries_the_derived_request_timeout() -> None:
    api = LeaseApi()
    leader = elector(api, FakeClock())
    assert leader.try_acquire_or_renew()  # GET (404) and POST
    assert leader.try_acquire_or_renew()  # GET and PUT
    leader.release()  # GET and PUT
    assert len(api.timeouts) == 6
    assert set(api.timeouts) == {leader.timing.request_timeout_s}


RENEW_ERRORS: list[BaseException] = [
    urllib3.exceptions.ReadTimeoutError(None, "/apis/coordination.k8s.io", "Read timed out."),  # type: ignore[arg-type]
    urllib3.exceptions.ProtocolError("Connection aborted.", ConnectionResetError(104, "reset")),
    urllib3.exceptions.MaxRetryError(None, "/apis/coordination.k8s.io", None),  # type: ignore[arg-type]
    ApiException(status=0, reason="connection refused"),
    KubeError(500, {"message": "etcdserver: request timed out"}),
    ValueError("a bug in the renew path"),
]


@pytest.mark.parametrize("error", RENEW_ERRORS, ids=lambda e: type(e).__name__)
def test_a_renew_error_of_any_type_is_logged_and_retried(
    error: BaseException, caplog: pytest.LogCaptureFixture
) -> None:
    """Before the fix only KubeError was caught: anything else ended the renew thread silently."""
    api, clock = LeaseApi(), FakeClock()
    leader = elector(api, clock)
    assert leader.acquire()
    errors_left = [3]

    def flaky(method: str) -> None:
        if errors_left[0] > 0:
            errors_left[0] -= 1
            raise error

    api.fail = flaky
    lost = threading.Event()
    stop = threading.Event()
    with caplog.at_level(logging.WARNING, logger="rljob.operator.leader"):
        renewer, _ = leader.keep_renewing(lost.set, stop)
        try:
            assert api.renewed_after_failure.wait(WAIT_S), "the renew loop stopped after the error"
            assert renewer.is_alive()
        finally:
            stop.set()
    assert api.failures == 3
    assert not lost.is_set()  # the clock never reached the deadline
    assert str(error) in caplog.text, "the error was not logged"


@pytest.mark.parametrize("error", RENEW_ERRORS, ids=lambda e: type(e).__name__)
def test_a_leader_that_cannot_renew_steps_down_at_the_deadline(error: BaseException) -> None:
    api, clock = LeaseApi(), FakeClock()
    leader = elector(api, clock)
    assert leader.acquire()

    def broken(method: str) -> None:
        raise error

    api.fail = broken
    lost = threading.Event()
    stop = threading.Event()
    leader.keep_renewing(lost.set, stop)
    try:
        assert api.failed.wait(WAIT_S)
        clock.advance(10.0)
        assert lost.wait(WAIT_S), "the leader kept leading past its renew deadline"
    finally:
        stop.set()


def test_a_renew_call_that_hangs_does_not_keep_the_leader_leading() -> None:
    """The watchdog does not depend on the renewing thread: a call stuck forever still ends leadership."""
    api, clock = LeaseApi(), FakeClock()
    leader = elector(api, clock)
    assert leader.acquire()
    release = threading.Event()
    hanging = threading.Event()

    def hang(method: str) -> None:
        hanging.set()
        release.wait()

    api.fail = hang
    lost = threading.Event()
    stop = threading.Event()
    leader.keep_renewing(lost.set, stop)
    try:
        assert hanging.wait(WAIT_S)
        clock.advance(10.0)
        assert lost.wait(WAIT_S)
    finally:
        stop.set()
        release.set()


def test_a_standby_keeps_trying_to_acquire_through_non_kube_errors() -> None:
    api, clock = LeaseApi(), FakeClock()
    errors_left = [2]

    def flaky(method: str) -> None:
        if errors_left[0] > 0:
            errors_left[0] -= 1
            raise urllib3.exceptions.ProtocolError("Connection aborted.")

    api.fail = flaky
    assert elector(api, clock).acquire()
    assert api.failures == 2
    assert api.lease is not None and api.lease["spec"]["holderIdentity"] == "me"
