"""APRIL rounds over HTTP: the runtime's scheduler, SGLang clients, real worker processes.

One worker is killed with SIGKILL in the middle of a round: the round still returns a full batch,
the dead worker's engine is excluded, and every token the clients received is in a trained or a
buffered sample (nothing lost, nothing duplicated).
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import httpx
import pytest

from rljob.runtime.engines.base import WeightUpdate
from rljob.runtime.engines.sglang_client import SGLangClientConfig, SGLangEngine
from rljob.runtime.rollout.strategy import AprilStrategy
from tests.helpers.processes import start_worker, stop, wait_http
from tests.helpers.tiny_model import save_tiny_model
from tests.helpers.waiting import wait_until
from tests.unit.runtime.rollout.test_scheduler import Ledger, assert_conserved, make_scheduler, run_rounds


def client(url: str) -> SGLangEngine:
    return SGLangEngine(SGLangClientConfig(worker_urls=[url], retries=1, backoff_s=0.05, backoff_max_s=0.1,
                                           reabort_interval_s=0.3, drain_timeout_s=20, probe_timeout_s=1.0))


@pytest.fixture
def workers(tmp_path: Path):
    model = save_tiny_model(tmp_path / "model", seed=1)
    started = [start_worker(model, tmp_path / f"w{i}.log", max_batch_size=16) for i in range(2)]
    try:
        for i, (url, proc) in enumerate(started):
            wait_http(url + "/health_generate", 180, proc, tmp_path / f"w{i}.log")
        yield started, model
    finally:
        stop([p for _, p in started])


async def test_worker_killed_mid_round_loses_no_sample(workers):
    started, model = workers
    engines = [client(url) for url, _ in started]
    await asyncio.gather(*(e.start() for e in engines))
    scheduler = make_scheduler(AprilStrategy(over_sampling=2.0), engines)
    ledger = Ledger()
    await run_rounds(scheduler, [0], ledger)
    assert_conserved(scheduler, ledger)

    victim_url, victim = started[1]

    async def kill_when_busy() -> None:
        async with httpx.AsyncClient() as http:

            async def victim_busy() -> bool:
                loads = (await http.get(victim_url + "/v1/loads")).json()["loads"][0]
                return bool(loads["num_running_reqs"] > 0)

            await wait_until(victim_busy, "requests running on the victim", timeout=600, interval=0.01)
        os.killpg(victim.pid, signal.SIGKILL)

    # Kill in the first round that runs a request on the victim: an APRIL round may end from its buffer
    # of finished surplus groups, or send nothing to the victim, and then the kill waits for the next one.
    for _ in range(8):
        killer = asyncio.ensure_future(kill_when_busy())
        result = await asyncio.wait_for(scheduler.run_round(0), timeout=120)
        ledger.trained += result.groups
        ledger.generated_tokens += result.stats.tokens_generated
        if killer.done():
            await killer
            break
        killer.cancel()
        await asyncio.gather(killer, return_exceptions=True)
    assert killer.done() and not killer.cancelled(), "no round ran a request on the victim"
    assert len(result.groups) == scheduler.config.batch_size
    assert all(s.status.finished for g in result.groups for s in g.samples)
    assert not engines[1].workers[victim_url].healthy, "the kill did not hit a request"
    assert_conserved(scheduler, ledger)

    # The next round runs on the survivor alone: groups sent to the dead engine are relaunched.
    await engines[0].update_weights(WeightUpdate(version=1, path=str(model)))
    result = await asyncio.wait_for(scheduler.run_round(1), timeout=120)
    ledger.trained += result.groups
    ledger.generated_tokens += result.stats.tokens_generated
    assert 1 in scheduler.pool.unhealthy  # the dead worker's engine is excluded
    assert len(result.groups) == scheduler.config.batch_size
    assert_conserved(scheduler, ledger)
    await asyncio.gather(*(e.close() for e in engines))
