"""The SGLang-protocol server on loopback, the SGLang client against it, and the REAL sglang router.

In-process tests run the aiohttp server in the test's event loop. The router tests start two worker
processes (``python -m rljob.runtime.engines.server``) and ``python -m sglang_router.launch_router``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
import torch

from rljob.runtime.engines.base import EngineError, GenerateRequest, GenerateResult, WeightUpdate
from rljob.runtime.engines.embedded import EmbeddedEngine
from rljob.runtime.engines.server import ServerOptions, SGLangProtocolServer
from rljob.runtime.engines.sglang_client import SGLangClientConfig, SGLangEngine
from rljob.runtime.weight_group import create_group, open_store
from tests.helpers.processes import start_router, start_worker, stop, wait_http
from tests.helpers.server_faults import Faults, FaultyServer
from tests.helpers.tiny_model import save_tiny_model
from tests.helpers.waiting import wait_until

PROMPT = [5, 6, 7, 8]


def greedy(rid: str, max_new_tokens: int, prompt: list[int] = PROMPT) -> GenerateRequest:
    return GenerateRequest(rid=rid, input_ids=prompt, max_new_tokens=max_new_tokens, temperature=0.0)


def fast_client(*urls: str, router: str | None = None) -> SGLangEngine:
    """A client with short backoff/drain settings so failure paths finish quickly in tests.

    Its probes wait 5 s: one unanswered probe takes a worker out of the rotation (and the router's list),
    and a worker decoding a full batch on a loaded 2-core machine can take over 1 s to answer. With 1 s,
    the likely cause of run 11's fan-out failure: a busy worker ejected, every request of the next batch
    sent to the other one. A killed worker refuses connections at once, so the kill tests stay quick."""
    return SGLangEngine(
        SGLangClientConfig(
            worker_urls=list(urls), router_url=router, retries=2, backoff_s=0.05, backoff_max_s=0.2,
            reabort_interval_s=0.3, drain_timeout_s=30, health_timeout_s=120, probe_timeout_s=5.0,
        )
    )


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("models")
    return save_tiny_model(root / "seed0", seed=0), save_tiny_model(root / "seed1", seed=1)


@dataclass
class Served:
    server: SGLangProtocolServer
    url: str
    client: SGLangEngine


@pytest.fixture
async def served(model_dirs: tuple[Path, Path]) -> AsyncIterator[Served]:
    server = SGLangProtocolServer(
        EmbeddedEngine(model_dirs[0], max_batch_size=4), ServerOptions(model_path=str(model_dirs[0]))
    )
    url = await server.start()
    client = fast_client(url)
    await client.start()
    yield Served(server, url, client)
    await client.close()
    await server.stop()


async def wait_until_generating(server: SGLangProtocolServer, tokens: int = 3) -> None:
    await wait_until(
        lambda: server.engine.stats.generated_tokens >= tokens and bool(server.engine.current_load().running),
        "the server to start generating",
    )


# --------------------------------------------------------------------------- in-process server


async def test_generate_over_http_matches_embedded_engine(served: Served, model_dirs: tuple[Path, Path]) -> None:
    local = EmbeddedEngine(model_dirs[0])
    try:
        expected = await local.generate(greedy("local", 12))
    finally:
        await local.close()
    got = await served.client.generate(greedy("http", 12))
    assert got.output_ids == expected.output_ids
    assert got.output_logprobs == pytest.approx(expected.output_logprobs, abs=1e-5)
    assert (got.finish_reason, got.weight_version, got.prompt_tokens) == ("length", 0, len(PROMPT))

    async with httpx.AsyncClient(base_url=served.url) as http:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "temperature": 0,
                "stop_token_ids": [expected.output_ids[1]]}, "return_logprob": True, "rid": "raw"}
        reply = (await http.post("/generate", json=body)).json()
    meta = reply["meta_info"]
    assert meta["id"] == "raw" and meta["weight_version"] == "0"
    assert meta["finish_reason"] == {"type": "stop", "matched": expected.output_ids[1]}
    assert meta["completion_tokens"] == 2 and meta["prompt_tokens"] == 4
    assert [t[1] for t in meta["output_token_logprobs"]] == reply["output_ids"] == expected.output_ids[:2]
    assert all(t[2] is None for t in meta["output_token_logprobs"])


async def test_abort_over_http_returns_partials_and_drains(served: Served) -> None:
    tasks = [asyncio.create_task(served.client.generate(greedy(f"r1-g{i}", 400))) for i in range(6)]
    await wait_until_generating(served.server)
    await served.client.abort_all()
    results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
    assert all(r.finish_reason == "abort" for r in results)
    running = [r for r in results if r.output_ids]
    assert running and all(len(r.output_logprobs) == len(r.output_ids) < 400 for r in running)
    assert [r for r in results if not r.output_ids]  # max_batch_size 4: two were still waiting
    assert (await served.client.load()).total == 0


async def test_resume_over_http_continues_where_it_stopped(served: Served) -> None:
    full = await served.client.generate(greedy("full", 80))
    task = asyncio.create_task(served.client.generate(greedy("seg-a1", 80)))
    await wait_until_generating(served.server, tokens=90)
    await served.client.abort("seg-a1")  # SGLang aborts exact rids only
    part = await task
    assert part.finish_reason == "abort" and 0 < len(part.output_ids) < 80
    rest = await served.client.generate(greedy("seg-a2", 80 - len(part.output_ids), PROMPT + part.output_ids))
    assert part.output_ids + rest.output_ids == full.output_ids
    assert rest.finish_reason == "length"


async def test_update_weights_from_disk_changes_outputs_and_version(
    served: Served, model_dirs: tuple[Path, Path]
) -> None:
    before = await served.client.generate(greedy("v0", 10))
    await served.client.update_weights(WeightUpdate(version=5, path=str(model_dirs[1])))
    after = await served.client.generate(greedy("v5", 10))
    assert after.weight_version == 5 and after.output_ids != before.output_ids
    async with httpx.AsyncClient(base_url=served.url) as http:
        assert (await http.get("/model_info")).json()["weight_version"] == "5"
        assert (await http.get("/get_model_info")).json()["weight_version"] == "5"
    with pytest.raises(EngineError, match="not a directory"):
        await served.client.update_weights(WeightUpdate(version=6, path="/nonexistent/ckpt"))
    with pytest.raises(EngineError, match="WeightUpdate\\(path=...\\)"):
        await served.client.update_weights(WeightUpdate(version=6))
    assert served.client.weight_version == 5


async def test_flush_cache_is_400_while_busy_and_200_when_idle(served: Served) -> None:
    task = asyncio.create_task(served.client.generate(greedy("busy", 400)))
    await wait_until_generating(served.server)
    async with httpx.AsyncClient(base_url=served.url) as http:
        assert (await http.post("/flush_cache")).status_code == 400
        await served.client.abort_all()
        await task
        assert (await http.post("/flush_cache")).status_code == 200
        assert (await http.get("/flush_cache")).status_code == 200


def _metric(text: str, name: str) -> float:
    """The value of the first sample ``name{...} value`` in a /metrics page."""
    line = next(ln for ln in text.splitlines() if ln.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


async def test_a_groups_requests_share_one_prefill_and_report_cached_tokens(served: Served) -> None:
    """One request per sample (what the client sends): the prompt is prefilled once, the other samples'
    ``meta_info.cached_tokens`` say they reused it, /metrics counts it as SGLang does, and /flush_cache
    makes the next request prefill again."""
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}, "return_logprob": True}
    stats = served.server.engine.stats
    before = stats.prefill_tokens  # the client's start-up health generation prefilled its own prompt
    async with httpx.AsyncClient(base_url=served.url) as http:
        replies = await asyncio.gather(*(http.post("/generate", json={**body, "rid": f"s{i}"}) for i in range(6)))
        cached = sorted(r.json()["meta_info"]["cached_tokens"] for r in replies)
        metrics = (await http.get("/metrics")).text
        assert (await http.post("/flush_cache")).status_code == 200
        after = (await http.post("/generate", json={**body, "rid": "after-flush"})).json()
    assert cached == [0] + [len(PROMPT)] * 5
    assert stats.prefill_tokens - before == 2 * len(PROMPT)  # the group's prefill, then after the flush
    assert _metric(metrics, "sglang:cached_tokens_total") == 5 * len(PROMPT)
    assert _metric(metrics, "sglang:prompt_tokens_total") - before == 6 * len(PROMPT)
    assert after["meta_info"]["cached_tokens"] == 0


async def test_n_primes_the_prompt_then_answers_n_samples_under_new_rids(served: Served) -> None:
    """SGLang's ``n`` (tokenizer_manager._handle_batch_request): a prefill-only request puts the prompt in
    the cache, then ``n`` samples run under fresh rids (the caller's names none of them), one list back."""
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "n": 3}, "rid": "group", "return_logprob": True}
    before = served.server.engine.stats.prefill_tokens
    async with httpx.AsyncClient(base_url=served.url) as http:
        replies = (await http.post("/generate", json=body)).json()
        mixed = await http.post("/generate", json={"input_ids": [PROMPT, PROMPT], "sampling_params": [
            {"max_new_tokens": 2, "n": 2}, {"max_new_tokens": 2}]})
    assert isinstance(replies, list) and len(replies) == 3
    ids = {r["meta_info"]["id"] for r in replies}
    assert len(ids) == 3 and "group" not in ids
    assert all(len(r["output_ids"]) == 3 and r["meta_info"]["cached_tokens"] == len(PROMPT) for r in replies)
    assert served.server.engine.stats.prefill_tokens - before == len(PROMPT)  # only the prefill-only request computed it
    assert mixed.status_code == 400 and "parallel_sample_num" in mixed.json()["error"]["message"]


@pytest.fixture
async def two_workers(model_dirs: tuple[Path, Path]) -> AsyncIterator[tuple[list[SGLangProtocolServer], list[str]]]:
    servers = [SGLangProtocolServer(EmbeddedEngine(model_dirs[0], max_batch_size=8),
                                    ServerOptions(model_path=str(model_dirs[0]))) for _ in range(2)]
    try:
        urls = [await server.start() for server in servers]
        yield servers, urls
    finally:
        for server in servers:
            await server.stop()


def group_of(n: int, prefix: str, share: bool, budget: int = 6) -> list[GenerateRequest]:
    return [GenerateRequest(rid=f"{prefix}{i}", input_ids=PROMPT, max_new_tokens=budget, temperature=1.0,
                            share_prefill=share) for i in range(n)]


async def test_the_client_primes_a_groups_prompt_on_one_worker_and_sends_the_group_there(
    two_workers: tuple[list[SGLangProtocolServer], list[str]],
) -> None:
    """What SGLang's ``n`` does, with one request per sample: a prefill-only request first, then every
    sample on the worker that holds the prompt, each reporting the whole prompt as cached. Unmarked
    requests spread over the workers as before, and each worker prefills the prompt for itself."""
    servers, urls = two_workers
    client = fast_client(*urls)
    await client.start()
    try:
        before = [s.engine.stats.prefill_tokens for s in servers]
        shared = await asyncio.gather(*(client.generate(r) for r in group_of(8, "g1-", share=True)))
        computed = [s.engine.stats.prefill_tokens - b for s, b in zip(servers, before, strict=True)]
        assert sorted(computed) == [0, len(PROMPT)]  # one worker prefilled the prompt, once
        assert [r.cached_tokens for r in shared] == [len(PROMPT)] * 8  # the prime came before every sample
        assert all(len(r.output_ids) == 6 and r.finish_reason == "length" for r in shared)
        assert len(client._prompts) == 0  # the group is gone with its last request

        for server in servers:
            server.engine.flush_prefix_cache()
        before = [s.engine.stats.prefill_tokens for s in servers]
        spread = await asyncio.gather(*(client.generate(r) for r in group_of(8, "g2-", share=False)))
        computed = [s.engine.stats.prefill_tokens - b for s, b in zip(servers, before, strict=True)]
        assert computed == [len(PROMPT), len(PROMPT)]  # both workers got samples, both prefilled
        assert sum(r.cached_tokens for r in spread) == 6 * len(PROMPT)
    finally:
        await client.close()


async def test_a_rollout_round_primes_each_groups_prompt_for_its_samples(served: Served) -> None:
    """The scheduler marks a group's fresh samples (segment.group_prompt), so over SGLang every sample of
    the round is served from its primed prompt: the worker computes each prompt once."""
    from rljob.runtime.rollout.scheduler import RolloutConfig, RolloutScheduler
    from rljob.runtime.rollout.strategy import make_strategy
    from rljob.runtime.tasks.dataset import PromptStream
    from rljob.runtime.tasks.tokenizer import CharTokenizer

    stats = served.server.engine.stats
    computed, cached = stats.prefill_tokens, stats.cached_prefill_tokens
    config = RolloutConfig(batch_size=2, samples_per_prompt=4, max_response_length=6)
    prompts = PromptStream([("12+3=", "15"), ("7*6=", "42")], CharTokenizer())
    scheduler = RolloutScheduler([served.client], config, make_strategy("sync"), prompts, score=lambda _s: 0.0)
    result = await asyncio.wait_for(scheduler.run_round(0), timeout=120)
    lengths = [len(g.samples[0].prompt_ids) for g in result.groups]
    assert len(result.groups) == 2 and result.stats.new_groups == 2
    assert stats.prefill_tokens - computed == sum(lengths)  # one prefill per group: its priming
    assert stats.cached_prefill_tokens - cached == 4 * sum(lengths)  # every sample found its prompt primed


async def test_an_abort_during_a_primed_group_returns_every_sample_and_resumes_them(
    two_workers: tuple[list[SGLangProtocolServer], list[str]],
) -> None:
    """APRIL over a primed group: abort_all while its samples run returns each one with its partial
    output and log-probs (none lost), the group is forgotten, and the resumed samples finish their budgets."""
    servers, urls = two_workers
    client = fast_client(*urls)
    await client.start()
    try:
        requests = group_of(12, "g3-", share=True, budget=300)  # 12 > max_batch_size 8: some wait queued
        tasks = [asyncio.create_task(client.generate(r)) for r in requests]
        await wait_until(lambda: any(s.engine.stats.generated_tokens > 20 for s in servers), "the group generating")
        await client.abort_all()
        first = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        assert all(r.finish_reason == "abort" for r in first)
        assert any(r.output_ids for r in first) and all(len(r.output_ids) < 300 for r in first)
        assert all(len(r.output_logprobs) == len(r.output_ids) for r in first)
        assert (await client.load()).total == 0 and len(client._prompts) == 0
        second = await asyncio.gather(*(
            client.generate(GenerateRequest(rid=f"{q.rid}-r", input_ids=PROMPT + r.output_ids,
                                            max_new_tokens=300 - len(r.output_ids), temperature=1.0))
            for q, r in zip(requests, first, strict=True)))
        assert all(len(a.output_ids) + len(b.output_ids) == 300 for a, b in zip(first, second, strict=True))
    finally:
        await client.close()


async def test_update_weight_version_aborts_by_default(served: Served) -> None:
    task = asyncio.create_task(served.client.generate(greedy("victim", 400)))
    await wait_until_generating(served.server)
    async with httpx.AsyncClient(base_url=served.url) as http:
        reply = await http.post("/update_weight_version", json={"new_version": "9"})
    assert reply.status_code == 200
    res = await task
    assert res.finish_reason == "abort"
    assert (await served.client.generate(greedy("after", 2))).weight_version == 9


async def test_info_loads_metrics_and_pause(served: Served) -> None:
    await served.client.generate(greedy("warm", 4))
    async with httpx.AsyncClient(base_url=served.url) as http:
        info = (await http.get("/get_server_info")).json()
        assert info["max_running_requests"] == 4 and info["context_length"] == 512
        assert (await http.get("/server_info")).json()["version"] == info["version"]
        assert (await http.get("/model_info")).json()["model_type"] == "qwen2"
        loads = (await http.get("/v1/loads", params={"include": "core"})).json()
        assert loads["loads"][0]["num_running_reqs"] == 0
        metrics = (await http.get("/metrics")).text
        for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:gen_throughput",
                     "sglang:token_usage", "sglang:generation_tokens_total"):
            assert name in metrics
        assert (await http.post("/pause_generation", json={"mode": "in_place"})).status_code == 200
        paused = asyncio.create_task(served.client.generate(greedy("paused", 3)))

        # The server holds the request at its admission gate (observed, not assumed after a delay): as in
        # SGLang, a paused server keeps it before its scheduler, so /v1/loads does not count it.
        await wait_until(lambda: served.server.gate.blocked == 1, "the paused server holding the request", interval=0.05)
        assert not paused.done()
        assert (await http.post("/continue_generation")).status_code == 200
        assert (await asyncio.wait_for(paused, 30)).finish_reason == "length"
        bad = await http.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 600}})
        assert bad.status_code == 400 and "context length" in bad.json()["error"]["message"]
        assert (await http.post("/generate", json={"text": "hi"})).status_code == 400  # no tokenizer


async def test_context_overflow_is_an_invalid_request_carrying_the_servers_message(served: Served) -> None:
    """An SGLang 400 (prompt + max_new_tokens beyond the context) is InvalidRequestError, never retried."""
    from rljob.runtime.engines.base import InvalidRequestError
    from rljob.runtime.rollout.scheduler import RolloutConfig, RolloutScheduler
    from rljob.runtime.rollout.strategy import make_strategy
    from rljob.runtime.tasks.dataset import PromptStream
    from rljob.runtime.tasks.tokenizer import CharTokenizer

    context = served.server.engine.max_context_len
    finished_before = served.server.engine.stats.finished.total()  # /health_generate probes generate too
    with pytest.raises(InvalidRequestError, match=rf"HTTP 400\): .*exceeds the model's maximum context length of {context}"):
        await served.client.generate(greedy("too-long", context))
    assert served.server.engine.stats.finished.total() == finished_before  # refused before any generation
    assert all(w.healthy for w in served.client.workers.values())  # a refusal is not a sick worker

    # The scheduler stops the round with the message instead of relaunching the group forever.
    config = RolloutConfig(batch_size=2, samples_per_prompt=2, max_response_length=context)
    prompts = PromptStream([("12+3=", "15")], CharTokenizer())
    scheduler = RolloutScheduler([served.client], config, make_strategy("sync"), prompts, score=lambda _s: 0.0)
    with pytest.raises(InvalidRequestError, match="maximum context length.*maxResponseLength"):
        await asyncio.wait_for(scheduler.run_round(0), timeout=60)
    # The round's other groups were cancelled and awaited: none keeps running, and none dies later
    # with an exception nobody retrieves (its finalizer would log it in the middle of another test).
    leftover = [t for t in asyncio.all_tasks() if t.get_coro().__qualname__.startswith("RolloutScheduler.")]
    assert leftover == []


def test_error_messages_of_every_known_reply_shape() -> None:
    from rljob.runtime.engines.protocol import error_message

    sglang = {"object": "error", "message": "Requested token count exceeds the model's maximum context length",
              "type": "BadRequestError", "param": None, "code": 400}
    assert error_message(sglang, "raw").startswith("Requested token count exceeds")
    assert error_message({"error": {"message": "too long", "code": 400}}, "raw") == "too long"
    assert error_message({"error": "bad input"}, "raw") == "bad input"
    assert error_message(None, "raw body") == "raw body"


async def test_health_is_503_while_starting(model_dirs: tuple[Path, Path]) -> None:
    server = SGLangProtocolServer(EmbeddedEngine(model_dirs[0]), ServerOptions(startup_delay_s=1.0))
    url = await server.start(wait_ready=False)
    try:
        async with httpx.AsyncClient(base_url=url) as http:
            assert (await http.get("/health_generate")).status_code == 503
            assert (await http.get("/health")).status_code == 503
            assert (await http.get("/model_info")).status_code == 503  # SGLang: nothing answers yet
            client = fast_client(url)
            await client.start()  # waits on /health_generate
            assert await client.health()
            await client.close()
            assert (await http.get("/health_generate")).status_code == 200
    finally:
        await server.stop()


async def test_old_server_behaviours_are_tolerated(model_dirs: tuple[Path, Path]) -> None:
    faults = Faults(legacy_abort_reply=True, require_abort_rid=True, ignore_first_aborts=1)
    server = FaultyServer(EmbeddedEngine(model_dirs[0], max_batch_size=1), faults=faults)
    url = await server.start()
    client = fast_client(url)
    try:
        running = asyncio.create_task(client.generate(greedy("old-a", 400)))
        queued = asyncio.create_task(client.generate(greedy("old-b", 400)))
        await wait_until_generating(server)
        # The first abort is swallowed: only the re-abort of the drain loop empties the server.
        await client.abort_all()
        r, q = await asyncio.wait_for(asyncio.gather(running, queued), 30)
        assert r.finish_reason == "abort" and r.output_ids
        assert q.finish_reason == "abort" and q.output_ids == [] and q.output_logprobs == []
        assert q.weight_version == 0  # missing on the old reply? then the submit-time version
    finally:
        await client.close()
        await server.stop()


async def test_a_failed_forward_is_retried_under_a_new_rid(model_dirs: tuple[Path, Path]) -> None:
    """sglang-router answers 500 when its forward to a worker breaks, and the operator runs it without
    retries of its own: the client retries under a new rid (a worker that got the first one aborts it
    when the router's connection drops) and the request comes back whole."""
    server = FaultyServer(EmbeddedEngine(model_dirs[0]), faults=Faults(failed_generates=1))
    url = await server.start()
    client = fast_client(url)
    try:
        result = await client.generate(greedy("forward", 7))
        assert result.finish_reason == "length" and len(result.output_ids) == 7 and result.rid == "forward"
        first, retry = server.generate_rids
        assert first.startswith("forward") and retry.startswith("forward") and first != retry, server.generate_rids
        assert client.workers[url].healthy  # it answers its probe: one failed call does not take it out
    finally:
        await client.close()
        await server.stop()


@pytest.mark.parametrize("fault", ["503", "hang"])
async def test_a_worker_whose_health_generate_fails_or_hangs_never_starts_the_client(
    model_dirs: tuple[Path, Path], fault: Literal["503", "hang"]
) -> None:
    """A worker whose /health_generate fails (503) or never answers: the client's start() does not
    take it, and says that no worker became healthy."""
    server = FaultyServer(EmbeddedEngine(model_dirs[0]), faults=Faults(health_generate=fault))
    url = await server.start()
    client = SGLangEngine(SGLangClientConfig(worker_urls=[url], health_timeout_s=3, health_generate_timeout_s=1))
    try:
        with pytest.raises(EngineError, match="no SGLang worker became healthy"):
            await client.start()
        assert not client.workers[url].healthy
    finally:
        await client.close()
        await server.stop()


async def test_unreachable_worker_gives_clear_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = fast_client(f"http://127.0.0.1:{port}")
    try:
        with pytest.raises(EngineError, match=f"127.0.0.1:{port}"):
            await client.generate(greedy("nobody", 3))
        assert not client.workers[f"http://127.0.0.1:{port}"].healthy
        await client.abort_all()  # fan-out to a dead worker logs, never raises
    finally:
        await client.close()


def test_cli_help_and_bad_model_path(tmp_path: Path) -> None:
    from rljob.runtime.engines.server import build_arg_parser, main

    text = build_arg_parser().format_help()
    for flag in ("--model-path", "--host", "--port", "--max-batch-size", "--sglang-version"):
        assert flag in text
    assert "--fault" not in text, "fault switches live in tests/helpers/server_faults.py, not in production"
    with pytest.raises(SystemExit, match="no config.json"):
        main(["--model-path", str(tmp_path)])


# --------------------------------------------------------------------------- a faithful stand-in
# Each test states what SGLang's own source does (docs/sglang_standin.md cites the functions) and checks
# the CPU server does the same over real HTTP, for 0.5.23 and, where they differ, 0.5.5.post3.

LEGACY = "0.5.5.post3"


@contextlib.asynccontextmanager
async def standin(model_dir: Path, max_batch_size: int = 4, **options: Any) -> AsyncIterator[tuple[SGLangProtocolServer, httpx.AsyncClient]]:
    """An in-process server with ``options`` and a raw HTTP client on it."""
    server = SGLangProtocolServer(EmbeddedEngine(model_dir, max_batch_size=max_batch_size),
                                  ServerOptions(model_path=str(model_dir), **options))
    url = await server.start()
    try:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            yield server, http
    finally:
        await server.stop()


def gen_body(rid: str, max_new_tokens: int, prompt: list[int] = PROMPT) -> dict[str, Any]:
    return {"input_ids": prompt, "rid": rid, "return_logprob": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}


def post_generate(http: httpx.AsyncClient, body: dict[str, Any]) -> asyncio.Task[httpx.Response]:
    return asyncio.create_task(http.post("/generate", json=body))


def test_health_settings_read_sglangs_environment() -> None:
    from rljob.runtime.engines.server import health_settings

    assert health_settings({}) == (True, 20.0)  # SGLang's defaults
    assert health_settings({"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false", "SGLANG_HEALTH_CHECK_TIMEOUT": "45"}) == (False, 45.0)
    assert health_settings({"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"})[0] is False
    with pytest.raises(ValueError, match="SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"):
        health_settings({"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "maybe"})


@pytest.mark.parametrize("generation", [True, False])
async def test_health_runs_a_generation_unless_switched_off(model_dirs: tuple[Path, Path], generation: bool) -> None:
    """/health and /health_generate are one handler: a 1-token generation, except that /health answers
    at once when SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is false."""
    async with standin(model_dirs[0], health_endpoint_generation=generation) as (server, http):
        stats = server.engine.stats
        before = stats.finished.total()
        assert (await http.get("/health")).status_code == 200
        assert (stats.finished.total() > before) is generation
        before = stats.finished.total()
        assert (await http.get("/health_generate")).status_code == 200
        assert stats.finished.total() > before  # /health_generate always generates


async def test_health_waits_while_paused_and_fails_without_scheduler_output(model_dirs: tuple[Path, Path]) -> None:
    """The health generation waits at the pause gate like any request; with no scheduler output for
    SGLANG_HEALTH_CHECK_TIMEOUT it answers 503 (and 0.5.23's /ready follows); once generation continues
    it passes again."""
    async with standin(model_dirs[0], health_check_timeout_s=600.0) as (server, http):
        assert (await http.post("/pause_generation", json={"mode": "in_place"})).status_code == 200
        waiting = asyncio.create_task(http.get("/health"))
        await wait_until(lambda: server.gate.blocked == 1, "the health generation to wait at the pause gate")
        assert not waiting.done()
        assert (await http.post("/continue_generation")).status_code == 200
        assert (await waiting).status_code == 200

        server.options.health_check_timeout_s = 2.0
        assert (await http.post("/pause_generation", json={"mode": "in_place"})).status_code == 200
        assert (await http.get("/health_generate")).status_code == 503
        assert (await http.get("/ready")).status_code == 503
        assert (await http.post("/continue_generation")).status_code == 200
        assert (await http.get("/ready")).status_code == 503  # unhealthy until a health check passes
        assert (await http.get("/health_generate")).status_code == 200
        assert (await http.get("/ready")).status_code == 200


async def test_a_busy_server_passes_health_on_other_requests_output(model_dirs: tuple[Path, Path]) -> None:
    """Any scheduler output after the check started counts, so a server busy with long requests is
    healthy even when its queue is full and the health request itself cannot run."""
    async with standin(model_dirs[0], max_batch_size=1) as (server, http):
        long = post_generate(http, gen_body("long", 400))
        await wait_until_generating(server)
        assert (await http.get("/health")).status_code == 200
        # The long request was not disturbed: it is either still running (our abort ends it) or it ran to
        # its full length meanwhile; which one depends on the machine's speed, so both are accepted.
        assert (await http.post("/abort_request", json={"rid": "long"})).status_code == 200
        meta = (await long).json()["meta_info"]
        assert meta["finish_reason"]["type"] in ("abort", "length"), meta
        if meta["finish_reason"]["type"] == "length":
            assert meta["completion_tokens"] == 400, meta


async def test_weight_updates_wait_for_requests_and_hold_new_ones(model_dirs: tuple[Path, Path]) -> None:
    """An update takes the model-update lock's exclusive side: it waits for the request in flight, and
    requests (and the health generation) that come meanwhile wait for it, then run on the new weights."""
    async with standin(model_dirs[0]) as (server, http):
        running = post_generate(http, gen_body("old-weights", 400))
        await wait_until_generating(server)
        update = asyncio.create_task(http.post("/update_weights_from_disk", json={
            "model_path": str(model_dirs[1]), "weight_version": "7"}))
        await wait_until(lambda: server.gate.writers_waiting == 1, "the update to wait for the running request")
        later = post_generate(http, gen_body("new-weights", 3))
        health = asyncio.create_task(http.get("/health"))
        await wait_until(lambda: server.gate.blocked == 2, "the new request and the health check to wait")
        assert not update.done() and not later.done() and not health.done()
        assert (await http.post("/abort_request", json={"rid": "old-weights"})).status_code == 200
        old = (await running).json()["meta_info"]
        assert old["finish_reason"]["type"] == "abort" and old["weight_version"] == "0"
        assert (await update).json()["success"] is True
        assert (await later).json()["meta_info"]["weight_version"] == "7"
        assert (await health).status_code == 200


async def test_weight_updates_reach_the_scheduler_one_at_a_time_in_arrival_order(model_dirs: tuple[Path, Path]) -> None:
    """SGLang's tokenizer manager has one weight update at the scheduler at a time and queues the others
    FIFO, also while paused, when 0.5.23 skips the model-update lock: a bucket posted while the one before
    is still receiving waits for its turn, then receives its own tensors. (A failure here leaves the
    first bucket's receive waiting: the group's timeout is short so the server still stops.)"""
    async with standin(model_dirs[0], weight_group_timeout_s=20.0) as (server, http):
        store = await asyncio.to_thread(open_store, "127.0.0.1", 0, 2, 60.0)
        name = f"fifo-{uuid.uuid4().hex[:8]}"
        rank0 = asyncio.create_task(asyncio.to_thread(create_group, store, name, 2, "gloo", 60.0))
        joined = await http.post("/init_weights_update_group", json={
            "master_address": "127.0.0.1", "master_port": store.port, "rank_offset": 1, "world_size": 2,
            "group_name": name, "backend": "gloo"})
        assert joined.json()["success"] is True, joined.text
        group = await rank0
        try:
            assert (await http.post("/pause_generation", json={"mode": "in_place"})).status_code == 200
            targets = server.engine.model.state_dict()
            first_name, second_name = "model.norm.weight", "model.layers.0.input_layernorm.weight"
            first, second = (torch.full_like(targets[n], value) for n, value in ((first_name, 2.0), (second_name, 3.0)))

            def bucket(tensor_name: str, tensor: torch.Tensor) -> dict[str, Any]:
                return {"names": [tensor_name], "dtypes": ["float32"], "shapes": [list(tensor.shape)],
                        "group_name": name}

            posted_first = asyncio.create_task(http.post("/update_weights_from_distributed", json=bucket(first_name, first)))
            await wait_until(lambda: server.update_running, "the first bucket to have its turn")
            posted_second = asyncio.create_task(http.post("/update_weights_from_distributed", json=bucket(second_name, second)))
            await wait_until(lambda: server.updates_queued == 1, "the second bucket to wait for its turn")
            await asyncio.to_thread(group.broadcast_all, [first])
            assert (await posted_first).json()["success"] is True
            await asyncio.to_thread(group.broadcast_all, [second])
            assert (await posted_second).json()["success"] is True
            loaded = server.engine.model.state_dict()
            assert torch.equal(loaded[first_name], first) and torch.equal(loaded[second_name], second)
        finally:
            group.close()


@pytest.mark.parametrize("version", ["0.5.23", LEGACY])
async def test_update_while_paused_in_place(model_dirs: tuple[Path, Path], version: str) -> None:
    """0.5.23 updates at once while paused (whoever paused owns the engine), and an in-place pause keeps
    the running request, which finishes on the new weights; 0.5.5.post3 ignores the pause body and
    aborts everything, then updates."""
    async with standin(model_dirs[0], sglang_version=version) as (server, http):
        running = post_generate(http, gen_body("kept", 400))
        await wait_until_generating(server)
        assert (await http.post("/pause_generation", json={"mode": "in_place"})).status_code == 200
        reply = await http.post("/update_weights_from_disk", json={"model_path": str(model_dirs[1]), "weight_version": "3"})
        assert reply.json()["success"] is True
        if version == LEGACY:  # aborted by the pause; the update waited for it to finish
            assert server.engine.current_load().running == 0
        else:  # kept, paused, while the update ran
            assert server.engine.current_load().running == 1
        assert (await http.post("/continue_generation")).status_code == 200
        await http.post("/abort_request", json={"rid": "kept"})
        meta = (await running).json()["meta_info"]
        assert meta["finish_reason"]["type"] == "abort"
        assert meta["weight_version"] == ("0" if version == LEGACY else "3")


@pytest.mark.parametrize("version", ["0.5.23", LEGACY])
async def test_context_length_check(model_dirs: tuple[Path, Path], version: str) -> None:
    """A prompt as long as the context is refused (>=, not >) with 400 {"error": {"message"}}; prompt plus
    max_new_tokens may fill the context in 0.5.23 but must stay below it in 0.5.5.post3."""
    async with standin(model_dirs[0], sglang_version=version) as (server, http):
        context = server.engine.max_context_len
        full = await http.post("/generate", json=gen_body("full", 1, [5] * context))
        assert full.status_code == 400
        assert "longer than the model's context length" in full.json()["error"]["message"]
        fills = await http.post("/generate", json=gen_body("fills", 1, [5] * (context - 1)))
        if version == LEGACY:
            assert fills.status_code == 400
            assert "exceeds the model's maximum context length" in fills.json()["error"]["message"]
        else:
            assert fills.status_code == 200 and len(fills.json()["output_ids"]) == 1
        over = await http.post("/generate", json=gen_body("over", 2, [5] * (context - 1)))
        assert over.status_code == 400 and "maximum context length" in over.json()["error"]["message"]


async def test_duplicate_request_ids(model_dirs: tuple[Path, Path]) -> None:
    """0.5.23 refuses a rid already in flight (or twice in one batch) with 400; the rid is free again once
    its request has answered. 0.5.5.post3 has no such check and runs both."""
    async with standin(model_dirs[0]) as (server, http):
        first = post_generate(http, gen_body("dup", 400))
        await wait_until_generating(server)
        again = await http.post("/generate", json=gen_body("dup", 3))
        assert again.status_code == 400 and again.json()["error"]["message"] == "Duplicate request ID detected: dup"
        batch = await http.post("/generate", json={"input_ids": [PROMPT, PROMPT], "rid": ["b", "b"]})
        assert batch.status_code == 400 and "Duplicate request ID detected: b" in batch.json()["error"]["message"]
        await http.post("/abort_request", json={"rid": "dup"})
        await first
        assert (await http.post("/generate", json=gen_body("dup", 3))).status_code == 200
    async with standin(model_dirs[0], sglang_version=LEGACY) as (server, http):
        both = [post_generate(http, gen_body("dup", 400)) for _ in range(2)]
        await wait_until(lambda: server.engine.current_load().running == 2, "both copies to run")
        await http.post("/abort_request", json={"abort_all": True})
        assert [(await t).status_code for t in both] == [200, 200]


@pytest.mark.parametrize("version", ["0.5.23", LEGACY])
async def test_abort_replies_of_running_and_queued_requests(model_dirs: tuple[Path, Path], version: str) -> None:
    """A running request answers with its partial output, log-probs, prompt_tokens and weight_version,
    finish type abort ("Aborted"); a queued one answers "Abort in waiting queue" without prompt_tokens
    (and, in 0.5.5.post3, without weight_version)."""
    async with standin(model_dirs[0], max_batch_size=1, sglang_version=version) as (server, http):
        running = post_generate(http, gen_body("run", 400))
        await wait_until_generating(server)
        queued = post_generate(http, gen_body("queue", 400))
        await wait_until(lambda: server.engine.current_load().waiting == 1, "the second request to queue")
        assert (await http.post("/abort_request", json={"abort_all": True})).status_code == 200
        run, queue = (await running).json(), (await queued).json()
        meta = run["meta_info"]
        assert meta["finish_reason"] == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        assert 0 < len(run["output_ids"]) == len(meta["output_token_logprobs"]) == meta["completion_tokens"] < 400
        assert meta["prompt_tokens"] == len(PROMPT) and meta["weight_version"] == "0"
        qmeta = queue["meta_info"]
        assert qmeta["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
        assert queue["output_ids"] == [] and qmeta["completion_tokens"] == 0 and "prompt_tokens" not in qmeta
        assert ("weight_version" in qmeta) is (version != LEGACY)


async def test_abort_by_rid_matches_exact_rids_only(model_dirs: tuple[Path, Path]) -> None:
    """SGLang forwards an abort only for a rid it holds: a prefix, an unknown rid or an empty rid without
    abort_all does nothing; the exact rid aborts."""
    async with standin(model_dirs[0]) as (server, http):
        task = post_generate(http, gen_body("grp-1", 400))
        await wait_until_generating(server)
        for body in ({"rid": "grp-"}, {"rid": "other"}, {"rid": ""}, {}):
            assert (await http.post("/abort_request", json=body)).status_code == 200
        tokens = server.engine.stats.generated_tokens
        await wait_until(lambda: server.engine.stats.generated_tokens >= tokens + 3, "decoding to go on")
        assert server.engine.current_load().running == 1
        assert (await http.post("/abort_request", json={"rid": "grp-1"})).status_code == 200
        assert (await task).json()["meta_info"]["finish_reason"]["type"] == "abort"


@pytest.mark.parametrize("version", ["0.5.23", LEGACY])
async def test_version_endpoints_and_the_client_on_each_release(model_dirs: tuple[Path, Path], version: str) -> None:
    """0.5.23 removed /get_weight_version (and /get_load): /model_info carries weight_version; 0.5.5.post3
    has /get_weight_version and /get_model_info but no /model_info, /v1/loads or /ready. The client finds
    the served version on both and keeps a paused worker in the rotation."""
    async with standin(model_dirs[0], sglang_version=version, health_check_timeout_s=600.0) as (server, http):
        paths = ("/get_weight_version", "/get_load", "/model_info", "/server_info", "/v1/loads", "/ready")
        found = {p for p in paths if (await http.get(p)).status_code == 200}
        legacy_only = {"/get_weight_version", "/get_load"}
        assert found == (legacy_only if version == LEGACY else set(paths) - legacy_only)
        assert (await http.get("/get_model_info")).json()["weight_version"] == "0"

        client = fast_client(str(http.base_url).rstrip("/"))
        await client.start()
        try:
            await client.update_weights(WeightUpdate(version=4, path=str(model_dirs[1])))
            assert (await client.generate(greedy("after", 3))).weight_version == 4
            assert (await http.post("/pause_generation", json={"mode": "in_place"})).status_code == 200
            assert await client.health()  # no /health generation: a paused worker stays in the rotation
            assert (await http.post("/continue_generation")).status_code == 200
        finally:
            await client.close()


# --------------------------------------------------------------------------- real router, worker processes


@dataclass
class Cluster:
    workers: list[str]
    router: str
    procs: dict[str, subprocess.Popen[bytes]]
    logs: Path

    async def describe(self) -> str:
        """What the router lists and each worker holds, and the router log's end: a failed wait's message."""
        lines = []
        async with httpx.AsyncClient() as http:
            for url in (self.router + "/workers", *(w + "/v1/loads" for w in self.workers),
                        *(w + "/metrics" for w in self.workers)):
                try:
                    text = (await http.get(url, timeout=10)).text
                except httpx.HTTPError as exc:
                    text = repr(exc)
                if url.endswith("/metrics"):  # what each worker served: finished requests, generated tokens
                    text = " ".join(line for line in text.splitlines()
                                    if line.startswith(("sglang:num_requests_total", "sglang:generation_tokens_total")))
                lines.append(f"{url}: {text[:2000]}")
        router_log = (self.logs / "router.log").read_text(errors="replace")
        return "\n".join(lines) + "\nrouter log, its end:\n" + router_log[-3000:]


@pytest.fixture(scope="module")
def cluster(model_dirs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("logs")
    procs: dict[str, subprocess.Popen[bytes]] = {}
    workers = []
    try:
        for i in range(2):
            url, procs[url] = start_worker(model_dirs[0], logs / f"worker{i}.log", max_batch_size=4)
            workers.append(url)
        for i, url in enumerate(workers):
            wait_http(url + "/health_generate", 180, procs[url], logs / f"worker{i}.log")
        router, procs[router] = start_router(workers, logs / "router.log")
        wait_http(router + "/health", 60, procs[router], logs / "router.log")
        # The router adds its workers asynchronously: wait until it lists both before any test reads it.
        asyncio.run(wait_until(lambda: _router_lists(router, set(workers)), "the router listing both workers",
                               timeout=120, interval=0.2))
        yield Cluster(workers, router, procs, logs)
    finally:
        stop(list(procs.values()))


# Batches of 400-token requests to send until one is seen on both workers at once: a batch can be back
# within a second, between two polls (the fan-out test saw two such batches in a row beside busy loops).
BATCH_ATTEMPTS = 10


async def worker_running(url: str) -> int:
    async with httpx.AsyncClient() as http:
        return int((await http.get(url + "/v1/loads")).json()["loads"][0]["num_running_reqs"])


async def _router_lists(router: str, workers: set[str]) -> bool:
    async with httpx.AsyncClient() as http:
        listed = (await http.get(router + "/workers", timeout=10)).json()["workers"]
    return {w["url"].rstrip("/") for w in listed} == workers


def batch_outcomes(tasks: list[asyncio.Task[GenerateResult]]) -> list[str]:
    """How each finished request of a batch ended: its finish reason, or its exception."""
    return [repr(t.exception()) if t.exception() else t.result().finish_reason for t in tasks]


async def running_everywhere_unless_done(workers: list[str], tasks: list[asyncio.Task[GenerateResult]]) -> bool:
    """Wait until every worker runs requests (True) or every task has finished first (False)."""
    async def settled() -> bool:
        return all(t.done() for t in tasks) or all([await worker_running(w) for w in workers])

    await wait_until(settled, "requests running on every worker, or the batch finished", interval=0.05)
    return not all(t.done() for t in tasks)


async def test_router_generation_and_abort_fan_out_reach_every_worker(cluster: Cluster) -> None:
    client = fast_client(router=cluster.router)  # workers discovered from the router
    await client.start()
    try:
        assert sorted(client.workers) == sorted(cluster.workers)
        short = await client.generate(greedy("router-short", 5))
        assert short.finish_reason == "length" and len(short.output_ids) == 5

        async def all_six_held() -> bool:  # none still in the router, where the abort cannot reach it
            async with httpx.AsyncClient() as http:
                loads = [(await http.get(w + "/v1/loads", timeout=10)).json()["loads"][0] for w in cluster.workers]
            return sum(load["num_running_reqs"] + load["num_waiting_reqs"] for load in loads) == 6

        async def pause_all(paused: bool) -> None:
            async with httpx.AsyncClient() as http:
                for w in cluster.workers:
                    path, body = ("/pause_generation", {"mode": "in_place"}) if paused else ("/continue_generation", {})
                    assert (await http.post(w + path, json=body, timeout=30)).status_code == 200

        async def frozen(tasks: list[asyncio.Task[GenerateResult]]) -> bool:
            """Freeze the six at an observed point: both workers run requests and, paused (the reply comes after
            the step in flight), hold all six, so none can finish by length before the abort. False when all six
            finished first: an idle machine decodes 400 tokens in about 2 s, and a poll of both workers, or a
            pause that found some already done, can miss that window (clean-clone runs 26 and 32)."""
            while not all(t.done() for t in tasks):
                if not all([await worker_running(w) for w in cluster.workers]):
                    await asyncio.sleep(0.005)
                    continue
                await pause_all(True)
                if await all_six_held():
                    return True
                await pause_all(False)
            return False

        attempts: list[str] = []  # each batch's outcome (the failure message's timeline)
        for attempt in range(BATCH_ATTEMPTS):  # a new batch only once the last one finished unfrozen: event-driven
            tasks = [asyncio.create_task(client.generate(greedy(f"rr-{attempt}-{i}", 400))) for i in range(6)]
            sent = asyncio.get_running_loop().time()
            if await frozen(tasks):
                break
            outcomes = batch_outcomes(tasks)
            attempts.append(f"batch {attempt}: {outcomes}, all back within {asyncio.get_running_loop().time() - sent:.1f} s")
        else:
            client_view = [(u, w.healthy, w.failures, w.last_error) for u, w in client.workers.items()]
            raise AssertionError("no batch of six was ever held by both workers at once\n" + "\n".join(attempts)
                                 + f"\nclient workers {client_view}\n{await cluster.describe()}")
        print(f"frozen on batch {len(attempts)}", *attempts, sep="\n")
        await client.abort_all()
        await pause_all(False)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        assert all(r.finish_reason == "abort" for r in results)
        assert sum(1 for r in results if r.output_ids) >= 2
        for url in cluster.workers:
            assert await worker_running(url) == 0
        async with httpx.AsyncClient() as http:  # the router itself does not forward aborts
            assert (await http.post(cluster.router + "/abort_request", json={"rid": ""})).status_code == 404
    finally:
        await client.close()


async def test_worker_killed_mid_round_is_marked_unhealthy_without_hanging(cluster: Cluster) -> None:
    """Runs last in this module: it kills one worker of the shared cluster.

    Two clients share the round: one generates through the router, one straight on the workers (it
    spreads requests over both). After the kill, nothing hangs, every call ends as an abort, a clear
    EngineError or (on the survivor, which may be quicker than the abort) its full budget, both clients
    take the dead worker out of rotation, and the survivor keeps serving.
    """
    via_router = fast_client(*cluster.workers, router=cluster.router)
    direct = fast_client(*cluster.workers)
    clients = (via_router, direct)
    for client in clients:
        await client.start()
    try:
        # Both workers must run requests at the kill. A batch may finish before a poll sees that (run 54, two
        # busy loops beside the suite: 120 s of polls never saw both running); a new batch then follows.
        attempts: list[str] = []  # each unseen batch's outcome (the failure message's timeline)
        for attempt in range(BATCH_ATTEMPTS):
            tasks = [
                asyncio.create_task(client.generate(greedy(f"kill-{attempt}-{n}-{i}", 400)))
                for n, client in enumerate(clients) for i in range(3)
            ]
            try:
                if await running_everywhere_unless_done(cluster.workers, tasks):
                    break
            except AssertionError as exc:  # neither: say what each side held
                views = [(c.table.router_url, [(u, w.healthy, w.in_flight) for u, w in c.workers.items()]) for c in clients]
                raise AssertionError(f"{exc}\n" + "\n".join(attempts) + f"\nclients {views}\n{await cluster.describe()}") from None
            attempts.append(f"batch {attempt}: {batch_outcomes(tasks)}")
        else:
            raise AssertionError("no batch ever ran on both workers at once\n" + "\n".join(attempts)
                                 + f"\n{await cluster.describe()}")
        victim, survivor = cluster.workers
        os.killpg(cluster.procs[victim].pid, signal.SIGKILL)
        cluster.procs[victim].wait(timeout=10)
        # The direct client has seen its connections drop (a failed call, then a failed /health probe).
        await wait_until(lambda: not direct.workers[victim].healthy, "the direct client marking the victim unhealthy")
        for client in clients:
            await client.abort_all()  # must not raise although one worker is gone
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
        cut_short = 0
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                assert isinstance(outcome, EngineError) and "/generate" in str(outcome)
                cut_short += 1
            elif outcome.finish_reason == "length":
                # A survivor's request may finish its whole budget before the abort reaches it.
                assert len(outcome.output_ids) == 400, outcome
            else:
                assert isinstance(outcome, GenerateResult) and outcome.finish_reason == "abort"
                cut_short += 1
        # The victim was running requests when it died: those cannot have finished normally.
        assert cut_short >= 1, outcomes
        for client in clients:
            assert not client.workers[victim].healthy and client.workers[survivor].healthy
            assert (await client.generate(greedy("survivor", 3))).finish_reason == "length"
            assert (await client.load()).total == 0
            assert await client.health()  # the survivor is enough
    finally:
        for client in clients:
            await client.close()



async def test_a_new_client_resumes_a_worker_a_killed_trainer_left_paused(served: Served) -> None:
    """A trainer killed inside a weight sync, between /pause_generation and /continue_generation, leaves
    the worker paused (found on the real node: the restarted trainer then waited on /health_generate
    for ever). The next trainer's client resumes it before probing it."""
    async with httpx.AsyncClient(base_url=served.url) as http:
        assert (await http.post("/pause_generation", json={"mode": "in_place"})).status_code == 200
    assert served.server.gate.paused
    successor = SGLangEngine(SGLangClientConfig(worker_urls=[served.url], health_timeout_s=60,
                                                health_generate_timeout_s=5, probe_timeout_s=2.0))
    try:
        await asyncio.wait_for(successor.start(), 90)
        assert not served.server.gate.paused
        assert (await successor.generate(greedy("resumed", 3))).finish_reason == "length"
    finally:
        await successor.close()
