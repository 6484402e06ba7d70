"""The one bucketer: a model's named tensors cut into buckets for a weight sync.

Both sides of a sync use it: the trainer's backends hand out their full weights in these buckets
(training/backend.py, training/fsdp.py) and the transports send them one bucket at a time
(weights/transport.py). A bucket holds at most ``bucket_bytes`` of distinct tensors, so a sync
never holds more than one bucket (or one tensor larger than a bucket) of full weights at a time.
A tied tensor listed under several names (an output head sharing the embedding) costs its bytes
once and keeps all its names in the bucket it started.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

Bucket = list[tuple[str, "torch.Tensor"]]


def named_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Named tensors, in order, grouped into buckets of at most ``bucket_bytes`` of distinct tensors.

    A tensor larger than a bucket travels alone; another name of a tensor already in the current
    bucket joins it without counting again.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    bucket: Bucket = []
    held: set[tuple[int, tuple[int, ...], str]] = set()  # the memory of the tensors in `bucket`
    size = 0
    for name, tensor in named:
        # Memory, not object identity: `state_dict()` detaches each name of a tied weight anew.
        key = (tensor.data_ptr(), tuple(tensor.shape), str(tensor.dtype))
        if key in held:
            bucket.append((name, tensor))
            continue
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, held, size = [], set(), 0
        bucket.append((name, tensor))
        held.add(key)
        size += nbytes
    if bucket:
        yield bucket


def module_buckets(module: torch.nn.Module, bucket_bytes: int) -> Iterator[Bucket]:
    """A module's parameters (tied ones once), in order, grouped into buckets (see named_buckets)."""
    return named_buckets(((name, param.detach()) for name, param in module.named_parameters()), bucket_bytes)


def bucket_bytes(bucket: Bucket) -> int:
    """Bytes of the tensors of one bucket, as they travel (a tied tensor once per name)."""
    return sum(t.numel() * t.element_size() for _, t in bucket)


def with_last(buckets: Iterable[Bucket]) -> Iterator[tuple[Bucket, bool]]:
    """Each bucket with a flag telling whether it is the last (one bucket of look-ahead)."""
    it = iter(buckets)
    try:
        current = next(it)
    except StopIteration:
        return
    for following in it:
        yield current, False
        current = following
    yield current, True


def drain(buckets: Iterable[object]) -> None:
    """Consume what is left of a bucket iterator (nobody to send it to, or a failed sync)."""
    for _ in buckets:
        pass
