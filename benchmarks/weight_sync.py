"""Streamed weight sync from FSDP2 shards: rank 0's peak extra RSS and seconds per GB against the raw gloo floor.

For each of 3 model sizes, two trainer ranks (spawned processes, FSDP2 over gloo, as `rljob run --nproc 2`)
shard a tiny Qwen2 model and push it to one SGLang-protocol worker process (the project's CPU server,
loopback) through the `distributed` transport, exactly as the runner does: `GatheredWeights` gathers one
bucket at a time from the shards while the transport broadcasts it over the weight-update group
(/update_weights_from_distributed). One warm-up sync, then N measured syncs, each timed end to end (pause,
every bucket's HTTP call and broadcast, continue, version checks). During each, a thread samples rank 0's
RSS (glibc told to unmap freed memory: tests/helpers/rss.py) for its peak above the RSS before the sync.

The floor, on the same run: rank 0 broadcasts the same bytes, bucket by bucket, to rank 1 over the
trainers' own gloo group (the same world size as the weight-update group: 1 sender, 1 receiver), with no
gather, no HTTP and no engine. `over_floor` is sync seconds per GB over floor seconds per GB. The gather
alone (every rank pulls the buckets from the shards, nothing is sent) is timed too: the transport gathers
bucket k+1 while it broadcasts bucket k, so a sync costs about the larger of the gather and the floor,
plus each bucket's HTTP call and the worker's copy into its model (the worker takes one bucket at a time).

Everything shares the machine's cores and the "network" is loopback; see docs/benchmarks/README.md for what
it says and does not say about a GPU cluster.
Run: `python benchmarks/weight_sync.py` (writes docs/benchmarks/weight_sync.json).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.helpers: the worker launcher, the rank spawner, the RSS sampler

from machine_info import describe, load_average  # noqa: E402  # benchmarks/machine_info.py
from tests.helpers.processes import start_workers, stop  # noqa: E402
from tests.helpers.ranks import run_ranks  # noqa: E402
from tests.helpers.tiny_model import build_tiny_model  # noqa: E402

console = Console()
# No tensor above the default 8 MB bucket (the embedding is 4096 x 512 fp32 = 8 MB); ~35, ~73, ~148 MB fp32.
SIZES = {"small": {"hidden_size": 512, "layers": 2, "vocab_size": 4096},
         "medium": {"hidden_size": 512, "layers": 6, "vocab_size": 4096},
         "large": {"hidden_size": 512, "layers": 14, "vocab_size": 4096}}


def bucket_sizes(config: dict[str, int], bucket: int) -> list[int]:
    """Bytes of each bucket a sync of this model sends (the same bucketing as the sync's)."""
    from rljob.runtime.weights.buckets import bucket_bytes, module_buckets

    return [bucket_bytes(b) for b in module_buckets(build_tiny_model(seed=0, **config), bucket)]


def floor_seconds(sizes: list[int], rank: int) -> float:
    """One pass of raw gloo broadcasts of `sizes` bytes from rank 0 on the default group (both ranks call it)."""
    import torch.distributed as dist

    dist.barrier()
    started = time.perf_counter()
    for size in sizes:
        tensor = torch.ones(size // 4) if rank == 0 else torch.empty(size // 4)
        dist.broadcast(tensor, 0)
    return time.perf_counter() - started


def gather_seconds(backend: Any, bucket: int) -> float:
    """One pass of the shards' gathers, bucket by bucket, nothing sent (every rank calls it)."""
    import torch.distributed as dist

    dist.barrier()
    started = time.perf_counter()
    for _ in backend.iter_full_weights(bucket):
        pass
    return time.perf_counter() - started


async def rank0_syncs(backend: Any, distributed: Any, url: str, bucket: int, syncs: int) -> list[dict[str, Any]]:
    from rljob.runtime.engines.sglang_client import SGLangClientConfig, SGLangEngine
    from rljob.runtime.ranks import GatheredWeights, OrderSender
    from rljob.runtime.weights.broadcast import DistributedOptions, DistributedTransport
    from tests.helpers.rss import PeakRss

    engine = SGLangEngine(SGLangClientConfig(worker_urls=[url]))
    await engine.start()
    transport = DistributedTransport([engine], DistributedOptions(master_address="127.0.0.1", backend="gloo"))
    source = GatheredWeights(backend, bucket, OrderSender(distributed))
    rows = []
    try:
        for version in range(1, syncs + 2):  # version 1: the warm-up (group set-up, imports)
            source.calls = 0  # rank 1 joins every pass without an order (it knows the count)
            gc.collect()
            with PeakRss() as peak:
                report = await transport.sync(version, source)
            if report.failed or not report.updated:
                raise SystemExit(f"sync {version} failed: {report.failed}")
            if version > 1:
                rows.append({"seconds": report.seconds, "bytes": report.bytes_sent, "peak_extra_rss": peak.extra})
    finally:
        await transport.close()
        await engine.close()
    return rows


def bench_rank(rank: int, config: dict[str, int], url: str, bucket: int, syncs: int, out: Path) -> None:
    """One trainer rank of one model size (spawned by run_ranks); rank 0 writes out/result.json."""
    from rljob.runtime.training.distributed import DistEnv, Distributed
    from rljob.runtime.training.fsdp import FSDP2Backend
    from tests.helpers.rss import exact_malloc

    exact_malloc()
    env = DistEnv.from_environ()
    assert env is not None
    distributed = Distributed(env, "cpu")
    backend = FSDP2Backend(build_tiny_model(seed=0, **config), 1e-3, 0.0, distributed)
    sizes = bucket_sizes(config, bucket)
    if rank == 0:
        rows = asyncio.run(rank0_syncs(backend, distributed, url, bucket, syncs))
    else:
        for _ in range(syncs + 1):
            for _ in backend.iter_full_weights(bucket):
                pass
    floor_seconds(sizes, rank)  # warm-up
    floors = [floor_seconds(sizes, rank) for _ in range(syncs)]
    gathers = [gather_seconds(backend, bucket) for _ in range(syncs)]
    if rank == 0:
        (out / "result.json").write_text(json.dumps({"syncs": rows, "floor_seconds": floors,
                                                     "gather_seconds": gathers, "floor_bytes": sum(sizes)}))


def run_size(name: str, config: dict[str, int], args: argparse.Namespace, work: Path) -> dict[str, Any]:
    model = build_tiny_model(seed=0, **config)
    path = work / name
    model.save_pretrained(path)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bucket = int(args.bucket_mb * 2**20)
    out = work / f"{name}-out"
    out.mkdir()
    procs: list[Any] = []
    try:
        (url,) = start_workers(path, work, 1, procs, prefix=f"{name}-w", max_batch_size=2, timeout=300)
        run_ranks(bench_rank, 2, config, url, bucket, args.syncs, out)
    finally:
        stop(procs)
    raw = json.loads((out / "result.json").read_text())
    syncs = raw["syncs"]
    if any(s["bytes"] != nbytes for s in syncs) or raw["floor_bytes"] != nbytes:
        raise SystemExit(f"{name}: a sync or the floor did not move the model's {nbytes} bytes: {raw}")
    gb = nbytes / 2**30
    floor = statistics.median(raw["floor_seconds"])
    gather = statistics.median(raw["gather_seconds"])
    median = statistics.median(s["seconds"] for s in syncs)
    peak = max(s["peak_extra_rss"] for s in syncs)
    return {
        "model": name, "parameters": sum(p.numel() for p in model.parameters()), "megabytes": round(nbytes / 2**20, 2),
        "bucket_megabytes": args.bucket_mb, "wire_dtype": "float32 (the CPU server serves float32)",
        "median_seconds": round(median, 4), "seconds_per_gb": round(median / gb, 2),
        "floor_median_seconds": round(floor, 4), "floor_seconds_per_gb": round(floor / gb, 2),
        "gather_median_seconds": round(gather, 4), "gather_seconds_per_gb": round(gather / gb, 2),
        "over_floor": round(median / floor, 2), "gather_over_floor": round(gather / floor, 2),
        "peak_extra_rss": peak, "peak_extra_rss_megabytes": round(peak / 2**20, 2),
        "peak_rss_buckets": round(peak / bucket, 2), "model_buckets": round(nbytes / bucket, 2),
        "all_seconds": [round(s["seconds"], 4) for s in syncs],
        "all_peak_extra_rss": [s["peak_extra_rss"] for s in syncs],
        "all_floor_seconds": [round(s, 4) for s in raw["floor_seconds"]],
        "all_gather_seconds": [round(s, 4) for s in raw["gather_seconds"]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--syncs", type=int, default=3, help="measured syncs (and floor passes) per size")
    parser.add_argument("--bucket-mb", type=float, default=8.0, help="weight-sync bucket size")
    parser.add_argument("--output", default=str(ROOT / "docs/benchmarks"), help="folder for the JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = [run_size(name, config, args, Path(tmp)) for name, config in SIZES.items()]
    result = {
        "runs": runs,
        "peak_rss_within_buckets": max(r["peak_rss_buckets"] for r in runs),
        "worst_over_floor": max(r["over_floor"] for r in runs),
        "trainer_ranks": 2, "engine_workers": 1, "bucket_megabytes": args.bucket_mb,
        "machine": describe(f"torch {torch.__version__}, gloo over loopback, no GPU"),
        "load_average_1min_at_end": load_average(),
    }
    table = Table(title="streamed weight sync, 2 FSDP2 ranks -> 1 SGLang-protocol worker (medians)")
    for col in ("model", "MB", "buckets", "sync s", "s/GB", "floor s/GB", "gather s/GB", "x floor",
                "peak extra RSS MB", "in buckets"):
        table.add_column(col)
    for r in runs:
        table.add_row(r["model"], str(r["megabytes"]), str(r["model_buckets"]), f"{r['median_seconds']:.3f}",
                      f"{r['seconds_per_gb']:.1f}", f"{r['floor_seconds_per_gb']:.1f}",
                      f"{r['gather_seconds_per_gb']:.1f}", f"{r['over_floor']:.2f}",
                      f"{r['peak_extra_rss_megabytes']:.1f}", f"{r['peak_rss_buckets']:.2f}")
    console.print(table)
    console.print(f"peak_rss_within_buckets {result['peak_rss_within_buckets']}, "
                  f"worst_over_floor {result['worst_over_floor']}")
    console.print(f"machine: {result['machine']}, load {result['load_average_1min_at_end']}")
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "weight_sync.json").write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {out / 'weight_sync.json'}")


if __name__ == "__main__":
    main()
