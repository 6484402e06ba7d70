"""A cpu-vendor RLJob, reconciled by the operator, trains to completion with its pods on the real node.

Everything a user sets: the model on a PersistentVolumeClaim, a cpu inference pool (rljob's
SGLang-protocol server), the router image built from the sglang-router package, the trainer gang
(an Indexed Job of two pods, torchrun ranks 0 and 1 -> `rljob run`, FSDP2 over gloo), weights over the `distributed` transport from the
trainer pod to the engine pod, worker discovery through the API server, status reported by the
trainer. The operator runs on the host against the real node's API server; the runtime image is
`runtime-thin` with the test run's virtualenv mounted read-only (`spec.pods.volumes`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s

from rljob.operator import crdgen
from rljob.runtime.metrics import ledger_imbalance, read_jsonl
from tests.cluster.kube import wait_until
from tests.cluster.realnode import RealCluster, mounted_runtime
from tests.helpers.operator_process import OperatorProcess
from tests.integration.test_job_pods_real_node import _model_claim
from tests.integration.test_runner_resume import tiny_policy

pytestmark = [pytest.mark.realnode, pytest.mark.cluster, pytest.mark.slow]

GROUP, VERSION, PLURAL = "rljob.io", "v1alpha1", "rljobs"
STEPS = 2
# Two trainer pods: torchrun ranks 0 and 1 rendezvous across pods through the headless Service.
TRAINER_REPLICAS = 2


def _checkpoint_volume(rc: RealCluster, namespace: str, folder: Path, claim: str) -> None:
    """A hostPath PV pre-bound to the operator's checkpoint claim (the cluster has no provisioner)."""
    folder.mkdir(parents=True)
    folder.chmod(0o777)
    rc.cluster.core().create_persistent_volume({
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"ckpt-{namespace}"[:63]},
        "spec": {"capacity": {"storage": "10Gi"}, "accessModes": ["ReadWriteOnce"], "storageClassName": "",
                 "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": str(folder), "type": "Directory"},
                 "claimRef": {"namespace": namespace, "name": claim}},
    })


def _rljob(runtime: str, router: str) -> dict[str, Any]:
    volumes, mounts = mounted_runtime()
    small = {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "3Gi"}}
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "RLJob", "metadata": {"name": "e2e"},
        "spec": {
            "model": {"path": "pvc://models/tiny"},
            "data": {"synthetic": {"numPrompts": 64, "seed": 3}},
            "algorithm": {"name": "grpo", "learningRate": 1e-3},
            "rollout": {
                "engine": "sglang", "strategy": "april", "rolloutBatchSize": 2, "samplesPerPrompt": 2,
                "maxResponseLength": 16,
                "pools": [{"name": "cpu", "vendor": "cpu", "replicas": 1, "image": runtime, "resources": small,
                           "extraArgs": ["--torch-threads", "1"]}],
                "router": {"image": router, "policy": "round_robin"},
                "weightTransport": {"mode": "distributed", "backend": "gloo", "bucketMegabytes": 1},
            },
            "trainer": {"vendor": "cpu", "gpusPerReplica": 0, "replicas": TRAINER_REPLICAS, "image": runtime, "steps": STEPS,
                        "microBatchSize": 4},
            "evaluation": {"everySteps": 100, "prompts": 2},
            "checkpoint": {"everySteps": 1},
            # On the checkpoint volume (a host folder here), so the step records outlive the trainer pod.
            "metrics": {"jsonl": "/var/lib/rljob/checkpoints/metrics.jsonl"},
            "pods": {"volumes": volumes, "volumeMounts": mounts},
        },
    }


def test_cpu_rljob_trains_to_complete_on_the_real_node(real_cluster: RealCluster, real_namespace: str,
                                                       tmp_path: Path) -> None:
    rc, ns = real_cluster, real_namespace
    runtime, router = rc.load_image("runtime-thin"), rc.load_image("router")
    rc.cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crdgen.CRD_PATH))
    model = tiny_policy(tmp_path / "volume" / "tiny")
    for file in model.iterdir():  # safetensors writes 0600; the pods run as uid 1000
        file.chmod(0o644)
    _model_claim(rc, ns, model.parent)
    _checkpoint_volume(rc, ns, tmp_path / "ckpt", "e2e-checkpoints")
    env = {**os.environ, "KUBECONFIG": str(rc.cluster.kubeconfig)}
    operator = OperatorProcess(
        lambda liveness, metrics: ["-n", ns, "--liveness", f"http://127.0.0.1:{liveness}/healthz",
                                   "--metrics-port", str(metrics), "--metrics-addr", "127.0.0.1", "--resync-seconds", "2"],
        tmp_path / "operator.log", env=env,
    )
    operator.start()
    api = k8s.CustomObjectsApi(rc.cluster.api)
    try:
        api.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, _rljob(runtime, router))

        def phase() -> str | None:
            obj = api.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "e2e")
            value = obj.get("status", {}).get("phase")
            return value if value in ("Complete", "Failed") else None

        try:
            final = wait_until(phase, 1500, "RLJob e2e Complete or Failed", interval=5)
        except TimeoutError:
            final = None
        if final != "Complete":
            print(rc.cluster.kubectl("get", "pods,jobs,pvc,rljob", "-n", ns, "-o", "wide", check=False).stdout)
            for pod in rc.cluster.core().list_namespaced_pod(ns).items:
                print(pod.metadata.name, rc.cluster.kubectl("logs", "-n", ns, pod.metadata.name, "--all-containers",
                                                            "--tail=40", check=False).stdout)
            print(json.dumps(api.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "e2e").get("status"), indent=1)[-4000:])
            print(operator.log_tail())
        assert final == "Complete"
        status = api.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "e2e")["status"]
        assert status["trainer"]["step"] == STEPS and status["trainer"]["policyVersion"] == STEPS
        # The trainer's step records: after every step the engine pod served the new version (the runtime
        # reads each engine's /get_weight_version before a step counts; the pod is scaled away at Complete),
        # with no failed sync, and the sample ledger closes.
        records = read_jsonl(tmp_path / "ckpt" / "metrics.jsonl")
        assert [r["policy_version"] for r in records] == list(range(1, STEPS + 1))
        assert all(r["engines_in_rotation"] == 1 and r["weight_sync_failures"] == 0 for r in records), records
        assert all(ledger_imbalance(r) == (0, 0) for r in records), records

        # Deletion: the API server's garbage collector removes every child (owner references).
        api.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "e2e")

        def children_left() -> bool:
            out = rc.cluster.kubectl("get", "pods,statefulsets,deployments,jobs,services,configmaps,pdb,pvc", "-n", ns,
                                     "-l", "rljob.io/job-name=e2e", "-o", "name", check=False).stdout.split()
            return not out

        wait_until(children_left, 180, "every child of RLJob e2e deleted", interval=2)
    finally:
        operator.stop()
        sys.stdout.flush()
