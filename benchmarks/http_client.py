"""The SGLang client's HTTP layer: client CPU per /generate call with many calls in flight.

A rollout keeps hundreds of /generate calls in flight (128 samples of a batch, twice that with
over-sampling, more with several replicas). This benchmark measures what each call costs the client's
event loop, side by side, for two HTTP clients:

- `httpx`: `httpx.AsyncClient`, as the SGLang client used it before (no connection cap, 256 kept alive);
- `aiohttp`: `HttpCaller` of runtime/engines/http_retry.py, the client's HTTP layer now (aiohttp).

The server is a loopback aiohttp app in a process of its own, pinned to core 0, that answers each call
with an SGLang /generate reply of `--tokens` tokens with their log-probs (protocol.py parses it) after a
random delay of up to `--delay-ms` (the generation). The client runs pinned to core 1 and keeps
`concurrency` calls in flight, `--calls` in all per run after a warm-up run, the variants interleaved.
Reported: client CPU seconds per call (the process's own CPU time, not the server's) and calls per second.

Run: .venv/bin/python benchmarks/http_client.py (about a minute; writes docs/benchmarks/http_client.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from machine_info import describe, load_average  # noqa: E402  # benchmarks/machine_info.py
from rljob.runtime.engines.base import GenerateRequest  # noqa: E402
from rljob.runtime.engines.http_retry import HttpCaller, RetryPolicy, Timeout  # noqa: E402
from rljob.runtime.engines.protocol import generate_call, parse_generate_reply  # noqa: E402

console = Console(width=120)
VARIANTS = ("httpx", "aiohttp")


def reply_body(tokens: int) -> dict[str, Any]:
    """An SGLang /generate reply with `tokens` output tokens and their log-probs."""
    return {"text": "7" * tokens, "output_ids": list(range(tokens)),
            "meta_info": {"id": "r", "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 40,
                          "completion_tokens": tokens, "cached_tokens": 0, "weight_version": "0",
                          "output_token_logprobs": [[-0.5, t, None] for t in range(tokens)]}}


def serve(port: int, tokens: int, delay_s: float) -> None:
    """The server process: /generate answers after a random delay."""
    os.sched_setaffinity(0, {0})
    body = json.dumps(reply_body(tokens))

    async def generate(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(random.random() * delay_s)
        return web.Response(text=body, content_type="application/json")

    app = web.Application()
    app.router.add_post("/generate", generate)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def wait_listening(port: int) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def make_call(variant: str, url: str) -> tuple[Callable[[GenerateRequest], Awaitable[Any]], Callable[[], Awaitable[None]]]:
    """(one /generate call returning the parsed reply, close) for a variant."""
    if variant == "httpx":
        http = httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=256,
                                                     keepalive_expiry=2.5))

        async def call_httpx(request: GenerateRequest) -> Any:
            resp = await http.post(url, json=generate_call(request, request.rid).body, timeout=httpx.Timeout(60.0))
            return parse_generate_reply(resp.json(), request.rid, 0)

        return call_httpx, http.aclose
    caller = HttpCaller(RetryPolicy(), keepalive_s=2.5)

    async def call_aiohttp(request: GenerateRequest) -> Any:
        resp = await caller.call("POST", url, json=generate_call(request, request.rid).body, timeout=Timeout(60.0))
        return parse_generate_reply(resp.json(), request.rid, 0)

    return call_aiohttp, caller.close


async def run_variant(variant: str, url: str, concurrency: int, calls: int) -> dict[str, float]:
    """`calls` calls, `concurrency` in flight; client CPU seconds per call and calls per second."""
    call, close = make_call(variant, url)
    prompt = list(range(40))
    try:
        async def measured(n: int) -> tuple[float, float]:
            left = n

            async def worker(w: int) -> None:
                nonlocal left
                while left > 0:
                    left -= 1
                    await call(GenerateRequest(rid=f"{variant}-{w}-{left}", input_ids=prompt, max_new_tokens=64))

            cpu0, wall0 = time.process_time(), time.perf_counter()
            await asyncio.gather(*(worker(w) for w in range(concurrency)))
            return time.process_time() - cpu0, time.perf_counter() - wall0

        await measured(max(concurrency, calls // 5))  # warm-up: the connections are opened here
        cpu, wall = await measured(calls)
    finally:
        await close()
    return {"client_cpu_ms_per_call": 1e3 * cpu / calls, "calls_per_s": calls / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 128, 512])
    parser.add_argument("--calls", type=int, default=3000, help="measured calls per variant and concurrency")
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per reply")
    parser.add_argument("--delay-ms", type=float, default=50.0, help="the server's reply delay, uniform up to this")
    parser.add_argument("--output", default=str(ROOT / "docs/benchmarks/http_client.json"))
    args = parser.parse_args()
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("needs 2 cores: the server on one, the client on the other")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = multiprocessing.get_context("spawn").Process(target=serve, args=(port, args.tokens, args.delay_ms / 1e3),
                                                          daemon=True)
    server.start()
    rows: list[dict[str, Any]] = []
    try:
        wait_listening(port)
        os.sched_setaffinity(0, {1})
        url = f"http://127.0.0.1:{port}/generate"
        for concurrency in args.concurrency:
            for variant in VARIANTS:
                result = asyncio.run(run_variant(variant, url, concurrency, args.calls))
                rows.append({"variant": variant, "concurrency": concurrency, **result})
                console.log(f"{variant:8s} {concurrency:4d} in flight: {result['client_cpu_ms_per_call']:.2f} ms CPU "
                            f"per call, {result['calls_per_s']:.0f} calls/s")
    finally:
        server.terminate()
        server.join()
    table = Table(title="client CPU per /generate call (loopback, client on one core)")
    for col in ("in flight", "httpx ms/call", "aiohttp ms/call", "httpx calls/s", "aiohttp calls/s", "CPU ratio"):
        table.add_column(col, justify="right")
    by = {(r["variant"], r["concurrency"]): r for r in rows}
    ratios: dict[str, float] = {}
    for c in args.concurrency:
        old, new = by[("httpx", c)], by[("aiohttp", c)]
        ratios[str(c)] = old["client_cpu_ms_per_call"] / new["client_cpu_ms_per_call"]
        table.add_row(str(c), f"{old['client_cpu_ms_per_call']:.2f}", f"{new['client_cpu_ms_per_call']:.2f}",
                      f"{old['calls_per_s']:.0f}", f"{new['calls_per_s']:.0f}", f"{ratios[str(c)]:.1f}x")
    console.print(table)
    machine = describe(f"httpx {version('httpx')} (httpcore {version('httpcore')}), aiohttp {version('aiohttp')}; "
                       "server pinned to core 0, client to core 1")
    console.print(f"machine: {machine}")
    result = {"benchmark": "http_client", "calls": args.calls, "tokens_per_reply": args.tokens,
              "server_delay_ms_max": args.delay_ms, "rows": rows, "httpx_over_aiohttp_cpu_per_call": ratios,
              "machine": machine, "load_average_1min_at_end": load_average()}
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
