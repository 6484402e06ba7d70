"""The cluster's object store on the real node: a cpu-vendor RLJob whose model and checkpoints live in S3.

The cluster of a platform with no egress (docs/install.md): a SeaweedFS pod serves S3 behind a Service,
signed requests only, with the keys in a Secret that model.s3 and checkpoint.s3 name. The job has no
model claim and no checkpoint claim:

- the tiny model is uploaded to the store and nowhere else. The operator, configured with a download
  image (RLJOB_IMAGE_DEFAULTS, as the chart's `images.download` sets it), gives every model pod a
  `model-download` init container that fetches the folder; the inference pod and both trainer pods
  start from their own copies;
- both trainer pods write each checkpoint: the second pod stages and uploads its own part (its DCP shard
  and RNG state), rank 0 the rest and the marker last (docs/distributed.md, "Checkpoints");
- the container of trainer rank 1 is SIGKILLed after a checkpoint is in the store: the operator restarts
  the gang, whose new pods have empty staging folders, so the resume comes from the store only, and the
  job trains to Complete.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rljob.operator.builders.images import IMAGE_DEFAULTS_ENV
from rljob.operator.builders.storage import DOWNLOAD_CONTAINER
from rljob.runtime.checkpoint import MARKER
from tests.cluster.kube import wait_until
from tests.cluster.realnode import RealCluster
from tests.cluster.seaweedfs_pod import SeaweedfsPod
from tests.helpers.real_node_rljob import RealNodeJob, real_node_job
from tests.integration.test_runner_resume import tiny_policy

pytestmark = [pytest.mark.realnode, pytest.mark.cluster, pytest.mark.slow]

STEPS = 5
MODEL_URI = "s3://models/tiny/v1"
CHECKPOINT_URI = "s3://checkpoints/e2e"
SECRET = "store-keys"


def _image_defaults(runtime_ref: str) -> str:
    """RLJOB_IMAGE_DEFAULTS naming the download image: the runtime-thin image the test's pods run."""
    repository, _, tag = runtime_ref.rpartition(":")
    return json.dumps({"download": {"repository": repository, "tag": tag}})


def _download_logs(rc: RealCluster, job: RealNodeJob) -> dict[str, str] | None:
    """Pod name -> its download step's log, once the step of every model pod (the cpu pool's engine and
    both trainer ranks) has exited 0; None before."""
    pods = [p for role in ("inference", "trainer") for p in job.pods(role)
            if any(c.name == DOWNLOAD_CONTAINER for c in p.spec.init_containers or [])]
    logs = {}
    for pod in pods:
        states = [s.state for s in pod.status.init_container_statuses or [] if s.name == DOWNLOAD_CONTAINER]
        if states and states[0].terminated is not None:
            assert states[0].terminated.exit_code == 0, (pod.metadata.name, states[0].terminated.message)
            logs[pod.metadata.name] = rc.cluster.kubectl(
                "logs", "-n", job.namespace, pod.metadata.name, "-c", DOWNLOAD_CONTAINER, check=False).stdout
    return logs if len(pods) == 3 and len(logs) == 3 else None


def _step(job: RealNodeJob) -> dict[str, Any]:
    status = job.status()
    assert status.get("phase") not in ("Failed", "Complete"), f"the job ended early: {status.get('phase')}"
    return dict(status.get("trainer", {}))


def test_model_and_checkpoints_in_the_clusters_object_store_survive_a_gang_restart(
        real_cluster: RealCluster, real_namespace: str, tmp_path: Path) -> None:
    rc, ns = real_cluster, real_namespace
    store = SeaweedfsPod(rc, ns)
    store.start(["models", "checkpoints"])
    store.upload_folder(tiny_policy(tmp_path / "model"), MODEL_URI)
    store.credentials_secret(SECRET)
    s3 = {"endpoint": store.endpoint, "credentialsSecret": SECRET}
    operator_env = {IMAGE_DEFAULTS_ENV: _image_defaults(rc.load_image("runtime-thin"))}
    with real_node_job(rc, ns, tmp_path, operator_env=operator_env) as job:
        job.create(STEPS, sections={"model": {"uri": MODEL_URI, "s3": s3},
                                    "checkpoint": {"uri": CHECKPOINT_URI, "s3": s3, "everySteps": 1, "keep": 2},
                                    "metrics": {}})  # no claim to keep the step records on
        logs = wait_until(lambda: _download_logs(rc, job), 600, "every model pod's download step done", interval=2)
        assert all(MODEL_URI in log for log in logs.values()), logs

        # A checkpoint in the store, steps left: kill rank 1; the restarted gang resumes from the store.
        trainer = wait_until(lambda: (t := _step(job)).get("lastCheckpoint", {}).get("step") and t, 900,
                             "a checkpoint written", interval=0.5)
        checkpointed = int(trainer["lastCheckpoint"]["step"])
        # The status may carry the checkpoint before the step count (both come from rank 0's reports).
        assert max(int(trainer.get("step") or 0), checkpointed) < STEPS - 1, f"too late to kill a rank: {trainer}"
        old_leaders = job.kill_trainer_rank(1)
        resumed_at = job.resumed_at(old_leaders)
        assert resumed_at >= checkpointed >= 1, (resumed_at, checkpointed)
        job.assert_completes()
        status = job.status()
        assert status["trainer"]["step"] == STEPS and status["restarts"]["trainer"] == 1, status

    # The store holds the newest checkpoints, each with both pods' parts and its marker.
    keys = store.list_keys(CHECKPOINT_URI)
    newest = f"step-{STEPS:08d}/"
    mine = sorted(k.removeprefix(newest) for k in keys if k.startswith(newest))
    assert MARKER in mine and "state.pt" in mine, mine
    assert {"rng/rank-00000.pt", "rng/rank-00001.pt"} <= set(mine), mine
    assert len([k for k in mine if k.startswith("trainer/") and k.endswith(".distcp")]) == 2, mine
    assert len({k.split("/")[0] for k in keys if k.startswith("step-")}) == 2, f"keep: 2, {sorted(keys)}"
