"""The run report shows the signals of docs/metrics.md side by side, and says where truncation lands."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rljob.runtime.report import truncation_verdict, write_report
from rljob.runtime.step_record import RoundPart, StepRecord, TrainPart


def _record(step: int, truncation: float, partial: float) -> dict:
    rec = StepRecord(step=step, policy_version=step, strategy="april", time=float(step),
                     round=RoundPart(truncation_rate=truncation, partial_rate=partial, rollout_seconds=2.0,
                                     trained_tokens=400, tokens_generated=500, aborted_tokens=50),
                     train=TrainPart(train_seconds=2.0))
    return rec.flat()


def test_summary_holds_each_signal_and_the_band_verdict(tmp_path: Path) -> None:
    records = [_record(1, 0.1, 0.4), _record(2, 0.3, 0.2)]
    written = write_report(tmp_path, records)
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
    old = _record(1, 0.2, 0.0)
    for key in ("partial_rate", "goodput_tokens_per_s", "aborted_token_share", "trainer_idle_seconds",
                "engine_idle_seconds"):
        del old[key]
    write_report(tmp_path, [old])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "mean_partial_rate" not in summary and summary["mean_truncation_rate"] == 0.2
    assert not (tmp_path / "goodput.png").exists()


def test_verdict_names_the_side_of_the_band() -> None:
    assert truncation_verdict(0.05).startswith("below") and truncation_verdict(0.4).startswith("above")
