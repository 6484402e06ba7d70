"""Pod hygiene shared by every child pod: security contexts, writable scratch, resources, env, scheduling.

Every container runs as a non-root user with a read-only root filesystem, no privilege escalation, no
capabilities and the runtime's default seccomp profile; what it must write goes to emptyDirs.
"""

from __future__ import annotations

from typing import Any

from rljob.api.spec import ComputeResources, EnvVar, PodPolicySpec

SCRATCH_VOLUME = "tmp"
SCRATCH_DIR = "/tmp"
SHM_VOLUME = "shm"


def pod_security_context(policy: PodPolicySpec, image_uid: int) -> dict[str, Any]:
    """Pod-level: non-root uid (spec.pods.securityContext's, else the image's own), fsGroup for volume
    ownership, seccomp RuntimeDefault."""
    ids = policy.security_context
    uid = ids.run_as_user if ids.run_as_user is not None else image_uid
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": ids.run_as_group if ids.run_as_group is not None else uid,
        "fsGroup": ids.fs_group,
        # Re-chowning a large model or checkpoint volume on every start would take minutes.
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def hardened_container_security() -> dict[str, Any]:
    """Container-level: read-only root filesystem, no privilege escalation, every capability dropped."""
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def scratch_volume() -> dict[str, Any]:
    """Writable /tmp (the root filesystem is read-only)."""
    return {"name": SCRATCH_VOLUME, "emptyDir": {}}


def scratch_mount() -> dict[str, Any]:
    """Mount of the writable /tmp."""
    return {"name": SCRATCH_VOLUME, "mountPath": SCRATCH_DIR}


def shm_volume(size_limit: str) -> dict[str, Any]:
    """Memory-backed /dev/shm with a size limit (it counts against the container's memory limit)."""
    return {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": size_limit}}


def shm_mount() -> dict[str, Any]:
    """Mount of /dev/shm."""
    return {"name": SHM_VOLUME, "mountPath": "/dev/shm"}


def container_resources(resources: ComputeResources, accelerators: dict[str, str] | None = None) -> dict[str, Any]:
    """requests/limits from the spec's CPU and memory plus whole accelerators (requests = limits)."""
    result: dict[str, dict[str, str]] = {}
    for kind in ("requests", "limits"):
        quantities = getattr(resources, kind).model_dump(exclude_none=True)
        quantities.update(accelerators or {})
        if quantities:
            result[kind] = quantities
    return result


def env_entry(var: EnvVar) -> dict[str, Any]:
    """A container env entry: a value or a valueFrom (secretKeyRef / configMapKeyRef)."""
    if var.value_from is None:
        return {"name": var.name, "value": var.value}
    return {"name": var.name, "valueFrom": var.value_from.to_wire()}


def merge_env(defaults: list[EnvVar], overrides: list[EnvVar]) -> list[dict[str, Any]]:
    """Environment as container env entries; an override replaces the default of the same name."""
    merged = {e.name: e for e in defaults}
    merged.update({e.name: e for e in overrides})
    return [env_entry(e) for e in merged.values()]


def extra_volumes(policy: PodPolicySpec) -> list[dict[str, Any]]:
    """The spec's own pod volumes, as written."""
    return [v.model_dump(by_alias=True, exclude_none=True) for v in policy.volumes]


def extra_mounts(policy: PodPolicySpec) -> list[dict[str, Any]]:
    """The spec's own volume mounts (of spec.pods.volumes) for a main container."""
    return [m.to_wire() for m in policy.volume_mounts]


def scheduling_fields(policy: PodPolicySpec) -> dict[str, Any]:
    """imagePullSecrets, priorityClassName and schedulerName of every child pod (only those set)."""
    fields: dict[str, Any] = {}
    if policy.image_pull_secrets:
        fields["imagePullSecrets"] = [{"name": n} for n in policy.image_pull_secrets]
    if policy.priority_class_name:
        fields["priorityClassName"] = policy.priority_class_name
    if policy.scheduler_name:
        fields["schedulerName"] = policy.scheduler_name
    return fields


def pod_base(policy: PodPolicySpec, run_as_user: int) -> dict[str, Any]:
    """The pod-level fields every child pod shares: its security context and scheduling fields."""
    return {"securityContext": pod_security_context(policy, run_as_user), **scheduling_fields(policy)}


def pod_volumes(policy: PodPolicySpec, own: list[dict[str, Any]], shm_size: str | None = None) -> list[dict[str, Any]]:
    """A pod's volumes: /dev/shm (when the role has one), /tmp, the role's ``own``, then the spec's extra ones."""
    shm = [shm_volume(shm_size)] if shm_size is not None else []
    return [*shm, scratch_volume(), *own, *extra_volumes(policy)]


def init_containers(policy: PodPolicySpec, containers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A pod's download steps with the spec's own mounts added: what a main container gets to reach a
    store (a CA bundle, proxy settings, a runtime mounted from the node) its download step needs too."""
    return [{**c, "volumeMounts": [*c.get("volumeMounts", []), *extra_mounts(policy)]} for c in containers]


def container_mounts(policy: PodPolicySpec, own: list[dict[str, Any]], shm: bool) -> list[dict[str, Any]]:
    """A main container's mounts, in the order of pod_volumes: /dev/shm (``shm``), /tmp, ``own``, the spec's."""
    return [*([shm_mount()] if shm else []), scratch_mount(), *own, *extra_mounts(policy)]


def pod_templates(children: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The pod specs of the workloads among `children` (StatefulSet, Deployment, Job)."""
    return [c["spec"]["template"]["spec"] for c in children if c["kind"] in ("StatefulSet", "Deployment", "Job")]


def fall_back_to_logs(children: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Set `terminationMessagePolicy: FallbackToLogsOnError` on every container and init container.

    A container that crashes without writing /dev/termination-log (a Python traceback, SGLang failing
    to load a model) then reports the tail of its log in its status, so `kubectl describe` and the
    operator's Events say why instead of "exit code 1". The runtime's own message still wins when written.
    """
    for pod in pod_templates(children):
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            container["terminationMessagePolicy"] = "FallbackToLogsOnError"
    return children
