"""The partial-rollout buffer: whole groups carried from one round to the next, oldest first."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

from rljob.runtime.rollout.sample import Group


class PartialBuffer:
    """FIFO of whole groups (unfinished, or finished but surplus). Nothing in it is ever dropped
    silently: the only ways out are `pop_oldest` (resumed) and checkpoint/restore."""

    def __init__(self) -> None:
        self._groups: deque[Group] = deque()

    def __len__(self) -> int:
        return len(self._groups)

    def __iter__(self) -> Iterator[Group]:
        return iter(self._groups)

    def push(self, group: Group) -> None:
        if any(g.group_id == group.group_id for g in self._groups):
            raise ValueError(f"group {group.group_id} is already buffered")
        self._groups.append(group)

    def pop_oldest(self) -> Group | None:
        return self._groups.popleft() if self._groups else None

    def sample_count(self) -> int:
        return sum(len(g.samples) for g in self._groups)

    def token_count(self) -> int:
        return sum(s.response_length for g in self._groups for s in g.samples)

    def state_dict(self) -> dict[str, Any]:
        return {"groups": [g.to_state() for g in self._groups]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._groups = deque(Group.from_state(g) for g in state["groups"])
