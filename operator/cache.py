"""The operator's read cache: the latest copy of every RLJob and child object its watches deliver.

kopf's watch streams (server-side filtered to the operator's own children, see handlers.configure)
feed `ObjectCache` through index handlers; `CachedKube` serves the reconcile's reads from it, so a
resync costs no LIST and no GET. Writes still go to the API server; the answers of applies and status
patches are stored at once, so the next read never sees an object from before our own write.

Until the cache is *synced* (every watched kind listed once, see `ObjectCache.mark_synced`) a read falls
through to the API server whenever the cache holds nothing for the job and kind, and a partial answer
is never taken from it: right after a restart the initial lists arrive object by object, and a cache
holding a job's StatefulSet and trainer pod but not yet its inference pods would make a Running job
look Degraded for a moment. Once synced, "nothing cached" means "nothing there".
Deleted objects leave the cache with their DELETED event, so memory follows the live objects. A write
the API server refuses drops the cached object, so the retry reads it from the API.

Two ways a deleted object could linger as a ghost, and what stops each:
- an answer to our own write that arrives after the object's DELETED event (a thread descheduled
  between its PATCH and its upsert) would store the deleted object again. The DELETED event leaves a
  tombstone with its resourceVersion, and no older version of that object is stored after it;
- a DELETED event that never arrives (a watch that fell too far behind lists again, and a list reports
  nothing about what vanished). The only ghost that stalls a job is one still being deleted, since the
  reconcile waits for it to go; so a read of an object whose deletion began more than
  STALE_DELETION_S ago asks the API server.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from rljob.api.spec import API_GROUP, API_VERSION, KIND
from rljob.common.kube import Kube, KubeError
from rljob.operator.builders.meta import LABEL_JOB
from rljob.operator.metrics import API_REQUESTS

RLJOB_API_VERSION = f"{API_GROUP}/{API_VERSION}"
# Kinds whose reads the cache serves (the watched ones).
CACHED_KINDS = frozenset(
    {
        ("apps/v1", "StatefulSet"),
        ("apps/v1", "Deployment"),
        ("batch/v1", "Job"),
        ("v1", "Pod"),
        ("v1", "Service"),
        ("policy/v1", "PodDisruptionBudget"),
        ("networking.k8s.io/v1", "NetworkPolicy"),
        ("v1", "ConfigMap"),
        ("v1", "ServiceAccount"),
        ("v1", "PersistentVolumeClaim"),
        ("rbac.authorization.k8s.io/v1", "Role"),
        ("rbac.authorization.k8s.io/v1", "RoleBinding"),
        (RLJOB_API_VERSION, KIND),
    }
)

_Key = tuple[str, str, str, str]  # api_version, kind, namespace, name
# Tombstones kept (the newest): enough for every deletion of a few minutes at 1,000 jobs.
MAX_TOMBSTONES = 20_000
# A cached object still deleting after this long may be a ghost (its DELETED event lost): check it.
STALE_DELETION_S = 30.0


def parse_selector(selector: str) -> dict[str, str]:
    """An equality label selector `a=b,c=d` (what the operator builds) as a dict."""
    out = {}
    for part in filter(None, selector.split(",")):
        key, sep, value = part.partition("=")
        if not sep or key.endswith("!"):
            raise ValueError(f"only equality selectors are served from the cache: {selector!r}")
        out[key.strip()] = value.strip().lstrip("=")
    return out


def _version(obj: dict[str, Any]) -> int | None:
    rv = obj.get("metadata", {}).get("resourceVersion")
    return int(rv) if isinstance(rv, str) and rv.isdigit() else None


def deleting_since(obj: dict[str, Any], now: datetime) -> float | None:
    """Seconds since the object's deletion began (its deletionTimestamp), or None when it is not deleting."""
    stamp = obj.get("metadata", {}).get("deletionTimestamp")
    if not stamp:
        return None
    try:
        started = datetime.fromisoformat(str(stamp).replace("Z", "+00:00"))
    except ValueError:
        return None
    return (now - started) / timedelta(seconds=1)


class ObjectCache:
    """Objects by kind, namespace and name, with an index by the `rljob.io/job-name` label; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._objects: dict[_Key, dict[str, Any]] = {}
        self._by_job: dict[tuple[str, str, str, str], set[str]] = {}
        self._tombstones: OrderedDict[_Key, int] = OrderedDict()  # resourceVersion of each DELETED event
        self._synced = threading.Event()

    def mark_synced(self) -> None:
        """Every watched kind has been listed into the cache: from now on it is complete.

        kopf calls no handler but index handlers before every indexed resource kind has been listed
        and indexed (its "operator indexed" gate); the cache feeders are index handlers, so the first
        call of any other handler may mark the cache synced.
        """
        self._synced.set()

    @property
    def synced(self) -> bool:
        """Whether the cache holds every watched object (see mark_synced)."""
        return self._synced.is_set()

    def upsert(self, api_version: str, kind: str, obj: dict[str, Any]) -> None:
        """Store an object unless the cache already holds a newer version of it.

        Without its managedFields: no reader needs them, and they are a large part of every object
        (memory, and the copy each read makes).
        """
        meta = {k: v for k, v in obj["metadata"].items() if k != "managedFields"}
        obj = {**obj, "metadata": meta}
        key = (api_version, kind, meta.get("namespace", ""), meta["name"])
        new_v = _version(obj)
        with self._lock:
            dead = self._tombstones.get(key)
            if dead is not None:
                if new_v is not None and new_v <= dead:
                    return  # the answer to a write that the object's deletion overtook
                del self._tombstones[key]
            old = self._objects.get(key)
            if old is not None:
                old_v = _version(old)
                if new_v is not None and old_v is not None and new_v < old_v:
                    return
                self._unindex(key, old)
            self._objects[key] = obj
            job = (meta.get("labels") or {}).get(LABEL_JOB)
            if job is not None:
                self._by_job.setdefault((api_version, kind, key[2], job), set()).add(key[3])

    def remove(self, api_version: str, kind: str, namespace: str, name: str, deleted_version: str | None = None) -> None:
        """Forget an object. `deleted_version`, the resourceVersion of its DELETED event, leaves a tombstone:
        no version up to it is stored again."""
        key = (api_version, kind, namespace, name)
        with self._lock:
            old = self._objects.pop(key, None)
            if old is not None:
                self._unindex(key, old)
            if deleted_version is not None and deleted_version.isdigit():
                self._tombstones[key] = int(deleted_version)
                self._tombstones.move_to_end(key)
                while len(self._tombstones) > MAX_TOMBSTONES:
                    self._tombstones.popitem(last=False)

    def _unindex(self, key: _Key, obj: dict[str, Any]) -> None:
        job = (obj["metadata"].get("labels") or {}).get(LABEL_JOB)
        if job is None:
            return
        index = (key[0], key[1], key[2], job)
        names = self._by_job.get(index)
        if names is not None:
            names.discard(key[3])
            if not names:
                del self._by_job[index]

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The cached object itself, or None; callers must not change it (as with list_job: every sync
        reads its RLJob and trainer Job, and copying them was half of a sync's cost)."""
        with self._lock:
            return self._objects.get((api_version, kind, namespace, name))

    def list_job(self, api_version: str, kind: str, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]] | None:
        """A job's objects matching `labels` (which must name the job): the cached objects themselves, which
        callers must not change (an observation reads dozens of pods per sync; copying them was most
        of its cost).

        None when the cache cannot answer (ask the API): before it is synced, since a partial answer
        would be wrong rather than just old. Once synced, [] when it holds none of them.
        """
        job = labels[LABEL_JOB]
        with self._lock:
            names = self._by_job.get((api_version, kind, namespace, job))
            if not names:
                return [] if self._synced.is_set() else None
            if not self._synced.is_set():
                return None
            objs = [self._objects[(api_version, kind, namespace, n)] for n in sorted(names)]
        # Safe outside the lock: upsert replaces an object, it never changes one in place.
        return [o for o in objs if all((o["metadata"].get("labels") or {}).get(k) == v for k, v in labels.items())]

    def generation(self, namespace: str, name: str) -> int | None:
        """metadata.generation of a cached RLJob (no copy), or None."""
        with self._lock:
            obj = self._objects.get((RLJOB_API_VERSION, KIND, namespace, name))
            return int(obj["metadata"].get("generation") or 0) if obj is not None else None

    def jobs(self, namespaces: frozenset[str]) -> list[tuple[str, str]]:
        """(namespace, name) of the cached RLJobs not being deleted, in `namespaces` (all when empty)."""
        with self._lock:
            return sorted(
                (key[2], key[3])
                for key, obj in self._objects.items()
                if key[:2] == (RLJOB_API_VERSION, KIND)
                and (not namespaces or key[2] in namespaces)
                and not obj["metadata"].get("deletionTimestamp")
            )

    def __len__(self) -> int:
        with self._lock:
            return len(self._objects)

    def index_size(self) -> int:
        """Entries of the job index (bounded by the live jobs and kinds)."""
        with self._lock:
            return len(self._by_job)


def count_request(method: str) -> None:
    """What the cache saves shows here (rljob_operator_api_requests_total)."""
    API_REQUESTS.labels(method).inc()


@dataclass
class CachedKube(Kube):
    """Kube whose reads of watched kinds come from an ObjectCache (falling through when it cannot answer)."""

    cache: ObjectCache = field(default_factory=ObjectCache)
    on_request: Callable[[str], None] | None = count_request

    def list(self, api_version: str, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        labels = parse_selector(selector)
        if (api_version, kind) in CACHED_KINDS and LABEL_JOB in labels:
            cached = self.cache.list_job(api_version, kind, namespace, labels)
            if cached is not None:
                return cached
        return super().list(api_version, kind, namespace, selector)

    def get_rljob(self, namespace: str, name: str) -> dict[str, Any] | None:
        cached = self.cache.get(RLJOB_API_VERSION, KIND, namespace, name)
        if cached is not None:
            return cached
        fresh = super().get_rljob(namespace, name)
        if fresh is not None:
            self.cache.upsert(RLJOB_API_VERSION, KIND, copy.deepcopy(fresh))
        return fresh

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        if (api_version, kind) in CACHED_KINDS:
            cached = self.cache.get(api_version, kind, namespace, name)
            if cached is not None:
                since = deleting_since(cached, datetime.now(timezone.utc))
                if since is None or since < STALE_DELETION_S:
                    return cached
                return self._refresh(api_version, kind, namespace, name)
            if self.cache.synced:
                return None
        return super().get(api_version, kind, namespace, name)

    def _refresh(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """Read an object from the API server and put the answer in the cache (possibly a ghost's end)."""
        fresh = super().get(api_version, kind, namespace, name)
        if fresh is None:
            self.cache.remove(api_version, kind, namespace, name)
        else:
            self.cache.upsert(api_version, kind, copy.deepcopy(fresh))
        return fresh

    def apply_object(self, obj: dict[str, Any], owner_uid: str | None = None) -> tuple[str, dict[str, Any]]:
        key = (obj["apiVersion"], obj["kind"])
        meta = obj["metadata"]
        try:
            result, stored = super().apply_object(obj, owner_uid)
        except KubeError:
            if key in CACHED_KINDS:
                self.cache.remove(*key, meta["namespace"], meta["name"])
            raise
        # Stored now: the status computed right after this apply sees the child (its watch event comes later).
        if key in CACHED_KINDS and stored.get("metadata", {}).get("name"):
            self.cache.upsert(*key, copy.deepcopy(stored))
        return result, stored

    def apply_rljob_status(self, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        try:
            result = super().apply_rljob_status(namespace, name, status)
        except KubeError:
            # Refused (for example a 409 or 422 against a newer object): the retry must read the RLJob from the API.
            self.cache.remove(RLJOB_API_VERSION, KIND, namespace, name)
            raise
        if result.get("metadata", {}).get("name"):
            self.cache.upsert(RLJOB_API_VERSION, KIND, result)
        return result
