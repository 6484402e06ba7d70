"""Sequence packing's row assignment (training/packing.py)."""

from __future__ import annotations

import random

import pytest

from rljob.runtime.training.packing import grid_tokens, micro_batch_rows, pack_rows


def test_every_sample_lands_once_and_no_row_overflows() -> None:
    rng = random.Random(0)
    lengths = [min(300, int(rng.lognormvariate(3.4, 0.8)) + 6) for _ in range(500)]
    capacity = max(lengths)
    rows = pack_rows(lengths, capacity)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= capacity for row in rows)
    # Best-fit decreasing: at most 11/9 of the fewest rows possible, plus one; the total is a lower bound.
    assert len(rows) <= 11 / 9 * -(-sum(lengths) // capacity) + 1


def test_the_longest_samples_open_the_first_rows_and_short_ones_fill_the_gaps() -> None:
    assert pack_rows([3, 10, 7, 2, 5], 10) == [[1], [2, 0], [4, 3]]


def test_ties_keep_input_order_and_a_full_row_takes_nothing_more() -> None:
    assert pack_rows([4, 4, 4, 4], 8) == [[0, 1], [2, 3]]
    assert pack_rows([], 8) == []


@pytest.mark.parametrize(("lengths", "capacity"), [([5, 9], 8), ([1], 0)])
def test_a_sample_longer_than_a_row_is_refused(lengths: list[int], capacity: int) -> None:
    with pytest.raises(ValueError):
        pack_rows(lengths, capacity)


def test_micro_batches_hold_at_most_their_rows_of_the_longest_sample() -> None:
    lengths = [20, 4, 15, 5, 3, 2, 18]
    packed = micro_batch_rows(lengths, 2, packed=True)
    padded = micro_batch_rows(lengths, 2, packed=False)
    assert packed == [[[0], [6, 5]], [[2, 3], [1, 4]]]  # rows of at most 20 tokens, two per micro-batch
    # One sample per row, shortest first: the long tail pads only the last micro-batches.
    assert padded == [[[5], [4]], [[1], [3]], [[2], [6]], [[0]]]
    assert grid_tokens(packed, lengths) == 2 * 20 + 2 * 20
    assert grid_tokens(padded, lengths) == 2 * 3 + 2 * 5 + 2 * 18 + 20
    assert micro_batch_rows([], 4, packed=True) == []


def test_packing_a_long_tailed_batch_computes_less_padding_in_fewer_passes() -> None:
    # An APRIL round's shape: 128 samples, most answers short, a few near the limit.
    rng = random.Random(1)
    lengths = [6 + min(300, int(rng.lognormvariate(3.2, 0.9))) for _ in range(128)]
    packed = micro_batch_rows(lengths, 32, packed=True)
    padded = micro_batch_rows(lengths, 32, packed=False)
    assert len(packed) < len(padded)
    assert grid_tokens(packed, lengths) < 0.85 * grid_tokens(padded, lengths)
    assert grid_tokens(packed, lengths) < 1.1 * sum(lengths)
