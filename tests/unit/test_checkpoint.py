"""Checkpoint writes are atomic: a save that dies half-way leaves the previous checkpoint whole."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from rljob.api.spec import AlgorithmSpec
from rljob.runtime.checkpoint import CheckpointManager, rng_state
from rljob.runtime.trainer import Trainer
from tests.helpers.tiny_model import build_tiny_model


def _trainer(seed: int) -> Trainer:
    return Trainer(build_tiny_model(seed=seed), AlgorithmSpec(), micro_batch_size=4)


def test_a_crash_during_a_save_leaves_the_previous_checkpoint_intact(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep=1)  # keep=1: the good checkpoint is the one pruning would remove
    good = _trainer(seed=0)
    manager.save(1, good.checkpoint_state(), rng_state(), {"step": 1, "marker": "good"})

    moved = _trainer(seed=1)
    # The model shards are written, then rank 0's state.pt fails half-way (a lambda cannot be pickled):
    # the same point a kill -9 or a full disk could hit.
    with pytest.raises(Exception, match="pickle|lambda"):
        manager.save(2, moved.checkpoint_state(), rng_state(), {"step": 2, "unpicklable": lambda: None})
    assert (tmp_path / ".tmp-step-00000002" / "trainer").is_dir(), "the failed save did not get as far as the shards"
    assert [p.name for p in manager.checkpoints()] == ["step-00000001"]

    restored = _trainer(seed=2)
    template = restored.checkpoint_state()
    loaded = manager.load(template)
    assert loaded is not None and loaded.path.name == "step-00000001"
    assert loaded.leader_state is not None and loaded.leader_state["marker"] == "good"
    restored.load_checkpoint_state(template)
    for (name, a), b in zip(good.model.state_dict().items(), restored.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name

    # The next save succeeds, replaces the old one (keep=1) and sweeps the debris of the failed one.
    manager.save(3, moved.checkpoint_state(), rng_state(), {"step": 3})
    assert [p.name for p in manager.checkpoints()] == ["step-00000003"]
    assert not list(tmp_path.glob(".tmp-*"))


def test_rank_0_must_pass_its_state(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="leader_state"):
        CheckpointManager(tmp_path).save(1, _trainer(0).checkpoint_state(), rng_state())


@pytest.mark.parametrize(("saved", "loaded"), [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_bf16_and_fp32_checkpoints_share_one_layout(tmp_path: Path, saved: torch.dtype, loaded: torch.dtype) -> None:
    """The master-weight optimizer of bf16 saves what FSDP2 and fp32 save: fp32 weights under "model",
    AdamW state by parameter name. So a bf16 checkpoint loads anywhere (and any rank count, see
    tests/integration/test_distributed_training.py), and the fp32 numbers come back exactly."""
    from tests.integration.test_distributed_training import fixed_batch

    saver = Trainer(build_tiny_model(seed=0).to(saved), AlgorithmSpec(learning_rate=1e-2), micro_batch_size=4)
    saver.train_step(fixed_batch(3), policy_version=0)
    expected = copy.deepcopy(saver.checkpoint_state())
    assert all(t.dtype == torch.float32 for t in expected["model"].values())
    CheckpointManager(tmp_path).save(1, saver.checkpoint_state(), rng_state(), {"step": 1})

    loader = Trainer(build_tiny_model(seed=1).to(loaded), AlgorithmSpec(learning_rate=1e-2), micro_batch_size=4)
    template = loader.checkpoint_state()
    assert template.keys() == expected.keys() and template["model"].keys() == expected["model"].keys()
    CheckpointManager(tmp_path).load(template)
    loader.load_checkpoint_state(template)
    got = loader.checkpoint_state()
    for name, tensor in expected["model"].items():
        assert torch.equal(got["model"][name], tensor), name
    params = dict(loader.model.named_parameters())
    for name, tensor in expected["model"].items():
        if name in params:  # the model holds the weights in its own precision (bf16: the masters rounded)
            assert torch.equal(params[name].detach(), tensor.to(loaded)), name
    assert got["optim"]["state"].keys() == expected["optim"]["state"].keys()
    for name, moments in expected["optim"]["state"].items():
        assert float(moments["exp_avg"].abs().sum()) > 0, name
        for key, value in moments.items():
            assert torch.equal(got["optim"]["state"][name][key], value), (name, key)
    assert int(got["steps_done"]) == 1
    loader.train_step(fixed_batch(3), policy_version=1)  # and it trains on
