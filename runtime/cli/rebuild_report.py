"""`rljob report RUN_DIR`: rebuild a run's plots and summary from its metrics.jsonl (and eval.jsonl)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from rljob.api.spec import TruncationBand
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


def rebuild_report(run_dir: Path, band: tuple[float, float] | None = None) -> list[Path]:
    """Write RUN_DIR/report from RUN_DIR/metrics.jsonl (and eval.jsonl); the files written. ``band``: the
    job's truncation band (None: the default band)."""
    from rljob.runtime.report import TRUNCATION_BAND, write_report

    history, evals = read_run(run_dir / "metrics.jsonl")
    return write_report(run_dir / "report", history, None, evals, band or TRUNCATION_BAND)


def report_command(args: argparse.Namespace) -> int:
    """`rljob report`: 2 when the folder holds no metrics.jsonl."""
    run_dir = Path(args.run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        console.print(f"[red]error[/]: {run_dir / 'metrics.jsonl'} does not exist; give the folder `rljob run` wrote "
                      "(its --output, default runs/<job name>)", soft_wrap=True)
        return 2
    low, high = args.band
    if not 0 <= low < high <= 1:
        console.print(f"[red]error[/]: --band {low} {high}: give LOW HIGH with 0 <= LOW < HIGH <= 1, as the job's "
                      "spec.autotune.truncationBand", soft_wrap=True)
        return 2
    written = rebuild_report(run_dir, (low, high))
    console.print(f"[green]report[/] rebuilt in [bold]{run_dir / 'report'}[/]: " + ", ".join(p.name for p in written),
                  soft_wrap=True)
    return 0


def add_parser(sub: Subparsers) -> None:
    """The `report` command: rebuild a run's plots."""
    report = sub.add_parser("report", help="rebuild a run's plots and summary from its metrics.jsonl",
                            description="Rebuild RUN_DIR/report (plots, summary.json, README.md) from "
                            "RUN_DIR/metrics.jsonl and eval.jsonl, e.g. after a crash or while a run goes on.")
    report.add_argument("run_dir", help="the folder `rljob run` wrote (its --output, default runs/<job name>)")
    default = TruncationBand()
    report.add_argument("--band", nargs=2, type=float, metavar=("LOW", "HIGH"), default=[default.low, default.high],
                        help="the job's healthy truncation-rate band (spec.autotune.truncationBand; default "
                        f"{default.low} {default.high}), which the summary's truncation verdict is against")
    report.set_defaults(func=report_command)
