"""Build the weight transport a job's rollout spec asks for, and sync until the engines serve it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from rljob.api.spec import RolloutSpec
from rljob.runtime.engines.base import Engine, EngineError
from rljob.runtime.weights.transport import SyncReport, WeightSource, WeightTransport

log = logging.getLogger(__name__)


def build_transport(
    spec: RolloutSpec, engines: Sequence[Engine], output_dir: Path, write_config: Callable[[Path], None]
) -> WeightTransport:
    """The transport of ``spec.transport_mode`` over ``engines`` (built by engines.factory)."""
    mode = spec.transport_mode
    t = spec.weight_transport
    if mode == "tensor":
        from rljob.runtime.engines.embedded import EmbeddedEngine
        from rljob.runtime.weights.tensor import TensorTransport

        return TensorTransport([e for e in engines if isinstance(e, EmbeddedEngine)], t.flush_cache)
    from rljob.runtime.engines.sglang_client import SGLangEngine

    http = [e for e in engines if isinstance(e, SGLangEngine)]
    if mode == "disk":
        from rljob.runtime.weights.disk import DiskTransport

        folder = Path(t.disk_dir or spec.sglang.weights_dir or output_dir / "weights")
        return DiskTransport(http, folder, t.keep_last, write_config)
    import torch

    from rljob.runtime.weights.broadcast import DistributedOptions, DistributedTransport

    backend = t.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    return DistributedTransport(
        http, DistributedOptions(t.master_address, t.master_port, backend, t.timeout_seconds, t.flush_cache))


async def sync_until_served(
    transport: WeightTransport, version: int, weights: WeightSource, deadline_s: float, backoff_s: float = 1.0
) -> SyncReport:
    """Sync, and again with backoff while no engine serves ``version``; EngineError after ``deadline_s``.

    A step must never report a policy version no engine serves, so a sync that reached none is
    not a success: the job waits for an engine (and says so) or stops with the reasons.
    """
    started = time.monotonic()
    attempt = 0
    while True:
        report = await transport.sync(version, weights)
        if report.ok:
            return report
        waited = time.monotonic() - started
        if waited >= deadline_s:
            raise EngineError(
                f"no engine serves weight version {version} after {waited:.0f} s of {transport.mode} weight syncs "
                f"(rollout.weightTransport.timeoutSeconds): "
                + "; ".join(f"{k}: {v}" for k, v in report.failed.items())
            )
        delay = min(30.0, backoff_s * 2**attempt)
        log.error("weight version %d reached no engine (%s); retrying the %s sync in %.0f s",
                  version, "; ".join(f"{k}: {v}" for k, v in report.failed.items()) or "no engine answers",
                  transport.mode, delay)
        await asyncio.sleep(delay)
        attempt += 1
