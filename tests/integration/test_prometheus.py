"""Debian's promtool and Prometheus from the binary cache, on loopback."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from rljob.operator.builders.meta import JobRef
from tests.cluster import prometheus_pod
from tests.cluster.fixtures import PrometheusFactory
from tests.cluster.kube import wait_until
from tests.cluster.prometheus import check_loopback_target, free_port, render_config

pytestmark = pytest.mark.prometheus


@pytest.fixture
def exporter() -> Iterator[tuple[str, Gauge]]:
    """A real /metrics endpoint on 127.0.0.1 exposing one gauge."""
    registry = CollectorRegistry()
    gauge = Gauge("rljob_test_value", "value set by the test", registry=registry)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        yield f"127.0.0.1:{port}", gauge
    finally:
        server.shutdown()
        thread.join(timeout=5)


def test_promtool_runs_and_accepts_rendered_config(
    tmp_path: Path, cached_binary: Callable[[str], Path]
) -> None:
    promtool = str(cached_binary("promtool"))
    version = subprocess.run(
        [promtool, "--version"], check=True, capture_output=True, text=True
    )
    assert "promtool, version 2." in version.stdout + version.stderr

    config = tmp_path / "prometheus.yml"
    config.write_text(render_config(["127.0.0.1:9"], "1s", "test", "/metrics", ()))
    subprocess.run(
        [promtool, "check", "config", str(config)],
        check=True,
        capture_output=True,
        text=True,
    )


def test_non_loopback_targets_are_rejected() -> None:
    assert check_loopback_target("127.0.0.5:80") == "127.0.0.5:80"
    assert check_loopback_target("[::1]:80") == "[::1]:80"
    with pytest.raises(ValueError, match="not on loopback"):
        check_loopback_target("10.0.0.1:9090")


def test_prometheus_scrapes_loopback_target_and_survives_restart(
    prometheus_factory: PrometheusFactory, exporter: tuple[str, Gauge]
) -> None:
    target, gauge = exporter
    gauge.set(42)
    prom = prometheus_factory([target], scrape_interval="1s")
    assert prom.url.startswith("http://127.0.0.1:")

    up = prom.wait_for_targets_up(timeout=30)
    assert up[0]["metric"]["instance"] == target
    wait_until(
        lambda: prom.query("rljob_test_value") or None,
        15,
        "first sample of rljob_test_value",
    )
    assert prom.query("rljob_test_value")[0]["value"][1] == "42"

    # Autotuner tests stop Prometheus mid-test: the URL stops answering, then comes back with data.
    prom.stop()
    assert not prom.running
    gauge.set(7)
    prom.start()
    wait_until(
        lambda: prom.query("rljob_test_value")[0]["value"][1] == "7",
        15,
        "a scrape after restart",
    )
    assert prom.query("max_over_time(rljob_test_value[5m])")[0]["value"][1] == "42"


def test_promtool_accepts_the_real_node_pod_scrape_config(
    tmp_path: Path, cached_binary: Callable[[str], Path]
) -> None:
    # The in-cluster config the real-node Prometheus pod runs (tests/cluster/prometheus_pod.py): service
    # discovery and relabelings must be valid for this Prometheus version before a slow real-node run.
    config = tmp_path / "prometheus.yml"
    services = prometheus_pod.rljob_services(JobRef("job-a", "ns-a", ""), {"cpu": "cpu", "h100": "nvidia"})
    config.write_text(json.dumps(prometheus_pod.scrape_config("ns-a", services)))
    subprocess.run(
        [str(cached_binary("promtool")), "check", "config", str(config)],
        check=True,
        capture_output=True,
        text=True,
    )
