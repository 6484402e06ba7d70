"""Seconds per GB of a weight sync: `disk` vs `distributed`, two tiny model sizes.

Two SGLang-protocol worker processes (CPU, loopback) take new weights from this process, which
plays trainer rank 0: `distributed` broadcasts bucketed tensors over a gloo weight-update group
(/update_weights_from_distributed), `disk` writes a safetensors snapshot to a local folder and has
both workers load it (/update_weights_from_disk). Each sync is timed end to end, version checks on
every worker included. On a 2-core machine the workers, the trainer and any other load share the
same cores and the "network" is loopback: the figures compare the two paths, they do not predict
a GPU cluster (NCCL over NVLink/InfiniBand, a network file system).
Run: `python benchmarks/weight_sync.py` (writes docs/benchmarks/weight_sync.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.helpers: the same worker launcher the integration tests use

from rljob.runtime.engines.sglang_client import SGLangClientConfig, SGLangEngine  # noqa: E402
from rljob.runtime.weights.disk import DiskTransport  # noqa: E402
from rljob.runtime.weights.broadcast import DistributedOptions, DistributedTransport  # noqa: E402
from rljob.runtime.weights.buckets import module_buckets  # noqa: E402
from rljob.runtime.weights.transport import WeightTransport  # noqa: E402
from machine_info import describe, load_average  # noqa: E402  # benchmarks/machine_info.py
from tests.helpers.processes import start_workers, stop  # noqa: E402
from tests.helpers.tiny_model import build_tiny_model  # noqa: E402

console = Console()
SIZES = {"small": {"hidden_size": 256, "layers": 4, "vocab_size": 4096},
         "medium": {"hidden_size": 512, "layers": 8, "vocab_size": 8192}}


async def time_transport(transport: WeightTransport, model: torch.nn.Module, syncs: int, bucket: int,
                         first_version: int) -> list[float]:
    seconds = []
    for i in range(syncs):
        report = await transport.sync(first_version + i, lambda: module_buckets(model, bucket))
        if report.failed or len(report.updated) != 2:
            raise SystemExit(f"{transport.mode} sync failed: {report.failed}")
        seconds.append(report.seconds)
    return seconds


async def run_size(name: str, config: dict[str, int], args: argparse.Namespace, work: Path) -> list[dict]:
    model = build_tiny_model(seed=0, **config)
    path = work / name
    model.save_pretrained(path)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    procs = []
    try:
        urls = start_workers(path, work, 2, procs, prefix=f"{name}-w", max_batch_size=2, timeout=300)
        engine = SGLangEngine(SGLangClientConfig(worker_urls=urls))
        await engine.start()
        bucket = int(args.bucket_mb * 2**20)
        transports: list[WeightTransport] = [
            DistributedTransport([engine], DistributedOptions(master_address="127.0.0.1", backend="gloo")),
            DiskTransport([engine], work / f"{name}-snapshots", keep_last=2, write_config=model.config.save_pretrained),
        ]
        rows = []
        version = 1
        for transport in transports:
            await time_transport(transport, model, 1, bucket, version)  # warm-up: group set-up, page cache
            version += 1
            seconds = await time_transport(transport, model, args.syncs, bucket, version)
            version += args.syncs
            median = statistics.median(seconds)
            rows.append({"model": name, "parameters": sum(p.numel() for p in model.parameters()),
                         "megabytes": round(nbytes / 2**20, 2), "transport": transport.mode, "syncs": args.syncs,
                         "median_seconds": round(median, 4), "seconds_per_gb": round(median / (nbytes / 2**30), 2),
                         "all_seconds": [round(s, 4) for s in seconds]})
            await transport.close()
        await engine.close()
        return rows
    finally:
        stop(procs)


async def run(args: argparse.Namespace) -> dict:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in SIZES.items():
            rows += await run_size(name, config, args, Path(tmp))
    return {"rows": rows, "bucket_megabytes": args.bucket_mb, "workers": 2,
            "machine": describe(f"torch {torch.__version__}, gloo over loopback, no GPU"),
            "load_average_1min_at_end": load_average()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--syncs", type=int, default=5, help="measured syncs per transport and size")
    parser.add_argument("--bucket-mb", type=float, default=16.0, help="broadcast bucket / snapshot shard size")
    parser.add_argument("--output", default=str(ROOT / "docs/benchmarks"), help="folder for the JSON")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    table = Table(title="weight sync to 2 SGLang-protocol workers (median of the measured syncs)")
    for col in ("model", "MB", "transport", "median s", "s per GB"):
        table.add_column(col)
    for r in result["rows"]:
        table.add_row(r["model"], str(r["megabytes"]), r["transport"], f"{r['median_seconds']:.3f}",
                      f"{r['seconds_per_gb']:.1f}")
    console.print(table)
    console.print(f"machine: {result['machine']}, load {result['load_average_1min_at_end']}")
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "weight_sync.json").write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {out / 'weight_sync.json'}")


if __name__ == "__main__":
    main()
