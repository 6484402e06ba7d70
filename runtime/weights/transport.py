"""The one weight-transport interface, its report, and the bucketing of a model's weights.

A transport takes the trainer's weights as an iterable of buckets of full named tensors (today's
single-process trainer: its model's named_parameters; a sharded trainer: full tensors gathered one
bucket at a time on rank 0) and installs them, with a new version, on every engine that can take
them. It never decides what the job's policy version is: it reports which engine ranks now serve
the new version, as the engines themselves tell it (their served ``weight_version`` is the truth).

Modes (one module each): ``distributed`` (distributed.py), ``disk`` (disk.py), ``tensor`` (tensor.py).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

Bucket = list[tuple[str, "torch.Tensor"]]
# Called once per sync attempt; yields the buckets in a fixed order. A collective source (every
# trainer rank takes part in gathering each bucket) must be called on every rank for each attempt.
WeightSource = Callable[[], Iterable[Bucket]]


@dataclass
class SyncReport:
    """What one sync did: which engine ranks serve ``version`` now, which failed and why."""

    version: int
    mode: str
    updated: list[str] = field(default_factory=list)  # engine ranks (worker URLs, engine names) now at version
    failed: dict[str, str] = field(default_factory=dict)  # engine rank -> reason
    bytes_sent: int = 0
    seconds: float = 0.0
    group_rebuilt: bool = False

    @property
    def ok(self) -> bool:
        """At least one engine serves the new version (the others left the rotation)."""
        return bool(self.updated)


class WeightTransport(abc.ABC):
    """Gets new weights into the engines; see the module docstring."""

    mode: str = "transport"

    @abc.abstractmethod
    async def sync(self, version: int, weights: WeightSource) -> SyncReport:
        """Install the weights of ``weights()`` as ``version`` on every engine that can take them.

        Calls ``weights()`` exactly once and consumes it to the end, whatever fails, so a collective
        source stays in step with the trainer ranks that gather it. Never raises because one engine
        failed: failures are in the report, and an engine that failed is out of the rotation until a
        later sync catches it up.
        """

    async def close(self) -> None:
        """Release groups, sockets and files the transport holds."""
        return None


def module_buckets(module: torch.nn.Module, bucket_bytes: int) -> Iterator[Bucket]:
    """A module's parameters (tied ones once), in order, grouped into buckets of about ``bucket_bytes``."""
    return named_buckets(((name, param.detach()) for name, param in module.named_parameters()), bucket_bytes)


def named_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Named tensors, in order, grouped into buckets of about ``bucket_bytes``."""
    bucket: Bucket = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def bucket_bytes(bucket: Bucket) -> int:
    """Bytes of the tensors of one bucket."""
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
