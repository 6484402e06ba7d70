"""Over gloo, trainer rank 0 posts bucket k+1's update while the worker still loads bucket k (it queues
at the worker: SGLang runs one update at a time, in arrival order), but the last bucket, which carries the
version, goes only after every earlier bucket was answered.

One in-process SGLang-protocol server (the CPU stand-in, real HTTP on loopback, real gloo group) whose
engine is instrumented at the point where it copies a bucket into its model; rank 0's side, where it
builds and sends each bucket's payload.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rljob.runtime.engines.base import EngineError
from rljob.runtime.engines.embedded import EmbeddedEngine
from rljob.runtime.engines.server import ServerOptions, SGLangProtocolServer
from rljob.runtime.engines.sglang_client import SGLangClientConfig, SGLangEngine
from rljob.runtime.weights.broadcast import DistributedOptions, DistributedTransport, _Prepared
from rljob.runtime.weights.buckets import Bucket, module_buckets
from rljob.runtime.weights.transport import SyncReport
from tests.helpers.tiny_model import save_tiny_model
from tests.helpers.waiting import wait_until

BUCKET_BYTES = 16 * 1024


class WatchedEngine(EmbeddedEngine):
    """An embedded engine that notes each bucket it is given, with the updates queued at its server then."""

    server: SGLangProtocolServer
    loads: list[list[str]]
    queued: list[int]  # the server's updates_queued as each bucket started and ended loading
    wait_for_next: bool = True  # the first bucket waits until the next bucket's call queues behind it
    failing: str | None = None  # a name whose bucket fails to load

    async def load_named_tensors(self, tensors: list[tuple[str, torch.Tensor]], version: int | None,
                                 flush_cache: bool = True, *, adopt: bool = False) -> None:
        names = [n for n, _ in tensors]
        self.loads.append(names)
        self.queued.append(self.server.updates_queued)
        if len(self.loads) == 1 and self.wait_for_next:
            # The next bucket's call must arrive and wait while this one loads; were calls sent only after
            # the previous reply, this would never hold.
            await wait_until(lambda: self.server.updates_queued == 1, "bucket 2's call to queue behind bucket 1",
                             timeout=30)
        if self.failing in names:
            raise EngineError(f"cannot load {self.failing}")
        await super().load_named_tensors(tensors, version, flush_cache, adopt=adopt)
        self.queued.append(self.server.updates_queued)


Pool = tuple[Path, list[WatchedEngine], SGLangEngine]


@contextlib.asynccontextmanager
async def pool_of(root: Path, workers: int) -> AsyncIterator[Pool]:
    """``workers`` in-process CPU servers on loopback, each with a WatchedEngine, and one client over them."""
    model = save_tiny_model(root / "model", seed=0)
    engines: list[WatchedEngine] = []
    servers: list[SGLangProtocolServer] = []
    try:
        for _ in range(workers):
            engine = WatchedEngine(model, max_batch_size=2)
            engine.loads, engine.queued = [], []
            engine.server = SGLangProtocolServer(engine, ServerOptions(model_path=str(model),
                                                                       weight_group_timeout_s=30.0))
            engines.append(engine)
            servers.append(engine.server)
        urls = [await server.start() for server in servers]
        client = SGLangEngine(SGLangClientConfig(worker_urls=urls, retries=1, backoff_s=0.05, backoff_max_s=0.1,
                                                 probe_timeout_s=5.0))
        await client.start()
        try:
            yield model, engines, client
        finally:
            await client.close()
    finally:
        for server in servers:
            await server.stop()


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[Path, WatchedEngine, SGLangEngine]]:
    async with pool_of(tmp_path, 1) as (model, (engine,), client):
        yield model, engine, client


async def sync_once(client: SGLangEngine, buckets: list[Bucket]) -> SyncReport:
    transport = DistributedTransport([client], DistributedOptions(master_address="127.0.0.1", backend="gloo",
                                                                   timeout_s=30))
    try:
        return await transport.sync(1, lambda _dtype: iter(buckets))
    finally:
        await transport.close()


def buckets_of(model: torch.nn.Module) -> list[Bucket]:
    buckets = list(module_buckets(model, BUCKET_BYTES))
    assert len(buckets) >= 4, "too few buckets for the checks below"
    return buckets


async def test_the_next_bucket_queues_at_the_worker_while_it_loads_and_all_arrive_in_order(
        served: tuple[Path, WatchedEngine, SGLangEngine], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="rljob.runtime.weights.broadcast")
    model_dir, engine, client = served
    trainer = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(-1.5)
    buckets = buckets_of(trainer)
    report = await sync_once(client, buckets)
    assert report.ok and not report.failed, report
    assert engine.loads == [[n for n, _ in b] for b in buckets]
    served_state = engine.model.state_dict()
    for name, param in trainer.named_parameters():
        assert torch.equal(served_state[name], param), name
    assert engine.weight_version == 1
    assert "each bucket's call goes while the workers load the one before" in caplog.text


async def test_a_bucket_that_fails_to_load_keeps_the_version_from_the_worker(
        served: tuple[Path, WatchedEngine, SGLangEngine]) -> None:
    # The second-to-last bucket fails after its broadcast. Its reply is awaited before the last bucket
    # (the one with the version) goes; sent ahead of it, the worker would load the last bucket and serve
    # version 1 with one bucket of version 0.
    model_dir, engine, client = served
    trainer = AutoModelForCausalLM.from_pretrained(model_dir)
    buckets = buckets_of(trainer)
    engine.failing = buckets[-2][0][0]
    report = await sync_once(client, buckets)
    assert not report.ok and report.updated == []
    assert "cannot load" in " ".join(report.failed.values()), report.failed
    assert engine.loads == [[n for n, _ in b] for b in buckets[:-1]], "the last bucket must not be sent"
    assert engine.weight_version != 1


async def test_a_worker_that_rank_0_does_not_send_to_gets_each_call_after_the_previous_reply(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="rljob.runtime.weights.broadcast")
    # Three TP-1 workers: ranks 1, 2, 3; gloo's broadcast reaches rank 3 through rank 1, so rank 0's
    # broadcast completing says nothing of it, and no worker may find a bucket queued behind another.
    async with pool_of(tmp_path, 3) as (model_dir, engines, client):
        trainer = AutoModelForCausalLM.from_pretrained(model_dir)
        with torch.no_grad():
            for p in trainer.parameters():
                p.mul_(0.5)
        buckets = buckets_of(trainer)
        for engine in engines:
            engine.wait_for_next = False
        report = await sync_once(client, buckets)
        assert report.ok and len(report.updated) == 3 and not report.failed, report
        assert "each bucket's call waits for the previous bucket's replies" in caplog.text
        for engine in engines:
            assert engine.loads == [[n for n, _ in b] for b in buckets]
            assert not any(engine.queued), engine.queued
            state = engine.model.state_dict()
            assert all(torch.equal(state[n], p) for n, p in trainer.named_parameters())


class WatchedTransport(DistributedTransport):
    """Notes each payload rank 0 builds and sends; the first broadcast waits until the next bucket's
    payload is built (were it built only after the broadcast, that would never happen)."""

    def __init__(self, client: SGLangEngine) -> None:
        super().__init__([client], DistributedOptions(master_address="127.0.0.1", backend="gloo", timeout_s=30))
        self.built: list[int] = []  # data_ptr of each bucket's flat payload, in build order
        self.sent: list[int] = []
        self.second_built = threading.Event()

    def _prepare(self, buckets: Iterator[tuple[Bucket, bool]], scratches: list[torch.Tensor | None],
                 index: int) -> _Prepared | None:
        prepared = super()._prepare(buckets, scratches, index)
        if prepared is not None:
            self.built.append(prepared.payload[0].data_ptr())
            if len(self.built) == 2:
                self.second_built.set()
        return prepared

    def _broadcast(self, payload: list[torch.Tensor]) -> None:
        self.sent.append(payload[0].data_ptr())
        if len(self.sent) == 1:
            assert self.second_built.wait(30), "bucket 2 was not built while bucket 1 was broadcast"
        super()._broadcast(payload)


async def test_the_next_bucket_is_flattened_into_the_other_buffer_while_this_one_is_broadcast(
        served: tuple[Path, WatchedEngine, SGLangEngine]) -> None:
    model_dir, engine, client = served
    trainer = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.25)
    # Four buckets of 64 KB, each of several tensors (a lone tensor is sent from its own storage, with no
    # copy), then the rest: the scratch buffers fit every bucket they take.
    named = dict(trainer.named_parameters())
    layer = "model.layers.{}.{}.weight".format
    groups = [[layer(0, "mlp.gate_proj"), layer(0, "mlp.up_proj")], [layer(1, "mlp.gate_proj"), layer(1, "mlp.up_proj")],
              [layer(0, "mlp.down_proj"), layer(1, "mlp.down_proj")],
              [layer(i, f"self_attn.{p}") for i in (0, 1) for p in ("q_proj", "o_proj")]]
    taken = {n for g in groups for n in g}
    buckets: list[Bucket] = [[(n, named[n]) for n in g] for g in groups]
    buckets.append([(n, p) for n, p in named.items() if n not in taken])
    assert {sum(t.numel() * t.element_size() for _, t in b) for b in buckets[:4]} == {64 * 1024}
    transport = WatchedTransport(client)
    try:
        report = await transport.sync(1, lambda _dtype: iter(buckets))
    finally:
        await transport.close()
    assert report.ok and not report.failed, report
    assert transport.sent == transport.built and len(transport.built) == len(buckets)
    # Two buffers in turn: each bucket's differs from the one broadcast beside it and is the one before that.
    assert all(a != b for a, b in zip(transport.built, transport.built[1:], strict=False)), transport.built
    assert transport.built[2:4] == transport.built[0:2], transport.built
    state = engine.model.state_dict()
    assert all(torch.equal(state[n], p) for n, p in trainer.named_parameters())
