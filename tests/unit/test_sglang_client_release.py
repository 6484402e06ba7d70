"""The SGLang client across releases and retries, over real loopback HTTP.

- Each worker's endpoints are detected once: the project's CPU server (current SGLang's endpoints) and
  a worker shaped like SGLang 0.5.5.post3 (no ``/model_info``, no ``/v1/loads``; its routes are the ones
  tests/unit/test_sglang_contract.py reads from that release).
- A ``/generate`` that outlives ``generate_timeout_s`` (requestTimeoutSeconds) is aborted on its worker
  and retried under a new rid (current SGLang refuses a repeated rid with 400).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from rljob.runtime.engines.base import GenerateRequest
from rljob.runtime.engines.embedded import EmbeddedEngine
from rljob.runtime.engines.protocol import MODEL_INFO, V1_LOADS, attempt_rid
from rljob.runtime.engines.server import SGLangProtocolServer
from rljob.runtime.engines.sglang_client import SGLangClientConfig, SGLangEngine
from tests.helpers.tiny_model import build_tiny_model
from tests.helpers.waiting import wait_until


def record_bodies(engine: SGLangEngine) -> list[tuple[str, Any]]:
    """Record (url, json body) of every request of the client's HTTP pool (the calls still go out)."""
    calls: list[tuple[str, Any]] = []
    real = engine._caller.request  # noqa: SLF001

    async def request(method: str, url: Any, **kwargs: Any):  # type: ignore[no-untyped-def]
        calls.append((str(url), kwargs.get("json")))
        return await real(method, url, **kwargs)

    engine._caller.request = request  # type: ignore[method-assign]  # noqa: SLF001
    return calls


@pytest.fixture
async def cpu_server() -> AsyncIterator[tuple[SGLangProtocolServer, str]]:
    """The project's SGLang-protocol server over a tiny model, and its base URL."""
    server = SGLangProtocolServer(EmbeddedEngine(build_tiny_model(seed=1), max_batch_size=2))
    url = await server.start()
    yield server, url
    await server.stop()


def test_every_attempt_gets_its_own_rid_under_the_callers() -> None:
    rids = [attempt_rid("r3-g1-s2-a0", n) for n in range(5)]
    assert rids[0] == "r3-g1-s2-a0"
    assert len(set(rids)) == 5 and all(r.startswith("r3-g1-s2-a0") for r in rids)


async def test_a_generate_past_its_read_timeout_is_aborted_then_retried_under_a_new_rid(
    cpu_server: tuple[SGLangProtocolServer, str],
) -> None:
    server, url = cpu_server
    # Two workers: the paused one may or may not answer /health meanwhile (real SGLang's /health is a
    # generation and blocks), so the retry may go to either; the outcome is the same.
    other = SGLangProtocolServer(EmbeddedEngine(build_tiny_model(seed=1), max_batch_size=2))
    urls = [url, await other.start()]
    engine = SGLangEngine(SGLangClientConfig(worker_urls=urls, generate_timeout_s=1.0, retries=4,
                                             backoff_s=0.01, backoff_max_s=0.05))
    calls = record_bodies(engine)
    try:
        await engine.start()
        server.engine.pause()  # the first attempt (to the first worker) cannot finish: the timeout ends it
        task = asyncio.create_task(engine.generate(GenerateRequest("r1-g0-s0-a0", [1, 2, 3], 4, temperature=0.0)))
        await wait_until(lambda: server.engine.stats.finished["abort"] >= 1, "the timed-out attempt aborted")
        server.engine.resume()
        result = await task
    finally:
        await engine.close()
        await other.stop()
    generates = [(u, body["rid"]) for u, body in calls if u.endswith("/generate")]
    aborts = [(u, body["rid"]) for u, body in calls if u.endswith("/abort_request")]
    assert generates[0] == (urls[0] + "/generate", "r1-g0-s0-a0")
    assert [rid for _, rid in generates][1] == "r1-g0-s0-a0-h1"
    assert len({rid for _, rid in generates}) == len(generates), "no rid is sent twice"
    assert aborts[0] == (urls[0] + "/abort_request", "r1-g0-s0-a0"), "aborted where it ran, by its exact rid"
    assert (result.rid, len(result.output_ids), result.finish_reason) == ("r1-g0-s0-a0", 4, "length")


async def test_the_cpu_server_is_used_through_current_sglangs_endpoints(
    cpu_server: tuple[SGLangProtocolServer, str],
) -> None:
    _, url = cpu_server
    engine = SGLangEngine(SGLangClientConfig(worker_urls=[url]))
    calls = record_bodies(engine)
    try:
        await engine.start()
        await engine.health()
        await engine.load()
        api = engine.workers[url].api
    finally:
        await engine.close()
    assert api is not None and (api.weight_version_path, api.load_path) == (MODEL_INFO, V1_LOADS)
    paths = [u.removeprefix(url) for u, _ in calls]
    assert "/get_weight_version" not in paths and "/get_load" not in paths
    assert paths.count(MODEL_INFO) >= 2, "detected once, then read for the version at every probe"


def _replying(payload: Any) -> Any:
    """An aiohttp handler answering 200 with ``payload`` as JSON (None: an empty body)."""
    async def handler(_request: web.Request) -> web.Response:
        return web.Response(status=200) if payload is None else web.json_response(payload)
    return handler


class OldRelease:
    """A worker with exactly SGLang 0.5.5.post3's health, info, version and load endpoints (reply shapes
    from its http_server.py), recording which paths were asked."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.app = web.Application(middlewares=[self._record])
        for path, payload in {
            "/health": None,
            "/health_generate": None,
            "/get_weight_version": {"weight_version": "0"},
            "/get_server_info": {"tp_size": 2, "dp_size": 1, "version": "0.5.5.post3"},
            "/get_load": [{"dp_rank": 0, "num_reqs": 3, "num_waiting_reqs": 1}],
        }.items():
            self.app.router.add_get(path, _replying(payload))

    @web.middleware
    async def _record(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.asked.append(request.path)
        return await handler(request)


async def test_a_0_5_5_worker_is_used_through_its_own_endpoints() -> None:
    worker = OldRelease()
    runner = web.AppRunner(worker.app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    engine = SGLangEngine(SGLangClientConfig(worker_urls=[url], probe_timeout_s=5))
    try:
        await engine.start()
        await engine.health()
        load = await engine.load()
        api = engine.workers[url].api
        in_rotation = [w.url for w in engine.table.rotation_workers()]
    finally:
        await engine.close()
        await runner.cleanup()
    assert api is not None and (api.release, api.tp_size, api.dp_size) == ("0.5.5.post3", 2, 1)
    assert (api.weight_version_path, api.load_path) == ("/get_weight_version", "/get_load")
    assert in_rotation == [url], "it serves version 0 by its /get_weight_version"
    assert (load.running, load.waiting) == (2, 1)
    assert worker.asked.count("/model_info") == 1, "detected once: the 404 probe is not repeated"
