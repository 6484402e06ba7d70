"""The alert-action decision, table by table: episodes, `for`, each action, and checks that conclude nothing."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from rljob.api.spec import RLJobSpec
from rljob.api.status import AlertsStatus, CheckpointRef
from rljob.operator.alerts.decide import AlertDecision, decide, due, rollback_id, unchecked

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
RULE_FOR = {"RLJobEntropyCollapse": 600, "RLJobRewardCollapse": 900, "RLJobTokenWasteHigh": 900}
CKPT = CheckpointRef(step=10, uri="/ckpt/step-00000010", time=T0 - timedelta(minutes=3))


def spec(*entries: dict[str, Any], **extra: Any) -> RLJobSpec:
    return RLJobSpec.model_validate(
        {"model": {"builtin": "tiny-arith"}, "data": {"synthetic": {}}, "alertActions": list(entries), **extra}
    )


def run(job: RLJobSpec, steps: list[tuple[int, dict[str, float | None] | None]],
        checkpoint: CheckpointRef | None = CKPT) -> list[AlertDecision]:
    """Checks at T0 + seconds with the given readings, each on the bookkeeping the previous one wrote."""
    out: list[AlertDecision] = []
    alerts: AlertsStatus | None = None
    for seconds, readings in steps:
        decision = decide("ns/job", job, alerts, readings, checkpoint, RULE_FOR, T0 + timedelta(seconds=seconds))
        alerts = decision.alerts
        out.append(decision)
    return out


def reasons(decision: AlertDecision) -> list[str]:
    return [e.reason for e in decision.events]


def test_notify_after_the_rule_for_once_per_episode_and_resolved() -> None:
    job = spec({"alert": "RLJobEntropyCollapse"})
    d = run(job, [(0, {"RLJobEntropyCollapse": 0.01}), (599, {"RLJobEntropyCollapse": 0.01}),
                  (600, {"RLJobEntropyCollapse": 0.02}), (900, {"RLJobEntropyCollapse": 0.02}),
                  (930, {"RLJobEntropyCollapse": None})])
    assert reasons(d[0]) == ["AlertPending"] and d[0].condition.reason == "Pending"
    assert reasons(d[1]) == [] and d[1].condition.status == "False"
    # Held the chart rule's `for` (600 s): acted on once, the condition True with what was done.
    assert reasons(d[2]) == ["RLJobEntropyCollapse"] and d[2].condition.status == "True"
    assert d[2].condition.reason == "Notified" and d[2].alerts.holding[0].value == 0.02
    assert reasons(d[3]) == [] and d[3].condition.reason == "Notified"  # not again in the same episode
    assert reasons(d[4]) == ["AlertResolved"] and d[4].alerts.holding == []
    assert d[4].condition.status == "False" and d[4].condition.reason == "NoAlertFiring"
    assert all(not x.spec_patch for x in d)


def test_a_check_that_no_longer_holds_restarts_the_clock() -> None:
    job = spec({"alert": "RLJobEntropyCollapse", "forSeconds": 60})
    d = run(job, [(0, {"RLJobEntropyCollapse": 0.01}), (30, {"RLJobEntropyCollapse": None}),
                  (70, {"RLJobEntropyCollapse": 0.01}), (120, {"RLJobEntropyCollapse": 0.01}),
                  (130, {"RLJobEntropyCollapse": 0.01})])
    assert d[2].alerts.holding[0].since == T0 + timedelta(seconds=70)
    assert d[3].condition.reason == "Pending"  # 50 s into the new episode
    assert d[4].condition.reason == "Notified"


def test_suspend_sets_spec_suspend_once() -> None:
    job = spec({"alert": "RLJobTokenWasteHigh", "action": "Suspend", "forSeconds": 0})
    d = run(job, [(0, {"RLJobTokenWasteHigh": 0.5}), (30, {"RLJobTokenWasteHigh": 0.5})])
    assert d[0].spec_patch == {"suspend": True} and "AlertSuspended" in reasons(d[0])
    assert d[0].condition.status == "True" and d[0].condition.reason == "Suspended"
    assert d[1].spec_patch == {}


def test_suspend_of_a_job_already_suspended_changes_nothing_in_the_spec() -> None:
    job = spec({"alert": "RLJobTokenWasteHigh", "action": "Suspend", "forSeconds": 0}, suspend=True)
    d = run(job, [(0, {"RLJobTokenWasteHigh": 0.5})])
    assert d[0].spec_patch == {} and d[0].condition.reason == "Suspended"


def test_rollback_names_the_checkpoint_the_job_had_when_the_condition_began() -> None:
    job = spec({"alert": "RLJobRewardCollapse", "action": "RollbackToCheckpoint", "forSeconds": 60,
                "learningRate": 2e-6})
    later = CheckpointRef(step=15, uri="/ckpt/step-00000015", time=T0 + timedelta(seconds=30))
    first = decide("ns/job", job, None, {"RLJobRewardCollapse": 0.1}, CKPT, RULE_FOR, T0)
    # A checkpoint taken while the condition held is not the target: the one from the episode's start is.
    acted = decide("ns/job", job, first.alerts, {"RLJobRewardCollapse": 0.1}, later, RULE_FOR, T0 + timedelta(seconds=60))
    assert acted.spec_patch == {
        "checkpoint": {"rollbackTo": {"step": 10, "id": f"rewardcollapse-{int(T0.timestamp())}"}},
        "algorithm": {"learningRate": 2e-6},
    }
    assert acted.condition.reason == "RolledBack" and reasons(acted) == ["AlertRolledBack"]
    assert "step 10" in acted.events[0].message and "1e-05 -> 2e-06" in acted.events[0].message
    # Decided again from the same episode (the status write was lost): the same rollback, same id.
    again = decide("ns/job", job, first.alerts, {"RLJobRewardCollapse": 0.1}, later, RULE_FOR, T0 + timedelta(seconds=90))
    assert again.spec_patch == acted.spec_patch


def test_rollback_without_a_learning_rate_keeps_the_spec_one() -> None:
    job = spec({"alert": "RLJobEntropyCollapse", "action": "RollbackToCheckpoint", "forSeconds": 0})
    d = run(job, [(0, {"RLJobEntropyCollapse": 0.01})])
    assert set(d[0].spec_patch) == {"checkpoint"}


def test_rollback_with_no_checkpoint_before_the_condition_says_so_and_changes_nothing() -> None:
    job = spec({"alert": "RLJobEntropyCollapse", "action": "RollbackToCheckpoint", "forSeconds": 0})
    d = run(job, [(0, {"RLJobEntropyCollapse": 0.01})], checkpoint=None)
    assert d[0].spec_patch == {} and "RollbackImpossible" in reasons(d[0])
    assert d[0].condition.status == "True" and d[0].condition.reason == "NoCheckpointBefore"


def test_no_series_of_the_job_neither_starts_nor_ends_an_episode() -> None:
    job = spec({"alert": "RLJobEntropyCollapse", "forSeconds": 60})
    d = run(job, [(0, {"RLJobEntropyCollapse": 0.01}), (30, None), (60, {"RLJobEntropyCollapse": 0.01})])
    assert d[1].alerts.holding == d[0].alerts.holding and d[1].condition.status == "Unknown"
    assert d[1].condition.reason == "NoMetrics" and d[1].events == []
    assert d[2].condition.reason == "Notified"  # the episode kept its start through the gap


def test_an_unreadable_check_keeps_an_acted_episode_true() -> None:
    job = spec({"alert": "RLJobEntropyCollapse", "forSeconds": 0})
    acted = run(job, [(0, {"RLJobEntropyCollapse": 0.01})])[0]
    kept = unchecked(acted.alerts, job, "PrometheusUnavailable", "down", T0 + timedelta(seconds=30))
    assert kept.condition.status == "True" and kept.alerts.holding == acted.alerts.holding
    fresh = unchecked(None, job, "PrometheusUnavailable", "down", T0)
    assert fresh.condition.status == "Unknown" and fresh.condition.reason == "PrometheusUnavailable"


def test_each_alert_is_its_own_episode() -> None:
    job = spec({"alert": "RLJobEntropyCollapse", "forSeconds": 0}, {"alert": "RLJobTokenWasteHigh", "forSeconds": 60})
    d = run(job, [(0, {"RLJobEntropyCollapse": 0.01, "RLJobTokenWasteHigh": 0.4})])
    assert [s.alert for s in d[0].alerts.holding] == ["RLJobEntropyCollapse", "RLJobTokenWasteHigh"]
    assert [s.action for s in d[0].alerts.holding] == ["Notified", None]


@pytest.mark.parametrize(("suspend", "last", "expected"), [
    (False, None, True), (False, 29, False), (False, 30, True), (True, None, False),
])
def test_due_every_interval_and_never_while_suspended(suspend: bool, last: int | None, expected: bool) -> None:
    job = spec({"alert": "RLJobEntropyCollapse"}, suspend=suspend)
    alerts = None if last is None else AlertsStatus(last_check_time=T0)
    assert due(job, alerts, T0 + timedelta(seconds=last or 0)) is expected
    assert due(spec(), None, T0) is False  # no alertActions: nothing to check


def test_rollback_id_is_a_dns_label() -> None:
    from rljob.api.status import AlertState

    assert rollback_id(AlertState(alert="RLJobEntropyCollapse", since=T0)) == f"entropycollapse-{int(T0.timestamp())}"
