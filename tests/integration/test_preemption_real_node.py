"""Preemption of a cpu-vendor RLJob's 2-pod trainer gang on the real node (issue 26, item 2).

Each test runs the job of test_rljob_real_node.py with more steps and no periodic checkpoint (only a
SIGTERM and the last step write one, so a step in flight that were lost would be trained again):

- `kubectl delete pod` of trainer rank 1, once a step is done: the kubelet sends SIGTERM to that pod's
  torchrun, which forwards it to rank 1 only. Rank 0 hears of it through the step boundary's vote, the
  gang finishes the step in flight, checkpoints it and exits Interrupted; the operator restarts it as an
  interruption (not a failure) and the new rank 0 resumes from that checkpoint;
- `spec.suspend: true` later: the Job controller deletes both pods (SIGTERM to both torchruns); the gang
  checkpoints the step in flight; resumed, it goes on from there to Complete.

The step records (appended by every run of rank 0, on the checkpoint claim) hold every step exactly once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.cluster.kube import wait_until
from tests.cluster.realnode import RealCluster
from tests.helpers.real_node_rljob import GROUP, NAME, PLURAL, VERSION, RealNodeJob, real_node_job, rljob_manifest
from rljob.runtime.checkpoint import MARKER
from rljob.runtime.metrics import read_jsonl

pytestmark = [pytest.mark.realnode, pytest.mark.cluster, pytest.mark.slow]

# Enough steps for an interruption with steps after it (a step takes 2-4 s here, and the status's step may
# lag a few behind the trainer's: the progress reporter batches its writes).
DELETE_STEPS = 12
SUSPEND_STEPS = 12


def _step(status: dict[str, Any]) -> int:
    return int(status.get("trainer", {}).get("step") or 0)


def _running(job: RealNodeJob) -> dict[str, Any]:
    status = job.status()
    assert status.get("phase") not in ("Failed", "Complete"), f"the job ended early: {status}"
    return status


def _wait(job: RealNodeJob, check: Any, timeout: float, what: str) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        status = _running(job)
        return status if check(status) else None

    result: dict[str, Any] = wait_until(probe, timeout, what, interval=0.5)
    return result


def _checkpoints(job: RealNodeJob) -> list[int]:
    """The steps of the complete checkpoints (their marker written) on the checkpoint claim."""
    return sorted(int(p.name.split("-")[1]) for p in job.checkpoints.glob("step-*") if (p / MARKER).is_file())


def _set_suspend(job: RealNodeJob, suspend: bool) -> None:
    job.api.patch_namespaced_custom_object(GROUP, VERSION, job.namespace, PLURAL, NAME, {"spec": {"suspend": suspend}})


def _records_hold_every_step_once(job: RealNodeJob, steps: int) -> None:
    """Every step exactly once across the runs of rank 0: none lost, none trained twice."""
    records = read_jsonl(job.checkpoints / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, steps + 1)), [r["step"] for r in records]
    assert [r["policy_version"] for r in records] == list(range(1, steps + 1)), records


def _start(job: RealNodeJob, steps: int) -> int:
    """Create the RLJob (checkpoints only on SIGTERM and at the last step); the step done first."""
    doc = rljob_manifest(job.runtime, job.router, steps)
    doc["spec"]["checkpoint"]["everySteps"] = 1000  # only SIGTERM's checkpoints and the last step's
    job.api.create_namespaced_custom_object(GROUP, VERSION, job.namespace, PLURAL, doc)
    before = _step(_wait(job, lambda s: _step(s) >= 1, 900, "the first step done"))
    assert before < steps - 2, "too late in the run to interrupt it"
    assert not _checkpoints(job), "a checkpoint before any SIGTERM: the test's everySteps was not applied"
    return before


def test_a_deleted_trainer_pod_loses_and_repeats_no_step(real_cluster: RealCluster, real_namespace: str,
                                                         tmp_path: Path) -> None:
    """`kubectl delete pod` of rank 1 once a step is done: SIGTERM reaches rank 1 only; the gang
    checkpoints the step in flight, the operator restarts it as an interruption, and it completes."""
    rc = real_cluster
    with real_node_job(rc, real_namespace, tmp_path) as job:
        before = _start(job, DELETE_STEPS)
        (rank1,) = [p for p in job.trainer_pods(1) if p.metadata.deletion_timestamp is None]
        rc.cluster.kubectl("delete", "pod", rank1.metadata.name, "-n", job.namespace, "--wait=false")
        restarted = _wait(job, lambda s: s.get("restarts", {}).get("interrupted") == 1, 600,
                          "the gang restarted after an interruption")
        assert restarted["restarts"]["trainer"] == 0, restarted["restarts"]  # an interruption, not a failure
        first = _checkpoints(job)
        assert len(first) == 1 and first[0] > before, (first, before)  # the step in flight, checkpointed
        job.assert_completes(900)
        status = job.status()
        assert status["trainer"]["step"] == DELETE_STEPS and status["restarts"]["trainer"] == 0, status
        _records_hold_every_step_once(job, DELETE_STEPS)
        print(f"deleted rank 1 after step {before}: checkpoint {first}")


def test_a_suspend_loses_and_repeats_no_step(real_cluster: RealCluster, real_namespace: str, tmp_path: Path) -> None:
    """`spec.suspend: true` once a step is done: the Job controller deletes both pods (SIGTERM to both
    torchruns); the engines stay up until they are gone, so the gang finishes and checkpoints the step in
    flight; the engines then scale to zero; resumed, the job goes on from there to Complete."""
    rc = real_cluster
    with real_node_job(rc, real_namespace, tmp_path) as job:
        before = _start(job, SUSPEND_STEPS)
        _set_suspend(job, True)
        wait_until(lambda: job.status().get("phase") == "Suspended" and not job.trainer_pods(), 600,
                   "RLJob Suspended, its trainer pods gone", interval=1)
        wait_until(lambda: not job.pods("inference"), 300, "the engines scaled to zero after the ranks", interval=1)
        stopped = _checkpoints(job)
        # What the suspended Job says of its stopped pods (the resume below must not count them as a failure).
        print("trainer Job while suspended:", rc.cluster.kubectl(
            "get", "job", f"{NAME}-trainer", "-n", job.namespace, "-o", "jsonpath={.status}", check=False).stdout)
        assert stopped and stopped[-1] > before, (stopped, before)
        _set_suspend(job, False)
        job.assert_completes(900)
        status = job.status()
        # Which way the race with the Job controller went: a trainer Job failed by the suspend
        # (podFailurePolicy on the stopped ranks) is recreated on resume, not counted (TrainerRecreated).
        print("events:", rc.cluster.kubectl("get", "events", "-n", job.namespace, "--field-selector",
                                            "reason=TrainerRecreated", "-o", "name", check=False).stdout.strip())
        assert status["trainer"]["step"] == SUSPEND_STEPS and status["restarts"]["trainer"] == 0, status
        assert status["restarts"]["interrupted"] == 0, status  # a suspend is neither
        _records_hold_every_step_once(job, SUSPEND_STEPS)
