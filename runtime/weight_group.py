"""The weight-update group: trainer rank 0 and every engine rank, for weight broadcasts.

It is laid out exactly as SGLang's engine side lays it out (``init_custom_process_group`` in
``sglang/srt/utils/common.py``, 0.5.5.post3 and 0.5.23), so the store keys of both sides meet:

- the store is a ``TCPStore`` hosted by rank 0 at ``tcp://master_address:master_port`` (SGLang's
  engine ranks reach it through ``torch.distributed.rendezvous`` of that URL);
- it is wrapped in ``PrefixStore(group_name, store)``;
- torch's ``_new_process_group_helper`` builds the group on that store, prefixing it again with
  ``"<group_name>/"`` and then ``"<device>/"`` (``cpu/`` for gloo, ``cuda/`` for NCCL).

A key such as gloo's rank-1 address therefore lives at ``<group>/<group>//cpu/...`` in rank 0's
store. The group is not the trainer's default group (its data-parallel ranks stay untouched) and is
torn down and rebuilt whenever an engine is replaced or added.

A bucket travels as one broadcast per tensor (SGLang 0.5.5.post3's ``update_weights_from_distributed``;
its request has no ``load_format``) or, to a release that takes ``load_format: "flattened_bucket"``
(0.5.23's ``weight_updater.receive_weights_from_distributed``), as one broadcast of a uint8 buffer
holding every listed tensor's bytes back to back in the order of ``names``
(``FlattenedTensorBucket.empty``, which refuses a tensor that would start at an offset that is not a
multiple of its item size). On the CPU benchmark the per-tensor broadcasts cost 1.3-1.9x one broadcast
of the same bytes; on GPUs each is an NCCL call. A release is assumed to take the flattened format only
from the one it was read in: an older one would drop the field and wait for broadcasts that never come.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
from packaging.version import InvalidVersion, Version

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


def open_store(host: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store, bound to ``host:port`` (0 = any free port, see ``.port``).

    What ``rendezvous("tcp://host:port")`` gives rank 0, built directly: under torchrun
    (``TORCHELASTIC_USE_AGENT_STORE``) ``rendezvous`` would make rank 0 a client of the agent's
    store, and no engine could reach that. It does not wait for the engines: they are told the port
    only after it is bound.
    """
    return dist.TCPStore(
        host, port, world_size, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False,
    )


def group_store(store: dist.Store, group_name: str) -> dist.PrefixStore:
    """The store as ``init_custom_process_group`` hands it to torch: ``PrefixStore(group_name, store)``."""
    return dist.PrefixStore(group_name, store)


def backend_store(store: dist.Store, group_name: str, backend: Backend) -> dist.PrefixStore:
    """The store ``_new_process_group_helper`` gives the backend of ``group_store(store, group_name)``:
    prefixed with ``"<group_name>/"``, then with the device the backend serves first (``cpu/`` for
    gloo, ``cuda/`` for NCCL). Only the CPU server builds its ranks from it (see ``join_group``);
    tests check it against the helper's own layout."""
    device = "cpu" if backend == "gloo" else "cuda"
    return dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{group_name}/", group_store(store, group_name)))


FLATTENED_BUCKET = "flattened_bucket"
FIRST_FLATTENED_RELEASE = Version("0.5.23")


def takes_flattened_buckets(release: str | None) -> bool:
    """Whether a worker of SGLang ``release`` (its server info's ``version``) takes ``flattened_bucket``."""
    if release is None:
        return False
    try:
        return Version(release) >= FIRST_FLATTENED_RELEASE
    except InvalidVersion:
        return False


def byte_offsets(dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]) -> list[int] | None:
    """Where each tensor starts in a flattened bucket, then its total size (one more entry than
    tensors); None when a tensor would start unaligned (the receiver refuses such a bucket)."""
    offsets = [0]
    for dtype, shape in zip(dtypes, shapes, strict=True):
        if offsets[-1] % dtype.itemsize:
            return None
        offsets.append(offsets[-1] + torch.Size(shape).numel() * dtype.itemsize)
    return offsets


def lay_flat(dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]],
             device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """A new uint8 buffer for tensors of these dtypes and shapes back to back (the flattened bucket's
    layout), and each tensor as a view of it; None when one would start unaligned."""
    offsets = byte_offsets(dtypes, shapes)
    if offsets is None:
        return None
    buffer = torch.empty(offsets[-1], dtype=torch.uint8, device=device)
    return buffer, [buffer[start:end].view(dtype).view(tuple(shape))
                    for dtype, shape, start, end in zip(dtypes, shapes, offsets, offsets[1:], strict=False)]


def lying_flat(tensors: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype],
               device: torch.device) -> torch.Tensor | None:
    """The uint8 buffer that ``tensors`` already are the views of, exactly in the flattened layout of
    these dtypes (what lay_flat makes, and what a sharded trainer gathers each bucket into:
    training/fsdp.py), so it is broadcast without a copy; None when they are laid out any other way."""
    offsets = byte_offsets(dtypes, [t.shape for t in tensors])
    if offsets is None or not tensors:
        return None
    storage = tensors[0].untyped_storage()
    base = storage.data_ptr()
    if storage.device != device or storage.nbytes() != offsets[-1]:
        return None
    for tensor, dtype, start in zip(tensors, dtypes, offsets, strict=False):
        if tensor.dtype != dtype or not tensor.is_contiguous() or tensor.untyped_storage().data_ptr() != base \
                or tensor.data_ptr() != base + start:
            return None
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def empty_flattened(names: Sequence[str], dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]],
                    device: torch.device) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
    """A receiver's buffer for one flattened bucket and the named tensors that are views of it.
    ValueError for an unaligned layout, as SGLang's receiver raises."""
    laid = lay_flat(dtypes, shapes, device)
    if laid is None:
        raise ValueError("unaligned tensor in a flattened bucket: every tensor must start at a multiple of its item size")
    buffer, views = laid
    return buffer, list(zip(names, views, strict=True))


class WeightGroup:
    """One member's handle on a weight-update group; rank 0 is the trainer and broadcasts."""

    def __init__(self, pg: dist.ProcessGroup, group_name: str, rank: int, world_size: int, backend: Backend,
                 timeout_s: float, registered: bool, store: dist.Store) -> None:
        """Wrap a formed group; ``registered``: torch's registry holds it (destroy it there on close)."""
        self._pg = pg
        self.group_name = group_name
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.timeout = timedelta(seconds=timeout_s)
        self._registered = registered
        self._store = store  # rank 0's store daemon must outlive the group
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast ``tensor`` from rank 0 in place (receivers pass an empty tensor of the right shape)."""
        self.broadcast_all([tensor])

    def broadcast_all(self, tensors: Sequence[torch.Tensor]) -> None:
        """Broadcast each of ``tensors`` from rank 0, in order: every broadcast is posted, then all are
        waited on, as SGLang's ``update_weights_from_distributed`` receives a bucket (``async_op=True``),
        so the tensors of a bucket do not each wait for the one before to be acknowledged."""
        works = [self._pg.broadcast(tensor, 0, self.timeout) for tensor in tensors]
        for work in works:
            work.wait(self.timeout)

    def close(self) -> None:
        """Drop the group (peers that still wait on it time out)."""
        try:
            if self._registered:
                dist.destroy_process_group(self._pg)
            else:
                self._pg.shutdown()
        except (RuntimeError, ValueError) as exc:  # already broken or gone: nothing left to release
            log.debug("weight group %s shutdown: %s", self.group_name, exc)


def create_group(store: dist.Store, group_name: str, world_size: int, backend: Backend,
                 timeout_s: float) -> WeightGroup:
    """Trainer rank 0 forms the group on its own ``open_store`` store, through the same prefix and
    the same torch helper as SGLang's engine ranks. Blocks until every rank has joined (or
    ``timeout_s`` passed: RuntimeError/DistBackendError). ``group_name`` must be new in this process."""
    from torch.distributed.distributed_c10d import _new_process_group_helper, _world

    timeout = timedelta(seconds=timeout_s)
    # No process-group options are passed: the helper's keyword for them was renamed in torch 2.6
    # (pg_options -> backend_options), and None is the default of both.
    pg, _ = _new_process_group_helper(world_size, 0, [], dist.Backend(backend), group_store(store, group_name),
                                      group_name=group_name, timeout=timeout)
    # As SGLang does for its side: the group's ranks are its own, which destroy_process_group expects.
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return WeightGroup(pg, group_name, 0, world_size, backend, timeout_s, registered=True, store=store)


def join_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
               timeout_s: float) -> WeightGroup:
    """An engine rank of the CPU server joins the trainer's group over gloo (blocks until every rank is in).

    Structured as SGLang's ``init_custom_process_group``: ``rendezvous("tcp://addr:port")``, then
    ``PrefixStore(group_name)``, then the process group on the helper's prefixes (``backend_store``).
    It builds the gloo group itself instead of calling torch's helper because the CPU server runs
    all its TP ranks in one process, and the helper registers each group name once per process.
    """
    if rank <= 0 or rank >= world_size:
        raise ValueError(f"rank {rank} outside 1..{world_size - 1}: rank 0 is the trainer")
    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(dist.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                                   timeout=timeout))
    store.set_timeout(timeout)
    pg = dist.ProcessGroupGloo(backend_store(store, group_name, "gloo"), rank, world_size, timeout)
    pg._set_sequence_number_for_group()  # as the helper does: rank 0 sets the number, the others read it
    return WeightGroup(pg, group_name, rank, world_size, "gloo", timeout_s, registered=False, store=store)


def receive_tensors(group: WeightGroup, names: list[str], dtypes: list[str], shapes: list[list[int]],
                    flattened: bool = False) -> list[tuple[str, torch.Tensor]]:
    """Receive one bucket in the order the trainer listed it: one broadcast per tensor, all posted
    before any is waited on (SGLang's model_runner.update_weights_from_distributed, 0.5.5.post3), or
    ``flattened``, one broadcast of a buffer the tensors are views of (0.5.23's ``flattened_bucket``, see
    the module docstring). ValueError for a flattened layout SGLang would refuse."""
    if flattened:
        buffer, views = empty_flattened(names, [dtype_of(d) for d in dtypes], shapes, group.device)
        group.broadcast(buffer)
        return views
    out = [(name, torch.empty(shape, dtype=dtype_of(dtype), device=group.device))
           for name, dtype, shape in zip(names, dtypes, shapes, strict=True)]
    group.broadcast_all([tensor for _, tensor in out])
    return out
