"""The trainer's step with samples packed several to a row against one right-padded sample per row.

The quickstart's policy (tiny-arith), algorithm and micro-batch size, on two batches of 16 prompts x 8
samples:

- quickstart round: the answers the warmed-up policy itself generates (the embedded engine, the
  quickstart's temperature and length limit): the start of training, short answers;
- long tail: the same prompts with answers of log-normal lengths up to the length limit, the shape of a
  later APRIL round whose resumed partials run long (tokens drawn from the generated answers).

Each variant trains the batch from the same weights (a fresh copy and optimizer each time: every step
does the same work), one warm-up step, then `--repeats` timed steps, the variants interleaved. The trainer
runs as it does in a disaggregated run: one core (sched_setaffinity), one torch thread. Reported per
batch and variant: the median step, the token positions the model computes (rows x width, summed over
micro-batches) against the real tokens, the forward/backward passes, and the step's loss and gradient
norm, which must agree between the variants (packing changes the layout, not the update).

Run: .venv/bin/python benchmarks/sequence_packing.py [--repeats 7] (about 1 minute on 2 cores; writes
docs/benchmarks/sequence_packing.json).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from machine_info import describe, load_average  # noqa: E402  # benchmarks/machine_info.py
from rljob.api.load import load_rljob  # noqa: E402
from rljob.runtime import job_parts  # noqa: E402
from rljob.runtime.engines.base import GenerateRequest  # noqa: E402
from rljob.runtime.rollout.sample import Group, Sample, SampleStatus  # noqa: E402
from rljob.runtime.trainer import Trainer  # noqa: E402
from rljob.runtime.training.packing import grid_tokens, micro_batch_rows  # noqa: E402

console = Console(width=120)
JOB = ROOT / "docs/examples/quickstart.yaml"
VARIANTS = {"packed": True, "padded": False}


def _group(index: int, prompt_ids: list[int], responses: list[tuple[list[int], list[float]]]) -> Group:
    # Rewards alternate so every sample has an advantage; the step's work does not depend on them.
    samples = [
        Sample(group_id=f"g{index}", index=i, prompt_ids=prompt_ids, answer="", response_ids=ids, logprobs=logps,
               versions=[0] * len(ids), status=SampleStatus.COMPLETED, reward=float(i % 2))
        for i, (ids, logps) in enumerate(responses)
    ]
    return Group(group_id=f"g{index}", prompt_text="", samples=samples)


async def _generate(engine: Any, prompts: list[list[int]], per_prompt: int, max_tokens: int, temperature: float,
                    stop: list[int]) -> list[list[Any]]:
    await engine.start()
    try:
        results = await asyncio.gather(*(
            engine.generate(GenerateRequest(f"p{p}-{i}", ids, max_tokens, temperature=temperature, stop_token_ids=stop))
            for p, ids in enumerate(prompts) for i in range(per_prompt)))
    finally:
        await engine.close()
    return [results[p * per_prompt : (p + 1) * per_prompt] for p in range(len(prompts))]


def batches(job: Any, policy: Any) -> dict[str, list[Group]]:
    """The two batches: the policy's own answers, and the same prompts with long-tailed answers."""
    spec = job.spec
    stream = job_parts.build_prompts(job, policy.tokenizer, policy.model)
    prompts = [stream.next_prompt().prompt_ids for _ in range(spec.rollout.rollout_batch_size)]
    engine = job_parts.build_engines(job, copy.deepcopy(policy.model))[0]
    generated = asyncio.run(_generate(engine, prompts, spec.rollout.samples_per_prompt,
                                      spec.rollout.max_response_length, spec.rollout.temperature,
                                      policy.stop_token_ids))
    real = [_group(p, ids, [(r.output_ids, r.output_logprobs) for r in results])
            for p, (ids, results) in enumerate(zip(prompts, generated))]
    rng = random.Random(0)
    pool = [t for results in generated for r in results for t in r.output_ids]
    limit = spec.rollout.max_response_length
    long_tail = []
    for p, ids in enumerate(prompts):
        lengths = [min(limit, 4 + int(rng.lognormvariate(3.6, 0.9))) for _ in range(spec.rollout.samples_per_prompt)]
        long_tail.append(_group(p, ids, [([rng.choice(pool) for _ in range(n)], [-1.0] * n) for n in lengths]))
    return {"quickstart round": real, "long tail": long_tail}


def run(args: argparse.Namespace) -> dict[str, Any]:
    job = load_rljob(JOB)
    spec = job.spec
    policy = job_parts.open_policy_for_training(job)
    groups_by_batch = batches(job, policy)
    core = max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})  # the trainer's side of a disaggregated run: one core, one thread
    torch.set_num_threads(1)

    def step(groups: list[Group], packed: bool) -> tuple[float, Any]:
        trainer = Trainer(copy.deepcopy(policy.model), spec.algorithm, spec.trainer.micro_batch_size,
                          temperature=spec.rollout.temperature, total_steps=spec.trainer.steps,
                          seed=spec.trainer.seed, pack_sequences=packed)
        batch = copy.deepcopy(groups)
        started = time.perf_counter()
        metrics = trainer.train_step(batch, policy_version=0)
        return time.perf_counter() - started, metrics

    rows: list[dict[str, Any]] = []
    for name, groups in groups_by_batch.items():
        lengths = [len(s.prompt_ids) + s.response_length for g in groups for s in g.samples if s.response_length]
        seconds: dict[str, list[float]] = {v: [] for v in VARIANTS}
        metrics: dict[str, Any] = {}
        for packed in VARIANTS.values():
            step(groups, packed)  # warm-up
        for _ in range(args.repeats):
            for v, packed in VARIANTS.items():
                took, metrics[v] = step(groups, packed)
                seconds[v].append(took)
        for v, packed in VARIANTS.items():
            layout = micro_batch_rows(lengths, spec.trainer.micro_batch_size, packed)
            rows.append({
                "batch": name, "variant": v, "samples": len(lengths), "tokens": sum(lengths),
                "longest": max(lengths), "computed_tokens": grid_tokens(layout, lengths), "passes": len(layout),
                "step_seconds": statistics.median(seconds[v]), "step_seconds_all": seconds[v],
                "loss": metrics[v].loss, "grad_norm": metrics[v].grad_norm, "entropy": metrics[v].entropy,
            })
    return {"rows": rows, "core": core, "micro_batch_size": spec.trainer.micro_batch_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per batch and variant")
    parser.add_argument("--output", default=str(ROOT / "docs/benchmarks"), help="folder for the JSON")
    args = parser.parse_args()
    result = run(args)
    rows = result["rows"]
    table = Table(title="train step: packed rows vs one padded sample per row (1 core, 1 thread)")
    for column in ("batch", "variant", "tokens", "computed", "passes", "step s", "speed-up", "loss", "grad norm"):
        table.add_column(column)
    summary: dict[str, Any] = {}
    for packed, padded in zip(rows[::2], rows[1::2]):
        speedup = padded["step_seconds"] / packed["step_seconds"]
        summary[packed["batch"]] = {
            "packed_speedup": speedup,
            "computed_tokens_saved": 1 - packed["computed_tokens"] / padded["computed_tokens"],
            # The GRPO loss at ratio 1 sums to about 0 (advantages are centred per group): compare it
            # absolutely, and the gradient norm and entropy relatively.
            "loss_abs_diff": abs(packed["loss"] - padded["loss"]),
            "entropy_rel_diff": abs(packed["entropy"] - padded["entropy"]) / max(padded["entropy"], 1e-12),
            "grad_norm_rel_diff": abs(packed["grad_norm"] - padded["grad_norm"]) / max(padded["grad_norm"], 1e-12),
        }
        for row in (packed, padded):
            table.add_row(row["batch"], row["variant"], str(row["tokens"]), str(row["computed_tokens"]),
                          str(row["passes"]), f"{row['step_seconds']:.3f}",
                          f"{speedup:.2f}x" if row is packed else "", f"{row['loss']:.4e}", f"{row['grad_norm']:.4f}")
    console.print(table)
    out = {
        "benchmark": "sequence_packing",
        "job": str(JOB.relative_to(ROOT)),
        "micro_batch_size": result["micro_batch_size"],
        "repeats": args.repeats,
        "summary": summary,
        "rows": rows,
        "machine": describe(f"torch {torch.__version__}, trainer pinned to core {result['core']}, 1 torch thread, no GPU"),
        "load_average_1min_at_end": load_average(),
    }
    path = Path(args.output) / "sequence_packing.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
