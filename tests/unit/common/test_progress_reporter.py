"""The runtime's status reporter: patch shape and rate limiting (no API server needed)."""

from __future__ import annotations

from typing import Any

import pytest

from rljob.api.status import RLJobStatus
from rljob.common.progress_reporter import ProgressReporter, progress_patch


class Recorder:
    def __init__(self, fail: bool = False) -> None:
        self.patches: list[dict[str, Any]] = []
        self.fail = fail

    def __call__(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        if self.fail:
            raise ConnectionError("API server unreachable")
        assert (namespace, name) == ("ns", "job")
        self.patches.append(patch)


def test_patch_uses_the_status_schema() -> None:
    patch = progress_patch(step=7, policy_version=7, metrics={"truncation_rate": 0.25, "entropy": 1.5})
    assert patch["trainer"]["step"] == 7 and patch["trainer"]["policyVersion"] == 7
    assert patch["metrics"]["truncationRate"] == 0.25
    status = RLJobStatus.model_validate(patch)
    assert status.trainer.step == 7 and status.metrics.entropy == 1.5
    with pytest.raises(ValueError, match="unknown status metrics"):
        progress_patch(metrics={"entropyy": 1.0})


def test_rate_limit_keeps_newest_values_and_checkpoints_go_out_at_once() -> None:
    now = [100.0]
    sent = Recorder()
    reporter = ProgressReporter("ns", "job", min_interval_seconds=10, sender=sent, clock=lambda: now[0])
    assert reporter.report(step=1, metrics={"reward_mean": 0.1})
    assert not reporter.report(step=2, metrics={"reward_mean": 0.2})
    assert not reporter.report(step=3)
    assert len(sent.patches) == 1
    assert reporter.report_checkpoint(step=3, uri="/ckpt/3"), "checkpoints bypass the rate limit"
    merged = sent.patches[-1]
    assert merged["trainer"]["step"] == 3 and merged["metrics"]["rewardMean"] == 0.2
    assert merged["trainer"]["lastCheckpoint"]["uri"] == "/ckpt/3"
    now[0] += 5
    assert not reporter.report(step=4)
    now[0] += 5
    assert reporter.report(step=5) and sent.patches[-1]["trainer"]["step"] == 5
    assert not reporter.flush(), "nothing queued"


def test_failures_are_logged_and_retried_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    sender = Recorder(fail=True)
    reporter = ProgressReporter("ns", "job", min_interval_seconds=0, sender=sender)
    assert not reporter.report(step=1)
    assert "could not report status" in caplog.text
    sender.fail = False
    assert reporter.report(policy_version=1)
    assert sender.patches[0]["trainer"]["step"] == 1 and sender.patches[0]["trainer"]["policyVersion"] == 1


def test_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RLJOB_STATUS_REPORT", raising=False)
    assert ProgressReporter.from_env() is None
    monkeypatch.setenv("RLJOB_STATUS_REPORT", "1")
    monkeypatch.setenv("RLJOB_NAMESPACE", "ns")
    monkeypatch.setenv("RLJOB_NAME", "job")
    reporter = ProgressReporter.from_env()
    assert reporter is not None and (reporter.namespace, reporter.name) == ("ns", "job")
