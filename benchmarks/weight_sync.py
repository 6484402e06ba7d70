"""Streamed weight sync from FSDP2 shards: rank 0's peak extra RSS and seconds per GB against the raw gloo floor.

For each case (below), two trainer ranks (spawned processes, FSDP2 over gloo, as `rljob run --nproc 2`)
shard a tiny Qwen2 model and push it to one SGLang-protocol worker process (the project's CPU server,
loopback) through the `distributed` transport, exactly as the runner does: `GatheredWeights` gathers one
bucket at a time from the shards while the transport broadcasts it over the weight-update group
(/update_weights_from_distributed). Two phases, each of one warm-up sync and N measured syncs: first a
thread samples rank 0's RSS during each sync (glibc told to unmap freed memory: tests/helpers/rss.py) for
its peak above the RSS before it; then, with glibc reusing its heap as a trainer's allocator does (those
per-bucket mappings would add page faults to every gathered bucket), each sync is timed end to end
(pause, every bucket's HTTP call and broadcast, continue, version checks), with the CPU seconds each
process (both ranks, the worker) spent on it: all share the machine's cores, so that work over the
cores is the least wall time the sync could take here (`cpu_bound_over_floor`).

The floor, on the same run: rank 0 broadcasts the same bytes, bucket by bucket, to rank 1 over the
trainers' own gloo group (the same world size as the weight-update group: 1 sender, 1 receiver), with no
gather, no HTTP and no engine, from and into buffers made and written before the clock starts (until
2026-12-07 each was allocated and filled inside the timed loop, which doubled the floor and flattered
every ratio). `over_floor` is sync seconds per GB over floor seconds per GB. A second
floor sends the same bytes one broadcast per tensor (a bucket's posted together, as SGLang's worker does),
which is what SGLang 0.5.5.post3's protocol allows; `over_tensor_floor` is the sync over that one. The
gather alone (every rank pulls the buckets from the shards, nothing is sent) is timed too: the transport
gathers bucket k+1 while it broadcasts bucket k, so a sync costs about the larger of the gather and the
floor, plus the worker's copy of each bucket into its model (over gloo the next bucket's HTTP call is
built and sent during that copy: docs/weight_sync.md).

Cases: the 3 sizes with a float32 worker standing in for SGLang 0.5.23 (the CPU server's default), which
takes a bucket as one flattened broadcast; the large model with a 0.5.5.post3 worker (the pinned image:
one broadcast per tensor); and the large model with a worker serving bfloat16 (`--dtype bfloat16`,
SGLang's `auto` for RL checkpoints: the production case of fp32 masters and bf16 engines) for each
release, plus once as the trainer gathered before (in fp32, each tensor cast as it is sent); and the large
model synced by one trainer process that holds it whole (no gather: the transport alone, as `rljob run`
without --nproc). The summary fields (`peak_rss_within_buckets`, `worst_over_floor`, ...) cover every
case but that "before" one.

Everything shares the machine's cores and the "network" is loopback; see docs/benchmarks/README.md for what
it says and does not say about a GPU cluster.
Run: `python benchmarks/weight_sync.py` (writes docs/benchmarks/weight_sync.json).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.helpers: the worker launcher, the rank spawner, the RSS sampler

from cpu_time import cpu_seconds  # noqa: E402  # benchmarks/cpu_time.py
from machine_info import describe, load_average  # noqa: E402  # benchmarks/machine_info.py
from tests.helpers.processes import start_workers, stop  # noqa: E402
from tests.helpers.ranks import run_ranks  # noqa: E402
from tests.helpers.tiny_model import build_tiny_model  # noqa: E402

console = Console(width=150)
# No tensor above the default 8 MB bucket (the embedding is 4096 x 512 fp32 = 8 MB); ~35, ~73, ~148 MB fp32.
SIZES = {"small": {"hidden_size": 512, "layers": 2, "vocab_size": 4096},
         "medium": {"hidden_size": 512, "layers": 6, "vocab_size": 4096},
         "large": {"hidden_size": 512, "layers": 14, "vocab_size": 4096}}


@dataclass(frozen=True)
class Case:
    """One measured configuration: a model size, the dtype its worker serves, and whether the trainer
    gathers in that dtype (since the wire-dtype gather) or in its fp32 and casts each tensor as it sends
    it (before)."""

    name: str
    size: str
    served: str = "float32"  # the worker's --dtype
    gather_in_wire: bool = True
    release: str = "0.5.23"  # the SGLang release the worker stands in for (0.5.5.post3: no flattened buckets)
    # "fsdp": rank 0 gathers each bucket from the two ranks' shards; "module": rank 0 syncs a whole copy of
    # the model it holds, as a one-process trainer (`rljob run` without --nproc) does: no gather, the
    # transport flattens the live tensors. Rank 1 then only takes part in the floor.
    source: str = "fsdp"

    @property
    def wire(self) -> torch.dtype:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.served]

    @property
    def plan_dtype(self) -> torch.dtype | None:
        """The dtype the source is asked for (None: the trainer's own, the path before)."""
        return self.wire if self.gather_in_wire else None


CASES = (Case("small", "small"), Case("medium", "medium"), Case("large", "large"),
         Case("large, 0.5.5.post3", "large", release="0.5.5.post3"),
         Case("large bf16, fp32 gather", "large", "bfloat16", gather_in_wire=False),
         Case("large bf16", "large", "bfloat16"),
         Case("large bf16, 0.5.5.post3", "large", "bfloat16", release="0.5.5.post3"),
         Case("large, one trainer process (no gather)", "large", source="module"))


def tensor_sizes(config: dict[str, int], bucket: int, case: Case) -> list[list[int]]:
    """Bytes on the wire of each tensor a sync of this model sends, bucket by bucket (the sync's bucketing;
    a tied tensor once per name, as it is sent)."""
    from rljob.runtime.weights.buckets import module_buckets
    from rljob.runtime.weights.wire_dtype import wire_bytes

    model = build_tiny_model(seed=0, **config)
    return [[wire_bytes([named], case.wire) for named in b] for b in module_buckets(model, bucket, case.plan_dtype)]


def floor_seconds(sizes: list[list[int]], per_tensor: bool, pids: list[int]) -> tuple[float, float]:
    """One pass of raw gloo broadcasts from rank 0 on the default group (both ranks call it) of the bytes
    of `sizes`: one broadcast per bucket (the floor), or one per tensor, a bucket's posted together and
    then waited on, as SGLang 0.5.5.post3's /update_weights_from_distributed receives them. Returns the
    wall seconds and the CPU seconds of the processes `pids` (the two ranks) over the pass."""
    import torch.distributed as dist

    # Every buffer made and written before the clock starts, on both sides: the floor is the broadcasts
    # alone, not the allocation, page faults and filling of fresh buffers.
    pieces = [[torch.ones(n, dtype=torch.uint8) for n in bucket] if per_tensor else [torch.ones(sum(bucket),
              dtype=torch.uint8)] for bucket in sizes]
    dist.barrier()
    cpu = cpu_seconds(pids)
    started = time.perf_counter()
    for tensors in pieces:
        for work in [dist.broadcast(t, 0, async_op=True) for t in tensors]:
            work.wait()
    return time.perf_counter() - started, cpu_seconds(pids) - cpu


def gather_seconds(backend: Any, bucket: int, dtype: torch.dtype | None) -> float:
    """One pass of the shards' gathers in rank 0's `dtype`, bucket by bucket, nothing sent (every rank calls it)."""
    import torch.distributed as dist

    dist.barrier()
    started = time.perf_counter()
    for _ in backend.iter_full_weights(bucket, dtype):
        pass
    return time.perf_counter() - started


async def rank0_syncs(backend: Any, distributed: Any, url: str, bucket: int, syncs: int,
                      case: Case, processes: dict[str, int]) -> list[dict[str, Any]]:
    from rljob.runtime.engines.sglang_client import SGLangClientConfig, SGLangEngine
    from rljob.runtime.ranks import GatheredWeights, OrderSender
    from rljob.runtime.weights.broadcast import DistributedOptions, DistributedTransport
    from rljob.runtime.weights.buckets import module_buckets
    from tests.helpers.rss import PeakRss, heap_malloc

    engine = SGLangEngine(SGLangClientConfig(worker_urls=[url]))
    await engine.start()
    transport = DistributedTransport([engine], DistributedOptions(master_address="127.0.0.1", backend="gloo"))
    gathered = GatheredWeights(backend, bucket, OrderSender(distributed))
    whole = build_tiny_model(seed=0, **SIZES[case.size]) if case.source == "module" else None

    def source(dtype: torch.dtype | None) -> Any:
        if whole is not None:
            return module_buckets(whole, bucket, dtype)
        return gathered(dtype)
    rows = []
    try:
        # Two phases of one warm-up (group set-up, imports; then the heap's first growth) and `syncs` measured
        # syncs: rank 0's peak RSS with glibc told to unmap freed memory (exact_malloc), then the seconds with
        # glibc reusing its heap (heap_malloc), as a trainer's allocator does: the first phase's per-bucket
        # mappings would add page faults to every gathered bucket.
        for version in range(1, 2 * syncs + 3):
            if version == syncs + 2:
                heap_malloc()
            gathered.calls = 0  # rank 1 joins every pass without an order (it knows the count)
            gc.collect()
            # RSS is sampled in the first phase only: the sampling thread would take CPU and the GIL
            # from the timed syncs.
            peak = PeakRss() if version <= syncs + 1 else None
            cpu = {name: cpu_seconds([pid]) for name, pid in processes.items()}
            with peak or contextlib.nullcontext():
                report = await transport.sync(version, lambda dtype: source(dtype if case.gather_in_wire else None))
            cpu = {name: cpu_seconds([pid]) - cpu[name] for name, pid in processes.items()}
            if report.failed or not report.updated:
                raise SystemExit(f"sync {version} failed: {report.failed}")
            if version not in (1, syncs + 2):
                rows.append({"phase": "rss" if peak else "seconds", "seconds": report.seconds,
                             "bytes": report.bytes_sent, "peak_extra_rss": peak.extra if peak else None,
                             "broadcasts": report.broadcasts, "cpu_seconds": cpu})
    finally:
        await transport.close()
        await engine.close()
    return rows


def bench_rank(rank: int, config: dict[str, int], url: str, bucket: int, syncs: int, out: Path, case: Case,
               worker_pid: int) -> None:
    """One trainer rank of one model size (spawned by run_ranks); rank 0 writes out/result.json."""
    import torch.distributed as dist

    from rljob.runtime.training.distributed import DistEnv, Distributed
    from rljob.runtime.training.fsdp import FSDP2Backend
    from tests.helpers.rss import exact_malloc

    if rank == 0:  # the rank whose RSS is measured; heap_malloc again before the timed syncs
        exact_malloc()
    env = DistEnv.from_environ()
    assert env is not None
    distributed = Distributed(env, "cpu")
    backend = FSDP2Backend(build_tiny_model(seed=0, **config), 1e-3, 0.0, distributed)
    sizes = tensor_sizes(config, bucket, case)
    ranks: list[int | None] = [None, None]
    dist.all_gather_object(ranks, os.getpid())
    pids = [int(pid) for pid in ranks if pid is not None]
    if rank == 0:
        processes = {"trainer rank 0": pids[0], "trainer rank 1": pids[1], "worker": worker_pid}
        rows = asyncio.run(rank0_syncs(backend, distributed, url, bucket, syncs, case, processes))
    elif case.source == "fsdp":
        for _ in range(2 * syncs + 2):
            for _ in backend.iter_full_weights(bucket):
                pass
    floor_seconds(sizes, True, pids)  # warm-up
    floors = [floor_seconds(sizes, False, pids) for _ in range(syncs)]
    tensor_floors = [floor_seconds(sizes, True, pids)[0] for _ in range(syncs)]
    gathers = [gather_seconds(backend, bucket, case.plan_dtype if rank == 0 else None)
               for _ in range(syncs if case.source == "fsdp" else 0)]
    if rank == 0:
        (out / "result.json").write_text(json.dumps({"syncs": rows, "floor_seconds": [f for f, _ in floors],
                                                     "floor_cpu_seconds": [c for _, c in floors],
                                                     "tensor_floor_seconds": tensor_floors,
                                                     "gather_seconds": gathers, "floor_bytes": sum(map(sum, sizes)),
                                                     "buckets": len(sizes)}))


def run_case(case: Case, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    config = SIZES[case.size]
    model = build_tiny_model(seed=0, **config)
    path = work / case.size
    if not path.exists():
        model.save_pretrained(path)
    nbytes = sum(p.numel() * case.wire.itemsize for p in model.parameters())  # as it travels
    bucket = int(args.bucket_mb * 2**20)
    out = work / f"{len(list(work.glob('*-out')))}-out"
    out.mkdir()
    procs: list[Any] = []
    try:
        (url,) = start_workers(path, work, 1, procs, prefix=f"{out.name}-w", max_batch_size=2, timeout=300,
                               extra_args=("--dtype", case.served, "--sglang-version", case.release))
        run_ranks(bench_rank, 2, config, url, bucket, args.syncs, out, case, procs[0].pid)
    finally:
        stop(procs)
    raw = json.loads((out / "result.json").read_text())
    syncs = [s for s in raw["syncs"] if s["phase"] == "seconds"]
    rss_syncs = [s for s in raw["syncs"] if s["phase"] == "rss"]
    if any(s["bytes"] != nbytes for s in raw["syncs"]) or raw["floor_bytes"] != nbytes:
        raise SystemExit(f"{case.name}: a sync or the floor did not move the model's {nbytes} bytes: {raw}")
    gb = nbytes / 2**30
    floor = statistics.median(raw["floor_seconds"])
    tensor_floor = statistics.median(raw["tensor_floor_seconds"])
    gather = statistics.median(raw["gather_seconds"]) if raw["gather_seconds"] else None
    median = statistics.median(s["seconds"] for s in syncs)
    cores = os.cpu_count() or 1
    sync_cpu = {name: statistics.median(s["cpu_seconds"][name] for s in syncs) for name in syncs[0]["cpu_seconds"]}
    sync_cpu_total = statistics.median(sum(s["cpu_seconds"].values()) for s in syncs)
    floor_cpu = statistics.median(raw["floor_cpu_seconds"])
    peak = max(s["peak_extra_rss"] for s in rss_syncs)
    return {
        "model": case.name, "size": case.size, "parameters": sum(p.numel() for p in model.parameters()),
        "megabytes": round(nbytes / 2**20, 2), "bucket_megabytes": args.bucket_mb,
        "wire_dtype": f"{case.served} (the worker's --dtype)", "trainer_dtype": "float32",
        "sglang_release": case.release,
        "broadcast_per": "bucket (flattened_bucket)" if case.release != "0.5.5.post3" else "tensor",
        "source": case.source,
        "gathered_in": ("not gathered: one process holds the model" if case.source == "module" else
                        case.served if case.gather_in_wire else "float32, cast per tensor as it is sent (the path before)"),
        "median_seconds": round(median, 4), "seconds_per_gb": round(median / gb, 2),
        "floor_median_seconds": round(floor, 4), "floor_seconds_per_gb": round(floor / gb, 2),
        "gather_median_seconds": round(gather, 4) if gather else None,
        "gather_seconds_per_gb": round(gather / gb, 2) if gather else None,
        "over_floor": round(median / floor, 2), "gather_over_floor": round(gather / floor, 2) if gather else None,
        "sync_cpu_seconds": {name: round(v, 4) for name, v in sync_cpu.items()},
        "sync_cpu_seconds_total": round(sync_cpu_total, 4), "floor_cpu_seconds": round(floor_cpu, 4),
        "floor_cores_busy": round(floor_cpu / floor, 2), "sync_cores_busy": round(sync_cpu_total / median, 2),
        "cpu_bound_over_floor": round(sync_cpu_total / cores / floor, 2),
        "tensor_floor_median_seconds": round(tensor_floor, 4), "tensor_floor_over_floor": round(tensor_floor / floor, 2),
        "over_tensor_floor": round(median / tensor_floor, 2),
        "peak_extra_rss": peak, "peak_extra_rss_megabytes": round(peak / 2**20, 2),
        "peak_rss_buckets": round(peak / bucket, 2), "model_buckets": round(nbytes / bucket, 2),
        "buckets_sent": raw["buckets"], "broadcasts_per_sync": syncs[0]["broadcasts"],
        "all_seconds": [round(s["seconds"], 4) for s in syncs],
        "all_peak_extra_rss": [s["peak_extra_rss"] for s in rss_syncs],
        "all_rss_phase_seconds": [round(s["seconds"], 4) for s in rss_syncs],
        "all_floor_seconds": [round(s, 4) for s in raw["floor_seconds"]],
        "all_tensor_floor_seconds": [round(s, 4) for s in raw["tensor_floor_seconds"]],
        "all_gather_seconds": [round(s, 4) for s in raw["gather_seconds"]],
        "all_sync_cpu_seconds_total": [round(sum(s["cpu_seconds"].values()), 4) for s in syncs],
        "all_floor_cpu_seconds": [round(c, 4) for c in raw["floor_cpu_seconds"]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--syncs", type=int, default=5, help="measured syncs (and floor passes) per size")
    parser.add_argument("--bucket-mb", type=float, default=8.0, help="weight-sync bucket size")
    parser.add_argument("--output", default=str(ROOT / "docs/benchmarks"), help="folder for the JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = [run_case(case, args, Path(tmp)) for case in CASES]
    current = [r for r, case in zip(runs, CASES, strict=True) if case.gather_in_wire]  # the path as it is now
    result = {
        "runs": runs,
        "peak_rss_within_buckets": max(r["peak_rss_buckets"] for r in current),
        "worst_over_floor": max(r["over_floor"] for r in current),
        "worst_over_tensor_floor": max(r["over_tensor_floor"] for r in current),
        "worst_cpu_bound_over_floor": max(r["cpu_bound_over_floor"] for r in current),
        "cores": os.cpu_count(),
        "worst_over_floor_by": {f"{case.served}, {case.release}": max(
            r["over_floor"] for r, c in zip(runs, CASES, strict=True)
            if c.gather_in_wire and (c.served, c.release) == (case.served, case.release))
            for case in CASES if case.gather_in_wire},
        "summaries_over": "the runs of the path as it is (every run but the 'fp32 gather' one, kept for comparison)",
        "trainer_ranks": 2, "engine_workers": 1, "bucket_megabytes": args.bucket_mb,
        "machine": describe(f"torch {torch.__version__}, gloo over loopback, no GPU"),
        "load_average_1min_at_end": load_average(),
    }
    table = Table(title="streamed weight sync, 2 FSDP2 ranks -> 1 SGLang-protocol worker (medians)")
    for col in ("model", "MB on the wire", "buckets", "sync s", "s/GB", "floor s/GB", "gather s/GB", "x floor",
                "per-tensor floor, x floor", "x per-tensor floor", "CPU s per sync", "CPU-bound, x floor",
                "peak extra RSS MB", "in buckets"):
        table.add_column(col)
    for r in runs:
        table.add_row(r["model"], str(r["megabytes"]), str(r["buckets_sent"]), f"{r['median_seconds']:.3f}",
                      f"{r['seconds_per_gb']:.1f}", f"{r['floor_seconds_per_gb']:.1f}",
                      f"{r['gather_seconds_per_gb']:.1f}" if r["gather_seconds_per_gb"] else "-", f"{r['over_floor']:.2f}",
                      f"{r['tensor_floor_over_floor']:.2f}", f"{r['over_tensor_floor']:.2f}",
                      f"{r['sync_cpu_seconds_total']:.3f}", f"{r['cpu_bound_over_floor']:.2f}",
                      f"{r['peak_extra_rss_megabytes']:.1f}", f"{r['peak_rss_buckets']:.2f}")
    console.print(table)
    console.print(f"peak_rss_within_buckets {result['peak_rss_within_buckets']}, "
                  f"worst_over_tensor_floor {result['worst_over_tensor_floor']}, "
                  f"worst_cpu_bound_over_floor {result['worst_cpu_bound_over_floor']}, "
                  f"worst_over_floor {result['worst_over_floor']} (by wire dtype and release: "
                  f"{result['worst_over_floor_by']})")
    console.print(f"machine: {result['machine']}, load {result['load_average_1min_at_end']}")
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "weight_sync.json").write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {out / 'weight_sync.json'}")


if __name__ == "__main__":
    main()
