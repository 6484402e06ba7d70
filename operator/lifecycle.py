"""Pure lifecycle decisions: observed children + previous status → new status, actions and Events.

Nothing here talks to the API server, so every rule (conditions, phase, deadlines, failure policy,
suspend) is unit-tested directly. The handlers observe, call `compute_status`, then act.

Failure policy:
- a lost or failed inference pod marks the job Degraded until its StatefulSet has replaced it;
- the trainer group is a gang (one Indexed Job): a failed rank restarts the whole group (the operator
  deletes the Job and creates a new one, which resumes from the last checkpoint), up to
  `spec.backoffLimit` restarts; the next failure ends the job Failed/BackoffLimitExceeded;
- a disrupted rank (DisruptionTarget condition: eviction, preemption, node shutdown) or one that
  exited Interrupted (SIGTERM before the last step) restarts the group too, counted in
  `restarts.interrupted`, never against backoffLimit and never as success;
- the leader's (completion index 0) exit 0 completes the job; finished and suspended jobs keep their
  objects (checkpoint PVC included) with every workload scaled to zero.
Only pods of the current trainer Job count: once the operator deleted a Job, what its pods do is
history. Every failure is identified by a key (`<role>/<pod uid>/<restart count>`) stored in status,
so a failure seen twice (timer and watch, or before and after an operator restart) is counted once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

from rljob.api.spec import RLJobSpec
from rljob.api.status import (
    CONDITION_TYPES,
    EXIT_INTERRUPTED,
    INTERRUPTED_REASON,
    REWARD_COLLAPSE_REASON,
    Condition,
    EffectiveKnobs,
    KnobValue,
    Outcome,
    Phase,
    PoolStatus,
    RestartStatus,
    RLJobStatus,
    RolloutStatus,
    rfc3339,
    TrainerStatus,
)
from rljob.operator.builders.inference import effective_pools, pool_replicas
from rljob.operator.builders.meta import (
    LABEL_POOL,
    LABEL_ROLE,
    ROLE_INFERENCE,
    ROLE_TRAINER,
    JobRef,
    selector_labels,
    selector_string,
)
from rljob.operator.builders.trainer import COMPLETION_INDEX_LABEL, JOB_UID_LABEL
from rljob.operator.exit_message import exit_reason
from rljob.operator.node_loss import NodeObs, TerminatingPod, deletion_deadline, deletion_requested, stuck_pods
from rljob.operator.pod_waits import PodWait, waits_message

TRAINER_CONTAINER = "trainer"
# How long after its grace period a deleting pod still counts as running (the kubelet's own margin to
# report the kill); past it the pod is lost with its node, and nothing waits on it.
PAST_GRACE_S = 60.0


@dataclass(frozen=True)
class WorkloadObs:
    """A StatefulSet or Deployment as observed: its scale and ready replicas."""

    replicas: int
    ready: int


@dataclass(frozen=True)
class TrainerJobObs:
    """The trainer's Indexed Job as observed."""

    uid: str
    replicas: int  # parallelism, 0 while suspended
    ready: int
    deleting: bool = False
    suspended: bool = False
    complete: bool = False
    failed_message: str | None = None  # the Job's Failed condition message, when it failed
    # It failed while suspended: the suspend's deletions stopped its ranks, which exit non-zero after a
    # SIGTERM, and the Job controller applies podFailurePolicy (FailJob) to pods that were deleted once
    # they are terminal. Whether that happens is a race with the pods' removal (1 run in 3 on the real node).
    failed_while_suspended: bool = False

    @property
    def live(self) -> bool:
        """Running (or about to): neither being deleted, nor suspended."""
        return not self.deleting and not self.suspended


@dataclass(frozen=True)
class ApplyResult:
    """Outcome of applying one generation's children: the API server's refusal, or what still waits."""

    generation: int
    error: str | None = None
    waiting: tuple[str, ...] = ()
    # Which consecutive attempt this was, and what the failed ones before it were (apply_retry.Failures.summary).
    attempt: int = 1
    retried: str = ""
    reason: str = "ApplyFailed"  # the condition's reason with an error: ApplyFailed, or NotOwned (an object not ours)


@dataclass(frozen=True)
class PodExit:
    """A terminated container (or a Failed pod) with the key that identifies this one termination."""

    key: str
    exit_code: int
    reason: str
    message: str = ""

    @property
    def interrupted(self) -> bool:
        """The runtime stopped on SIGTERM before its last step (a disruption, not a failure nor success)."""
        return self.exit_code == EXIT_INTERRUPTED or self.message.startswith(INTERRUPTED_REASON)


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
    job_uid: str | None = None  # the owning Job's uid (trainer pods)
    disrupted: bool = False  # DisruptionTarget=True: evicted, preempted, node shutdown
    restart_count: int = 0
    # When the pod's deletion was asked for (the API server's deletionTimestamp less the grace period; to
    # the second): None while nobody deletes it, and for a pod force-deleted without one.
    deletion_requested: datetime | None = None
    # The pod's phase, and when its grace period ends (the API server's deletionTimestamp).
    phase: str = ""
    deletion_deadline: datetime | None = None

    def running(self, now: datetime) -> bool:
        """Whether the pod's containers may still run: not terminal, and not past its grace period by more
        than PAST_GRACE_S (a pod left Terminating on an unreachable node runs nothing any more)."""
        if self.phase in ("Succeeded", "Failed"):
            return False
        return self.deletion_deadline is None or now < self.deletion_deadline + timedelta(seconds=PAST_GRACE_S)

    def failures(self) -> list[PodExit]:
        """Terminations with a non-zero exit code (or a Failed pod phase)."""
        return [e for e in self.exits if e.exit_code != 0]

    def succeeded(self) -> bool:
        """Whether a termination with exit code 0 was seen."""
        return any(e.exit_code == 0 for e in self.exits)

    @property
    def key(self) -> str:
        """Key of this pod's current incarnation (role, uid, restart count)."""
        return failure_key(self.role, self.uid, self.restart_count)


@dataclass
class Observed:
    """Children of one RLJob as seen now; `None` means the object does not exist (yet)."""

    pools: dict[str, WorkloadObs | None] = field(default_factory=dict)
    router: WorkloadObs | None = None
    trainer: TrainerJobObs | None = None
    trainer_pods: list[PodObs] = field(default_factory=list)
    # uids of the inference pods that exist now (handled keys of other pods are dropped).
    inference_pod_uids: set[str] = field(default_factory=set)
    # Inference pods that disappeared or failed (from the pod watch), and the uids of the inference
    # pods that are Ready now by name (to tell whether a lost pod's replacement is already serving).
    lost_inference_pods: list[PodObs] = field(default_factory=list)
    ready_inference_pods: dict[str, str] = field(default_factory=dict)
    # The job's pods being deleted on a node, and the nodes of those deleting for long (operator/node_loss.py).
    terminating_pods: list[TerminatingPod] = field(default_factory=list)
    nodes: dict[str, NodeObs] = field(default_factory=dict)
    # Pods waiting on something that will not fix itself (image pull, scheduling, claim, crash loop).
    waiting_pods: list[PodWait] = field(default_factory=list)


@dataclass(frozen=True)
class EventRecord:
    """A Kubernetes Event to post on the RLJob."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass
class LifecycleDecision:
    """Result of one lifecycle evaluation."""

    status: RLJobStatus
    active: bool
    # uid of the trainer Job to delete so that the whole group restarts (a new Job is then created).
    restart_trainer_job: str | None = None
    events: list[EventRecord] = field(default_factory=list)
    # Pods stuck Terminating on a node tainted out-of-service: to force-delete (operator/node_loss.py).
    force_delete: list[TerminatingPod] = field(default_factory=list)

    @property
    def restart_trainer(self) -> bool:
        """Whether the trainer group is to be restarted."""
        return self.restart_trainer_job is not None


# Condition flips worth an Event (terminal outcomes and failures have their own, more specific ones).
_FLIP_EVENTS: dict[tuple[str, bool], tuple[Literal["Normal", "Warning"], str]] = {
    ("Ready", True): ("Normal", "JobReady"),
    ("Degraded", True): ("Warning", "Degraded"),
    ("Degraded", False): ("Normal", "Recovered"),
    ("Suspended", True): ("Normal", "Suspended"),
    ("Suspended", False): ("Normal", "Resumed"),
    ("NodeUnreachable", True): ("Warning", "PodStuckTerminating"),
    ("NodeUnreachable", False): ("Normal", "NoPodStuck"),
}


def pod_observation(pod: dict[str, Any]) -> PodObs:
    """Reduce a Pod object to what the lifecycle needs."""
    meta = pod.get("metadata", {})
    labels = meta.get("labels") or {}
    status = pod.get("status") or {}
    ordinal = labels.get(COMPLETION_INDEX_LABEL) or labels.get("apps.kubernetes.io/pod-index")
    if ordinal is None:
        # Older clusters do not set the pod-index label: the StatefulSet pod name ends in the ordinal.
        tail = meta.get("name", "").rsplit("-", 1)[-1]
        ordinal = tail if tail.isdigit() else None
    exits: list[PodExit] = []
    uid = meta.get("uid", "")
    role = labels.get(LABEL_ROLE, "")
    restart_count = 0
    for cs in status.get("containerStatuses") or []:
        if cs.get("name") != TRAINER_CONTAINER and role != ROLE_INFERENCE:
            continue
        restart_count = int(cs.get("restartCount") or 0)
        terminated = (cs.get("state") or {}).get("terminated")
        if terminated:
            exits.append(_exit(role, uid, restart_count, terminated))
        last = (cs.get("lastState") or {}).get("terminated")
        if last and restart_count > 0:
            exits.append(_exit(role, uid, restart_count - 1, last))
    current = failure_key(role, uid, restart_count)
    if status.get("phase") == "Failed" and not any(e.key == current for e in exits):
        exits.append(PodExit(current, -1, status.get("reason") or "PodFailed", status.get("message") or ""))
    if status.get("phase") == "Succeeded" and not exits:
        exits.append(PodExit(current, 0, "Completed"))
    disrupted = any(
        c.get("type") == "DisruptionTarget" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    return PodObs(
        name=meta.get("name", ""),
        uid=uid,
        role=role,
        pool=labels.get(LABEL_POOL),
        ordinal=int(ordinal) if ordinal is not None else None,
        deleting=meta.get("deletionTimestamp") is not None,
        exits=tuple(exits),
        job_uid=labels.get(JOB_UID_LABEL),
        disrupted=disrupted,
        restart_count=restart_count,
        deletion_requested=deletion_requested(meta),
        phase=status.get("phase") or "",
        deletion_deadline=deletion_deadline(meta),
    )


def failure_key(role: str, uid: str, restart_count: int | str) -> str:
    """`<role>/<pod uid>/<restart count>`: one termination of one pod incarnation."""
    return f"{role}/{uid}/{restart_count}"


def _exit(role: str, uid: str, count: int, terminated: dict[str, Any]) -> PodExit:
    code = int(terminated.get("exitCode", -1))
    reason = terminated.get("reason") or ("Completed" if code == 0 else "Error")
    return PodExit(failure_key(role, uid, count), code, reason, (terminated.get("message") or "").strip())


def trainer_job_observation(job: dict[str, Any]) -> TrainerJobObs:
    """Reduce the trainer's batch/v1 Job to what the lifecycle needs."""
    spec, status = job.get("spec") or {}, job.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or [] if c.get("status") == "True"}
    suspended = bool(spec.get("suspend"))
    failed = conditions.get("Failed")
    # The Job controller no longer syncs a finished Job, so a Job that failed while suspended keeps its
    # Suspended=True condition after the operator resumes it; one resumed by the controller first has
    # Suspended=False, and a later failure is the resumed run's own. (RFC 3339 times compare as strings.)
    # The controller marks FailureTarget first and Failed once the pods are gone (seen on the real node:
    # FailureTarget 5 min after Suspended, when the stopped ranks' grace period ran out).
    suspended_since = (conditions.get("Suspended") or {}).get("lastTransitionTime")
    failed_at = (conditions.get("FailureTarget") or failed or {}).get("lastTransitionTime")
    return TrainerJobObs(
        uid=job["metadata"]["uid"],
        replicas=0 if suspended else int(spec.get("parallelism") or 0),
        ready=int(status.get("ready") or 0),
        deleting=job["metadata"].get("deletionTimestamp") is not None,
        suspended=suspended,
        complete="Complete" in conditions or "SuccessCriteriaMet" in conditions,
        failed_message=None if failed is None else (failed.get("message") or failed.get("reason") or "Job failed"),
        failed_while_suspended=bool(suspended_since and failed_at and failed_at >= suspended_since),
    )


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
        status: Literal["True", "False"] = "True" if true else "False"
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

    def keep(self, type_: str) -> None:
        """Carry the previous condition of this type over unchanged (nothing new is known about it)."""
        old = self.prev.condition(type_)
        if old is not None:
            self.items[type_] = old

    def as_list(self) -> list[Condition]:
        foreign = [c for c in self.prev.conditions if c.type not in CONDITION_TYPES]
        return [self.items[t] for t in CONDITION_TYPES if t in self.items] + foreign


def _remember(handled: list[str], keys: list[str]) -> list[str]:
    return handled + [k for k in keys if k not in handled]


# Keys of lost inference pods kept after the pods are gone from every list (the newest ones).
LOST_INFERENCE_KEYS_KEPT = 32


def _prune(handled: list[str], obs: Observed, lost: list[PodObs]) -> list[str]:
    """Keep the keys of failures that can still be seen: trainer pods of the current Job (and the Job's own
    key), inference pods that exist or were just reported lost, and the newest lost inference pods.

    A lost inference pod's deletion can be reported again after the pass that counted it, by a sync that
    runs after another pass had already pruned its key (two `lost (DELETED)` reports of one pod 33 ms
    apart counted `restarts.rollout` 2 in a clean-clone run), so the newest LOST_INFERENCE_KEYS_KEPT of
    those keys stay, a bound instead of a clock."""
    keep = {p.uid for p in obs.trainer_pods} | obs.inference_pod_uids | {p.uid for p in lost}
    if obs.trainer is not None:
        keep.add(obs.trainer.uid)
    seen = {k for k in handled if k.split("/")[1:2] and k.split("/")[1] in keep}
    gone_inference = [k for k in handled if k not in seen and k.startswith(f"{ROLE_INFERENCE}/")]
    recent = set(gone_inference[-LOST_INFERENCE_KEYS_KEPT:])
    return [k for k in handled if k in seen or k in recent]


@dataclass(frozen=True)
class _RankTrouble:
    """One reason to restart the trainer group: a failed or disrupted rank (or the failed Job itself)."""

    key: str
    what: str
    interrupted: bool
    collapsed: bool = False  # the runtime stopped on RewardCollapse: a restart would collapse again


def _trainer_troubles(obs: Observed, handled: list[str]) -> list[_RankTrouble]:
    """Unhandled failures and disruptions of the current trainer Job's ranks.

    Pods being deleted without a DisruptionTarget condition were stopped on purpose (a gang restart,
    suspend, the Job controller stopping the other ranks after a failure or success): not a reason,
    unless the runtime says it stopped Interrupted: a trainer pod deleted by hand (`kubectl delete pod`)
    stops the whole gang at the step boundary, checkpointed, and its exit fails the Job (torchrun exits 1),
    which is an interruption, not a failure. (A gang restart and a suspend happen with the Job deleted or
    the job inactive, which this is not asked about; after a real failure that rank's exit counts.)
    """
    job = obs.trainer
    if job is None or not job.live:
        return []
    job_key = failure_key(ROLE_TRAINER, job.uid, "job")
    if job_key in handled or job.failed_while_suspended:
        # (A Job that failed while suspended: every rank was stopped by the suspend, see compute_status.)
        # This Job was already restarted: a read that still shows it live (its deletion not yet seen)
        # must not count a rank's failure again, also when that rank's own key was pruned meanwhile
        # (the pod gone from one read, back in the next as a pod the watch reported).
        return []
    troubles: list[_RankTrouble] = []
    for pod in obs.trainer_pods:
        failures = pod.failures()
        stopped_on_purpose = pod.deleting and not pod.disrupted and not (failures and all(e.interrupted for e in failures))
        if pod.job_uid != job.uid or stopped_on_purpose or pod.key in handled:
            continue
        if pod.disrupted:
            troubles.append(_RankTrouble(pod.key, f"trainer pod {pod.name} was disrupted (DisruptionTarget)", True))
        elif failures:
            exit_ = failures[0]
            said = exit_reason(exit_.message)
            detail = f"{exit_.reason}, exit code {exit_.exit_code}" + (f": {said}" if said else "")
            interrupted = all(e.interrupted for e in failures)
            verb = "was interrupted" if interrupted else "failed"
            collapsed = any(e.message.startswith(REWARD_COLLAPSE_REASON) for e in failures)
            troubles.append(_RankTrouble(exit_.key, f"trainer pod {pod.name} {verb} ({detail})", interrupted, collapsed))
    if not troubles and job.failed_message is not None:
        # The Job failed but none of its ranks shows why (a pod deleted outright): a failure.
        troubles.append(_RankTrouble(job_key, f"trainer Job failed: {job.failed_message}", False))
    return troubles


def engines_serve(active: bool, trainer_pods: list[PodObs], now: datetime) -> bool:
    """Whether the inference pools and the router keep their replicas: while the job is active, and after
    it stops (suspend, completion, failure) for as long as a trainer pod still runs. A rank stopped by a
    suspend or a preemption finishes its step and checkpoints it before it exits (docs/distributed.md,
    "Preemption"); that step's rollouts need the engines, so they go only once the ranks are gone."""
    return active or any(pod.running(now) for pod in trainer_pods)


def compute_status(
    job: JobRef,
    spec: RLJobSpec,
    generation: int,
    prev: RLJobStatus,
    obs: Observed,
    now: datetime,
    applied: ApplyResult | None = None,
) -> LifecycleDecision:
    """Decide the new status and the actions for one RLJob from its spec, old status and children.

    `applied` is the result of applying this generation's children in this pass (None: no apply was
    attempted, the previous ChildrenApplied condition and observedGeneration stand).
    """
    events: list[EventRecord] = []
    outcome = prev.outcome
    restarts = prev.restarts.model_copy(deep=True)
    restart_job: str | None = None
    hold_s = 0  # seconds the new trainer group waits after an interruption (failurePolicy backoff)
    was_active = not spec.suspend and outcome is None
    lost_now: list[PodObs] = []
    current_job = obs.trainer.uid if obs.trainer is not None else None

    if outcome is None:
        leader_done = [
            p
            for p in obs.trainer_pods
            if p.ordinal == 0 and p.job_uid == current_job and p.succeeded() and not p.failures()
        ]
        if leader_done or (obs.trainer is not None and obs.trainer.complete):
            who = leader_done[0].name if leader_done else "the trainer Job's leader (index 0)"
            outcome = Outcome(result="Complete", reason="TrainerSucceeded", message=f"{who} exited 0", time=now)
            events.append(EventRecord("Normal", "Completed", f"trainer {who} finished: job complete"))

    troubles = _trainer_troubles(obs, restarts.handled_failures) if outcome is None and was_active else []
    stale = obs.trainer if outcome is None and was_active and obs.trainer is not None else None
    if stale is not None and stale.failed_while_suspended and not stale.deleting and \
            failure_key(ROLE_TRAINER, stale.uid, "job") not in restarts.handled_failures:
        # The resumed job's trainer Job failed while it was suspended, by the suspend's own deletions:
        # recreate it (from the checkpoint the stopping ranks wrote), counted neither as a failure nor as
        # an interruption.
        restart_job = stale.uid
        events.append(EventRecord("Normal", "TrainerRecreated",
                                  "the trainer Job failed while suspended (the suspend stopped its ranks); "
                                  "recreating it from the last checkpoint, not counted against backoffLimit"))
    if troubles and obs.trainer is not None:
        restarts.handled_failures = _remember(restarts.handled_failures, [t.key for t in troubles])
        failures = [t for t in troubles if not t.interrupted]
        first = (failures or troubles)[0]
        policy = spec.failure_policy
        collapse = next((t for t in failures if t.collapsed), None)
        if collapse is not None:
            message = f"{collapse.what}; not restarted: a restart would sample the same collapsed rewards"
            outcome = Outcome(result="Failed", reason=REWARD_COLLAPSE_REASON, message=message, time=now)
            events.append(EventRecord("Warning", REWARD_COLLAPSE_REASON, message))
        elif not failures and restarts.interrupted >= policy.max_interruptions:
            message = f"{first.what}; failurePolicy.maxInterruptions {policy.max_interruptions} reached"
            outcome = Outcome(result="Failed", reason="InterruptionLimitExceeded", message=message, time=now)
            events.append(EventRecord("Warning", "InterruptionLimitExceeded", message))
        elif not failures:
            restarts.interrupted += 1
            restart_job = obs.trainer.uid
            hold_s = policy.interruption_delay(restarts.interrupted)
            events.append(
                EventRecord(
                    "Warning",
                    "TrainerInterrupted",
                    f"{first.what}; restarting the trainer group from the last checkpoint in {hold_s} s "
                    f"(not counted against backoffLimit; interruption {restarts.interrupted}/{policy.max_interruptions})",
                )
            )
        elif restarts.trainer < spec.backoff_limit:
            restarts.trainer += 1
            restart_job = obs.trainer.uid
            events.append(
                EventRecord(
                    "Warning",
                    "TrainerRestarting",
                    f"{first.what}; restarting the trainer group from the last checkpoint "
                    f"(restart {restarts.trainer}/{spec.backoff_limit})",
                )
            )
        else:
            message = f"{first.what}; backoffLimit {spec.backoff_limit} reached"
            outcome = Outcome(result="Failed", reason="BackoffLimitExceeded", message=message, time=now)
            events.append(EventRecord("Warning", "BackoffLimitExceeded", message))
    if restart_job is not None:
        restarts.last_trainer_restart_time = now
        # Only an interruption backs off (a failure is bounded by backoffLimit instead); the hold is read by
        # trainer_start_held before a new trainer Job is created.
        restarts.trainer_start_not_before = now + timedelta(seconds=hold_s) if hold_s else None
        # One restart per Job: a later read of the same Job (failed, not yet seen deleting, e.g. a watch
        # cache that has the pod's deletion before the Job's) must not count its failure again.
        restarts.handled_failures = _remember(restarts.handled_failures, [failure_key(ROLE_TRAINER, restart_job, "job")])

    if outcome is None and was_active and prev.start_time and spec.active_deadline_seconds:
        if (now - prev.start_time).total_seconds() >= spec.active_deadline_seconds:
            message = f"job ran longer than activeDeadlineSeconds={spec.active_deadline_seconds}"
            outcome = Outcome(result="Failed", reason="DeadlineExceeded", message=message, time=now)
            events.append(EventRecord("Warning", "DeadlineExceeded", message))

    active = not spec.suspend and outcome is None
    desired_counts = pool_replicas(spec.rollout)
    # Pods lost while the job was suspended (the scale-down's DELETED events can arrive after the resume,
    # tagged with the resumed generation) are no loss of the resumed job: its pools start from scratch.
    # Nor are pods whose deletion was asked for before the job's latest start: a DELETED event of the
    # suspend's scale-down can come after the first pass of the resumed job (seen in the chaos test as
    # Starting -> Degraded [InferenceReplicaLost] for ~15 s after a resume, counted in restarts.rollout).
    if active and prev.phase != "Suspended":
        for pod in obs.lost_inference_pods:
            if pod.deletion_requested is not None and prev.start_time and pod.deletion_requested < prev.start_time:
                continue
            key = failure_key(ROLE_INFERENCE, pod.uid, pod.restart_count)
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
    observed_generation = prev.observed_generation
    if applied is None:
        conds.keep("ChildrenApplied")
    elif applied.error is not None:
        conds.set(
            "ChildrenApplied", False, applied.reason,
            f"{applied.error} (attempt {applied.attempt}; retried with capped backoff until it applies)",
        )
    elif applied.waiting:
        conds.set("ChildrenApplied", False, "Recreating", f"waiting for the old {', '.join(applied.waiting)} to go")
    else:
        observed_generation = applied.generation
        after = f" after {applied.retried}" if applied.retried else ""
        conds.set("ChildrenApplied", True, "Applied", f"children of generation {applied.generation} applied{after}")
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
        held = trainer_start_held(restarts, now)
        if held and not trainer_ok and obs.trainer is None and restarts.trainer_start_not_before is not None:
            conds.set(
                "TrainerReady", False, "BackingOff",
                f"interruption {restarts.interrupted}: the trainer group restarts at "
                f"{rfc3339(restarts.trainer_start_not_before)} (spec.failurePolicy backoff)",
            )
        else:
            conds.set(
                "TrainerReady",
                trainer_ok,
                "AllReplicasReady" if trainer_ok else ("Restarting" if restart_job is not None else "ReplicasNotReady"),
                f"{trainer_ready_count}/{trainer_desired} trainer pods ready",
            )
    ready = active and rollout_ok and trainer_ok and not degraded
    if degraded:
        message = "; ".join([f"lost {p.name}" for p in lost_now] + short) or "inference replicas not ready"
        conds.set("Degraded", True, "ReplicaLost" if lost_now else "ReplicasUnavailable", message)
    else:
        conds.set("Degraded", False, "AsExpected" if active else "NotRunning")
    conds.set("Ready", ready, "JobReady" if ready else ("NotRunning" if not active else "NotReady"))
    events += _blocked_pods(conds, prev, obs.waiting_pods if active else [], active)
    if active:
        conds.set("Progressing", True, "Running" if ready else ("Recovering" if degraded else "Starting"))
    else:
        conds.set("Progressing", False, outcome.result if outcome else "Suspended")
    suspended = spec.suspend and outcome is None
    conds.set("Suspended", suspended, "JobSuspended" if suspended else "NotSuspended")
    stuck = stuck_pods(obs.terminating_pods, obs.nodes, now)
    if stuck:
        conds.set("NodeUnreachable", True, "PodStuckTerminating", "; ".join(s.describe() for s in stuck))
    else:
        conds.set("NodeUnreachable", False, "NoPodStuck", "no pod of the job is stuck terminating on an unreachable node")
    complete = outcome is not None and outcome.result == "Complete"
    failed_job = outcome is not None and outcome.result == "Failed"
    reason, message = (outcome.reason, outcome.message) if outcome is not None else ("", "")
    conds.set("Complete", complete, reason if complete else "NotComplete", message if complete else "")
    conds.set("Failed", failed_job, reason if failed_job else "NotFailed", message if failed_job else "")

    # Phase and times.
    phase: Phase
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

    restarts.handled_failures = _prune(restarts.handled_failures, obs, obs.lost_inference_pods)
    status = RLJobStatus(
        phase=phase,
        observed_generation=observed_generation,
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
    return LifecycleDecision(
        status=status, active=active, restart_trainer_job=restart_job, events=events,
        force_delete=[s.pod for s in stuck if s.force_delete],
    )


def trainer_start_held(restarts: RestartStatus, now: datetime) -> bool:
    """Whether a new trainer group must not be created yet: the backoff after an interruption still runs."""
    return restarts.trainer_start_not_before is not None and now < restarts.trainer_start_not_before


def _blocked_pods(conds: _Conditions, prev: RLJobStatus, waits: list[PodWait], active: bool) -> list[EventRecord]:
    """Set PodsBlocked from the blocked pods; a Warning Event for each pod/reason not reported before."""
    if not waits:
        conds.set("PodsBlocked", False, "NoneBlocked" if active else "NotRunning")
        return []
    message = waits_message(waits)
    conds.set("PodsBlocked", True, waits[0].reason, message)
    old = prev.condition("PodsBlocked")
    said = old.message if old is not None and old.status == "True" else ""
    return [EventRecord("Warning", w.reason, w.describe()) for w in waits if w.key not in said]


OPERATOR_STATUS_KEYS = ("phase", "observedGeneration", "startTime", "completionTime", "rollout", "restarts", "outcome")


def operator_apply(new: RLJobStatus) -> dict[str, Any]:
    """The status the operator server-side applies: exactly the fields it owns.

    Its own condition types only (`conditions` is a list-map keyed by type, so the autotuner's stay
    its own), never the runtime's progress, and the effectiveKnobs entries whose source is the spec:
    a knob the autotuner has taken over is left out, so its value stays the autotuner's.
    """
    wire = new.to_wire()
    body: dict[str, Any] = {key: wire[key] for key in OPERATOR_STATUS_KEYS if key in wire}
    body["conditions"] = [c.to_wire() for c in new.conditions if c.type in CONDITION_TYPES]
    body["trainer"] = {k: wire["trainer"][k] for k in ("desired", "ready", "summary")}
    knobs = {
        wire_name: value.to_wire()
        for name, wire_name in (("over_sampling", "overSampling"), ("truncation", "truncation"))
        if (value := getattr(new.effective_knobs, name)) is not None and value.source == "spec"
    }
    if knobs:
        body["effectiveKnobs"] = knobs
    return body
