"""The runtime comparison (benchmarks/rollout_throughput.py, `rljob run --compare-rounds`) reports
both throughput metrics: every generated token per rollout second, and trained tokens per second."""

from __future__ import annotations

from rljob.runtime.compare import PhaseWork, StrategyResult, comparison_table
from rljob.runtime.engines.embedded import EngineStats


def test_comparison_rows_carry_generated_and_trained_rates():
    sync = StrategyResult(strategy="sync", rounds=2, tokens=1000, rollout_seconds=10.0, trained_tokens=1000)
    april = StrategyResult(strategy="april", rounds=2, tokens=3000, rollout_seconds=10.0, trained_tokens=1500)
    rows = {r["strategy"]: r for r in comparison_table({"sync": sync, "april": april}, ceiling=400.0)}
    assert rows["april"]["tokens_per_s"] == 300.0 and rows["april"]["trained_tokens_per_s"] == 150.0
    assert rows["april"]["over_sync"] == 3.0 and rows["april"]["trained_over_sync"] == 1.5
    assert rows["sync"]["trained_over_sync"] == 1.0


def test_phase_work_counts_the_engines_between_two_snapshots():
    work = PhaseWork()
    work.add(EngineStats(generated_tokens=100, decode_steps=10, busy_seconds=1.0),
             EngineStats(generated_tokens=700, decode_steps=20, busy_seconds=1.5), wall_seconds=1.0)
    work.add(EngineStats(generated_tokens=0, decode_steps=0, busy_seconds=0.0),
             EngineStats(generated_tokens=200, decode_steps=10, busy_seconds=0.5), wall_seconds=1.0)
    assert work.summary() == {"seconds": 2.0, "busy_share": 0.5, "tokens_per_s": 400.0, "tokens_per_decode_step": 40.0}
    assert PhaseWork().summary()["tokens_per_decode_step"] == 0.0  # nothing measured: no division by zero


def test_only_a_strategy_that_overlapped_training_reports_its_overlap():
    april = StrategyResult(strategy="april", rounds=1, tokens=10, rollout_seconds=1.0)
    asynch = StrategyResult(strategy="async", rounds=1, tokens=10, rollout_seconds=1.0)
    asynch.overlap.add(EngineStats(), EngineStats(generated_tokens=50, decode_steps=5, busy_seconds=0.4), 0.5)
    rows = {r["strategy"]: r for r in comparison_table({"april": april, "async": asynch}, ceiling=100.0)}
    assert "engine_overlap" not in rows["april"]
    assert rows["async"]["engine_overlap"]["tokens_per_decode_step"] == 10.0
