"""Per-job NetworkPolicies: who may open a connection to each of a job's pods (ingress only).

Without them any pod in the cluster can drive a job's engines (abort or pause a round, load other
weights under the current version), add workers to its router, or join its trainer's stores. With them:

- inference pods: their HTTP port from the job's trainer and router only; when weights travel by the
  weight-update group, every other port from the job's trainer and inference pods (gloo and NCCL pair
  ranks over ports the kernel picks, engine to engine too); the HTTP port, which also serves SGLang's
  `/metrics`, from the monitoring namespace;
- the router: its HTTP port from the job's trainer only;
- trainer pods: any port from the job's trainer pods (torchrun's rendezvous store, then torch.distributed's
  own store and gloo/NCCL pairs on picked ports); when weights travel by the weight-update group, any port
  from the job's inference pods (rank 0's group store, fixed or picked, and the group's gloo/NCCL pairs);
  the metrics port from the monitoring namespace.

A peer named by pod labels only is a pod of the policy's own namespace, so a pod in another namespace,
or of another job (its `rljob.io/job-name` differs), matches no rule. Egress is not restricted: the pods
keep reaching DNS, the API server (worker discovery, status) and model stores. The kubelet's probes come
from the node, which NetworkPolicy implementations allow.

Pure builders: settings in, manifests out; the operator reads the settings (chart values) once at start.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rljob.api.spec import RLJobSpec
from rljob.operator.builders.inference import SGLANG_PORT
from rljob.operator.builders.meta import (
    ROLE_INFERENCE,
    ROLE_ROUTER,
    ROLE_TRAINER,
    JobRef,
    child_name,
    object_meta,
    selector_labels,
)
from rljob.operator.builders.trainer import METRICS_PORT, uses_weight_group

# The label every namespace carries with its own name (set by the API server since Kubernetes 1.22).
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
MAX_PORT = 65535


# Where `python -m rljob.operator` (its --network-policy and --monitoring-namespace flags, set from the
# chart's values) hands the settings to the handlers, like its other settings.
ENV_ENABLED = "RLJOB_NETWORK_POLICY"
ENV_MONITORING_NAMESPACE = "RLJOB_MONITORING_NAMESPACE"
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


@dataclass(frozen=True)
class NetworkPolicySettings:
    """The chart's `networkPolicy` values as the operator received them."""

    enabled: bool = True
    # Namespace whose pods may scrape the jobs' metrics ports (the chart's networkPolicy.monitoringNamespace);
    # None: no scraping from outside the job.
    monitoring_namespace: str | None = None

    def __post_init__(self) -> None:
        ns = self.monitoring_namespace
        if ns is not None and not _DNS_LABEL.fullmatch(ns):
            raise ValueError(f"networkPolicy.monitoringNamespace: {ns!r} is not a namespace name (a DNS-1123 label)")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> NetworkPolicySettings:
        """Read the settings from `env` (unset: policies on, no monitoring namespace)."""
        flag = env.get(ENV_ENABLED, "true").strip().lower()
        if flag not in ("true", "false"):
            raise ValueError(f"{ENV_ENABLED}: {flag!r} is neither true nor false")
        return cls(enabled=flag == "true", monitoring_namespace=env.get(ENV_MONITORING_NAMESPACE) or None)


def network_policy_name(job: JobRef, role: str) -> str:
    """Name of the NetworkPolicy guarding the job's pods of `role`."""
    return child_name(job, role)


def _job_pods(job: JobRef, *roles: str) -> list[dict[str, Any]]:
    """`from` peers: the job's own pods of `roles`, in the policy's namespace."""
    return [{"podSelector": {"matchLabels": selector_labels(job, role)}} for role in roles]


def _tcp(port: int, end_port: int | None = None) -> dict[str, Any]:
    rule: dict[str, Any] = {"protocol": "TCP", "port": port}
    if end_port is not None:
        rule["endPort"] = end_port
    return rule


def _all_tcp_but(port: int) -> list[dict[str, Any]]:
    """Every TCP port except `port`, as port ranges."""
    return [_tcp(1, port - 1), _tcp(port + 1, MAX_PORT)]


def _monitoring(settings: NetworkPolicySettings, port: int) -> list[dict[str, Any]]:
    """The rule letting the monitoring namespace reach `port`, when the settings name one."""
    if settings.monitoring_namespace is None:
        return []
    namespace = {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: settings.monitoring_namespace}}}
    return [{"from": [namespace], "ports": [_tcp(port)]}]


def _policy(job: JobRef, role: str, ingress: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_meta(job, network_policy_name(job, role), role),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(job, role)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def inference_policy(job: JobRef, spec: RLJobSpec, settings: NetworkPolicySettings) -> dict[str, Any]:
    """Inference pods (every pool): HTTP from the job's trainer and router; the weight-update group's
    pair ports from the job's trainer and engines; /metrics (on the HTTP port) from the monitoring namespace."""
    ingress = [{"from": _job_pods(job, ROLE_TRAINER, ROLE_ROUTER), "ports": [_tcp(SGLANG_PORT)]}]
    if uses_weight_group(spec):
        ingress.append({"from": _job_pods(job, ROLE_TRAINER, ROLE_INFERENCE), "ports": _all_tcp_but(SGLANG_PORT)})
    return _policy(job, ROLE_INFERENCE, ingress + _monitoring(settings, SGLANG_PORT))


def router_policy(job: JobRef) -> dict[str, Any]:
    """The router: HTTP (generation, and its worker API) from the job's trainer only."""
    return _policy(job, ROLE_ROUTER, [{"from": _job_pods(job, ROLE_TRAINER), "ports": [_tcp(SGLANG_PORT)]}])


def trainer_policy(job: JobRef, spec: RLJobSpec, settings: NetworkPolicySettings) -> dict[str, Any]:
    """Trainer pods: any port from the gang itself and, with the weight-update group, from the job's
    engines (rank 0's group store and the group's pairs); the metrics port from the monitoring namespace."""
    peers = (ROLE_TRAINER, ROLE_INFERENCE) if uses_weight_group(spec) else (ROLE_TRAINER,)
    ingress = [{"from": _job_pods(job, *peers)}]
    return _policy(job, ROLE_TRAINER, ingress + _monitoring(settings, METRICS_PORT))


def network_policies(job: JobRef, spec: RLJobSpec, settings: NetworkPolicySettings) -> list[dict[str, Any]]:
    """The job's NetworkPolicies; none when the chart turned them off."""
    if not settings.enabled:
        return []
    return [inference_policy(job, spec, settings), router_policy(job), trainer_policy(job, spec, settings)]
