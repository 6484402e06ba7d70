"""The alert rules: promtool accepts them, every alert has a promtool unit test and a runbook
(docs/runbooks/<alert>.md, linked by an absolute URL), and every metric they read is one the runtime
or the operator exports."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from tests.helpers.metric_names import (
    operator_metric_names,
    runtime_metric_names,
)

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "charts/rljob-operator/files/rljob-alerts.rules.yaml"
TESTS = ROOT / "tests/alerts"
RUNBOOKS = ROOT / "docs/runbooks"
RUNBOOK_BASE = "https://github.com/rljob/rljob/blob/main/docs/runbooks"
REQUIRED = {
    "RLJobTruncationRateHigh", "RLJobEntropyCollapse", "RLJobStalenessOverBudget", "RLJobRolloutStalled",
    "RLJobRewardCollapse", "RLJobWeightSyncFailures", "RLJobRuntimeMetricsAbsent", "RLJobTokenWasteHigh",
    "RLJobEngineIdleHigh",
    # operator health
    "RLJobOperatorDown", "RLJobReconcileErrors", "RLJobFailed", "RLJobDegraded", "RLJobTrainerRestarts",
    "RLJobStuckStarting",
}


def alert_rules() -> list[dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def test_required_alerts_exist_with_severity_and_runbook() -> None:
    rules = alert_rules()
    assert REQUIRED <= {r["alert"] for r in rules}
    for rule in rules:
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        assert set(rule["annotations"]) >= {"summary", "description", "runbook_url"}, rule["alert"]
        # Absolute: Alertmanager and its receivers cannot resolve a path relative to nothing.
        assert rule["annotations"]["runbook_url"] == f"{RUNBOOK_BASE}/{rule['alert'].lower()}.md"


def test_every_alert_has_a_runbook() -> None:
    names = {r["alert"] for r in alert_rules()}
    files = {p.stem for p in RUNBOOKS.glob("*.md")}
    missing = {n for n in names if n.lower() not in files}
    assert not missing, f"docs/runbooks lacks {sorted(missing)}"
    for name in names:
        text = (RUNBOOKS / f"{name.lower()}.md").read_text()
        assert text.startswith(f"# {name}\n"), name
        for part in ("**What it means**", "**What to check**", "**What to change**"):
            assert part in text, f"{name}: runbook lacks {part}"


def test_alerts_read_only_exported_metrics() -> None:
    known = runtime_metric_names() | operator_metric_names()
    for rule in alert_rules():
        # rljob_namespace is a label of rljob_job_info (joined in group_left and label_replace), not a metric.
        used = set(re.findall(r"\brljob_[a-z_]+\b", rule["expr"])) - {"rljob_namespace"}
        assert used, rule["alert"]
        assert used <= known, f"{rule['alert']} reads unknown metrics {sorted(used - known)}"


def test_every_job_alert_names_namespace_and_job() -> None:
    """Job alerts carry namespace AND name (a job of the same name in another namespace is another job)."""
    for rule in alert_rules():
        expr, summary = rule["expr"], rule["annotations"]["summary"]
        if "rljob_job_info" in expr:
            assert "group_left(rljob, rljob_namespace) rljob_job_info" in expr or "on(namespace, name)" in expr, rule["alert"]
        if "{{ $labels.rljob }}" in summary:
            assert "{{ $labels.rljob_namespace }}/{{ $labels.rljob }}" in summary or "{{ $labels.namespace }}/" in summary, rule["alert"]
        if "{{ $labels.name }}" in summary:
            assert "{{ $labels.namespace }}/{{ $labels.name }}" in summary, rule["alert"]


def test_every_alert_has_a_firing_and_a_silent_promtool_case() -> None:
    fired: set[str] = set()
    silent: set[str] = set()
    for path in TESTS.glob("*.test.yaml"):
        doc = yaml.safe_load(path.read_text())
        assert doc["rule_files"] == ["../../charts/rljob-operator/files/rljob-alerts.rules.yaml"], path.name
        for case in doc["tests"]:
            for check in case.get("alert_rule_test", []):
                (fired if check["exp_alerts"] else silent).add(check["alertname"])
    names = {r["alert"] for r in alert_rules()}
    assert names <= fired, f"no firing test for {sorted(names - fired)}"
    assert names <= silent, f"no must-not-fire test for {sorted(names - silent)}"


@pytest.mark.prometheus
def test_promtool_checks_and_unit_tests_pass(cached_binary: Callable[[str], Path]) -> None:
    promtool = str(cached_binary("promtool"))
    check = subprocess.run(
        [promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60, check=False
    )
    assert check.returncode == 0, check.stdout + check.stderr
    files = sorted(p.name for p in TESTS.glob("*.test.yaml"))
    run = subprocess.run(
        [promtool, "test", "rules", *files], cwd=TESTS, capture_output=True, text=True, timeout=120, check=False
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("SUCCESS") == len(files)
