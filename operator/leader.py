"""Leader election on a coordination.k8s.io/v1 Lease, so several operator replicas run with one active.

The rules are client-go's: a replica takes the Lease when it is free (no holder) or when its record
(holder and renew time) has not changed for `leaseDurationSeconds` as measured on this replica's own
clock (no clock comparison across machines); the holder renews it every `renew_s`. Writes carry the
resourceVersion read, so two replicas racing for a free Lease cannot both win.

Any failure of a renewal (an API error, a timeout, a dropped connection, a bug) counts as a lost
renewal and is retried every `retry_s`. A watchdog, separate from the thread that talks to the API,
gives the leadership up once no renewal has succeeded for the renew deadline, which is shorter than
the lease: the leader has stopped before any standby may take over, even when the renewing thread
hangs in a call or dies. Every Lease call has a request timeout derived from the deadline, so one
stuck call cannot use up the whole deadline. On a clean shutdown the leader releases the Lease for a
quick hand-over.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from rljob.common.kube import Kube, KubeError

log = logging.getLogger(__name__)

LEASE_API = "/apis/coordination.k8s.io/v1"

# client-go's defaults are a 15 s lease and a 10 s renew deadline: the leader gives up after 2/3 of
# the lease, leaving the last third for its exit and for clock-rate differences between replicas.
DEFAULT_DEADLINE_FRACTION = 2 / 3
# One attempt is a GET and a PUT; with a quarter of the deadline per call, two whole attempts fit
# inside the deadline, so a single hung call never costs the leadership.
CALLS_PER_DEADLINE = 4


def _micro_time(now: datetime) -> str:
    return now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class LeaseRecord:
    """The part of a Lease's spec that leader election reads."""

    holder: str
    renew_time: str
    duration_s: int
    transitions: int

    @classmethod
    def from_lease(cls, lease: dict[str, Any]) -> LeaseRecord:
        spec = lease.get("spec") or {}
        return cls(
            holder=spec.get("holderIdentity") or "",
            renew_time=spec.get("renewTime") or "",
            duration_s=int(spec.get("leaseDurationSeconds") or 0),
            transitions=int(spec.get("leaseTransitions") or 0),
        )


def may_take(record: LeaseRecord, identity: str, observed_at: float, now: float) -> bool:
    """Whether `identity` may write itself as holder: it holds it already, it is free, or it expired.

    `observed_at` is when this replica first saw the current record (its own monotonic clock).
    """
    if record.holder in ("", identity):
        return True
    return now >= observed_at + record.duration_s


@dataclass(frozen=True)
class LeaseTiming:
    """The lease, renew-deadline and renew periods (seconds), checked once: renew < deadline < lease."""

    lease_s: float
    renew_deadline_s: float
    renew_s: float

    def __post_init__(self) -> None:
        if not 0 < self.renew_s < self.renew_deadline_s:
            raise ValueError(
                f"renew_s ({self.renew_s}) must be positive and shorter than renew_deadline_s "
                f"({self.renew_deadline_s}): the leader must get at least one renewal in before it gives up"
            )
        if self.renew_deadline_s >= self.lease_s:
            raise ValueError(
                f"renew_deadline_s ({self.renew_deadline_s}) must be shorter than lease_s ({self.lease_s}): "
                "the leader must stop before a standby may take the Lease"
            )

    @classmethod
    def derived(cls, lease_s: float, renew_s: float, renew_deadline_s: float | None = None) -> LeaseTiming:
        """The timing with the renew deadline defaulting to client-go's share of the lease."""
        deadline = lease_s * DEFAULT_DEADLINE_FRACTION if renew_deadline_s is None else renew_deadline_s
        return cls(lease_s=lease_s, renew_deadline_s=deadline, renew_s=renew_s)

    @property
    def request_timeout_s(self) -> float:
        """Timeout of one Lease API call: several attempts fit inside the renew deadline."""
        return self.renew_deadline_s / CALLS_PER_DEADLINE


def renew_budget_s(timing: LeaseTiming, last_renewed: float, now: float) -> float:
    """Seconds left before a leader that last renewed at `last_renewed` must stop (<= 0: now)."""
    return last_renewed + timing.renew_deadline_s - now


def must_step_down(timing: LeaseTiming, last_renewed: float, now: float) -> bool:
    """Whether a leader must stop acting: no renewal succeeded within the renew deadline.

    `last_renewed` is when the last successful renewal *started* on this replica's clock, which is
    no later than when a standby first saw that record, so the leader stops at least
    `lease_s - renew_deadline_s` before a standby may take over.
    """
    return renew_budget_s(timing, last_renewed, now) <= 0


@dataclass
class LeaderElector:
    """Acquire, renew and release one Lease for `identity`."""

    kube: Kube
    namespace: str
    name: str
    identity: str
    timing: LeaseTiming = field(default_factory=lambda: LeaseTiming.derived(lease_s=15, renew_s=2.0))
    retry_s: float = 2.0
    clock: Callable[[], float] = time.monotonic
    _observed: tuple[LeaseRecord, float] | None = field(default=None, init=False)
    _last_renewed: float = field(default=0.0, init=False)

    @property
    def _path(self) -> str:
        return f"{LEASE_API}/namespaces/{self.namespace}/leases/{self.name}"

    def _spec(self, transitions: int, acquire: bool) -> dict[str, Any]:
        now = _micro_time(datetime.now(UTC))
        spec: dict[str, Any] = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": int(self.timing.lease_s),
            "renewTime": now,
            "leaseTransitions": transitions,
        }
        if acquire:
            spec["acquireTime"] = now
        return spec

    def try_acquire_or_renew(self) -> bool:
        """One attempt; True when this replica holds the Lease afterwards."""
        now = self.clock()
        timeout = self.timing.request_timeout_s
        try:
            lease = self.kube.request("GET", self._path, timeout=timeout)
        except KubeError as err:
            if err.status != 404:
                log.warning("leader election: cannot read Lease %s/%s: %s", self.namespace, self.name, err)
                return False
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": self._spec(0, acquire=True),
            }
            try:
                self.kube.request("POST", f"{LEASE_API}/namespaces/{self.namespace}/leases", body=body, timeout=timeout)
            except KubeError as create_err:
                log.info("leader election: Lease creation lost the race: %s", create_err)
                return False
            self._last_renewed = now
            return True
        record = LeaseRecord.from_lease(lease)
        if self._observed is None or self._observed[0] != record:
            self._observed = (record, now)
        if not may_take(record, self.identity, self._observed[1], now):
            return False
        ours = record.holder == self.identity
        lease["spec"] = {**(lease.get("spec") or {}), **self._spec(record.transitions + (0 if ours else 1), not ours)}
        try:
            self.kube.request("PUT", self._path, body=lease, timeout=timeout)  # carries the resourceVersion read: optimistic
        except KubeError as err:
            log.info("leader election: Lease update refused (%s)", err.status)
            return False
        if not ours:
            log.info("leader election: %s now holds Lease %s/%s (was %r)", self.identity, self.namespace, self.name, record.holder)
        self._last_renewed = now
        return True

    def attempt(self) -> bool:
        """`try_acquire_or_renew`, with any exception logged and counted as a failed attempt.

        A dropped connection or timeout surfaces as a urllib3 error, the client raises its own
        ApiException, and a bug raises anything: none of them may end the loops below.
        """
        try:
            return self.try_acquire_or_renew()
        except Exception:  # noqa: BLE001 (every failure is a lost renewal, retried)
            log.warning("leader election: Lease %s/%s call failed", self.namespace, self.name, exc_info=True)
            return False

    def acquire(self, stop: threading.Event | None = None) -> bool:
        """Block until this replica leads (True), or `stop` is set (False)."""
        log.info("leader election: %s waiting for Lease %s/%s", self.identity, self.namespace, self.name)
        while not (stop is not None and stop.is_set()):
            if self.attempt():
                return True
            time.sleep(self.retry_s)
        return False

    def keep_renewing(
        self, on_lost: Callable[[], None], stop: threading.Event
    ) -> tuple[threading.Thread, threading.Thread]:
        """Renew in a daemon thread; a watchdog thread calls `on_lost` once the renew deadline passes.

        Returns (renewer, watchdog). The watchdog only reads the clock and the last renewal time, so
        it fires on time however the renewer fails (a hung call, an exception, a dead thread).
        """

        def renew() -> None:
            wait = self.timing.renew_s
            while not stop.wait(wait):
                wait = self.timing.renew_s if self.attempt() else self.retry_s

        def watch() -> None:
            while not must_step_down(self.timing, self._last_renewed, self.clock()):
                # Sleep until the deadline a renewal may since have moved, re-checking at least
                # every retry period (the clock is injectable, so not necessarily wall time).
                budget = renew_budget_s(self.timing, self._last_renewed, self.clock())
                if stop.wait(max(0.0, min(budget, self.retry_s))):
                    return
            log.error(
                "leader election: %s could not renew Lease %s/%s within %.1f s; stepping down",
                self.identity, self.namespace, self.name, self.timing.renew_deadline_s,
            )
            stop.set()
            on_lost()

        renewer = threading.Thread(target=renew, name="lease-renewer", daemon=True)
        watchdog = threading.Thread(target=watch, name="lease-watchdog", daemon=True)
        renewer.start()
        watchdog.start()
        return renewer, watchdog

    def release(self) -> None:
        """Give the Lease up (clean shutdown), if this replica still holds it."""
        timeout = self.timing.request_timeout_s
        try:
            lease = self.kube.request("GET", self._path, timeout=timeout)
            if LeaseRecord.from_lease(lease).holder != self.identity:
                return
            lease["spec"]["holderIdentity"] = ""
            self.kube.request("PUT", self._path, body=lease, timeout=timeout)
            log.info("leader election: %s released Lease %s/%s", self.identity, self.namespace, self.name)
        except Exception:  # noqa: BLE001 (best effort: a standby takes over after the lease anyway)
            log.warning("leader election: could not release Lease", exc_info=True)
