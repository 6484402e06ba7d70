"""What the operator does about a job's alert conditions, pure: spec + bookkeeping + one reading → a decision.

The checker (checker.py) reads Prometheus and does what the decision says. Semantics follow
Prometheus's own `for`: a condition that holds at a check starts an episode (`since`); once it has held
for `forSeconds` the entry's action is taken, once per episode; a check at which it no longer holds
ends the episode. A check without any series of the job (a suspended or restarting job, a scrape gap)
neither starts nor ends an episode: no data is no evidence.

Actions (spec.alertActions[].action), each with an Event and the AlertAction condition:
- Notify: nothing else;
- Suspend: spec.suspend = true (the job's ordinary suspend path; the user resumes it);
- RollbackToCheckpoint: spec.checkpoint.rollbackTo names the newest checkpoint the job had when the
  episode began (`checkpointBefore`, from status.trainer.lastCheckpoint), with spec.algorithm.learningRate
  lowered when the entry gives one. The rollback's id is derived from the episode, so deciding it twice
  (a status write lost after the spec patch) asks for the same rollback.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Literal

from rljob.api.spec import AlertActionSpec, CheckpointRollback, RLJobSpec
from rljob.api.status import AlertsStatus, AlertState, CheckpointRef

CONDITION = "AlertAction"

# What an action did, as the condition's reason and status.alerts.holding[].action.
_DONE = {"Notify": "Notified", "Suspend": "Suspended", "RollbackToCheckpoint": "RolledBack"}
NO_CHECKPOINT = "NoCheckpointBefore"


@dataclass(frozen=True)
class AlertEvent:
    """A Kubernetes Event to post on the RLJob."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True)
class ConditionState:
    """The AlertAction condition to write."""

    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str


@dataclass
class AlertDecision:
    """The bookkeeping to write, and what to change in the spec (nothing by default)."""

    alerts: AlertsStatus
    condition: ConditionState
    events: list[AlertEvent] = field(default_factory=list)
    suspend: bool = False
    rollback: CheckpointRollback | None = None
    learning_rate: float | None = None

    @property
    def spec_patch(self) -> dict[str, object]:
        """The JSON merge patch of the RLJob's spec that carries out the actions (empty: none)."""
        patch: dict[str, object] = {}
        if self.suspend:
            patch["suspend"] = True
        if self.rollback is not None:
            patch["checkpoint"] = {"rollbackTo": self.rollback.to_wire()}
        if self.learning_rate is not None:
            patch["algorithm"] = {"learningRate": self.learning_rate}
        return patch


def due(spec: RLJobSpec, alerts: AlertsStatus | None, now: datetime) -> bool:
    """Whether the job's alert conditions are checked now (every autotune.intervalSeconds)."""
    if not spec.alert_actions or spec.suspend:
        return False
    last = alerts.last_check_time if alerts is not None else None
    return last is None or now >= last + timedelta(seconds=spec.autotune.interval_seconds)


def for_seconds(entry: AlertActionSpec, rule_for: Mapping[str, int]) -> int:
    """How long the entry's condition must hold: its forSeconds, else the chart rule's `for`."""
    return entry.for_seconds if entry.for_seconds is not None else rule_for[entry.alert]


def rollback_id(state: AlertState) -> str:
    """The rollback's name, fixed by the episode (alert and start), so deciding it again changes nothing."""
    short = state.alert.removeprefix("RLJob").lower()
    return f"{short}-{int(state.since.timestamp())}"


def _act(entry: AlertActionSpec, state: AlertState, spec: RLJobSpec, decision: AlertDecision, label: str) -> str:
    """Take the entry's action for an episode that has held long enough; returns what was done."""
    held = f"{label}: {entry.alert} has held since {state.since.isoformat()} (value {state.value:.4g})"
    if entry.action == "Notify":
        decision.events.append(AlertEvent("Warning", entry.alert, f"{held}; action Notify"))
        return _DONE["Notify"]
    if entry.action == "Suspend":
        decision.suspend = not spec.suspend
        decision.events.append(AlertEvent("Warning", "AlertSuspended", f"{held}; the job is suspended (spec.suspend)"))
        return _DONE["Suspend"]
    target = state.checkpoint_before
    if target is None:
        decision.events.append(AlertEvent(
            "Warning", "RollbackImpossible",
            f"{held}; no checkpoint was taken before it began, so there is nothing to roll back to (the job runs on)",
        ))
        return NO_CHECKPOINT
    decision.rollback = CheckpointRollback(step=target.step, id=rollback_id(state))
    lowered = ""
    if entry.learning_rate is not None and entry.learning_rate != spec.algorithm.learning_rate:
        decision.learning_rate = entry.learning_rate
        lowered = f", learning rate {spec.algorithm.learning_rate:g} -> {entry.learning_rate:g}"
    decision.events.append(AlertEvent(
        "Warning", "AlertRolledBack",
        f"{held}; resuming from the checkpoint of step {target.step} ({target.uri}), the newest before it began"
        f"{lowered} (spec.checkpoint.rollbackTo id {decision.rollback.id})",
    ))
    return _DONE["RollbackToCheckpoint"]


def decide(
    label: str,
    spec: RLJobSpec,
    previous: AlertsStatus | None,
    readings: Mapping[str, float | None] | None,
    checkpoint: CheckpointRef | None,
    rule_for: Mapping[str, int],
    now: datetime,
) -> AlertDecision:
    """One check of a job's alert conditions.

    `readings`: per alert of spec.alertActions, the rule's value for the job (None: it does not hold);
    None when Prometheus has no series of the job at all (nothing is concluded). `checkpoint` is the
    job's newest checkpoint now (status.trainer.lastCheckpoint); `rule_for` the chart rules' `for`.
    `label` names the job in messages.
    """
    before = previous or AlertsStatus()
    if readings is None:
        return unchecked(before, spec, "NoMetrics", f"Prometheus has no series of {label}", now)
    decision = AlertDecision(AlertsStatus(last_check_time=now), ConditionState("False", "NoAlertFiring", ""))
    for entry in spec.alert_actions:
        state = before.state(entry.alert)
        value = readings.get(entry.alert)
        if value is None:
            if state is not None:
                decision.events.append(AlertEvent("Normal", "AlertResolved", f"{label}: {entry.alert} no longer holds"))
            continue
        if state is None:
            state = AlertState(alert=entry.alert, since=now, checkpoint_before=checkpoint)
            decision.events.append(AlertEvent(
                "Normal", "AlertPending",
                f"{label}: {entry.alert} holds (value {value:g}); action {entry.action} after "
                f"{for_seconds(entry, rule_for)} s",
            ))
        state = state.model_copy(update={"value": value})
        if state.action is None and now >= state.since + timedelta(seconds=for_seconds(entry, rule_for)):
            state = state.model_copy(update={"action": _act(entry, state, spec, decision, label), "acted_time": now})
        decision.alerts.holding.append(state)
    decision.condition = _summary(decision.alerts, spec)
    return decision


def _summary(alerts: AlertsStatus, spec: RLJobSpec) -> ConditionState:
    """The AlertAction condition for the episodes in `alerts`: True while one has been acted on."""
    acted = sorted((s for s in alerts.holding if s.action), key=lambda s: s.acted_time or s.since)
    pending = [s for s in alerts.holding if not s.action]
    if acted:
        latest = acted[-1]
        return ConditionState("True", latest.action or "", "; ".join(f"{s.alert}: {s.action}" for s in acted))
    if pending:
        names = ", ".join(s.alert for s in pending)
        return ConditionState("False", "Pending", f"holding, not yet for long enough: {names}")
    checked = ", ".join(a.alert for a in spec.alert_actions)
    return ConditionState("False", "NoAlertFiring", f"none of {checked} holds")


def unchecked(previous: AlertsStatus | None, spec: RLJobSpec, reason: str, why: str, now: datetime) -> AlertDecision:
    """A check that concluded nothing (Prometheus failed, or has no series of the job): episodes are kept as
    they are; the condition stays True while one was acted on, else it is Unknown with the reason."""
    kept = (previous or AlertsStatus()).model_copy(update={"last_check_time": now})
    if any(s.action for s in kept.holding):
        return AlertDecision(kept, _summary(kept, spec))
    return AlertDecision(kept, ConditionState("Unknown", reason, f"{why}: alert conditions not checked"))
