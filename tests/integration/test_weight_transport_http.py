"""Weight transports over real HTTP: two SGLang-protocol worker processes behind the REAL sglang
router, real gloo broadcasts (distributed) and a real shared folder (disk).

After each sync every worker's own /model_info weight_version is the new version and its greedy output is
the trainer's; a worker SIGKILLed and restarted on its port is kept out of the router until a sync
(over a rebuilt weight-update group) gives it the current weights.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from rljob.runtime.engines.sglang_client import SGLangClientConfig, SGLangEngine
from rljob.runtime.weights.disk import DiskTransport
from rljob.runtime.weights.broadcast import DistributedOptions, DistributedTransport
from rljob.runtime.weights.buckets import module_buckets
from tests.helpers.greedy import greedy_of, greedy_on
from tests.helpers.processes import start_router, start_worker, stop, wait_http
from tests.helpers.tiny_model import save_tiny_model
from tests.helpers.waiting import wait_until



@dataclass
class Pool:
    model: Path
    workers: list[str]
    router: str
    procs: dict[str, subprocess.Popen[bytes]]
    logs: Path

    def restart(self, url: str) -> None:
        """SIGKILL the worker at ``url`` and start a fresh one on the same port (initial weights)."""
        proc = self.procs[url]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        port = int(url.rsplit(":", 1)[1])
        new_url, self.procs[url] = start_worker(self.model, self.logs / f"restart-{port}.log", max_batch_size=8, port=port)
        assert new_url == url


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[Pool]:
    model = save_tiny_model(tmp_path / "model", seed=1)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        workers = []
        for i in range(2):
            url, procs[url] = start_worker(model, tmp_path / f"w{i}.log", max_batch_size=8)
            workers.append(url)
        for i, url in enumerate(workers):
            wait_http(url + "/health_generate", 180, procs[url], tmp_path / f"w{i}.log")
        router, procs["router"] = start_router(workers, tmp_path / "router.log")
        wait_http(router + "/health", 60, procs["router"], tmp_path / "router.log")
        yield Pool(model, workers, router, procs, tmp_path)
    finally:
        stop(list(procs.values()))


def engine_of(pool: Pool) -> SGLangEngine:
    return SGLangEngine(SGLangClientConfig(
        worker_urls=pool.workers, router_url=pool.router, retries=1, backoff_s=0.05, backoff_max_s=0.1,
        probe_timeout_s=1.0, probe_interval_s=0.2, probe_backoff_s=0.2, probe_backoff_max_s=1.0,
    ))


async def served_versions(urls: list[str]) -> list[str]:
    async with httpx.AsyncClient() as http:
        return [(await http.get(u + "/model_info")).json()["weight_version"] for u in urls]


async def router_workers(router: str) -> set[str]:
    async with httpx.AsyncClient() as http:
        body = (await http.get(router + "/workers")).json()
    return {w["url"].rstrip("/") for w in body["workers"]}


def perturb(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)


async def test_distributed_sync_reaches_every_worker_and_a_restarted_one_waits_outside_the_router(pool: Pool):
    trainer = AutoModelForCausalLM.from_pretrained(pool.model)
    engine = engine_of(pool)
    await engine.start()
    transport = DistributedTransport([engine], DistributedOptions(master_address="127.0.0.1", backend="gloo",
                                                                   timeout_s=60))
    try:
        assert await router_workers(pool.router) == set(pool.workers)
        before = await greedy_on(pool.workers[0])
        perturb(trainer, 1)
        expected = await greedy_of(trainer)
        assert expected != before, "the perturbation must change the greedy output, or the check proves nothing"

        report = await transport.sync(1, lambda _dtype: module_buckets(trainer, 16 * 1024))
        assert report.group_rebuilt and sorted(report.updated) == sorted(pool.workers) and not report.failed
        assert report.bytes_sent == sum(p.numel() * p.element_size() for p in trainer.parameters())
        # Both workers stand in for 0.5.23, which takes flattened_bucket: one broadcast per bucket.
        assert report.broadcasts == len(list(module_buckets(trainer, 16 * 1024)))
        assert await served_versions(pool.workers) == ["1", "1"]
        for url in pool.workers:
            assert await greedy_on(url) == expected, url
        assert await router_workers(pool.router) == set(pool.workers)

        # Same members, same versions: the group is reused.
        perturb(trainer, 2)
        report = await transport.sync(2, lambda _dtype: module_buckets(trainer, 16 * 1024))
        assert not report.group_rebuilt and len(report.updated) == 2

        # A worker dies and comes back on its port with its start-up weights.
        victim, survivor = pool.workers
        pool.restart(victim)

        async def victim_out_of_router() -> bool:
            return victim not in await router_workers(pool.router)

        await wait_until(victim_out_of_router, "restarted worker removed from the router", timeout=60, interval=0.1)
        wait_http(victim + "/health_generate", 180, pool.procs[victim], pool.logs / "restart.log")
        await engine.health()
        assert engine.workers[victim].served_version == 0
        assert await router_workers(pool.router) == {survivor}, "version 0 must not be routed to"

        perturb(trainer, 3)
        expected = await greedy_of(trainer)
        report = await transport.sync(3, lambda _dtype: module_buckets(trainer, 16 * 1024))
        assert report.group_rebuilt, "a restarted member needs a new group"
        assert sorted(report.updated) == sorted(pool.workers)
        assert await served_versions(pool.workers) == ["3", "3"]

        async def both_in_router() -> bool:
            return await router_workers(pool.router) == set(pool.workers)

        # The router queues an add and lists the worker once its own /health check passed (a generation).
        await wait_until(both_in_router, "the caught-up worker back in the router", timeout=60, interval=0.1)
        for url in pool.workers:
            assert await greedy_on(url) == expected, url
    finally:
        await transport.close()
        await engine.close()


async def test_disk_sync_loads_the_snapshot_everywhere_and_keeps_the_last_k(pool: Pool, tmp_path: Path):
    trainer = AutoModelForCausalLM.from_pretrained(pool.model)
    engine = engine_of(pool)
    await engine.start()
    folder = tmp_path / "shared-weights"
    transport = DiskTransport([engine], folder, keep_last=2, write_config=trainer.config.save_pretrained)
    try:
        for version in (1, 2, 3):
            perturb(trainer, version)
            report = await transport.sync(version, lambda _dtype: module_buckets(trainer, 16 * 1024))
            assert sorted(report.updated) == sorted(pool.workers), report.failed
            assert await served_versions(pool.workers) == [str(version)] * 2
        expected = await greedy_of(trainer)
        for url in pool.workers:
            assert await greedy_on(url) == expected
        assert sorted(p.name for p in folder.iterdir()) == ["v000002", "v000003"]

        # A failed load leaves the worker out of the rotation with the reason.
        async with httpx.AsyncClient() as http:
            await http.post(pool.workers[1] + "/update_weight_version", json={"new_version": "2",
                                                                               "abort_all_requests": False})
        await engine.health()
        assert [w.url for w in engine.table.rotation_workers()] == [pool.workers[0]]

        async def out_of_router() -> bool:
            return pool.workers[1] not in await router_workers(pool.router)

        await wait_until(out_of_router, "behind worker removed from the router", timeout=30, interval=0.1)
        await asyncio.sleep(0)
    finally:
        await transport.close()
        await engine.close()


async def _generated_tokens(http: httpx.AsyncClient, url: str) -> float:
    text = (await http.get(url + "/metrics")).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("sglang:generation_tokens"))


async def _interrupted(http: httpx.AsyncClient, url: str, prompt: list[int]) -> list[int]:
    """A long greedy /generate aborted once the worker has generated a few of its tokens: its partial output."""
    start = await _generated_tokens(http, url)
    call = asyncio.create_task(http.post(url + "/generate", json={
        "input_ids": prompt, "sampling_params": {"max_new_tokens": 200, "temperature": 0.0, "ignore_eos": True},
    }, timeout=60))

    async def some_tokens() -> bool:
        return await _generated_tokens(http, url) >= start + 4

    await wait_until(some_tokens, "4 tokens generated", timeout=60, interval=0.01)
    await http.post(url + "/abort_request", json={"rid": "", "abort_all": True})
    reply = (await call).json()
    assert reply["meta_info"]["finish_reason"]["type"] == "abort"
    return list(reply["output_ids"])


async def test_a_sync_that_keeps_the_cache_lets_an_interrupted_sample_resume_without_a_prefill(tmp_path: Path):
    """weightTransport.flushCache: the distributed sync's last bucket carries it to the worker, which
    drops the aborted sample's keys and values (true, the default) or keeps them (false): the resumed
    sample (prompt + partial output) then reports everything but its last token as cached."""
    model = save_tiny_model(tmp_path / "model", seed=1)
    url, proc = start_worker(model, tmp_path / "w.log", max_batch_size=8)
    trainer = AutoModelForCausalLM.from_pretrained(model)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    try:
        wait_http(url + "/health_generate", 180, proc, tmp_path / "w.log")
        engine = SGLangEngine(SGLangClientConfig(worker_urls=[url], retries=1, backoff_s=0.05, backoff_max_s=0.1,
                                                 probe_timeout_s=1.0, probe_interval_s=0.2))
        await engine.start()
        cached = {}
        async with httpx.AsyncClient() as http:
            for version, flush in ((1, True), (2, False)):
                transport = DistributedTransport([engine], DistributedOptions(
                    master_address="127.0.0.1", backend="gloo", timeout_s=60, flush_cache=flush))
                try:
                    partial = await _interrupted(http, url, prompt)
                    perturb(trainer, version)
                    report = await transport.sync(version, lambda _dtype: module_buckets(trainer, 16 * 1024))
                    assert report.updated == [url] and not report.failed
                finally:
                    await transport.close()
                reply = (await http.post(url + "/generate", json={
                    "input_ids": prompt + partial, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                }, timeout=60)).json()
                assert reply["meta_info"]["weight_version"] == str(version)
                cached[flush] = (reply["meta_info"]["cached_tokens"], len(prompt + partial))
        await engine.close()
    finally:
        stop([proc])
    assert cached[True][0] == 0
    assert cached[False][0] == cached[False][1] - 1


async def test_a_bfloat16_worker_gets_the_weights_in_bfloat16_and_serves_what_a_bfloat16_checkpoint_serves(
    tmp_path: Path,
):
    """An fp32 trainer and a worker started with ``--dtype bfloat16`` (SGLang's default for RL checkpoints):
    the transport asks its source for bf16 (a sharded trainer gathers in it), sends half the fp32 bytes, and
    the worker then decodes exactly as a second bf16 worker that loaded the trainer's weights from disk."""
    model = save_tiny_model(tmp_path / "model", seed=1)
    trainer = AutoModelForCausalLM.from_pretrained(model)
    perturb(trainer, 4)
    trainer.to(torch.bfloat16).save_pretrained(tmp_path / "perturbed")
    trainer.to(torch.float32)  # the round trip is exact: the perturbed fp32 weights are what the sync sends
    procs: list[subprocess.Popen[bytes]] = []
    asked: list[torch.dtype | None] = []

    def source(dtype: torch.dtype | None) -> Iterator[list[tuple[str, torch.Tensor]]]:
        asked.append(dtype)
        return module_buckets(trainer, 16 * 1024, dtype)

    try:
        synced, procs_a = start_worker(model, tmp_path / "bf16.log", extra_args=("--dtype", "bfloat16"))
        loaded, procs_b = start_worker(tmp_path / "perturbed", tmp_path / "loaded.log", extra_args=("--dtype", "bfloat16"))
        procs += [procs_a, procs_b]
        wait_http(synced + "/health_generate", 180, procs_a, tmp_path / "bf16.log")
        wait_http(loaded + "/health_generate", 180, procs_b, tmp_path / "loaded.log")
        async with httpx.AsyncClient() as http:
            assert (await http.get(synced + "/get_server_info")).json()["dtype"] == "bfloat16"
        before = await greedy_on(synced)
        expected = await greedy_on(loaded)
        assert expected != before, "the perturbation must change the greedy output, or the check proves nothing"
        engine = SGLangEngine(SGLangClientConfig(worker_urls=[synced], retries=1, backoff_s=0.05, backoff_max_s=0.1))
        await engine.start()
        transport = DistributedTransport([engine], DistributedOptions(master_address="127.0.0.1", backend="gloo",
                                                                       timeout_s=60))
        try:
            report = await transport.sync(1, source)
        finally:
            await transport.close()
            await engine.close()
        assert report.updated == [synced] and not report.failed
        assert asked == [torch.bfloat16]
        assert report.bytes_sent == sum(p.numel() * 2 for p in trainer.parameters())
        assert await greedy_on(synced) == expected
    finally:
        stop(procs)


async def test_a_pool_with_a_0_5_5_post3_worker_gets_one_broadcast_per_tensor_and_both_serve_the_weights(
    tmp_path: Path,
):
    """0.5.5.post3 (the pinned image) has no flattened_bucket: one broadcast reaches every member, so with
    such a worker in the pool every bucket goes tensor by tensor, to the 0.5.23 worker as well."""
    model = save_tiny_model(tmp_path / "model", seed=1)
    trainer = AutoModelForCausalLM.from_pretrained(model)
    perturb(trainer, 5)
    expected = await greedy_of(trainer)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        legacy, proc = start_worker(model, tmp_path / "legacy.log", extra_args=("--sglang-version", "0.5.5.post3"))
        procs.append(proc)
        current, proc = start_worker(model, tmp_path / "current.log")
        procs.append(proc)
        wait_http(legacy + "/health_generate", 180, procs[0], tmp_path / "legacy.log")
        wait_http(current + "/health_generate", 180, procs[1], tmp_path / "current.log")
        engine = SGLangEngine(SGLangClientConfig(worker_urls=[legacy, current], retries=1, backoff_s=0.05,
                                                 backoff_max_s=0.1))
        await engine.start()
        transport = DistributedTransport([engine], DistributedOptions(master_address="127.0.0.1", backend="gloo",
                                                                       timeout_s=60))
        try:
            report = await transport.sync(1, lambda _dtype: module_buckets(trainer, 16 * 1024))
        finally:
            await transport.close()
            await engine.close()
        assert sorted(report.updated) == sorted([legacy, current]) and not report.failed
        assert report.broadcasts == sum(len(b) for b in module_buckets(trainer, 16 * 1024))
        assert await greedy_on(legacy) == expected
        assert await greedy_on(current) == expected
    finally:
        stop(procs)
