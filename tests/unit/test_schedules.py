"""Pure schedule functions: learning-rate warm-up/cosine decay and DAPO's overlong punishment."""

from __future__ import annotations

import math

import pytest

from rljob.runtime.algorithms.lr_schedule import lr_multiplier
from rljob.runtime.algorithms.overlong import overlong_penalty


def test_constant_schedule_is_one_without_warmup() -> None:
    assert [lr_multiplier(s, total_steps=None) for s in range(5)] == [1.0] * 5


def test_linear_warmup_then_constant() -> None:
    assert [lr_multiplier(s, total_steps=None, warmup_steps=4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_decay_after_warmup_reaches_the_floor_at_total_steps() -> None:
    total, warmup, floor = 12, 2, 0.1
    values = [lr_multiplier(s, total_steps=total, warmup_steps=warmup, decay="cosine", min_ratio=floor)
              for s in range(total + 3)]
    assert values[:2] == [0.5, 1.0]
    assert values[2] == 1.0  # the decay starts at the top
    # Half way through the decay span: the cosine's midpoint.
    assert values[warmup + (total - warmup) // 2] == pytest.approx(floor + (1 - floor) * 0.5)
    assert all(a > b for a, b in zip(values[2:total], values[3:total]))  # strictly decreasing
    assert values[total - 1] > floor and values[total:] == [pytest.approx(floor)] * 3  # then flat
    expected = floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * 3 / 10))
    assert values[5] == pytest.approx(expected)


def test_bad_schedule_arguments() -> None:
    with pytest.raises(ValueError, match="trainer.steps"):
        lr_multiplier(0, total_steps=None, decay="cosine")
    with pytest.raises(ValueError, match="min_ratio"):
        lr_multiplier(0, total_steps=10, min_ratio=1.5)


def test_overlong_penalty_is_dapo_equation_13() -> None:
    cap, buffer = 100, 20
    assert overlong_penalty(50, cap, buffer) == 0.0
    assert overlong_penalty(80, cap, buffer) == 0.0  # the buffer starts after L - B
    assert overlong_penalty(90, cap, buffer) == -0.5
    assert overlong_penalty(100, cap, buffer) == -1.0
    assert overlong_penalty(101, cap, buffer) == -1.0
    assert overlong_penalty(90, cap, buffer, factor=2.0) == -1.0
    with pytest.raises(ValueError, match="bufferTokens"):
        overlong_penalty(10, 10, 20)
