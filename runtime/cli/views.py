"""What `rljob run` shows: the live display (steps bar, the running round, recent steps), the per-step
line without it, the strategy comparison and the run summary."""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Group
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rljob.runtime.cli.console import console
from rljob.runtime.step_record import StepRecord

if TYPE_CHECKING:
    from rljob.runtime.report import RunHistory
    from rljob.runtime.runner import JobRunner, RunSummary


def step_table(rows: deque[StepRecord]) -> Table:
    """The recent steps: reward, held-out reward, rollout figures, staleness, buffer and timings."""
    table = Table(title="steps", expand=False, header_style="bold")
    for col in ("step", "reward", "held-out", "tok/s", "goodput", "trunc", "partial", "off-pol", "stale", "buffer",
                "len μ", "rollout s", "train s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r.step),
            f"{r.batch.reward_mean:.3f}",
            "" if r.eval_reward is None else f"{r.eval_reward:.3f}",
            f"{r.round.rollout_tokens_per_s:.0f}",
            f"{r.goodput_tokens_per_s:.0f}",
            f"{r.round.truncation_rate:.2f}",
            f"{r.round.partial_rate:.2f}",
            f"{r.batch.off_policy_token_ratio:.2f}",
            str(r.batch.staleness_max),
            str(r.round.buffer_groups),
            f"{r.batch.length_mean:.0f}",
            f"{r.round.rollout_seconds:.1f}",
            f"{r.train.train_seconds:.1f}",
        )
    return table


def step_line(rec: StepRecord) -> str:
    """One step as a line (--no-live: logs, CI, pods)."""
    return (
        f"step {rec.step}: reward {rec.batch.reward_mean:.3f} tok/s {rec.round.rollout_tokens_per_s:.0f} "
        f"goodput {rec.goodput_tokens_per_s:.0f} trunc {rec.round.truncation_rate:.2f} "
        f"partial {rec.round.partial_rate:.2f} off-policy {rec.batch.off_policy_token_ratio:.2f} buffer {rec.round.buffer_groups}"
        + ("" if rec.eval_reward is None else f" held-out reward {rec.eval_reward:.3f}")
    )


class RunDisplay:
    """The live display: the steps bar, the running round's bar (read from the scheduler's progress)
    and a table of the last `table_rows` steps."""

    def __init__(self, runner: JobRunner, round_size: int, table_rows: int) -> None:
        self.runner = runner
        self.recent: deque[StepRecord] = deque(maxlen=table_rows)
        self.steps = Progress(TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        self.step_task = self.steps.add_task("steps", total=runner.total_steps, completed=runner.step)
        self.round_bar = Progress(TextColumn("[bold]round {task.fields[idx]}"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.fields[info]}"))
        self.round_task = self.round_bar.add_task("round", total=round_size, idx=0, info="")

    def render(self) -> Group:
        """The display as it stands now (rich's Live calls this on every refresh)."""
        p = self.runner.scheduler.progress
        self.round_bar.update(
            self.round_task, completed=p.accepted, idx=p.round_index,
            info=f"{p.phase} · in flight {p.in_flight_groups} groups · buffer {p.buffer_groups} · {p.tokens} tokens",
        )
        return Group(self.steps, self.round_bar, step_table(self.recent))

    def add_step(self, rec: StepRecord) -> None:
        """A step finished: into the table, and the steps bar moves."""
        self.recent.append(rec)
        self.steps.update(self.step_task, completed=rec.step)


def comparison_view(rows: list[dict], ceiling: float, title: str) -> Table:
    """Rich table of a strategy comparison (compare.comparison_table rows) with the ceiling row."""
    table = Table(title=title, header_style="bold",
                  caption="rows/step: tokens generated per decode step (in parentheses: while the trainer trains)")
    for col in ("strategy", "tokens/s", "trained tok/s", "round s", "off-policy", "truncation", "× sync",
                "trained × sync", "× ceiling", "rows/step"):
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(row["strategy"], f"{row['tokens_per_s']:.0f}", f"{row.get('trained_tokens_per_s', 0.0):.0f}",
                      f"{row['step_seconds']:.2f}", f"{row['off_policy_ratio']:.2f}", f"{row['truncation_rate']:.2f}",
                      f"{row['over_sync']:.2f}", f"{row.get('trained_over_sync', 0.0):.2f}",
                      f"{row['over_ceiling']:.2f}", _batch_rows(row))
    table.add_row("bubble-free ceiling", f"{ceiling:.0f}", "", "", "", "", "", "", "1.00", "")
    return table


def _batch_rows(row: dict) -> str:
    """How full the engines' decode batches ran while collecting, and (async) while the trainer trained."""
    collection, overlap = row.get("engine_collection"), row.get("engine_overlap")
    text = f"{collection['tokens_per_decode_step']:.0f}" if collection else ""
    return text + (f" ({overlap['tokens_per_decode_step']:.0f})" if overlap else "")


def print_summary(summary: RunSummary, history: RunHistory, evals: list[dict], report_dir: Path,
                  written: list[Path]) -> None:
    """The run summary table: steps, policy version, wall time, reward and held-out reward, the report."""
    from rljob.runtime.report import reward_gain

    table = Table(title="run summary", show_header=False)
    table.add_row("steps run", f"{summary.steps_run} (steps {summary.first_step}-{summary.last_step})")
    table.add_row("policy version", str(summary.policy_version))
    table.add_row("wall time", f"{summary.wall_seconds:.0f} s")
    if history:
        first, last = reward_gain(history)
        table.add_row("reward, first → last steps", f"{first:.3f} → {last:.3f}")
    if evals:
        table.add_row(
            f"held-out reward ({evals[-1]['prompts']} prompts)",
            f"{evals[0]['reward_mean']:.3f} (step {evals[0]['step']}) → {evals[-1]['reward_mean']:.3f} (step {evals[-1]['step']})",
        )
    table.add_row("report", str(report_dir))
    console.print(table)
    console.print("plots: " + ", ".join(p.name for p in written if p.suffix == ".png"))
