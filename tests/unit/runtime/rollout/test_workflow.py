"""Rollout workflows (rollout/workflow.py): the default single-turn one, and a second one plugged in.

`TwoTurnWorkflow` is what a tool-calling workflow looks like from the scheduler's side: the policy's
first turn ends with a stop token, a "tool" answers with fixed tokens, the policy's second turn
follows, all within the segment the scheduler granted. Its state is read back from the sample alone,
so an abort or a segment cut anywhere resumes it correctly, on the real embedded engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from rljob.runtime.engines.base import GenerateResult, WeightUpdate
from rljob.runtime.rollout.sample import Sample, SampleStatus
from rljob.runtime.rollout.scheduler import RolloutConfig, RolloutScheduler
from rljob.runtime.rollout.strategy import AprilStrategy, Strategy
from rljob.runtime.rollout.truncation import TruncationPolicy
from rljob.runtime.rollout.workflow import Segment, SegmentEnd, SegmentResult, SingleTurnWorkflow, segment_end
from tests.unit.runtime.rollout import test_scheduler
from tests.unit.runtime.rollout.test_scheduler import CAP, STOP, Prompts, RecordingEngine

engine = test_scheduler.engine  # the same fixture: the real embedded engine on the tiny model

TOOL = [100, 101]  # the tool's answer, appended after the first turn's stop token


def stops(ids: list[int]) -> list[int]:
    return [i for i, t in enumerate(ids) if t in STOP]


@dataclass(frozen=True)
class TwoTurnWorkflow:
    """Policy turn, tool answer, policy turn. A response is complete at its second stop token."""

    async def generate(self, sample: Sample, segment: Segment) -> SegmentResult:
        start, generated = sample.response_length, 0
        while True:
            turn = 2 if stops(sample.response_ids) else 1
            left = segment.max_new_tokens - (sample.response_length - start)
            if turn == 2 and sample.response_ids[-1] in STOP:  # the first turn just ended: the tool answers
                if left < len(TOOL):
                    return SegmentResult(SegmentEnd.LENGTH, generated)
                sample.append(TOOL, [0.0] * len(TOOL), segment.policy_version)
                left -= len(TOOL)
            if left <= 0:
                return SegmentResult(SegmentEnd.LENGTH, generated)
            result: GenerateResult = await segment.engine.generate(
                segment.request(sample.prompt_ids + sample.response_ids, max_new_tokens=left, suffix=f"t{turn}")
            )
            sample.append(result.output_ids, result.output_logprobs, segment.version(result))
            generated += len(result.output_ids)
            end = segment_end(result.finish_reason)
            if end is not SegmentEnd.STOP or turn == 2:
                return SegmentResult(end, generated)


def tool_tokens(ids: list[int]) -> int:
    """Tokens the tool appended (all or none: a workflow appends only what it can resume from)."""
    at = stops(ids)
    return len(TOOL) if at and ids[at[0] + 1: at[0] + 1 + len(TOOL)] == TOOL else 0


def check_two_turn_shape(sample: Sample) -> None:
    """turn-1 tokens, a stop, the tool's answer, turn-2 tokens, a stop; or a prefix of that, with the
    tool's answer whole, when the sample was cut at the response cap or is still unfinished."""
    ids = sample.response_ids
    at = stops(ids)
    if sample.status is SampleStatus.COMPLETED:
        assert len(at) == 2 and at[1] == len(ids) - 1, ids
    else:
        assert len(at) <= (2 if sample.status is SampleStatus.TRUNCATED else 1), ids
    if at and at[0] + 1 < len(ids):  # something follows the first turn: the whole tool answer first
        assert tool_tokens(ids) == len(TOOL), ids


def make(engine: RecordingEngine, strategy, workflow, truncation=None) -> RolloutScheduler:
    config = RolloutConfig(batch_size=3, samples_per_prompt=3, max_response_length=CAP, max_staleness=2,
                           stop_token_ids=STOP)
    return RolloutScheduler([engine], config, strategy, Prompts(), score=lambda s: float(len(s.response_ids) % 2),
                            truncation=truncation, workflow=workflow)


async def test_the_default_workflow_is_single_turn(engine):
    scheduler = make(engine, Strategy(), None)
    assert isinstance(scheduler.workflow, SingleTurnWorkflow)
    result = await scheduler.run_round(0)
    assert all(len(stops(s.response_ids)) <= 1 for g in result.groups for s in g.samples)
    assert not any(r.rid.endswith("t1") for r in engine.requests)


async def test_a_two_turn_workflow_plugs_in(engine):
    scheduler = make(engine, Strategy(), TwoTurnWorkflow())
    result = await scheduler.run_round(0)
    samples = [s for g in result.groups for s in g.samples]
    assert len(result.groups) == 3 and all(s.reward is not None for s in samples)
    for s in samples:
        check_two_turn_shape(s)
    second_turns = [r for r in engine.requests if r.rid.endswith("t2")]
    assert second_turns, "no sample reached its second turn"
    assert all(r.input_ids[-len(TOOL):] == TOOL for r in second_turns if r.rid.endswith(".1.t2"))
    # the round's tokens are the engine's: the tool's answer is not counted as generated
    assert result.stats.tokens_generated == sum(len(s.response_ids) - tool_tokens(s.response_ids) for s in samples)


async def test_a_two_turn_workflow_resumes_across_segment_cuts_and_aborts(engine):
    # A segment cap of 16 tokens (ceil(48 / 3), the floor for maxStaleness 2) cuts samples mid-turn and
    # APRIL aborts the rest at collection: every resumed sample must still have the two-turn shape.
    truncation = TruncationPolicy(mode="tokens", max_tokens=1)
    scheduler = make(engine, AprilStrategy(over_sampling=2.0), TwoTurnWorkflow(), truncation)
    resumed = 0
    for version in range(4):
        await engine.update_weights(WeightUpdate(version=version, module=engine.model))
        result = await scheduler.run_round(version)
        resumed += result.stats.resumed_samples
        for s in (s for g in [*result.groups, *scheduler.buffer] for s in g.samples):
            check_two_turn_shape(s)
    assert resumed > 0, "no sample was resumed: the test did not exercise the resume point"
