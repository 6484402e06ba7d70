"""A dense reward for tests that need a gradient.

A random tiny policy almost never solves the arithmetic task, so with the exact-answer reward every
group can score 0: no advantage, no gradient, AdamW moments that stay zero, and a test of training or
of checkpointed optimizer state that proves nothing (or fails by chance, as the bf16 resume test did
under load). Rewarding shorter answers gives almost every group a signal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MAX_LENGTH = 40
# For processes whose import path must not hold the repository (its `operator/` shadows the stdlib's):
# the same function as a module of its own, written next to the job.
_MODULE = f"def score(inp):\n    return 1.0 - min(inp.response_length, {MAX_LENGTH}) / {MAX_LENGTH}\n"


def shorter_is_better(inp: Any) -> float:
    """1 for an empty answer, falling linearly to 0 at MAX_LENGTH tokens."""
    return 1.0 - min(inp.response_length, MAX_LENGTH) / MAX_LENGTH


def use_shorter_is_better(doc: dict[str, Any], module_dir: Path | None = None) -> None:
    """Set the job's reward to `shorter_is_better`: imported from here, or (module_dir given, for a
    subprocess that must find it on its PYTHONPATH) from a `length_reward.py` written into module_dir."""
    if module_dir is None:
        doc["spec"]["reward"] = {"type": "python", "function": f"{__name__}:shorter_is_better"}
        return
    (module_dir / "length_reward.py").write_text(_MODULE)
    doc["spec"]["reward"] = {"type": "python", "function": "length_reward:score"}


def always_zero(_inp: Any) -> float:
    """A reward that never moves: every group scores alike (the reward-collapse fault)."""
    return 0.0
