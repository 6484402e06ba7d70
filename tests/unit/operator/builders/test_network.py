"""The per-job NetworkPolicies (operator/builders/network.py), read the way Kubernetes reads them.

`allowed` evaluates NetworkPolicy ingress semantics (a pod selected by any policy is isolated; a
connection passes when one rule of one selecting policy matches its source and port) over the policies
the builders make, so each case states who may open a connection to whom, not how the YAML looks.
The ports come from the pods the builders make, so a port moved in a pod spec is checked here too.
tests/integration/test_network_policy_real_node.py shows a real implementation enforcing the same table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from rljob.api.spec import RLJobSpec
from rljob.operator.builders import JobRef, build_children
from rljob.operator.builders.meta import ROLE_INFERENCE, ROLE_ROUTER, ROLE_TRAINER, labels
from rljob.operator.builders.network import (
    ENV_ENABLED,
    ENV_MONITORING_NAMESPACE,
    NAMESPACE_NAME_LABEL,
    NetworkPolicySettings,
    network_policies,
)

JOB = JobRef(name="demo", namespace="team-a", uid="uid-1")
OTHER_JOB = JobRef(name="other", namespace="team-a", uid="uid-2")
MONITORING = "monitoring"
ON = NetworkPolicySettings(enabled=True, monitoring_namespace=MONITORING)
GLOO_PORT = 41234  # a port the kernel may pick for a gloo/NCCL pair


@dataclass(frozen=True)
class Pod:
    namespace: str
    labels: dict[str, str] = field(default_factory=dict)


def job_pod(job: JobRef, role: str, namespace: str | None = None) -> Pod:
    return Pod(namespace or job.namespace, labels(job, role))


def _matches(selector: dict[str, Any], have: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, f"only matchLabels is evaluated here: {selector}"
    return all(have.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _peer_matches(peer: dict[str, Any], policy_ns: str, source: Pod) -> bool:
    ns_ok = (
        _matches(peer["namespaceSelector"], {NAMESPACE_NAME_LABEL: source.namespace})
        if "namespaceSelector" in peer
        else source.namespace == policy_ns
    )
    pod_ok = _matches(peer["podSelector"], source.labels) if "podSelector" in peer else True
    assert set(peer) <= {"podSelector", "namespaceSelector"}, peer
    return ns_ok and pod_ok


def _port_matches(rule_port: dict[str, Any], port: int) -> bool:
    assert rule_port["protocol"] == "TCP" and isinstance(rule_port["port"], int)
    return rule_port["port"] <= port <= rule_port.get("endPort", rule_port["port"])


def allowed(policies: list[dict[str, Any]], source: Pod, target: Pod, port: int) -> bool:
    """Whether Kubernetes lets `source` open a TCP connection to `target`:`port` under `policies`."""
    selecting = [
        p for p in policies
        if p["metadata"]["namespace"] == target.namespace and _matches(p["spec"]["podSelector"], target.labels)
    ]
    if not selecting:
        return True
    for policy in selecting:
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        for rule in policy["spec"].get("ingress", []):
            peers, ports = rule.get("from"), rule.get("ports")
            if peers is not None and not any(_peer_matches(p, policy["metadata"]["namespace"], source) for p in peers):
                continue
            if ports is not None and not any(_port_matches(p, port) for p in ports):
                continue
            return True
    return False


def _spec(**rollout: Any) -> RLJobSpec:
    return RLJobSpec.model_validate(
        {
            "model": {"huggingFace": "Qwen/Qwen3-4B", "revision": "main"},
            "data": {"synthetic": {}},
            "rollout": {"engine": "sglang", "pools": [{"name": "nv", "vendor": "nvidia", "replicas": 2}], **rollout},
            "trainer": {"vendor": "nvidia", "gpusPerReplica": 8, "replicas": 2},
        }
    )


def _ports(children: list[dict[str, Any]], kind: str, role: str) -> dict[str, int]:
    """The named container ports of the job's `role` workload, as the builders declare them."""
    (workload,) = [c for c in children if c["kind"] == kind and c["metadata"]["labels"]["rljob.io/role"] == role]
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def _policies(spec: RLJobSpec, settings: NetworkPolicySettings) -> list[dict[str, Any]]:
    """The job's policies as build_children emits them, plus another job's in the same namespace."""
    mine = [c for c in build_children(JOB, spec, active=True, network=settings) if c["kind"] == "NetworkPolicy"]
    return mine + network_policies(OTHER_JOB, spec, settings)


SPEC = _spec()
CHILDREN = build_children(JOB, SPEC, active=True, network=ON)
HTTP = _ports(CHILDREN, "StatefulSet", ROLE_INFERENCE)["http"]
ROUTER_HTTP = _ports(CHILDREN, "Deployment", ROLE_ROUTER)["http"]
TRAINER_PORTS = _ports(CHILDREN, "Job", ROLE_TRAINER)
RENDEZVOUS, STORE, METRICS = TRAINER_PORTS["rendezvous"], TRAINER_PORTS["weight-sync"], TRAINER_PORTS["metrics"]

TRAINER, ROUTER, ENGINE = job_pod(JOB, ROLE_TRAINER), job_pod(JOB, ROLE_ROUTER), job_pod(JOB, ROLE_INFERENCE)
OTHER_TRAINER, OTHER_ENGINE = job_pod(OTHER_JOB, ROLE_TRAINER), job_pod(OTHER_JOB, ROLE_INFERENCE)
# A pod in another namespace that copies the job's labels: labels alone must not let it in.
IMPOSTOR = job_pod(JOB, ROLE_TRAINER, namespace="intruders")
SCRAPER = Pod(MONITORING, {"app": "prometheus"})
STRANGER = Pod("team-a", {"app": "notebook"})

# (source, target, port, allowed)
CASES = [
    # Inference pods: HTTP only from the job's trainer and router.
    (TRAINER, ENGINE, HTTP, True),
    (ROUTER, ENGINE, HTTP, True),
    (ENGINE, ENGINE, HTTP, False),
    (OTHER_TRAINER, ENGINE, HTTP, False),
    (IMPOSTOR, ENGINE, HTTP, False),
    (STRANGER, ENGINE, HTTP, False),
    (SCRAPER, ENGINE, HTTP, True),  # SGLang's /metrics lives on its HTTP port
    # The weight-update group's pairs: trainer and engines of the job, on picked ports.
    (TRAINER, ENGINE, GLOO_PORT, True),
    (ENGINE, ENGINE, GLOO_PORT, True),
    (OTHER_ENGINE, ENGINE, GLOO_PORT, False),
    (IMPOSTOR, ENGINE, GLOO_PORT, False),
    (SCRAPER, ENGINE, GLOO_PORT, False),
    # The router: only the job's trainer.
    (TRAINER, ROUTER, ROUTER_HTTP, True),
    (ENGINE, ROUTER, ROUTER_HTTP, False),
    (OTHER_TRAINER, ROUTER, ROUTER_HTTP, False),
    (IMPOSTOR, ROUTER, ROUTER_HTTP, False),
    (SCRAPER, ROUTER, ROUTER_HTTP, False),
    # Trainer: the gang on any port (rendezvous, torch.distributed's pairs), engines on the group's store and pairs.
    (TRAINER, TRAINER, RENDEZVOUS, True),
    (TRAINER, TRAINER, GLOO_PORT, True),
    (ENGINE, TRAINER, STORE, True),
    (ENGINE, TRAINER, GLOO_PORT, True),
    (ROUTER, TRAINER, STORE, False),
    (OTHER_TRAINER, TRAINER, RENDEZVOUS, False),
    (OTHER_ENGINE, TRAINER, STORE, False),
    (IMPOSTOR, TRAINER, RENDEZVOUS, False),
    (IMPOSTOR, TRAINER, STORE, False),
    (STRANGER, TRAINER, STORE, False),
    (SCRAPER, TRAINER, METRICS, True),
    (SCRAPER, TRAINER, RENDEZVOUS, False),
    (SCRAPER, TRAINER, STORE, False),
]


@pytest.mark.parametrize(("source", "target", "port", "expected"), CASES)
def test_who_reaches_which_port(source: Pod, target: Pod, port: int, expected: bool) -> None:
    assert allowed(_policies(SPEC, ON), source, target, port) is expected


def test_every_pod_of_the_job_is_isolated_and_named_ports_are_covered() -> None:
    policies = _policies(SPEC, ON)
    for pod in (TRAINER, ROUTER, ENGINE):
        assert allowed(policies, STRANGER, pod, 1) is False, pod
    # Each declared port of a trainer pod is open to the gang (a port added later stays reachable by it).
    for port in TRAINER_PORTS.values():
        assert allowed(policies, TRAINER, TRAINER, port)


def test_no_monitoring_namespace_means_no_scraping_from_outside() -> None:
    policies = _policies(SPEC, NetworkPolicySettings(enabled=True, monitoring_namespace=None))
    assert not allowed(policies, SCRAPER, ENGINE, HTTP)
    assert not allowed(policies, SCRAPER, TRAINER, METRICS)
    assert allowed(policies, TRAINER, ENGINE, HTTP)


def test_disk_transport_opens_no_weight_group_ports() -> None:
    spec = _spec(weightTransport={"mode": "disk"}, sglang={"weightsDir": "/weights"})
    policies = _policies(spec, ON)
    assert not allowed(policies, ENGINE, TRAINER, STORE)
    assert not allowed(policies, ENGINE, ENGINE, GLOO_PORT)
    assert not allowed(policies, TRAINER, ENGINE, GLOO_PORT)
    assert allowed(policies, TRAINER, ENGINE, HTTP)


def test_opt_out_builds_no_policies() -> None:
    children = build_children(JOB, SPEC, active=True, network=NetworkPolicySettings(enabled=False))
    assert not [c for c in children if c["kind"] == "NetworkPolicy"]


def test_policies_come_before_the_workloads_they_guard() -> None:
    kinds = [c["kind"] for c in CHILDREN]
    last_policy = max(i for i, k in enumerate(kinds) if k == "NetworkPolicy")
    assert all(i > last_policy for i, k in enumerate(kinds) if k in ("StatefulSet", "Deployment", "Job"))


def test_settings_from_the_environment() -> None:
    assert NetworkPolicySettings.from_env({}) == NetworkPolicySettings(enabled=True, monitoring_namespace=None)
    assert NetworkPolicySettings.from_env({ENV_ENABLED: "false", ENV_MONITORING_NAMESPACE: "obs"}) == (
        NetworkPolicySettings(enabled=False, monitoring_namespace="obs")
    )
    assert NetworkPolicySettings.from_env({ENV_MONITORING_NAMESPACE: ""}).monitoring_namespace is None
    with pytest.raises(ValueError, match=ENV_ENABLED):
        NetworkPolicySettings.from_env({ENV_ENABLED: "yes please"})
    with pytest.raises(ValueError, match="networkPolicy.monitoringNamespace"):
        NetworkPolicySettings.from_env({ENV_MONITORING_NAMESPACE: "Not_A_Namespace"})
