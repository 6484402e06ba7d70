"""The autotuner's control law: the truncation band loop, the goodput search on over-sampling, its safety
bounds, cooldown, settling, modes, and closed loops on toy plants."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from rljob.api.spec import AutotuneSpec, TruncationTokensBounds
from rljob.common.autotune.controller import (
    Bounds,
    ControllerConfig,
    Knobs,
    Observation,
    TunerState,
    cap_at_floor,
    decide,
    mean_noise,
)

CFG = ControllerConfig(cooldown_s=60, settle_rounds=2)
SIGMA = Knobs(over_sampling=2.0, truncation=2.0, truncation_unit="sigma")
TOKENS = Knobs(over_sampling=2.0, truncation=32.0, truncation_unit="tokens")
NO_TRUNC = Knobs(over_sampling=2.0)


def obs(rate: float, **kw: float) -> Observation:
    defaults = {"length_mean": 100.0, "length_std": 50.0, "steps": 10, "goodput": 100.0}
    defaults.update(kw)
    return Observation(truncation_rate=rate, **defaults)  # type: ignore[arg-type]


def test_above_band_relaxes_truncation_first() -> None:
    d = decide(obs(0.6), SIGMA, CFG, TunerState(), now=1000)
    assert d.changed and d.reason == "TruncationAboveBand"
    assert d.knobs.truncation == pytest.approx(2.5)  # full maxStep: far from the band
    assert d.knobs.over_sampling == 2.0
    assert d.state.direction == 1 and d.state.last_change_time == 1000 and d.state.last_change_step == 10


def test_above_band_token_cap_moves_in_whole_tokens() -> None:
    d = decide(obs(0.30), TOKENS, CFG, TunerState(), now=0)
    assert d.changed
    assert d.knobs.truncation == float(int(d.knobs.truncation))
    assert 32 < d.knobs.truncation <= 32 + 64


def test_step_scales_with_error_and_never_exceeds_max_step() -> None:
    small = decide(obs(0.29), SIGMA, CFG, TunerState(), now=0)
    large = decide(obs(0.95), SIGMA, CFG, TunerState(), now=0)
    assert small.knobs.truncation is not None and large.knobs.truncation is not None
    assert 0 < small.knobs.truncation - 2.0 < large.knobs.truncation - 2.0 <= CFG.truncation_k.max_step


def test_truncation_threshold_bounds_are_never_crossed() -> None:
    d = decide(obs(0.0), Knobs(over_sampling=2.0, truncation=0.6, truncation_unit="sigma"), CFG, TunerState(), now=0)
    assert d.changed and d.reason == "TruncationBelowBand" and d.knobs.truncation == 0.5
    d = decide(obs(0.9), Knobs(over_sampling=2.0, truncation=5.9, truncation_unit="sigma"), CFG, TunerState(), now=0)
    assert d.changed and d.knobs.truncation == 6.0


def test_hysteresis_continues_correction_until_inside_band() -> None:
    d = decide(obs(0.27), SIGMA, CFG, TunerState(), now=0)  # above 0.25 but within the 0.03 margin
    assert d.knobs.truncation == 2.0 and "by less than 0.03" in d.message  # (the goodput search may move)
    correcting = TunerState(direction=1)
    d = decide(obs(0.27), SIGMA, CFG, correcting, now=0)
    assert d.changed and d.reason == "TruncationAboveBand"
    d = decide(obs(0.24), SIGMA, CFG, correcting, now=0)
    assert d.reason != "TruncationAboveBand" and d.state.direction == 0


def test_a_rate_outside_the_band_by_less_than_twice_its_noise_moves_nothing() -> None:
    d = decide(obs(0.32, truncation_noise=0.05), SIGMA, CFG, TunerState(), now=0)
    assert d.knobs.truncation == 2.0 and "by less than 0.1 (two standard errors" in d.message
    d = decide(obs(0.36, truncation_noise=0.05), SIGMA, CFG, TunerState(), now=0)
    assert d.changed and d.reason == "TruncationAboveBand"


def test_a_correction_goes_on_until_the_rate_is_within_one_standard_error() -> None:
    correcting = TunerState(direction=1)
    d = decide(obs(0.31, truncation_noise=0.05), SIGMA, CFG, correcting, now=0)
    assert d.changed and d.reason == "TruncationAboveBand"
    d = decide(obs(0.29, truncation_noise=0.05), SIGMA, CFG, correcting, now=0)
    assert d.knobs.truncation == 2.0 and d.state.direction == 0


def test_an_overshoot_needs_the_margin_to_reverse() -> None:
    """A correction from above that lands below the band is not undone at once: reversing is starting anew."""
    correcting = TunerState(direction=1)
    d = decide(obs(0.13), SIGMA, CFG, correcting, now=0)  # below 0.15, within the 0.03 margin
    assert d.knobs.truncation == 2.0 and d.state.direction == 0
    d = decide(obs(0.11), SIGMA, CFG, correcting, now=0)
    assert d.changed and d.reason == "TruncationBelowBand" and d.state.direction == -1


def test_mean_noise_is_the_standard_error_of_the_mean() -> None:
    assert mean_noise([0.2, 0.6]) == pytest.approx(0.2)  # stdev 0.4/√2, over √2
    assert mean_noise([0.3, 0.3, 0.3]) == 0.0 and mean_noise([0.5]) is None and mean_noise([]) is None


def test_cooldown_and_settling_gate_changes() -> None:
    state = TunerState(last_change_time=1000, last_change_step=10, direction=1)
    d = decide(obs(0.6, steps=20), SIGMA, CFG, state, now=1030)
    assert not d.changed and d.reason == "Cooldown" and "30 s left" in d.message
    d = decide(obs(0.6, steps=11), SIGMA, CFG, state, now=2000)
    assert not d.changed and d.reason == "Settling"
    d = decide(obs(0.6, steps=12), SIGMA, CFG, state, now=2000)
    assert d.changed


def test_apply_waits_for_the_runtime_to_run_the_last_knobs() -> None:
    old = Knobs(over_sampling=2.0, truncation=1.5, truncation_unit="sigma")
    d = decide(obs(0.6), SIGMA, CFG, TunerState(), now=0, mode="Apply", in_force=old)
    assert not d.changed and d.reason == "AwaitingRuntime"
    d = decide(obs(0.6), SIGMA, CFG, TunerState(), now=0, mode="Apply", in_force=SIGMA)
    assert d.changed
    # Recommend never applies, so it never waits for the runtime.
    d = decide(obs(0.6), SIGMA, CFG, TunerState(), now=0, mode="Recommend", in_force=old)
    assert d.changed


def test_off_mode_never_changes() -> None:
    d = decide(obs(0.9), SIGMA, CFG, TunerState(direction=1), now=0, mode="Off")
    assert not d.changed and d.reason == "AutotuneOff" and d.state.direction == 0


def test_invalid_rate_is_never_acted_on() -> None:
    d = decide(obs(float("nan")), SIGMA, CFG, TunerState(), now=0)
    assert not d.changed and d.reason == "InvalidMetrics"


def test_config_from_spec_caps_tokens_by_response_length() -> None:
    spec = AutotuneSpec(truncation_tokens=TruncationTokensBounds(min=8, max=4096, max_step=32), cooldown_seconds=30)
    cfg = ControllerConfig.from_spec(spec, max_response_length=256)
    assert cfg.truncation_tokens == Bounds(8, 256, 32)
    assert cfg.cooldown_s == 30 and cfg.band_low == 0.15 and cfg.band_high == 0.25


# ---------------------------------------------------------------- over-sampling: the goodput search

IN_BAND = 0.2
SEARCHED_UP = TunerState(search=1, goodput_ref=100.0)
SEARCHED_DOWN = TunerState(search=-1, goodput_ref=100.0)
SETTLED = TunerState(goodput_ref=100.0, next_probe=-1, settled_decisions=3)

# (case, observation, knobs, state, reason, over-sampling after, search state after)
SEARCH_TABLE = [
    ("no reference: probe up", obs(IN_BAND), SIGMA, TunerState(), "GoodputProbe", 2.5, 1),
    ("probe down when the last probe up failed", obs(IN_BAND), SIGMA, TunerState(next_probe=-1), "GoodputProbe", 1.5, -1),
    ("probe the other way at the bound", obs(IN_BAND), Knobs(4.0, 2.0, "sigma"), TunerState(), "GoodputProbe", 3.5, -1),
    ("rising: keep going up", obs(IN_BAND, goodput=110.0), SIGMA, SEARCHED_UP, "GoodputRising", 2.5, 1),
    ("rising: keep going down", obs(IN_BAND, goodput=110.0), SIGMA, SEARCHED_DOWN, "GoodputRising", 1.5, -1),
    ("falling: step back down", obs(IN_BAND, goodput=90.0), SIGMA, SEARCHED_UP, "GoodputFalling", 1.5, 0),
    ("falling: step back up", obs(IN_BAND, goodput=90.0), SIGMA, SEARCHED_DOWN, "GoodputFalling", 2.5, 0),
    # A tie keeps the higher over-sampling: a raise that cost nothing goes on, a cut that gained nothing goes back.
    ("flat after a raise: keep going up", obs(IN_BAND, goodput=102.0), SIGMA, SEARCHED_UP, "GoodputFlat", 2.5, 1),
    ("flat after a raise at the bound: settle", obs(IN_BAND, goodput=102.0), Knobs(4.0, 2.0, "sigma"), SEARCHED_UP,
     "GoodputFlat", 4.0, 0),
    ("flat after a cut: back up", obs(IN_BAND, goodput=98.0), SIGMA, SEARCHED_DOWN, "GoodputFlat", 2.5, 0),
    # Noise widens the margin to 2·√2·(relative standard error): ±20 % on a 10 % noisy window is a tie.
    ("noisy rise is a tie", obs(IN_BAND, goodput=120.0, goodput_noise=0.1), SIGMA, SEARCHED_DOWN, "GoodputFlat", 2.5, 0),
    ("noisy fall is a tie", obs(IN_BAND, goodput=80.0, goodput_noise=0.1), SIGMA, SEARCHED_UP, "GoodputFlat", 2.5, 1),
    ("fall beyond the noise", obs(IN_BAND, goodput=60.0, goodput_noise=0.1), SIGMA, SEARCHED_UP, "GoodputFalling", 1.5, 0),
    ("settled, a noisy dip: hold", obs(IN_BAND, goodput=70.0, goodput_noise=0.1), SIGMA, SETTLED, "GoodputSettled", 2.0, 0),
    ("rising at the bound: settle", obs(IN_BAND, goodput=120.0), Knobs(4.0, 2.0, "sigma"), SEARCHED_UP,
     "GoodputAtBound", 4.0, 0),
    ("settled: hold", obs(IN_BAND, goodput=99.0), SIGMA, SETTLED, "GoodputSettled", 2.0, 0),
    ("settled, goodput dropped: probe again", obs(IN_BAND, goodput=80.0), SIGMA, SETTLED, "GoodputProbe", 1.5, -1),
    ("settled long enough: probe again", obs(IN_BAND), SIGMA, TunerState(goodput_ref=100.0, settled_decisions=9),
     "GoodputProbe", 2.5, 1),
    ("no goodput measured: hold", obs(IN_BAND, goodput=0.0), SIGMA, TunerState(), "NoGoodput", 2.0, 0),
    ("truncation off: over-sampling still searched", obs(0.0), NO_TRUNC, TunerState(), "GoodputProbe", 2.5, 1),
    # Safety bounds lower over-sampling whatever goodput says, and reset the search.
    ("off-policy limit", obs(IN_BAND, off_policy_ratio=0.9, goodput=200.0), SIGMA, SEARCHED_UP, "OffPolicyLimit", 1.5, 0),
    ("staleness budget", obs(IN_BAND, aborted_token_share=0.5), SIGMA, SEARCHED_UP, "StalenessBudget", 1.5, 0),
    ("low length spread", obs(IN_BAND, length_std=2.0), SIGMA, TunerState(), "LowLengthSpread", 1.5, 0),
    ("limit at the minimum: hold", obs(IN_BAND, off_policy_ratio=0.9), Knobs(1.0, 2.0, "sigma"), TunerState(),
     "OffPolicyLimit", 1.0, 0),
    # The truncation loop goes first: its band is the health constraint.
    ("truncation above band first", obs(0.6, goodput=500.0), SIGMA, SEARCHED_UP, "TruncationAboveBand", 2.0, 0),
    ("truncation at its bound: search goes on", obs(0.6), Knobs(2.0, 6.0, "sigma"), TunerState(), "GoodputProbe", 2.5, 1),
    # Below the band with the cap at its floor a lower k cuts nothing more: the threshold is at its bound.
    ("cap at its floor: search goes on", obs(0.0, cap_at_floor=True), SIGMA, TunerState(), "GoodputProbe", 2.5, 1),
    ("cap above its floor: lower k", obs(0.0, cap_at_floor=False), SIGMA, TunerState(), "TruncationBelowBand", 2.0, 0),
    ("cap at its floor, above band: raise k", obs(0.6, cap_at_floor=True), SIGMA, TunerState(), "TruncationAboveBand",
     2.0, 0),
]


@pytest.mark.parametrize(("observation", "knobs", "state", "reason", "over_sampling", "search"),
                         [c[1:] for c in SEARCH_TABLE], ids=[c[0] for c in SEARCH_TABLE])
def test_over_sampling_table(observation: Observation, knobs: Knobs, state: TunerState, reason: str,
                             over_sampling: float, search: int) -> None:
    d = decide(observation, knobs, CFG, state, now=1000)
    assert (d.reason, d.knobs.over_sampling, d.state.search) == (reason, over_sampling, search), d.message
    assert d.changed == (over_sampling != knobs.over_sampling or d.knobs.truncation != knobs.truncation)
    assert d.knobs.truncation == knobs.truncation or reason.startswith("Truncation")
    assert d.message  # every decision says why, in words (status condition and Event)


def test_cap_at_floor_reads_the_runtime_knobs() -> None:
    assert cap_at_floor({"segment_cap_tokens": 100.0, "segment_cap_floor_tokens": 100.0}) is True
    assert cap_at_floor({"segment_cap_tokens": 140.0, "segment_cap_floor_tokens": 100.0}) is False
    assert cap_at_floor({"segment_cap_tokens": 0.0, "segment_cap_floor_tokens": 100.0}) is None  # no cap
    assert cap_at_floor({"over_sampling": 2.0}) is None  # an older runtime
    d = decide(obs(0.0, cap_at_floor=True), SIGMA, CFG, TunerState(), now=0)
    assert "segment cap at its floor" in d.message


def test_flat_verdicts_never_ratchet_the_reference_down() -> None:
    """Cuts that each look flat within the tolerance must not add up: the reference keeps the best figure,
    so the next settled check sees the accumulated drop and probes again."""
    d = decide(obs(IN_BAND, goodput=96.0), SIGMA, CFG, SEARCHED_DOWN, now=0)
    assert d.reason == "GoodputFlat" and d.state.goodput_ref == 100.0 and d.knobs.over_sampling == 2.5
    d = decide(obs(IN_BAND, goodput=89.0, steps=20), d.knobs, CFG, replace(d.state, last_change_step=None, last_change_time=None), now=0)
    assert d.changed and d.reason == "GoodputProbe" and d.knobs.over_sampling == 3.0  # 89 < 100 x (1 - 2 x 0.05)


def test_goodput_noise_is_the_ratio_estimators_standard_error() -> None:
    """Σt/Σs over steps (t, s): R = 300/3 = 100, residuals t - R·s = (-50, 50, 0), s̄ = 1, n = 3:
    Var(R) = Σe² / ((n-1)·n·s̄²) = 5000 / 6, so the relative error is √(5000/6) / 100 ≈ 0.2887."""
    from rljob.common.autotune.controller import goodput_margin, goodput_noise

    assert goodput_noise([50.0, 150.0, 100.0], [1.0, 1.0, 1.0]) == pytest.approx((5000 / 6) ** 0.5 / 100)
    assert goodput_noise([100.0, 200.0], [1.0, 2.0]) == 0.0  # every step at the same rate
    assert goodput_noise([100.0], [1.0]) is None and goodput_noise([0.0, 0.0], [1.0, 1.0]) is None
    assert goodput_margin(CFG, None) == CFG.goodput_tolerance == goodput_margin(CFG, 0.001)
    assert goodput_margin(CFG, 0.1) == pytest.approx(2 * 2**0.5 * 0.1)


def test_entropy_floor_lowers_over_sampling() -> None:
    d = decide(obs(IN_BAND, entropy=0.1), SIGMA, ControllerConfig(entropy_floor=0.5), TunerState(), now=0)
    assert d.changed and d.reason == "LowEntropy" and d.knobs.over_sampling == 1.5


def test_a_verdict_on_the_last_move_waits_for_cooldown_and_settling() -> None:
    """Goodput measured before the job settled on the new knobs must not judge them."""
    moved = TunerState(last_change_time=1000, last_change_step=10, search=1, goodput_ref=100.0)
    d = decide(obs(IN_BAND, goodput=50.0, steps=20), SIGMA, CFG, moved, now=1030)
    assert not d.changed and d.reason == "Cooldown" and d.state == moved
    d = decide(obs(IN_BAND, goodput=50.0, steps=11), SIGMA, CFG, moved, now=2000)
    assert not d.changed and d.reason == "Settling" and d.state == moved
    d = decide(obs(IN_BAND, goodput=50.0, steps=12), SIGMA, CFG, moved, now=2000)
    assert d.changed and d.reason == "GoodputFalling"


def test_config_takes_the_safety_bounds_from_the_spec() -> None:
    spec = AutotuneSpec(max_aborted_token_share=0.2, goodput_tolerance=0.1, entropy_floor=0.3)
    cfg = ControllerConfig.from_spec(spec)
    assert (cfg.max_aborted_token_share, cfg.goodput_tolerance, cfg.entropy_floor) == (0.2, 0.1, 0.3)


# ---------------------------------------------------------------- closed loops on toy plants


def _truncation_plant(knobs: Knobs) -> float:
    """Higher k cuts fewer samples; over-sampling does not change what the threshold cuts."""
    assert knobs.truncation is not None
    return min(1.0, max(0.0, 0.75 - 0.18 * knobs.truncation))


def _goodput_plant(knobs: Knobs, peak: float = 2.5) -> float:
    """Goodput with a single peak in over-sampling (the tail hidden vs surplus off-policy work)."""
    return 1000.0 - 150.0 * (knobs.over_sampling - peak) ** 2


@pytest.mark.parametrize("start", [Knobs(2.0, 0.5, "sigma"), Knobs(1.0, 6.0, "sigma"), Knobs(4.0, 1.0, "sigma")])
def test_closed_loop_enters_the_band_and_finds_the_goodput_peak(start: Knobs) -> None:
    knobs, state, changes = start, TunerState(), 0
    history = []
    for i in range(60):
        steps = i * 3  # three rounds per decision: settling is always satisfied
        o = obs(_truncation_plant(knobs), steps=steps, goodput=_goodput_plant(knobs))
        d = decide(o, knobs, CFG, state, now=i * 100.0)
        knobs, state = d.knobs, d.state
        changes += d.changed
        history.append((_truncation_plant(knobs), knobs.over_sampling))
    rates = [r for r, _ in history]
    assert CFG.band_low <= rates[-1] <= CFG.band_high
    first_in = next(i for i, r in enumerate(rates) if CFG.band_low <= r <= CFG.band_high)
    assert all(CFG.band_low - CFG.hysteresis <= r <= CFG.band_high + CFG.hysteresis for r in rates[first_in:])
    # Over-sampling ends within one step of the peak, and moves only by bounded steps with periodic probes.
    assert abs(knobs.over_sampling - 2.5) <= CFG.over_sampling.max_step
    assert changes <= 30


def test_the_search_follows_a_drifting_peak() -> None:
    """The length distribution drifts: the best over-sampling moves from 1.5 to 3.5; the probes find it."""
    knobs, state = Knobs(1.5, 2.0, "sigma"), TunerState(goodput_ref=_goodput_plant(Knobs(1.5, 2.0, "sigma"), 1.5))
    for i in range(60):
        o = obs(IN_BAND, steps=i * 3, goodput=_goodput_plant(knobs, peak=3.5))
        d = decide(o, knobs, CFG, state, now=i * 100.0)
        knobs, state = d.knobs, d.state
    assert abs(knobs.over_sampling - 3.5) <= CFG.over_sampling.max_step


def _noisy_loop(seed: int, noise_known: bool, decisions: int = 80, se: float = 0.07) -> tuple[int, float]:
    """The truncation loop on the toy plant with each window's mean rate off by N(0, se): changes, final rate."""
    rng = random.Random(seed)
    knobs, state, changes = Knobs(2.0, 0.5, "sigma"), TunerState(), 0
    for i in range(decisions):
        rate = min(1.0, max(0.0, _truncation_plant(knobs) + rng.gauss(0.0, se)))
        o = Observation(truncation_rate=rate, truncation_noise=se if noise_known else None, steps=i * 3)
        d = decide(o, knobs, CFG, state, now=i * 100.0)
        changes += d.knobs.truncation != knobs.truncation
        knobs, state = d.knobs, d.state
    return changes, _truncation_plant(knobs)


def test_a_noisy_rate_with_its_noise_known_moves_the_threshold_far_less() -> None:
    """A window's mean rate as noisy as the band is wide (the 16-sample rounds of the cluster test): with its
    standard error known the loop reaches the band in the 5 moves the distance needs and then seldom moves;
    without it, it chases the noise. The CI failure that led here: 19 changes where 6 were needed."""
    known = [_noisy_loop(seed, noise_known=True) for seed in range(20)]
    unknown = [_noisy_loop(seed, noise_known=False) for seed in range(20)]
    assert max(c for c, _ in known) <= 15 and sum(c for c, _ in known) * 3 < sum(c for c, _ in unknown)
    finals = sorted(rate for _, rate in known)
    assert CFG.band_low <= finals[len(finals) // 2] <= CFG.band_high  # the median run ends inside the band
    assert all(CFG.band_low - 2 * 0.07 <= r <= CFG.band_high + 2 * 0.07 for r in finals)
