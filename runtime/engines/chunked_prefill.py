"""Chunked prefill mixed into decode steps: the prompt tokens of a step ride in the decode step's forward.

Without it, the embedded engine prefills every admitted prompt whole, in forwards of their own, before
the step's decode forward: a step that admits a resumed 300-token partial stalls every running decode
for that prefill, and the prefill forwards pay their own fixed costs (and padding, prefill_chunks).
With it, as SGLang does with ``--chunked-prefill-size`` and ``--enable-mixed-chunk``, a step runs ONE
forward over a packed token list: one token for every decode row, then at most a budget of prompt
tokens ("pieces": a prompt's next chunk, oldest prompt first; the prompt in progress goes on first at
the next step). A long prompt spreads over several steps while the decodes keep going.

How one forward serves both: the model runs on a batch of one row of N packed tokens (per-token
position ids, so rotary embeddings are right), so every linear layer is one matrix product over all
tokens. Only attention differs per part: ``mixed_attention`` (registered with transformers as the
model's attention implementation) gives the decode rows the slot cache's attention (slot_cache.py:
the same keys, values and 4D mask as a decode-only step) and every piece causal attention over its
prompt's earlier chunks (kept in a ``PartialPrefill``) and itself. ``MixedBatch`` is the model's
``cache`` argument for that forward: it writes the decode column into the slot cache and appends each
piece's keys and values to its prompt's partial prefill. Without a ``MixedBatch`` in the call (every
other forward) the attention is plain ``sdpa``.

A finished prompt's keys and values become a ``Prefill`` (prefix_cache.py): the engine samples its
first token from the last chunk's logits and copies it into the sequence's KV slot, exactly as an
unchunked prefill would. The arithmetic is the same up to float summation order (checked in float64
by tests/unit/runtime/engines/test_chunked_prefill.py).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from rljob.runtime.engines.slot_cache import SlotKVCache

MIXED_ATTENTION = "rljob_mixed"  # the attention implementation name registered with transformers
K = TypeVar("K", bound=Hashable)  # what identifies a prompt (the engine's group key)


@dataclass
class PartialPrefill:
    """The prompt tokens of one prompt prefilled so far: per layer keys and values ``[kv_heads, tokens, head_dim]``."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def tokens(self) -> int:
        """Prompt tokens already prefilled."""
        return int(self.keys[0].shape[1]) if self.keys else 0


@dataclass(frozen=True)
class Planned(Generic[K]):
    """One prompt's piece in a step: its tokens ``[start, end)``."""

    key: K
    start: int
    end: int


def plan_pieces(pending: Sequence[tuple[K, int, int]], budget: int) -> list[Planned[K]]:
    """The prompt tokens a step prefills: ``pending`` is (key, prompt length, tokens already prefilled)
    in arrival order; each prompt gets its next tokens, oldest first, until ``budget`` tokens are planned.

    Oldest first means a prompt in progress finishes before a newer one starts (SGLang continues its
    chunked request first too), so first tokens come in arrival order and few partials are held.
    """
    if budget < 1:
        raise ValueError(f"budget must be at least 1 token, got {budget}")
    planned: list[Planned[K]] = []
    left = budget
    for key, length, done in pending:
        if left == 0:
            break
        take = min(length - done, left)
        if take > 0:
            planned.append(Planned(key, done, done + take))
            left -= take
    return planned


@dataclass
class Piece:
    """A planned piece with its tokens and the prompt's partial prefill before it."""

    ids: list[int]  # the whole prompt
    start: int
    end: int
    before: PartialPrefill | None
    keys: list[torch.Tensor] = field(default_factory=list)  # per layer, the prompt's [0, end) after the forward
    values: list[torch.Tensor] = field(default_factory=list)

    @property
    def completes(self) -> bool:
        """Whether this piece ends its prompt (its last token's logits give the first token)."""
        return self.end == len(self.ids)

    def after(self) -> PartialPrefill:
        """The prompt's partial prefill once this forward ran."""
        return PartialPrefill(self.keys, self.values)


class MixedBatch:
    """One mixed forward: ``rows`` decode tokens (the slot cache's rows, in order) then the pieces' tokens.

    Passed to the model as its ``cache`` (``update`` stores each layer's new keys and values where they
    belong) and as the ``mixed_batch`` keyword that ``mixed_attention`` reads.
    """

    def __init__(self, slots: SlotKVCache | None, rows: int, decode_mask: torch.Tensor | None, pieces: list[Piece]) -> None:
        self.slots = slots
        self.rows = rows
        self.decode_mask = decode_mask
        self.pieces = pieces
        self.spans: list[tuple[int, int]] = []  # each piece's columns in the packed token list
        at = rows
        for piece in pieces:
            self.spans.append((at, at + piece.end - piece.start))
            at += piece.end - piece.start
        self.tokens = at
        self._decode_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def inputs(self, decode_ids: torch.Tensor | None, decode_positions: torch.Tensor | None,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed input ids and position ids ``[1, tokens]``."""
        ids = [decode_ids.reshape(-1)] if decode_ids is not None else []
        positions = [decode_positions.reshape(-1)] if decode_positions is not None else []
        for piece in self.pieces:
            ids.append(torch.tensor(piece.ids[piece.start : piece.end], dtype=torch.long, device=device))
            positions.append(torch.arange(piece.start, piece.end, dtype=torch.long, device=device))
        return torch.cat(ids)[None], torch.cat(positions)[None]

    # ----------------------------------------------------------------- the model's cache interface

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store layer ``layer_idx``'s new keys and values ``[1, kv_heads, tokens, head_dim]``: the decode
        column in the slot cache, each piece appended to its prompt's earlier chunks."""
        if self.rows:
            assert self.slots is not None
            k = key_states[0, :, : self.rows].transpose(0, 1).unsqueeze(2)
            v = value_states[0, :, : self.rows].transpose(0, 1).unsqueeze(2)
            self._decode_kv[layer_idx] = self.slots.update(k, v, layer_idx)
        for piece, (lo, hi) in zip(self.pieces, self.spans, strict=True):
            k, v = key_states[0, :, lo:hi], value_states[0, :, lo:hi]
            if piece.before is not None:
                k = torch.cat([piece.before.keys[layer_idx], k], dim=1)
                v = torch.cat([piece.before.values[layer_idx], v], dim=1)
            else:  # a copy: a view would keep the whole packed forward's keys alive with the prefill
                k, v = k.clone(), v.clone()
            piece.keys.append(k)
            piece.values.append(v)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Not consulted (the engine passes position ids); the decode rows' attended columns."""
        return self.slots.get_seq_length(layer_idx) if self.slots is not None and self.rows else 0

    # ----------------------------------------------------------------- attention

    def attend(self, module: torch.nn.Module, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """Attention output ``[1, tokens, heads, head_dim]`` for the packed ``query`` ``[1, heads, tokens, head_dim]``."""
        layer = int(module.layer_idx)  # type: ignore[arg-type]  # every attention module of these models has one
        out = query.new_empty((1, self.tokens, query.shape[1], query.shape[3]))
        if self.rows:
            keys, values = self._decode_kv[layer]
            q = query[0, :, : self.rows].transpose(0, 1).unsqueeze(2)  # [rows, heads, 1, head_dim]
            o, _ = sdpa_attention_forward(module, q, keys, values, self.decode_mask, scaling=scaling)
            out[0, : self.rows] = o[:, 0]
        for piece, (lo, hi) in zip(self.pieces, self.spans, strict=True):
            keys, values = piece.keys[layer][None], piece.values[layer][None]
            # Causal over the whole prompt so far: the token at position start + i sees positions <= start + i.
            seen = torch.arange(piece.end, device=query.device)[None, :]
            mine = torch.arange(piece.start, piece.end, device=query.device)[:, None]
            mask = (seen <= mine)[None, None]
            o, _ = sdpa_attention_forward(module, query[:, :, lo:hi], keys, values, mask, scaling=scaling)
            out[0, lo:hi] = o[0]
        return out


def mixed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention implementation of a model served with chunked prefill: a mixed forward's attention
    when the call carries a ``mixed_batch``, else plain sdpa (every other forward of the model)."""
    batch = kwargs.pop("mixed_batch", None)
    if batch is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return batch.attend(module, query, scaling), None


def enable_mixed_attention(model: PreTrainedModel) -> None:
    """Serve ``model`` through ``mixed_attention`` (which is sdpa outside mixed forwards).

    Raises ValueError for a model on another attention implementation: its other forwards would change.
    """
    current = model.config._attn_implementation
    if current == MIXED_ATTENTION:
        return
    if current != "sdpa":
        raise ValueError(f"chunked prefill needs a model on sdpa attention, this one uses {current!r}")
    AttentionInterface.register(MIXED_ATTENTION, mixed_attention)
    AttentionMaskInterface.register(MIXED_ATTENTION, sdpa_mask)
    model.set_attn_implementation(MIXED_ATTENTION)
