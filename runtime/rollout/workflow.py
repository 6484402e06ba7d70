"""Rollout workflows: how one segment of one sample is generated, behind a small protocol.

The scheduler (scheduler.py) owns concurrency, stopping, aborting and buffering; it grants a sample a
`Segment` (an engine, a token budget, sampling settings, the abort flag) and a workflow spends it.
The default, `SingleTurnWorkflow`, is one generate call that continues the response. A multi-turn,
tool-calling workflow plugs in the same way (docs/architecture.md#rollout-workflows): it alternates
generate calls with tool calls inside the one segment, within its budget.

The resume point: whatever a workflow leaves in ``sample.response_ids`` when it returns is where the
sample resumes after an abort (the next segment, this round or a later one, starts from
``prompt_ids + response_ids``, and the scheduler re-prefills exactly that). So a workflow appends
only what it can continue from: policy tokens as the engine returns them (an aborted turn continues
token-exactly, as APRIL does), a tool's output only once the call is complete.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import Protocol

from rljob.runtime.engines.base import Engine, GenerateRequest, GenerateResult
from rljob.runtime.rollout.sample import Sample


@dataclass(frozen=True)
class Sampling:
    """Sampling settings of every generate call of the round."""

    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings


@dataclass(frozen=True)
class Segment:
    """What the scheduler grants one sample for one segment."""

    engine: Engine
    rid: str  # request id prefix, unique per segment: a workflow making several calls adds a suffix
    max_new_tokens: int  # the budget: response cap and segment cap, both applied
    policy_version: int  # stamped on the tokens when the engine reports no version of its own
    sampling: Sampling
    aborting: asyncio.Event  # set when the round aborts: return at once, keeping what is resumable
    # The prompt this sample starts from together with other samples of its group (None: it resumes a
    # response, or its group is one sample): a request of exactly these ids may share their prefill.
    group_prompt: list[int] | None = None

    def request(self, input_ids: list[int], max_new_tokens: int | None = None, suffix: str = "") -> GenerateRequest:
        """A generate request with this segment's settings (at most the segment's budget)."""
        budget = self.max_new_tokens if max_new_tokens is None else min(max_new_tokens, self.max_new_tokens)
        s = self.sampling
        return GenerateRequest(
            rid=self.rid + suffix, input_ids=input_ids, max_new_tokens=budget, temperature=s.temperature,
            top_p=s.top_p, stop_token_ids=list(s.stop_token_ids), stop=list(s.stop),
            share_prefill=self.group_prompt is not None and input_ids == self.group_prompt,
        )

    def version(self, result: GenerateResult) -> int:
        """The policy version that generated `result`'s tokens."""
        return result.weight_version if result.weight_version is not None else self.policy_version


class SegmentEnd(enum.Enum):
    """Why a segment ended; the scheduler turns it into the sample's status."""

    STOP = "stop"  # the response is complete (a stop token, or the episode's last turn ended)
    LENGTH = "length"  # the budget is spent: the response cap (truncated) or the segment cap (cut)
    ABORT = "abort"  # the round aborted it: resumed from the resume point


@dataclass(frozen=True)
class SegmentResult:
    """What one segment did: why it ended and how many tokens the engine generated in it."""

    end: SegmentEnd
    generated: int  # tokens the engine generated, aborted ones included (the round's tokens_generated)


class RolloutWorkflow(Protocol):
    """How one segment of one sample is generated (anchors: slime's custom generate function,
    AReaL's RolloutWorkflow.arun_episode)."""

    async def generate(self, sample: Sample, segment: Segment) -> SegmentResult:
        """Extend `sample` within `segment`'s budget and return why it stopped.

        Appends tokens with ``sample.append`` (stamped ``segment.version(result)``), leaves
        ``sample.response_ids`` at a resume point, and lets ``EngineError`` propagate: the scheduler
        retries the group on a healthy engine from that resume point.
        """
        ...


def segment_end(finish_reason: str) -> SegmentEnd:
    """How a generate call's finish reason ends a segment: an engine abort (or an unknown reason) aborts it."""
    return {"stop": SegmentEnd.STOP, "length": SegmentEnd.LENGTH}.get(finish_reason, SegmentEnd.ABORT)


@dataclass(frozen=True)
class SingleTurnWorkflow:
    """The default: one generate call continuing the response from its last token."""

    async def generate(self, sample: Sample, segment: Segment) -> SegmentResult:
        """One generate call on ``prompt_ids + response_ids``; an abort keeps the partial response."""
        result = await segment.engine.generate(segment.request(sample.prompt_ids + sample.response_ids))
        sample.append(result.output_ids, result.output_logprobs, segment.version(result))
        return SegmentResult(end=segment_end(result.finish_reason), generated=len(result.output_ids))
