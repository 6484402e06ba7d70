"""Checkpoints: model, optimizer, data cursor, RNG and the partial-rollout buffer, written atomically by every rank.

A checkpoint is a directory `step-XXXXXXXX/`:

    trainer/             torch.distributed.checkpoint (DCP): model and optimizer, as FSDP2 shards in a
                         multi-rank job, plus the step counter and (with KL) the reference model.
                         DCP reshards on load: a checkpoint of 2 ranks resumes with 1 or with 4.
    rng/rank-00000.pt    each rank's RNG states (Python, torch, CUDA); rank 0's also holds the engines'
                         sampling generators.
    state.pt             rank 0's: step, policy version, data cursor, scheduler (partial-rollout buffer,
                         truncation statistics), the job spec and the world size that wrote it.

Every rank writes its part into `.tmp-step-XXXXXXXX/`; after all have finished rank 0 renames that
folder into place, so a crash at any moment of a save leaves the previous checkpoints as they were
and no half checkpoint a restart would pick up (only `step-*` folders are checkpoints). In a
multi-rank job the directory must be one shared filesystem (a ReadWriteMany volume on a cluster).
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp

if TYPE_CHECKING:
    from rljob.runtime.training.distributed import Distributed

log = logging.getLogger(__name__)

_PREFIX = "step-"
_TMP = ".tmp-"
LEADER_STATE = "state.pt"
TRAINER_DIR = "trainer"


@contextmanager
def _single_process_quiet(single: bool) -> Iterator[None]:
    """DCP warns on every single-process save and load that it assumes one process: it is meant."""
    with warnings.catch_warnings():
        if single:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def rng_state() -> dict[str, Any]:
    """Python, torch and (when present) CUDA RNG states of this process."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what rng_state() returned."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class LoadedCheckpoint:
    """A checkpoint as one rank sees it after `CheckpointManager.load`."""

    path: Path
    leader_state: dict[str, Any] | None  # state.pt, on rank 0 only
    rng: dict[str, Any] | None  # this rank's; None when the saving job had fewer ranks


class CheckpointManager:
    """Writes, lists, loads and prunes the checkpoints of one directory. `save` and `load` are
    collective in a multi-rank job (`distributed`): every rank calls them, in the same order."""

    def __init__(self, directory: str | Path, keep: int = 2, distributed: Distributed | None = None) -> None:
        self.directory = Path(directory)
        self.keep = keep
        self.distributed = distributed

    @property
    def rank(self) -> int:
        return self.distributed.rank if self.distributed is not None else 0

    def _barrier(self) -> None:
        if self.distributed is not None:
            self.distributed.barrier()

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir() if p.name.startswith(_PREFIX) and (p / LEADER_STATE).is_file()]
        return sorted(found, key=lambda p: int(p.name[len(_PREFIX) :]))

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        found = self.checkpoints()
        return found[-1] if found else None

    def save(
        self, step: int, trainer_state: dict[str, Any], rng: dict[str, Any], leader_state: dict[str, Any] | None = None
    ) -> Path:
        """Write the checkpoint of `step` (collective) and prune old ones; returns its directory.

        `trainer_state` is this rank's Trainer.checkpoint_state(), `rng` its RNG states; rank 0
        passes `leader_state` (everything else a restart needs)."""
        final = self.directory / f"{_PREFIX}{step:08d}"
        tmp = self.directory / f"{_TMP}{final.name}"
        if self.rank == 0:
            if leader_state is None:
                raise ValueError("rank 0 must pass leader_state to CheckpointManager.save")
            self.directory.mkdir(parents=True, exist_ok=True)
            for stale in self.directory.glob(f"{_TMP}*"):  # left by a crash during an earlier save
                shutil.rmtree(stale, ignore_errors=True)
            (tmp / "rng").mkdir(parents=True)
        self._barrier()
        with _single_process_quiet(self.distributed is None):
            dcp.save(trainer_state, checkpoint_id=tmp / TRAINER_DIR, no_dist=self.distributed is None)
        torch.save(rng, tmp / "rng" / f"rank-{self.rank:05d}.pt")
        if self.rank == 0:
            world = self.distributed.world_size if self.distributed is not None else 1
            torch.save({**leader_state, "world_size": world}, tmp / LEADER_STATE)
        self._barrier()  # every rank's part is on disk
        if self.rank == 0:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            for old in self.checkpoints()[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
            log.info("checkpoint written: %s", final)
        self._barrier()  # nobody reads or prunes while rank 0 renames
        return final

    def load(self, trainer_state: dict[str, Any], path: Path | None = None) -> LoadedCheckpoint | None:
        """Load the given checkpoint, or the newest one (collective; rank 0 decides which), filling
        `trainer_state` (this rank's Trainer.checkpoint_state()) in place; None when there is none."""
        if self.rank == 0:
            path = path or self.latest()
        if self.distributed is not None:
            path = self.distributed.broadcast(path)
        if path is None:
            return None
        with _single_process_quiet(self.distributed is None):
            dcp.load(trainer_state, checkpoint_id=path / TRAINER_DIR, no_dist=self.distributed is None)
        rng_file = path / "rng" / f"rank-{self.rank:05d}.pt"
        rng = torch.load(rng_file, weights_only=False) if rng_file.is_file() else None
        if rng is None:
            log.warning("%s has no RNG state for rank %d (saved by fewer ranks): its RNG starts from the seed",
                        path, self.rank)
        leader = self.read_leader_state(path) if self.rank == 0 else None
        return LoadedCheckpoint(path, leader, rng)

    @staticmethod
    def read_leader_state(path: Path) -> dict[str, Any]:
        """Rank 0's state.pt of the checkpoint at `path`."""
        # weights_only=False: the state holds plain Python containers and RNG tuples we wrote ourselves.
        return torch.load(path / LEADER_STATE, map_location="cpu", weights_only=False)
