"""Writes the simulator's validation and strategy-comparison data under docs/benchmarks/.

    python -m rljob.runtime.sim.validation validate   # APRIL Qwen3-4B gains vs published
    python -m rljob.runtime.sim.validation compare SCENARIO --gpus 8,64,512 [--steps 8]

`validate` averages over seeds and writes simulator_validation.json (and a σ_b/σ sensitivity
sweep); `compare` appends one scenario's strategy table per GPU count to simulator_comparison.json
and redraws simulator_comparison.png.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path
from statistics import mean

from rljob.runtime.sim.report import gain_over_sync
from rljob.runtime.sim.runner import simulate, simulate_strategy
from rljob.runtime.sim.scenario import AprilSpec, Scenario, SyncSpec, load_calibration, load_scenario

log = logging.getLogger(__name__)
DOCS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"
PUBLISHED = {"dapo-math-17k": 17.0, "deepscaler": 21.0, "deepmath-103k": 35.0}  # APRIL README, Qwen3-4B


def _sync_vs_april(scenario: Scenario, seeds: list[int]) -> dict[str, float]:
    rows = []
    for seed in seeds:
        sc = scenario.model_copy(update={"seed": seed})
        sync = simulate_strategy(sc, SyncSpec(kind="sync"))
        april = simulate_strategy(sc, AprilSpec(kind="april", over_sampling=2.0))
        rows.append((sync, april))
    return {
        "predicted_gain_pct": round(mean(100 * (a.rollout_throughput / s.rollout_throughput - 1) for s, a in rows), 1),
        "sync_tokens_per_s": round(mean(s.rollout_throughput for s, _ in rows), 1),
        "april_tokens_per_s": round(mean(a.rollout_throughput for _, a in rows), 1),
        "sync_ceiling_share": round(mean(s.ceiling_share for s, _ in rows), 3),
        "april_ceiling_share": round(mean(a.ceiling_share for _, a in rows), 3),
        "april_off_policy_share": round(mean(a.off_policy_share for _, a in rows), 3),
        "april_fork_off_policy_ratio": round(mean(a.summary()["fork_off_policy_ratio"] for _, a in rows), 3),  # type: ignore[misc]
    }


def validate(seeds: list[int]) -> None:
    """Predicted vs published APRIL rollout-throughput gains on the three Qwen3-4B datasets."""
    out = []
    for dataset, published in PUBLISHED.items():
        scenario = load_scenario(f"qwen3-4b-h100-{dataset}.yaml")
        row = {"dataset": dataset, **_sync_vs_april(scenario, seeds), "published_gain_pct": published}
        row = {"dataset": dataset, "predicted_gain_pct": row.pop("predicted_gain_pct"),
               "published_gain_pct": published, **{k: v for k, v in row.items() if k != "dataset"}}
        log.warning("%s: predicted %+.1f %%, published %+.1f %%", dataset, row["predicted_gain_pct"], published)
        out.append(row)
    (DOCS / "simulator_validation.json").write_text(json.dumps(out, indent=2))
    # Sensitivity to the unmeasured split of σ between prompts and samples (PM §2.3), DAPO law.
    base = load_scenario("qwen3-4b-h100-dapo-math-17k.yaml")
    law = load_calibration().datasets["dapo-math-17k"]
    sigma = math.hypot(law.sigma_between, law.sigma_within)
    sweep = []
    for share in (0.3, 0.5, 0.7):
        between = sigma * math.sqrt(share)
        within = sigma * math.sqrt(1 - share)
        load_calibration().datasets["dapo-math-17k"] = law.model_copy(
            update={"sigma_between": between, "sigma_within": within})
        sweep.append({"sigma_between_share_of_variance": share, **_sync_vs_april(base, seeds)})
        log.warning("σ_b² share %.1f: %+.1f %%", share, sweep[-1]["predicted_gain_pct"])
    load_calibration().datasets["dapo-math-17k"] = law
    (DOCS / "simulator_sensitivity.json").write_text(json.dumps(sweep, indent=2))


def compare(scenario_name: str, gpu_counts: list[int], steps: int | None) -> None:
    """Every strategy of a scenario at each GPU count; merged into simulator_comparison.json."""
    path = DOCS / "simulator_comparison.json"
    data = json.loads(path.read_text()) if path.exists() else []
    base = load_scenario(scenario_name)
    for gpus in gpu_counts:
        update = {"gpus": gpus}
        if steps:
            update |= {"steps": steps, "warmup_steps": min(base.warmup_steps, steps - 2)}
        scenario = Scenario.model_validate({**base.model_dump(), **update, "strategies": base.strategies})
        results = simulate(scenario)
        data = [d for d in data if not (d["scenario"] == scenario.name and d["gpus"] == gpus)]
        for r in results:
            data.append({"scenario": scenario.name, "gpus": gpus, **r.summary(),
                         "rollout_gain_pct": round(gain_over_sync(results, r) or 0.0, 1)})
        log.warning("%s at %d GPUs done", scenario.name, gpus)
        path.write_text(json.dumps(data, indent=2))
    plot_comparison(data, DOCS / "simulator_comparison.png")


def plot_comparison(data: list[dict], path: Path) -> None:
    """Rollout tokens/s per GPU ÷ the ceiling, per strategy, one panel per scenario."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = sorted({d["scenario"] for d in data})
    fig, axes = plt.subplots(1, len(scenarios), figsize=(6 * len(scenarios), 4.5), squeeze=False)
    for ax, name in zip(axes[0], scenarios):
        rows = [d for d in data if d["scenario"] == name]
        gpus = sorted({d["gpus"] for d in rows})
        strategies = list(dict.fromkeys(d["strategy"] for d in rows))
        width = 0.8 / len(strategies)
        for i, strat in enumerate(strategies):
            ys = [next((d["ceiling_share"] for d in rows if d["gpus"] == g and d["strategy"] == strat), 0) for g in gpus]
            ax.bar([j + i * width for j in range(len(gpus))], ys, width, label=strat)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(gpus))], [f"{g} GPUs" for g in gpus])
        ax.axhline(1.0, color="k", ls="--", lw=1)
        ax.set_ylim(0, 1.1)
        ax.set_ylabel("rollout throughput ÷ bubble-free ceiling")
        ax.set_title(name, fontsize=9)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("validate")
    v.add_argument("--seeds", default="0,1,2")
    c = sub.add_parser("compare")
    c.add_argument("scenario")
    c.add_argument("--gpus", default="8,64,512")
    c.add_argument("--steps", type=int)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    DOCS.mkdir(parents=True, exist_ok=True)
    if args.cmd == "validate":
        validate([int(s) for s in args.seeds.split(",")])
    else:
        compare(args.scenario, [int(g) for g in args.gpus.split(",")], args.steps)


if __name__ == "__main__":
    main()
