"""An asyncio event loop whose clock is virtual: it jumps to the next timer instead of sleeping.

The simulator runs the runtime's real rollout scheduler, unchanged, on this loop. Every
`asyncio.sleep`, `asyncio.wait(timeout=...)` and `loop.call_at` works as usual, but when no
callback is ready the clock advances straight to the earliest scheduled timer, so a simulated hour
of cluster time costs only the Python work of its events. Real file descriptors (the loop's own
self-pipe) are still polled, without blocking.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class SimulationDeadlock(RuntimeError):
    """Nothing is ready and no timer is scheduled: the simulated system can never make progress."""


class _VirtualSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """Polls real descriptors without blocking; a would-be wait advances the virtual clock."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise SimulationDeadlock(
                "the simulation is waiting on something no simulated event will ever resolve"
            )
        self.now += timeout
        return ready


class VirtualTimeEventLoop(asyncio.SelectorEventLoop):
    """A selector event loop on virtual time, starting at t = 0 seconds."""

    def __init__(self) -> None:
        self._virtual = _VirtualSelector()
        super().__init__(self._virtual)
        # Timers due within this resolution of `time()` run in the same iteration; virtual time
        # is exact, so only float rounding needs absorbing.
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self._virtual.now


def run_virtual(main: Coroutine[Any, Any, T]) -> tuple[T, float]:
    """Run `main` to completion on a fresh virtual-time loop; returns its result and the virtual
    seconds it took."""
    loop = VirtualTimeEventLoop()
    try:
        result = loop.run_until_complete(main)
        return result, loop.time()
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
