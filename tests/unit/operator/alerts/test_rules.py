"""The chart's alert rules as the alert actions evaluate them: the same expression, the job's series only."""

from __future__ import annotations

import copy
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from rljob.api.spec import ACTIONABLE_ALERTS
from rljob.operator.alerts.rules import actionable_rules, duration_seconds, parse_rules

ROOT = Path(__file__).resolve().parents[4]
CHART_RULES = ROOT / "charts/rljob-operator/files/rljob-alerts.rules.yaml"
ALERT_TESTS = ROOT / "tests/alerts"


def test_the_operator_reads_the_chart_rules_with_their_for() -> None:
    chart = parse_rules(CHART_RULES.read_text())
    rules = actionable_rules()
    assert set(rules) == set(ACTIONABLE_ALERTS)
    for alert, rule in rules.items():
        assert rule == chart[alert]
    assert rules["RLJobEntropyCollapse"].for_seconds == 600 and rules["RLJobEngineIdleHigh"].for_seconds == 1800


@pytest.mark.parametrize(("text", "seconds"), [("15m", 900), ("1h", 3600), ("30s", 30), ("1h30m", 5400), ("0s", 0)])
def test_durations(text: str, seconds: int) -> None:
    assert duration_seconds(text) == seconds


@pytest.mark.parametrize("text", ["", "15", "1d", "m"])
def test_unsupported_durations_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="unsupported duration"):
        duration_seconds(text)


def test_every_join_is_narrowed_to_the_job_and_matchLabels_cannot_widen_it() -> None:
    for rule in actionable_rules().values():
        expr = rule.for_job("demo", "ml", {"rljob": "other", "cluster": "eu"})
        assert expr.count("rljob_job_info{") == rule.expr.count("rljob_job_info") > 0, rule.alert
        assert expr.count('rljob_job_info{cluster="eu",rljob="demo",rljob_namespace="ml"}') == expr.count("rljob_job_info")


def _scoped_cases(alert: str) -> list[tuple[Path, dict[str, Any], dict[str, str]]]:
    """The chart's promtool tests of `alert` that fire for some job: (file, its document, one such job)."""
    out = []
    for path in sorted(ALERT_TESTS.glob("*.test.yaml")):
        doc = yaml.safe_load(path.read_text())
        for case in doc["tests"]:
            for check in case.get("alert_rule_test", []):
                if check["alertname"] == alert and check["exp_alerts"]:
                    labels = check["exp_alerts"][0]["exp_labels"]
                    out.append((path, doc, {"rljob": labels["rljob"], "rljob_namespace": labels["rljob_namespace"]}))
                    break
            else:
                continue
            break
    return out


@pytest.mark.prometheus
@pytest.mark.parametrize("alert", ACTIONABLE_ALERTS)
def test_the_scoped_rule_fires_exactly_for_the_job_on_the_charts_own_test_series(
    alert: str, cached_binary: Callable[[str], Path], tmp_path: Path
) -> None:
    """The chart's promtool cases of the alert, against a rules file holding the operator's expression for
    one of the jobs they fire for: it fires for that job, at the same evaluation times, and for no other."""
    cases = _scoped_cases(alert)
    assert cases, f"tests/alerts has no firing case of {alert}"
    source, doc, job = cases[0]
    rule = actionable_rules()[alert]
    chart_rule = next(r for g in yaml.safe_load(CHART_RULES.read_text())["groups"] for r in g["rules"]
                      if r.get("alert") == alert)
    scoped = {**chart_rule, "expr": rule.for_job(job["rljob"], job["rljob_namespace"])}
    (tmp_path / "scoped.rules.yaml").write_text(yaml.safe_dump({"groups": [{"name": "scoped", "rules": [scoped]}]}))
    test = copy.deepcopy(doc)
    test["rule_files"] = ["scoped.rules.yaml"]
    for case in test["tests"]:
        case["alert_rule_test"] = [
            {**check, "exp_alerts": [a for a in check["exp_alerts"]
                                     if all(a["exp_labels"].get(k) == v for k, v in job.items())]}
            for check in case.get("alert_rule_test", []) if check["alertname"] == alert
        ]
        case.pop("promql_expr_test", None)
    (tmp_path / "scoped.test.yaml").write_text(yaml.safe_dump(test))
    run = subprocess.run([str(cached_binary("promtool")), "test", "rules", "scoped.test.yaml"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, f"{source.name} scoped to {job}:\n{run.stdout}{run.stderr}"
