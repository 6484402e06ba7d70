"""PromQL for one RLJob's runtime metrics, and the read of one controller Observation.

Runtime series carry no job label of their own; `rljob_job_info{rljob="<name>",rljob_namespace="<ns>"}`
(value 1) names the job of a scrape target, so every query joins on (job, instance) with it. The
namespace is always part of the selector: two jobs of the same name in different namespaces are
two jobs. Several trainer replicas are averaged. The queries of one reading run concurrently.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rljob.common.autotune.controller import Observation, cap_at_floor
from rljob.common.autotune.prometheus import NoData, PrometheusClient
from rljob.api.metrics import METRIC_PREFIX
from rljob.api.spec import RESERVED_SELECTOR_LABELS

# Shortest averaging window: below two scrapes avg_over_time may see a single sample or none.
MIN_WINDOW_S = 5


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def job_selector(name: str, namespace: str, match_labels: Mapping[str, str] = {}) -> str:
    """Label matchers of the job's info series, e.g. {rljob="demo",rljob_namespace="ml"}.

    The job's own name and namespace always win: the spec refuses them in matchLabels, and a spec that
    got past that (an old stored object) still cannot point the autotuner at another job's series.
    """
    extra = {k: v for k, v in match_labels.items() if k not in RESERVED_SELECTOR_LABELS}
    labels = {**extra, "rljob": name, "rljob_namespace": namespace}
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items())) + "}"


@dataclass(frozen=True)
class JobQueries:
    """The queries the autotuner runs for one job; each is stored in status next to the knob it moved."""

    name: str
    namespace: str
    match_labels: Mapping[str, str]
    window_s: int

    def _joined(self, inner: str) -> str:
        info = f"{METRIC_PREFIX}job_info{job_selector(self.name, self.namespace, self.match_labels)}"
        return f"{inner} * on(job, instance) group_left() {info}"

    def averaged(self, metric: str, matchers: str = "") -> str:
        """Mean over the window and over replicas of a runtime gauge."""
        window = max(MIN_WINDOW_S, self.window_s)
        return f"avg({self._joined(f'avg_over_time({METRIC_PREFIX}{metric}{matchers}[{window}s])')})"

    def standard_error(self, metric: str, relative: bool = False) -> str:
        """Standard error of a per-step gauge's window mean: its standard deviation over the window divided
        by √(steps in the window), counting a step as a change of the value; `relative`: over the mean too."""
        window = max(MIN_WINDOW_S, self.window_s)
        series = f"{METRIC_PREFIX}{metric}[{window}s]"
        inner = f"stddev_over_time({series}) / sqrt(changes({series}) + 1)"
        if relative:
            inner = f"{inner} / avg_over_time({series})"
        return f"avg({self._joined(inner)})"

    def latest(self, metric: str, matchers: str = "", by: str = "") -> str:
        """Latest value of a runtime series (max over replicas, optionally per label)."""
        agg = f"max by ({by}) " if by else "max "
        return f"{agg}({self._joined(f'{METRIC_PREFIX}{metric}{matchers}')})"

    @property
    def truncation_rate(self) -> str:
        return self.averaged("truncation_rate")

    @property
    def knobs(self) -> str:
        return self.latest("knob", by="knob")


@dataclass(frozen=True)
class Reading:
    """One observation plus the knob values the runtime reports in force."""

    observation: Observation
    in_force: dict[str, float]
    query: str  # the query the decision is driven by (truncation rate)


async def _optional(client: PrometheusClient, expr: str) -> float | None:
    try:
        return await client.query_value(expr)
    except NoData:
        return None


async def read_observation(client: PrometheusClient, q: JobQueries, step: int | None) -> Reading:
    """Read the controller's inputs, all queries at once. The truncation rate is required (NoData
    propagates); the rest is optional.

    `step` is the job's persisted training step (status.trainer.step): settling counts rounds on it,
    so a trainer restart, whose runtime counters start again at zero, does not reset the count.
    Raises PrometheusUnavailable / PrometheusQueryError / NoData / AmbiguousResult as the client does.
    """
    optional = {
        "goodput": q.averaged("goodput_tokens_per_second"),
        "goodput_noise": q.standard_error("goodput_tokens_per_second", relative=True),
        "truncation_noise": q.standard_error("truncation_rate"),
        "partial_rate": q.averaged("partial_rate"),
        "aborted_token_share": q.averaged("aborted_token_share"),
        "length_mean": q.averaged("response_length_tokens", '{stat="mean"}'),
        "length_std": q.averaged("response_length_tokens", '{stat="std"}'),
        "off_policy_ratio": q.averaged("off_policy_token_ratio"),
        "entropy": q.averaged("policy_entropy"),
    }
    rate, knobs, *values = await asyncio.gather(
        client.query_value(q.truncation_rate),
        client.query(q.knobs),
        *(_optional(client, expr) for expr in optional.values()),
    )
    # (gather over mixed awaitables types every result as the union of their types)
    in_force = {s.labels.get("knob", ""): s.value for s in knobs}  # type: ignore[union-attr]
    extra: dict[str, Any] = dict(zip(optional, values, strict=True))
    obs = Observation(truncation_rate=rate, steps=step, cap_at_floor=cap_at_floor(in_force), **extra)  # type: ignore[arg-type]
    return Reading(observation=obs, in_force=in_force, query=q.truncation_rate)
