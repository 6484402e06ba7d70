"""No silent waits, on the real node: a job whose pods cannot start says why within a resync.

The chart's cpu example (tests/helpers/real_node_rljob.py), reconciled by the operator on the host
(resync every 2 s), with one thing broken:

- the trainer's image does not exist (the node has no registry to pull it from): the PodsBlocked
  condition turns True with reason ImagePullBackOff naming a trainer pod and the missing image, and a
  Warning Event with that reason is posted on the RLJob;
- the held-out data sits on a claim that never binds (no PersistentVolume, no provisioner): the
  scheduler cannot place the trainer pods, and PodsBlocked says UnboundClaim naming a trainer pod.

The waits are on the status and the Events themselves (generous deadlines: an image pull's first
failure can take tens of seconds on a busy node).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.cluster.kube import wait_until
from tests.cluster.realnode import RealCluster
from tests.helpers.real_node_rljob import GROUP, NAME, PLURAL, VERSION, RealNodeJob, real_node_job, rljob_manifest

pytestmark = [pytest.mark.realnode, pytest.mark.cluster, pytest.mark.slow]

MISSING_IMAGE = "localhost/rljob/no-such-image:0.0.0"
NEVER_BOUND = "never-bound"


def _blocked(job: RealNodeJob, reason: str) -> dict[str, Any] | None:
    """The PodsBlocked condition once it is True with `reason`."""
    status = job.status()
    assert status.get("phase") not in ("Complete", "Failed"), f"the job ended: {status.get('phase')}"
    cond = next((c for c in status.get("conditions", []) if c["type"] == "PodsBlocked"), None)
    return cond if cond is not None and cond["status"] == "True" and cond["reason"] == reason else None


def _event(job: RealNodeJob, reason: str) -> Any:
    events = job.rc.cluster.core().list_namespaced_event(
        job.namespace, field_selector=f"involvedObject.name={NAME},reason={reason}").items
    return next((e for e in events if e.type == "Warning"), None)


def _create(job: RealNodeJob, manifest: dict[str, Any]) -> None:
    job.api.create_namespaced_custom_object(GROUP, VERSION, job.namespace, PLURAL, manifest)


def test_missing_image_is_reported_with_the_pod(real_cluster: RealCluster, real_namespace: str, tmp_path: Path) -> None:
    with real_node_job(real_cluster, real_namespace, tmp_path) as job:
        manifest = rljob_manifest(job.runtime, job.router, steps=2)
        manifest["spec"]["trainer"]["image"] = MISSING_IMAGE
        _create(job, manifest)
        cond = wait_until(lambda: _blocked(job, "ImagePullBackOff"), 300, "PodsBlocked=True/ImagePullBackOff")
        assert f"pod {NAME}-trainer" in cond["message"] and MISSING_IMAGE in cond["message"], cond
        event = wait_until(lambda: _event(job, "ImagePullBackOff"), 60, "a Warning Event ImagePullBackOff")
        assert f"pod {NAME}-trainer" in event.message, event.message
        assert job.status()["phase"] == "Starting"


def test_claim_that_never_binds_is_reported_with_the_pod(real_cluster: RealCluster, real_namespace: str,
                                                          tmp_path: Path) -> None:
    with real_node_job(real_cluster, real_namespace, tmp_path) as job:
        # A claim with no volume and no storage class to provision one: Pending for good.
        job.rc.cluster.core().create_namespaced_persistent_volume_claim(real_namespace, {
            "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": NEVER_BOUND},
            "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "", "resources": {"requests": {"storage": "1Gi"}}},
        })
        manifest = rljob_manifest(job.runtime, job.router, steps=2)
        manifest["spec"]["evaluation"]["jsonl"] = f"pvc://{NEVER_BOUND}/test.jsonl"
        _create(job, manifest)
        cond = wait_until(lambda: _blocked(job, "UnboundClaim"), 300, "PodsBlocked=True/UnboundClaim")
        assert f"pod {NAME}-trainer" in cond["message"], cond
        event = wait_until(lambda: _event(job, "UnboundClaim"), 60, "a Warning Event UnboundClaim")
        assert f"pod {NAME}-trainer" in event.message, event.message
