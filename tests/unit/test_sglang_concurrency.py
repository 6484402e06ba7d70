"""The SGLang client's concurrency follows its workers' own capacity, and nothing is sent after an abort.

Eight SGLang-protocol servers (the project's CPU server, real HTTP on loopback, in this process) each
run at most 2 requests at once and say so in their server info (``max_running_requests``, as SGLang's
``/get_server_info`` spreads ServerArgs). The client must hold 16 calls in flight, not one fixed
number for the whole pool, and a request still waiting for a slot when ``abort_all`` runs must come
back aborted without ever being sent: every ``/generate`` the client's HTTP pool sends is recorded with
the abort epoch at that moment.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from rljob.runtime.engines.base import GenerateRequest
from rljob.runtime.engines.embedded import EmbeddedEngine
from rljob.runtime.engines.server import SGLangProtocolServer
from rljob.runtime.engines.sglang_client import SGLangClientConfig, SGLangEngine
from tests.helpers.tiny_model import build_tiny_model
from tests.helpers.waiting import wait_until

WORKERS = 8
PER_WORKER = 2  # each server's max_batch_size, reported as max_running_requests


@pytest.fixture
async def pool() -> AsyncIterator[list[str]]:
    model = build_tiny_model(seed=1)
    servers = [SGLangProtocolServer(EmbeddedEngine(model, max_batch_size=PER_WORKER, seed=i)) for i in range(WORKERS)]
    urls = []
    try:
        for server in servers:
            urls.append(await server.start())
        yield urls
    finally:
        await asyncio.gather(*(s.stop() for s in servers))


def record_generates(engine: SGLangEngine) -> list[tuple[str, int]]:
    """(URL, the client's abort epoch then) of every /generate the client's HTTP pool sends (they still go out)."""
    sent: list[tuple[str, int]] = []
    real = engine._caller.request  # noqa: SLF001

    async def request(method: str, url: Any, **kwargs: Any):  # type: ignore[no-untyped-def]
        if str(url).endswith("/generate"):
            sent.append((str(url), engine._abort_epoch))  # noqa: SLF001
        return await real(method, url, **kwargs)

    engine._caller.request = request  # type: ignore[method-assign]  # noqa: SLF001
    return sent


async def test_in_flight_calls_grow_with_the_workers_capacity_and_none_is_sent_after_an_abort(pool: list[str]):
    # worker_concurrency far above the servers' own: it must not be what the client uses.
    engine = SGLangEngine(SGLangClientConfig(worker_urls=pool, worker_concurrency=1000, drain_timeout_s=120))
    sent = record_generates(engine)
    tasks: list[asyncio.Task[Any]] = []
    peak = 0
    try:
        await engine.start()
        assert [engine.worker_capacity(w) for w in engine.workers.values()] == [PER_WORKER] * WORKERS
        tasks = [asyncio.create_task(engine.generate(GenerateRequest(f"r{i}", [1, 2, 3], 400, temperature=1.0)))
                 for i in range(5 * WORKERS * PER_WORKER)]

        def saturated() -> bool:
            nonlocal peak
            peak = max(peak, engine.in_flight)
            return engine.in_flight == WORKERS * PER_WORKER

        await wait_until(saturated, "the client holding one call per worker slot", timeout=120)
        assert len({url for url, _ in sent}) == WORKERS, "the calls did not spread over every worker"
        await engine.abort_all()
        results = await asyncio.gather(*tasks)
        after = [url for url, epoch in sent if epoch > 0]
        assert not after, f"{len(after)} /generate calls went out after abort_all: {after[:3]}"
        never_sent = [r for r in results if r.finish_reason == "abort" and not r.output_ids]
        assert len(never_sent) >= len(tasks) - len(sent), "queued requests must come back aborted, untouched"
        assert peak <= WORKERS * PER_WORKER
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await engine.close()
