"""What `rljob run` prints (runtime/cli/views.py): the step line, the steps table and the comparison."""

from __future__ import annotations

from collections import deque

from rich.console import Console

from rljob.runtime.cli.views import comparison_view, step_line, step_table
from rljob.runtime.step_record import BatchPart, RoundPart, StepRecord, TrainPart


def record(step: int, eval_reward: float | None = None) -> StepRecord:
    return StepRecord(
        step=step, policy_version=step, strategy="april", time=0.0, eval_reward=eval_reward,
        round=RoundPart(rollout_tokens_per_s=1234.4, truncation_rate=0.25, partial_rate=0.5, buffer_groups=3,
                        rollout_seconds=2.5, trained_tokens=500),
        batch=BatchPart(reward_mean=0.5, off_policy_token_ratio=0.125, staleness_max=2, length_mean=41.6),
        train=TrainPart(train_seconds=1.25),
    )


def cells(renderable: object) -> list[list[str]]:
    """The rendered table's lines as lists of words, borders left out."""
    console = Console(width=200)
    with console.capture() as capture:
        console.print(renderable)
    return [line.replace("│", " ").replace("┃", " ").split() for line in capture.get().splitlines()]


def test_the_step_line_has_the_held_out_reward_only_when_one_ran() -> None:
    # goodput: 500 trained tokens over the step's 3.75 s (docs/metrics.md)
    assert step_line(record(3)) == (
        "step 3: reward 0.500 tok/s 1234 goodput 133 trunc 0.25 partial 0.50 off-policy 0.12 buffer 3")
    assert step_line(record(4, eval_reward=0.75)).endswith("buffer 3 held-out reward 0.750")


def test_the_steps_table_shows_one_row_per_recent_step() -> None:
    rows = [line for line in cells(step_table(deque([record(1), record(2, eval_reward=0.75)])))
            if line and line[0].isdigit()]
    assert rows == [["1", "0.500", "1234", "133", "0.25", "0.50", "0.12", "2", "3", "42", "2.5", "1.2"],
                    ["2", "0.500", "0.750", "1234", "133", "0.25", "0.50", "0.12", "2", "3", "42", "2.5", "1.2"]]


def test_the_comparison_ends_with_the_ceiling_row() -> None:
    rows = [{"strategy": "sync", "tokens_per_s": 100.0, "step_seconds": 2.0, "off_policy_ratio": 0.0,
             "truncation_rate": 0.0, "over_sync": 1.0, "over_ceiling": 0.25},
            {"strategy": "april", "tokens_per_s": 150.0, "trained_tokens_per_s": 90.0, "step_seconds": 1.5,
             "off_policy_ratio": 0.2, "truncation_rate": 0.3, "over_sync": 1.5, "trained_over_sync": 1.1,
             "over_ceiling": 0.375}]
    body = [line for line in cells(comparison_view(rows, 400.0, "t")) if line and line[0] in ("sync", "april", "bubble-free")]
    assert body == [["sync", "100", "0", "2.00", "0.00", "0.00", "1.00", "0.00", "0.25"],
                    ["april", "150", "90", "1.50", "0.20", "0.30", "1.50", "1.10", "0.38"],
                    ["bubble-free", "ceiling", "400", "1.00"]]
