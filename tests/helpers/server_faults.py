"""Older SGLang behaviours, for tests only: the CPU SGLang-protocol server with fault switches.

The production server (runtime/engines/server.py) reproduces the releases the project runs; the
client must also tolerate replies and failures of older servers. This subclass overrides the
affected handlers; everything else is the production server.
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


class FaultyServer(SGLangProtocolServer):
    """SGLangProtocolServer with ``faults`` switched on."""

    def __init__(self, engine: EmbeddedEngine, options: ServerOptions | None = None, faults: Faults = Faults()) -> None:
        self.faults = faults
        self._aborts_to_ignore = faults.ignore_first_aborts
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
