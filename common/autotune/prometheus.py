"""A small Prometheus HTTP API client: instant queries with timeouts and typed failures.

Nothing is guessed: an unreachable server, a rejected query and an empty result are three
different exceptions, so the autotuner can keep the last knobs and say exactly why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Self

import httpx


class PrometheusError(Exception):
    """Base of every failure of a Prometheus read."""

    kind = "error"


class PrometheusUnavailable(PrometheusError):
    """Server unreachable, timed out, or answered 5xx/non-JSON: retry later."""

    kind = "unavailable"


class PrometheusQueryError(PrometheusError):
    """The server rejected the query (bad PromQL, 4xx, status "error"): retrying will not help."""

    kind = "query"


class NoData(PrometheusError):
    """The query succeeded but matched no series (runtime not scraped yet, or a wrong selector)."""

    kind = "nodata"


class AmbiguousResult(PrometheusError):
    """A query expected to return one series returned several."""

    kind = "ambiguous"


@dataclass(frozen=True)
class VectorSample:
    """One series of an instant vector."""

    labels: dict[str, str]
    value: float
    timestamp: float


class PrometheusClient:
    """Instant queries against one Prometheus server (`/api/v1/query`).

    With `http`, requests go through that shared connection pool (see PrometheusPool), which the
    client does not close; without it, the client owns a pool of its own.
    """

    def __init__(
        self,
        address: str,
        timeout_s: float = 5.0,
        bearer_token: str | None = None,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self.address = address.rstrip("/")
        self.timeout_s = timeout_s
        self._headers = {"Authorization": f"Bearer {bearer_token}"} if bearer_token else {}
        self._owned = http is None
        self._client = http if http is not None else httpx.AsyncClient()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool if this client owns it."""
        if self._owned:
            await self._client.aclose()

    async def query(self, expr: str, time: float | None = None) -> list[VectorSample]:
        """Evaluate `expr`; returns the instant vector (a scalar result becomes one unlabeled sample)."""
        params: dict[str, Any] = {"query": expr, "timeout": f"{self.timeout_s:g}s"}
        if time is not None:
            params["time"] = f"{time:.3f}"
        try:
            resp = await self._client.get(
                f"{self.address}/api/v1/query", params=params, headers=self._headers, timeout=self.timeout_s
            )
        except httpx.HTTPError as exc:
            raise PrometheusUnavailable(f"Prometheus at {self.address} unreachable: {type(exc).__name__}") from exc
        # What a reply says goes nowhere (status, Events, logs): only its status code and a fixed reason.
        # Whatever answers at the address chose the body, so echoing it would turn the autotuner into a
        # reader of any URL a job names (SSRF with the response shown back).
        if resp.status_code >= 500 or resp.status_code in (429, 503):
            raise PrometheusUnavailable(f"Prometheus at {self.address} answered HTTP {resp.status_code}")
        try:
            body = resp.json()
        except ValueError as exc:
            raise PrometheusUnavailable(
                f"Prometheus at {self.address} answered HTTP {resp.status_code} without JSON"
            ) from exc
        if not isinstance(body, dict):
            raise PrometheusUnavailable(f"Prometheus at {self.address} answered HTTP {resp.status_code} without a JSON object")
        if resp.status_code >= 400 or body.get("status") != "success":
            raise PrometheusQueryError(f"query {expr!r} rejected (HTTP {resp.status_code}: {_error_type(body)})")
        return _parse(body.get("data") or {}, expr)

    async def query_value(self, expr: str, time: float | None = None) -> float:
        """Evaluate `expr`, which must yield exactly one finite value."""
        samples = await self.query(expr, time)
        if not samples:
            raise NoData(f"query {expr!r} returned no data")
        if len(samples) > 1:
            raise AmbiguousResult(f"query {expr!r} returned {len(samples)} series, expected one: aggregate it")
        value = samples[0].value
        if math.isnan(value) or math.isinf(value):
            raise NoData(f"query {expr!r} returned {value}")
        return value


# Prometheus's own errorType values (web/api/v1 errorType*): the only part of an error reply reported.
_ERROR_TYPES = frozenset({"timeout", "canceled", "execution", "bad_data", "internal", "unavailable", "not_found",
                          "not_acceptable"})


def _error_type(body: dict[str, Any]) -> str:
    """The reply's errorType when it is one Prometheus defines, else a fixed word (never its text)."""
    kind = body.get("errorType")
    return kind if isinstance(kind, str) and kind in _ERROR_TYPES else "not a Prometheus query reply"


class PrometheusPool:
    """One HTTP connection pool for every Prometheus the autotuner reads (keep-alive across ticks and jobs).

    Create and use it inside one event loop; `aclose` at shutdown.
    """

    def __init__(self, max_connections: int = 32) -> None:
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._http = httpx.AsyncClient(limits=limits)

    def client(self, address: str, timeout_s: float = 5.0, bearer_token: str | None = None) -> PrometheusClient:
        """A client for one server and credential, sharing the pool's connections."""
        return PrometheusClient(address, timeout_s=timeout_s, bearer_token=bearer_token, http=self._http)

    async def aclose(self) -> None:
        """Close every pooled connection."""
        await self._http.aclose()


def _parse(data: dict[str, Any], expr: str) -> list[VectorSample]:
    kind = data.get("resultType")
    result = data.get("result")
    if kind == "vector":
        return [
            VectorSample(labels=dict(item.get("metric", {})), value=float(item["value"][1]), timestamp=float(item["value"][0]))
            for item in result or []
        ]
    if kind == "scalar" and result:
        return [VectorSample(labels={}, value=float(result[1]), timestamp=float(result[0]))]
    raise PrometheusQueryError(f"query {expr!r} returned a {kind} result; an instant vector or scalar is needed")
