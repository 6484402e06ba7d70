"""Whole runs with `rollout.strategy: async` (a real tiny policy): on the embedded engine and on two
SGLang-protocol worker processes behind the real sglang router (gloo `distributed` weight transport),
with one trainer process and with two gloo trainer ranks (`rljob run --nproc 2`).

Each must show: the engines generated while the trainer trained (one process: each `train_step` is held
until the engines' own token counter has grown since the overlap began, and fails if it never does);
trained responses whose tokens come from several versions, none more than `maxStaleness` behind the
step's version, versions never decreasing along a response; every step's ledger balanced (the
overlap's tokens included) and the engines serving each new version.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from rljob.api import parse_rljob
from rljob.runtime.metrics import ledger_imbalance, read_jsonl
from rljob.runtime.rollout.sample import Group
from rljob.runtime.rollout.strategy import AsyncStrategy
from rljob.runtime.runner import JobRunner, RunOptions
from tests.cluster.kube import wait_until
from tests.integration.test_run_weight_sync import check_ledger, http_pool, use_sglang_pool  # noqa: F401 (fixture)
from tests.integration.test_runner_resume import job_doc, tiny_policy

STEPS = 6
ETA = 1
# How long a training step is held for the engines' first token (a bound on a failure, not a wait).
GENERATION_TIMEOUT_S = 300.0


def async_doc(model: Path, tmp_path: Path, steps: int = STEPS) -> dict:
    doc = job_doc(model, tmp_path / "ckpt", steps=steps, every=100)
    doc["spec"]["rollout"]["strategy"] = "async"
    doc["spec"]["rollout"]["partial"]["maxStaleness"] = ETA
    # Responses long enough that some are still running when a training step ends (the tiny policy's
    # lengths are long-tailed up to the cap).
    doc["spec"]["rollout"]["maxResponseLength"] = 120
    return doc


def check_versions(trained: list[tuple[int, Group]]) -> int:
    """Every trained token within the bound, versions non-decreasing along each response; returns how
    many responses carry tokens of more than one version."""
    mixed = 0
    for version, group in trained:
        for s in group.samples:
            assert len(s.versions) == len(s.response_ids) == len(s.logprobs)
            assert all(version - ETA <= v <= version for v in s.versions), (version, s.versions)
            assert s.versions == sorted(s.versions), "a response's versions went backwards"
            mixed += len(set(s.versions)) > 1
    return mixed


def mixed_responses(runner: JobRunner, trained: list[tuple[int, Group]]) -> int:
    """Responses with tokens of two versions or more, trained (checked by check_versions) or still
    buffered at the end (an interrupted response need not finish within the run's steps)."""
    buffered = [s for g in runner.scheduler.buffer for s in g.samples]
    for s in buffered:
        assert s.versions == sorted(s.versions) and len(s.versions) == len(s.response_ids)
    return check_versions(trained) + sum(len(set(s.versions)) > 1 for s in buffered)


def embedded_tokens(runner: JobRunner) -> Callable[[], int]:
    """The embedded engines' generated-token counter (EngineStats.generated_tokens, one per decoded token)."""
    return lambda: sum(e.stats.generated_tokens for e in runner.engines)  # type: ignore[attr-defined]


def worker_tokens(workers: list[str]) -> Callable[[], int]:
    """The workers' `sglang:generation_tokens_total` counters (their /metrics, as SGLang exports it)."""

    def total() -> int:
        count = 0.0
        for url in workers:
            for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
                count += sum(s.value for s in family.samples if s.name == "sglang:generation_tokens_total")
        return int(count)

    return total


def hold_until_generated(generated: Callable[[], int], before: int) -> None:
    """Block the training step until the engines' counter passed `before` (read as the overlap began).

    A wait on the event (a token generated while the step has not returned), bounded only to fail:
    run_in_process makes every overlap start with groups launched ahead, so tokens must come while
    the step trains; a scheduler that left the engines idle during training fails here, not hangs."""
    wait_until(lambda: generated() > before, GENERATION_TIMEOUT_S, "a token generated while the trainer trained",
               interval=0.01)


async def run_in_process(doc: dict, tmp_path: Path,
                         generated: Callable[[JobRunner], Callable[[], int]]) -> tuple[JobRunner, list[tuple[int, Group]]]:
    """Run the job in this process; record every trained group (with the step's version) and hold each
    train_step until the engines generated a token since its overlap began (`generated` reads their
    counter, as generate_during starts: before it launches the groups ahead).

    With the default one batch ahead, the engines may rightly idle through a step: when the round's
    over-sampled surplus (2 x 3 groups launched, 3 accepted) has finished before the step starts, a
    batch is already done ahead (run 57 of docs/development.md). Two batches ahead leave at least three
    groups to launch as every step starts, each owing at least one token."""
    runner = JobRunner(parse_rljob(doc), RunOptions(output_dir=tmp_path / "out"))
    await runner.setup()
    assert isinstance(runner.scheduler.strategy, AsyncStrategy)
    runner.scheduler.strategy.ahead_batches = 2.0
    tokens = generated(runner)
    overlap_began_at = [0]
    trained: list[tuple[int, Group]] = []
    real_step, real_during = runner.trainer.train_step, runner.scheduler.generate_during

    def train_step(groups: list[Group], version: int):  # type: ignore[no-untyped-def]
        trained.extend((version, g) for g in groups)
        metrics = real_step(groups, version)
        hold_until_generated(tokens, overlap_began_at[0])
        return metrics

    async def generate_during(training):  # type: ignore[no-untyped-def]
        overlap_began_at[0] = await asyncio.to_thread(tokens)
        return await real_during(training)

    runner.trainer.train_step = train_step  # type: ignore[method-assign]
    runner.scheduler.generate_during = generate_during  # type: ignore[method-assign]
    summary = await runner.run()
    assert summary.policy_version == doc["spec"]["trainer"]["steps"]
    return runner, trained


async def test_async_run_on_the_embedded_engine(tmp_path: Path) -> None:
    doc = async_doc(tiny_policy(tmp_path / "model"), tmp_path)
    runner, trained = await run_in_process(doc, tmp_path, embedded_tokens)
    assert mixed_responses(runner, trained) >= 1, "no response carries tokens of two versions"
    records = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert [r["policy_version"] for r in records] == list(range(1, STEPS + 1))
    # Every train step was held until the engines generated (run_in_process): the step records say so,
    # and those seconds are not engine idle.
    for rec in records:
        assert rec["overlap_tokens"] > 0 and rec["overlap_seconds"] > 0, rec
        assert rec["engine_idle_seconds"] <= rec["end_to_end_seconds"] - rec["overlap_seconds"] + 1e-9, rec
    assert max(r["staleness_max"] for r in records) <= ETA
    check_ledger(records, len(runner.scheduler.buffer))


async def test_async_run_on_sglang_workers(tmp_path: Path, http_pool) -> None:  # noqa: F811
    model, workers, router = http_pool
    doc = async_doc(model, tmp_path)
    use_sglang_pool(doc, router, workers)
    runner, trained = await run_in_process(doc, tmp_path, lambda _runner: worker_tokens(workers))
    # Versions within the bound and non-decreasing; a response of two versions is likely, not certain,
    # here (the workers often finish what is in flight before the tiny model's step ends): the
    # embedded test and tests/unit/runtime/rollout/test_scheduler_async.py require one.
    mixed_responses(runner, trained)
    records = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert [r["engines_in_rotation"] for r in records] == [2] * STEPS
    assert [r["weight_sync_failures"] for r in records] == [0] * STEPS
    assert max(r["staleness_max"] for r in records) <= ETA
    check_ledger(records, len(runner.scheduler.buffer))


def run_on_two_ranks(doc: dict, tmp_path: Path) -> None:
    """`rljob run --nproc 2` (two gloo trainer ranks under FSDP2); checks its step records."""
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    cmd = [sys.executable, "-m", "rljob.runtime.cli", "run", str(job), "--nproc", "2", "--no-live",
           "--output", str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "COLUMNS": "300"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    records = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, len(records) + 1)) and records
    assert records[-1]["policy_version"] == doc["spec"]["trainer"]["steps"]
    for rec in records:
        assert ledger_imbalance(rec) == (0, 0), rec
        assert rec["staleness_max"] <= ETA, rec
    assert sum(r["off_policy_token_ratio"] for r in records) > 0, "no trained token came from an older version"


@pytest.mark.slow
def test_async_run_on_two_trainer_ranks_embedded(tmp_path: Path) -> None:
    run_on_two_ranks(async_doc(tiny_policy(tmp_path / "model"), tmp_path, steps=3), tmp_path)


@pytest.mark.slow
def test_async_run_on_two_trainer_ranks_sglang(tmp_path: Path, http_pool) -> None:  # noqa: F811
    model, workers, router = http_pool
    doc = async_doc(model, tmp_path, steps=3)
    use_sglang_pool(doc, router, workers)
    run_on_two_ranks(doc, tmp_path)
