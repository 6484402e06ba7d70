"""The runtime's RolloutScheduler, unchanged, on simulated engines and virtual time; and a small
scenario end to end through `rljob simulate`."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import yaml

from rljob.runtime.cli import main
from rljob.runtime.rollout.scheduler import RolloutConfig, RolloutScheduler, RoundStats
from rljob.runtime.rollout.strategy import AprilStrategy, Strategy
from rljob.runtime.sim.engine import ResponseOracle, SimEngine
from rljob.runtime.sim.length_model import LengthModel, SimPromptSource
from rljob.runtime.sim.scenario import EngineConstants, LengthLaw
from rljob.runtime.sim.virtual_loop import run_virtual

CONSTS = EngineConstants(
    fixed_step_s=0.005, per_seq_step_s=4e-5, kv_read_s_per_token=4.6e-8, prefill_s_per_token=1.5e-5,
    kv_capacity_tokens=200_000, admit_fraction=0.9, max_running_requests=256, abort_latency_s=0.05,
    weight_sync_s=2.0,
)
LAW = LengthLaw(median_tokens=300, sigma_between=0.5, sigma_within=0.5, runaway_share=0.01, prompt_tokens=4)
CAP, BATCH, G, ROUNDS = 2048, 8, 4, 6


def run_rounds(strategy: Strategy) -> tuple[list[RoundStats], list[int], list[list[int]], int]:
    """ROUNDS rounds on 2 simulated engines: stats, trained tokens per round, prompt order per
    round, tokens left in the buffer."""

    async def go() -> tuple[list[RoundStats], list[int], list[list[int]], int]:
        oracle = ResponseOracle(lengths=LengthModel(law=LAW, cap=CAP, seed=3), quantum=1, prompt_units=4)
        engines = [SimEngine(f"sim{i}", CONSTS, oracle) for i in range(2)]
        config = RolloutConfig(batch_size=BATCH, samples_per_prompt=G, max_response_length=CAP, max_staleness=100)
        loop = asyncio.get_running_loop()
        scheduler = RolloutScheduler(engines, config, strategy, SimPromptSource(prompt_units=4),
                                     score=lambda s: 1.0, clock=loop.time)
        stats, trained, order = [], [], []
        for version in range(ROUNDS):
            result = await scheduler.run_round(version)
            assert len(result.groups) == BATCH and all(g.finished for g in result.groups)
            assert all(len(g.samples) == G for g in result.groups)
            stats.append(result.stats)
            trained.append(sum(s.response_length for g in result.groups for s in g.samples))
            order.append([g.prompt_index for g in result.groups])
            for e in engines:  # drained before the weight update, as the scheduler promises
                assert (await e.load()).total == 0
        return stats, trained, order, scheduler.buffer.token_count()

    return run_virtual(go())[0]


def test_sync_rounds_wait_for_every_group_and_buffer_nothing():
    stats, trained, order, left = run_rounds(Strategy())
    assert left == 0
    assert all(s.buffered_groups == 0 and s.partial_samples == 0 for s in stats)
    assert [s.tokens_generated for s in stats] == trained  # every token generated is trained
    assert order == [list(range(r * BATCH, (r + 1) * BATCH)) for r in range(ROUNDS)]  # fresh prompts in order


def test_april_over_samples_buffers_partials_and_loses_nothing():
    stats, trained, order, left = run_rounds(AprilStrategy(over_sampling=2.0))
    assert sum(s.tokens_generated for s in stats) == sum(trained) + left  # conservation
    assert any(s.buffered_groups for s in stats) and sum(s.resumed_samples for s in stats) > 0
    assert all(o == sorted(o) for o in order)
    sync_stats, _, _, _ = run_rounds(Strategy())
    # Stop-upon-collection: APRIL's rounds are shorter and its token rate higher than sync's.
    assert sum(s.rollout_seconds for s in stats) < sum(s.rollout_seconds for s in sync_stats)
    rate = sum(s.tokens_generated for s in stats) / sum(s.rollout_seconds for s in stats)
    sync_rate = sum(s.tokens_generated for s in sync_stats) / sum(s.rollout_seconds for s in sync_stats)
    assert rate > sync_rate


SCENARIO = {
    "name": "tiny", "model": "qwen3-4b", "gpu": "h100", "gpus": 4, "tensor_parallel": 1, "mem_fraction": 0.85,
    "dataset": "deepscaler", "max_response_length": 4096, "samples_per_prompt": 4, "groups_per_engine": 2,
    "steps": 4, "warmup_steps": 1,
    "strategies": [
        {"kind": "sync"}, {"kind": "april"}, {"kind": "tail-batching"},
        {"kind": "bounded-staleness", "eta": 1, "trainer_gpu_share": 0.25},
        {"kind": "large-group", "samples_per_prompt": 16}, {"kind": "draft-reuse", "epochs_in_run": 2.0},
    ],
}


def test_rljob_simulate_runs_a_small_scenario_end_to_end(tmp_path: Path, capsys):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(SCENARIO))
    assert main(["simulate", str(path), "--output", str(tmp_path / "out"), "--gpus", "4,8"]) == 0
    out = capsys.readouterr().out
    assert "rollout tok/s" in out and "async-eta" in out
    for gpus in (4, 8):
        data = json.loads((tmp_path / "out" / f"tiny-{gpus}gpu.json").read_text())
        rows = {s["strategy"]: s for s in data["strategies"]}
        assert list(rows) == ["sync", "april", "tail-batching", "async-eta", "large-n", "draft-reuse"]
        assert rows["sync"]["off_policy_share"] == 0.0 and rows["april"]["off_policy_share"] > 0.0
        assert rows["april"]["rollout_gain_pct"] > 0.0
        assert rows["draft-reuse"]["draft_tokens"] > 0
        assert all(0.0 < r["ceiling_share"] <= 1.0 for r in rows.values())
        assert all(len(r["steps"]) == 4 for r in rows.values())
        assert (tmp_path / "out" / f"tiny-{gpus}gpu.png").stat().st_size > 0


def test_rljob_simulate_names_the_bad_field(tmp_path: Path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**SCENARIO, "gpu": "tpu9"}))
    assert main(["simulate", str(path), "--output", str(tmp_path / "out")]) == 2
    out = capsys.readouterr().out
    assert "gpu 'tpu9'" in out and "h100" in out


def test_bundled_scenarios_load_by_name_with_or_without_suffix() -> None:
    from rljob.runtime.sim.scenario import SCENARIO_DIR, ScenarioError, load_scenario

    bundled = sorted(SCENARIO_DIR.glob("*.yaml"))
    assert bundled
    for path in bundled:
        assert load_scenario(path.stem).name == load_scenario(path.name).name == path.stem
    with pytest.raises(ScenarioError, match="give a path or a name"):
        load_scenario("no-such-scenario")
