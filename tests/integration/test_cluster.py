"""Acceptance tests of the local control plane: real apiserver, scheduler, controllers and kwok."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from kubernetes import client as k8s

from tests.cluster.kube import KubeCluster, start_cluster, wait_until

pytestmark = pytest.mark.cluster

PAUSE_IMAGE = "registry.k8s.io/pause:3.10"  # never pulled: kwok fakes the containers


def _gpu_pod_spec(resource: str, count: int, accelerator: str | None) -> k8s.V1PodSpec:
    return k8s.V1PodSpec(
        containers=[
            k8s.V1Container(
                name="main",
                image=PAUSE_IMAGE,
                resources=k8s.V1ResourceRequirements(limits={resource: str(count)}),
            )
        ],
        node_selector={"rljob.io/accelerator": accelerator} if accelerator else None,
    )


def _pod_ready(pod: k8s.V1Pod) -> bool:
    conditions = pod.status.conditions or []
    return pod.status.phase == "Running" and any(
        c.type == "Ready" and c.status == "True" for c in conditions
    )


def _ready_pod(core: k8s.CoreV1Api, namespace: str, name: str) -> k8s.V1Pod | None:
    pod = core.read_namespaced_pod(name, namespace)
    return pod if _pod_ready(pod) else None


def test_server_reports_stamped_kubernetes_version(kube_cluster: KubeCluster) -> None:
    with kube_cluster.http() as http:
        version = http.get("/version").json()
    assert version["gitVersion"].startswith("v1.36."), version
    assert (version["major"], version["minor"]) == ("1", "36")
    assert kube_cluster.version == version["gitVersion"]


def test_nodes_are_listed_with_gpu_capacity(kube_cluster: KubeCluster) -> None:
    nodes = {n.metadata.name: n for n in kube_cluster.core().list_node().items}
    nvidia = [n for name, n in nodes.items() if name.startswith("nv-")]
    amd = [n for name, n in nodes.items() if name.startswith("amd-")]
    cpu = [n for name, n in nodes.items() if name.startswith("cpu-")]
    assert (len(nvidia), len(amd), len(cpu)) == (2, 2, 1)
    for node in nvidia:
        assert node.status.capacity["nvidia.com/gpu"] == "8"
        assert node.status.allocatable["nvidia.com/gpu"] == "8"
        assert node.metadata.labels["nvidia.com/gpu.present"] == "true"
        assert node.metadata.labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
        assert node.metadata.labels["rljob.io/accelerator"] == "nvidia"
    for node in amd:
        assert node.status.capacity["amd.com/gpu"] == "8"
        assert (
            node.metadata.labels["amd.com/gpu.product-name"]
            == "AMD_Instinct_MI300X_OAM"
        )
        assert node.metadata.labels["rljob.io/accelerator"] == "amd"
    for node in cpu:
        assert not any(key.endswith("/gpu") for key in node.status.capacity)
    for node in nodes.values():
        ready = next(c for c in node.status.conditions if c.type == "Ready")
        assert ready.status == "True", node.metadata.name

    # The same through upstream kubectl, as a developer would look at it.
    out = kube_cluster.kubectl(
        "get",
        "nodes",
        "-o",
        "custom-columns=NAME:.metadata.name,NVIDIA:.status.capacity.nvidia\\.com/gpu,"
        "AMD:.status.capacity.amd\\.com/gpu",
    ).stdout
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[1:]}
    assert rows["nv-0"] == ["8", "<none>"]
    assert rows["amd-1"] == ["<none>", "8"]


@pytest.mark.parametrize(
    ("accelerator", "resource"), [("nvidia", "nvidia.com/gpu"), ("amd", "amd.com/gpu")]
)
def test_deployment_pods_schedule_onto_matching_gpu_nodes_and_become_ready(
    kube_cluster: KubeCluster, namespace: str, accelerator: str, resource: str
) -> None:
    labels = {"app": f"rollout-{accelerator}"}
    deployment = k8s.V1Deployment(
        metadata=k8s.V1ObjectMeta(name=f"rollout-{accelerator}"),
        spec=k8s.V1DeploymentSpec(
            replicas=3,
            selector=k8s.V1LabelSelector(match_labels=labels),
            template=k8s.V1PodTemplateSpec(
                metadata=k8s.V1ObjectMeta(labels=labels),
                # 3 pods x 4 GPUs cannot fit on one 8-GPU node: the scheduler must spread them.
                spec=_gpu_pod_spec(resource, 4, accelerator),
            ),
        ),
    )
    kube_cluster.apps().create_namespaced_deployment(namespace, deployment)
    core = kube_cluster.core()

    def ready_pods() -> list[k8s.V1Pod] | None:
        pods = core.list_namespaced_pod(
            namespace, label_selector=f"app=rollout-{accelerator}"
        ).items
        return pods if len(pods) == 3 and all(_pod_ready(p) for p in pods) else None

    pods = wait_until(ready_pods, 60, f"3 Running+Ready {accelerator} pods")
    node_names = [p.spec.node_name for p in pods]
    prefix = "nv-" if accelerator == "nvidia" else "amd-"
    assert all(name.startswith(prefix) for name in node_names), node_names
    assert len(set(node_names)) == 2, (
        f"4-GPU pods must spread over both 8-GPU nodes: {node_names}"
    )
    assert all(p.status.pod_ip for p in pods), "kwok assigns fake pod IPs"
    # The Deployment's status follows its pods' readiness one controller pass later: wait for it, do not
    # read it right after the pods (run 19, loaded: read as None with all three pods Ready).
    wait_until(
        lambda: kube_cluster.apps().read_namespaced_deployment_status(f"rollout-{accelerator}", namespace)
        .status.ready_replicas == 3,
        60, f"the {accelerator} Deployment's status to count 3 ready replicas",
    )


def test_pod_requesting_more_gpus_than_any_node_stays_pending(
    kube_cluster: KubeCluster, namespace: str
) -> None:
    core = kube_cluster.core()
    pod = k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(name="too-big"),
        spec=_gpu_pod_spec("nvidia.com/gpu", 16, None),
    )
    core.create_namespaced_pod(namespace, pod)

    def failed_scheduling() -> list[k8s.CoreV1Event] | None:
        events = core.list_namespaced_event(
            namespace,
            field_selector="involvedObject.name=too-big,reason=FailedScheduling",
        ).items
        return events or None

    events = wait_until(
        failed_scheduling, 120, "a FailedScheduling event for pod too-big"
    )
    assert "Insufficient nvidia.com/gpu" in events[0].message, events[0].message
    current = core.read_namespaced_pod("too-big", namespace)
    assert current.status.phase == "Pending"
    assert current.spec.node_name is None


def test_deleting_owner_garbage_collects_children(
    kube_cluster: KubeCluster, namespace: str
) -> None:
    core = kube_cluster.core()
    owner = core.create_namespaced_config_map(
        namespace,
        k8s.V1ConfigMap(
            metadata=k8s.V1ObjectMeta(name="owner"), data={"role": "owner"}
        ),
    )
    ref = k8s.V1OwnerReference(
        api_version="v1", kind="ConfigMap", name="owner", uid=owner.metadata.uid
    )
    core.create_namespaced_config_map(
        namespace,
        k8s.V1ConfigMap(
            metadata=k8s.V1ObjectMeta(name="child", owner_references=[ref])
        ),
    )
    core.create_namespaced_pod(
        namespace,
        k8s.V1Pod(
            metadata=k8s.V1ObjectMeta(name="child-pod", owner_references=[ref]),
            spec=_gpu_pod_spec("nvidia.com/gpu", 1, "nvidia"),
        ),
    )
    wait_until(lambda: _ready_pod(core, namespace, "child-pod"), 120, "child pod Ready")

    core.delete_namespaced_config_map(
        "owner", namespace, propagation_policy="Background"
    )

    def children_gone() -> bool:
        names = {
            c.metadata.name for c in core.list_namespaced_config_map(namespace).items
        }
        pods = core.list_namespaced_pod(namespace).items
        return "child" not in names and not pods

    wait_until(
        children_gone, 60, "the garbage collector to delete the owner's children"
    )


def test_service_account_without_rolebinding_is_forbidden(
    kube_cluster: KubeCluster, namespace: str
) -> None:
    core = kube_cluster.core()
    core.create_namespaced_service_account(
        namespace, k8s.V1ServiceAccount(metadata=k8s.V1ObjectMeta(name="reader"))
    )
    token = core.create_namespaced_service_account_token(
        "reader",
        namespace,
        k8s.AuthenticationV1TokenRequest(spec=k8s.V1TokenRequestSpec(audiences=[])),
    ).status.token
    path = f"/api/v1/namespaces/{namespace}/pods"

    with kube_cluster.http(token=token) as http:
        denied = http.get(path)
        assert denied.status_code == 403, denied.text
        assert f"system:serviceaccount:{namespace}:reader" in denied.json()["message"]

        rbac = k8s.RbacAuthorizationV1Api(kube_cluster.api)
        rbac.create_namespaced_role(
            namespace,
            k8s.V1Role(
                metadata=k8s.V1ObjectMeta(name="pod-reader"),
                rules=[
                    k8s.V1PolicyRule(
                        api_groups=[""], resources=["pods"], verbs=["list"]
                    )
                ],
            ),
        )
        rbac.create_namespaced_role_binding(
            namespace,
            k8s.V1RoleBinding(
                metadata=k8s.V1ObjectMeta(name="pod-reader"),
                role_ref=k8s.V1RoleRef(
                    api_group="rbac.authorization.k8s.io",
                    kind="Role",
                    name="pod-reader",
                ),
                subjects=[
                    k8s.RbacV1Subject(
                        kind="ServiceAccount", name="reader", namespace=namespace
                    )
                ],
            ),
        )
        # The same token is allowed once bound: the 403 above came from RBAC, not from a bad token.
        wait_until(
            lambda: http.get(path).status_code == 200, 120, "RoleBinding to take effect"
        )


def test_helm_installs_chart_into_cluster(
    kube_cluster: KubeCluster,
    namespace: str,
    tmp_path: Path,
    cached_binary: Callable[[str], Path],
) -> None:
    helm = str(cached_binary("helm"))
    version = subprocess.run(
        [helm, "version", "--short"], check=True, capture_output=True, text=True
    ).stdout
    assert version.startswith("v3.22."), version

    chart = tmp_path / "probe"
    (chart / "templates").mkdir(parents=True)
    # kubeVersion makes helm check the server's stamped version, as a real chart would.
    (chart / "Chart.yaml").write_text(
        'apiVersion: v2\nname: probe\nversion: 0.1.0\nkubeVersion: ">=1.36.0-0"\n'
    )
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-cm\ndata:\n  k: {{ .Values.k | quote }}\n"
    )
    subprocess.run(
        [
            helm,
            "install",
            "probe",
            str(chart),
            "--namespace",
            namespace,
            "--set",
            "k=v",
            "--wait",
            "--timeout",
            "60s",
        ],
        check=True,
        capture_output=True,
        text=True,
        env={
            "KUBECONFIG": str(kube_cluster.kubeconfig),
            "HOME": str(tmp_path),
            "PATH": "/usr/bin:/bin",
        },
    )
    cm = kube_cluster.core().read_namespaced_config_map("probe-cm", namespace)
    assert cm.data == {"k": "v"}


def test_node_flags_shape_a_second_cluster_with_tainted_gpu_nodes(
    tmp_path: Path,
) -> None:
    cluster = start_cluster(
        tmp_path / "tainted",
        (
            "--nvidia-nodes=1",
            "--amd-nodes=0",
            "--cpu-nodes=1",
            "--gpus-per-node=4",
            "--taint-gpu-nodes",
        ),
    )
    try:
        ns = cluster.create_namespace("tainted")
        core = cluster.core()
        assert sorted(n.metadata.name for n in core.list_node().items) == [
            "cpu-0",
            "nv-0",
        ]
        assert core.read_node("nv-0").status.capacity["nvidia.com/gpu"] == "4"

        plain = k8s.V1Pod(
            metadata=k8s.V1ObjectMeta(name="plain"),
            spec=k8s.V1PodSpec(
                containers=[k8s.V1Container(name="main", image=PAUSE_IMAGE)]
            ),
        )
        gpu_spec = _gpu_pod_spec("nvidia.com/gpu", 4, "nvidia")
        gpu_spec.tolerations = [
            k8s.V1Toleration(
                key="nvidia.com/gpu", operator="Exists", effect="NoSchedule"
            )
        ]
        core.create_namespaced_pod(ns, plain)
        core.create_namespaced_pod(
            ns, k8s.V1Pod(metadata=k8s.V1ObjectMeta(name="gpu"), spec=gpu_spec)
        )
        for name, node in (("plain", "cpu-0"), ("gpu", "nv-0")):
            pod = wait_until(
                lambda name=name: _ready_pod(core, ns, name), 30, f"pod {name} Ready"
            )
            assert pod.spec.node_name == node
    finally:
        cluster.stop()
