"""How fast the rollout simulator runs: 10,000 rollout groups on 64 simulated engines.

Prints a table and writes docs/benchmarks/simulator_speed.json. Target (issue 7): under a minute
on 2 CPU cores per strategy. Run: .venv/bin/python benchmarks/simulator_speed.py
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from rljob.runtime.sim.runner import simulate_strategy
from rljob.runtime.sim.scenario import AprilSpec, Scenario, SyncSpec

GROUPS = 10_000
ENGINES = 64
OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "simulator_speed.json"


def main() -> None:
    groups_per_engine = 8
    steps = math.ceil(GROUPS / (groups_per_engine * ENGINES))
    scenario = Scenario(
        name="speed", model="qwen3-4b", gpu="h100", gpus=ENGINES, tensor_parallel=1, mem_fraction=0.85,
        dataset="dapo-math-17k", groups_per_engine=groups_per_engine, steps=steps, warmup_steps=1,
    )
    rows = []
    for spec in (SyncSpec(kind="sync"), AprilSpec(kind="april", over_sampling=2.0)):
        started = time.perf_counter()
        result = simulate_strategy(scenario, spec)
        wall = time.perf_counter() - started
        trained_groups = steps * scenario.batch_size
        rows.append({
            "strategy": spec.name, "engines": ENGINES, "steps": steps, "trained_groups": trained_groups,
            "generated_tokens": sum(r.tokens_generated for r in result.records),
            "simulated_seconds": round(sum(r.step_s for r in result.records), 1),
            "wall_seconds": round(wall, 2),
        })
    table = Table(title=f"simulator speed: ≥{GROUPS:,} groups on {ENGINES} engines")
    for col in rows[0]:
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(*(f"{v:,}" if isinstance(v, int) else str(v) for v in row.values()))
    Console(width=150).print(table)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
