"""Checkpoint writes are atomic: a save that dies half-way leaves the previous checkpoint whole."""

from __future__ import annotations

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
