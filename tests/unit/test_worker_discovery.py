"""Runtime worker discovery: which pods are SGLang workers now (pure selection), and how the SGLang
engine adopts a changed worker set (real HTTP on loopback, discovery as a plain async function)."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from rljob.api.spec import PodDiscoverySpec
from rljob.common.kube import KubeError
from rljob.runtime.engines.base import WeightUpdate
from rljob.runtime.engines.discovery import DiscoveryError, PodWorkerDiscovery, worker_urls
from rljob.runtime.engines.sglang_client import SGLangClientConfig, SGLangEngine


def pod(name: str, ip: str | None = "10.0.0.1", ready: bool = True, phase: str = "Running", **extra: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if extra.get("deleting"):
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    spec = {"hostname": name, "subdomain": extra["subdomain"]} if "subdomain" in extra else {}
    status: dict[str, Any] = {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "spec": spec, "status": status}


def test_only_ready_running_pods_with_an_address_are_workers() -> None:
    pods = [
        pod("p-2", "10.0.0.2"),
        pod("p-0", "10.0.0.9"),
        pod("loading", "10.0.0.3", ready=False),
        pod("pending", None, ready=False, phase="Pending"),
        pod("leaving", "10.0.0.4", deleting=True),
        pod("done", "10.0.0.5", phase="Succeeded"),
    ]
    assert worker_urls(pods, "ns", 30000) == ["http://10.0.0.2:30000", "http://10.0.0.9:30000"]


def test_statefulset_pods_are_addressed_by_their_stable_dns_name() -> None:
    pods = [pod("job-infer-nv-1", "10.0.0.7", subdomain="job-infer-nv"), pod("job-infer-nv-0", "10.0.0.8", subdomain="job-infer-nv")]
    assert worker_urls(pods, "team-a", 30000) == [
        "http://job-infer-nv-0.job-infer-nv.team-a.svc:30000",
        "http://job-infer-nv-1.job-infer-nv.team-a.svc:30000",
    ]


class FlakyKube:
    """Stands in for rljob.common.kube.Kube's list call: fails `failures` times, then answers."""

    def __init__(self, failures: list[Exception], pods: list[dict[str, Any]]) -> None:
        self.failures = failures
        self.pods = pods
        self.calls: list[tuple[str, str, str, str]] = []

    def list(self, api_version: str, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        self.calls.append((api_version, kind, namespace, selector))
        if self.failures:
            raise self.failures.pop(0)
        return self.pods


SPEC = PodDiscoverySpec(namespace="ns", selector={"rljob.io/role": "inference", "rljob.io/job-name": "j"}, port=8000)


def test_discovery_lists_by_selector_and_retries_transient_errors() -> None:
    kube = FlakyKube([KubeError(503, "unavailable"), ConnectionRefusedError("refused")], [pod("a", "10.1.0.1")])
    discovery = PodWorkerDiscovery(SPEC, kube=kube, backoff_s=0.001)  # type: ignore[arg-type]
    assert asyncio.run(discovery()) == ["http://10.1.0.1:8000"]
    assert kube.calls[-1] == ("v1", "Pod", "ns", "rljob.io/job-name=j,rljob.io/role=inference")
    assert len(kube.calls) == 3


def test_discovery_names_the_missing_permission_and_gives_up_after_retries() -> None:
    refused = PodWorkerDiscovery(SPEC, kube=FlakyKube([KubeError(403, "forbidden")], []), backoff_s=0.001)  # type: ignore[arg-type]
    try:
        asyncio.run(refused())
    except DiscoveryError as err:
        assert "get/list/watch on pods" in str(err)
    else:
        raise AssertionError("a 403 must raise DiscoveryError")
    down = PodWorkerDiscovery(SPEC, kube=FlakyKube([KubeError(500, "x")] * 3, []), retries=2, backoff_s=0.001)  # type: ignore[arg-type]
    try:
        asyncio.run(down())
    except DiscoveryError as err:
        assert "after 3 attempts" in str(err)
    else:
        raise AssertionError("exhausted retries must raise DiscoveryError")


async def _workers(count: int, received: list[tuple[str, str]]) -> tuple[list[str], list[web.AppRunner]]:
    """HTTP workers on loopback answering the SGLang endpoints this test needs (/health, /health_generate,
    /update_weights_from_disk, /get_weight_version: the client checks every worker's served version);
    a stand-in for SGLang, which needs a GPU. Records (worker, path)."""
    urls, runners = [], []
    for _ in range(count):
        url_box: list[str] = []
        version = ["0"]

        async def answer(request: web.Request, url_box: list[str] = url_box, version: list[str] = version) -> web.Response:
            received.append((url_box[0], request.path))
            if request.path == "/update_weights_from_disk":
                version[0] = (await request.json())["weight_version"]
            if request.path == "/get_weight_version":
                return web.json_response({"weight_version": version[0]})
            return web.json_response({"success": True})

        app = web.Application()
        app.router.add_get("/health", answer)
        app.router.add_get("/health_generate", answer)
        app.router.add_get("/get_weight_version", answer)
        app.router.add_post("/update_weights_from_disk", answer)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        url_box.append(f"http://127.0.0.1:{port}")
        urls.append(url_box[0])
        runners.append(runner)
    return urls, runners


def test_engine_adopts_scaled_workers_before_each_weight_update() -> None:
    async def scenario() -> None:
        received: list[tuple[str, str]] = []
        urls, runners = await _workers(3, received)
        current = urls[:2]

        async def discover() -> list[str]:
            return list(current)

        engine = SGLangEngine(SGLangClientConfig(discover=discover, health_timeout_s=10))
        try:
            await engine.start()
            assert sorted(engine.workers) == sorted(urls[:2])
            current.append(urls[2])  # the pool scaled from 2 to 3
            await engine.update_weights(WeightUpdate(version=1, path="/w/v1"))
            updated = {u for u, p in received if p == "/update_weights_from_disk"}
            assert updated == set(urls), "the new worker gets the weights of the update after it joined"
            current.remove(urls[0])  # scaled down again
            await engine.health()
            assert sorted(engine.workers) == sorted(urls[1:])
        finally:
            await engine.close()
            for runner in runners:
                await runner.cleanup()

    asyncio.run(scenario())


def test_a_failing_discovery_keeps_the_known_workers() -> None:
    async def scenario() -> None:
        calls = 0

        async def discover() -> list[str]:
            nonlocal calls
            calls += 1
            if calls > 1:
                raise DiscoveryError("API server down")
            return ["http://127.0.0.1:1"]

        engine = SGLangEngine(SGLangClientConfig(discover=discover, probe_timeout_s=0.2))
        await engine.table.refresh_workers()
        await engine.table.refresh_workers()
        assert list(engine.workers) == ["http://127.0.0.1:1"] and calls == 2
        await engine.close()

    asyncio.run(scenario())
