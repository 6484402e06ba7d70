"""One autotuner tick: due/backoff, Apply vs Recommend status shapes, failures, mode changes, metrics."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from prometheus_client import CollectorRegistry
from rljob.api.spec import RLJobSpec
from rljob.api.status import RLJobStatus
from rljob.common.autotune import tick
from rljob.common.autotune.controller import Observation
from rljob.operator.autotune.metrics import AutotuneMetrics
from rljob.common.autotune.prometheus import NoData, PrometheusUnavailable
from rljob.common.autotune.queries import Reading

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def spec(mode: str = "Apply", **autotune: Any) -> RLJobSpec:
    return RLJobSpec.model_validate(
        {
            "model": {"builtin": "tiny-arith"},
            "data": {"synthetic": {}},
            "rollout": {"maxResponseLength": 64, "partial": {"overSampling": 2.0, "truncation": {"mode": "tokens", "maxTokens": 8}}},
            "autotune": {"mode": mode, "intervalSeconds": 10, "cooldownSeconds": 30, "settleRounds": 2,
                         "truncationTokens": {"min": 4, "max": 64, "maxStep": 8}, **autotune},
        }
    )


def reading(rate: float, steps: int = 10, over: float = 2.0, cap: float = 8.0, goodput: float | None = None) -> Reading:
    return Reading(
        observation=Observation(truncation_rate=rate, length_mean=20, length_std=10, steps=steps, goodput=goodput),
        in_force={"over_sampling": over, "truncation_k": 0.0, "segment_cap_tokens": cap, "max_staleness": 2},
        query='avg(avg_over_time(rljob_truncation_rate[60s]) * on(job, instance) group_left() rljob_job_info{rljob="j"})',
    )


def merged(status: RLJobStatus, patch: dict[str, Any]) -> RLJobStatus:
    """Apply a JSON merge patch to a status, as the API server does."""

    def merge(base: Any, p: Any) -> Any:
        if not isinstance(p, dict) or not isinstance(base, dict):
            return p
        out = dict(base)
        for k, v in p.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = merge(out.get(k), v)
        return out

    return RLJobStatus.model_validate(merge(status.to_wire(), patch))


def test_apply_writes_effective_knobs_condition_and_event() -> None:
    s = spec()
    r = tick.on_reading("j", s, RLJobStatus(), reading(0.8), 3, NOW)
    assert r.decision is not None and r.decision.changed
    trunc = r.patch["effectiveKnobs"]["truncation"]
    assert trunc["source"] == "autotune" and trunc["unit"] == "tokens" and trunc["value"] == 16.0
    assert "rljob_truncation_rate" in trunc["query"] and trunc["time"] == "2026-01-01T12:00:00Z" and trunc["reason"]
    assert "recommendedKnobs" not in r.patch
    status = merged(RLJobStatus(), r.patch)
    cond = status.condition(tick.CONDITION)
    assert cond is not None and cond.status == "True" and cond.reason == "TruncationAboveBand" and cond.observed_generation == 3
    assert status.autotune is not None and status.autotune.adjustments == 1 and status.autotune.last_change_step == 10
    assert [e.reason for e in r.events] == ["KnobsAdjusted"]


def test_the_goodput_search_state_survives_in_status_and_every_new_reason_is_an_event() -> None:
    """The over-sampling search spans ticks (its state lives in status.autotune); a hold whose reason is
    new is an Event as well as the condition, a repeated one only the condition."""
    s = spec(cooldownSeconds=0, settleRounds=0)
    status = RLJobStatus()
    first = tick.on_reading("j", s, status, reading(0.2, goodput=100.0), 1, NOW)
    assert first.decision is not None and first.decision.reason == "GoodputProbe"
    status = merged(status, first.patch)
    assert status.autotune is not None and (status.autotune.search, status.autotune.goodput_ref) == (1, 100.0)
    assert status.effective_knobs.over_sampling is not None and status.effective_knobs.over_sampling.value == 2.5
    later = NOW + timedelta(seconds=60)
    second = tick.on_reading("j", s, status, reading(0.2, steps=14, over=2.5, goodput=101.0), 1, later)
    assert second.decision is not None and second.decision.reason == "GoodputFlat"  # +1%: a tie, on up to 3.0
    status = merged(status, second.patch)
    assert status.autotune is not None and status.autotune.search == 1 and status.autotune.goodput_ref == 101.0
    later += timedelta(seconds=60)
    third = tick.on_reading("j", s, status, reading(0.2, steps=18, over=3.0, goodput=90.0), 1, later)
    assert third.decision is not None and third.decision.reason == "GoodputFalling"  # -11%: back to 2.5
    status = merged(status, third.patch)
    assert status.autotune is not None and status.autotune.search == 0 and status.autotune.next_probe == -1
    later += timedelta(seconds=60)
    fourth = tick.on_reading("j", s, status, reading(0.2, steps=22, over=2.5, goodput=100.0), 1, later)
    assert fourth.decision is not None and not fourth.decision.changed and fourth.decision.reason == "GoodputSettled"
    assert [(e.reason, e.type) for e in fourth.events] == [("GoodputSettled", "Normal")]
    status = merged(status, fourth.patch)
    fourth = tick.on_reading("j", s, status, reading(0.2, steps=26, over=2.5, goodput=100.0), 1, later + timedelta(seconds=60))
    assert fourth.decision is not None and fourth.decision.reason == "GoodputSettled" and fourth.events == []
    cond = merged(status, fourth.patch).condition(tick.CONDITION)
    assert cond is not None and cond.reason == "GoodputSettled" and "goodput 100.0" in cond.message


def test_recommend_writes_only_recommended_knobs() -> None:
    s = spec("Recommend")
    r = tick.on_reading("j", s, RLJobStatus(), reading(0.8), 1, NOW)
    assert "effectiveKnobs" not in r.patch
    assert r.patch["recommendedKnobs"]["truncation"]["value"] == 16.0
    assert [e.reason for e in r.events] == ["KnobsRecommended"] and "not applied" in r.events[0].message


def test_next_decision_waits_for_interval_then_cooldown_and_runtime() -> None:
    s = spec()
    status = merged(RLJobStatus(), tick.on_reading("j", s, RLJobStatus(), reading(0.8), 1, NOW).patch)
    assert not tick.due(s, status, NOW + timedelta(seconds=5))
    assert tick.due(s, status, NOW + timedelta(seconds=10))
    # Runtime still on the old cap: wait for it.
    r = tick.on_reading("j", s, status, reading(0.8, steps=20, cap=8), 1, NOW + timedelta(seconds=40))
    assert r.decision is not None and r.decision.reason == "AwaitingRuntime" and "effectiveKnobs" not in r.patch
    # Runtime on the new cap, but inside the cooldown.
    r = tick.on_reading("j", s, status, reading(0.8, steps=20, cap=16), 1, NOW + timedelta(seconds=20))
    assert r.decision is not None and r.decision.reason == "Cooldown"
    r = tick.on_reading("j", s, status, reading(0.8, steps=20, cap=16), 1, NOW + timedelta(seconds=40))
    assert r.decision is not None and r.decision.changed and r.patch["effectiveKnobs"]["truncation"]["value"] == 24.0


def test_window_starts_after_the_last_change() -> None:
    s = spec(windowSeconds=60)
    status = merged(RLJobStatus(), tick.on_reading("j", s, RLJobStatus(), reading(0.8), 1, NOW).patch)
    assert tick.query_window(s, status, NOW + timedelta(seconds=25)) == 25
    assert tick.query_window(s, status, NOW + timedelta(seconds=600)) == 60
    assert "[25s]" in tick.queries_for("j", "ns", s, status, NOW + timedelta(seconds=25)).truncation_rate


def test_failure_keeps_knobs_sets_condition_and_backs_off() -> None:
    s = spec()
    ok = merged(RLJobStatus(), tick.on_reading("j", s, RLJobStatus(), reading(0.8), 1, NOW).patch)
    r1 = tick.on_failure(s, ok, PrometheusUnavailable("connection refused"), 1, NOW + timedelta(seconds=10))
    assert "effectiveKnobs" not in r1.patch and r1.failure == "PrometheusUnavailable"
    st1 = merged(ok, r1.patch)
    cond = st1.condition(tick.CONDITION)
    assert cond is not None and cond.status == "False" and "connection refused" in cond.message
    assert st1.effective_knobs.truncation is not None and st1.effective_knobs.truncation.value == 16.0
    assert [e.type for e in r1.events] == ["Warning"]
    assert not tick.due(s, st1, NOW + timedelta(seconds=15))
    assert tick.due(s, st1, NOW + timedelta(seconds=20))
    r2 = tick.on_failure(s, st1, PrometheusUnavailable("connection refused"), 1, NOW + timedelta(seconds=20))
    st2 = merged(st1, r2.patch)
    assert st2.autotune is not None and st2.autotune.consecutive_failures == 2
    assert st2.autotune.next_attempt_time == NOW + timedelta(seconds=40)  # doubled
    assert r2.events == []  # same reason: no Event spam
    r3 = tick.on_failure(s, st2, NoData("no series"), 1, NOW + timedelta(seconds=40))
    assert r3.failure == "NoMetrics" and [e.reason for e in r3.events] == ["NoMetrics"]
    # Recovery: condition True again, backoff cleared, an Event says so.
    r4 = tick.on_reading("j", s, merged(st2, r3.patch), reading(0.2, steps=30, cap=16), 1, NOW + timedelta(seconds=200))
    st4 = merged(merged(st2, r3.patch), r4.patch)
    assert st4.condition(tick.CONDITION).status == "True"  # type: ignore[union-attr]
    assert st4.autotune is not None and st4.autotune.consecutive_failures == 0 and st4.autotune.next_attempt_time is None
    assert "AutotuneRecovered" in [e.reason for e in r4.events]


def test_off_reverts_autotune_knobs_to_spec_once() -> None:
    applied = merged(RLJobStatus(), tick.on_reading("j", spec(), RLJobStatus(), reading(0.8), 1, NOW).patch)
    off = spec("Off")
    assert not tick.due(off, applied, NOW)
    r = tick.on_mode(off, applied, 1, NOW)
    assert r.patch["effectiveKnobs"]["truncation"] == {"value": 8.0, "unit": "tokens", "source": "spec",
                                                      "reason": "autotune mode is Off: spec value", "query": ""}
    after = merged(applied, r.patch)
    assert after.condition(tick.CONDITION).reason == "AutotuneOff"  # type: ignore[union-attr]
    assert tick.on_mode(off, after, 1, NOW).patch == {}


def test_other_conditions_are_kept() -> None:
    status = RLJobStatus.model_validate(
        {"conditions": [{"type": "Ready", "status": "True", "reason": "AllReady", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}
    )
    r = tick.on_reading("j", spec(), status, reading(0.2), 1, NOW)
    assert [c["type"] for c in r.patch["conditions"]] == ["Ready", tick.CONDITION]


def test_operator_metrics_count_adjustments() -> None:
    m = AutotuneMetrics(CollectorRegistry())
    s = spec()
    r = tick.on_reading("j", s, RLJobStatus(), reading(0.8), 1, NOW)
    m.observe("ns", "j", "Apply", tick.current_knobs(s, RLJobStatus()), r)
    assert m.registry.get_sample_value("rljob_effective_knob", {"namespace": "ns", "rljob": "j", "knob": "segment_cap_tokens"}) == 16
    labels = {"namespace": "ns", "rljob": "j", "knob": "truncation", "mode": "Apply"}
    assert m.registry.get_sample_value("rljob_autotune_adjustments_total", labels) == 1
    m.observe("ns", "j", "Apply", tick.current_knobs(s, RLJobStatus()), tick.on_failure(s, RLJobStatus(), NoData("x"), 1, NOW))
    assert m.registry.get_sample_value("rljob_autotune_failures_total", {"namespace": "ns", "rljob": "j", "reason": "NoMetrics"}) == 1
    m.forget("ns", "j")
    assert m.registry.get_sample_value("rljob_autotune_adjustments_total", labels) is None


def test_selector_labels_rljob_and_rljob_namespace_are_reserved() -> None:
    import pytest
    from pydantic import ValidationError

    from rljob.api.load import format_validation_error
    from rljob.common.autotune.queries import job_selector

    base = {"model": {"builtin": "tiny-arith"}, "data": {"synthetic": {}}}
    for label in ("rljob", "rljob_namespace"):
        with pytest.raises(ValidationError) as info:
            RLJobSpec.model_validate({**base, "autotune": {"prometheus": {"matchLabels": {label: "other", "env": "prod"}}}})
        message = format_validation_error(info.value, "spec")
        assert "autotune.prometheus.matchLabels: matchLabels cannot set rljob or rljob_namespace" in message, message
    ok = RLJobSpec.model_validate({**base, "autotune": {"prometheus": {"matchLabels": {"env": "prod"}}}})
    assert ok.autotune.prometheus.match_labels == {"env": "prod"}
    # Never overridable in the query, even from labels that got past validation (an object stored earlier).
    selector = job_selector("demo", "ml", {"rljob": "victim", "rljob_namespace": "other", "env": "prod"})
    assert selector == '{env="prod",rljob="demo",rljob_namespace="ml"}'
