"""A trainer pod stuck Terminating on an unreachable node, on the real local control plane (no mock).

The local API server has no kubelet for a Node object the test creates (no kwok annotation: kwok leaves
it alone), so a pod bound to that node and then deleted stays Terminating, exactly as on a node that
lost power: nothing confirms that its containers stopped. The test binds the job's trainer pod to such a
node (the pods/binding subresource, as the scheduler does), then changes the trainer config so the
operator replaces the gang: the old Job's Foreground deletion waits for that pod, and the job waits in
`Recreating`. Then:
- the operator reports it: the NodeUnreachable condition and a PodStuckTerminating Event name the pod
  and the node, and the pod is not force-deleted (the node is not declared out of service);
- the test taints the node `node.kubernetes.io/out-of-service` (what an administrator does once the node
  is known to be down): the pod goes, the new gang starts and the job is Running again.
Kubernetes' own pod garbage collector (non-graceful node shutdown, 1.28+) also force-deletes terminating
pods on out-of-service nodes, so the test does not say which of the two removed the pod; the operator's
decision to delete only then is covered by tests/unit/operator/test_node_loss.py.
RLJOB_STUCK_TERMINATING_SECONDS=2 (default 60) keeps the test short; the rule does not depend on it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from tests.helpers.operator_process import OperatorProcess
from tests.helpers.trainer_pods import SimulatedTrainerKubelet
from tests.integration import test_operator as base
from tests.integration.test_operator import api, crd, kubelet, volumes  # noqa: F401 (fixtures)

pytestmark = pytest.mark.cluster

OUT_OF_SERVICE = "node.kubernetes.io/out-of-service"


@pytest.fixture
def lost_node(kube_cluster: Any, namespace: str) -> Iterator[str]:
    """A Node object no kubelet (and no kwok) serves: it never reports Ready."""
    name = f"lost-{namespace}"[:63]
    core = kube_cluster.core()
    core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {"rljob.test/lost": "true"}}})
    yield name
    try:
        core.delete_node(name)
    except ApiException as exc:
        if exc.status != 404:
            raise


@pytest.fixture
def operator(namespace: str, crd: None, tmp_path: Path, kubelet: SimulatedTrainerKubelet) -> Iterator[OperatorProcess]:
    op = base.namespaced_operator(
        namespace, tmp_path / "operator.log", env=dict(os.environ, RLJOB_STUCK_TERMINATING_SECONDS="2")
    )
    op.start()
    yield op
    op.stop()
    print(f"--- operator log ({op.log_path}) ---\n{op.log_tail(120)}")


def test_a_pod_stuck_on_an_unreachable_node_is_reported_then_released_by_the_out_of_service_taint(
    kube_cluster: Any, namespace: str, api: k8s.CustomObjectsApi, operator: OperatorProcess, volumes: Any,
    kubelet: SimulatedTrainerKubelet, lost_node: str,
) -> None:
    core = kube_cluster.core()
    volumes("stranded")
    api.create_namespaced_custom_object(base.GROUP, base.VERSION, namespace, base.PLURAL, base.rljob("stranded"))
    base.wait_phase(api, namespace, "stranded", "Running")
    old_uid = base.trainer_job_uid(kube_cluster, namespace, "stranded")
    (pod,) = kubelet.pods("stranded")
    pod_name = pod.metadata.name
    binding = k8s.V1Binding(
        metadata=k8s.V1ObjectMeta(name=pod_name), target=k8s.V1ObjectReference(api_version="v1", kind="Node", name=lost_node)
    )
    # The client cannot parse the Status this endpoint returns (a known quirk): the binding is read back.
    core.create_namespaced_pod_binding(pod_name, namespace, binding, _preload_content=False)
    assert core.read_namespaced_pod(pod_name, namespace).spec.node_name == lost_node

    # A config change replaces the whole gang: the old Job waits (Foreground) for the pod on the lost node.
    api.patch_namespaced_custom_object(base.GROUP, base.VERSION, namespace, base.PLURAL, "stranded",
                                       {"spec": {"trainer": {"steps": 7}}})

    def reported() -> dict[str, Any] | None:
        job = base.get(api, namespace, "stranded")
        cond = base.condition(job, "NodeUnreachable")
        return job if cond and cond["status"] == "True" else None

    job = base.wait_for(reported, "NodeUnreachable=True", timeout=180)
    message = base.condition(job, "NodeUnreachable")["message"]
    assert f"pod {pod_name} on node {lost_node}" in message and f"once the node carries the {OUT_OF_SERVICE}" in message
    assert base.condition(job, "ChildrenApplied")["reason"] == "Recreating", base.condition(job, "ChildrenApplied")
    base.wait_events(kube_cluster, namespace, "stranded", "PodStuckTerminating")
    stuck = kube_cluster.core().list_namespaced_event(
        namespace, field_selector="involvedObject.name=stranded,reason=PodStuckTerminating").items
    assert any(pod_name in e.message and lost_node in e.message for e in stuck), [e.message for e in stuck]
    # The operator decided (the condition says so) and did not force-delete: the pod is still there, deleting.
    still = core.read_namespaced_pod(pod_name, namespace)
    assert still.metadata.deletion_timestamp is not None and still.metadata.uid == pod.metadata.uid
    assert "PodForceDeleted" not in base.events(kube_cluster, namespace, "stranded")

    # Declared out of service: the pod may go, the new gang starts, the condition clears.
    core.patch_node(lost_node, {"spec": {"taints": [{"key": OUT_OF_SERVICE, "value": "nodeshutdown", "effect": "NoExecute"}]}})

    def pod_gone() -> bool:
        try:
            core.read_namespaced_pod(pod_name, namespace)
        except ApiException as exc:
            return exc.status == 404
        return False

    base.wait_for(pod_gone, f"pod {pod_name} removed from the out-of-service node", timeout=180)
    base.new_gang(kube_cluster, kubelet, namespace, "stranded", old_uid, 1)
    job = base.wait_phase(api, namespace, "stranded", "Running")

    def cleared() -> dict[str, Any] | None:
        job = base.get(api, namespace, "stranded")
        cond = base.condition(job, "NodeUnreachable")
        return job if cond and cond["status"] == "False" else None

    job = base.wait_for(cleared, "NodeUnreachable=False", timeout=120)
    assert job["status"]["observedGeneration"] == 2 and base.condition(job, "ChildrenApplied")["status"] == "True"
    assert job["status"]["restarts"]["trainer"] == 0, "a replaced gang is no failure"
