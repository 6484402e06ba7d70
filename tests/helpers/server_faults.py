"""Older SGLang behaviours and failed forwards, for tests only: the CPU SGLang-protocol server with fault switches.

The production server (runtime/engines/server.py) reproduces the releases the project runs; the
client must also tolerate replies and failures of older servers, and the 500 that sglang-router
answers when its forward to a worker breaks. This subclass overrides the affected handlers;
everything else is the production server.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Literal

from aiohttp import web

import rljob.runtime.engines.protocol as proto
from rljob.runtime.engines.base import GenerateRequest, GenerateResult
from rljob.runtime.engines.embedded import EmbeddedEngine
from rljob.runtime.engines.server import JsonError, SGLangProtocolServer, ServerOptions, read_body

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Faults:
    """Which older behaviours the server shows."""

    legacy_abort_reply: bool = False  # aborted-before-prefill replies lack output ids/log-probs
    require_abort_rid: bool = False  # /abort_request without "rid" -> 422 (old versions)
    ignore_first_aborts: int = 0  # the first N /abort_request calls are acknowledged but do nothing
    health_generate: Literal["none", "hang", "503"] = "none"  # /health_generate hangs or fails
    # The first N /generate calls answer 500 with the router's text for a broken forward (its log:
    # `Failed to send typed request ... error sending request`), as a router in front of this worker does.
    failed_generates: int = 0


class FaultyServer(SGLangProtocolServer):
    """SGLangProtocolServer with ``faults`` switched on."""

    def __init__(self, engine: EmbeddedEngine, options: ServerOptions | None = None, faults: Faults = Faults()) -> None:
        self.faults = faults
        self._aborts_to_ignore = faults.ignore_first_aborts
        self._generates_to_fail = faults.failed_generates
        self.generate_rids: list[str] = []  # the rids of every /generate received, in order
        # A hung handler would hold stop() for aiohttp's 60 s shutdown timeout; stop() releases it first.
        self._release_hangs = asyncio.Event()
        super().__init__(engine, options)

    async def stop(self) -> None:
        """Release hung handlers, then stop as the production server does."""
        self._release_hangs.set()
        await super().stop()

    def _reply(self, req: GenerateRequest, res: GenerateResult, sp: proto.SamplingParamsBody,
               return_logprob: bool, text_in_logprobs: bool, latency: float) -> dict[str, Any]:
        if self.faults.legacy_abort_reply and res.finish_reason == "abort" and not res.output_ids:
            # Old servers answered such a request like one that ran, without output ids or log-probs.
            return {"text": "", "meta_info": self._meta_info(req, res, latency, "Abort before prefill")}
        return super()._reply(req, res, sp, return_logprob, text_in_logprobs, latency)

    async def _generate(self, request: web.Request) -> web.Response:
        self.generate_rids.append(str((await request.json()).get("rid", "")))
        if self._generates_to_fail > 0:
            self._generates_to_fail -= 1
            return web.Response(status=500, text=f"Request failed: error sending request for url ({request.url})")
        return await super()._generate(request)

    async def _abort_request(self, request: web.Request) -> web.Response:
        await read_body(request, proto.AbortBody)  # a malformed body is still a 400 first
        if self.faults.require_abort_rid and b'"rid"' not in await request.read():
            raise JsonError(422, "field required: rid")
        if self._aborts_to_ignore > 0:
            self._aborts_to_ignore -= 1
            log.warning("fault switch: ignoring this /abort_request")
            return web.Response(status=200)
        return await super()._abort_request(request)

    async def _health_generate(self, request: web.Request) -> web.Response:
        self._require_ready()
        if self.faults.health_generate == "503":
            raise JsonError(503, "fault switch: health_generate fails")
        if self.faults.health_generate == "hang":
            await self._release_hangs.wait()
            raise JsonError(503, "fault switch: health_generate hung until the server stopped")
        return await super()._health_generate(request)
