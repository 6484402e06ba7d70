"""Leader election on a coordination.k8s.io/v1 Lease, so several operator replicas run with one active.

The rules are client-go's: a replica takes the Lease when it is free (no holder) or when its record
(holder and renew time) has not changed for `leaseDurationSeconds` as measured on this replica's own
clock (no clock comparison across machines); the holder renews it every `renew_s`. Writes carry the
resourceVersion read, so two replicas racing for a free Lease cannot both win. A leader that cannot
renew within the lease duration exits at once (another replica may already lead: no split brain);
its Deployment restarts it as a standby. On a clean shutdown it releases the Lease for a quick hand-over.
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


@dataclass
class LeaderElector:
    """Acquire, renew and release one Lease for `identity`."""

    kube: Kube
    namespace: str
    name: str
    identity: str
    lease_s: int = 15
    renew_s: float = 5.0
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
            "leaseDurationSeconds": self.lease_s,
            "renewTime": now,
            "leaseTransitions": transitions,
        }
        if acquire:
            spec["acquireTime"] = now
        return spec

    def try_acquire_or_renew(self) -> bool:
        """One attempt; True when this replica holds the Lease afterwards."""
        now = self.clock()
        try:
            lease = self.kube.request("GET", self._path)
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
                self.kube.request("POST", f"{LEASE_API}/namespaces/{self.namespace}/leases", body=body)
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
            self.kube.request("PUT", self._path, body=lease)  # carries the resourceVersion read: optimistic
        except KubeError as err:
            log.info("leader election: Lease update refused (%s)", err.status)
            return False
        if not ours:
            log.info("leader election: %s now holds Lease %s/%s (was %r)", self.identity, self.namespace, self.name, record.holder)
        self._last_renewed = now
        return True

    def acquire(self, stop: threading.Event | None = None) -> bool:
        """Block until this replica leads (True), or `stop` is set (False)."""
        log.info("leader election: %s waiting for Lease %s/%s", self.identity, self.namespace, self.name)
        while not (stop is not None and stop.is_set()):
            if self.try_acquire_or_renew():
                return True
            time.sleep(self.retry_s)
        return False

    def keep_renewing(self, on_lost: Callable[[], None], stop: threading.Event) -> threading.Thread:
        """Renew in a daemon thread; call `on_lost` once renewals fail for longer than the lease."""

        def loop() -> None:
            while not stop.wait(self.renew_s):
                if self.try_acquire_or_renew():
                    continue
                if self.clock() - self._last_renewed >= self.lease_s:
                    log.error("leader election: Lease %s/%s lost by %s", self.namespace, self.name, self.identity)
                    on_lost()
                    return

        thread = threading.Thread(target=loop, name="lease-renewer", daemon=True)
        thread.start()
        return thread

    def release(self) -> None:
        """Give the Lease up (clean shutdown), if this replica still holds it."""
        try:
            lease = self.kube.request("GET", self._path)
            if LeaseRecord.from_lease(lease).holder != self.identity:
                return
            lease["spec"]["holderIdentity"] = ""
            self.kube.request("PUT", self._path, body=lease)
            log.info("leader election: %s released Lease %s/%s", self.identity, self.namespace, self.name)
        except KubeError as err:
            log.warning("leader election: could not release Lease: %s", err)
