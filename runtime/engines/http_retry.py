"""HTTP calls to SGLang servers with the client's failure policy (reference/sglang_protocol.md §4).

- A transport error or a 5xx is ``NoReply``; it says whether the request may have reached the
  server (``sent``) and whether it was the read timeout (the server may still be working on it).
- Idempotent calls retry with exponential backoff and jitter on a lost connection and on 5xx, but
  not on a refused connection: nothing listens, the worker is dead, fail fast (membership.retry_call).
- Any other reply (2xx, 4xx) is returned as it is: what it means is the caller's to judge.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any

import httpx

from rljob.runtime.engines.membership import retry_call


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
    """One connection pool and the failure policy of the module docstring."""

    def __init__(self, http: httpx.AsyncClient, policy: RetryPolicy) -> None:
        self.http = http
        self.policy = policy

    async def call(
        self, method: str, url: str, *, json: Any = None, timeout: httpx.Timeout | float | None = None
    ) -> httpx.Response:
        """One HTTP call; raises NoReply on transport errors and 5xx, returns any other response."""
        try:
            resp = await self.http.request(method, url, json=json, timeout=timeout or self.policy.timeout_s)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise NoReply(url, f"connection failed ({type(exc).__name__}: {exc})", sent=False) from exc
        except httpx.ReadTimeout as exc:
            raise NoReply(url, f"no reply within the read timeout ({exc})", sent=True, timed_out=True) from exc
        except httpx.TransportError as exc:
            raise NoReply(url, f"connection lost ({type(exc).__name__}: {exc})", sent=True) from exc
        if resp.status_code >= 500:
            raise NoReply(url, f"HTTP {resp.status_code}: {resp.text[:200]}", sent=True)
        return resp

    async def call_with_retries(
        self, method: str, url: str, *, json: Any = None, timeout: httpx.Timeout | float | None = None
    ) -> httpx.Response:
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
            resp = await self.http.get(url, timeout=timeout)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200
