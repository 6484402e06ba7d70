"""Runtime knob sources: knobs file, RLJob status, local autotuner; and how the CLI picks them."""

from __future__ import annotations

import itertools
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from rljob.api.spec import RLJobSpec
from rljob.runtime.knob_sources import (
    FileKnobSource,
    LocalAutotuner,
    RLJobStatusKnobSource,
    knob_sources_for,
)
from rljob.runtime.knobs import KnobValues
from rljob.runtime.step_record import BatchPart, RoundPart, StepRecord


def job_spec(**autotune: Any) -> RLJobSpec:
    return RLJobSpec.model_validate(
        {
            "model": {"builtin": "tiny-arith"},
            "data": {"synthetic": {}},
            "rollout": {"maxResponseLength": 64, "partial": {"overSampling": 2.0, "truncation": {"mode": "tokens", "maxTokens": 8}}},
            "autotune": {"mode": "Apply", "intervalSeconds": 1, "cooldownSeconds": 0, "settleRounds": 1,
                         "truncationTokens": {"min": 4, "max": 64, "maxStep": 8}, **autotune},
        }
    )


# ---------------------------------------------------------------------------------------- file


def _touch(path: Path, text: str) -> None:
    path.write_text(text)
    # Same-second rewrites keep mtime on coarse filesystems; the size check or a bumped mtime catches them.
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


def test_file_source_reads_json_and_yaml_once_per_change(tmp_path: Path) -> None:
    path = tmp_path / "knobs.yaml"
    src = FileKnobSource(path)
    assert src.poll() is None  # no file yet: nothing to apply
    _touch(path, '{"overSampling": 1.5, "reason": "manual"}')
    v = src.poll()
    assert v == KnobValues(over_sampling=1.5, source=f"file {path}", reason="manual")
    assert src.poll() is None
    _touch(path, "truncationK: 3.0\ntruncation_max_tokens: 40\n")
    v = src.poll()
    assert v is not None and v.truncation_k == 3.0 and v.truncation_max_tokens == 40 and v.over_sampling is None


def test_file_source_rejects_bad_files_without_raising(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "knobs.json"
    src = FileKnobSource(path)
    for bad in ("{not yaml: [", '{"overSampling": 0.5}', '{"overSamplng": 2}'):
        _touch(path, bad)
        with caplog.at_level(logging.ERROR):
            assert src.poll() is None
    assert "knobs file" in caplog.text and "fix it" in caplog.text


# -------------------------------------------------------------------------------------- status


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _job(knobs: dict[str, Any], recommended: dict[str, Any] | None = None) -> dict[str, Any]:
    status: dict[str, Any] = {"effectiveKnobs": knobs}
    if recommended:
        status["recommendedKnobs"] = recommended
    return {"metadata": {"name": "j"}, "status": status}


def test_status_source_applies_effective_knobs_on_change_only() -> None:
    served = {"job": _job({"overSampling": {"value": 2.0, "unit": "ratio", "source": "spec"}})}
    clock = FakeClock()
    src = RLJobStatusKnobSource("ns", "j", getter=lambda ns, n: served["job"], min_interval_s=5, clock=clock)
    v = src.poll()
    assert v is not None and v.over_sampling == 2.0 and v.truncation_max_tokens is None
    clock.t = 1
    assert src.poll() is None  # rate-limited
    clock.t = 6
    assert src.poll() is None  # unchanged
    served["job"] = _job(
        {
            "overSampling": {"value": 2.0, "unit": "ratio", "source": "spec", "reason": "new text only"},
            "truncation": {"value": 24.0, "unit": "tokens", "source": "autotune", "reason": "rate 0.8 above band"},
        },
        recommended={"overSampling": {"value": 3.0, "unit": "ratio", "source": "autotune"}},
    )
    clock.t = 12
    v = src.poll()
    assert v is not None and v.truncation_max_tokens == 24 and v.over_sampling == 2.0 and v.truncation_k is None
    assert "above band" in v.reason


def test_status_source_sigma_unit_maps_to_k() -> None:
    src = RLJobStatusKnobSource("ns", "j", getter=lambda ns, n: _job({"truncation": {"value": 2.5, "unit": "sigma", "source": "autotune"}}))
    v = src.poll()
    assert v is not None and v.truncation_k == 2.5 and v.truncation_max_tokens is None


def test_status_source_backs_off_on_api_errors() -> None:
    clock = FakeClock()
    calls = []

    def failing(ns: str, name: str) -> dict[str, Any]:
        calls.append(clock.t)
        raise ConnectionError("apiserver down")

    src = RLJobStatusKnobSource("ns", "j", getter=failing, min_interval_s=5, max_backoff_s=30, clock=clock)
    for t in range(200):
        clock.t = float(t)
        assert src.poll() is None
    gaps = [b - a for a, b in itertools.pairwise(calls)]
    assert gaps[:3] == [10, 20, 30] and set(gaps[3:]) == {30}


def test_status_source_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RLJOB_NAMESPACE", raising=False)
    monkeypatch.delenv("RLJOB_NAME", raising=False)
    assert RLJobStatusKnobSource.from_env() is None
    monkeypatch.setenv("RLJOB_NAMESPACE", "ml")
    monkeypatch.setenv("RLJOB_NAME", "demo")
    src = RLJobStatusKnobSource.from_env()
    assert src is not None and (src.namespace, src.name) == ("ml", "demo")


# ------------------------------------------------------------------------------- local autotuner


def record(step: int, rate: float, cap: float, t: float) -> StepRecord:
    return StepRecord(
        step=step, policy_version=step, strategy="april", time=t, round=RoundPart(truncation_rate=rate),
        batch=BatchPart(length_mean=20.0, length_std=10.0),
        knobs={"over_sampling": 2.0, "max_staleness": 2.0, "truncation_k": 0.0, "segment_cap_tokens": cap},
    )


def test_local_autotuner_raises_cap_then_waits_for_rounds_on_it() -> None:
    clock = FakeClock()
    tuner = LocalAutotuner(job_spec(), clock=clock)
    assert tuner.poll() is None  # no records yet
    tuner.observe(record(1, 0.8, 8, 0.0))
    clock.t = 1
    v = tuner.poll()
    assert v is not None and v.truncation_max_tokens == 16 and v.source == "local autotune"
    clock.t = 3
    assert tuner.poll() is None  # newest record still ran with the old cap
    tuner.observe(record(2, 0.5, 16, 3.0))  # first round with the new cap
    clock.t = 4
    v = tuner.poll()
    assert v is not None and v.truncation_max_tokens == 24
    tuner.observe(record(3, 0.2, 24, 5.0))
    clock.t = 6
    assert tuner.poll() is None  # in band


def test_local_autotuner_judges_knobs_only_by_the_rounds_since_they_last_came_into_force() -> None:
    """Knobs revisited after a drift are judged by their new rounds, not by old ones made with the same values."""
    clock = FakeClock()
    tuner = LocalAutotuner(job_spec(), clock=clock)
    for step, rate, cap in ((1, 0.0, 16), (2, 0.0, 16), (3, 0.2, 24), (4, 0.9, 16)):
        tuner.observe(record(step, rate, cap, float(step)))
    seen = tuner.observation(5.0)
    assert seen is not None and seen[0].truncation_rate == 0.9 and seen[1].truncation == 16


def test_local_autotuner_recommend_mode_applies_nothing(caplog: pytest.LogCaptureFixture) -> None:
    tuner = LocalAutotuner(job_spec(mode="Recommend"), clock=lambda: 10.0)
    tuner.observe(record(1, 0.8, 8, 9.0))
    with caplog.at_level(logging.INFO):
        assert tuner.poll() is None
    assert "recommends" in caplog.text


def test_knob_sources_for_spec_and_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RLJOB_NAMESPACE", raising=False)
    monkeypatch.delenv("RLJOB_NAME", raising=False)
    listeners: list[Any] = []
    assert knob_sources_for(job_spec(mode="Off", local=True), listeners) == [] and listeners == []
    monkeypatch.setenv("RLJOB_NAMESPACE", "ml")
    monkeypatch.setenv("RLJOB_NAME", "demo")
    sources = knob_sources_for(job_spec(local=True, knobsFile=str(tmp_path / "k.yaml")), listeners)
    assert [type(s).__name__ for s in sources] == ["RLJobStatusKnobSource", "LocalAutotuner", "FileKnobSource"]
    assert len(listeners) == 1

