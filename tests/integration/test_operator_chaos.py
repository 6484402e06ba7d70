"""Chaos: the operator is SIGKILLed at random points while 20 RLJobs go through their lifecycles.

Each job follows a seeded random script (create, scale, suspend, resume, trainer failure, delete) while a
chaos thread kills the operator at random moments and restarts it. Afterwards, with the operator
running undisturbed:
- every surviving RLJob is in the phase its history implies (Running, Suspended or Failed);
- its children are exactly the expected set, each with one controller owner reference to it;
- every deleted RLJob is gone (no finalizer holds it) and no managed object is left without its job.

The trainer gang is an Indexed Job; kwok would complete its pods at once, so they stay unscheduled
and `SimulatedTrainerKubelet` (tests/helpers/trainer_pods.py) plays their kubelet: a trainer failure is
the leader pod reported Failed with exit code 1.

One exception, stated: a trainer failure is injected while the operator runs and is held alive until
the failure is counted. A failed trainer pod whose Job the operator recreates on a later pass is only
counted if an operator saw it; a failure injected while none runs is not guaranteed to be counted.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest
from kubernetes import client as k8s

from tests.helpers.operator_process import OperatorProcess
from tests.helpers.trainer_pods import SimulatedTrainerKubelet
from tests.integration import test_operator as base
from tests.integration.test_operator import api, crd, kubelet, operator, volumes  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

JOBS = 20
SEED = 15
MANAGED = "app.kubernetes.io/managed-by=rljob-operator"
# One GPU per pool replica: the fake cluster has 2 NVIDIA and 2 AMD nodes of 8 GPUs, and up to 20 jobs
# may be alive at once (the first run, with test_operator's 2x2-GPU pool, left pods Pending for GPUs).
ROLLOUT = {
    "rolloutBatchSize": 4,
    "pools": [
        {"name": "nv", "vendor": "nvidia", "replicas": 1, "gpusPerReplica": 1},
        {"name": "mi", "vendor": "amd", "replicas": 1, "gpusPerReplica": 1},
    ],
}


@dataclass
class History:
    """What happened to one job, and so the phase it must end in."""

    name: str
    ops: list[str]
    trainer_failures: int = 0
    suspended: bool = False
    deleted: bool = False

    def expected_phase(self) -> str | None:
        if self.deleted:
            return None
        if self.trainer_failures > 1:  # backoffLimit 1: the second failure ends the job
            return "Failed"
        return "Suspended" if self.suspended else "Running"


def script(rng: random.Random, name: str) -> History:
    ops = ["create"]
    for op in rng.sample(["scale", "suspend-resume", "fail"], k=rng.randint(1, 3)):
        ops += ["suspend", "resume"] if op == "suspend-resume" else [op]
    if rng.random() < 0.2:
        ops.append("fail")  # a second failure: past the backoff limit
    ending = rng.random()
    if ending < 0.25:
        ops.append("delete")
    elif ending < 0.45 and "fail" not in ops[-1:]:
        ops.append("suspend")
    return History(name, ops)


@dataclass
class Chaos:
    """Kills the operator at random moments (SIGKILL) and restarts it, until stopped."""

    operator: OperatorProcess
    rng: random.Random
    kills: int = 0
    hold: threading.Lock = field(default_factory=threading.Lock)  # held: the operator must stay up
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        # A kill every 3-15 s of operator uptime: a restarted operator first lists and resumes every job,
        # which takes seconds on a loaded machine; shorter lives would only ever test the start-up.
        while not self.stop.wait(self.rng.uniform(3.0, 15.0)):
            with self.hold:
                self.operator.kill()
                self.kills += 1
                time.sleep(self.rng.uniform(0.0, 2.0))
                self.operator.start()


def test_random_kills_during_twenty_lifecycles_leave_a_consistent_state(
    kube_cluster: Any,
    namespace: str,
    api: k8s.CustomObjectsApi,  # noqa: F811
    operator: OperatorProcess,  # noqa: F811
    volumes: Any,  # noqa: F811
    kubelet: SimulatedTrainerKubelet,  # noqa: F811
) -> None:
    rng = random.Random(SEED)
    histories = [script(rng, f"c{i:02d}") for i in range(JOBS)]
    chaos = Chaos(operator, random.Random(SEED + 1))
    patch = lambda name, spec: api.patch_namespaced_custom_object(  # noqa: E731
        base.GROUP, base.VERSION, namespace, base.PLURAL, name, {"spec": spec}
    )

    def live(h: History) -> None:
        for op in h.ops:
            if op == "create":
                volumes(h.name)
                api.create_namespaced_custom_object(base.GROUP, base.VERSION, namespace, base.PLURAL, base.rljob(h.name, rollout=ROLLOUT))
                base.wait_phase(api, namespace, h.name, "Running", timeout=300)
            elif op == "scale":
                patch(h.name, {"rollout": {"replicas": 1}})  # 2 -> 1 over the pools: frees capacity too
            elif op == "suspend":
                patch(h.name, {"suspend": True})
                h.suspended = True
                base.wait_phase(api, namespace, h.name, "Suspended", timeout=300)
            elif op == "resume":
                patch(h.name, {"suspend": False})
                h.suspended = False
                base.wait_phase(api, namespace, h.name, "Running", timeout=300)
            elif op == "fail":
                before = (base.get(api, namespace, h.name).get("status") or {}).get("restarts", {}).get("trainer", 0)
                with chaos.hold:  # see the module docstring
                    pods = base.wait_for(
                        lambda: [p for p in kubelet.pods(h.name) if p.status.phase == "Running"] or None,
                        f"{h.name} trainer pod running", timeout=120,
                    )
                    kubelet.fail(pods[0])
                    h.trainer_failures += 1
                    if h.trainer_failures > 1:
                        base.wait_phase(api, namespace, h.name, "Failed", timeout=120)
                    else:
                        base.wait_for(
                            lambda: (base.get(api, namespace, h.name)["status"].get("restarts") or {}).get("trainer", 0)
                            > before,
                            f"{h.name} trainer restart counted", timeout=120,
                        )
                if h.trainer_failures == 1:
                    base.wait_phase(api, namespace, h.name, "Running", timeout=300)
            elif op == "delete":
                api.delete_namespaced_custom_object(base.GROUP, base.VERSION, namespace, base.PLURAL, h.name)
                h.deleted = True
            if h.trainer_failures > 1:
                break  # a Failed job stays Failed; nothing more happens to it

    killer = threading.Thread(target=chaos.run, daemon=True)
    killer.start()
    try:
        with ThreadPoolExecutor(max_workers=5) as pool:
            for result in [pool.submit(live, h) for h in histories]:
                result.result()
    finally:
        chaos.stop.set()
        killer.join(timeout=30)
    assert chaos.kills >= 3, f"only {chaos.kills} kills: the chaos did not happen"

    for h in histories:
        expected = h.expected_phase()
        if expected is None:
            def gone(name: str = h.name) -> bool:
                try:
                    base.get(api, namespace, name)
                except k8s.exceptions.ApiException as err:
                    return err.status == 404
                return False

            base.wait_for(gone, f"{h.name} deleted (no stuck finalizer)", timeout=60)
            continue
        job = base.wait_phase(api, namespace, h.name, expected, timeout=120)
        assert base.children(kube_cluster, namespace, h.name) == base.expected_children(h.name), h
        uid = job["metadata"]["uid"]
        apps, batch = kube_cluster.apps(), k8s.BatchV1Api(kube_cluster.api)
        selector = f"rljob.io/job-name={h.name}"
        for workload in [*apps.list_namespaced_stateful_set(namespace, label_selector=selector).items,
                         *batch.list_namespaced_job(namespace, label_selector=selector).items]:
            refs = [r for r in workload.metadata.owner_references or [] if r.controller]
            assert [r.uid for r in refs] == [uid], (h.name, workload.metadata.name)

    # No orphans: every managed object belongs to a job that still exists (the GC removes the others).
    alive = {h.name for h in histories if not h.deleted}

    def orphans() -> list[str]:
        core, apps, batch = kube_cluster.core(), kube_cluster.apps(), k8s.BatchV1Api(kube_cluster.api)
        objs = [*apps.list_namespaced_stateful_set(namespace, label_selector=MANAGED).items,
                *batch.list_namespaced_job(namespace, label_selector=MANAGED).items,
                *apps.list_namespaced_deployment(namespace, label_selector=MANAGED).items,
                *core.list_namespaced_service(namespace, label_selector=MANAGED).items,
                *core.list_namespaced_config_map(namespace, label_selector=MANAGED).items]
        return [o.metadata.name for o in objs if o.metadata.labels.get("rljob.io/job-name") not in alive]

    base.wait_for(lambda: not orphans() or None, "children of deleted jobs collected", timeout=120)
    print(f"chaos: {chaos.kills} operator kills; histories: {[(h.name, h.ops) for h in histories]}")
