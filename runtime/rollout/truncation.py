"""Length truncation, APRIL's second knob: a per-round segment cap on response tokens.

A sample may generate at most `segment_cap` new tokens in one round. One that reaches the cap
before its natural end is cut and buffered (resumed next round), so a runaway generation no
longer holds the round open. `sigma` derives the cap from recent response lengths
(mean + k*std), `tokens` fixes it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass
class TruncationPolicy:
    """Decides the segment cap from the lengths of recently finished samples."""

    mode: str = "none"  # none | sigma | tokens
    k: float = 2.0
    max_tokens: int | None = None
    min_samples: int = 8
    window: int = 256  # finished lengths remembered across rounds
    _lengths: deque[int] = field(default_factory=deque, repr=False)

    def observe(self, length: int) -> None:
        """Record the total response length of a sample that finished naturally."""
        self._lengths.append(length)
        while len(self._lengths) > self.window:
            self._lengths.popleft()

    def threshold(self) -> int | None:
        """Current segment cap in tokens, or None when truncation is off or not yet calibrated."""
        if self.mode == "tokens":
            return self.max_tokens
        if self.mode != "sigma" or len(self._lengths) < self.min_samples:
            return None
        n = len(self._lengths)
        mean = sum(self._lengths) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in self._lengths) / n)
        return max(1, math.ceil(mean + self.k * std))

    def state_dict(self) -> dict:
        return {"lengths": list(self._lengths)}

    def load_state_dict(self, state: dict) -> None:
        self._lengths = deque(state["lengths"])
