"""Checkpoint writes are atomic: a save that dies half-way leaves the previous checkpoint whole, and a
torn newest checkpoint (no completion marker, or a file that fails to load) falls back to the one before."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch

from rljob.api.spec import AlgorithmSpec
from rljob.runtime.checkpoint import (
    LEADER_STATE,
    MARKER,
    UNMARKED,
    CheckpointManager,
    ResumePlan,
    plan_resume,
    plan_rollback,
    rng_state,
)
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


def test_plan_resume_tries_marked_checkpoints_newest_first_and_reports_newer_torn_ones() -> None:
    def d(step: int) -> Path:
        return Path(f"/ckpt/step-{step:08d}")

    listing = [(d(1), True), (d(3), True), (d(4), False), (d(2), False), (d(5), False),
               (Path("/ckpt/.tmp-step-00000006"), False), (Path("/ckpt/step-notanumber"), True)]
    plan = plan_resume(listing)
    assert plan.candidates == [d(3), d(1)]
    # Only the unmarked folders newer than the newest complete one were passed over; step 2 never mattered.
    assert [s.path for s in plan.unmarked] == [d(5), d(4)]
    assert all(s.reason == UNMARKED for s in plan.unmarked)
    nothing_complete = plan_resume([(d(7), False)])
    assert nothing_complete.candidates == [] and [s.path for s in nothing_complete.unmarked] == [d(7)]
    assert plan_resume([]) == ResumePlan([], [])


def _two_checkpoints(directory: Path) -> tuple[CheckpointManager, Trainer]:
    """Checkpoints of steps 1 (the one to fall back to) and 2 (the one the tests tear)."""
    manager = CheckpointManager(directory, keep=2)
    good = _trainer(seed=0)
    manager.save(1, good.checkpoint_state(), rng_state(), {"step": 1})
    manager.save(2, _trainer(seed=1).checkpoint_state(), rng_state(), {"step": 2})
    assert [p.name for p in manager.checkpoints()] == ["step-00000001", "step-00000002"]
    assert all((p / MARKER).is_file() for p in manager.checkpoints())
    return manager, good


def _assert_loads_step_1(manager: CheckpointManager, good: Trainer, reason: str,
                         caplog: pytest.LogCaptureFixture) -> None:
    restored = _trainer(seed=2)
    template = restored.checkpoint_state()
    with caplog.at_level(logging.WARNING, logger="rljob.runtime.checkpoint"):
        loaded = manager.load(template)
    assert loaded is not None and loaded.path.name == "step-00000001"
    assert loaded.leader_state == {"step": 1, "world_size": 1}
    assert [s.path.name for s in loaded.skipped] == ["step-00000002"] and reason in loaded.skipped[0].reason
    assert any("step-00000002" in r.getMessage() and reason in r.getMessage() for r in caplog.records), caplog.text
    restored.load_checkpoint_state(template)
    for (name, a), b in zip(good.model.state_dict().items(), restored.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_a_newest_checkpoint_without_its_marker_is_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    manager, good = _two_checkpoints(tmp_path)
    (tmp_path / "step-00000002" / MARKER).unlink()  # the crash came before the marker reached the disk
    assert [p.name for p in manager.checkpoints()] == ["step-00000001"]
    _assert_loads_step_1(manager, good, "no completion marker", caplog)
    # The next save supersedes the torn folder, and prunes it with the other old ones.
    manager.save(3, good.checkpoint_state(), rng_state(), {"step": 3})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001", "step-00000003"]


@pytest.mark.parametrize("part", [LEADER_STATE, "trainer/.metadata"])
def test_a_newest_checkpoint_that_fails_to_load_is_skipped(tmp_path: Path, part: str,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    manager, good = _two_checkpoints(tmp_path)
    torn = tmp_path / "step-00000002" / part
    torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])  # marked, yet its file is cut in half
    _assert_loads_step_1(manager, good, "failed to load", caplog)


def test_no_loadable_checkpoint_means_a_fresh_start(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(1, _trainer(seed=0).checkpoint_state(), rng_state(), {"step": 1})
    (tmp_path / "step-00000001" / MARKER).unlink()
    assert manager.load(_trainer(seed=1).checkpoint_state()) is None


class _Planted:
    """What a crafted state.pt would hold: an object whose unpickling runs code (here: records a call)."""

    ran: list[str] = []

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (_Planted.ran.append, ("code ran at load",))


def test_checkpoints_load_with_weights_only_and_a_planted_object_is_refused(tmp_path: Path) -> None:
    """Everything a checkpoint holds is plain data (tensors, dicts, lists, tuples, numbers, strings), so
    it loads with torch.load(weights_only=True); a file that names any other object is not run but
    skipped like a corrupt one, and the checkpoint before it is loaded."""
    from rljob.runtime.rollout.buffer import PartialBuffer
    from rljob.runtime.rollout.sample import Group, Sample, SampleStatus

    buffer = PartialBuffer()
    buffer.push(Group(group_id="g3", prompt_text="1+1", prompt_index=7, samples=[
        Sample(group_id="g3", index=0, prompt_ids=[1, 2], answer="2", response_ids=[5], logprobs=[-0.5], versions=[1],
               status=SampleStatus.PENDING, metadata={"source": "synthetic"}),
    ]))
    leader = {"step": 1, "version": 1, "data": {"epoch": 0, "position": 4, "served": 4, "num_records": 8},
              "scheduler": {"buffer": buffer.state_dict(), "truncation": {"lengths": [3, 4]}, "round": 1,
                            "group_counter": 4},
              "job": {"model": {"builtin": "tiny-arith"}}}
    manager = CheckpointManager(tmp_path, keep=3)
    trainer = _trainer(seed=0)
    manager.save(1, trainer.checkpoint_state(), rng_state(), leader)
    manager.save(2, trainer.checkpoint_state(), rng_state(), {**leader, "step": 2, "planted": _Planted()})

    loaded = manager.load(_trainer(seed=1).checkpoint_state())
    assert loaded is not None and loaded.path.name == "step-00000001", "the planted checkpoint must be skipped"
    assert _Planted.ran == [], "loading must never run code a checkpoint names"
    assert [s.path.name for s in loaded.skipped] == ["step-00000002"] and "Unpickl" in loaded.skipped[0].reason
    assert loaded.leader_state is not None
    restored = PartialBuffer()
    restored.load_state_dict(loaded.leader_state["scheduler"]["buffer"])
    assert restored.state_dict() == buffer.state_dict()
    assert loaded.rng is not None and isinstance(loaded.rng["torch"], torch.Tensor)


@pytest.mark.parametrize(("listing", "step", "target", "aside"), [
    # The newest complete checkpoint at or before the step; everything newer goes, torn folders too.
    ([(2, True), (4, True), (6, True)], 4, 4, [6]),
    ([(2, True), (4, True), (5, False), (6, True)], 5, 4, [5, 6]),
    ([(2, True), (4, False), (6, True)], 4, 2, [4, 6]),
    # The step itself was pruned: an older checkpoint is still from before the condition.
    ([(4, True), (6, True)], 5, 4, [6]),
    # Nothing at or before the step is left: nothing is set aside.
    ([(6, True), (8, True)], 4, None, []),
    ([], 4, None, []),
])
def test_plan_rollback(listing: list[tuple[int, bool]], step: int, target: int | None, aside: list[int]) -> None:
    paths = [(Path(f"/c/step-{n:08d}"), marked) for n, marked in listing] + [(Path("/c/rollbacks"), False)]
    found, newer = plan_rollback(paths, step)
    assert found == target and newer == [Path(f"/c/step-{n:08d}") for n in aside]


def test_roll_back_applies_once_and_keeps_nothing_it_cannot_replace(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep=5)
    for step in (1, 2, 3):
        manager.save(step, _trainer(0).checkpoint_state(), rng_state(), {"step": step})
    first = manager.roll_back(1, "r1")
    assert (first.applied_before, first.target, first.set_aside) == (False, 1, ["step-00000002", "step-00000003"])
    assert [p.name for p in manager.checkpoints()] == ["step-00000001"]
    assert sorted(p.name for p in (tmp_path / "rolled-back-r1").iterdir()) == ["step-00000002", "step-00000003"]
    manager.save(2, _trainer(0).checkpoint_state(), rng_state(), {"step": 2})  # the new run's own step 2
    again = manager.roll_back(1, "r1")
    assert again.applied_before and [p.name for p in manager.checkpoints()] == ["step-00000001", "step-00000002"]
    impossible = manager.roll_back(0, "r2")  # no checkpoint at or before step 0: nothing moves
    assert impossible.target is None and not impossible.applied_before and len(manager.checkpoints()) == 2
    assert "raise checkpoint.keep" in impossible.describe(0)
    assert manager.roll_back(0, "r2").applied_before


def test_a_save_without_pruning_keeps_the_older_checkpoints_until_the_next_regular_save(tmp_path: Path) -> None:
    """The checkpoint a stopping trainer writes (prune=False) leaves a rollback's target in place."""
    manager = CheckpointManager(tmp_path, keep=2)
    for step in (1, 2):
        manager.save(step, _trainer(0).checkpoint_state(), rng_state(), {"step": step})
    manager.save(3, _trainer(0).checkpoint_state(), rng_state(), {"step": 3}, prune=False)
    assert [p.name for p in manager.checkpoints()] == ["step-00000001", "step-00000002", "step-00000003"]
    manager.save(4, _trainer(0).checkpoint_state(), rng_state(), {"step": 4})
    assert [p.name for p in manager.checkpoints()] == ["step-00000003", "step-00000004"]
