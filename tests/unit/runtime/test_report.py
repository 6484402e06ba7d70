"""The report streams metrics.jsonl: one number per plotted metric per step, the response lengths of the
first and last third only, and the same summary as the records in memory would give."""

from __future__ import annotations

import json
from pathlib import Path

from rljob.runtime.report import read_history, reward_gain, write_report

STEPS = 30
SAMPLES = 8


def _record(step: int) -> dict:
    return {"step": step, "policy_version": step, "reward_mean": step / STEPS, "rollout_tokens_per_s": 100.0 + step,
            "truncation_rate": 0.1, "off_policy_token_ratio": 0.05 * (step % 3),
            "lengths": [step * 10 + i for i in range(SAMPLES)]}


def _jsonl(path: Path, steps: int) -> Path:
    path.write_text("".join(json.dumps(_record(s)) + "\n" for s in range(1, steps + 1)) + "\n")  # a blank last line
    return path


def test_the_history_keeps_the_lengths_of_the_two_thirds_only(tmp_path: Path) -> None:
    history = read_history(_jsonl(tmp_path / "metrics.jsonl", STEPS))
    assert history.steps == list(range(1, STEPS + 1))
    assert history.third == 10 and history.final_policy_version == STEPS
    assert history.early_lengths == [x for s in range(1, 11) for x in _record(s)["lengths"]]
    assert history.late_lengths == [x for s in range(21, 31) for x in _record(s)["lengths"]]
    # The middle third's per-sample lists were read and let go.
    assert not set(range(110, 210)) & set(history.early_lengths + history.late_lengths)


def test_the_summary_of_a_streamed_history_is_that_of_the_records(tmp_path: Path) -> None:
    history = read_history(_jsonl(tmp_path / "metrics.jsonl", STEPS))
    written = write_report(tmp_path / "report", history)
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    records = [_record(s) for s in range(1, STEPS + 1)]
    assert summary["steps"] == STEPS and summary["final_policy_version"] == STEPS
    assert summary["mean_rollout_tokens_per_s"] == sum(r["rollout_tokens_per_s"] for r in records) / STEPS
    assert summary["mean_off_policy_token_ratio"] == sum(r["off_policy_token_ratio"] for r in records) / STEPS
    assert reward_gain(history) == (sum(s / STEPS for s in range(1, 6)) / 5, sum(s / STEPS for s in range(26, 31)) / 5)
    assert {p.name for p in written} >= {"reward.png", "length_distribution.png", "summary.json", "README.md"}
    assert all(p.stat().st_size > 0 for p in written)


def test_an_empty_run_writes_a_summary_without_plots(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("")
    written = write_report(tmp_path / "report", read_history(tmp_path / "metrics.jsonl"))
    assert [p.name for p in written] == ["summary.json", "README.md"]
    assert json.loads((tmp_path / "report" / "summary.json").read_text()) == {"steps": 0}
