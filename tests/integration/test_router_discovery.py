"""The real sglang router finds its workers through the API server, as the operator runs it, and a
worker added by scaling receives traffic.

kwok pods never run, so the worker pods here are plain Pod objects that no node runs (their scheduler
does not exist): the test writes their status (Running, Ready, podIP 127.0.0.N) the way a kubelet
would, and a real SGLang-protocol server process listens on each of those loopback addresses. The
router is `python -m sglang_router.launch_router` with exactly the arguments the operator's builder
renders, pointed at the local control plane through KUBECONFIG.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rljob.api.spec import RLJobSpec
from rljob.operator.builders import JobRef
from rljob.operator.builders.router import router_args
from tests.helpers.processes import free_port, spawn, stop, wait_http
from tests.helpers.tiny_model import save_tiny_model
from tests.integration.test_operator import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

JOB = "disc"
LABELS = {"rljob.io/job-name": JOB, "rljob.io/role": "inference", "rljob.io/pool": "cpu"}


def _worker_pod(kube_cluster: Any, ns: str, name: str, ip: str) -> None:
    """A pod carrying the pool's labels, then given the status a kubelet would report once it serves."""
    core = kube_cluster.core()
    core.create_namespaced_pod(ns, {
        "metadata": {"name": name, "labels": LABELS},
        # No such scheduler: the pod is never bound, so neither kwok nor a kubelet rewrites its status.
        "spec": {"schedulerName": "nobody", "containers": [{"name": "sglang", "image": "none"}]},
    })
    core.patch_namespaced_pod_status(name, ns, {"status": {
        "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
        "conditions": [{"type": "Ready", "status": "True"}],
    }})


def _generated(url: str) -> float:
    """sglang:generation_tokens of one worker (its /metrics)."""
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("sglang:generation_tokens_total") or line.startswith("sglang:generation_tokens{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{url}/metrics has no sglang:generation_tokens")


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[tuple[int, list[str]]]:
    """Three SGLang-protocol servers on 127.0.0.2-4, one port (the router's --service-discovery-port)."""
    model = save_tiny_model(tmp_path / "model")
    port = free_port()
    procs, urls = [], []
    try:
        for i in (2, 3, 4):
            log = tmp_path / f"worker{i}.log"
            proc = spawn([sys.executable, "-m", "rljob.runtime.engines.server", "--model-path", str(model),
                          "--host", f"127.0.0.{i}", "--port", str(port), "--max-batch-size", "4",
                          "--torch-threads", "1", "--log-level", "warning"], log)
            procs.append(proc)
            urls.append(f"http://127.0.0.{i}:{port}")
            wait_http(urls[-1] + "/health_generate", 180, proc, log)
        yield port, urls
    finally:
        stop(procs)


def test_router_discovers_labelled_pods_and_sends_the_new_worker_traffic(
    kube_cluster: Any, namespace: str, workers: tuple[int, list[str]], tmp_path: Path
) -> None:
    port, urls = workers
    spec = RLJobSpec.model_validate({"model": {"huggingFace": "x/y"}, "data": {"synthetic": {}},
                                     "rollout": {"router": {"policy": "round_robin"}, "startupBudgetSeconds": 60}})
    args = router_args(JobRef(name=JOB, namespace=namespace, uid="u"), spec)
    # The builder's arguments, on loopback and with the test servers' port instead of 30000.
    args[args.index("--host") + 1] = "127.0.0.1"
    router_port = free_port()
    args[args.index("--port") + 1] = str(router_port)
    args[args.index("--service-discovery-port") + 1] = str(port)
    for i, ip in enumerate(("127.0.0.2", "127.0.0.3")):
        _worker_pod(kube_cluster, namespace, f"{JOB}-infer-cpu-{i}", ip)
    log = tmp_path / "router.log"
    router = spawn([sys.executable, "-m", "sglang_router.launch_router", *args, "--log-level", "info"], log)
    base = f"http://127.0.0.1:{router_port}"
    try:
        wait_http(base + "/liveness", 60, router, log)

        def listed() -> set[str]:
            body = httpx.get(base + "/workers", timeout=5).json()
            return {w["url"] if isinstance(w, dict) else w for w in body.get("workers", body.get("urls", []))}

        wait_for(lambda: listed() == set(urls[:2]), "the router to discover the two ready pods", 90)
        _worker_pod(kube_cluster, namespace, f"{JOB}-infer-cpu-2", "127.0.0.4")  # scale 2 -> 3
        wait_for(lambda: listed() == set(urls), "the router to discover the third pod", 90)
        before = _generated(urls[2])
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        for _ in range(6):  # round robin over three workers: each gets two
            assert httpx.post(base + "/generate", json=body, timeout=60).status_code == 200
        assert _generated(urls[2]) > before, "the new worker received no traffic through the router"
    finally:
        stop([router])
        print(f"--- router log ---\n{log.read_text()[-4000:]}")
