"""Coalesced status syncs: a burst of child events of one job costs one sync; no request is ever lost."""

from __future__ import annotations

import asyncio
import threading

from rljob.operator.lifecycle import PodObs
from rljob.operator.sync_queue import SeenPod, PendingSyncs, StatusQueue, seen_under

from tests.helpers.waiting import wait_until


def pod(uid: str) -> PodObs:
    return PodObs(name=f"p-{uid}", uid=uid, role="trainer", pool=None, ordinal=0, deleting=False)


def test_one_worker_per_job_and_requests_merge_until_taken() -> None:
    plan = PendingSyncs()
    assert plan.request(("ns", "a")) is True  # start a worker
    assert plan.request(("ns", "a"), trainer_pods=[SeenPod(pod("1"), 1)]) is False  # joins the pending sync
    seen = [SeenPod(pod("1"), 1), SeenPod(pod("2"), 1)]
    assert plan.request(("ns", "a"), trainer_pods=seen, lost=[SeenPod(pod("3"), 1)]) is False
    assert plan.request(("ns", "b")) is True  # another job, its own worker
    work = plan.take(("ns", "a"))
    assert work is not None and sorted(work.trainer_pods) == ["1", "2"] and list(work.lost_inference_pods) == ["3"]
    assert plan.request(("ns", "a")) is False  # while a's sync runs: once more after it
    assert plan.take(("ns", "a")) is not None
    assert plan.take(("ns", "a")) is None  # nothing left: the worker ends
    assert plan.take(("ns", "b")) is not None and plan.take(("ns", "b")) is None
    assert len(plan) == 0 and plan.pending == {}
    assert plan.request(("ns", "a")) is True  # a later event starts a new worker


def test_a_burst_costs_one_sync_and_a_request_during_a_sync_one_more() -> None:
    calls: list[tuple[str, list[str]]] = []
    started, release = threading.Event(), threading.Event()

    def sync(namespace: str, name: str, trainer: list[SeenPod], lost: list[SeenPod]) -> bool:
        calls.append((name, sorted(p.pod.uid for p in trainer)))
        if len(calls) == 1:
            started.set()
            assert release.wait(120), "the test never released the first sync"
        return True

    async def scenario() -> None:
        queue = StatusQueue(sync, settle_s=0.05, threads=2)
        for i in range(50):  # one job's event burst
            queue.request("ns", "a", trainer_pods=[SeenPod(pod(str(i % 3)), 1)])
        assert await asyncio.to_thread(started.wait, 120), "the first sync never started"
        queue.request("ns", "a", trainer_pods=[SeenPod(pod("late"), 1)])  # arrives while the first sync runs
        queue.request("ns", "a")
        release.set()
        await wait_until(lambda: not len(queue), "every sync done")
        await queue.aclose()

    asyncio.run(scenario())
    assert calls == [("a", ["0", "1", "2"]), ("a", ["late"])]


def test_a_failing_sync_does_not_stop_the_job_worker_or_others() -> None:
    calls: list[str] = []

    def sync(namespace: str, name: str, trainer: list[SeenPod], lost: list[SeenPod]) -> bool:
        calls.append(name)
        if name == "bad":
            raise RuntimeError("API server unreachable")
        return True

    async def scenario() -> None:
        queue = StatusQueue(sync, settle_s=0.01, threads=2)
        queue.request("ns", "bad")
        queue.request("ns", "good")
        await wait_until(lambda: not len(queue), "both first syncs done")
        queue.request("ns", "bad")  # the failed job's next event is served again
        await wait_until(lambda: not len(queue), "the failed job's second sync done")
        await queue.aclose()

    asyncio.run(scenario())
    assert sorted(calls) == ["bad", "bad", "good"]


def test_a_busy_job_keeps_its_request_and_is_synced_once_free() -> None:
    """While an apply holds the job (sync answers False) the request, pods included, waits for the next try."""
    from rljob.operator.keyed_locks import KeyedLocks

    locks = KeyedLocks()
    seen: list[list[str]] = []
    busy_tries: list[int] = []

    def sync(namespace: str, name: str, trainer: list[SeenPod], lost: list[SeenPod]) -> bool:
        with locks.try_hold((namespace, name)) as free:
            if free:
                seen.append(sorted(p.pod.uid for p in trainer))
            else:
                busy_tries.append(len(trainer))
            return free

    async def scenario() -> None:
        queue = StatusQueue(sync, settle_s=0.01, threads=1)
        with locks.hold(("ns", "a")):  # the apply of job a
            queue.request("ns", "a", trainer_pods=[SeenPod(pod("exit"), 1)])
            await wait_until(lambda: len(busy_tries) >= 3, "three busy tries")
            assert seen == [] and len(queue) == 1
        await wait_until(lambda: not len(queue), "the sync once the job is free")
        await queue.aclose()

    asyncio.run(scenario())
    assert seen == [["exit"]] and set(busy_tries) == {1}  # every busy try carried the pod
    assert len(locks) == 0


def test_pods_seen_under_an_older_generation_are_no_news_for_the_current_one() -> None:
    """Suspend scales the pools to zero (their pods' DELETED events are losses seen under generation 2); a
    sync that runs only after the resume (generation 3) must not call the resumed job Degraded for them,
    nor count again a trainer failure from before the suspend."""
    lost = [SeenPod(pod("suspend-scaled"), 2), SeenPod(pod("now"), 3), SeenPod(pod("unknown"), None)]
    assert [p.uid for p in seen_under(lost, 3)] == ["now", "unknown"]
    assert [p.uid for p in seen_under(lost, 2)] == ["suspend-scaled", "unknown"]


def test_the_resync_skips_jobs_synced_within_its_period_and_forgets_gone_ones() -> None:
    plan = PendingSyncs()
    a, b, c = ("ns", "a"), ("ns", "b"), ("ns", "c")
    plan.done(a, now=100.0)
    plan.done(b, now=95.0)
    plan.request(c)  # c's sync is pending: the resync adds nothing
    assert plan.due([a, b, c], now=104.0, period_s=10.0) == []
    assert plan.due([a, b, c], now=106.0, period_s=10.0) == [b]  # b's last sync is a period old
    assert plan.due([a, b], now=110.0, period_s=10.0) == [a, b]
    assert plan.due([b], now=110.0, period_s=10.0) == [b] and set(plan.last_done) == {b}  # a deleted: forgotten


def test_a_finished_sync_is_recorded_for_the_resync() -> None:
    def sync(namespace: str, name: str, trainer: list[SeenPod], lost: list[SeenPod]) -> bool:
        return name != "busy"

    async def scenario() -> list[tuple[str, str]]:
        queue = StatusQueue(sync, settle_s=0.01, threads=1)
        jobs = [("ns", "a"), ("ns", "busy"), ("ns", "idle")]
        assert queue.due(jobs, period_s=60.0) == jobs
        queue.request("ns", "a")
        queue.request("ns", "busy")  # its sync answers busy, again and again: never recorded as done
        await wait_until(lambda: len(queue) == 1, "a's worker ended")
        due = queue.due(jobs, period_s=60.0)
        await queue.aclose()
        return due

    assert asyncio.run(scenario()) == [("ns", "idle")]
