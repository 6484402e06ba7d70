"""The SGLang client's HTTP failure policy (runtime/engines/http_retry.py) against a real server on loopback:
what is retried (5xx, a lost connection), what fails fast (a refused connection) and what is returned as is."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from rljob.runtime.engines.http_retry import HttpCaller, NoReply, Reply, RetryPolicy

FAST = RetryPolicy(retries=3, backoff_s=0.001, backoff_max_s=0.002, timeout_s=10.0)


@dataclass
class Script:
    """The statuses the server answers, one per request (the last repeats), and the requests it saw."""

    statuses: list[int]
    seen: int = 0
    never_answer: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: web.Request) -> web.Response:
        self.seen += 1
        status = self.statuses[min(self.seen, len(self.statuses)) - 1]
        if status == 0:  # hold the request until the server stops: the client's read timeout fires
            await self.never_answer.wait()
        return web.Response(status=status, text=f"answer {self.seen}")


@pytest.fixture
async def server() -> AsyncIterator[tuple[Script, str]]:
    script = Script(statuses=[200])
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", script.handle)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield script, f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        script.never_answer.set()
        await runner.cleanup()


@pytest.fixture
async def caller() -> AsyncIterator[RecordingCaller]:
    recording = RecordingCaller(FAST)
    try:
        yield recording
    finally:
        await recording.close()


class RecordingCaller(HttpCaller):
    """The real caller, noting each backoff (one before every retry)."""

    def __init__(self, policy: RetryPolicy) -> None:
        super().__init__(policy)
        self.backoffs: list[int] = []

    async def backoff(self, attempt: int) -> None:
        self.backoffs.append(attempt)
        await super().backoff(attempt)


def closed_port_url() -> str:
    """A loopback URL nothing listens on (the port was bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


async def test_5xx_is_retried_until_an_answer(server: tuple[Script, str], caller: RecordingCaller) -> None:
    script, url = server
    script.statuses = [503, 502, 200]
    resp = await caller.call_with_retries("POST", f"{url}/update_weights_from_disk", json={"x": 1})
    assert (resp.status_code, resp.text, script.seen, caller.backoffs) == (200, "answer 3", 3, [0, 1])


async def test_retries_run_out_with_the_last_no_reply(server: tuple[Script, str], caller: RecordingCaller) -> None:
    script, url = server
    script.statuses = [500]
    with pytest.raises(NoReply) as err:
        await caller.call_with_retries("GET", f"{url}/get_model_info")
    assert err.value.sent and not err.value.timed_out and "HTTP 500" in str(err.value)
    assert script.seen == FAST.retries + 1 and caller.backoffs == [0, 1, 2]


async def test_a_4xx_is_returned_as_it_is_never_retried(server: tuple[Script, str], caller: RecordingCaller) -> None:
    script, url = server
    script.statuses = [400, 200]
    resp = await caller.call_with_retries("POST", f"{url}/generate")
    assert (resp.status_code, script.seen, caller.backoffs) == (400, 1, [])


async def test_a_refused_connection_fails_fast(caller: RecordingCaller) -> None:
    url = closed_port_url()
    with pytest.raises(NoReply) as err:
        await caller.call_with_retries("GET", f"{url}/health")
    assert not err.value.sent and "connection failed" in str(err.value) and caller.backoffs == []


async def test_the_read_timeout_says_the_server_may_still_be_working(server: tuple[Script, str],
                                                                    caller: RecordingCaller) -> None:
    script, url = server
    script.statuses = [0]
    with pytest.raises(NoReply) as err:
        await caller.call("POST", f"{url}/generate", timeout=0.2)
    assert err.value.sent and err.value.timed_out and script.seen == 1


async def test_probe_is_true_only_on_200(server: tuple[Script, str], caller: RecordingCaller) -> None:
    script, url = server
    script.statuses = [200, 503]
    assert await caller.probe(f"{url}/health", timeout=5.0) is True
    assert await caller.probe(f"{url}/health", timeout=5.0) is False
    assert await caller.probe(f"{closed_port_url()}/health", timeout=5.0) is False


@pytest.fixture
async def dropping_server() -> AsyncIterator[tuple[list[int], str]]:
    """A server that reads each request and closes the connection without a reply; counts them."""
    seen: list[int] = []

    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        seen.append(1)
        writer.close()

    server = await asyncio.start_server(drop, "127.0.0.1", 0)
    try:
        yield seen, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


async def test_a_connection_dropped_before_the_reply_is_lost_and_retried(
        dropping_server: tuple[list[int], str], caller: RecordingCaller) -> None:
    seen, url = dropping_server
    with pytest.raises(NoReply) as err:  # a POST: aiohttp itself resends a GET once on a dropped connection
        await caller.call_with_retries("POST", f"{url}/update_weights_from_disk", json={})
    # The request reached the server (it may have acted on it): not a refused connection, not a timeout.
    assert err.value.sent and not err.value.timed_out and "connection lost" in str(err.value)
    assert len(seen) == FAST.retries + 1 and caller.backoffs == [0, 1, 2]


def test_a_caller_serves_one_event_loop_after_another() -> None:
    """A job's engines outlive an event loop (a CLI command that runs several): the pool is made anew."""
    caller = HttpCaller(FAST)

    async def refused() -> bool:
        with pytest.raises(NoReply) as err:
            await caller.call("GET", f"{closed_port_url()}/health")
        return err.value.sent

    assert asyncio.run(refused()) is False
    assert asyncio.run(refused()) is False
    asyncio.run(caller.close())


def test_a_reply_that_is_not_json_raises_value_error() -> None:
    assert Reply(200, b'{"a": [1]}').json() == {"a": [1]}
    assert Reply(503, b"\xffbusy").text == "\ufffdbusy"
    with pytest.raises(ValueError):
        Reply(200, b"<html>").json()
