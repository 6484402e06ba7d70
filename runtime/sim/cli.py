"""`rljob simulate scenario.yaml`: the arguments and the command (wired into runtime/cli/entry.py)."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from rich.console import Console

from rljob.runtime.sim.report import print_results, write_outputs
from rljob.runtime.sim.runner import simulate
from rljob.runtime.sim.scenario import SCENARIO_DIR, ScenarioError, load_scenario

log = logging.getLogger(__name__)
console = Console(width=None if sys.stdout.isatty() else 220)  # logs and CI get the full table


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `rljob simulate`."""
    parser.add_argument("scenario", help=f"scenario YAML (a path, or a file name in {SCENARIO_DIR})")
    parser.add_argument("--output", default="runs/simulate", help="folder for the JSON and plots")
    parser.add_argument("--gpus", help="comma-separated GPU counts to sweep, e.g. 8,64,512 (default: the scenario's)")
    parser.add_argument("--steps", type=int, help="training steps per strategy, overriding the scenario")
    parser.add_argument("--strategy", action="append", help="only these strategy names (repeatable)")


def run_simulate(args: argparse.Namespace) -> int:
    """Simulate the scenario (per GPU count), print the tables, write JSON and plots."""
    try:
        base = load_scenario(args.scenario)
        gpu_counts = [int(g) for g in args.gpus.split(",")] if args.gpus else [base.gpus]
        updates: dict = {}
        if args.steps:
            updates["steps"] = args.steps
            updates["warmup_steps"] = min(base.warmup_steps, args.steps - 1)
        if args.strategy:
            chosen = [s for s in base.strategies if s.name in args.strategy]
            if not chosen:
                raise ScenarioError(f"no strategy named {args.strategy} in {base.name}; "
                                    f"it has {[s.name for s in base.strategies]}")
            updates["strategies"] = chosen
        for gpus in gpu_counts:
            scenario = type(base).model_validate({**base.model_dump(), **updates, "gpus": gpus,
                                                   "strategies": updates.get("strategies", base.strategies)})
            started = time.perf_counter()
            results = simulate(scenario)
            print_results(console, scenario, results)
            paths = write_outputs(scenario, results, Path(args.output))
            console.print(f"simulated in {time.perf_counter() - started:.1f} s; wrote "
                          + ", ".join(str(p) for p in paths))
    except ValueError as err:  # ScenarioError, bad --gpus, pydantic errors on overrides
        console.print(f"[red]invalid scenario[/]: {err}")
        return 2
    return 0
