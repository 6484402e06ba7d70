"""Reconcile one RLJob: apply its children, observe them, decide (lifecycle.py), act, write status.

Level-based and idempotent: every call reads the RLJob and its children fresh, so it can be
interrupted anywhere and simply run again (by the next event, the resync timer or a restarted
operator) with the same result and no duplicate children.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from pydantic import ValidationError

from rljob.api.load import format_validation_error
from rljob.api.spec import RLJobSpec
from rljob.api.status import RLJobStatus, utcnow
from rljob.operator.builders import ImageDefaults, JobRef, NetworkPolicySettings, build_children
from rljob.operator.builders.inference import effective_pools, pool_workload_name
from rljob.operator.builders.meta import LABEL_JOB, LABEL_POOL, LABEL_ROLE, ROLE_INFERENCE, ROLE_TRAINER, selector_string
from rljob.operator.builders.router import router_name
from rljob.operator.builders.trainer import ANNOTATION_TEMPLATE_HASH, trainer_name
from rljob.common.kube import Kube, KubeError, NotOwned, check_controlled_by
from rljob.operator.apply_retry import ApplyRetries, Backoff, Failures
from rljob.operator.builders.engine_key import engine_key_secret, engine_key_secret_name, new_engine_key
from rljob.operator.keyed_locks import KeyedLocks
from rljob.operator.node_loss import OUT_OF_SERVICE_TAINT, NodeObs, TerminatingPod, node_observation, overdue, terminating_pod
from rljob.operator.pod_waits import pod_waits
from rljob.operator.sync_queue import SeenPod, seen_under
from rljob.operator.volume_policy import allowed_volume_types, refused_volume
from rljob.operator.metrics import JOB_PHASES, RECONCILE_ERRORS, RECONCILE_SECONDS, RESTARTS
from rljob.operator.lifecycle import (
    ApplyResult,
    LifecycleDecision,
    Observed,
    PodObs,
    WorkloadObs,
    compute_status,
    engines_serve,
    operator_apply,
    pod_observation,
    trainer_job_observation,
    trainer_start_held,
)

log = logging.getLogger(__name__)

# Children applied concurrently per job (RLJOB_APPLY_CONCURRENCY, `--apply-concurrency`; 1: one by one).
APPLY_CONCURRENCY = max(1, int(os.environ.get("RLJOB_APPLY_CONCURRENCY", "8")))
# The child pods' default images (RLJOB_IMAGE_DEFAULTS, JSON, from the chart's `images`); read once,
# so an invalid configuration stops the operator at start.
IMAGES = ImageDefaults.from_env()
_WORKLOAD_KINDS = ("StatefulSet", "Deployment", "Job")
# Children the operator may prune when a pool disappears from the spec.
_POOL_KINDS = (("apps/v1", "StatefulSet"), ("v1", "Service"), ("policy/v1", "PodDisruptionBudget"))
_NETWORK_POLICY = ("networking.k8s.io/v1", "NetworkPolicy")
# The chart's networkPolicy values (`python -m rljob.operator --network-policy --monitoring-namespace`).
NETWORK_POLICY = NetworkPolicySettings.from_env(os.environ)

# Handlers run on a thread pool; one lock per RLJob, dropped when no handler uses it.
JOB_LOCKS = KeyedLocks()


class InvalidSpec(ValueError):
    """The stored spec does not validate against the shared models (the message names the fields)."""


class ChildApplyError(KubeError):
    """The API server refused a child object, or an object of its name belongs to someone else (NotOwned);
    the message names the object and carries the reason."""

    def __init__(self, what: str, err: KubeError) -> None:
        message = err.body.get("message", err.body) if isinstance(err.body, dict) else err.body
        super().__init__(err.status, {"message": f"{what}: {message}"})
        self.what = what
        self.reason = "NotOwned" if isinstance(err, NotOwned) else "ApplyFailed"


class ChildrenNotApplied(RuntimeError):
    """Raised after recording an apply failure in status, so kopf retries the handler with backoff."""


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


def _contains(current: Any, applied: Any) -> bool:
    """Whether `current` already holds every value of `applied` (list-maps keyed by `type` per item)."""
    if isinstance(applied, dict):
        return isinstance(current, dict) and all(k in current and _contains(current[k], v) for k, v in applied.items())
    if isinstance(applied, list) and all(isinstance(i, dict) and "type" in i for i in applied):
        if not isinstance(current, list):
            return False
        by_type = {i.get("type"): i for i in current if isinstance(i, dict)}
        return all(i["type"] in by_type and _contains(by_type[i["type"]], i) for i in applied)
    return current == applied


def status_apply_changes(current: dict[str, Any], previous: dict[str, Any], applied: dict[str, Any]) -> bool:
    """Whether server-side applying `applied` (all the operator's fields) would change the live status.

    `current` is the live status, `previous` the operator's fields as read from it (operator_apply of
    the parsed status): every applied value must already be live, and nothing the operator holds may
    be dropped (a field it leaves out is removed by the apply).
    """
    return previous != applied or not _contains(current, applied)


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


def _apply_one(kube: Kube, body: dict[str, Any], child: dict[str, Any]) -> tuple[str, str]:
    """Apply one child (the trainer Job through its recreate rule): (what, created/configured/unchanged/waiting).

    An existing object of the child's name that this RLJob does not control is never applied over
    (NotOwned): a forced apply would adopt it, and deleting the RLJob would then delete it."""
    what = f"{child['kind']} {child['metadata']['name']}"
    uid = body["metadata"]["uid"]
    try:
        result = _apply_trainer_job(kube, body, child) if child["kind"] == "Job" else kube.apply(child, owner_uid=uid)
    except KubeError as err:
        raise ChildApplyError(what, err) from None
    return what, result


def ensure_engine_key(kube: Kube, body: dict[str, Any]) -> str:
    """Create the job's engine-key Secret with a fresh random key unless it exists: "created" or "unchanged".

    It is created once and never updated (a new key would lock the running pods out of each other);
    an existing Secret of its name that this RLJob does not control is refused (NotOwned). Raises
    ChildApplyError naming it."""
    job = JobRef.from_body(body)
    name = engine_key_secret_name(job)
    what = f"Secret {name}"
    try:
        current = kube.get("v1", "Secret", job.namespace, name)
        check_controlled_by(current, job.uid)
        if current is not None:
            return "unchanged"
        kube.create(engine_key_secret(job, new_engine_key()))
    except KubeError as err:
        raise ChildApplyError(what, err) from None
    return "created"


def apply_children(kube: Kube, body: dict[str, Any], spec: RLJobSpec, active: bool, hold_trainer: bool = False) -> list[str]:
    """Server-side apply every child, prune pools removed from the spec, post an Event per kind of change.

    Children are independent requests, so they go out APPLY_CONCURRENCY at a time, in two waves: what
    the workloads use (config, identity, volume, Services, PDBs) before the workloads, so their pods
    never wait for a missing ServiceAccount or claim. One Event names all children created (another
    all configured): a new job costs one Event, not thirteen. Returns the children still waiting (the
    trainer Job being recreated); raises ChildApplyError naming the first object the API server refused.
    `hold_trainer`: a missing trainer Job is not created (the backoff after an interruption still runs).
    An inactive job's engines and router keep their replicas while a trainer pod still runs
    (lifecycle.engines_serve): the trainer pods are listed to decide it.
    """
    job = JobRef.from_body(body)
    # An active job serves anyway: only a stopped one lists its trainer pods.
    serving = active or engines_serve(active, _trainer_pods(kube, job), utcnow())
    children = build_children(job, spec, active=active, network=NETWORK_POLICY, images=IMAGES, serving=serving)
    if hold_trainer and kube.get("batch/v1", "Job", job.namespace, trainer_name(job)) is None:
        children = [c for c in children if c["kind"] != "Job"]
    waves = [[c for c in children if c["kind"] not in _WORKLOAD_KINDS], [c for c in children if c["kind"] in _WORKLOAD_KINDS]]
    changed: dict[str, list[str]] = {}
    try:
        changed.setdefault(ensure_engine_key(kube, body), []).append(f"Secret {engine_key_secret_name(job)}")
        with ThreadPoolExecutor(max_workers=APPLY_CONCURRENCY, thread_name_prefix="apply") as pool:
            for wave in waves:
                for done in [pool.submit(_apply_one, kube, body, child) for child in wave]:
                    what, result = done.result()  # re-raises the first failure
                    changed.setdefault(result, []).append(what)
    finally:  # what was applied before a refusal is reported too
        for result in ("created", "configured"):
            if changed.get(result):
                kube.post_event(body, "Normal", result.capitalize(), f"{', '.join(changed[result])} {result}")
    wanted = {pool_workload_name(job, p) for p in effective_pools(spec.rollout)}
    selector = selector_string({LABEL_JOB: job.name, LABEL_ROLE: ROLE_INFERENCE})
    for api_version, kind in _POOL_KINDS:
        _prune(kube, body, (api_version, kind), selector, wanted, "pool removed from spec")
    policies = {c["metadata"]["name"] for c in children if (c["apiVersion"], c["kind"]) == _NETWORK_POLICY}
    _prune(kube, body, _NETWORK_POLICY, selector_string({LABEL_JOB: job.name}), policies, "network policies turned off")
    return changed.get("waiting", [])


def _trainer_pods(kube: Kube, job: JobRef) -> list[PodObs]:
    selector = selector_string({LABEL_JOB: job.name, LABEL_ROLE: ROLE_TRAINER})
    return [pod_observation(p) for p in kube.list("v1", "Pod", job.namespace, selector)]


def _prune(kube: Kube, body: dict[str, Any], kind: tuple[str, str], selector: str, wanted: set[str], why: str) -> None:
    """Delete the job's children of `kind` matching `selector` that are not `wanted`, with an Event each."""
    namespace = body["metadata"]["namespace"]
    for obj in kube.list(kind[0], kind[1], namespace, selector):
        name = obj["metadata"]["name"]
        if name not in wanted and kube.delete(kind[0], kind[1], namespace, name):
            kube.post_event(body, "Normal", "Deleted", f"{kind[1]} {name} deleted ({why})")


def apply_result(
    kube: Kube, body: dict[str, Any], spec: RLJobSpec, active: bool, retried: Failures | None = None
) -> ApplyResult:
    """apply_children as a result for the status: what is still waiting, the API server's refusal, or the
    operator's own (a pass-through volume type it does not allow: nothing is applied).

    `retried` are the consecutive failed attempts before this one (operator/apply_retry.py's count):
    the result's condition names them, and an apply that goes through after them posts an
    `AppliedAfterRetries` Event saying how many and for how long.
    """
    generation = int(body["metadata"].get("generation") or 0)
    refused = refused_volume(spec, allowed_volume_types())
    if refused is not None:
        kube.post_event(body, "Warning", "VolumeNotAllowed", refused)
        return ApplyResult(generation, error=refused, reason="VolumeNotAllowed")
    attempt = 1 + (retried.count if retried else 0)
    summary = retried.summary(time.monotonic()) if retried else ""
    try:
        held = trainer_start_held(_status(body).restarts, utcnow())
        waiting = apply_children(kube, body, spec, active, hold_trainer=held)
    except ChildApplyError as err:
        kube.post_event(body, "Warning", err.reason, f"{err} (attempt {attempt})")
        return ApplyResult(generation, error=str(err), reason=err.reason, attempt=attempt, retried=summary)
    if retried:
        kube.post_event(body, "Normal", "AppliedAfterRetries", f"children of generation {generation} applied after {summary}")
    return ApplyResult(generation, waiting=tuple(waiting), attempt=attempt, retried=summary)


def delete_trainer_job(kube: Kube, namespace: str, name: str, uid: str) -> bool:
    """Stop the whole trainer group: delete its Job, preconditioned on the uid that was decided on.

    Foreground propagation keeps the Job (deleting) until every pod is gone, so a new group never
    starts next to an old one still writing its SIGTERM checkpoint.
    """
    return kube.delete("batch/v1", "Job", namespace, name, uid=uid, propagation="Foreground")


def _apply_trainer_job(kube: Kube, body: dict[str, Any], desired: dict[str, Any]) -> str:
    """Apply the trainer Job, or recreate it when its immutable part changed (the whole gang at once)."""
    meta = desired["metadata"]
    existing = kube.get("batch/v1", "Job", meta["namespace"], meta["name"])
    if existing is not None:
        check_controlled_by(existing, body["metadata"]["uid"])  # never delete (recreate) someone else's Job
        if existing["metadata"].get("deletionTimestamp"):
            return "waiting"  # the old group is still stopping; its deletion event brings us back
        have = (existing["metadata"].get("annotations") or {}).get(ANNOTATION_TEMPLATE_HASH)
        if have != meta["annotations"][ANNOTATION_TEMPLATE_HASH]:
            delete_trainer_job(kube, meta["namespace"], meta["name"], existing["metadata"]["uid"])
            kube.post_event(
                body, "Normal", "Recreating",
                f"Job {meta['name']}: pod template changed; recreating the whole trainer group",
            )
            return "waiting"
    return kube.apply(desired, owner_uid=body["metadata"]["uid"])


def _workload(obj: dict[str, Any] | None) -> WorkloadObs | None:
    if obj is None:
        return None
    return WorkloadObs(
        replicas=int((obj.get("spec") or {}).get("replicas") or 0),
        ready=int((obj.get("status") or {}).get("readyReplicas") or 0),
    )


def _pool_workload(obj: dict[str, Any] | None, ready_pods: int) -> WorkloadObs | None:
    workload = _workload(obj)
    if workload is None:
        return None
    return WorkloadObs(replicas=workload.replicas, ready=min(workload.ready, ready_pods))


def _is_ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return not pod["metadata"].get("deletionTimestamp") and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in conditions
    )


def observe(kube: Kube, job: JobRef, spec: RLJobSpec) -> Observed:
    """List the job's workloads and pods."""
    selector = selector_string({LABEL_JOB: job.name})
    statefulsets = {o["metadata"]["name"]: o for o in kube.list("apps/v1", "StatefulSet", job.namespace, selector)}
    deployments = {o["metadata"]["name"]: o for o in kube.list("apps/v1", "Deployment", job.namespace, selector)}
    trainer_job = kube.get("batch/v1", "Job", job.namespace, trainer_name(job))
    pods = kube.list("v1", "Pod", job.namespace, selector)
    terminating = [t for p in pods if (t := terminating_pod(p)) is not None]
    inference = [p for p in pods if (p["metadata"].get("labels") or {}).get(LABEL_ROLE) == ROLE_INFERENCE]
    # A pool's ready count is capped by its Ready pods seen: the StatefulSet's readyReplicas lags a lost
    # pod by a controller round trip, and a cached read of it can be the old value.
    ready_pods = Counter((p["metadata"].get("labels") or {}).get(LABEL_POOL) for p in inference if _is_ready(p))
    return Observed(
        pools={
            p.name: _pool_workload(statefulsets.get(pool_workload_name(job, p)), ready_pods[p.name])
            for p in effective_pools(spec.rollout)
        },
        router=_workload(deployments.get(router_name(job))),
        trainer=trainer_job_observation(trainer_job) if trainer_job is not None else None,
        trainer_pods=[
            pod_observation(p) for p in pods if (p["metadata"].get("labels") or {}).get(LABEL_ROLE) == ROLE_TRAINER
        ],
        inference_pod_uids={p["metadata"]["uid"] for p in inference},
        ready_inference_pods={p["metadata"]["name"]: p["metadata"]["uid"] for p in inference if _is_ready(p)},
        terminating_pods=terminating,
        nodes=_nodes({p.node for p in overdue(terminating, utcnow())}, kube),
        waiting_pods=pod_waits(pods, kube.list("v1", "PersistentVolumeClaim", job.namespace, selector)),
    )


def _nodes(names: set[str], kube: Kube) -> dict[str, NodeObs]:
    """The Nodes of pods deleting for long (none most of the time: no request then). A Node the operator
    may not read (RBAC without `get nodes`) is left out and its pods are not judged; the warning says why."""
    nodes: dict[str, NodeObs] = {}
    for name in sorted(names):
        try:
            node: dict[str, Any] | None = kube.request("GET", f"/api/v1/nodes/{name}")
        except KubeError as err:
            if err.status == 404:
                node = None
            elif err.status == 403:
                log.warning("cannot read Node %s to judge its terminating pods: %s", name, err)
                continue
            else:
                raise
        nodes[name] = node_observation(name, node)
    return nodes


def force_delete_pod(kube: Kube, namespace: str, pod: TerminatingPod) -> bool:
    """Delete a pod stuck on an out-of-service node at once (grace period 0), only the incarnation decided on."""
    path = f"/api/v1/namespaces/{namespace}/pods/{pod.name}"
    try:
        kube.request("DELETE", path, body={"gracePeriodSeconds": 0, "preconditions": {"uid": pod.uid}})
    except KubeError as err:
        if err.status in (404, 409):  # gone already, or another incarnation
            return False
        raise
    return True


def reconcile(kube: Kube, namespace: str, name: str, retried: Failures | None = None) -> None:
    """Apply the children for the current spec, then refresh the status (create/resume/update).

    An apply the API server refuses becomes the ChildrenApplied=False condition with its message
    (observedGeneration stays at the last generation that applied), then is raised for a retry.
    `retried`: the consecutive failed attempts before this one (see apply_retry), reported by the status.
    """
    # One lock hold for the apply and its status: a pass in between could apply more (recreate the
    # trainer Job), and this apply's result would then be stale.
    with job_lock(namespace, name):
        with measured("apply"):
            body = kube.get_rljob(namespace, name)
            if body is None or body["metadata"].get("deletionTimestamp"):
                return
            # Names the generation being applied: the trace of a reconcile in progress (fault tests kill here).
            log.info("%s/%s: applying generation %s", namespace, name, body["metadata"].get("generation"))
            try:
                spec = parse_spec(body)
            except InvalidSpec as err:
                kube.post_event(body, "Warning", "InvalidSpec", str(err))
                raise
            status = _status(body)
            result = apply_result(kube, body, spec, active=not spec.suspend and status.outcome is None, retried=retried)
        with measured("status"):
            _sync_once(kube, namespace, name, [], [], result)
    if result.error is not None:
        raise ChildrenNotApplied(result.error)


def reconcile_or_schedule_retry(
    kube: Kube, retries: ApplyRetries, backoff: Backoff, namespace: str, name: str
) -> Failures | None:
    """reconcile(); if it fails for any reason but an invalid spec, count the failure and schedule the next
    attempt (the operator's retry loop makes it: see apply_retry). Returns the failures, None on success.

    An invalid spec is raised (nothing to retry until the spec changes); every other error (refused,
    unreachable, timed out) is logged and retried the same way, without end.
    """
    job = (namespace, name)
    try:
        reconcile(kube, namespace, name, retried=retries.pending(job))
    except InvalidSpec:
        retries.succeeded(job)
        raise
    except Exception as err:  # noqa: BLE001 - whatever stopped the apply, the answer is to retry it later
        failures = retries.failed(job, f"{type(err).__name__}: {err}".splitlines()[0][:300], backoff)
        log.warning(
            "%s/%s: apply attempt %d failed (%s); retrying in %.0f s",
            namespace, name, failures.count, failures.last_error, backoff.delay(failures.count),
        )
        return failures
    retries.succeeded(job)
    return None


def sync_status(
    kube: Kube, namespace: str, name: str, trainer_pods: Iterable[SeenPod] = (), lost_inference_pods: Iterable[SeenPod] = ()
) -> bool:
    """Observe, decide, act and write the status of one RLJob, unless the job is busy.

    `trainer_pods`/`lost_inference_pods` carry pods seen by the watch that a fresh list may no longer
    show (a Failed pod already deleted, a deleted inference pod). Returns False at once when another
    pass holds the job (an apply, which writes the status after it), so a status thread never sits
    waiting behind an apply.
    """
    with JOB_LOCKS.try_hold((namespace, name)) as free:
        if not free:
            return False
        with measured("status"):
            _sync_once(kube, namespace, name, list(trainer_pods), list(lost_inference_pods), None)
        return True


def current_generation_applied(prev: RLJobStatus, generation: int) -> bool:
    """Whether an apply of `generation` has finished: it applied everything, or it is waiting for the old
    trainer Job to go (ChildrenApplied=False, Recreating, set at this generation) and a sync must recreate it."""
    if prev.observed_generation == generation:
        return True
    applied = prev.condition("ChildrenApplied")
    return applied is not None and applied.reason == "Recreating" and applied.observed_generation == generation


def needs_apply(obs: Observed, active: bool, generation_applied: bool, held: bool = False, serving: bool = True) -> bool:
    """Whether a status sync must apply the children itself: the trainer Job is missing, its suspension
    disagrees with the decision (finished, suspended, resumed), or the engines of an inactive job are still
    scaled up though they no longer serve (`serving`: lifecycle.engines_serve; its trainer pods are gone).

    `held`: the backoff after an interruption still runs (trainer_start_held), so a missing trainer Job
    is not created yet; a later resync creates it once the hold is over.

    Never before the current generation's create/update handler has applied it (`generation_applied`,
    see current_generation_applied): with kopf's workers busy that handler may not even have started,
    and a resync (or the child events of the apply itself) would otherwise apply every new job a second
    time (a missing trainer Job is the normal state of a job not applied yet).
    """
    if not generation_applied:
        return False
    if obs.trainer is None:
        return not (held and active)
    if obs.trainer.deleting:
        return False
    return obs.trainer.suspended == active or (not serving and _scaled_up(obs))


def _scaled_up(obs: Observed) -> bool:
    """Whether any inference pool or the router has replicas."""
    workloads = [*obs.pools.values(), obs.router]
    return any(w is not None and w.replicas > 0 for w in workloads)


def _sync_once(
    kube: Kube, namespace: str, name: str, extra_trainer: list[SeenPod], lost: list[SeenPod], applied: ApplyResult | None
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
    generation = int(body["metadata"].get("generation") or 0)
    prev = _status(body)
    obs = observe(kube, job, spec)
    listed_trainer_pods = list(obs.trainer_pods)  # the pods that exist now (the seen ones below may be gone)
    seen = {p.uid for p in obs.trainer_pods}
    obs.trainer_pods += [p for p in seen_under(extra_trainer, generation) if p.uid not in seen]
    obs.lost_inference_pods = seen_under(lost, generation)

    def decide(result: ApplyResult | None) -> LifecycleDecision:
        return compute_status(job, spec, generation, prev, obs, utcnow(), applied=result)

    decision = decide(applied)
    # Pods stuck on a node declared out of service: only the operator's decision lets them go (node_loss.py).
    for pod in decision.force_delete:
        if force_delete_pod(kube, namespace, pod):
            log.info("%s/%s: force-deleted pod %s on out-of-service node %s", namespace, name, pod.name, pod.node)
            kube.post_event(
                body, "Warning", "PodForceDeleted",
                f"pod {pod.name} force-deleted: node {pod.node} is not Ready and carries {OUT_OF_SERVICE_TAINT}",
            )
    # Act first, record second: if the operator dies in between, the next pass finds the Job deleting
    # (or gone, then recreated) and restarts nothing twice; it never records a restart that did not happen.
    if decision.restart_trainer_job is not None:
        deleted = delete_trainer_job(kube, namespace, trainer_name(job), decision.restart_trainer_job)
        log.info("restarting the trainer group of %s/%s (Job deleted: %s)", namespace, name, deleted)
    elif needs_apply(
        obs, decision.active, current_generation_applied(prev, generation),
        held=trainer_start_held(decision.status.restarts, utcnow()),
        serving=engines_serve(decision.active, listed_trainer_pods, utcnow()),
    ):
        decision = decide(apply_result(kube, body, spec, decision.active))
    status = operator_apply(decision.status)
    # A resync that changes nothing writes nothing (one request per job and period saved).
    if status_apply_changes(body.get("status") or {}, operator_apply(prev), status):
        kube.apply_rljob_status(namespace, name, status)
    if decision.status.phase != prev.phase:
        log.info("%s/%s: %s -> %s %s", namespace, name, prev.phase, decision.status.phase, [e.reason for e in decision.events])
    JOB_PHASES.set(namespace, name, decision.status.phase)
    for event in decision.events:
        kube.post_event(body, event.type, event.reason, event.message)
    new, old = decision.status.restarts, prev.restarts
    for role, delta in (
        ("trainer", new.trainer - old.trainer),
        ("trainer-interrupted", new.interrupted - old.interrupted),
        ("rollout", new.rollout - old.rollout),
    ):
        if delta > 0:
            RESTARTS.labels(namespace, name, role).inc(delta)
