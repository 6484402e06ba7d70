"""The engine API key end to end: a CPU SGLang-protocol server and the REAL sglang router, both started
with ``--api-key`` as the operator starts them, refuse callers without the key, while the runtime's
client, which sends it, generates through the router, updates weights and aborts.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from rljob.runtime.engines.base import GenerateRequest
from rljob.runtime.engines.sglang_client import SGLangClientConfig, SGLangEngine
from tests.helpers.processes import start_router, start_worker, stop, wait_http
from tests.helpers.tiny_model import save_tiny_model
from tests.helpers.waiting import wait_until

KEY = "test-engine-key-0123456789"
# The control calls an attacker in the cluster would make, with bodies SGLang accepts.
CONTROL_CALLS = {
    "/update_weights_from_disk": {"model_path": "/tmp/poisoned", "weight_version": "7"},
    "/init_weights_update_group": {"master_address": "10.0.0.66", "master_port": 29600, "rank_offset": 1,
                                   "world_size": 2, "group_name": "evil", "backend": "gloo"},
    "/abort_request": {"rid": "", "abort_all": True},
    "/update_weight_version": {"new_version": "7"},
    "/pause_generation": {"mode": "abort"},
}


@dataclass
class Served:
    worker: str
    router: str
    model_dirs: tuple[Path, Path]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("auth")
    models = save_tiny_model(root / "seed0", seed=0), save_tiny_model(root / "seed1", seed=1)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        worker, proc = start_worker(models[0], root / "worker.log", max_batch_size=4, extra_args=("--api-key", KEY))
        procs.append(proc)
        wait_http(worker + "/health_generate", 180, proc, root / "worker.log")  # probes need no key
        router, proc = start_router([], root / "router.log", extra_args=("--api-key", KEY))
        procs.append(proc)
        wait_http(router + "/liveness", 60, proc, root / "router.log")
        yield Served(worker, router, models)
    finally:
        stop(procs)


def test_control_calls_without_the_key_are_refused_as_sglang_does(served: Served) -> None:
    with httpx.Client(timeout=30) as http:
        for path, body in CONTROL_CALLS.items():
            for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": KEY}):
                reply = http.post(served.worker + path, json=body, headers=headers)
                assert (reply.status_code, reply.json()) == (401, {"error": "Unauthorized"}), (path, headers)
        assert http.post(served.worker + "/generate", json={"input_ids": [5, 6], "sampling_params": {}}).status_code == 401
        # Nothing reached a handler: the worker still serves its start-up version.
        info = http.get(served.worker + "/get_server_info", headers={"Authorization": f"Bearer {KEY}"})
        assert info.status_code == 200 and info.json()["weight_version"] == "0"
        # Probes and Prometheus stay open (the kubelet and the scraper hold no key).
        for path in ("/health", "/health_generate", "/metrics"):
            assert http.get(served.worker + path).status_code == 200, path
    # The router: no worker may be added and nothing generated without the key. One connection per call: the
    # router closes a connection after refusing a request, so a pooled one may be gone by the next call.
    assert httpx.post(served.router + "/workers", json={"url": "http://10.0.0.66:30000"}, timeout=30).status_code == 401
    assert httpx.post(served.router + "/generate", json={"input_ids": [5], "sampling_params": {}}, timeout=30).status_code == 401
    assert httpx.get(served.router + "/workers", timeout=30).status_code == 401


async def test_the_client_with_the_key_adds_the_worker_generates_and_updates_weights(served: Served) -> None:
    client = SGLangEngine(SGLangClientConfig(
        worker_urls=[served.worker], router_url=served.router, api_key=KEY, retries=2, backoff_s=0.05,
        backoff_max_s=0.2, health_timeout_s=120, probe_timeout_s=5.0,
    ))
    await client.start()
    try:
        # start() put the worker into the router through its authenticated worker API (with the key for
        # the router to use towards it); the router activates it in the background.
        async def router_lists_worker() -> bool:
            async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}) as http:
                listed = (await http.get(served.router + "/workers", timeout=10)).json()["workers"]
            return {w["url"].rstrip("/") for w in listed} == {served.worker}

        await wait_until(router_lists_worker, "the router listing the worker", timeout=120, interval=0.2)
        result = await client.generate(GenerateRequest(rid="auth-1", input_ids=[5, 6, 7], max_new_tokens=4,
                                                       temperature=0.0))
        assert result.finish_reason == "length" and len(result.output_ids) == 4
        synced = await client.update_weights_from_disk(str(served.model_dirs[1]), 1)
        assert synced.updated == [served.worker] and not synced.failed
        await client.abort_all()
    finally:
        await client.close()
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}) as http:
        info = (await http.get(served.worker + "/get_server_info", timeout=30)).json()
    assert info["weight_version"] == "1"
