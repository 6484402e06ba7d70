"""Pods that really run: the local cluster's real node (kubelet, containerd, kube-proxy, CoreDNS).

What kwok cannot show: a container starts from a locally built image, its logs and `exec` reach it
through the apiserver and the kubelet's authenticated API, a Service name resolves and routes to a
pod, and a pod talks to the apiserver with its service-account token and the cluster CA.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.cluster.binaries import LOCALKUBE_SH
from tests.cluster.kube import wait_until
from tests.cluster.realnode import RealCluster

pytestmark = [pytest.mark.realnode, pytest.mark.cluster]


def busybox(rc: RealCluster, name: str, script: str, **extra: object) -> dict:
    return {"name": name, "image": rc.images["busybox"], "imagePullPolicy": "Never",
            "command": ["sh", "-c", script], **extra}


def test_pod_runs_logs_and_exec(real_cluster: RealCluster, real_namespace: str) -> None:
    rc, ns = real_cluster, real_namespace
    rc.run_pod(ns, "hello", [busybox(rc, "main", "echo hello from $(hostname); sleep 3600")])
    pod = rc.wait_phase(ns, "hello", {"Running"})
    assert pod.spec.node_name == rc.node
    assert pod.status.pod_ip.startswith("10.245.")
    assert "hello from hello" in rc.logs(ns, "hello")
    out = rc.cluster.kubectl("exec", "-n", ns, "hello", "--", "sh", "-c", "echo $((6 * 7)); id -u").stdout.split()
    assert out == ["42", "0"]


def test_container_exit_code_is_reported(real_cluster: RealCluster, real_namespace: str) -> None:
    rc, ns = real_cluster, real_namespace
    rc.run_pod(ns, "fails", [busybox(rc, "main", "echo bye; exit 3")])
    pod = rc.wait_phase(ns, "fails", {"Failed"})
    assert pod.status.container_statuses[0].state.terminated.exit_code == 3


def test_service_dns_and_cluster_ip(real_cluster: RealCluster, real_namespace: str) -> None:
    """A ClusterIP Service in front of a pod, reached by its DNS name from another pod (kube-proxy, CoreDNS)."""
    rc, ns = real_cluster, real_namespace
    core = rc.cluster.core()
    rc.run_pod(
        ns, "web",
        [busybox(rc, "httpd", "mkdir -p /www && echo served-by-web > /www/index.html && httpd -f -p 8080 -h /www",
                 ports=[{"name": "http", "containerPort": 8080}],
                 readinessProbe={"tcpSocket": {"port": 8080}, "periodSeconds": 1})],
    )
    # The pod needs a label for the Service's selector.
    core.patch_namespaced_pod("web", ns, {"metadata": {"labels": {"app": "web"}}})
    core.create_namespaced_service(ns, {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": "http"}]},
    })
    rc.wait_phase(ns, "web", {"Running"})
    # Python as the client: Debian's static busybox wget crashes in glibc's static NSS lookups.
    script = textwrap.dedent(f"""
        import time, urllib.request
        for attempt in range(60):
            try:
                print(urllib.request.urlopen("http://web.{ns}.svc.cluster.local", timeout=2).read().decode())
                break
            except OSError as exc:
                print("retry:", exc)
                time.sleep(1)
        else:
            raise SystemExit(1)
    """)
    rc.run_pod(ns, "client", [{"name": "main", "image": rc.images["base-python"], "imagePullPolicy": "Never",
                               "command": ["python3", "-c", script]}])
    rc.wait_phase(ns, "client", {"Succeeded", "Failed"}, timeout=120)
    assert "served-by-web" in rc.logs(ns, "client")


IN_CLUSTER = textwrap.dedent(
    """
    import json, os, ssl, urllib.error, urllib.request
    sa = "/var/run/secrets/kubernetes.io/serviceaccount"
    token = open(sa + "/token").read()
    tls = ssl.create_default_context(cafile=sa + "/ca.crt")
    base = "https://kubernetes.default.svc"
    def get(url, context, auth=True):
        req = urllib.request.Request(url, headers={"Authorization": "Bearer " + token} if auth else {})
        try:
            with urllib.request.urlopen(req, context=context, timeout=10) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:
            return e.code, None
    out = {"version": get(base + "/version", tls)[1]["gitVersion"],
           "own_pods": get(base + "/api/v1/namespaces/" + open(sa + "/namespace").read() + "/pods", tls)[0]}
    insecure = ssl._create_unverified_context()
    kubelet = "https://" + os.environ["NODE_IP"] + ":10250/pods"
    out["kubelet_anonymous"] = get(kubelet, insecure, auth=False)[0]
    out["kubelet_token"] = get(kubelet, insecure)[0]
    print(json.dumps(out))
    """
)


def test_in_cluster_api_and_kubelet_authn(real_cluster: RealCluster, real_namespace: str) -> None:
    """Service-account token over verified TLS through Service `kubernetes`; the kubelet refuses
    anonymous callers (401) and callers without node rights (403)."""
    rc, ns = real_cluster, real_namespace
    rc.run_pod(ns, "incluster", [{
        "name": "main", "image": rc.images["base-python"], "imagePullPolicy": "Never",
        "command": ["python3", "-c", IN_CLUSTER],
        "env": [{"name": "NODE_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}}],
    }])
    rc.wait_phase(ns, "incluster", {"Succeeded"}, timeout=120)
    result = json.loads(rc.logs(ns, "incluster").strip().splitlines()[-1])
    assert result == {"version": rc.cluster.version, "own_pods": 403, "kubelet_anonymous": 401, "kubelet_token": 403}


def test_kubelet_api_through_the_apiserver(real_cluster: RealCluster) -> None:
    """The apiserver reaches the kubelet with its client certificate (node proxy, as `kubectl logs` does)."""
    out = real_cluster.cluster.kubectl("get", "--raw", f"/api/v1/nodes/{real_cluster.node}/proxy/healthz").stdout
    assert out == "ok"
    node = real_cluster.cluster.core().read_node(real_cluster.node)
    assert node.metadata.labels["rljob.io/real-node"] == "true"
    assert {a.type: a.address for a in node.status.addresses}["InternalIP"] == "10.250.0.1"


def test_a_second_real_node_waits_for_the_first(real_cluster: RealCluster, tmp_path: Path) -> None:
    """One real node per machine: another `up --real-node` (say, a second CI run) queues on the
    machine-wide lock and leaves the running node alone."""
    state = tmp_path / "second"
    state.mkdir()
    log = tmp_path / "second.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(LOCALKUBE_SH), "up", "--foreground", "--exit-with-parent", "--real-node"],
            env={**os.environ, "LOCALKUBE_DIR": str(state)},
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
    waiting = state / "waiting-for-real-node-lock"
    try:
        wait_until(lambda: waiting.exists() or proc.poll() is not None, 120, "the second real node to queue")
        assert proc.poll() is None, log.read_text()
        assert f"dir={real_cluster.cluster.state_dir}" in waiting.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    assert not (state / "ready").exists()
    node = real_cluster.cluster.core().read_node(real_cluster.node)
    assert {c.type: c.status for c in node.status.conditions}["Ready"] == "True"
