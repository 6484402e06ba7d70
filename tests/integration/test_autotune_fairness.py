"""Autotune fairness: one job's unreachable Prometheus does not delay another job's decisions.

Two jobs are tuned by the operator's autotune loop (operator/resync.py's ResyncLoop with the operator's
AUTOTUNE_CONCURRENCY, each tick exactly as the operator runs it: timer.run_tick):
- `stuck` reads a "Prometheus" that accepts the connection and never answers (a real listening socket
  that nobody serves), with the largest timeout the spec allows, 60 s;
- `tuned` reads a real Prometheus scraping real runtime metrics on loopback.
Before issue 25 the loop visited jobs one after another, so `tuned` waited for `stuck`'s timeout on
every pass. Now each job's tick runs on its own: `tuned` decides again and again while `stuck`'s first
tick is still waiting for its answer (the test checks that order, not a duration).
"""

from __future__ import annotations

import asyncio
import socket
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from rljob.api.status import RLJobStatus
from rljob.common.autotune.prometheus import PrometheusPool
from rljob.operator.autotune.timer import AUTOTUNE_CONCURRENCY, run_tick
from rljob.operator.resync import ResyncLoop
from rljob.runtime.metrics import RuntimeMetrics

from tests.cluster.fixtures import PrometheusFactory
from tests.helpers.waiting import wait_until
from tests.integration.test_autotune_prometheus import (  # noqa: F401 (runtime_metrics is a fixture)
    merge,
    runtime_metrics,
    scraping_first_step,
    tuned_spec,
)

pytestmark = pytest.mark.prometheus

DEAD_TIMEOUT_S = 60  # the spec's maximum timeoutSeconds


@pytest.fixture
def unanswering_url() -> Iterator[str]:
    """An HTTP URL whose server accepts connections (the kernel's backlog) and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


async def test_an_unreachable_prometheus_does_not_delay_another_jobs_decisions(
    prometheus_factory: PrometheusFactory, runtime_metrics: tuple[RuntimeMetrics, str], unanswering_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Both jobs name their own Prometheus: it must be on the operator's allow-list (credentials.py).
    monkeypatch.setenv("RLJOB_PROMETHEUS_ALLOWED_ADDRESSES", "http://127.0.0.1:*")
    prom = scraping_first_step(prometheus_factory, runtime_metrics)

    # `stuck` is listed first: a loop that visits jobs in turn would reach `tuned` only after its timeout.
    specs = {"stuck": tuned_spec(unanswering_url, DEAD_TIMEOUT_S), "tuned": tuned_spec(prom.url, 5)}
    wires: dict[str, dict[str, Any]] = {name: {} for name in specs}
    decisions: Counter[str] = Counter()
    started: set[str] = set()
    returned: set[str] = set()
    pool = PrometheusPool()

    async def job_pass(namespace: str, name: str) -> None:
        started.add(name)
        now = datetime.now(UTC).replace(microsecond=0)
        result = await run_tick(name, namespace, specs[name], RLJobStatus.model_validate(wires[name]), 1, now, pool)
        wires[name] = merge(wires[name], result.patch)
        decisions[name] += result.decision is not None
        returned.add(name)

    loop = ResyncLoop("autotune", 0.5, lambda: [("ns", name) for name in specs], job_pass, concurrency=AUTOTUNE_CONCURRENCY)
    runner = asyncio.create_task(loop.run_forever())
    try:
        await wait_until(lambda: "stuck" in started, "the stuck job's tick started", timeout=60)
        await wait_until(lambda: decisions["tuned"] >= 3, "three decisions of the live job", timeout=DEAD_TIMEOUT_S - 5)
        # All of them while the stuck job's first tick still waits for its Prometheus.
        assert "stuck" not in returned and ("ns", "stuck") in loop.in_flight(), (returned, loop.in_flight())
        assert wires["tuned"]["effectiveKnobs"]["truncation"]["source"] == "autotune"
        assert decisions["stuck"] == 0
    finally:
        runner.cancel()
        await loop.stop()
        await pool.aclose()
