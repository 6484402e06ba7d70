"""The round's pure decisions (rollout/decisions.py), one table row per case."""

from __future__ import annotations

import pytest

from rljob.runtime.rollout.decisions import (
    Harvest,
    Launch,
    Outcome,
    RoundCounts,
    chunk_launches,
    classify,
    fill_launches,
    next_launch,
)

N = 4  # batch size in every row


@pytest.mark.parametrize(
    ("counts", "expected"),
    [
        # nothing launched yet: launch the next group (buffered first, else fresh)
        (RoundCounts(N, target=8), Launch.NEXT),
        # fewer than N viable: launch, even with the target spent on cut groups ...
        (RoundCounts(N, target=8, accepted=1, in_flight=2, cut=5), Launch.NEXT),
        # ... a waiting retry goes first
        (RoundCounts(N, target=8, accepted=1, in_flight=2, cut=5, retry=1), Launch.RETRY),
        # N viable but the launch target not reached (over-sampling): keep launching
        (RoundCounts(N, target=8, in_flight=6), Launch.NEXT),
        (RoundCounts(N, target=8, in_flight=6, retry=2), Launch.RETRY),
        # N viable and the target reached: enough
        (RoundCounts(N, target=8, in_flight=8), None),
        (RoundCounts(N, target=8, accepted=2, in_flight=2, cut=4), None),
        (RoundCounts(N, target=4, accepted=4), None),
        # a retry waits but enough are launched: it waits for the next top-up (or the buffer)
        (RoundCounts(N, target=8, in_flight=8, retry=1), None),
        # back-pressure: target spent, fewer than N viable, buffer + this round's cuts hold a round's
        # worth: continue this round's oldest cut group without the cap instead of a fresh prompt
        (RoundCounts(N, target=8, accepted=1, in_flight=2, cut=6, buffered=2), Launch.CONTINUE_CUT),
        (RoundCounts(N, target=8, accepted=1, in_flight=2, cut=6, buffered=1), Launch.NEXT),
        # ... but never ahead of a retry
        (RoundCounts(N, target=8, accepted=1, in_flight=2, cut=6, buffered=2, retry=1), Launch.RETRY),
        # sync (target = N): a cut group is buffered and a fresh prompt replaces it
        (RoundCounts(N, target=N, accepted=1, in_flight=2, cut=1), Launch.NEXT),
        (RoundCounts(N, target=N, accepted=1, in_flight=2, cut=1, buffered=3), Launch.CONTINUE_CUT),
    ],
)
def test_next_launch(counts: RoundCounts, expected: Launch | None) -> None:
    assert next_launch(counts) is expected


def test_one_by_one_top_up_launches_up_to_the_target() -> None:
    """Applying next_launch until it says None, as the scheduler does, launches exactly the target."""
    counts = RoundCounts(N, target=8, accepted=1, cut=2)
    launched = 0
    while next_launch(counts) is not None:
        counts = RoundCounts(N, target=8, accepted=1, cut=2, in_flight=counts.in_flight + 1)
        launched += 1
    assert launched == 5  # 1 accepted + 5 in flight + 2 cut = 8 = target, 6 viable >= N


@pytest.mark.parametrize(
    ("counts", "chunk", "expected"),
    [
        (RoundCounts(N, target=8), 4, 8),  # first top-up: the whole launch target
        (RoundCounts(N, target=4), 4, 4),  # a baseline with K = N
        (RoundCounts(N, target=8, in_flight=8), 4, 0),  # enough viable
        (RoundCounts(N, target=8, accepted=1, in_flight=2), 4, 4),  # one missing: a whole chunk
        (RoundCounts(N, target=8, accepted=1, in_flight=2), 3, 3),
        (RoundCounts(N, target=8, accepted=0, in_flight=0, cut=1), 2, 4),  # four missing: two chunks of 2
        (RoundCounts(N, target=8, accepted=0, in_flight=1, cut=1), 2, 4),  # three missing: still two chunks
        (RoundCounts(N, target=8, accepted=1, in_flight=2), 0, 1),  # K < 1 counts as 1
        (RoundCounts(N, target=8, accepted=4), 4, 0),
    ],
)
def test_chunk_launches(counts: RoundCounts, chunk: int, expected: int) -> None:
    assert chunk_launches(counts, chunk) == expected


@pytest.mark.parametrize(
    ("harvest", "accepted", "expected"),
    [
        (Harvest(finished=False, engine_failed=True), 0, Outcome.RETRY),
        (Harvest(finished=False), 0, Outcome.CUT),
        (Harvest(finished=False), N, Outcome.CUT),
        (Harvest(finished=True, over_bound=True), 0, Outcome.REGENERATE),
        (Harvest(finished=True, over_bound=True, kept=False), 0, Outcome.REGENERATE),  # bound before filter
        (Harvest(finished=True, kept=False), 0, Outcome.FILTERED),
        (Harvest(finished=True, kept=False), N, Outcome.FILTERED),
        (Harvest(finished=True), 0, Outcome.ACCEPTED),
        (Harvest(finished=True), N - 1, Outcome.ACCEPTED),
        (Harvest(finished=True), N, Outcome.SURPLUS),
        # a finished group whose engine failed on a later sample keeps its finished samples: accepted
        (Harvest(finished=True, engine_failed=True), 0, Outcome.ACCEPTED),
    ],
)
def test_classify(harvest: Harvest, accepted: int, expected: Outcome) -> None:
    assert classify(harvest, accepted, N) is expected


@pytest.mark.parametrize(
    ("capacity", "requests", "samples_per_prompt", "expected"),
    [
        (128, 128, 8, 0),  # full
        (128, 121, 8, 0),  # 7 free slots: no whole group fits
        (128, 120, 8, 1),
        (128, 0, 8, 16),
        (128, 140, 8, 0),  # more in flight than slots (over-sampling queues them): nothing more
        (None, 0, 8, 0),  # an engine that cannot tell its capacity is never filled
    ],
)
def test_fill_launches(capacity: int | None, requests: int, samples_per_prompt: int, expected: int) -> None:
    assert fill_launches(capacity, requests, samples_per_prompt) == expected
