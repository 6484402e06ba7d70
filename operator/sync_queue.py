"""Coalesced status syncs: N child events of one RLJob within a short window cost one status computation.

Every child event (a pod scheduled, a StatefulSet's readyReplicas moving, ...) asks for a status sync of
its job. Computing it per event cost a full observe + decide per event, ~50 events per job while it
starts, and held kopf's worker threads that the child applies of new jobs also need. Instead:

- `PendingSyncs` (pure, no I/O) keeps at most one pending sync per job, merging what the events carry
  (trainer pods and lost inference pods the watch saw and a fresh read may no longer show), and at most
  one worker per job: a request while the job's sync runs is done once more right after it.
- `StatusQueue` runs the syncs on its own small thread pool (never kopf's, so applies do not wait
  behind status work), each after a short settling delay that lets a burst of events coalesce. A job
  whose apply is running is not waited for: its request is kept and tried after the next delay.
- The periodic resync asks only for the jobs that no sync covered within its period (`due`): while
  jobs start, their own events sync them several times a period, and the resync's pass on top was
  most of a starting job's syncs. A job's status is therefore recomputed at least every two periods.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from rljob.operator.metrics import RECONCILE_ERRORS
from rljob.operator.lifecycle import PodObs

log = logging.getLogger(__name__)

JobKey = tuple[str, str]  # namespace, name


@dataclass(frozen=True)
class SeenPod:
    """A pod as the watch saw it (failed, finished, lost), and the RLJob generation it was seen under (None:
    unknown).

    A sync may run after a spec change (the job was busy with its apply): what a pod did under another
    generation is no news for the current one. An inference pod lost to a suspend's scale-down is no loss
    after the resume, and a trainer pod's failure from before a suspend, whose handled key was dropped
    while the pod was gone, must not count a second time after the resume.
    """

    pod: PodObs
    generation: int | None


def seen_under(pods: Iterable[SeenPod], generation: int) -> list[PodObs]:
    """The pods that count for the RLJob at `generation` (seen under it, or under an unknown one)."""
    return [p.pod for p in pods if p.generation in (None, generation)]


@dataclass
class SyncRequest:
    """What one pending sync of a job carries: pods seen by the watch, by uid (the latest report wins)."""

    trainer_pods: dict[str, SeenPod] = field(default_factory=dict)
    lost_inference_pods: dict[str, SeenPod] = field(default_factory=dict)

    def merge(self, trainer_pods: Iterable[SeenPod], lost_inference_pods: Iterable[SeenPod]) -> None:
        """Add the pods of one more request."""
        self.trainer_pods.update((p.pod.uid, p) for p in trainer_pods)
        self.lost_inference_pods.update((p.pod.uid, p) for p in lost_inference_pods)


@dataclass
class PendingSyncs:
    """Per-job single flight: which jobs have a worker, and the merged request each one waits to do."""

    pending: dict[JobKey, SyncRequest] = field(default_factory=dict)
    working: set[JobKey] = field(default_factory=set)
    # When each job's last sync finished (monotonic seconds); only listed jobs are kept (see `due`).
    last_done: dict[JobKey, float] = field(default_factory=dict)

    def request(self, key: JobKey, trainer_pods: Iterable[SeenPod] = (), lost: Iterable[SeenPod] = ()) -> bool:
        """Record a sync request; True when the caller must start the job's worker (none runs yet)."""
        self.pending.setdefault(key, SyncRequest()).merge(trainer_pods, lost)
        if key in self.working:
            return False
        self.working.add(key)
        return True

    def take(self, key: JobKey) -> SyncRequest | None:
        """The worker's next sync: everything requested since its last one; None (worker ends) when nothing is."""
        work = self.pending.pop(key, None)
        if work is None:
            self.working.discard(key)
        return work

    def done(self, key: JobKey, now: float) -> None:
        """Record that a sync of the job finished at `now`."""
        self.last_done[key] = now

    def due(self, jobs: Sequence[JobKey], now: float, period_s: float) -> list[JobKey]:
        """The jobs a resync at `now` must sync: neither in work nor synced within `period_s`. Forgets the
        jobs not in `jobs` (all live jobs), so the record stays bounded as jobs come and go."""
        listed = set(jobs)
        for key in [k for k in self.last_done if k not in listed]:
            del self.last_done[key]
        return [
            k for k in jobs
            if k not in self.working and now - self.last_done.get(k, float("-inf")) >= period_s
        ]

    def __len__(self) -> int:
        """Jobs with a worker (bounded by the live jobs; 0 when idle)."""
        return len(self.working)


# Returns False when the job was busy: its request is then kept and tried again after the settling delay.
SyncFn = Callable[[str, str, list[SeenPod], list[SeenPod]], bool]


class StatusQueue:
    """Runs coalesced status syncs in the event loop's background, on `threads` threads of its own."""

    def __init__(self, sync: SyncFn, settle_s: float = 0.2, threads: int = 4) -> None:
        self._sync = sync
        self._settle_s = settle_s
        self._plan = PendingSyncs()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="status")
        self._tasks: set[asyncio.Task[None]] = set()

    def request(self, namespace: str, name: str, trainer_pods: Iterable[SeenPod] = (), lost: Iterable[SeenPod] = ()) -> None:
        """Ask for a sync of one job (call from the event loop; returns at once)."""
        key = (namespace, name)
        if self._plan.request(key, trainer_pods, lost):
            task = asyncio.get_running_loop().create_task(self._work(key), name=f"status {namespace}/{name}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _work(self, key: JobKey) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._settle_s)  # let the rest of an event burst join this sync
            work = self._plan.take(key)
            if work is None:
                return
            trainer, lost = list(work.trainer_pods.values()), list(work.lost_inference_pods.values())
            try:
                if await loop.run_in_executor(self._pool, self._sync, *key, trainer, lost):
                    self._plan.done(key, time.monotonic())
                else:
                    self._plan.request(key, trainer, lost)  # busy: merged back, this worker goes on
            except Exception:  # noqa: BLE001 - the next event or resync tries again
                RECONCILE_ERRORS.labels("status-queue").inc()
                log.exception("status sync of %s/%s failed", *key)

    def due(self, jobs: Sequence[JobKey], period_s: float) -> list[JobKey]:
        """Of `jobs` (every live job), those that no sync covered within the last `period_s` (see PendingSyncs.due)."""
        return self._plan.due(jobs, time.monotonic(), period_s)

    def __len__(self) -> int:
        """Jobs with a sync pending or running."""
        return len(self._plan)

    async def aclose(self) -> None:
        """Cancel pending syncs and stop the threads (operator shutdown)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._pool.shutdown(wait=False, cancel_futures=True)
