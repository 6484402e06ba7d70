"""Lifecycle decisions: conditions, phase, failure policy, suspend, deadline (pure functions)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from rljob.api.spec import RLJobSpec
from rljob.api.status import KnobValue, RLJobStatus
from rljob.common.autotune.tick import autotuner_status, merge_patch
from rljob.operator.builders import JobRef
from rljob.operator.lifecycle import (
    ApplyResult,
    LifecycleDecision,
    Observed,
    PodObs,
    TrainerJobObs,
    WorkloadObs,
    compute_status,
    operator_apply,
    pod_observation,
    trainer_job_observation,
)

JOB = JobRef("demo", "ns", "uid-1")
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def _spec(**extra: Any) -> RLJobSpec:
    return RLJobSpec.model_validate(
        {
            "model": {"builtin": "tiny-arith"},
            "data": {"synthetic": {}},
            "rollout": {"pools": [{"name": "nv", "vendor": "nvidia", "replicas": 2}, {"name": "mi", "vendor": "amd"}]},
            "backoffLimit": 2,
            **extra,
        }
    )


def _obs(nv: int = 2, mi: int = 1, router: int = 1, trainer: int = 1, **kw: Any) -> Observed:
    return Observed(
        pools={"nv": WorkloadObs(2, nv), "mi": WorkloadObs(1, mi)},
        router=WorkloadObs(1, router),
        trainer=kw.pop("job", TrainerJobObs(uid="job-1", replicas=1, ready=trainer)),
        **kw,
    )


def _pod(
    phase: str = "Running", uid: str = "p1", ordinal: int = 0, role: str = "trainer", job_uid: str = "job-1", **state: Any
) -> dict:
    container: dict[str, Any] = {"name": "trainer", "restartCount": state.pop("restarts", 0)}
    conditions = state.pop("conditions", [])
    container.update(state)
    labels = {"rljob.io/role": role, "rljob.io/pool": "nv"}
    if role == "trainer":
        labels |= {"batch.kubernetes.io/job-completion-index": str(ordinal), "batch.kubernetes.io/controller-uid": job_uid}
    else:
        labels["apps.kubernetes.io/pod-index"] = str(ordinal)
    return {
        "metadata": {"name": f"demo-{role}-{ordinal}", "uid": uid, "labels": labels},
        "status": {"phase": phase, "containerStatuses": [container], "conditions": conditions},
    }


def _run(
    spec: RLJobSpec, prev: RLJobStatus, obs: Observed, now: datetime = T0, gen: int = 1, applied: Any = "ok"
) -> LifecycleDecision:
    """One evaluation; by default as after reconcile applied generation `gen` (applied=None: a plain resync)."""
    result = ApplyResult(gen) if applied == "ok" else applied
    return compute_status(JOB, spec, gen, prev, obs, now, applied=result)


def _cond(status: RLJobStatus, type_: str) -> tuple[str, str]:
    c = status.condition(type_)
    assert c is not None
    return c.status, c.reason


def test_all_ready_is_ready_with_every_condition() -> None:
    d = _run(_spec(), RLJobStatus(), _obs(), gen=3)
    s = d.status
    assert s.phase == "Running" and d.active
    assert [c.type for c in s.conditions] == [
        "ChildrenApplied", "RolloutReady", "TrainerReady", "Ready", "Progressing", "Degraded", "Suspended", "Complete", "Failed",
        "NodeUnreachable",
        "PodsBlocked",
    ]
    assert all(c.observed_generation == 3 for c in s.conditions) and s.observed_generation == 3
    assert _cond(s, "Ready") == ("True", "JobReady")
    assert s.rollout.summary == "3/3" and s.trainer.summary == "1/1"
    assert s.rollout.selector == "rljob.io/job-name=demo,rljob.io/role=inference"
    assert [(p.name, p.vendor, p.desired, p.ready) for p in s.rollout.pools] == [("nv", "nvidia", 2, 2), ("mi", "amd", 1, 1)]
    assert s.start_time == T0
    assert [e.reason for e in d.events] == ["JobReady"]
    assert s.effective_knobs.over_sampling == KnobValue(value=2.0, unit="ratio", source="spec", reason="FromSpec")
    assert s.effective_knobs.truncation is None


def test_starting_then_ready_keeps_transition_times() -> None:
    first = _run(_spec(), RLJobStatus(), _obs(nv=0, router=0, trainer=0)).status
    assert first.phase == "Starting" and _cond(first, "Ready")[0] == "False"
    assert _cond(first, "Degraded")[0] == "False", "not degraded while starting"
    later = T0 + timedelta(minutes=5)
    second = _run(_spec(), first, _obs(), now=later).status
    assert second.phase == "Running"
    assert second.condition("Ready").last_transition_time == later
    assert second.condition("Suspended").last_transition_time == T0, "unchanged status keeps its time"
    assert second.start_time == T0


def test_lost_inference_pod_degrades_until_replaced() -> None:
    ready = _run(_spec(), RLJobStatus(), _obs()).status
    lost = pod_observation(_pod(uid="inf-1", role="inference", ordinal=1))
    # The pod is gone but the StatefulSet status still says 2/2: the loss alone degrades the job.
    d = _run(_spec(), ready, _obs(lost_inference_pods=[lost]))
    assert d.status.phase == "Degraded" and _cond(d.status, "Degraded") == ("True", "ReplicaLost")
    assert _cond(d.status, "Ready")[0] == "False" and d.status.restarts.rollout == 1
    assert {e.reason for e in d.events} == {"InferenceReplicaLost", "Degraded"}
    # Replacement not ready yet: still degraded, the loss is not counted twice.
    d2 = _run(_spec(), d.status, _obs(nv=1, lost_inference_pods=[lost]))
    assert d2.status.phase == "Degraded" and _cond(d2.status, "Degraded")[1] == "ReplicasUnavailable"
    assert d2.status.restarts.rollout == 1
    d3 = _run(_spec(), d2.status, _obs())
    assert d3.status.phase == "Running" and [e.reason for e in d3.events] == ["Recovered", "JobReady"]


def test_loss_reported_after_replacement_is_counted_without_degrading() -> None:
    ready = _run(_spec(), RLJobStatus(), _obs()).status
    lost = pod_observation(_pod(uid="inf-1", role="inference", ordinal=1))
    d = _run(_spec(), ready, _obs(lost_inference_pods=[lost], ready_inference_pods={lost.name: "inf-2"}))
    assert d.status.phase == "Running" and d.status.restarts.rollout == 1
    assert [e.reason for e in d.events] == ["InferenceReplicaLost"]


def test_scale_down_is_not_a_loss() -> None:
    ready = _run(_spec(), RLJobStatus(), _obs()).status
    beyond_scale = pod_observation(_pod(uid="inf-9", role="inference", ordinal=5))
    d = _run(_spec(), ready, _obs(lost_inference_pods=[beyond_scale]))
    assert d.status.phase == "Running" and d.status.restarts.rollout == 0


def test_a_restarted_job_read_live_again_does_not_count_a_failure_twice() -> None:
    """Seen in the chaos test: after the restart one read had the failed pod gone (its handled key pruned),
    the next had it back as a pod the watch reported, with the deleted Job still read live (its deletion
    not yet seen): that was counted as a second failure and ended the job at backoffLimit 1."""
    status = _run(_spec(backoffLimit=1), RLJobStatus(), _obs()).status
    failed = pod_observation(_pod(phase="Failed", uid="t1", job_uid="job-1"))
    job = TrainerJobObs(uid="job-1", replicas=1, ready=0)
    d = _run(_spec(backoffLimit=1), status, _obs(trainer_pods=[failed], job=job))
    assert d.restart_trainer_job == "job-1" and d.status.restarts.trainer == 1
    pruned = _run(_spec(backoffLimit=1), d.status, _obs(job=job)).status  # the pod gone from this read
    assert "trainer/t1/0" not in pruned.restarts.handled_failures
    again = _run(_spec(backoffLimit=1), pruned, _obs(trainer_pods=[failed], job=job))
    assert again.restart_trainer_job is None and again.status.outcome is None and again.status.restarts.trainer == 1


def test_pods_deleted_by_a_suspend_are_no_loss_after_the_resume() -> None:
    """Their DELETED events may reach the operator only after the resume (seen in the chaos test as a
    Suspended -> Degraded [InferenceReplicaLost] flap): the resumed job is Starting, not Degraded."""
    suspended = _run(_spec(suspend=True), _run(_spec(), RLJobStatus(), _obs()).status, _obs()).status
    assert suspended.phase == "Suspended"
    scaled_away = pod_observation(_pod(uid="inf-1", role="inference", ordinal=0))
    d = _run(_spec(), suspended, _obs(nv=0, mi=0, lost_inference_pods=[scaled_away]))
    assert d.status.phase != "Degraded" and d.status.restarts.rollout == 0
    assert "InferenceReplicaLost" not in {e.reason for e in d.events}


def test_a_lost_inference_pod_reported_again_after_its_key_was_pruned_counts_once() -> None:
    """The watch may report one pod's deletion twice, the second report reaching a sync after another
    pass (without it) ran: counted once (a clean-clone run counted restarts.rollout 2)."""
    status = _run(_spec(), RLJobStatus(), _obs()).status
    lost = pod_observation(_pod(uid="inf-1", role="inference", ordinal=1))
    first = _run(_spec(), status, _obs(nv=1, lost_inference_pods=[lost]))
    assert first.status.restarts.rollout == 1
    between = _run(_spec(), first.status, _obs(nv=1))  # a pass that no longer sees the pod anywhere
    again = _run(_spec(), between.status, _obs(nv=1, lost_inference_pods=[lost]))
    assert again.status.restarts.rollout == 1, again.status.restarts
    assert "InferenceReplicaLost" not in {e.reason for e in again.events}
    # Bounded: many later losses push the oldest key out.
    handled = again.status.restarts.handled_failures
    for n in range(40):
        other = pod_observation(_pod(uid=f"inf-x{n}", role="inference", ordinal=1))
        d = _run(_spec(), again.status.model_copy(update={"restarts": again.status.restarts.model_copy(
            update={"handled_failures": handled})}), _obs(nv=1, lost_inference_pods=[other]))
        handled = d.status.restarts.handled_failures
    assert len(handled) <= 33 and "inference/inf-1/0" not in handled


def test_trainer_failure_restarts_group_until_backoff_limit() -> None:
    status = _run(_spec(), RLJobStatus(), _obs()).status
    for n in (1, 2):
        job_uid = f"job-{n}"
        failed = pod_observation(_pod(phase="Failed", uid=f"t{n}", job_uid=job_uid))
        job = TrainerJobObs(uid=job_uid, replicas=1, ready=0)
        d = _run(_spec(), status, _obs(trainer_pods=[failed], job=job))
        # The whole gang restarts: the operator deletes this Job (a new one resumes from the checkpoint).
        assert d.restart_trainer_job == job_uid and d.status.restarts.trainer == n and d.active
        assert d.events[0].reason == "TrainerRestarting" and f"restart {n}/2" in d.events[0].message
        assert d.status.restarts.handled_failures == [f"trainer/t{n}/0", f"trainer/{job_uid}/job"]
        # Seen again before the Job is gone (timer + watch): acted on once.
        again = _run(_spec(), d.status, _obs(trainer_pods=[failed], job=job))
        assert not again.restart_trainer and again.status.restarts.trainer == n
        # The same Job read once more as failed, its pod already gone and the Job not yet seen deleting
        # (a watch cache delivers the pod's deletion first): still the one failure.
        failed_job = TrainerJobObs(uid=job_uid, replicas=1, ready=0, failed_message="pod failed: FailJob")
        stale = _run(_spec(), d.status, _obs(job=failed_job))
        assert not stale.restart_trainer and stale.status.restarts.trainer == n and stale.status.outcome is None
        deleting = TrainerJobObs(uid=job_uid, replicas=1, ready=0, deleting=True)
        gone = _run(_spec(), again.status, _obs(trainer_pods=[failed], job=deleting))
        assert not gone.restart_trainer and gone.status.restarts.trainer == n
        status = gone.status
    crashed = pod_observation(_pod(phase="Failed", uid="t3", job_uid="job-3",
                                   state={"terminated": {"exitCode": 137, "reason": "OOMKilled"}}))
    d = _run(_spec(), status, _obs(trainer_pods=[crashed], job=TrainerJobObs(uid="job-3", replicas=1, ready=0)))
    assert not d.restart_trainer and not d.active
    assert d.status.phase == "Failed" and _cond(d.status, "Failed") == ("True", "BackoffLimitExceeded")
    assert "OOMKilled" in d.status.condition("Failed").message
    assert d.status.completion_time == T0
    # Terminal: stays failed whatever the children do next.
    d2 = _run(_spec(), d.status, _obs(), now=T0 + timedelta(hours=1))
    assert d2.status.phase == "Failed" and not d2.active and d2.status.completion_time == T0



def test_a_reward_collapse_fails_the_job_at_once_without_spending_backoff_limit():
    """The runtime's RewardCollapse termination message: a restart would sample the same rewards, so the
    job fails on the first one, with the reason and the runtime's message, instead of restarting."""
    message = "RewardCollapse: the dynamic-sampling filter rejected 256 groups in a row (the last one's rewards: [0.0])"
    collapsed = pod_observation(_pod(phase="Failed", uid="t1", job_uid="job-1", state={
        "terminated": {"exitCode": 76, "reason": "Error", "message": message}}))
    d = _run(_spec(), _run(_spec(), RLJobStatus(), _obs()).status,
             _obs(trainer_pods=[collapsed], job=TrainerJobObs(uid="job-1", replicas=1, ready=0)))
    assert not d.restart_trainer and d.status.restarts.trainer == 0
    assert d.status.phase == "Failed" and _cond(d.status, "Failed") == ("True", "RewardCollapse")
    assert "rejected 256 groups in a row" in d.status.condition("Failed").message
    assert [e.reason for e in d.events if e.type == "Warning"] == ["RewardCollapse"]

def test_pods_of_an_old_trainer_job_are_history() -> None:
    status = _run(_spec(), RLJobStatus(), _obs()).status
    old = pod_observation(_pod(phase="Failed", uid="old-0", job_uid="job-0"))
    d = _run(_spec(), status, _obs(trainer_pods=[old]))
    assert not d.restart_trainer and d.status.restarts.trainer == 0


def test_pods_stopped_on_purpose_are_not_failures() -> None:
    status = _run(_spec(), RLJobStatus(), _obs()).status
    dying = _pod(uid="t1", state={"terminated": {"exitCode": 143, "reason": "Error"}})
    dying["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    d = _run(_spec(), status, _obs(trainer_pods=[pod_observation(dying)]))
    assert not d.restart_trainer and d.status.restarts.trainer == 0
    # While the Job is suspended, ranks it stops are not failures either.
    suspended = TrainerJobObs(uid="job-1", replicas=0, ready=0, suspended=True)
    failed = pod_observation(_pod(phase="Failed", uid="t2"))
    assert not _run(_spec(), status, _obs(trainer_pods=[failed], job=suspended)).restart_trainer


def _trainer_job(*conditions: tuple[str, str, str], suspend: bool = False) -> dict[str, Any]:
    """A batch/v1 Job as the API server returns it, with (type, status, lastTransitionTime) conditions."""
    return {"metadata": {"uid": "job-1"}, "spec": {"parallelism": 2, "suspend": suspend},
            "status": {"conditions": [{"type": t, "status": st, "lastTransitionTime": at,
                                       "reason": "PodFailurePolicy", "message": "matching FailJob rule"}
                                      for t, st, at in conditions]}}


def test_a_trainer_job_failed_by_its_suspend_is_recreated_on_resume_without_counting() -> None:
    """The suspend deletes the ranks; they exit non-zero after SIGTERM, and the Job controller may apply
    podFailurePolicy's FailJob to them once terminal (a race: 1 run in 3 on the real node). On resume
    that Job is recreated, neither a failure nor an interruption, and only once."""
    running = _run(_spec(), RLJobStatus(), _obs()).status
    suspended = _run(_spec(suspend=True), running, _obs(job=trainer_job_observation(_trainer_job(
        ("Suspended", "True", "2026-01-01T00:00:10Z"), suspend=True)))).status
    assert suspended.phase == "Suspended"
    failed_in_suspend = trainer_job_observation(_trainer_job(
        ("Suspended", "True", "2026-01-01T00:00:10Z"), ("Failed", "True", "2026-01-01T00:00:12Z")))
    assert failed_in_suspend.failed_while_suspended and failed_in_suspend.live
    marked = trainer_job_observation(_trainer_job(  # before Failed, the controller sets FailureTarget
        ("Suspended", "True", "2026-01-01T00:00:10Z"), ("FailureTarget", "True", "2026-01-01T00:05:10Z")))
    assert marked.failed_while_suspended
    d = _run(_spec(), suspended, _obs(job=failed_in_suspend, trainer=0), gen=2)
    assert d.restart_trainer_job == "job-1"
    assert d.status.restarts.trainer == 0 and d.status.restarts.interrupted == 0, d.status.restarts
    assert "TrainerRecreated" in [e.reason for e in d.events]
    again = _run(_spec(), d.status, _obs(job=failed_in_suspend, trainer=0), gen=2)  # a stale read of it
    assert not again.restart_trainer and again.status.restarts.trainer == 0


def test_a_trainer_job_that_fails_after_the_controller_resumed_it_is_a_failure() -> None:
    """Suspended=False (the Job controller resumed it) before Failed: the resumed run's own failure."""
    running = _run(_spec(), RLJobStatus(), _obs()).status
    job = trainer_job_observation(_trainer_job(
        ("Suspended", "False", "2026-01-01T00:00:20Z"), ("Failed", "True", "2026-01-01T00:00:30Z")))
    assert not job.failed_while_suspended
    d = _run(_spec(), running, _obs(job=job, trainer=0))
    assert d.restart_trainer_job == "job-1" and d.status.restarts.trainer == 1
    # Failed before a suspend was asked for: the controller never marks a finished Job Suspended.
    assert not trainer_job_observation(_trainer_job(("Failed", "True", "2026-01-01T00:00:30Z"))).failed_while_suspended


def test_sigterm_before_the_last_step_is_an_interruption_never_success() -> None:
    status = _run(_spec(), RLJobStatus(), _obs()).status
    # torchrun exits 1 when its worker stopped on SIGTERM; the worker's termination message says why.
    leader = pod_observation(_pod(phase="Failed", uid="t1", state={"terminated": {
        "exitCode": 1, "reason": "Error", "message": "Interrupted: SIGTERM after step 7; its checkpoint is written"}}))
    d = _run(_spec(), status, _obs(trainer_pods=[leader]))
    assert d.status.phase != "Complete" and d.status.outcome is None and d.active
    assert d.restart_trainer_job == "job-1"
    assert d.status.restarts.interrupted == 1 and d.status.restarts.trainer == 0, "not counted against backoffLimit"
    assert [e.reason for e in d.events][0] == "TrainerInterrupted"
    # Without torchrun, the runtime's own exit code says the same.
    bare = pod_observation(_pod(phase="Failed", uid="t2", state={"terminated": {"exitCode": 75, "reason": "Error"}}))
    assert _run(_spec(), status, _obs(trainer_pods=[bare])).status.restarts.interrupted == 1


def test_a_trainer_pod_deleted_by_hand_that_stopped_interrupted_is_an_interruption() -> None:
    """`kubectl delete pod` of one rank: no DisruptionTarget, but the gang stopped at the step boundary,
    checkpointed, and each rank's pod (deleting, or deleted by the Job controller once the first one failed
    the Job) says Interrupted. Counted as an interruption; a deleted pod killed without that message is
    still no reason of its own, and the failed Job counts as a failure."""
    status = _run(_spec(), RLJobStatus(), _obs()).status
    message = "Interrupted: SIGTERM after step 2; its checkpoint is written, the next run resumes there"
    failed_job = TrainerJobObs(uid="job-1", replicas=2, ready=0, failed_message="matching FailJob rule")
    ranks = []
    for ordinal in (0, 1):
        pod = _pod(phase="Failed", uid=f"t{ordinal}", ordinal=ordinal,
                   state={"terminated": {"exitCode": 1, "reason": "Error", "message": message}})
        pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        ranks.append(pod_observation(pod))
    d = _run(_spec(), status, _obs(trainer_pods=ranks, job=failed_job))
    assert d.restart_trainer_job == "job-1"
    assert d.status.restarts.interrupted == 1 and d.status.restarts.trainer == 0
    assert [e.reason for e in d.events][0] == "TrainerInterrupted"
    killed = _pod(phase="Failed", uid="t9", state={"terminated": {"exitCode": 137, "reason": "Error"}})
    killed["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    d = _run(_spec(), status, _obs(trainer_pods=[pod_observation(killed)], job=failed_job))
    assert d.status.restarts.trainer == 1 and d.status.restarts.interrupted == 0


def test_disruption_target_restarts_the_group_without_counting() -> None:
    status = _run(_spec(), RLJobStatus(), _obs()).status
    evicted = _pod(uid="t1", conditions=[{"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}])
    evicted["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    for _ in range(5):  # many more than backoffLimit=2
        d = _run(_spec(), status, _obs(trainer_pods=[pod_observation(evicted)]))
        assert d.restart_trainer and d.status.outcome is None
        status = d.status.model_copy(update={"restarts": d.status.restarts.model_copy(update={"handled_failures": []})})
    assert status.restarts.interrupted == 5 and status.restarts.trainer == 0


def test_a_failed_job_without_a_visible_failed_rank_is_a_failure() -> None:
    status = _run(_spec(), RLJobStatus(), _obs()).status
    failed_job = TrainerJobObs(uid="job-1", replicas=1, ready=0, failed_message="Pod default/x was deleted")
    d = _run(_spec(), status, _obs(job=failed_job))
    assert d.restart_trainer_job == "job-1" and d.status.restarts.trainer == 1


def test_handled_failures_have_no_shared_cap() -> None:
    """A trainer failure key survives any number of inference losses (was: 32 keys shared by both)."""
    status = _run(_spec(), RLJobStatus(), _obs()).status
    failed = pod_observation(_pod(phase="Failed", uid="t1"))
    d = _run(_spec(), status, _obs(trainer_pods=[failed]))
    status = d.status
    for i in range(40):
        lost = pod_observation(_pod(uid=f"inf-{i}", role="inference", ordinal=1))
        status = _run(_spec(), status, _obs(trainer_pods=[failed], lost_inference_pods=[lost])).status
    assert "trainer/t1/0" in status.restarts.handled_failures
    again = _run(_spec(), status, _obs(trainer_pods=[failed]))
    assert not again.restart_trainer and again.status.restarts.trainer == 1
    # Keys of pods that can no longer be seen are dropped, but for the newest lost inference pods (whose
    # deletion may be reported again): bounded, no unbounded growth.
    left = _run(_spec(), again.status, _obs(job=TrainerJobObs(uid="job-2", replicas=1, ready=1))).status.restarts.handled_failures
    assert left == [f"inference/inf-{i}/0" for i in range(8, 40)]


def test_rank0_exit_zero_completes_and_scales_down() -> None:
    status = _run(_spec(), RLJobStatus(), _obs()).status
    done = pod_observation(_pod(phase="Succeeded", state={"terminated": {"exitCode": 0, "reason": "Completed"}}))
    d = _run(_spec(), status, _obs(trainer_pods=[done]))
    assert d.status.phase == "Complete" and not d.active
    assert _cond(d.status, "Complete") == ("True", "TrainerSucceeded")
    assert _cond(d.status, "Ready") == ("False", "NotRunning")
    assert d.status.rollout.desired == 0 and d.status.trainer.summary.endswith("/0")


def test_suspend_and_resume_reset_the_deadline_clock() -> None:
    spec = _spec(activeDeadlineSeconds=600)
    running = _run(spec, RLJobStatus(), _obs()).status
    suspended_spec = _spec(activeDeadlineSeconds=600, suspend=True)
    d = _run(suspended_spec, running, _obs(), now=T0 + timedelta(seconds=300))
    assert d.status.phase == "Suspended" and not d.active and d.status.start_time is None
    assert _cond(d.status, "Suspended") == ("True", "JobSuspended")
    assert "Suspended" in [e.reason for e in d.events]
    # Pods gone while suspended: not degraded.
    d = _run(suspended_spec, d.status, _obs(nv=0, mi=0, router=0, trainer=0), now=T0 + timedelta(hours=2))
    assert d.status.phase == "Suspended" and _cond(d.status, "Degraded")[0] == "False"
    resumed_at = T0 + timedelta(hours=3)
    d = _run(spec, d.status, _obs(nv=0, mi=0, router=0, trainer=0), now=resumed_at)
    assert d.status.phase == "Starting" and d.active and d.status.start_time == resumed_at
    assert "Resumed" in [e.reason for e in d.events]
    d = _run(spec, d.status, _obs(), now=resumed_at + timedelta(seconds=599))
    assert d.status.phase == "Running"
    d = _run(spec, d.status, _obs(), now=resumed_at + timedelta(seconds=600))
    assert d.status.phase == "Failed" and _cond(d.status, "Failed")[1] == "DeadlineExceeded" and not d.active


def test_autotuned_knobs_are_not_overwritten() -> None:
    spec = _spec(rollout={"partial": {"truncation": {"mode": "sigma", "k": 2.5}}})
    prev = RLJobStatus()
    prev.effective_knobs.over_sampling = KnobValue(value=1.5, source="autotune", reason="HighTruncation")
    d = _run(spec, prev, _obs())
    assert d.status.effective_knobs.over_sampling.value == 1.5
    assert d.status.effective_knobs.truncation == KnobValue(value=2.5, unit="sigma", source="spec", reason="FromSpec")
    body = operator_apply(d.status)
    assert body["effectiveKnobs"] == {"truncation": {"value": 2.5, "unit": "sigma", "source": "spec",
                                                     "reason": "FromSpec", "query": ""}}


def test_operator_apply_holds_only_operator_fields() -> None:
    prev = RLJobStatus.model_validate(
        {"conditions": [{"type": "AutotuneActive", "status": "True", "reason": "Apply",
                         "lastTransitionTime": "2026-01-01T00:00:00Z"}],
         "trainer": {"step": 7}, "metrics": {"entropy": 1.5}}
    )
    d = _run(_spec(), prev, _obs())
    body = operator_apply(d.status)
    assert body["trainer"] == {"desired": 1, "ready": 1, "summary": "1/1"}
    assert "metrics" not in body and "outcome" not in body and "autotune" not in body
    assert "AutotuneActive" not in [c["type"] for c in body["conditions"]], "the autotuner's condition is its own"
    assert body["startTime"] == "2026-01-01T00:00:00Z"


def test_autotuner_apply_holds_only_autotuner_fields() -> None:
    status = _run(_spec(), RLJobStatus(), _obs()).status.to_wire()
    patch = {"conditions": [*status["conditions"], {"type": "AutotuneActive", "status": "False", "reason": "NoMetrics",
                                                    "lastTransitionTime": "2026-01-01T00:00:00Z"}],
             "autotune": {"mode": "Apply", "consecutiveFailures": 1, "nextAttemptTime": None}}
    body = autotuner_status(RLJobStatus.model_validate(merge_patch(status, patch)))
    assert [c["type"] for c in body["conditions"]] == ["AutotuneActive"]
    assert body["autotune"]["consecutiveFailures"] == 1 and "nextAttemptTime" not in body["autotune"]
    assert "phase" not in body and "effectiveKnobs" not in body, "spec-sourced knobs are the operator's"


def test_observed_generation_only_after_that_generations_children_applied() -> None:
    applied = _run(_spec(), RLJobStatus(), _obs(), gen=1).status
    assert applied.observed_generation == 1 and _cond(applied, "ChildrenApplied") == ("True", "Applied")
    # Generation 2's apply was refused: the condition carries the API server's message.
    refused = ApplyResult(2, error='StatefulSet demo-infer-nv: HTTP 422: spec.template: Invalid value: "x"')
    d = _run(_spec(), applied, _obs(), gen=2, applied=refused).status
    assert d.observed_generation == 1
    cond = d.condition("ChildrenApplied")
    assert cond.status == "False" and cond.reason == "ApplyFailed" and "HTTP 422" in cond.message
    # A resync that applies nothing changes neither.
    again = _run(_spec(), d, _obs(), gen=2, applied=None).status
    assert again.observed_generation == 1 and again.condition("ChildrenApplied") == cond
    waiting = _run(_spec(), again, _obs(), gen=2, applied=ApplyResult(2, waiting=("Job demo-trainer",))).status
    assert waiting.observed_generation == 1 and _cond(waiting, "ChildrenApplied") == ("False", "Recreating")
    assert _run(_spec(), waiting, _obs(), gen=2).status.observed_generation == 2


def test_trainer_job_observation() -> None:
    job = {"metadata": {"uid": "j1"}, "spec": {"parallelism": 2, "suspend": False},
           "status": {"ready": 2, "conditions": [{"type": "Failed", "status": "True", "reason": "PodFailurePolicy",
                                                  "message": "Container trainer for pod x failed with exit code 1"}]}}
    obs = trainer_job_observation(job)
    assert obs == TrainerJobObs(uid="j1", replicas=2, ready=2, failed_message="Container trainer for pod x failed with exit code 1")
    job["spec"]["suspend"] = True
    assert trainer_job_observation(job).replicas == 0 and not trainer_job_observation(job).live


def test_foreign_conditions_are_kept() -> None:
    prev = RLJobStatus.model_validate(
        {"conditions": [{"type": "AutotuneActive", "status": "True", "reason": "Apply",
                         "lastTransitionTime": "2026-01-01T00:00:00Z"}]}
    )
    types = [c.type for c in _run(_spec(), prev, _obs()).status.conditions]
    assert types[-1] == "AutotuneActive" and len(types) == 12


def test_pod_observation_keys_are_stable_across_restart_counts() -> None:
    # A crash first shows as state.terminated (restartCount 0), then as lastState (restartCount 1).
    now = pod_observation(_pod(uid="x", state={"terminated": {"exitCode": 1}}))
    later = pod_observation(_pod(uid="x", restarts=1, lastState={"terminated": {"exitCode": 1}}, state={"running": {}}))
    failed_phase = pod_observation(_pod(phase="Failed", uid="x", state={"terminated": {"exitCode": 1}}))
    assert [e.key for e in now.failures()] == [e.key for e in later.failures()] == ["trainer/x/0"]
    assert [e.key for e in failed_phase.failures()] == ["trainer/x/0"]
    assert isinstance(now, PodObs) and now.ordinal == 0 and now.role == "trainer" and now.job_uid == "job-1"


def test_a_cpu_pool_gets_a_pool_status() -> None:
    """Found on the real node: a cpu-vendor job's status could not be computed at all (PoolStatus knew
    only the GPU vendors), so its phase stayed Pending while its trainer trained to the end."""
    spec = RLJobSpec.model_validate({
        "model": {"path": "pvc://models/tiny"}, "data": {"synthetic": {}},
        "rollout": {"engine": "sglang", "pools": [{"name": "cpu", "vendor": "cpu", "replicas": 1}]},
        "trainer": {"vendor": "cpu", "gpusPerReplica": 0},
    })
    obs = Observed(pools={"cpu": WorkloadObs(1, 1)}, router=WorkloadObs(1, 1),
                   trainer=TrainerJobObs(uid="job-1", replicas=1, ready=1))
    status = _run(spec, RLJobStatus(), obs).status
    assert [(p.name, p.vendor, p.ready) for p in status.rollout.pools] == [("cpu", "cpu", 1)]
    assert status.phase == "Running"


def test_a_pod_deleted_before_the_resume_is_no_loss_on_a_later_pass() -> None:
    """A scale-down DELETED event may come after the resumed job's first pass (then prev is Starting, not
    Suspended): a pod whose deletion was asked for before the job's start is history. One deleted after the
    start is a loss."""
    suspended = _run(_spec(suspend=True), _run(_spec(), RLJobStatus(), _obs()).status, _obs()).status
    resumed_at = T0 + timedelta(minutes=5)
    starting = _run(_spec(), suspended, _obs(nv=0, mi=0), now=resumed_at).status
    assert starting.phase == "Starting" and starting.start_time == resumed_at

    def deleted_at(at: datetime, uid: str) -> PodObs:
        pod = _pod(uid=uid, role="inference", ordinal=0)
        # The API server stamps the end of the grace period: 30 s after the request.
        pod["metadata"] |= {"deletionTimestamp": (at + timedelta(seconds=30)).strftime("%Y-%m-%dT%H:%M:%SZ"),
                            "deletionGracePeriodSeconds": 30}
        return pod_observation(pod)

    old = deleted_at(resumed_at - timedelta(seconds=10), "inf-old")
    assert old.deletion_requested == resumed_at - timedelta(seconds=10)
    d = _run(_spec(), starting, _obs(nv=0, mi=0, lost_inference_pods=[old]), now=resumed_at + timedelta(seconds=20))
    assert d.status.phase == "Starting" and d.status.restarts.rollout == 0
    assert "InferenceReplicaLost" not in {e.reason for e in d.events}
    new = deleted_at(resumed_at + timedelta(seconds=10), "inf-new")
    d = _run(_spec(), starting, _obs(nv=1, lost_inference_pods=[new]), now=resumed_at + timedelta(seconds=20))
    assert d.status.restarts.rollout == 1 and "InferenceReplicaLost" in {e.reason for e in d.events}


def _interrupted(uid: str, job_uid: str = "job-1") -> PodObs:
    evicted = _pod(uid=uid, job_uid=job_uid, conditions=[{"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}])
    evicted["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return pod_observation(evicted)


def test_interruptions_back_off_and_past_the_cap_the_job_fails() -> None:
    from rljob.operator.lifecycle import trainer_start_held

    policy = {"failurePolicy": {"maxInterruptions": 3, "interruptionBackoffSeconds": 10, "interruptionBackoffMaxSeconds": 30}}
    spec = _spec(**policy)
    status, now = _run(spec, RLJobStatus(), _obs()).status, T0
    holds = []
    for n in range(1, 4):
        # Each restart is a new trainer Job (a new uid): one restart per Job.
        job = TrainerJobObs(uid=f"job-{n}", replicas=1, ready=1)
        d = _run(spec, status, _obs(trainer_pods=[_interrupted(f"t{n}", job.uid)], job=job), now=now)
        assert d.restart_trainer and d.status.outcome is None and d.status.restarts.interrupted == n
        hold = d.status.restarts.trainer_start_not_before
        holds.append((hold - now).total_seconds())
        assert f"in {holds[-1]:.0f} s" in d.events[0].message and f"interruption {n}/3" in d.events[0].message
        # Until the hold is over, the missing trainer Job is not created, and TrainerReady says why and until when.
        assert trainer_start_held(d.status.restarts, now + timedelta(seconds=holds[-1] - 1))
        assert not trainer_start_held(d.status.restarts, hold)
        gone = _run(spec, d.status, _obs(job=None), now=now + timedelta(seconds=1), applied=None).status
        assert _cond(gone, "TrainerReady") == ("False", "BackingOff") and "restarts at" in gone.condition("TrainerReady").message
        status, now = d.status, hold
    assert holds == [10, 20, 30], "doubling, capped at interruptionBackoffMaxSeconds"
    # The 4th interruption is past maxInterruptions=3: the job fails, naming the cap and the pod.
    job = TrainerJobObs(uid="job-4", replicas=1, ready=1)
    d = _run(spec, status, _obs(trainer_pods=[_interrupted("t4", job.uid)], job=job), now=now)
    assert not d.restart_trainer and d.status.phase == "Failed"
    assert d.status.outcome.reason == "InterruptionLimitExceeded" and "maxInterruptions 3 reached" in d.status.outcome.message
    assert "demo-trainer-0" in d.status.outcome.message and d.events[-1].reason == "InterruptionLimitExceeded"


def test_a_failure_restart_does_not_wait_for_an_interruption_backoff() -> None:
    status = _run(_spec(), RLJobStatus(), _obs()).status
    d = _run(_spec(), status, _obs(trainer_pods=[_interrupted("t1")]))
    assert d.status.restarts.trainer_start_not_before == T0 + timedelta(seconds=10), "the default policy: 10 s first"
    failed = pod_observation(_pod(phase="Failed", uid="t2", job_uid="job-2"))
    job = TrainerJobObs(uid="job-2", replicas=1, ready=0)
    again = _run(_spec(), d.status, _obs(trainer_pods=[failed], job=job), now=T0 + timedelta(seconds=20))
    assert again.restart_trainer and again.status.restarts.trainer_start_not_before is None


def test_failure_policy_is_validated_naming_the_field() -> None:
    import pytest
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="interruptionBackoffMaxSeconds must be at least interruptionBackoffSeconds"):
        _spec(failurePolicy={"interruptionBackoffSeconds": 60, "interruptionBackoffMaxSeconds": 30})
    with pytest.raises(ValidationError, match="maxInterruptions"):
        _spec(failurePolicy={"maxInterruptions": -1})
    assert _spec().failure_policy.interruption_delay(40) == 600, "default cap, no overflow"
    assert _spec(failurePolicy={"interruptionBackoffSeconds": 0}).failure_policy.interruption_delay(3) == 0


def test_engines_serve_while_a_stopped_jobs_trainer_pod_still_runs() -> None:
    """A suspended (or finished) job keeps its engines while a rank still runs: a rank stopping on SIGTERM
    finishes its step, whose rollouts need the engines. A terminal pod, or one left Terminating past its
    grace period plus PAST_GRACE_S (a lost node), serves nothing."""
    from rljob.operator.lifecycle import PAST_GRACE_S, engines_serve

    deleting = _pod()
    deleting["metadata"] |= {"deletionTimestamp": "2026-01-01T00:05:00Z", "deletionGracePeriodSeconds": 300}
    running, stopping = pod_observation(_pod()), pod_observation(deleting)
    done, failed = pod_observation(_pod("Succeeded")), pod_observation(_pod("Failed"))
    assert engines_serve(True, [], T0)  # active: always
    assert not engines_serve(False, [], T0)  # suspended, ranks gone
    assert engines_serve(False, [running], T0)  # suspend applied, the Job controller has not deleted them yet
    assert engines_serve(False, [done, stopping], T0 + timedelta(minutes=4))  # in its grace period
    past = T0 + timedelta(minutes=5, seconds=PAST_GRACE_S)
    assert engines_serve(False, [stopping], past - timedelta(seconds=1))
    assert not engines_serve(False, [stopping], past)  # stuck on a lost node: nothing to wait for
    assert not engines_serve(False, [done, failed], T0)  # completed or failed job
