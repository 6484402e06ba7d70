"""Chunked prefill mixed into decode steps (chunked_prefill.py) changes nothing a caller sees: the same
greedy tokens and the same log-probs as the unchunked engine, through aborts, resumes, prefix sharing and
weight installs. The engine's counters show the chunks really rode in decode steps (``mixed_steps``).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from rljob.runtime.engines.base import EngineError, GenerateRequest, GenerateResult, WeightUpdate
from rljob.runtime.engines.chunked_prefill import Planned, plan_pieces
from rljob.runtime.engines.embedded import EmbeddedEngine
from tests.helpers.engine_runs import run_all
from tests.helpers.tiny_model import build_tiny_model
from tests.helpers.waiting import wait_until

# float64, as test_embedded.py explains: the packed forward and the unchunked ones reduce in different
# orders, which in float64 moves log-probs by ~1e-15 (eps64 times the model's ~1e3 amplification);
# 1e-9 leaves five orders of margin, while a wrong chunk (a missing or misplaced key, a shifted position,
# a leaked causal mask) moves log-probs by more than 1e-2.
EXACT_ATOL = 1e-9
BUDGET = 5  # prompt tokens per step: every prompt below takes 2 to 13 steps to prefill
PROMPTS = [
    [3, 1, 4, 1, 5, 9, 2, 6],
    [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4, 5, 2, 3, 5, 3, 6, 0, 2, 8, 7, 4, 7, 1],
    [1, 4, 1, 4, 2, 1],
    list(range(10, 74)),  # a long one (a resumed partial's length): 13 chunks while the others decode
    [6, 6, 2, 6, 0, 7, 5],
]


def float64_engine(max_batch_size: int, chunked: int, **kw: object) -> EmbeddedEngine:
    return EmbeddedEngine(build_tiny_model(0).double(), max_batch_size=max_batch_size, dtype=torch.float64,
                          chunked_prefill_tokens=chunked, **kw)  # type: ignore[arg-type]


def greedy(rid: str, prompt: list[int], max_new_tokens: int) -> GenerateRequest:
    return GenerateRequest(rid=rid, input_ids=prompt, max_new_tokens=max_new_tokens, temperature=0.0)


def assert_same(got: list[GenerateResult], expected: list[GenerateResult]) -> None:
    for g, e in zip(got, expected, strict=True):
        assert g.output_ids == e.output_ids and g.finish_reason == e.finish_reason
        assert g.output_logprobs == pytest.approx(e.output_logprobs, abs=EXACT_ATOL)


def test_plan_takes_the_oldest_prompts_first_within_the_budget() -> None:
    pending = [("a", 10, 7), ("b", 4, 0), ("c", 9, 0)]  # a is part-way: 3 tokens left
    assert plan_pieces(pending, 5) == [Planned("a", 7, 10), Planned("b", 0, 2)]
    assert plan_pieces(pending, 7) == [Planned("a", 7, 10), Planned("b", 0, 4)]
    assert plan_pieces(pending, 100) == [Planned("a", 7, 10), Planned("b", 0, 4), Planned("c", 0, 9)]
    assert plan_pieces([("done", 4, 4), ("b", 4, 0)], 2) == [Planned("b", 0, 2)]
    assert plan_pieces([], 8) == []
    with pytest.raises(ValueError, match="budget"):
        plan_pieces(pending, 0)


@pytest.mark.parametrize("prefix_cache_tokens", [0, 1024])
async def test_chunked_prefill_gives_the_unchunked_tokens_and_logprobs(prefix_cache_tokens: int) -> None:
    """Staggered budgets on a batch of 3 (requests join as others leave), two samples of each prompt (so
    with a prefix cache the second shares the first's chunked prefill), the long prompt prefilled in 13
    chunks while the others decode."""
    budgets = [24, 9, 30, 12, 18]
    requests = [greedy(f"{i}.{k}", p, n) for k in range(2) for i, (p, n) in enumerate(zip(PROMPTS, budgets))]
    chunked = float64_engine(3, BUDGET, prefix_cache_tokens=prefix_cache_tokens)
    plain = float64_engine(3, 0, prefix_cache_tokens=prefix_cache_tokens)
    got = await run_all(chunked, requests)
    expected = await run_all(plain, requests)
    assert_same(got, expected)
    assert chunked.stats.prefill_tokens == plain.stats.prefill_tokens  # the same prompt tokens computed
    assert chunked.stats.cached_prefill_tokens == plain.stats.cached_prefill_tokens
    assert [r.cached_tokens for r in got] == [r.cached_tokens for r in expected]
    # Chunks really rode in decode steps, and a long prompt really spread over several steps.
    assert chunked.stats.mixed_steps >= len(PROMPTS[3]) // BUDGET
    assert chunked.stats.prefill_steps > plain.stats.prefill_steps


async def test_sampled_logprobs_are_those_of_the_full_sequence() -> None:
    """Sampling (temperature 0.7, top-p) draws other random numbers than the unchunked order, so the check
    is against the model itself: each token's log-prob is log_softmax(logits / T) of the full sequence."""
    temperature = 0.7
    eng = float64_engine(4, BUDGET, seed=0)
    requests = [GenerateRequest(rid=f"s{i}", input_ids=p, max_new_tokens=10, temperature=temperature, top_p=0.9)
                for i, p in enumerate(PROMPTS)]
    results = await run_all(eng, requests)
    model = build_tiny_model(0).double()
    for prompt, res in zip(PROMPTS, results, strict=True):
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([prompt + res.output_ids])).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits / temperature, dim=-1).gather(-1, torch.tensor(res.output_ids)[:, None])
        assert res.output_logprobs == pytest.approx(expected.squeeze(-1).tolist(), abs=EXACT_ATOL)


async def test_abort_mid_prefill_and_resume_are_exact() -> None:
    """Abort everything while the long prompt is part-way through its chunks and another sequence is
    decoding: the part-way one returns no tokens, the decoding one its tokens so far; resuming each from
    prompt + partial response gives exactly an uninterrupted unchunked run. (The long prompt's part-way
    prefill, computed under the same weights, may be continued by the new request of the same tokens if
    no step ran in between, or dropped: exact either way.)"""
    long_prompt, short_prompt, budget = PROMPTS[3], PROMPTS[0], 20
    eng = float64_engine(4, BUDGET)
    plain = float64_engine(4, 0)
    try:
        await eng.start()
        short = asyncio.create_task(eng.generate(greedy("short", short_prompt, budget)))
        await wait_until(lambda: eng.stats.generated_tokens >= 2, "the short request decoding")
        long = asyncio.create_task(eng.generate(greedy("long", long_prompt, budget)))
        await wait_until(lambda: bool(eng._partials), "the long prompt part-way through its prefill")
        await eng.abort_all()
        cut_short, cut_long = await short, await long
        assert (cut_long.output_ids, cut_long.finish_reason) == ([], "abort")
        assert cut_short.finish_reason == "abort" and 0 < len(cut_short.output_ids) < budget
        resumed = await asyncio.gather(
            eng.generate(greedy("short-r", short_prompt + cut_short.output_ids, budget - len(cut_short.output_ids))),
            eng.generate(greedy("long-r", long_prompt, budget)),
        )
        assert not eng._partials  # the aborted prompt's part-way prefill was dropped, not reused
        await plain.start()
        whole = await asyncio.gather(plain.generate(greedy("s", short_prompt, budget)),
                                     plain.generate(greedy("l", long_prompt, budget)))
    finally:
        await eng.close()
        await plain.close()
    assert cut_short.output_ids + resumed[0].output_ids == whole[0].output_ids
    assert cut_short.output_logprobs + resumed[0].output_logprobs == pytest.approx(whole[0].output_logprobs,
                                                                                   abs=EXACT_ATOL)
    assert_same([resumed[1]], [whole[1]])


async def test_a_weight_install_restarts_part_way_prefills_under_the_new_weights() -> None:
    """A prompt part-way through its chunks when new weights land starts over: its first token comes from
    the new weights only (as on an engine that only ever had them), stamped with the new version."""
    prompt = PROMPTS[3]
    eng = float64_engine(4, 3, prefix_cache_tokens=1024)
    fresh = EmbeddedEngine(build_tiny_model(1).double(), max_batch_size=4, dtype=torch.float64)
    try:
        await eng.start()
        task = asyncio.create_task(eng.generate(greedy("g", prompt, 6)))
        await wait_until(lambda: bool(eng._partials), "the prompt part-way through its prefill")
        eng.pause()
        await eng.update_weights(WeightUpdate(version=1, module=build_tiny_model(1).double()))
        assert not eng._partials and not task.done()  # the prefill was still part-way, and is forgotten
        computed_before = eng.stats.prefill_tokens
        assert computed_before < len(prompt)
        eng.resume()
        after = await task
        await fresh.start()
        expected = await fresh.generate(greedy("f", prompt, 6))
    finally:
        await eng.close()
        await fresh.close()
    assert after.weight_version == 1
    assert eng.stats.prefill_tokens == computed_before + len(prompt)  # all of it again
    assert_same([after], [expected])


async def test_a_prefill_only_request_primes_the_cache_in_chunks() -> None:
    eng = float64_engine(4, BUDGET, prefix_cache_tokens=1024)
    try:
        await eng.start()
        primed = await eng.generate(greedy("prime", PROMPTS[1], 0))
        assert (primed.output_ids, primed.finish_reason) == ([], "length")
        group = await asyncio.gather(*(eng.generate(greedy(f"s{i}", PROMPTS[1], 4)) for i in range(3)))
    finally:
        await eng.close()
    assert eng.stats.prefill_tokens == len(PROMPTS[1])
    assert eng.stats.prefill_steps == -(-len(PROMPTS[1]) // BUDGET)
    assert [r.cached_tokens for r in group] == [len(PROMPTS[1])] * 3


async def test_chunked_prefill_needs_sdpa_attention() -> None:
    model = build_tiny_model(0)
    model.set_attn_implementation("eager")
    eng = EmbeddedEngine(model, max_batch_size=2, chunked_prefill_tokens=8)
    with pytest.raises(EngineError, match="sdpa"):
        await eng.start()
    with pytest.raises(ValueError, match="chunked_prefill_tokens"):
        EmbeddedEngine(model, chunked_prefill_tokens=-1)
