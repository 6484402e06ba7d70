"""ResyncLoop with concurrency: bounded, no job twice at once, a slow job never holds the others back."""

from __future__ import annotations

import asyncio

import pytest

from rljob.operator.resync import ResyncLoop
from tests.helpers.waiting import wait_until


async def test_concurrent_passes_are_bounded_and_a_job_in_flight_is_not_started_again() -> None:
    jobs = [("ns", f"j{i}") for i in range(4)]
    release = {name: asyncio.Event() for _, name in jobs}
    running: list[str] = []
    finished: list[str] = []

    async def job_pass(namespace: str, name: str) -> None:
        running.append(name)
        await release[name].wait()
        running.remove(name)
        finished.append(name)

    loop = ResyncLoop("test", 60.0, lambda: jobs, job_pass, concurrency=2)
    await loop.run_once()
    await wait_until(lambda: len(running) == 2, "two passes running")
    await loop.run_once()  # nothing new: all four are in flight (two of them waiting for a slot)
    assert sorted(loop.in_flight()) == jobs and len(running) == 2
    slow = running[0]
    for _, name in jobs:
        if name != slow:
            release[name].set()
    # The other three all run and finish while the slow one still holds its slot.
    await wait_until(lambda: len(finished) == 3, "the three other passes")
    assert slow not in finished and loop.in_flight() == [("ns", slow)]
    await loop.run_once()  # the finished ones start again; the slow one is not doubled
    await wait_until(lambda: len(finished) == 6, "their next passes")
    assert running == [slow]
    await loop.stop()
    assert loop.in_flight() == []


async def test_a_failing_pass_is_counted_and_the_others_still_run() -> None:
    seen: list[str] = []

    async def job_pass(namespace: str, name: str) -> None:
        seen.append(name)
        if name == "bad":
            raise RuntimeError("broken")

    loop = ResyncLoop("test", 60.0, lambda: [("ns", "bad"), ("ns", "good")], job_pass, concurrency=4)
    await loop.run_once()
    await wait_until(lambda: not loop.in_flight(), "both passes done")
    assert sorted(seen) == ["bad", "good"]


def test_concurrency_must_be_positive() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        ResyncLoop("test", 1.0, list, lambda ns, n: asyncio.sleep(0), concurrency=0)
