"""Rank 0's weight source of a multi-rank job (ranks.GatheredWeights), on one process: each call is one
full pass of the trainer's buckets, and a pass no transport took is still run once, so the other ranks,
waiting in its gathers, are never left behind."""

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
    untaken.join_if_untaken()
    untaken.join_if_untaken()
    assert untaken.calls == 1
    taken = source()
    list(taken())
    taken.join_if_untaken()
    assert taken.calls == 1
