"""SGLang inference pools: one StatefulSet and one headless Service per pool."""

from __future__ import annotations

import math
from typing import Any

from rljob.api.spec import InferencePoolSpec, ModelSpec, RLJobSpec, RolloutSpec
from rljob.operator.builders.meta import (
    LABEL_VENDOR,
    ROLE_INFERENCE,
    JobRef,
    child_name,
    labels,
    object_meta,
    selector_labels,
)
from rljob.operator.builders.vendor import (
    CPU_SERVER_COMMAND,
    PROFILES,
    RUNTIME_IMAGE,
    merge_env,
    tolerations,
    vendor_affinity,
)

SGLANG_PORT = 30000
DEFAULT_SERVER_COMMAND = ["python3", "-m", "sglang.launch_server"]

# Probe timings (operator_conventions.md §7, after OME): generous, so a saturated server that answers
# slowly is not restarted; the startup budget covers weight loading.
STARTUP_PERIOD_SECONDS = 10
READINESS = {"periodSeconds": 30, "timeoutSeconds": 30, "failureThreshold": 3}
LIVENESS = {"periodSeconds": 60, "timeoutSeconds": 60, "failureThreshold": 5}


def effective_pools(rollout: RolloutSpec) -> list[InferencePoolSpec]:
    """The pools to run: the spec's, or one default NVIDIA pool (so a laptop RLJob also runs on a cluster)."""
    return list(rollout.pools) or [InferencePoolSpec(name="default", vendor="nvidia")]


def pool_replicas(rollout: RolloutSpec) -> dict[str, int]:
    """Desired replicas per pool: each pool's own, or `rollout.replicas` spread by the pools' weights.

    The spread uses largest remainders, so the counts always add up to `rollout.replicas` exactly.
    """
    pools = effective_pools(rollout)
    if rollout.replicas is None:
        return {p.name: p.replicas for p in pools}
    weights = [p.replicas for p in pools]
    if sum(weights) == 0:
        weights = [1] * len(pools)
    total_weight = sum(weights)
    shares = [rollout.replicas * w / total_weight for w in weights]
    counts = [math.floor(s) for s in shares]
    by_remainder = sorted(range(len(pools)), key=lambda i: (-(shares[i] - counts[i]), i))
    for i in by_remainder[: rollout.replicas - sum(counts)]:
        counts[i] += 1
    return {p.name: c for p, c in zip(pools, counts, strict=True)}


def pool_workload_name(job: JobRef, pool: InferencePoolSpec) -> str:
    """Name of the pool's StatefulSet and of its headless Service."""
    return child_name(job, "infer", pool.name)


def worker_urls(job: JobRef, rollout: RolloutSpec) -> list[str]:
    """Stable per-pod URLs of every desired inference replica (StatefulSet DNS through the headless Service)."""
    counts = pool_replicas(rollout)
    urls = []
    for pool in effective_pools(rollout):
        name = pool_workload_name(job, pool)
        urls += [f"http://{name}-{i}.{name}.{job.namespace}.svc:{SGLANG_PORT}" for i in range(counts[pool.name])]
    return urls


def model_args(model: ModelSpec) -> list[str]:
    """`--model-path` (and revision) for the SGLang server."""
    source = model.hugging_face or model.path or model.builtin
    args = ["--model-path", str(source)]
    if model.revision:
        args += ["--revision", model.revision]
    return args


def _probe(path: str, **timing: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, **timing}


def pool_container(spec: RLJobSpec, pool: InferencePoolSpec) -> dict[str, Any]:
    """The SGLang server container of one pool (a `cpu` pool runs rljob's SGLang-protocol server)."""
    if pool.vendor == "cpu":
        image, command, resources = RUNTIME_IMAGE, CPU_SERVER_COMMAND, {}
        env = merge_env([], pool.env)
    else:
        profile = PROFILES[pool.vendor]
        gpus = {pool.resource_name or profile.resource_name: str(pool.gpus_per_replica)}
        image, command, resources = profile.sglang_image, DEFAULT_SERVER_COMMAND, {"limits": gpus, "requests": gpus}
        env = merge_env(profile.env_vars(), pool.env)
    startup_failures = math.ceil(spec.rollout.startup_budget_seconds / STARTUP_PERIOD_SECONDS)
    return {
        "name": "sglang",
        "image": pool.image or image,
        "command": list(pool.command or command),
        "args": [
            *model_args(spec.model),
            "--tp",
            str(pool.tensor_parallel_size),
            "--host",
            "0.0.0.0",
            "--port",
            str(SGLANG_PORT),
            "--enable-metrics",
            *pool.extra_args,
        ],
        "ports": [{"name": "http", "containerPort": SGLANG_PORT, "protocol": "TCP"}],
        "env": env,
        "resources": resources,
        "startupProbe": _probe(
            "/health_generate", periodSeconds=STARTUP_PERIOD_SECONDS, timeoutSeconds=10, failureThreshold=startup_failures
        ),
        "readinessProbe": _probe("/health_generate", **READINESS),
        "livenessProbe": _probe("/health", **LIVENESS),
        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}],
    }


def pool_statefulset(
    job: JobRef, spec: RLJobSpec, pool: InferencePoolSpec, replicas: int, active: bool
) -> dict[str, Any]:
    """StatefulSet of one pool's SGLang replicas (scaled to zero when the job is not active)."""
    name = pool_workload_name(job, pool)
    pod_labels = {**labels(job, ROLE_INFERENCE, pool.name), LABEL_VENDOR: pool.vendor}
    pod_spec: dict[str, Any] = {
        "containers": [pool_container(spec, pool)],
        "nodeSelector": dict(pool.node_selector),
        "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}}],
    }
    if pool.vendor == "cpu":
        if pool.tolerations:
            pod_spec["tolerations"] = [t.to_wire() for t in pool.tolerations]
    else:
        pod_spec["affinity"] = vendor_affinity(pool.vendor)
        pod_spec["tolerations"] = tolerations(pool.vendor, pool.tolerations)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": object_meta(job, name, ROLE_INFERENCE, pool.name),
        "spec": {
            "replicas": replicas if active else 0,
            "serviceName": name,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector_labels(job, ROLE_INFERENCE, pool.name)},
            "template": {"metadata": {"labels": pod_labels}, "spec": pod_spec},
        },
    }


def pool_service(job: JobRef, pool: InferencePoolSpec) -> dict[str, Any]:
    """Headless Service giving every replica a stable DNS name (the router and trainer address workers by it)."""
    name = pool_workload_name(job, pool)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(job, name, ROLE_INFERENCE, pool.name),
        "spec": {
            "clusterIP": "None",
            # Workers must be resolvable before they are ready: the router waits for them itself.
            "publishNotReadyAddresses": True,
            "selector": selector_labels(job, ROLE_INFERENCE, pool.name),
            "ports": [{"name": "http", "port": SGLANG_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }
