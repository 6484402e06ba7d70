"""FSDP2 training backend: every rank holds a shard of each parameter (`fully_shard`), gathers a
block's full weights for its forward and backward, and reduce-scatters the gradients.

Sharding follows the recipe of the FSDP2 docs: each decoder layer is its own unit (one all-gather
per layer, freed after use), then the root takes the rest (embeddings, final norm, output head).
The trainer computes log-probs from the decoder body and the head's weight, not through the model's
own forward (trainer._token_stats), so the root's gather is attached to `forward`'s stand-in through
`register_fsdp_forward_method`.

Gradients are summed, not averaged, over ranks: the trainer divides every rank's loss by the global
loss denominator already, so the sum of the ranks' gradients is the gradient of the whole batch.

bf16: the shards stay float32 (they are the master weights, and AdamW's state is float32) and
`MixedPrecisionPolicy` casts the gathered weights to bf16 for compute, with float32 gradient reduction.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeGuard, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, Shard

from rljob.runtime.training.distributed import Distributed
from rljob.runtime.weight_group import lay_flat
from rljob.runtime.weights.buckets import Bucket, PlannedBuckets, named_buckets
from rljob.runtime.weights.wire_dtype import as_wire, wire_dtype_of

if TYPE_CHECKING:
    # backend.py builds this backend (a lazy import there), so the protocol's types come type-only.
    from rljob.runtime.training.backend import ReduceOp

log = logging.getLogger(__name__)
T = TypeVar("T")
_FORWARD = "_rljob_forward"
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _run(self: nn.Module, fn: Callable[..., Any], *args: Any) -> Any:
    return fn(self, *args)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a Hugging Face decoder (model.model.layers), each an FSDP unit."""
    # (nn.Module types unknown attributes as Tensor | Module; callable() was checked)
    body = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else None  # type: ignore[operator]
    layers = getattr(body, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"{type(model).__name__}: no decoder layers (model.get_decoder().layers) to shard")
    return list(layers)


def _unique(bucket: Bucket) -> list[torch.Tensor]:
    """The bucket's tensors, each once (a tied tensor is listed under several names)."""
    return list({id(t): t for _, t in bucket}.values())


def _row_sharded(tensor: torch.Tensor) -> TypeGuard[DTensor]:
    """A DTensor split by rows over a 1-D mesh: what fully_shard makes of every parameter."""
    return isinstance(tensor, DTensor) and tensor.device_mesh.ndim == 1 and tensor.placements == (Shard(0),)


def _rows_of(full: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """Each rank's rows of `full` as views, as fully_shard splits them (torch.chunk, then empty
    chunks for the ranks past the last row), so a shard is received straight into its place."""
    parts = list(full.chunk(world_size, dim=0))
    return parts + [full[:0]] * (world_size - len(parts))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _full_slots(planned: Bucket, wire: list[torch.dtype]) -> list[torch.Tensor]:
    """Where each name of a planned bucket gets its full tensor, on the shards' device: views of one
    buffer in the flattened layout (weight_group.lay_flat), else, for a layout that would be unaligned,
    a new tensor per distinct tensor, which all its names share."""
    device = _local(planned[0][1]).device
    laid = lay_flat(wire, [t.shape for _, t in planned], device)
    if laid is not None:
        return laid[1]
    made: dict[int, torch.Tensor] = {}
    for (_, tensor), dtype in zip(planned, wire, strict=True):
        if id(tensor) not in made:
            made[id(tensor)] = torch.empty(tensor.shape, dtype=dtype, device=device)
    return [made[id(tensor)] for _, tensor in planned]


def _start_p2p(ops: list[dist.P2POp]) -> list[dist.Work]:
    # Point-to-point into rank 0, not an all-gather: over gloo an all-gather moves every shard to
    # every rank and costs 2.5-3x a broadcast of the same bytes (benchmarks/weight_sync.py).
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()


def _gather_the_rest(unique: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Collective (every rank, in plan order): the full value of each tensor not sharded by rows
    (a DTensor of another placement is all-gathered; a plain tensor is itself), keyed by id."""
    rest = {}
    for tensor in unique:
        if not _row_sharded(tensor):
            value = tensor.detach()
            rest[id(tensor)] = value.full_tensor() if isinstance(value, DTensor) else value
    return rest


def _shard(model: nn.Module, mp_policy: MixedPrecisionPolicy) -> nn.Module:
    """The wrapping every sharded model here gets: one FSDP unit per decoder layer, the root for the
    rest, and `_FORWARD` as a root forward method (the trainer calls the body and head directly)."""
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    assert isinstance(model, FSDPModule)
    setattr(model, _FORWARD, _run.__get__(model, type(model)))
    register_fsdp_forward_method(model, _FORWARD)
    return model


class FrozenFSDP2:
    """The frozen KL reference under the policy's wrapping: every rank holds a shard of it, in the
    dtype it was loaded in, and each forward gathers one unit at a time (a collective, like the
    policy's). No optimizer, no gradients: nothing of it changes after the start."""

    def __init__(self, model: nn.Module) -> None:
        """Shard `model` (a copy of the policy made before the policy was sharded) in place."""
        model.eval()
        model.requires_grad_(False)
        self.model = _shard(model, MixedPrecisionPolicy())

    def forward(self, fn: Callable[..., T], *args: Any) -> T:
        """Collective: `fn(model, *args)` between the root's all-gather and reshard."""
        return getattr(self.model, _FORWARD)(fn, *args)


class FSDP2Backend:
    """One rank of a `fully_shard` data-parallel trainer (see the module docstring)."""

    def __init__(self, model: nn.Module, learning_rate: float, weight_decay: float, distributed: Distributed) -> None:
        """Shard `model` in place across the default process group and build AdamW over the shards."""
        self.distributed = distributed
        self.rank = distributed.rank
        self.world_size = distributed.world_size
        compute_dtype = next(model.parameters()).dtype
        mp_policy = MixedPrecisionPolicy()
        if compute_dtype in (torch.bfloat16, torch.float16):
            model.to(torch.float32)  # the shards are the fp32 master weights
            mp_policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        _shard(model, mp_policy)
        for module in model.modules():
            if isinstance(module, FSDPModule):  # per unit: sum over ranks, the loss is globally normalised
                module.set_gradient_divide_factor(1.0)
                # A plain SUM reduce-scatter: for fp32/bf16 a factor other than the world size would
                # otherwise become ReduceOp.PREMUL_SUM, which NCCL has and gloo refuses.
                module.set_force_sum_reduction_for_comms(True)
        self.model = model
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=learning_rate, weight_decay=weight_decay
        )
        log.info("rank %d: model sharded over %d ranks with fully_shard (%d layer units + root)",
                 self.rank, self.world_size, len(decoder_layers(model)))

    def forward(self, fn: Callable[..., T], *args: Any) -> T:
        """Collective: `fn(model, *args)` between the root's all-gather and reshard (FSDP's forward hooks)."""
        return getattr(self.model, _FORWARD)(fn, *args)

    def all_reduce(self, values: Sequence[float], op: ReduceOp = "sum") -> list[float]:
        """Collective: element-wise reduction of `values` (float64, so token counts stay exact)."""
        device = torch.device("cuda", torch.cuda.current_device()) if self.distributed.backend == "nccl" else None
        tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
        dist.all_reduce(tensor, op=_OPS[op])
        return tensor.tolist()

    def clip_grad_norm(self, max_norm: float) -> float:
        """Collective: the global gradient norm (torch reduces the DTensor shards' norms), then clipping."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)

    def iter_full_weights(self, bucket_bytes: int, dtype: torch.dtype | None = None) -> Iterator[Bucket]:
        """Collective: the full, unsharded state of the model on rank 0, `bucket_bytes` at a time.

        Every rank must iterate this generator to its end, in step with the others. Rank 0 receives
        buckets of (Hugging Face parameter name, full tensor on its device) of at most `bucket_bytes` each
        (a larger tensor comes alone; weights/buckets.py); the other ranks send their shards of each
        bucket and receive no bucket. Floating-point tensors travel and arrive in rank 0's `dtype` (None:
        the training dtype): every rank casts its shard before sending it, so an fp32 trainer gathers
        half the bytes for bf16 engines. The other ranks join a sync without being told that dtype:
        rank 0's is broadcast first. A bucket is planned from the shards' full sizes before any of it
        is gathered, so rank 0 holds one bucket of full tensors at a time (plus what its consumer
        keeps), never the whole model. Tied weights (an output head sharing the embedding) are gathered
        once and listed under each of their names, in the same bucket.
        """
        dtype = self._rank0_dtype(dtype)
        plan = list(named_buckets(self._sharded(), bucket_bytes, key=id, dtype=dtype))
        # A tag per tensor of the whole pass, not per bucket: a shard meets its receive by tag, so ranks
        # whose buckets were cut differently still pair every shard with its place (no deadlock).
        tags = {id(t): tag for tag, t in enumerate(t for bucket in plan for t in _unique(bucket))}
        if self.rank == 0:
            return PlannedBuckets(plan, lambda planned: self._gather_bucket(planned, tags, dtype))
        return self._send_buckets(plan, tags, dtype)

    def _rank0_dtype(self, dtype: torch.dtype | None) -> torch.dtype | None:
        """Collective: rank 0's `dtype` on every rank."""
        if self.world_size == 1:
            return dtype
        box = [dtype if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _sharded(self) -> Iterator[tuple[str, torch.Tensor]]:
        # State-dict order, every name of a tied tensor right after its first (FSDP2 ties share the object).
        aliases: dict[int, list[str]] = {}
        state = self.model.state_dict(keep_vars=True)
        for name, tensor in state.items():
            aliases.setdefault(id(tensor), []).append(name)
        done: set[int] = set()
        for tensor in state.values():
            if id(tensor) not in done:
                done.add(id(tensor))
                yield from ((alias, tensor) for alias in aliases[id(tensor)])

    def _gather_bucket(self, planned: Bucket, tags: dict[int, int], dtype: torch.dtype | None) -> Bucket:
        """Rank 0: one bucket of full tensors in `dtype`, received from the other ranks' shards in one batch.

        The bucket is laid flat where its layout allows: every name's tensor a view of one buffer, back
        to back in the bucket's order (the weight-update group's flattened layout, weight_group.py), so
        the distributed transport broadcasts that buffer as it is, without a copy of the bucket on
        rank 0's side of every sync (weight_group.lying_flat)."""
        unique = _unique(planned)
        slots = _full_slots(planned, [wire_dtype_of(t, dtype) for _, t in planned])
        full: dict[int, torch.Tensor] = {}  # each distinct tensor's place: its first name's slot
        for (_, tensor), slot in zip(planned, slots, strict=True):
            full.setdefault(id(tensor), slot)
        receives: list[dist.P2POp] = []
        own: list[tuple[torch.Tensor, DTensor]] = []  # rank 0's rows of each tensor, and its shard
        for tensor in filter(_row_sharded, unique):
            parts = _rows_of(full[id(tensor)], self.world_size)
            own.append((parts[0], tensor))
            receives += [dist.P2POp(dist.irecv, part, group=tensor.device_mesh.get_group(), group_peer=r,
                                    tag=tags[id(tensor)]) for r, part in enumerate(parts) if r > 0 and part.numel()]
        # Every receive is posted first: the other ranks' shards arrive while rank 0 copies (and casts) its own.
        works = _start_p2p(receives)
        for rows, tensor in own:
            rows.copy_(tensor.to_local().detach())  # cast in the copy
        _wait(works)
        for key, value in _gather_the_rest(unique).items():
            full[key].copy_(value)
        for (_, tensor), slot in zip(planned, slots, strict=True):
            if slot is not full[id(tensor)]:
                slot.copy_(full[id(tensor)])  # a tied tensor's other name has a place of its own in the layout
        # Left on the device they were gathered on: an NCCL broadcast sends them from there (a trip through
        # the host would cost two PCIe copies per bucket), safetensors and the embedded engine's copy
        # take them from any device, as they take a single-process trainer's live tensors.
        return [(name, slot) for (name, _), slot in zip(planned, slots, strict=True)]

    def _send_buckets(self, plan: list[Bucket], tags: dict[int, int], dtype: torch.dtype | None) -> Iterator[Bucket]:
        """Ranks > 0: each bucket's shards to rank 0 in `dtype`, in step with its _gather_bucket; no bucket here."""
        for planned in plan:
            unique = _unique(planned)
            _wait(_start_p2p([dist.P2POp(dist.isend, as_wire(local, dtype).contiguous(), group_peer=0,
                                         group=tensor.device_mesh.get_group(), tag=tags[id(tensor)])
                              for tensor in filter(_row_sharded, unique) if (local := tensor.to_local().detach()).numel()]))
            _gather_the_rest(unique)
        yield from ()

    def checkpoint_state(self) -> dict[str, Any]:
        """{"model", "optim"}: sharded DTensors under their parameter names (torch.distributed.checkpoint
        reshards them on load to whatever world size the loading job has)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state}

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Install a loaded {"model", "optim"} into the shards and the optimizer."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
