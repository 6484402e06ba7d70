"""Rollout throughput of `sync`, `april` and `async` on the embedded engine, against the bubble-free ceiling.

Same policy (the warmed-up tiny-arith model), same prompts, same seeds, one process; the rounds of
the strategies are interleaved so machine noise hits both alike. The ceiling is the engine's
steady full-batch decode rate. Prints a table, writes docs/benchmarks/rollout_throughput.json and
a plot. Run: `python benchmarks/rollout_throughput.py` (or `make benchmark`).

`--engine-variants` compares the options of issue 29 item 4 instead, each on its own and together, for
`april` and `async` side by side in one run (rounds interleaved): baseline, +chunked prefill (the
embedded engine's `chunked_prefill_tokens`, one budget per `--chunked-prefill-tokens`), +fill (the
scheduler's `fill_engines`: the batch kept full to the end of a round), both, and +keepcache (the weight
sync keeps the engines' KV cache, `weightTransport.flushCache: false`: the samples interrupted at the
sync resume without a prefill); writes docs/benchmarks/engine_prefill.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rljob.api import RLJob, load_rljob
from rljob.runtime.cli.views import comparison_view
from rljob.runtime.report import comparison_plot
from rljob.runtime.compare import Variant, compare_strategies
from rljob.runtime.runner import JobRunner, RunOptions
from machine_info import describe, load_average  # benchmarks/machine_info.py

ROOT = Path(__file__).resolve().parents[1]
console = Console()


def machine() -> str:
    """CPU, cores and library versions (see machine_info)."""
    return describe(f"torch {torch.__version__} ({torch.get_num_threads()} threads), no GPU")


def _display_path(path: Path) -> str:
    """Repository-relative when inside the repository, so the JSON does not carry a home directory."""
    resolved = path.resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(path)


async def compare(args: argparse.Namespace, strategies: tuple[str, ...],
                  variants: tuple[Variant, ...] = ()) -> tuple[RLJob, dict]:
    """The job of `--job` and its strategies' (and variants') comparison, rounds interleaved."""
    job = load_rljob(args.job)
    with tempfile.TemporaryDirectory() as tmp:
        job.spec.checkpoint.dir = str(Path(tmp) / "ckpt")
        runner = JobRunner(job, RunOptions(output_dir=Path(tmp), resume=False))
        await runner.setup()
        await runner.close()

        def progress(name: str, i: int, result) -> None:  # type: ignore[no-untyped-def]
            s = result.stats
            tag = "warm-up" if i < args.warmup else "round"
            console.log(f"{name:5s} {tag} {i + 1}: {s.tokens_generated} tokens in {s.rollout_seconds:.2f}s "
                        f"({s.tokens_per_second:.0f} tok/s), truncation {s.truncation_rate:.2f}")

        comparison = await compare_strategies(runner, args.rounds, strategies=strategies, warmup_rounds=args.warmup,
                                              on_round=progress, train_seconds=args.train_seconds, variants=variants)
    return job, comparison


async def run(args: argparse.Namespace) -> dict:
    job, comparison = await compare(args, ("sync", "april", "async"))
    rows = {r["strategy"]: r for r in comparison["rows"]}
    sync, april, asynch = rows["sync"], rows["april"], rows["async"]
    r = job.spec.rollout
    return {
        "benchmark": "rollout_throughput",
        "job": _display_path(Path(args.job)),
        "policy": f"{job.spec.model.builtin or job.spec.model.path} as loaded (the warmed-up policy, before any RL step)",
        "task": "arith-chain (long-tailed answer lengths)",
        "rollout_batch_size": r.rollout_batch_size,
        "samples_per_prompt": r.samples_per_prompt,
        "over_sampling": r.partial.over_sampling,
        "truncation": r.partial.truncation.to_wire(),
        "max_batch_size": r.embedded.max_batch_size,
        "rounds": args.rounds,
        "warmup_rounds": args.warmup,
        "sync_tokens_per_s": sync["tokens_per_s"],
        "april_tokens_per_s": april["tokens_per_s"],
        # The honest metric beside the paper's: returned (trained) response tokens per rollout second.
        "sync_trained_tokens_per_s": sync["trained_tokens_per_s"],
        "april_trained_tokens_per_s": april["trained_tokens_per_s"],
        "april_trained_over_sync": april["trained_over_sync"],
        "ceiling_tokens_per_s": comparison["ceiling_tokens_per_s"],
        "april_over_sync": april["over_sync"],
        "april_over_ceiling": april["over_ceiling"],
        "sync_over_ceiling": sync["over_ceiling"],
        # async: its engines keep generating for a train step's time after each collection (a trainer
        # on its own hardware); tokens over collection + overlap seconds.
        "train_seconds": args.train_seconds,
        "train_seconds_source": args.train_seconds_source,
        "async_tokens_per_s": asynch["tokens_per_s"],
        "async_trained_tokens_per_s": asynch["trained_tokens_per_s"],
        "async_over_sync": asynch["over_sync"],
        "async_over_ceiling": asynch["over_ceiling"],
        "async_off_policy_ratio": asynch["off_policy_ratio"],
        # How full the engine's decode batches ran (generated tokens per decode step, EngineStats), while
        # collecting and, for async, while the trainer trained: where async's share of the ceiling goes.
        "april_collection_tokens_per_decode_step": april["engine_collection"]["tokens_per_decode_step"],
        "async_collection_tokens_per_decode_step": asynch["engine_collection"]["tokens_per_decode_step"],
        "async_overlap_tokens_per_decode_step": asynch["engine_overlap"]["tokens_per_decode_step"],
        "async_overlap_busy_share": asynch["engine_overlap"]["busy_share"],
        "sync_step_seconds": sync["step_seconds"],
        "april_step_seconds": april["step_seconds"],
        "off_policy_ratio": april["off_policy_ratio"],
        "april_truncation_rate": april["truncation_rate"],
        "rows": comparison["rows"],
        "machine": machine(),
        "load_average_1min_at_end": load_average(),
    }


def engine_variants(budgets: list[int]) -> tuple[Variant, ...]:
    """Each option on its own beside the plain `april` and `async` rows (which are the baselines), then
    both together (with the first budget)."""
    strategies = ("april", "async")
    chunked = [Variant(f"{s}+chunked{n}", s, chunked_prefill_tokens=n) for n in budgets for s in strategies]
    full = [Variant(f"{s}+fill", s, fill_engines=True) for s in strategies]
    both = [Variant(f"{s}+chunked{budgets[0]}+fill", s, chunked_prefill_tokens=budgets[0], fill_engines=True)
            for s in strategies]
    kept = [Variant(f"{s}+keepcache", s, flush_cache=False) for s in strategies]
    return (*chunked, *full, *both, *kept)


def step_profile(stats: list[dict]) -> dict[str, float]:
    """Where an engine's step time went (warm-up rounds included): prefill share, mean step times."""
    busy = sum(s["busy_seconds"] for s in stats)
    steps = sum(s["decode_steps"] for s in stats)
    return {
        "busy_seconds": busy,
        "prefill_tokens": sum(s["prefill_tokens"] for s in stats),
        "cached_prefill_tokens": sum(s["cached_prefill_tokens"] for s in stats),
        "prefill_forwards": sum(s["prefill_steps"] for s in stats),
        "mixed_steps": sum(s["mixed_steps"] for s in stats),
        "decode_steps": steps,
        "generated_tokens": sum(s["generated_tokens"] for s in stats),
        "busy_ms_per_decode_step": 1000 * busy / steps if steps else 0.0,
        "busy_ms_per_generated_token": 1000 * busy / max(1, sum(s["generated_tokens"] for s in stats)),
        "full_decode_step_ms": 1000 * max((s["full_step_seconds"] for s in stats), default=0.0),
    }


async def run_variants(args: argparse.Namespace) -> dict:
    """The engine options side by side (see the module docstring)."""
    job, comparison = await compare(args, ("april", "async"), engine_variants(args.chunked_prefill_tokens))
    rows = {r["strategy"]: r for r in comparison["rows"]}
    return {
        "benchmark": "engine_prefill",
        "job": _display_path(Path(args.job)),
        "what": "chunked prefill (engine option chunked_prefill_tokens) and a full batch to the end of the round "
                "(scheduler option fill_engines) for APRIL and async, each on its own and both, and the KV cache "
                "kept across the weight sync (weightTransport.flushCache false: interrupted samples resume "
                "without a prefill), rounds interleaved in one run; the plain april/async rows are the baselines",
        "rollout_batch_size": job.spec.rollout.rollout_batch_size,
        "samples_per_prompt": job.spec.rollout.samples_per_prompt,
        "max_batch_size": job.spec.rollout.embedded.max_batch_size,
        "rounds": args.rounds,
        "warmup_rounds": args.warmup,
        "train_seconds": args.train_seconds,
        "train_seconds_source": args.train_seconds_source,
        "ceiling_tokens_per_s": comparison["ceiling_tokens_per_s"],
        "over_ceiling": {name: r["over_ceiling"] for name, r in rows.items()},
        "tokens_per_s": {name: r["tokens_per_s"] for name, r in rows.items()},
        "trained_tokens_per_s": {name: r["trained_tokens_per_s"] for name, r in rows.items()},
        # Round by round against the baseline of the same strategy (rounds interleaved, same prompt seeds):
        # the median of the per-round ratios is less sensitive to a load spike than the totals.
        "median_round_ratio_vs_baseline": {
            name: statistics.median(v / b for v, b in zip(result["round_tokens_per_s"],
                                                          comparison["results"][name.split("+")[0]]["round_tokens_per_s"],
                                                          strict=True) if b > 0)
            for name, result in comparison["results"].items() if "+" in name
        },
        "engine_profile": {name: step_profile(stats) for name, stats in comparison["engine_stats"].items()},
        "rows": comparison["rows"],
        "machine": machine(),
        "load_average_1min_at_end": load_average(),
    }


def train_seconds(given: float | None, folder: Path) -> tuple[float, str]:
    """The train step's seconds: as given, else the sync runs' trainer-busy seconds per step in
    time_to_reward.json (the quickstart's train step, the trainer pinned to one core)."""
    if given is not None:
        return given, "--train-seconds"
    path = folder / "time_to_reward.json"
    if not path.exists():
        raise SystemExit(f"{path} not found: run benchmarks/time_to_reward.py first, or pass --train-seconds")
    return json.loads(path.read_text())["train_step_seconds"]["sync"], "time_to_reward.json: train_step_seconds.sync"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", default=str(ROOT / "docs/examples/quickstart.yaml"), help="RLJob whose policy, "
                        "task and rollout settings are used")
    parser.add_argument("--rounds", type=int, default=8, help="measured rounds per strategy")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured rounds first (fills APRIL's buffer)")
    parser.add_argument("--output", default=str(ROOT / "docs/benchmarks"), help="folder for JSON and plot")
    parser.add_argument("--train-seconds", type=float, default=None, help="the async strategy's overlap per "
                        "round (default: the quickstart's train step measured in time_to_reward.json)")
    parser.add_argument("--engine-variants", action="store_true", help="compare chunked prefill, "
                        "fill_engines and a KV cache kept across the weight sync for april and async instead; "
                        "writes engine_prefill.json")
    parser.add_argument("--chunked-prefill-tokens", type=int, nargs="+", default=[512],
                        help="chunked prefill budgets (prompt tokens per step) compared with --engine-variants")
    args = parser.parse_args()
    args.train_seconds, args.train_seconds_source = train_seconds(args.train_seconds, Path(args.output))
    if args.engine_variants:
        variants = asyncio.run(run_variants(args))
        console.print(comparison_view(variants["rows"], variants["ceiling_tokens_per_s"],
                                      "embedded-engine options (same policy, prompts and seeds)"))
        for name, profile in variants["engine_profile"].items():
            console.print(f"{name:18s} " + ", ".join(f"{k} {v:.4g}" for k, v in profile.items()))
        console.print(f"machine: {variants['machine']}")
        path = Path(args.output) / "engine_prefill.json"
        path.write_text(json.dumps(variants, indent=2) + "\n")
        console.print(f"wrote {path}")
        return
    result = asyncio.run(run(args))

    console.print(comparison_view(result["rows"], result["ceiling_tokens_per_s"],
                                  "rollout throughput (embedded engine, same policy, prompts and seeds)"))
    console.print(f"machine: {result['machine']}")

    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rollout_throughput.json").write_text(json.dumps(result, indent=2) + "\n")
    comparison_plot(out / "rollout_throughput.png", result["rows"], result["ceiling_tokens_per_s"],
                    f"april/ceiling = {result['april_over_ceiling']:.2f}, "
                    f"async/ceiling = {result['async_over_ceiling']:.2f}")
    console.print(f"wrote {out / 'rollout_throughput.json'} and {out / 'rollout_throughput.png'}")


if __name__ == "__main__":
    main()
