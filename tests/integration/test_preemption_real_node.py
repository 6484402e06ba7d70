"""Preemption of a cpu-vendor RLJob's 2-pod trainer gang on the real node (issue 26, item 2).

One RLJob run (the job of test_rljob_real_node.py, more steps, and no periodic checkpoint: only a
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

import sys
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.kube import wait_until
from tests.cluster.realnode import RealCluster
from tests.helpers.real_node_rljob import GROUP, NAME, PLURAL, VERSION, RealNodeJob, real_node_job, rljob_manifest
from rljob.runtime.checkpoint import MARKER
from rljob.runtime.metrics import read_jsonl

pytestmark = [pytest.mark.realnode, pytest.mark.cluster, pytest.mark.slow]

# Steps for two interruptions with steps after each (a step takes 2-4 s here, and the status's step may
# lag a few behind the trainer's: the progress reporter batches its writes).
STEPS = 24
TRAINER_LABELS = f"rljob.io/job-name={NAME},rljob.io/role=trainer"
INDEX_LABEL = "batch.kubernetes.io/job-completion-index"


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


def _trainer_pods(rc: RealCluster, job: RealNodeJob, index: int | None = None) -> list[Any]:
    selector = TRAINER_LABELS if index is None else f"{TRAINER_LABELS},{INDEX_LABEL}={index}"
    return list(rc.cluster.core().list_namespaced_pod(job.namespace, label_selector=selector).items)


def _set_suspend(job: RealNodeJob, suspend: bool) -> None:
    job.api.patch_namespaced_custom_object(GROUP, VERSION, job.namespace, PLURAL, NAME, {"spec": {"suspend": suspend}})


def test_a_deleted_trainer_pod_and_a_suspend_lose_and_repeat_no_step(real_cluster: RealCluster, real_namespace: str,
                                                                     tmp_path: Path) -> None:
    rc = real_cluster
    with real_node_job(rc, real_namespace, tmp_path) as job:
        try:
            doc = rljob_manifest(job.runtime, job.router, STEPS)
            doc["spec"]["checkpoint"]["everySteps"] = 1000  # only SIGTERM's checkpoints and the last step's
            job.api.create_namespaced_custom_object(GROUP, VERSION, job.namespace, PLURAL, doc)

            # 1. kubectl delete pod of rank 1, a step done: SIGTERM reaches rank 1 only.
            before = _step(_wait(job, lambda s: _step(s) >= 1, 900, "the first step done"))
            assert before < STEPS - 4, "too late in the run to interrupt it"
            (rank1,) = [p for p in _trainer_pods(rc, job, 1) if p.metadata.deletion_timestamp is None]
            assert not _checkpoints(job), "a checkpoint before any SIGTERM: the test's everySteps was not applied"
            rc.cluster.kubectl("delete", "pod", rank1.metadata.name, "-n", job.namespace, "--wait=false")
            restarted = _wait(job, lambda s: s.get("restarts", {}).get("interrupted") == 1, 600,
                              "the gang restarted after an interruption")
            assert restarted["restarts"]["trainer"] == 0, restarted["restarts"]  # an interruption, not a failure
            first = _checkpoints(job)
            assert len(first) == 1 and first[0] > before, (first, before)  # the step in flight, checkpointed

            # 2. suspend, steps done after the restart: SIGTERM to both pods.
            resumed = _step(_wait(job, lambda s: _step(s) > first[0], 600, "a step done after the restart"))
            assert resumed < STEPS - 2, "too late in the run to suspend it"
            _set_suspend(job, True)
            wait_until(lambda: job.status().get("phase") == "Suspended" and not _trainer_pods(rc, job), 600,
                       "RLJob Suspended, its trainer pods gone", interval=1)
            second = _checkpoints(job)
            # What the suspended Job says of its stopped pods (the resume below must not count them as a failure).
            print("trainer Job while suspended:", rc.cluster.kubectl(
                "get", "job", f"{NAME}-trainer", "-n", job.namespace, "-o", "jsonpath={.status}", check=False).stdout)
            assert second[-1] > resumed, (second, resumed)
            _set_suspend(job, False)
            job.assert_completes(900)
            status = job.status()
            assert status["trainer"]["step"] == STEPS and status["restarts"]["trainer"] == 0, status

            # Every step exactly once across the three runs of rank 0: none lost, none trained twice.
            records = read_jsonl(job.checkpoints / "metrics.jsonl")
            assert [r["step"] for r in records] == list(range(1, STEPS + 1)), [r["step"] for r in records]
            assert [r["policy_version"] for r in records] == list(range(1, STEPS + 1)), records
            print(f"deleted rank 1 after step {before}: checkpoint {first}; suspended after step {resumed}: "
                  f"checkpoints {second}")
        except BaseException:
            job.print_diagnostics()
            print(rc.cluster.kubectl("get", "events", "-n", job.namespace, "--field-selector", "involvedObject.kind=RLJob",
                                     check=False).stdout)
            raise
        finally:
            sys.stdout.flush()
