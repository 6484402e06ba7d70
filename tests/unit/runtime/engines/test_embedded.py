"""The embedded continuous-batching engine on a real tiny Qwen2 model (CPU)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from rljob.runtime.engines.base import EngineError, GenerateRequest, WeightUpdate
from rljob.runtime.engines.embedded import EmbeddedEngine, InvalidRequestError, prefill_chunks
from rljob.runtime.engines.sampling import SamplingParams, draw, sample_tokens
from transformers import Qwen2ForCausalLM

from tests.helpers.tiny_model import build_tiny_model, save_tiny_model, tiny_config
from tests.helpers.waiting import wait_until

PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [12], [20, 21, 22, 23], [40, 41], [60, 61, 62, 63, 64, 65]]


# Batched, solo and full-sequence forwards reduce in different orders (batch shape, padding and KV
# width pick different kernels), so in float32 their log-probs differ by rounding: 1.2e-4 on the
# wraparound test below, because this model's wide initialisation makes logits of magnitude ~10-30
# and 2 layers plus the log-softmax amplify each ulp ~1e3 times. These comparisons are about cache
# bookkeeping, not about float32, so they run the model in float64, where the same test differs by
# 3e-15 (eps64 times the same amplification). EXACT_ATOL leaves five orders of margin above that,
# while a cache fault (a wrong slot, a stale key, a shifted position) moves log-probs by more than 1e-2.
EXACT_ATOL = 1e-9


def float64_engine(max_batch_size: int, **kw: object) -> EmbeddedEngine:
    """An engine on the float64 tiny model, for comparisons whose tolerance must not depend on kernels."""
    return EmbeddedEngine(build_tiny_model(0).double(), max_batch_size=max_batch_size, dtype=torch.float64, **kw)  # type: ignore[arg-type]


def greedy(rid: str, prompt: list[int], max_new_tokens: int, **kw: object) -> GenerateRequest:
    return GenerateRequest(rid=rid, input_ids=prompt, max_new_tokens=max_new_tokens, temperature=0.0, **kw)  # type: ignore[arg-type]


@pytest.fixture
async def engine() -> AsyncIterator[EmbeddedEngine]:
    eng = EmbeddedEngine(build_tiny_model(0), max_batch_size=4, seed=0)
    await eng.start()
    yield eng
    await eng.close()


async def wait_for_tokens(eng: EmbeddedEngine, at_least: int) -> None:
    """Wait until the engine has generated at least ``at_least`` tokens in total."""
    await wait_until(lambda: eng.stats.generated_tokens >= at_least, f"{at_least} generated tokens")


async def test_batched_decoding_matches_decoding_alone() -> None:
    alone = float64_engine(max_batch_size=1)
    batched = float64_engine(max_batch_size=3)  # < len(PROMPTS): requests join as others leave
    try:
        solo = [await alone.generate(greedy(f"a{i}", p, 24)) for i, p in enumerate(PROMPTS)]
        # Different budgets make sequences leave at different steps, so the batch reshapes mid-flight.
        together = await asyncio.gather(
            *(batched.generate(greedy(f"b{i}", p, 24 - 3 * i)) for i, p in enumerate(PROMPTS))
        )
    finally:
        await alone.close()
        await batched.close()
    for i, (s, b) in enumerate(zip(solo, together, strict=True)):
        n = 24 - 3 * i
        assert len(b.output_ids) == n
        assert b.output_ids == s.output_ids[:n]
        assert b.output_logprobs == pytest.approx(s.output_logprobs[:n], abs=EXACT_ATOL)
        assert b.finish_reason == "length"
    assert batched.stats.prefill_steps >= 2  # admission really happened in several waves



async def test_kv_slots_survive_wraparound_and_growth() -> None:
    """Long, staggered sequences: the KV cursor wraps several times and the capacity grows mid-flight."""
    budgets = [30, 60, 25, 200, 240, 230]  # the later, longer requests need a wider cache
    alone = float64_engine(max_batch_size=1)
    batched = float64_engine(max_batch_size=3)
    try:
        solo = [await alone.generate(greedy(f"a{i}", p, n)) for i, (p, n) in enumerate(zip(PROMPTS, budgets))]
        together = await asyncio.gather(
            *(batched.generate(greedy(f"b{i}", p, n)) for i, (p, n) in enumerate(zip(PROMPTS, budgets)))
        )
        kv = batched._cache
        assert kv is not None and kv.wraps >= 1, "the KV cursor never wrapped: the test lost its point"
    finally:
        await alone.close()
        await batched.close()
    for s, b, n in zip(solo, together, budgets, strict=True):
        assert b.output_ids == s.output_ids and len(b.output_ids) == n
        assert b.output_logprobs == pytest.approx(s.output_logprobs, abs=EXACT_ATOL)
    assert batched.stats.prefill_steps >= 2  # the long requests joined a running batch

async def test_logprobs_are_log_softmax_of_logits_over_temperature() -> None:
    engine = float64_engine(max_batch_size=4, seed=0)
    prompt = [3, 1, 4, 1, 5]
    temperature = 0.7
    try:
        res = await engine.generate(
            GenerateRequest(rid="t", input_ids=prompt, max_new_tokens=12, temperature=temperature, top_p=0.9)
        )
        full = torch.tensor([prompt + res.output_ids])
        with torch.inference_mode():
            logits = engine.model(input_ids=full).logits[0, len(prompt) - 1 : -1]
    finally:
        await engine.close()
    expected = torch.log_softmax(logits / temperature, dim=-1).gather(-1, torch.tensor(res.output_ids)[:, None])
    assert res.output_logprobs == pytest.approx(expected.squeeze(-1).tolist(), abs=EXACT_ATOL)


async def test_stop_token_finishes_with_stop_and_is_included(engine: EmbeddedEngine) -> None:
    reference = await engine.generate(greedy("ref", PROMPTS[1], 10))
    stop = reference.output_ids[3]
    first = reference.output_ids.index(stop)
    res = await engine.generate(greedy("stop", PROMPTS[1], 10, stop_token_ids=[stop]))
    assert res.finish_reason == "stop"
    assert res.output_ids == reference.output_ids[: first + 1]
    assert res.output_ids[-1] == stop
    length = await engine.generate(greedy("len", PROMPTS[1], 5))
    assert length.finish_reason == "length" and len(length.output_ids) == 5
    assert (await engine.generate(greedy("zero", PROMPTS[1], 0))).output_ids == []


async def test_abort_returns_partial_output_running_and_waiting() -> None:
    eng = EmbeddedEngine(build_tiny_model(0), max_batch_size=1)
    await eng.start()
    try:
        running = asyncio.create_task(eng.generate(greedy("round1-a", PROMPTS[0], 400)))
        waiting = asyncio.create_task(eng.generate(greedy("round1-b", PROMPTS[1], 400)))
        other = asyncio.create_task(eng.generate(greedy("round2-c", PROMPTS[2], 5)))
        await wait_for_tokens(eng, 5)
        assert (await eng.load()).running == 1 and (await eng.load()).waiting == 2
        await eng.abort("round1-")
        r, w = await asyncio.gather(running, waiting)
        assert r.finish_reason == "abort" and 0 < len(r.output_ids) < 400
        assert len(r.output_logprobs) == len(r.output_ids)
        assert w.finish_reason == "abort" and w.output_ids == [] and w.output_logprobs == []
        # A prefix that does not match leaves the rest alone.
        assert (await other).finish_reason == "length"
    finally:
        await eng.close()


async def test_resume_from_partial_continues_exactly(engine: EmbeddedEngine) -> None:
    budget = 60
    full = await engine.generate(greedy("full", PROMPTS[3], budget))
    task = asyncio.create_task(engine.generate(greedy("seg1", PROMPTS[3], budget)))
    await wait_for_tokens(engine, budget + 5)
    await engine.abort_all()
    part = await task
    assert part.finish_reason == "abort" and 0 < len(part.output_ids) < budget
    rest = await engine.generate(
        greedy("seg2", PROMPTS[3] + part.output_ids, budget - len(part.output_ids))
    )
    assert part.output_ids + rest.output_ids == full.output_ids
    assert part.output_logprobs + rest.output_logprobs == pytest.approx(full.output_logprobs, abs=1e-4)
    assert rest.finish_reason == "length"


async def test_load_counts_and_abort_all_drains() -> None:
    eng = EmbeddedEngine(build_tiny_model(0), max_batch_size=2)
    await eng.start()
    try:
        tasks = [asyncio.create_task(eng.generate(greedy(f"r{i}", p, 300))) for i, p in enumerate(PROMPTS[:5])]
        await wait_for_tokens(eng, 2)
        load = await eng.load()
        assert (load.running, load.waiting) == (2, 3)
        await eng.abort_all()
        results = await asyncio.gather(*tasks)
        assert all(r.finish_reason == "abort" for r in results)
        assert (await eng.load()).total == 0
        # The engine keeps serving after a full abort.
        assert (await eng.generate(greedy("after", PROMPTS[0], 3))).finish_reason == "length"
    finally:
        await eng.close()


async def test_weight_update_from_module_and_path_changes_outputs_and_version(
    engine: EmbeddedEngine, tmp_path: Path
) -> None:
    before = await engine.generate(greedy("v0", PROMPTS[0], 16))
    assert before.weight_version == 0
    await engine.update_weights(WeightUpdate(version=1, module=build_tiny_model(seed=1)))
    after = await engine.generate(greedy("v1", PROMPTS[0], 16))
    assert after.weight_version == 1 and after.output_ids != before.output_ids

    await engine.update_weights(WeightUpdate(version=2, path=str(save_tiny_model(tmp_path / "ckpt", seed=0))))
    back = await engine.generate(greedy("v2", PROMPTS[0], 16))
    assert back.weight_version == 2
    assert back.output_ids == before.output_ids

    with pytest.raises(EngineError, match="module or a path"):
        await engine.update_weights(WeightUpdate(version=3))


async def test_a_whole_update_and_a_sync_bucket_install_by_one_rule(engine: EmbeddedEngine) -> None:
    """update_weights is the transports' load_named_tensors over the whole state: it must name every
    weight, a bucket may name some; an unknown name or a wrong shape is refused either way and the
    served version stays."""
    state = build_tiny_model(seed=1).state_dict()
    name = "model.norm.weight"  # not one of a tied pair, which a whole state may lack
    tensor = state[name]
    partial = {n: t for n, t in state.items() if n != name}
    with pytest.raises(EngineError, match=r"missing \['" + name):
        await engine.update_weights(WeightUpdate(version=1, tensors=partial))
    await engine.load_named_tensors(list(partial.items()), None)  # a bucket is a part of the model
    with pytest.raises(EngineError, match=r"wrong shape \['" + name):
        await engine.load_named_tensors([(name, tensor[:1])], 1)
    with pytest.raises(EngineError, match=r"unknown \['no.such.weight"):
        await engine.update_weights(WeightUpdate(version=1, tensors={**state, "no.such.weight": tensor}))
    assert engine.served_version() == 0
    await engine.load_named_tensors([(name, tensor)], 2)
    assert engine.served_version() == 2


async def test_an_adopted_bucket_becomes_the_weights_and_a_lent_one_is_copied() -> None:
    """The CPU server gives load_named_tensors the buffers it received (``adopt``): each parameter takes
    its tensor with no copy, a tied pair stays one parameter, and the engine generates what an engine
    that copied the same weights generates. Tensors lent by a trainer (the ``tensor`` transport) are
    copied: changing them afterwards leaves the served weights alone. A tensor of another dtype is
    cast into the parameter, which keeps its dtype."""
    config = tiny_config()
    config.tie_word_embeddings = True
    engines = []
    for _ in range(2):
        torch.manual_seed(0)
        engines.append(EmbeddedEngine(Qwen2ForCausalLM(config).eval(), max_batch_size=2))
    adopting, copying = engines
    torch.manual_seed(1)
    new = Qwen2ForCausalLM(config).state_dict()
    received = [(name, tensor.clone()) for name, tensor in new.items()]
    lent = [(name, tensor.clone()) for name, tensor in new.items()]
    for eng in engines:
        await eng.start()
    try:
        before = await adopting.generate(greedy("before", PROMPTS[1], 12))
        await adopting.load_named_tensors(received, 1, adopt=True)
        await copying.load_named_tensors(lent, 1)
        model = adopting.model
        assert model.lm_head.weight is model.model.embed_tokens.weight  # type: ignore[union-attr]
        for name, tensor in received:
            served = model.get_parameter(name)
            # A tied pair's parameter takes the later of its two names' tensors (lm_head.weight).
            if name != "model.embed_tokens.weight":
                assert served.data_ptr() == tensor.data_ptr(), name
        assert all(copying.model.get_parameter(n).data_ptr() != t.data_ptr() for n, t in lent)

        adopted = await adopting.generate(greedy("adopted", PROMPTS[1], 12))
        copied = await copying.generate(greedy("copied", PROMPTS[1], 12))
        assert adopted.output_ids == copied.output_ids != before.output_ids
        for _, tensor in lent:
            tensor.zero_()
        again = await copying.generate(greedy("again", PROMPTS[1], 12))
        assert again.output_ids == copied.output_ids

        norm = "model.norm.weight"
        await adopting.load_named_tensors([(norm, torch.full_like(new[norm], 2.0, dtype=torch.float64))], None,
                                          adopt=True)
        assert model.get_parameter(norm).dtype == torch.float32
        assert torch.equal(model.get_parameter(norm), torch.full_like(new[norm], 2.0))
    finally:
        for eng in engines:
            await eng.close()


async def test_weight_update_waits_for_step_boundary_and_running_requests_continue(
    engine: EmbeddedEngine,
) -> None:
    task = asyncio.create_task(engine.generate(greedy("long", PROMPTS[0], 80)))
    await wait_for_tokens(engine, 3)
    await engine.update_weights(WeightUpdate(version=7, module=build_tiny_model(seed=2)))
    res = await task
    assert res.finish_reason == "length" and len(res.output_ids) == 80
    assert res.weight_version == 7  # the version current at completion, like SGLang's meta_info


async def test_invalid_requests_are_rejected_with_clear_errors(engine: EmbeddedEngine) -> None:
    with pytest.raises(InvalidRequestError, match="no input_ids"):
        await engine.generate(greedy("empty", [], 4))
    with pytest.raises(InvalidRequestError, match="context length 512"):
        await engine.generate(greedy("long", [1] * 500, 100))
    with pytest.raises(InvalidRequestError, match="outside"):
        await engine.generate(greedy("vocab", [100000], 4))


async def test_cancelled_caller_frees_its_slot() -> None:
    eng = EmbeddedEngine(build_tiny_model(0), max_batch_size=1)
    await eng.start()
    try:
        hog = asyncio.create_task(eng.generate(greedy("hog", PROMPTS[0], 400)))
        await wait_for_tokens(eng, 2)
        hog.cancel()
        with pytest.raises(asyncio.CancelledError):
            await hog
        res = await asyncio.wait_for(eng.generate(greedy("next", PROMPTS[1], 4)), timeout=30)
        assert res.finish_reason == "length"
    finally:
        await eng.close()


async def test_pause_holds_steps_until_resume(engine: EmbeddedEngine) -> None:
    engine.pause()
    steps = (engine.stats.prefill_steps, engine.stats.decode_steps)
    task = asyncio.create_task(engine.generate(greedy("p", PROMPTS[0], 4)))
    # Queued (observed, not assumed after a delay): a paused engine admits nothing from the queue.
    await wait_until(lambda: engine.current_load().waiting == 1, "the request queued")
    assert not task.done() and (await engine.load()).waiting == 1
    assert (engine.stats.prefill_steps, engine.stats.decode_steps) == steps
    engine.resume()
    assert (await asyncio.wait_for(task, timeout=30)).finish_reason == "length"


async def test_settle_after_pause_returns_once_the_step_in_flight_is_done(engine: EmbeddedEngine,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # The step in flight is held at an observed point (inside _step, on the worker thread) until released,
    # so the order is fixed: pause lands mid-step, settle must wait for that step, not return at once.
    inside, release = threading.Event(), threading.Event()
    step = engine._step

    def held_step(admitted: list) -> int:  # type: ignore[type-arg]
        inside.set()
        release.wait(timeout=60)
        return step(admitted)

    monkeypatch.setattr(engine, "_step", held_step)
    task = asyncio.create_task(engine.generate(greedy("p", PROMPTS[0], 1)))
    await wait_until(inside.is_set, "a step in flight")
    engine.pause()
    settled = asyncio.create_task(engine.settle())
    for _ in range(20):
        await asyncio.sleep(0)
    assert not settled.done(), "settle() returned while a step was still running"
    release.set()
    await asyncio.wait_for(settled, timeout=30)
    # The step that was in flight produced the only token asked for: the request finished before the
    # reply, and nothing more runs while paused.
    assert (await asyncio.wait_for(task, timeout=30)).finish_reason == "length"
    assert (await engine.load()).running == 0
    engine.resume()


def test_sampling_truncation_and_log_prob_base() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]] * 64)
    gen = torch.Generator().manual_seed(0)
    top1 = [SamplingParams(temperature=1.0, top_k=1)] * 64
    tokens, logprobs = sample_tokens(logits, top1, gen)
    assert tokens.tolist() == [0] * 64
    # The log-prob is measured on the untruncated tempered distribution, not the top-k one (which is 0).
    assert logprobs[0].item() == pytest.approx(torch.log_softmax(logits[0], -1)[0].item())
    nucleus = [SamplingParams(temperature=0.5, top_p=0.6)] * 64
    tokens, logprobs = sample_tokens(logits, nucleus, gen)
    assert set(tokens.tolist()) == {0}  # p(token 0) at T=0.5 is 0.87 > 0.6: the nucleus is one token
    assert logprobs[0].item() == pytest.approx(torch.log_softmax(logits[0] / 0.5, -1)[0].item())
    free = [SamplingParams(temperature=1.0)] * 64
    assert len(set(sample_tokens(logits, free, gen)[0].tolist())) > 1


def test_draw_follows_each_rows_distribution_and_never_picks_a_token_without_mass() -> None:
    # Rows that do not sum to one (what top-k/top-p truncation leaves), with zero-mass tokens at both ends
    # and in the middle.
    rows = torch.tensor([[0.0, 0.1, 0.0, 0.6, 0.3, 0.0], [0.5, 0.0, 0.0, 0.0, 0.0, 0.25]], dtype=torch.float32)
    n = 100_000
    drawn = draw(rows.repeat_interleave(n, dim=0), torch.Generator().manual_seed(0)).view(2, n)
    for row, picks in zip(rows, drawn, strict=True):
        freq = torch.bincount(picks, minlength=row.numel()).double() / n
        expected = (row / row.sum()).double()
        assert torch.equal(freq[expected == 0], torch.zeros_like(freq[expected == 0]))
        # Four standard deviations of a binomial share at n draws: about 0.006 at p = 0.5.
        assert torch.allclose(freq, expected, atol=4 * 0.5 / n**0.5)


def test_prefill_chunks_bound_padding_and_keep_every_item() -> None:
    lengths = [5, 200, 7, 6, 180, 40, 5, 190]
    chunks = prefill_chunks(list(range(len(lengths))), lambda i: lengths[i])
    assert sorted(i for c in chunks for i in c) == list(range(len(lengths)))
    for chunk in chunks:
        real = sum(lengths[i] for i in chunk)
        assert len(chunk) * max(lengths[i] for i in chunk) <= 1.25 * real
    # Short prompts share one forward instead of being padded to the 200-token resumed sample.
    assert [lengths[i] for i in chunks[0]] == [5, 5, 6, 7]
    assert len(chunks) == 3
