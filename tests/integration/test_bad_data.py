"""Bad rows never end a job: a broken line and an over-long prompt are skipped, counted in the metrics,
the step record and the status metrics, and a resume neither replays nor forgets them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rljob.api import parse_rljob
from rljob.runtime.metrics import read_jsonl
from rljob.runtime.runner import JobRunner, RunOptions, status_metrics
from rljob.runtime.tasks.synthetic import ArithChainTask
from tests.integration.test_runner_resume import job_doc, tiny_policy


def _data(path: Path) -> Path:
    """Arithmetic rows with a broken line (line 2) and a prompt longer than the model's context (line 4)."""
    rows = [json.dumps({"prompt": p.prompt, "answer": p.answer}) for p in ArithChainTask(seed=5).problems(24)]
    rows.insert(1, "{broken")
    rows.insert(3, json.dumps({"prompt": "7" * 300, "answer": "7"}))  # 300 tokens > 256 - 40 - 1
    path.write_text("\n".join(rows) + "\n")
    return path


async def test_broken_and_over_long_rows_are_skipped_counted_and_never_replayed(tmp_path: Path) -> None:
    doc = job_doc(tiny_policy(tmp_path / "model"), tmp_path / "ckpt", steps=3, every=1)
    doc["spec"]["data"] = {"jsonl": str(_data(tmp_path / "train.jsonl")), "shuffle": False}
    job = parse_rljob(doc)
    first = JobRunner(job, RunOptions(output_dir=tmp_path / "out"))
    await first.setup()
    record = await first.run_step()  # 3 groups of fresh prompts: lines 1, 3, 5 (2 and 4 skipped on the way)
    await first.run_step()
    await first.close()
    assert record.data_rows_skipped == {"unreadable": 1, "too_long": 1}
    assert status_metrics(record)["data_rows_skipped"] == 2
    registry = first.metrics.registry
    assert registry.get_sample_value("rljob_data_rows_skipped", {**_labels(registry), "reason": "too_long"}) == 1.0
    assert [r["data_rows_skipped"] for r in read_jsonl(tmp_path / "out" / "metrics.jsonl")] == [record.data_rows_skipped] * 2

    second = JobRunner(job, RunOptions(output_dir=tmp_path / "out"))
    await second.setup()
    assert second.step == 2 and second.prompts.skipped == {"unreadable": 1, "too_long": 1}
    resumed = await second.run_step()
    await second.close()
    assert resumed.data_rows_skipped == {"unreadable": 1, "too_long": 1}, "a resume replayed or forgot a bad row"


def _labels(registry) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """The job labels every runtime sample carries (read from a sample, not assumed)."""
    sample = next(s for m in registry.collect() if m.name == "rljob_data_rows_skipped" for s in m.samples)
    return {k: v for k, v in sample.labels.items() if k != "reason"}


def test_a_reward_that_is_always_zero_ends_the_job_with_reward_collapse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DAPO's filter rejects every group: the job stops past algorithm.maxConsecutiveRejections with exit
    code 76 and a RewardCollapse termination message (the operator fails the job on it), not a round that
    samples for ever."""
    import yaml

    from rljob.api.status import EXIT_REWARD_COLLAPSE
    from rljob.runtime.cli import main

    doc = job_doc(tiny_policy(tmp_path / "model"), tmp_path / "ckpt", steps=3, every=1)
    doc["spec"]["algorithm"].update(name="dapo", maxConsecutiveRejections=12)
    doc["spec"]["reward"] = {"type": "python", "function": "tests.helpers.rewards:always_zero"}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    message = tmp_path / "termination-log"
    monkeypatch.setenv("RLJOB_TERMINATION_MESSAGE_PATH", str(message))
    assert main(["run", str(job), "--no-live", "--output", str(tmp_path / "out")]) == EXIT_REWARD_COLLAPSE
    assert message.read_text().startswith("RewardCollapse: the dynamic-sampling filter rejected 12 groups in a row")
