"""The SGLang client's table of workers: who they are, what they serve, and the router's list.

Membership rules are pure functions in membership.py; this module applies them with I/O:
- discovery: the configured URLs, `config.discover` (pods, discovery.py) re-asked before weight
  updates and health checks, or the router's own list at start;
- probes: each worker's release is detected once (protocol.detect_worker_api) and its served
  weight version read from its version endpoint, never ``/health`` (SGLang's ``/health`` may run a
  generation and block during syncs, docs/sglang_standin.md); a background monitor re-probes workers
  out of the rotation with backoff and the router at a steady pace;
- the router: the client owns its worker list and makes it equal the rotation, judged against the
  list the router reports each time (a router that restarted empty gets the rotation back);
- a weight sync's commit: the new version becomes current only where workers serve it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

from rljob.runtime.engines.auth import router_worker_body
from rljob.runtime.engines.base import EngineError, MemberSync
from rljob.runtime.engines.http_retry import HttpCaller, NoReply, strip_url
from rljob.runtime.engines.membership import (
    ProbePolicy,
    WorkerView,
    adds_due,
    due,
    in_rotation,
    observe_probe,
    router_plan,
)
from rljob.runtime.engines.protocol import HEALTH, MODEL_INFO, V1_LOADS, WEIGHT_VERSION_KEY, WorkerApi, detect_worker_api
from rljob.runtime.engines.sglang_config import SGLangClientConfig

log = logging.getLogger(__name__)


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


class WorkerTable:
    """The workers behind one SGLang engine, their probes and the router's list (module docstring)."""

    def __init__(self, config: SGLangClientConfig, caller: HttpCaller, weight_version: int) -> None:
        self.config = config
        self.caller = caller
        self.weight_version = weight_version  # the job's current version: the rotation's target
        self.router_url = strip_url(config.router_url) if config.router_url else None
        # Until the first probe (start(), the monitor, health()) a worker is taken at the initial version.
        self.workers: dict[str, WorkerState] = {
            strip_url(u): WorkerState(strip_url(u), served_version=weight_version) for u in config.worker_urls
        }
        self.router_up = True
        self.syncing_now = False  # a weight sync is under way: versions move, the monitor waits (see syncing())
        self._probes = ProbePolicy(config.probe_interval_s, config.probe_backoff_s, config.probe_backoff_max_s)
        self._monitor_task: asyncio.Task[None] | None = None
        self._membership_lock = asyncio.Lock()
        self._router_filled = False  # some worker was added: an empty router later means it restarted
        self._router_posted: dict[str, float] = {}  # url -> when it was last posted to the router, until listed

    def start_monitor(self) -> None:
        """Start the background probes (membership.probe_delay decides each worker's turn)."""
        self._monitor_task = asyncio.create_task(self._monitor(), name="sglang-membership-monitor")

    async def stop_monitor(self) -> None:
        """Stop the background probes."""
        if self._monitor_task is not None:
            self._monitor_task.cancel()
            await asyncio.gather(self._monitor_task, return_exceptions=True)
            self._monitor_task = None

    def healthy_workers(self) -> list[WorkerState]:
        """Workers that answer: included in aborts, load polls and weight updates."""
        return [w for w in self.workers.values() if w.healthy]

    def rotation_workers(self) -> list[WorkerState]:
        """Workers requests may go to: answering and at the current weight version."""
        return [w for w in self.workers.values() if in_rotation(w, self.weight_version)]

    def note_success(self, worker: WorkerState) -> None:
        worker.failures = 0
        if not worker.healthy:
            worker.healthy = True
            log.info("SGLang worker %s answers again; it rejoins the rotation once it serves weight version %d",
                     worker.url, self.weight_version)

    async def note_failure(self, worker: WorkerState, error: str) -> None:
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

    async def discover_workers(self) -> list[str]:
        """Worker URLs from the router: ``GET /workers`` (new API) or ``GET /list_workers`` (old)."""
        if self.router_url is None:
            raise EngineError("no router_url configured to discover SGLang workers from")
        for path in ("/workers", "/list_workers"):
            try:
                resp = await self.caller.call_with_retries("GET", self.router_url + path)
            except NoReply as exc:
                raise EngineError(f"cannot reach the sglang router at {self.router_url} ({exc}); is it running?") from exc
            if resp.status_code != 200:
                continue
            body = resp.json()
            if isinstance(body.get("workers"), list):
                return [strip_url(w["url"] if isinstance(w, dict) else str(w)) for w in body["workers"]]
            if isinstance(body.get("urls"), list):
                return [strip_url(str(u)) for u in body["urls"]]
        raise EngineError(f"the sglang router at {self.router_url} lists no workers (/workers, /list_workers)")

    async def refresh_workers(self) -> None:
        """Adopt the worker set `config.discover` reports: new workers join, vanished ones leave.

        A discovery failure is logged and the known workers are kept (the next call retries).
        """
        if self.config.discover is None:
            return
        try:
            urls = {strip_url(u) for u in await self.config.discover()}
        except Exception as exc:  # the discovery's own retries are spent; keep serving with what we know
            log.warning("SGLang worker discovery failed, keeping %d known workers: %s", len(self.workers), exc)
            return
        for url in sorted(urls - set(self.workers)):
            log.info("SGLang worker %s discovered; it joins the rotation once it serves the current weights", url)
            self.workers[url] = WorkerState(url)  # version unknown until probed: out of the rotation
        for url in sorted(set(self.workers) - urls):
            log.info("SGLang worker %s is gone from discovery (scaled down or restarting)", url)
            del self.workers[url]

    async def _detect_api(self, worker: WorkerState) -> WorkerApi | None:
        """The endpoints of the worker's release (protocol.detect_worker_api), or None when it does not
        answer the probes; asked once per worker, and again after the worker was unreachable (a
        restarted pod may run another image)."""
        timeout = self.config.probe_timeout_s
        try:
            model_info = await self.caller.request("GET", worker.url + MODEL_INFO, timeout=timeout)
            if model_info.status_code not in (200, 404):
                return None  # loading (503) or failing: the release cannot be told yet
            loads = await self.caller.request("GET", worker.url + V1_LOADS, timeout=timeout)
            api = detect_worker_api(model_info.status_code, loads.status_code)
            resp = await self.caller.request("GET", worker.url + api.server_info_path, timeout=self.config.control_timeout_s)
            info = resp.json() if resp.status_code == 200 else {}
        except (NoReply, ValueError):
            return None
        api = api.with_server_info(info if isinstance(info, dict) else {})
        log.info("SGLang worker %s: release %s, tp_size %d, dp_size %d; weight version from %s, load from %s",
                 worker.url, api.release or "unknown", api.tp_size, api.dp_size, api.weight_version_path, api.load_path)
        return api

    async def worker_api(self, worker: WorkerState) -> WorkerApi | None:
        if worker.api is None:
            worker.api = await self._detect_api(worker)
        return worker.api

    async def _probe_version(self, worker: WorkerState) -> tuple[bool, int | None]:
        """(answers, the weight version it serves as an int or None). Whether it answers is read from the
        version endpoint itself, not ``/health``: SGLang's ``/health`` may run a generation (at least 1 s,
        blocked while generation is paused or weights update; docs/sglang_standin.md), so it would flap
        during syncs. Any reply below 500 means the server is up."""
        api = await self.worker_api(worker)
        if api is None:
            return False, None
        try:
            resp = await self.caller.request("GET", worker.url + api.weight_version_path, timeout=self.config.probe_timeout_s)
        except NoReply:
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
        up = await self.caller.probe(self.router_url + HEALTH, self.config.probe_timeout_s)
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
            if self.syncing_now:
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
                resp = await self.caller.request("GET", self.router_url + path, timeout=self.config.probe_timeout_s)
            except NoReply:
                return None
            if resp.status_code != 200:
                continue
            body = resp.json()
            if isinstance(body.get("workers"), list):
                return {
                    strip_url(w["url"] if isinstance(w, dict) else str(w)): str(w.get("id", w["url"]) if isinstance(w, dict) else w)
                    for w in body["workers"]
                }
            if isinstance(body.get("urls"), list):
                return {strip_url(str(u)): strip_url(str(u)) for u in body["urls"]}
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
            body = router_worker_body(url, self.config.api_key)
            resp = await self.caller.request("POST", self.router_url + "/workers", json=body, timeout=self.config.probe_timeout_s)
            if resp.status_code == 404:  # old router API
                resp = await self.caller.request("POST", self.router_url + "/add_worker", params={"url": url},
                                                 timeout=self.config.probe_timeout_s)
        except NoReply as exc:
            log.warning("could not add worker %s to the sglang router: %s", url, exc)
            return
        if resp.status_code >= 300 and "already" not in resp.text.lower():
            log.warning("the sglang router refused to add %s: HTTP %d %s", url, resp.status_code, resp.text[:200])
            return
        log.info("worker %s serves weight version %d: added to the sglang router", url, self.weight_version)

    async def _router_remove(self, url: str, worker_id: str) -> None:
        assert self.router_url is not None
        try:
            resp = await self.caller.request("DELETE", self.router_url + f"/workers/{worker_id}", timeout=self.config.probe_timeout_s)
            if resp.status_code == 404:  # old router API
                resp = await self.caller.request("POST", self.router_url + "/remove_worker", params={"url": url},
                                                 timeout=self.config.probe_timeout_s)
        except NoReply as exc:
            log.warning("could not remove worker %s from the sglang router: %s", url, exc)
            return
        if resp.status_code >= 300:
            log.warning("the sglang router refused to remove %s: HTTP %d %s", url, resp.status_code, resp.text[:200])
            return
        log.info("worker %s removed from the sglang router until it serves weight version %d", url, self.weight_version)

    @contextlib.asynccontextmanager
    async def syncing(self) -> AsyncIterator[None]:
        """Hold the background monitor while a weight sync runs: workers reach the new version before
        it becomes the target, and a probe in between would take them out of the rotation for nothing."""
        self.syncing_now = True
        try:
            yield
        finally:
            self.syncing_now = False

    async def commit_version(self, version: int, replies: Mapping[str, str | None]) -> MemberSync:
        """After a sync to ``version``: make it the current version, read every worker's served
        version (authoritative), and let the rotation and the router follow. When no worker serves
        ``version``, the previous version stays current (its workers keep serving; the caller retries)."""
        previous, self.weight_version = self.weight_version, version
        await self.probe_all()
        if not self.rotation_workers():
            self.weight_version = previous
            await self.probe_all()
        result = MemberSync()
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
