"""Periodic passes over every RLJob, without kopf timers (so without finalizers).

kopf adds its finalizer (`rljob.io/finalizer`) to every object that has a timer or daemon, so that
it can stop them before the object goes. An RLJob needs no clean-up before deletion (owner
references delete the children), and a finalizer would make `kubectl delete rljob` hang whenever
the operator is not running (after `helm uninstall`, for example). These loops do what the timers
did: every `interval` seconds they list the RLJobs in the watched namespaces and run one pass per
job. A failing pass is logged and counted; it never stops the loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from rljob.api.spec import API_GROUP, API_VERSION
from rljob.common.kube import RLJOB_PLURAL, Kube
from rljob.operator.metrics import RECONCILE_ERRORS

log = logging.getLogger(__name__)

JobPass = Callable[[str, str], Awaitable[None]]
JobKey = tuple[str, str]


def list_rljobs(kube: Kube, namespaces: Sequence[str]) -> list[tuple[str, str]]:
    """(namespace, name) of every RLJob in `namespaces` (all namespaces when empty)."""
    paths = (
        [f"/apis/{API_GROUP}/{API_VERSION}/namespaces/{ns}/{RLJOB_PLURAL}" for ns in namespaces]
        if namespaces
        else [f"/apis/{API_GROUP}/{API_VERSION}/{RLJOB_PLURAL}"]
    )
    jobs: list[tuple[str, str]] = []
    for path in paths:
        for item in kube.request("GET", path).get("items", []):
            meta = item["metadata"]
            if not meta.get("deletionTimestamp"):
                jobs.append((meta["namespace"], meta["name"]))
    return jobs


@dataclass(frozen=True)
class ResyncLoop:
    """Runs `job_pass` for every RLJob every `interval` seconds (metrics step: `step`).

    With `concurrency` 1 a pass visits the jobs one after another and the next pass starts when it is
    done. Above 1, each job's pass runs as its own task, at most `concurrency` at once: a job whose pass
    is slow (an unreachable Prometheus waits out its timeout) holds one slot and is skipped by later
    passes until it returns, while every other job keeps its own period.
    """

    step: str
    interval: float
    list_jobs: Callable[[], list[JobKey]]
    job_pass: JobPass
    # Which of the listed jobs this pass visits (run in the event loop, so it may read loop-owned state).
    select: Callable[[list[JobKey]], list[JobKey]] | None = None
    concurrency: int = 1
    # Jobs whose pass is running or waiting for a slot (concurrency > 1); touched only in the event loop.
    _in_flight: dict[JobKey, asyncio.Task[None]] = field(default_factory=dict, repr=False, compare=False)
    _slots: asyncio.Semaphore = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"{self.step}: concurrency must be at least 1, not {self.concurrency}")
        # A semaphore binds to the event loop on first use, not here: the loop may be built outside it.
        object.__setattr__(self, "_slots", asyncio.Semaphore(self.concurrency))

    async def run_once(self) -> None:
        """One pass over all (selected) RLJobs; errors are logged and counted per job.

        With concurrency above 1 it starts the passes and returns (see in_flight).
        """
        try:
            jobs = await asyncio.to_thread(self.list_jobs)
            if self.select is not None:
                jobs = self.select(jobs)
        except Exception as err:  # noqa: BLE001 - the loop must survive an unreachable API server
            RECONCILE_ERRORS.labels(f"{self.step}-list").inc()
            log.warning("%s: cannot list RLJobs: %s", self.step, err)
            return
        if self.concurrency == 1:
            for job in jobs:
                await self._pass_one(job)
            return
        for job in jobs:
            if job not in self._in_flight:
                self._in_flight[job] = asyncio.create_task(self._bounded(job), name=f"{self.step} {job[0]}/{job[1]}")

    def in_flight(self) -> list[JobKey]:
        """Jobs whose pass has not returned yet (concurrency above 1)."""
        return list(self._in_flight)

    async def _bounded(self, job: JobKey) -> None:
        try:
            async with self._slots:
                await self._pass_one(job)
        finally:
            self._in_flight.pop(job, None)

    async def _pass_one(self, job: JobKey) -> None:
        namespace, name = job
        try:
            await self.job_pass(namespace, name)
        except Exception:  # noqa: BLE001 - one broken job must not starve the others
            RECONCILE_ERRORS.labels(self.step).inc()
            log.exception("%s of %s/%s failed", self.step, namespace, name)

    async def stop(self) -> None:
        """Cancel the passes in flight (operator shutdown)."""
        tasks = list(self._in_flight.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def run_forever(self) -> None:
        """Sleep, pass, repeat (cancelled at operator shutdown)."""
        while True:
            await asyncio.sleep(self.interval)
            await self.run_once()
