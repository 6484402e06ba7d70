"""The one weight-transport interface and its report (the bucketing is weights/buckets.py).

A transport takes the trainer's weights as an iterable of buckets of full named tensors (today's
single-process trainer: its model's named_parameters; a sharded trainer: full tensors gathered one
bucket at a time on rank 0) and installs them, with a new version, on every engine that can take
them. It never decides what the job's policy version is: it reports which engine ranks now serve
the new version, as the engines themselves tell it (their served ``weight_version`` is the truth).

Modes (one module each): ``distributed`` (broadcast.py), ``disk`` (disk.py), ``tensor`` (tensor.py).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rljob.runtime.weights.buckets import Bucket

if TYPE_CHECKING:
    import torch

# Called once per sync attempt with the dtype the weights travel in (None: the trainer's); yields the
# buckets in a fixed order, cut by their bytes in that dtype. A source that copies the tensors anyway
# (a sharded trainer's gather) makes them in that dtype, which halves what an fp32 trainer gathers for
# bf16 engines; a consumer casts whatever still is not (wire_dtype.as_wire: a no-op on the others).
# A collective source (every trainer rank takes part in gathering each bucket) must be called on every
# rank for each attempt.
WeightSource = Callable[["torch.dtype | None"], Iterable[Bucket]]


@dataclass
class SyncReport:
    """What one sync did: which engine ranks serve ``version`` now, which failed and why."""

    version: int
    mode: str
    updated: list[str] = field(default_factory=list)  # engine ranks (worker URLs, engine names) now at version
    failed: dict[str, str] = field(default_factory=dict)  # engine rank -> reason
    bytes_sent: int = 0
    broadcasts: int = 0  # collective calls that moved them (distributed mode: per tensor, or per flattened bucket)
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
        """Install the weights of ``weights(dtype)`` as ``version`` on every engine that can take them.

        Calls ``weights`` exactly once and consumes it to the end, whatever fails, so a collective
        source stays in step with the trainer ranks that gather it. Never raises because one engine
        failed: failures are in the report, and an engine that failed is out of the rotation until a
        later sync catches it up.
        """

    async def close(self) -> None:
        """Release groups, sockets and files the transport holds."""
        return None
