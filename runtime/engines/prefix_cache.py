"""Finished prefills of the embedded engine, keyed by their token ids, so a group prefills its prompt once.

A GRPO group is N requests of the same prompt. Without sharing, each sample runs the prompt through
the model (N prefills of the same tokens, and N times the compute of the prompt). With this cache the
engine prefills a prompt once, keeps its keys and values and its last position's logits, and every
other request with exactly the same token ids copies them into its own KV row and samples its first
token from the same logits: within one step (the group's samples admitted together) and across steps
(the samples admitted later, as slots free up). Real SGLang gets the same effect from its radix cache
(one request per sample) or from its ``n`` sampling parameter, which primes the radix cache with a
prefill-only request before it sends the N samples (docs/architecture.md#shared-prefill).

Only whole inputs match: a resumed sample (prompt + its own partial response) has a key of its own.
Entries are computed under the weights of the moment, so the engine clears the cache at every weight
install (as SGLang flushes its radix cache on every weight update): a first token sampled from stale
logits would carry the wrong policy version. Least recently used entries go first once the cache
holds more than its capacity in tokens.

The same cache, over ``Interrupted`` entries, keeps the rows of sequences aborted part-way (what
SGLang's radix cache keeps of an aborted request: its tokens' keys and values, no logits), so the
sample resumed from them decodes on without a prefill (docs/weight_sync.md#keeping-the-cache).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch


@dataclass(frozen=True)
class Prefill:
    """One prompt's prefill: per layer keys and values ``[kv_heads, tokens, head_dim]``, and the
    logits of its last position ``[vocab]`` (what the first generated token is sampled from)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    logits: torch.Tensor

    @property
    def tokens(self) -> int:
        """Prompt tokens it covers."""
        return int(self.keys[0].shape[1])


@dataclass(frozen=True)
class Interrupted:
    """A sequence aborted part-way: per layer keys and values ``[kv_heads, tokens, head_dim]`` of every
    token of its ids but the last, which was sampled and not yet fed (the next decode step feeds it)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def tokens(self) -> int:
        """Tokens whose keys and values it holds (its ids but the last)."""
        return int(self.keys[0].shape[1])


class _Sized(Protocol):
    @property
    def tokens(self) -> int: ...


E = TypeVar("E", bound=_Sized)


class PrefillCache(Generic[E]):
    """Entries (``Prefill`` or ``Interrupted``) by exact token ids, least recently used evicted first, at
    most ``capacity_tokens`` held."""

    def __init__(self, capacity_tokens: int) -> None:
        if capacity_tokens < 0:
            raise ValueError(f"capacity_tokens must be >= 0, got {capacity_tokens}")
        self.capacity_tokens = capacity_tokens
        self.held_tokens = 0
        self._entries: OrderedDict[tuple[int, ...], E] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, ids: Sequence[int]) -> E | None:
        """The entry of exactly ``ids``, if held (it becomes the most recently used)."""
        key = tuple(ids)
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, ids: Sequence[int], prefill: E) -> None:
        """Keep ``prefill`` for ``ids``, evicting the least recently used entries to make room; an entry
        larger than the whole capacity is not kept."""
        key = tuple(ids)
        if prefill.tokens > self.capacity_tokens or key in self._entries:
            return
        while self.held_tokens + prefill.tokens > self.capacity_tokens:
            _, evicted = self._entries.popitem(last=False)
            self.held_tokens -= evicted.tokens
        self._entries[key] = prefill
        self.held_tokens += prefill.tokens

    def clear(self) -> None:
        """Forget every entry (new weights make prefills wrong)."""
        self._entries.clear()
        self.held_tokens = 0
