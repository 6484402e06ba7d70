"""`rljob validate JOB`: check a job file (and, with --cluster, what the operator cannot run) and its data."""

from __future__ import annotations

import argparse

from rich.markup import escape
from rich.table import Table

from rljob.api import RLJobConfigError, load_rljob
from rljob.api.spec import RLJob, cluster_problems
from rljob.runtime.cli.console import Subparsers, console


def validate_command(args: argparse.Namespace) -> int:
    """`rljob validate`: print what the job would run, then check its data (--data)."""
    job = load_rljob(args.job)
    problems = cluster_problems(job.spec) if args.cluster else []
    if problems:
        raise RLJobConfigError(f"{args.job}: a cluster cannot run this RLJob:\n" + "\n".join(problems))
    r = job.spec.rollout
    console.print(
        f"[green]ok[/]: RLJob {job.metadata.name}: {r.strategy} rollout on {r.engine} engine, "
        f"{r.rollout_batch_size} groups × {r.samples_per_prompt} samples, {job.spec.trainer.steps} steps"
    )
    mode = args.data or ("none" if args.cluster else "sample")
    if mode == "none":
        return 0
    return _report_data_check(job, None if mode == "all" else args.data_rows, args.strict)


def _report_data_check(job: RLJob, limit: int | None, strict: bool) -> int:
    """Print what `rljob validate` found in the job's data; 1 when --strict and a row would be skipped."""
    from rljob.runtime.tasks.data_check import check_data

    try:
        found = check_data(job, limit)
    except ValueError as err:
        raise RLJobConfigError(str(err)) from None
    for note in found.notes:
        console.print(f"[yellow]note[/]: {escape(note)}", soft_wrap=True)
    if not found.skipped:
        console.print(f"[green]data ok[/]: {found.rows_read} rows read, {found.rows_rendered} rendered, none skipped")
        return 0
    table = Table(title=f"{len(found.skipped)} data rows the runtime would skip (it logs and counts them, and goes on)")
    table.add_column("reason")
    table.add_column("row and problem", overflow="fold")
    for row in found.skipped[:20]:
        table.add_row(row.reason, row.message)
    console.print(table)
    if len(found.skipped) > 20:
        console.print(f"... and {len(found.skipped) - 20} more: {found.by_reason}")
    return 1 if strict else 0


def add_parser(sub: Subparsers) -> None:
    """The `validate` command: check a job file (and its data)."""
    validate = sub.add_parser("validate", help="check an RLJob file and print what it would run")
    validate.add_argument("job", help="path of the RLJob YAML file")
    validate.add_argument(
        "--cluster", action="store_true",
        help="also reject what the operator cannot run (the CRD's cluster rules), e.g. a builtin model or a local "
        "model.path on GPU inference pools, a Hugging Face id with no cache claim or download, engines of another "
        "vendor in an NCCL weight group, or several trainer pods on a ReadWriteOnce checkpoint claim",
    )
    validate.add_argument(
        "--data", choices=["sample", "all", "none"], default=None,
        help="open the data and report rows the runtime would skip (unreadable, unrenderable, too long for the "
        "context): 'sample' renders the first --data-rows rows (default without --cluster), 'all' every row, "
        "'none' skips the check (default with --cluster, whose paths are the pods')",
    )
    validate.add_argument("--data-rows", type=int, default=1000, metavar="N",
                          help="rows rendered by --data sample (default 1000)")
    validate.add_argument("--strict", action="store_true", help="exit 1 when any data row would be skipped")
    validate.set_defaults(func=validate_command)
