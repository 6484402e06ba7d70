"""Chaos: the operator is SIGKILLed at planned lifecycle events while 20 RLJobs go through their lifecycles.

Each job follows a seeded random script (create, scale, suspend, resume, trainer failure, delete), and
the same seed plans, up front, at which of those steps the operator is killed (SIGKILL) and restarted:
- `mid-apply`: as soon as the operator logs that it is applying the generation the step produced
  (reconcile's "applying generation N" line): the kill lands inside the create/update handler;
- `after-action`: right after the API server accepted the step, before the operator may have seen it;
- `after-settled`: once the phase the step leads to is observed (the operator then resumes a settled job).
The kills happen where the test sees these events, so the machine's speed changes neither how many
there are nor where; the test asserts that every planned kill happened, exactly. Afterwards, with the
operator running undisturbed:
- every surviving RLJob is in the phase its history implies (Running, Suspended or Failed);
- its children are exactly the expected set, each with one controller owner reference to it;
- every deleted RLJob is gone (no finalizer holds it) and no managed object is left without its job.

The trainer gang is an Indexed Job; kwok would complete its pods at once, so they stay unscheduled
and `SimulatedTrainerKubelet` (tests/helpers/trainer_pods.py) plays their kubelet: a trainer failure is
the leader pod reported Failed with exit code 1.

One exception, stated: a trainer failure is injected while the operator runs and is held alive until
the failure is counted (a kill planned by another job meanwhile waits for it). A failed trainer pod
whose Job the operator recreates on a later pass is only counted if an operator saw it; a failure
injected while none runs is not guaranteed to be counted.
"""

from __future__ import annotations

import random
import threading
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


# Where a step may be followed by a kill (see the module docstring); a trainer failure gets none: it is held.
KILL_POINTS = {
    "create": ("mid-apply", "after-action", "after-settled"),
    "scale": ("mid-apply", "after-action"),
    "suspend": ("mid-apply", "after-action", "after-settled"),
    "resume": ("mid-apply", "after-action", "after-settled"),
    "delete": ("after-action",),
}
KILL_CHANCE = 0.4  # per step: SEED plans 21 kills (9 mid-apply, 8 after-action, 4 after-settled)


@dataclass
class History:
    """What happens to one job (its steps, and the kill after each step or None), and so its final phase."""

    name: str
    ops: list[str]
    kills: list[str | None] = field(default_factory=list)
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
    """A job's steps and the planned kills, all drawn from `rng`."""
    ops = ["create"]
    for op in rng.sample(["scale", "suspend-resume", "fail"], k=rng.randint(1, 3)):
        ops += ["suspend", "resume"] if op == "suspend-resume" else [op]
    if rng.random() < 0.2:
        ops.append("fail")  # a second failure: past the backoff limit; a Failed job stays Failed, nothing follows
    else:
        ending = rng.random()
        if ending < 0.25:
            ops.append("delete")
        elif ending < 0.45 and "fail" not in ops[-1:]:
            ops.append("suspend")
    kills = [rng.choice(KILL_POINTS[op]) if op in KILL_POINTS and rng.random() < KILL_CHANCE else None for op in ops]
    return History(name, ops, kills)


@dataclass
class Chaos:
    """Kills the operator (SIGKILL) and restarts it when a job reaches a planned kill point."""

    operator: OperatorProcess
    done: list[str] = field(default_factory=list)  # "job:step:point" of each kill made
    hold: threading.Lock = field(default_factory=threading.Lock)  # held: the operator must stay up

    def kill(self, label: str) -> None:
        """Kill now (after any hold is released), and restart: start() returns once the new one is live."""
        with self.hold:
            self.operator.kill()
            self.done.append(label)
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
    planned = sorted(f"{h.name}:{i}:{k}" for h in histories for i, k in enumerate(h.kills) if k)
    # The plan is the seed's, checked here so a change of script cannot quietly thin the chaos out.
    points = {p.rsplit(":", 1)[1] for p in planned}
    assert len(planned) >= 15 and points == {"mid-apply", "after-action", "after-settled"}, planned
    chaos = Chaos(operator)

    def act(h: History, op: str) -> tuple[int | None, str | None]:
        """Do one step through the API: (the generation it produced, the phase it leads to)."""
        patch = lambda spec: api.patch_namespaced_custom_object(  # noqa: E731
            base.GROUP, base.VERSION, namespace, base.PLURAL, h.name, {"spec": spec}
        )
        if op == "create":
            volumes(h.name)
            body = api.create_namespaced_custom_object(
                base.GROUP, base.VERSION, namespace, base.PLURAL, base.rljob(h.name, rollout=ROLLOUT)
            )
            return body["metadata"]["generation"], "Running"
        if op == "scale":
            return patch({"rollout": {"replicas": 1}})["metadata"]["generation"], None  # 2 -> 1: frees capacity too
        if op in ("suspend", "resume"):
            h.suspended = op == "suspend"
            return patch({"suspend": h.suspended})["metadata"]["generation"], "Suspended" if h.suspended else "Running"
        if op == "delete":
            api.delete_namespaced_custom_object(base.GROUP, base.VERSION, namespace, base.PLURAL, h.name)
            h.deleted = True
            return None, None
        raise AssertionError(f"unknown step {op}")

    def fail_trainer(h: History) -> None:
        before = (base.get(api, namespace, h.name).get("status") or {}).get("restarts", {}).get("trainer", 0)
        with chaos.hold:  # see the module docstring
            pods = base.wait_for(
                lambda: [p for p in kubelet.pods(h.name) if p.status.phase == "Running"] or None,
                f"{h.name} trainer pod running", timeout=300,
            )
            kubelet.fail(pods[0])
            h.trainer_failures += 1
            if h.trainer_failures > 1:
                base.wait_phase(api, namespace, h.name, "Failed", timeout=300)
            else:
                base.wait_for(
                    lambda: (base.get(api, namespace, h.name)["status"].get("restarts") or {}).get("trainer", 0)
                    > before,
                    f"{h.name} trainer restart counted", timeout=300,
                )
        if h.trainer_failures == 1:
            base.wait_phase(api, namespace, h.name, "Running", timeout=300)

    def live(h: History) -> None:
        for step, (op, kill) in enumerate(zip(h.ops, h.kills)):
            label = f"{h.name}:{step}:{kill}"
            if op == "fail":
                fail_trainer(h)
                continue
            mark = operator.log_size()
            generation, phase = act(h, op)
            if kill == "after-action":
                chaos.kill(label)
            elif kill == "mid-apply":
                # The create/update handler (or, after another job's kill, the resume pass) logs this line
                # as it starts applying: the kill lands while it applies the children or writes the status.
                operator.wait_log(rf"{namespace}/{h.name}: applying generation {generation}\b", since=mark)
                chaos.kill(label)
            if phase is not None:
                base.wait_phase(api, namespace, h.name, phase, timeout=300)
            if kill == "after-settled":
                chaos.kill(label)

    with ThreadPoolExecutor(max_workers=5) as pool:
        for result in [pool.submit(live, h) for h in histories]:
            result.result()
    assert sorted(chaos.done) == planned, f"kills made {sorted(chaos.done)} != planned {planned}"

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
    print(f"chaos: {len(chaos.done)} operator kills ({chaos.done}); histories: {[(h.name, h.ops) for h in histories]}")
