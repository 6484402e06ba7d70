"""One lock per key (an RLJob), held only while someone uses it: memory stays bounded as jobs come and go."""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class _Entry:
    lock: threading.Lock = field(default_factory=threading.Lock)
    users: int = 0


class KeyedLocks:
    """Serialise work per key across threads; a key's lock is dropped when its last user leaves."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._entries: dict[Hashable, _Entry] = {}

    @contextmanager
    def hold(self, key: Hashable) -> Iterator[None]:
        """Hold the lock of `key` for the duration of the block."""
        with self._guard:
            entry = self._entries.setdefault(key, _Entry())
            entry.users += 1
        try:
            with entry.lock:
                yield
        finally:
            with self._guard:
                entry.users -= 1
                if entry.users == 0:
                    del self._entries[key]

    @contextmanager
    def try_hold(self, key: Hashable) -> Iterator[bool]:
        """Hold the lock of `key` if it is free: the block gets True, else False at once (nothing held)."""
        with self._guard:
            entry = self._entries.setdefault(key, _Entry())
            entry.users += 1
        acquired = entry.lock.acquire(blocking=False)
        try:
            yield acquired
        finally:
            if acquired:
                entry.lock.release()
            with self._guard:
                entry.users -= 1
                if entry.users == 0:
                    del self._entries[key]

    def __len__(self) -> int:
        """Keys with a lock right now (held or waited for)."""
        with self._guard:
            return len(self._entries)
