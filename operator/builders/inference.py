"""SGLang inference pools: a StatefulSet, a headless Service and a PodDisruptionBudget per pool."""

from __future__ import annotations

import math
from typing import Any

from rljob.api.spec import ComputeResources, EnvVar, InferencePoolSpec, ModelSpec, ResourceQuantities, RLJobSpec, RolloutSpec
from rljob.operator.builders.engine_key import engine_key_args, engine_key_env
from rljob.operator.builders.meta import (
    LABEL_VENDOR,
    ROLE_INFERENCE,
    JobRef,
    child_name,
    labels,
    object_meta,
    selector_labels,
)
from rljob.operator.builders.pods import (
    SCRATCH_DIR,
    container_mounts,
    container_resources,
    hardened_container_security,
    init_containers,
    merge_env,
    pod_base,
    pod_volumes,
)
from rljob.operator.builders.storage import model_path_in_pods, model_storage, weights_storage
from rljob.operator.builders.vendor import (
    CPU_SERVER_COMMAND,
    PROFILES,
    RUNTIME_IMAGE,
    RUNTIME_UID,
    SGLANG_UID,
    tolerations,
    vendor_affinity,
)

SGLANG_PORT = 30000
DEFAULT_SERVER_COMMAND = ["python3", "-m", "sglang.launch_server"]

# The root filesystem is read-only and the upstream images' home is root's: every cache SGLang, Triton,
# PyTorch and FlashInfer write goes under the writable /tmp.
SCRATCH_ENV = (
    ("HOME", f"{SCRATCH_DIR}/home"),
    ("XDG_CACHE_HOME", f"{SCRATCH_DIR}/cache"),
    ("HF_HOME", f"{SCRATCH_DIR}/cache/huggingface"),
    ("TRITON_CACHE_DIR", f"{SCRATCH_DIR}/cache/triton"),
    ("TORCHINDUCTOR_CACHE_DIR", f"{SCRATCH_DIR}/cache/inductor"),
)

# SGLang's /health runs a 1-token generation unless this is false (sglang/srt/environ.py): that takes at
# least a second, waits while generation is paused or weights update, and answers 503 after 20 s without
# scheduler output, so a long prefill or a slow sync would fail it. The runtime owns membership (its own
# version probes); the kubelet only needs "the server is up", so the pools turn the generation off, as
# slime does, and /health becomes a cheap check that no sync or pause can fail. It is set after the
# pool's own env: the probes below depend on it (docs/sglang_standin.md).
HEALTH_ENV = (("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "false"),)

# Probes (docs/sglang_standin.md). Startup: /health_generate, a real 1-token generation, proves the model
# serves; its timeout exceeds SGLang's own 20 s health window so SGLang, not the kubelet, decides; the
# startup budget covers weight loading. Readiness (the runtime discovers Ready pods) and liveness: /health,
# which with HEALTH_ENV never generates, so a paused or syncing worker stays Ready and is never restarted.
# A hung scheduler is SGLang's own watchdog's job (it exits after --watchdog-timeout, 300 s); liveness
# restarts a server whose HTTP side stops answering for 5 minutes.
STARTUP_PERIOD_SECONDS = 10
STARTUP_TIMEOUT_SECONDS = 30
READINESS = {"periodSeconds": 10, "timeoutSeconds": 10, "failureThreshold": 3}
LIVENESS = {"periodSeconds": 30, "timeoutSeconds": 30, "failureThreshold": 10}


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


def worker_selector(job: JobRef) -> dict[str, str]:
    """Labels of every inference pod of the job, over all pools: how the router and the runtime find
    workers. It does not depend on any replica count, so scaling changes no config."""
    return selector_labels(job, ROLE_INFERENCE)


def model_args(model: ModelSpec) -> list[str]:
    """`--model-path` (and revision) for the SGLang server: a path the pod sees, or a hub id."""
    path = model_path_in_pods(model)
    args = ["--model-path", path]
    if model.revision and path == model.hugging_face:
        args += ["--revision", model.revision]
    return args


def _probe(path: str, **timing: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, **timing}


def pool_resources(pool: InferencePoolSpec) -> ComputeResources:
    """The pool's CPU and memory: its spec, else the default of its kind (GPU server or CPU server)."""
    if pool.resources is not None:
        return pool.resources
    # A GPU server stages weights through host memory while loading, and /dev/shm (memory-backed) counts
    # against the limit; the CPU server holds a small model. No CPU limit: throttling stalls decoding.
    if pool.vendor == "cpu":
        return ComputeResources(requests=ResourceQuantities(cpu="1", memory="2Gi"), limits=ResourceQuantities(memory="8Gi"))
    return ComputeResources(requests=ResourceQuantities(cpu="4", memory="32Gi"), limits=ResourceQuantities(memory="96Gi"))


def pool_container(job: JobRef, spec: RLJobSpec, pool: InferencePoolSpec) -> dict[str, Any]:
    """The SGLang server container of one pool (a `cpu` pool runs rljob's SGLang-protocol server).

    It requires the job's engine key (``--api-key``, read from the job's Secret) on every endpoint but
    SGLang's unauthenticated health, readiness and metrics ones, which the probes use."""
    scratch = [EnvVar(name=k, value=v) for k, v in SCRATCH_ENV]
    health = [EnvVar(name=k, value=v) for k, v in HEALTH_ENV]
    accelerators: dict[str, str] = {}
    if pool.vendor == "cpu":
        image, command, defaults = RUNTIME_IMAGE, CPU_SERVER_COMMAND, scratch
    else:
        profile = PROFILES[pool.vendor]
        accelerators = {pool.resource_name or profile.resource_name: str(pool.gpus_per_replica)}
        image, command, defaults = profile.sglang_image, DEFAULT_SERVER_COMMAND, scratch + profile.env_vars()
    startup_failures = math.ceil(spec.rollout.startup_budget_seconds / STARTUP_PERIOD_SECONDS)
    files = model_storage(spec).add(weights_storage(spec, writable=False))
    return {
        "name": "sglang",
        "image": pool.image or image,
        "command": list(pool.command or command),
        "args": [
            *model_args(spec.model),
            "--tp-size",
            str(pool.tensor_parallel_size),
            "--host",
            "0.0.0.0",
            "--port",
            str(SGLANG_PORT),
            "--enable-metrics",
            # A fresh server serves the base weights, the job's version 0. SGLang's own default
            # ("default") is no version the runtime could count as current, so a worker would never
            # join the router at the start of a run.
            "--weight-version",
            "0",
            *engine_key_args(),
            *pool.extra_args,
        ],
        "ports": [{"name": "http", "containerPort": SGLANG_PORT, "protocol": "TCP"}],
        "env": [*files.env, *merge_env(defaults, [*pool.env, *health]), engine_key_env(job)],
        "resources": container_resources(pool_resources(pool), accelerators),
        "securityContext": hardened_container_security(),
        "startupProbe": _probe(
            "/health_generate", periodSeconds=STARTUP_PERIOD_SECONDS, timeoutSeconds=STARTUP_TIMEOUT_SECONDS,
            failureThreshold=startup_failures,
        ),
        "readinessProbe": _probe("/health", **READINESS),
        "livenessProbe": _probe("/health", **LIVENESS),
        "volumeMounts": container_mounts(spec.pods, files.mounts, shm=True),
    }


def pool_statefulset(
    job: JobRef, spec: RLJobSpec, pool: InferencePoolSpec, replicas: int, active: bool
) -> dict[str, Any]:
    """StatefulSet of one pool's SGLang replicas (scaled to zero when the job is not active)."""
    name = pool_workload_name(job, pool)
    pod_labels = {**labels(job, ROLE_INFERENCE, pool.name), LABEL_VENDOR: pool.vendor}
    files = model_storage(spec).add(weights_storage(spec, writable=False))
    # The CPU server is the runtime image (uid 1000); GPU pools run SGLang as the sglang-* images' user.
    uid = RUNTIME_UID if pool.vendor == "cpu" else SGLANG_UID
    pod_spec: dict[str, Any] = {
        **pod_base(spec.pods, uid),
        # SGLang needs no Kubernetes API: no token for a compromised server to use.
        "automountServiceAccountToken": False,
        "containers": [pool_container(job, spec, pool)],
        "nodeSelector": dict(pool.node_selector),
        "volumes": pod_volumes(spec.pods, files.volumes, pool.shm_size),
    }
    if files.init_containers:
        pod_spec["initContainers"] = init_containers(spec.pods, files.init_containers)
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


def pool_disruption_budget(job: JobRef, pool: InferencePoolSpec) -> dict[str, Any]:
    """PodDisruptionBudget: a node drain takes at most `maxUnavailable` replicas of the pool at once."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": object_meta(job, pool_workload_name(job, pool), ROLE_INFERENCE, pool.name),
        "spec": {
            "maxUnavailable": pool.max_unavailable,
            "selector": {"matchLabels": selector_labels(job, ROLE_INFERENCE, pool.name)},
            # A replica that never became ready (still loading, crash-looping) may always be evicted.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
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
            # Workers must be resolvable before they are ready: the runtime reads readiness from the pod
            # (discovery.py) and then dials the worker by this name at once; a record published only at
            # readiness would race the EndpointSlice and DNS (a cached NXDOMAIN outlives the race). Who may
            # connect to a not-ready worker is the NetworkPolicies' business (network.py), not DNS's.
            "publishNotReadyAddresses": True,
            "selector": selector_labels(job, ROLE_INFERENCE, pool.name),
            "ports": [{"name": "http", "port": SGLANG_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }
