"""A scaled-in worker reaches the router only once it holds the current weights (issues 12 and 14).

The router runs exactly as the operator starts it: the real `python -m sglang_router.launch_router`
with the builder's arguments, which give it no workers and no discovery of its own. The runtime's
SGLang client (trainer rank 0) finds the pools' pods through the local control plane's API server by
their labels (`PodWorkerDiscovery`, as `rollout.sglang.discovery` configures it) and is the only one
adding workers to the router, through its worker API.

kwok pods never run, so the worker pods here are plain Pod objects that no node runs (their scheduler
does not exist): the test writes their status (Running, Ready, podIP 127.0.0.N) the way a kubelet
would, and a real SGLang-protocol server process listens on each of those loopback addresses. The
weights travel over the `distributed` transport (real gloo broadcasts) from a real tiny model.

That the operator leaves the trainer and router pods alone (same uid) when a pool scales is shown
against the operator itself in tests/integration/test_pool_scaling_and_admission.py; here the one router process
lives through the scale and fills up without a restart.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoModelForCausalLM

from rljob.api.spec import PodDiscoverySpec, RLJobSpec
from rljob.operator.builders import JobRef
from rljob.operator.builders.inference import worker_selector
from rljob.operator.builders.router import router_args
from rljob.runtime.engines.discovery import PodWorkerDiscovery
from rljob.runtime.engines.sglang_client import SGLangClientConfig, SGLangEngine
from rljob.runtime.weights.broadcast import DistributedOptions, DistributedTransport
from rljob.runtime.weights.buckets import module_buckets
from tests.helpers.processes import free_port, spawn, stop, wait_http
from tests.helpers.tiny_model import save_tiny_model
from tests.helpers.waiting import wait_until
from tests.helpers.greedy import greedy_of, greedy_on
from tests.integration.test_weight_transport_http import perturb, router_workers, served_versions

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

JOB = "disc"
LABELS = {"rljob.io/job-name": JOB, "rljob.io/role": "inference", "rljob.io/pool": "cpu"}
ROUND_ROBIN_REQUESTS = 6  # two per worker once three are listed


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


async def _generated(url: str) -> float:
    """sglang:generation_tokens of one worker (its /metrics)."""
    async with httpx.AsyncClient() as http:
        text = (await http.get(url + "/metrics", timeout=5)).text
    for line in text.splitlines():
        if line.startswith(("sglang:generation_tokens_total", "sglang:generation_tokens{")):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{url}/metrics has no sglang:generation_tokens")


async def _versions_through(router: str, n: int) -> list[str]:
    """The weight version stamped on each of ``n`` generations sent through the router."""
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    async with httpx.AsyncClient() as http:
        replies = [await http.post(router + "/generate", json=body, timeout=60) for _ in range(n)]
    assert all(r.status_code == 200 for r in replies), [r.text[:200] for r in replies]
    return [str(r.json()["meta_info"]["weight_version"]) for r in replies]


@dataclass
class Workers:
    model: Path
    port: int
    urls: list[str]


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Workers]:
    """Three SGLang-protocol servers on 127.0.0.2-4, one port (the pools' SGLang port)."""
    model = save_tiny_model(tmp_path / "model", seed=1)
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
        yield Workers(model, port, urls)
    finally:
        stop(procs)


def _start_router(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    # Its Prometheus exporter on a free port: the default (29000) may be taken by another test run.
    proc = spawn([sys.executable, "-m", "sglang_router.launch_router", *args, "--prometheus-port", str(free_port()),
                  "--log-level", "info"], log)
    # /liveness, as the router pod's readiness probe: /readiness is 503 while the router holds no worker.
    wait_http(f"http://127.0.0.1:{args[args.index('--port') + 1]}/liveness", 60, proc, log)
    return proc


async def test_a_scaled_in_worker_gets_traffic_only_once_it_holds_the_current_weights(
    kube_cluster: Any, namespace: str, workers: Workers, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="rljob.runtime.engines.worker_table")  # the router adds are its
    spec = RLJobSpec.model_validate({"model": {"huggingFace": "x/y"}, "data": {"synthetic": {}},
                                     "rollout": {"router": {"policy": "round_robin"}, "startupBudgetSeconds": 60}})
    job = JobRef(name=JOB, namespace=namespace, uid="u")
    urls = workers.urls
    args = router_args(spec)
    assert not {"--worker-urls", "--service-discovery", "--selector"} & set(args), "the router must not find workers"
    # The builder's arguments, on loopback instead of 0.0.0.0:30000.
    router_port = free_port()
    args[args.index("--host") + 1] = "127.0.0.1"
    args[args.index("--port") + 1] = str(router_port)
    base = f"http://127.0.0.1:{router_port}"
    for i, ip in enumerate(("127.0.0.2", "127.0.0.3")):
        _worker_pod(kube_cluster, namespace, f"{JOB}-infer-cpu-{i}", ip)
    log = tmp_path / "router.log"
    router = _start_router(args, log)
    engine = SGLangEngine(SGLangClientConfig(
        router_url=base, retries=1, backoff_s=0.05, backoff_max_s=0.1,
        discover=PodWorkerDiscovery(PodDiscoverySpec(namespace=namespace, selector=worker_selector(job),
                                                     port=workers.port)),
        probe_timeout_s=1.0, probe_interval_s=0.2, probe_backoff_s=0.2, probe_backoff_max_s=1.0,
    ))
    transport = DistributedTransport([engine], DistributedOptions(master_address="127.0.0.1", backend="gloo",
                                                                   timeout_s=60))
    trainer = AutoModelForCausalLM.from_pretrained(workers.model)
    try:
        assert await router_workers(base) == set(), "started empty: nothing but the runtime adds workers"
        await engine.start()  # finds the two ready pods through the API server; both serve version 0
        await wait_until(lambda: _is(router_workers(base), set(urls[:2])), "the runtime to add the two workers",
                         timeout=60, interval=0.1)
        perturb(trainer, 1)
        report = await transport.sync(1, lambda _dtype: module_buckets(trainer, 16 * 1024))
        assert sorted(report.updated) == urls[:2] and not report.failed

        # Scale 2 -> 3: a ready pod whose server still holds its start-up weights (version 0).
        _worker_pod(kube_cluster, namespace, f"{JOB}-infer-cpu-2", "127.0.0.4")
        assert await engine.health()  # re-discovers and probes now, then reconciles the router
        new = engine.workers[urls[2]]
        assert new.reachable and new.served_version == 0, "the runtime knows the new worker, answering and behind"
        assert await router_workers(base) == set(urls[:2]), "a worker behind the current version is kept out"
        before = await _generated(urls[2])
        assert await _versions_through(base, ROUND_ROBIN_REQUESTS) == ["1"] * ROUND_ROBIN_REQUESTS
        assert await _generated(urls[2]) == before, "the worker with start-up weights received traffic"

        # The next sync rebuilds the weight-update group with the new member and gives it the weights.
        perturb(trainer, 2)
        expected = await greedy_of(trainer)
        report = await transport.sync(2, lambda _dtype: module_buckets(trainer, 16 * 1024))
        assert report.group_rebuilt and sorted(report.updated) == urls and not report.failed
        assert await served_versions(urls) == ["2", "2", "2"]
        assert await greedy_on(urls[2]) == expected, "the new worker serves the trainer's weights"
        await wait_until(lambda: _is(router_workers(base), set(urls)), "the runtime to add the caught-up worker",
                         timeout=60, interval=0.1)
        assert await _versions_through(base, ROUND_ROBIN_REQUESTS) == ["2"] * ROUND_ROBIN_REQUESTS
        assert await _generated(urls[2]) > before, "the caught-up worker received no traffic through the router"
        assert router.poll() is None, "the router lived through the scale"

        # A router that restarts comes back empty; the runtime refills it with the rotation.
        stop([router])
        router = _start_router(args, tmp_path / "router-restarted.log")
        await wait_until(lambda: _is(router_workers(base), set(urls)), "the runtime to refill the restarted router",
                         timeout=60, interval=0.1)
        assert await _versions_through(base, ROUND_ROBIN_REQUESTS) == ["2"] * ROUND_ROBIN_REQUESTS

        # A router that loses a worker without ever going down (no probe sees it fail) gets it back too:
        # the runtime compares with the router's own list, not with what it last sent.
        def adds() -> int:
            return sum(f"worker {urls[0]} serves weight version 2: added" in r.getMessage() for r in caplog.records)

        added_before = adds()
        async with httpx.AsyncClient() as http:
            listed = (await http.get(base + "/workers")).json()["workers"]
            (victim,) = [w for w in listed if w["url"].rstrip("/") == urls[0]]
            assert (await http.delete(f"{base}/workers/{victim['id']}")).status_code < 300
        await wait_until(lambda: adds() > added_before, "the runtime to re-add the dropped worker", timeout=60,
                         interval=0.1)
        await wait_until(lambda: _is(router_workers(base), set(urls)), "the router to list it again", timeout=60,
                         interval=0.1)
    finally:
        await transport.close()
        await engine.close()
        stop([router])
        print(f"--- router log ---\n{log.read_text()[-4000:]}")


async def _is(listed: Any, expected: set[str]) -> bool:
    """``await listed == expected``, tolerating a router that does not answer yet (it is restarting)."""
    try:
        return bool(await listed == expected)
    except httpx.HTTPError:
        return False
