"""kopf handlers: thin adapters from Kubernetes events to `reconcile` (all decisions live elsewhere).

Run with `python -m rljob.operator` (flags: --help) or `kopf run -m rljob.operator.handlers`.
Settings come from the environment so both entry points behave the same:
RLJOB_RESYNC_SECONDS (status resync period, default 10), RLJOB_OPERATOR_METRICS_PORT (default 8080,
0 = off), RLJOB_OPERATOR_METRICS_ADDR (default 0.0.0.0), RLJOB_WATCH_NAMESPACES (comma-separated
namespaces the resync loops list; empty: all namespaces).

No handler here needs a finalizer (no kopf timers, deletion handlers are optional), so deleting an
RLJob never waits for the operator: see operator/resync.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import kopf

from rljob.api.spec import API_GROUP, API_VERSION
from rljob.operator.builders.meta import LABEL_JOB, LABEL_ROLE, MANAGER, ROLE_INFERENCE, ROLE_TRAINER
from rljob.common.kube import RLJOB_PLURAL, shared_kube
from rljob.operator.autotune.timer import TICK_S, autotune_job
from rljob.operator.metrics import JOB_PHASES, serve
from rljob.operator.reconcile import InvalidSpec, reconcile, sync_status
from rljob.operator.resync import ResyncLoop, list_rljobs
from rljob.operator.status_logic import pod_observation

log = logging.getLogger(__name__)

RESYNC_SECONDS = float(os.environ.get("RLJOB_RESYNC_SECONDS", "10"))
METRICS_PORT = int(os.environ.get("RLJOB_OPERATOR_METRICS_PORT", "8080"))
METRICS_ADDR = os.environ.get("RLJOB_OPERATOR_METRICS_ADDR", "0.0.0.0")
WATCH_NAMESPACES = [ns for ns in os.environ.get("RLJOB_WATCH_NAMESPACES", "").split(",") if ns]

RLJOB = (API_GROUP, API_VERSION, RLJOB_PLURAL)
CHILD_LABELS = {LABEL_JOB: kopf.PRESENT, "app.kubernetes.io/managed-by": MANAGER}


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    """Keep kopf's bookkeeping in annotations (the structural status schema is ours) and bound all waits."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=API_GROUP, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{API_GROUP}/finalizer"
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 30
    settings.networking.request_timeout = 60
    settings.execution.max_workers = 8
    if METRICS_PORT:
        serve(METRICS_PORT, METRICS_ADDR)
        log.info("operator metrics on http://%s:%d/metrics", METRICS_ADDR, METRICS_PORT)


async def _resync_pass(namespace: str, name: str) -> None:
    await asyncio.to_thread(sync_status, shared_kube(), namespace, name)


@kopf.on.startup()
async def start_resync(memo: kopf.Memo, **_: Any) -> None:
    """Start the resync loops (lifecycle status, autotuner): timers without kopf's finalizer."""
    def jobs() -> list[tuple[str, str]]:
        return list_rljobs(shared_kube(), WATCH_NAMESPACES)

    loops = [ResyncLoop("resync", RESYNC_SECONDS, jobs, _resync_pass), ResyncLoop("autotune", TICK_S, jobs, autotune_job)]
    memo["resync_tasks"] = [asyncio.create_task(loop.run_forever(), name=loop.step) for loop in loops]


@kopf.on.cleanup()
async def stop_resync(memo: kopf.Memo, **_: Any) -> None:
    """Stop the resync loops."""
    for task in memo.get("resync_tasks", []):
        task.cancel()


@kopf.on.resume(*RLJOB, retries=20, backoff=5)
@kopf.on.create(*RLJOB, retries=20, backoff=5)
@kopf.on.update(*RLJOB, field="spec", retries=20, backoff=5)
def apply(namespace: str, name: str, **_: Any) -> None:
    """Apply the children for the current spec and refresh the status."""
    try:
        reconcile(shared_kube(), namespace, name)
    except InvalidSpec as err:
        raise kopf.PermanentError(str(err)) from None


@kopf.on.event("apps", "v1", "statefulsets", labels=CHILD_LABELS)
@kopf.on.event("apps", "v1", "deployments", labels=CHILD_LABELS)
@kopf.on.event("batch", "v1", "jobs", labels=CHILD_LABELS)
def workload_changed(namespace: str, labels: dict[str, str], **_: Any) -> None:
    """A child workload changed (replicas, the trainer Job finished or is gone): refresh the parent now."""
    sync_status(shared_kube(), namespace, labels[LABEL_JOB])


@kopf.on.event("", "v1", "pods", labels=CHILD_LABELS)
def pod_changed(event: dict[str, Any], body: kopf.Body, namespace: str, labels: dict[str, str], **_: Any) -> None:
    """Pods that failed, finished or vanished: the watch may be the only one to see them."""
    pod = pod_observation(dict(body))
    role = labels.get(LABEL_ROLE)
    if role == ROLE_TRAINER and (pod.exits or pod.disrupted):
        log.info("trainer pod %s/%s terminated or disrupted: %s", namespace, pod.name, [e.reason for e in pod.exits])
        sync_status(shared_kube(), namespace, labels[LABEL_JOB], trainer_pods=[pod])
    elif role == ROLE_INFERENCE and (event.get("type") == "DELETED" or pod.failures()):
        log.info("inference pod %s/%s lost (%s)", namespace, pod.name, event.get("type"))
        sync_status(shared_kube(), namespace, labels[LABEL_JOB], lost_inference_pods=[pod])


@kopf.on.delete(*RLJOB, optional=True)
def forget(namespace: str, name: str, **_: Any) -> None:
    """Owner references delete the children; only the metrics need cleaning (optional: no finalizer)."""
    JOB_PHASES.forget(namespace, name)


@kopf.on.probe(id="rljobs")
def tracked_jobs(**_: Any) -> int:
    """Liveness detail: number of RLJobs this operator has a status for."""
    return JOB_PHASES.count()

