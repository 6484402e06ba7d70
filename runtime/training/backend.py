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
from rljob.runtime.weights.buckets import Bucket, named_buckets

if TYPE_CHECKING:
    from rljob.runtime.training.distributed import Distributed

T = TypeVar("T")
ReduceOp = Literal["sum", "max", "min"]
Optimizer = torch.optim.Optimizer | MasterWeightAdamW


class TrainingBackend(Protocol):
    """What the trainer needs from the parallelism under it. Methods marked collective must be called
    by every rank, in the same order, or the job hangs."""

    rank: int
    world_size: int

    # Read-only to the trainer, so a backend may hold a narrower type (FSDP2: an FSDPModule, AdamW).
    @property
    def model(self) -> nn.Module:
        """The policy as the trainer runs it (under FSDP2 its parameters are DTensor shards)."""
        ...

    @property
    def optimizer(self) -> Optimizer:
        """The optimizer over the model's (local) parameters."""
        ...

    def forward(self, fn: Callable[..., T], *args: Any) -> T:
        """Collective (FSDP2): `fn(model, *args)` with the model's parameters usable (gathered)."""
        ...

    def all_reduce(self, values: Sequence[float], op: ReduceOp = "sum") -> list[float]:
        """Collective: the element-wise sum / max / min of `values` over all ranks."""
        ...

    def clip_grad_norm(self, max_norm: float) -> float:
        """Collective: clip the gradients to a global L2 norm of `max_norm`; returns the norm before clipping."""
        ...

    def iter_full_weights(self, bucket_bytes: int, dtype: torch.dtype | None = None) -> Iterator[Bucket]:
        """Collective: the full (unsharded) named parameters and buffers, in buckets of at most `bucket_bytes` of
        distinct tensors as they travel in rank 0's `dtype` (None: the training dtype; a WeightSource's)."""
        ...

    def checkpoint_state(self) -> dict[str, Any]:
        """Model and optimizer state for torch.distributed.checkpoint (sharded tensors under FSDP2);
        also the template a load fills in place."""
        ...

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Install a state that torch.distributed.checkpoint loaded into `checkpoint_state()`'s template."""
        ...


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

    def iter_full_weights(self, bucket_bytes: int, dtype: torch.dtype | None = None) -> Iterator[Bucket]:
        """The model's state dict (the live tensors, detached: a consumer casts them to `dtype` as it
        sends them), bucketed by their bytes in `dtype` (weights/buckets.py)."""
        return named_buckets(((n, t.detach()) for n, t in self.model.state_dict().items()), bucket_bytes,
                             dtype=dtype)

    def checkpoint_state(self) -> dict[str, Any]:
        """{"model", "optim"} in torch.distributed.checkpoint's layout (parameter names as keys), the
        layout FSDP2's shards have too, so either backend's checkpoint loads into the other at any
        world size. With bf16 parameters "model" holds the fp32 master weights (FSDP2's shards are
        fp32 masters as well) and "optim" the masters' AdamW state under the parameters' names."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        optim = self.optimizer
        if isinstance(optim, MasterWeightAdamW):
            return _master_checkpoint_state(self.model, optim)
        return {"model": get_model_state_dict(self.model), "optim": get_optimizer_state_dict(self.model, optim)}

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Install what torch.distributed.checkpoint loaded into checkpoint_state()."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        if isinstance(self.optimizer, MasterWeightAdamW):
            _load_master_checkpoint_state(self.model, self.optimizer, state)
            return
        set_model_state_dict(self.model, state["model"])
        set_optimizer_state_dict(self.model, self.optimizer, state["optim"])


def _master_names(model: nn.Module, optim: MasterWeightAdamW) -> list[str]:
    """The parameter name of each of the optimizer's masters, in its order (named_parameters lists a
    tied weight once, under its first name, as model.parameters() does)."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [names[id(p)] for p in optim.params]


def _master_checkpoint_state(model: nn.Module, optim: MasterWeightAdamW) -> dict[str, Any]:
    """The master-weight optimizer's checkpoint in DCP's layout: the fp32 masters in place of the bf16
    parameters under "model", the AdamW moments by parameter name under "optim". The tensors are the
    live ones (detached), so a DCP load fills them in place. AdamW's state is created here when no
    step has run yet (torch creates it lazily), so a load has tensors to fill."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    names = _master_names(model, optim)
    masters = {p.data_ptr(): m.detach() for p, m in zip(optim.params, optim.master, strict=True)}
    # (a model state dict holds tensors; its declared value type is every state-dict value)
    model_state = {k: masters.get(v.data_ptr(), v) for k, v in get_model_state_dict(model).items()}  # type: ignore[union-attr]
    inner = optim.inner
    for m in optim.master:
        if m not in inner.state:
            inner.state[m] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(m.detach()),
                              "exp_avg_sq": torch.zeros_like(m.detach())}
    index = {id(m): name for m, name in zip(optim.master, names, strict=True)}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(m)] for m in g["params"]]}
              for g in inner.param_groups]
    optim_state = {"state": {index[id(m)]: inner.state[m] for m in optim.master}, "param_groups": groups}
    return {"model": model_state, "optim": optim_state}


@torch.no_grad()
def _load_master_checkpoint_state(model: nn.Module, optim: MasterWeightAdamW, state: dict[str, Any]) -> None:
    """Install a DCP-layout state (this backend's or FSDP2's, gathered) into the masters, the bf16
    parameters (the masters rounded) and the inner AdamW."""
    names = _master_names(model, optim)
    for name, p, m in zip(names, optim.params, optim.master, strict=True):
        m.copy_(state["model"][name])
        p.copy_(m)
    position = {name: i for i, name in enumerate(names)}
    saved = state["optim"]
    optim.inner.load_state_dict({
        "state": {position[name]: value for name, value in saved["state"].items()},
        "param_groups": [{**g, "params": [position[n] for n in g["params"]]} for g in saved["param_groups"]],
    })


class ReferenceModel(Protocol):
    """The frozen KL reference: its module and a forward like the backend's (collective when sharded)."""

    model: nn.Module

    def forward(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(model, *args)` with the reference's parameters usable (gathered when sharded)."""
        ...


class FrozenModel:
    """The frozen KL reference held whole by the only process (a multi-rank job shards it: fsdp.FrozenFSDP2)."""

    def __init__(self, model: nn.Module) -> None:
        model.eval()
        model.requires_grad_(False)
        self.model = model

    def forward(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(model, *args)`."""
        return fn(self.model, *args)


def build_reference(model: nn.Module, device: torch.device, distributed: Distributed | None = None) -> ReferenceModel:
    """The frozen KL reference over `model` (a copy of the policy, still on the CPU): whole on `device`
    in a single process, else sharded under FSDP2 as the policy is, so no rank holds all of it
    (fully_shard moves each rank's shard to its device). Either has `.model` and `.forward(fn, *args)`."""
    if distributed is None:
        return FrozenModel(model.to(device))
    from rljob.runtime.training.fsdp import FrozenFSDP2

    return FrozenFSDP2(model)


def build_backend(
    model: nn.Module, learning_rate: float, weight_decay: float, distributed: Distributed | None = None
) -> TrainingBackend:
    """FSDP2 across the ranks of a multi-process job; the single-process backend otherwise."""
    if distributed is None:
        return SingleProcessBackend(model, learning_rate, weight_decay)
    from rljob.runtime.training.fsdp import FSDP2Backend

    return FSDP2Backend(model, learning_rate, weight_decay, distributed)
