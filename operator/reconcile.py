"""Reconcile one RLJob: apply its children, observe them, decide (status_logic), act, write status.

Level-based and idempotent: every call reads the RLJob and its children fresh, so it can be
interrupted anywhere and simply run again (by the next event, the resync timer or a restarted
operator) with the same result and no duplicate children.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from pydantic import ValidationError

from rljob.api.load import format_validation_error
from rljob.api.spec import RLJobSpec
from rljob.api.status import RLJobStatus, utcnow
from rljob.operator.builders import JobRef, build_children
from rljob.operator.builders.inference import effective_pools, pool_workload_name
from rljob.operator.builders.meta import LABEL_JOB, LABEL_ROLE, ROLE_INFERENCE, ROLE_TRAINER, selector_string
from rljob.operator.builders.router import router_name
from rljob.operator.builders.trainer import trainer_name
from rljob.common.kube import Kube, KubeError
from rljob.operator.keyed_locks import KeyedLocks
from rljob.operator.metrics import JOB_PHASES, RECONCILE_ERRORS, RECONCILE_SECONDS, RESTARTS
from rljob.operator.status_logic import Observed, PodObs, WorkloadObs, compute_status, operator_patch, pod_observation

log = logging.getLogger(__name__)

# Children applied concurrently per job (RLJOB_APPLY_CONCURRENCY, `--apply-concurrency`; 1: one by one).
APPLY_CONCURRENCY = max(1, int(os.environ.get("RLJOB_APPLY_CONCURRENCY", "8")))
_WORKLOAD_KINDS = ("StatefulSet", "Deployment")
# Children the operator may prune when a pool disappears from the spec.
_POOL_KINDS = (("apps/v1", "StatefulSet"), ("v1", "Service"))
_CONFLICT_RETRIES = 3

# Handlers run on a thread pool; one lock per RLJob, dropped when no handler uses it.
JOB_LOCKS = KeyedLocks()


class InvalidSpec(ValueError):
    """The stored spec does not validate against the shared models (the message names the fields)."""


@contextmanager
def job_lock(namespace: str, name: str) -> Iterator[None]:
    """Serialise work on one RLJob inside this process (handlers run on a thread pool)."""
    with JOB_LOCKS.hold((namespace, name)):
        yield


@contextmanager
def measured(step: str) -> Iterator[None]:
    """Observe duration, count errors."""
    start = time.perf_counter()
    try:
        yield
    except Exception:
        RECONCILE_ERRORS.labels(step).inc()
        raise
    finally:
        RECONCILE_SECONDS.labels(step).observe(time.perf_counter() - start)


def merge_patch_changes(current: Any, patch: Any) -> bool:
    """Whether applying JSON merge patch `patch` to `current` would change it."""
    if not isinstance(patch, dict):
        return current != patch
    if not isinstance(current, dict):
        return True
    for key, value in patch.items():
        if value is None:
            if key in current:
                return True
        elif key not in current or merge_patch_changes(current[key], value):
            return True
    return False


def parse_spec(body: dict[str, Any]) -> RLJobSpec:
    """The RLJob's spec as the shared model; InvalidSpec with field paths when it does not validate."""
    try:
        return RLJobSpec.model_validate(body.get("spec") or {})
    except ValidationError as err:
        raise InvalidSpec(format_validation_error(err, "spec")) from None


def _status(body: dict[str, Any]) -> RLJobStatus:
    try:
        return RLJobStatus.model_validate(body.get("status") or {})
    except ValidationError:
        log.warning("ignoring unreadable status of %s", body["metadata"]["name"])
        return RLJobStatus()


def _apply_one(kube: Kube, body: dict[str, Any], child: dict[str, Any]) -> None:
    result = kube.apply(child)
    if result != "unchanged":
        what = f"{child['kind']} {child['metadata']['name']}"
        kube.post_event(body, "Normal", result.capitalize(), f"{what} {result}")


def apply_children(kube: Kube, body: dict[str, Any], spec: RLJobSpec, active: bool) -> None:
    """Server-side apply every child, prune pools removed from the spec, post an Event per change.

    Children are independent requests, so they go out APPLY_CONCURRENCY at a time, in two waves: what
    the workloads use (config, identity, volume, Services) before the workloads, so their pods never
    wait for a missing ServiceAccount or claim.
    """
    job = JobRef.from_body(body)
    children = build_children(job, spec, active=active)
    waves = [[c for c in children if c["kind"] not in _WORKLOAD_KINDS], [c for c in children if c["kind"] in _WORKLOAD_KINDS]]
    with ThreadPoolExecutor(max_workers=APPLY_CONCURRENCY, thread_name_prefix="apply") as pool:
        for wave in waves:
            for done in [pool.submit(_apply_one, kube, body, child) for child in wave]:
                done.result()  # re-raises the first failure (kopf retries the handler)
    wanted = {pool_workload_name(job, p) for p in effective_pools(spec.rollout)}
    selector = selector_string({LABEL_JOB: job.name, LABEL_ROLE: ROLE_INFERENCE})
    for api_version, kind in _POOL_KINDS:
        for obj in kube.list(api_version, kind, job.namespace, selector):
            name = obj["metadata"]["name"]
            if name not in wanted and kube.delete(api_version, kind, job.namespace, name):
                kube.post_event(body, "Normal", "Deleted", f"{kind} {name} deleted (pool removed from spec)")


def _workload(obj: dict[str, Any] | None) -> WorkloadObs | None:
    if obj is None:
        return None
    return WorkloadObs(
        replicas=int((obj.get("spec") or {}).get("replicas") or 0),
        ready=int((obj.get("status") or {}).get("readyReplicas") or 0),
    )


def observe(kube: Kube, job: JobRef, spec: RLJobSpec) -> Observed:
    """List the job's workloads and trainer pods."""
    selector = selector_string({LABEL_JOB: job.name})
    statefulsets = {o["metadata"]["name"]: o for o in kube.list("apps/v1", "StatefulSet", job.namespace, selector)}
    deployments = {o["metadata"]["name"]: o for o in kube.list("apps/v1", "Deployment", job.namespace, selector)}
    trainer_selector = selector_string({LABEL_JOB: job.name, LABEL_ROLE: ROLE_TRAINER})
    return Observed(
        pools={p.name: _workload(statefulsets.get(pool_workload_name(job, p))) for p in effective_pools(spec.rollout)},
        router=_workload(deployments.get(router_name(job))),
        trainer=_workload(statefulsets.get(trainer_name(job))),
        trainer_pods=[pod_observation(p) for p in kube.list("v1", "Pod", job.namespace, trainer_selector)],
    )


def _ready_inference_pods(kube: Kube, job: JobRef) -> dict[str, str]:
    selector = selector_string({LABEL_JOB: job.name, LABEL_ROLE: ROLE_INFERENCE})
    ready = {}
    for pod in kube.list("v1", "Pod", job.namespace, selector):
        conditions = (pod.get("status") or {}).get("conditions") or []
        if not pod["metadata"].get("deletionTimestamp") and any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in conditions
        ):
            ready[pod["metadata"]["name"]] = pod["metadata"]["uid"]
    return ready


def restart_trainer_group(kube: Kube, job: JobRef, peers: Iterable[PodObs]) -> int:
    """Delete the failed pods' healthy peers; the StatefulSet recreates them from the checkpoint.

    Each delete is preconditioned on the uid seen when deciding, so a pod the StatefulSet has
    recreated meanwhile under the same name is left alone.
    """
    return sum(kube.delete("v1", "Pod", job.namespace, p.name, uid=p.uid) for p in peers)


def reconcile(kube: Kube, namespace: str, name: str) -> None:
    """Apply the children for the current spec, then refresh the status (create/resume/update)."""
    with job_lock(namespace, name), measured("apply"):
        body = kube.get_rljob(namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return
        try:
            spec = parse_spec(body)
        except InvalidSpec as err:
            kube.post_event(body, "Warning", "InvalidSpec", str(err))
            raise
        status = _status(body)
        apply_children(kube, body, spec, active=not spec.suspend and status.outcome is None)
    sync_status(kube, namespace, name)


def sync_status(
    kube: Kube,
    namespace: str,
    name: str,
    trainer_pods: Iterable[PodObs] = (),
    lost_inference_pods: Iterable[PodObs] = (),
) -> None:
    """Observe, decide, act and write the status of one RLJob.

    `trainer_pods`/`lost_inference_pods` carry pods seen by the watch that a fresh list may no longer
    show (a Failed pod its StatefulSet already replaced, a deleted inference pod).
    """
    with job_lock(namespace, name), measured("status"):
        for attempt in range(_CONFLICT_RETRIES):
            try:
                _sync_once(kube, namespace, name, list(trainer_pods), list(lost_inference_pods))
                return
            except KubeError as err:
                if err.status != 409 or attempt == _CONFLICT_RETRIES - 1:
                    raise
                log.debug("status of %s/%s changed meanwhile; retrying", namespace, name)


def _sync_once(
    kube: Kube, namespace: str, name: str, extra_trainer: list[PodObs], lost: list[PodObs]
) -> None:
    body = kube.get_rljob(namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        JOB_PHASES.forget(namespace, name)
        return
    try:
        spec = parse_spec(body)
    except InvalidSpec:
        return  # reported by reconcile(); nothing sensible to compute
    job = JobRef.from_body(body)
    prev = _status(body)
    obs = observe(kube, job, spec)
    seen = {p.uid for p in obs.trainer_pods}
    obs.trainer_pods += [p for p in extra_trainer if p.uid not in seen]
    obs.lost_inference_pods = lost
    if lost:
        obs.ready_inference_pods = _ready_inference_pods(kube, job)
    decision = compute_status(job, spec, int(body["metadata"].get("generation") or 0), prev, obs, utcnow())

    patch = operator_patch(prev, decision.status)
    # Optimistic concurrency where it matters: counting a restart or setting an outcome must be based
    # on the status we read. Plain refreshes skip it (kopf's own annotation writes would conflict).
    counts_changed = decision.status.restarts != prev.restarts or decision.status.outcome != prev.outcome
    guard = body["metadata"]["resourceVersion"] if counts_changed else None
    # A resync that changes nothing writes nothing (one request per job and period saved).
    if guard is not None or merge_patch_changes(body.get("status") or {}, patch):
        kube.patch_rljob_status(namespace, name, patch, resource_version=guard)
    if decision.status.phase != prev.phase:
        log.info("%s/%s: %s -> %s %s", namespace, name, prev.phase, decision.status.phase, [e.reason for e in decision.events])
    JOB_PHASES.set(namespace, name, decision.status.phase)
    for event in decision.events:
        kube.post_event(body, event.type, event.reason, event.message)
    new_restarts = decision.status.restarts
    if new_restarts.trainer > prev.restarts.trainer:
        RESTARTS.labels(namespace, name, "trainer").inc(new_restarts.trainer - prev.restarts.trainer)
    if new_restarts.rollout > prev.restarts.rollout:
        RESTARTS.labels(namespace, name, "rollout").inc(new_restarts.rollout - prev.restarts.rollout)
    # Act after the decision is durable: a crash here re-runs the action, never double-counts it.
    if decision.restart_trainer:
        deleted = restart_trainer_group(kube, job, decision.restart_peers)
        log.info("restarted trainer group of %s/%s (%d healthy peers deleted)", namespace, name, deleted)
    running = obs.trainer is not None and obs.trainer.replicas > 0
    if obs.trainer is None or running != decision.active:
        apply_children(kube, body, spec, active=decision.active)
