"""The round's engines: which one takes the next group, which are unhealthy or behind, abort and drain.

The scheduler launches every group through `EnginePool.pick`; the pool keeps the per-engine load,
probes unhealthy engines back in, leaves engines that served over-stale weights out for the rest of
the round, and waits (with a deadline) while no engine can generate.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from rljob.runtime.engines.base import Engine, EngineError

log = logging.getLogger(__name__)

# Called while no engine can generate; may bring one back (a catch-up weight sync) and says whether it did.
Recover = Callable[[], Awaitable[bool]]


class StaleEnginesError(RuntimeError):
    """Every usable engine serves weights older than the staleness bound allows this round."""


class EngineWaitTimeout(EngineError):
    """No engine could generate for longer than the round may wait (``rollout.engineWaitTimeoutSeconds``).

    An EngineError, so the job exits with the engine-error status: in a trainer pod the gang restart then
    resumes it from its last checkpoint, where a wait without a deadline would report Running for ever.
    """


class EnginePool:
    """The engines of one scheduler, with their load and health."""

    def __init__(self, engines: Sequence[Engine], recover: Recover | None = None) -> None:
        if not engines:
            raise ValueError("the rollout scheduler needs at least one engine")
        self.engines = list(engines)
        self.recover = recover
        self.assigned = [0] * len(self.engines)  # groups in flight per engine
        self.requests = [0] * len(self.engines)  # samples in flight per engine (launched, not yet returned)
        self.unhealthy: set[int] = set()
        self.lagging: set[int] = set()  # engines that served over-stale weights this round

    def new_round(self) -> None:
        """Weights were synced since the last round: every engine gets a new chance."""
        self.lagging.clear()

    def failed(self, idx: int) -> None:
        """An engine failed a call: out of the rotation until a health probe brings it back."""
        self.unhealthy.add(idx)

    def served_over_stale(self, idx: int, policy_version: int, max_staleness: int) -> None:
        """An engine returned tokens over the staleness bound. An engine that manages its workers'
        rotation (SGLang) has dropped the stale worker by now if it still serves a current version;
        only a whole engine behind leaves this round."""
        served = self.engines[idx].served_version()
        if served is None or policy_version - served > max_staleness:
            self.lagging.add(idx)

    async def pick(self, max_staleness: int, wait_timeout_s: float, retry_max_s: float,
                   on_wait: Callable[[], None] = lambda: None) -> int:
        """Least-loaded healthy engine. While none is, ask `recover` to bring one back (a catch-up sync:
        engines that only serve older weights cannot come back otherwise mid-round), else wait with
        backoff (calling `on_wait`); EngineWaitTimeout once `wait_timeout_s` has passed without one."""
        delay = 0.5
        deadline = time.monotonic() + wait_timeout_s
        while True:
            for idx in sorted(self.unhealthy):
                if await self._probe(idx):
                    log.info("engine %s is healthy again", self.engines[idx].name)
                    self.unhealthy.discard(idx)
            if (picked := self.pick_now()) is not None:
                return picked
            if self.recover is not None and await self.recover():
                self.lagging.clear()  # every engine that answers holds the current weights again
                continue
            if not self.unhealthy:
                raise StaleEnginesError(
                    f"every engine serves weights more than rollout.partial.maxStaleness="
                    f"{max_staleness} versions old; check the weight sync to the engines"
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineWaitTimeout(
                    f"no engine could generate for {wait_timeout_s:.0f} s "
                    f"(rollout.engineWaitTimeoutSeconds; engines: {', '.join(e.name for e in self.engines)}): "
                    "check that the inference pods run and answer /health, that the router answers, and the "
                    "weight sync errors above; the job stops so that its restart resumes from the last checkpoint"
                )
            log.error("no healthy engine; retrying in %.1fs, giving up in %.0fs (check the inference workers)",
                      min(delay, left), left)
            on_wait()
            await asyncio.sleep(min(delay, left))
            delay = min(delay * 2, retry_max_s)

    def pick_now(self) -> int | None:
        """Least-loaded engine of the rotation, or None at once when there is none: work launched while
        the trainer trains must neither wait nor ask for a catch-up sync (the trainer owns the weights)."""
        healthy = [i for i in range(len(self.engines)) if i not in self.unhealthy and i not in self.lagging]
        return min(healthy, key=lambda i: self.assigned[i]) if healthy else None

    async def _probe(self, idx: int) -> bool:
        try:
            return await self.engines[idx].health()
        except EngineError:
            return False

    async def abort_all(self) -> None:
        """Abort every request on every engine; a dead worker must not stop the others' abort."""
        results = await asyncio.gather(*(e.abort_all() for e in self.engines), return_exceptions=True)
        for engine, res in zip(self.engines, results, strict=True):
            if isinstance(res, Exception):
                log.warning("abort on %s failed: %s", engine.name, res)

    async def verify_drained(self) -> None:
        """Engines must be idle before training or a weight update touches their memory."""
        for idx, engine in enumerate(self.engines):
            if idx in self.unhealthy:
                continue
            try:
                load = await engine.load()
            except EngineError as err:
                log.warning("cannot read load of %s: %s", engine.name, err)
                continue
            if load.total:
                log.warning("%s still reports %d requests after abort; aborting again", engine.name, load.total)
                await engine.abort_all()
