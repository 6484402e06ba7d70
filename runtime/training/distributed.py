"""The torchrun contract: process group from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, and rank 0's orders.

`torch.distributed.run` (torchrun), the operator's trainer pods and `rljob run --nproc N` all start
one process per rank with the standard variables set. `DistEnv.from_environ` reads them (None when
WORLD_SIZE is unset or 1: today's single-process path, no process group at all) and `Distributed`
holds the two groups a job uses:

- the default group (NCCL on GPUs, gloo on CPU) carries the training collectives: FSDP2's
  all-gathers and reduce-scatters, the global loss denominators, the weight gather for a sync;
- a gloo `control` group carries rank 0's pickled orders to the other ranks (the groups each rank
  trains, when to checkpoint, when to stop). It is gloo even on GPUs, because object collectives
  over NCCL would stage every pickle through device memory, and it waits long: the other ranks sit
  in it while rank 0 runs a whole rollout round.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# A rollout round on rank 0 can be long (big batch, long answers); the other ranks wait in the control group.
CONTROL_TIMEOUT = datetime.timedelta(hours=6)


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job, as torchrun describes it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int

    @property
    def answers_pod_probe(self) -> bool:
        """Whether this rank, not being rank 0, answers its pod's readiness probe (/metrics).

        Every trainer pod runs the same template, probe included; rank 0 serves the job's metrics on
        that port, and in every other pod its first local rank answers (one process per pod may bind
        the port; a local multi-rank run shares rank 0's host, where only rank 0 does).
        """
        return self.rank != 0 and self.local_rank == 0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> DistEnv | None:
        """The torchrun variables, or None for a single process (WORLD_SIZE unset or 1)."""
        if int(environ.get("WORLD_SIZE", "1") or "1") <= 1:
            return None
        missing = [name for name in _VARIABLES if not environ.get(name)]
        if missing:
            raise ValueError(
                f"WORLD_SIZE is {environ['WORLD_SIZE']} but {', '.join(missing)} is not set; start the ranks with "
                "torchrun (torch.distributed.run) or `rljob run --nproc N`, which set all of "
                + ", ".join(_VARIABLES)
            )
        values: dict[str, int] = {}
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
            try:
                values[name] = int(environ[name])
            except ValueError:
                raise ValueError(f"{name} must be an integer, got {environ[name]!r}") from None
        env = cls(values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"], values["LOCAL_WORLD_SIZE"],
                  environ["MASTER_ADDR"], values["MASTER_PORT"])
        if not 0 <= env.rank < env.world_size:
            raise ValueError(f"RANK {env.rank} is outside 0..WORLD_SIZE-1 ({env.world_size - 1})")
        if not 0 <= env.local_rank < env.local_world_size:
            raise ValueError(f"LOCAL_RANK {env.local_rank} is outside 0..LOCAL_WORLD_SIZE-1")
        return env


def backend_for(device: str) -> str:
    """The collective backend of a trainer device: NCCL (RCCL on ROCm) for GPUs, gloo for CPU."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def _attempt_store(env: DistEnv) -> dist.Store | None:
    """Under torchrun's static rendezvous the agent's store outlives a group restart: without a prefix
    per attempt, a restarted rank reads the gloo addresses its dead predecessors published and times
    out connecting to them. torch adds no prefix there (it assumes a new store per restart, as the c10d
    rendezvous makes), so this does. None outside torchelastic: plain env:// initialisation."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agent = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False,
                          timeout=datetime.timedelta(minutes=30))
    return dist.PrefixStore(f"rljob/attempt_{attempt}", agent)


class Distributed:
    """The process groups of a multi-rank job (see the module docstring for which carries what)."""

    def __init__(self, env: DistEnv, device: str) -> None:
        """Join the default group (blocks until every rank has joined) and create the control group."""
        self.env = env
        self.backend = backend_for(device)
        if self.backend == "nccl":
            torch.cuda.set_device(env.local_rank)
        if not dist.is_initialized():
            store = _attempt_store(env)
            if store is None:
                dist.init_process_group(self.backend, init_method="env://", rank=env.rank, world_size=env.world_size)
            else:
                dist.init_process_group(self.backend, store=store, rank=env.rank, world_size=env.world_size)
        self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        log.info("rank %d/%d joined the %s group at %s:%d", env.rank, env.world_size, self.backend,
                 env.master_addr, env.master_port)

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_leader(self) -> bool:
        """Rank 0: the rollout scheduler, the engines, status and metrics live here."""
        return self.env.rank == 0

    def device(self, configured: str) -> str:
        """This rank's device: its own GPU (LOCAL_RANK) for a cuda trainer, the CPU otherwise."""
        return f"cuda:{self.env.local_rank}" if self.backend == "nccl" else configured

    def broadcast(self, value: Any = None) -> Any:
        """Rank 0's `value`, on every rank (the others pass nothing)."""
        box = [value if self.is_leader else None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def scatter(self, values: list[Any] | None = None) -> Any:
        """values[r] on rank r; only rank 0 passes the list (one entry per rank)."""
        if self.is_leader and (values is None or len(values) != self.world_size):
            raise ValueError(f"scatter needs one value per rank ({self.world_size})")
        out: list[Any] = [None]
        dist.scatter_object_list(out, values if self.is_leader else None, src=0, group=self.control)
        return out[0]

    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` is true on any rank (every rank calls it at the same point; control group).

        The stop vote of the step boundary: SIGTERM may reach only some ranks (one pod of a multi-node
        group deleted), and every rank must learn of it at the same step so that none exits alone."""
        votes = torch.tensor([int(flag)], dtype=torch.int32)
        dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=self.control)
        return bool(votes.item())

    def barrier(self) -> None:
        """Wait for every rank (on the control group: no device memory involved)."""
        dist.barrier(group=self.control)

    def close(self) -> None:
        """Leave the groups (the job is done on this rank)."""
        if dist.is_initialized():
            dist.destroy_process_group()
