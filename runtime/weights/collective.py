"""A process group of its own between trainer rank 0 and the engine ranks, for weight broadcasts.

It is built from a TCPStore and a ProcessGroupGloo (or ProcessGroupNCCL) directly, not through
``torch.distributed.init_process_group``: the trainer's own default group (its data-parallel ranks)
and the engines' are separate and stay untouched, and the group can be torn down and rebuilt
whenever an engine is replaced or added, as SGLang's ``init_weights_update_group`` does it.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

Backend = Literal["gloo", "nccl"]

# torch dtype <-> the names SGLang's update_weights_from_distributed carries ("bfloat16", ...)
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's name of a torch dtype ("bfloat16")."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype of an SGLang dtype name; ValueError naming the unknown one."""
    try:
        return DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}") from None


def open_store(host: str, port: int, world_size: int, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store; the master (trainer rank 0) binds ``port`` (0 = any free port, see ``.port``)."""
    return dist.TCPStore(
        host, port, world_size, is_master=is_master, timeout=timedelta(seconds=timeout_s), wait_for_workers=False,
        use_libuv=False,
    )


class WeightGroup:
    """One member's handle on a weight-update group; rank 0 is the trainer and broadcasts."""

    def __init__(
        self,
        store: dist.Store,
        group_name: str,
        rank: int,
        world_size: int,
        backend: Backend,
        timeout_s: float,
    ) -> None:
        """Blocks until every rank has joined (or ``timeout_s`` passed: RuntimeError)."""
        self.group_name = group_name
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.timeout = timedelta(seconds=timeout_s)
        prefixed = dist.PrefixStore(group_name, store)
        self._store = store  # the master's store must outlive the group
        if backend == "gloo":
            self._pg: dist.ProcessGroup = dist.ProcessGroupGloo(prefixed, rank, world_size, self.timeout)
        else:  # pragma: no cover - needs GPUs
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            self._pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast ``tensor`` from rank 0 in place (receivers pass an empty tensor of the right shape)."""
        self._pg.broadcast(tensor, 0, self.timeout).wait(self.timeout)

    def close(self) -> None:
        """Drop the group (peers that still wait on it time out)."""
        shutdown = getattr(self._pg, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except RuntimeError as exc:  # already broken: nothing left to release
                log.debug("weight group %s shutdown: %s", self.group_name, exc)


def join_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
               timeout_s: float, backend: Backend = "gloo") -> WeightGroup:
    """An engine rank joins the trainer's group (blocks until every rank is in)."""
    if rank <= 0 or rank >= world_size:
        raise ValueError(f"rank_offset {rank} outside 1..{world_size - 1}: rank 0 is the trainer")
    store = open_store(master_address, master_port, world_size, is_master=False, timeout_s=timeout_s)
    return WeightGroup(store, group_name, rank, world_size, backend, timeout_s)


def receive_tensors(group: WeightGroup, names: list[str], dtypes: list[str],
                    shapes: list[list[int]]) -> list[tuple[str, torch.Tensor]]:
    """Receive one bucket: one broadcast per tensor, in the order the trainer listed them."""
    out = []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        tensor = torch.empty(shape, dtype=dtype_of(dtype), device=group.device)
        group.broadcast(tensor)
        out.append((name, tensor))
    return out
