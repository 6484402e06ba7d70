"""A cpu-vendor RLJob, reconciled by the operator, trains to completion with its pods on the real node.

Everything a user sets: the model on a PersistentVolumeClaim, a cpu inference pool (rljob's
SGLang-protocol server), the router image built from the sglang-router package, the trainer gang
(an Indexed Job of two pods, torchrun ranks 0 and 1 -> `rljob run`, FSDP2 over gloo), weights over the `distributed` transport from the
trainer pod to the engine pod, worker discovery through the API server, status reported by the
trainer. The operator runs on the host against the real node's API server; the runtime image is
`runtime-thin` with the test run's virtualenv mounted read-only (`spec.pods.volumes`).

Twice: with the example's `april` strategy, and with `async` (the engine pod keeps generating while the
trainer gang trains; the weight sync interrupts it), whose trained tokens must stay within maxStaleness.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from rljob.runtime.metrics import ledger_imbalance, read_jsonl
from tests.cluster.kube import wait_until
from tests.cluster.realnode import RealCluster
from tests.helpers.real_node_rljob import EXAMPLE, real_node_job

pytestmark = [pytest.mark.realnode, pytest.mark.cluster, pytest.mark.slow]

STEPS = 2
MAX_STALENESS = yaml.safe_load(EXAMPLE.read_text())["spec"]["rollout"]["partial"]["maxStaleness"]  # the example's η


@pytest.mark.parametrize("strategy", ["april", "async"])
def test_cpu_rljob_trains_to_complete_on_the_real_node(real_cluster: RealCluster, real_namespace: str,
                                                       tmp_path: Path, strategy: str) -> None:
    with real_node_job(real_cluster, real_namespace, tmp_path) as job:
        try:
            job.create(STEPS, rollout={"strategy": strategy})
            job.assert_completes()
            status = job.status()
            assert status["trainer"]["step"] == STEPS and status["trainer"]["policyVersion"] == STEPS
            # The trainer's step records: after every step the engine pod served the new version (the runtime
            # reads each engine's /get_weight_version before a step counts; the pod is scaled away at Complete),
            # with no failed sync, and the sample ledger closes.
            records = read_jsonl(job.checkpoints / "metrics.jsonl")
            assert [r["policy_version"] for r in records] == list(range(1, STEPS + 1))
            assert all(r["engines_in_rotation"] == 1 and r["weight_sync_failures"] == 0 for r in records), records
            assert all(ledger_imbalance(r) == (0, 0) for r in records), records
            # No trained token older than the bound (async's overlap makes older tokens possible).
            assert max(r["staleness_max"] for r in records) <= MAX_STALENESS, records
            # Async's engine pod was kept generating through each train step (whether it had work left then
            # depends on the round: a batch may already be done ahead); APRIL's never is.
            overlapped = [r["overlap_seconds"] > 0 for r in records]
            assert overlapped == [strategy == "async"] * STEPS, records

            # Deletion: the API server's garbage collector removes every child (owner references).
            job.delete()
            wait_until(lambda: not job.children(), 180, "every child of RLJob e2e deleted", interval=2)
        finally:
            sys.stdout.flush()
