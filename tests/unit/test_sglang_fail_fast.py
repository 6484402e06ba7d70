"""The SGLang client against dead endpoints (closed loopback ports, no mock): an abort to a dead
worker is tried once, generation through a dead router fails at once, and health counts the router."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from rljob.runtime.engines.base import EngineError, GenerateRequest
from rljob.runtime.engines.embedded import EmbeddedEngine
from rljob.runtime.engines.server import SGLangProtocolServer
from rljob.runtime.engines.sglang_client import SGLangClientConfig, SGLangEngine
from tests.helpers.tiny_model import build_tiny_model


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def count_calls(engine: SGLangEngine) -> list[str]:
    """Record every URL the client's HTTP pool is asked for (the real calls still go out)."""
    calls: list[str] = []
    real = engine._caller.request  # noqa: SLF001

    async def request(method: str, url: Any, **kwargs: Any):  # type: ignore[no-untyped-def]
        calls.append(str(url))
        return await real(method, url, **kwargs)

    engine._caller.request = request  # type: ignore[method-assign]  # noqa: SLF001
    return calls


async def test_abort_to_a_dead_worker_is_tried_once():
    dead = closed_port_url()
    engine = SGLangEngine(SGLangClientConfig(worker_urls=[dead], retries=5, backoff_s=1.0))
    calls = count_calls(engine)
    try:
        await engine.abort_all()  # logs, never raises
        assert calls.count(dead + "/abort_request") == 1, calls
        assert not engine.workers[dead].healthy
    finally:
        await engine.close()


async def test_generation_through_a_dead_router_fails_at_once_and_health_says_so():
    server = SGLangProtocolServer(EmbeddedEngine(build_tiny_model(seed=1), max_batch_size=2))
    worker = await server.start()
    router = closed_port_url()
    engine = SGLangEngine(SGLangClientConfig(worker_urls=[worker], router_url=router, retries=5, backoff_s=1.0))
    calls = count_calls(engine)
    try:
        with pytest.raises(EngineError, match="router .* refused"):
            await engine.generate(GenerateRequest("r1", [1, 2, 3], 4, temperature=0.0))
        assert calls.count(router + "/generate") == 1
        assert not await engine.health(), "workers alone do not make the engine healthy when its router is down"
        with pytest.raises(EngineError, match="router .* is down"):
            await engine.generate(GenerateRequest("r2", [1, 2, 3], 4, temperature=0.0))
        assert calls.count(router + "/generate") == 1, "no call while the router is known to be down"
        direct = SGLangEngine(SGLangClientConfig(worker_urls=[worker]))
        assert await direct.health()
        await direct.close()
    finally:
        await engine.close()
        await server.stop()
