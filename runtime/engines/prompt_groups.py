"""The SGLang client's requests that share a prompt: the first primes one worker's prefix cache, the rest follow.

A GRPO group sends N requests of the same prompt at once. SGLang shares a prompt's prefill through
its radix cache, but only with requests admitted after the prompt is in it: requests that arrive
together are prefilled together, each computing the prompt (the default ``fcfs`` schedule policy does
no in-batch prefix matching). SGLang's own ``n`` sampling parameter avoids that by sending one
prefill-only request (``max_new_tokens`` 0) first and the N samples after it
(``tokenizer_manager._handle_batch_request``). The client cannot use ``n`` itself: SGLang gives every
sample a new random rid, so one sample can no longer be aborted or told apart, and the reply comes only
when all N are done, while APRIL aborts, buffers and resumes samples one by one. So the client does
what ``n`` does with one request per sample: the first request of a prompt sends the prefill-only
request and the others wait for it; then all of them go to the worker that holds the prompt.

This module is the bookkeeping only: which prompts are in flight, and which worker their first
request primed. Prompts are keyed by their token ids; a group lives while any of its requests runs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

# Primes a prompt; returns the URL of the worker that now holds it (None: no worker in particular, as
# through the router, or the priming failed). It must not raise for a failed priming: the samples then
# go as usual and meet the failure themselves.
Prime = Callable[[], Awaitable[str | None]]


@dataclass
class _Group:
    primed: asyncio.Future[str | None]  # set once, always with a result: followers never see an exception
    members: int = field(default=0)


class PromptGroups:
    """The prompts with requests in flight, by token ids."""

    def __init__(self) -> None:
        self._groups: dict[tuple[int, ...], _Group] = {}

    def __len__(self) -> int:
        return len(self._groups)

    @contextlib.asynccontextmanager
    async def join(self, ids: Sequence[int], prime: Prime) -> AsyncIterator[str | None]:
        """Join the group of prompt ``ids`` for the duration of one request; yields the worker its first
        request primed (None: any). The first request of a group runs ``prime``; the others wait for it."""
        key = tuple(ids)
        group = self._groups.get(key)
        leader = group is None
        if group is None:
            group = self._groups[key] = _Group(asyncio.get_running_loop().create_future())
        group.members += 1
        try:
            if leader:
                url: str | None = None
                try:
                    url = await prime()
                finally:  # also when the leader is cancelled: its followers go on without a worker
                    group.primed.set_result(url)
            yield await asyncio.shield(group.primed)
        finally:
            group.members -= 1
            if not group.members:
                del self._groups[key]
