"""How rank 0 splits a step's accepted groups over the training ranks: balanced by token count.

A rank's step time is its slowest micro-batch chain, so the ranks should get equal numbers of tokens,
not equal numbers of groups (a resumed APRIL group can be ten times longer than a fresh one). Groups
stay whole: their advantages are normalised within the group. Pure functions, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence


def balance_by_tokens(token_counts: Sequence[int], world_size: int) -> list[list[int]]:
    """Indices of `token_counts` per rank: longest first onto the least-loaded rank (LPT).

    Deterministic (ties go to the lower index and the lower rank), every index appears exactly once,
    and each rank's indices are in ascending order, so a rank trains its groups in round order.
    LPT's largest load is at most 4/3 of the optimum; with more groups than ranks it is close to even.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if any(n < 0 for n in token_counts):
        raise ValueError("token counts must be >= 0")
    loads = [0] * world_size
    shards: list[list[int]] = [[] for _ in range(world_size)]
    # Ties among equal counts: by index, so fewer-token groups of equal size still round-robin.
    order = sorted(range(len(token_counts)), key=lambda i: (-token_counts[i], i))
    for index in order:
        # Least tokens first, then fewest groups: zero-token groups spread instead of piling on rank 0.
        rank = min(range(world_size), key=lambda r: (loads[r], len(shards[r]), r))
        shards[rank].append(index)
        loads[rank] += token_counts[index]
    return [sorted(s) for s in shards]
