"""Held-out evaluation: one sampled response per fixed prompt, scored with the job's reward.

It runs on the rollout engines between steps (after the weight sync, while they are idle), so it
measures the policy the engines serve, with the same sampling as the rollouts. An engine failure
skips the evaluation (logged) instead of failing the job.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rljob.runtime.engines.base import Engine, EngineError, GenerateRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalPrompt:
    """One held-out prompt, tokenized."""

    prompt_ids: list[int]
    answer: str
    text: str = ""  # the prompt text (reward input)
    metadata: dict[str, Any] = field(default_factory=dict)  # the data row's extra fields (reward input)


@dataclass(frozen=True)
class EvalResult:
    """The outcome of one evaluation."""

    step: int  # optimizer steps done when evaluated (0: the initial policy)
    policy_version: int
    reward_mean: float
    length_mean: float
    prompts: int
    seconds: float

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


async def evaluate_held_out(
    engines: Sequence[Engine],
    prompts: Sequence[EvalPrompt],
    score: Callable[[Sequence[EvalPrompt], Sequence[list[int]]], Awaitable[list[float]]],
    *,
    step: int,
    policy_version: int,
    temperature: float,
    max_new_tokens: int,
    stop_token_ids: list[int],
    stop: Sequence[str] = (),
) -> EvalResult | None:
    """Sample one response per prompt (spread over the engines) and average the reward; None on failure.

    `score(prompts, response_ids)` returns the rewards of all responses (the job's reward, batched).
    """
    started = time.perf_counter()
    requests = [
        GenerateRequest(
            rid=f"eval{step}.{i}.",
            input_ids=list(p.prompt_ids),
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            stop_token_ids=list(stop_token_ids),
            stop=list(stop),
        )
        for i, p in enumerate(prompts)
    ]
    # Every call is awaited even when one fails, so none is left running into the next round.
    results = await asyncio.gather(
        *(engines[i % len(engines)].generate(r) for i, r in enumerate(requests)), return_exceptions=True
    )
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        if not all(isinstance(e, EngineError) for e in errors):
            raise next(e for e in errors if not isinstance(e, EngineError))
        log.warning("held-out evaluation at step %d skipped: %s", step, errors[0])
        return None
    outputs = [r.output_ids for r in results if not isinstance(r, BaseException)]
    rewards = await score(prompts, outputs)
    return EvalResult(
        step=step,
        policy_version=policy_version,
        reward_mean=sum(rewards) / len(rewards),
        length_mean=sum(len(ids) for ids in outputs) / len(outputs),
        prompts=len(prompts),
        seconds=time.perf_counter() - started,
    )
