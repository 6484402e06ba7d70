"""The autotuner's control law: observed truncation rate and friends → new knob values, pure.

Both the operator's timer (metrics from Prometheus) and `rljob run`'s LocalAutotuner (metrics from
its own step records) call `decide`, so one law runs everywhere. The law and why it is stable are in
docs/autotune.md; in short:

- the controlled variable is the truncation rate r (share of launched samples that end a round
  partial), kept inside a band [low, high];
- the plant is monotone: raising the truncation threshold (k or the token cap) or lowering the
  over-sampling ratio lowers r, and the opposite moves raise it;
- every change is bounded (maxStep, scaled by the error, clamped to [min, max]), separated by a
  cooldown and a number of settled rounds, and only starts once r is outside the band by the
  hysteresis margin; once started it continues until r is back inside the band.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

from rljob.api.spec import AutotuneSpec, KnobBounds

Mode = Literal["Off", "Recommend", "Apply"]
TruncationUnit = Literal["sigma", "tokens"]

# A change smaller than this share of maxStep is never worth a round of settling.
MIN_STEP_FRACTION = 0.25
# Knob values closer than this are the same value (float round trips through Prometheus and JSON).
KNOB_TOLERANCE = 1e-6


@dataclass(frozen=True)
class Bounds:
    """Range and largest single change of one knob."""

    min: float
    max: float
    max_step: float

    def clamp(self, value: float) -> float:
        """`value` limited to [min, max]."""
        return min(self.max, max(self.min, value))

    @classmethod
    def from_spec(cls, spec: KnobBounds, ceiling: float | None = None) -> Bounds:
        """Bounds of the spec, with `max` lowered to `ceiling` when given."""
        top = spec.max if ceiling is None else min(spec.max, ceiling)
        return cls(min=min(spec.min, top), max=top, max_step=spec.max_step)


@dataclass(frozen=True)
class Knobs:
    """Values of the tuned knobs. `truncation` is k (unit sigma) or a token cap (unit tokens), or None when off."""

    over_sampling: float
    truncation: float | None = None
    truncation_unit: TruncationUnit | None = None

    def same_as(self, other: Knobs) -> bool:
        """Whether both sets hold the same values (within float tolerance)."""
        if abs(self.over_sampling - other.over_sampling) > KNOB_TOLERANCE:
            return False
        if (self.truncation is None) != (other.truncation is None):
            return False
        if self.truncation is not None and other.truncation is not None:
            return self.truncation_unit == other.truncation_unit and abs(self.truncation - other.truncation) <= max(
                KNOB_TOLERANCE, 1e-9 * abs(self.truncation)
            )
        return True


def knobs_in_force(values: Mapping[str, float], unit: TruncationUnit | None) -> Knobs | None:
    """The runtime's `rljob_knob` values as controller Knobs in `unit`, or None when not reported."""
    if "over_sampling" not in values:
        return None
    truncation: float | None = None
    if unit == "sigma":
        truncation = values.get("truncation_k")
    elif unit == "tokens":
        truncation = values.get("segment_cap_tokens")
    if unit is not None and truncation is None:
        return None
    return Knobs(over_sampling=values["over_sampling"], truncation=truncation, truncation_unit=unit)


@dataclass(frozen=True)
class Observation:
    """Recent runtime metrics, averaged over the decision window. Only truncation_rate is required."""

    truncation_rate: float
    length_mean: float | None = None
    length_std: float | None = None
    tokens_per_second: float | None = None
    ceiling_tokens_per_second: float | None = None
    off_policy_ratio: float | None = None
    entropy: float | None = None
    steps: int | None = None  # runtime step counter (settle rounds)

    @property
    def length_spread(self) -> float | None:
        """Coefficient of variation σ/μ of response lengths, when known."""
        if self.length_mean is None or self.length_std is None or self.length_mean <= 0:
            return None
        return self.length_std / self.length_mean

    @property
    def ceiling_share(self) -> float | None:
        """Rollout throughput as a share of the bubble-free ceiling, when both are known."""
        if self.tokens_per_second is None or not self.ceiling_tokens_per_second:
            return None
        return self.tokens_per_second / self.ceiling_tokens_per_second


@dataclass(frozen=True)
class ControllerConfig:
    """Everything the law needs from the spec."""

    band_low: float = 0.15
    band_high: float = 0.25
    hysteresis: float = 0.03
    cooldown_s: float = 120.0
    settle_rounds: int = 2
    over_sampling: Bounds = Bounds(1.0, 4.0, 0.5)
    truncation_k: Bounds = Bounds(0.5, 6.0, 0.5)
    truncation_tokens: Bounds = Bounds(8, 1_000_000, 64)
    min_length_spread: float = 0.1
    max_off_policy_ratio: float = 0.8
    near_ceiling: float = 0.95  # above this share of the ceiling more over-sampling buys nothing
    entropy_floor: float | None = None  # below it, never make the batch more off-policy

    @classmethod
    def from_spec(cls, spec: AutotuneSpec, max_response_length: int | None = None) -> ControllerConfig:
        """The controller configuration of an RLJob's spec.autotune (token cap bounded by the response cap)."""
        return cls(
            band_low=spec.truncation_band.low,
            band_high=spec.truncation_band.high,
            hysteresis=spec.hysteresis,
            cooldown_s=float(spec.cooldown_seconds),
            settle_rounds=spec.settle_rounds,
            over_sampling=Bounds.from_spec(spec.over_sampling),
            truncation_k=Bounds.from_spec(spec.truncation_k),
            truncation_tokens=Bounds.from_spec(
                spec.truncation_tokens, float(max_response_length) if max_response_length else None
            ),
            min_length_spread=spec.min_length_spread,
            max_off_policy_ratio=spec.max_off_policy_ratio,
        )

    def truncation_bounds(self, unit: TruncationUnit) -> Bounds:
        return self.truncation_k if unit == "sigma" else self.truncation_tokens


@dataclass(frozen=True)
class TunerState:
    """What the law remembers between decisions."""

    last_change_time: float | None = None
    last_change_step: int | None = None
    direction: int = 0  # +1 correcting a rate above the band, -1 below, 0 idle


@dataclass(frozen=True)
class TunerDecision:
    """Outcome of one decision. `knobs` equals the current knobs when `changed` is False."""

    knobs: Knobs
    changed: bool
    reason: str  # CamelCase, usable as a Condition/Event reason
    message: str
    state: TunerState


def _step_fraction(rate: float, edge: float, cfg: ControllerConfig) -> float:
    """Share of maxStep to move: proportional to the distance from the band, at least MIN_STEP_FRACTION."""
    width = cfg.band_high - cfg.band_low
    return min(1.0, max(MIN_STEP_FRACTION, abs(rate - edge) / width))


def _moved(value: float, direction: int, fraction: float, bounds: Bounds, integer: bool) -> float:
    step = bounds.max_step * fraction
    if integer:
        step = max(1.0, math.floor(step))
    new = bounds.clamp(value + direction * step)
    return float(round(new)) if integer else round(new, 6)


def _error_direction(rate: float, cfg: ControllerConfig, state: TunerState) -> int:
    """+1 above the band, -1 below, 0 inside; the margin applies only when not already correcting."""
    margin = 0.0 if state.direction != 0 else cfg.hysteresis
    if rate > cfg.band_high + margin:
        return 1
    if rate < cfg.band_low - margin:
        return -1
    return 0


@dataclass(frozen=True)
class _Proposal:
    knobs: Knobs
    reason: str
    message: str


def _propose(obs: Observation, current: Knobs, cfg: ControllerConfig, direction: int) -> _Proposal | None:
    """The change the law wants, ignoring cooldown; None with no change wanted (reason from _hold_reason)."""
    r = obs.truncation_rate
    band = f"[{cfg.band_low:g}, {cfg.band_high:g}]"
    unit = current.truncation_unit
    trunc = current.truncation if unit is not None else None
    tb = cfg.truncation_bounds(unit) if unit is not None else None
    os_b = cfg.over_sampling

    if direction == 1:
        # Too many samples end partial: the batch is too off-policy. Relax truncation first (it cuts
        # samples that would have finished), then launch fewer surplus groups.
        frac = _step_fraction(r, cfg.band_high, cfg)
        if trunc is not None and tb is not None and trunc < tb.max - KNOB_TOLERANCE:
            new = _moved(trunc, +1, frac, tb, integer=unit == "tokens")
            return _Proposal(
                replace(current, truncation=new),
                "TruncationAboveBand",
                f"truncation rate {r:.3f} above band {band}: truncation threshold {trunc:g} -> {new:g} {unit}",
            )
        if current.over_sampling > os_b.min + KNOB_TOLERANCE:
            new = _moved(current.over_sampling, -1, frac, os_b, integer=False)
            return _Proposal(
                replace(current, over_sampling=new),
                "TruncationAboveBand",
                f"truncation rate {r:.3f} above band {band}: over-sampling {current.over_sampling:g} -> {new:g}",
            )
        return None

    spread = obs.length_spread
    if spread is not None and spread < cfg.min_length_spread:
        # Lengths barely vary: no long tail to hide, so surplus groups only add off-policy tokens.
        if current.over_sampling > os_b.min + KNOB_TOLERANCE:
            new = _moved(current.over_sampling, -1, 1.0, os_b, integer=False)
            return _Proposal(
                replace(current, over_sampling=new),
                "LowLengthSpread",
                f"length spread σ/μ {spread:.3f} below {cfg.min_length_spread:g}: over-sampling buys nothing, "
                f"{current.over_sampling:g} -> {new:g}",
            )
        return None

    if direction == 0:
        return None

    # Below the band: few samples end partial, so the tail still stalls rounds. Making the batch
    # more off-policy is refused when the off-policy ratio or the entropy says it is unsafe.
    if obs.off_policy_ratio is not None and obs.off_policy_ratio > cfg.max_off_policy_ratio:
        return None
    if cfg.entropy_floor is not None and obs.entropy is not None and obs.entropy < cfg.entropy_floor:
        return None
    frac = _step_fraction(r, cfg.band_low, cfg)
    share = obs.ceiling_share
    if current.over_sampling < os_b.max - KNOB_TOLERANCE and (share is None or share < cfg.near_ceiling):
        new = _moved(current.over_sampling, +1, frac, os_b, integer=False)
        return _Proposal(
            replace(current, over_sampling=new),
            "TruncationBelowBand",
            f"truncation rate {r:.3f} below band {band}: over-sampling {current.over_sampling:g} -> {new:g}",
        )
    if trunc is not None and tb is not None and trunc > tb.min + KNOB_TOLERANCE:
        new = _moved(trunc, -1, frac, tb, integer=unit == "tokens")
        return _Proposal(
            replace(current, truncation=new),
            "TruncationBelowBand",
            f"truncation rate {r:.3f} below band {band}: truncation threshold {trunc:g} -> {new:g} {unit}",
        )
    return None


def _hold_reason(obs: Observation, cfg: ControllerConfig, direction: int) -> tuple[str, str]:
    """Why no change is wanted (reason, message)."""
    r = obs.truncation_rate
    band = f"[{cfg.band_low:g}, {cfg.band_high:g}]"
    spread = obs.length_spread
    if direction == 0:
        if cfg.band_low <= r <= cfg.band_high:
            return "InBand", f"truncation rate {r:.3f} inside band {band}"
        return "WithinHysteresis", f"truncation rate {r:.3f} outside band {band} by less than {cfg.hysteresis:g}"
    if direction == -1 and spread is not None and spread < cfg.min_length_spread:
        return "LowLengthSpread", f"length spread σ/μ {spread:.3f} too low for more over-sampling; at bounds"
    if direction == -1 and obs.off_policy_ratio is not None and obs.off_policy_ratio > cfg.max_off_policy_ratio:
        return (
            "OffPolicyLimit",
            (
                f"truncation rate {r:.3f} below band {band}, but off-policy ratio {obs.off_policy_ratio:.3f} "
                f"is above {cfg.max_off_policy_ratio:g}"
            ),
        )
    if direction == -1 and cfg.entropy_floor is not None and obs.entropy is not None and obs.entropy < cfg.entropy_floor:
        return "LowEntropy", f"entropy {obs.entropy:.3f} below floor {cfg.entropy_floor:g}: not adding off-policy tokens"
    side = "above" if direction == 1 else "below"
    return "AtBounds", f"truncation rate {r:.3f} {side} band {band}, but every knob is at its bound"


def decide(
    obs: Observation,
    current: Knobs,
    cfg: ControllerConfig,
    state: TunerState,
    now: float,
    mode: Mode = "Apply",
    in_force: Knobs | None = None,
) -> TunerDecision:
    """One step of the control law.

    `current` are the knobs the tuner last decided (or the spec's); `in_force` the values the
    runtime reports it runs with, when known. In Apply mode a decision waits until the runtime runs
    with `current`, so the metrics always describe the knobs being judged. Recommend mode decides
    like Apply; the caller only publishes the result.
    """

    def hold(reason: str, message: str, new_state: TunerState = state) -> TunerDecision:
        return TunerDecision(knobs=current, changed=False, reason=reason, message=message, state=new_state)

    if mode == "Off":
        return hold("AutotuneOff", "autotune mode is Off", TunerState(state.last_change_time, state.last_change_step))
    if not 0.0 <= obs.truncation_rate <= 1.0 or math.isnan(obs.truncation_rate):
        return hold("InvalidMetrics", f"truncation rate {obs.truncation_rate!r} is not a share in [0, 1]")
    if mode == "Apply" and in_force is not None and not in_force.same_as(current):
        return hold("AwaitingRuntime", "the runtime has not applied the last knob values yet")

    direction = _error_direction(obs.truncation_rate, cfg, state)
    proposal = _propose(obs, current, cfg, direction)
    if proposal is None:
        reason, message = _hold_reason(obs, cfg, direction)
        return hold(reason, message, replace(state, direction=direction))

    if state.last_change_time is not None and now - state.last_change_time < cfg.cooldown_s:
        left = cfg.cooldown_s - (now - state.last_change_time)
        return hold("Cooldown", f"{proposal.message} after the cooldown ({left:.0f} s left)")
    if (
        cfg.settle_rounds
        and obs.steps is not None
        and state.last_change_step is not None
        and obs.steps - state.last_change_step < cfg.settle_rounds
    ):
        done = obs.steps - state.last_change_step
        return hold("Settling", f"{proposal.message} after {cfg.settle_rounds} rounds on the last knobs ({done} so far)")
    return TunerDecision(
        knobs=proposal.knobs,
        changed=True,
        reason=proposal.reason,
        message=proposal.message,
        state=TunerState(last_change_time=now, last_change_step=obs.steps, direction=direction),
    )
