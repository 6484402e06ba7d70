"""SGLang 0.5.23's ``flattened_bucket``: rank 0 packs a bucket into one buffer (weights/broadcast.flatten)
that the receiver's layout (weight_group.empty_flattened, after SGLang's FlattenedTensorBucket.empty)
reads back exactly; which releases take it; which layouts fall back to one broadcast per tensor."""

from __future__ import annotations

import pytest
import torch

from rljob.runtime.weight_group import byte_offsets, empty_flattened, lay_flat, lying_flat, takes_flattened_buckets
from rljob.runtime.weights.broadcast import flatten

CPU = torch.device("cpu")


def test_a_flattened_bucket_reads_back_as_the_tensors_cast_to_the_wire_dtype():
    gen = torch.Generator().manual_seed(0)
    embed = torch.randn(6, 4, generator=gen)
    bucket = [("embed", embed), ("norm", torch.randn(4, generator=gen)), ("head", embed),  # tied: sent per name
              ("step", torch.tensor([7, 9], dtype=torch.int64))]
    flat = flatten(bucket, torch.bfloat16, CPU)
    assert flat is not None
    buffer, scratch = flat
    assert scratch is not None and buffer.data_ptr() == scratch.data_ptr() and buffer.dtype == torch.uint8
    wire = [torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int64]
    assert buffer.numel() == (24 + 4 + 24) * 2 + 2 * 8  # the int64 starts at byte 104, aligned
    received, views = empty_flattened([n for n, _ in bucket], wire, [list(t.shape) for _, t in bucket], CPU)
    received.copy_(buffer)  # what one broadcast does
    for (name, sent), (got_name, got) in zip(bucket, views, strict=True):
        assert got_name == name and got.shape == sent.shape
        expected = sent.to(torch.bfloat16) if sent.is_floating_point() else sent
        assert got.dtype == expected.dtype and torch.equal(got, expected), name
    assert views[0][1].data_ptr() != views[2][1].data_ptr(), "each name of a tied tensor has its own bytes"


def test_a_bucket_that_already_lies_flat_is_its_own_buffer_and_any_other_is_copied():
    wire = [torch.bfloat16, torch.bfloat16, torch.int64]
    shapes = [[3, 2], [2], [2]]
    laid = lay_flat(wire, shapes, CPU)
    assert laid is not None
    buffer, views = laid
    for i, view in enumerate(views):
        view.copy_(torch.arange(view.numel()).view(view.shape) + i)
    bucket = list(zip(["a", "b", "c"], views, strict=True))
    flat = flatten(bucket, torch.bfloat16, CPU)
    assert flat is not None
    got, scratch = flat
    assert scratch is None and got.data_ptr() == buffer.data_ptr() and got.numel() == buffer.numel()  # no copy
    # The same views in another order, or a wire dtype they are not in, are not that layout: copied.
    assert lying_flat(views[::-1], wire[::-1], CPU) is None
    assert lying_flat(views[:2], wire[:2], CPU) is None  # the buffer holds more than these
    reordered = flatten(bucket[::-1], torch.bfloat16, CPU)
    assert reordered is not None and reordered[1] is not None and reordered[0].data_ptr() != buffer.data_ptr()
    as_fp32 = flatten(bucket, torch.float32, CPU)  # the bf16 view is cast: a new buffer
    assert as_fp32 is not None and as_fp32[1] is not None
    received, _ = empty_flattened(["c", "b", "a"], wire[::-1], shapes[::-1], CPU)
    received.copy_(reordered[0])
    assert torch.equal(received[-12:].view(torch.bfloat16).view(3, 2), views[0])


def test_every_bucket_is_flattened_into_one_scratch_buffer_that_grows_to_the_largest():
    # Cast to bf16, so none lies flat: 20 bytes, then 12, then 20 again.
    large = [("a", torch.arange(6.0)), ("b", torch.arange(4.0))]
    small = [("c", torch.arange(6.0))]
    sent, scratch = flatten(large, torch.bfloat16, CPU) or pytest.fail("aligned")
    assert scratch is not None and scratch.numel() == 20 and sent.data_ptr() == scratch.data_ptr()
    sent, kept = flatten(small, torch.bfloat16, CPU, scratch) or pytest.fail("aligned")
    assert sent.numel() == 12 and kept is scratch  # the front of the scratch; the whole of it is kept
    assert torch.equal(sent.view(torch.bfloat16), torch.arange(6.0, dtype=torch.bfloat16))
    sent, kept = flatten(large, torch.bfloat16, CPU, kept) or pytest.fail("aligned")
    assert kept is scratch and sent.data_ptr() == scratch.data_ptr()  # no new buffer for the larger bucket
    grown = [("d", torch.arange(16.0))]
    sent, kept = flatten(grown, torch.bfloat16, CPU, kept) or pytest.fail("aligned")
    assert kept is not scratch and kept is not None and kept.numel() == 32  # too small: a new scratch


def test_a_layout_the_receiver_would_refuse_is_sent_tensor_by_tensor():
    # 3 bf16 values (6 bytes), then an int64 at byte 6: SGLang's receiver raises; rank 0 does not flatten.
    bucket = [("a", torch.zeros(3)), ("b", torch.zeros(2, dtype=torch.int64))]
    assert byte_offsets([torch.bfloat16, torch.int64], [[3], [2]]) is None
    assert flatten(bucket, torch.bfloat16, CPU) is None
    # Four bf16 values end at byte 8: there the int64 starts aligned.
    assert flatten([("a", torch.zeros(4)), ("b", torch.zeros(2, dtype=torch.int64))], torch.bfloat16, CPU) is not None
    with pytest.raises(ValueError, match="unaligned"):
        empty_flattened(["a", "b"], [torch.bfloat16, torch.int64], [[3], [2]], CPU)


@pytest.mark.parametrize(("release", "takes"), [
    ("0.5.23", True), ("0.5.24.post1", True), ("0.6.0", True),
    ("0.5.5.post3", False), ("0.5.22", False), (None, False), ("rljob-cpu-sglang-protocol-0.1", False),
])
def test_only_releases_read_to_take_it_get_a_flattened_bucket(release: str | None, takes: bool):
    assert takes_flattened_buckets(release) is takes
