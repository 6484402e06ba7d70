"""Checkpoints: model, optimizer, data cursor, RNG and the partial-rollout buffer, written atomically.

A checkpoint is a directory `step-XXXXXXXX/` holding one `state.pt`. It is written to a temporary
directory first and renamed into place, so a crash mid-write never leaves a half checkpoint that
a restart would pick up.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

_PREFIX = "step-"


def rng_state() -> dict[str, Any]:
    """Python and torch RNG states."""
    return {"python": random.getstate(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])


class CheckpointManager:
    """Writes, lists, loads and prunes checkpoints in one directory."""

    def __init__(self, directory: str | Path, keep: int = 2) -> None:
        self.directory = Path(directory)
        self.keep = keep

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir() if p.name.startswith(_PREFIX) and (p / "state.pt").is_file()]
        return sorted(found, key=lambda p: int(p.name[len(_PREFIX) :]))

    def latest(self) -> Path | None:
        found = self.checkpoints()
        return found[-1] if found else None

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write `state` as the checkpoint of `step` and prune old ones; returns its directory."""
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.directory / f"{_PREFIX}{step:08d}"
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.directory))
        try:
            torch.save(state, tmp / "state.pt")
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        for old in self.checkpoints()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        log.info("checkpoint written: %s", final)
        return final

    def load(self, path: Path | None = None) -> dict[str, Any] | None:
        """Load the given checkpoint, or the newest one; None when there is none."""
        path = path or self.latest()
        if path is None:
            return None
        # weights_only=False: the state holds plain Python containers and RNG tuples we wrote ourselves.
        return torch.load(path / "state.pt", map_location="cpu", weights_only=False)
