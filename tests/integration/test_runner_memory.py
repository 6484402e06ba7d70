"""Rank 0's memory does not grow with the run (issue 26, item 6): the runner keeps the newest step
record, not every one with its per-sample lists; the history is metrics.jsonl on disk."""

from __future__ import annotations

import gc
from pathlib import Path

from rljob.api import parse_rljob
from rljob.runtime.metrics import read_jsonl
from rljob.runtime.runner import JobRunner, RunOptions
from rljob.runtime.step_record import StepRecord
from tests.integration.test_runner_resume import job_doc, tiny_policy

STEPS = 6


def _live_step_records() -> int:
    gc.collect()
    return sum(type(o) is StepRecord for o in gc.get_objects())


async def test_the_step_records_held_stay_constant_as_steps_grow(tmp_path: Path) -> None:
    model = tiny_policy(tmp_path / "model")
    runner = JobRunner(parse_rljob(job_doc(model, tmp_path / "ckpt", steps=STEPS, every=100)),
                       RunOptions(output_dir=tmp_path / "out"))
    await runner.setup()
    held: list[int] = []
    runner.step_listeners.append(lambda _record: held.append(_live_step_records()))
    summary = await runner.run()
    # Counted after each step, the new record included: the same at step 6 as at step 2, where a list of
    # every record would hold 4 more.
    assert len(held) == STEPS and held[1:] == [held[1]] * (STEPS - 1), held
    assert held[1] <= 2, held  # this step's record and the previous one at most
    assert summary.steps_run == STEPS and summary.last_record is not None and summary.last_record.step == STEPS
    assert [r["step"] for r in read_jsonl(tmp_path / "out" / "metrics.jsonl")] == list(range(1, STEPS + 1))
