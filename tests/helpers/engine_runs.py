"""Run a set of requests on an engine together, for tests that compare two engines' outputs."""

from __future__ import annotations

import asyncio

from rljob.runtime.engines.base import Engine, GenerateRequest, GenerateResult


async def run_all(eng: Engine, requests: list[GenerateRequest]) -> list[GenerateResult]:
    """Start ``eng``, send every request at once, and close it whatever happens; results in request order."""
    try:
        await eng.start()
        return list(await asyncio.gather(*(eng.generate(r) for r in requests)))
    finally:
        await eng.close()
