"""Router membership and health decisions (pure): who is in the rotation, what the router is told,
when a worker out of the rotation is probed again."""

from __future__ import annotations

from rljob.runtime.engines.membership import (
    ProbePolicy,
    WorkerView,
    adds_due,
    catch_up_needed,
    due,
    engine_healthy,
    in_rotation,
    observe_probe,
    probe_delay,
    retry_call,
    rotation,
    router_plan,
)

POLICY = ProbePolicy(interval_s=1.0, backoff_s=0.5, backoff_max_s=8.0)


def test_only_answering_workers_at_the_current_version_are_in_the_rotation():
    current = WorkerView("a", reachable=True, served_version=5)
    behind = WorkerView("b", reachable=True, served_version=4)
    restarted = WorkerView("c", reachable=True, served_version=0)
    dead = WorkerView("d", reachable=False, served_version=5)
    unknown = WorkerView("e", reachable=True, served_version=None)
    assert [w.url for w in rotation([current, behind, restarted, dead, unknown], 5)] == ["a"]


def test_router_holds_exactly_the_rotation_judged_by_its_own_list():
    workers = [
        WorkerView("keep", served_version=3),
        WorkerView("behind-listed", served_version=2),
        WorkerView("caught-up", served_version=3),
        WorkerView("dead-listed", reachable=False, served_version=3),
        WorkerView("behind-unlisted", served_version=1),
        WorkerView("new-unknown-version", served_version=None),
    ]
    listed = {"keep", "behind-listed", "dead-listed", "scaled-away"}
    plan = router_plan(workers, 3, listed)
    assert plan.add == ["caught-up"]
    # A URL the runtime does not know (its pod is gone) leaves too: the runtime alone fills the router.
    assert plan.remove == ["behind-listed", "dead-listed", "scaled-away"]


def test_a_router_that_restarted_empty_gets_the_whole_rotation_back():
    workers = [WorkerView("a", served_version=7), WorkerView("b", served_version=7),
               WorkerView("restarted", served_version=0)]
    plan = router_plan(workers, 7, listed=set())
    assert plan.add == ["a", "b"] and plan.remove == []
    assert router_plan(workers, 7, listed={"a", "b"}).add == [], "nothing to do once the list matches"


def test_worker_out_of_the_rotation_is_probed_with_backoff_and_comes_back():
    w = WorkerView("w", served_version=2)
    delays = []
    for now in range(5):  # restarted: answers, but at the initial version
        observe_probe(w, answered=True, served_version=0, version=2, now=float(now), policy=POLICY)
        delays.append(w.next_probe_at - now)
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0]
    observe_probe(w, answered=True, served_version=0, version=2, now=10.0, policy=POLICY)
    assert w.next_probe_at - 10.0 == 8.0, "backoff is capped"
    observe_probe(w, answered=True, served_version=2, version=2, now=20.0, policy=POLICY)  # caught up by a sync
    assert in_rotation(w, 2) and w.probe_failures == 0 and w.next_probe_at == 21.0
    assert probe_delay(w, 2, POLICY) == POLICY.interval_s


def test_probe_that_gets_no_answer_keeps_the_last_known_version():
    w = WorkerView("w", served_version=4)
    observe_probe(w, answered=False, served_version=None, version=4, now=0.0, policy=POLICY)
    assert not w.reachable and w.served_version == 4 and not in_rotation(w, 4)


def test_due_workers():
    a, b = WorkerView("a", next_probe_at=1.0), WorkerView("b", next_probe_at=3.0)
    assert [w.url for w in due([a, b], 2.0)] == ["a"]


def test_health_needs_the_router_and_a_current_worker():
    workers = [WorkerView("a", served_version=1), WorkerView("b", served_version=0)]
    assert engine_healthy(True, True, workers, 1)
    assert not engine_healthy(True, False, workers, 1), "a dead router means no generation"
    assert engine_healthy(False, False, workers, 1), "no router configured: the workers decide"
    assert not engine_healthy(True, True, workers, 2), "nobody serves the current version"


def test_catch_up_only_when_nobody_serves_the_current_version_but_someone_answers_behind():
    restarted = WorkerView("r", served_version=0)  # start-up weights
    dead = WorkerView("d", reachable=False, served_version=3)
    current = WorkerView("c", served_version=3)
    assert catch_up_needed([restarted, dead], 3), "the only answering worker restarted mid-round"
    assert catch_up_needed([WorkerView("ahead", served_version=5)], 3), "a newer version is not ours either"
    assert catch_up_needed([WorkerView("odd", served_version=None)], 3), "a version the job never set"
    assert not catch_up_needed([restarted, current], 3), "one worker still serves: the next sync catches it up"
    assert not catch_up_needed([dead], 3), "nobody answers: a sync could not reach anyone"
    assert not catch_up_needed([], 3)


def test_refused_connection_is_not_retried():
    assert not retry_call(sent=False, attempt=0, retries=5), "nothing listens: fail fast"
    assert retry_call(sent=True, attempt=0, retries=5)
    assert not retry_call(sent=True, attempt=5, retries=5)


def test_an_add_the_router_has_queued_is_not_posted_again_until_its_grace_ran_out():
    posted = {"queued": 100.0, "stuck": 80.0}
    due_now = adds_due(["new", "queued", "stuck"], posted, now=105.0, grace_s=10.0)
    assert due_now == ["new", "stuck"]
    assert adds_due(["queued"], posted, now=110.0, grace_s=10.0) == ["queued"], "the grace ends at grace_s"
