"""Greedy continuations of one prompt: served by an SGLang-protocol worker, or computed in process by the
same engine code, so that equal tokens mean equal weights (a perturbation that changes them is checked
by each caller, or the comparison proves nothing)."""

from __future__ import annotations

import copy

import httpx
import torch

from rljob.runtime.engines.base import GenerateRequest
from rljob.runtime.engines.embedded import EmbeddedEngine

PROMPT = [1, 5, 9, 2, 7]


async def greedy_on(url: str, n: int = 12) -> list[int]:
    """The worker's greedy continuation of PROMPT (temperature 0, n tokens whatever EOS)."""
    async with httpx.AsyncClient() as http:
        reply = (await http.post(url + "/generate", json={
            "input_ids": PROMPT, "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True},
        }, timeout=60)).json()
    return list(reply["output_ids"])


async def greedy_of(model: torch.nn.Module, n: int = 12) -> list[int]:
    """`model`'s own greedy continuation of PROMPT (the embedded engine, in process, on a copy)."""
    engine = EmbeddedEngine(copy.deepcopy(model), max_batch_size=1)
    await engine.start()
    try:
        result = await engine.generate(GenerateRequest("ref", PROMPT, n, temperature=0.0))
    finally:
        await engine.close()
    return result.output_ids
