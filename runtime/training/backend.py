"""The training backend: where the policy's parameters live and how gradients and weights cross ranks.

The trainer (runtime/trainer.py) owns the algorithm: batches, losses, PPO mini-batches. A backend
owns the parallelism: it wraps the model, builds the optimizer, runs forwards so that sharded
parameters are gathered, reduces the step's counts across ranks, clips by the global gradient norm,
hands out full weights for a sync and the state a checkpoint saves. Two implementations:

- `SingleProcessBackend`: one process, the model as it is (today's path; bf16 parameters get fp32
  master weights, models/precision.py);
- `FSDP2Backend` (training/fsdp.py): one rank per process, parameters sharded by
  `torch.distributed.fsdp.fully_shard`.

A megatron-core backend (tensor/pipeline parallel) would be a third implementation of the same
protocol; the trainer would not change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

import torch
from torch import nn

from rljob.runtime.models.precision import MasterWeightAdamW, build_optimizer

if TYPE_CHECKING:
    from rljob.runtime.training.distributed import Distributed

T = TypeVar("T")
ReduceOp = Literal["sum", "max", "min"]
NamedTensors = list[tuple[str, torch.Tensor]]
Optimizer = torch.optim.Optimizer | MasterWeightAdamW


class TrainingBackend(Protocol):
    """What the trainer needs from the parallelism under it. Methods marked collective must be called
    by every rank, in the same order, or the job hangs."""

    rank: int
    world_size: int
    model: nn.Module  # the policy as the trainer runs it (under FSDP2 its parameters are DTensor shards)
    optimizer: Optimizer

    def forward(self, fn: Callable[..., T], *args: Any) -> T:
        """Collective (FSDP2): `fn(model, *args)` with the model's parameters usable (gathered)."""
        ...

    def all_reduce(self, values: Sequence[float], op: ReduceOp = "sum") -> list[float]:
        """Collective: the element-wise sum / max / min of `values` over all ranks."""
        ...

    def clip_grad_norm(self, max_norm: float) -> float:
        """Collective: clip the gradients to a global L2 norm of `max_norm`; returns the norm before clipping."""
        ...

    def iter_full_weights(self, bucket_bytes: int) -> Iterator[NamedTensors]:
        """Collective: the full (unsharded) named parameters and buffers, in buckets of about `bucket_bytes`."""
        ...

    def checkpoint_state(self) -> dict[str, Any]:
        """Model and optimizer state for torch.distributed.checkpoint (sharded tensors under FSDP2);
        also the template a load fills in place."""
        ...

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Install a state that torch.distributed.checkpoint loaded into `checkpoint_state()`'s template."""
        ...


def bucketed(named: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[NamedTensors]:
    """Group (name, tensor) pairs into lists of at least `bucket_bytes` (the last may be smaller);
    a tensor larger than a bucket is a bucket of its own."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    bucket: NamedTensors = []
    size = 0
    for name, tensor in named:
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


class SingleProcessBackend:
    """One process holds the whole model; every collective is the identity."""

    rank = 0
    world_size = 1

    def __init__(self, model: nn.Module, learning_rate: float, weight_decay: float) -> None:
        self.model = model
        # bf16 parameters get fp32 master weights and fp32 AdamW state (models/precision.py).
        self.optimizer: Optimizer = build_optimizer(model, learning_rate, weight_decay)

    def forward(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(model, *args)`."""
        return fn(self.model, *args)

    def all_reduce(self, values: Sequence[float], op: ReduceOp = "sum") -> list[float]:
        """`values` unchanged (one rank)."""
        return list(values)

    def clip_grad_norm(self, max_norm: float) -> float:
        """torch's clip_grad_norm_ over the model's parameters."""
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))

    def iter_full_weights(self, bucket_bytes: int) -> Iterator[NamedTensors]:
        """The model's state dict (the live tensors, detached), in buckets of about `bucket_bytes`."""
        return bucketed(((n, t.detach()) for n, t in self.model.state_dict().items()), bucket_bytes)

    def checkpoint_state(self) -> dict[str, Any]:
        """{"model", "optim"} in torch.distributed.checkpoint's layout (parameter names as keys), so a
        checkpoint of this backend and of FSDP2 load into each other; the bf16 master-weight optimizer
        keeps its own layout (it exists in one process only)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        optim = self.optimizer
        if isinstance(optim, MasterWeightAdamW):
            return {"model": get_model_state_dict(self.model), "master_optim": _master_state_template(optim)}
        return {"model": get_model_state_dict(self.model), "optim": get_optimizer_state_dict(self.model, optim)}

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Install what torch.distributed.checkpoint loaded into checkpoint_state()."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        set_model_state_dict(self.model, state["model"])
        if isinstance(self.optimizer, MasterWeightAdamW):
            self.optimizer.load_state_dict(state["master_optim"])
        else:
            set_optimizer_state_dict(self.model, self.optimizer, state["optim"])


def _master_state_template(optim: MasterWeightAdamW) -> dict[str, Any]:
    """The master-weight optimizer's state with its AdamW moments created, so a checkpoint load has
    tensors to fill (torch creates AdamW state lazily, at the first step)."""
    inner = optim.inner
    for group in inner.param_groups:
        for p in group["params"]:
            if p not in inner.state:
                inner.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                  "exp_avg_sq": torch.zeros_like(p)}
    return optim.state_dict()


def build_backend(
    model: nn.Module, learning_rate: float, weight_decay: float, distributed: Distributed | None = None
) -> TrainingBackend:
    """FSDP2 across the ranks of a multi-process job; the single-process backend otherwise."""
    if distributed is None:
        return SingleProcessBackend(model, learning_rate, weight_decay)
    from rljob.runtime.training.fsdp import FSDP2Backend

    return FSDP2Backend(model, learning_rate, weight_decay, distributed)
