"""The runtime comparison (benchmarks/rollout_throughput.py, `rljob run --compare-rounds`) reports
both throughput metrics: every generated token per rollout second, and trained tokens per second."""

from __future__ import annotations

from rljob.runtime.compare import StrategyResult, comparison_table


def test_comparison_rows_carry_generated_and_trained_rates():
    sync = StrategyResult(strategy="sync", rounds=2, tokens=1000, rollout_seconds=10.0, trained_tokens=1000)
    april = StrategyResult(strategy="april", rounds=2, tokens=3000, rollout_seconds=10.0, trained_tokens=1500)
    rows = {r["strategy"]: r for r in comparison_table({"sync": sync, "april": april}, ceiling=400.0)}
    assert rows["april"]["tokens_per_s"] == 300.0 and rows["april"]["trained_tokens_per_s"] == 150.0
    assert rows["april"]["over_sync"] == 3.0 and rows["april"]["trained_over_sync"] == 1.5
    assert rows["sync"]["trained_over_sync"] == 1.0
