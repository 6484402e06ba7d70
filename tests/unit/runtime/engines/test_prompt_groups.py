"""The SGLang client's prompt groups (prompt_groups.py): one priming per prompt in flight, followers
wait for it and get its worker, a failed or cancelled priming never strands them, groups end with
their last request."""

from __future__ import annotations

import asyncio

from rljob.runtime.engines.prompt_groups import PromptGroups
from tests.helpers.waiting import wait_until


async def test_the_first_request_of_a_prompt_primes_and_the_others_follow_its_worker() -> None:
    groups = PromptGroups()
    primes: list[str] = []
    release = asyncio.Event()

    async def prime() -> str | None:
        primes.append("primed")
        await release.wait()
        return "http://worker-b"

    async def member(ids: list[int]) -> str | None:
        async with groups.join(ids, prime) as url:
            return url

    same = [asyncio.create_task(member([1, 2, 3])) for _ in range(4)]
    other = asyncio.create_task(member([1, 2]))  # another prompt: its own group and its own priming
    await wait_until(lambda: len(primes) == 2, "both prompts priming")
    assert len(groups) == 2 and not any(t.done() for t in same)  # the followers wait for the priming
    release.set()
    assert await asyncio.gather(*same, other) == ["http://worker-b"] * 5
    assert len(primes) == 2 and len(groups) == 0


async def test_a_cancelled_priming_lets_its_followers_go_without_a_worker() -> None:
    groups = PromptGroups()
    started = asyncio.Event()

    async def prime() -> str | None:
        started.set()
        await asyncio.Event().wait()  # never primes: its request is cancelled first
        return "never"

    async def member() -> str | None:
        async with groups.join([7, 8], prime) as url:
            return url

    leader = asyncio.create_task(member())
    await started.wait()
    follower = asyncio.create_task(member())
    await wait_until(lambda: groups._groups[(7, 8)].members == 2, "the follower joining")
    leader.cancel()
    assert await follower is None
    assert leader.cancelled() and len(groups) == 0
