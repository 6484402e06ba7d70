"""Measures the embedded engine and the quickstart's response lengths, for the simulator's CPU setup.

The simulator's `xeon-core` GPU entry and `tiny-arith` model entry (runtime/sim/calibration.yaml) stand
for benchmarks/time_to_reward.py's CPU setup: one core for the engine (one torch thread, pinned as that
benchmark pins it), the warmed-up tiny-arith policy, the quickstart job. This script measures what
those entries need, on this machine:

- the engine's step law (PM §3.3 shape, t = a + n·κ + c·Σ context, plus prefill p per prompt token): batches
  of n requests that each decode exactly T tokens, n ∈ {1, 16, 64, 128}, T ∈ {32, 160}, fitted by least
  squares on the total times (each run's total is a sum of its steps in closed form);
- the response-length law (log-normal, between- and within-prompt spread, share at the cap) of the
  policy as loaded, from `--rounds` synchronous rounds of the quickstart's batch (16 prompts × 8);
- the weight sync of the whole policy into the engine.

Writes docs/benchmarks/simulator_cpu_calibration.json. Run: `python benchmarks/simulator_cpu_calibration.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from machine_info import describe, load_average  # benchmarks/machine_info.py
from rich.console import Console
from rljob.api import load_rljob
from rljob.runtime.compare import measure_ceiling
from rljob.runtime.engines.base import WeightUpdate
from rljob.runtime.runner import JobRunner, RunOptions

ROOT = Path(__file__).resolve().parents[1]
console = Console()
BATCHES = (1, 16, 64, 128)
LENGTHS = (32, 160)


def fit_step_law(points: list[dict[str, float]], prompt: int) -> dict[str, float]:
    """Least-squares a (s/step), κ (s/sequence/step), c (s/context token/step), p (s/prefill token) from runs
    of n requests decoding T tokens each: total = T·a + n·T·κ + c·n·(T·P + T(T+1)/2) + p·n·P."""
    rows = [[t, n * t, n * (t * prompt + t * (t + 1) / 2), n * prompt]
            for n, t in ((p["batch"], p["tokens"]) for p in points)]
    seconds = [p["seconds"] for p in points]
    coef, *_ = np.linalg.lstsq(np.array(rows), np.array(seconds), rcond=None)
    a, kappa, c, pf = (max(0.0, float(x)) for x in coef)  # a negative term is noise around zero
    return {"fixed_step_s": a, "per_seq_step_s": kappa, "per_context_token_step_s": c, "prefill_s_per_token": pf}


def length_law(groups: list[list[int]], cap: int) -> dict[str, float]:
    """Log-normal law of response lengths: median, between-prompt and within-prompt σ of log length,
    and the share that reached the cap."""
    logs = [[math.log(max(1, n)) for n in g] for g in groups if g]
    within = statistics.fmean(statistics.pvariance(g) for g in logs if len(g) > 1)
    between = statistics.pvariance([statistics.fmean(g) for g in logs])
    flat = sorted(n for g in groups for n in g)
    return {"median_tokens": float(statistics.median(flat)), "sigma_between": math.sqrt(between),
            "sigma_within": math.sqrt(within), "cap_share": sum(1 for n in flat if n >= cap) / len(flat),
            "mean_tokens": statistics.fmean(flat), "samples": len(flat)}


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    if (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {0})  # the engine's core, as time_to_reward.py pins it
    job = load_rljob(args.job)
    job.spec.rollout.strategy = "sync"
    with tempfile.TemporaryDirectory() as tmp:
        job.spec.checkpoint.dir = str(Path(tmp) / "ckpt")
        runner = JobRunner(job, RunOptions(output_dir=Path(tmp), resume=False))
        await runner.setup()
        try:
            groups: list[list[int]] = []
            prompt_lengths: list[int] = []
            rollout_s: list[float] = []
            for i in range(args.rounds):
                result = await runner.scheduler.run_round(0)
                rollout_s.append(result.stats.rollout_seconds)
                for g in result.groups:
                    groups.append([s.response_length for s in g.samples])
                    prompt_lengths += [len(s.prompt_ids) for s in g.samples]
                console.log(f"sync round {i + 1}: {result.stats.tokens_generated} tokens in "
                            f"{result.stats.rollout_seconds:.2f} s")
            engine = runner.engines[0]
            prompt_ids = list(runner.scheduler.prompts.next_prompt().prompt_ids)
            points = []
            for tokens in LENGTHS:
                for batch in BATCHES:
                    # The best of `--repeats`: other jobs on a shared machine only ever slow a run down.
                    rate = max([await measure_ceiling(engine, batch=batch, tokens=tokens, prompt_ids=prompt_ids)
                                for _ in range(args.repeats)])
                    points.append({"batch": batch, "tokens": tokens, "seconds": batch * tokens / rate})
                    console.log(f"n={batch:3d} T={tokens:3d}: {rate:,.0f} tok/s")
            model = cast("torch.nn.Module", runner.trainer.model)
            t0 = time.perf_counter()
            for version in range(1, 6):
                await engine.update_weights(WeightUpdate(version=version, module=model))
            sync_s = (time.perf_counter() - t0) / 5
            params = sum(p.numel() for p in model.parameters())
        finally:
            await runner.close()
    cap = job.spec.rollout.max_response_length
    return {
        "benchmark": "simulator_cpu_calibration",
        "job": str(Path(args.job)),
        "engine": "embedded, one torch thread, pinned to core 0",
        "rounds": args.rounds,
        "repeats": args.repeats,
        "sync_rollout_seconds_per_round": statistics.fmean(rollout_s),
        "step_law": fit_step_law(points, round(statistics.fmean(prompt_lengths))),
        "step_points": points,
        "length_law": length_law(groups, cap),
        "prompt_tokens": statistics.fmean(prompt_lengths),
        "max_response_length": cap,
        "weight_sync_s": sync_s,
        "policy_parameters": params,
        "machine": describe(f"torch {torch.__version__} (1 thread), no GPU"),
        "load_average_1min_at_end": load_average(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", default=str(ROOT / "docs/examples/quickstart.yaml"))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3, help="runs per step-law point; the fastest is kept")
    parser.add_argument("--out", type=Path, default=ROOT / "docs/benchmarks/simulator_cpu_calibration.json")
    args = parser.parse_args()
    result = asyncio.run(measure(args))
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    console.print_json(json.dumps({k: result[k] for k in ("step_law", "length_law", "weight_sync_s",
                                                          "sync_rollout_seconds_per_round")}))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
