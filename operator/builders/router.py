"""The sglang router in front of all inference pools: a Deployment and a ClusterIP Service."""

from __future__ import annotations

from typing import Any

from rljob.api.spec import RLJobSpec
from rljob.operator.builders.inference import SGLANG_PORT, worker_selector
from rljob.operator.builders.meta import ROLE_ROUTER, JobRef, child_name, labels, object_meta, selector_labels
from rljob.operator.builders.pods import (
    container_resources,
    extra_mounts,
    extra_volumes,
    hardened_container_security,
    pod_security_context,
    scheduling_fields,
    scratch_mount,
    scratch_volume,
)
from rljob.operator.builders.vendor import ROUTER_IMAGE, ROUTER_UID


def router_name(job: JobRef) -> str:
    """Name of the router Deployment, Service, ServiceAccount, Role and RoleBinding."""
    return child_name(job, "router")


def router_url(job: JobRef) -> str:
    """In-cluster URL the trainer sends /generate to."""
    return f"http://{router_name(job)}.{job.namespace}.svc:{SGLANG_PORT}"


def router_args(job: JobRef, spec: RLJobSpec) -> list[str]:
    """sglang-router flags: workers come from Kubernetes service discovery (ready pods with the job's
    inference labels), never from a URL list, so scaling a pool leaves the router pod alone."""
    selector = [f"{k}={v}" for k, v in sorted(worker_selector(job).items())]
    return [
        "--host",
        "0.0.0.0",
        "--port",
        str(SGLANG_PORT),
        "--policy",
        spec.rollout.router.policy,
        "--worker-startup-timeout-secs",
        str(spec.rollout.startup_budget_seconds),
        "--service-discovery",
        "--selector",
        *selector,
        "--service-discovery-port",
        str(SGLANG_PORT),
        "--service-discovery-namespace",
        job.namespace,
    ]


def router_deployment(job: JobRef, spec: RLJobSpec, active: bool) -> dict[str, Any]:
    """Router Deployment (CPU only) running under its own ServiceAccount, which may watch pods."""
    router = spec.rollout.router
    container = {
        "name": "router",
        "image": router.image or ROUTER_IMAGE,
        "command": ["python3", "-m", "sglang_router.launch_router"],
        "args": router_args(job, spec),
        "ports": [{"name": "http", "containerPort": SGLANG_PORT, "protocol": "TCP"}],
        "resources": container_resources(router.resources),
        "securityContext": hardened_container_security(),
        "readinessProbe": {"httpGet": {"path": "/readiness", "port": "http"}, "periodSeconds": 10},
        "livenessProbe": {"httpGet": {"path": "/liveness", "port": "http"}, "periodSeconds": 30, "failureThreshold": 5},
        "volumeMounts": [scratch_mount(), *extra_mounts(spec.pods)],
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
                    "serviceAccountName": router_name(job),
                    "securityContext": pod_security_context(spec.pods, ROUTER_UID),
                    **scheduling_fields(spec.pods),
                    "containers": [container],
                    "volumes": [scratch_volume(), *extra_volumes(spec.pods)],
                },
            },
        },
    }


def router_service_account(job: JobRef) -> dict[str, Any]:
    """The router's identity for service discovery."""
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": object_meta(job, router_name(job), ROLE_ROUTER)}


def router_role(job: JobRef) -> dict[str, Any]:
    """Service discovery watches the pods of the job's namespace; nothing else."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": object_meta(job, router_name(job), ROLE_ROUTER),
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
    }


def router_role_binding(job: JobRef) -> dict[str, Any]:
    """Binds the router Role to the router ServiceAccount."""
    name = router_name(job)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": object_meta(job, name, ROLE_ROUTER),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": job.namespace}],
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
