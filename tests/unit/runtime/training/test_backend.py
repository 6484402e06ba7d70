"""The single-process training backend on the tiny transformer (bucketing: tests/unit/runtime/weights/test_buckets.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from rljob.runtime.models.precision import MasterWeightAdamW
from rljob.runtime.training.backend import SingleProcessBackend, build_backend

from tests.helpers.tiny_model import build_tiny_model

IDS = torch.tensor([[3, 17, 42, 9, 77, 5], [8, 8, 1, 64, 2, 99]])


def loss_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of `ids` under `model`."""
    logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def weights(backend: SingleProcessBackend) -> dict[str, torch.Tensor]:
    return {n: t.clone() for bucket in backend.iter_full_weights(1 << 20) for n, t in bucket}


def test_without_ranks_the_backend_is_the_model_itself():
    model = build_tiny_model(seed=0)
    backend = build_backend(model, learning_rate=1e-3, weight_decay=0.0)
    assert isinstance(backend, SingleProcessBackend) and backend.model is model
    assert (backend.rank, backend.world_size) == (0, 1)
    assert backend.all_reduce([1.0, 2.5], "max") == [1.0, 2.5]
    assert backend.forward(lambda m, x: (m, x), 7) == (model, 7)
    full = weights(backend)
    assert list(full) == list(model.state_dict())
    assert all(torch.equal(full[n], t) for n, t in model.state_dict().items())


def test_clipping_reports_the_norm_before_and_scales_the_gradients_to_the_limit():
    backend = SingleProcessBackend(build_tiny_model(seed=0), learning_rate=1e-3, weight_decay=0.0)
    loss_of(backend.model, IDS).backward()
    grads = [p.grad for p in backend.model.parameters() if p.grad is not None]
    before = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
    assert before > 0.01
    assert backend.clip_grad_norm(0.01) == pytest.approx(before, rel=1e-5)
    after = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
    assert after == pytest.approx(0.01, rel=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_checkpoint_state_restores_weights_and_optimizer_after_more_steps(dtype: torch.dtype):
    backend = SingleProcessBackend(build_tiny_model(seed=1).to(dtype), learning_rate=1e-2, weight_decay=0.0)
    # bf16 parameters train through fp32 master weights; the checkpoint holds the masters.
    assert isinstance(backend.optimizer, MasterWeightAdamW) == (dtype == torch.bfloat16)

    def step() -> None:
        backend.optimizer.zero_grad()
        loss_of(backend.model, IDS).backward()
        backend.optimizer.step()

    step()
    saved = copy.deepcopy(backend.checkpoint_state())
    assert set(saved) == {"model", "optim"}
    assert all(t.dtype == torch.float32 for t in saved["model"].values())
    at_save = weights(backend)
    step()
    after_save = weights(backend)
    step()  # moves on, so the reload has something to undo
    assert any(not torch.equal(after_save[n], at_save[n]) for n in at_save)

    template = backend.checkpoint_state()  # what torch.distributed.checkpoint would load into
    for name, tensor in template["model"].items():
        tensor.copy_(saved["model"][name])
    template["optim"] = saved["optim"]
    backend.load_checkpoint_state(template)
    assert all(torch.equal(t, at_save[n]) for n, t in weights(backend).items())
    step()  # same weights and the same AdamW moments: the same step as before the reload
    assert all(torch.equal(t, after_save[n]) for n, t in weights(backend).items())
