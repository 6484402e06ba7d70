"""The benchmarks' verdicts on hand-computed cases: the autotune goals as paired tests against the noise of
the confirmation's repeats, the bound that overlap alone puts on async-APRIL's time to reward, and what
async_ahead.py sets and sums."""

from __future__ import annotations

import math
from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers.scripts import load_script

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def script(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import their sibling machine_info

    def load(name: str) -> ModuleType:
        return load_script(BENCHMARKS / f"{name}.py")
    return load


def test_paired_ratio_is_shown_missed_or_inside_the_noise(script) -> None:  # type: ignore[no-untyped-def]
    paired = script("autotune").paired
    # 1.02, 1.04, 1.06: mean 1.04, sample stdev 0.02, standard error 0.02 / sqrt(3) = 0.011547.
    v = paired([1.02, 1.04, 1.06], 1.0)
    assert v["mean"] == pytest.approx(1.04) and v["standard_error"] == pytest.approx(0.02 / math.sqrt(3))
    assert v["shown"] and not v["missed"]  # 1.04 - 0.0231 >= 1
    # Run 8's autotune / defaults (0.97, 1.05, 1.00): mean 1.007, 2 SE 0.046: neither way.
    v = paired([0.97, 1.05, 1.00], 1.0)
    assert not v["shown"] and not v["missed"]
    v = paired([0.80, 0.82, 0.84], 0.95)  # 0.82 + 0.0231 < 0.95
    assert v["missed"] and not v["shown"]
    v = paired([1.1], 1.0)  # one repeat has no spread to judge by
    assert v["standard_error"] == math.inf and not v["shown"] and not v["missed"]


def test_verdicts_pair_each_repeat_and_bound_the_headroom(script) -> None:  # type: ignore[no-untyped-def]
    per = {"autotune_over_best_fixed": [0.9, 1.0], "autotune_over_defaults": [1.0, 1.1],
           "best_fixed_goodput": [110.0, 90.0], "default_goodput": [100.0, 100.0]}
    v = script("autotune").verdicts(per)
    assert v["autotune_at_least_95pct_of_best_fixed"]["mean"] == pytest.approx(0.95)
    assert v["autotune_beats_defaults"]["mean"] == pytest.approx(1.05)
    # Paired per repeat: 110/100 and 90/100, not the ratio of the means.
    assert v["best_fixed_beats_defaults"]["mean"] == pytest.approx(1.0)
    assert v["best_fixed_beats_defaults"]["standard_error"] == pytest.approx(0.1)
    assert "autotune_eval_reward_minus_best_fixed" not in v  # no held-out rewards: no reward verdict


def test_the_reward_goal_is_met_inside_the_noise_of_the_paired_differences(script) -> None:  # type: ignore[no-untyped-def]
    verdicts = script("autotune").verdicts
    per = {"autotune_over_best_fixed": [1.0, 1.0, 1.0], "autotune_over_defaults": [1.0, 1.0, 1.0],
           "best_fixed_goodput": [1.0, 1.0, 1.0], "default_goodput": [1.0, 1.0, 1.0],
           # Run 8: differences -0.0625, +0.03125, +0.015625: mean -0.0052, SE 0.029: inside the noise.
           "autotune_eval_reward": [0.515625, 0.578125, 0.59375], "best_fixed_eval_reward": [0.578125, 0.546875, 0.578125]}
    v = verdicts(per)["autotune_eval_reward_minus_best_fixed"]
    assert v["mean"] == pytest.approx(-0.015625 / 3) and v["within_noise"]
    per["autotune_eval_reward"] = [0.40, 0.42, 0.41]  # about 0.15 below in every repeat
    v = verdicts(per)["autotune_eval_reward_minus_best_fixed"]
    assert v["missed"] and not v["within_noise"]
    per["autotune_eval_reward"] = [None, 0.5, 0.5]  # a run without a held-out evaluation: no verdict
    assert "autotune_eval_reward_minus_best_fixed" not in verdicts(per)


def test_overlap_bound_is_the_busier_sides_share_of_syncs_wall(script) -> None:  # type: ignore[no-untyped-def]
    bound = script("time_to_reward").overlap_bound
    # Engine busy 0.7 and 0.6 of the wall, the trainer 0.3 and 0.5: the busier side per seed, then the mean.
    runs = [{"engine_idle_share": 0.3, "trainer_idle_share": 0.7},
            {"engine_idle_share": 0.4, "trainer_idle_share": 0.5}]
    assert bound(runs) == pytest.approx((0.7 + 0.6) / 2)
    # A trainer busier than the engines bounds it instead.
    assert bound([{"engine_idle_share": 0.9, "trainer_idle_share": 0.2}]) == pytest.approx(0.8)
    assert bound([]) is None


def test_async_ahead_sets_the_bound_on_the_runners_strategy_and_sums_a_runs_waste(script) -> None:  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    from rljob.runtime.rollout.strategy import AprilStrategy, AsyncStrategy

    ahead = script("async_ahead")
    runner = SimpleNamespace(scheduler=SimpleNamespace(strategy=AsyncStrategy(over_sampling=2.0)))
    ahead.with_ahead(2.0)(runner)
    assert runner.scheduler.strategy.ahead_target(16) == 32 and runner.scheduler.strategy.over_sampling == 2.0
    with pytest.raises(AssertionError, match="async"):
        ahead.with_ahead(1.0)(SimpleNamespace(scheduler=SimpleNamespace(strategy=AprilStrategy())))
    run = {"seed": 2, "wall_s": 100.0, "engine_idle_share": 0.1, "trainer_idle_share": 0.4,
           "eval": [{"step": 0, "reward": 0.5}, {"step": 30, "reward": 0.6}],
           "train": [{"tokens_generated": 300, "trained_tokens": 200, "regenerated_tokens": 30},
                     {"tokens_generated": 100, "trained_tokens": 200, "regenerated_tokens": 10}]}
    row = ahead.measured(run, "one batch", 1.0)
    # 40 of 400 generated tokens thrown away; 400 generated for 400 trained.
    assert row["thrown_away_share"] == pytest.approx(0.1) and row["generated_over_trained"] == pytest.approx(1.0)
    assert (row["heldout_start"], row["heldout_end"], row["seed"]) == (0.5, 0.6, 2)


def test_reward_at_equal_steps_is_judged_against_the_seed_to_seed_spread(script) -> None:  # type: ignore[no-untyped-def]
    compare = script("time_to_reward").reward_at_equal_steps

    def run(rewards: dict[int, float]) -> dict:
        return {"eval": [{"step": step, "reward": r} for step, r in rewards.items()]}

    # Step 10: sync 0.50, 0.52, 0.54 (variance 0.0004), async 0.49, 0.51, 0.53 (0.0004): gap -0.01, two
    # standard errors 2 * sqrt(0.0004/3 + 0.0004/3) = 0.0327: within. Step 20: async 0.1 lower everywhere.
    by = {"sync": [run({10: 0.50, 20: 0.60}), run({10: 0.52, 20: 0.62}), run({10: 0.54, 20: 0.64})],
          "async": [run({10: 0.49, 20: 0.50}), run({10: 0.51, 20: 0.52}), run({10: 0.53, 20: 0.54})]}
    out = compare(by)["async"]
    first, second = out["per_step"]
    assert first["gap"] == pytest.approx(-0.01) and first["two_standard_errors"] == pytest.approx(
        2 * math.sqrt(0.0008 / 3)) and first["within"]
    assert second["gap"] == pytest.approx(-0.10) and not second["within"]
    assert (out["within_spread"], out["steps"]) == (1, 2) and out["largest_gap"] == pytest.approx(-0.10)
    assert compare({"sync": by["sync"][:1], "async": by["async"][:1]}) == {}  # one seed has no spread
