"""Run a function on N real gloo ranks in spawned processes on loopback, as torchrun would start them.

Each process gets the torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) and one torch thread (the machine has two cores); the function must be
importable (defined at module level) and reports its results through files.
"""

from __future__ import annotations

import faulthandler
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from rljob.runtime.cli.run_job import end_rank_process
from tests.helpers.processes import free_port

# A deadline for hung ranks, not a timing check: 4 ranks that each import torch and build a model took
# 67-84 s on the 2-core VM, and far longer with a CUDA image build and a real-node test sharing the cores.
RANKS_TIMEOUT_S = 900.0


def _entry(rank: int, fn: Callable[..., None], world_size: int, port: int, args: tuple[Any, ...],
           pods: bool) -> None:
    local_rank, local_world = (0, 1) if pods else (rank, world_size)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank),
                      LOCAL_WORLD_SIZE=str(local_world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    faulthandler.enable(all_threads=True)  # a rank killed by SIGABRT (a C++ terminate) shows where it was
    try:
        fn(rank, *args)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    # As a rank of `rljob run` ends: without the interpreter's teardown, where torch objects the FSDP
    # model still holds were destroyed and a rank whose work was done now and then died of SIGABRT
    # ("terminate called without an active exception", no Python frame; CI on stop 41's submission,
    # the catch-up test's rank 1). A failure above still reaches torch's spawn wrapper, which reports it.
    end_rank_process(0)


def run_ranks(fn: Callable[..., None], world_size: int, *args: Any, timeout: float = RANKS_TIMEOUT_S,
              pods: bool = False) -> None:
    """fn(rank, *args) on `world_size` processes; raises if any rank fails or the deadline passes.

    `pods`: every rank is the only one of its machine (LOCAL_RANK 0, LOCAL_WORLD_SIZE 1), as in a
    trainer gang of one-rank pods; otherwise all are local ranks of one machine, as `rljob run --nproc`."""
    ctx = mp.start_processes(_entry, args=(fn, world_size, free_port(), args, pods), nprocs=world_size, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in ctx.processes:
                process.kill()
            raise AssertionError(f"{world_size} ranks of {fn.__name__} still running after {timeout:.0f} s")
