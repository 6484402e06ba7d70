"""A group's samples share their prompt's prefill in the embedded engine (prefix_cache.py), and sharing
changes nothing a caller sees: the same tokens and log-probs as every sample prefilling on its own.

The engine's own counters tell prefills apart: ``prefill_tokens`` (prompt tokens run through the model),
``cached_prefill_tokens`` (taken from a shared prefill) and ``prefill_steps`` (prefill forwards).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from rljob.runtime.engines.base import GenerateRequest, GenerateResult, WeightUpdate
from rljob.runtime.engines.embedded import EmbeddedEngine
from rljob.runtime.engines.prefix_cache import Prefill, PrefillCache
from tests.helpers.engine_runs import run_all
from tests.helpers.tiny_model import build_tiny_model
from tests.helpers.waiting import wait_until

# float64, as test_embedded.py explains: batched and solo forwards then agree to ~1e-15, so a tolerance
# five orders above that still catches any cache fault (those move log-probs by more than 1e-2).
EXACT_ATOL = 1e-9
PROMPT_A = [3, 1, 4, 1, 5, 9, 2]
PROMPT_B = [2, 7, 1, 8, 2, 8]  # similar length: prefilled in the same forward as PROMPT_A


def engine(max_batch_size: int, prefix_cache_tokens: int, seed: int = 0) -> EmbeddedEngine:
    return EmbeddedEngine(build_tiny_model(0).double(), max_batch_size=max_batch_size, dtype=torch.float64,
                          seed=seed, prefix_cache_tokens=prefix_cache_tokens)


def sample(rid: str, prompt: list[int], max_new_tokens: int = 12) -> GenerateRequest:
    return GenerateRequest(rid=rid, input_ids=prompt, max_new_tokens=max_new_tokens, temperature=1.0)


async def test_a_group_prefills_its_prompt_once_and_samples_as_if_each_prefilled_alone() -> None:
    """Two groups of 5 interleaved, plus one resumed sample (its own prompt + partial response), on a
    batch of 4: the groups' later samples are admitted in later steps, so the first wave shares within
    one forward and the later waves share through the cache. Fixed seed: sampled, not greedy."""
    resumed = PROMPT_A + [11, 12, 13]
    requests = [sample(f"a{i}", PROMPT_A) for i in range(5)] + [sample(f"b{i}", PROMPT_B) for i in range(5)]
    requests = requests[::2] + requests[1::2] + [sample("resumed", resumed)]
    shared_engine, alone_engine = engine(4, prefix_cache_tokens=1024), engine(4, prefix_cache_tokens=0)
    shared = await run_all(shared_engine, requests)
    alone = await run_all(alone_engine, requests)

    for s, a in zip(shared, alone, strict=True):
        assert s.output_ids == a.output_ids and len(s.output_ids) == 12
        assert s.output_logprobs == pytest.approx(a.output_logprobs, abs=EXACT_ATOL)
    distinct = len(PROMPT_A) + len(PROMPT_B) + len(resumed)
    everything = 5 * len(PROMPT_A) + 5 * len(PROMPT_B) + len(resumed)
    assert shared_engine.stats.prefill_tokens == distinct  # each distinct prompt ran through the model once
    assert shared_engine.stats.cached_prefill_tokens == everything - distinct
    assert alone_engine.stats.prefill_tokens == everything and alone_engine.stats.cached_prefill_tokens == 0
    # The later waves' samples took their prompts from the cache: no forward at all for them.
    assert shared_engine.stats.prefill_steps < alone_engine.stats.prefill_steps
    assert sorted(r.cached_tokens for r in shared) == [0] * 3 + [len(PROMPT_B)] * 4 + [len(PROMPT_A)] * 4
    assert all(r.cached_tokens == 0 for r in alone)


async def test_a_prefill_only_request_primes_the_cache_as_sglangs_n_does() -> None:
    """``max_new_tokens`` 0 prefills the prompt and returns no tokens (SGLang's prefill-only request, which
    its ``n`` parameter sends before the samples); the group that follows computes no prompt token."""
    eng = engine(8, prefix_cache_tokens=1024)
    try:
        await eng.start()
        primed = await eng.generate(sample("prime", PROMPT_A, max_new_tokens=0))
        assert (primed.output_ids, primed.finish_reason, primed.cached_tokens) == ([], "length", 0)
        assert eng.stats.prefill_tokens == len(PROMPT_A)
        group = await asyncio.gather(*(eng.generate(sample(f"s{i}", PROMPT_A)) for i in range(6)))
    finally:
        await eng.close()
    assert eng.stats.prefill_tokens == len(PROMPT_A)
    assert [r.cached_tokens for r in group] == [len(PROMPT_A)] * 6
    assert all(len(r.output_ids) == 12 for r in group)


async def test_new_weights_flush_the_cache_so_no_token_comes_from_old_logits() -> None:
    """A prompt cached under version 0 is prefilled again under version 1: its first token must come from
    the new weights (it is stamped with the new version), exactly as on an engine that never cached it."""
    eng = engine(4, prefix_cache_tokens=1024)
    fresh = EmbeddedEngine(build_tiny_model(1).double(), max_batch_size=4, dtype=torch.float64, prefix_cache_tokens=0)
    greedy = GenerateRequest(rid="g", input_ids=PROMPT_A, max_new_tokens=6, temperature=0.0)
    try:
        await eng.start()
        await eng.generate(greedy)
        await eng.update_weights(WeightUpdate(version=1, module=build_tiny_model(1).double()))
        after = await eng.generate(greedy)
        await fresh.start()
        expected = await fresh.generate(greedy)
    finally:
        await eng.close()
        await fresh.close()
    assert after.weight_version == 1 and after.cached_tokens == 0
    assert eng.stats.prefill_tokens == 2 * len(PROMPT_A)
    assert after.output_ids == expected.output_ids
    assert after.output_logprobs == pytest.approx(expected.output_logprobs, abs=EXACT_ATOL)


async def test_aborted_samples_of_a_shared_group_resume_exactly() -> None:
    """APRIL with sharing: a group is aborted mid-generation (running and waiting samples), then every
    sample resumes from prompt + its partial response; the concatenation equals an uninterrupted run's
    tokens on an engine without sharing (greedy, so the split point cannot change the draw)."""
    n, budget = 6, 20
    eng = engine(4, prefix_cache_tokens=1024)
    plain = engine(4, prefix_cache_tokens=0)
    try:
        await eng.start()
        tasks = [asyncio.create_task(eng.generate(GenerateRequest(f"s{i}", PROMPT_A, budget, temperature=0.0)))
                 for i in range(n)]
        # Some tokens exist: the abort cuts running samples mid-way and finds others still waiting.
        await wait_until(lambda: eng.stats.generated_tokens >= 8, "8 generated tokens")
        await eng.abort_all()
        first = await asyncio.gather(*tasks)
        assert any(r.output_ids for r in first) and any(len(r.output_ids) < budget for r in first)
        second = await asyncio.gather(*(
            eng.generate(GenerateRequest(f"s{i}-r", PROMPT_A + r.output_ids, budget - len(r.output_ids), temperature=0.0))
            for i, r in enumerate(first)))
        await plain.start()
        whole = await plain.generate(GenerateRequest("w", PROMPT_A, budget, temperature=0.0))
    finally:
        await eng.close()
        await plain.close()
    for a, b in zip(first, second, strict=True):
        assert a.output_ids + b.output_ids == whole.output_ids
        assert a.output_logprobs + b.output_logprobs == pytest.approx(whole.output_logprobs, abs=EXACT_ATOL)


def _prefill(tokens: int) -> Prefill:
    return Prefill(keys=[torch.zeros(2, tokens, 4)], values=[torch.zeros(2, tokens, 4)], logits=torch.zeros(8))


def test_prefill_cache_evicts_least_recently_used_within_its_token_budget() -> None:
    cache = PrefillCache(capacity_tokens=10)
    cache.put([1, 2, 3, 4], _prefill(4))
    cache.put([5, 6, 7], _prefill(3))
    assert cache.get([1, 2, 3, 4]) is not None  # now the most recently used
    cache.put([8, 9, 10, 11], _prefill(4))  # 11 tokens: the least recently used ([5, 6, 7]) goes
    assert cache.get([5, 6, 7]) is None and cache.get([1, 2, 3, 4]) is not None
    assert cache.held_tokens == 8 and len(cache) == 2
    cache.put(list(range(11)), _prefill(11))  # larger than the whole cache: not kept, nothing evicted
    assert len(cache) == 2 and cache.get([1, 2, 3]) is None  # only whole inputs match
    cache.clear()
    assert len(cache) == 0 and cache.held_tokens == 0
    with pytest.raises(ValueError, match="capacity_tokens"):
        PrefillCache(-1)


async def _interrupt(eng: EmbeddedEngine, n: int, budget: int) -> list[GenerateResult]:
    """Start ``n`` greedy samples of PROMPT_A and abort them once every one of the first four (the
    batch) has a few tokens: those are cut mid-way while running."""
    tasks = [asyncio.create_task(eng.generate(GenerateRequest(f"s{i}", PROMPT_A, budget, temperature=0.0)))
             for i in range(n)]
    await wait_until(lambda: eng.stats.generated_tokens >= 12, "12 generated tokens")
    await eng.abort_all()
    return list(await asyncio.gather(*tasks))


async def test_an_interrupted_row_resumes_without_a_prefill() -> None:
    """The samples aborted while running keep their rows (SGLang's radix cache keeps an aborted request's
    keys and values): resumed as prompt + partial response, they run no prompt token through the model
    and count all of it but the last token as cached; the samples aborted while waiting prefill as usual."""
    budget = 20
    eng = engine(4, prefix_cache_tokens=1024)
    try:
        await eng.start()
        first = await _interrupt(eng, 6, budget)
        cut = [r for r in first if r.output_ids]
        assert cut and all(len(r.output_ids) < budget for r in cut)
        before = eng.stats.prefill_tokens
        second = await asyncio.gather(*(
            eng.generate(GenerateRequest(f"r{i}", PROMPT_A + r.output_ids, budget - len(r.output_ids), temperature=0.0))
            for i, r in enumerate(cut)))
    finally:
        await eng.close()
    assert eng.stats.resumed_without_prefill == len(cut)
    assert eng.stats.prefill_tokens == before  # nothing prefilled for them
    assert [r.cached_tokens for r in second] == [len(PROMPT_A) + len(r.output_ids) - 1 for r in cut]


async def test_a_weight_update_drops_interrupted_rows_unless_told_to_keep_them() -> None:
    """flush_cache (the default) drops the rows: the resumed sample is prefilled under the new weights.
    flush_cache False keeps them: the resumed sample's first token comes from the new weights reading the
    old weights' keys and values, exactly as Hugging Face computes it with that cache, and is stamped with
    the new version; the cached prompt prefill goes either way (it holds old logits)."""
    budget = 20
    new_model = build_tiny_model(1).double()
    outcomes = {}
    for flush in (True, False):
        eng = engine(4, prefix_cache_tokens=1024)
        try:
            await eng.start()
            cut = next(r for r in await _interrupt(eng, 4, budget) if r.output_ids)
            await eng.update_weights(WeightUpdate(version=1, module=new_model, flush_cache=flush))
            before = eng.stats.prefill_tokens
            resumed_ids = PROMPT_A + cut.output_ids
            resumed = await eng.generate(GenerateRequest("r", resumed_ids, 1, temperature=0.0))
            prefilled = eng.stats.prefill_tokens - before
            fresh_prompt = await eng.generate(GenerateRequest("p", PROMPT_A, 1, temperature=0.0))
        finally:
            await eng.close()
        outcomes[flush] = (resumed_ids, resumed, prefilled, fresh_prompt)
    resumed_ids, resumed, prefilled, prompt_again = outcomes[True]
    assert prefilled == len(resumed_ids) and resumed.cached_tokens == 0
    assert prompt_again.cached_tokens == 0
    resumed_ids, resumed, prefilled, prompt_again = outcomes[False]
    assert prefilled == 0 and resumed.cached_tokens == len(resumed_ids) - 1 and resumed.weight_version == 1
    assert prompt_again.cached_tokens == 0
    ids = torch.tensor([resumed_ids])
    with torch.no_grad():
        old = build_tiny_model(0).double()(ids[:, :-1], use_cache=True)
        logits = new_model(ids[:, -1:], cache=old.cache, use_cache=True).logits[0, -1]  # as the engine calls it
    logprobs = torch.log_softmax(logits, dim=-1)
    token = int(logits.argmax())
    assert resumed.output_ids == [token]
    assert resumed.output_logprobs == pytest.approx([float(logprobs[token])], abs=EXACT_ATOL)
