"""The one bucketer (runtime/weights/buckets.py), used by the trainer's backends and the transports."""

from __future__ import annotations

import pytest
import torch

from rljob.runtime.training.backend import SingleProcessBackend
from rljob.runtime.weights.buckets import Bucket, PlannedBuckets, bucket_bytes, named_buckets, with_last


def tensors(*sizes: int) -> list[tuple[str, torch.Tensor]]:
    """float32 tensors of `sizes` elements, named t0, t1, ..."""
    return [(f"t{i}", torch.zeros(n)) for i, n in enumerate(sizes)]


def test_a_bucket_never_exceeds_the_limit_unless_one_tensor_does():
    named = tensors(10, 10, 10, 40, 5, 5, 20)  # float32: 4 bytes an element
    buckets = list(named_buckets(named, 80))
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"], ["t6"]]
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]
    assert all(bucket_bytes(b) <= 80 or len(b) == 1 for b in buckets)


def test_buckets_are_cut_by_the_bytes_that_travel_in_the_wire_dtype():
    named = [*tensors(10, 10, 10, 10), ("steps", torch.zeros(10, dtype=torch.int64))]
    # float32 counted as bfloat16: 20 bytes each, four to an 80-byte bucket; the int64 tensor keeps its 80.
    buckets = list(named_buckets(named, 80, dtype=torch.bfloat16))
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1", "t2", "t3"], ["steps"]]
    assert all(t.dtype == torch.float32 for _, t in buckets[0]), "only counted: the tensors are not cast here"


def test_every_name_of_a_tied_tensor_stays_in_its_bucket_and_counts_once():
    shared = torch.zeros(16)
    named = [("embed", shared), ("head", shared.detach()), ("norm", torch.zeros(4)), ("last", torch.zeros(16))]
    buckets = list(named_buckets(named, 80))
    # embed (64 bytes) + norm (16 bytes) fill the bucket; head is embed's memory and costs nothing.
    assert [[n for n, _ in b] for b in buckets] == [["embed", "head", "norm"], ["last"]]


def test_the_single_process_backend_buckets_a_tied_head_with_its_embedding():
    embed = torch.nn.Embedding(8, 4)
    model = torch.nn.ModuleDict({"embed": embed, "head": torch.nn.Linear(4, 8, bias=False)})
    model["head"].weight = embed.weight
    backend = SingleProcessBackend(model, learning_rate=1e-3, weight_decay=0.0)
    buckets = list(backend.iter_full_weights(8 * 4 * 4))
    assert [[n for n, _ in b] for b in buckets] == [["embed.weight", "head.weight"]]


def test_a_bucket_size_below_one_byte_is_refused():
    with pytest.raises(ValueError, match="bucket_bytes must be >= 1"):
        list(named_buckets(tensors(1), 0))


def test_planned_buckets_tell_the_last_one_without_producing_the_next_early():
    plan = [[("a", torch.zeros(1))], [("b", torch.zeros(1))], [("c", torch.zeros(1))]]
    produced: list[str] = []

    def produce(bucket: Bucket) -> Bucket:
        produced.append(bucket[0][0])
        return bucket

    seen = [(bucket[0][0], last, list(produced)) for bucket, last in with_last(PlannedBuckets(plan, produce))]
    # When a bucket is handed out, only it and those before it were produced (gathered).
    assert seen == [("a", False, ["a"]), ("b", False, ["a", "b"]), ("c", True, ["a", "b", "c"])]


def test_unplanned_buckets_are_flagged_with_one_bucket_of_look_ahead():
    named = tensors(10, 10, 10)
    assert [last for _, last in with_last(named_buckets(named, 40))] == [False, False, True]


def test_with_last_keeps_no_bucket_alive_while_the_next_is_produced():
    # The distributed transport lets a bucket go once it is flattened, then has the next one gathered:
    # a reference left in with_last would put a third bucket in rank 0's memory.
    import weakref

    alive: list[weakref.ref[torch.Tensor]] = []

    def produce(planned: Bucket) -> Bucket:
        assert all(ref() is None for ref in alive), "the previous bucket is still alive while the next is made"
        tensor = torch.zeros(4)
        alive.append(weakref.ref(tensor))
        return [(planned[0][0], tensor)]

    pulls = with_last(PlannedBuckets([[("a", torch.zeros(4))], [("b", torch.zeros(4))], [("c", torch.zeros(4))]],
                                     produce))
    seen = []
    for bucket, last in pulls:
        seen.append((bucket[0][0], last))
        del bucket
    assert seen == [("a", False), ("b", False), ("c", True)]
