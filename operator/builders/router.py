"""The sglang router in front of all inference pools: a Deployment and a ClusterIP Service."""

from __future__ import annotations

from typing import Any

from rljob.api.spec import RLJobSpec
from rljob.operator.builders.inference import SGLANG_PORT, worker_urls
from rljob.operator.builders.meta import ROLE_ROUTER, JobRef, child_name, labels, object_meta, selector_labels
from rljob.operator.builders.vendor import PROFILES

# The router only forwards HTTP; it runs on CPU. The CUDA SGLang image ships the sglang_router package.
ROUTER_RESOURCES = {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}}


def router_name(job: JobRef) -> str:
    """Name of the router Deployment and Service."""
    return child_name(job, "router")


def router_url(job: JobRef) -> str:
    """In-cluster URL the trainer sends /generate to."""
    return f"http://{router_name(job)}.{job.namespace}.svc:{SGLANG_PORT}"


def router_deployment(job: JobRef, spec: RLJobSpec, active: bool) -> dict[str, Any]:
    """Router Deployment; the worker list is the pools' stable per-pod URLs."""
    startup_budget = spec.rollout.startup_budget_seconds
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
                    "containers": [
                        {
                            "name": "router",
                            "image": spec.rollout.router.image or PROFILES["nvidia"].sglang_image,
                            "command": ["python3", "-m", "sglang_router.launch_router"],
                            "args": [
                                "--host",
                                "0.0.0.0",
                                "--port",
                                str(SGLANG_PORT),
                                "--policy",
                                spec.rollout.router.policy,
                                "--worker-startup-timeout-secs",
                                str(startup_budget),
                                "--worker-urls",
                                *worker_urls(job, spec.rollout),
                            ],
                            "ports": [{"name": "http", "containerPort": SGLANG_PORT, "protocol": "TCP"}],
                            "resources": ROUTER_RESOURCES,
                            "readinessProbe": {"httpGet": {"path": "/readiness", "port": "http"}, "periodSeconds": 10},
                            "livenessProbe": {
                                "httpGet": {"path": "/liveness", "port": "http"},
                                "periodSeconds": 30,
                                "failureThreshold": 5,
                            },
                        }
                    ]
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
