"""Trainer step time with 1 and with 2 data-parallel ranks (FSDP2 over gloo on CPU), side by side.

One fixed batch of groups (prompt + response token counts spread like an APRIL round), a small
random Qwen2 (fp32), the real `Trainer.train_step` (old-policy pass, PPO update, AdamW). Variants:

- 1 rank x 1 thread: one process, the single-process backend;
- 1 rank x 2 threads: the same with torch's intra-op parallelism over both cores;
- 2 ranks x 1 thread: FSDP2 (`fully_shard`), each rank trains its token-balanced half of the groups;
  gloo over loopback carries the all-gathers, reduce-scatters and the global loss denominators.

Each variant runs in fresh processes: one warm-up step, then `--repeats` timed steps (the same batch
every time, so the optimizer really steps and every step does the same work). The variants run
interleaved, `--rounds` times over (A B C A B C ...), so that load from other work on a shared machine
falls on all of them alike; each round records the load average. Two figures per step:

- wall seconds (median over all rounds' steps): what a user waits;
- CPU seconds summed over the ranks (process CPU time, intra-op threads included): the work done,
  which other load on the machine disturbs far less than wall time.

Prints a table and writes docs/benchmarks/trainer_scaling.json.

Run: .venv/bin/python benchmarks/trainer_scaling.py [--repeats 3] [--rounds 3] [--groups 32]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from machine_info import describe, load_average

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "trainer_scaling.json"
VOCAB = 2048


def _model() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False)
    return Qwen2ForCausalLM(config).eval()


def _batch(groups: int) -> list[Any]:
    from rljob.runtime.rollout.sample import Group, Sample, SampleStatus

    rng = random.Random(0)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(16, 48))]
        samples = []
        for i in range(4):
            # Long-tailed responses: most short, a few long (as a resumed APRIL group).
            n = min(256, int(rng.lognormvariate(3.6, 0.8)) + 2)
            samples.append(Sample(group_id=f"g{g}", index=i, prompt_ids=prompt, answer="",
                                  status=SampleStatus.COMPLETED, response_ids=[rng.randrange(1, VOCAB) for _ in range(n)],
                                  logprobs=[-2.0] * n, versions=[0] * n, reward=rng.random()))
        out.append(Group(group_id=f"g{g}", prompt_text="", samples=samples))
    return out


def _rank(rank: int, world: int, port: int, threads: int, args: argparse.Namespace, out: str) -> None:
    from rljob.api.spec import AlgorithmSpec
    from rljob.runtime.ranks import group_tokens
    from rljob.runtime.trainer import Trainer
    from rljob.runtime.training.balance import balance_by_tokens

    torch.set_num_threads(threads)
    distributed = None
    groups = _batch(args.groups)
    mine = groups
    if world > 1:
        from rljob.runtime.training.distributed import DistEnv, Distributed

        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env = DistEnv.from_environ()
        assert env is not None
        distributed = Distributed(env, "cpu")
        shares = balance_by_tokens([group_tokens(g) for g in groups], world)
        mine = [groups[i] for i in shares[rank]]
    trainer = Trainer(_model(), AlgorithmSpec(learning_rate=1e-5), micro_batch_size=args.micro_batch,
                      distributed=distributed)
    seconds, cpu_seconds = [], []
    for _ in range(args.repeats + 1):
        start, cpu_start = time.perf_counter(), time.process_time()
        metrics = trainer.train_step(mine, policy_version=0)
        seconds.append(time.perf_counter() - start)
        cpu_seconds.append(time.process_time() - cpu_start)
    tokens = sum(group_tokens(g) for g in mine)
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "seconds": seconds[1:], "cpu_seconds": cpu_seconds[1:], "samples": metrics.samples, "tokens": tokens,
        "loss": metrics.loss}))
    if distributed is not None:
        from rljob.runtime.cli.run_job import end_rank_process

        distributed.close()
        end_rank_process(0)  # skips the teardown that now and then aborts a finished rank (docs/distributed.md)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


VARIANTS = [(1, 1), (1, 2), (2, 1)]  # (ranks, threads per rank)


def run_variant(world: int, threads: int, args: argparse.Namespace) -> dict[str, Any]:
    """One fresh run of a variant: per timed step, rank 0's wall seconds and the ranks' summed CPU seconds."""
    load = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(world, _free_port(), threads, args, tmp), nprocs=world, start_method="spawn")
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
    cpu = [sum(step) for step in zip(*(r["cpu_seconds"] for r in ranks))]
    return {"load_average": load, "steps_s": ranks[0]["seconds"], "cpu_steps_s": cpu, "samples": ranks[0]["samples"],
            "tokens_on_rank0": ranks[0]["tokens"], "loss": ranks[0]["loss"]}


def summarise(world: int, threads: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A variant's row: medians over every timed step of every round."""
    steps = [s for run in runs for s in run["steps_s"]]
    cpu = [s for run in runs for s in run["cpu_steps_s"]]
    return {"ranks": world, "threads_per_rank": threads, "median_step_s": statistics.median(steps),
            "median_cpu_s": statistics.median(cpu), "samples": runs[0]["samples"],
            "tokens_on_rank0": runs[0]["tokens_on_rank0"], "loss": runs[0]["loss"], "rounds": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per run, after one warm-up")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved runs of every variant")
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    load_before = load_average()
    runs: dict[tuple[int, int], list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for round_ in range(args.rounds):
        for world, threads in VARIANTS:
            runs[(world, threads)].append(run_variant(world, threads, args))
            print(f"round {round_ + 1}/{args.rounds}: {world} rank x {threads} thread done", flush=True)
    rows = [summarise(world, threads, runs[(world, threads)]) for world, threads in VARIANTS]
    base = rows[0]["median_step_s"]
    print(f"{'variant':<22}{'wall s':>9}{'x 1 rank':>10}{'CPU s':>9}{'tokens on rank 0':>18}")
    for r in rows:
        r["speedup_vs_1x1"] = base / r["median_step_s"]
        name = f"{r['ranks']} rank x {r['threads_per_rank']} thread"
        print(f"{name:<22}{r['median_step_s']:>9.2f}{r['speedup_vs_1x1']:>10.2f}{r['median_cpu_s']:>9.2f}"
              f"{r['tokens_on_rank0']:>18}")
    result = {
        "machine": describe(f"torch {torch.__version__}"),
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "model": "Qwen2, 4 layers, hidden 256, vocab 2048, fp32",
        "groups": args.groups,
        "samples_per_group": 4,
        "micro_batch": args.micro_batch,
        "repeats": args.repeats,
        "rounds": args.rounds,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
