"""What the real sglang router (the pinned release, started with the operator's flags) does with the
client's requests: it forwards the /generate body's decoding parameters unchanged, so the router path
and the direct path decode alike, and its worker API (POST /workers, GET /workers, DELETE
/workers/{id}) takes and drops workers as the client's membership rules say.

The worker is a recorder on loopback that answers with SGLang's reply shapes and keeps every /generate
body it receives exactly as the router sent it (the project's CPU server would parse it first).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from rljob.runtime.engines.base import GenerateRequest
from rljob.runtime.engines.protocol import generate_call
from rljob.runtime.engines.sglang_client import SGLangClientConfig, SGLangEngine
from tests.helpers.processes import start_router, stop, wait_http
from tests.helpers.waiting import wait_until


@dataclass
class Recorder:
    """A worker that records /generate bodies and serves ``version`` as its weight version."""

    version: str = "0"
    bodies: list[dict[str, Any]] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        info = {"tp_size": 1, "dp_size": 1, "version": "0.5.23", "model_path": "m", "max_total_num_tokens": 4096}
        for path in ("/health", "/health_generate"):
            app.router.add_get(path, self._ok)
        for path in ("/model_info", "/get_model_info"):
            app.router.add_get(path, self._model_info)
        for path in ("/server_info", "/get_server_info"):
            app.router.add_get(path, self._json(info))
        app.router.add_get("/v1/loads", self._json({"loads": [{"num_running_reqs": 0, "num_waiting_reqs": 0}]}))
        app.router.add_post("/generate", self._generate)
        return app

    async def _ok(self, _request: web.Request) -> web.Response:
        return web.Response(status=200)

    def _json(self, payload: Any) -> Any:
        async def handler(_request: web.Request) -> web.Response:
            return web.json_response(payload)
        return handler

    async def _model_info(self, _request: web.Request) -> web.Response:
        return web.json_response({"model_path": "m", "is_generation": True, "weight_version": self.version})

    async def _generate(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        self.bodies.append(body)
        return web.json_response({
            "text": "x", "output_ids": [7],
            "meta_info": {"id": body.get("rid"), "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 3,
                          "completion_tokens": 1, "output_token_logprobs": [[-0.1, 7, None]],
                          "weight_version": self.version},
        })


@pytest.fixture
async def recorder() -> AsyncIterator[tuple[Recorder, str]]:
    worker = Recorder()
    runner = web.AppRunner(worker.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield worker, f"http://127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


async def _router_workers(router: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient() as http:
        return list((await http.get(router + "/workers")).json()["workers"])


async def test_the_router_forwards_the_decoding_parameters_and_follows_the_worker_api(
    recorder: tuple[Recorder, str], tmp_path: Path
) -> None:
    worker, url = recorder
    log = tmp_path / "router.log"
    router, proc = start_router([], log)  # empty, as the operator starts it: the client adds the worker
    engine = SGLangEngine(SGLangClientConfig(worker_urls=[url], router_url=router, probe_interval_s=0.2))
    try:
        wait_http(router + "/liveness", 60, proc, log)
        await engine.start()
        await wait_until(lambda: _listed(router, url), "the router lists the worker the client added (POST /workers)")

        request = GenerateRequest("r1-g0-s0-a0", [1, 2, 3], 1, temperature=0.7, top_p=0.9, top_k=20,
                                  stop_token_ids=[2], stop=["</a>"])
        result = await engine.generate(request)
        assert (result.rid, result.output_ids) == ("r1-g0-s0-a0", [7])
        sent = generate_call(request, request.rid).body
        assert sent is not None
        [received] = worker.bodies
        # Every decoding parameter the client sends arrives as sent: the direct path (the same body to the
        # worker) and the router path decode alike.
        assert {k: received["sampling_params"].get(k) for k in sent["sampling_params"]} == sent["sampling_params"]
        assert (received["input_ids"], received["rid"], received["return_logprob"]) == ([1, 2, 3], request.rid, True)

        worker.version = "5"  # no longer the job's version: the client takes it out (DELETE /workers/{id})
        await engine.table.probe_all()
        assert await _router_workers(router) == []
    finally:
        await engine.close()
        stop([proc])


async def _listed(router: str, url: str) -> bool:
    return url in [w["url"].rstrip("/") for w in await _router_workers(router)]
