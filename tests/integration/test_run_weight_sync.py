"""Whole runs (JobRunner, the loop behind `rljob run`) with a real tiny policy: after every step each
engine serves the new weight version by its own API, and every step record closes the ledger.

- embedded engine, `tensor` transport (the local default);
- two SGLang-protocol worker processes behind the REAL sglang router, `distributed` transport (real
  gloo broadcasts from trainer rank 0). Trainer ranks are a parameter: 1 today; the 2-rank case is
  added when the distributed trainer lands (issue 12, trainer branch). The workers run with one and
  with two tensor-parallel ranks each: with TP 2 the group has 1 + 2 x 2 ranks, placed from the
  workers' own /get_server_info.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rljob.api import parse_rljob
from rljob.runtime.metrics import ledger_imbalance, read_jsonl
from rljob.runtime.step_record import StepRecord
from rljob.runtime.runner import JobRunner, RunOptions
from tests.helpers.processes import start_router, start_workers, stop, wait_http
from tests.integration.test_runner_resume import job_doc, tiny_policy

STEPS = 4


def check_ledger(records: list[dict], final_buffer: int) -> None:
    for rec in records:
        assert ledger_imbalance(rec) == (0, 0), rec["step"]
        assert rec["trained_groups"] == 3
    for before, after in zip(records, records[1:], strict=False):
        assert after["buffer_groups_before"] == before["buffer_groups"], "the buffer changed between rounds"
    new = sum(r["new_groups"] for r in records)
    out = sum(r["trained_groups"] + r["filtered_groups"] + r["discarded_groups"] for r in records)
    assert new == out + final_buffer, "over the run every new group was trained, filtered, or is buffered"


async def test_embedded_run_serves_every_version_and_closes_the_ledger(tmp_path: Path):
    doc = job_doc(tiny_policy(tmp_path / "model"), tmp_path / "ckpt", steps=STEPS, every=100)
    doc["spec"]["algorithm"]["name"] = "dapo"  # dynamic sampling: the filtered term is exercised
    runner = JobRunner(parse_rljob(doc), RunOptions(output_dir=tmp_path / "out"))
    await runner.setup()
    served: list[tuple[int, list[int | None]]] = []
    runner.step_listeners.append(lambda rec: served.append((rec.policy_version, [e.served_version() for e in runner.engines])))
    summary = await runner.run()
    assert [v for v, _ in served] == list(range(1, STEPS + 1))
    assert all(versions == [v] * len(versions) for v, versions in served), served
    records = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert len(records) == STEPS and summary.policy_version == STEPS
    check_ledger(records, len(runner.scheduler.buffer))


def use_sglang_pool(doc: dict, router: str, workers: list[str]) -> None:
    """Point a job_doc at the http_pool's router and workers, weights over the gloo `distributed` transport."""
    doc["spec"]["rollout"].pop("embedded")
    doc["spec"]["rollout"].update({
        "engine": "sglang",
        "sglang": {"routerUrl": router, "workerUrls": workers},
        "weightTransport": {"mode": "distributed", "backend": "gloo", "masterAddress": "127.0.0.1",
                            "masterPort": 0, "bucketMegabytes": 0.05, "timeoutSeconds": 120},
    })


@pytest.fixture(params=[1], ids=lambda tp: f"tp{tp}")
def http_pool(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Path, list[str], str]]:
    """Two workers (``request.param`` TP ranks each) behind the real router."""
    model = tiny_policy(tmp_path / "model")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        workers = start_workers(model, tmp_path, 2, procs, max_batch_size=16, ready_path="/health_generate",
                                tp_size=request.param)
        router, proc = start_router(workers, tmp_path / "router.log")
        procs.append(proc)
        wait_http(router + "/health", 60, proc, tmp_path / "router.log")
        yield model, workers, router
    finally:
        stop(procs)


@pytest.mark.parametrize("trainer_ranks", [1])
@pytest.mark.parametrize(("http_pool", "steps"), [(1, STEPS), (2, 3)], ids=["tp1", "tp2"], indirect=["http_pool"])
async def test_sglang_run_with_distributed_transport(tmp_path: Path, http_pool, trainer_ranks: int, steps: int,
                                                     caplog: pytest.LogCaptureFixture):
    model, workers, router = http_pool
    tp_sizes = [httpx.get(u + "/get_server_info").json()["tp_size"] for u in workers]
    caplog.set_level(logging.INFO, logger="rljob.runtime.weights.broadcast")
    doc = job_doc(model, tmp_path / "ckpt", steps=steps, every=100)
    use_sglang_pool(doc, router, workers)
    job = parse_rljob(doc)
    assert job.spec.rollout.transport_mode == "distributed"
    runner = JobRunner(job, RunOptions(output_dir=tmp_path / "out"))
    await runner.setup()
    seen: list[tuple[int, list[str]]] = []

    def engines_serve(rec: StepRecord) -> None:
        # The engines' own API, not the client's bookkeeping.
        seen.append((rec.policy_version, [httpx.get(u + "/model_info").json()["weight_version"]
                                          for u in workers]))

    runner.step_listeners.append(engines_serve)
    summary = await runner.run()
    assert seen == [(v, [str(v)] * 2) for v in range(1, steps + 1)]
    records = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert [r["engines_in_rotation"] for r in records] == [2] * steps
    assert [r["weight_sync_failures"] for r in records] == [0] * steps
    assert summary.policy_version == steps
    # Every TP rank of every worker was its own rank, placed from the workers' own server info.
    assert f"trainer rank 0 + {sum(tp_sizes)} engine ranks over 2 workers" in caplog.text
    check_ledger(records, len(runner.scheduler.buffer))
