"""The trainer group: runtime config, RBAC, checkpoint volume, an Indexed Job (a gang) and its rendezvous Service.

The group runs to completion: one Indexed Job with `parallelism = completions = replicas`, every pod
running `torchrun` with its completion index as node rank and index 0's stable hostname as the
rendezvous. The Job never retries a rank by itself (`backoffLimit: 0`): the operator restarts the whole
group by deleting and recreating the Job (lifecycle.py decides, reconcile acts). The pod template is
immutable, so any change to it (config, image, replicas) also recreates the Job as a whole instead of
rolling pods one at a time.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import yaml

from rljob.api.spec import API_GROUP, API_VERSION, KIND, EnvVar, RLJobSpec
from rljob.operator.builders.engine_key import engine_key_env
from rljob.operator.builders.inference import SGLANG_PORT, worker_selector
from rljob.operator.builders.meta import (
    ANNOTATION_CONFIG_HASH,
    ROLE_TRAINER,
    JobRef,
    child_name,
    labels,
    object_meta,
    selector_labels,
)
from rljob.operator.builders.pods import (
    container_mounts,
    hardened_container_security,
    init_containers,
    merge_env,
    pod_base,
    pod_volumes,
)
from rljob.operator.builders.router import router_url
from rljob.operator.builders.storage import (
    PodStorage,
    data_storage,
    model_storage,
    runtime_paths,
    s3_credentials_env,
    weights_storage,
)
from rljob.operator.builders.vendor import PROFILES, RUNTIME_UID, TRAINER_IMAGES, tolerations, vendor_affinity

CONFIG_DIR = "/etc/rljob"
CONFIG_KEY = "job.yaml"
CHECKPOINT_DIR = "/var/lib/rljob/checkpoints"
METRICS_PORT = 9400
RENDEZVOUS_PORT = 29500
PVC_URI_PREFIX = "pvc://"
# The runtime image's home (HOME, working directory, runs/ output, Hugging Face cache): writable emptyDir.
HOME_DIR = "/home/rljob"
S3_STAGING_DIR = f"{HOME_DIR}/checkpoint-staging"
# The runtime checkpoints on SIGTERM (suspend, restart); give it time to finish.
TERMINATION_GRACE_SECONDS = 300
# torchrun (process 1) forwards SIGTERM to its ranks, then SIGKILLs them after TORCH_ELASTIC_SHUTDOWN_TIMEOUT
# seconds, 30 by default: far less than the grace period, so a step still in flight when the pod is deleted
# was lost. Its wait follows the grace period instead, less a margin for torchrun to reap the ranks and
# exit before the kubelet's own SIGKILL. An environment variable, not the --shutdown-timeout flag: a
# torch without the setting ignores it, where an unknown flag would stop torchrun from starting.
TORCHRUN_SHUTDOWN_MARGIN_SECONDS = 15
# Set by the Job controller on every pod of an Indexed Job (label and annotation).
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
JOB_UID_LABEL = "batch.kubernetes.io/controller-uid"
# Hash of the Job's immutable part: a different hash means the Job must be recreated, not patched.
ANNOTATION_TEMPLATE_HASH = f"{API_GROUP}/template-hash"


def trainer_name(job: JobRef) -> str:
    """Name of the trainer Job, its headless Service, ServiceAccount, Role and RoleBinding."""
    return child_name(job, "trainer")


def config_map_name(job: JobRef) -> str:
    """Name of the ConfigMap holding the rendered runtime config."""
    return child_name(job, "config")


def checkpoint_claim_name(job: JobRef, spec: RLJobSpec) -> str | None:
    """PVC the trainer mounts for checkpoints: the given pvc:// claim, the operator's own, or none."""
    uri = spec.checkpoint.uri
    if uri is None:
        return child_name(job, "checkpoints")
    if uri.startswith(PVC_URI_PREFIX):
        return uri.removeprefix(PVC_URI_PREFIX)
    return None


def runtime_document(job: JobRef, spec: RLJobSpec) -> dict[str, Any]:
    """The RLJob the trainer runs: the user's spec wired to the cluster's engines and volumes."""
    wire = spec.to_wire()
    # Lifecycle fields the runtime does not read: changing them must not change the config hash (that
    # would recreate the trainer Job on a suspend).
    for key in ("suspend", "backoffLimit", "activeDeadlineSeconds"):
        wire.pop(key, None)
    rollout = wire["rollout"]
    rollout["engine"] = "sglang"
    # Workers are discovered through the API server (the pods' labels), not listed: the config, and with
    # it the trainer's pod template, stays the same when a pool scales. Pools, replicas and the router
    # are the operator's business, so they stay out of it too.
    rollout["sglang"] = {
        **rollout.get("sglang", {}),
        "routerUrl": router_url(job),
        "workerUrls": [],
        "discovery": {"namespace": job.namespace, "selector": worker_selector(job), "port": SGLANG_PORT},
    }
    for operator_only in ("pools", "replicas", "router"):
        rollout.pop(operator_only, None)
    wire.pop("pods", None)
    runtime_paths(spec, wire)
    # A claim is mounted at CHECKPOINT_DIR; an s3:// store is staged in the pod's home (the runtime
    # uploads each checkpoint, and downloads the one it resumes from).
    wire["checkpoint"]["dir"] = CHECKPOINT_DIR if checkpoint_claim_name(job, spec) is not None else S3_STAGING_DIR
    wire["metrics"] = {**wire.get("metrics", {}), "port": METRICS_PORT, "host": "0.0.0.0"}
    if spec.trainer.vendor != "cpu":
        # ROCm builds of PyTorch expose AMD GPUs as the "cuda" device too.
        wire["trainer"]["device"] = "cuda"
    # Validate what we render with the same models `rljob run` uses.
    RLJobSpec.model_validate(wire)
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": KIND,
        "metadata": {"name": job.name, "namespace": job.namespace},
        "spec": wire,
    }


def render_config(job: JobRef, spec: RLJobSpec) -> str:
    """The runtime config file text."""
    return yaml.safe_dump(runtime_document(job, spec), sort_keys=False)


def config_map(job: JobRef, spec: RLJobSpec) -> dict[str, Any]:
    """ConfigMap with job.yaml for `rljob run`."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(job, config_map_name(job), ROLE_TRAINER),
        "data": {CONFIG_KEY: render_config(job, spec)},
    }


def service_account(job: JobRef) -> dict[str, Any]:
    """The trainer's own identity, used to report progress into the RLJob status."""
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": object_meta(job, trainer_name(job), ROLE_TRAINER)}


def role(job: JobRef) -> dict[str, Any]:
    """Least privilege: read its own RLJob, patch its status, post Events, list pods (worker discovery)."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": object_meta(job, trainer_name(job), ROLE_TRAINER),
        "rules": [
            {"apiGroups": [API_GROUP], "resources": ["rljobs"], "resourceNames": [job.name], "verbs": ["get"]},
            {
                "apiGroups": [API_GROUP],
                "resources": ["rljobs/status"],
                "resourceNames": [job.name],
                "verbs": ["get", "patch"],
            },
            {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
            # Worker discovery lists the inference pods of the namespace.
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        ],
    }


def role_binding(job: JobRef) -> dict[str, Any]:
    """Binds the trainer Role to the trainer ServiceAccount."""
    name = trainer_name(job)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": object_meta(job, name, ROLE_TRAINER),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": job.namespace}],
    }


def checkpoint_pvc(job: JobRef, spec: RLJobSpec) -> dict[str, Any] | None:
    """The operator's checkpoint PVC (kept while suspended; deleted with the RLJob), unless a URI is given."""
    if spec.checkpoint.uri is not None:
        return None
    pvc_spec: dict[str, Any] = {
        "accessModes": [spec.checkpoint.access_mode],
        "resources": {"requests": {"storage": spec.checkpoint.storage_size}},
    }
    if spec.checkpoint.storage_class_name:
        pvc_spec["storageClassName"] = spec.checkpoint.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": object_meta(job, child_name(job, "checkpoints"), ROLE_TRAINER),
        "spec": pvc_spec,
    }


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def trainer_container(job: JobRef, spec: RLJobSpec) -> dict[str, Any]:
    """The runtime container: `torchrun` launching `rljob run` on the rendered config."""
    trainer = spec.trainer
    defaults = [
        EnvVar(name="RLJOB_STATUS_REPORT", value="1"),
        EnvVar(name="TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
               value=str(TERMINATION_GRACE_SECONDS - TORCHRUN_SHUTDOWN_MARGIN_SECONDS)),
    ]
    resources: dict[str, Any] = {}
    if trainer.vendor != "cpu":
        profile = PROFILES[trainer.vendor]
        defaults = profile.env_vars() + defaults
        gpus = {profile.resource_name: str(trainer.gpus_per_replica)}
        resources = {"limits": gpus, "requests": gpus}
    files = trainer_storage(spec)
    mounts = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        *container_mounts(spec.pods, [{"name": "home", "mountPath": HOME_DIR}, *files.mounts], shm=True),
    ]
    if checkpoint_claim_name(job, spec) is not None:
        mounts.append({"name": "checkpoints", "mountPath": CHECKPOINT_DIR})
    return {
        "name": "trainer",
        "image": trainer.image or TRAINER_IMAGES[trainer.vendor],
        "command": torchrun_command(job, spec),
        "env": [
            _field_env("RLJOB_NAMESPACE", "metadata.namespace"),
            {"name": "RLJOB_NAME", "value": job.name},
            _field_env("POD_NAME", "metadata.name"),
            # The engines dial rank 0 at its pod IP to join the weight-update group (distributed transport).
            _field_env("POD_IP", "status.podIP"),
            _field_env("NODE_RANK", f"metadata.annotations['{COMPLETION_INDEX_LABEL}']"),
            *files.env,
            *s3_credentials_env(spec.checkpoint.s3),
            *merge_env(defaults, trainer.env),
            # The runtime sends the job's engine key to the workers and the router (Authorization: Bearer).
            engine_key_env(job),
        ],
        "ports": [
            {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
            {"name": "rendezvous", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"},
            *[{"name": "weight-sync", "containerPort": port, "protocol": "TCP"} for port in weight_sync_ports(spec)],
        ],
        "resources": resources,
        "securityContext": hardened_container_security(),
        "readinessProbe": {"httpGet": {"path": "/metrics", "port": "metrics"}, "periodSeconds": 10},
        "volumeMounts": mounts,
    }


def trainer_storage(spec: RLJobSpec) -> PodStorage:
    """Model (read-only), data (read-only) and shared weights (writable) of a trainer pod."""
    return model_storage(spec).add(data_storage(spec)).add(weights_storage(spec, writable=True))


def uses_weight_group(spec: RLJobSpec) -> bool:
    """Whether weights travel by the distributed transport (the trainer's default against SGLang): a
    weight-update group whose engine ranks dial trainer rank 0's store and pair with each other."""
    return (spec.rollout.weight_transport.mode or "distributed") == "distributed"


def weight_sync_ports(spec: RLJobSpec) -> list[int]:
    """The weight-update group's store port on trainer rank 0, when weights travel by the distributed
    transport on a fixed port."""
    transport = spec.rollout.weight_transport
    if not uses_weight_group(spec) or transport.master_port == 0:
        return []
    return [transport.master_port]


def rendezvous_host(job: JobRef) -> str:
    """Stable DNS name of the trainer pod with completion index 0 (hostname `<job>-0`, subdomain the Service)."""
    name = trainer_name(job)
    return f"{name}-0.{name}.{job.namespace}.svc"


def nproc_per_node(spec: RLJobSpec) -> int:
    """torchrun worker processes per pod: one per GPU, one on CPU."""
    return spec.trainer.gpus_per_replica if spec.trainer.vendor != "cpu" and spec.trainer.gpus_per_replica > 0 else 1


def torchrun_command(job: JobRef, spec: RLJobSpec) -> list[str]:
    """`torchrun` (static rendezvous at index 0) launching `rljob run` once per local GPU.

    `$(NODE_RANK)` is expanded by the kubelet from the container env (the pod's completion index).
    torchrun exports RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT to each worker.
    """
    return [
        "python",
        "-m",
        "torch.distributed.run",
        f"--nnodes={spec.trainer.replicas}",
        "--node-rank=$(NODE_RANK)",
        f"--nproc-per-node={nproc_per_node(spec)}",
        f"--master-addr={rendezvous_host(job)}",
        f"--master-port={RENDEZVOUS_PORT}",
        "--no-python",
        "rljob",
        "run",
        f"{CONFIG_DIR}/{CONFIG_KEY}",
    ]


def pod_failure_policy() -> dict[str, Any]:
    """Disruptions (eviction, preemption, node shutdown) never fail the Job; any other rank failure
    fails it at once, so the Job controller stops the remaining ranks and the operator restarts the gang."""
    return {
        "rules": [
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            {"action": "FailJob", "onExitCodes": {"containerName": "trainer", "operator": "NotIn", "values": [0]}},
        ]
    }


def trainer_job(job: JobRef, spec: RLJobSpec, active: bool) -> dict[str, Any]:
    """Indexed Job of trainer pods: a gang that runs to completion; the leader's success ends it.

    `active=False` suspends the Job (its pods are deleted, the object is kept). The template hash
    annotation tells the operator when the Job must be recreated (the template is immutable).
    """
    name = trainer_name(job)
    trainer = spec.trainer
    config_hash = hashlib.sha256(render_config(job, spec).encode()).hexdigest()[:16]
    files = trainer_storage(spec)
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": config_map_name(job)}},
        *pod_volumes(spec.pods, [{"name": "home", "emptyDir": {}}, *files.volumes], trainer.shm_size),
    ]
    claim = checkpoint_claim_name(job, spec)
    if claim is not None:
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": claim}})
    pod_spec: dict[str, Any] = {
        "serviceAccountName": name,
        **pod_base(spec.pods, RUNTIME_UID),
        "subdomain": name,
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
        "containers": [trainer_container(job, spec)],
        "nodeSelector": dict(trainer.node_selector),
        "volumes": volumes,
    }
    if files.init_containers:
        pod_spec["initContainers"] = init_containers(spec.pods, files.init_containers)
    if trainer.vendor != "cpu":
        pod_spec["affinity"] = vendor_affinity(trainer.vendor)
        pod_spec["tolerations"] = tolerations(trainer.vendor, trainer.tolerations)
    elif trainer.tolerations:
        pod_spec["tolerations"] = [t.to_wire() for t in trainer.tolerations]
    immutable = {
        "completionMode": "Indexed",
        "completions": trainer.replicas,
        "parallelism": trainer.replicas,
        "backoffLimit": 0,
        "podFailurePolicy": pod_failure_policy(),
        "successPolicy": {"rules": [{"succeededIndexes": "0"}]},
        "template": {
            "metadata": {
                "labels": labels(job, ROLE_TRAINER),
                "annotations": {ANNOTATION_CONFIG_HASH: config_hash},
            },
            "spec": pod_spec,
        },
    }
    template_hash = hashlib.sha256(json.dumps(immutable, sort_keys=True).encode()).hexdigest()[:16]
    meta = object_meta(job, name, ROLE_TRAINER)
    meta["annotations"] = {ANNOTATION_TEMPLATE_HASH: template_hash}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {**immutable, "suspend": not active},
    }


def trainer_service(job: JobRef, spec: RLJobSpec) -> dict[str, Any]:
    """Headless Service for rendezvous: it gives every trainer pod a stable DNS name (`<job>-trainer-<index>`).

    It publishes pods that are not ready, and must: a trainer pod is ready once `rljob run` serves its
    metrics, which is only after torchrun's rendezvous at index 0's name has gathered every rank, so
    without the not-ready addresses no rank could resolve index 0 and the gang would never start. Who
    may connect to those addresses is the NetworkPolicies' business (network.py), not DNS's.
    """
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(job, trainer_name(job), ROLE_TRAINER),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector_labels(job, ROLE_TRAINER),
            "ports": [
                {"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": "rendezvous", "protocol": "TCP"},
                {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"},
                *[
                    {"name": "weight-sync", "port": port, "targetPort": "weight-sync", "protocol": "TCP"}
                    for port in weight_sync_ports(spec)
                ],
            ],
        },
    }
