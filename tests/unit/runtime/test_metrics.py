"""The runtime's Prometheus exposition before and after the first step."""

from __future__ import annotations

import json
from pathlib import Path

from prometheus_client import generate_latest

from rljob.runtime.evaluation import EvalResult
from rljob.runtime.metrics import RuntimeMetrics, current_names, ledger_imbalance, read_jsonl
from rljob.runtime.step_record import RoundPart, StepRecord, TrainPart


def exposed(metrics: RuntimeMetrics) -> dict[str, float]:
    """Sample name (with labels) -> value, comments left out."""
    out: dict[str, float] = {}
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_measured_gauges_are_absent_until_the_first_step_sets_them() -> None:
    # A 0 before the first step would read as a measured truncation rate of 0: the autotuner would
    # raise over-sampling on it and a 10-minute average would hide a real rate of 1.0.
    metrics = RuntimeMetrics("job", namespace="ns")
    metrics.set_knobs({"over_sampling": 1.5})
    before = exposed(metrics)
    for name in ("rljob_truncation_rate", "rljob_policy_entropy", "rljob_reward_mean", "rljob_eval_reward_mean",
                 "rljob_policy_version", "rljob_last_step_timestamp_seconds"):
        assert name not in before, name
    assert before['rljob_job_info{rljob="job",rljob_namespace="ns"}'] == 1.0
    assert before['rljob_knob{knob="over_sampling"}'] == 1.5
    assert before["rljob_steps_total"] == 0.0

    metrics.record_eval(EvalResult(step=0, policy_version=0, reward_mean=0.25, length_mean=3.0, prompts=8, seconds=0.1))
    after_eval = exposed(metrics)
    assert after_eval["rljob_eval_reward_mean"] == 0.25 and "rljob_truncation_rate" not in after_eval

    metrics.record(StepRecord(step=1, policy_version=1, strategy="april", time=5.0, round=RoundPart(truncation_rate=1.0),
                              train=TrainPart(entropy=0.7)))
    metrics.record(StepRecord(step=2, policy_version=2, strategy="april", time=6.0, round=RoundPart(truncation_rate=0.5),
                              train=TrainPart(entropy=0.6)))
    after = exposed(metrics)
    assert after["rljob_truncation_rate"] == 0.5 and after["rljob_policy_entropy"] == 0.6
    assert after["rljob_policy_version"] == 2.0 and after["rljob_steps_total"] == 2.0
    assert after["rljob_last_step_timestamp_seconds"] == 6.0


def test_each_ledger_outcome_is_exported_under_its_word(tmp_path: Path) -> None:
    """filtered and regenerated (docs/architecture.md#the-round-ledger) name the counters and the jsonl keys."""
    metrics = RuntimeMetrics("job", jsonl_path=tmp_path / "metrics.jsonl")
    metrics.record(StepRecord(step=1, policy_version=1, strategy="april", time=5.0,
                              round=RoundPart(new_groups=3, trained_groups=2, filtered_groups=1, filtered_tokens=40,
                                              regenerated_tokens=7)))
    after = exposed(metrics)
    assert after["rljob_filtered_groups_total"] == 1.0 and after["rljob_filtered_tokens_total"] == 40.0
    assert after["rljob_regenerated_tokens_total"] == 7.0
    assert not any(name.startswith(("rljob_dropped", "rljob_wasted", "rljob_discarded_stale")) for name in after)
    [written] = read_jsonl(tmp_path / "metrics.jsonl")
    assert (written["filtered_groups"], written["filtered_tokens"], written["regenerated_tokens"]) == (1, 40, 7)


def test_an_older_runs_ledger_keys_are_read_under_todays_names(tmp_path: Path) -> None:
    """A run resumed across the rename has both spellings in one metrics.jsonl; `rljob report` and the
    ledger check read them alike."""
    old = {"step": 1, "new_groups": 4, "buffer_groups_before": 0, "trained_groups": 2, "buffered_groups": 1,
           "dropped_groups": 1, "discarded_groups": 0, "buffer_tokens_before": 0, "tokens_generated": 100,
           "trained_tokens": 50, "buffer_tokens_after": 20, "discarded_stale_tokens": 10, "wasted_tokens": 15,
           "discarded_tokens": 5}
    new = {"step": 2, "new_groups": 4, "buffer_groups_before": 0, "trained_groups": 2, "buffered_groups": 1,
           "filtered_groups": 1, "discarded_groups": 0, "buffer_tokens_before": 0, "tokens_generated": 100,
           "trained_tokens": 50, "buffer_tokens_after": 20, "regenerated_tokens": 10, "filtered_tokens": 15,
           "discarded_tokens": 5}
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(old) + "\n" + json.dumps(new) + "\n")
    first, second = read_jsonl(path)
    assert list(first) == list(second) and {k: v for k, v in first.items() if k != "step"} == {
        k: v for k, v in second.items() if k != "step"}
    assert first["filtered_groups"] == 1 and first["regenerated_tokens"] == 10 and first["filtered_tokens"] == 15
    assert ledger_imbalance(first) == (0, 0)
    assert current_names(new) == new  # today's keys pass through


def test_each_signal_of_docs_metrics_is_exported_under_its_own_name() -> None:
    """Truncation and partial rates apart; goodput, waste and idle as gauges; counters for rate()."""
    from rljob.runtime.step_record import SyncPart

    metrics = RuntimeMetrics("job", namespace="ns")
    rnd = RoundPart(truncation_rate=0.2, partial_rate=0.3, rollout_seconds=3.0, tokens_generated=1000,
                    trained_tokens=600, aborted_tokens=250)
    for step in (1, 2):
        metrics.record(StepRecord(step=step, policy_version=step, strategy="april", time=float(step), round=rnd,
                                  train=TrainPart(train_seconds=1.0), sync=SyncPart(sync_seconds=0.5, sync_bytes=2**20),
                                  wall_seconds=6.0))
    out = exposed(metrics)
    assert out["rljob_truncation_rate"] == 0.2 and out["rljob_partial_rate"] == 0.3
    assert out["rljob_goodput_tokens_per_second"] == 100.0 and out["rljob_aborted_token_share"] == 0.25
    assert out["rljob_trainer_idle_seconds"] == 4.5 and out["rljob_engine_idle_seconds"] == 2.5
    assert out["rljob_trained_tokens_total"] == 1200.0 and out["rljob_aborted_tokens_total"] == 500.0
    assert out['rljob_phase_seconds{phase="wall"}'] == 6.0 and out['rljob_phase_seconds{phase="step"}'] == 4.5
    assert out["rljob_weight_sync_bytes"] == 2**20 and out['rljob_phase_seconds{phase="sync"}'] == 0.5
    metrics.set_truncation_band(0.1, 0.2)
    out = exposed(metrics)
    assert out['rljob_truncation_band{edge="low"}'] == 0.1 and out['rljob_truncation_band{edge="high"}'] == 0.2
