"""The operator's bounded per-job state: keyed locks, the object cache, no-op status applies, Lease rules."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from rljob.operator.cache import ObjectCache, parse_selector
from rljob.operator.keyed_locks import KeyedLocks
from rljob.operator.leader import LeaseRecord, may_take
from rljob.operator.reconcile import status_apply_changes


def test_locks_are_dropped_when_jobs_go_away() -> None:
    locks = KeyedLocks()
    for i in range(1000):
        with locks.hold(("ns", f"job-{i}")):
            assert len(locks) == 1
    assert len(locks) == 0


def test_locks_serialise_one_key_and_survive_contention() -> None:
    locks = KeyedLocks()
    inside = 0
    most = 0
    guard = threading.Lock()

    def work() -> None:
        nonlocal inside, most
        for _ in range(200):
            with locks.hold(("ns", "same")):
                with guard:
                    inside += 1
                    most = max(most, inside)
                with guard:
                    inside -= 1

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most == 1 and len(locks) == 0


def obj(name: str, job: str, rv: str, role: str = "inference", **extra: Any) -> dict[str, Any]:
    labels = {"rljob.io/job-name": job, "rljob.io/role": role}
    return {"metadata": {"name": name, "namespace": "ns", "labels": labels, "resourceVersion": rv}, **extra}


def test_cache_lists_by_job_and_labels_and_forgets_deleted_objects() -> None:
    cache = ObjectCache()
    for i in range(100):
        cache.upsert("v1", "Pod", obj(f"j{i}-infer-0", f"j{i}", "1"))
        cache.upsert("v1", "Pod", obj(f"j{i}-trainer-0", f"j{i}", "1", role="trainer"))
    cache.mark_synced()
    labels = {"rljob.io/job-name": "j7", "rljob.io/role": "trainer"}
    assert [o["metadata"]["name"] for o in cache.list_job("v1", "Pod", "ns", labels) or []] == ["j7-trainer-0"]
    assert cache.list_job("v1", "Pod", "ns", {"rljob.io/job-name": "absent"}) == []  # synced: really none
    assert cache.list_job("v1", "Pod", "other", labels) == []
    for i in range(100):
        cache.remove("v1", "Pod", "ns", f"j{i}-infer-0")
        cache.remove("v1", "Pod", "ns", f"j{i}-trainer-0")
    assert len(cache) == 0 and cache.index_size() == 0


def test_cache_answers_no_list_before_it_is_synced() -> None:
    """After a restart the initial lists arrive object by object: a job's trainer pod may be cached before
    its inference pods. An unsynced cache must not answer with that partial list (the status would call
    the job's pool unready: the Running -> Degraded flap seen after operator restarts), nor call an
    object absent; once synced it answers both."""
    cache = ObjectCache()
    cache.upsert("v1", "Pod", obj("j-trainer-0", "j", "1", role="trainer"))
    job = {"rljob.io/job-name": "j"}
    assert cache.list_job("v1", "Pod", "ns", job) is None
    assert cache.list_job("apps/v1", "StatefulSet", "ns", job) is None
    cache.upsert("v1", "Pod", obj("j-infer-0", "j", "1"))
    cache.mark_synced()
    assert [o["metadata"]["name"] for o in cache.list_job("v1", "Pod", "ns", job) or []] == ["j-infer-0", "j-trainer-0"]
    assert cache.list_job("apps/v1", "StatefulSet", "ns", job) == []


def test_unsynced_reads_go_to_the_api_server_and_synced_ones_do_not() -> None:
    """CachedKube.observe-style reads: before the sync every list and get of a job asks the API (which
    has the whole truth), after it none does, and a missing child is None without a request."""
    from rljob.operator.cache import CachedKube

    calls: list[str] = []
    api_pods = [obj("j-trainer-0", "j", "1", role="trainer"), obj("j-infer-0", "j", "1")]

    class Server(CachedKube):
        def request(self, method: str, path: str, body: Any = None, query: Any = None, content_type: str = "") -> Any:
            calls.append(path)
            if path.endswith("/pods"):
                return {"items": api_pods}
            from rljob.common.kube import KubeError

            raise KubeError(404, {"message": "not found"})

    kube = Server(api=None)  # type: ignore[arg-type]
    kube.cache.upsert("v1", "Pod", api_pods[0])  # the trainer pod's listing arrived, the inference pod's not yet
    assert len(kube.list("v1", "Pod", "ns", "rljob.io/job-name=j")) == 2
    assert kube.get("batch/v1", "Job", "ns", "j-trainer") is None
    assert len(calls) == 2
    kube.cache.upsert("v1", "Pod", api_pods[1])
    kube.cache.mark_synced()
    assert len(kube.list("v1", "Pod", "ns", "rljob.io/job-name=j")) == 2
    assert kube.get("batch/v1", "Job", "ns", "j-trainer") is None
    assert kube.list("apps/v1", "StatefulSet", "ns", "rljob.io/job-name=j") == []
    assert len(calls) == 2


def test_cache_keeps_the_newer_version_and_replaces_objects_whole() -> None:
    """Reads hand out the cached objects without a copy: safe because an upsert replaces an object and never
    changes one in place, so a reader keeps the version it read."""
    cache = ObjectCache()
    cache.upsert("v1", "Pod", obj("p", "j", "20", status={"phase": "Running"}))
    cache.upsert("v1", "Pod", obj("p", "j", "10", status={"phase": "Pending"}))  # a late, older event
    got = cache.get("v1", "Pod", "ns", "p")
    assert got is not None and got["status"]["phase"] == "Running"
    cache.upsert("v1", "Pod", obj("p", "j", "30", status={"phase": "Failed"}))
    assert got["status"]["phase"] == "Running" and got["metadata"]["resourceVersion"] == "20"
    assert cache.get("v1", "Pod", "ns", "p")["status"]["phase"] == "Failed"  # type: ignore[index]


def test_a_write_answer_that_a_deletion_overtook_leaves_no_ghost() -> None:
    """The answer to our PATCH of an object may be stored after the object's DELETED event was handled (a
    thread descheduled in between): the tombstone refuses that older version; a new object of the name is kept."""
    cache = ObjectCache()
    cache.mark_synced()
    cache.upsert("batch/v1", "Job", obj("j-trainer", "j", "5", role="trainer"))
    cache.remove("batch/v1", "Job", "ns", "j-trainer", deleted_version="7")
    cache.upsert("batch/v1", "Job", obj("j-trainer", "j", "6", role="trainer"))  # the late answer
    assert cache.get("batch/v1", "Job", "ns", "j-trainer") is None
    assert cache.list_job("batch/v1", "Job", "ns", {"rljob.io/job-name": "j"}) == []
    cache.upsert("batch/v1", "Job", obj("j-trainer", "j", "9", role="trainer"))  # recreated
    assert cache.get("batch/v1", "Job", "ns", "j-trainer")["metadata"]["resourceVersion"] == "9"  # type: ignore[index]


def test_an_object_deleting_for_long_is_read_from_the_api_server() -> None:
    """A DELETED event lost across a watch's relist leaves a ghost that is still 'deleting', and the reconcile
    waits for it forever. A recent deletion is served from the cache; one older than STALE_DELETION_S is
    checked with a GET, whose answer (gone) replaces the ghost."""
    from datetime import datetime, timedelta, timezone

    from rljob.common.kube import KubeError
    from rljob.operator.cache import STALE_DELETION_S, CachedKube

    calls: list[str] = []

    class Server(CachedKube):
        def request(self, method: str, path: str, body: Any = None, query: Any = None, content_type: str = "") -> Any:
            calls.append(f"{method} {path}")
            raise KubeError(404, {"message": "not found"})

    def deleting(name: str, seconds_ago: float) -> dict[str, Any]:
        stamp = (datetime.now(timezone.utc) - timedelta(seconds=seconds_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")
        job = obj(name, "j", "3", role="trainer")
        job["metadata"]["deletionTimestamp"] = stamp
        return job

    kube = Server(api=None)  # type: ignore[arg-type]
    kube.cache.mark_synced()
    kube.cache.upsert("batch/v1", "Job", deleting("recent", 5))
    kube.cache.upsert("batch/v1", "Job", deleting("ghost", STALE_DELETION_S + 30))
    assert kube.get("batch/v1", "Job", "ns", "recent") is not None and calls == []
    assert kube.get("batch/v1", "Job", "ns", "ghost") is None
    assert calls == ["GET /apis/batch/v1/namespaces/ns/jobs/ghost"]
    assert kube.get("batch/v1", "Job", "ns", "ghost") is None and len(calls) == 1  # the ghost is gone from the cache


def test_relabelled_object_moves_between_jobs() -> None:
    cache = ObjectCache()
    cache.upsert("v1", "Pod", obj("p", "a", "1"))
    cache.upsert("v1", "Pod", obj("p", "b", "2"))
    cache.mark_synced()
    assert cache.list_job("v1", "Pod", "ns", {"rljob.io/job-name": "a"}) == []
    assert len(cache.list_job("v1", "Pod", "ns", {"rljob.io/job-name": "b"}) or []) == 1


def test_selectors_served_from_the_cache_are_equality_only() -> None:
    assert parse_selector("rljob.io/job-name=j,rljob.io/role=trainer") == {
        "rljob.io/job-name": "j",
        "rljob.io/role": "trainer",
    }
    with pytest.raises(ValueError):
        parse_selector("rljob.io/role!=trainer")


_RUNNING = {"phase": "Running", "rollout": {"ready": 2}}
_READY = {"type": "Ready", "status": "True"}
_TUNED = {"type": "AutotuneActive", "status": "True"}


@pytest.mark.parametrize(
    ("current", "previous", "applied", "changes"),
    [
        # Live status holds every applied value, other managers' fields and conditions besides: no write.
        ({**_RUNNING, "trainer": {"step": 3}}, _RUNNING, _RUNNING, False),
        ({"conditions": [_READY, _TUNED]}, {"conditions": [_READY]}, {"conditions": [_READY]}, False),
        # A changed value, a condition of ours added or changed, a field missing live: write.
        (_RUNNING, _RUNNING, {**_RUNNING, "phase": "Degraded"}, True),
        ({"conditions": [_TUNED]}, {"conditions": []}, {"conditions": [_READY]}, True),
        ({"conditions": [_READY]}, {"conditions": [_READY]}, {"conditions": [{**_READY, "status": "False"}]}, True),
        ({}, {"rollout": {"ready": 0}}, {"rollout": {"ready": 0}}, True),
        # A field the operator held and now leaves out must be removed by the apply: write.
        ({**_RUNNING, "outcome": {"reason": "x"}}, {**_RUNNING, "outcome": {"reason": "x"}}, _RUNNING, True),
    ],
)
def test_status_apply_changes(
    current: dict[str, Any], previous: dict[str, Any], applied: dict[str, Any], changes: bool
) -> None:
    assert status_apply_changes(current, previous, applied) is changes


def record(holder: str, renew: str = "t1", duration: int = 15) -> LeaseRecord:
    return LeaseRecord(holder=holder, renew_time=renew, duration_s=duration, transitions=0)


def test_lease_is_taken_when_free_held_or_expired_on_our_own_clock() -> None:
    assert may_take(record(""), "me", observed_at=100.0, now=100.0)
    assert may_take(record("me"), "me", observed_at=100.0, now=100.0)
    assert not may_take(record("other"), "me", observed_at=100.0, now=114.9)
    assert may_take(record("other"), "me", observed_at=100.0, now=115.0)


def test_a_refused_status_write_makes_the_next_read_fresh() -> None:
    """A status apply the API server refuses (409): the cached RLJob is dropped, the retry GETs it from the API."""
    from rljob.common.kube import KubeError
    from rljob.operator.cache import RLJOB_API_VERSION, CachedKube

    calls: list[tuple[str, str]] = []
    fresh = obj("job", "job", "9")

    class Server(CachedKube):
        def request(self, method: str, path: str, body: Any = None, query: Any = None, content_type: str = "") -> Any:
            calls.append((method, path))
            if method == "PATCH":
                raise KubeError(409, {"message": "the object has been modified"})
            return fresh

    kube = Server(api=None)  # type: ignore[arg-type]
    kube.cache.upsert(RLJOB_API_VERSION, "RLJob", obj("job", "job", "5"))
    assert kube.get_rljob("ns", "job")["metadata"]["resourceVersion"] == "5"  # type: ignore[index]
    assert calls == []
    with pytest.raises(KubeError):
        kube.apply_rljob_status("ns", "job", {"phase": "Running"})
    assert kube.get_rljob("ns", "job")["metadata"]["resourceVersion"] == "9"  # type: ignore[index]
    assert [m for m, _ in calls] == ["PATCH", "GET"]
    assert kube.cache.get(RLJOB_API_VERSION, "RLJob", "ns", "job")["metadata"]["resourceVersion"] == "9"  # type: ignore[index]


def test_a_status_sync_applies_only_what_the_current_generation_already_applied() -> None:
    """A new job whose create handler has not run (kopf's workers busy) or is half-way has no trainer Job:
    its resync or early child events must leave the apply to that handler (they used to apply every child
    a second time). After a config change the handler waits for the old Job to go: then the sync must
    recreate it."""
    from rljob.api.status import RLJobStatus
    from rljob.operator.reconcile import current_generation_applied, needs_apply
    from rljob.operator.lifecycle import Observed, TrainerJobObs, WorkloadObs

    recreating = {"type": "ChildrenApplied", "status": "False", "reason": "Recreating", "observedGeneration": 2,
                  "lastTransitionTime": "2026-01-01T00:00:00Z"}
    assert not current_generation_applied(RLJobStatus(), 1)  # never applied
    assert not current_generation_applied(RLJobStatus(observedGeneration=1), 2)  # spec update not applied yet
    assert current_generation_applied(RLJobStatus(observedGeneration=2), 2)
    waiting = RLJobStatus.model_validate({"observedGeneration": 1, "conditions": [recreating]})
    assert current_generation_applied(waiting, 2)  # applied, waiting for the old Job
    assert not current_generation_applied(waiting, 3)

    missing = Observed()
    running = Observed(trainer=TrainerJobObs(uid="u", replicas=1, ready=1))
    suspended = Observed(trainer=TrainerJobObs(uid="u", replicas=0, ready=0, suspended=True))
    assert not needs_apply(missing, active=True, generation_applied=False)
    assert needs_apply(missing, active=True, generation_applied=True)  # deleted for a restart or recreate
    assert not needs_apply(running, active=True, generation_applied=True)
    assert needs_apply(running, active=False, generation_applied=True)  # finished: suspend it
    assert needs_apply(suspended, active=True, generation_applied=True)  # resumed
    # Suspended with the engines still up: kept while a trainer pod finishes its step, scaled down after.
    engines_up = Observed(pools={"nv": WorkloadObs(2, 2)}, router=WorkloadObs(1, 1), trainer=suspended.trainer)
    assert not needs_apply(engines_up, active=False, generation_applied=True, serving=True)
    assert needs_apply(engines_up, active=False, generation_applied=True, serving=False)
    assert not needs_apply(suspended, active=False, generation_applied=True, serving=False)  # already down
