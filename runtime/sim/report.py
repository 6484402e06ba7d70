"""The simulator's outputs: a rich table, JSON and matplotlib plots."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from rljob.runtime.sim.records import SimStrategyResult
from rljob.runtime.sim.scenario import Scenario


def gain_over_sync(results: Sequence[SimStrategyResult], result: SimStrategyResult) -> float | None:
    """Rollout-throughput gain of `result` over the run's sync baseline, in percent."""
    base = next((r for r in results if r.kind == "sync"), None)
    if base is None or not base.rollout_throughput:
        return None
    return 100.0 * (result.rollout_throughput / base.rollout_throughput - 1.0)


def results_table(scenario: Scenario, results: Sequence[SimStrategyResult]) -> Table:
    """One row per strategy: both throughput metrics (every generated token, and trained tokens,
    per rollout second), ceiling share, bubble, off-policy share, step time, waste and the sync
    tail statistics (share of round time after 90 % of requests finished, longest ÷ median)."""
    table = Table(title=f"{scenario.name}: {scenario.model} on {scenario.gpus}× {scenario.gpu} "
                        f"(TP{scenario.tensor_parallel}), {scenario.dataset}")
    for col in ("strategy", "rollout tok/s", "per GPU", "vs sync", "trained/rollout s", "÷ ceiling", "bubble",
                "off-policy", "step s", "trained tok/s e2e", "wasted", "tail 10 %", "max/median"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for r in results:
        gain = gain_over_sync(results, r)
        table.add_row(
            r.name, f"{r.rollout_throughput:,.0f}", f"{r.rollout_throughput / r.rollout_gpus:,.0f}",
            "—" if gain is None else f"{gain:+.1f} %", f"{r.trained_rollout_throughput:,.0f}",
            f"{r.ceiling_share:.2f}", f"{r.bubble_share:.0%}",
            f"{r.off_policy_share:.0%}", f"{r.step_seconds:,.1f}", f"{r.trained_throughput:,.0f}",
            f"{r.wasted_share:.0%}", f"{r.tail_share:.0%}", f"{r.longest_over_median:.1f}",
        )
    return table


def results_json(scenario: Scenario, results: Sequence[SimStrategyResult]) -> dict:
    """Scenario, per-strategy summary and per-step records, as plain data."""
    return {
        "scenario": scenario.model_dump(mode="json"),
        "strategies": [
            {**r.summary(), "rollout_gain_pct": gain_over_sync(results, r),
             "steps": [vars(s) for s in r.records]}
            for r in results
        ],
    }


def plot_results(scenario: Scenario, results: Sequence[SimStrategyResult], path: Path) -> None:
    """Bar charts of rollout throughput (with the ceiling), step time and off-policy share."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.name for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].bar(names, [r.rollout_throughput for r in results], color="tab:blue")
    axes[0].axhline(results[0].ceiling_tokens_per_s if results else 0, color="k", ls="--", label="ceiling (all GPUs)")
    axes[0].set_ylabel("rollout tokens/s")
    axes[0].legend()
    axes[1].bar(names, [r.step_seconds for r in results], color="tab:orange")
    axes[1].set_ylabel("step time (s)")
    axes[2].bar(names, [r.off_policy_share for r in results], color="tab:red")
    axes[2].set_ylabel("off-policy token share")
    for ax in axes:
        ax.tick_params(axis="x", rotation=35)
    fig.suptitle(f"{scenario.name}: {scenario.gpus}× {scenario.gpu}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(scenario: Scenario, results: Sequence[SimStrategyResult], out_dir: Path) -> list[Path]:
    """Write `<name>.json` and `<name>.png` under out_dir; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{scenario.name}-{scenario.gpus}gpu"
    json_path, png_path = out_dir / f"{stem}.json", out_dir / f"{stem}.png"
    json_path.write_text(json.dumps(results_json(scenario, results), indent=2))
    plot_results(scenario, results, png_path)
    return [json_path, png_path]


def print_results(console: Console, scenario: Scenario, results: Sequence[SimStrategyResult]) -> None:
    console.print(results_table(scenario, results))
