"""How many requests one SGLang worker runs at once, from its server info, and a gate that holds the
client's in-flight ``/generate`` calls to what its workers can run (pure rule + one asyncio primitive).

SGLang's scheduler runs at most ``max_running_requests`` requests per data-parallel rank; the rest
wait in its queue. Its server info (``/get_server_info``, ``/server_info`` on 0.5.23) spreads the
ServerArgs fields and the scheduler's start-up info, read from the released source:

- ``max_running_requests``: the ``--max-running-requests`` flag, None unless given;
- without the flag the scheduler derives it (``tp_worker.py`` and ``model_runner.py``, 0.5.5.post3):
  ``min(max_total_num_tokens // 2, pool)`` with the request pool
  ``pool = min(max(int(max_total_num_tokens / context_len * 512), 2048), 4096)``;
  ``max_total_num_tokens`` and ``max_req_input_len`` come with the scheduler's info, ``context_length``
  is the flag (None unless given), so the model's context is taken as ``max_req_input_len`` when the
  flag is absent (the two differ by a handful of tokens; the pool's clamp to 2048..4096 absorbs it).

The client then holds as many calls in flight as the rotation's workers can run together: the total
grows with every replica instead of one fixed semaphore shared by all of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

_POOL_MIN, _POOL_MAX, _POOL_PER_CONTEXT = 2048, 4096, 512  # model_runner.py's request-pool sizing


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def running_capacity(info: Mapping[str, Any]) -> int | None:
    """Requests the server runs at once over all its data-parallel ranks (see the module docstring);
    None when its server info tells neither the flag nor the scheduler's token budget."""
    dp = _positive_int(info.get("dp_size")) or 1
    flag = _positive_int(info.get("max_running_requests"))
    if flag is not None:
        return flag * dp
    total = _positive_int(info.get("max_total_num_tokens"))
    context = _positive_int(info.get("context_length")) or _positive_int(info.get("max_req_input_len"))
    if total is None or context is None:
        return None
    pool = min(max(int(total / context * _POOL_PER_CONTEXT), _POOL_MIN), _POOL_MAX)
    return max(1, min(total // 2, pool)) * dp


class SlotGate:
    """In-flight slots whose number follows a changing limit (the rotation's total capacity).

    ``limit`` is read whenever a slot may be taken: when one is released, and every ``recheck_s``
    (a worker joining the rotation raises the limit without releasing anything). Releasing never
    waits, so a cancelled request always gives its slot back."""

    def __init__(self, limit: Callable[[], int], recheck_s: float = 0.5) -> None:
        self._limit = limit
        self._recheck_s = recheck_s
        self._released = asyncio.Event()
        self.in_use = 0

    async def acquire(self) -> None:
        """Wait for a free slot and take it."""
        while self.in_use >= max(1, self._limit()):
            self._released.clear()
            try:
                await asyncio.wait_for(self._released.wait(), self._recheck_s)
            except TimeoutError:
                pass
        self.in_use += 1  # no await since the check: nobody took the slot meanwhile

    def release(self) -> None:
        """Give a slot back and wake the waiters."""
        self.in_use -= 1
        self._released.set()
