"""pytest fixtures for the local control plane and Prometheus (loaded via `pytest_plugins`).

- `kube_cluster` (session): a real etcd + kube-apiserver + controller-manager + scheduler + kwok,
  with KUBECONFIG set for the whole session.
- `namespace` (function): a fresh namespace per test, deleted afterwards.
- `prometheus_factory` (function): start Debian's Prometheus on loopback scraping given targets.
- `cached_binary` (function): path of a cached tool such as helm or promtool, built if missing.
- `real_cluster` (session): a second control plane with one real node (kubelet, containerd,
  kube-proxy, CoreDNS) where pods really run; KUBECONFIG is left alone (use its kubeconfig).
- `real_namespace` (function): a fresh namespace in `real_cluster`.

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
from tests.cluster.realnode import REAL_NODE_BINARIES, RealCluster, can_run_real_node, start_real_cluster, wait_clean

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


@pytest.fixture(scope="session")
def real_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    """A control plane with the machine's one real node, for the whole session.

    Another test run on this machine that holds the real node makes this wait, not fail. After the
    session the node's teardown is checked: no cgroup, process or per-run state may be left.
    """
    if os.environ.get("RLJOB_SKIP_REAL_NODE") == "1":
        pytest.skip("RLJOB_SKIP_REAL_NODE=1: real-node tests disabled")
    reason = can_run_real_node()
    if reason:
        pytest.fail(f"{reason} (set RLJOB_SKIP_REAL_NODE=1 to skip)", pytrace=False)
    _require_binaries(("localkube", "kwokstages", "kwok", "helm", *REAL_NODE_BINARIES))
    state_dir = tmp_path_factory.mktemp("localkube-real")
    try:
        cluster = start_real_cluster(state_dir)
    except (ClusterStartError, RuntimeError) as exc:
        failure = f"real node did not start: {exc}"
    else:
        failure = ""
    if failure:
        pytest.fail(failure, pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()
    left = wait_clean()
    assert not left, f"the real node's teardown left {left}"


@pytest.fixture
def real_namespace(real_cluster: RealCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace in the real-node cluster, deleted afterwards (its pods with it)."""
    prefix = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-") or "t"
    name = real_cluster.cluster.create_namespace(prefix)
    try:
        yield name
    finally:
        real_cluster.cluster.delete_namespace(name)
