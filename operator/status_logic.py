"""Pure lifecycle decisions: observed children + previous status → new status, actions and Events.

Nothing here talks to the API server, so every rule (conditions, phase, deadlines, failure policy,
suspend) is unit-tested directly. The handlers observe, call `compute_status`, then act.

Failure policy:
- a lost or failed inference pod marks the job Degraded until its StatefulSet has replaced it;
- a failed trainer pod restarts the whole trainer group (it resumes from the last checkpoint), up to
  `spec.backoffLimit` restarts; the next failure ends the job Failed/BackoffLimitExceeded;
- rank 0's trainer container exiting 0 completes the job; finished and suspended jobs keep their
  objects (checkpoint PVC included) with every workload scaled to zero.
Every failure is identified by a key (pod uid + container restart count) stored in status, so a
failure seen twice (timer and watch, or before and after an operator restart) is acted on once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from rljob.api.spec import RLJobSpec
from rljob.api.status import (
    CONDITION_TYPES,
    MAX_HANDLED_FAILURES,
    Condition,
    EffectiveKnobs,
    KnobValue,
    Outcome,
    PoolStatus,
    RLJobStatus,
    RolloutStatus,
    TrainerStatus,
)
from rljob.operator.builders.inference import effective_pools, pool_replicas
from rljob.operator.builders.meta import (
    LABEL_POOL,
    LABEL_ROLE,
    ROLE_INFERENCE,
    JobRef,
    selector_labels,
    selector_string,
)

TRAINER_CONTAINER = "trainer"


@dataclass(frozen=True)
class WorkloadObs:
    """A StatefulSet or Deployment as observed: its scale and ready replicas."""

    replicas: int
    ready: int


@dataclass(frozen=True)
class PodExit:
    """A terminated container (or a Failed pod) with the key that identifies this one termination."""

    key: str
    exit_code: int
    reason: str


@dataclass(frozen=True)
class PodObs:
    """What the lifecycle needs from one pod."""

    name: str
    uid: str
    role: str
    pool: str | None
    ordinal: int | None
    deleting: bool
    exits: tuple[PodExit, ...] = ()

    def failures(self) -> list[PodExit]:
        """Terminations with a non-zero exit code (or a Failed pod phase)."""
        return [e for e in self.exits if e.exit_code != 0]

    def succeeded(self) -> bool:
        """Whether a termination with exit code 0 was seen."""
        return any(e.exit_code == 0 for e in self.exits)


@dataclass
class Observed:
    """Children of one RLJob as seen now; `None` means the object does not exist (yet)."""

    pools: dict[str, WorkloadObs | None] = field(default_factory=dict)
    router: WorkloadObs | None = None
    trainer: WorkloadObs | None = None
    trainer_pods: list[PodObs] = field(default_factory=list)
    # Inference pods that disappeared or failed (from the pod watch), and the uids of the inference
    # pods that are Ready now by name (to tell whether a lost pod's replacement is already serving).
    lost_inference_pods: list[PodObs] = field(default_factory=list)
    ready_inference_pods: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class EventRecord:
    """A Kubernetes Event to post on the RLJob."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass
class Decision:
    """Result of one lifecycle evaluation."""

    status: RLJobStatus
    active: bool
    restart_trainer: bool = False
    # Healthy peers of the failed trainer pods: deleted so the whole group restarts together. The
    # failed pods themselves need nothing: kubelet restarts their container, or the StatefulSet
    # replaces a Failed pod, so deleting them could kill an already-fresh replacement.
    restart_peers: list[PodObs] = field(default_factory=list)
    events: list[EventRecord] = field(default_factory=list)


# Condition flips worth an Event (terminal outcomes and failures have their own, more specific ones).
_FLIP_EVENTS: dict[tuple[str, bool], tuple[Literal["Normal", "Warning"], str]] = {
    ("Ready", True): ("Normal", "JobReady"),
    ("Degraded", True): ("Warning", "Degraded"),
    ("Degraded", False): ("Normal", "Recovered"),
    ("Suspended", True): ("Normal", "Suspended"),
    ("Suspended", False): ("Normal", "Resumed"),
}


def pod_observation(pod: dict[str, Any]) -> PodObs:
    """Reduce a Pod object to what the lifecycle needs."""
    meta = pod.get("metadata", {})
    labels = meta.get("labels") or {}
    status = pod.get("status") or {}
    ordinal = labels.get("apps.kubernetes.io/pod-index")
    if ordinal is None:
        # Older clusters do not set the pod-index label: the StatefulSet pod name ends in the ordinal.
        tail = meta.get("name", "").rsplit("-", 1)[-1]
        ordinal = tail if tail.isdigit() else None
    exits: list[PodExit] = []
    uid = meta.get("uid", "")
    restart_count = 0
    for cs in status.get("containerStatuses") or []:
        if cs.get("name") != TRAINER_CONTAINER and labels.get(LABEL_ROLE) != ROLE_INFERENCE:
            continue
        restart_count = int(cs.get("restartCount") or 0)
        terminated = (cs.get("state") or {}).get("terminated")
        if terminated:
            exits.append(_exit(uid, restart_count, terminated))
        last = (cs.get("lastState") or {}).get("terminated")
        if last and restart_count > 0:
            exits.append(_exit(uid, restart_count - 1, last))
    if status.get("phase") == "Failed" and not any(e.key == f"{uid}:{restart_count}" for e in exits):
        exits.append(PodExit(f"{uid}:{restart_count}", -1, status.get("reason") or "PodFailed"))
    if status.get("phase") == "Succeeded" and not exits:
        exits.append(PodExit(f"{uid}:{restart_count}", 0, "Completed"))
    return PodObs(
        name=meta.get("name", ""),
        uid=uid,
        role=labels.get(LABEL_ROLE, ""),
        pool=labels.get(LABEL_POOL),
        ordinal=int(ordinal) if ordinal is not None else None,
        deleting=meta.get("deletionTimestamp") is not None,
        exits=tuple(exits),
    )


def _exit(uid: str, count: int, terminated: dict[str, Any]) -> PodExit:
    code = int(terminated.get("exitCode", -1))
    return PodExit(f"{uid}:{count}", code, terminated.get("reason") or ("Completed" if code == 0 else "Error"))


def _knobs(spec: RLJobSpec, prev: EffectiveKnobs) -> EffectiveKnobs:
    """Spec values for every knob the autotuner does not currently own."""
    partial = spec.rollout.partial
    over = prev.over_sampling
    if over is None or over.source == "spec":
        over = KnobValue(value=partial.over_sampling, unit="ratio", source="spec", reason="FromSpec")
    trunc = prev.truncation
    if trunc is None or trunc.source == "spec":
        t = partial.truncation
        if t.mode == "sigma":
            trunc = KnobValue(value=t.k, unit="sigma", source="spec", reason="FromSpec")
        elif t.mode == "tokens" and t.max_tokens is not None:
            trunc = KnobValue(value=float(t.max_tokens), unit="tokens", source="spec", reason="FromSpec")
        else:
            trunc = None
    return EffectiveKnobs(over_sampling=over, truncation=trunc)


class _Conditions:
    """Builds the condition list, keeping lastTransitionTime unless the status flips."""

    def __init__(self, prev: RLJobStatus, generation: int, now: datetime) -> None:
        self.prev = prev
        self.generation = generation
        self.now = now
        self.items: dict[str, Condition] = {}
        self.flipped: list[Condition] = []

    def set(self, type_: str, true: bool, reason: str, message: str = "") -> None:
        status = "True" if true else "False"
        old = self.prev.condition(type_)
        changed = old is None or old.status != status
        cond = Condition(
            type=type_,
            status=status,
            reason=reason,
            message=message,
            observed_generation=self.generation,
            last_transition_time=self.now if changed or old is None else old.last_transition_time,
        )
        self.items[type_] = cond
        if changed and (old is not None or true):
            self.flipped.append(cond)

    def as_list(self) -> list[Condition]:
        foreign = [c for c in self.prev.conditions if c.type not in CONDITION_TYPES]
        return [self.items[t] for t in CONDITION_TYPES] + foreign


def _remember(handled: list[str], keys: list[str]) -> list[str]:
    merged = handled + [k for k in keys if k not in handled]
    return merged[-MAX_HANDLED_FAILURES:]


def compute_status(
    job: JobRef, spec: RLJobSpec, generation: int, prev: RLJobStatus, obs: Observed, now: datetime
) -> Decision:
    """Decide the new status and the actions for one RLJob from its spec, old status and children."""
    events: list[EventRecord] = []
    outcome = prev.outcome
    restarts = prev.restarts.model_copy(deep=True)
    restart_trainer = False
    restart_peers: list[PodObs] = []
    was_active = not spec.suspend and outcome is None
    lost_now: list[PodObs] = []

    if outcome is None:
        rank0_done = [p for p in obs.trainer_pods if p.ordinal == 0 and not p.deleting and p.succeeded()]
        if rank0_done:
            outcome = Outcome(
                result="Complete", reason="TrainerSucceeded", message=f"{rank0_done[0].name} exited 0", time=now
            )
            events.append(EventRecord("Normal", "Completed", f"trainer {rank0_done[0].name} finished: job complete"))

    if outcome is None:
        failed = [
            (p, e)
            for p in obs.trainer_pods
            if not p.deleting
            for e in p.failures()
            if e.key not in restarts.handled_failures
        ]
        if failed:
            pod, exit_ = failed[0]
            what = f"trainer pod {pod.name} failed ({exit_.reason}, exit code {exit_.exit_code})"
            restarts.handled_failures = _remember(restarts.handled_failures, [e.key for _, e in failed])
            if restarts.trainer < spec.backoff_limit:
                restarts.trainer += 1
                restarts.last_trainer_restart_time = now
                restart_trainer = True
                failed_ordinals = {p.ordinal for p, _ in failed}
                restart_peers = [
                    p for p in obs.trainer_pods if not p.deleting and p.ordinal not in failed_ordinals
                ]
                events.append(
                    EventRecord(
                        "Warning",
                        "TrainerRestarting",
                        f"{what}; restarting the trainer group from the last checkpoint "
                        f"(restart {restarts.trainer}/{spec.backoff_limit})",
                    )
                )
            else:
                message = f"{what}; backoffLimit {spec.backoff_limit} reached"
                outcome = Outcome(result="Failed", reason="BackoffLimitExceeded", message=message, time=now)
                events.append(EventRecord("Warning", "BackoffLimitExceeded", message))

    if outcome is None and was_active and prev.start_time and spec.active_deadline_seconds:
        if (now - prev.start_time).total_seconds() >= spec.active_deadline_seconds:
            message = f"job ran longer than activeDeadlineSeconds={spec.active_deadline_seconds}"
            outcome = Outcome(result="Failed", reason="DeadlineExceeded", message=message, time=now)
            events.append(EventRecord("Warning", "DeadlineExceeded", message))

    active = not spec.suspend and outcome is None
    desired_counts = pool_replicas(spec.rollout)
    if active:
        for pod in obs.lost_inference_pods:
            key = f"{pod.uid}:lost"
            in_scale = pod.ordinal is not None and pod.ordinal < desired_counts.get(pod.pool or "", 0)
            if in_scale and key not in restarts.handled_failures:
                restarts.handled_failures = _remember(restarts.handled_failures, [key])
                restarts.rollout += 1
                # A loss reported after its replacement is already serving is counted, not degrading.
                if obs.ready_inference_pods.get(pod.name, pod.uid) == pod.uid:
                    lost_now.append(pod)
                events.append(
                    EventRecord(
                        "Warning",
                        "InferenceReplicaLost",
                        f"inference pod {pod.name} of pool {pod.pool} is gone; its StatefulSet replaces it",
                    )
                )

    # Rollout and trainer replica status.
    pools: list[PoolStatus] = []
    for pool in effective_pools(spec.rollout):
        seen = obs.pools.get(pool.name)
        desired = desired_counts[pool.name] if active else 0
        pools.append(PoolStatus(name=pool.name, vendor=pool.vendor, desired=desired, ready=seen.ready if seen else 0))
    router_ready = obs.router is not None and obs.router.ready >= 1
    desired_total = sum(p.desired for p in pools)
    ready_total = sum(min(p.ready, p.desired) for p in pools)
    rollout = RolloutStatus(
        desired=desired_total,
        ready=sum(p.ready for p in pools),
        router_ready=router_ready,
        selector=selector_string(selector_labels(job, ROLE_INFERENCE)),
        summary=f"{ready_total}/{desired_total}",
        pools=pools,
    )
    trainer_desired = spec.trainer.replicas if active else 0
    trainer_ready_count = obs.trainer.ready if obs.trainer else 0
    trainer = TrainerStatus(
        desired=trainer_desired,
        ready=trainer_ready_count,
        summary=f"{min(trainer_ready_count, trainer_desired)}/{trainer_desired}",
    )

    # Conditions.
    conds = _Conditions(prev, generation, now)
    short = [f"{p.name} {p.ready}/{p.desired}" for p in pools if p.ready < p.desired]
    rollout_ok = active and desired_total > 0 and not short and router_ready
    trainer_ok = active and trainer_ready_count >= trainer_desired
    was_serving = prev.is_true("RolloutReady") or prev.is_true("Degraded")
    degraded = active and (bool(lost_now) or (was_serving and not rollout_ok))

    if not active:
        inactive_reason = outcome.result if outcome else "Suspended"
        conds.set("RolloutReady", False, inactive_reason, "workloads scaled to zero")
        conds.set("TrainerReady", False, inactive_reason, "workloads scaled to zero")
    else:
        if rollout_ok:
            conds.set("RolloutReady", True, "AllReplicasReady", f"{ready_total}/{desired_total} replicas and router ready")
        elif desired_total == 0:
            conds.set("RolloutReady", False, "NoReplicas", "no inference replicas requested")
        else:
            parts = short + ([] if router_ready else ["router not ready"])
            conds.set("RolloutReady", False, "ReplicasNotReady", "; ".join(parts))
        conds.set(
            "TrainerReady",
            trainer_ok,
            "AllReplicasReady" if trainer_ok else ("Restarting" if restart_trainer else "ReplicasNotReady"),
            f"{trainer_ready_count}/{trainer_desired} trainer pods ready",
        )
    ready = active and rollout_ok and trainer_ok and not degraded
    if degraded:
        message = "; ".join([f"lost {p.name}" for p in lost_now] + short) or "inference replicas not ready"
        conds.set("Degraded", True, "ReplicaLost" if lost_now else "ReplicasUnavailable", message)
    else:
        conds.set("Degraded", False, "AsExpected" if active else "NotRunning")
    conds.set("Ready", ready, "JobReady" if ready else ("NotRunning" if not active else "NotReady"))
    if active:
        conds.set("Progressing", True, "Running" if ready else ("Recovering" if degraded else "Starting"))
    else:
        conds.set("Progressing", False, outcome.result if outcome else "Suspended")
    suspended = spec.suspend and outcome is None
    conds.set("Suspended", suspended, "JobSuspended" if suspended else "NotSuspended")
    complete = outcome is not None and outcome.result == "Complete"
    failed_job = outcome is not None and outcome.result == "Failed"
    conds.set("Complete", complete, outcome.reason if complete else "NotComplete", outcome.message if complete else "")
    conds.set("Failed", failed_job, outcome.reason if failed_job else "NotFailed", outcome.message if failed_job else "")

    # Phase and times.
    if outcome is not None:
        phase = outcome.result
    elif suspended:
        phase = "Suspended"
    elif degraded:
        phase = "Degraded"
    elif ready:
        phase = "Running"
    elif obs.trainer is None and not any(obs.pools.values()):
        phase = "Pending"
    else:
        phase = "Starting"
    # Like a Kubernetes Job, the deadline clock restarts when a suspended job resumes.
    start_time = (prev.start_time or now) if active else (prev.start_time if outcome else None)

    for cond in conds.flipped:
        flip = _FLIP_EVENTS.get((cond.type, cond.status == "True"))
        if flip is not None:
            events.append(EventRecord(flip[0], flip[1], cond.message or cond.reason))

    status = RLJobStatus(
        phase=phase,
        observed_generation=generation,
        conditions=conds.as_list(),
        start_time=start_time,
        completion_time=outcome.time if outcome else None,
        rollout=rollout,
        trainer=trainer,
        restarts=restarts,
        outcome=outcome,
        effective_knobs=_knobs(spec, prev.effective_knobs),
        metrics=prev.metrics,
    )
    return Decision(
        status=status, active=active, restart_trainer=restart_trainer, restart_peers=restart_peers, events=events
    )


def operator_patch(prev: RLJobStatus, new: RLJobStatus) -> dict[str, Any]:
    """JSON merge patch of the keys the operator owns (never the runtime's progress or the autotuner's knobs)."""
    wire = new.to_wire()
    patch: dict[str, Any] = {
        key: wire.get(key)
        for key in ("phase", "observedGeneration", "conditions", "startTime", "completionTime", "rollout", "restarts")
    }
    if new.outcome is not None:
        patch["outcome"] = wire["outcome"]
    patch["trainer"] = {k: wire["trainer"][k] for k in ("desired", "ready", "summary")}
    knobs: dict[str, Any] = {}
    for name, wire_name in (("over_sampling", "overSampling"), ("truncation", "truncation")):
        old, value = getattr(prev.effective_knobs, name), getattr(new.effective_knobs, name)
        if value is not None and value.source == "spec":
            knobs[wire_name] = value.to_wire()
        elif value is None and old is not None and old.source == "spec":
            knobs[wire_name] = None
    if knobs:
        patch["effectiveKnobs"] = knobs
    return patch
