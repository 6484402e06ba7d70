"""One autotuner tick for one RLJob, pure: spec + status + a Prometheus reading (or its failure) → status patch and Events.

The kopf timer (timer.py) does the I/O around it: it asks `due` whether to read Prometheus now,
reads, calls `on_reading` or `on_failure`, patches status and posts the Events.

Status written here (a JSON merge patch onto the status the tick read; `autotuner_status` turns the
merged status into what the autotuner server-side applies as field manager `rljob-autotuner`):
- `effectiveKnobs.<knob>` with source `autotune` (mode Apply only: the runtime applies these);
- `recommendedKnobs` (mode Recommend: shown, never applied);
- `autotune` bookkeeping (last decision, last change, backoff);
- the `AutotuneActive` condition (False with the reason while Prometheus fails or has no data).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

from rljob.api.spec import RLJobSpec
from rljob.api.status import (
    AutotuneStatus,
    Condition,
    EffectiveKnobs,
    KnobValue,
    RLJobStatus,
)
from rljob.common.autotune.controller import (
    ControllerConfig,
    TunerDecision,
    Knobs,
    TruncationUnit,
    TunerState,
    decide,
    knobs_in_force,
)
from rljob.common.autotune.prometheus import PrometheusError
from rljob.common.autotune.queries import JobQueries, Reading

CONDITION = "AutotuneActive"
MAX_BACKOFF_S = 600.0

_FAILURE_REASONS = {
    "unavailable": "PrometheusUnavailable",
    "query": "QueryRejected",
    "nodata": "NoMetrics",
    "ambiguous": "AmbiguousMetrics",
    "error": "PrometheusError",
}


@dataclass(frozen=True)
class AutotuneEvent:
    """A Kubernetes Event to post on the RLJob."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass
class TickResult:
    """What one tick decided: a status merge patch (empty: nothing to write), Events, the decision."""

    patch: dict[str, Any] = field(default_factory=dict)
    events: list[AutotuneEvent] = field(default_factory=list)
    decision: TunerDecision | None = None
    failure: str | None = None  # failure reason, when the read failed


def truncation_unit(spec: RLJobSpec) -> TruncationUnit | None:
    """The truncation knob's unit from the spec (None: truncation off, not tuned)."""
    mode = spec.rollout.partial.truncation.mode
    return "sigma" if mode == "sigma" else "tokens" if mode == "tokens" else None


def spec_knobs(spec: RLJobSpec) -> Knobs:
    """The knob values the spec asks for."""
    t = spec.rollout.partial.truncation
    unit = truncation_unit(spec)
    value = t.k if unit == "sigma" else float(t.max_tokens) if unit == "tokens" and t.max_tokens else None
    return Knobs(over_sampling=spec.rollout.partial.over_sampling, truncation=value, truncation_unit=unit)


def current_knobs(spec: RLJobSpec, status: RLJobStatus) -> Knobs:
    """Knobs in force as the operator sees them: effectiveKnobs where set (in the spec's unit), else the spec."""
    base = spec_knobs(spec)
    ek = status.effective_knobs
    over = ek.over_sampling.value if ek.over_sampling is not None else base.over_sampling
    trunc = base.truncation
    if ek.truncation is not None and ek.truncation.unit == base.truncation_unit:
        trunc = ek.truncation.value
    return Knobs(over_sampling=over, truncation=trunc, truncation_unit=base.truncation_unit)


def _ts(value: datetime | None) -> float | None:
    return value.timestamp() if value is not None else None


def due(spec: RLJobSpec, status: RLJobStatus, now: datetime) -> bool:
    """Whether Prometheus should be read now: the interval since the last decision, or the failure backoff."""
    if spec.autotune.mode == "Off":
        return False
    a = status.autotune
    if a is None or a.mode != spec.autotune.mode:
        return True
    if a.consecutive_failures > 0:
        return a.next_attempt_time is None or now >= a.next_attempt_time
    if a.last_decision_time is None:
        return True
    return now >= a.last_decision_time + timedelta(seconds=spec.autotune.interval_seconds)


def query_window(spec: RLJobSpec, status: RLJobStatus, now: datetime) -> int:
    """Averaging window in seconds: the configured one, shortened so it starts after the last change."""
    window = spec.autotune.window_seconds
    a = status.autotune
    if a is not None and a.last_change_time is not None:
        window = min(window, int((now - a.last_change_time).total_seconds()))
    return window


def queries_for(name: str, namespace: str, spec: RLJobSpec, status: RLJobStatus, now: datetime) -> JobQueries:
    """The PromQL of this tick (the job's series in its namespace)."""
    return JobQueries(
        name=name,
        namespace=namespace,
        match_labels=dict(spec.autotune.prometheus.match_labels),
        window_s=query_window(spec, status, now),
    )


def persisted_step(status: RLJobStatus) -> int | None:
    """The job's training step as the trainer last wrote it to status (survives trainer restarts)."""
    return status.trainer.step


def _condition(status: RLJobStatus, true: bool, reason: str, message: str, generation: int, now: datetime) -> list[dict[str, Any]]:
    """The whole conditions list (merge patches replace lists) with AutotuneActive set."""
    state: Literal["True", "False"] = "True" if true else "False"
    old = status.condition(CONDITION)
    cond = Condition(
        type=CONDITION,
        status=state,
        reason=reason,
        message=message[:2000],
        observed_generation=generation,
        last_transition_time=now if old is None or old.status != state else old.last_transition_time,
    )
    others = [c for c in status.conditions if c.type != CONDITION]
    return [c.to_wire() for c in others + [cond]]


def _autotune_patch(a: AutotuneStatus) -> dict[str, Any]:
    wire = a.to_wire()
    # Merge patch: null removes a key that is no longer set (e.g. the backoff deadline after a success).
    for key in ("lastChangeTime", "lastChangeStep", "nextAttemptTime", "lastDecisionTime", "goodputRef"):
        wire.setdefault(key, None)
    return wire


def _knob_values(knobs: Knobs, decision: TunerDecision, query: str, now: datetime, source: Literal["spec", "autotune"]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "overSampling": KnobValue(
            value=knobs.over_sampling, unit="ratio", source=source, reason=decision.message, query=query, time=now
        ).to_wire()
    }
    if knobs.truncation is not None and knobs.truncation_unit is not None:
        out["truncation"] = KnobValue(
            value=knobs.truncation, unit=knobs.truncation_unit, source=source, reason=decision.message, query=query, time=now
        ).to_wire()
    return out


def _revert_to_spec(spec: RLJobSpec, status: RLJobStatus) -> dict[str, Any] | None:
    """effectiveKnobs entries the autotuner owns, set back to the spec (mode no longer Apply); None if none."""
    ek: EffectiveKnobs = status.effective_knobs
    owned = [n for n in ("over_sampling", "truncation") if (v := getattr(ek, n)) is not None and v.source == "autotune"]
    if not owned:
        return None
    base = spec_knobs(spec)
    out: dict[str, Any] = {}
    reason = f"autotune mode is {spec.autotune.mode}: spec value"
    if "over_sampling" in owned:
        out["overSampling"] = KnobValue(value=base.over_sampling, unit="ratio", source="spec", reason=reason).to_wire()
    if "truncation" in owned:
        out["truncation"] = (
            KnobValue(value=base.truncation, unit=base.truncation_unit, source="spec", reason=reason).to_wire()
            if base.truncation is not None and base.truncation_unit is not None
            else None
        )
    return out


def on_mode(spec: RLJobSpec, status: RLJobStatus, generation: int, now: datetime) -> TickResult:
    """Bookkeeping when the mode is Off or changed away from Apply; empty when nothing is to write."""
    mode = spec.autotune.mode
    result = TickResult()
    revert = _revert_to_spec(spec, status) if mode != "Apply" else None
    if revert:
        result.patch["effectiveKnobs"] = revert
        result.events.append(AutotuneEvent("Normal", "KnobsReverted", f"autotune mode {mode}: knobs back to the spec"))
    if mode != "Recommend" and status.recommended_knobs is not None:
        result.patch["recommendedKnobs"] = None
    if mode == "Off" and (status.autotune is None or status.autotune.mode != "Off" or status.condition(CONDITION) is None):
        prev = status.autotune or AutotuneStatus()
        result.patch["autotune"] = _autotune_patch(
            prev.model_copy(update={"mode": "Off", "consecutive_failures": 0, "next_attempt_time": None, "direction": 0})
        )
        result.patch["conditions"] = _condition(status, False, "AutotuneOff", "spec.autotune.mode is Off", generation, now)
    return result


def on_failure(
    spec: RLJobSpec, status: RLJobStatus, error: PrometheusError, generation: int, now: datetime
) -> TickResult:
    """Prometheus failed or had no data: keep the knobs, say why, back off exponentially."""
    prev = status.autotune or AutotuneStatus(mode=spec.autotune.mode)
    failures = prev.consecutive_failures + 1
    delay = min(MAX_BACKOFF_S, spec.autotune.interval_seconds * 2 ** min(failures - 1, 10))
    reason = _FAILURE_REASONS.get(error.kind, "PrometheusError")
    message = f"{error}; keeping the last knobs, retry in {delay:.0f} s"
    autotune = prev.model_copy(
        update={
            "mode": spec.autotune.mode,
            "consecutive_failures": failures,
            "next_attempt_time": now + timedelta(seconds=delay),
            "last_decision_time": now,
            "last_decision": reason,
        }
    )
    result = TickResult(failure=reason)
    result.patch["autotune"] = _autotune_patch(autotune)
    result.patch["conditions"] = _condition(status, False, reason, message, generation, now)
    old = status.condition(CONDITION)
    if old is None or old.status == "True" or old.reason != reason:
        result.events.append(AutotuneEvent("Warning", reason, message))
    return result


def on_reading(
    name: str, spec: RLJobSpec, status: RLJobStatus, reading: Reading, generation: int, now: datetime
) -> TickResult:
    """Run the control law on a reading and describe the status change."""
    mode = spec.autotune.mode
    prev = status.autotune or AutotuneStatus(mode=mode)
    cfg = ControllerConfig.from_spec(spec.autotune, spec.rollout.max_response_length)
    # Recommend never applies: its base is what the runtime runs, the spec.
    current = current_knobs(spec, status) if mode == "Apply" else spec_knobs(spec)
    state = TunerState(
        last_change_time=_ts(prev.last_change_time), last_change_step=prev.last_change_step, direction=prev.direction,
        search=prev.search, goodput_ref=prev.goodput_ref, next_probe=prev.next_probe or 1,
        settled_decisions=prev.settled_decisions,
    )
    in_force = knobs_in_force(reading.in_force, current.truncation_unit)
    decision = decide(reading.observation, current, cfg, state, now.timestamp(), mode, in_force)

    result = on_mode(spec, status, generation, now)  # reverts autotune-owned knobs when mode is Recommend
    result.decision = decision
    changed_at = now if decision.changed else prev.last_change_time
    autotune = prev.model_copy(
        update={
            "mode": mode,
            "last_decision_time": now,
            "last_decision": decision.reason,
            "last_change_time": changed_at,
            "last_change_step": decision.state.last_change_step if decision.changed else prev.last_change_step,
            "direction": decision.state.direction,
            "search": decision.state.search,
            "goodput_ref": decision.state.goodput_ref,
            "next_probe": decision.state.next_probe,
            "settled_decisions": decision.state.settled_decisions,
            "adjustments": prev.adjustments + int(decision.changed),
            "consecutive_failures": 0,
            "next_attempt_time": None,
        }
    )
    result.patch["autotune"] = _autotune_patch(autotune)
    was_failing = (old := status.condition(CONDITION)) is not None and old.status == "False" and prev.consecutive_failures
    result.patch["conditions"] = _condition(status, True, decision.reason, decision.message, generation, now)
    if was_failing:
        result.events.append(AutotuneEvent("Normal", "AutotuneRecovered", f"metrics readable again: {decision.message}"))
    if not decision.changed and decision.reason != prev.last_decision and not was_failing:
        # Every decision's reason is an Event too, once per new reason (a hold repeated every interval
        # would flood the job's Events); the condition carries the latest one.
        result.events.append(AutotuneEvent("Normal", decision.reason, f"{name}: {decision.message}"))
    if decision.changed:
        if mode == "Apply":
            result.patch["effectiveKnobs"] = _knob_values(decision.knobs, decision, reading.query, now, "autotune")
            result.events.append(AutotuneEvent("Normal", "KnobsAdjusted", f"{name}: {decision.message}"))
        else:
            result.patch["recommendedKnobs"] = _knob_values(decision.knobs, decision, reading.query, now, "autotune")
            result.events.append(
                AutotuneEvent("Normal", "KnobsRecommended", f"{name}: {decision.message} (mode Recommend: not applied)")
            )
    return result


def merge_patch(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """RFC 7386 JSON merge patch of `patch` onto a copy of `target` (null removes a key, lists are replaced)."""
    out = dict(target)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_patch(out[key], value)
        else:
            out[key] = value
    return out


def autotuner_status(status: RLJobStatus) -> dict[str, Any]:
    """Exactly the status fields the autotuner owns, as its server-side apply body.

    The AutotuneActive condition, `autotune`, `recommendedKnobs` and the effectiveKnobs entries whose
    source is `autotune`. A knob reverted to the spec is left out: the autotuner gives it up, and the
    operator fills it from the spec again.
    """
    wire = status.to_wire()
    body: dict[str, Any] = {"conditions": [c.to_wire() for c in status.conditions if c.type == CONDITION]}
    for key in ("autotune", "recommendedKnobs"):
        if key in wire:
            body[key] = wire[key]
    knobs = {
        wire_name: value.to_wire()
        for name, wire_name in (("over_sampling", "overSampling"), ("truncation", "truncation"))
        if (value := getattr(status.effective_knobs, name)) is not None and value.source == "autotune"
    }
    if knobs:
        body["effectiveKnobs"] = knobs
    return body
