"""Blocked pods (image pull, unschedulable, unbound claim, crash loop before Ready): pure decisions and
the PodsBlocked condition and Events compute_status makes of them."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pytest

from rljob.api.spec import RLJobSpec
from rljob.api.status import RLJobStatus
from rljob.operator.builders import JobRef, build_children
from rljob.operator.builders.pods import pod_templates
from rljob.operator.pod_waits import PodWait, pod_wait, pod_waits
from rljob.operator.lifecycle import Observed, TrainerJobObs, WorkloadObs, compute_status

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def _pod(
    name: str = "demo-trainer-0-abc",
    *,
    phase: str = "Pending",
    conditions: list[dict[str, Any]] | None = None,
    containers: list[dict[str, Any]] | None = None,
    init: list[dict[str, Any]] | None = None,
    claims: tuple[str, ...] = (),
    deleting: bool = False,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "uid": f"uid-{name}"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "metadata": meta,
        "spec": {"volumes": [{"name": c, "persistentVolumeClaim": {"claimName": c}} for c in claims]},
        "status": {
            "phase": phase,
            "conditions": conditions or [],
            "containerStatuses": containers or [],
            "initContainerStatuses": init or [],
        },
    }


def _waiting(reason: str, message: str = "", name: str = "trainer", **extra: Any) -> dict[str, Any]:
    return {"name": name, "image": "registry.example/rljob/runtime:0.1.0", "state": {"waiting": {"reason": reason, "message": message}}, **extra}


UNSCHEDULABLE = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
READY = {"type": "Ready", "status": "True"}
PENDING_CLAIM = {"metadata": {"name": "ckpt"}, "spec": {}, "status": {"phase": "Pending"}}
BOUND_CLAIM = {"metadata": {"name": "ckpt"}, "spec": {"volumeName": "pv-1"}, "status": {"phase": "Bound"}}


@pytest.mark.parametrize(
    ("pod", "claims", "reason", "in_message"),
    [
        # Image pull: every kubelet reason, in init containers too (the download step).
        (_pod(containers=[_waiting("ImagePullBackOff", "Back-off pulling image")]), {}, "ImagePullBackOff", "registry.example/rljob/runtime:0.1.0"),
        (_pod(containers=[_waiting("ErrImagePull", "not found")]), {}, "ImagePullBackOff", "ErrImagePull"),
        (_pod(containers=[_waiting("InvalidImageName")]), {}, "ImagePullBackOff", "InvalidImageName"),
        (_pod(init=[_waiting("ImagePullBackOff", name="download-model")]), {}, "ImagePullBackOff", "cannot pull"),
        # Scheduling: no node fits, or the scheduler names a claim.
        (_pod(conditions=[UNSCHEDULABLE | {"message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]), {},
         "Unschedulable", "Insufficient nvidia.com/gpu"),
        (_pod(conditions=[UNSCHEDULABLE | {"message": 'persistentvolumeclaim "ckpt" not found'}]), {},
         "UnboundClaim", "ckpt"),
        (_pod(conditions=[UNSCHEDULABLE | {"message": "pod has unbound immediate PersistentVolumeClaims"}]), {},
         "UnboundClaim", "unbound immediate"),
        # A known claim that is Pending while the scheduler cannot place the pod, or Lost.
        (_pod(conditions=[UNSCHEDULABLE | {"message": "0/1 nodes are available"}], claims=("ckpt",)),
         {"ckpt": PENDING_CLAIM}, "UnboundClaim", "PersistentVolumeClaim ckpt is Pending"),
        (_pod(claims=("ckpt",)), {"ckpt": PENDING_CLAIM | {"status": {"phase": "Lost"}}}, "UnboundClaim", "Lost"),
        # Crash loop before Ready, with the termination message (FallbackToLogsOnError puts the log tail there).
        (_pod(phase="Running", containers=[_waiting("CrashLoopBackOff", restartCount=3,
              lastState={"terminated": {"exitCode": 1, "message": "ValueError: no such model"}})]), {},
         "CrashLoopBackOff", "(exit code 1): ValueError: no such model"),
        (_pod(containers=[_waiting("CreateContainerConfigError", 'secret "hf-token" not found')]), {},
         "ContainerConfigError", "hf-token"),
    ],
)
def test_blocked_pod(pod: dict[str, Any], claims: dict[str, Any], reason: str, in_message: str) -> None:
    wait = pod_wait(pod, claims)
    assert wait is not None and wait.reason == reason
    assert in_message in wait.message
    assert wait.describe().startswith(f"pod {pod['metadata']['name']}")


@pytest.mark.parametrize(
    ("pod", "claims"),
    [
        (_pod(phase="Running", conditions=[READY]), {}),
        (_pod(containers=[_waiting("ContainerCreating")]), {}),
        # Crash loop after the pod was Ready: the failure policy's business, not a blocked start.
        (_pod(phase="Running", conditions=[READY], containers=[_waiting("CrashLoopBackOff")]), {}),
        # Pending claim of a pod the scheduler has not judged yet (WaitForFirstConsumer binds on scheduling).
        (_pod(claims=("ckpt",)), {"ckpt": PENDING_CLAIM}),
        (_pod(claims=("ckpt",)), {"ckpt": BOUND_CLAIM}),
        (_pod(deleting=True, containers=[_waiting("ImagePullBackOff")]), {}),
        (_pod(phase="Failed", containers=[_waiting("ImagePullBackOff")]), {}),
    ],
)
def test_not_blocked(pod: dict[str, Any], claims: dict[str, Any]) -> None:
    assert pod_wait(pod, claims) is None


def test_waits_sorted_by_pod_and_claims_by_name() -> None:
    pods = [
        _pod("b", conditions=[UNSCHEDULABLE | {"message": "0/1 nodes"}], claims=("ckpt",)),
        _pod("a", containers=[_waiting("ErrImagePull")]),
    ]
    assert [(w.pod, w.reason) for w in pod_waits(pods, [PENDING_CLAIM])] == [("a", "ImagePullBackOff"), ("b", "UnboundClaim")]


def _spec() -> RLJobSpec:
    return RLJobSpec.model_validate({"model": {"builtin": "tiny-arith"}, "data": {"synthetic": {}}})


def _observed(waits: list[PodWait]) -> Observed:
    return Observed(
        pools={"cpu": WorkloadObs(1, 0)}, router=WorkloadObs(1, 0),
        trainer=TrainerJobObs(uid="job-1", replicas=1, ready=0), waiting_pods=waits,
    )


def test_condition_and_event_within_one_pass_then_no_repeat() -> None:
    job, spec = JobRef("demo", "ns", "uid-1"), _spec()
    waits = [PodWait("demo-trainer-0-x", "ImagePullBackOff", "cannot pull r/x:1 (ErrImagePull)", "trainer")]
    first = compute_status(job, spec, 1, RLJobStatus(), _observed(waits), T0)
    cond = first.status.condition("PodsBlocked")
    assert cond is not None and cond.status == "True" and cond.reason == "ImagePullBackOff"
    assert "demo-trainer-0-x" in cond.message
    (event,) = [e for e in first.events if e.reason == "ImagePullBackOff"]
    assert event.type == "Warning" and "pod demo-trainer-0-x/trainer" in event.message
    assert first.status.phase == "Starting"
    # Same pod, same reason, a new back-off message: no second Event; a new pod gets its own.
    again = [PodWait("demo-trainer-0-x", "ImagePullBackOff", "cannot pull r/x:1 (ImagePullBackOff)", "trainer"),
             PodWait("demo-infer-cpu-0", "Unschedulable", "0/1 nodes are available")]
    second = compute_status(job, spec, 1, first.status, _observed(again), T0)
    assert [e.reason for e in second.events if e.type == "Warning"] == ["Unschedulable"]
    # Cleared: the condition goes False.
    third = compute_status(job, spec, 1, second.status, _observed([]), T0)
    cleared = third.status.condition("PodsBlocked")
    assert cleared is not None and cleared.status == "False" and cleared.reason == "NoneBlocked"


def test_suspended_job_reports_no_blocked_pods() -> None:
    spec = RLJobSpec.model_validate({"model": {"builtin": "tiny-arith"}, "data": {"synthetic": {}}, "suspend": True})
    waits = [PodWait("p", "Unschedulable", "no node")]
    decision = compute_status(JobRef("demo", "ns", "u"), spec, 1, RLJobStatus(), _observed(waits), T0)
    cond = decision.status.condition("PodsBlocked")
    assert cond is not None and cond.status == "False" and cond.reason == "NotRunning"
    assert not [e for e in decision.events if e.reason == "Unschedulable"]


def test_every_built_container_falls_back_to_logs() -> None:
    spec = RLJobSpec.model_validate({
        "model": {"huggingFace": "Qwen/Qwen2.5-0.5B-Instruct", "storage": {"download": {}}},
        "data": {"synthetic": {}},
        "rollout": {"pools": [{"name": "h100", "vendor": "nvidia"}]},
    })
    pods = pod_templates(build_children(JobRef("demo", "ns", "u"), spec, active=True))
    containers = [c for p in pods for c in [*p.get("initContainers", []), *p["containers"]]]
    assert len(pods) == 3 and any(p.get("initContainers") for p in pods)
    assert {c.get("terminationMessagePolicy") for c in containers} == {"FallbackToLogsOnError"}
