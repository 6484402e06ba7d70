"""Ranks of the weight-update group, from what each server says of itself (pure rules, no I/O).

SGLang gives every tensor-parallel rank of a server its own rank in the group:
``rank = rank_offset + tp_rank`` (``model_runner.init_weights_update_group``). The trainer is rank 0,
so a worker's ``rank_offset`` is 1 plus the TP sizes of the workers before it, and ``world_size`` is
1 plus all of them. A server with ``dp_size > 1`` runs several data-parallel schedulers whose ranks
that path does not count: it cannot join.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class ServerShape(BaseModel):
    """The two fields of ``/get_server_info`` (SGLang's ServerArgs) that place a server in the group."""

    model_config = ConfigDict(extra="ignore")

    tp_size: int = Field(default=1, ge=1)
    dp_size: int = Field(default=1, ge=1)


def server_shape(info: dict[str, object]) -> ServerShape:
    """A server's shape from its server info; ValueError naming the field when it is unusable or
    when the server cannot join the group (``dp_size > 1``)."""
    try:
        shape = ServerShape.model_validate(info)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ValueError(f"/get_server_info {'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    if shape.dp_size > 1:
        raise ValueError(
            f"/get_server_info dp_size={shape.dp_size}: SGLang's weight-update group takes servers with dp_size 1 "
            "only; run more replicas instead of --dp-size, or use the disk transport"
        )
    return shape


@dataclass(frozen=True)
class RankLayout:
    """Where each worker's TP ranks sit in the group; rank 0 is the trainer."""

    offsets: dict[str, int]  # worker URL -> rank_offset (its TP rank 0)
    world_size: int

    def ranks_of(self, url: str) -> range:
        """The group ranks of ``url``'s TP ranks."""
        start = self.offsets[url]
        return range(start, min((o for o in self.offsets.values() if o > start), default=self.world_size))

    def rank0_reaches_every_worker(self) -> bool:
        """Whether each worker has a rank that rank 0 sends to itself in a gloo broadcast.

        gloo broadcasts along a binomial tree (``gloo/broadcast.cc``): rank 0 sends to ranks 1, 2, 4,
        8, ...; every other rank receives from one of those. A send completes only once its peer has
        posted the receive (``transport/tcp/pair.cc``), so rank 0's broadcast completing shows that each
        of those workers is inside the update that receives it, and shows nothing of the others."""
        direct = {1 << i for i in range(self.world_size.bit_length()) if 1 << i < self.world_size}
        return all(any(rank in direct for rank in self.ranks_of(url)) for url in self.offsets)


def rank_layout(workers: Sequence[tuple[str, int]]) -> RankLayout:
    """The layout of ``(url, tp_size)`` in this order: offsets 1, 1 + tp_0, 1 + tp_0 + tp_1, ..."""
    offsets: dict[str, int] = {}
    next_rank = 1
    for url, tp_size in workers:
        if tp_size < 1:
            raise ValueError(f"{url}: tp_size {tp_size} must be at least 1")
        offsets[url] = next_rank
        next_rank += tp_size
    return RankLayout(offsets, next_rank)
