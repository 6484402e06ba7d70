"""How much work async-APRIL keeps ahead while the trainer trains: one batch against the over-sampled target.

While the trainer trains step v, async-APRIL's engines go on generating: the groups still in flight
at collection run on and more are launched, so that `AsyncStrategy.ahead_target` groups are in flight
or done ahead. What generates then is trained at v + 1 at the earliest, and v + 1 takes one batch.
This benchmark runs the two bounds side by side on the quickstart task, in time_to_reward.py's
setup (the engine in its own server process on core 0, the trainer on core 1, weights over gloo):

- `one batch` (ahead_batches 1, the default);
- `over-sampled target` (ahead_batches = the job's overSampling, 2.0: the launch target of a round,
  the bound before this benchmark).

Seeds are interleaved, each seed running both variants back to back, so machine noise hits both alike.
Reports per run: wall time of the training steps, the share of generated tokens thrown away because
they aged past maxStaleness (regenerated), generated over trained tokens, engine and trainer idle
shares, held-out reward before and after. The verdict is the mean of the per-seed wall-time ratios
(over-sampled target / one batch) with two standard errors. Writes docs/benchmarks/async_ahead.json.
Run: `python benchmarks/async_ahead.py` (about 15 min on 2 cores for 3 seeds of 30 steps).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from autotune import paired  # benchmarks/autotune.py: the paired verdict of interleaved repeats
from machine_info import describe, load_average  # benchmarks/machine_info.py
from rich.console import Console
from rich.table import Table
from rljob.api import load_rljob
from rljob.runtime.rollout.strategy import AsyncStrategy
from rljob.runtime.runner import JobRunner
from time_to_reward import ROOT, disaggregation, train_one  # benchmarks/time_to_reward.py: the same setup

console = Console()
SUMMARY_KEYS = ("wall_s", "thrown_away_share", "generated_over_trained", "heldout_end", "engine_idle_share",
                "trainer_idle_share")


def with_ahead(batches: float) -> Callable[[JobRunner], None]:
    """A runner adjustment: the async strategy keeps `batches` batches in flight or done ahead."""

    def adjust(runner: JobRunner) -> None:
        strategy = runner.scheduler.strategy
        assert isinstance(strategy, AsyncStrategy), "the job must run the async strategy"
        runner.scheduler.strategy = dataclasses.replace(strategy, ahead_batches=batches)

    return adjust


def measured(run: dict[str, Any], variant: str, batches: float) -> dict[str, Any]:
    """One run's row: wall time, waste, held-out reward, idle shares."""
    steps = run["train"]
    generated = sum(s["tokens_generated"] for s in steps)
    trained = sum(s["trained_tokens"] for s in steps)
    thrown = sum(s["regenerated_tokens"] for s in steps)
    return {"variant": variant, "ahead_batches": batches, "seed": run["seed"], "wall_s": run["wall_s"],
            "thrown_away_share": thrown / generated if generated else 0.0,
            "generated_over_trained": generated / trained if trained else None,
            "heldout_start": run["eval"][0]["reward"], "heldout_end": run["eval"][-1]["reward"],
            "engine_idle_share": run["engine_idle_share"], "trainer_idle_share": run["trainer_idle_share"]}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    over = load_rljob(args.job).spec.rollout.partial.over_sampling
    variants = {"one batch": 1.0, "over-sampled target": over}
    cores = (0, 1)
    torch.set_num_threads(1)
    ns = argparse.Namespace(job=args.job, steps=args.steps, eval_every=args.steps, eval_prompts=args.eval_prompts,
                            sides="processes", keep_cache=False)
    rows: list[dict[str, Any]] = []
    for seed in args.seeds:
        for variant, batches in variants.items():
            run = await train_one(ns, "async", seed, cores, with_ahead(batches))
            rows.append(measured(run, variant, batches))
            console.print(f"seed {seed} {variant}: {run['wall_s']:.0f} s, "
                          f"thrown away {rows[-1]['thrown_away_share']:.0%}")
    by = {v: [r for r in rows if r["variant"] == v] for v in variants}
    ratios = [o["wall_s"] / b["wall_s"] for o, b in zip(by["over-sampled target"], by["one batch"], strict=True)]
    return {
        "benchmark": "async_ahead", "job": str(Path(args.job).relative_to(ROOT)) if Path(args.job).is_relative_to(ROOT)
        else args.job, "steps": args.steps, "seeds": args.seeds, "eval_prompts": args.eval_prompts,
        "disaggregation": disaggregation("processes", cores),
        "summary": {v: {k: statistics.fmean(r[k] for r in rs) for k in SUMMARY_KEYS} for v, rs in by.items()},
        "over_target_over_one_batch_wall": paired(ratios, 1.0) | {"per_seed": ratios},
        "runs": rows, "machine": describe(), "load_average_1min_at_end": load_average(),
    }


def show(result: dict[str, Any]) -> None:
    table = Table(title=f"async-APRIL work ahead: {result['steps']} steps x seeds {result['seeds']}")
    for col in ("variant", "wall s", "thrown away", "generated / trained", "held-out end", "engine idle",
                "trainer idle"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for variant, s in result["summary"].items():
        table.add_row(variant, f"{s['wall_s']:.0f}", f"{s['thrown_away_share']:.0%}",
                      f"{s['generated_over_trained']:.2f}", f"{s['heldout_end']:.3f}",
                      f"{s['engine_idle_share']:.0%}", f"{s['trainer_idle_share']:.0%}")
    console.print(table)
    v = result["over_target_over_one_batch_wall"]
    verdict = "one batch faster" if v["shown"] else "over-sampled target faster" if v["missed"] else "inside the noise"
    console.print(f"wall, over-sampled target / one batch: {v['mean']:.3f} ± {2 * v['standard_error']:.3f} "
                  f"(2 SE, {v['repeats']} seeds): {verdict}")
    console.print(f"machine: {result['machine']}; {result['disaggregation']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", default=str(ROOT / "docs/examples/quickstart.yaml"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="data seeds")
    parser.add_argument("--eval-prompts", type=int, default=128, help="held-out problems before and after")
    parser.add_argument("--output", default=str(ROOT / "docs/benchmarks"))
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "async_ahead.json").write_text(json.dumps(result, indent=2) + "\n")
    show(result)
    console.print(f"wrote {out / 'async_ahead.json'}")


if __name__ == "__main__":
    main()
