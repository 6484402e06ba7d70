"""GPU smoke check of the runtime's device paths, sized for one lent GPU (see tests/gpu/README.md).

With a tiny Qwen3 built locally (no network), on one device:

- engine: the embedded engine decodes in bf16 (the SGLang stand-in the CPU tests use);
- train: a bf16 FSDP2 training step (fully_shard over a one-rank process group: NCCL on CUDA);
- logprobs: the trainer's log-probs of the engine's tokens agree with the engine's within bf16 tolerance,
  and far better than with the tokens misaligned by one (so the check can fail);
- weight group: the trained weights go as FSDP2's full-weight buckets through the weight-update group's
  code path (TCPStore + ProcessGroupNCCL broadcast from rank 0: the only rank one GPU allows) into the
  engine, which then serves version 1 with exactly the trainer's weights (cast to bf16) and agrees on
  log-probs again.

Real SGLang (several GB of kernels) and a two-rank NCCL group (one GPU per rank) cannot run on one GPU.
Exits non-zero on any failure and prints a summary table. `--device cpu` runs the same on CPU (gloo).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import math
import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# bf16 log-probs of a tiny model: bf16 keeps 8 bits of mantissa, so a logit of magnitude ~4 is off by
# up to ~0.02 between two kernels; a log-softmax over 384 tokens adds a little. Misaligned tokens
# differ by whole nats.
MAX_ABS_LOGP_DIFF = 0.15
MEAN_ABS_LOGP_DIFF = 0.03
MISALIGNED_MARGIN = 10.0  # the misaligned mean difference must be at least this many times the aligned one
PROMPTS = 8
SAMPLES_PER_PROMPT = 2
NEW_TOKENS = 24
BUCKET_BYTES = 64 * 1024  # small buckets: the tiny model still takes several


@dataclass
class Check:
    """One row of the summary table."""

    name: str
    ok: bool | None = None  # None: not run (an earlier check it needs failed)
    seconds: float = 0.0
    detail: str = ""


@dataclass
class Smoke:
    """The state the checks hand on to each other."""

    device: str
    workdir: Path
    checks: list[Check] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)

    def run(self, name: str, fn: Callable[[], str], needs: tuple[str, ...] = ()) -> None:
        """Run one check, recording pass/fail, time and a one-line detail; never raises."""
        check = Check(name)
        self.checks.append(check)
        missing = [n for n in needs if not any(c.name == n and c.ok for c in self.checks)]
        if missing:
            check.detail = f"not run: needs {', '.join(missing)}"
            return
        started = time.perf_counter()
        try:
            check.detail = fn()
            check.ok = True
        except Exception as exc:  # a smoke check reports every failure and goes on
            check.ok = False
            check.detail = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        check.seconds = time.perf_counter() - started


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def environment(smoke: Smoke) -> str:
    info = [f"torch {torch.__version__}", f"python {sys.version.split()[0]}"]
    if smoke.device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda but torch.cuda.is_available() is False")
        props = torch.cuda.get_device_properties(0)
        version = torch.cuda.nccl.version()  # a tuple in current torch, an int (2.27.3 -> 22703) in older ones
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        info += [f"{props.name} ({props.total_memory / 2**30:.0f} GiB)", f"CUDA {torch.version.cuda}", f"NCCL {nccl}"]
        if not torch.cuda.is_bf16_supported():
            raise RuntimeError("this GPU has no bf16")
    return ", ".join(info)


def build_model(smoke: Smoke) -> str:
    from rljob.runtime.models.tiny import TinyModelRecipe, build_tiny_model

    # A wider initialisation than a trained model's: peaked logits, so log-prob comparisons mean something.
    recipe = TinyModelRecipe(family="qwen3", initializer_range=0.2, seed=7)
    folder = build_tiny_model(smoke.workdir / "tiny-qwen3", recipe)
    smoke.state["folder"] = folder
    return f"{folder.name}: qwen3, {recipe.layers} layers, hidden {recipe.hidden_size}, vocab {recipe.vocab_size}"


async def _generate(engine: Any, prompts: list[list[int]], tag: str) -> list[Any]:
    from rljob.runtime.engines.base import GenerateRequest

    requests = [
        GenerateRequest(rid=f"{tag}-{i}-{j}", input_ids=p, max_new_tokens=NEW_TOKENS, temperature=1.0)
        for i, p in enumerate(prompts) for j in range(SAMPLES_PER_PROMPT)
    ]
    return list(await asyncio.gather(*(engine.generate(r) for r in requests)))


def engine_decode(smoke: Smoke) -> str:
    from transformers import AutoTokenizer

    from rljob.runtime.engines.embedded import EmbeddedEngine

    folder = smoke.state["folder"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"{i} + {i * 7} = ?"}],
                                             add_generation_prompt=True, tokenize=True) for i in range(PROMPTS)]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    loop = asyncio.new_event_loop()
    engine = EmbeddedEngine(folder, max_batch_size=64, seed=0, device=smoke.device, dtype=torch.bfloat16)
    loop.run_until_complete(engine.start())
    results = loop.run_until_complete(_generate(engine, prompts, "v0"))
    smoke.state.update(loop=loop, engine=engine, prompts=prompts, results=results)
    param = next(engine.model.parameters())
    if param.device.type != smoke.device or param.dtype != torch.bfloat16:
        raise RuntimeError(f"engine weights on {param.device} in {param.dtype}, expected {smoke.device} bf16")
    tokens = sum(len(r.output_ids) for r in results)
    if any(not r.output_ids for r in results) or any(not math.isfinite(x) for r in results for x in r.output_logprobs):
        raise RuntimeError("an empty response or a non-finite log-prob")
    if {r.weight_version for r in results} != {0}:
        raise RuntimeError(f"served versions {sorted({r.weight_version for r in results})}, expected [0]")
    return f"{len(results)} responses, {tokens} tokens, version 0, weights {param.device} bf16"


def _groups(smoke: Smoke, results: list[Any], version: int) -> list[Any]:
    from rljob.runtime.rollout.sample import Group, Sample, SampleStatus

    groups = []
    for i, prompt in enumerate(smoke.state["prompts"]):
        samples = []
        for j in range(SAMPLES_PER_PROMPT):
            r = results[i * SAMPLES_PER_PROMPT + j]
            s = Sample(group_id=f"g{i}", index=j, prompt_ids=list(prompt), answer="")
            s.append(list(r.output_ids), list(r.output_logprobs), version)
            s.status = SampleStatus.COMPLETED
            s.reward = float(j % 2)  # different rewards in every group: every sample has an advantage
            samples.append(s)
        groups.append(Group(group_id=f"g{i}", prompt_text="", samples=samples, prompt_index=i))
    return groups


def init_trainer(smoke: Smoke) -> str:
    from transformers import AutoModelForCausalLM

    from rljob.api.spec import AlgorithmSpec
    from rljob.runtime.trainer import Trainer
    from rljob.runtime.training.distributed import DistEnv, Distributed

    port = free_port()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist = Distributed(DistEnv(0, 1, 0, 1, "127.0.0.1", port), smoke.device)
    device = dist.device(smoke.device)
    model = AutoModelForCausalLM.from_pretrained(smoke.state["folder"], dtype=torch.bfloat16)
    spec = AlgorithmSpec(name="grpo", learning_rate=1e-3, off_policy={"mode": "tis"})
    trainer = Trainer(model, spec, micro_batch_size=8, device=device, distributed=dist)
    smoke.state.update(trainer=trainer, dist=dist)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    shard = next(trainer.model.parameters())
    if not isinstance(trainer.model, FSDPModule) or not isinstance(shard, DTensor):
        raise RuntimeError("the trainer's model is not sharded with fully_shard")
    return f"FSDP2 over a 1-rank {dist.backend} group; shards {shard.device} {shard.dtype}, compute bf16"


def _trainer_logps(smoke: Smoke, groups: list[Any], version: int) -> list[torch.Tensor]:
    """The trainer's own π_old log-probs of each response (its real micro-batch path)."""
    trainer = smoke.state["trainer"]
    items, _ = trainer._items(groups, version)
    trainer._fill_logps(items, old=True)
    return [it.old_logp.float() for it in items]


def compare_logprobs(smoke: Smoke, results: list[Any], version: int) -> str:
    groups = _groups(smoke, results, version)
    trainer_logps = _trainer_logps(smoke, groups, version)
    engine_logps = [torch.tensor(r.output_logprobs, dtype=torch.float32) for r in results if r.output_ids]
    aligned = torch.cat([(t - e).abs() for t, e in zip(trainer_logps, engine_logps, strict=True)])
    misaligned = torch.cat([(t[1:] - e[:-1]).abs() for t, e in zip(trainer_logps, engine_logps, strict=True)])
    detail = (f"{aligned.numel()} tokens: max |Δ| {aligned.max():.4f}, mean {aligned.mean():.4f} "
              f"(misaligned by one: mean {misaligned.mean():.3f})")
    if aligned.max() > MAX_ABS_LOGP_DIFF or aligned.mean() > MEAN_ABS_LOGP_DIFF:
        raise RuntimeError(f"{detail}; tolerance max {MAX_ABS_LOGP_DIFF}, mean {MEAN_ABS_LOGP_DIFF}")
    if misaligned.mean() < MISALIGNED_MARGIN * aligned.mean():
        raise RuntimeError(f"{detail}; the check cannot tell aligned from misaligned tokens")
    return detail


def train_step(smoke: Smoke) -> str:
    trainer = smoke.state["trainer"]
    before = {n: t.clone() for b in trainer.backend.iter_full_weights(BUCKET_BYTES) for n, t in b}
    metrics = trainer.train_step(_groups(smoke, smoke.state["results"], 0), policy_version=0)
    after = {n: t for b in trainer.backend.iter_full_weights(BUCKET_BYTES) for n, t in b}
    moved = sum(not torch.equal(before[n], after[n]) for n in before)
    if not (math.isfinite(metrics.loss) and math.isfinite(metrics.grad_norm) and metrics.grad_norm > 0):
        raise RuntimeError(f"loss {metrics.loss}, grad norm {metrics.grad_norm}")
    if metrics.optimizer_steps < 1 or moved == 0:
        raise RuntimeError(f"{metrics.optimizer_steps} optimizer steps, {moved} tensors changed")
    return (f"loss {metrics.loss:.4f}, grad norm {metrics.grad_norm:.3f}, {metrics.tokens} tokens, "
            f"{moved}/{len(before)} tensors changed")


def weight_group(smoke: Smoke) -> str:
    from rljob.runtime.weight_group import create_group, dtype_name, dtype_of, open_store
    from rljob.runtime.weights.tensor import TensorTransport

    trainer, engine, loop = smoke.state["trainer"], smoke.state["engine"], smoke.state["loop"]
    backend = "nccl" if smoke.device == "cuda" else "gloo"
    # Formed as rank 0 forms the real group (SGLang's store layout and torch's group helper), with no engine rank.
    group = create_group(open_store("127.0.0.1", 0, 1, 60.0), "rljob-smoke", 1, backend, 60.0)
    received: list[list[tuple[str, torch.Tensor]]] = []
    nbytes = 0
    try:
        for bucket in trainer.backend.iter_full_weights(BUCKET_BYTES, torch.bfloat16):  # gathered in the wire dtype
            out = []
            if any(t.dtype != torch.bfloat16 or t.device != group.device for _, t in bucket if t.is_floating_point()):
                raise RuntimeError("the gather did not give bf16 tensors on the broadcasting device")
            for name, tensor in bucket:  # as DistributedTransport._broadcast sends it
                sent = tensor.detach().to(group.device).contiguous()
                group.broadcast(sent)
                if dtype_of(dtype_name(sent.dtype)) != sent.dtype:
                    raise RuntimeError(f"dtype name round trip lost {sent.dtype}")
                out.append((name, sent))
                nbytes += sent.numel() * sent.element_size()
            received.append(out)
    finally:
        group.close()
    report = loop.run_until_complete(TensorTransport([engine]).sync(1, lambda _dtype: iter(received)))
    if not report.ok or engine.served_version() != 1:
        raise RuntimeError(f"engine serves {engine.served_version()} after the sync: {report.failed}")
    served = dict(engine.model.named_parameters(remove_duplicate=False))  # tied weights under each name
    expected = {n: t for b in received for n, t in b}
    differ = [n for n, t in expected.items() if not torch.equal(served[n].detach(), t.to(served[n].device, torch.bfloat16))]
    if differ or set(expected) != set(served):
        raise RuntimeError(f"served weights differ from the trainer's: {differ[:3]}, "
                           f"missing {sorted(set(served) - set(expected))[:3]}")
    return (f"{len(received)} buckets, {nbytes / 2**20:.2f} MiB over a 1-rank {backend} group on {group.device}; "
            f"engine serves version 1 = trainer weights")


def logprobs_after_sync(smoke: Smoke) -> str:
    loop, engine = smoke.state["loop"], smoke.state["engine"]
    results = loop.run_until_complete(_generate(engine, smoke.state["prompts"], "v1"))
    if {r.weight_version for r in results} != {1}:
        raise RuntimeError(f"tokens stamped {sorted({r.weight_version for r in results})}, expected [1]")
    return compare_logprobs(smoke, results, 1)


def table(checks: list[Check]) -> str:
    rows = [("check", "result", "seconds", "detail")]
    rows += [(c.name, {True: "PASS", False: "FAIL", None: "SKIP"}[c.ok], f"{c.seconds:.1f}", c.detail) for c in checks]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [" | ".join([*(r[i].ljust(widths[i]) for i in range(3)), r[3]]) for r in rows]
    lines.insert(1, "-+-".join(["-" * w for w in widths] + ["-" * 6]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--workdir", type=Path, default=None, help="where the tiny model is built (default: a temp dir)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rljob-smoke-") as tmp:
        smoke = Smoke(args.device, args.workdir or Path(tmp))
        smoke.run("environment", lambda: environment(smoke))
        smoke.run("tiny qwen3 built", lambda: build_model(smoke), needs=("environment",))
        smoke.run("(b) engine decodes bf16", lambda: engine_decode(smoke), needs=("tiny qwen3 built",))
        smoke.run("(a) FSDP2 trainer set up", lambda: init_trainer(smoke), needs=("tiny qwen3 built",))
        both = ("(b) engine decodes bf16", "(a) FSDP2 trainer set up")
        smoke.run("(c) log-probs agree, v0", lambda: compare_logprobs(smoke, smoke.state["results"], 0), needs=both)
        smoke.run("(a) bf16 FSDP2 step", lambda: train_step(smoke), needs=both)
        smoke.run("(d) weight-update group", lambda: weight_group(smoke), needs=("(a) bf16 FSDP2 step",))
        smoke.run("(c) log-probs agree, v1", lambda: logprobs_after_sync(smoke), needs=("(d) weight-update group",))
        if "engine" in smoke.state:
            smoke.state["loop"].run_until_complete(smoke.state["engine"].close())
        if "dist" in smoke.state:
            smoke.state["dist"].close()
    failed = [c for c in smoke.checks if not c.ok]
    print(f"\nrljob GPU smoke on {args.device} ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}), "
          f"{time.perf_counter() - started:.0f} s")
    print(table(smoke.checks))
    print(f"\n{'FAILED: ' + ', '.join(c.name for c in failed) if failed else 'ALL PASSED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
