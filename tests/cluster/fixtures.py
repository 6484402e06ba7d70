"""pytest fixtures for the local control plane and Prometheus (loaded via `pytest_plugins`).

- `kube_cluster` (session): a real etcd + kube-apiserver + controller-manager + scheduler + kwok,
  with KUBECONFIG set for the whole session.
- `namespace` (function): a fresh namespace per test, deleted afterwards.
- `prometheus_factory` (function): start Debian's Prometheus on loopback scraping given targets.
- `cached_binary` (function): path of a cached tool such as helm or promtool, built if missing.

Cluster tests fail, with the reason, when the binaries cannot be built; set RLJOB_SKIP_CLUSTER=1
to skip them instead (for machines without Go).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from tests.cluster.binaries import BinariesUnavailable, binary_path, ensure_built
from tests.cluster.kube import ClusterStartError, KubeCluster, start_cluster
from tests.cluster.prometheus import PrometheusServer, render_config

PrometheusFactory = Callable[..., PrometheusServer]


def _require_binaries(names: Sequence[str]) -> None:
    if os.environ.get("RLJOB_SKIP_CLUSTER") == "1":
        pytest.skip(
            "RLJOB_SKIP_CLUSTER=1: local control plane and its binaries disabled"
        )
    try:
        ensure_built(names)
    except BinariesUnavailable as exc:
        failure = str(exc)
    else:
        return
    pytest.fail(failure, pytrace=False)


@pytest.fixture(scope="session")
def kube_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeCluster]:
    """A running local control plane for the whole test session; KUBECONFIG points at it."""
    _require_binaries(("localkube", "kwokstages", "kwok", "helm"))
    state_dir = tmp_path_factory.mktemp("localkube")
    try:
        cluster = start_cluster(state_dir)
    except ClusterStartError as exc:
        failure = f"local control plane did not start: {exc}"
    else:
        failure = ""
    if failure:
        pytest.fail(failure, pytrace=False)
    previous = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(cluster.kubeconfig)
    try:
        yield cluster
    finally:
        if previous is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = previous
        cluster.stop()


@pytest.fixture
def namespace(
    kube_cluster: KubeCluster, request: pytest.FixtureRequest
) -> Iterator[str]:
    """A fresh namespace named after the test, with its `default` ServiceAccount present."""
    prefix = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-") or "t"
    name = kube_cluster.create_namespace(prefix)
    try:
        yield name
    finally:
        kube_cluster.delete_namespace(name)


@pytest.fixture
def cached_binary() -> Callable[[str], Path]:
    """Return a function mapping a binary name (helm, promtool, ...) to its cached, built path."""

    def path(name: str) -> Path:
        _require_binaries((name,))
        return binary_path(name)

    return path


@pytest.fixture
def prometheus_factory(tmp_path: Path) -> Iterator[PrometheusFactory]:
    """Start Prometheus servers on 127.0.0.1; all are stopped after the test.

    Call it as `prometheus_factory(["127.0.0.1:8000"], scrape_interval="1s")`; it returns a
    started `PrometheusServer` with `.url`, `.query()`, `.stop()`, `.start()` and `.restart()`.
    """
    _require_binaries(("prometheus",))
    binary = binary_path("prometheus")
    servers: list[PrometheusServer] = []

    def factory(
        targets: Sequence[str],
        scrape_interval: str = "1s",
        job: str = "test",
        metrics_path: str = "/metrics",
        rule_files: Sequence[Path] = (),
    ) -> PrometheusServer:
        server = PrometheusServer(
            binary=binary,
            workdir=tmp_path / f"prometheus-{len(servers)}",
            config=render_config(
                targets, scrape_interval, job, metrics_path, rule_files
            ),
            target_count=len(targets),
        )
        servers.append(server)
        server.start()
        return server

    yield factory
    for server in servers:
        server.stop()
