"""Engine client for SGLang workers (real SGLang, or the project's SGLang-protocol server).

Generation goes through the sglang router when one is configured (else straight to the least busy
healthy worker). Everything the router does not forward or cannot be trusted with goes to every worker
directly: aborts (the router answers 404 to /abort_request), load polling for drain verification, and
weight updates. Follows the client rules of reference/sglang_protocol.md §4, §10, §11.

Failure policy:
- idempotent calls (loads, health, info, aborts) retry with exponential backoff on connection errors
  and 5xx; ``/generate`` retries only when nothing came back (connection refused/reset, 5xx from the
  router because its worker vanished);
- a worker that fails a call and then its ``/health`` probe is marked unhealthy (warning logged) and
  left out of fan-outs until ``health()`` finds it answering again; fan-out never raises because one
  worker is down;
- a ``/generate`` whose worker died after an ``abort_all`` returns an abort result with no new tokens
  (the sample keeps what it had and resumes later); otherwise it is retried on a healthy worker and,
  when retries run out, raises EngineError naming the URL;
- a 4xx reply to ``/generate`` (other than 408/429) is the server refusing the request itself, for
  example prompt + ``max_new_tokens`` beyond the context length: it raises InvalidRequestError with the
  server's message and is never retried, here or by the scheduler.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from rljob.runtime.engines.base import (
    Engine,
    EngineError,
    EngineLoad,
    GenerateRequest,
    GenerateResult,
    InvalidRequestError,
    WeightUpdate,
)
from rljob.runtime.engines.protocol import error_message, parse_generate_reply, parse_load

log = logging.getLogger(__name__)

# 4xx replies that say "not now" rather than "never": the request may succeed on a retry or elsewhere.
_TRANSIENT_4XX = frozenset({408, 429})


@dataclass
class SGLangClientConfig:
    """Where the workers are and how patient to be with them."""

    worker_urls: list[str] = field(default_factory=list)  # empty: ask `discover`, else the router
    router_url: str | None = None  # None: generate straight on the workers
    # Current worker URLs (the Kubernetes pods of the pools): re-asked before every weight update and
    # health check, so replicas added or removed by scaling join and leave without a restart.
    discover: Callable[[], Awaitable[list[str]]] | None = None
    max_concurrency: int = 512  # in-flight /generate calls (slime's default per engine)
    retries: int = 4
    backoff_s: float = 0.25  # first retry delay; doubles up to backoff_max_s (with jitter)
    backoff_max_s: float = 4.0
    control_timeout_s: float = 30.0  # loads, aborts, health, info
    weight_update_timeout_s: float = 900.0
    health_timeout_s: float = 600.0  # start(): how long workers may take to come up
    drain_timeout_s: float = 120.0
    drain_poll_s: float = 0.2
    reabort_interval_s: float = 3.0
    probe_timeout_s: float = 2.0  # /health probe after a failure


@dataclass
class WorkerState:
    """What the client knows about one SGLang worker."""

    url: str
    healthy: bool = True
    failures: int = 0  # consecutive failed calls
    last_error: str = ""
    in_flight: int = 0


class _NoReply(Exception):
    """A call got no usable reply; ``sent`` says whether the request may have reached the server."""

    def __init__(self, url: str, detail: str, sent: bool) -> None:
        super().__init__(f"{url}: {detail}")
        self.url = url
        self.sent = sent


def _strip(url: str) -> str:
    return url.rstrip("/")


class SGLangEngine(Engine):
    """The Engine interface over SGLang's HTTP API (router for generation, workers for control)."""

    name = "sglang"

    def __init__(self, config: SGLangClientConfig, weight_version: int = 0) -> None:
        if not config.worker_urls and not config.router_url and config.discover is None:
            raise EngineError("SGLang engine needs worker_urls, a router_url or pod discovery to find workers")
        self.config = config
        self.weight_version = weight_version
        self.router_url = _strip(config.router_url) if config.router_url else None
        self.workers: dict[str, WorkerState] = {_strip(u): WorkerState(_strip(u)) for u in config.worker_urls}
        self._semaphore = asyncio.Semaphore(config.max_concurrency)
        self._abort_epoch = 0  # bumped by abort_all: requests older than it must not be retried
        self._http = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=config.max_concurrency + 64, max_keepalive_connections=64),
            timeout=httpx.Timeout(config.control_timeout_s),
        )

    # ----------------------------------------------------------------- plumbing

    def healthy_workers(self) -> list[WorkerState]:
        """Workers currently included in fan-outs."""
        return [w for w in self.workers.values() if w.healthy]

    async def _call(
        self, method: str, url: str, *, json: Any = None, timeout: httpx.Timeout | float | None = None
    ) -> httpx.Response:
        """One HTTP call; raises _NoReply on transport errors and 5xx, returns any other response."""
        try:
            resp = await self._http.request(method, url, json=json, timeout=timeout or self.config.control_timeout_s)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise _NoReply(url, f"connection failed ({type(exc).__name__}: {exc})", sent=False) from exc
        except httpx.TransportError as exc:
            raise _NoReply(url, f"connection lost ({type(exc).__name__}: {exc})", sent=True) from exc
        if resp.status_code >= 500:
            raise _NoReply(url, f"HTTP {resp.status_code}: {resp.text[:200]}", sent=True)
        return resp

    async def _call_with_retries(
        self, method: str, url: str, *, json: Any = None, timeout: httpx.Timeout | float | None = None
    ) -> httpx.Response:
        """_call for idempotent requests: retried with exponential backoff, last _NoReply re-raised."""
        for attempt in range(self.config.retries + 1):
            try:
                return await self._call(method, url, json=json, timeout=timeout)
            except _NoReply:
                if attempt == self.config.retries:
                    raise
                await self._backoff(attempt)
        raise AssertionError("unreachable")

    async def _backoff(self, attempt: int) -> None:
        delay = min(self.config.backoff_max_s, self.config.backoff_s * (2**attempt))
        await asyncio.sleep(delay * (0.5 + random.random() / 2))

    def _worker_of(self, url: str) -> WorkerState | None:
        for base, worker in self.workers.items():
            if url.startswith(base + "/"):
                return worker
        return None

    def _note_success(self, worker: WorkerState) -> None:
        worker.failures = 0
        if not worker.healthy:
            worker.healthy = True
            log.info("SGLang worker %s answers again; back in rotation", worker.url)

    async def _note_failure(self, worker: WorkerState, error: str) -> None:
        """Count a failure; a worker that also fails its /health probe leaves the rotation."""
        worker.failures += 1
        worker.last_error = error
        if not worker.healthy:
            return
        if await self._probe(worker.url, "/health") or not worker.healthy:
            return  # alive, or a concurrent failure already took it out of rotation
        worker.healthy = False
        log.warning(
            "SGLang worker %s marked unhealthy (%s); it is left out of aborts, load polls and weight updates "
            "until it answers /health_generate again. Check the inference pod's logs.",
            worker.url,
            error,
        )

    async def _probe(self, base: str, path: str) -> bool:
        try:
            resp = await self._http.get(base + path, timeout=self.config.probe_timeout_s)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    async def _fan_out(self, method: str, path: str, json: Any = None) -> dict[str, httpx.Response]:
        """Send one call to every healthy worker at once; failures are logged and noted, never raised."""
        workers = self.healthy_workers()

        async def one(worker: WorkerState) -> httpx.Response | None:
            try:
                resp = await self._call_with_retries(method, worker.url + path, json=json)
            except _NoReply as exc:
                log.warning("%s %s%s failed: %s", method, worker.url, path, exc)
                await self._note_failure(worker, str(exc))
                return None
            self._note_success(worker)
            return resp

        replies = await asyncio.gather(*(one(w) for w in workers))
        return {w.url: r for w, r in zip(workers, replies, strict=True) if r is not None}

    # ----------------------------------------------------------------- lifecycle

    async def discover_workers(self) -> list[str]:
        """Worker URLs from the router: ``GET /workers`` (new API) or ``GET /list_workers`` (old)."""
        if self.router_url is None:
            raise EngineError("no router_url configured to discover SGLang workers from")
        for path in ("/workers", "/list_workers"):
            try:
                resp = await self._call_with_retries("GET", self.router_url + path)
            except _NoReply as exc:
                raise EngineError(f"cannot reach the sglang router at {self.router_url} ({exc}); is it running?") from exc
            if resp.status_code != 200:
                continue
            body = resp.json()
            if isinstance(body.get("workers"), list):
                return [_strip(w["url"] if isinstance(w, dict) else str(w)) for w in body["workers"]]
            if isinstance(body.get("urls"), list):
                return [_strip(str(u)) for u in body["urls"]]
        raise EngineError(f"the sglang router at {self.router_url} lists no workers (/workers, /list_workers)")

    async def refresh_workers(self) -> None:
        """Adopt the worker set `config.discover` reports: new workers join, vanished ones leave.

        A discovery failure is logged and the known workers are kept (the next call retries).
        """
        if self.config.discover is None:
            return
        try:
            urls = {_strip(u) for u in await self.config.discover()}
        except Exception as exc:  # the discovery's own retries are spent; keep serving with what we know
            log.warning("SGLang worker discovery failed, keeping %d known workers: %s", len(self.workers), exc)
            return
        for url in sorted(urls - set(self.workers)):
            log.info("SGLang worker %s discovered; it joins weight updates, aborts and load polls", url)
            self.workers[url] = WorkerState(url)
        for url in sorted(set(self.workers) - urls):
            log.info("SGLang worker %s is gone from discovery (scaled down or restarting)", url)
            del self.workers[url]

    async def start(self) -> None:
        """Discover workers if none are configured, then wait until each answers ``/health_generate``."""
        deadline = time.monotonic() + self.config.health_timeout_s
        if not self.workers and self.config.discover is not None:
            # The pools may still be loading weights: wait for the first ready worker.
            await self.refresh_workers()
            while not self.workers and time.monotonic() < deadline:
                await asyncio.sleep(2.0)
                await self.refresh_workers()
        if not self.workers:
            self.workers = {u: WorkerState(u) for u in await self.discover_workers()}
        pending = set(self.workers)
        while pending and time.monotonic() < deadline:
            results = await asyncio.gather(*(self._probe(u, "/health_generate") for u in pending))
            pending -= {u for u, ok in zip(list(pending), results, strict=True) if ok}
            if pending:
                await asyncio.sleep(1.0)
        for url in pending:
            self.workers[url].healthy = False
            log.warning("SGLang worker %s did not pass /health_generate within %.0f s", url, self.config.health_timeout_s)
        if not self.healthy_workers():
            raise EngineError(
                f"no SGLang worker became healthy within {self.config.health_timeout_s:.0f} s "
                f"({', '.join(self.workers)}): check that the inference pods run and /health_generate answers 200"
            )
        if self.router_url is not None:
            while not await self._probe(self.router_url, "/health"):
                if time.monotonic() > deadline:
                    raise EngineError(f"the sglang router at {self.router_url} does not answer /health; is it running?")
                await asyncio.sleep(0.5)

    async def close(self) -> None:
        """Close the HTTP connection pool."""
        await self._http.aclose()

    async def health(self) -> bool:
        """Probe every worker's ``/health_generate`` (re-admitting recovered ones); True if any is healthy."""
        await self.refresh_workers()
        for worker in self.workers.values():
            if await self._probe(worker.url, "/health_generate"):
                self._note_success(worker)
            elif worker.healthy:
                await self._note_failure(worker, "/health_generate did not answer 200")
        return bool(self.healthy_workers())

    # ----------------------------------------------------------------- generation

    def _generate_body(self, request: GenerateRequest) -> dict[str, Any]:
        return {
            "input_ids": request.input_ids,
            "sampling_params": {
                "max_new_tokens": request.max_new_tokens,
                "temperature": request.temperature,
                "top_p": request.top_p,
                "top_k": request.top_k,
                "stop_token_ids": request.stop_token_ids,
                **({"stop": request.stop} if request.stop else {}),
                "skip_special_tokens": False,
                "spaces_between_special_tokens": False,
                "no_stop_trim": True,
            },
            "return_logprob": True,
            "rid": request.rid,
        }

    def _generate_target(self) -> tuple[str, WorkerState | None]:
        if self.router_url is not None:
            return self.router_url, None
        healthy = self.healthy_workers()
        if not healthy:
            raise EngineError(
                f"every SGLang worker is unhealthy ({', '.join(f'{w.url}: {w.last_error}' for w in self.workers.values())}); "
                "check the inference pods, then call health() to re-admit them"
            )
        worker = min(healthy, key=lambda w: w.in_flight)
        return worker.url, worker

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """POST /generate (router or least busy worker); see the module docstring for failures."""
        submitted_version = self.weight_version
        if request.max_new_tokens <= 0:
            return GenerateResult(request.rid, [], [], "length", submitted_version, len(request.input_ids))
        epoch = self._abort_epoch
        body = self._generate_body(request)
        timeout = httpx.Timeout(None, connect=self.config.control_timeout_s)
        last_error = ""
        async with self._semaphore:
            for attempt in range(self.config.retries + 1):
                base, worker = self._generate_target()
                if worker is not None:
                    worker.in_flight += 1
                try:
                    resp = await self._call("POST", base + "/generate", json=body, timeout=timeout)
                except _NoReply as exc:
                    last_error = str(exc)
                    log.warning("generate %s on %s failed (attempt %d): %s", request.rid, base, attempt + 1, exc)
                    await self._after_generate_failure(worker, last_error)
                    if exc.sent and self._abort_epoch != epoch:
                        # Aborted meanwhile: the caller wants the request back, not a retry.
                        return GenerateResult(request.rid, [], [], "abort", submitted_version, len(request.input_ids))
                    await self._backoff(attempt)
                    continue
                finally:
                    if worker is not None:
                        worker.in_flight -= 1
                if worker is not None:
                    self._note_success(worker)
                return self._parse_generate(resp, base, request, submitted_version)
        raise EngineError(
            f"/generate for {request.rid} failed {self.config.retries + 1} times (last: {last_error}); "
            "check the SGLang workers and router, the sample can be resumed from its previous state"
        )

    async def _after_generate_failure(self, worker: WorkerState | None, error: str) -> None:
        if worker is not None:
            await self._note_failure(worker, error)
            return
        # Through the router we cannot tell which worker failed: probe them all.
        await asyncio.gather(*(self._note_failure(w, f"router reported: {error}") for w in self.healthy_workers()))

    def _parse_generate(
        self, resp: httpx.Response, base: str, request: GenerateRequest, submitted_version: int
    ) -> GenerateResult:
        if resp.status_code in _TRANSIENT_4XX:
            raise EngineError(f"{base}/generate is overloaded for {request.rid}: HTTP {resp.status_code}: {resp.text[:300]}")
        if 400 <= resp.status_code < 500:
            # The server refused this request itself (e.g. prompt + max_new_tokens beyond the context
            # length): every engine would, so it must never be relaunched elsewhere.
            try:
                payload: Any = resp.json()
            except ValueError:
                payload = None
            message = error_message(payload, resp.text[:500])
            raise InvalidRequestError(f"{base}/generate rejected {request.rid} (HTTP {resp.status_code}): {message}")
        if resp.status_code != 200:
            raise EngineError(f"{base}/generate rejected {request.rid}: HTTP {resp.status_code}: {resp.text[:300]}")
        try:
            reply = resp.json()
            if isinstance(reply, list):  # batched reply to a single input: take the one element
                reply = reply[0]
            return parse_generate_reply(reply, request.rid, submitted_version)
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise EngineError(f"{base}/generate returned an unreadable reply for {request.rid}: {exc}") from exc

    # ----------------------------------------------------------------- abort and drain

    async def abort(self, rid_prefix: str) -> None:
        """Abort requests whose rid starts with ``rid_prefix`` on every healthy worker."""
        await self._fan_out("POST", "/abort_request", {"rid": rid_prefix, "abort_all": False})

    async def abort_all(self) -> None:
        """Abort everything on every worker, then poll loads (re-aborting every few seconds) until drained.

        Raises EngineError naming the busy workers if they do not drain within ``drain_timeout_s``.
        """
        self._abort_epoch += 1
        body = {"rid": "", "abort_all": True}
        await self._fan_out("POST", "/abort_request", body)
        deadline = time.monotonic() + self.config.drain_timeout_s
        last_abort = time.monotonic()
        while True:
            loads = await self.worker_loads()
            busy = {url: load for url, load in loads.items() if load.total}
            if not busy:
                return
            now = time.monotonic()
            if now > deadline:
                raise EngineError(
                    "SGLang workers did not drain after abort within "
                    f"{self.config.drain_timeout_s:.0f} s: "
                    + ", ".join(f"{u} ({ld.running} running, {ld.waiting} waiting)" for u, ld in busy.items())
                )
            if now - last_abort >= self.config.reabort_interval_s:
                log.info("re-aborting %d SGLang workers that still report requests", len(busy))
                await self._fan_out("POST", "/abort_request", body)
                last_abort = now
            await asyncio.sleep(self.config.drain_poll_s)

    async def worker_loads(self) -> dict[str, EngineLoad]:
        """Per healthy worker load from ``/v1/loads?include=core`` (``/get_load`` on old servers)."""
        workers = self.healthy_workers()

        async def one(worker: WorkerState) -> EngineLoad | None:
            try:
                resp = await self._call_with_retries("GET", worker.url + "/v1/loads?include=core")
                if resp.status_code == 404:
                    resp = await self._call_with_retries("GET", worker.url + "/get_load")
                resp.raise_for_status()
                load = parse_load(resp.json())
            except (_NoReply, httpx.HTTPStatusError, ValueError) as exc:
                log.warning("load of SGLang worker %s unavailable: %s", worker.url, exc)
                await self._note_failure(worker, f"load poll: {exc}")
                return None
            self._note_success(worker)
            return load

        loads = await asyncio.gather(*(one(w) for w in workers))
        return {w.url: ld for w, ld in zip(workers, loads, strict=True) if ld is not None}

    async def load(self) -> EngineLoad:
        """Sum of running and waiting requests over healthy workers."""
        loads = (await self.worker_loads()).values()
        return EngineLoad(running=sum(ld.running for ld in loads), waiting=sum(ld.waiting for ld in loads))

    # ----------------------------------------------------------------- weights

    async def update_weights(self, update: WeightUpdate) -> None:
        """POST /update_weights_from_disk with ``weight_version`` to every healthy worker.

        Needs ``update.path`` readable by the workers (shared volume). Raises EngineError naming every
        worker that failed; the version is recorded only when all healthy workers succeeded.
        """
        if update.path is None:
            raise EngineError(
                "SGLang engines load weights from disk: save the policy (save_pretrained) to a path the "
                "inference pods can read and pass WeightUpdate(path=...)"
            )
        body = {
            "model_path": update.path,
            "weight_version": str(update.version),
            "flush_cache": True,
            "abort_all_requests": False,
        }
        await self.refresh_workers()  # a replica added since the last update gets this version too
        workers = self.healthy_workers()
        if not workers:
            raise EngineError("no healthy SGLang worker to update weights on; check the inference pods")

        async def one(worker: WorkerState) -> str | None:
            try:
                resp = await self._call_with_retries(
                    "POST", worker.url + "/update_weights_from_disk", json=body,
                    timeout=self.config.weight_update_timeout_s,
                )
            except _NoReply as exc:
                await self._note_failure(worker, str(exc))
                return f"{worker.url}: {exc}"
            reply = resp.json() if resp.headers.get("content-type", "").startswith("application/json") else {}
            if resp.status_code != 200 or not reply.get("success", False):
                return f"{worker.url}: HTTP {resp.status_code} {reply.get('message') or resp.text[:200]}"
            self._note_success(worker)
            return None

        errors = [e for e in await asyncio.gather(*(one(w) for w in workers)) if e]
        if errors:
            raise EngineError(f"weight update to version {update.version} from {update.path} failed on: " + "; ".join(errors))
        self.weight_version = update.version
