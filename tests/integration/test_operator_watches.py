"""The operator sees only its own objects, and its per-job state follows the live jobs.

Against the local control plane: unrelated workloads (and a look-alike without the managed-by
label) run next to RLJobs; the operator's watch cache holds exactly the RLJobs and their watched
children (StatefulSets, Deployments, the trainer Job, Pods, Services, PodDisruptionBudgets, ConfigMaps,
ServiceAccounts, PersistentVolumeClaims, Roles, RoleBindings, NetworkPolicies):
server-side label selectors keep the others from ever reaching it. Deleting the jobs empties the
cache and drops every per-job lock.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from kubernetes import client as k8s

from tests.helpers.operator_process import OperatorProcess
from tests.integration import test_operator as base
from tests.integration.test_operator import api, crd, kubelet, operator, volumes  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

MANAGED = "app.kubernetes.io/managed-by=rljob-operator,rljob.io/job-name"
JOBS = ("w1", "w2", "w3")


def metric(op: OperatorProcess, name: str) -> float | None:
    match = re.search(rf"^{name} (\S+)$", op.metrics(), re.MULTILINE)
    return float(match.group(1)) if match else None


def unrelated_statefulset(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": 2,
            "serviceName": name,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name, **labels}},
                "spec": {
                    "containers": [{"name": "c", "image": "busybox"}],
                    "tolerations": [{"operator": "Exists"}],
                },
            },
        },
    }


def managed_objects(kube_cluster: Any, namespace: str) -> int:
    core, apps = kube_cluster.core(), kube_cluster.apps()
    batch, policy = k8s.BatchV1Api(kube_cluster.api), k8s.PolicyV1Api(kube_cluster.api)
    rbac = k8s.RbacAuthorizationV1Api(kube_cluster.api)
    children = (
        len(apps.list_namespaced_stateful_set(namespace, label_selector=MANAGED).items)
        + len(apps.list_namespaced_deployment(namespace, label_selector=MANAGED).items)
        + len(batch.list_namespaced_job(namespace, label_selector=MANAGED).items)
        + len(policy.list_namespaced_pod_disruption_budget(namespace, label_selector=MANAGED).items)
        + len(core.list_namespaced_pod(namespace, label_selector=MANAGED).items)
        + len(core.list_namespaced_service(namespace, label_selector=MANAGED).items)
        + len(core.list_namespaced_config_map(namespace, label_selector=MANAGED).items)
        + len(core.list_namespaced_service_account(namespace, label_selector=MANAGED).items)
        + len(core.list_namespaced_persistent_volume_claim(namespace, label_selector=MANAGED).items)
        + len(rbac.list_namespaced_role(namespace, label_selector=MANAGED).items)
        + len(rbac.list_namespaced_role_binding(namespace, label_selector=MANAGED).items)
        + len(k8s.NetworkingV1Api(kube_cluster.api).list_namespaced_network_policy(namespace, label_selector=MANAGED).items)
    )
    jobs = k8s.CustomObjectsApi(kube_cluster.api).list_namespaced_custom_object(base.GROUP, base.VERSION, namespace, base.PLURAL)
    return children + len(jobs["items"])


def test_cache_holds_only_managed_objects_and_empties_when_jobs_go(
    kube_cluster: Any,
    namespace: str,
    api: k8s.CustomObjectsApi,  # noqa: F811
    operator: OperatorProcess,  # noqa: F811
    volumes: Any,  # noqa: F811
) -> None:
    apps = kube_cluster.apps()
    apps.create_namespaced_stateful_set(namespace, unrelated_statefulset("stranger", {"team": "x"}))
    # Looks like a child but is not managed by the operator: filtered out on the server side too.
    apps.create_namespaced_stateful_set(namespace, unrelated_statefulset("lookalike", {"rljob.io/job-name": "w1"}))
    for job in JOBS:
        volumes(job)
        api.create_namespaced_custom_object(base.GROUP, base.VERSION, namespace, base.PLURAL, base.rljob(job))
    for job in JOBS:
        base.wait_phase(api, namespace, job, "Running", timeout=120)
    base.wait_for(
        lambda: len(kube_cluster.core().list_namespaced_pod(namespace, label_selector="app in (stranger,lookalike)").items)
        == 4,
        "unrelated pods created",
    )

    def cache_matches() -> tuple[float | None, int] | None:
        pair = (metric(operator, "rljob_operator_cached_objects"), managed_objects(kube_cluster, namespace))
        return pair if pair[0] == pair[1] else None

    cached, managed = base.wait_for(cache_matches, "cache size equal to the managed objects", timeout=120)
    assert managed > len(JOBS) * 10, managed  # the jobs' children really are there (and cached)

    for job in JOBS:
        api.delete_namespaced_custom_object(base.GROUP, base.VERSION, namespace, base.PLURAL, job)
    # The garbage collector deletes the children; their DELETED events empty the cache.
    base.wait_for(lambda: metric(operator, "rljob_operator_cached_objects") == 0 or None, "cache emptied", timeout=120)
    assert metric(operator, "rljob_operator_job_locks") == 0
