"""The CPU server's admission gate (runtime/engines/admission.py): SGLang's pause flag and its
writer-preferring model-update lock, driven by real tasks and observed through the gate's counters."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from rljob.runtime.engines.admission import AdmissionGate
from tests.helpers.waiting import wait_until


class Holder:
    """A task inside one of the gate's context managers until `release` is set."""

    def __init__(self, side: contextlib.AbstractAsyncContextManager[None]) -> None:
        self.inside = asyncio.Event()
        self.release = asyncio.Event()
        self.task = asyncio.ensure_future(self._hold(side))

    async def _hold(self, side: contextlib.AbstractAsyncContextManager[None]) -> None:
        async with side:
            self.inside.set()
            await self.release.wait()

    async def finish(self) -> None:
        self.release.set()
        await self.task


@pytest.fixture
async def holders() -> AsyncIterator[list[Holder]]:
    made: list[Holder] = []
    yield made
    for h in made:  # nothing outlives the test, whatever it asserted
        h.task.cancel()
    await asyncio.gather(*(h.task for h in made), return_exceptions=True)


def hold(holders: list[Holder], side: contextlib.AbstractAsyncContextManager[None]) -> Holder:
    holders.append(Holder(side))
    return holders[-1]


async def test_a_waiting_update_goes_before_requests_that_came_after_it(holders: list[Holder]) -> None:
    gate = AdmissionGate()
    first = hold(holders, gate.request())
    await first.inside.wait()
    update = hold(holders, gate.update(skip_when_paused=True))
    await wait_until(lambda: gate.writers_waiting == 1, "the update waiting for the request in flight")
    later = hold(holders, gate.request())
    await wait_until(lambda: gate.blocked == 1, "the later request queued behind the update")
    assert not update.inside.is_set() and gate.readers == 1

    await first.finish()
    await update.inside.wait()
    assert gate.writer_active and gate.readers == 0 and not later.inside.is_set()
    await update.finish()
    await later.inside.wait()
    assert (gate.writer_active, gate.readers, gate.blocked) == (False, 1, 0)
    await later.finish()


async def test_paused_requests_wait_and_newer_sglang_updates_at_once(holders: list[Holder]) -> None:
    gate = AdmissionGate()
    await gate.set_paused(True)
    request = hold(holders, gate.request())
    await wait_until(lambda: gate.blocked == 1, "the request held at the paused gate")
    async with gate.update(skip_when_paused=True):  # whoever paused owns the engine: no lock taken
        assert not gate.writer_active and gate.writers_waiting == 0
    await gate.set_paused(False)
    await request.inside.wait()
    assert gate.readers == 1
    await request.finish()


async def test_older_sglang_takes_the_lock_even_while_paused() -> None:
    gate = AdmissionGate()
    await gate.set_paused(True)
    async with gate.update(skip_when_paused=False):
        assert gate.writer_active
    assert not gate.writer_active


async def test_wait_idle_returns_once_every_admitted_request_finished(holders: list[Holder]) -> None:
    gate = AdmissionGate()
    request = hold(holders, gate.request())
    await request.inside.wait()
    idle = asyncio.ensure_future(gate.wait_idle())
    try:
        for _ in range(5):  # loop turns, not time: an uncontended wait_idle would finish within two
            await asyncio.sleep(0)
        assert gate.readers == 1 and not idle.done()
        await request.finish()
        await asyncio.wait_for(idle, timeout=60)
        assert gate.readers == 0
    finally:
        idle.cancel()
        await asyncio.gather(idle, return_exceptions=True)
