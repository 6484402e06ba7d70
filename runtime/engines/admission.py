"""SGLang's admission gate, for the CPU SGLang-protocol server: the pause flag and the model-update lock.

SGLang's tokenizer manager lets a ``/generate`` (and the ``/health`` generation) reach the scheduler only
when generation is not paused, and then holds the shared side of a model-update lock until the request
has finished; a weight update takes the exclusive side, so it waits for the requests in flight and
blocks new ones meanwhile. The lock prefers writers: once an update waits, new requests queue behind it.
docs/sglang_standin.md cites the SGLang functions this follows.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field


@dataclass
class AdmissionGate:
    """Pause flag plus a writer-preferring reader/writer lock, with counters tests and logs can observe."""

    paused: bool = False
    readers: int = 0  # requests holding the shared side (admitted, not finished)
    writer_active: bool = False
    writers_waiting: int = 0
    blocked: int = 0  # requests waiting for admission (paused, or an update active or waiting)
    _cond: asyncio.Condition = field(default_factory=asyncio.Condition)

    def _admits_request(self) -> bool:
        return not self.paused and not self.writer_active and self.writers_waiting == 0

    @contextlib.asynccontextmanager
    async def request(self) -> AsyncIterator[None]:
        """Hold the shared side for one generation: waits while paused or while an update runs or waits."""
        async with self._cond:
            if not self._admits_request():
                self.blocked += 1
                try:
                    await self._cond.wait_for(self._admits_request)
                finally:
                    self.blocked -= 1
            self.readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self.readers -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def update(self, skip_when_paused: bool) -> AsyncIterator[None]:
        """Hold the exclusive side for one weight update: waits for the requests in flight to finish.

        ``skip_when_paused``: newer SGLang updates at once while generation is paused (whoever paused
        it owns the engine); older SGLang takes the lock regardless.
        """
        async with self._cond:
            if skip_when_paused and self.paused:
                exclusive = False
            else:
                exclusive = True
                self.writers_waiting += 1
                try:
                    await self._cond.wait_for(lambda: not self.writer_active and self.readers == 0)
                finally:
                    self.writers_waiting -= 1
                self.writer_active = True
        try:
            yield
        finally:
            if exclusive:
                async with self._cond:
                    self.writer_active = False
                    self._cond.notify_all()

    async def set_paused(self, paused: bool) -> None:
        """Pause (new requests wait at the gate) or continue (they are let in)."""
        async with self._cond:
            self.paused = paused
            self._cond.notify_all()

    async def wait_idle(self) -> None:
        """Wait until no request holds the shared side (every admitted request has finished)."""
        async with self._cond:
            await self._cond.wait_for(lambda: self.readers == 0)
