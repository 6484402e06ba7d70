"""Which SGLang workers are in the rotation, what the router must be told, when to probe again.

Pure decisions (no I/O): the SGLang client feeds in what its probes saw and applies the plan with
the router's worker API. Rules (docs/weight_sync.md):
- a worker is in the rotation only while it answers and serves exactly the job's current weight
  version (its own report of it is the truth): a new, restarted or behind worker is out;
- the router holds exactly the workers in the rotation, judged against the list the router itself
  reports (``GET /workers``), never against what the runtime last told it: a router that restarted
  empty gets the whole rotation back, and a worker the runtime no longer knows (its pod is gone) is
  taken out;
- a worker out of the rotation is probed again with exponential backoff, so it comes back on its
  own once it answers and a weight sync has brought it to the current version;
- the engine is healthy when its router (if it has one) answers and at least one worker is in the
  rotation;
- when no worker is in the rotation but some answer at another version (restarted with their
  start-up weights, or missed syncs), the current weights must be pushed again now (a catch-up
  sync): otherwise the round waits for an engine that only a sync can bring back.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field


@dataclass
class WorkerView:
    """What the client last saw of one worker."""

    url: str
    reachable: bool = True  # last probe or call got an answer
    served_version: int | None = None  # the weight version it reports; None: not known yet
    probe_failures: int = 0  # consecutive probes without an answer or at a wrong version
    next_probe_at: float = 0.0  # monotonic time of its next probe


@dataclass
class RouterPlan:
    """Router membership changes that make the router hold exactly the rotation."""

    add: list[str] = field(default_factory=list)
    remove: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ProbePolicy:
    """Probe cadence: workers in the rotation every ``interval_s``, the others with backoff."""

    interval_s: float = 1.0
    backoff_s: float = 0.5
    backoff_max_s: float = 8.0


def in_rotation(worker: WorkerView, version: int) -> bool:
    """A worker serves requests only while it answers and holds the current weights."""
    return worker.reachable and worker.served_version == version


def rotation(workers: list[WorkerView], version: int) -> list[WorkerView]:
    """The workers requests may go to."""
    return [w for w in workers if in_rotation(w, version)]


def router_plan(workers: list[WorkerView], version: int, listed: Collection[str]) -> RouterPlan:
    """The changes that make the router's own list (``listed``) equal the rotation: add the rotation
    workers it lacks (all of them after a router restart), remove every listed worker outside the
    rotation, including URLs no known worker has (scaled away, or added by someone else)."""
    wanted = [w.url for w in rotation(workers, version)]
    have = set(listed)
    return RouterPlan(
        add=[url for url in wanted if url not in have],
        remove=sorted(have - set(wanted)),
    )


def adds_due(add: list[str], posted: dict[str, float], now: float, grace_s: float) -> list[str]:
    """The adds to send now. The router queues an add and lists the worker only once it has checked it,
    so a worker posted less than ``grace_s`` ago is left to the router; after that it is posted again."""
    return [url for url in add if now - posted.get(url, -grace_s) >= grace_s]


def probe_delay(worker: WorkerView, version: int, policy: ProbePolicy) -> float:
    """Seconds until the next probe: the steady interval in the rotation, backoff outside it."""
    if in_rotation(worker, version):
        return policy.interval_s
    return min(policy.backoff_max_s, policy.backoff_s * 2 ** max(0, worker.probe_failures - 1))


def observe_probe(worker: WorkerView, answered: bool, served_version: int | None, version: int,
                  now: float, policy: ProbePolicy) -> None:
    """Record one probe's outcome and schedule the next (the one mutation the I/O layer delegates)."""
    worker.reachable = answered
    if answered:
        worker.served_version = served_version
    if in_rotation(worker, version):
        worker.probe_failures = 0
    else:
        worker.probe_failures += 1
    worker.next_probe_at = now + probe_delay(worker, version, policy)


def due(workers: list[WorkerView], now: float) -> list[WorkerView]:
    """Workers whose next probe time has come."""
    return [w for w in workers if w.next_probe_at <= now]


def engine_healthy(has_router: bool, router_up: bool, workers: list[WorkerView], version: int) -> bool:
    """Generation can go on: the router (if any) answers and some worker is in the rotation."""
    return (router_up or not has_router) and bool(rotation(workers, version))


def catch_up_needed(workers: list[WorkerView], version: int) -> bool:
    """A catch-up sync of ``version`` is due: no worker is in the rotation, yet some answer while serving
    another version (a restarted worker serves its start-up weights; a behind one missed syncs). Without
    it a round whose every worker restarted would wait for ever: syncs otherwise come only between rounds."""
    return not rotation(workers, version) and any(w.reachable and w.served_version != version for w in workers)


def retry_call(sent: bool, attempt: int, retries: int) -> bool:
    """Retry a control call? Not when nothing is listening (connection refused: the worker is
    dead, and retrying only stalls the round); yes for lost connections and 5xx, within ``retries``."""
    return sent and attempt < retries
