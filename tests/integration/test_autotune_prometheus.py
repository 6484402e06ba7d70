"""The autotuner's Prometheus side against a real Prometheus scraping real runtime metrics on loopback.

No cluster: the RuntimeMetrics endpoint stands for a runtime process, and the tick runs exactly as
the kopf timer runs it (timer.run_tick), with the status patches merged the way the API server does.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from rljob.api.spec import RLJobSpec
from rljob.api.status import RLJobStatus
from rljob.common.autotune.prometheus import (
    NoData,
    PrometheusClient,
    PrometheusPool,
    PrometheusQueryError,
    PrometheusUnavailable,
)
from rljob.common.autotune.queries import JobQueries, read_observation
from rljob.operator.autotune.timer import run_tick
from rljob.runtime.metrics import RuntimeMetrics
from rljob.runtime.step_record import BatchPart, RoundPart, StepRecord, TrainPart

from tests.cluster.fixtures import PrometheusFactory
from tests.cluster.kube import wait_until
from tests.cluster.prometheus import free_port

pytestmark = pytest.mark.prometheus


def step(n: int, rate: float, cap: float) -> StepRecord:
    return StepRecord(
        step=n, policy_version=n, strategy="april", time=time.time(),
        round=RoundPart(truncation_rate=rate, partial_rate=0.25, rollout_seconds=4.0, trained_tokens=1000,
                        tokens_generated=2000, aborted_tokens=100),
        batch=BatchPart(length_mean=40.0, length_std=20.0, off_policy_token_ratio=0.3), train=TrainPart(entropy=1.2),
        knobs={"over_sampling": 2.0, "max_staleness": 2.0, "truncation_k": 0.0, "segment_cap_tokens": cap,
               "segment_cap_floor_tokens": 4.0},
    )


def tuned_spec(address: str, timeout_s: float) -> RLJobSpec:
    """A job tuned in Apply mode every second from the Prometheus at `address` (a token cap of 8 to start)."""
    return RLJobSpec.model_validate(
        {
            "model": {"builtin": "tiny-arith"},
            "data": {"synthetic": {}},
            "rollout": {"maxResponseLength": 64, "partial": {"truncation": {"mode": "tokens", "maxTokens": 8}}},
            "autotune": {"mode": "Apply", "prometheus": {"address": address, "timeoutSeconds": timeout_s},
                         "intervalSeconds": 1, "windowSeconds": 10, "cooldownSeconds": 0, "settleRounds": 1,
                         "truncationTokens": {"min": 4, "max": 64, "maxStep": 8}},
        }
    )


def scraping_first_step(prometheus_factory: PrometheusFactory, runtime_metrics: tuple[RuntimeMetrics, str]) -> Any:
    """A real Prometheus scraping the runtime metrics, once it holds their first step (truncation rate 0.7)."""
    metrics, target = runtime_metrics
    metrics.record(step(1, 0.7, 8))
    prom = prometheus_factory([target], scrape_interval="1s")
    prom.wait_for_targets_up()
    wait_until(lambda: prom.query("rljob_truncation_rate") or None, 120, "first truncation sample")
    return prom


@pytest.fixture
def runtime_metrics() -> Iterator[tuple[RuntimeMetrics, str]]:
    metrics = RuntimeMetrics("tuned", namespace="ns")
    port = metrics.serve("127.0.0.1", free_port())
    yield metrics, f"127.0.0.1:{port}"


def merge(base: Any, patch: Any) -> Any:
    if not isinstance(patch, dict) or not isinstance(base, dict):
        return patch
    out = dict(base)
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge(out.get(k), v)
    return out


async def test_the_truncation_noise_is_the_standard_error_of_the_window_mean(
    prometheus_factory: PrometheusFactory, runtime_metrics: tuple[RuntimeMetrics, str]
) -> None:
    """Two rounds, at 0.2 and 0.6, each scraped at least once: the samples' standard deviation is
    0.4·√(p(1-p)) for the share p of 0.2 samples, over √2 rounds, so the noise lies in (0, 0.2/√2]."""
    metrics, target = runtime_metrics
    metrics.record(step(1, 0.2, 8))
    prom = prometheus_factory([target], scrape_interval="1s")
    prom.wait_for_targets_up()
    wait_until(lambda: prom.query("rljob_truncation_rate") or None, 120, "the first round's sample")
    metrics.record(step(2, 0.6, 8))
    wait_until(lambda: prom.query("rljob_truncation_rate == 0.6") or None, 120, "the second round's sample")

    async with PrometheusClient(prom.url, timeout_s=5) as client:
        obs = (await read_observation(client, JobQueries("tuned", "ns", {}, window_s=300), step=2)).observation
    assert 0.2 < obs.truncation_rate < 0.6
    assert obs.truncation_noise is not None and 0.0 < obs.truncation_noise <= 0.2 / 2**0.5 + 1e-9


async def test_client_reads_observation_and_types_failures(
    prometheus_factory: PrometheusFactory, runtime_metrics: tuple[RuntimeMetrics, str]
) -> None:
    metrics, target = runtime_metrics
    for n in (1, 2, 3):
        metrics.record(step(n, 0.6, 8))
    prom = prometheus_factory([target], scrape_interval="1s")
    prom.wait_for_targets_up()
    wait_until(lambda: prom.query("rljob_truncation_rate") or None, 120, "first truncation sample")

    async with PrometheusClient(prom.url, timeout_s=5) as client:
        reading = await read_observation(client, JobQueries("tuned", "ns", {}, window_s=30), step=7)
        obs = reading.observation
        assert obs.truncation_rate == pytest.approx(0.6)
        assert obs.length_spread == pytest.approx(0.5)
        # The signals of docs/metrics.md: 1000 trained tokens over 4 s, 100 of 2000 tokens thrown away.
        assert obs.goodput == pytest.approx(250.0) and obs.partial_rate == pytest.approx(0.25)
        assert obs.goodput_noise == pytest.approx(0.0)  # every step at 250 tokens/s: the query runs, no spread
        assert obs.truncation_noise == pytest.approx(0.0)  # every step at 0.6
        assert obs.aborted_token_share == pytest.approx(0.05)
        assert obs.cap_at_floor is False  # a cap of 8 tokens above its floor of 4: lowering k still cuts more
        # The step is the persisted one passed in, not the runtime's counter (3).
        assert obs.steps == 7 and obs.off_policy_ratio == pytest.approx(0.3) and obs.entropy == pytest.approx(1.2)
        assert reading.in_force["segment_cap_tokens"] == 8 and reading.in_force["over_sampling"] == 2
        assert 'rljob="tuned"' in reading.query and 'rljob_namespace="ns"' in reading.query

        with pytest.raises(NoData):
            await read_observation(client, JobQueries("other-job", "ns", {}, window_s=30), step=None)
        with pytest.raises(NoData):  # the same name in another namespace is another job
            await read_observation(client, JobQueries("tuned", "other-ns", {}, window_s=30), step=None)
        with pytest.raises(PrometheusQueryError):
            await client.query_value("rate(rljob_truncation_rate[")

    async with PrometheusClient(f"http://127.0.0.1:{free_port()}", timeout_s=1) as closed:
        with pytest.raises(PrometheusUnavailable):
            await closed.query_value("up")


async def test_tick_tunes_backs_off_while_prometheus_is_down_and_resumes(
    prometheus_factory: PrometheusFactory, runtime_metrics: tuple[RuntimeMetrics, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    metrics, _ = runtime_metrics
    # The job names this Prometheus itself: it must be on the operator's allow-list (credentials.py).
    monkeypatch.setenv("RLJOB_PROMETHEUS_ALLOWED_ADDRESSES", "http://127.0.0.1:*")
    prom = scraping_first_step(prometheus_factory, runtime_metrics)
    spec = tuned_spec(prom.url, timeout_s=2)
    wire: dict[str, Any] = {}
    now = datetime.now(UTC).replace(microsecond=0)
    pool = PrometheusPool()

    async def tick(at: datetime) -> Any:
        nonlocal wire
        result = await run_tick("tuned", "ns", spec, RLJobStatus.model_validate(wire), 1, at, pool)
        wire = merge(wire, result.patch)
        return result

    first = await tick(now)
    assert first.decision is not None and first.decision.changed
    assert wire["effectiveKnobs"]["truncation"]["value"] == 16.0
    assert wire["effectiveKnobs"]["truncation"]["source"] == "autotune"

    prom.stop()
    down = await tick(now + timedelta(seconds=5))
    assert down.failure == "PrometheusUnavailable" and [e.type for e in down.events] == ["Warning"]
    cond = next(c for c in wire["conditions"] if c["type"] == "AutotuneActive")
    assert cond["status"] == "False" and cond["reason"] == "PrometheusUnavailable"
    assert wire["effectiveKnobs"]["truncation"]["value"] == 16.0  # last knobs kept
    skipped = await tick(now + timedelta(seconds=5.5))  # inside the backoff: no read, no change
    assert skipped.failure is None and skipped.decision is None and wire["autotune"]["consecutiveFailures"] == 1

    prom.start()
    prom.wait_for_targets_up()
    metrics.record(step(2, 0.5, 16))  # the runtime now runs the new cap
    wait_until(lambda: prom.query('rljob_knob{knob="segment_cap_tokens"} == 16') or None, 120, "new cap scraped")
    back = await tick(now + timedelta(seconds=30))
    assert back.decision is not None and back.decision.changed
    assert "AutotuneRecovered" in [e.reason for e in back.events]
    assert wire["effectiveKnobs"]["truncation"]["value"] == 24.0
    cond = next(c for c in wire["conditions"] if c["type"] == "AutotuneActive")
    assert cond["status"] == "True" and wire["autotune"]["consecutiveFailures"] == 0
    await pool.aclose()


async def test_same_name_in_two_namespaces_is_read_apart(prometheus_factory: PrometheusFactory) -> None:
    """Two runtimes of jobs named alike in namespaces a and b: each reading sees only its own series."""
    targets = []
    for namespace, rate in (("team-a", 0.1), ("team-b", 0.9)):
        metrics = RuntimeMetrics("same", namespace=namespace)
        targets.append(f"127.0.0.1:{metrics.serve('127.0.0.1', free_port())}")
        metrics.record(step(1, rate, 8))
    prom = prometheus_factory(targets, scrape_interval="1s")
    prom.wait_for_targets_up()
    wait_until(lambda: len(prom.query("rljob_truncation_rate")) == 2 or None, 120, "both runtimes scraped")
    pool = PrometheusPool()
    try:
        client = pool.client(prom.url, timeout_s=5)
        a = await read_observation(client, JobQueries("same", "team-a", {}, window_s=30), step=None)
        b = await read_observation(client, JobQueries("same", "team-b", {}, window_s=30), step=None)
    finally:
        await pool.aclose()
    assert a.observation.truncation_rate == pytest.approx(0.1)
    assert b.observation.truncation_rate == pytest.approx(0.9)
