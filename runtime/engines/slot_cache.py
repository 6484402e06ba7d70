"""The preallocated KV cache of the embedded engine: one row ("slot") per running sequence.

Why not a growing ``DynamicCache``: it concatenates one column per decode step, copying the whole
cache every step, so a step costs O(rows x context) and a half-empty batch is nearly free. That is
not how a GPU serving engine behaves (its decode step is bound by reading the weights, nearly
independent of the batch), and it hides exactly the bubble that partial rollouts remove. Here the
keys and values live in fixed buffers and a decode step writes one column in place, so step time is
dominated by a per-step cost, as on a GPU.

Layout: ``[slots, kv_heads, 2H, head_dim]`` per layer, where H is the longest context (prompt plus
``max_new_tokens``) any admitted request may reach. All rows write the same column, ``cursor``; a
sequence occupies columns ``[start, cursor)`` of its row and the attention mask hides the rest, so
each row sees its own tokens only, at its own positions (rotary embeddings get per-row position ids).
A new sequence's prefill (its prompt's tokens only, no padding) is copied into the columns just left
of the cursor. When the cursor reaches 2H, every live sequence lies in the right half (none is longer
than H), so the right half moves left and the cursor goes back to H: one copy every H steps.

The cache is handed to the Hugging Face model as its ``cache`` argument: attention layers call
``update`` with the new column and attend to the returned views; the engine passes a ready 4D mask,
which transformers uses as is.
"""

from __future__ import annotations

import heapq
from typing import Any

import torch
from transformers import PretrainedConfig

_ALIGN = 64  # context capacity grows in multiples of this, so growth (a full copy) is rare


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class SlotKVCache:
    """Fixed-slot KV cache with a shared write column; see the module docstring for the layout."""

    def __init__(self, config: PretrainedConfig, slots: int, device: torch.device, dtype: torch.dtype) -> None:
        self.slots = slots
        self._layers = int(config.num_hidden_layers)
        self._kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        self._head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self._device, self._dtype = device, dtype
        self._half = 0  # H: the longest context a live sequence may reach
        self.cursor = 0  # the column the next decode step writes
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.valid = torch.zeros((slots, 0), dtype=torch.bool, device=device)
        self.next_tokens = torch.zeros(slots, dtype=torch.long, device=device)  # fed at the next decode step
        self.positions = torch.zeros(slots, dtype=torch.long, device=device)  # their position ids
        self._start: dict[int, int] = {}  # live slot -> first column it occupies
        self._free = list(range(slots))  # a heap: the lowest free slot is reused first, keeping `rows` small
        self._span = (0, 0)  # (first column, rows) attended in the forward in progress
        self.wraps = 0  # times the cursor went back (the copy it costs is worth watching)

    # ----------------------------------------------------------------- slots

    @property
    def rows(self) -> int:
        """Rows a decode forward covers: every slot up to the highest live one."""
        return max(self._start) + 1 if self._start else 0

    def allocate(self) -> int:
        """Take the lowest free slot (the engine never admits more sequences than slots)."""
        slot = heapq.heappop(self._free)
        self._start[slot] = self.cursor
        return slot

    def release(self, slot: int) -> None:
        """Give a finished sequence's slot back; its row stays in the forward until slots above it free up."""
        del self._start[slot]
        self.valid[slot] = False
        self.positions[slot] = 0  # a dead row keeps feeding position 0: valid for any position encoding
        heapq.heappush(self._free, slot)

    # ----------------------------------------------------------------- capacity

    def reserve(self, context: int) -> None:
        """Make room for sequences reaching `context` tokens (prompt + max_new_tokens)."""
        if context <= self._half:
            return
        half = _round_up(context)
        offset = half - self._half  # old columns move right by this; the cursor stays >= the new H
        shape = (self.slots, self._kv_heads, 2 * half, self._head_dim)
        grown_k = [torch.zeros(shape, device=self._device, dtype=self._dtype) for _ in range(self._layers)]
        grown_v = [torch.zeros(shape, device=self._device, dtype=self._dtype) for _ in range(self._layers)]
        valid = torch.zeros((self.slots, 2 * half), dtype=torch.bool, device=self._device)
        old_width = 2 * self._half
        if old_width:
            for new, old in zip(grown_k + grown_v, self.keys + self.values, strict=True):
                new[:, :, offset : offset + old_width] = old
            valid[:, offset : offset + old_width] = self.valid
        self.keys, self.values, self.valid = grown_k, grown_v, valid
        self._start = {slot: start + offset for slot, start in self._start.items()}
        self.cursor += offset
        self._half = half

    def _wrap(self) -> None:
        """At the right edge, move the right half (which holds every live column) to the left half."""
        half = self._half
        for t in self.keys + self.values:
            t[:, :, :half] = t[:, :, half:]
        self.valid[:, :half] = self.valid[:, half:]
        self.valid[:, half:] = False
        self._start = {slot: start - half for slot, start in self._start.items()}
        self.cursor -= half
        self.wraps += 1

    # ----------------------------------------------------------------- prefill

    def admit(self, slots: list[int], keys: list[torch.Tensor], values: list[torch.Tensor], first_token: torch.Tensor) -> None:
        """Copy one prompt's prefill (per layer ``[kv_heads, tokens, head_dim]``) into every one of ``slots``,
        ending left of the cursor; ``first_token`` [len(slots)] are their first generated tokens.

        Several slots take the same prefill when a group's samples share their prompt (prefix_cache.py):
        one broadcast copy per layer.
        """
        length = int(keys[0].shape[1])
        lo = self.cursor - length
        idx = torch.tensor(slots, dtype=torch.long, device=self._device)
        for layer in range(self._layers):
            self.keys[layer][idx, :, lo : self.cursor] = keys[layer]
            self.values[layer][idx, :, lo : self.cursor] = values[layer]
        self.valid[idx] = False
        self.valid[idx, lo : self.cursor] = True
        for slot in slots:
            self._start[slot] = lo
        self.positions[idx] = length
        self.next_tokens[idx] = first_token

    def row(self, slot: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of a live slot's keys and values, per layer ``[kv_heads, tokens, head_dim]``: its
        columns up to the cursor (every token it was fed), the layout ``admit`` takes back."""
        lo = self._start[slot]
        return ([k[slot, :, lo : self.cursor].clone() for k in self.keys],
                [v[slot, :, lo : self.cursor].clone() for v in self.values])

    # ----------------------------------------------------------------- decode

    def decode_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input ids [rows, 1], position ids [rows, 1], 4D bool mask) for one decode step."""
        if self.cursor >= 2 * self._half:
            self._wrap()
        rows = self.rows
        first = min(self._start.values())
        # Every covered row attends to the column it writes now: live rows need it, and a dead row
        # then attends to something finite instead of to nothing (which would give NaN).
        self.valid[:rows, self.cursor] = True
        self._span = (first, rows)
        mask = self.valid[:rows, first : self.cursor + 1][:, None, None, :]
        return self.next_tokens[:rows, None], self.positions[:rows, None], mask

    def advance(self, slots: list[int], tokens: torch.Tensor) -> None:
        """After a decode step: ``tokens`` are the next inputs of ``slots``; the cursor moves on."""
        idx = torch.tensor(slots, dtype=torch.long, device=self._device)
        self.next_tokens[idx] = tokens
        self.positions[idx] += 1
        self.cursor += 1

    # ----------------------------------------------------------------- the model's cache interface

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's column for layer ``layer_idx``; return the keys/values to attend to."""
        first, rows = self._span
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[:rows, :, self.cursor] = key_states[:, :, 0]
        values[:rows, :, self.cursor] = value_states[:, :, 0]
        return keys[:rows, :, first : self.cursor + 1], values[:rows, :, first : self.cursor + 1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns attended (only consulted by models when position ids are not given)."""
        first, _ = self._span
        return self.cursor - first
