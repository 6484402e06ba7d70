"""Engine client for SGLang workers (real SGLang, or the project's SGLang-protocol server).

Generation goes through the sglang router when one is configured (else straight to the least busy
healthy worker). Everything the router does not forward or cannot be trusted with goes to every worker
directly: aborts (the router answers 404 to /abort_request), load polling for drain verification, and
weight updates. Follows the client rules of reference/sglang_protocol.md §4, §10, §11.

Membership (membership.py holds the rules): the client owns the router's worker list; on a cluster the
router starts empty and has no discovery of its own, so the client is the only one adding workers. A
worker is in the rotation only while it answers and serves the job's current weight version (as the
worker itself reports it: ``/model_info`` on current SGLang, ``/get_weight_version`` on 0.5.5.post3;
each worker's endpoints are detected once, protocol.detect_worker_api); a new, restarted or behind
worker is kept out of the router (and skipped for direct generation) and probed again with backoff
until a weight sync has brought it up to date.
The router's own ``GET /workers`` is read back at every reconcile, so a router that restarted empty
gets the rotation back. A background monitor probes every worker and the router; ``health()`` probes
at once.

Failure policy:
- idempotent calls (loads, health, info, aborts) retry with exponential backoff on lost connections
  and 5xx, but not on connection refused (nothing listens: the worker is dead, fail fast);
  ``/generate`` retries only when nothing came back (connection refused/reset, 5xx from the router
  because its worker vanished), and fails at once while the router itself is down;
- liveness probes read the version endpoint, never ``/health``: SGLang's ``/health`` may run a
  generation (1 s or more, blocked while generation is paused or weights update), which would take
  a busy or syncing worker out of the rotation for nothing;
- a worker that fails a call and then its liveness probe is marked unhealthy (warning logged) and
  left out of fan-outs until ``health()`` finds it answering again; fan-out never raises because one
  worker is down;
- a ``/generate`` whose worker died after an ``abort_all`` returns an abort result with no new tokens
  (the sample keeps what it had and resumes later); otherwise it is retried on a healthy worker and,
  when retries run out, raises EngineError naming the URL;
- every HTTP attempt of a ``/generate`` carries its own rid (protocol.attempt_rid): current SGLang
  refuses a repeated rid with 400; a ``/generate`` without a reply within ``generate_timeout_s``
  (``requestTimeoutSeconds``) is aborted where it may still run, then retried;
- a 4xx reply to ``/generate`` (other than 408/429) is the server refusing the request itself, for
  example prompt + ``max_new_tokens`` beyond the context length: it raises InvalidRequestError with the
  server's message and is never retried, here or by the scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
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
from rljob.runtime.engines.membership import (
    ProbePolicy,
    WorkerView,
    adds_due,
    catch_up_needed,
    due,
    engine_healthy,
    in_rotation,
    observe_probe,
    retry_call,
    router_plan,
)
from rljob.runtime.engines.protocol import (
    HEALTH,
    HEALTH_GENERATE,
    MODEL_INFO,
    V1_LOADS,
    WEIGHT_VERSION_KEY,
    Call,
    WorkerApi,
    abort_call,
    attempt_rid,
    detect_worker_api,
    error_message,
    generate_call,
    parse_generate_reply,
    parse_load,
    update_weights_from_disk_call,
)

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
    # Read timeout of one /generate (spec.rollout.sglang.requestTimeoutSeconds): a wedged worker can still
    # answer /health, so only this notices it. The request is then aborted there and retried elsewhere.
    generate_timeout_s: float = 600.0
    weight_update_timeout_s: float = 900.0
    health_timeout_s: float = 600.0  # start(): how long workers may take to come up
    drain_timeout_s: float = 120.0
    drain_poll_s: float = 0.2
    reabort_interval_s: float = 3.0
    probe_timeout_s: float = 2.0  # liveness/version probe (an info endpoint: never blocked by syncs)
    # start(): one /health_generate; SGLang answers it after >= 1 s, or 503 after its own 20 s window.
    health_generate_timeout_s: float = 30.0
    probe_interval_s: float = 1.0  # monitor: workers in the rotation and the router
    probe_backoff_s: float = 0.5  # monitor: first re-probe of a worker out of the rotation
    probe_backoff_max_s: float = 8.0
    manage_router: bool = True  # keep the router's worker list equal to the rotation
    router_add_grace_s: float = 10.0  # a worker the router accepted but does not list yet is posted again after this


@dataclass
class WorkerState(WorkerView):
    """What the client knows about one SGLang worker (membership fields from WorkerView)."""

    failures: int = 0  # consecutive failed calls
    last_error: str = ""
    in_flight: int = 0
    api: WorkerApi | None = None  # its release's endpoints; None until detected (again after it was unreachable)

    @property
    def healthy(self) -> bool:
        """Answers calls (it may still be out of the rotation: see membership.in_rotation)."""
        return self.reachable

    @healthy.setter
    def healthy(self, value: bool) -> None:
        self.reachable = value


@dataclass
class WorkerSyncResult:
    """Per worker outcome of one weight update, by the workers' own served version."""

    updated: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


class _NoReply(Exception):
    """A call got no usable reply; ``sent`` says whether the request may have reached the server,
    ``timed_out`` whether it was the read timeout (the server may still be working on it)."""

    def __init__(self, url: str, detail: str, sent: bool, timed_out: bool = False) -> None:
        super().__init__(f"{url}: {detail}")
        self.url = url
        self.sent = sent
        self.timed_out = timed_out


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
        # Until the first probe (start(), the monitor, health()) a worker is taken at the initial version.
        self.workers: dict[str, WorkerState] = {
            _strip(u): WorkerState(_strip(u), served_version=weight_version) for u in config.worker_urls
        }
        self._semaphore = asyncio.Semaphore(config.max_concurrency)
        self._abort_epoch = 0  # bumped by abort_all: requests older than it must not be retried
        self.router_up = True
        self._probes = ProbePolicy(config.probe_interval_s, config.probe_backoff_s, config.probe_backoff_max_s)
        self._monitor_task: asyncio.Task[None] | None = None
        self._membership_lock = asyncio.Lock()
        self._router_filled = False  # some worker was added: an empty router later means it restarted
        self._router_posted: dict[str, float] = {}  # url -> when it was last posted to the router, until listed
        self._syncing = False  # a weight sync is under way: versions move, the monitor waits (see syncing())
        self._http = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=config.max_concurrency + 64, max_keepalive_connections=64),
            timeout=httpx.Timeout(config.control_timeout_s),
        )

    # ----------------------------------------------------------------- plumbing

    def healthy_workers(self) -> list[WorkerState]:
        """Workers that answer: included in aborts, load polls and weight updates."""
        return [w for w in self.workers.values() if w.healthy]

    def rotation_workers(self) -> list[WorkerState]:
        """Workers requests may go to: answering and at the current weight version."""
        return [w for w in self.workers.values() if in_rotation(w, self.weight_version)]

    def served_version(self) -> int | None:
        """The version generation is served at: the current one while any worker is in the rotation."""
        return self.weight_version if self.rotation_workers() else None

    def needs_catch_up(self) -> bool:
        """Every worker out of the rotation, some answering at another version (membership.catch_up_needed)."""
        return catch_up_needed(list(self.workers.values()), self.weight_version)

    async def _call(
        self, method: str, url: str, *, json: Any = None, timeout: httpx.Timeout | float | None = None
    ) -> httpx.Response:
        """One HTTP call; raises _NoReply on transport errors and 5xx, returns any other response."""
        try:
            resp = await self._http.request(method, url, json=json, timeout=timeout or self.config.control_timeout_s)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise _NoReply(url, f"connection failed ({type(exc).__name__}: {exc})", sent=False) from exc
        except httpx.ReadTimeout as exc:
            raise _NoReply(url, f"no reply within the read timeout ({exc})", sent=True, timed_out=True) from exc
        except httpx.TransportError as exc:
            raise _NoReply(url, f"connection lost ({type(exc).__name__}: {exc})", sent=True) from exc
        if resp.status_code >= 500:
            raise _NoReply(url, f"HTTP {resp.status_code}: {resp.text[:200]}", sent=True)
        return resp

    async def _call_with_retries(
        self, method: str, url: str, *, json: Any = None, timeout: httpx.Timeout | float | None = None
    ) -> httpx.Response:
        """_call for idempotent requests: retried with exponential backoff, last _NoReply re-raised."""
        attempt = 0
        while True:
            try:
                return await self._call(method, url, json=json, timeout=timeout)
            except _NoReply as exc:
                if not retry_call(exc.sent, attempt, self.config.retries):
                    raise
                await self._backoff(attempt)
                attempt += 1

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
            log.info("SGLang worker %s answers again; it rejoins the rotation once it serves weight version %d",
                     worker.url, self.weight_version)

    async def _note_failure(self, worker: WorkerState, error: str) -> None:
        """Count a failure; a worker that also fails its liveness probe leaves the rotation."""
        worker.failures += 1
        worker.last_error = error
        if not worker.healthy:
            return
        if (await self._probe_version(worker))[0] or not worker.healthy:
            return  # alive, or a concurrent failure already took it out of rotation
        worker.healthy = False
        worker.next_probe_at = time.monotonic()  # the monitor re-probes it with backoff from now on
        log.warning(
            "SGLang worker %s marked unhealthy (%s); it is out of the rotation (and the router) until it answers "
            "and serves the current weights again. Check the inference pod's logs.",
            worker.url,
            error,
        )
        await self.apply_membership()

    async def _probe(self, base: str, path: str, timeout: float | None = None) -> bool:
        try:
            resp = await self._http.get(base + path, timeout=timeout or self.config.probe_timeout_s)
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
            log.info("SGLang worker %s discovered; it joins the rotation once it serves the current weights", url)
            self.workers[url] = WorkerState(url)  # version unknown until probed: out of the rotation
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
            urls = await self.discover_workers()
            while not urls and time.monotonic() < deadline:
                # The router lists a worker only once its own health check (an SGLang /health, which
                # may take a generation's time) has passed.
                await asyncio.sleep(0.5)
                urls = await self.discover_workers()
            self.workers = {u: WorkerState(u, served_version=self.weight_version) for u in urls}
        pending = set(self.workers)
        while pending and time.monotonic() < deadline:
            results = await asyncio.gather(
                *(self._probe(u, HEALTH_GENERATE, self.config.health_generate_timeout_s) for u in pending)
            )
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
            while not await self._probe(self.router_url, HEALTH):
                if time.monotonic() > deadline:
                    raise EngineError(f"the sglang router at {self.router_url} does not answer /health; is it running?")
                await asyncio.sleep(0.5)
        await self.probe_all()
        self._monitor_task = asyncio.create_task(self._monitor(), name="sglang-membership-monitor")

    async def close(self) -> None:
        """Stop the monitor and close the HTTP connection pool."""
        if self._monitor_task is not None:
            self._monitor_task.cancel()
            await asyncio.gather(self._monitor_task, return_exceptions=True)
            self._monitor_task = None
        await self._http.aclose()

    async def health(self) -> bool:
        """Probe the router and every worker now; True when the router answers and a worker is in the rotation."""
        await self.refresh_workers()
        await self.probe_all()
        return engine_healthy(self.router_url is not None, self.router_up, list(self.workers.values()), self.weight_version)

    # ----------------------------------------------------------------- membership

    async def _detect_api(self, worker: WorkerState) -> WorkerApi | None:
        """The endpoints of the worker's release (protocol.detect_worker_api), or None when it does not
        answer the probes; asked once per worker, and again after the worker was unreachable (a
        restarted pod may run another image)."""
        timeout = self.config.probe_timeout_s
        try:
            model_info = await self._http.get(worker.url + MODEL_INFO, timeout=timeout)
            if model_info.status_code not in (200, 404):
                return None  # loading (503) or failing: the release cannot be told yet
            loads = await self._http.get(worker.url + V1_LOADS, timeout=timeout)
            api = detect_worker_api(model_info.status_code, loads.status_code)
            resp = await self._http.get(worker.url + api.server_info_path, timeout=self.config.control_timeout_s)
            info = resp.json() if resp.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            return None
        api = api.with_server_info(info if isinstance(info, dict) else {})
        log.info("SGLang worker %s: release %s, tp_size %d, dp_size %d; weight version from %s, load from %s",
                 worker.url, api.release or "unknown", api.tp_size, api.dp_size, api.weight_version_path, api.load_path)
        return api

    async def _worker_api(self, worker: WorkerState) -> WorkerApi | None:
        if worker.api is None:
            worker.api = await self._detect_api(worker)
        return worker.api

    async def _probe_version(self, worker: WorkerState) -> tuple[bool, int | None]:
        """(answers, the weight version it serves as an int or None). Whether it answers is read from the
        version endpoint itself, not ``/health``: SGLang's ``/health`` may run a generation (at least 1 s,
        blocked while generation is paused or weights update; docs/sglang_standin.md), so it would flap
        during syncs. Any reply below 500 means the server is up."""
        api = await self._worker_api(worker)
        if api is None:
            return False, None
        try:
            resp = await self._http.get(worker.url + api.weight_version_path, timeout=self.config.probe_timeout_s)
        except httpx.HTTPError:
            worker.api = None  # unreachable: a restarted pod may run another release
            return False, None
        if resp.status_code >= 500:
            return False, None
        try:
            raw = resp.json().get(WEIGHT_VERSION_KEY) if resp.status_code == 200 else None
        except ValueError:
            raw = None
        try:
            return True, int(raw) if raw is not None else None
        except (TypeError, ValueError):
            return True, None  # a version the job did not set (e.g. a model name): never current

    async def _probe_worker(self, worker: WorkerState) -> None:
        was_in, was_reachable = in_rotation(worker, self.weight_version), worker.reachable
        answered, version = await self._probe_version(worker)
        observe_probe(worker, answered, version, self.weight_version, time.monotonic(), self._probes)
        now_in = in_rotation(worker, self.weight_version)
        if was_in and not now_in:
            log.warning(
                "SGLang worker %s left the rotation: %s; it is re-probed with backoff and rejoins once it serves "
                "weight version %d", worker.url,
                "it does not answer" if not answered else f"it serves weight version {worker.served_version}",
                self.weight_version,
            )
        elif now_in and not was_in:
            log.info("SGLang worker %s serves weight version %d: back in the rotation", worker.url, self.weight_version)
        if answered and not was_reachable:
            worker.failures = 0

    async def _probe_router(self) -> None:
        if self.router_url is None:
            return
        up = await self._probe(self.router_url, HEALTH)
        if up != self.router_up:
            if up:
                log.info("the sglang router at %s answers again; its worker list is reconciled with the rotation",
                         self.router_url)
            else:
                log.warning("the sglang router at %s does not answer /health; generation waits for it", self.router_url)
        self.router_up = up

    async def probe_all(self) -> None:
        """Probe the router and every worker now, then bring the router in line with the rotation."""
        await asyncio.gather(self._probe_router(), *(self._probe_worker(w) for w in self.workers.values()))
        await self.apply_membership()

    async def _monitor(self) -> None:
        """Background probes: each worker when its turn (membership.probe_delay) has come, and the router."""
        while True:
            await asyncio.sleep(min(self.config.probe_interval_s, self.config.probe_backoff_s))
            if self._syncing:
                continue
            try:
                workers = due(list(self.workers.values()), time.monotonic())
                await asyncio.gather(self._probe_router(), *(self._probe_worker(w) for w in workers))  # type: ignore[arg-type]
                await self.apply_membership()
            except Exception:  # noqa: BLE001 - the monitor must outlive any one bad probe
                log.exception("SGLang membership monitor: probe failed")

    async def _router_list(self) -> dict[str, str] | None:
        """url -> router worker id (``GET /workers``; ``/list_workers`` on old routers); None if unreachable."""
        assert self.router_url is not None
        for path in ("/workers", "/list_workers"):
            try:
                resp = await self._http.get(self.router_url + path, timeout=self.config.probe_timeout_s)
            except httpx.HTTPError:
                return None
            if resp.status_code != 200:
                continue
            body = resp.json()
            if isinstance(body.get("workers"), list):
                return {
                    _strip(w["url"] if isinstance(w, dict) else str(w)): str(w.get("id", w["url"]) if isinstance(w, dict) else w)
                    for w in body["workers"]
                }
            if isinstance(body.get("urls"), list):
                return {_strip(str(u)): _strip(str(u)) for u in body["urls"]}
        return None

    async def apply_membership(self) -> None:
        """Make the router's own worker list (read back every time) equal the rotation, as
        membership.router_plan says; no-op without a router. Reading the list, not trusting what was
        last sent, is what refills a router that restarted empty between two probes."""
        if self.router_url is None or not self.config.manage_router or not self.router_up:
            return
        async with self._membership_lock:
            listed = await self._router_list()
            if listed is None:
                return  # the router does not answer: the next probe finds it down or retries
            plan = router_plan(list(self.workers.values()), self.weight_version, listed)
            rotation = self.rotation_workers()
            if self._router_filled and rotation and len(plan.add) == len(rotation):
                log.warning("the sglang router at %s lists none of the %d workers in the rotation (it restarted "
                            "empty); adding them back", self.router_url, len(rotation))
            self._router_filled = self._router_filled or bool(plan.add)
            for url in plan.remove:
                await self._router_remove(url, listed[url])
            now = time.monotonic()
            self._router_posted = {u: t for u, t in self._router_posted.items() if u in plan.add}
            for url in adds_due(plan.add, self._router_posted, now, self.config.router_add_grace_s):
                if url in self._router_posted:
                    log.warning("the sglang router accepted worker %s %.0f s ago but does not list it: can the router "
                                "reach it (its /health, /get_model_info)? Posting it again", url,
                                now - self._router_posted[url])
                self._router_posted[url] = now
                await self._router_add(url)

    async def _router_add(self, url: str) -> None:
        assert self.router_url is not None
        try:
            resp = await self._http.post(self.router_url + "/workers", json={"url": url}, timeout=self.config.probe_timeout_s)
            if resp.status_code == 404:  # old router API
                resp = await self._http.post(self.router_url + "/add_worker", params={"url": url},
                                             timeout=self.config.probe_timeout_s)
        except httpx.HTTPError as exc:
            log.warning("could not add worker %s to the sglang router: %s", url, exc)
            return
        if resp.status_code >= 300 and "already" not in resp.text.lower():
            log.warning("the sglang router refused to add %s: HTTP %d %s", url, resp.status_code, resp.text[:200])
            return
        log.info("worker %s serves weight version %d: added to the sglang router", url, self.weight_version)

    async def _router_remove(self, url: str, worker_id: str) -> None:
        assert self.router_url is not None
        try:
            resp = await self._http.delete(self.router_url + f"/workers/{worker_id}", timeout=self.config.probe_timeout_s)
            if resp.status_code == 404:  # old router API
                resp = await self._http.post(self.router_url + "/remove_worker", params={"url": url},
                                             timeout=self.config.probe_timeout_s)
        except httpx.HTTPError as exc:
            log.warning("could not remove worker %s from the sglang router: %s", url, exc)
            return
        if resp.status_code >= 300:
            log.warning("the sglang router refused to remove %s: HTTP %d %s", url, resp.status_code, resp.text[:200])
            return
        log.info("worker %s removed from the sglang router until it serves weight version %d", url, self.weight_version)

    # ----------------------------------------------------------------- generation

    def _generate_target(self) -> tuple[str, WorkerState | None]:
        if self.router_url is not None:
            if not self.router_up:
                raise EngineError(f"the sglang router at {self.router_url} is down; generation waits until it answers")
            return self.router_url, None
        current = self.rotation_workers()
        if not current:
            raise EngineError(
                f"no SGLang worker is in the rotation at weight version {self.weight_version} ("
                + ", ".join(f"{w.url}: {w.last_error or f'serves {w.served_version}'}" for w in self.workers.values())
                + "); check the inference pods and the weight sync, then call health() to re-admit them"
            )
        worker = min(current, key=lambda w: w.in_flight)
        return worker.url, worker

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """POST /generate (router or least busy worker); see the module docstring for failures."""
        submitted_version = self.weight_version
        if request.max_new_tokens <= 0:
            return GenerateResult(request.rid, [], [], "length", submitted_version, len(request.input_ids))
        epoch = self._abort_epoch
        timeout = httpx.Timeout(self.config.generate_timeout_s, connect=self.config.control_timeout_s)
        last_error = ""
        async with self._semaphore:
            for attempt in range(self.config.retries + 1):
                base, worker = self._generate_target()
                call = generate_call(request, attempt_rid(request.rid, attempt))
                if worker is not None:
                    worker.in_flight += 1
                try:
                    resp = await self._call(call.method, base + call.path, json=call.body, timeout=timeout)
                except _NoReply as exc:
                    last_error = str(exc)
                    if exc.timed_out:
                        await self._abort_timed_out(worker, call)
                    if worker is None and not exc.sent:
                        # Nothing listens on the router's port: fail now, the scheduler waits for health().
                        self.router_up = False
                        raise EngineError(f"the sglang router at {base} refused the connection for {request.rid}") from exc
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
                return replace(self._parse_generate(resp, base, request, submitted_version), rid=request.rid)
        raise EngineError(
            f"/generate for {request.rid} failed {self.config.retries + 1} times (last: {last_error}); "
            "check the SGLang workers and router, the sample can be resumed from its previous state"
        )

    async def _abort_timed_out(self, worker: WorkerState | None, call: Call) -> None:
        """Abort a /generate that outlived its read timeout where it may still run (its worker, or every
        worker behind the router), so the retry under a new rid does not race it."""
        rid = str((call.body or {}).get("rid", ""))
        log.warning("generate %s got no reply within %.0f s (requestTimeoutSeconds); aborting it before the retry",
                    rid, self.config.generate_timeout_s)
        abort = abort_call(rid)
        if worker is None:
            await self._fan_out(abort.method, abort.path, abort.body)
            return
        with contextlib.suppress(_NoReply):
            await self._call(abort.method, worker.url + abort.path, json=abort.body)

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
        """Abort the request whose rid is exactly ``rid_prefix`` on every healthy worker: SGLang ignores
        an abort whose rid is not a request it holds, so a bare prefix aborts nothing (use abort_all)."""
        call = abort_call(rid_prefix)
        await self._fan_out(call.method, call.path, call.body)

    async def abort_all(self) -> None:
        """Abort everything on every worker, then poll loads (re-aborting every few seconds) until drained.

        Raises EngineError naming the busy workers if they do not drain within ``drain_timeout_s``.
        """
        self._abort_epoch += 1
        call = abort_call(abort_all=True)
        await self._fan_out(call.method, call.path, call.body)
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
                await self._fan_out(call.method, call.path, call.body)
                last_abort = now
            await asyncio.sleep(self.config.drain_poll_s)

    async def worker_loads(self) -> dict[str, EngineLoad]:
        """Per healthy worker load from its release's load endpoint (``/v1/loads``, ``/get_load`` on 0.5.5)."""
        workers = self.healthy_workers()

        async def one(worker: WorkerState) -> EngineLoad | None:
            try:
                api = await self._worker_api(worker)
                if api is None:
                    raise _NoReply(worker.url, "does not answer its release's probes", sent=False)
                resp = await self._call_with_retries("GET", worker.url + api.load_path)
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
        """POST /update_weights_from_disk of ``update.path`` (a folder the workers can read).

        Raises EngineError when no worker serves ``update.version`` afterwards; workers that failed
        leave the rotation (see update_weights_from_disk).
        """
        if update.path is None:
            raise EngineError(
                "SGLang engines load weights from disk or over a weight-update group: save the policy to a path "
                "the inference pods can read and pass WeightUpdate(path=...), or use rollout.weightTransport"
            )
        result = await self.update_weights_from_disk(update.path, update.version)
        if not result.updated:
            raise EngineError(
                f"weight update to version {update.version} from {update.path} failed on every worker: "
                + "; ".join(f"{u}: {e}" for u, e in result.failed.items())
            )

    @contextlib.asynccontextmanager
    async def syncing(self) -> AsyncIterator[None]:
        """Hold the background monitor while a weight sync runs: workers reach the new version before
        it becomes the target, and a probe in between would take them out of the rotation for nothing."""
        self._syncing = True
        try:
            yield
        finally:
            self._syncing = False

    async def update_weights_from_disk(self, path: str, version: int) -> WorkerSyncResult:
        """``/update_weights_from_disk`` on every answering worker (also those out of the rotation:
        this is how they catch up), then membership by the versions the workers report."""
        call = update_weights_from_disk_call(path, version)
        await self.refresh_workers()  # a replica added since the last update gets this version too
        async with self.syncing():
            replies = await self.post_workers([w.url for w in self.healthy_workers()], call.path, call.body or {})
            return await self.commit_version(version, replies)

    async def post_worker(self, url: str, path: str, body: dict[str, Any], timeout: float | None = None) -> str | None:
        """One control POST to a worker (weight-update endpoints); None on success, else the reason."""
        worker = self.workers[url]
        try:
            resp = await self._call_with_retries("POST", url + path, json=body,
                                                 timeout=timeout or self.config.weight_update_timeout_s)
        except _NoReply as exc:
            await self._note_failure(worker, str(exc))
            return str(exc)
        try:
            reply = resp.json()
        except ValueError:
            reply = {}
        if resp.status_code != 200 or (isinstance(reply, dict) and reply.get("success") is False):
            message = reply.get("message") if isinstance(reply, dict) else None
            return f"{path}: HTTP {resp.status_code} {message or resp.text[:200]}"
        self._note_success(worker)
        return None

    async def post_workers(self, urls: list[str], path: str, body: dict[str, Any],
                           timeout: float | None = None) -> dict[str, str | None]:
        """post_worker on each of ``urls`` at once: url -> None (ok) or the reason it failed."""
        results = await asyncio.gather(*(self.post_worker(u, path, body, timeout) for u in urls))
        return dict(zip(urls, results, strict=True))

    async def server_info(self, url: str) -> dict[str, Any]:
        """A worker's server info (its ServerArgs: ``tp_size``, ``dp_size``, ...) from its release's
        endpoint (``/server_info``; ``/get_server_info`` on 0.5.5.post3, deprecated later); EngineError
        naming the worker when it does not answer with a JSON object."""
        api = await self._worker_api(self.workers[url])
        path = api.server_info_path if api is not None else "/get_server_info"
        try:
            resp = await self._call_with_retries("GET", url + path)
            info = resp.json()
        except (_NoReply, ValueError) as exc:
            raise EngineError(f"{url}{path}: {exc}") from exc
        if resp.status_code != 200 or not isinstance(info, dict):
            raise EngineError(f"{url}{path}: HTTP {resp.status_code} {resp.text[:200]}")
        return info

    async def commit_version(self, version: int, replies: dict[str, str | None]) -> WorkerSyncResult:
        """After a sync to ``version``: make it the current version, read every worker's served
        version (authoritative), and let the rotation and the router follow. When no worker serves
        ``version``, the previous version stays current (its workers keep serving; the caller retries)."""
        previous, self.weight_version = self.weight_version, version
        await self.probe_all()
        if not self.rotation_workers():
            self.weight_version = previous
            await self.probe_all()
        result = WorkerSyncResult()
        for url, worker in self.workers.items():
            if in_rotation(worker, version):
                result.updated.append(url)
            else:
                result.failed[url] = replies.get(url) or (
                    "does not answer" if not worker.reachable else f"serves weight version {worker.served_version}"
                )
        for url, reason in result.failed.items():
            log.error("weight version %d did not reach SGLang worker %s (%s); it stays out of the rotation until "
                      "a later sync catches it up", version, url, reason)
        return result
