"""The runtime's Prometheus exposition before and after the first step."""

from __future__ import annotations

from prometheus_client import generate_latest

from rljob.runtime.evaluation import EvalResult
from rljob.runtime.metrics import RuntimeMetrics
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
