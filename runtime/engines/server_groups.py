"""The CPU server's side of the trainer's weight-update groups: its tensor-parallel ranks join,
receive and leave each group together, as SGLang's TP workers do (docs/weight_sync.md, "The CPU
server"). Each rank is a thread of the one server process; decoding stays on one CPU engine, so
every rank must receive the same bytes and rank 0's copy is the one installed."""

from __future__ import annotations

import asyncio

import torch

from rljob.runtime.weight_group import WeightGroup, join_group, receive_tensors


class GroupError(RuntimeError):
    """A group could not be joined or a broadcast failed; the message says what happened."""


class TPRankGroups:
    """The weight-update groups joined, by name: one member per TP rank."""

    def __init__(self, tp_size: int, timeout_s: float) -> None:
        self.tp_size = tp_size
        self.timeout_s = timeout_s  # joining and each broadcast
        self._groups: dict[str, list[WeightGroup]] = {}

    async def join(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str) -> None:
        """Join ``group_name`` with every TP rank at once, as ranks ``rank_offset + tp_rank`` (the group
        forms only with every rank in); a group of that name joined before is left first (the
        trainer rebuilt it). GroupError, with no rank left in the group, when any rank fails."""
        self.destroy(group_name)
        joins = await asyncio.gather(*(
            asyncio.to_thread(join_group, master_address, master_port, rank_offset + tp_rank, world_size,
                              group_name, self.timeout_s)
            for tp_rank in range(self.tp_size)
        ), return_exceptions=True)
        ranks = [j for j in joins if isinstance(j, WeightGroup)]
        errors = [j for j in joins if not isinstance(j, WeightGroup)]
        if errors:
            _close_all(ranks)
            raise GroupError(f"could not join {group_name}: {errors[0]}")
        self._groups[group_name] = ranks

    def __contains__(self, group_name: str) -> bool:
        return group_name in self._groups

    async def receive(self, group_name: str, names: list[str], dtypes: list[str],
                      shapes: list[list[int]], flattened: bool = False) -> list[tuple[str, torch.Tensor]]:
        """One bucket by broadcast from rank 0, on every TP rank; a broken group is dropped (the
        trainer rebuilds it) and GroupError raised. KeyError when the group was never joined."""
        ranks = self._groups[group_name]
        try:
            received = await asyncio.gather(*(
                asyncio.to_thread(receive_tensors, rank, names, dtypes, shapes, flattened) for rank in ranks
            ))
            return _same_on_every_rank(received)
        except (RuntimeError, ValueError) as exc:
            self.destroy(group_name)
            raise GroupError(f"broadcast failed: {exc}") from exc

    def destroy(self, group_name: str) -> bool:
        """Leave ``group_name`` on every rank; False when it was not joined."""
        ranks = self._groups.pop(group_name, None)
        if ranks is not None:
            _close_all(ranks)
        return ranks is not None

    def close(self) -> None:
        """Leave every group (the server stops)."""
        for name in list(self._groups):
            self.destroy(name)


def _close_all(ranks: list[WeightGroup]) -> None:
    for rank in ranks:
        rank.close()


def _same_on_every_rank(received: list[list[tuple[str, torch.Tensor]]]) -> list[tuple[str, torch.Tensor]]:
    """The tensors of TP rank 0, once every rank is seen to hold the same ones (real TP shards each
    load their slice of the full tensor they receive; here each must have received all of it)."""
    first = received[0]
    for tp_rank, tensors in enumerate(received[1:], start=1):
        for (name, expected), (_, got) in zip(first, tensors, strict=True):
            if not torch.equal(expected, got):
                raise ValueError(f"TP rank {tp_rank} received different bytes for {name} than TP rank 0")
    return first
