"""bf16 parameters with fp32 optimizer state: AdamW over fp32 master copies of the model's weights.

With bf16 parameters a plain AdamW keeps its moments in bf16 and, worse, adds each update to a bf16
weight: an update smaller than the weight's bf16 spacing (2^-8 relative) is rounded away, so small
learning rates stop training altogether. The standard cure (mixed-precision training, and FSDP2's
MixedPrecisionPolicy on a cluster) is used here: the optimizer owns fp32 copies of the weights and
its moments; each step copies the bf16 gradients into fp32, steps the fp32 weights, and writes them
back rounded to bf16 for the next forward and for the engines.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


class MasterWeightAdamW:
    """AdamW on fp32 master weights for a model whose parameters are in a lower precision.

    Offers what the trainer uses of a torch optimizer: `param_groups` (learning-rate schedules set
    `lr` there), `zero_grad`, `step`, `state_dict` and `load_state_dict`.
    """

    def __init__(self, params: Iterable[nn.Parameter], **adamw: Any) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.master = [p.detach().to(torch.float32).clone().requires_grad_(True) for p in self.params]
        self.inner = torch.optim.AdamW(self.master, **adamw)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner AdamW's parameter groups (they hold the fp32 masters and the learning rate)."""
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's and the masters' gradients."""
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        self.inner.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self) -> None:
        """One AdamW step on the masters from the model's gradients; the model gets the rounded result."""
        for p, m in zip(self.params, self.master, strict=True):
            m.grad = None if p.grad is None else p.grad.to(torch.float32)
        self.inner.step()
        for p, m in zip(self.params, self.master, strict=True):
            p.copy_(m)

    def state_dict(self) -> dict[str, Any]:
        """AdamW state and the fp32 masters (the model's bf16 weights alone would lose their low bits)."""
        return {"adamw": self.inner.state_dict(), "master": [m.detach().clone() for m in self.master]}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict() saved, masters included, and round them into the model."""
        if len(state["master"]) != len(self.master):
            raise ValueError(
                f"optimizer checkpoint holds {len(state['master'])} master tensors but the model has {len(self.master)}"
            )
        for p, m, saved in zip(self.params, self.master, state["master"], strict=True):
            m.copy_(saved)
            p.copy_(m)
        self.inner.load_state_dict(state["adamw"])


def build_optimizer(model: nn.Module, learning_rate: float, weight_decay: float) -> torch.optim.Optimizer | MasterWeightAdamW:
    """AdamW for an fp32 (or fp64) model; fp32 master-weight AdamW when any trainable parameter is in lower precision."""
    params = [p for p in model.parameters() if p.requires_grad]
    if all(p.dtype in (torch.float32, torch.float64) for p in params):
        return torch.optim.AdamW(params, lr=learning_rate, weight_decay=weight_decay)
    return MasterWeightAdamW(params, lr=learning_rate, weight_decay=weight_decay)
