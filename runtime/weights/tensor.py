"""``tensor`` mode: engines in the trainer's own process (TensorTarget: the embedded engine) copy the tensors."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from rljob.runtime.engines.base import EngineError, TensorTarget
from rljob.runtime.weights.buckets import bucket_bytes, with_last
from rljob.runtime.weights.transport import SyncReport, WeightSource, WeightTransport
from rljob.runtime.weights.wire_dtype import common_dtype

log = logging.getLogger(__name__)


class TensorTransport(WeightTransport):
    """Copies every bucket into each in-process engine; the version moves with the last bucket."""

    mode = "tensor"

    def __init__(self, engines: Sequence[TensorTarget], flush_cache: bool = True) -> None:
        self.engines = list(engines)
        self.flush_cache = flush_cache  # False: the engines keep their cached keys and values (WeightUpdate)

    async def sync(self, version: int, weights: WeightSource) -> SyncReport:
        """One pass over the buckets; an engine that rejects one keeps its old version."""
        started = time.perf_counter()
        report = SyncReport(version=version, mode=self.mode)
        names = [f"{e.name}[{i}]" for i, e in enumerate(self.engines)]
        # Made in a thread: with a sharded trainer, making the source and pulling a bucket are collectives.
        source = await asyncio.to_thread(weights, common_dtype(e.dtype for e in self.engines))
        buckets = with_last(source)
        while (item := await asyncio.to_thread(next, buckets, None)) is not None:
            bucket, last = item
            report.bytes_sent += bucket_bytes(bucket)  # as given: each engine's copy casts what is not its dtype
            for name, engine in zip(names, self.engines, strict=True):
                if name in report.failed:
                    continue
                try:
                    await engine.load_named_tensors(bucket, version if last else None,
                                                    flush_cache=self.flush_cache)
                except EngineError as exc:
                    log.error("weight sync of version %d to %s failed: %s", version, name, exc)
                    report.failed[name] = str(exc)
            del bucket, item  # before the next bucket is gathered: one bucket of full tensors at a time
        report.updated = [
            n for n, e in zip(names, self.engines, strict=True) if n not in report.failed and e.served_version() == version
        ]
        report.seconds = time.perf_counter() - started
        return report
