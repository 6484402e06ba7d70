"""Waiting on a named condition in async tests, with a deadline generous enough for a loaded CI box.

A fixed number of short polls (say 2,000 x 5 ms) is a timing assumption in disguise: on a 2-core
machine shared with other work, a tiny model's first tokens can take longer than 10 s. The deadline
here is wall-clock and wide; a test that really hangs still fails, with the condition's name.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable

DEFAULT_TIMEOUT_S = 120.0


async def wait_until(
    condition: Callable[[], bool | Awaitable[bool]],
    what: str,
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    interval: float = 0.005,
) -> None:
    """Poll `condition` (sync or async) until it is true; AssertionError naming `what` after `timeout` s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if loop.time() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(interval)
