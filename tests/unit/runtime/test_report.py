"""The report streams metrics.jsonl: one number per plotted metric per step, the response lengths of the
first and last third only, and the same summary as the records in memory would give. It shows the signals
of docs/metrics.md side by side, and says where truncation lands."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rljob.runtime.report import history_of, read_history, reward_gain, truncation_verdict, write_report
from rljob.runtime.step_record import RoundPart, StepRecord, TrainPart

# A plot that draws a legend with nothing in it (a run recorded without a signal) is a defect, not noise.
pytestmark = pytest.mark.filterwarnings("error::UserWarning")

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


def _signal_record(step: int, truncation: float, partial: float) -> dict:
    rec = StepRecord(step=step, policy_version=step, strategy="april", time=float(step),
                     round=RoundPart(truncation_rate=truncation, partial_rate=partial, rollout_seconds=2.0,
                                     trained_tokens=400, tokens_generated=500, aborted_tokens=50),
                     train=TrainPart(train_seconds=2.0))
    return rec.flat()


def test_summary_holds_each_signal_and_the_band_verdict(tmp_path: Path) -> None:
    records = [_signal_record(1, 0.1, 0.4), _signal_record(2, 0.3, 0.2)]
    written = write_report(tmp_path, history_of(records, len(records)))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["mean_truncation_rate"] == 0.2 and summary["mean_partial_rate"] == pytest.approx(0.3)
    assert summary["mean_goodput_tokens_per_s"] == 100.0  # 400 trained tokens over 4 s
    assert summary["mean_aborted_token_share"] == 0.1
    assert summary["mean_trainer_idle_seconds_per_step"] == 2.0
    assert summary["mean_engine_idle_seconds_per_step"] == 2.0
    assert summary["truncation_rate_vs_band"] == "inside the 15%-25% band"
    assert (tmp_path / "goodput.png") in written
    readme = (tmp_path / "README.md").read_text()
    assert "mean_partial_rate" in readme and "truncation_rate_vs_band: inside" in readme


def test_records_from_before_the_signals_still_make_a_report(tmp_path: Path) -> None:
    old = _signal_record(1, 0.2, 0.0)
    for key in ("partial_rate", "goodput_tokens_per_s", "aborted_token_share", "trainer_idle_seconds",
                "engine_idle_seconds"):
        del old[key]
    write_report(tmp_path, history_of([old], 1))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "mean_partial_rate" not in summary and summary["mean_truncation_rate"] == 0.2
    assert not (tmp_path / "goodput.png").exists()


def test_verdict_names_the_side_of_the_band() -> None:
    assert truncation_verdict(0.05).startswith("below the 15%-25% band: the length threshold cuts few")
    assert truncation_verdict(0.4) == "above the 15%-25% band: the length threshold cuts too many samples; raise k"
    assert truncation_verdict(0.2) == "inside the 15%-25% band"


def test_the_verdict_is_against_the_jobs_own_band(tmp_path: Path) -> None:
    """A job that sets spec.autotune.truncationBand is judged against it, not against the default."""
    records = [_signal_record(1, 0.3, 0.0), _signal_record(2, 0.3, 0.0)]
    assert truncation_verdict(0.3, (0.25, 0.35)) == "inside the 25%-35% band"
    write_report(tmp_path, history_of(records, len(records)), band=(0.25, 0.35))
    assert json.loads((tmp_path / "summary.json").read_text())["truncation_rate_vs_band"] == "inside the 25%-35% band"
    write_report(tmp_path, history_of(records, len(records)))
    assert json.loads((tmp_path / "summary.json").read_text())["truncation_rate_vs_band"].startswith(
        "above the 15%-25% band")
