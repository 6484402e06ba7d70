"""Peak memory and step time of the trainer's log-prob computation: naive vs chunked, Qwen vocabulary.

A tiny Qwen2 body (2 layers, hidden 64) with Qwen's 151,936-token vocabulary, so the output layer
dominates exactly as it does in a real model's loss. Each variant runs forward + backward of the
policy-gradient loss on one micro-batch of prompt + response sequences:

- naive: what the trainer did before issue 11: `model(ids).logits` over every position
  (prompt included), the response positions gathered into a float32 [B, R, V] tensor, a full
  log-softmax and entropy, all kept alive by autograd until the backward pass;
- chunked/<n>: `Trainer._token_stats`: the decoder body, the response positions only, logits in
  checkpointed chunks of n tokens (runtime/algorithms/logprobs.py); peak memory is bounded by the
  chunk (a few [n, V] float32 tensors), whatever the micro-batch.

Each variant runs in its own process (a fresh allocator) and reports its peak memory growth over
the set-up (CPU: peak RSS from getrusage minus the RSS before the step; CUDA: max_memory_allocated
minus the allocation before the step) and the median step time of `--repeats` steps after one warm-up.
Prints a table and writes docs/benchmarks/trainer_memory[_<device>].json.

Run: .venv/bin/python benchmarks/trainer_memory.py [--device cuda] [--batch 16]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import torch

VOCAB = 151_936
OUT_DIR = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _build(args: argparse.Namespace, chunk: int) -> tuple[Any, Any, Any]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rljob.api.spec import AlgorithmSpec
    from rljob.runtime.trainer import Trainer, _TrainItem

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=args.prompt + args.response + 8, tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config).eval()
    trainer = Trainer(model, AlgorithmSpec(), micro_batch_size=args.batch, device=args.device,
                      temperature=0.8, logprob_chunk_tokens=chunk, pack_sequences=False)
    gen = torch.Generator().manual_seed(1)
    items = []
    for i in range(args.batch):
        # Response lengths spread like a rollout's: the longest sets the padding.
        n = args.response - (i * args.response) // (2 * args.batch)
        ids = torch.randint(0, VOCAB, (args.prompt + n,), generator=gen).tolist()
        items.append(_TrainItem(input_ids=ids, prompt_length=args.prompt, rollout_logp=[-1.0] * n,
                                stale=[False] * n, advantage=1.0 if i % 2 else -1.0))
    return trainer, trainer._collate([[it] for it in items]), model  # one sample per row, right-padded


def _naive_token_stats(model: Any, mb: Any, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    # The pre-issue-11 trainer: full logits, gathered to [B, R, V] float32, full log-softmax.
    logits = model(input_ids=mb.input_ids).logits
    logits = logits.flatten(0, 1)[mb.positions].float() / temperature  # [B, R, V]
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = torch.gather(logp_all, -1, mb.targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def _step(variant: str, trainer: Any, mb: Any, model: Any) -> None:
    if variant == "naive":
        logp, entropy = _naive_token_stats(model, mb, trainer.temperature)
    else:
        logp, entropy = trainer._token_stats(model, mb)
    mask = mb.response_mask
    # -A·ratio at ratio 1 (the first PPO update), token mean: the loss shape does not change memory.
    loss = -(mb.advantages.unsqueeze(-1) * torch.exp(logp - logp.detach()) * mask).sum() / mask.sum()
    loss = loss + 0.0 * (entropy * mask).sum()
    loss.backward()
    model.zero_grad(set_to_none=True)


def _run_variant(variant: str, chunk: int, args: argparse.Namespace, queue: Any) -> None:
    torch.set_num_threads(args.threads)
    trainer, mb, model = _build(args, chunk)
    cuda = args.device.startswith("cuda")
    _step(variant, trainer, mb, model)  # warm-up: allocator pools, kernels
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = _rss_bytes()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        _step(variant, trainer, mb, model)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    if cuda:
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    name = variant if variant == "naive" else f"chunked/{chunk}"
    queue.put({"variant": name, "chunk_tokens": None if variant == "naive" else chunk, "peak_bytes": int(peak), "step_seconds": statistics.median(times),
               "step_seconds_all": times})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=4, help="samples per micro-batch")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per sample")
    parser.add_argument("--response", type=int, default=256, help="response tokens of the longest sample")
    parser.add_argument("--chunk", type=int, nargs="+", default=[1024, 256],
                        help="trainer.logprobChunkTokens values to run the chunked variant with")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    rows = []
    for variant, chunk in [("naive", 0)] + [("chunked", c) for c in args.chunk]:
        queue = ctx.Queue()
        proc = ctx.Process(target=_run_variant, args=(variant, chunk, args, queue))
        proc.start()
        rows.append(queue.get())
        proc.join()
    naive, chunked = rows[0], rows[1]
    machine = {
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": args.threads,
        "torch": torch.__version__,
        "load_average_1m_at_start": os.getloadavg()[0],
    }
    result = {
        "vocab_size": VOCAB,
        "micro_batch": args.batch,
        "prompt_tokens": args.prompt,
        "max_response_tokens": args.response,
        "machine": machine,
        "rows": rows,
        # Against the first chunk size (the default, 1024).
        "peak_memory_ratio_naive_over_chunked": naive["peak_bytes"] / max(chunked["peak_bytes"], 1),
        "step_time_ratio_chunked_over_naive": chunked["step_seconds"] / naive["step_seconds"],
        "note": "CPU peak = getrusage max RSS (warm-up step included) minus RSS before the timed steps",
    }
    print(f"trainer log-prob memory, vocab {VOCAB:,}, micro-batch {args.batch} x ({args.prompt} + <= {args.response}) "
          f"tokens, {machine['device_name']} ({args.device})")
    print(f"{'variant':<16}{'peak memory (MiB)':>20}{'step (s, median)':>20}")
    for row in rows:
        print(f"{row['variant']:<16}{row['peak_bytes'] / 2**20:>20.0f}{row['step_seconds']:>20.3f}")
    print(f"naive / {chunked['variant']} peak memory: {result['peak_memory_ratio_naive_over_chunked']:.1f}x; "
          f"step time: {result['step_time_ratio_chunked_over_naive']:.2f}x")
    suffix = "" if args.device == "cpu" else f"_{args.device.split(':')[0]}"
    out = OUT_DIR / f"trainer_memory{suffix}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
