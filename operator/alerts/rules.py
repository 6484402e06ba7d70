"""The chart's alert rules, as the alert actions evaluate them for one job.

`rljob-alerts.rules.yaml` next to this module is a byte copy of the chart's
`charts/rljob-operator/files/rljob-alerts.rules.yaml` (charts/tools/chart_sync.py keeps it so; the
operator image has no chart). The operator checks the very expression an alert fires on, with the
`rljob_job_info` join narrowed to the job's own series: every runtime rule ends with
`* on(job, instance) group_left(...) rljob_job_info`, so selecting that series by the job's name and
namespace keeps exactly the job's result, with the rule's own windows and thresholds.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources

import yaml

from rljob.api.spec import ACTIONABLE_ALERTS
from rljob.common.autotune.queries import job_selector

RULES_FILE = "rljob-alerts.rules.yaml"
# `rljob_job_info` not already followed by a selector (the rules use it bare).
_JOB_INFO = re.compile(r"\brljob_job_info\b(?!\s*\{)")
_DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")


@dataclass(frozen=True)
class AlertRule:
    """One alerting rule of the chart: its expression and how long it must hold before it fires."""

    alert: str
    expr: str
    for_seconds: int

    def for_job(self, name: str, namespace: str, match_labels: Mapping[str, str] = {}) -> str:
        """The rule's expression restricted to one job's series (a result holds the condition)."""
        selector = job_selector(name, namespace, match_labels)
        return _JOB_INFO.sub(lambda _m: f"rljob_job_info{selector}", self.expr.strip())


def duration_seconds(text: str) -> int:
    """Seconds of a Prometheus duration as the rules write it (`15m`, `1h`, `30s`, `1h30m`)."""
    match = _DURATION.match(text.strip())
    if not text.strip() or match is None:
        raise ValueError(f"unsupported duration {text!r} in {RULES_FILE}")
    hours, minutes, seconds = (int(g) if g else 0 for g in match.groups())
    return hours * 3600 + minutes * 60 + seconds


def parse_rules(text: str) -> dict[str, AlertRule]:
    """Every alerting rule of a Prometheus rules file, by alert name."""
    rules: dict[str, AlertRule] = {}
    for group in (yaml.safe_load(text) or {}).get("groups", []):
        for rule in group.get("rules", []):
            if "alert" in rule:
                rules[rule["alert"]] = AlertRule(rule["alert"], rule["expr"], duration_seconds(rule.get("for", "0s")))
    return rules


@cache
def actionable_rules() -> dict[str, AlertRule]:
    """The rules a job's spec.alertActions may name, read from the copy shipped with the operator."""
    rules = parse_rules(resources.files(__package__).joinpath(RULES_FILE).read_text())
    missing = [alert for alert in ACTIONABLE_ALERTS if alert not in rules]
    if missing:
        raise RuntimeError(f"{RULES_FILE} has no rule for {', '.join(missing)} (spec.alertActions names them)")
    return {alert: rules[alert] for alert in ACTIONABLE_ALERTS}
