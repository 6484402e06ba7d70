"""Checkpoints: model, optimizer, data cursor, RNG and the partial-rollout buffer, written atomically by every rank.

A checkpoint is a directory `step-XXXXXXXX/`:

    trainer/             torch.distributed.checkpoint (DCP): model and optimizer, as FSDP2 shards in a
                         multi-rank job, plus the step counter and (with KL) the reference model.
                         DCP reshards on load: a checkpoint of 2 ranks resumes with 1 or with 4.
    rng/rank-00000.pt    each rank's RNG states (Python, torch, CUDA); rank 0's also holds the engines'
                         sampling generators.
    state.pt             rank 0's: step, policy version, data cursor, scheduler (partial-rollout buffer,
                         truncation statistics), the job spec and the world size that wrote it.
    COMPLETE             the completion marker, written last (see below).

Every rank writes its part into `.tmp-step-XXXXXXXX/` and fsyncs it; after all have finished rank 0
writes the marker, fsyncs it and the folder, renames the folder into place and fsyncs the parent.
Without the fsyncs a node crash can persist the rename but not the data (a `step-*` folder of empty
or short files); with them, a folder that holds the marker holds everything written before it.

Only `step-*` folders with the marker count as complete. A folder without it is torn, or was written
before markers existed: those are ignored (with a warning naming them), because nothing else tells a
whole pre-marker checkpoint from one a crash tore (its files were never fsynced; a torn DCP shard can
read back as zeros and load without an error). If the newest marked checkpoint fails to load, the one
before it is loaded: `load` says which folders it skipped and why (LoadedCheckpoint.skipped).
`spec.checkpoint.rollbackTo: {step, id}` (the operator's RollbackToCheckpoint alert action) moves every
folder newer than the newest complete checkpoint at or before `step` into `rolled-back-<id>/` (deletes
it from a store) before the resume, once: the marker `rollbacks/<id>` records that it was applied. The
checkpoint a trainer writes when it is stopped (SIGTERM) prunes nothing, so the stop before a rollback
never removes its target.
In a multi-rank job the directory must be one shared filesystem (a ReadWriteMany volume on a cluster).

With an object store (`checkpoint.uri: s3://bucket/prefix`) the directory is a local staging folder:
each checkpoint is written there as above, then rank 0 uploads it to `<prefix>/step-XXXXXXXX/` with
the marker LAST, so the same rule holds in the store: a folder without its marker is torn. Resume
plans from the store's listing and downloads the checkpoint it tries into the staging folder;
pruning removes old and torn folders from the store too (`rljob.runtime.object_store` does the I/O).
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from rljob.runtime.object_store import ObjectStore, ObjectUri, StoreSettings, is_object_uri

if TYPE_CHECKING:
    from rljob.api.spec import CheckpointSpec
    from rljob.runtime.training.distributed import Distributed

log = logging.getLogger(__name__)

_PREFIX = "step-"
# Applied rollbacks (spec.checkpoint.rollbackTo), one empty marker per id, in the directory or the store.
ROLLBACKS = "rollbacks"
_TMP = ".tmp-"
LEADER_STATE = "state.pt"
TRAINER_DIR = "trainer"
MARKER = "COMPLETE"


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


@dataclass(frozen=True)
class SkippedCheckpoint:
    """A `step-*` folder newer than the checkpoint loaded, and why it was not loaded."""

    path: Path
    reason: str

    def __str__(self) -> str:
        return f"{self.path.name} ({self.reason})"


@dataclass(frozen=True)
class ResumePlan:
    """Which checkpoints to try, newest first, and the folders passed over without trying."""

    candidates: list[Path]
    unmarked: list[SkippedCheckpoint]


UNMARKED = "no completion marker: torn by a crash, or written before markers existed"


def step_of(path: Path) -> int | None:
    """The step of a `step-XXXXXXXX` folder, None for any other name."""
    digits = path.name[len(_PREFIX) :]
    return int(digits) if path.name.startswith(_PREFIX) and digits.isdigit() else None


def plan_resume(listing: Iterable[tuple[Path, bool]]) -> ResumePlan:
    """From (folder, has marker) pairs: the marked checkpoints newest first, and the unmarked folders
    newer than the newest marked one (older unmarked folders never matter, so they are not reported)."""
    steps = sorted(((step, path, marked) for path, marked in listing if (step := step_of(path)) is not None),
                   key=lambda t: t[0], reverse=True)
    candidates = [path for _, path, marked in steps if marked]
    newest = step_of(candidates[0]) if candidates else None
    unmarked = [SkippedCheckpoint(path, UNMARKED) for step, path, marked in steps
                if not marked and (newest is None or step > newest)]
    return ResumePlan(candidates, unmarked)


def plan_rollback(listing: Iterable[tuple[Path, bool]], step: int) -> tuple[int | None, list[Path]]:
    """From (folder, has marker) pairs: the newest complete checkpoint at or before `step`, and the step
    folders newer than it (complete or torn), which a rollback to it sets aside, oldest first.
    (None, []) when no complete checkpoint at or before `step` is left (pruned, or never written)."""
    steps = [(found, path, marked) for path, marked in listing if (found := step_of(path)) is not None]
    kept = [found for found, _, marked in steps if marked and found <= step]
    if not kept:
        return None, []
    target = max(kept)
    return target, [path for found, path, _ in sorted(steps, key=lambda t: t[0]) if found > target]


@dataclass(frozen=True)
class RollbackResult:
    """What `CheckpointManager.roll_back` did."""

    applied_before: bool  # its marker was there: an earlier start applied it, nothing was done now
    target: int | None  # the checkpoint the resume will load (None: none at or before the step is left)
    set_aside: list[str] = field(default_factory=list)  # folders moved aside (deleted from a store)

    def describe(self, step: int) -> str:
        """What the resume will do, in words."""
        if self.applied_before:
            return f"the rollback to step {step} was applied by an earlier start; resuming from the newest checkpoint"
        if self.target is None:
            return (f"no complete checkpoint at or before step {step} is left (pruned: raise checkpoint.keep); "
                    "resuming from the newest instead")
        return (f"resuming from the checkpoint of step {self.target} (at or before {step}); set aside: "
                f"{', '.join(self.set_aside) or 'nothing'}")


def plan_prune(listing: Iterable[tuple[Path, bool]], keep: int, newest: int) -> list[Path]:
    """From (folder, has marker) pairs: what to delete after `newest` was saved. The complete checkpoints
    beyond the newest `keep`, and the unmarked folders older than `newest` (torn by an earlier crash, or
    pre-marker folders a complete checkpoint has superseded). Unmarked newer ones may be in progress."""
    entries = [(step, path, marked) for path, marked in listing if (step := step_of(path)) is not None]
    complete = sorted(((step, path) for step, path, marked in entries if marked), key=lambda t: t[0], reverse=True)
    torn = [path for step, path, marked in entries if not marked and step < newest]
    return [path for _, path in complete[keep:]] + torn


def checkpoint_store(spec: CheckpointSpec) -> ObjectStore | None:
    """The object store `spec.uri` names (s3://), or None when checkpoints live in `spec.dir` alone."""
    if spec.uri is None or not is_object_uri(spec.uri):
        return None
    s3 = spec.s3
    settings = StoreSettings() if s3 is None else StoreSettings(endpoint=s3.endpoint, region=s3.region)
    return ObjectStore(ObjectUri.parse(spec.uri), settings)


def _fsync(path: Path) -> None:
    """Flush a file or a directory (its entries: creations, renames) to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file and folder under `root`, and `root` itself (folders after their contents)."""
    for folder, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            _fsync(Path(folder) / name)
        _fsync(Path(folder))


@dataclass
class LoadedCheckpoint:
    """A checkpoint as one rank sees it after `CheckpointManager.load`."""

    path: Path
    leader_state: dict[str, Any] | None  # state.pt, on rank 0 only
    rng: dict[str, Any] | None  # this rank's; None when the saving job had fewer ranks
    # Newer folders passed over (torn or failing to load), newest first; complete on rank 0 only.
    skipped: list[SkippedCheckpoint] = field(default_factory=list)


class CheckpointManager:
    """Writes, lists, loads and prunes the checkpoints of one directory, mirrored to `store` when one is
    given (the directory then stages them). `save` and `load` are collective in a multi-rank job
    (`distributed`): every rank calls them, in the same order.

    With a store, each trainer pod stages in its own folder (its emptyDir home), which holds only the
    files of its own ranks: the first local rank of every other pod uploads its pod's part (DCP shards,
    RNG states) and drops it, then rank 0 uploads the rest (DCP metadata, state.pt) and the completion
    marker last, lists, plans and prunes. On resume every pod's first local rank downloads the
    checkpoint rank 0 picked, so each rank reads a whole copy (DCP reshards across any rank count)."""

    def __init__(self, directory: str | Path, keep: int = 2, distributed: Distributed | None = None,
                 store: ObjectStore | None = None) -> None:
        self.directory = Path(directory)
        self.keep = keep
        self.distributed = distributed
        self.store = store

    @property
    def rank(self) -> int:
        return self.distributed.rank if self.distributed is not None else 0

    @property
    def pod_leader(self) -> bool:
        """Whether this rank stages for its machine (pod): its first local rank (rank 0 in one process)."""
        return self.distributed is None or self.distributed.env.local_rank == 0

    @property
    def stages_own_part(self) -> bool:
        """A rank other than 0 that prepares, uploads and fetches its pod's staging folder: only with a
        store (a claim or a local folder is one folder rank 0 manages for everyone)."""
        return self.store is not None and self.rank != 0 and self.pod_leader

    def _barrier(self) -> None:
        if self.distributed is not None:
            self.distributed.barrier()

    def _local_listing(self) -> list[tuple[Path, bool]]:
        if not self.directory.is_dir():
            return []
        return [(p, (p / MARKER).is_file()) for p in self.directory.iterdir() if p.is_dir()]

    def _store_listing(self, store: ObjectStore) -> list[tuple[Path, bool]]:
        """The store's folders as the staging paths they download to, with whether each has its marker."""
        return [(self.directory / name, MARKER in keys)
                for name, keys in store.folders().items() if step_of(Path(name)) is not None]

    def plan(self) -> ResumePlan:
        """What `plan_resume` makes of the store (or, without one, the directory) as it is now. With a
        store the paths are where `fetch` puts each checkpoint in the staging directory."""
        return plan_resume(self._store_listing(self.store) if self.store is not None else self._local_listing())

    def location(self, path: Path) -> str:
        """Where the checkpoint staged at `path` is kept: its store URI, or the path itself."""
        return self.store.uri.child(path.name) if self.store is not None else str(path)

    def fetch(self, path: Path) -> Path:
        """Make the checkpoint `path` (from `plan`) readable locally: download it from the store, if any."""
        if self.store is not None:
            self.store.download_folder(path.name, path)
        return path

    def set_aside(self, stamp: str) -> Path | None:
        """Move every step folder into `previous-<stamp>/` (a fresh run's start), so that neither this run's
        resume nor its pruning ever sees another run's checkpoints; the folder moved to, or None."""
        if not self.directory.is_dir():
            return None
        steps = [p for p in self.directory.iterdir() if p.is_dir() and step_of(p) is not None]
        if not steps:
            return None
        aside = self.directory / f"previous-{stamp}"
        aside.mkdir()
        for path in steps:
            path.rename(aside / path.name)
        _fsync(self.directory)
        return aside

    def roll_back(self, step: int, rollback_id: str) -> RollbackResult:
        """Rank 0, before `load`: apply spec.checkpoint.rollbackTo once. Every step folder newer than the
        newest complete checkpoint at or before `step` moves to `rolled-back-<id>/` (from a store: is
        deleted), so the resume loads that checkpoint and later resumes and pruning never see the
        abandoned steps again. The marker `rollbacks/<id>`, written last, makes a later start (a crash
        after the new run's own checkpoints) leave them alone. With no checkpoint at or before `step`
        left, nothing is set aside (the resume takes the newest, as without a rollback) and the marker
        is written too: the rollback is not possible, and retrying it would not make it so."""
        marker = f"{ROLLBACKS}/{rollback_id}"
        local_marker = self.directory / marker
        if local_marker.is_file() or (self.store is not None and self.store.exists(marker)):
            return RollbackResult(applied_before=True, target=None)
        listing = self._store_listing(self.store) if self.store is not None else self._local_listing()
        target, newer = plan_rollback(listing, step)
        aside = self.directory / f"rolled-back-{rollback_id}"
        for path in newer:
            if self.store is not None:
                self.store.delete_folder(path.name)
            if path.is_dir():
                aside.mkdir(parents=True, exist_ok=True)
                path.rename(aside / path.name)
        local_marker.parent.mkdir(parents=True, exist_ok=True)
        local_marker.write_text(f"rollback to step {step}: resumed from {target}\n")
        _fsync(local_marker)
        _fsync(self.directory)
        if self.store is not None:
            self.store.put_file(local_marker, marker)
        return RollbackResult(applied_before=False, target=target, set_aside=[p.name for p in newer])

    def checkpoints(self) -> list[Path]:
        """Complete (marked) checkpoints, oldest first."""
        return self.plan().candidates[::-1]

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        found = self.plan().candidates
        return found[0] if found else None

    def save(
        self, step: int, trainer_state: dict[str, Any], rng: dict[str, Any], leader_state: dict[str, Any] | None = None,
        prune: bool = True,
    ) -> Path:
        """Write the checkpoint of `step` (collective) and, unless `prune` is False, prune old ones; returns
        its directory. (The checkpoint a stopping trainer writes does not prune: the next start may be a
        rollback to one of the older checkpoints; the next regular save prunes.)

        `trainer_state` is this rank's Trainer.checkpoint_state(), `rng` its RNG states; rank 0
        passes `leader_state` (everything else a restart needs)."""
        final = self.directory / f"{_PREFIX}{step:08d}"
        tmp = self.directory / f"{_TMP}{final.name}"
        if self.rank == 0 and leader_state is None:
            raise ValueError("rank 0 must pass leader_state to CheckpointManager.save")
        if self.rank == 0 or self.stages_own_part:
            self.directory.mkdir(parents=True, exist_ok=True)
            for stale in self.directory.glob(f"{_TMP}*"):  # left by a crash during an earlier save
                shutil.rmtree(stale, ignore_errors=True)
            (tmp / "rng").mkdir(parents=True)
        self._barrier()
        with _single_process_quiet(self.distributed is None):
            dcp.save(trainer_state, checkpoint_id=tmp / TRAINER_DIR, no_dist=self.distributed is None)
        torch.save(rng, tmp / "rng" / f"rank-{self.rank:05d}.pt")
        if self.rank == 0:
            assert leader_state is not None  # checked before any file was written
            world = self.distributed.world_size if self.distributed is not None else 1
            torch.save({**leader_state, "world_size": world}, tmp / LEADER_STATE)
        _fsync_tree(tmp)  # this rank's files (and, harmlessly, the others') reach the disk before the marker
        self._barrier()  # every rank's part is on disk
        if self.store is not None:
            if self.stages_own_part:  # another pod: its ranks' files exist only here
                self.store.upload_folder(tmp, final.name)
                shutil.rmtree(tmp)
            self._barrier()  # every pod's part is in the store before rank 0 uploads the marker
        if self.rank == 0:
            (tmp / MARKER).write_text(f"{final.name}\n")
            _fsync(tmp / MARKER)
            _fsync(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync(self.directory)  # the rename itself
            if self.store is not None:
                self.store.upload_folder(final, final.name, last=MARKER)
            if prune:
                self._prune(step)
            log.info("checkpoint written: %s", self.location(final))
        self._barrier()  # nobody reads or prunes while rank 0 renames
        return final

    def _prune(self, newest: int) -> None:
        """Apply `plan_prune` to the directory and to the store."""
        for path in plan_prune(self._local_listing(), self.keep, newest):
            shutil.rmtree(path, ignore_errors=True)
        if self.store is not None:
            for path in plan_prune(self._store_listing(self.store), self.keep, newest):
                self.store.delete_folder(path.name)

    def load(self, trainer_state: dict[str, Any]) -> LoadedCheckpoint | None:
        """Load the newest complete checkpoint that loads on every rank (collective; rank 0 decides
        which to try), filling `trainer_state` (this rank's Trainer.checkpoint_state()) in place; None
        when there is none. Torn folders and checkpoints that fail to load are skipped with a warning,
        and listed in the result's `skipped`."""
        plan = self.plan() if self.rank == 0 else ResumePlan([], [])
        skipped = list(plan.unmarked)
        for torn in skipped:
            log.warning("checkpoint %s skipped: %s", torn.path, torn.reason)
        candidates = iter(plan.candidates)
        while True:
            path = next(candidates, None) if self.rank == 0 else None
            if self.distributed is not None:
                path = self.distributed.broadcast(path)
            if path is None:
                return None
            path = self.directory / path.name  # rank 0's staging folder is not every pod's
            if self.rank == 0 or self.stages_own_part:
                self.fetch(path)  # into the staging folder the ranks of this pod read
            if self.store is not None:
                self._barrier()  # every pod has its copy
            loaded, error = self._try_load(trainer_state, path)
            errors = [error] if self.distributed is None else self._gather_errors(error)
            failed = [e for e in errors if e is not None]
            if self.stages_own_part:  # read by every local rank (the gather waited for them): not needed here
                shutil.rmtree(path, ignore_errors=True)
            if not failed:
                assert loaded is not None
                loaded.skipped = skipped
                return loaded
            skipped.append(SkippedCheckpoint(path, f"failed to load: {failed[0]}"))
            log.warning("checkpoint %s skipped: %s; trying the one before it", path, skipped[-1].reason)

    def _gather_errors(self, error: str | None) -> list[str | None]:
        """Every rank's load error (None: loaded), on every rank: a checkpoint counts only if all loaded it."""
        import torch.distributed as dist

        assert self.distributed is not None
        errors: list[str | None] = [None] * self.distributed.world_size
        dist.all_gather_object(errors, error, group=self.distributed.control)
        return errors

    def _try_load(self, trainer_state: dict[str, Any], path: Path) -> tuple[LoadedCheckpoint | None, str | None]:
        """This rank's part of loading `path`: the checkpoint, or why it failed (a torn or corrupt file)."""
        try:
            # DCP first: it is collective, so every rank must reach it whatever its own files hold.
            with _single_process_quiet(self.distributed is None):
                dcp.load(trainer_state, checkpoint_id=path / TRAINER_DIR, no_dist=self.distributed is None)
            leader = self.read_leader_state(path) if self.rank == 0 else None
            rng_file = path / "rng" / f"rank-{self.rank:05d}.pt"
            rng = torch.load(rng_file, weights_only=True) if rng_file.is_file() else None
        # DCP's CheckpointException derives from BaseException, not Exception.
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - any failure to read means: try the one before
            # DCP's message carries every rank's traceback; its last line names the actual failure.
            lines = str(err).strip().splitlines()
            return None, f"{type(err).__name__}: {lines[-1] if lines else ''}"[:300]
        if rng is None:
            log.warning("%s has no RNG state for rank %d (saved by fewer ranks): its RNG starts from the seed",
                        path, self.rank)
        return LoadedCheckpoint(path, leader, rng), None

    @staticmethod
    def read_leader_state(path: Path) -> dict[str, Any]:
        """Rank 0's state.pt of the checkpoint at `path`."""
        # weights_only=True: a checkpoint directory may be shared or restored from elsewhere, and a full
        # unpickler runs any code a crafted file names. The state is tensors and plain containers only.
        return torch.load(path / LEADER_STATE, map_location="cpu", weights_only=True)
