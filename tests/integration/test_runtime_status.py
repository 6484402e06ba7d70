"""The runtime reports its progress into the RLJob's status through the real API server."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from kubernetes import client as k8s

from rljob.api import parse_rljob
from rljob.runtime.metrics import read_jsonl
from rljob.runtime.runner import JobRunner, RunOptions
from tests.integration.test_operator import api, crd  # noqa: F401 - fixtures
from tests.integration.test_runner_resume import job_doc, tiny_policy

pytestmark = pytest.mark.cluster


async def test_runner_writes_step_checkpoint_and_metrics_into_status(
    tmp_path: Path, namespace: str, api: k8s.CustomObjectsApi, monkeypatch: pytest.MonkeyPatch  # noqa: F811
):
    doc = job_doc(tiny_policy(tmp_path / "model"), tmp_path / "ckpt", steps=2, every=1)
    doc["metadata"]["namespace"] = namespace
    # The object names a model its (never created) inference pods could load: the CRD rejects a local
    # folder. The runner here trains the local folder and only reports into this object's status.
    cluster_doc = copy.deepcopy(doc)
    cluster_doc["spec"]["model"] = {"path": "pvc://models/tiny"}
    api.create_namespaced_custom_object("rljob.io", "v1alpha1", namespace, "rljobs", cluster_doc)
    monkeypatch.setenv("RLJOB_STATUS_REPORT", "1")
    monkeypatch.setenv("RLJOB_NAMESPACE", namespace)
    monkeypatch.setenv("RLJOB_NAME", doc["metadata"]["name"])

    runner = JobRunner(parse_rljob(doc), RunOptions(output_dir=tmp_path / "out"))
    assert runner.progress_reporter is not None
    await runner.setup()
    await runner.run()

    status = api.get_namespaced_custom_object("rljob.io", "v1alpha1", namespace, "rljobs", doc["metadata"]["name"])["status"]
    assert status["trainer"]["step"] == 2
    assert status["trainer"]["policyVersion"] == 2
    assert status["trainer"]["lastCheckpoint"]["step"] == 2
    assert status["trainer"]["lastCheckpoint"]["uri"].endswith("step-00000002")
    assert 0.0 <= status["metrics"]["truncationRate"] <= 1.0
    assert "rewardMean" in status["metrics"]
    # The signals of docs/metrics.md, side by side in status, are the last step's (metrics.jsonl).
    last = read_jsonl(tmp_path / "out" / "metrics.jsonl")[-1]
    assert last["step"] == 2
    for field, key in (("truncationRate", "truncation_rate"), ("partialRate", "partial_rate"),
                       ("goodputTokensPerSecond", "goodput_tokens_per_s"),
                       ("abortedTokenShare", "aborted_token_share"),
                       ("trainerIdleSeconds", "trainer_idle_seconds"), ("engineIdleSeconds", "engine_idle_seconds")):
        assert status["metrics"][field] == pytest.approx(last[key]), field
    assert status["metrics"]["goodputTokensPerSecond"] > 0
