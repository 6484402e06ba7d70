"""bf16 parameters with fp32 master weights and AdamW state; gradient checkpointing in the trainer."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from rljob.api.spec import AlgorithmSpec
from rljob.runtime.models.loading import enable_gradient_checkpointing, is_checkpointing, load_causal_lm
from rljob.runtime.models.precision import MasterWeightAdamW, build_optimizer
from rljob.runtime.rollout.sample import Group, Sample, SampleStatus
from rljob.runtime.trainer import Trainer


def _constant_grad_steps(optimizer: object, param: nn.Parameter, steps: int) -> None:
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)  # type: ignore[attr-defined]
        param.grad = torch.ones_like(param)  # exactly representable in bf16: both runs see the same gradient
        optimizer.step()  # type: ignore[attr-defined]


def test_master_weights_keep_updates_that_bf16_would_round_away() -> None:
    lr, steps = 1e-4, 200
    bf16 = nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    naive = nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    reference = nn.Parameter(torch.ones(8, dtype=torch.float32))
    master = MasterWeightAdamW([bf16], lr=lr, weight_decay=0.0)
    _constant_grad_steps(master, bf16, steps)
    _constant_grad_steps(torch.optim.AdamW([naive], lr=lr, weight_decay=0.0), naive, steps)
    _constant_grad_steps(torch.optim.AdamW([reference], lr=lr, weight_decay=0.0), reference, steps)

    # Each step moves a weight by ~lr = 1e-4, below bf16's spacing at 1.0 (2^-7): plain bf16 AdamW never moves.
    assert torch.equal(naive.detach(), torch.ones(8, dtype=torch.bfloat16))
    # The fp32 masters follow fp32 AdamW exactly (same gradients, same fp32 arithmetic) ...
    assert torch.equal(master.master[0].detach(), reference.detach())
    assert master.inner.state[master.master[0]]["exp_avg"].dtype == torch.float32
    # ... and the model holds their bf16 rounding, which has moved by now (1 - 200 * 1e-4 = 0.98).
    assert torch.equal(bf16.detach(), reference.detach().to(torch.bfloat16))
    assert float(bf16.detach()[0]) < 1.0


def test_master_weight_state_round_trips() -> None:
    param = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    optimizer = MasterWeightAdamW([param], lr=1e-4)
    _constant_grad_steps(optimizer, param, 3)
    state = copy.deepcopy(optimizer.state_dict())

    restored_param = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    restored = MasterWeightAdamW([restored_param], lr=1e-4)
    restored.load_state_dict(state)
    _constant_grad_steps(optimizer, param, 2)
    _constant_grad_steps(restored, restored_param, 2)
    assert torch.equal(restored.master[0], optimizer.master[0]) and torch.equal(restored_param, param)


def test_trainer_uses_master_weights_for_a_bf16_model(tiny_hf_models: dict[str, Path]) -> None:
    bf16 = Trainer(load_causal_lm(tiny_hf_models["qwen3"], dtype=torch.bfloat16), AlgorithmSpec())
    fp32 = Trainer(load_causal_lm(tiny_hf_models["qwen3"]), AlgorithmSpec())
    assert isinstance(bf16.optimizer, MasterWeightAdamW)
    assert isinstance(fp32.optimizer, torch.optim.AdamW)
    assert isinstance(build_optimizer(nn.Linear(2, 2), 1e-3, 0.0), torch.optim.AdamW)


def _group() -> Group:
    """One group of two finished samples with different rewards (a non-zero gradient)."""
    prompt = [1, 20, 30, 40]
    samples = [
        Sample("g", i, prompt, "", response_ids=resp, logprobs=[-1.0] * len(resp), versions=[0] * len(resp),
               status=SampleStatus.COMPLETED, reward=float(i))
        for i, resp in enumerate([[50, 60, 70, 2], [55, 65, 75, 85, 95, 2]])
    ]
    return Group("g", "prompt", samples)


def test_gradient_checkpointing_recomputes_layers_and_trains_identically(tiny_hf_models: dict[str, Path]) -> None:
    plain = load_causal_lm(tiny_hf_models["llama"])
    checkpointed = load_causal_lm(tiny_hf_models["llama"])
    enable_gradient_checkpointing(checkpointed)
    assert is_checkpointing(checkpointed) and not is_checkpointing(plain)
    mlp_calls = {"plain": 0, "checkpointed": 0}
    # A pre-hook: torch stops a recompute once the tensors backward needs exist, before the MLP's forward ends.
    plain.model.layers[0].mlp.register_forward_pre_hook(lambda *_: mlp_calls.__setitem__("plain", mlp_calls["plain"] + 1))
    checkpointed.model.layers[0].mlp.register_forward_pre_hook(
        lambda *_: mlp_calls.__setitem__("checkpointed", mlp_calls["checkpointed"] + 1)
    )

    trainers = [Trainer(m, AlgorithmSpec(learning_rate=1e-3)) for m in (plain, checkpointed)]
    metrics = [t.train_step([_group()], policy_version=0) for t in trainers]

    # Forward, then backward: a checkpointed layer runs its forward again during backward.
    assert mlp_calls == {"plain": 1, "checkpointed": 2}
    assert metrics[0].optimizer_steps == metrics[1].optimizer_steps == 1
    # The recompute repeats the same fp32 kernels on the same inputs, so the update is the same bit for bit.
    for (name, a), b in zip(plain.state_dict().items(), checkpointed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
