"""kopf handlers: thin adapters from Kubernetes events to `reconcile` (all decisions live elsewhere).

Run with `python -m rljob.operator` (flags: --help) or `kopf run -m rljob.operator.handlers`.

Watches are cheap: child kinds are watched with a server-side label selector (only objects labelled
`app.kubernetes.io/managed-by=rljob-operator` and `rljob.io/job-name` reach the operator), and every
watched object lands in one ObjectCache (operator/cache.py) that the reconcile reads instead of
LISTing the API on each resync. The cache is fed by kopf *index* handlers: kopf runs no other handler
before every indexed kind has been listed, so no reconcile ever reads a half-filled cache.

Child events do not compute the status themselves: they ask the StatusQueue (operator/sync_queue.py),
which coalesces a job's events into one sync on its own threads, so the applies of new jobs on kopf's
threads never wait behind status work.

Settings come from the environment so both entry points behave the same:
RLJOB_RESYNC_SECONDS (status resync period, default 10), RLJOB_OPERATOR_METRICS_PORT (default 8080,
0 = off), RLJOB_OPERATOR_METRICS_ADDR (default 0.0.0.0), RLJOB_WATCH_NAMESPACES (comma-separated
namespaces the resync loops list; empty: all namespaces), RLJOB_STATUS_SETTLE_SECONDS (how long a
job's status sync waits for more of its child events to join it, default 0.2), RLJOB_STATUS_THREADS
(threads computing statuses, default 4), RLJOB_APPLY_BACKOFF_SECONDS and RLJOB_APPLY_BACKOFF_CAP_SECONDS
(a failed apply is retried without end after 5, 10, 20, … seconds, at most 60: operator/apply_retry.py),
RLJOB_AUTOTUNE_CONCURRENCY (jobs autotuned at once, default 16: operator/autotune/timer.py).

No handler here needs a finalizer (no kopf timers, deletion handlers are optional), so deleting an
RLJob never waits for the operator: see operator/resync.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import kopf

from rljob.api.spec import API_GROUP, API_VERSION, KIND
from rljob.common.kube import RLJOB_PLURAL, load_api_client
from rljob.operator.builders.meta import LABEL_JOB, LABEL_ROLE, MANAGER, ROLE_INFERENCE, ROLE_TRAINER
from rljob.common.autotune.prometheus import PrometheusPool
from rljob.operator.alerts.checker import check_job
from rljob.operator.apply_retry import ApplyRetries, Backoff
from rljob.operator.autotune.timer import AUTOTUNE_CONCURRENCY, TICK_S, autotune_job
from rljob.operator.cache import RLJOB_API_VERSION, CachedKube
from rljob.operator.metrics import CACHED_OBJECTS, JOB_LOCKS_HELD, JOB_PHASES, STATUS_SYNCS_PENDING, serve
from rljob.operator.reconcile import APPLY_CONCURRENCY, JOB_LOCKS, InvalidSpec, reconcile_or_schedule_retry, sync_status
from rljob.operator.resync import ResyncLoop, list_rljobs
from rljob.operator.lifecycle import pod_observation
from rljob.operator.sync_queue import SeenPod, StatusQueue

log = logging.getLogger(__name__)

RESYNC_SECONDS = float(os.environ.get("RLJOB_RESYNC_SECONDS", "10"))
METRICS_PORT = int(os.environ.get("RLJOB_OPERATOR_METRICS_PORT", "8080"))
METRICS_ADDR = os.environ.get("RLJOB_OPERATOR_METRICS_ADDR", "0.0.0.0")
WATCH_NAMESPACES = [ns for ns in os.environ.get("RLJOB_WATCH_NAMESPACES", "").split(",") if ns]
STATUS_SETTLE_SECONDS = float(os.environ.get("RLJOB_STATUS_SETTLE_SECONDS", "0.2"))
STATUS_THREADS = int(os.environ.get("RLJOB_STATUS_THREADS", "4"))
APPLY_BACKOFF = Backoff.from_env()
APPLY_RETRY_CHECK_SECONDS = 1.0
HANDLER_WORKERS = 8  # kopf's threads for handlers, and the apply retries run at once

RLJOB = (API_GROUP, API_VERSION, RLJOB_PLURAL)
CHILD_LABELS = {LABEL_JOB: kopf.PRESENT, "app.kubernetes.io/managed-by": MANAGER}
# The same filter on the server side: the API server sends only the operator's children.
CHILD_SELECTOR = f"app.kubernetes.io/managed-by={MANAGER},{LABEL_JOB}"
# Watched child kinds: (group, version, plural) for kopf, (apiVersion, kind) for the cache.
CHILD_KINDS = {
    ("apps", "v1", "statefulsets"): ("apps/v1", "StatefulSet"),
    ("apps", "v1", "deployments"): ("apps/v1", "Deployment"),
    ("batch", "v1", "jobs"): ("batch/v1", "Job"),
    ("", "v1", "pods"): ("v1", "Pod"),
    ("", "v1", "services"): ("v1", "Service"),
    ("policy", "v1", "poddisruptionbudgets"): ("policy/v1", "PodDisruptionBudget"),
    # Watched only for the cache: applying a child first reads it (created or unchanged?), and these
    # reads were a third of a new job's requests.
    ("", "v1", "configmaps"): ("v1", "ConfigMap"),
    ("", "v1", "serviceaccounts"): ("v1", "ServiceAccount"),
    ("", "v1", "persistentvolumeclaims"): ("v1", "PersistentVolumeClaim"),
    ("rbac.authorization.k8s.io", "v1", "roles"): ("rbac.authorization.k8s.io/v1", "Role"),
    ("rbac.authorization.k8s.io", "v1", "rolebindings"): ("rbac.authorization.k8s.io/v1", "RoleBinding"),
    ("networking.k8s.io", "v1", "networkpolicies"): ("networking.k8s.io/v1", "NetworkPolicy"),
}
# Kinds whose changes can move a job's status (workloads and their pods).
STATUS_KINDS = frozenset({"StatefulSet", "Deployment", "Job", "Pod"})


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
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
    settings.execution.max_workers = HANDLER_WORKERS
    # kopf's own Events ("Handler 'apply' succeeded", one POST per reconcile) only for warnings and errors.
    settings.posting.level = logging.WARNING
    for group, version, plural in CHILD_KINDS:
        settings.watching.label_selectors[group, version, plural] = CHILD_SELECTOR
    # kopf's workers times the concurrent applies of one job: one pooled connection for each.
    memo.apply_retries = ApplyRetries()
    memo.kube = CachedKube(load_api_client(pool_maxsize=HANDLER_WORKERS * APPLY_CONCURRENCY))
    CACHED_OBJECTS.set_function(memo.kube.cache.__len__)
    JOB_LOCKS_HELD.set_function(JOB_LOCKS.__len__)
    if METRICS_PORT:
        serve(METRICS_PORT, METRICS_ADDR)
        log.info("operator metrics on http://%s:%d/metrics", METRICS_ADDR, METRICS_PORT)


def _store(kube: CachedKube, api_version: str, kind: str, body: kopf.Body) -> None:
    kube.cache.upsert(api_version, kind, dict(body))


def _forget_deleted(kube: CachedKube, api_version: str, kind: str, event: dict[str, Any], body: kopf.Body) -> None:
    # Any handler but an index handler runs only once every indexed kind has been listed: the cache is complete.
    kube.cache.mark_synced()
    if event.get("type") == "DELETED":  # index handlers never see deletions
        meta = body.get("metadata", {})
        kube.cache.remove(
            api_version, kind, meta.get("namespace", ""), meta.get("name", ""), meta.get("resourceVersion")
        )


# Cache feeders: kopf runs an object's index handlers before its other handlers, so the reconcile
# below already reads the object of this very event. They return None: kopf's own index stays empty.
@kopf.index(*RLJOB, id="cache-rljobs")
async def cache_rljob(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Keep the cached copy of an RLJob current."""
    _store(memo.kube, RLJOB_API_VERSION, KIND, body)


@kopf.on.event(*RLJOB, id="uncache-rljobs")
async def uncache_rljob(event: dict[str, Any], body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Drop a deleted RLJob from the cache."""
    _forget_deleted(memo.kube, RLJOB_API_VERSION, KIND, event, body)


def _status_request(
    kube: CachedKube, event: dict[str, Any], body: kopf.Body, kind: str, namespace: str, labels: dict[str, str]
) -> tuple[list[SeenPod], list[SeenPod]]:
    """What a child's event adds to its job's status sync: pods that failed, finished or vanished (the watch
    may be the only one to see them). Any other child change (replicas, readiness, the trainer Job
    finished or gone) just asks for a sync."""
    if kind != "Pod":
        return [], []
    pod = pod_observation(dict(body))
    role = labels.get(LABEL_ROLE)
    if role == ROLE_TRAINER and (pod.exits or pod.disrupted):
        log.info("trainer pod %s/%s terminated or disrupted: %s", namespace, pod.name, [e.reason for e in pod.exits])
        return [SeenPod(pod, kube.cache.generation(namespace, labels[LABEL_JOB]))], []
    if role == ROLE_INFERENCE and (event.get("type") == "DELETED" or pod.failures()):
        # The uid and creation time tell a second pod of the same name from a late event of an earlier one.
        log.info("inference pod %s/%s lost (%s; uid %s, created %s)", namespace, pod.name, event.get("type"),
                 pod.uid, body.get("metadata", {}).get("creationTimestamp"))
        return [], [SeenPod(pod, kube.cache.generation(namespace, labels[LABEL_JOB]))]
    return [], []


def _child_handlers(group: str, version: str, plural: str, api_version: str, kind: str) -> None:
    @kopf.index(group, version, plural, labels=CHILD_LABELS, id=f"cache-{plural}")
    async def cache_child(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        _store(memo.kube, api_version, kind, body)

    # One handler per event: kopf's per-handler bookkeeping is a large part of an event's cost.
    @kopf.on.event(group, version, plural, labels=CHILD_LABELS, id=f"{plural}-changed")
    async def child_changed(
        event: dict[str, Any], body: kopf.Body, namespace: str, labels: dict[str, str], memo: kopf.Memo, **_: Any
    ) -> None:
        _forget_deleted(memo.kube, api_version, kind, event, body)
        if kind in STATUS_KINDS:
            trainer_pods, lost = _status_request(memo.kube, event, body, kind, namespace, labels)
            memo.status_queue.request(namespace, labels[LABEL_JOB], trainer_pods=trainer_pods, lost=lost)


for (_group, _version, _plural), (_api_version, _kind) in CHILD_KINDS.items():
    _child_handlers(_group, _version, _plural, _api_version, _kind)


@kopf.on.startup()
async def start_resync(memo: kopf.Memo, **_: Any) -> None:
    """Start the resync loops (lifecycle status, autotuner, alert actions): timers without kopf's finalizer."""
    kube: CachedKube = memo.kube
    # One pooled Prometheus HTTP client per operator, in kopf's event loop (closed at cleanup).
    pool = memo.prometheus_pool = PrometheusPool()

    def sync(namespace: str, name: str, trainer_pods: list[SeenPod], lost: list[SeenPod]) -> bool:
        return sync_status(kube, namespace, name, trainer_pods=trainer_pods, lost_inference_pods=lost)

    queue = memo.status_queue = StatusQueue(sync, settle_s=STATUS_SETTLE_SECONDS, threads=STATUS_THREADS)
    STATUS_SYNCS_PENDING.set_function(queue.__len__)

    def jobs() -> list[tuple[str, str]]:
        if kube.cache.synced:
            return kube.cache.jobs(frozenset(WATCH_NAMESPACES))
        return list_rljobs(kube, WATCH_NAMESPACES)

    async def resync_pass(namespace: str, name: str) -> None:
        queue.request(namespace, name)

    retries: ApplyRetries = memo.apply_retries

    async def retry_apply(namespace: str, name: str) -> None:
        try:
            await asyncio.to_thread(reconcile_or_schedule_retry, kube, retries, APPLY_BACKOFF, namespace, name)
        except InvalidSpec:
            pass  # the spec changed meanwhile and no longer validates: reconcile reported it

    async def autotune_pass(namespace: str, name: str) -> None:
        await autotune_job(kube, pool, namespace, name)

    async def alert_pass(namespace: str, name: str) -> None:
        await check_job(kube, pool, namespace, name)

    def resync_due(listed: list[tuple[str, str]]) -> list[tuple[str, str]]:
        return queue.due(listed, RESYNC_SECONDS)

    loops = [
        ResyncLoop("resync", RESYNC_SECONDS, jobs, resync_pass, select=resync_due),
        # Failed applies whose backoff has passed (see operator/apply_retry.py); checked every second, as
        # many at once as kopf runs handlers, so a retry that hangs on a slow API server delays no other job.
        ResyncLoop("apply-retry", APPLY_RETRY_CHECK_SECONDS, retries.take_due, retry_apply, concurrency=HANDLER_WORKERS),
        # Concurrent: one job's unreachable Prometheus (up to its 60 s timeout) must not delay the others.
        ResyncLoop("autotune", TICK_S, jobs, autotune_pass, concurrency=AUTOTUNE_CONCURRENCY),
        # Alert actions (operator/alerts/): the job's alert conditions, read from the same Prometheus.
        ResyncLoop("alert-actions", TICK_S, jobs, alert_pass, concurrency=AUTOTUNE_CONCURRENCY),
    ]
    memo["resync_loops"] = loops
    memo["resync_tasks"] = [asyncio.create_task(loop.run_forever(), name=loop.step) for loop in loops]


@kopf.on.cleanup()
async def stop_resync(memo: kopf.Memo, **_: Any) -> None:
    """Stop the resync loops and close the Prometheus connections."""
    for task in memo.get("resync_tasks", []):
        task.cancel()
    for loop in memo.get("resync_loops", []):
        await loop.stop()
    pool = getattr(memo, "prometheus_pool", None)
    if pool is not None:
        await pool.aclose()
    queue = getattr(memo, "status_queue", None)
    if queue is not None:
        await queue.aclose()


@kopf.on.resume(*RLJOB)
@kopf.on.create(*RLJOB)
@kopf.on.update(*RLJOB, field="spec")
def apply(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    """Apply the children for the current spec and refresh the status.

    A failed apply is not raised to kopf: the operator's retry loop (start_resync) applies it again,
    without end and with capped backoff. kopf's own retries keep their state on the RLJob, which cannot
    be written while the API server is down, so they stop in exactly the outage they are for.
    """
    try:
        reconcile_or_schedule_retry(memo.kube, memo.apply_retries, APPLY_BACKOFF, namespace, name)
    except InvalidSpec as err:
        raise kopf.PermanentError(str(err)) from None


@kopf.on.delete(*RLJOB, optional=True)
def forget(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    """Owner references delete the children; only the metrics and retry counts need cleaning (no finalizer)."""
    JOB_PHASES.forget(namespace, name)
    memo.apply_retries.succeeded((namespace, name))


@kopf.on.probe(id="rljobs")
def tracked_jobs(**_: Any) -> int:
    """Liveness detail: number of RLJobs this operator has a status for."""
    return JOB_PHASES.count()

