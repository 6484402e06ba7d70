"""Engine client for SGLang workers (real SGLang, or the project's SGLang-protocol server).

Generation goes through the sglang router when one is configured (else straight to the least full
healthy worker). The client holds as many /generate calls in flight as the rotation's workers run
together, each worker counting its own max running requests (capacity.py); a call that waited for its
slot, or for a retry, while ``abort_all`` ran is not sent. Everything the router does not forward or cannot be trusted with goes to every worker
directly: aborts (the router answers 404 to /abort_request), load polling for drain verification, and
weight updates. Follows the client rules of reference/sglang_protocol.md §4, §10, §11. A group's
samples that start from their prompt share its prefill: the first primes one worker with the prompt
and all of them go there, what SGLang's ``n`` does inside the server (prompt_groups.py).

The parts: HTTP calls and their retries (http_retry.py), the worker table with membership, probes
and the router's list (worker_table.py; its rules in membership.py), the configuration
(sglang_config.py), the prompts in flight (prompt_groups.py); this module is the engine: generation,
aborts and drains, weight endpoints.
Why about 540 lines: these three share the per-worker slots and the abort epoch (a call that waited
for its slot while an abort ran must not be sent), so they stay one class.

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
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from rljob.runtime.engines.auth import bearer_headers
from rljob.runtime.engines.capacity import SlotGate
from rljob.runtime.engines.base import (
    Engine,
    EngineError,
    EngineLoad,
    GenerateRequest,
    GenerateResult,
    InvalidRequestError,
    MemberSync,
    WeightUpdate,
    post_and_commit,
)
from rljob.runtime.engines.http_retry import HttpCaller, NoReply, Reply, Timeout
from rljob.runtime.engines.membership import WorkerView, catch_up_needed, engine_healthy
from rljob.runtime.engines.protocol import (
    continue_generation_call,
    HEALTH,
    HEALTH_GENERATE,
    CLIENT_KEEPALIVE_EXPIRY_S,
    Call,
    abort_call,
    attempt_rid,
    error_message,
    generate_call,
    parse_generate_reply,
    parse_load,
    update_weights_from_disk_call,
)
from rljob.runtime.engines.prompt_groups import PromptGroups
from rljob.runtime.engines.sglang_config import SGLangClientConfig
from rljob.runtime.engines.worker_table import WorkerState, WorkerTable

log = logging.getLogger(__name__)

# 4xx replies that say "not now" rather than "never": the request may succeed on a retry or elsewhere.
_TRANSIENT_4XX = frozenset({408, 429})


class SGLangEngine(Engine):
    """The Engine interface over SGLang's HTTP API (router for generation, workers for control), and
    the WeightTargets the distributed and disk transports drive."""

    name = "sglang"

    def __init__(self, config: SGLangClientConfig, weight_version: int = 0) -> None:
        if not config.worker_urls and not config.router_url and config.discover is None:
            raise EngineError("SGLang engine needs worker_urls, a router_url or pod discovery to find workers")
        self.config = config
        # In-flight /generate calls: as many as the rotation's workers run together (capacity.py).
        self._slots = SlotGate(self._capacity)
        self._abort_epoch = 0  # bumped by abort_all: requests older than it must not be retried
        # Pooled connections are dropped before SGLang's keep-alive closes them (protocol.py).
        self._caller = HttpCaller(config.retry_policy(), bearer_headers(config.api_key),
                                  keepalive_s=CLIENT_KEEPALIVE_EXPIRY_S)
        self._prompts = PromptGroups()  # prompts with requests in flight, for shared prefills
        self.table = WorkerTable(config, self._caller, weight_version)

    def worker_capacity(self, worker: WorkerState) -> int:
        """Requests ``worker`` runs at once: its server info's (capacity.py), else the configured default."""
        told = worker.api.capacity if worker.api is not None else None
        return told or self.config.worker_concurrency

    def _capacity(self) -> int:
        """In-flight /generate calls the client allows: the rotation's capacities together (a worker
        that is not in it yet takes nothing; with none, one worker's worth, so a call can fail fast)."""
        current = self.table.rotation_workers()
        return sum(self.worker_capacity(w) for w in current) if current else self.config.worker_concurrency

    @property
    def in_flight(self) -> int:
        """/generate calls holding a slot now."""
        return self._slots.in_use

    @property
    def workers(self) -> dict[str, WorkerState]:
        """The workers by URL (worker_table.py)."""
        return self.table.workers

    @property
    def weight_version(self) -> int:
        """The job's current weight version: the one the rotation serves."""
        return self.table.weight_version

    @property
    def router_up(self) -> bool:
        """Whether the router (if any) answered its last probe."""
        return self.table.router_up

    def served_version(self) -> int | None:
        """The version generation is served at: the current one while any worker is in the rotation."""
        return self.weight_version if self.table.rotation_workers() else None

    def needs_catch_up(self) -> bool:
        """Every worker out of the rotation, some answering at another version (membership.catch_up_needed)."""
        return catch_up_needed(list(self.workers.values()), self.weight_version)

    # ----------------------------------------------------------------- lifecycle

    async def _resume_generation(self, url: str) -> None:
        """``/continue_generation`` on one worker, best effort: its health probe decides what follows."""
        call = continue_generation_call()
        try:
            await self._caller.call(call.method, url + call.path, json=call.body, timeout=self.config.probe_timeout_s)
        except NoReply as err:
            log.info("could not resume generation on %s before probing it: %s", url, err)

    async def start(self) -> None:
        """Discover workers if none are configured, then wait until each answers ``/health_generate``."""
        deadline = time.monotonic() + self.config.health_timeout_s
        if not self.workers and self.config.discover is not None:
            # The pools may still be loading weights: wait for the first ready worker.
            await self.table.refresh_workers()
            while not self.workers and time.monotonic() < deadline:
                await asyncio.sleep(2.0)
                await self.table.refresh_workers()
        if not self.workers:
            urls = await self.table.discover_workers()
            while not urls and time.monotonic() < deadline:
                # The router lists a worker only once its own health check (an SGLang /health, which
                # may take a generation's time) has passed.
                await asyncio.sleep(0.5)
                urls = await self.table.discover_workers()
            self.table.workers = {u: WorkerState(u, served_version=self.weight_version) for u in urls}
        # A trainer killed inside a weight sync (between /pause_generation and /continue_generation)
        # leaves its workers paused, and a paused worker never passes /health_generate: this trainer
        # resumes them first (continue_generation changes nothing on a running worker).
        await asyncio.gather(*(self._resume_generation(u) for u in self.workers))
        pending = set(self.workers)
        while pending and time.monotonic() < deadline:
            results = await asyncio.gather(
                *(self._caller.probe(u + HEALTH_GENERATE, self.config.health_generate_timeout_s) for u in pending)
            )
            pending -= {u for u, ok in zip(list(pending), results, strict=True) if ok}
            if pending:
                await asyncio.sleep(1.0)
        for url in pending:
            self.workers[url].healthy = False
            log.warning("SGLang worker %s did not pass /health_generate within %.0f s", url, self.config.health_timeout_s)
        if not self.table.healthy_workers():
            raise EngineError(
                f"no SGLang worker became healthy within {self.config.health_timeout_s:.0f} s "
                f"({', '.join(self.workers)}): check that the inference pods run and /health_generate answers 200"
            )
        if self.table.router_url is not None:
            while not await self._caller.probe(self.table.router_url + HEALTH, self.config.probe_timeout_s):
                if time.monotonic() > deadline:
                    raise EngineError(f"the sglang router at {self.table.router_url} does not answer /health; is it running?")
                await asyncio.sleep(0.5)
        await self.table.probe_all()
        self.table.start_monitor()

    async def close(self) -> None:
        """Stop the monitor and close the HTTP connection pool."""
        await self.table.stop_monitor()
        await self._caller.close()

    async def health(self) -> bool:
        """Probe the router and every worker now; True when the router answers and a worker is in the rotation."""
        await self.table.refresh_workers()
        await self.table.probe_all()
        return engine_healthy(self.table.router_url is not None, self.table.router_up, list(self.workers.values()), self.weight_version)

    async def _fan_out(self, method: str, path: str, json: Any = None) -> dict[str, Reply]:
        """Send one call to every healthy worker at once; failures are logged and noted, never raised."""
        workers = self.table.healthy_workers()

        async def one(worker: WorkerState) -> Reply | None:
            try:
                resp = await self._caller.call_with_retries(method, worker.url + path, json=json)
            except NoReply as exc:
                log.warning("%s %s%s failed: %s", method, worker.url, path, exc)
                await self.table.note_failure(worker, str(exc))
                return None
            self.table.note_success(worker)
            return resp

        replies = await asyncio.gather(*(one(w) for w in workers))
        return {w.url: r for w, r in zip(workers, replies, strict=True) if r is not None}

    # ----------------------------------------------------------------- generation

    def _generate_target(self, prefer: str | None = None) -> tuple[str, WorkerState | None]:
        if self.table.router_url is not None:
            if not self.table.router_up:
                raise EngineError(f"the sglang router at {self.table.router_url} is down; generation waits until it answers")
            return self.table.router_url, None
        current = self.table.rotation_workers()
        if not current:
            raise EngineError(
                f"no SGLang worker is in the rotation at weight version {self.weight_version} ("
                + ", ".join(f"{w.url}: {w.last_error or f'serves {w.served_version}'}" for w in self.workers.values())
                + "); check the inference pods and the weight sync, then call health() to re-admit them"
            )
        preferred = [w for w in current if w.url == prefer]
        worker = preferred[0] if preferred else min(current, key=lambda w: w.in_flight / self.worker_capacity(w))
        return worker.url, worker

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """POST /generate (router or least busy worker); see the module docstring for failures.

        A request marked ``share_prefill`` (a group's sample starting from its prompt) joins the other
        requests of the same prompt: the first primes a worker with the prompt, and all of them go there
        (prompt_groups.py), so the worker prefills the prompt once for the group.
        """
        submitted_version = self.weight_version
        if request.max_new_tokens <= 0:
            return GenerateResult(request.rid, [], [], "length", submitted_version, len(request.input_ids))
        epoch = self._abort_epoch
        if not (request.share_prefill and self.config.share_prefill):
            result, _ = await self._generate_with_slot(request, submitted_version, epoch, None)
            return result
        async with self._prompts.join(request.input_ids, lambda: self._prime(request, epoch)) as primed:
            result, _ = await self._generate_with_slot(request, submitted_version, epoch, primed)
            return result

    async def _prime(self, request: GenerateRequest, epoch: int) -> str | None:
        """Prefill ``request``'s prompt alone (``max_new_tokens`` 0, SGLang's prefill-only request, what its
        ``n`` sends first); returns the worker that holds it now (None through the router, which routes
        the samples by their prefix itself, or when priming failed: the samples then go as usual)."""
        prime = replace(request, rid=request.rid + "prime", max_new_tokens=0)
        try:
            result, url = await self._generate_with_slot(prime, self.weight_version, epoch, None)
        except EngineError as exc:  # also a refused request: each sample meets the refusal itself
            log.info("could not prime the prompt of %s (its samples go unprimed): %s", request.rid, exc)
            return None
        return url if result.finish_reason != "abort" else None

    async def _generate_with_slot(
        self, request: GenerateRequest, submitted_version: int, epoch: int, prefer: str | None
    ) -> tuple[GenerateResult, str | None]:
        """_generate_in_slot holding one of the client's in-flight slots."""
        await self._slots.acquire()
        try:
            return await self._generate_in_slot(request, submitted_version, epoch, prefer)
        finally:
            self._slots.release()

    async def _generate_in_slot(
        self, request: GenerateRequest, submitted_version: int, epoch: int, prefer: str | None
    ) -> tuple[GenerateResult, str | None]:
        """generate()'s attempts, once it holds a slot; ``epoch``: the abort epoch it was submitted in;
        ``prefer``: the worker to send it to while that one is in the rotation. Returns the result and the
        worker that answered (None through the router)."""
        timeout = Timeout(self.config.generate_timeout_s, connect_s=self.config.control_timeout_s)
        aborted = GenerateResult(request.rid, [], [], "abort", submitted_version, len(request.input_ids))
        last_error = ""
        for attempt in range(self.config.retries + 1):
            if self._abort_epoch != epoch:
                # abort_all ran while this request waited for its slot or its retry: sending it now would
                # start work the drain must abort again (and could stretch it past drainTimeoutSeconds).
                return aborted, None
            base, worker = self._generate_target(prefer)
            call = generate_call(request, attempt_rid(request.rid, attempt))
            if worker is not None:
                worker.in_flight += 1
            try:
                resp = await self._caller.call(call.method, base + call.path, json=call.body, timeout=timeout)
            except NoReply as exc:
                last_error = str(exc)
                if exc.timed_out:
                    await self._abort_timed_out(worker, call)
                if worker is None and not exc.sent:
                    # Nothing listens on the router's port: fail now, the scheduler waits for health().
                    self.table.router_up = False
                    raise EngineError(f"the sglang router at {base} refused the connection for {request.rid}") from exc
                log.warning("generate %s on %s failed (attempt %d): %s", request.rid, base, attempt + 1, exc)
                await self._after_generate_failure(worker, last_error)
                if exc.sent and self._abort_epoch != epoch:
                    return aborted, None  # aborted meanwhile: the caller wants the request back, not a retry
                await self._caller.backoff(attempt)
                continue
            finally:
                if worker is not None:
                    worker.in_flight -= 1
            if worker is not None:
                self.table.note_success(worker)
            result = replace(self._parse_generate(resp, base, request, submitted_version), rid=request.rid)
            return result, worker.url if worker is not None else None
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
        with contextlib.suppress(NoReply):
            await self._caller.call(abort.method, worker.url + abort.path, json=abort.body)

    async def _after_generate_failure(self, worker: WorkerState | None, error: str) -> None:
        if worker is not None:
            await self.table.note_failure(worker, error)
            return
        # Through the router we cannot tell which worker failed: probe them all.
        await asyncio.gather(*(self.table.note_failure(w, f"router reported: {error}") for w in self.table.healthy_workers()))

    def _parse_generate(
        self, resp: Reply, base: str, request: GenerateRequest, submitted_version: int
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
        workers = self.table.healthy_workers()

        async def one(worker: WorkerState) -> EngineLoad | None:
            try:
                api = await self.table.worker_api(worker)
                if api is None:
                    raise NoReply(worker.url, "does not answer its release's probes", sent=False)
                resp = await self._caller.call_with_retries("GET", worker.url + api.load_path)
                if resp.status_code != 200:
                    raise ValueError(f"HTTP {resp.status_code} from {api.load_path}: {resp.text[:200]}")
                load = parse_load(resp.json())
            except (NoReply, ValueError) as exc:
                log.warning("load of SGLang worker %s unavailable: %s", worker.url, exc)
                await self.table.note_failure(worker, f"load poll: {exc}")
                return None
            self.table.note_success(worker)
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

    async def update_weights_from_disk(self, path: str, version: int) -> MemberSync:
        """``/update_weights_from_disk`` on every answering worker, then membership by the versions the
        workers report (base.post_and_commit: the disk transport's path too)."""
        call = update_weights_from_disk_call(path, version)
        return await post_and_commit(self, version, call.path, call.body or {})

    async def _post_worker(self, url: str, path: str, body: dict[str, Any], timeout: float | None = None) -> str | None:
        """One control POST to a worker (weight-update endpoints); None on success, else the reason."""
        worker = self.workers[url]
        try:
            resp = await self._caller.call_with_retries("POST", url + path, json=body,
                                                 timeout=timeout or self.config.weight_update_timeout_s)
        except NoReply as exc:
            await self.table.note_failure(worker, str(exc))
            return str(exc)
        try:
            reply = resp.json()
        except ValueError:
            reply = {}
        if resp.status_code != 200 or (isinstance(reply, dict) and reply.get("success") is False):
            message = reply.get("message") if isinstance(reply, dict) else None
            return f"{path}: HTTP {resp.status_code} {message or resp.text[:200]}"
        self.table.note_success(worker)
        return None

    async def post(self, urls: Sequence[str], path: str, body: dict[str, Any],
                   timeout: float | None = None) -> dict[str, str | None]:
        """_post_worker on each of ``urls`` at once: url -> None (ok) or the reason it failed."""
        results = await asyncio.gather(*(self._post_worker(u, path, body, timeout) for u in urls))
        return dict(zip(urls, results, strict=True))

    async def member_info(self, url: str) -> dict[str, Any]:
        """A worker's server info (its ServerArgs: ``tp_size``, ``dp_size``, ...) from its release's
        endpoint (``/server_info``; ``/get_server_info`` on 0.5.5.post3, deprecated later); EngineError
        naming the worker when it does not answer with a JSON object."""
        api = await self.table.worker_api(self.workers[url])
        path = api.server_info_path if api is not None else "/get_server_info"
        try:
            resp = await self._caller.call_with_retries("GET", url + path)
            info = resp.json()
        except (NoReply, ValueError) as exc:
            raise EngineError(f"{url}{path}: {exc}") from exc
        if resp.status_code != 200 or not isinstance(info, dict):
            raise EngineError(f"{url}{path}: HTTP {resp.status_code} {resp.text[:200]}")
        return info

    # ----------------------------------------------------------------- WeightTargets (engines/base.py)

    def syncing(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Hold the background monitor while a weight sync runs: workers reach the new version before
        it becomes the target, and a probe in between would take them out of the rotation for nothing."""
        return self.table.syncing()

    async def refresh_members(self) -> None:
        """Adopt the workers discovery reports (replicas added by scaling), then probe every one."""
        await self.table.refresh_workers()
        await self.table.probe_all()

    def members(self) -> Mapping[str, WorkerView]:
        """Every known worker by URL, as last probed."""
        return self.table.workers

    async def commit(self, version: int, replies: Mapping[str, str | None]) -> MemberSync:
        """worker_table.commit_version: ``version`` becomes current where workers serve it."""
        return await self.table.commit_version(version, replies)
