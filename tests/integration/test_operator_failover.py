"""Two operator replicas with leader election: kill the leader mid-reconcile, the standby takes over.

Both replicas run as real processes against the local control plane; the Lease is a real
coordination.k8s.io object. Afterwards the job's children exist once each, the job is Running, and
deleting it leaves nothing behind (no finalizer holds it).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes import watch as k8s_watch

from tests.helpers.operator_process import OperatorProcess
from tests.helpers.trainer_pods import SimulatedTrainerKubelet
from tests.integration import test_operator as base
from tests.integration.test_operator import api, crd, kubelet, volumes  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

LEASE = "rljob-operator"


def replica(namespace: str, identity: str, log_path: Path) -> OperatorProcess:
    return base.namespaced_operator(
        namespace, log_path,
        # A 10 s lease: the leader steps down after a 6.7 s renew deadline with 1.7 s Lease calls, which a loaded
        # API server answers in time (a 4 s lease meant 0.7 s calls, and a standby that steps down leaves no leader).
        "--leader-elect", "--leader-election-namespace", namespace, "--lease-seconds", "10", "--renew-seconds", "1",
        env={**os.environ, "POD_ID": identity},
    )


@pytest.fixture
def replicas(
    namespace: str, crd: None, tmp_path: Path, kubelet: SimulatedTrainerKubelet  # noqa: F811
) -> Iterator[dict[str, OperatorProcess]]:
    """Two replicas; the simulated kubelet runs the trainer pods (kwok would complete the Job's at once)."""
    ops = {name: replica(namespace, name, tmp_path / f"{name}.log") for name in ("op-a", "op-b")}
    for op in ops.values():
        op.start()  # a standby answers its liveness endpoint too
    yield ops
    for name, op in ops.items():
        op.stop()
        print(f"--- {name} log ---\n{op.log_tail(60)}")


def holder(kube_cluster: Any, namespace: str) -> str | None:
    coord = k8s.CoordinationV1Api(kube_cluster.api)
    try:
        return coord.read_namespaced_lease(LEASE, namespace).spec.holder_identity or None
    except k8s.exceptions.ApiException:
        return None


def test_leader_killed_mid_reconcile_standby_takes_over_without_duplicates(
    kube_cluster: Any,
    namespace: str,
    api: k8s.CustomObjectsApi,  # noqa: F811
    replicas: dict[str, OperatorProcess],
    volumes: Any,  # noqa: F811
) -> None:
    leader = base.wait_for(lambda: holder(kube_cluster, namespace), "a replica holding the Lease", timeout=120)
    standby = next(n for n in replicas if n != leader)
    volumes("failover")
    # Kill the moment the first child appears (a watch, not a poll): the leader is in the middle of
    # applying the children, most of which do not exist yet.
    core = kube_cluster.core()
    stream = k8s_watch.Watch()
    since = core.list_namespaced_config_map(namespace).metadata.resource_version
    api.create_namespaced_custom_object(base.GROUP, base.VERSION, namespace, base.PLURAL, base.rljob("failover"))
    for _ in stream.stream(
        core.list_namespaced_config_map, namespace, label_selector="rljob.io/job-name=failover",
        resource_version=since, timeout_seconds=60,
    ):
        replicas[leader].kill()
        stream.stop()
    # How many children exist by now depends on the machine's speed (the second wave of applies may
    # have finished between the event and the kill), so it is reported, not asserted.
    print(f"children when the leader died: {base.children(kube_cluster, namespace, 'failover')}")

    base.wait_for(lambda: holder(kube_cluster, namespace) == standby or None, f"{standby} taking the Lease", timeout=120)
    # In the standby's own log, nothing was handled before it took the Lease (an ordering, not a timing).
    replicas[standby].wait_log(r"now holds Lease", since=0, timeout=120)
    before_lease = replicas[standby].log_text().split("now holds Lease")[0]
    assert "Handler 'apply" not in before_lease, "the standby reconciled while not leading"
    job = base.wait_phase(api, namespace, "failover", "Running", timeout=120)
    assert job["status"]["rollout"]["summary"] == "3/3"
    assert base.children(kube_cluster, namespace, "failover") == base.expected_children("failover")
    selector = "rljob.io/job-name=failover"
    for workload in [*kube_cluster.apps().list_namespaced_stateful_set(namespace, label_selector=selector).items,
                     *k8s.BatchV1Api(kube_cluster.api).list_namespaced_job(namespace, label_selector=selector).items]:
        assert len(workload.metadata.owner_references) == 1

    # Deleting the job is not held up by a finalizer of the dead leader.
    api.delete_namespaced_custom_object(base.GROUP, base.VERSION, namespace, base.PLURAL, "failover")

    def gone() -> bool:
        try:
            base.get(api, namespace, "failover")
        except k8s.exceptions.ApiException as err:
            return err.status == 404
        return False

    base.wait_for(gone, "RLJob deleted (no stuck finalizer)", timeout=120)
