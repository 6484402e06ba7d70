"""The Grafana dashboard: one RLJob chosen by a variable, every query on an exported metric and valid PromQL."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from tests.helpers.metric_names import (
    operator_metric_names,
    runtime_metric_names,
)

from tests.cluster.fixtures import PrometheusFactory

DASHBOARD = Path(__file__).resolve().parents[2] / "charts/rljob-operator/files/rljob-dashboard.json"


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def exprs(dash: dict) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def test_one_job_is_selected_by_namespace_and_name() -> None:
    """A job is its namespace and name: the same name in two namespaces is two jobs, never blended."""
    variables = {v["name"]: v for v in load()["templating"]["list"]}
    assert variables["namespace"]["definition"] == "label_values(rljob_job_info, rljob_namespace)"
    assert variables["job"]["definition"] == 'label_values(rljob_job_info{rljob_namespace="$namespace"}, rljob)'
    for name in ("namespace", "job"):
        assert variables[name]["multi"] is False and variables[name]["includeAll"] is False, name
    assert variables["datasource"]["query"] == "prometheus"
    runtime = 'rljob_job_info{rljob_namespace="$namespace", rljob="$job"}'  # runtime series, joined on their target
    operator = '{namespace="$namespace", rljob="$job"}'  # the operator's autotune series carry both labels
    for title, expr in exprs(load()):
        assert runtime in expr or operator in expr, f"panel {title!r} is not restricted to the selected job: {expr}"
        assert "$rljob" not in expr, title


def test_every_query_reads_an_exported_metric() -> None:
    known = runtime_metric_names() | operator_metric_names()
    for title, expr in exprs(load()):
        used = set(re.findall(r"\brljob_[a-z_]+\b", expr)) - {"rljob_namespace"}  # a label of rljob_job_info
        assert used, f"panel {title!r} reads no rljob metric"
        assert used <= known, f"panel {title!r} reads unknown metrics {sorted(used - known)}"


def test_required_views_and_layout() -> None:
    dash = load()
    titles = " | ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("throughput vs ceiling", "truncation rate and band", "off-policy", "staleness", "lengths",
                  "reward", "entropy", "knobs in force", "autotuner", "goodput", "aborted-token waste",
                  "trainer and engine idle"):
        assert topic in titles, topic
    # The signals of docs/metrics.md each have their series (the truncation and partial rates side by side).
    queried: dict[str, str] = {}
    for title, expr in exprs(dash):
        queried[title] = f"{queried.get(title, '')} {expr}"
    for title, metrics in (("Truncation rate and band", ("rljob_truncation_rate", "rljob_partial_rate")),
                           ("Goodput vs rollout throughput", ("rljob_goodput_tokens_per_second",
                                                              "rljob_trained_tokens_total")),
                           ("Aborted-token waste", ("rljob_aborted_token_share", "rljob_aborted_tokens_total")),
                           ("Trainer and engine idle", ("rljob_trainer_idle_seconds", "rljob_engine_idle_seconds"))):
        for metric in metrics:
            assert metric in queried[title], f"{title}: {metric}"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panel {p['title']!r} overlaps another"
                cells.add((x, y))
    band = next(p for p in dash["panels"] if p["title"] == "Truncation rate and band")
    steps = [s["value"] for s in band["fieldConfig"]["defaults"]["thresholds"]["steps"]]
    assert steps == [None, 0.15, 0.25, 0.30]


@pytest.mark.prometheus
def test_every_query_is_valid_promql(prometheus_factory: PrometheusFactory) -> None:
    prom = prometheus_factory(["127.0.0.1:9"])  # nothing to scrape: only the parser is exercised
    for title, expr in exprs(load()):
        query = expr.replace("$__rate_interval", "1m").replace("$namespace", "ml").replace("$job", "demo")
        body = httpx.get(f"{prom.url}/api/v1/query", params={"query": query}, timeout=10).json()
        assert body["status"] == "success", f"panel {title!r}: {body.get('error')}"
