"""The chart's operator pod on the real node: image built from images/operator.Dockerfile, chart values
as shipped (non-root uid 65532, read-only root filesystem, no capabilities), helm install --wait.

Before the fix in `rljob.operator.__main__.peering_identity` this pod crash-looped with
`KeyError: 'getpwuid(): uid not found: 65532'` (kopf's peering identity; the unit-level regression
test is tests/unit/test_operator_identity.py). With kwok the pod was "Running" all along.
"""

from __future__ import annotations

import subprocess
import uuid

import pytest
import yaml
from kubernetes import client as k8s

from tests.cluster.kube import wait_until
from tests.cluster.realnode import RealCluster
from tests.unit.test_chart import CHART, helm_binary

pytestmark = [pytest.mark.realnode, pytest.mark.cluster]

GROUP, VERSION, PLURAL = "rljob.io", "v1alpha1", "rljobs"


def helm(rc: RealCluster, namespace: str, *args: str) -> str:
    proc = subprocess.run(
        [str(helm_binary()), "--kubeconfig", str(rc.cluster.kubeconfig), "--namespace", namespace, *args],
        capture_output=True, text=True, timeout=300, check=False,
    )
    if proc.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}", pytrace=False)
    return proc.stdout


def test_chart_operator_pod_becomes_ready(real_cluster: RealCluster, real_namespace: str, tmp_path) -> None:
    rc, ns = real_cluster, real_namespace
    repository, tag = rc.images["operator"].rsplit(":", 1)
    release = f"op{uuid.uuid4().hex[:5]}"
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "operator": {"watchNamespaces": [ns]},
    }))
    # Another real-node test may have applied the CRD without Helm (RealNodeJob does): hand it to this release
    # the way a user adopts an existing CRD, or Helm refuses to install over it.
    crd = f"customresourcedefinition/{PLURAL}.{GROUP}"
    if rc.cluster.kubectl("get", crd, check=False).returncode == 0:
        rc.cluster.kubectl("label", crd, "app.kubernetes.io/managed-by=Helm", "--overwrite")
        rc.cluster.kubectl("annotate", crd, f"meta.helm.sh/release-name={release}",
                           f"meta.helm.sh/release-namespace={ns}", "--overwrite")
    try:
        helm(rc, ns, "install", release, str(CHART), "-f", str(values), "--wait", "--timeout", "4m")
    except BaseException:
        pods = rc.cluster.kubectl("get", "pods", "-n", ns, "-o", "wide", check=False).stdout
        logs = rc.cluster.kubectl("logs", "-n", ns, "-l", "app.kubernetes.io/name=rljob-operator",
                                  "--tail=40", "--previous", check=False)
        print(pods, logs.stdout, logs.stderr)
        raise
    core = rc.cluster.core()
    pods = core.list_namespaced_pod(ns, label_selector="app.kubernetes.io/name=rljob-operator").items
    assert len(pods) == 1
    pod = pods[0]
    assert pod.spec.node_name == rc.node
    container = pod.spec.containers[0]
    # The chart's hardening, as it ran.
    assert pod.spec.security_context.run_as_user == 65532
    assert container.security_context.read_only_root_filesystem is True
    assert container.security_context.capabilities.drop == ["ALL"]
    status = pod.status.container_statuses[0]
    assert status.ready and status.restart_count == 0
    logs = rc.logs(ns, pod.metadata.name)
    assert "getpwuid" not in logs

    # It reconciles: an RLJob in its namespace gets its children (pods on the fake GPU nodes).
    api = k8s.CustomObjectsApi(rc.cluster.api)
    api.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "RLJob", "metadata": {"name": "smoke"},
        "spec": {"model": {"huggingFace": "Qwen/Qwen3-0.6B", "storage": {"download": {}}}, "data": {"synthetic": {}},
                 "rollout": {"engine": "sglang"}},
    })

    def reconciled() -> bool:
        obj = api.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "smoke")
        return bool(obj.get("status", {}).get("phase"))

    wait_until(reconciled, 90, "the operator pod to reconcile RLJob smoke (status.phase set)", interval=1)
