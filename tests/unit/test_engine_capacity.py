"""A worker's capacity from its server info (engines/capacity.py), checked against SGLang's released source,
and the slot gate that follows the rotation's total."""

from __future__ import annotations

import asyncio
import re

import pytest

from rljob.runtime.engines.capacity import SlotGate, running_capacity
from tests.helpers.sglang_release import PINNED, read_source
from tests.helpers.sglang_source import SGLangSource
from tests.helpers.releases import SGLANG_RELEASES, release_dir


def test_the_flag_wins_and_counts_per_data_parallel_rank():
    assert running_capacity({"max_running_requests": 48, "max_total_num_tokens": 10**6}) == 48
    assert running_capacity({"max_running_requests": 48, "dp_size": 2}) == 96


def test_without_the_flag_it_is_derived_as_sglang_sizes_its_request_pool():
    # 20k tokens of KV cache, 8k context: 1250 contexts' worth is clamped up to 2048; half the tokens is above.
    assert running_capacity({"max_running_requests": None, "max_total_num_tokens": 20_000,
                             "max_req_input_len": 8187}) == 2048
    # a huge cache with a short context: the pool is clamped to 4096.
    assert running_capacity({"max_total_num_tokens": 10**7, "context_length": 512}) == 4096
    # a tiny cache: half its tokens.
    assert running_capacity({"max_total_num_tokens": 1000, "context_length": 4096}) == 500


def test_an_info_without_either_tells_nothing():
    assert running_capacity({}) is None
    assert running_capacity({"max_total_num_tokens": 1000}) is None
    assert running_capacity({"max_running_requests": "many", "max_total_num_tokens": True}) is None


@pytest.mark.parametrize("version", SGLANG_RELEASES)
def test_sglang_reports_the_fields_the_rule_reads(version: str):
    source = SGLangSource(release_dir("sglang", version))
    assert {"max_running_requests", "context_length", "dp_size", "dtype"} <= source.server_args_fields
    scheduler = read_source(version, "sglang/srt/managers/scheduler.py")
    # The scheduler's start-up info, which /get_server_info spreads next to ServerArgs.
    assert re.search(r'"status": "ready",\s*"max_total_num_tokens": [^,]+,\s*"max_req_input_len"', scheduler)


def test_the_pinned_release_derives_max_running_requests_as_the_rule_does():
    worker = read_source(PINNED, "sglang/srt/managers/tp_worker.py")
    assert re.search(r"self\.max_total_num_tokens // 2\s*if server_args\.max_running_requests is None", worker)
    assert "self.model_runner.req_to_token_pool.size" in worker
    runner = read_source(PINNED, "sglang/srt/model_executor/model_runner.py")
    assert re.search(r"self\.max_total_num_tokens / self\.model_config\.context_len \* 512\s*\),\s*2048,\s*\),\s*4096",
                     runner)


async def test_the_gate_admits_up_to_a_limit_that_may_grow():
    limit = 2
    gate = SlotGate(lambda: limit, recheck_s=0.01)
    await gate.acquire()
    await gate.acquire()
    third = asyncio.create_task(gate.acquire())
    fourth: asyncio.Task[None] | None = None
    try:
        await asyncio.sleep(0)
        assert not third.done() and gate.in_use == 2
        limit = 3  # a worker joined the rotation: no release, the recheck admits it
        await asyncio.wait_for(third, 10)
        assert gate.in_use == 3
        fourth = asyncio.create_task(gate.acquire())
        await asyncio.sleep(0)
        assert not fourth.done()
        gate.release()
        await asyncio.wait_for(fourth, 10)
        assert gate.in_use == 3
    finally:
        for task in (third, fourth):
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in (third, fourth) if t is not None), return_exceptions=True)
