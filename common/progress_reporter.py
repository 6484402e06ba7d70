"""Progress reporting from the trainer into its RLJob's status (step, policy version, checkpoint, metrics).

The runtime calls it at the end of each step; patches are rate-limited (the newest values are kept
and sent at the next allowed moment or on `flush()`), and a failed patch is logged, never raised:
training must not stop because the API server is briefly unreachable.

    reporter = ProgressReporter.from_env()        # None outside the operator's trainer pods
    if reporter:
        reporter.report(step=3, policy_version=3, metrics={"truncation_rate": 0.12, "entropy": 1.9})
        reporter.report_checkpoint(step=5, uri="/var/lib/rljob/checkpoints/step-5")
        reporter.flush()

Credentials: the pod's own service account (the operator grants it `patch` on `rljobs/status` for this
job only), or the kubeconfig outside a cluster. Importing this module needs pydantic only; the
kubernetes client is loaded when the first patch is sent.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from rljob.api.status import CheckpointRef, JobMetrics, rfc3339, utcnow

log = logging.getLogger(__name__)

PatchSender = Callable[[str, str, dict[str, Any]], None]
# status.trainer keys the runtime owns (desired/ready/summary are the operator's).
TRAINER_KEYS = ("step", "policyVersion", "lastCheckpoint", "lastReportTime")


def progress_patch(
    step: int | None = None,
    policy_version: int | None = None,
    checkpoint: CheckpointRef | None = None,
    metrics: Mapping[str, float | int | None] | None = None,
) -> dict[str, Any]:
    """The runtime-owned status keys that changed; metric names are snake_case fields of JobMetrics."""
    now = utcnow()
    trainer: dict[str, Any] = {}
    if step is not None:
        trainer["step"] = step
    if policy_version is not None:
        trainer["policyVersion"] = policy_version
    if checkpoint is not None:
        trainer["lastCheckpoint"] = checkpoint.to_wire()
    patch: dict[str, Any] = {}
    if trainer:
        trainer["lastReportTime"] = rfc3339(now)
        patch["trainer"] = trainer
    if metrics:
        unknown = set(metrics) - set(JobMetrics.model_fields)
        if unknown:
            raise ValueError(f"unknown status metrics {sorted(unknown)}; known: {sorted(JobMetrics.model_fields)}")
        patch["metrics"] = JobMetrics.model_validate({**metrics, "last_updated_time": now}).to_wire()
    return patch


def _merge(into: dict[str, Any], patch: dict[str, Any]) -> None:
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def owned_progress(status: Mapping[str, Any]) -> dict[str, Any]:
    """The trainer's own fields of an RLJob status (what its field manager applies)."""
    trainer = {k: v for k, v in (status.get("trainer") or {}).items() if k in TRAINER_KEYS}
    owned: dict[str, Any] = {"trainer": trainer} if trainer else {}
    if status.get("metrics"):
        owned["metrics"] = dict(status["metrics"])
    return owned


def kubernetes_sender() -> PatchSender:
    """Server-side apply the trainer's progress as field manager `rljob-trainer` (in-cluster token, else kubeconfig).

    An apply carries everything this manager owns (a field left out would be removed), so the sender
    keeps the accumulated progress, starting from what the RLJob already shows (a restarted trainer
    keeps `lastCheckpoint` until it writes a newer one).
    """
    from rljob.common.kube import TRAINER_FIELD_MANAGER, Kube, load_api_client

    kube = Kube(load_api_client(), field_manager=TRAINER_FIELD_MANAGER)
    state: dict[str, Any] | None = None

    def send(namespace: str, name: str, patch: dict[str, Any]) -> None:
        nonlocal state
        if state is None:
            body = kube.get_rljob(namespace, name) or {}
            state = owned_progress(body.get("status") or {})
        merged = copy.deepcopy(state)
        _merge(merged, patch)
        kube.apply_rljob_status(namespace, name, merged)
        state = merged

    return send


class ProgressReporter:
    """Rate-limited writer of the trainer's progress into `status` of one RLJob."""

    def __init__(
        self,
        namespace: str,
        name: str,
        min_interval_seconds: float = 10.0,
        sender: PatchSender | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.namespace = namespace
        self.name = name
        self.min_interval_seconds = min_interval_seconds
        self._sender = sender
        self._clock = clock
        self._pending: dict[str, Any] = {}
        self._last_sent: float | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, min_interval_seconds: float = 10.0) -> ProgressReporter | None:
        """A reporter for the RLJob named by RLJOB_NAMESPACE/RLJOB_NAME when RLJOB_STATUS_REPORT=1, else None."""
        if os.environ.get("RLJOB_STATUS_REPORT") != "1":
            return None
        namespace, name = os.environ.get("RLJOB_NAMESPACE"), os.environ.get("RLJOB_NAME")
        if not namespace or not name:
            log.warning("RLJOB_STATUS_REPORT=1 but RLJOB_NAMESPACE/RLJOB_NAME are unset: not reporting status")
            return None
        return cls(namespace, name, min_interval_seconds)

    def report(
        self,
        step: int | None = None,
        policy_version: int | None = None,
        metrics: Mapping[str, float | int | None] | None = None,
    ) -> bool:
        """Queue progress; send it if the rate limit allows. Returns whether a patch was sent."""
        return self._queue(progress_patch(step=step, policy_version=policy_version, metrics=metrics), force=False)

    def report_checkpoint(self, step: int, uri: str) -> bool:
        """A checkpoint was written: always sent at once (it is what a restart resumes from)."""
        return self._queue(progress_patch(checkpoint=CheckpointRef(step=step, uri=uri, time=utcnow())), force=True)

    def flush(self) -> bool:
        """Send whatever is queued (call at the end of training)."""
        return self._queue({}, force=True)

    def _queue(self, patch: dict[str, Any], force: bool) -> bool:
        with self._lock:
            _merge(self._pending, patch)
            now = self._clock()
            due = self._last_sent is None or now - self._last_sent >= self.min_interval_seconds
            if not self._pending or not (force or due):
                return False
            pending, self._pending = self._pending, {}
            self._last_sent = now
        try:
            if self._sender is None:
                self._sender = kubernetes_sender()
            self._sender(self.namespace, self.name, pending)
        except Exception as err:  # noqa: BLE001 - reporting is best effort by design
            log.warning("could not report status to RLJob %s/%s: %s", self.namespace, self.name, err)
            with self._lock:
                merged = pending
                _merge(merged, self._pending)
                self._pending = merged
            return False
        return True
