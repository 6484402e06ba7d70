"""The simulator's virtual-time loop and its event-driven engine model (step-time math, KV limit,
abort), checked against a brute-force step-by-step reference."""

from __future__ import annotations

import asyncio

import pytest

from rljob.runtime.engines.base import GenerateRequest, GenerateResult
from rljob.runtime.sim.engine import ResponseOracle, SimEngine
from rljob.runtime.sim.length_model import LengthModel
from rljob.runtime.sim.scenario import EngineConstants, LengthLaw
from rljob.runtime.sim.virtual_loop import SimulationDeadlock, run_virtual

CONSTS = EngineConstants(
    fixed_step_s=0.01, per_seq_step_s=0.001, kv_read_s_per_token=1e-5, prefill_s_per_token=1e-4,
    kv_capacity_tokens=10_000, admit_fraction=0.9, max_running_requests=100, abort_latency_s=0.0,
    weight_sync_s=1.0,
)
PROMPT = 4  # prompt units: [uid, epoch, 0, 0]


def make_engine(capacity: int = 10_000, quantum: int = 1) -> SimEngine:
    # A law whose responses never stop by themselves: max_new_tokens decides every length.
    law = LengthLaw(median_tokens=1e9, sigma_between=0.0, sigma_within=0.0)
    oracle = ResponseOracle(lengths=LengthModel(law=law, cap=10**9), quantum=quantum, prompt_units=PROMPT)
    return SimEngine("sim0", CONSTS.model_copy(update={"kv_capacity_tokens": capacity}), oracle)


def request(rid: str, extra_input: int, max_new: int) -> GenerateRequest:
    return GenerateRequest(rid=rid, input_ids=[1, 0] + [0] * (PROMPT - 2 + extra_input), max_new_tokens=max_new)


def reference_finish_times(inputs: list[int], lengths: list[int]) -> list[float]:
    """Step-by-step reference of PM §3.3 for requests all admitted at t = 0."""
    t = sum(inputs) * CONSTS.prefill_s_per_token
    ctx, left, done = list(inputs), list(lengths), [0.0] * len(inputs)
    while any(left):
        live = [i for i, n in enumerate(left) if n]
        t += CONSTS.fixed_step_s + len(live) * CONSTS.per_seq_step_s + CONSTS.kv_read_s_per_token * sum(
            ctx[i] for i in live)
        for i in live:
            ctx[i] += 1
            left[i] -= 1
            if not left[i]:
                done[i] = t
    return done


async def timed(engine: SimEngine, req: GenerateRequest) -> tuple[float, GenerateResult]:
    result = await engine.generate(req)
    return asyncio.get_running_loop().time(), result


def test_virtual_loop_jumps_to_timers_without_sleeping():
    async def main() -> list[tuple[str, float]]:
        loop = asyncio.get_running_loop()
        seen: list[tuple[str, float]] = []
        loop.call_at(7200.0, lambda: seen.append(("late", loop.time())))
        loop.call_later(5.0, lambda: seen.append(("early", loop.time())))
        await asyncio.sleep(3600)
        seen.append(("slept", loop.time()))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.sleep(100), timeout=10)
        seen.append(("timed out", loop.time()))
        await asyncio.sleep(4000)
        return seen

    seen, elapsed = run_virtual(main())
    assert seen == [("early", 5.0), ("slept", 3600.0), ("timed out", 3610.0), ("late", 7200.0)]
    assert elapsed == 7610.0


def test_virtual_loop_reports_a_deadlock():
    async def main() -> None:
        await asyncio.get_running_loop().create_future()  # nothing will ever resolve it

    with pytest.raises(SimulationDeadlock):
        run_virtual(main())


def test_step_time_matches_the_step_by_step_reference():
    async def main() -> list[tuple[float, GenerateResult]]:
        engine = make_engine()
        return await asyncio.gather(timed(engine, request("a", 6, 50)), timed(engine, request("b", 16, 20)),
                                    timed(engine, request("c", 0, 35)))

    results, _ = run_virtual(main())
    expected = reference_finish_times([PROMPT + 6, PROMPT + 16, PROMPT], [50, 20, 35])
    for (t, res), want, n in zip(results, expected, [50, 20, 35]):
        assert t == pytest.approx(want, rel=1e-9)
        assert len(res.output_ids) == n and res.finish_reason == "length"


def test_token_quantum_scales_the_cost_of_a_step():
    # 10 units of 16 tokens must cost what 160 single-token steps cost.
    async def main(quantum: int, units: int, extra: int) -> float:
        t, _ = await timed(make_engine(quantum=quantum), request("a", extra, units))
        return t

    coarse, _ = run_virtual(main(16, 10, 0))
    fine, _ = run_virtual(main(1, 160, 16 * PROMPT - PROMPT))
    assert coarse == pytest.approx(fine, rel=1e-9)


def test_abort_returns_the_partial_output_at_the_next_step_boundary():
    async def main() -> tuple[float, GenerateResult]:
        engine = make_engine()
        task = asyncio.ensure_future(timed(engine, request("a", 0, 1000)))
        await asyncio.sleep(0.5)
        await engine.abort_all()
        return await task

    (t, result), _ = run_virtual(main())
    boundaries = [reference_finish_times([PROMPT], [k])[0] for k in range(1, 100)]
    steps_done = next(k for k, b in enumerate(boundaries, start=1) if b >= 0.5)
    assert result.finish_reason == "abort"
    assert len(result.output_ids) == steps_done
    assert t == pytest.approx(boundaries[steps_done - 1])


def test_kv_limit_retracts_the_newest_request_and_readmits_it_with_a_reprefill():
    async def main() -> tuple[list[tuple[float, GenerateResult]], int, int]:
        engine = make_engine(capacity=100)
        a = asyncio.ensure_future(timed(engine, request("a", 36, 30)))  # 40 units in, 30 out
        b = asyncio.ensure_future(timed(engine, request("b", 36, 30)))
        await asyncio.sleep(0.3)  # contexts pass 100 units after 11 steps; b is retracted then
        load = await engine.load()
        return list(await asyncio.gather(a, b)), load.waiting, engine.counters.retractions

    results, waiting_mid_run, retractions = run_virtual(main())[0]
    (t_a, res_a), (t_b, res_b) = results
    assert retractions == 1 and waiting_mid_run == 1
    assert len(res_a.output_ids) == 30 and len(res_b.output_ids) == 30  # nothing lost by the retraction
    assert t_b > t_a


def test_weight_update_interrupts_and_pauses_the_engine():
    async def main() -> tuple[GenerateResult, float, int]:
        from rljob.runtime.engines.base import WeightUpdate

        engine = make_engine()
        task = asyncio.ensure_future(engine.generate(request("a", 0, 1000)))
        await asyncio.sleep(0.2)
        await engine.update_weights(WeightUpdate(version=3))
        return await task, asyncio.get_running_loop().time(), engine.version

    (result, t, version), _ = run_virtual(main())
    assert result.finish_reason == "abort" and result.weight_version == 0 and 0 < len(result.output_ids) < 1000
    assert version == 3 and t == pytest.approx(0.2 + CONSTS.weight_sync_s, abs=0.05)
