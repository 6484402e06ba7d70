"""Time to reward: sync, APRIL and async-APRIL trained on the quickstart task, side by side.

Each strategy trains the same warmed-up policy on the same data seeds (the quickstart job, only
`rollout.strategy`, the step count and the evaluation cadence changed), one run after the other in
this one process, seeds interleaved so machine noise hits every strategy alike. The held-out reward
is measured every `--eval-every` steps on `--eval-prompts` held-out problems; wall time is the time
of the training steps themselves (rollout, train, weight sync), the held-out evaluations excluded.

Disaggregation on a CPU: a cluster gives the inference pods and the trainer their own GPUs. Here each
side gets a core of its own and one torch thread, so the strategies cannot borrow the other side's core
and async-APRIL's overlap is what a cluster would see. `--sides processes` (the default) runs them as a
cluster does, one process per side: the engine is rljob's SGLang-protocol CPU server (the cpu pools'
server) pinned to core 0 (`taskset`), the trainer this process pinned to core 1, weights sent over gloo
(the `distributed` transport), so neither side holds the other's interpreter lock. `--sides threads`
keeps both in this process: the embedded engine's steps (and the event loop) on core 0 and the trainer's
steps on core 1, per thread. The output states which.

Reports per strategy: held-out reward against wall time and against step for each seed; the wall
time to reach sync's final held-out reward (seed-averaged curves, linear interpolation between
evaluations); the engine's and the trainer's idle shares. Writes docs/benchmarks/time_to_reward.json
and .png. Run: `python benchmarks/time_to_reward.py` (the JSON is rewritten after every run, marked
`complete: false` until the last). `--keep-cache`: every strategy's weight sync keeps the engines' KV
cache (docs/weight_sync.md#keeping-the-cache).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from machine_info import describe, load_average  # noqa: E402  (benchmarks/machine_info.py)
from rich.console import Console  # noqa: E402
from rljob.api import load_rljob  # noqa: E402
from rljob.runtime.engines.embedded import EmbeddedEngine  # noqa: E402
from rljob.runtime.runner import JobRunner, RunOptions  # noqa: E402
from rljob.runtime.tasks.policy import policy_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = ("sync", "april", "async")
console = Console()


def pinned(fn: Callable[..., Any], core: int | None, busy: list[float]) -> Callable[..., Any]:
    """`fn`, run on `core` only (the calling thread's affinity; Linux sets it per thread), its wall
    time added to `busy[0]`."""

    def run(*args: Any, **kwargs: Any) -> Any:
        if core is not None:
            os.sched_setaffinity(0, {core})
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            busy[0] += time.perf_counter() - t0

    return run


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of process `pid` so far (/proc/PID/stat), its threads included."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def engine_process(model: Path, core: int | None, max_batch_size: int, seed: int, log: Path) -> Iterator[tuple[str, int]]:
    """rljob's SGLang-protocol CPU server over `model`, on `core` with one torch thread: (url, pid)."""
    port = free_port()
    pin = ["taskset", "-c", str(core)] if core is not None else []
    cmd = [*pin, sys.executable, "-m", "rljob.runtime.engines.server", "--model-path", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--max-batch-size", str(max_batch_size),
           "--torch-threads", "1", "--seed", str(seed), "--log-level", "warning"]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:  # /health_generate answers once the model is loaded and a generation went through
            if proc.poll() is not None:
                raise RuntimeError(f"the engine process exited ({proc.returncode}): {log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(url + "/health_generate", timeout=30) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the engine process did not get ready in 300 s: {log.read_text()[-2000:]}") from None
                time.sleep(0.5)
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def train_one(args: argparse.Namespace, strategy: str, seed: int, cores: tuple[int, int] | None,
                    adjust: Callable[[JobRunner], None] | None = None) -> dict:
    """One training run; returns its curves and idle shares. `adjust` changes the runner once it is set up
    (another benchmark's variant: benchmarks/async_ahead.py)."""
    job = load_rljob(args.job)
    job.spec.rollout.strategy = strategy
    assert job.spec.data.synthetic is not None
    job.spec.data.synthetic.seed = seed
    job.spec.evaluation.every_steps = args.eval_every
    job.spec.evaluation.prompts = args.eval_prompts
    keep_cache = args.keep_cache
    job.spec.rollout.weight_transport.flush_cache = not keep_cache
    engine_core, trainer_core = cores if cores else (None, None)
    with tempfile.TemporaryDirectory() as tmp:
        job.spec.checkpoint.dir = str(Path(tmp) / "ckpt")
        job.spec.checkpoint.every_steps = args.steps + 1  # only the final one: checkpoints are not the subject
        if args.sides == "processes":
            model, _ = policy_dir(job.spec.model)
            batch = job.spec.rollout.embedded.max_batch_size
            with engine_process(model, engine_core, batch, seed, Path(tmp) / "engine.log") as (url, pid):
                job.spec = job.spec.model_validate({
                    **job.spec.model_dump(by_alias=True, exclude_none=True),
                    "rollout": {**job.spec.rollout.model_dump(by_alias=True, exclude_none=True, exclude={"embedded"}),
                                "engine": "sglang", "sglang": {"workerUrls": [url]},
                                "weightTransport": {"mode": "distributed", "backend": "gloo",
                                                    "masterAddress": "127.0.0.1", "masterPort": 0,
                                                    "flushCache": not keep_cache}},
                })
                if trainer_core is not None:
                    os.sched_setaffinity(0, {trainer_core})  # this whole process is the trainer's side
                try:
                    return await run_measured(args, job, strategy, seed, Path(tmp), lambda: cpu_seconds(pid), None,
                                              adjust)
                finally:
                    if trainer_core is not None:
                        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
        return await run_measured(args, job, strategy, seed, Path(tmp), None, cores, adjust)


async def run_measured(args: argparse.Namespace, job: Any, strategy: str, seed: int, tmp: Path,
                       engine_cpu: Callable[[], float] | None, cores: tuple[int, int] | None,
                       adjust: Callable[[JobRunner], None] | None = None) -> dict:
    """Train `job` and measure it. `engine_cpu`: the engine process's CPU seconds (one process per side);
    None: embedded engines in this process, their steps pinned per thread to `cores`."""
    engine_core, trainer_core = cores if cores else (None, None)
    runner = JobRunner(job, RunOptions(output_dir=tmp, steps=args.steps, resume=False))
    if engine_core is not None:
        os.sched_setaffinity(0, {engine_core})  # the event loop drives the engines: their side
    try:
        await runner.setup()
        if adjust is not None:
            adjust(runner)
        engine_busy, trainer_busy = [0.0], [0.0]
        if engine_cpu is None:
            for engine in runner.engines:
                assert isinstance(engine, EmbeddedEngine), "--sides threads pins embedded engines"
                engine._step = pinned(engine._step, engine_core, engine_busy)  # type: ignore[method-assign]
        runner.trainer.train_step = pinned(runner.trainer.train_step, trainer_core, trainer_busy)  # type: ignore[method-assign]
        engine_cpu_at_start = engine_cpu() if engine_cpu is not None else 0.0
        eval_engine_cpu = [0.0]
        wall = [0.0]
        points: list[dict[str, float]] = []
        steps: list[dict[str, float]] = []
        evaluate = runner.evaluate

        async def timed_eval():  # type: ignore[no-untyped-def]
            busy_before = engine_busy[0]
            cpu_before = engine_cpu() if engine_cpu is not None else 0.0
            result = await evaluate()
            engine_busy[0] = busy_before  # evaluation is measurement, not training work
            if engine_cpu is not None:
                eval_engine_cpu[0] += engine_cpu() - cpu_before
            if result is not None:  # evaluated before the step's listeners ran: its wall time is set after the run
                points.append({"step": result.step, "reward": result.reward_mean})
                console.log(f"{strategy:5s} seed {seed} step {result.step:3d}: held-out {result.reward_mean:.3f}")
            return result

        runner.evaluate = timed_eval  # type: ignore[method-assign]

        def on_step(rec: Any) -> None:
            wall[0] += rec.step_seconds
            steps.append({"step": rec.step, "wall_s": wall[0], "reward": rec.batch.reward_mean,
                          "off_policy_token_ratio": rec.batch.off_policy_token_ratio,
                          "tokens_generated": rec.round.tokens_generated, "trained_tokens": rec.round.trained_tokens,
                          "regenerated_tokens": rec.round.regenerated_tokens})

        runner.step_listeners.append(on_step)
        await runner.run()
        if engine_cpu is not None:  # the server's CPU seconds outside evaluations: its busy time
            engine_busy[0] = engine_cpu() - engine_cpu_at_start - eval_engine_cpu[0]
    finally:
        if engine_core is not None:
            os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    walls = {s["step"]: s["wall_s"] for s in steps} | {0: 0.0}
    for p in points:
        p["wall_s"] = walls[int(p["step"])]
    return {
        "strategy": strategy, "seed": seed, "steps": args.steps, "wall_s": wall[0], "eval": points, "train": steps,
        "engine_idle_share": max(0.0, 1 - engine_busy[0] / wall[0]) if wall[0] else None,
        "trainer_idle_share": max(0.0, 1 - trainer_busy[0] / wall[0]) if wall[0] else None,
    }


def mean_curve(runs: list[dict]) -> list[dict[str, float]]:
    """Held-out reward and wall time averaged over seeds, per evaluation step (steps every seed has)."""
    common = set.intersection(*({p["step"] for p in r["eval"]} for r in runs)) if runs else set()
    curve = []
    for step in sorted(common):
        pts = [next(p for p in r["eval"] if p["step"] == step) for r in runs]
        curve.append({"step": step, "wall_s": sum(p["wall_s"] for p in pts) / len(pts),
                      "reward": sum(p["reward"] for p in pts) / len(pts)})
    return curve


def time_to(curve: list[dict[str, float]], target: float) -> float | None:
    """Wall time at which `curve` first reaches `target` (linear between evaluations), None if never."""
    for prev, cur in zip(curve, curve[1:], strict=False):
        if cur["reward"] >= target:
            if prev["reward"] >= target:
                return prev["wall_s"]
            frac = (target - prev["reward"]) / (cur["reward"] - prev["reward"])
            return prev["wall_s"] + frac * (cur["wall_s"] - prev["wall_s"])
    return curve[0]["wall_s"] if curve and curve[0]["reward"] >= target else None


def reward_at_equal_steps(by: dict[str, list[dict]]) -> dict[str, Any]:
    """Each strategy's held-out reward against sync's at the same steps, per evaluation step every run has:
    the gap of the seed means and two standard errors of that gap (Welch, from the per-seed rewards: the
    seed-to-seed spread). `within_spread` counts the steps whose gap lies inside it."""
    sync = by.get("sync", [])
    out: dict[str, Any] = {}
    for name, runs in by.items():
        if name == "sync" or len(runs) < 2 or len(sync) < 2:
            continue
        steps = sorted(set.intersection(*({p["step"] for p in r["eval"]} for r in runs + sync)))
        rows = []
        for step in steps:
            mine = [next(p["reward"] for p in r["eval"] if p["step"] == step) for r in runs]
            theirs = [next(p["reward"] for p in r["eval"] if p["step"] == step) for r in sync]
            gap = statistics.fmean(mine) - statistics.fmean(theirs)
            two_se = 2 * math.sqrt(statistics.variance(mine) / len(mine) + statistics.variance(theirs) / len(theirs))
            rows.append({"step": step, "gap": gap, "two_standard_errors": two_se, "within": abs(gap) <= two_se})
        out[name] = {"within_spread": sum(r["within"] for r in rows), "steps": len(rows),
                     "largest_gap": max((r["gap"] for r in rows), key=abs, default=None), "per_step": rows}
    return out


def overlap_bound(sync_runs: list[dict]) -> float | None:
    """The busier side's share of sync's wall time (seed mean): a perfect overlap of sync's engine and trainer
    work still takes that long, so it bounds what async-APRIL can gain by overlap alone."""
    if not sync_runs:
        return None
    return sum(max(1 - r["engine_idle_share"], 1 - r["trainer_idle_share"]) for r in sync_runs) / len(sync_runs)


def summarize(args: argparse.Namespace, runs: list[dict], cores: tuple[int, int] | None, complete: bool) -> dict:
    # Compare like with like: only the seeds every strategy has finished enter the curves and ratios.
    seeds = [seed for seed in args.seeds if all(any(r["strategy"] == s and r["seed"] == seed for r in runs)
                                                 for s in STRATEGIES)]
    by = {s: [r for r in runs if r["strategy"] == s and r["seed"] in seeds] for s in STRATEGIES}
    curves = {s: mean_curve(rs) for s, rs in by.items() if rs}
    target = curves["sync"][-1]["reward"] if curves.get("sync") else None
    ttr = {s: (time_to(c, target) if target is not None else None) for s, c in curves.items()}
    sync_t = ttr.get("sync")

    def ratio(name: str) -> float | None:
        t = ttr.get(name)
        return t / sync_t if t is not None and sync_t else None

    final = {s: [r["eval"][-1]["reward"] for r in rs if r["eval"]] for s, rs in by.items()}
    return {
        "benchmark": "time_to_reward",
        "complete": complete,
        "job": str(Path(args.job).resolve().relative_to(ROOT)) if Path(args.job).resolve().is_relative_to(ROOT)
        else args.job,
        "task": "arith-chain (the quickstart), warmed-up tiny-arith policy",
        "steps": args.steps,
        "steps_note": (f"{args.steps} steps per run, not the issue's 120: 3 strategies x 3 seeds x 120 steps do not "
                       "fit the shared 2-core machine's time budget" if args.steps < 120 else "as asked"),
        "seeds": args.seeds,
        "seeds_compared": seeds,  # the seeds every strategy finished (curves, ratios and shares use these)
        "eval_every": args.eval_every,
        "eval_prompts": args.eval_prompts,
        "sides": args.sides,
        "disaggregation": disaggregation(args.sides, cores),
        # weightTransport.flushCache of every strategy's job (false: --keep-cache, docs/weight_sync.md#keeping-the-cache)
        "flush_cache": not args.keep_cache,
        "sync_final_heldout_reward": target,
        "time_to_sync_final_reward_s": ttr,
        "async_over_sync_time_to_reward": ratio("async"),
        "april_over_sync_time_to_reward": ratio("april"),
        "time_to_reward_note": ("a null ratio: that strategy's seed-averaged held-out curve never reached sync's "
                                f"final held-out reward within the {args.steps} steps"),
        # Wall seconds of the whole run over sync's (same steps): the speed half of time to reward.
        "wall_over_sync_same_steps": {s: sum(r["wall_s"] for r in rs) / sum(r["wall_s"] for r in by["sync"])
                                      for s, rs in by.items() if rs and by["sync"]},
        "final_heldout_reward_per_seed": final,
        # The second goal: reward at equal steps within the seed-to-seed spread (reward_at_equal_steps).
        "reward_at_equal_steps": reward_at_equal_steps(by),
        "mean_wall_s": {s: sum(r["wall_s"] for r in rs) / len(rs) for s, rs in by.items() if rs},
        # The trainer's own seconds per step (its busy time): the rollout benchmark's async overlap window.
        "train_step_seconds": {s: sum((1 - r["trainer_idle_share"]) * r["wall_s"] / r["steps"] for r in rs) / len(rs)
                               for s, rs in by.items() if rs},
        "engine_idle_share": {s: sum(r["engine_idle_share"] for r in rs) / len(rs) for s, rs in by.items() if rs},
        "overlap_bound_over_sync": overlap_bound(by["sync"]),
        "overlap_bound_note": ("the least wall time, over sync's, that overlapping the two sides can give for sync's "
                               "work: the busier side's share of sync's wall (max of engine and trainer busy), seed "
                               "mean. Overlap alone cannot beat it; async-APRIL's time-to-reward ratio can only go "
                               "below it by needing fewer steps or less work per step"),
        "trainer_idle_share": {s: sum(r["trainer_idle_share"] for r in rs) / len(rs) for s, rs in by.items() if rs},
        "mean_curves": curves,
        "runs": runs,
        "machine": describe(f"torch {torch.__version__} ({torch.get_num_threads()} threads), no GPU"),
        "load_average_1min_at_end": load_average(),
    }


def disaggregation(sides: str, cores: tuple[int, int] | None) -> str:
    """How the engine and the trainer were kept apart, in words (the output states it)."""
    if cores is None:
        return "not pinned (fewer than 2 cores)"
    if sides == "processes":
        return (f"one process per side: the engine is rljob's SGLang-protocol CPU server pinned to core {cores[0]} "
                f"(taskset), the trainer this process pinned to core {cores[1]}, weights over gloo; torch threads 1; "
                "engine busy time is the server's CPU seconds outside evaluations")
    return (f"one process, a thread per side: engine steps and the event loop pinned to core {cores[0]}, trainer "
            f"steps to core {cores[1]} (sched_setaffinity of the thread running each step), torch threads 1")


def plot(path: Path, result: dict) -> None:
    colors = {"sync": "#999999", "april": "#2a7ab9", "async": "#c0504d"}
    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(11, 4))
    for run in result["runs"]:
        c = colors[run["strategy"]]
        ax_t.plot([p["wall_s"] for p in run["eval"]], [p["reward"] for p in run["eval"]], color=c, alpha=0.25, lw=1)
        ax_s.plot([p["step"] for p in run["eval"]], [p["reward"] for p in run["eval"]], color=c, alpha=0.25, lw=1)
    for name, curve in result["mean_curves"].items():
        label = name if name != "async" else "async-APRIL"
        ax_t.plot([p["wall_s"] for p in curve], [p["reward"] for p in curve], color=colors[name], lw=2, marker="o",
                  label=label)
        ax_s.plot([p["step"] for p in curve], [p["reward"] for p in curve], color=colors[name], lw=2, marker="o",
                  label=label)
    target = result["sync_final_heldout_reward"]
    if target is not None:
        for ax in (ax_t, ax_s):
            ax.axhline(target, color="black", ls="--", lw=1)
    bound, sync_wall = result.get("overlap_bound_over_sync"), result["mean_wall_s"].get("sync")
    if bound is not None and sync_wall:  # where sync's last point would be with its two sides fully overlapped
        ax_t.axvline(bound * sync_wall, color="#999999", ls=":", lw=1,
                     label=f"overlap bound ({bound:.2f} of sync's wall)")
    ratios = ", ".join(f"{k.split('_')[0]}/sync {v:.2f}" for k, v in result.items()
                       if k.endswith("_over_sync_time_to_reward") and v is not None)
    ax_t.set_xlabel("wall seconds (training steps, evaluation excluded)")
    ax_s.set_xlabel("step")
    for ax in (ax_t, ax_s):
        ax.set_ylabel("held-out reward")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"time to sync's final held-out reward (dashed): {ratios or 'n/a'}; "
                 f"{len(result['seeds_compared'])} data seeds, thin lines per seed", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def resummarize(args: argparse.Namespace) -> None:
    """Summary and plot again from the runs an earlier invocation wrote (a run cut short keeps its runs)."""
    out = Path(args.output)
    old = json.loads((out / "time_to_reward.json").read_text())
    runs = old["runs"]
    args.steps, args.seeds = old["steps"], old["seeds"]
    args.eval_every, args.eval_prompts = old["eval_every"], old["eval_prompts"]
    args.sides = old.get("sides", "threads")  # runs before --sides were threads
    args.keep_cache = not old.get("flush_cache", True)  # runs before --keep-cache flushed
    cores = None if old["disaggregation"].startswith("not pinned") else (0, 1)
    complete = len(runs) == len(args.seeds) * len(STRATEGIES)
    result = summarize(args, runs, cores, complete)
    result["machine"], result["load_average_1min_at_end"] = old["machine"], old["load_average_1min_at_end"]
    if not complete:
        result["incomplete_note"] = (f"{len(runs)} of {len(args.seeds) * len(STRATEGIES)} runs finished before "
                                     "the time budget ran out; the comparison uses the seeds every strategy finished")
    (out / "time_to_reward.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(out / "time_to_reward.png", result)


async def main_async(args: argparse.Namespace) -> None:
    cores = (0, 1) if (os.cpu_count() or 1) >= 2 and not args.no_pin else None
    if cores:
        torch.set_num_threads(1)
    console.print(f"disaggregation: {disaggregation(args.sides, cores)}")
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    if args.warmup_steps:  # one-off costs (allocations, first-call paths) must not land on the first strategy
        await train_one(argparse.Namespace(**{**vars(args), "steps": args.warmup_steps, "eval_prompts": 8}),
                        "sync", args.seeds[0], cores)
    runs: list[dict] = []
    for seed in args.seeds:
        for strategy in STRATEGIES:
            runs.append(await train_one(args, strategy, seed, cores))
            done = len(runs) == len(args.seeds) * len(STRATEGIES)
            result = summarize(args, runs, cores, complete=done)
            (out / "time_to_reward.json").write_text(json.dumps(result, indent=2) + "\n")
            plot(out / "time_to_reward.png", result)
            console.print(f"{strategy} seed {seed}: {runs[-1]['wall_s']:.0f} s; async/sync "
                          f"{result['async_over_sync_time_to_reward']}, april/sync "
                          f"{result['april_over_sync_time_to_reward']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", default=str(ROOT / "docs/examples/quickstart.yaml"))
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="data seeds")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--eval-prompts", type=int, default=256)
    parser.add_argument("--warmup-steps", type=int, default=2, help="an unmeasured sync run first")
    parser.add_argument("--no-pin", action="store_true", help="do not pin engines and trainer to their own cores")
    parser.add_argument("--sides", choices=("processes", "threads"), default="processes",
                        help="processes: the engine in its own server process, as on a cluster (default); "
                        "threads: the embedded engine in this process, a thread per side")
    parser.add_argument("--keep-cache", action="store_true", help="every strategy's weight sync keeps the engines' "
                        "KV cache (weightTransport.flushCache false: interrupted samples resume without a prefill)")
    parser.add_argument("--output", default=str(ROOT / "docs/benchmarks"))
    parser.add_argument("--resummarize", action="store_true", help="only rebuild summary and plot from the runs "
                        "already in the output's time_to_reward.json")
    args = parser.parse_args()
    if args.resummarize:
        resummarize(args)
    else:
        asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
