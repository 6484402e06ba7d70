"""Issue 14 against the real local control plane (kwok nodes): scaling a pool leaves the trainer and
the router alone while the runtime's discovery sees the new worker; the API server accepts the hardened
pods with their storage; every pool has a PodDisruptionBudget."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s

from rljob.api.spec import PodDiscoverySpec
from rljob.runtime.engines.discovery import PodWorkerDiscovery
from tests.helpers.operator_process import OperatorProcess
from tests.integration.test_operator import (  # noqa: F401  (fixtures are found by name)
    GROUP,
    PLURAL,
    VERSION,
    api,
    crd,
    get,
    kubelet,
    operator,
    pods,
    rljob,
    volumes,
    wait_for,
    wait_phase,
)

pytestmark = pytest.mark.cluster


def _uids(kube_cluster: Any, ns: str, selector: str) -> dict[str, str]:
    return {p.metadata.name: p.metadata.uid for p in pods(kube_cluster, ns, selector)}


def _discovered(namespace: str, job: str) -> list[str]:
    """What the trainer's runtime sees: its own discovery, through rljob.common.kube and KUBECONFIG."""
    spec = PodDiscoverySpec(namespace=namespace, selector={"rljob.io/job-name": job, "rljob.io/role": "inference"})
    return asyncio.run(PodWorkerDiscovery(spec)())


@pytest.mark.slow
def test_scaling_a_pool_from_2_to_3_touches_neither_trainer_nor_router(
    kube_cluster: Any, namespace: str, api: k8s.CustomObjectsApi, operator: OperatorProcess, volumes: Any
) -> None:
    volumes("grow")
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, rljob("grow"))
    wait_phase(api, namespace, "grow", "Running")
    trainer_before = _uids(kube_cluster, namespace, "rljob.io/job-name=grow,rljob.io/role=trainer")
    router_before = _uids(kube_cluster, namespace, "rljob.io/job-name=grow,rljob.io/role=router")
    assert len(trainer_before) == 1 and len(router_before) == 1
    apps = kube_cluster.apps()
    trainer_generation = k8s.BatchV1Api(kube_cluster.api).read_namespaced_job("grow-trainer", namespace).metadata.generation
    router_generation = apps.read_namespaced_deployment("grow-router", namespace).metadata.generation
    config_version = kube_cluster.core().read_namespaced_config_map("grow-config", namespace).metadata.resource_version
    workers = wait_for(lambda: len(_discovered(namespace, "grow")) == 3 and _discovered(namespace, "grow"), "3 workers")
    assert "http://grow-infer-nv-1.grow-infer-nv.%s.svc:30000" % namespace in workers

    # nv: 2 -> 3 replicas (a JSON patch, so the other pool's entry stays as it is).
    kube_cluster.kubectl(
        "patch", "rlj", "grow", "-n", namespace, "--type=json",
        "-p", json.dumps([{"op": "replace", "path": "/spec/rollout/pools/0/replicas", "value": 3}]),
    )
    wait_for(lambda: get(api, namespace, "grow")["status"]["rollout"]["summary"] == "4/4", "4/4 replicas ready", 120)
    new_worker = f"http://grow-infer-nv-2.grow-infer-nv.{namespace}.svc:30000"
    workers = wait_for(lambda: new_worker in _discovered(namespace, "grow") and _discovered(namespace, "grow"),
                       "the runtime's discovery to see the third nv replica", 120)
    assert len(workers) == 4
    wait_phase(api, namespace, "grow", "Running")

    assert _uids(kube_cluster, namespace, "rljob.io/job-name=grow,rljob.io/role=trainer") == trainer_before
    assert _uids(kube_cluster, namespace, "rljob.io/job-name=grow,rljob.io/role=router") == router_before
    assert k8s.BatchV1Api(kube_cluster.api).read_namespaced_job("grow-trainer", namespace).metadata.generation == trainer_generation
    assert apps.read_namespaced_deployment("grow-router", namespace).metadata.generation == router_generation
    config = kube_cluster.core().read_namespaced_config_map("grow-config", namespace)
    assert config.metadata.resource_version == config_version, "the runtime config did not change"


def test_hardened_pods_with_storage_are_accepted_and_every_pool_has_a_budget(
    kube_cluster: Any, namespace: str, api: k8s.CustomObjectsApi, operator: OperatorProcess, volumes: Any,
    request: pytest.FixtureRequest,
) -> None:
    volumes("store")
    scheduling = k8s.SchedulingV1Api(kube_cluster.api)
    priority = f"{namespace}-rl"
    scheduling.create_priority_class({"metadata": {"name": priority}, "value": 1000})
    request.addfinalizer(lambda: scheduling.delete_priority_class(priority))
    doc = rljob("store")
    doc["spec"].update(
        model={"huggingFace": "Qwen/Qwen3-0.6B", "storage": {"huggingFaceCache": "pvc://hf-cache",
                                                           "download": {"tokenSecretRef": {"name": "hf", "key": "token"}}}},
        data={"jsonl": "pvc://datasets/train.jsonl"},
        evaluation={"everySteps": 5, "jsonl": "pvc://datasets/test.jsonl"},
        pods={"priorityClassName": priority, "imagePullSecrets": ["regcred"]},
    )
    doc["spec"]["rollout"]["weightsVolume"] = {"claim": "pvc://weights"}
    doc["spec"]["trainer"]["env"] = [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}]
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, doc)
    # The claims do not exist, so the pods stay Pending: what matters is that the API server admitted them.
    expected = {"store-infer-nv-0", "store-infer-nv-1", "store-infer-mi-0", "store-router", "store-trainer-0"}

    def created() -> dict[str, Any] | None:
        # Deployment pods end in -<hash>-<id>, Indexed Job pods in -<index>-<id>.
        def stem(name: str) -> str:
            if name.startswith("store-router-"):
                return name.rsplit("-", 2)[0]
            return name.rsplit("-", 1)[0] if name.startswith("store-trainer-") else name

        found = {stem(p.metadata.name): p for p in pods(kube_cluster, namespace, "rljob.io/job-name=store")}
        return found if set(found) == expected else None

    found = wait_for(created, "every child pod created", 120)
    for name, pod in found.items():
        ctx = pod.spec.security_context
        assert ctx.run_as_non_root and ctx.fs_group == 1000 and ctx.seccomp_profile.type == "RuntimeDefault", name
        assert pod.spec.priority_class_name == priority and pod.spec.priority == 1000, name
        assert [s.name for s in pod.spec.image_pull_secrets] == ["regcred"], name
        assert all(c.security_context.read_only_root_filesystem for c in pod.spec.containers), name
    infer = found["store-infer-nv-0"]
    assert [c.name for c in infer.spec.init_containers] == ["model-download"]
    assert {v.name for v in infer.spec.volumes} >= {"hf-cache", "weights", "shm", "tmp"}
    trainer = found["store-trainer-0"]
    assert {v.name for v in trainer.spec.volumes} >= {"hf-cache", "weights", "data-datasets", "checkpoints"}
    assert next(e for e in trainer.spec.containers[0].env if e.name == "HF_TOKEN").value_from.secret_key_ref.key == "token"

    policy = k8s.PolicyV1Api(kube_cluster.api)
    budgets = {b.metadata.name: b for b in policy.list_namespaced_pod_disruption_budget(namespace).items}
    assert set(budgets) == {"store-infer-nv", "store-infer-mi"}
    assert budgets["store-infer-nv"].spec.max_unavailable == 1
    assert budgets["store-infer-nv"].spec.selector.match_labels["rljob.io/pool"] == "nv"


def test_a_hub_dataset_and_overridden_pod_ids_reach_the_admitted_pods(
    kube_cluster: Any, namespace: str, api: k8s.CustomObjectsApi, operator: OperatorProcess, volumes: Any,
) -> None:
    volumes("hub")
    doc = rljob("hub")
    cache = "pvc://hf-cache/hub"
    doc["spec"].update(
        model={"huggingFace": "Qwen/Qwen3-0.6B", "storage": {"huggingFaceCache": cache}},
        data={"huggingFace": "openai/gsm8k", "revision": "main", "parquet": "main/train-00000-of-00001.parquet",
              "storage": {"huggingFaceCache": cache, "download": {"tokenSecretRef": {"name": "hf", "key": "token"}}}},
        pods={"securityContext": {"runAsUser": 1000680000, "runAsGroup": 1000680000, "fsGroup": 1000680000}},
    )
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, doc)

    def created() -> dict[str, Any] | None:
        found = {p.metadata.labels["rljob.io/role"]: p for p in pods(kube_cluster, namespace, "rljob.io/job-name=hub")}
        return found if {"trainer", "inference", "router"} <= set(found) else None

    found = wait_for(created, "trainer, inference and router pods created", 120)
    for role, pod in found.items():
        ctx = pod.spec.security_context
        assert (ctx.run_as_user, ctx.run_as_group, ctx.fs_group) == (1000680000, 1000680000, 1000680000), role
        assert ctx.run_as_non_root, role
    trainer = found["trainer"]
    (init,) = trainer.spec.init_containers
    assert init.name == "data-download"
    assert init.args[:5] == ["download", "openai/gsm8k", "main/train-00000-of-00001.parquet", "--repo-type", "dataset"]
    token = next(e for e in init.env if e.name == "HF_TOKEN")
    assert (token.value_from.secret_key_ref.name, token.value_from.secret_key_ref.key) == ("hf", "token")
    cache_volumes = [v for v in trainer.spec.volumes if v.name == "hf-cache"]
    assert len(cache_volumes) == 1 and not cache_volumes[0].persistent_volume_claim.read_only  # false: dropped as the default
    assert all(m.read_only for m in trainer.spec.containers[0].volume_mounts if m.name == "hf-cache")
    assert not found["inference"].spec.init_containers, "the engines download no dataset"
    config = yaml.safe_load(kube_cluster.core().read_namespaced_config_map("hub-config", namespace).data["job.yaml"])
    data = config["spec"]["data"]
    assert data["huggingFace"] == "openai/gsm8k" and "storage" not in data  # resolved in HF_HUB_CACHE, offline
