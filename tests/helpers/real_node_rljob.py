"""A cpu-vendor RLJob on the real node: its volumes, its manifest, the operator on the host, diagnostics.

Shared by the real-node RLJob tests (tests/integration/test_rljob_real_node.py and
test_rljob_failures_real_node.py). The job is the chart's cpu example
(charts/rljob-operator/examples/cpu-only.yaml) with the tests' images, sizes and step counts. Its model
and its data (training and held-out jsonl) sit on PersistentVolumeClaims, the checkpoints (and the step
records, `metrics.jsonl`) on the operator's checkpoint claim, all hostPath PVs pre-bound to their claims
(the cluster has no provisioner); the runtime image is `runtime-thin` with the test run's virtualenv
mounted read-only (`spec.pods.volumes`).
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client as k8s

from rljob.operator import crdgen
from rljob.operator.volume_policy import ALLOWED_VOLUME_TYPES_ENV, RESTRICTED_VOLUME_TYPES
from rljob.runtime.tasks.dataset import synthetic_records
from tests.cluster.kube import wait_until
from tests.cluster.realnode import RealCluster, mounted_runtime
from tests.helpers.operator_process import OperatorProcess
from tests.helpers.pod_logs import PodLogRecorder
from tests.integration.test_job_pods_real_node import read_only_claim
from tests.integration.test_runner_resume import tiny_policy

GROUP, VERSION, PLURAL = "rljob.io", "v1alpha1", "rljobs"
EXAMPLE = Path(__file__).resolve().parents[2] / "charts/rljob-operator/examples/cpu-only.yaml"
NAME = "e2e"
TRAINER_LABELS = f"rljob.io/job-name={NAME},rljob.io/role=trainer"
INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
# Inside the pods: the checkpoint claim's mount; the step records live there so they outlive the trainer pods.
METRICS_JSONL = "/var/lib/rljob/checkpoints/metrics.jsonl"


def checkpoint_volume(rc: RealCluster, namespace: str, folder: Path, claim: str) -> None:
    """A hostPath PV pre-bound to the operator's checkpoint claim (the cluster has no provisioner).

    ReadWriteMany, as the example's claim asks: both trainer pods mount it (the API server refuses a
    ReadWriteOnce checkpoint claim for more than one trainer pod)."""
    folder.mkdir(parents=True)
    folder.chmod(0o777)
    rc.cluster.core().create_persistent_volume({
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"ckpt-{namespace}"[:63]},
        "spec": {"capacity": {"storage": "10Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": "",
                 "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": str(folder), "type": "Directory"},
                 "claimRef": {"namespace": namespace, "name": claim}},
    })


def data_files(folder: Path, train: int = 64, held_out: int = 16) -> Path:
    """The example's data claim: train.jsonl and test.jsonl of arithmetic problems the tiny model's
    character tokenizer can spell (the held-out ones follow the training ones, never trained on)."""
    folder.mkdir(parents=True)
    for name, rows in (("train.jsonl", synthetic_records(train, seed=3)),
                       ("test.jsonl", synthetic_records(held_out, seed=3, start=train))):
        lines = (json.dumps({"prompt": r.prompt, "answer": r.answer}) for r in rows)
        (folder / name).write_text("\n".join(lines) + "\n")
        (folder / name).chmod(0o644)  # the pods run as uid 1000
    folder.chmod(0o755)
    return folder


def rljob_manifest(runtime: str, router: str, steps: int, trainer_replicas: int = 2,
                   rollout: dict[str, Any] | None = None, sections: dict[str, Any] | None = None) -> dict[str, Any]:
    """The chart's cpu example with the tests' images and sizes: rounds of 2 groups x 2 short samples,
    small pod requests, a checkpoint every step, no evaluation, the step records on the checkpoint claim.
    ``rollout``: spec.rollout fields to set on top (a test's strategy, say); ``sections``: whole spec
    sections that replace the test job's (a model in an object store instead of the model claim, say)."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"] = {"name": NAME}
    spec = doc["spec"]
    volumes, mounts = mounted_runtime()
    spec["rollout"].update(rolloutBatchSize=2, samplesPerPrompt=2, maxResponseLength=16, **(rollout or {}))
    spec["rollout"]["router"]["image"] = router
    for pool in spec["rollout"]["pools"]:
        pool.update(image=runtime, resources={"requests": {"cpu": "100m", "memory": "256Mi"},
                                              "limits": {"memory": "3Gi"}})
    spec["trainer"].update(image=runtime, steps=steps, replicas=trainer_replicas)
    spec["evaluation"].update(everySteps=100, prompts=2)
    spec["checkpoint"]["everySteps"] = 1
    spec["metrics"] = {"jsonl": METRICS_JSONL}
    spec.update(sections or {})
    spec["pods"] = {"volumes": volumes, "volumeMounts": mounts}
    return doc


class RealNodeJob:
    """One RLJob `e2e` in `namespace`, its volumes ready and the operator running on the host."""

    def __init__(self, rc: RealCluster, namespace: str, tmp_path: Path, monitoring_namespace: str | None = None,
                 operator_env: dict[str, str] | None = None) -> None:
        self.rc, self.namespace = rc, namespace
        self.checkpoints = tmp_path / "ckpt"  # the host folder behind the checkpoint claim
        self.api = k8s.CustomObjectsApi(rc.cluster.api)
        self.pod_logs = PodLogRecorder(rc.cluster.core(), namespace, tmp_path / "pod-logs")
        self.runtime, self.router = rc.load_image("runtime-thin"), rc.load_image("router")
        rc.cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crdgen.CRD_PATH))
        model = tiny_policy(tmp_path / "volume" / "tiny")
        for file in model.iterdir():  # safetensors writes 0600; the pods run as uid 1000
            file.chmod(0o644)
        read_only_claim(rc, namespace, "models", model.parent)  # its root holds tiny/
        read_only_claim(rc, namespace, "data", data_files(tmp_path / "data-volume"))
        checkpoint_volume(rc, namespace, self.checkpoints, f"{NAME}-checkpoints")
        # The test job mounts the installed runtime from the host (hostPath, spec.pods.volumes): allowed as
        # the chart's jobPods.allowHostPath would.
        env = {**os.environ, "KUBECONFIG": str(rc.cluster.kubeconfig),
               ALLOWED_VOLUME_TYPES_ENV: ",".join(sorted(RESTRICTED_VOLUME_TYPES | {"hostPath"})),
               **(operator_env or {})}
        # The namespace the NetworkPolicies let scrape the metrics ports (none: no scraper outside the job).
        scraper = ["--monitoring-namespace", monitoring_namespace] if monitoring_namespace else []
        self.operator = OperatorProcess(
            lambda liveness, metrics: ["-n", namespace, "--liveness", f"http://127.0.0.1:{liveness}/healthz",
                                       "--metrics-port", str(metrics), "--metrics-addr", "127.0.0.1",
                                       "--resync-seconds", "2", *scraper],
            tmp_path / "operator.log", env=env,
        )

    def create(self, steps: int, rollout: dict[str, Any] | None = None, sections: dict[str, Any] | None = None) -> None:
        """Create the RLJob (``rollout``: spec.rollout fields to set on top of the test job's; ``sections``:
        spec sections that replace the test job's)."""
        doc = rljob_manifest(self.runtime, self.router, steps, rollout=rollout, sections=sections)
        self.api.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, doc)

    def status(self) -> dict[str, Any]:
        """The RLJob's status (empty before the operator wrote one)."""
        return dict(self.api.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, NAME).get("status", {}))

    def final_phase(self) -> str | None:
        """`Complete` or `Failed` once the job has ended, else None."""
        phase = self.status().get("phase")
        return phase if phase in ("Complete", "Failed") else None

    def assert_completes(self, timeout: float = 1500) -> None:
        """Wait for the job to end; fail unless it ended Complete (`real_node_job` prints the diagnostics)."""
        try:
            final = wait_until(self.final_phase, timeout, f"RLJob {NAME} Complete or Failed", interval=5)
        except TimeoutError:
            final = None
        assert final == "Complete", f"RLJob {NAME} ended {final or 'nowhere'} within {timeout:.0f} s"

    def pods(self, role: str) -> list[Any]:
        """The job's pods of `role` (trainer, inference, router), Terminating ones included."""
        selector = f"rljob.io/job-name={NAME},rljob.io/role={role}"
        return list(self.rc.cluster.core().list_namespaced_pod(self.namespace, label_selector=selector).items)

    def trainer_pods(self, index: int | None = None) -> list[Any]:
        """The trainer pods (of completion index `index` when given: that rank's pod)."""
        if index is None:
            return self.pods("trainer")
        selector = f"{TRAINER_LABELS},{INDEX_LABEL}={index}"
        return list(self.rc.cluster.core().list_namespaced_pod(self.namespace, label_selector=selector).items)

    def kill_trainer_rank(self, index: int) -> set[str]:
        """SIGKILL the container of trainer rank `index` through containerd (as an OOM kill or a crash
        would end it); the names of the gang's rank-0 pods so far, to tell the restarted one by."""
        running = [p for p in self.trainer_pods(index)
                   if p.status.phase == "Running" and p.metadata.deletion_timestamp is None]
        assert len(running) == 1, [p.metadata.name for p in self.trainer_pods(index)]
        leaders = {p.metadata.name for p in self.trainer_pods(0)}
        container = running[0].status.container_statuses[0].container_id.removeprefix("containerd://")
        self.rc.ctr("tasks", "kill", "--signal", "SIGKILL", container)
        return leaders

    def resumed_at(self, old_leaders: set[str], timeout: float = 600) -> int:
        """The step the restarted gang's rank 0 says it resumed at (read while it runs: at Complete the
        operator suspends the trainer Job and its pods go)."""
        def logged() -> int | None:
            for pod in self.trainer_pods(0):
                if pod.metadata.name not in old_leaders:
                    log = self.rc.cluster.kubectl("logs", "-n", self.namespace, pod.metadata.name, check=False).stdout
                    resumed = re.search(r"resumed from \S*step-(\d+)\s+at step (\d+)", log)
                    if resumed is not None:
                        return int(resumed.group(2))
            return None

        step: int = wait_until(logged, timeout, "the restarted rank 0 logs `resumed from <checkpoint> at step N`",
                               interval=1)
        return step

    def delete(self) -> None:
        """Delete the RLJob (its children go with it, by owner references)."""
        self.api.delete_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, NAME)

    def children(self) -> list[str]:
        """The job's children still present, as kind/name."""
        return self.rc.cluster.kubectl(
            "get", "pods,statefulsets,deployments,jobs,services,configmaps,pdb,pvc,networkpolicies", "-n", self.namespace,
            "-l", f"rljob.io/job-name={NAME}", "-o", "name", check=False).stdout.split()

    def print_diagnostics(self) -> None:
        """Pods, their containers' last states and logs (the crashed run's too, for a container that
        restarted), the ends of the logs of pods already gone (a replaced trainer gang's), the job's Events,
        its status and the operator's log: a failed test's output. Everything is read back here, because
        the real node's pod logs are wiped with the node."""
        kubectl = self.rc.cluster.kubectl
        print(kubectl("get", "pods,jobs,pvc,rljob", "-n", self.namespace, "-o", "wide", check=False).stdout)
        for pod in self.rc.cluster.core().list_namespaced_pod(self.namespace).items:
            name = pod.metadata.name
            for container in pod.status.container_statuses or []:
                if container.restart_count:
                    print(name, container.name, f"restarted {container.restart_count} times; last state:",
                          container.last_state.terminated)
                    print(kubectl("logs", "-n", self.namespace, name, "-c", container.name, "--previous",
                                  "--tail=60", check=False).stdout)
            print(name, kubectl("logs", "-n", self.namespace, name, "--all-containers", "--tail=40", check=False).stdout)
        print(kubectl("get", "events", "-n", self.namespace, "--sort-by=.lastTimestamp", check=False).stdout[-6000:])
        try:
            print(json.dumps(self.status(), indent=1)[-4000:])
        except k8s.ApiException as exc:  # not created yet, or already deleted
            print(f"RLJob {NAME}: {exc.status} {exc.reason}")
        present = {pod.metadata.name for pod in self.rc.cluster.core().list_namespaced_pod(self.namespace).items}
        for name, tail in self.pod_logs.gone_tails(present).items():
            print(f"log of {name} (the pod is gone), its end:\n{tail}")
        print(self.operator.log_tail())


@contextmanager
def real_node_job(rc: RealCluster, namespace: str, tmp_path: Path, monitoring_namespace: str | None = None,
                  operator_env: dict[str, str] | None = None) -> Iterator[RealNodeJob]:
    """A RealNodeJob with its operator started (``operator_env`` added to its environment); the operator
    is stopped afterwards. When the body fails (an assertion, a timeout), the job's diagnostics are
    printed first, while its pods exist."""
    job = RealNodeJob(rc, namespace, tmp_path, monitoring_namespace, operator_env)
    job.pod_logs.start()
    job.operator.start()
    try:
        yield job
    except BaseException:
        try:
            job.print_diagnostics()
        except Exception as exc:  # the test's own failure is the one to report
            print(f"diagnostics unavailable: {exc!r}")
        raise
    finally:
        sys.stdout.flush()
        job.operator.stop()
        job.pod_logs.stop()
