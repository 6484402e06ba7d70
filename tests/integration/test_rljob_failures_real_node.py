"""Failures of a cpu-vendor RLJob's pods on the real node, and Prometheus scraping them through their Services.

One RLJob run (the job of test_rljob_real_node.py, more steps), reconciled by the operator on the host:

- its only inference pod is force-deleted INSIDE a rollout round, on purpose: once a step is done, the
  pod is seen holding requests (with the sync strategy every round's groups are fresh, so a round whose
  requests the pod holds needs it) and is paused there (`/pause_generation`, so the round cannot end
  before the kill). The job goes Degraded, never Failed; the StatefulSet recreates the pod, which
  serves its start-up weights: nothing is in the rotation, so the round catches it up with a mid-round
  weight sync (docs/weight_sync.md) and training continues;
- then the container of trainer rank 1 is SIGKILLed (through containerd, as an OOM kill or a crash
  would end it): the operator restarts the whole gang, the new rank 0 resumes from the last
  checkpoint (not from step 0), and the job reaches Complete;
- a real Prometheus pod, discovering the job's pods through their Services (DNS SRV of the named
  ports the chart's PodMonitors select), has scraped the trainer's `rljob_*` series and the
  inference server's `sglang:*` series, with their namespace and job labels, the replacement
  inference pod's included.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rljob.api.engine_auth import ENGINE_API_KEY_ENV
from rljob.runtime.metrics import ledger_imbalance, read_jsonl
from tests.cluster.kube import wait_until
from rljob.operator.builders.meta import JobRef
from rljob.operator.builders.trainer import METRICS_PORT
from tests.cluster.prometheus_pod import PrometheusPod, rljob_services
from tests.cluster.realnode import RealCluster
from tests.helpers.real_node_rljob import NAME, RealNodeJob, real_node_job

pytestmark = [pytest.mark.realnode, pytest.mark.cluster, pytest.mark.slow]

# Enough steps to kill an engine after the first one and a trainer rank after the engine is back,
# with steps left to run after the gang's restart (a step takes ~4 s here; the waits poll every 0.5-1 s).
STEPS = 10
INFERENCE_POD = f"{NAME}-infer-cpu-0"
# Prometheus keeps every sample of the run; the range covers all of it (pods gone at the end included).
WHOLE_RUN = "[1h]"
ENGINE_PORT = 30000  # the pools' SGLang HTTP port (rollout.sglang.discovery.port's default)
# Run inside the inference pod (its own Python, no network from the host needed): wait until the server
# holds requests (a round's: evaluation runs only before step 1 and after the last), pause generation at
# once so the round cannot end, and print how many requests it holds then. The requests seen before the
# pause may all finish before it lands (a tiny model's are short): then generation continues and the wait
# starts again, so the kill always falls on a round the paused pod holds (CI run on a8f622b held 0).
HOLD_A_ROUND = f"""
import json, os, sys, time, urllib.request as u
base = "http://127.0.0.1:{ENGINE_PORT}"
# The engine refuses callers without the job's key (as SGLang's --api-key does); the container holds it.
auth = {{"Authorization": "Bearer " + os.environ["{ENGINE_API_KEY_ENV}"]}}
def post(path, body):
    req = u.Request(base + path, data=body, headers={{"Content-Type": "application/json", **auth}})
    u.urlopen(req, timeout=10).read()
def held():
    load = json.load(u.urlopen(u.Request(base + "/v1/loads", headers=auth), timeout=5))["loads"][0]
    return load["num_running_reqs"] + load["num_waiting_reqs"]
deadline = time.monotonic() + 300
while True:
    while not held():
        if time.monotonic() > deadline:
            sys.exit("no request held by the paused inference server in 300 s")
        time.sleep(0.01)
    post("/pause_generation", b'{{"mode": "in_place"}}')
    if held():
        break
    post("/continue_generation", b"{{}}")
print(held())
"""


def _step(status: dict[str, Any]) -> int:
    return int(status.get("trainer", {}).get("step") or 0)


def _condition(status: dict[str, Any], kind: str) -> str | None:
    return next((c["status"] for c in status.get("conditions", []) if c["type"] == kind), None)


def _not_failed(job: RealNodeJob) -> dict[str, Any]:
    """The status; an AssertionError the moment the job has ended (the waits below expect it running)."""
    status = job.status()
    assert status.get("phase") not in ("Failed", "Complete"), f"the job ended early: {status.get('phase')}"
    return status


def _wait_status(job: RealNodeJob, check: Any, timeout: float, what: str, interval: float = 1) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        status = _not_failed(job)
        return status if check(status) else None

    result: dict[str, Any] = wait_until(probe, timeout, what, interval=interval)
    return result


def _kill_engine_and_recover(rc: RealCluster, job: RealNodeJob) -> None:
    """Force-delete the inference pod inside a rollout round; check Degraded (not Failed), then recovery."""
    ns, core = job.namespace, rc.cluster.core()
    _wait_status(job, lambda s: _step(s) >= 1, 900, "the first step done", interval=0.5)
    old_uid = core.read_namespaced_pod(INFERENCE_POD, ns).metadata.uid
    held = rc.cluster.kubectl("exec", "-n", ns, INFERENCE_POD, "--", "python", "-c", HOLD_A_ROUND).stdout
    assert int(held.split()[-1]) > 0, f"the paused inference server holds no request: {held}"
    assert _step(_not_failed(job)) < STEPS - 2, "too late in the run to check the recovery"
    rc.cluster.kubectl("delete", "pod", INFERENCE_POD, "-n", ns, "--grace-period=0", "--force")

    degraded = _wait_status(job, lambda s: s.get("phase") == "Degraded", 120, "RLJob Degraded", interval=0.5)
    assert _condition(degraded, "Degraded") == "True" and _condition(degraded, "Failed") == "False", degraded

    def replaced() -> bool:
        _not_failed(job)
        pod = core.read_namespaced_pod(INFERENCE_POD, ns)
        ready = any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
        return pod.metadata.uid != old_uid and ready

    wait_until(replaced, 300, f"{INFERENCE_POD} recreated by its StatefulSet and Ready", interval=1)
    # Running again: the engine serves the current weights, both trainer pods pass their probes.
    back = _wait_status(job, lambda s: s.get("phase") == "Running" and _condition(s, "Degraded") == "False", 180,
                        "RLJob Running again, not Degraded")
    assert back["restarts"]["rollout"] == 1 and back["restarts"]["trainer"] == 0, back["restarts"]
    # Training continues on the replacement: a step completes after the recovery.
    _wait_status(job, lambda s: _step(s) > _step(back), 300, "a step completed after the engine came back")
    # The kill hit a round: its generate calls failed (they were held by the paused pod).
    records = read_jsonl(job.checkpoints / "metrics.jsonl")
    assert any(r["engine_errors"] > 0 for r in records), [r["engine_errors"] for r in records]


def _kill_trainer_rank(job: RealNodeJob, index: int) -> tuple[int, set[str]]:
    """SIGKILL the container of trainer rank `index`; the last checkpointed step before the kill and the
    names of the gang's rank-0 pods so far."""
    status = _not_failed(job)
    checkpointed = int(status["trainer"]["lastCheckpoint"]["step"])
    assert checkpointed >= 1 and _step(status) < STEPS - 1, f"too late to kill a rank: {status['trainer']}"
    return checkpointed, job.kill_trainer_rank(index)


def _check_resumed(job: RealNodeJob, checkpointed: int, resumed_at: int) -> None:
    """The restarted gang resumed from a checkpoint at or after `checkpointed`; the step records agree."""
    assert resumed_at >= checkpointed >= 1, (resumed_at, checkpointed)

    # The step records (appended by every run of rank 0): 1..k, then, after the restart, resumed_at+1..STEPS.
    # Steps between the checkpoint and the kill may appear twice; step 1 never does.
    steps = [r["step"] for r in read_jsonl(job.checkpoints / "metrics.jsonl")]
    restart_at = [i for i in range(1, len(steps)) if steps[i] != steps[i - 1] + 1]
    assert len(restart_at) <= 1, steps
    first = steps[restart_at[0]] if restart_at else steps[resumed_at]
    assert steps[0] == 1 and steps.count(1) == 1 and first == resumed_at + 1 and steps[-1] == STEPS, steps
    assert sorted(set(steps)) == list(range(1, STEPS + 1)), steps


def _check_scraped(prom: PrometheusPod, namespace: str) -> None:
    """Prometheus scraped the trainer and inference pods through their Services, with their labels."""
    info = prom.query(f'max_over_time(rljob_job_info{{rljob="{NAME}",rljob_namespace="{namespace}"}}{WHOLE_RUN})')
    assert info, "no rljob_job_info from the trainer pods"
    assert {(s["metric"]["namespace"], s["metric"]["service"]) for s in info} == {(namespace, f"{NAME}-trainer")}, info
    assert all(s["metric"]["instance"].endswith(f":{METRICS_PORT}") for s in info), info
    steps = prom.query(f'max(max_over_time(rljob_steps_total{{namespace="{namespace}",service="{NAME}-trainer"}}{WHOLE_RUN}))')
    assert steps and float(steps[0]["value"][1]) >= 1, steps

    selector = f'namespace="{namespace}",rljob="{NAME}",pool="cpu",vendor="cpu",service="{NAME}-infer-cpu"'
    generated = prom.query(f"max_over_time(sglang:generation_tokens_total{{{selector}}}{WHOLE_RUN})")
    assert generated and all(float(s["value"][1]) > 0 for s in generated), generated
    # The Service's endpoints followed the replacement pod: it was scraped too, as a new series (a new
    # address) or, under the same DNS name, as a reset of the old pod's counter.
    resets = prom.query(f"sum(resets(sglang:generation_tokens_total{{{selector}}}{WHOLE_RUN}))")
    assert len(generated) >= 2 or (resets and float(resets[0]["value"][1]) >= 1), (generated, resets)


def test_failures_degrade_or_restart_and_prometheus_scrapes_the_pods(real_cluster: RealCluster, real_namespace: str,
                                                                     tmp_path: Path) -> None:
    rc, ns = real_cluster, real_namespace
    prom = PrometheusPod(rc, ns, rljob_services(JobRef(NAME, ns, ""), {"cpu": "cpu"}))
    # The Prometheus pod runs in the job's namespace: the NetworkPolicies let that namespace scrape.
    with real_node_job(rc, ns, tmp_path, monitoring_namespace=ns) as job:
        prom.start()
        job.create(STEPS, rollout={"strategy": "sync"})  # every round needs the engine: see the docstring
        _kill_engine_and_recover(rc, job)
        checkpointed, old_leaders = _kill_trainer_rank(job, index=1)
        restarted = wait_until(lambda: _not_failed(job)["restarts"]["trainer"] == 1 or None, 120,
                               "the operator restarts the trainer gang", interval=1)
        assert restarted
        resumed_at = job.resumed_at(old_leaders)
        final = wait_until(job.final_phase, 900, "RLJob e2e Complete or Failed", interval=2)
        status = job.status()
        assert final == "Complete", status.get("conditions")
        assert status["trainer"]["step"] == STEPS and status["restarts"]["trainer"] == 1, status
        assert status["restarts"]["rollout"] == 1, status["restarts"]
        _check_resumed(job, checkpointed, resumed_at)
        # The last steps ran with the replacement engine in the rotation; every step's sample ledger closes.
        records = read_jsonl(job.checkpoints / "metrics.jsonl")
        assert records[-1]["engines_in_rotation"] == 1, records[-1]
        assert all(ledger_imbalance(r) == (0, 0) for r in records), records
        _check_scraped(prom, ns)
