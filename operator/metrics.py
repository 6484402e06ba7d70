"""Operator metrics on /metrics (prometheus-client): liveness info, jobs by phase, reconcile timing and errors, restarts."""

from __future__ import annotations

import threading
from collections import Counter as Tally
from collections.abc import Iterator

from importlib.metadata import PackageNotFoundError, version

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, Info, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from rljob.api.status import Phase

PHASES: tuple[str, ...] = Phase.__args__  # type: ignore[attr-defined]

# Always 1 while the operator runs: RLJobOperatorDown is `absent(rljob_operator_info)`.
OPERATOR_INFO = Info("rljob_operator", "The running rljob operator")
RECONCILE_SECONDS = Histogram(
    "rljob_reconcile_duration_seconds",
    "Time spent in one reconcile step",
    ["step"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
RECONCILE_ERRORS = Counter("rljob_reconcile_errors_total", "Reconcile steps that raised", ["step"])
RESTARTS = Counter(
    "rljob_restarts_total",
    "Trainer group restarts (role trainer: failures, trainer-interrupted: disruptions) and lost inference replicas "
    "(role rollout)",
    ["namespace", "name", "role"],
)
# State that must follow the live jobs (memory bounded as jobs come and go); set_function at start-up.
CACHED_OBJECTS = Gauge("rljob_operator_cached_objects", "Objects in the operator's watch cache (RLJobs and children)")
STATUS_SYNCS_PENDING = Gauge(
    "rljob_operator_status_syncs_pending", "RLJobs with a coalesced status sync pending or running"
)
JOB_LOCKS_HELD = Gauge("rljob_operator_job_locks", "Per-RLJob locks currently held or waited for")
API_REQUESTS = Counter(
    "rljob_operator_api_requests_total", "API requests of the reconcile (kopf's own watches and patches excluded)", ["verb"]
)


class JobPhaseCollector(Collector):
    """Computes `rljob_jobs{phase}` and `rljob_phase{namespace,name,phase}` at scrape time."""

    def __init__(self) -> None:
        self._phases: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()

    def set(self, namespace: str, name: str, phase: str) -> None:
        """Record the current phase of one job."""
        with self._lock:
            self._phases[(namespace, name)] = phase

    def forget(self, namespace: str, name: str) -> None:
        """Drop a deleted job."""
        with self._lock:
            self._phases.pop((namespace, name), None)

    def count(self) -> int:
        """Number of jobs with a recorded phase."""
        with self._lock:
            return len(self._phases)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            phases = dict(self._phases)
        jobs = GaugeMetricFamily("rljob_jobs", "RLJobs by phase", labels=["phase"])
        counts = Tally(phases.values())
        for phase in PHASES:
            jobs.add_metric([phase], counts.get(phase, 0))
        yield jobs
        per_job = GaugeMetricFamily("rljob_phase", "1 for the current phase of each RLJob", labels=["namespace", "name", "phase"])
        for (namespace, name), phase in sorted(phases.items()):
            per_job.add_metric([namespace, name, phase], 1)
        yield per_job


JOB_PHASES = JobPhaseCollector()
REGISTRY.register(JOB_PHASES)


def _version() -> str:
    try:
        return version("rljob")
    except PackageNotFoundError:
        return "unknown"


def serve(port: int, addr: str) -> None:
    """Start the /metrics HTTP server in a background thread."""
    OPERATOR_INFO.info({"version": _version()})
    start_http_server(port, addr=addr)
