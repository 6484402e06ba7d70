"""The autotuner's control law: direction, bounds, hysteresis, cooldown, settling, modes, closed loop."""

from __future__ import annotations

import pytest
from rljob.api.spec import AutotuneSpec, TruncationTokensBounds
from rljob.common.autotune.controller import (
    Bounds,
    ControllerConfig,
    Knobs,
    Observation,
    TunerState,
    decide,
)

CFG = ControllerConfig(cooldown_s=60, settle_rounds=2)
SIGMA = Knobs(over_sampling=2.0, truncation=2.0, truncation_unit="sigma")
TOKENS = Knobs(over_sampling=2.0, truncation=32.0, truncation_unit="tokens")
NO_TRUNC = Knobs(over_sampling=2.0)


def obs(rate: float, **kw: float) -> Observation:
    defaults = {"length_mean": 100.0, "length_std": 50.0, "steps": 10}
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


def test_above_band_without_truncation_lowers_over_sampling() -> None:
    d = decide(obs(0.6), NO_TRUNC, CFG, TunerState(), now=0)
    assert d.changed and d.knobs.over_sampling == pytest.approx(1.5)


def test_truncation_at_max_falls_back_to_over_sampling() -> None:
    at_max = Knobs(over_sampling=2.0, truncation=6.0, truncation_unit="sigma")
    d = decide(obs(0.6), at_max, CFG, TunerState(), now=0)
    assert d.changed and d.knobs.truncation == 6.0 and d.knobs.over_sampling < 2.0


def test_every_knob_at_bound_holds() -> None:
    stuck = Knobs(over_sampling=1.0, truncation=6.0, truncation_unit="sigma")
    d = decide(obs(0.9), stuck, CFG, TunerState(), now=0)
    assert not d.changed and d.reason == "AtBounds" and d.knobs == stuck


def test_below_band_raises_over_sampling_then_tightens_truncation() -> None:
    d = decide(obs(0.02), SIGMA, CFG, TunerState(), now=0)
    assert d.changed and d.reason == "TruncationBelowBand" and d.knobs.over_sampling > 2.0
    os_max = Knobs(over_sampling=4.0, truncation=2.0, truncation_unit="sigma")
    d = decide(obs(0.02), os_max, CFG, TunerState(), now=0)
    assert d.changed and d.knobs.truncation is not None and d.knobs.truncation < 2.0


def test_step_scales_with_error_and_never_exceeds_max_step() -> None:
    small = decide(obs(0.29), SIGMA, CFG, TunerState(), now=0)
    large = decide(obs(0.95), SIGMA, CFG, TunerState(), now=0)
    assert small.knobs.truncation is not None and large.knobs.truncation is not None
    assert 0 < small.knobs.truncation - 2.0 < large.knobs.truncation - 2.0 <= CFG.truncation_k.max_step


def test_bounds_are_never_crossed() -> None:
    near = Knobs(over_sampling=3.9, truncation=0.6, truncation_unit="sigma")
    d = decide(obs(0.0), near, CFG, TunerState(), now=0)
    assert d.knobs.over_sampling == 4.0
    d = decide(obs(0.0), Knobs(over_sampling=4.0, truncation=0.6, truncation_unit="sigma"), CFG, TunerState(), now=0)
    assert d.knobs.truncation == 0.5


def test_inside_band_and_hysteresis_margin_hold() -> None:
    d = decide(obs(0.2), SIGMA, CFG, TunerState(), now=0)
    assert not d.changed and d.reason == "InBand"
    d = decide(obs(0.27), SIGMA, CFG, TunerState(), now=0)  # above 0.25 but within the 0.03 margin
    assert not d.changed and d.reason == "WithinHysteresis"


def test_hysteresis_continues_correction_until_inside_band() -> None:
    correcting = TunerState(direction=1)
    d = decide(obs(0.27), SIGMA, CFG, correcting, now=0)
    assert d.changed and d.reason == "TruncationAboveBand"
    d = decide(obs(0.24), SIGMA, CFG, correcting, now=0)
    assert not d.changed and d.state.direction == 0


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


def test_low_length_spread_lowers_over_sampling_even_in_band() -> None:
    d = decide(obs(0.2, length_std=2.0), SIGMA, CFG, TunerState(), now=0)
    assert d.changed and d.reason == "LowLengthSpread" and d.knobs.over_sampling == 1.5
    at_min = Knobs(over_sampling=1.0, truncation=2.0, truncation_unit="sigma")
    d = decide(obs(0.05, length_std=2.0), at_min, CFG, TunerState(), now=0)
    assert not d.changed and d.reason == "LowLengthSpread"


def test_off_policy_limit_and_low_entropy_refuse_more_off_policy() -> None:
    d = decide(obs(0.02, off_policy_ratio=0.9), SIGMA, CFG, TunerState(), now=0)
    assert not d.changed and d.reason == "OffPolicyLimit"
    cfg = ControllerConfig(entropy_floor=0.5)
    d = decide(obs(0.02, entropy=0.1), SIGMA, cfg, TunerState(), now=0)
    assert not d.changed and d.reason == "LowEntropy"
    # Above the band the fix reduces off-policy tokens, so it is always allowed.
    d = decide(obs(0.6, off_policy_ratio=0.9, entropy=0.1), SIGMA, cfg, TunerState(), now=0)
    assert d.changed


def test_near_ceiling_prefers_truncation_over_more_over_sampling() -> None:
    d = decide(obs(0.02, tokens_per_second=98.0, ceiling_tokens_per_second=100.0), SIGMA, CFG, TunerState(), now=0)
    assert d.changed and d.knobs.over_sampling == 2.0 and d.knobs.truncation is not None and d.knobs.truncation < 2.0


def test_invalid_rate_is_never_acted_on() -> None:
    d = decide(obs(float("nan")), SIGMA, CFG, TunerState(), now=0)
    assert not d.changed and d.reason == "InvalidMetrics"


def test_config_from_spec_caps_tokens_by_response_length() -> None:
    spec = AutotuneSpec(truncation_tokens=TruncationTokensBounds(min=8, max=4096, max_step=32), cooldown_seconds=30)
    cfg = ControllerConfig.from_spec(spec, max_response_length=256)
    assert cfg.truncation_tokens == Bounds(8, 256, 32)
    assert cfg.cooldown_s == 30 and cfg.band_low == 0.15 and cfg.band_high == 0.25


def _plant(knobs: Knobs) -> float:
    """A monotone toy plant: higher k lowers the truncation rate, more over-sampling raises it."""
    assert knobs.truncation is not None
    return min(1.0, max(0.0, 0.75 - 0.18 * knobs.truncation + 0.12 * (knobs.over_sampling - 1.0)))


@pytest.mark.parametrize("start", [Knobs(2.0, 0.5, "sigma"), Knobs(1.0, 6.0, "sigma"), Knobs(4.0, 1.0, "sigma")])
def test_closed_loop_enters_the_band_and_stays(start: Knobs) -> None:
    knobs, state, changes = start, TunerState(), 0
    history = []
    for i in range(40):
        steps = i * 3  # three rounds per decision: settling is always satisfied
        d = decide(obs(_plant(knobs), steps=steps), knobs, CFG, state, now=i * 100.0)
        knobs, state = d.knobs, d.state
        changes += d.changed
        history.append(_plant(knobs))
    assert CFG.band_low <= history[-1] <= CFG.band_high
    assert changes <= 12  # bounded number of adjustments
    first_in = next(i for i, r in enumerate(history) if CFG.band_low <= r <= CFG.band_high)
    assert all(CFG.band_low - CFG.hysteresis <= r <= CFG.band_high + CFG.hysteresis for r in history[first_in:])
