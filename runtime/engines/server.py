"""The embedded engine behind SGLang's HTTP API, so the SGLang client, the real sglang router and the
operator's probes can all be exercised on CPU.

Run: ``python -m rljob.runtime.engines.server --model-path DIR --host 127.0.0.1 --port 30000``.
The HTTP port is bound at once; the model loads in the background and ``/health``,
``/health_generate`` and ``/generate`` answer 503 until it is ready, like SGLang while starting.

It stands in for a real SGLang release (``--sglang-version``: 0.5.23 by default, or 0.5.5.post3), and
reproduces what the runtime depends on the way that release's source does it: ``/health`` semantics,
requests blocked while generation is paused or weights are updating, the context-length check, duplicate
request ids, aborts of queued and running requests with their reply shapes, and which version endpoints
exist. docs/sglang_standin.md cites the SGLang function behind each behaviour.
Older SGLang behaviours the client must tolerate are reproduced by a test-only subclass
(tests/helpers/server_faults.py); this module has no fault switches. The TP ranks' side of the
weight-update groups is server_groups.py, the pause flag and model-update lock admission.py.

Why one module of about 850 lines: each handler mirrors one SGLang endpoint and they share one
state (the engine, the admission gate, the table of live request ids, the served version string);
split further, every part would reach into the others.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel, ValidationError

import rljob.runtime.engines.protocol as proto
from rljob.runtime.engines.admission import AdmissionGate
from rljob.runtime.engines.auth import api_key_middleware
from rljob.runtime.engines.base import EngineError, GenerateRequest, GenerateResult, WeightUpdate
from rljob.runtime.engines.embedded import DEFAULT_PREFIX_CACHE_TOKENS, EmbeddedEngine, InvalidRequestError
from rljob.runtime.engines.server_groups import GroupError, TPRankGroups
from rljob.runtime.weight_group import FLATTENED_BUCKET

log = logging.getLogger(__name__)

SGLangRelease = Literal["0.5.23", "0.5.5.post3"]
SGLANG_RELEASES: tuple[SGLangRelease, ...] = ("0.5.23", "0.5.5.post3")
LEGACY_RELEASE: SGLangRelease = "0.5.5.post3"
# SGLang's --dtype names that a CPU server serves well (its half/float16 would decode slowly on a CPU).
SERVED_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16}
HEALTH_POLL_S = 1.0  # SGLang's /health loop sleeps 1 s before each look at the scheduler's last output
HEALTH_RID_PREFIX = "HEALTH_CHECK"
# SGLang's environment switches for /health (sglang/srt/environ.py) and their defaults.
HEALTH_GENERATION_ENV = "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"
HEALTH_TIMEOUT_ENV = "SGLANG_HEALTH_CHECK_TIMEOUT"
DEFAULT_HEALTH_CHECK_TIMEOUT_S = 20.0


class Tokenizer(Protocol):
    """The two tokenizer methods the server uses (text input/output only)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass
class ServerOptions:
    """How the server presents itself and which SGLang release it stands in for."""

    model_path: str = "in-memory"
    weight_version: str = "0"
    startup_delay_s: float = 0.0  # extra time /health answers 503 after the model has loaded
    tokenizer: Tokenizer | None = None
    weight_group_timeout_s: float = 300.0  # joining and each broadcast of a weight-update group
    # Tensor-parallel ranks: each joins weight-update groups as its own rank (rank_offset + tp_rank) and
    # receives every broadcast, as SGLang's TP workers do. Decoding itself stays on one CPU engine.
    tp_size: int = 1
    sglang_version: SGLangRelease = "0.5.23"  # the release whose behaviours are reproduced
    health_endpoint_generation: bool = True  # SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION
    health_check_timeout_s: float = DEFAULT_HEALTH_CHECK_TIMEOUT_S  # SGLANG_HEALTH_CHECK_TIMEOUT
    api_key: str | None = None  # --api-key: every call but health/ready/metrics needs it (engines/auth.py)

    @property
    def legacy(self) -> bool:
        """True when standing in for 0.5.5.post3 (the pinned image) rather than 0.5.23."""
        return self.sglang_version == LEGACY_RELEASE


def _env_bool(environ: Mapping[str, str], name: str, default: bool) -> bool:
    """A boolean environment switch spelled as SGLang's EnvBool accepts it."""
    raw = environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in ("true", "1", "yes", "y"):
        return True
    if value in ("false", "0", "no", "n"):
        return False
    raise ValueError(f"{name}={raw!r}: expected true/false (or 1/0, yes/no, y/n)")


def health_settings(environ: Mapping[str, str]) -> tuple[bool, float]:
    """(health endpoint generation on, health check timeout in s) from SGLang's environment variables."""
    raw_timeout = environ.get(HEALTH_TIMEOUT_ENV)
    try:
        timeout = float(int(raw_timeout)) if raw_timeout is not None else DEFAULT_HEALTH_CHECK_TIMEOUT_S
    except ValueError as exc:
        raise ValueError(f"{HEALTH_TIMEOUT_ENV}={raw_timeout!r}: expected a whole number of seconds") from exc
    return _env_bool(environ, HEALTH_GENERATION_ENV, True), timeout


class JsonError(Exception):
    """Raised by a handler: answered as SGLang's JSON error body with ``status``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _json_error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


async def read_body(request: web.Request, model: type[BaseModel]) -> Any:
    """Parse the JSON body (empty body = {}) into ``model``; 400 with the field path on error."""
    raw = await request.read()
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "body"
        raise JsonError(400, f"invalid {request.path} request: {field}: {first['msg']}") from exc


def _as_list(value: Any, n: int) -> list[Any]:
    return list(value) if isinstance(value, list) else [value] * n


class _SGLangMetrics(Collector):
    """SGLang-named gauges and counters read from the engine at scrape time."""

    def __init__(self, server: SGLangProtocolServer) -> None:
        self._server = server

    def collect(self) -> Iterator[Metric]:
        engine = self._server.engine
        labels = {"model_name": self._server.options.model_path}
        load = engine.current_load()
        stats = engine.stats
        capacity = max(1, self._server.max_total_num_tokens)

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=list(labels))
            g.add_metric(list(labels.values()), value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=list(labels))
            c.add_metric(list(labels.values()), value)
            return c

        yield gauge("sglang:num_running_reqs", "Running requests.", load.running)
        yield gauge("sglang:num_queue_reqs", "Waiting requests.", load.waiting)
        yield gauge("sglang:num_used_tokens", "Tokens held in the KV cache.", engine.used_tokens())
        yield gauge("sglang:token_usage", "KV cache usage (0-1).", engine.used_tokens() / capacity)
        yield gauge(
            "sglang:gen_throughput",
            "Generation throughput of the latest decode step (tokens/s).",
            stats.last_step_tokens_per_s if load.running else 0.0,
        )
        yield gauge("sglang:cache_hit_rate", "Share of prompt tokens served from the prefix cache.", stats.cache_hit_rate)
        # As SGLang's: every admitted prompt token, and those of them the prefix cache served.
        yield counter("sglang:prompt_tokens", "Prompt tokens.", stats.prefill_tokens + stats.cached_prefill_tokens)
        yield counter("sglang:cached_tokens", "Prompt tokens served from the prefix cache.", stats.cached_prefill_tokens)
        yield counter("sglang:generation_tokens", "Generated tokens.", stats.generated_tokens)
        yield counter("sglang:num_requests", "Finished requests.", sum(stats.finished.values()))
        yield counter("sglang:num_aborted_requests", "Requests finished by abort.", stats.finished["abort"])


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class SGLangProtocolServer:
    """An aiohttp application serving one EmbeddedEngine with SGLang's endpoints."""

    def __init__(self, engine: EmbeddedEngine, options: ServerOptions | None = None) -> None:
        self.engine = engine
        self.options = options or ServerOptions()
        self.weight_version = self.options.weight_version
        self._ready = False
        self._startup: asyncio.Task[None] | None = None
        self.gate = AdmissionGate()  # SGLang's pause flag and model-update lock
        self._live_rids: Counter[str] = Counter()  # rids of requests received and not yet answered
        self._control_replies = 0  # weight updates answered: SGLang counts them as scheduler output
        # SGLang's tokenizer manager sends the scheduler one weight update at a time, in arrival order
        # (its communicator's FIFO queue); the others wait here, counted for tests to observe.
        self._update_turn = asyncio.Lock()
        self.updates_queued = 0
        self._unhealthy = False  # the last /health generation timed out (SGLang: ServerStatus.UnHealthy)
        self._groups = TPRankGroups(self.options.tp_size, self.options.weight_group_timeout_s)
        self._runner: web.AppRunner | None = None
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(_SGLangMetrics(self))
        self.app = self._build_app()

    @property
    def max_total_num_tokens(self) -> int:
        """KV capacity in tokens: every batch slot at full context."""
        return self.engine.max_batch_size * self.engine.max_context_len if self._ready else 0

    # ----------------------------------------------------------------- app and lifecycle

    def _build_app(self) -> web.Application:
        # The key is checked first, as SGLang's middleware does, so no handler runs for a caller without it.
        auth: list[Middleware] = [api_key_middleware(self.options.api_key)] if self.options.api_key else []
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[*auth, self._errors])
        routes: list[tuple[str, str, Handler]] = [
            ("*", "/generate", self._generate),
            ("POST", "/abort_request", self._abort_request),
            ("GET", "/health", self._health),
            ("GET", "/health_generate", self._health_generate),
            ("*", "/flush_cache", self._flush_cache),
            ("GET", "/get_model_info", self._model_info),
            ("GET", "/get_server_info", self._server_info),
            ("POST", "/update_weight_version", self._update_weight_version),
            ("POST", "/update_weights_from_disk", self._exclusive(self._update_weights_from_disk)),
            ("POST", "/init_weights_update_group", self._init_weights_update_group),
            ("POST", "/update_weights_from_distributed", self._exclusive(self._update_weights_from_distributed)),
            ("POST", "/destroy_weights_update_group", self._destroy_weights_update_group),
            ("POST", "/pause_generation", self._pause),
            ("POST", "/continue_generation", self._continue),
            ("GET", "/metrics", self._metrics),
        ]
        # The routes only one of the two releases has (sglang/srt/entrypoints/http_server.py, v1_loads.py).
        if self.options.legacy:
            routes += [
                ("GET", "/get_weight_version", self._get_weight_version),
                ("GET", "/get_load", self._get_load),
            ]
        else:
            routes += [
                ("GET", "/model_info", self._model_info),
                ("GET", "/server_info", self._server_info),
                ("GET", "/v1/loads", self._loads),
                ("GET", "/ready", self._ready_endpoint),
            ]
        for method, path, handler in routes:
            app.router.add_route(method, path, handler)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except JsonError as exc:
            return _json_error(exc.status, str(exc))

    async def _on_startup(self, _app: web.Application) -> None:
        self._startup = asyncio.create_task(self._load_model(), name="sglang-protocol-server-startup")

    async def _load_model(self) -> None:
        try:
            await self.engine.start()
        except Exception:
            log.exception("could not load the model from %s; the server stays unhealthy", self.options.model_path)
            return
        await asyncio.sleep(self.options.startup_delay_s)
        self._ready = True
        log.info("model %s loaded; serving", self.options.model_path)

    async def _on_cleanup(self, _app: web.Application) -> None:
        if self._startup is not None:
            self._startup.cancel()
        self._groups.close()
        self._ready = False
        await self.engine.close()

    async def start(self, host: str = "127.0.0.1", port: int = 0, wait_ready: bool = True) -> str:
        """Serve on ``host:port`` (0 = ephemeral) in this event loop; returns the base URL."""
        self._runner = web.AppRunner(self.app, access_log=None, keepalive_timeout=proto.KEEP_ALIVE_S)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound_host, bound_port = self._runner.addresses[0][:2]
        if wait_ready:
            while not self._ready:
                if self._startup is not None and self._startup.done():
                    raise EngineError(f"SGLang-protocol server could not load {self.options.model_path}")
                await asyncio.sleep(0.02)
        return f"http://{bound_host}:{bound_port}"

    async def stop(self) -> None:
        """Stop serving and close the engine (in-flight requests get their partial outputs)."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _require_ready(self) -> None:
        if not self._ready:
            raise JsonError(503, "server is starting: the model is not loaded yet")

    # ----------------------------------------------------------------- generation

    async def _generate(self, request: web.Request) -> web.Response:
        self._require_ready()
        body: proto.GenerateBody = await read_body(request, proto.GenerateBody)
        if body.stream:
            raise JsonError(400, "stream=true is not supported by the CPU SGLang-protocol server; send stream=false")
        batch_inputs, single = self._inputs_of(body)
        n = len(batch_inputs)
        rids = _as_list(body.rid, n) if body.rid is not None else [None] * n
        if len(rids) != n:
            raise JsonError(400, f"rid has {len(rids)} entries for {n} inputs")
        params = _as_list(body.sampling_params, n)
        want_logprobs = _as_list(body.return_logprob, n)
        started = time.perf_counter()
        samples = {sp.n for sp in params}
        if len(samples) > 1:
            raise JsonError(400, "The parallel_sample_num should be the same for all samples in sample params.")
        if (parallel := samples.pop()) > 1:
            batch_inputs, params, want_logprobs = await self._prime(batch_inputs, params, want_logprobs, parallel)
            rids, single = [None] * len(batch_inputs), False
        done = await self._run([rid or uuid.uuid4().hex for rid in rids], batch_inputs, params)
        latency = time.perf_counter() - started
        replies = [
            self._reply(req, res, sp, lp, body.return_text_in_logprobs, latency)
            for (req, res), sp, lp in zip(done, params, want_logprobs, strict=True)
        ]
        return web.json_response(replies[0] if single else replies)

    async def _prime(
        self, batch_inputs: list[list[int]], params: list[proto.SamplingParamsBody], want_logprobs: list[bool], n: int
    ) -> tuple[list[list[int]], list[proto.SamplingParamsBody], list[bool]]:
        """SGLang's ``n`` (``tm._handle_batch_request``): one prefill-only request (``max_new_tokens`` 0) per
        input puts its prompt in the prefix cache, then each input runs ``n`` times, every sample under a
        new random rid (the caller's rid names none of them), answered as one list grouped by input."""
        prefill_only = [sp.model_copy(update={"max_new_tokens": 0}) for sp in params]
        await self._run([uuid.uuid4().hex for _ in batch_inputs], batch_inputs, prefill_only)
        return ([ids for ids in batch_inputs for _ in range(n)], [sp for sp in params for _ in range(n)],
                [lp for lp in want_logprobs for _ in range(n)])

    async def _run(
        self, rids: list[str], batch_inputs: list[list[int]], params: list[proto.SamplingParamsBody]
    ) -> list[tuple[GenerateRequest, GenerateResult]]:
        """One /generate as SGLang's tokenizer manager handles it: register the rids (0.5.23 refuses a
        rid already in flight), wait at the admission gate (pause, weight updates), check the context
        length, then run the requests on the engine while holding the gate's shared side."""
        with self._registered(rids):
            async with self.gate.request():
                for ids, sp in zip(batch_inputs, params, strict=True):
                    self._check_context(ids, sp.max_new_tokens)
                requests = [self._engine_request(rid, ids, sp) for rid, ids, sp in zip(rids, batch_inputs, params, strict=True)]
                try:
                    results = await asyncio.gather(*(self.engine.generate(r) for r in requests))
                except InvalidRequestError as exc:
                    raise JsonError(400, str(exc)) from exc
        return list(zip(requests, results, strict=True))

    @contextlib.contextmanager
    def _registered(self, rids: list[str]) -> Iterator[None]:
        """Track ``rids`` as live while a request runs (aborts match live rids only)."""
        if not self.options.legacy:  # 0.5.5.post3 has no such check and runs both copies
            seen: set[str] = set()
            for rid in rids:
                if self._live_rids[rid] or rid in seen:
                    raise JsonError(400, f"Duplicate request ID detected: {rid}")
                seen.add(rid)
        self._live_rids.update(rids)
        try:
            yield
        finally:
            self._live_rids.subtract(rids)
            for rid in rids:
                if self._live_rids[rid] <= 0:
                    del self._live_rids[rid]

    def _check_context(self, ids: list[int], max_new_tokens: int) -> None:
        """SGLang's length check: the prompt alone must be shorter than the context; the prompt plus
        ``max_new_tokens`` may fill it in 0.5.23 but must stay below it in 0.5.5.post3."""
        context = self.engine.max_context_len
        if len(ids) >= context:
            raise JsonError(400, f"The input ({len(ids)} tokens) is longer than the model's context length ({context} tokens).")
        total = len(ids) + max_new_tokens
        if total >= context if self.options.legacy else total > context:
            raise JsonError(
                400,
                f"Requested token count exceeds the model's maximum context length of {context} tokens: "
                f"{len(ids)} input tokens + {max_new_tokens} max_new_tokens = {total}; shorten the prompt or "
                "lower max_new_tokens.",
            )

    def _inputs_of(self, body: proto.GenerateBody) -> tuple[list[list[int]], bool]:
        if (body.input_ids is None) == (body.text is None):
            raise JsonError(400, "give exactly one of input_ids or text")
        if body.input_ids is not None:
            ids = body.input_ids
            if ids and isinstance(ids[0], list):
                return [list(x) for x in ids], False  # type: ignore[arg-type]
            return [list(ids)], True  # type: ignore[arg-type]
        tok = self.options.tokenizer
        if tok is None:
            raise JsonError(400, "this server has no tokenizer (start it with --tokenizer-path); send input_ids")
        texts = body.text if isinstance(body.text, list) else [body.text]
        return [tok.encode(t) for t in texts if t is not None], not isinstance(body.text, list)

    def _engine_request(self, rid: str, ids: list[int], sp: proto.SamplingParamsBody) -> GenerateRequest:
        stops = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
        if stops and self.options.tokenizer is None:
            raise JsonError(400, "stop strings need a tokenizer: start the server with --tokenizer-path, or use stop_token_ids")
        stop_ids = list(sp.stop_token_ids or [])
        if not sp.ignore_eos:
            stop_ids += self._eos_ids()
        return GenerateRequest(
            rid=rid,
            input_ids=ids,
            max_new_tokens=sp.max_new_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            stop_token_ids=stop_ids,
            stop=stops,
        )

    def _eos_ids(self) -> list[int]:
        """The model's stop tokens (config and generation config), as SGLang derives them."""
        from rljob.runtime.models.loading import stop_token_ids

        return stop_token_ids(self.engine.model, None)

    def _reply(
        self,
        req: GenerateRequest,
        res: GenerateResult,
        sp: proto.SamplingParamsBody,
        return_logprob: bool,
        text_in_logprobs: bool,
        latency: float,
    ) -> dict[str, Any]:
        tok = self.options.tokenizer
        if res.finish_reason == "abort" and not res.output_ids:
            return self._queued_abort_reply(req, return_logprob, latency)
        meta = self._meta_info(req, res, latency)
        reply: dict[str, Any] = {"text": tok.decode(res.output_ids) if tok else "", "meta_info": meta}
        reply["output_ids"] = res.output_ids
        if return_logprob:
            meta["output_token_logprobs"] = [
                [lp, tid, tok.decode([tid]) if (tok and text_in_logprobs) else None]
                for lp, tid in zip(res.output_logprobs, res.output_ids, strict=True)
            ]
        return reply

    def _meta_info(self, req: GenerateRequest, res: GenerateResult, latency: float,
                   message: str | None = None) -> dict[str, Any]:
        """``meta_info`` of a request that ran: ids, finish reason, token counts, version, latency."""
        return {
            "id": req.rid,
            "finish_reason": proto.finish_reason_json(res, req.max_new_tokens, message),
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(res.output_ids),
            "cached_tokens": res.cached_tokens,
            "weight_version": self.weight_version,
            "e2e_latency": latency,
        }

    def _queued_abort_reply(self, req: GenerateRequest, return_logprob: bool, latency: float) -> dict[str, Any]:
        """A request aborted before it ran (still queued): SGLang answers from the tokenizer manager's
        abort path, without ``prompt_tokens``; 0.5.5.post3 also without ``weight_version``."""
        meta: dict[str, Any] = {"id": req.rid, "finish_reason": {"type": "abort", "message": "Abort in waiting queue"}}
        if not self.options.legacy:
            meta["weight_version"] = self.weight_version
            meta["e2e_latency"] = latency
        if return_logprob:
            meta["output_token_logprobs"] = []
        meta["completion_tokens"] = 0
        return {"text": "", "output_ids": [], "meta_info": meta}

    # ----------------------------------------------------------------- abort, health, cache

    async def _abort_request(self, request: web.Request) -> web.Response:
        body: proto.AbortBody = await read_body(request, proto.AbortBody)
        if body.abort_all:
            await self.engine.abort_all()
            return web.Response(status=200)
        for rid in body.rid if isinstance(body.rid, list) else [body.rid]:
            # SGLang forwards an abort only for a rid it holds (exact key); the scheduler then aborts
            # every request whose rid starts with it. A prefix or unknown rid does nothing.
            if rid and self._live_rids[rid]:
                await self.engine.abort(rid)
            else:
                log.info("abort_request for rid %r: no such request in flight (aborts match exact rids); ignored", rid)
        return web.Response(status=200)

    async def _health(self, request: web.Request) -> web.Response:
        self._require_ready()
        if not self.options.health_endpoint_generation:
            return web.Response(status=200)  # SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false: no generation
        return await self._health_generate(request)

    def _progress(self) -> tuple[int, int, int]:
        """Changes whenever SGLang's tokenizer manager would receive scheduler output: tokens, finished
        (or aborted) requests, answered weight updates."""
        stats = self.engine.stats
        return stats.generated_tokens, stats.finished.total(), self._control_replies

    async def _health_generate(self, _request: web.Request) -> web.Response:
        """SGLang's health check: submit a 1-token generation like any request (so it waits while paused
        or while weights update), then look once a second for any scheduler output since the start,
        this request's or another's; none within the health timeout is a 503."""
        self._require_ready()
        before = self._progress()
        probe = asyncio.create_task(
            self._run([f"{HEALTH_RID_PREFIX}_{uuid.uuid4().hex}"], [[0]],
                      [proto.SamplingParamsBody(max_new_tokens=1, temperature=0.0)])
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.options.health_check_timeout_s
        try:
            while loop.time() < deadline:
                await asyncio.sleep(HEALTH_POLL_S)
                if self._progress() != before:
                    self._unhealthy = False
                    return web.Response(status=200)
        finally:
            probe.cancel()
            await asyncio.gather(probe, return_exceptions=True)
        self._unhealthy = True
        log.error("health check failed: no scheduler output for %.0f s (paused=%s, weight update active=%s, "
                  "waiting=%d)", self.options.health_check_timeout_s, self.gate.paused, self.gate.writer_active,
                  self.gate.writers_waiting)
        return web.Response(status=503)

    async def _ready_endpoint(self, _request: web.Request) -> web.Response:
        """0.5.23's ``/ready``: 503 while starting, paused, or after a failed health check."""
        ok = self._ready and not self.gate.paused and not self._unhealthy
        return web.Response(status=200 if ok else 503)

    async def _flush_cache(self, _request: web.Request) -> web.Response:
        load = self.engine.current_load()
        if load.total:
            return web.Response(
                status=400,
                text=f"Cache not flushed: {load.running} running and {load.waiting} waiting requests. Retry when idle.",
            )
        self.engine.flush_prefix_cache()
        return web.Response(status=200, text="Cache flushed.")

    # ----------------------------------------------------------------- info and load

    async def _model_info(self, _request: web.Request) -> web.Response:
        # SGLang serves HTTP only once its scheduler runs: nothing answers while the model loads, so a
        # version read then must not look like a serving worker.
        self._require_ready()
        config = self.engine.model.config
        return web.json_response(
            {
                "model_path": self.options.model_path,
                "tokenizer_path": self.options.model_path if self.options.tokenizer else None,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.weight_version,
                "model_type": getattr(config, "model_type", None),
                "architectures": getattr(config, "architectures", None),
            }
        )

    def _load_record(self) -> dict[str, Any]:
        load = self.engine.current_load()
        used = self.engine.used_tokens()
        return {
            "dp_rank": 0,
            "num_running_reqs": load.running,
            "num_waiting_reqs": load.waiting,
            "num_used_tokens": used,
            "max_total_num_tokens": self.max_total_num_tokens,
            "token_usage": used / max(1, self.max_total_num_tokens),
            "gen_throughput": self.engine.stats.last_step_tokens_per_s if load.running else 0.0,
            "cache_hit_rate": self.engine.stats.cache_hit_rate,
        }

    async def _server_info(self, _request: web.Request) -> web.Response:
        context = self.engine.max_context_len if self._ready else None
        return web.json_response(
            {
                "model_path": self.options.model_path,
                "max_running_requests": self.engine.max_batch_size,
                "dtype": str(self.engine.dtype).removeprefix("torch."),  # ServerArgs.dtype, as resolved
                "context_length": context,
                "max_total_num_tokens": self.max_total_num_tokens,
                "max_req_input_len": context - 1 if context else None,
                "weight_version": self.weight_version,
                "tp_size": self.options.tp_size,
                "dp_size": 1,
                "internal_states": [self._load_record()],
                "version": self.options.sglang_version,  # SGLang's __version__: the release stood in for
            }
        )

    async def _loads(self, _request: web.Request) -> web.Response:
        record = self._load_record()
        return web.json_response({"timestamp": time.time(), "dp_rank_count": 1, "loads": [record]})

    async def _get_load(self, _request: web.Request) -> web.Response:
        record = self._load_record()
        # The older shape: one record per data-parallel rank with num_reqs / num_tokens.
        return web.json_response(
            [{"dp_rank": 0, "num_reqs": record["num_running_reqs"] + record["num_waiting_reqs"], "num_waiting_reqs": record["num_waiting_reqs"],
              "num_tokens": record["num_used_tokens"]}]
        )

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self._registry), content_type="text/plain", charset="utf-8")

    # ----------------------------------------------------------------- weights

    async def _get_weight_version(self, _request: web.Request) -> web.Response:
        self._require_ready()
        return web.json_response({"weight_version": self.weight_version})

    def _engine_version_for(self, version: str | None) -> int:
        try:
            return int(version) if version is not None else self.engine.weight_version + 1
        except ValueError:
            return self.engine.weight_version + 1

    async def _update_weight_version(self, request: web.Request) -> web.Response:
        body: proto.UpdateWeightVersionBody = await read_body(request, proto.UpdateWeightVersionBody)
        if body.abort_all_requests:
            await self.engine.abort_all()
        self.weight_version = body.new_version
        self.engine.weight_version = self._engine_version_for(body.new_version)
        return web.json_response({"success": True, "message": f"weight version set to {body.new_version}",
                                  "new_version": body.new_version})

    async def _update_weights_from_disk(self, request: web.Request) -> web.Response:
        self._require_ready()
        body: proto.UpdateWeightsFromDiskBody = await read_body(request, proto.UpdateWeightsFromDiskBody)
        if body.abort_all_requests:
            await self.engine.abort_all()
        if not Path(body.model_path).is_dir():
            return web.json_response(
                {"success": False, "message": f"model_path {body.model_path} is not a directory on the inference pod"},
                status=400,
            )
        version = self._engine_version_for(body.weight_version)
        try:
            await self.engine.update_weights(WeightUpdate(version=version, path=body.model_path,
                                                          flush_cache=body.flush_cache))
        except Exception as exc:  # any load failure is the caller's checkpoint problem: report, keep serving
            log.warning("update_weights_from_disk %s failed: %s", body.model_path, exc)
            return web.json_response({"success": False, "message": f"failed to load {body.model_path}: {exc}"}, status=400)
        if body.weight_version is not None:
            self.weight_version = body.weight_version
        else:
            self.weight_version = str(version)
        return web.json_response(
            {"success": True, "message": f"loaded {body.model_path}", "num_paused_requests": 0}
        )

    async def _init_weights_update_group(self, request: web.Request) -> web.Response:
        """Join the trainer's weight-update group with every TP rank, as ranks ``rank_offset + tp_rank``
        (gloo here: CPU tensors). All ranks join at once: the group forms only with every rank in."""
        self._require_ready()
        body: proto.InitWeightsUpdateGroupBody = await read_body(request, proto.InitWeightsUpdateGroupBody)
        if body.backend != "gloo":
            return web.json_response({"success": False, "message": f"backend {body.backend!r}: this CPU server "
                                      "joins weight-update groups with gloo only"}, status=400)
        try:  # a group of the same name is left first: the trainer rebuilt it (an engine was replaced or added)
            await self._groups.join(body.master_address, body.master_port, body.rank_offset, body.world_size,
                                    body.group_name)
        except GroupError as exc:
            log.warning("init_weights_update_group %s failed: %s", body.group_name, exc)
            return web.json_response({"success": False, "message": str(exc)}, status=400)
        last = body.rank_offset + self.options.tp_size - 1
        return web.json_response({"success": True, "message": f"joined {body.group_name} as ranks {body.rank_offset}..{last}"})

    async def _update_weights_from_distributed(self, request: web.Request) -> web.Response:
        """Receive the listed tensors by broadcast from rank 0 on every TP rank and install them;
        ``weight_version`` when given."""
        self._require_ready()
        body: proto.UpdateWeightsFromDistributedBody = await read_body(request, proto.UpdateWeightsFromDistributedBody)
        if body.group_name not in self._groups:
            return web.json_response({"success": False, "message": f"no weight-update group {body.group_name}: "
                                      "call /init_weights_update_group first"}, status=400)
        if not len(body.names) == len(body.dtypes) == len(body.shapes):
            raise JsonError(400, "names, dtypes and shapes must have the same length")
        if body.abort_all_requests:
            await self.engine.abort_all()
        try:  # a broken group stays broken: it is dropped, the trainer rebuilds it
            # 0.5.5.post3 has no load_format (its request type drops the field); 0.5.23 takes flattened_bucket.
            flattened = body.load_format == FLATTENED_BUCKET and not self.options.legacy
            tensors = await self._groups.receive(body.group_name, body.names, body.dtypes, body.shapes, flattened)
        except GroupError as exc:
            log.warning("update_weights_from_distributed failed: %s", exc)
            return web.json_response({"success": False, "message": str(exc)}, status=400)
        version = self._engine_version_for(body.weight_version) if body.weight_version is not None else None
        try:
            await self.engine.load_named_tensors(tensors, version, flush_cache=body.flush_cache, adopt=True)
        except EngineError as exc:
            return web.json_response({"success": False, "message": str(exc)}, status=400)
        if body.weight_version is not None:
            self.weight_version = body.weight_version
        return web.json_response({"success": True, "message": f"updated {len(tensors)} tensors",
                                  "num_paused_requests": 0})

    async def _destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body: proto.DestroyWeightsUpdateGroupBody = await read_body(request, proto.DestroyWeightsUpdateGroupBody)
        left = self._groups.destroy(body.group_name)
        return web.json_response({"success": True, "message": f"{body.group_name} destroyed" if left else "no such group"})

    @property
    def update_running(self) -> bool:
        """Whether a weight update has its turn at the scheduler now."""
        return self._update_turn.locked()

    def _exclusive(self, handler: Handler) -> Handler:
        """A weight update as SGLang runs it: ``abort_all_requests`` first, then the model-update lock's
        exclusive side (it waits for the requests in flight and holds new ones back); 0.5.23 skips the
        lock while generation is paused. Either way updates reach the scheduler one at a time, in the
        order they came (0.5.23 ``FanOutCommunicator.queueing_call``, 0.5.5.post3
        ``_Communicator.queueing_call``: one request in flight per communicator, the others queued
        FIFO): a trainer may post bucket k+1 while bucket k is still loading. Its reply counts as
        scheduler output for /health."""

        async def exclusive(request: web.Request) -> web.StreamResponse:
            try:
                wanted = json.loads(await request.read() or b"{}")
            except ValueError:
                wanted = {}  # the handler reports the malformed body
            if isinstance(wanted, dict) and wanted.get("abort_all_requests") is True:
                await self.engine.abort_all()
            async with self.gate.update(skip_when_paused=not self.options.legacy):
                self.updates_queued += 1
                try:
                    await self._update_turn.acquire()
                finally:
                    self.updates_queued -= 1
                try:
                    response = await handler(request)
                finally:
                    self._update_turn.release()
            self._control_replies += 1
            return response

        return exclusive

    async def _pause(self, request: web.Request) -> web.Response:
        body: proto.PauseBody = await read_body(request, proto.PauseBody)
        mode = "abort" if self.options.legacy else body.mode  # 0.5.5.post3 ignores the body
        await self.gate.set_paused(True)  # new requests wait at the gate from now on
        if mode == "abort":
            await self.engine.abort_all()
            if not self.options.legacy:  # 0.5.23 re-aborts until no request holds the lock
                await self.gate.wait_idle()
        else:
            # retract and in_place both keep requests and their KV here: the CPU engine never evicts.
            # SGLang's scheduler takes the pause between two forward passes; the reply here likewise
            # waits for the step in flight, so a caller that reads /v1/loads after it sees a frozen state
            # (a step finishing after the reply emptied the held requests: CI run on 2370df4).
            self.engine.pause()
            await self.engine.settle()
        return web.json_response({"success": True, "message": f"generation paused ({mode})"})

    async def _continue(self, _request: web.Request) -> web.Response:
        await self.gate.set_paused(False)
        self.engine.resume()
        return web.json_response({"success": True, "message": "generation continued"})


# --------------------------------------------------------------------------------- CLI


def _load_tokenizer(path: str | None) -> Tokenizer | None:
    if path is None:
        return None
    from transformers import AutoTokenizer

    # Its decode is typed `str | list[str]` (a list for batched ids); the server decodes one list of ids.
    return AutoTokenizer.from_pretrained(path)  # type: ignore[return-value]


def build_arg_parser() -> argparse.ArgumentParser:
    """The CLI of the CPU SGLang-protocol server (flag names follow sglang.launch_server where they exist)."""
    p = argparse.ArgumentParser(
        prog="python -m rljob.runtime.engines.server",
        description=(
            "Serve a Hugging Face causal LM (a save_pretrained directory) on CPU with the SGLang HTTP API: "
            "/generate, /abort_request, /health, /health_generate, /flush_cache, /v1/loads, "
            "/update_weights_from_disk, /metrics and friends. Token ids in and out; text needs --tokenizer-path."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model-path", required=True, help="directory written by save_pretrained (config.json + weights)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind; keep 127.0.0.1 outside a pod")
    p.add_argument("--port", type=int, default=30000, help="port to bind")
    p.add_argument(
        "--max-batch-size", "--max-running-requests", dest="max_batch_size", type=int, default=32,
        help="most requests decoded together; further ones wait in a FIFO queue",
    )
    p.add_argument(
        "--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1,
        help="tensor-parallel ranks, as SGLang's: each joins weight-update groups as its own rank and receives "
        "every broadcast (decoding stays on one CPU engine)",
    )
    p.add_argument("--context-length", type=int, default=None, help="max prompt + generation tokens (default: model's)")
    p.add_argument("--dtype", choices=sorted(SERVED_DTYPES), default="float32",
                   help="the dtype the weights are served in, as SGLang's flag (this CPU server takes these of its "
                   "choices); /get_server_info reports it, and a weight sync sends that dtype")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
    p.add_argument("--weight-version", default="0", help="initial weight version reported in meta_info")
    p.add_argument("--torch-threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--tokenizer-path", default=None, help="Hugging Face tokenizer directory, to accept text input")
    p.add_argument("--startup-delay", type=float, default=0.0, help="seconds to keep answering 503 after loading")
    p.add_argument("--disable-radix-cache", action="store_true",
                   help="no prefix sharing: every request prefills its own prompt, as SGLang's flag of that name")
    p.add_argument("--enable-metrics", action="store_true", help="accepted for SGLang compatibility; /metrics is always on")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health*, /ready*, /metrics* "
                   "(SGLang's --api-key); in a pod, pass it as $(RLJOB_ENGINE_API_KEY) from the job's Secret")
    p.add_argument(
        "--sglang-version", choices=SGLANG_RELEASES, default=SGLANG_RELEASES[0],
        help="the SGLang release whose HTTP behaviours to reproduce (docs/sglang_standin.md); /health reads "
        f"{HEALTH_GENERATION_ENV} and {HEALTH_TIMEOUT_ENV} from the environment, as SGLang does",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    """Entry point: parse flags, build engine and server, serve until SIGINT/SIGTERM."""
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    if args.tp_size < 1:
        parser.error(f"--tp-size {args.tp_size}: must be at least 1")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not (Path(args.model_path) / "config.json").is_file():
        raise SystemExit(f"--model-path {args.model_path}: no config.json there; pass a save_pretrained() directory")
    try:
        health_generation, health_timeout = health_settings(os.environ)
    except ValueError as exc:
        parser.error(str(exc))
    tokenizer = _load_tokenizer(args.tokenizer_path)
    engine = EmbeddedEngine(
        args.model_path,
        max_batch_size=args.max_batch_size,
        seed=args.seed,
        weight_version=int(args.weight_version) if args.weight_version.isdigit() else 0,
        torch_threads=args.torch_threads,
        max_context_len=args.context_length,
        detokenize=tokenizer.decode if tokenizer is not None else None,  # stop strings
        prefix_cache_tokens=0 if args.disable_radix_cache else DEFAULT_PREFIX_CACHE_TOKENS,
        dtype=SERVED_DTYPES[args.dtype],
    )
    options = ServerOptions(
        model_path=args.model_path,
        weight_version=args.weight_version,
        startup_delay_s=args.startup_delay,
        tokenizer=tokenizer,
        tp_size=args.tp_size,
        sglang_version=args.sglang_version,
        health_endpoint_generation=health_generation,
        health_check_timeout_s=health_timeout,
        api_key=args.api_key or None,
    )
    server = SGLangProtocolServer(engine, options)
    # A short shutdown grace: pods and tests stop workers often, and callers get aborts, not hangs.
    web.run_app(server.app, host=args.host, port=args.port, access_log=None, print=None, shutdown_timeout=3.0,
                keepalive_timeout=proto.KEEP_ALIVE_S)


if __name__ == "__main__":
    main()
