"""Rank 0's weight source of a multi-rank job (ranks.GatheredWeights), on one process: each call is one
full pass of the trainer's buckets, and a pass no transport took is still run once, so the other ranks,
waiting in its gathers, are never left behind; nor is a pass a push gave up mid-way."""

from __future__ import annotations

from rljob.runtime.ranks import GatheredWeights, OrderSender
from rljob.runtime.training.backend import SingleProcessBackend
from tests.helpers.tiny_model import build_tiny_model


def source() -> GatheredWeights:
    backend = SingleProcessBackend(build_tiny_model(seed=0), learning_rate=1e-3, weight_decay=0.0)
    return GatheredWeights(backend, 1 << 14, OrderSender(None))


def test_each_call_is_a_full_pass_of_the_weights():
    gathered = source()
    names = {n for bucket in gathered() for n, _ in bucket}
    assert names == set(gathered.backend.model.state_dict())
    assert {n for bucket in gathered() for n, _ in bucket} == names and gathered.calls == 2


def test_a_pass_no_transport_took_is_run_once_and_a_taken_one_is_not_repeated():
    untaken = source()
    untaken.finish_pass()
    untaken.finish_pass()
    assert untaken.calls == 1
    taken = source()
    list(taken())
    taken.finish_pass()
    assert taken.calls == 1


def test_a_pass_given_up_mid_way_is_pulled_to_its_end():
    """A push given up on SIGTERM after its first bucket: the rest of that pass still runs (the other
    ranks wait in its gathers), and no new pass starts."""
    gathered = source()
    buckets = gathered()
    first = next(buckets)
    left = list(gathered.backend.iter_full_weights(1 << 14))[1:]
    assert left, "the tiny model must span more than one bucket for this test"
    gathered.finish_pass()
    assert next(buckets, None) is None and gathered.calls == 1
    assert first
