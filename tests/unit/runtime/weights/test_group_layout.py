"""Ranks of the weight-update group from the servers' own shapes, and the admission rules that keep
SGLang pools to tensor parallelism (no data parallelism inside a server)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from rljob.api.spec import RolloutSpec
from rljob.runtime.weights.group_layout import RankLayout, rank_layout, server_shape


def test_each_tp_rank_is_a_rank_after_the_trainer() -> None:
    layout = rank_layout([("http://a", 2), ("http://b", 2), ("http://c", 1)])
    assert layout == RankLayout({"http://a": 1, "http://b": 3, "http://c": 5}, world_size=6)
    assert rank_layout([]) == RankLayout({}, world_size=1)


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
