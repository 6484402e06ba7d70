"""Learning-rate schedule as a pure function of the training step.

Steps are rollout rounds (Trainer.train_step calls), the unit of `trainer.steps`: every optimizer
update of a round (ppoMiniBatches x ppoEpochs) uses the same rate, so a round's mini-batches all
move under one schedule point.

- warm-up: step s < W trains at (s + 1) / W of the base rate, so the first step is not wasted at 0;
- constant: 1 after the warm-up;
- cosine: from 1 at step W down along half a cosine to `min_ratio` at step `total_steps`
  (the last trained step, total_steps - 1, is just above min_ratio, as in the usual convention).
"""

from __future__ import annotations

import math
from typing import Literal

Decay = Literal["constant", "cosine"]


def lr_multiplier(
    step: int, *, total_steps: int | None, warmup_steps: int = 0, decay: Decay = "constant", min_ratio: float = 0.0
) -> float:
    """Factor applied to the base learning rate at 0-based training step `step`."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if warmup_steps < 0 or not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"warmup_steps must be >= 0 and min_ratio in [0, 1]; got {warmup_steps}, {min_ratio}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay == "constant":
        return 1.0
    if decay != "cosine":
        raise ValueError(f"unknown decay {decay!r}; use constant or cosine")
    if total_steps is None or total_steps <= 0:
        raise ValueError("cosine decay needs the total number of training steps (trainer.steps)")
    span = max(total_steps - warmup_steps, 1)
    progress = min((step - warmup_steps) / span, 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
