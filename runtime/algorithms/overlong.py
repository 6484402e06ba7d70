"""DAPO soft overlong punishment (arXiv 2503.14476, eq. 13), a pure function of the response length.

A response that runs into the cap is usually cut mid-thought; giving it the task reward alone teaches
nothing about length, and giving it 0 punishes reasoning that was right but long. DAPO instead adds a
penalty that grows linearly over the last `buffer_tokens` before the cap:

    0                                   if n <= L - B
    (L - B - n) / B * factor            if L - B < n <= L
    -factor                             if n > L
"""

from __future__ import annotations


def overlong_penalty(length: int, max_length: int, buffer_tokens: int, factor: float = 1.0) -> float:
    """The (non-positive) reward term for a response of `length` tokens under cap `max_length`."""
    if buffer_tokens <= 0 or max_length <= 0:
        raise ValueError(f"buffer_tokens and max_length must be > 0; got {buffer_tokens}, {max_length}")
    if buffer_tokens > max_length:
        raise ValueError(
            f"reward.overlongPunishment.bufferTokens ({buffer_tokens}) exceeds rollout.maxResponseLength ({max_length})"
        )
    start = max_length - buffer_tokens
    if length <= start:
        return 0.0
    if length <= max_length:
        return (start - length) / buffer_tokens * factor
    return -factor
