"""Sequence packing: which samples share a row of a micro-batch, so that the trainer computes on tokens,
not on padding.

An RL batch is long-tailed: most answers are short and a few run to the length limit. Right-padded, every
row of a micro-batch is as long as its longest sample, and on the quickstart batch a quarter to a third of
the forward and backward work is padding. Packed, several samples share one row back to back; each keeps its
own position ids (0, 1, ... from its first token), from which Hugging Face models build a block-diagonal
causal mask (flex/sdpa/eager since transformers 4.54) or varlen attention (flash-attention), so no sample
sees another. This is verl's `use_remove_padding` and slime's packed batches.

Pure decisions, no tensors: the trainer (trainer.py) lays the rows out.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence


def pack_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` packed into rows of at most `capacity` tokens, best-fit decreasing.

    Longest first, each into the row with the least room left that still holds it, else a new row:
    at most 11/9 of the fewest rows possible, plus one. Deterministic (ties keep input order); every index appears
    exactly once; rows come out in the order they were opened, so the first rows hold the longest samples.
    """
    if capacity < 1:
        raise ValueError(f"row capacity must be >= 1, got {capacity}")
    too_long = [n for n in lengths if n > capacity]
    if too_long:
        raise ValueError(f"a sample of {max(too_long)} tokens does not fit a row of {capacity}")
    rows: list[list[int]] = []
    # (room left, row number), kept sorted: the best fit is the first entry with room >= length.
    rooms: list[tuple[int, int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        at = bisect.bisect_left(rooms, (length, -1))
        if at == len(rooms):
            rows.append([index])
            bisect.insort(rooms, (capacity - length, len(rows) - 1))
        else:
            room, row = rooms.pop(at)
            rows[row].append(index)
            bisect.insort(rooms, (room - length, row))
    return rows


def micro_batch_rows(lengths: Sequence[int], rows_per_batch: int, packed: bool) -> list[list[list[int]]]:
    """The trainer's layout of samples of `lengths`: micro-batches of at most `rows_per_batch` rows, each
    row a list of sample indices laid back to back.

    Packed, rows are as long as the longest sample (pack_rows), so a micro-batch never holds more tokens
    than `rows_per_batch` of the longest samples: the memory bound of the padded layout, reached with
    fewer passes. Unpacked, a row is one sample and similar lengths go together, so that the long tail
    pads as few micro-batches as possible.
    """
    if rows_per_batch < 1:
        raise ValueError(f"rows per micro-batch must be >= 1, got {rows_per_batch}")
    if not lengths:
        return []
    if packed:
        rows = pack_rows(lengths, max(lengths))
    else:
        rows = [[i] for i in sorted(range(len(lengths)), key=lambda i: (lengths[i], i))]
    return [rows[at : at + rows_per_batch] for at in range(0, len(rows), rows_per_batch)]


def grid_tokens(layout: list[list[list[int]]], lengths: Sequence[int]) -> int:
    """Token positions the model computes for `layout`: each micro-batch is rows x its longest row."""
    return sum(len(batch) * max(sum(lengths[i] for i in row) for row in batch) for batch in layout)
