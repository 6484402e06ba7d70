"""Ranks of the weight-update group from the servers' own shapes, and the admission rules that keep
SGLang pools to tensor parallelism (no data parallelism inside a server)."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from pydantic import ValidationError

from rljob.api.spec import RolloutSpec
from rljob.runtime.weights.group_layout import RankLayout, rank_layout, server_shape


def test_each_tp_rank_is_a_rank_after_the_trainer() -> None:
    layout = rank_layout([("http://a", 2), ("http://b", 2), ("http://c", 1)])
    assert layout == RankLayout({"http://a": 1, "http://b": 3, "http://c": 5}, world_size=6)
    assert rank_layout([]) == RankLayout({}, world_size=1)


@pytest.mark.parametrize(("tp_sizes", "reached"), [
    ([1], True), ([4], True), ([1, 1], True),  # ranks 1 | 1-4 | 1, 2
    ([1, 1, 1], False),  # rank 3 receives from rank 1
    ([2, 1], False), ([1, 2], True), ([2, 2], True),  # 1-2, 3 | 1, 2-3 | 1-2, 3-4 (4 is rank 0's)
    ([1, 1, 1, 1], False), ([1, 1, 2, 4], True),  # 1, 2, 3-4, 5-8
])
def test_rank0_reaches_a_worker_when_one_of_its_ranks_is_a_power_of_two(tp_sizes: list[int], reached: bool) -> None:
    layout = rank_layout([(f"http://w{i}", tp) for i, tp in enumerate(tp_sizes)])
    assert layout.rank0_reaches_every_worker() is reached
    assert [r for u in layout.offsets for r in layout.ranks_of(u)] == list(range(1, layout.world_size))


def test_rank0s_gloo_broadcast_completes_before_a_rank_it_does_not_send_to_has_posted_its_receive() -> None:
    """Why the rule above: in a real gloo group of 4, rank 3 posts its receive only after rank 0's
    broadcast has returned, and every rank still gets the tensor (rank 3 from rank 1)."""
    store, world = dist.HashStore(), 4
    groups: list[Any] = [None] * world

    def join(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("tree", store), rank, world, timedelta(seconds=60))

    def broadcast(rank: int, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        groups[rank].broadcast([tensor], options).wait()

    joins = [threading.Thread(target=join, args=(r,)) for r in range(world)]
    for t in joins:
        t.start()
    for t in joins:
        t.join()
    root_done = threading.Event()
    got = {r: torch.zeros(3) for r in range(1, world)}

    def receive(rank: int) -> None:
        if rank == 3:
            assert root_done.wait(60), "rank 0's broadcast never returned"
        broadcast(rank, got[rank])

    receivers = [threading.Thread(target=receive, args=(r,)) for r in got]
    for t in receivers:
        t.start()
    broadcast(0, torch.ones(3))
    root_done.set()
    for t in receivers:
        t.join()
    assert all(torch.equal(t, torch.ones(3)) for t in got.values())
    assert not rank_layout([("http://a", 1), ("http://b", 1), ("http://c", 1)]).rank0_reaches_every_worker()


def test_a_server_shape_comes_from_its_server_info() -> None:
    assert server_shape({"tp_size": 4, "dp_size": 1, "model_path": "m"}).tp_size == 4
    assert server_shape({"model_path": "m"}).tp_size == 1  # no tp_size reported: one rank
    with pytest.raises(ValueError, match="dp_size=2"):
        server_shape({"tp_size": 1, "dp_size": 2})
    with pytest.raises(ValueError, match="tp_size"):
        server_shape({"tp_size": 0})


def _rollout(extra: list[str], mode: str | None = None, **pool: Any) -> RolloutSpec:
    doc: dict[str, Any] = {"engine": "sglang", "pools": [
        {"name": "nv", "vendor": "nvidia", "gpusPerReplica": 2, "tensorParallelSize": 2, "extraArgs": extra, **pool}]}
    if mode:
        doc["weightTransport"] = {"mode": mode}
    return RolloutSpec.model_validate(doc)


@pytest.mark.parametrize("flag", [["--dp-size", "2"], ["--dp=2"], ["--data-parallel-size", "2"]])
def test_data_parallel_servers_are_refused(flag: list[str]) -> None:
    # distributed (engine sglang's default): no ranks for DP schedulers; disk: no GPUs left for them.
    for mode in (None, "distributed", "disk"):
        with pytest.raises(ValidationError, match=r"extraArgs must not set SGLang's data parallelism"):
            _rollout(flag, mode)
    assert _rollout(["--max-running-requests", "8"]).pools[0].extra_args == ["--max-running-requests", "8"]


def test_every_gpu_of_a_replica_is_a_tensor_parallel_rank() -> None:
    with pytest.raises(ValidationError, match="gpusPerReplica must equal tensorParallelSize"):
        _rollout([], gpusPerReplica=4)
