"""One group of N samples of one prompt on the CPU (embedded) engine: N = 8 vs N = 256, per token,
with the prompt's prefill shared by the group and without.

A group's samples share their prompt. With sharing (the default: prefix_cache.py), the engine
prefills the prompt once and copies its keys and values into each sample's KV row, for the samples
admitted together and for those admitted later as slots free up; without it (``prefix_cache_tokens=0``),
every sample prefills the prompt itself, as the engine did before. For each N and each mode: one group
of N requests of the same 256-token prompt, 32 new tokens each, submitted at once to an EmbeddedEngine
that runs up to 64 sequences together; wall seconds, generated tokens per second, prompt tokens the
model computed and those it took from the shared prefill (the engine's own counters), prefill forwards,
and the process's peak extra RSS over the group (glibc told to unmap freed memory: tests/helpers/rss.py),
also per generated token. The engine's KV rows are not shared: each sample still holds its own copy
of the prompt's keys and values (SGLang's radix cache shares those pages as well).
Run: `python benchmarks/large_n.py` (writes docs/benchmarks/large_n.json; about 2 minutes on 2 cores).
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
from rljob.runtime.engines.embedded import DEFAULT_PREFIX_CACHE_TOKENS, EmbeddedEngine  # noqa: E402
from tests.helpers.rss import PeakRss, exact_malloc  # noqa: E402
from tests.helpers.tiny_model import build_tiny_model  # noqa: E402

console = Console()
MODEL = {"hidden_size": 256, "layers": 4, "vocab_size": 4096}


async def one_group(n: int, shared: bool, prompt_tokens: int, new_tokens: int, batch: int) -> dict[str, Any]:
    engine = EmbeddedEngine(build_tiny_model(seed=0, **MODEL), max_batch_size=batch, seed=0,
                            prefix_cache_tokens=DEFAULT_PREFIX_CACHE_TOKENS if shared else 0)
    await engine.start()
    prompt = [1 + (i * 7) % 4000 for i in range(prompt_tokens)]
    try:
        # Warm-up on another prompt: one-off allocations, and nothing of the measured prompt in the cache.
        await engine.generate(GenerateRequest("warm-up", prompt[::-1], 2, temperature=1.0))
        computed, cached, forwards = (engine.stats.prefill_tokens, engine.stats.cached_prefill_tokens,
                                      engine.stats.prefill_steps)
        with PeakRss() as peak:
            started = time.perf_counter()
            results = await asyncio.gather(*(
                engine.generate(GenerateRequest(f"g-{i}", prompt, new_tokens, temperature=1.0)) for i in range(n)))
            seconds = time.perf_counter() - started
        stats = engine.stats
    finally:
        await engine.close()
    generated = sum(len(r.output_ids) for r in results)
    return {"n": n, "shared_prefill": shared, "prompt_tokens": prompt_tokens, "max_new_tokens": new_tokens,
            "max_batch_size": batch, "seconds": round(seconds, 3), "generated_tokens": generated,
            "tokens_per_second": round(generated / seconds, 1),
            "seconds_per_1k_tokens": round(1000 * seconds / generated, 3),
            "prefill_tokens_computed": stats.prefill_tokens - computed,
            "prefill_tokens_shared": stats.cached_prefill_tokens - cached,
            "prefill_forwards": stats.prefill_steps - forwards,
            "peak_extra_rss_megabytes": round(peak.extra / 2**20, 2),
            "peak_extra_rss_kib_per_generated_token": round(peak.extra / 1024 / generated, 2)}


def side_by_side(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per N: shared over unshared, for throughput, peak memory and prompt tokens computed."""
    rows = []
    for n in sorted({r["n"] for r in runs}):
        on = next(r for r in runs if r["n"] == n and r["shared_prefill"])
        off = next(r for r in runs if r["n"] == n and not r["shared_prefill"])
        rows.append({"n": n,
                     "tokens_per_second_shared_over_unshared": round(on["tokens_per_second"] / off["tokens_per_second"], 2),
                     "peak_extra_rss_shared_over_unshared": round(
                         on["peak_extra_rss_megabytes"] / off["peak_extra_rss_megabytes"], 2),
                     "prefill_tokens_computed_shared_over_unshared": round(
                         on["prefill_tokens_computed"] / off["prefill_tokens_computed"], 4)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="8,256", help="group sizes N")
    parser.add_argument("--output", default=str(ROOT / "docs/benchmarks"), help="folder for the JSON")
    args = parser.parse_args()
    exact_malloc()
    torch.set_num_threads(1)
    runs = [asyncio.run(one_group(int(n), shared, 256, 32, 64))
            for n in args.sizes.split(",") for shared in (False, True)]
    for r in runs:
        console.print(r)
    result = {"runs": runs, "side_by_side": side_by_side(runs), "model": MODEL,
              "engine": "embedded (CPU); shared_prefill: a prefix cache keyed by token ids (prefix_cache.py), "
                        "else every sample prefills the prompt",
              "machine": describe(f"torch {torch.__version__}, 1 torch thread"),
              "load_average_1min_at_end": load_average()}
    console.print(result["side_by_side"])
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "large_n.json").write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {out / 'large_n.json'}")


if __name__ == "__main__":
    main()
