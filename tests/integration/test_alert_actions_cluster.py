"""Alert actions on the local control plane with a real Prometheus: Notify, RollbackToCheckpoint, Suspend.

- the runtime's own metrics endpoint (RuntimeMetrics, as `rljob run` serves it) on loopback stands for the
  trainer; the test records the steps it exports, so it decides when each alert condition holds;
- Debian's Prometheus scrapes it;
- the operator (`python -m rljob.operator`) checks the job's spec.alertActions against that Prometheus
  with the chart's own alert expressions, and acts;
- the trainer's checkpoint reports reach status.trainer.lastCheckpoint through the trainer's real status
  writer (ProgressReporter with its Kubernetes sender).

One job, three conditions injected in turn, each waited for on what the operator wrote (status, spec,
Events), never on the clock:
1. RLJobTruncationRateHigh -> Notify: an Event named by the alert, AlertAction=True Notified;
2. RLJobEntropyCollapse -> RollbackToCheckpoint: spec.checkpoint.rollbackTo names the checkpoint the job
   had when the collapse began (not one reported after), spec.algorithm.learningRate is lowered;
3. RLJobTokenWasteHigh -> Suspend: spec.suspend, and the operator's lifecycle suspends the job.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s
from rljob.common.progress_reporter import ProgressReporter, kubernetes_sender
from rljob.runtime.metrics import RuntimeMetrics
from rljob.runtime.step_record import BatchPart, RoundPart, StepRecord, TrainPart

from tests.cluster.fixtures import PrometheusFactory
from tests.cluster.prometheus import free_port
from tests.helpers.operator_process import OperatorProcess
from tests.helpers.trainer_pods import TRAINER_NODE_SELECTOR
from tests.integration.test_operator import (  # noqa: F401 (crd, api and kubelet are fixtures)
    GROUP,
    PLURAL,
    VERSION,
    api,
    condition,
    crd,
    events,
    get,
    kubelet,
    namespaced_operator,
    wait_events,
    wait_for,
    wait_phase,
)

pytestmark = [pytest.mark.cluster, pytest.mark.prometheus]

NAME = "watched"
LOWER_LR = 2e-6
FOR_S = 2


class Trainer:
    """The trainer's metrics endpoint: each `step` records one step with the given signals."""

    def __init__(self, namespace: str) -> None:
        self.metrics = RuntimeMetrics(NAME, namespace=namespace)
        self.port = self.metrics.serve("127.0.0.1", free_port())
        self.steps = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def step(self, truncation: float = 0.1, entropy: float = 1.2, aborted: int = 0) -> None:
        self.steps += 1
        self.metrics.record(StepRecord(
            step=self.steps, policy_version=self.steps, strategy="april", time=time.time(),
            round=RoundPart(truncation_rate=truncation, partial_rate=0.2, rollout_seconds=2.0, trained_tokens=1000,
                            tokens_generated=2000 + aborted, aborted_tokens=aborted),
            batch=BatchPart(length_mean=40.0, length_std=20.0, reward_mean=0.5), train=TrainPart(entropy=entropy),
            knobs={"over_sampling": 1.5, "max_staleness": 2.0, "truncation_k": 2.0, "segment_cap_tokens": 0.0},
        ))


def job_spec(prom_url: str) -> dict[str, Any]:
    return {
        # The CRD refuses a builtin model on GPU pools; nothing loads it here.
        "model": {"huggingFace": "rljob/tiny-arith", "storage": {"download": {}}},
        "data": {"synthetic": {"numPrompts": 64}},
        "rollout": {"rolloutBatchSize": 4},
        # The operator's trainer Job stays unscheduled: the loopback endpoint is the trainer.
        "trainer": {"vendor": "cpu", "gpusPerReplica": 0, "nodeSelector": TRAINER_NODE_SELECTOR},
        "algorithm": {"learningRate": 1e-5},
        "autotune": {"prometheus": {"address": prom_url, "timeoutSeconds": 3}, "intervalSeconds": 1},
        "alertActions": [
            {"alert": "RLJobTruncationRateHigh", "forSeconds": FOR_S},
            {"alert": "RLJobEntropyCollapse", "action": "RollbackToCheckpoint", "forSeconds": FOR_S,
             "learningRate": LOWER_LR},
            {"alert": "RLJobTokenWasteHigh", "action": "Suspend", "forSeconds": FOR_S},
        ],
        "backoffLimit": 1,
    }


@pytest.fixture
def operator(namespace: str, crd: None, tmp_path: Path, kubelet: Any) -> Iterator[OperatorProcess]:  # noqa: F811
    """The operator, allowed to call this test's Prometheus, ticking every second."""
    env = {**os.environ, "RLJOB_PROMETHEUS_ALLOWED_ADDRESSES": "http://127.0.0.1:*", "RLJOB_AUTOTUNE_TICK_SECONDS": "1"}
    op = namespaced_operator(namespace, tmp_path / "operator.log", env=env)
    op.start()
    yield op
    op.stop()
    print(f"--- operator log ({op.log_path}) ---\n{op.log_tail(120)}")


def holding(api: k8s.CustomObjectsApi, namespace: str, alert: str) -> dict[str, Any] | None:  # noqa: F811
    alerts = (get(api, namespace, NAME).get("status") or {}).get("alerts") or {}
    return next((a for a in alerts.get("holding", []) if a["alert"] == alert), None)


def test_notify_rollback_and_suspend_on_the_jobs_own_alert_conditions(
    api: k8s.CustomObjectsApi,  # noqa: F811
    operator: OperatorProcess,
    namespace: str,
    kube_cluster: Any,
    prometheus_factory: PrometheusFactory,
) -> None:
    trainer = Trainer(namespace)
    trainer.step()
    prom = prometheus_factory([trainer.target], scrape_interval="1s")
    prom.wait_for_targets_up()
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "RLJob", "metadata": {"name": NAME}, "spec": job_spec(prom.url)})

    # Healthy: the conditions are checked and none holds.
    quiet = wait_for(lambda: (c := condition(get(api, namespace, NAME), "AlertAction")) and c["status"] == "False"
                     and c["reason"] == "NoAlertFiring" and c, "AlertAction=False NoAlertFiring", timeout=120)
    assert "RLJobEntropyCollapse" in quiet["message"]

    # 1. Truncation rate far above the band: Notify.
    trainer.step(truncation=0.9)
    notified = wait_for(lambda: (c := condition(get(api, namespace, NAME), "AlertAction")) and c["status"] == "True"
                        and c, "AlertAction=True after the truncation rate", timeout=120)
    assert notified["reason"] == "Notified" and "RLJobTruncationRateHigh" in notified["message"]
    wait_events(kube_cluster, namespace, NAME, "AlertPending", "RLJobTruncationRateHigh")
    job = get(api, namespace, NAME)
    assert not job["spec"].get("suspend") and "rollbackTo" not in job["spec"].get("checkpoint", {})

    # 2. A checkpoint at step 5, then the entropy collapses: the rollback goes to step 5, not to a checkpoint
    #    reported once the collapse had begun.
    reporter = ProgressReporter(namespace, NAME, sender=kubernetes_sender())
    reporter.report_checkpoint(5, "/var/lib/rljob/checkpoints/step-00000005")
    wait_for(lambda: (get(api, namespace, NAME)["status"].get("trainer", {}).get("lastCheckpoint") or {}).get("step") == 5,
             "lastCheckpoint step 5 in status", timeout=60)
    trainer.step(truncation=0.9, entropy=0.01)
    began = wait_for(lambda: holding(api, namespace, "RLJobEntropyCollapse"), "the entropy episode began", timeout=120)
    assert began["checkpointBefore"]["step"] == 5
    reporter.report_checkpoint(7, "/var/lib/rljob/checkpoints/step-00000007")
    rolled = wait_for(lambda: (spec := get(api, namespace, NAME)["spec"]).get("checkpoint", {}).get("rollbackTo") and spec,
                      "spec.checkpoint.rollbackTo", timeout=120)
    assert rolled["checkpoint"]["rollbackTo"]["step"] == 5
    assert rolled["checkpoint"]["rollbackTo"]["id"].startswith("entropycollapse-")
    assert rolled["algorithm"]["learningRate"] == pytest.approx(LOWER_LR)
    wait_events(kube_cluster, namespace, NAME, "AlertRolledBack")

    # The runtime reads the rollback from its rendered config (the trainer Job is recreated with it).
    def rendered() -> dict[str, Any] | None:
        cm = kube_cluster.core().read_namespaced_config_map(f"{NAME}-config", namespace)
        doc = yaml.safe_load(cm.data["job.yaml"])["spec"]
        return doc if doc["checkpoint"].get("rollbackTo") else None

    config = wait_for(rendered, "the rollback in the trainer's rendered config", timeout=120)
    assert config["checkpoint"]["rollbackTo"] == rolled["checkpoint"]["rollbackTo"]
    assert config["algorithm"]["learningRate"] == pytest.approx(LOWER_LR)
    rolled_back = wait_for(lambda: (c := condition(get(api, namespace, NAME), "AlertAction")) and c["reason"] == "RolledBack"
                           and c, "AlertAction reason RolledBack", timeout=60)
    assert "RLJobEntropyCollapse: RolledBack" in rolled_back["message"]

    # 3. Most generated tokens thrown away: Suspend, through the job's ordinary suspend path.
    for n in range(1, 4):
        trainer.step(truncation=0.9, entropy=0.01, aborted=20_000)
        # Each increase scraped before the next: the counters' rate needs two samples in its window.
        wait_for(lambda n=n: (r := prom.query("rljob_aborted_tokens_total")) and float(r[0]["value"][1]) >= n * 20_000,
                 f"aborted tokens of waste step {n} scraped", timeout=60)
    suspended = wait_for(lambda: get(api, namespace, NAME)["spec"].get("suspend") or None, "spec.suspend", timeout=120)
    assert suspended is True
    wait_phase(api, namespace, NAME, "Suspended", timeout=120)
    wait_events(kube_cluster, namespace, NAME, "AlertSuspended")
    final = get(api, namespace, NAME)
    assert condition(final, "AlertAction")["reason"] == "Suspended"
    assert condition(final, "Suspended")["status"] == "True"
    # Each action once per episode: no second rollback or notification while the conditions kept holding.
    seen = events(kube_cluster, namespace, NAME)
    assert seen.count("AlertRolledBack") == 1 and seen.count("RLJobTruncationRateHigh") == 1, seen
    managers = {m["manager"] for m in final["metadata"]["managedFields"]}
    assert "rljob-alerts" in managers, managers
