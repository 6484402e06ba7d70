"""The sglang router in front of all inference pools: a Deployment and a ClusterIP Service."""

from __future__ import annotations

import math
from typing import Any

from rljob.api.spec import RLJobSpec
from rljob.operator.builders.engine_key import engine_key_args, engine_key_env
from rljob.operator.builders.inference import SGLANG_PORT
from rljob.operator.builders.meta import ROLE_ROUTER, JobRef, child_name, labels, object_meta, selector_labels
from rljob.operator.builders.pods import container_mounts, container_resources, hardened_container_security, pod_base, pod_volumes
from rljob.operator.builders.vendor import ROUTER_IMAGE, ROUTER_UID


def router_name(job: JobRef) -> str:
    """Name of the router Deployment and Service."""
    return child_name(job, "router")


def router_url(job: JobRef) -> str:
    """In-cluster URL the trainer sends /generate to."""
    return f"http://{router_name(job)}.{job.namespace}.svc:{SGLANG_PORT}"


# The router may give up on a /generate only after the runtime has: the runtime's read timeout
# (requestTimeoutSeconds) fires first, aborts the request on its worker and retries it under a new rid.
# A router that cut it first would answer 504 while the worker kept generating it.
ROUTER_TIMEOUT_MARGIN_S = 60


def router_args(spec: RLJobSpec) -> list[str]:
    """sglang-router flags: the router starts with no workers and has no discovery of its own.

    The trainer's runtime (rank 0) finds the pools' pods itself and adds a worker through the router's
    worker API only once that worker serves the current weight version (docs/weight_sync.md), so a new
    or restarted replica never serves its start-up weights through the router. Scaling a pool leaves
    these arguments, and so the router pod, as they are.

    The runtime owns membership, so the router's own judgement is switched off (as slime does): its
    health checks (every 60 s, 5 s timeout, 3 failures: SGLang's /health is a generation that blocks
    for a whole weight sync), its circuit breaker, and its retries (a retry resends the same rid, which
    current SGLang refuses as a duplicate; the runtime retries under a new rid instead). Its request
    timeout outlasts the runtime's. tests/unit/test_sglang_contract.py parses these with the released
    router's own argument parser.
    """
    timeout = math.ceil(spec.rollout.sglang.request_timeout_seconds) + ROUTER_TIMEOUT_MARGIN_S
    return [
        "--host",
        "0.0.0.0",
        "--port",
        str(SGLANG_PORT),
        "--policy",
        spec.rollout.router.policy,
        "--worker-startup-timeout-secs",
        str(spec.rollout.startup_budget_seconds),
        "--disable-health-check",
        "--disable-circuit-breaker",
        "--disable-retries",
        "--request-timeout-secs",
        str(timeout),
    ]


def router_deployment(job: JobRef, spec: RLJobSpec, active: bool) -> dict[str, Any]:
    """Router Deployment (CPU only). It needs no Kubernetes API access (no discovery), so it gets no
    ServiceAccount token; it is Ready as soon as it serves (``/liveness``): its ``/readiness`` stays 503
    while it holds no workers, which is how it starts, and the runtime can only fill it through the
    Service once it is Ready."""
    router = spec.rollout.router
    container = {
        "name": "router",
        "image": router.image or ROUTER_IMAGE,
        "command": ["python3", "-m", "sglang_router.launch_router"],
        # The router requires the job's key on every route but its probes and sends it to the workers.
        "args": [*router_args(spec), *engine_key_args()],
        "env": [engine_key_env(job)],
        "ports": [{"name": "http", "containerPort": SGLANG_PORT, "protocol": "TCP"}],
        "resources": container_resources(router.resources),
        "securityContext": hardened_container_security(),
        "readinessProbe": {"httpGet": {"path": "/liveness", "port": "http"}, "periodSeconds": 10},
        "livenessProbe": {"httpGet": {"path": "/liveness", "port": "http"}, "periodSeconds": 30, "failureThreshold": 5},
        "volumeMounts": container_mounts(spec.pods, [], shm=False),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(job, router_name(job), ROLE_ROUTER),
        "spec": {
            "replicas": 1 if active else 0,
            "selector": {"matchLabels": selector_labels(job, ROLE_ROUTER)},
            "template": {
                "metadata": {"labels": labels(job, ROLE_ROUTER)},
                "spec": {
                    "automountServiceAccountToken": False,
                    **pod_base(spec.pods, ROUTER_UID),
                    "containers": [container],
                    "volumes": pod_volumes(spec.pods, []),
                },
            },
        },
    }


def router_service(job: JobRef) -> dict[str, Any]:
    """ClusterIP Service of the router."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(job, router_name(job), ROLE_ROUTER),
        "spec": {
            "selector": selector_labels(job, ROLE_ROUTER),
            "ports": [{"name": "http", "port": SGLANG_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }
