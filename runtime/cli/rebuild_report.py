"""`rljob report RUN_DIR`: rebuild a run's plots and summary from its metrics.jsonl (and eval.jsonl)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from rljob.runtime.cli.console import Subparsers, console

if TYPE_CHECKING:
    from rljob.runtime.report import RunHistory


def read_run(jsonl: Path | None) -> tuple[RunHistory, list[dict]]:
    """The step history (streamed) and held-out evaluations a run folder holds (metrics.jsonl, eval.jsonl)."""
    from rljob.runtime.metrics import read_jsonl
    from rljob.runtime.report import RunHistory, read_history

    if jsonl is None or not jsonl.exists():
        return RunHistory(), []
    evals = jsonl.with_name("eval.jsonl")
    return read_history(jsonl), read_jsonl(evals) if evals.exists() else []


def rebuild_report(run_dir: Path) -> list[Path]:
    """Write RUN_DIR/report from RUN_DIR/metrics.jsonl (and eval.jsonl); the files written."""
    from rljob.runtime.report import write_report

    history, evals = read_run(run_dir / "metrics.jsonl")
    return write_report(run_dir / "report", history, None, evals)


def report_command(args: argparse.Namespace) -> int:
    """`rljob report`: 2 when the folder holds no metrics.jsonl."""
    run_dir = Path(args.run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        console.print(f"[red]error[/]: {run_dir / 'metrics.jsonl'} does not exist; give the folder `rljob run` wrote "
                      "(its --output, default runs/<job name>)", soft_wrap=True)
        return 2
    written = rebuild_report(run_dir)
    console.print(f"[green]report[/] rebuilt in [bold]{run_dir / 'report'}[/]: " + ", ".join(p.name for p in written),
                  soft_wrap=True)
    return 0


def add_parser(sub: Subparsers) -> None:
    """The `report` command: rebuild a run's plots."""
    report = sub.add_parser("report", help="rebuild a run's plots and summary from its metrics.jsonl",
                            description="Rebuild RUN_DIR/report (plots, summary.json, summary.md) from "
                            "RUN_DIR/metrics.jsonl and eval.jsonl, e.g. after a crash or while a run goes on.")
    report.add_argument("run_dir", help="the folder `rljob run` wrote (its --output, default runs/<job name>)")
    report.set_defaults(func=report_command)
