"""How fast the rollout simulator runs: 10,240 trained rollout groups on 64 simulated engines.

Prints a table and writes docs/benchmarks/simulator_speed.json (with the machine it ran on).
Target (issues 7 and 16): well under a minute per strategy on 2 CPU cores, including the slime
baseline and APRIL with the DAPO filter on (which launch more groups than they train).
Run: .venv/bin/python benchmarks/simulator_speed.py
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from rljob.runtime.sim.runner import simulate_strategy
from rljob.runtime.sim.scenario import AprilSpec, Scenario, StrategySpec, SyncSpec
from machine_info import describe, load_average  # benchmarks/machine_info.py

GROUPS = 10_240
ENGINES = 64
OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "simulator_speed.json"


def machine() -> str:
    """CPU and cores (see machine_info); the speed runs share the machine with other jobs."""
    return describe("shared with other jobs")


def main() -> None:
    groups_per_engine = 8
    steps = math.ceil(GROUPS / (groups_per_engine * ENGINES))
    scenario = Scenario(
        name="speed", model="qwen3-4b", gpu="h100", gpus=ENGINES, tensor_parallel=1, mem_fraction=0.85,
        dataset="dapo-math-17k", groups_per_engine=groups_per_engine, steps=steps, warmup_steps=1,
    )
    filtered = scenario.model_copy(update={"dynamic_sampling": True})
    runs: list[tuple[Scenario, StrategySpec]] = [
        (scenario, SyncSpec(kind="sync")),
        (scenario, AprilSpec(kind="april", over_sampling=2.0)),
        (filtered, SyncSpec(kind="sync", name="slime-baseline+dapo", refill_factor=1.0)),
        (filtered, AprilSpec(kind="april", name="april+dapo", over_sampling=2.0, refill_factor=2.0)),
    ]
    rows = []
    for sc, spec in runs:
        started, cpu_started = time.perf_counter(), time.process_time()
        result = simulate_strategy(sc, spec)
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        trained_groups = steps * scenario.batch_size
        rows.append({
            "strategy": spec.name, "engines": ENGINES, "steps": steps, "trained_groups": trained_groups,
            "generated_tokens": sum(r.tokens_generated for r in result.records),
            "simulated_seconds": round(sum(r.step_s for r in result.records), 1),
            "wall_seconds": round(wall, 2),
            # The simulator is single-threaded: its CPU seconds are its wall time on an idle core.
            "cpu_seconds": round(cpu, 2),
            "dynamic_sampling": sc.dynamic_sampling,
            "load_average_1min": load_average(),
        })
    table = Table(title=f"simulator speed: ≥{GROUPS:,} groups on {ENGINES} engines")
    for col in rows[0]:
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(*(f"{v:,}" if isinstance(v, int) else str(v) for v in row.values()))
    Console(width=150).print(table)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"machine": machine(), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
