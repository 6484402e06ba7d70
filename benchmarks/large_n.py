"""One group of N samples of one prompt on the CPU (embedded) engine: N = 8 vs N = 256, per token.

A group's samples share their prompt. This measures what a large group (BroRL's N = 512 regime) costs the
CPU engine today, where each sample is its own request with its own prefill and KV cache row (the
embedded engine has no prefix cache; real SGLang shares the prompt's prefill through its radix cache).
For each N: one group of N requests of the same 256-token prompt, 32 new tokens each, submitted at once
to an EmbeddedEngine that runs up to 64 sequences together; wall seconds, generated tokens per second,
prefill tokens computed, and the process's peak extra RSS over the group (glibc told to unmap freed
memory: tests/helpers/rss.py), also per generated token.
Run: `python benchmarks/large_n.py` (writes docs/benchmarks/large_n.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from machine_info import describe, load_average  # noqa: E402  # benchmarks/machine_info.py
from rljob.runtime.engines.base import GenerateRequest  # noqa: E402
from rljob.runtime.engines.embedded import EmbeddedEngine  # noqa: E402
from tests.helpers.rss import PeakRss, exact_malloc  # noqa: E402
from tests.helpers.tiny_model import build_tiny_model  # noqa: E402

console = Console()
MODEL = {"hidden_size": 256, "layers": 4, "vocab_size": 4096}


async def one_group(n: int, prompt_tokens: int, new_tokens: int, batch: int) -> dict[str, Any]:
    engine = EmbeddedEngine(build_tiny_model(seed=0, **MODEL), max_batch_size=batch, seed=0)
    await engine.start()
    prompt = [1 + (i * 7) % 4000 for i in range(prompt_tokens)]
    try:
        await engine.generate(GenerateRequest("warm-up", prompt, 2, temperature=1.0))
        with PeakRss() as peak:
            started = time.perf_counter()
            results = await asyncio.gather(*(
                engine.generate(GenerateRequest(f"g-{i}", prompt, new_tokens, temperature=1.0)) for i in range(n)))
            seconds = time.perf_counter() - started
    finally:
        await engine.close()
    generated = sum(len(r.output_ids) for r in results)
    return {"n": n, "prompt_tokens": prompt_tokens, "max_new_tokens": new_tokens, "max_batch_size": batch,
            "seconds": round(seconds, 3), "generated_tokens": generated,
            "tokens_per_second": round(generated / seconds, 1),
            "seconds_per_1k_tokens": round(1000 * seconds / generated, 3),
            "prefill_tokens_computed": n * prompt_tokens, "prefill_tokens_shared": 0,
            "peak_extra_rss_megabytes": round(peak.extra / 2**20, 2),
            "peak_extra_rss_kib_per_generated_token": round(peak.extra / 1024 / generated, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="8,256", help="group sizes N")
    parser.add_argument("--output", default=str(ROOT / "docs/benchmarks"), help="folder for the JSON")
    args = parser.parse_args()
    exact_malloc()
    torch.set_num_threads(1)
    runs = [asyncio.run(one_group(int(n), 256, 32, 64)) for n in args.sizes.split(",")]
    for r in runs:
        console.print(r)
    result = {"runs": runs, "model": MODEL, "engine": "embedded (CPU), no prefix cache: every sample prefills the prompt",
              "machine": describe(f"torch {torch.__version__}, 1 torch thread"),
              "load_average_1min_at_end": load_average()}
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "large_n.json").write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {out / 'large_n.json'}")


if __name__ == "__main__":
    main()
