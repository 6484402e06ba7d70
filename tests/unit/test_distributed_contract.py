"""The pure parts of distributed training: the token-balanced hand-out and the torchrun variables."""

from __future__ import annotations

import random

import pytest

from rljob.runtime.training.balance import balance_by_tokens
from rljob.runtime.training.distributed import DistEnv, backend_for

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.7",
            "MASTER_PORT": "29500"}


def test_every_group_goes_to_exactly_one_rank_in_round_order() -> None:
    counts = [random.Random(3).randint(0, 500) for _ in range(37)]
    shards = balance_by_tokens(counts, 4)
    assert sorted(i for s in shards for i in s) == list(range(37))
    assert all(s == sorted(s) for s in shards)


def test_loads_are_balanced_by_tokens_not_group_counts() -> None:
    # One long resumed group and many short fresh ones: equal group counts would give one rank 4x the work.
    counts = [400] + [50] * 8
    shards = balance_by_tokens(counts, 2)
    loads = [sum(counts[i] for i in s) for s in shards]
    assert loads == [400, 400] and sorted(len(s) for s in shards) == [1, 8]


def test_lpt_bound_and_determinism() -> None:
    rng = random.Random(11)
    for _ in range(50):
        counts = [rng.randint(1, 1000) for _ in range(rng.randint(1, 40))]
        world = rng.randint(1, 6)
        shards = balance_by_tokens(counts, world)
        assert shards == balance_by_tokens(counts, world)
        loads = [sum(counts[i] for i in s) for s in shards]
        lower_bound = max(max(counts), sum(counts) / world)  # no split can beat this
        assert max(loads) <= 4 / 3 * lower_bound + 1e-9


def test_fewer_groups_than_ranks_and_zero_token_groups_spread() -> None:
    assert balance_by_tokens([10], 3) == [[0], [], []]
    assert sorted(map(len, balance_by_tokens([0, 0, 0, 0], 2))) == [2, 2]
    with pytest.raises(ValueError, match="world_size"):
        balance_by_tokens([1], 0)


def test_single_process_without_torchrun_variables() -> None:
    assert DistEnv.from_environ({}) is None
    assert DistEnv.from_environ({"WORLD_SIZE": "1", "RANK": "0"}) is None


def test_torchrun_variables_are_read() -> None:
    env = DistEnv.from_environ(TORCHRUN)
    assert env == DistEnv(rank=1, world_size=2, local_rank=1, local_world_size=2, master_addr="10.0.0.7",
                          master_port=29500)


@pytest.mark.parametrize(("change", "message"), [
    ({"MASTER_ADDR": ""}, "MASTER_ADDR is not set"),
    ({"MASTER_PORT": "http"}, "MASTER_PORT must be an integer"),
    ({"RANK": "2"}, "RANK 2 is outside"),
    ({"LOCAL_RANK": "5"}, "LOCAL_RANK 5 is outside"),
])
def test_bad_torchrun_variables_name_the_variable(change: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DistEnv.from_environ({**TORCHRUN, **change})


def test_gloo_on_cpu_nccl_on_gpus() -> None:
    assert backend_for("cpu") == "gloo" and backend_for("cuda") == "nccl" and backend_for("cuda:1") == "nccl"


@pytest.mark.parametrize(("rank", "local_rank", "answers"), [
    (0, 0, False),  # rank 0 serves the job's own metrics on the port
    (1, 1, False),  # a local multi-rank run (or a multi-GPU pod): rank 0's local rank 0 holds the port
    (1, 0, True),   # one rank per pod: the second trainer pod of a cpu gang
    (8, 0, True),   # the first rank of the second 8-GPU pod
    (9, 1, False),
])
def test_the_first_rank_of_every_pod_but_rank_0s_answers_the_probe(rank: int, local_rank: int, answers: bool) -> None:
    # Regression (real node): ranks 1..N-1 served nothing, so the trainer pods' shared readiness probe
    # (/metrics) failed on every pod but rank 0's and the job never left Starting.
    env = DistEnv(rank=rank, world_size=16, local_rank=local_rank, local_world_size=8 if local_rank else 1,
                  master_addr="10.0.0.7", master_port=29500)
    assert env.answers_pod_probe is answers
