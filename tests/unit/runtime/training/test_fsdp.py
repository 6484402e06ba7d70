"""FSDP2 on a one-rank gloo group on the CPU: the sharded backend trains exactly as the single-process one,
hands out the full weights under the model's own names, and checkpoints as sharded DTensors."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rljob.runtime.ranks import GatheredWeights, OrderSender
from rljob.runtime.training.backend import SingleProcessBackend, build_backend
from rljob.runtime.training.distributed import DistEnv, Distributed
from rljob.runtime.training.fsdp import FSDP2Backend, decoder_layers
from rljob.runtime.weight_group import lying_flat
from rljob.runtime.weights.buckets import with_last

from tests.helpers.processes import free_port
from tests.helpers.tiny_model import build_tiny_model

IDS = torch.tensor([[3, 17, 42, 9, 77, 5], [8, 8, 1, 64, 2, 99]])


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch) -> Iterator[Distributed]:
    """A real one-rank gloo group (env:// rendezvous on a free loopback port), left at the end."""
    if dist.is_initialized():
        pytest.fail("a process group is already initialised in this process")
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    distributed = Distributed(DistEnv(0, 1, 0, 1, "127.0.0.1", port), "cpu")
    try:
        yield distributed
    finally:
        distributed.close()


def loss_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy through the decoder body and the head's weight, as the trainer reads them."""
    hidden = model.get_decoder()(input_ids=ids).last_hidden_state[:, :-1]
    logits = hidden @ model.get_output_embeddings().weight.T
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def full_weights(backend: SingleProcessBackend | FSDP2Backend) -> dict[str, torch.Tensor]:
    return {n: t.clone() for bucket in backend.iter_full_weights(1 << 16) for n, t in bucket}


def train_step(backend: SingleProcessBackend | FSDP2Backend) -> tuple[float, float]:
    """One optimizer step; (loss, gradient norm before clipping)."""
    backend.optimizer.zero_grad()
    loss = backend.forward(loss_of, IDS)
    loss.backward()
    norm = backend.clip_grad_norm(1.0)
    backend.optimizer.step()
    return float(loss.detach()), norm


def test_one_rank_fsdp2_trains_like_the_single_process_backend(one_rank: Distributed):
    plain = SingleProcessBackend(build_tiny_model(seed=3).double(), learning_rate=1e-2, weight_decay=0.01)
    model = build_tiny_model(seed=3).double()
    names = list(model.state_dict())
    sharded = build_backend(model, learning_rate=1e-2, weight_decay=0.01, distributed=one_rank)
    assert isinstance(sharded, FSDP2Backend) and (sharded.rank, sharded.world_size) == (0, 1)
    assert all(isinstance(p, DTensor) for p in sharded.model.parameters())  # sharded in place
    assert len(decoder_layers(sharded.model)) == 2  # one FSDP unit per decoder layer, plus the root

    start = full_weights(sharded)
    assert list(start) == names  # the Hugging Face names, full tensors on the CPU
    assert all(not isinstance(t, DTensor) and t.device.type == "cpu" for t in start.values())
    assert all(torch.equal(start[n], t) for n, t in full_weights(plain).items())

    for _ in range(2):
        loss_plain, norm_plain = train_step(plain)
        loss_sharded, norm_sharded = train_step(sharded)
        assert loss_sharded == pytest.approx(loss_plain, rel=1e-12)
        assert norm_sharded == pytest.approx(norm_plain, rel=1e-9)
    after = full_weights(sharded)
    assert any(not torch.equal(after[n], start[n]) for n in names)
    for name, tensor in full_weights(plain).items():
        torch.testing.assert_close(after[name], tensor, rtol=1e-10, atol=1e-12)
    assert sharded.all_reduce([2.0, 5.0], "sum") == [2.0, 5.0]


def test_one_rank_fsdp2_checkpoint_state_round_trips(one_rank: Distributed):
    backend = FSDP2Backend(build_tiny_model(seed=4).double(), learning_rate=1e-2, weight_decay=0.0,
                           distributed=one_rank)
    train_step(backend)
    state = backend.checkpoint_state()
    assert set(state) == {"model", "optim"}
    assert all(isinstance(t, DTensor) for t in state["model"].values())
    saved = {n: t.full_tensor().clone() for n, t in state["model"].items()}
    saved_optim = {k: {n: (v.full_tensor().clone() if isinstance(v, DTensor) else v) for n, v in s.items()}
                   for k, s in state["optim"]["state"].items()}
    train_step(backend)
    moved = full_weights(backend)
    assert any(not torch.equal(moved[n], saved[n]) for n in saved)

    template = backend.checkpoint_state()
    for name, tensor in template["model"].items():
        tensor.to_local().copy_(saved[name])
    for key, values in template["optim"]["state"].items():
        for name, value in values.items():
            if isinstance(value, DTensor):
                value.to_local().copy_(saved_optim[key][name])
    backend.load_checkpoint_state(template)
    restored = full_weights(backend)
    assert all(torch.equal(restored[n], saved[n]) for n in saved)


def test_rank0_sync_source_is_planned_so_a_transport_holds_no_bucket_ahead(one_rank: Distributed):
    # The distributed transport gathers bucket k+1 while it broadcasts bucket k; with one bucket of
    # look-ahead on top (with_last's fallback for a source it cannot count), rank 0 would hold three.
    backend = FSDP2Backend(build_tiny_model(seed=0), learning_rate=1e-3, weight_decay=0.0, distributed=one_rank)
    total = len(list(backend.iter_full_weights(1 << 14)))
    assert total > 2, "the tiny model must span several buckets for this test"
    gathered = GatheredWeights(backend, 1 << 14, OrderSender(None))
    pulls = with_last(gathered())
    seen = []
    for _, last in pulls:
        assert gathered.current is not None and gathered.current.remaining == total - len(seen) - 1
        seen.append(last)
    assert seen == [False] * (total - 1) + [True]


def test_rank0_gathers_each_bucket_flat_so_a_broadcast_sends_it_without_a_copy(one_rank: Distributed):
    # weights/broadcast.flatten sends a bucket that lies flat as it is; the values are the model's either way.
    model = build_tiny_model(seed=0)
    expected = {n: t.detach().to(torch.bfloat16) for n, t in model.state_dict().items()}
    backend = FSDP2Backend(model, learning_rate=1e-3, weight_decay=0.0, distributed=one_rank)
    seen = 0
    for bucket in backend.iter_full_weights(1 << 14, torch.bfloat16):
        wire = [t.dtype for _, t in bucket]
        assert lying_flat([t for _, t in bucket], wire, torch.device("cpu")) is not None, [n for n, _ in bucket]
        for name, tensor in bucket:
            assert torch.equal(tensor, expected[name]), name
            seen += 1
    assert seen == len(expected)
