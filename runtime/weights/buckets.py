"""The one bucketer: a model's named tensors cut into buckets for a weight sync.

Both sides of a sync use it: the trainer's backends hand out their full weights in these buckets
(training/backend.py, training/fsdp.py) and the transports send them one bucket at a time
(weights/transport.py). A bucket holds at most ``bucket_bytes`` of distinct tensors, so a sync
never holds more than one bucket (or one tensor larger than a bucket) of full weights at a time.
A tied tensor listed under several names (an output head sharing the embedding) costs its bytes
once and keeps all its names in the bucket it started.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from rljob.runtime.weights.wire_dtype import tensor_wire_bytes

if TYPE_CHECKING:
    import torch

Bucket = list[tuple[str, "torch.Tensor"]]


def memory_key(tensor: torch.Tensor) -> Hashable:
    """Which tensors are one: the same memory, not the same object (`state_dict()` detaches each
    name of a tied weight anew)."""
    return (tensor.data_ptr(), tuple(tensor.shape), str(tensor.dtype))


def named_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                  key: Callable[[torch.Tensor], Hashable] = memory_key,
                  dtype: torch.dtype | None = None) -> Iterator[Bucket]:
    """Named tensors, in order, grouped into buckets of at most ``bucket_bytes`` of distinct tensors,
    counted as they travel in ``dtype`` (weights/wire_dtype.py; None: their own dtypes).

    A tensor larger than a bucket travels alone; another name of a tensor already in the current
    bucket (the same ``key``) joins it without counting again. Only sizes are read, so the tensors
    may be sharded ones whose full size ``numel()`` reports (training/fsdp.py plans its gathers so).
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    bucket: Bucket = []
    held: set[Hashable] = set()  # the keys of the tensors in `bucket`
    size = 0
    for name, tensor in named:
        identity = key(tensor)
        if identity in held:
            bucket.append((name, tensor))
            continue
        nbytes = tensor_wire_bytes(tensor, dtype)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, held, size = [], set(), 0
        bucket.append((name, tensor))
        held.add(identity)
        size += nbytes
    if bucket:
        yield bucket


def module_buckets(module: torch.nn.Module, bucket_bytes: int, dtype: torch.dtype | None = None) -> Iterator[Bucket]:
    """A module's parameters (tied ones once), in order, grouped into buckets (see named_buckets).
    The tensors are the live ones: a consumer casts them to ``dtype`` as it sends them."""
    return named_buckets(((name, param.detach()) for name, param in module.named_parameters()), bucket_bytes,
                         dtype=dtype)


def bucket_bytes(bucket: Bucket) -> int:
    """Bytes of the tensors of one bucket, as they travel (a tied tensor once per name)."""
    return sum(t.numel() * t.element_size() for _, t in bucket)


@runtime_checkable
class CountedBuckets(Protocol):
    """Buckets that can say how many are left before producing them (None: they cannot)."""

    @property
    def remaining(self) -> int | None:
        """Buckets not produced yet, or None when unknown."""

    def __next__(self) -> Bucket:
        """The next bucket."""


class PlannedBuckets(Iterator[Bucket]):
    """Buckets planned from sizes before any is produced (a sharded trainer plans from its shards and
    gathers a bucket only when asked), so a consumer knows which is the last without holding the next."""

    def __init__(self, plan: list[Bucket], produce: Callable[[Bucket], Bucket]) -> None:
        """``plan``: the buckets as placeholders (sizes and names); ``produce`` makes one real."""
        self._plan = plan
        self._produce = produce

    @property
    def remaining(self) -> int:
        """Buckets not produced yet."""
        return len(self._plan)

    def __next__(self) -> Bucket:
        if not self._plan:
            raise StopIteration
        return self._produce(self._plan.pop(0))


def with_last(buckets: Iterable[Bucket]) -> Iterator[tuple[Bucket, bool]]:
    """Each bucket with a flag telling whether it is the last: from the count of CountedBuckets (a
    PlannedBuckets), else with one bucket of look-ahead (which a consumer then holds next to the
    current one)."""
    it = iter(buckets)
    if isinstance(it, CountedBuckets) and it.remaining is not None:
        for bucket in it:
            yield bucket, it.remaining == 0
            # Dropped before the next is produced: the loop variable would otherwise keep this bucket
            # alive through the next one's gather, after its consumer let it go.
            del bucket
        return
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
