"""HTTP calls to SGLang servers with the client's failure policy (reference/sglang_protocol.md §4).

- A transport error or a 5xx is ``NoReply``; it says whether the request may have reached the
  server (``sent``) and whether it was the read timeout (the server may still be working on it).
- Idempotent calls retry with exponential backoff and jitter on a lost connection and on 5xx, but
  not on a refused connection: nothing listens, the worker is dead, fail fast (membership.retry_call).
- Any other reply (2xx, 4xx) is returned as it is: what it means is the caller's to judge.

Why aiohttp and not httpx: a rollout keeps hundreds of ``/generate`` calls in flight, and httpx's
connection pool (httpcore 1.0) walks every pooled connection, with a system call or two each, whenever
a request starts or ends. At 128 calls in flight on loopback that cost 4.5 ms of client CPU per call
(about 200 calls per second on a core), against 0.23 ms with aiohttp's connector
(benchmarks/http_client.py, http_client.json). The time-to-reward benchmark's trainer process spent 62 % of its event
loop there, and its engine ran half its decode steps with fewer than 8 rows while the client caught up.
"""

from __future__ import annotations

import asyncio
import json as jsonlib
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from rljob.runtime.engines.membership import retry_call


@dataclass(frozen=True)
class Timeout:
    """Limits of one call: to connect, and between bytes of the reply once sent (read)."""

    read_s: float
    connect_s: float | None = None  # None: read_s

    def client_timeout(self) -> aiohttp.ClientTimeout:
        """aiohttp's form. No limit on the whole call: a long generation keeps its bytes coming."""
        return aiohttp.ClientTimeout(total=None, sock_connect=self.connect_s or self.read_s, sock_read=self.read_s)


@dataclass(frozen=True)
class Reply:
    """An HTTP reply, read whole (every reply an SGLang server sends is one JSON or text body)."""

    status_code: int
    content: bytes

    @property
    def text(self) -> str:
        """The body as text (undecodable bytes replaced)."""
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The body as JSON; ValueError when it is not."""
        return jsonlib.loads(self.content)


class NoReply(Exception):
    """A call got no usable reply; ``sent`` says whether the request may have reached the server,
    ``timed_out`` whether it was the read timeout (the server may still be working on it)."""

    def __init__(self, url: str, detail: str, sent: bool, timed_out: bool = False) -> None:
        super().__init__(f"{url}: {detail}")
        self.url = url
        self.sent = sent
        self.timed_out = timed_out


def strip_url(url: str) -> str:
    """A base URL without its trailing slashes (the workers' keys)."""
    return url.rstrip("/")


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a call is retried."""

    retries: int = 4
    backoff_s: float = 0.25  # first retry delay; doubles up to backoff_max_s (with jitter)
    backoff_max_s: float = 4.0
    timeout_s: float = 30.0  # a call's timeout unless it names its own


class HttpCaller:
    """One connection pool (aiohttp, made in the event loop that first calls) and the failure policy of
    the module docstring. Proxy variables of the environment are not read: the calls go to the job's own
    pods and router. aiohttp itself sends an idempotent request (GET, DELETE) once more when the server
    closed the connection without replying (RFC 9112 §9.3.1); a POST, such as ``/generate``, never."""

    def __init__(self, policy: RetryPolicy, headers: Mapping[str, str] | None = None,
                 keepalive_s: float = 15.0) -> None:
        """``headers`` go with every call (the API key); a pooled connection idle for ``keepalive_s``
        is closed (the SGLang client passes protocol.CLIENT_KEEPALIVE_EXPIRY_S: before the server closes
        it; 15 s is aiohttp's own default)."""
        self.policy = policy
        self._headers = dict(headers or {})
        self._keepalive_s = keepalive_s
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the session's: a pool serves one loop

    def _pool(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            # A session from a loop that has ended cannot be closed from this one: it is let go.
            # No connection cap here: the engine's slots bound the /generate calls (capacity.py).
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=self._keepalive_s)
            self._session = aiohttp.ClientSession(connector=connector, headers=self._headers)
            self._loop = loop
        return self._session

    async def close(self) -> None:
        """Close the pool's connections."""
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    async def request(self, method: str, url: str, *, json: Any = None, params: Mapping[str, str] | None = None,
                      timeout: Timeout | float | None = None) -> Reply:
        """One HTTP call, whatever its status; raises NoReply only when no reply came back."""
        limits = timeout if isinstance(timeout, Timeout) else Timeout(timeout or self.policy.timeout_s)
        try:
            async with self._pool().request(method, url, json=json, params=params,
                                            timeout=limits.client_timeout()) as resp:
                return Reply(resp.status, await resp.read())
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            raise NoReply(url, f"connection failed ({type(exc).__name__}: {exc})", sent=False) from exc
        except TimeoutError as exc:  # aiohttp's read timeout (SocketTimeoutError) is a TimeoutError
            raise NoReply(url, f"no reply within the read timeout ({limits.read_s:g} s)", sent=True,
                          timed_out=True) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise NoReply(url, f"connection lost ({type(exc).__name__}: {exc})", sent=True) from exc

    async def call(self, method: str, url: str, *, json: Any = None, timeout: Timeout | float | None = None) -> Reply:
        """One HTTP call; raises NoReply on transport errors and 5xx, returns any other reply."""
        resp = await self.request(method, url, json=json, timeout=timeout)
        if resp.status_code >= 500:
            raise NoReply(url, f"HTTP {resp.status_code}: {resp.text[:200]}", sent=True)
        return resp

    async def call_with_retries(
        self, method: str, url: str, *, json: Any = None, timeout: Timeout | float | None = None
    ) -> Reply:
        """call() for idempotent requests: retried with exponential backoff, last NoReply re-raised."""
        attempt = 0
        while True:
            try:
                return await self.call(method, url, json=json, timeout=timeout)
            except NoReply as exc:
                if not retry_call(exc.sent, attempt, self.policy.retries):
                    raise
                await self.backoff(attempt)
                attempt += 1

    async def backoff(self, attempt: int) -> None:
        """Wait before retry ``attempt + 1``: exponential, capped, with jitter."""
        delay = min(self.policy.backoff_max_s, self.policy.backoff_s * (2**attempt))
        await asyncio.sleep(delay * (0.5 + random.random() / 2))

    async def probe(self, url: str, timeout: float) -> bool:
        """GET ``url`` once; True on HTTP 200, False on anything else or no answer."""
        try:
            resp = await self.request("GET", url, timeout=timeout)
        except NoReply:
            return False
        return resp.status_code == 200
