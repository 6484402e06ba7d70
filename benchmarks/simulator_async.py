"""The runtime's async strategy in the simulator: its predicted speed-up on published setups beside the
published figures, and its prediction for this runtime's CPU benchmark beside what that benchmark measured.

Published setups (runtime/sim/scenarios/verl-*.yaml, each file names its sources): verl's fully-async
recipe on 32 and 128 H20 and its one-step-off recipe on 16 H20, all Qwen2.5-Math-7B with DAPO on
dapo-math-17k. Each runs the runtime's `sync` colocated on every GPU and the runtime's `async` on the
published trainer/rollout split, with each arm's trainer time taken from the published per-step table
(the simulator predicts the rollout side and the overlap, not the trainer). The response-length law is
not published: its median is fitted on ONE published number, the 128-GPU colocated sync's `gen` time
(`fit` redoes it); the 32- and 16-GPU gen times are then predictions, printed beside the published ones.
AReaL's 2.77x is listed with its setup (AReaL's v0.3 blog, table 2: R1-Distill-Qwen-1.5B on 16 nodes, 1000
PPO steps, synchronous 41.0 h vs asynchronous 14.8 h), not simulated: that table gives no batch size,
response lengths or rollout:train split, and none is made up for it.

CPU validation: runtime/sim/scenarios/cpu-time-to-reward.yaml is benchmarks/time_to_reward.py's setup
(engine on one core, trainer on the other), calibrated by benchmarks/simulator_cpu_calibration.py. Its
predicted wall-time ratios at equal steps (april/sync, async/sync) are set beside
docs/benchmarks/time_to_reward.json's measured ones (read, not rerun), in three variants: as calibrated;
load-matched (the trainer's time rescaled so that train ÷ sync rollout is the benchmark's own, since the
benchmark ran at load ~12 and the calibration at ~5); and load-matched with the async arm's trainer as
slow as the benchmark measured it under async (the two sides contend for the machine).

    python benchmarks/simulator_async.py        # writes docs/benchmarks/simulator_async.json and .png
    python benchmarks/simulator_async.py fit    # re-fits the verl length law's median
    python benchmarks/simulator_async.py plot   # redraws the plot and tables from the JSON
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import fmean
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from machine_info import describe, load_average  # noqa: E402  (benchmarks/machine_info.py)
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from rljob.runtime.sim.records import SimStrategyResult  # noqa: E402
from rljob.runtime.sim.runner import simulate_strategy  # noqa: E402
from rljob.runtime.sim.scenario import AsyncSpec, Scenario, load_scenario  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "benchmarks"
console = Console(width=200)
VERL_FULLY_ASYNC = ("https://verl.readthedocs.io/en/latest/advance/fully_async.html "
                    "(verl-project/verl docs/advance/fully_async.md)")
VERL_ONE_STEP_OFF = ("https://verl.readthedocs.io/en/latest/advance/one_step_off.html "
                     "(verl-project/verl docs/advance/one_step_off.md)")
AREAL = ("inclusionAI/AReaL blog/AReaL_v0_3.md, table 2 'End-to-end comparison between asynchronous AReaL and "
         "synchronous AReaL' (the 2.77x of arXiv 2505.24298's abstract); 8 H800 per node: blog/AReaL_v0_1.md")


@dataclass(frozen=True)
class Published:
    """A published async-over-sync speed-up and the figures of its table the simulation is checked against."""

    setup: str
    system: str
    scenario: str | None  # runtime/sim/scenarios/<name>.yaml; None: not simulated (the source lacks its inputs)
    speedup: float  # end to end, as the source states it
    speedup_note: str
    source: str
    sync_step_s: float | None = None  # published mean seconds per step
    sync_gen_s: float | None = None
    async_step_s: float | None = None

    @property
    def step_ratio(self) -> float | None:
        """Published sync step ÷ async step: the like-for-like figure for a per-step prediction."""
        return self.sync_step_s / self.async_step_s if self.sync_step_s and self.async_step_s else None


PUBLISHED = (
    Published("Qwen2.5-Math-7B, 128 H20: colocated sync vs 64:64", "verl fully_async_policy",
              "verl-fully-async-h20-128", 2.35,
              "total time at 400 steps, 1d16h48m vs 17h22m (2.67x, 2.65x, 2.67x at 100, 200, 300 steps)",
              f"{VERL_FULLY_ASYNC}, table 'Asynchronous Training on 7B Model'", 356.30, 177.85, 150.63),
    Published("Qwen2.5-Math-7B, 32 H20: colocated sync vs 16:16", "verl fully_async_policy",
              "verl-fully-async-h20-32", 2.66,
              "total time at 400 steps, 3d17h5m vs 1d9h26m (1.72x, 1.70x, 2.31x at 100, 200, 300 steps)",
              f"{VERL_FULLY_ASYNC}, table 'Asynchronous Training on 7B Model'", 790.10, 357.41, 294.77),
    Published("Qwen2.5-Math-7B, 16 H20: colocated sync vs 4 gen : 12 train", "verl one_step_off_policy",
              "verl-one-step-off-h20-16", 1.24,
              "total time, FSDP2: 19h18m vs 15h34m (the doc says +23 %); Megatron 18h21m vs 13h06m = 1.40x",
              f"{VERL_ONE_STEP_OFF}, table 'Experimental Results'", 749.0, 321.0, 520.0),
    # 41.0 h and 14.8 h over 1000 steps: 147.6 and 53.28 s per step (the published time per step).
    Published("R1-Distill-Qwen-1.5B, 16 nodes x 8 H800: synchronous vs asynchronous AReaL", "AReaL",
              None, 2.77, "1000 PPO steps, 41.0 h vs 14.8 h (AIME24 42.0 vs 42.2); 7B on 24 nodes 57.7 h vs 25.4 h = "
              "2.27x. Not simulated: the table gives no batch size, response lengths or rollout:train split",
              AREAL, sync_step_s=147.6, async_step_s=53.28),
)
FIT_SCENARIO, FIT_TARGET_GEN_S = "verl-fully-async-h20-128", 177.85


def mean_over(results: list[SimStrategyResult], attr: str, measured_only: bool = True) -> float:
    """Mean per step of a record attribute over every run in `results`."""
    recs = [r for res in results for r in (res.measured if measured_only else res.records)]
    return fmean(getattr(r, attr) for r in recs)


def run_seeds(scenario: Scenario, seeds: list[int]) -> dict[str, list[SimStrategyResult]]:
    """Every strategy of `scenario` for every seed, by strategy name."""
    out: dict[str, list[SimStrategyResult]] = {s.name: [] for s in scenario.strategies}
    for seed in seeds:
        sc = scenario.model_copy(update={"seed": seed})
        for spec in sc.strategies:
            out[spec.name].append(simulate_strategy(sc, spec))
    return out


def published_setup(pub: Published, seeds: list[int], steps: int) -> dict[str, Any]:
    """Simulate one published setup (sync and async); the predicted per-step speed-up beside the published."""
    assert pub.scenario is not None
    scenario = load_scenario(pub.scenario).model_copy(update={"steps": steps})
    started = time.process_time()
    runs = run_seeds(scenario, seeds)
    sync, asynch = runs["sync"], runs["async"]
    async_spec = next(s for s in scenario.strategies if isinstance(s, AsyncSpec))
    sync_step, async_step = mean_over(sync, "step_s"), mean_over(asynch, "step_s")
    per_seed = [s.step_seconds / a.step_seconds for s, a in zip(sync, asynch, strict=True)]
    return {
        **asdict(pub), "published_step_ratio": pub.step_ratio,
        "parameters": {"model": scenario.model, "gpu": scenario.gpu, "gpus": scenario.gpus,
                       "tensor_parallel": scenario.tensor_parallel, "trainer_gpus": asynch[0].gpus - asynch[0].rollout_gpus,
                       "rollout_gpus_async": asynch[0].rollout_gpus, "prompts_per_step": scenario.batch_size,
                       "samples_per_prompt": scenario.samples_per_prompt,
                       "max_response_length": scenario.max_response_length, "dataset_law": scenario.dataset,
                       "max_staleness": scenario.max_staleness, "async_over_sampling": async_spec.over_sampling,
                       "sync_train_gpu_seconds": scenario.train_gpu_seconds_per_step,
                       "async_train_gpu_seconds": async_spec.train_gpu_seconds_per_step},
        "predicted_speedup": sync_step / async_step,
        "predicted_speedup_per_seed": per_seed,
        "predicted_sync_step_s": sync_step, "predicted_sync_gen_s": mean_over(sync, "rollout_s"),
        "predicted_sync_train_s": mean_over(sync, "train_s"),
        "predicted_async_step_s": async_step, "predicted_async_train_s": mean_over(asynch, "train_s"),
        "predicted_async_off_policy_share": fmean(a.off_policy_share for a in asynch),
        "predicted_async_max_staleness": max(a.summary()["max_staleness"] for a in asynch),  # type: ignore[type-var]
        "predicted_async_trainer_idle_share": 1 - mean_over(asynch, "train_s") / async_step,
        "seeds": seeds, "steps": steps, "warmup_steps": scenario.warmup_steps,
        "simulator_cpu_seconds": time.process_time() - started,
    }


def idle_shares(results: list[SimStrategyResult]) -> tuple[float, float]:
    """(engine idle, trainer idle) shares of wall time over whole runs, as time_to_reward.py measures them."""
    wall = sum(r.step_s for res in results for r in res.records)
    busy = sum(res.busy_seconds for res in results)
    engines = results[0].engines
    train = sum(r.train_s for res in results for r in res.records)
    return 1 - busy / (engines * wall), 1 - train / wall


def cpu_validation(seeds: list[int]) -> dict[str, Any]:
    """The CPU setup's predicted wall ratios (same steps) beside time_to_reward.json's measured ones."""
    measured = json.loads((DOCS / "time_to_reward.json").read_text())
    compared = measured["seeds_compared"]
    per_seed = {s: [r["wall_s"] for r in measured["runs"] if r["strategy"] == s and r["seed"] in compared]
                for s in ("sync", "april", "async")}
    steps = measured["steps"]
    sync_wall = measured["mean_wall_s"]["sync"]
    engine_busy_sync = (1 - measured["engine_idle_share"]["sync"]) * sync_wall / steps  # seconds per step
    train_sync = measured["train_step_seconds"]["sync"]
    contention = measured["train_step_seconds"]["async"] / train_sync
    base = load_scenario("cpu-time-to-reward").model_copy(update={"steps": steps})

    def predict(scenario: Scenario) -> tuple[dict[str, Any], float]:
        runs = run_seeds(scenario, seeds)
        walls = {name: fmean(sum(r.step_s for r in res.records) for res in rs) for name, rs in runs.items()}
        out: dict[str, Any] = {"train_seconds": scenario.train_gpu_seconds_per_step}
        for name, rs in runs.items():
            engine_idle, trainer_idle = idle_shares(rs)
            out[name] = {"wall_over_sync": walls[name] / walls["sync"], "wall_s": walls[name],
                         "engine_idle_share": engine_idle, "trainer_idle_share": trainer_idle,
                         "off_policy_share": fmean(r.off_policy_share for r in rs),
                         "max_staleness": max(r.summary()["max_staleness"] for r in rs)}  # type: ignore[type-var]
        return out, mean_over(runs["sync"], "rollout_s", measured_only=False)

    as_calibrated, sync_rollout = predict(base)
    matched_train = train_sync / engine_busy_sync * sync_rollout
    matched = base.model_copy(update={"train_gpu_seconds_per_step": matched_train})
    load_matched, _ = predict(matched)
    slowed = matched.model_copy(update={"strategies": [
        s.model_copy(update={"train_gpu_seconds_per_step": matched_train * contention}) if isinstance(s, AsyncSpec)
        else s for s in matched.strategies]})
    with_contention, _ = predict(slowed)
    return {
        "scenario": "runtime/sim/scenarios/cpu-time-to-reward.yaml",
        "calibration": "docs/benchmarks/simulator_cpu_calibration.json (runtime/sim/calibration.yaml xeon-core, "
                       "tiny-arith, arith-chain)",
        "measured_source": "docs/benchmarks/time_to_reward.json (read, not rerun)",
        "measured": {
            "seeds": compared, "steps": steps, "load_average_1min_at_end": measured["load_average_1min_at_end"],
            **{s: {"wall_over_sync": measured["wall_over_sync_same_steps"][s],
                   "wall_over_sync_per_seed": [w / b for w, b in zip(per_seed[s], per_seed["sync"], strict=True)],
                   "engine_idle_share": measured["engine_idle_share"][s],
                   "trainer_idle_share": measured["trainer_idle_share"][s],
                   "train_step_seconds": measured["train_step_seconds"][s]} for s in ("sync", "april", "async")},
        },
        "sync_engine_busy_seconds_per_step_measured": engine_busy_sync,
        "sync_rollout_seconds_per_step_simulated": sync_rollout,
        "load_matched_train_seconds": matched_train,
        "async_trainer_contention_measured": contention,
        "predicted": {"as_calibrated": as_calibrated, "load_matched": load_matched,
                      "load_matched_async_trainer_contention": with_contention},
        "seeds": seeds,
    }


def fit_median(lo: float = 1000.0, hi: float = 8000.0, iterations: int = 9) -> float:
    """Bisect the verl length law's median so that the simulated 128-GPU colocated sync gen time is the
    published 177.85 s (gen time grows with the median)."""
    base = load_scenario(FIT_SCENARIO)
    sync = next(s for s in base.strategies if s.kind == "sync")
    sc = base.model_copy(update={"steps": 5, "warmup_steps": 1})
    for _ in range(iterations):
        mid = (lo * hi) ** 0.5
        gen = fmean(r.rollout_s for r in simulate_strategy(sc.model_copy(update={"median_tokens": mid}), sync).measured)
        console.log(f"median {mid:,.0f} tokens: sync gen {gen:.1f} s (published {FIT_TARGET_GEN_S})")
        lo, hi = (mid, hi) if gen < FIT_TARGET_GEN_S else (lo, mid)
    return (lo * hi) ** 0.5


def print_tables(result: dict[str, Any]) -> None:
    table = Table(title="Async over sync: the simulator's prediction (rljob's async) beside the published speed-up")
    for col in ("system", "setup", "published", "published per step", "predicted", "seeds", "sync gen s pub / sim",
                "sync step s pub / sim", "async step s pub / sim", "off-policy"):
        table.add_column(col, justify="left" if col in ("system", "setup") else "right")
    for row in result["published_setups"]:
        if row.get("predicted_speedup") is None:
            per_step = f"{row['published_step_ratio']:.2f}x" if row.get("published_step_ratio") else "—"
            table.add_row(row["system"], row["setup"], f"{row['speedup']:.2f}x", per_step, "not simulated", "", "", "", "", "")
            continue
        table.add_row(
            row["system"], row["setup"], f"{row['speedup']:.2f}x", f"{row['published_step_ratio']:.2f}x",
            f"[bold]{row['predicted_speedup']:.2f}x[/]",
            ", ".join(f"{x:.2f}" for x in row["predicted_speedup_per_seed"]),
            f"{row['sync_gen_s']:.0f} / {row['predicted_sync_gen_s']:.0f}",
            f"{row['sync_step_s']:.0f} / {row['predicted_sync_step_s']:.0f}",
            f"{row['async_step_s']:.0f} / {row['predicted_async_step_s']:.0f}",
            f"{row['predicted_async_off_policy_share']:.0%}",
        )
    console.print(table)
    cpu = result["cpu_validation"]
    t = Table(title="CPU setup of time_to_reward.py: wall time at equal steps over sync's (measured vs predicted)")
    for col in ("", "april / sync", "async / sync", "engine idle sync / april / async",
                "trainer idle sync / april / async"):
        t.add_column(col, justify="left" if not col else "right")
    m = cpu["measured"]

    def idle(d: dict[str, Any], key: str) -> str:
        return " / ".join(f"{d[s][key]:.2f}" for s in ("sync", "april", "async"))

    t.add_row("measured (time_to_reward.json, seeds " + ", ".join(map(str, m["seeds"])) + ")",
              f"{m['april']['wall_over_sync']:.2f} ({', '.join(f'{x:.2f}' for x in m['april']['wall_over_sync_per_seed'])})",
              f"{m['async']['wall_over_sync']:.2f} ({', '.join(f'{x:.2f}' for x in m['async']['wall_over_sync_per_seed'])})",
              idle(m, "engine_idle_share"), idle(m, "trainer_idle_share"))
    for name, p in cpu["predicted"].items():
        train = f"train {p['train_seconds']:.2f} s"
        if name.endswith("contention"):
            train += f", async's {p['train_seconds'] * cpu['async_trainer_contention_measured']:.2f} s"
        t.add_row(f"predicted, {name.replace('_', ' ')} ({train})",
                  f"{p['april']['wall_over_sync']:.2f}", f"{p['async']['wall_over_sync']:.2f}",
                  idle(p, "engine_idle_share"), idle(p, "trainer_idle_share"))
    console.print(t)


def plot(path: Path, result: dict[str, Any]) -> None:
    fig, (ax_pub, ax_cpu) = plt.subplots(1, 2, figsize=(13, 4.6))
    rows = result["published_setups"]
    labels = [f"{r['system'].replace('_policy', '')}\n{r['parameters']['gpus']} {r['parameters']['gpu'].upper()}"
              if r["scenario"] else f"{r['system']}\nnot simulated" for r in rows]
    x = range(len(rows))
    ax_pub.bar([i - 0.2 for i in x], [r["speedup"] for r in rows], 0.4, label="published (end to end)", color="#999999")
    ax_pub.bar([i + 0.2 for i in x], [r.get("predicted_speedup") or 0 for r in rows], 0.4,
               label="simulated rljob async (per step)", color="#c0504d")
    for i, r in enumerate(rows):
        if r.get("published_step_ratio"):
            ax_pub.plot([i - 0.2], [r["published_step_ratio"]], "k_", markersize=18)
    ax_pub.plot([], [], "k_", markersize=12, label="published per-step ratio")
    ax_pub.axhline(1.0, color="k", lw=0.6)
    ax_pub.set_xticks(list(x), labels, fontsize=8)
    ax_pub.set_ylabel("async speed-up over sync")
    ax_pub.legend(fontsize=8)
    ax_pub.set_title("published setups")
    cpu = result["cpu_validation"]
    groups = ["april", "async"]
    series = [("measured", {g: cpu["measured"][g]["wall_over_sync"] for g in groups}, "#333333")]
    colors = ("#f4b183", "#e06666", "#990000")
    for (name, p), color in zip(cpu["predicted"].items(), colors, strict=True):
        series.append((f"predicted, {name.replace('_', ' ')}", {g: p[g]["wall_over_sync"] for g in groups}, color))
    width = 0.8 / len(series)
    for k, (name, vals, color) in enumerate(series):
        ax_cpu.bar([i + (k - (len(series) - 1) / 2) * width for i in range(len(groups))], [vals[g] for g in groups],
                   width, label=name, color=color)
    for i, g in enumerate(groups):
        pts = cpu["measured"][g]["wall_over_sync_per_seed"]
        ax_cpu.plot([i - 0.3] * len(pts), pts, "ko", markersize=4)
    ax_cpu.plot([], [], "ko", markersize=4, label="measured, per seed")
    ax_cpu.axhline(1.0, color="k", lw=0.6)
    ax_cpu.set_xticks(range(len(groups)), [f"{g} / sync" for g in groups])
    ax_cpu.set_ylabel("wall time at equal steps, over sync's")
    ax_cpu.set_title("CPU setup of time_to_reward.py (lower is faster)")
    ax_cpu.set_ylim(0, 1.45)
    ax_cpu.legend(fontsize=7, loc="upper center", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", default="report", choices=("report", "fit", "plot"),
                        help="report: simulate, write, print; fit: the verl length median; plot: redraw from the JSON")
    parser.add_argument("--seeds", default="0,1", help="simulation seeds for the published setups")
    parser.add_argument("--cpu-seeds", default="0,1,2", help="simulation seeds for the CPU setup")
    parser.add_argument("--steps", type=int, default=8, help="steps per published-setup run (2 warm-up left out)")
    parser.add_argument("--out", type=Path, default=DOCS / "simulator_async.json")
    args = parser.parse_args()
    if args.command == "fit":
        console.print(f"fitted median: {fit_median():,.0f} tokens (put it in calibration.yaml)")
        return
    if args.command == "plot":
        result = json.loads(args.out.read_text())
        print_tables(result)
        plot(args.out.with_suffix(".png"), result)
        return
    seeds = [int(s) for s in args.seeds.split(",")]
    started = time.perf_counter()
    rows = []
    for pub in PUBLISHED:
        if pub.scenario is None:
            rows.append({**asdict(pub), "published_step_ratio": pub.step_ratio, "predicted_speedup": None})
            continue
        console.log(f"simulating {pub.scenario}")
        rows.append(published_setup(pub, seeds, args.steps))
    console.log("simulating the CPU setup")
    result = {
        "benchmark": "simulator_async",
        "what": "rljob's async strategy (runtime AsyncStrategy, simulated) against colocated sync on published "
                "setups, and against this runtime's measured CPU time_to_reward",
        "published_setups": rows,
        "cpu_validation": cpu_validation([int(s) for s in args.cpu_seeds.split(",")]),
        "machine": describe("simulation only (virtual time): the figures do not depend on this machine's speed"),
        "wall_seconds": time.perf_counter() - started,
        "load_average_1min_at_end": load_average(),
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print_tables(result)
    plot(args.out.with_suffix(".png"), result)
    console.print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
