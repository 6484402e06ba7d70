"""The `rljob` parser and entry point: each command adds its own parser; `main` maps errors to exit codes."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import logging
import sys

from rich.logging import RichHandler
from rich.markup import escape

from rljob.api import RLJobConfigError
from rljob.runtime.cli import build_model, export_checkpoint, rebuild_report, run_job, validate_job
from rljob.runtime.cli.console import console, terminate
from rljob.runtime.engines.base import EngineError
from rljob.runtime.models.errors import ExportError, ModelSourceError
from rljob.runtime.rollout.round import RewardCollapse
from rljob.runtime.sim.cli import add_simulate_arguments, run_simulate


def build_parser() -> argparse.ArgumentParser:
    """The `rljob` argument parser (kept separate so tests and docs can inspect it)."""
    parser = argparse.ArgumentParser(
        prog="rljob", description="rljob: fast RL post-training of LLMs with APRIL partial rollouts."
    )
    parser.add_argument("--log-level", default="WARNING", help="logging level (DEBUG, INFO, WARNING, ERROR)")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (run_job, rebuild_report, validate_job, export_checkpoint, build_model):
        command.add_parser(sub)
    simulate = sub.add_parser("simulate", help="simulate rollout strategies on a GPU cluster (virtual time)")
    add_simulate_arguments(simulate)
    simulate.set_defaults(func=run_simulate)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `rljob` console script."""
    # A rank that dies on a fatal signal (SIGABRT from a C++ std::terminate in a collective library,
    # SIGSEGV) prints every thread's Python stack to stderr, so its pod log says where it was. Left as it
    # is where a host already enabled it (pytest) or stderr has no file descriptor (captured in-process).
    if not faulthandler.is_enabled():
        with contextlib.suppress(OSError, ValueError):
            faulthandler.enable(all_threads=True)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what --nproc hands to torchrun
    logging.basicConfig(level=args.log_level.upper(), format="%(message)s",
                        handlers=[RichHandler(console=console, show_path=False)])
    code = _exit_code(args)
    if run_job.is_rank_process(args):
        run_job.end_rank_process(code)
    return code


def _exit_code(args: argparse.Namespace) -> int:
    """Run the command; its exit code, errors mapped to theirs."""
    try:
        return int(args.func(args) or 0)
    except RLJobConfigError as err:
        # Unwrapped, so paths and field names can be copied; escaped, so `[0]` is not read as markup.
        console.print(f"[red]invalid RLJob[/]\n{escape(str(err))}", soft_wrap=True)
        return 2
    except EngineError as err:
        console.print(f"[red]engine error[/]: {escape(str(err))}", soft_wrap=True)
        return 3
    except RewardCollapse as err:
        from rljob.api.status import EXIT_REWARD_COLLAPSE, REWARD_COLLAPSE_REASON

        return terminate(f"{REWARD_COLLAPSE_REASON}: {err}", EXIT_REWARD_COLLAPSE)
    except (ModelSourceError, ExportError) as err:
        console.print(f"[red]error[/]: {escape(str(err))}", soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        console.print("interrupted; the last checkpoint is kept, run the same command to resume")
        return 130
