"""A real Prometheus as a pod on the real node, discovering an RLJob's pods through their Services.

This is how a cluster's Prometheus scrapes a job: from inside the pod network, following the job's
Services as their pods come and go. Debian's Prometheus (the cached binary) is built without
Kubernetes service discovery (`kubernetes_sd_configs` is not a known field there), so discovery goes
through the Services' DNS instead: one SRV query per Service and named port (`_<port>._tcp.<service>`,
answered by the cluster's CoreDNS for every endpoint of the headless Service), so the port is chosen
by name as the chart's PodMonitors choose it (charts/rljob-operator/templates/podmonitors.yaml:
inference pods on `http`, trainer pods on `metrics`). The target labels are those the PodMonitors
and the prometheus-operator give (`namespace`, `service`; `rljob`, `pool`, `vendor` for inference
pods); DNS carries no pod labels, so they are written per Service here. The binary is mounted
read-only into the `base-python` image (it needs only glibc); queries go through
the API server's pod proxy.
"""

from __future__ import annotations

import json
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from kubernetes import utils

from rljob.operator.builders.meta import JobRef, child_name
from rljob.operator.builders.trainer import trainer_name
from tests.cluster.binaries import binary_path
from tests.cluster.kube import wait_until
from tests.cluster.realnode import RealCluster

NAME = "prometheus"
PORT = 9090
# Where the cached binary is mounted (not at its host path: /root is closed to other users).
MOUNT = "/opt/prometheus/prometheus"


@dataclass(frozen=True)
class ScrapedService:
    """One Service of a job to scrape: its name, the named port of its pods' metrics, target labels."""

    service: str
    port: str
    labels: dict[str, str] = field(default_factory=dict)


def rljob_services(job: JobRef, pools: dict[str, str]) -> list[ScrapedService]:
    """The Services of RLJob `job` (pools: name -> vendor) as the chart's PodMonitors select their pods.

    The trainer gets no `rljob` target label: it names its job itself (`rljob_job_info{rljob}`), and a
    target label would rename that one `exported_rljob`.
    """
    inference = [ScrapedService(child_name(job, "infer", pool), "http", {"rljob": job.name, "pool": pool, "vendor": vendor})
                 for pool, vendor in pools.items()]
    return [*inference, ScrapedService(trainer_name(job), "metrics")]


def scrape_config(namespace: str, services: list[ScrapedService], interval: str = "2s") -> dict[str, Any]:
    """Prometheus configuration: one scrape job per Service, its endpoints found by DNS SRV."""
    jobs = []
    for svc in services:
        labels = {"namespace": namespace, "service": svc.service, **svc.labels}
        jobs.append({
            "job_name": f"{namespace}/{svc.service}",
            "metrics_path": "/metrics",
            "dns_sd_configs": [{"names": [f"_{svc.port}._tcp.{svc.service}.{namespace}.svc.cluster.local"],
                                "type": "SRV", "refresh_interval": interval}],
            "relabel_configs": [{"target_label": k, "replacement": v} for k, v in labels.items()],
        })
    return {
        "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
        "scrape_configs": jobs,
    }


def manifests(namespace: str, image: str, config: dict[str, Any]) -> list[dict[str, Any]]:
    """ConfigMap and the pod (no service account token: DNS discovery needs no API access)."""
    binary = binary_path("prometheus")
    meta = {"name": NAME, "namespace": namespace}
    return [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
         "data": {"prometheus.yml": json.dumps(config, indent=1)}},  # JSON is YAML
        {"apiVersion": "v1", "kind": "Pod", "metadata": {**meta, "labels": {"app": NAME}},
         "spec": {
             "automountServiceAccountToken": False,
             "securityContext": {"runAsUser": 65534, "runAsGroup": 65534, "runAsNonRoot": True},
             "containers": [{
                 "name": NAME, "image": image, "imagePullPolicy": "Never",
                 "command": [MOUNT, "--config.file=/etc/prometheus/prometheus.yml",
                             "--storage.tsdb.path=/prometheus", f"--web.listen-address=0.0.0.0:{PORT}",
                             "--storage.tsdb.retention.time=1h", "--log.level=warn"],
                 "ports": [{"name": "web", "containerPort": PORT}],
                 "readinessProbe": {"httpGet": {"path": "/-/ready", "port": "web"}, "periodSeconds": 2},
                 "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "512Mi"}},
                 "volumeMounts": [{"name": "binary", "mountPath": MOUNT, "readOnly": True},
                                  {"name": "config", "mountPath": "/etc/prometheus", "readOnly": True},
                                  {"name": "data", "mountPath": "/prometheus"}],
             }],
             "volumes": [{"name": "binary", "hostPath": {"path": str(binary), "type": "File"}},
                         {"name": "config", "configMap": {"name": NAME}},
                         {"name": "data", "emptyDir": {}}],
         }},
    ]


class PrometheusPod:
    """The Prometheus pod of one namespace on the real node."""

    def __init__(self, rc: RealCluster, namespace: str, services: list[ScrapedService]) -> None:
        self.rc, self.namespace, self.services = rc, namespace, services

    def start(self, timeout: float = 120) -> None:
        """Create the objects and wait for the pod's readiness (its /-/ready)."""
        objects = manifests(self.namespace, self.rc.images["base-python"], scrape_config(self.namespace, self.services))
        utils.create_from_yaml(self.rc.cluster.api, yaml_objects=objects, namespace=self.namespace)

        def ready() -> bool:
            pod = self.rc.cluster.core().read_namespaced_pod(NAME, self.namespace)
            return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])

        wait_until(ready, timeout, f"Prometheus pod {self.namespace}/{NAME} ready", interval=1)

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant PromQL query through the API server's pod proxy; the result vector."""
        path = (f"/api/v1/namespaces/{self.namespace}/pods/{NAME}:{PORT}/proxy/api/v1/query?"
                + urllib.parse.urlencode({"query": expr}))
        body = json.loads(self.rc.cluster.kubectl("get", "--raw", path).stdout)
        if body.get("status") != "success":
            raise RuntimeError(f"query {expr!r} failed: {body}")
        return list(body["data"]["result"])
