"""The KV cache of a continuously batched set of sequences, left-padded to a common length.

Rows are sequences; columns are cache positions. Padding sits on the left and is masked out by
``attention_mask``; every row carries its own true position, so rotary embeddings see each sequence
exactly as if it ran alone. Rows join (``merge``) and leave (``select``) between decode steps;
columns that are padding in every row are dropped (``trim``) so a long-gone sequence does not keep
the batch wide.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """Pad ``t`` with zeros on the left of ``dim`` up to ``width``."""
    missing = width - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


@dataclass
class KVBatch:
    """Cache tensors plus the bookkeeping needed to feed the next decode step."""

    cache: DynamicCache
    attention_mask: torch.Tensor  # [B, T] long, 0 = padding
    positions: torch.Tensor  # [B] position id of the next token fed
    next_tokens: torch.Tensor  # [B] token id fed at the next decode step

    @property
    def size(self) -> int:
        """Number of rows (sequences)."""
        return int(self.attention_mask.shape[0])

    @property
    def width(self) -> int:
        """Number of cache columns (including padding)."""
        return int(self.attention_mask.shape[1])

    def layer_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys, values) per layer, each [B, kv_heads, T, head_dim]."""
        return [(layer.keys, layer.values) for layer in self.cache.layers]

    def _set_layers(self, tensors: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for layer, (k, v) in zip(self.cache.layers, tensors, strict=True):
            layer.keys, layer.values = k, v

    def zero_padding(self) -> None:
        """Zero cached keys/values at padded columns.

        Padded query rows of a left-padded prefill may attend to nothing and produce NaN; a masked
        NaN value still poisons attention (0 * NaN), so padded cache entries must be finite.
        """
        keep = self.attention_mask.bool()[:, None, :, None]
        self._set_layers([(torch.where(keep, k, 0.0), torch.where(keep, v, 0.0)) for k, v in self.layer_tensors()])

    def select(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in that order), then drop all-padding columns."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.attention_mask.device)
        self._set_layers([(k.index_select(0, idx), v.index_select(0, idx)) for k, v in self.layer_tensors()])
        self.attention_mask = self.attention_mask.index_select(0, idx)
        self.positions = self.positions.index_select(0, idx)
        self.next_tokens = self.next_tokens.index_select(0, idx)
        self.trim()

    def trim(self) -> None:
        """Drop leading columns that are padding in every row."""
        if self.size == 0:
            return
        used = self.attention_mask.any(dim=0).nonzero()
        first = int(used[0]) if used.numel() else self.width
        if first == 0:
            return
        self._set_layers([(k[:, :, first:, :], v[:, :, first:, :]) for k, v in self.layer_tensors()])
        self.attention_mask = self.attention_mask[:, first:]

    def merge(self, other: KVBatch) -> None:
        """Append the rows of ``other`` after this batch's rows, left-padding the narrower one."""
        width = max(self.width, other.width)
        merged = [
            (
                torch.cat([_left_pad(k1, width, 2), _left_pad(k2, width, 2)], dim=0),
                torch.cat([_left_pad(v1, width, 2), _left_pad(v2, width, 2)], dim=0),
            )
            for (k1, v1), (k2, v2) in zip(self.layer_tensors(), other.layer_tensors(), strict=True)
        ]
        self._set_layers(merged)
        self.attention_mask = torch.cat(
            [_left_pad(self.attention_mask, width, 1), _left_pad(other.attention_mask, width, 1)], dim=0
        )
        self.positions = torch.cat([self.positions, other.positions])
        self.next_tokens = torch.cat([self.next_tokens, other.next_tokens])

    def extend_mask(self) -> torch.Tensor:
        """Add the column the next decode step writes; returns the new mask."""
        ones = self.attention_mask.new_ones((self.size, 1))
        self.attention_mask = torch.cat([self.attention_mask, ones], dim=1)
        return self.attention_mask
