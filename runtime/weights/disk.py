"""``disk`` mode: a snapshot folder both the trainer and the inference pods mount.

Rank 0 writes each version as a Hugging Face directory (config + one safetensors shard per
bucket + the shard index), renamed into place only when complete, then asks every reachable
worker to ``/update_weights_from_disk`` it. Only the last ``keep_last`` snapshots are kept.

The shards are written as the buckets arrive (a sharded trainer gathers one bucket at a time), in
the dtype the workers serve (wire_dtype.py), so neither the trainer nor the folder ever holds an
fp32 copy of the whole model beyond what the snapshot itself is.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from rljob.runtime.engines.base import EngineError, WeightTargets, post_and_commit
from rljob.runtime.engines.protocol import update_weights_from_disk_call
from rljob.runtime.weights.buckets import Bucket, bucket_bytes, drain
from rljob.runtime.weights.transport import SyncReport, WeightSource, WeightTransport
from rljob.runtime.weights.wire_dtype import cast_bucket, common_dtype, served_dtype

log = logging.getLogger(__name__)

SNAPSHOT_PREFIX = "v"
INDEX_FILE = "model.safetensors.index.json"


def snapshot_name(version: int) -> str:
    """Folder name of one version's snapshot (sorts by version)."""
    return f"{SNAPSHOT_PREFIX}{version:06d}"


def snapshots_to_delete(names: Sequence[str], keep_last: int) -> list[str]:
    """Snapshot folder names beyond the newest ``keep_last`` (pure; other names are left alone)."""
    ours = sorted(n for n in names if n.startswith(SNAPSHOT_PREFIX) and n[len(SNAPSHOT_PREFIX):].isdigit())
    return ours[: max(0, len(ours) - keep_last)]


def write_snapshot(folder: Path, buckets: Iterable[Bucket], write_config: Callable[[Path], None],
                   dtype: torch.dtype | None = None) -> int:
    """Write a loadable checkpoint into ``folder`` (must not exist), floating-point tensors in ``dtype``
    (None: as given); returns the tensor bytes written."""
    from safetensors.torch import save_file

    tmp = folder.with_name(folder.name + ".tmp")
    weight_map: dict[str, str] = {}
    total = 0
    stream = iter(buckets)
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for i, given in enumerate(stream):  # streamed: one bucket in memory at a time
            bucket = cast_bucket(given, dtype)
            shard = f"model-{i + 1:05d}.safetensors"
            save_file({n: t.contiguous() for n, t in bucket}, str(tmp / shard), metadata={"format": "pt"})
            weight_map.update({n: shard for n, _ in bucket})
            total += bucket_bytes(bucket)
            del given, bucket  # before the next bucket is gathered: one bucket of full tensors at a time
    except OSError:
        drain(stream)  # a collective source must still be consumed to the end
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (tmp / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    write_config(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)  # atomic: a worker never sees half a snapshot
    return total


class DiskTransport(WeightTransport):
    """Snapshot to a shared folder, then ``/update_weights_from_disk`` on every reachable worker."""

    mode = "disk"

    def __init__(
        self,
        engines: Sequence[WeightTargets],
        folder: Path,
        keep_last: int,
        write_config: Callable[[Path], None],
    ) -> None:
        self.engines = list(engines)
        self.folder = folder
        self.keep_last = keep_last
        self.write_config = write_config

    async def _served_dtype(self) -> torch.dtype | None:
        """The dtype the reachable workers serve, from their server info (None: unknown, keep the trainer's)."""
        async def one(engine: WeightTargets, url: str) -> torch.dtype | None:
            try:
                return served_dtype(await engine.member_info(url))
            except (EngineError, ValueError) as exc:
                log.warning("weight snapshot dtype: SGLang worker %s: %s", url, exc)
                return None

        return common_dtype(await asyncio.gather(*(
            one(e, u) for e in self.engines for u, m in e.members().items() if m.reachable)))

    async def sync(self, version: int, weights: WeightSource) -> SyncReport:
        """Write the snapshot, load it everywhere, then prune old snapshots."""
        started = time.perf_counter()
        report = SyncReport(version=version, mode=self.mode)
        path = self.folder / snapshot_name(version)
        dtype = await self._served_dtype()
        try:
            # In a thread, the source too: making a sharded trainer's source is a collective.
            report.bytes_sent = await asyncio.to_thread(
                lambda: write_snapshot(path, weights(dtype), self.write_config, dtype))
        except OSError as exc:
            reason = f"snapshot {path} could not be written ({exc}); check rollout.weightTransport.diskDir"
            log.error("weight sync of version %d: %s", version, reason)
            report.failed = {url: reason for e in self.engines for url in e.members()}
            report.seconds = time.perf_counter() - started
            return report
        for engine in self.engines:
            call = update_weights_from_disk_call(str(path), version)
            result = await post_and_commit(engine, version, call.path, call.body or {})
            report.updated += result.updated
            report.failed.update(result.failed)
        self._prune()
        report.seconds = time.perf_counter() - started
        return report

    def _prune(self) -> None:
        if not self.folder.is_dir():
            return
        for name in snapshots_to_delete([p.name for p in self.folder.iterdir() if p.is_dir()], self.keep_last):
            shutil.rmtree(self.folder / name, ignore_errors=True)
            log.debug("deleted weight snapshot %s", self.folder / name)
