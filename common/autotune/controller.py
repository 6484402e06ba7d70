"""The autotuner's control law: observed signals (docs/metrics.md) → new knob values, pure.

Both the operator's timer (metrics from Prometheus) and `rljob run`'s LocalAutotuner (metrics from
its own step records) call `decide`, so one law runs everywhere. The law is in docs/autotune.md; in short,
two loops, one knob each, at most one change per decision:

- the truncation threshold (k or the token cap) keeps the truncation rate r (share of launched samples
  the threshold cut) inside a band [low, high]: the plant is monotone (a higher threshold cuts fewer);
  a change starts once r is outside the band by a margin, the hysteresis or, when larger, two standard
  errors of the window's mean rate (`truncation_margin`), and continues in that direction until r is
  back (within one standard error). A reversal (an overshoot) needs the margin again, so a noisy rate
  does not ping-pong the threshold;
- over-sampling climbs goodput (trained tokens per wall second): a bounded search that moves one step,
  lets the job settle, keeps going while goodput rises by more than a margin, steps back when it falls
  by more, and treats a smaller difference as a tie, which keeps the higher over-sampling (a raise that
  cost nothing measurable goes on; a cut that gained nothing measurable goes back); it probes again
  after a while or when goodput drops. The margin is the tolerance or, when larger, twice the standard
  error of a difference of two window goodputs (`goodput_margin`), so step-to-step noise never reads as
  a gradient. It is bounded by the off-policy share, the entropy
  floor and the staleness budget (the share of generated tokens thrown away), which lower it when crossed;
- every change is bounded (maxStep, clamped to [min, max]) and separated by a cooldown and a number
  of settled rounds, and the truncation loop goes first (its band is the health constraint).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
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


def cap_at_floor(values: Mapping[str, float]) -> bool | None:
    """Whether the runtime's segment cap in force (`rljob_knob` values) sits at its floor,
    maxResponseLength / (maxStaleness + 1): then a lower threshold cuts nothing more. None: not reported."""
    cap, floor = values.get("segment_cap_tokens"), values.get("segment_cap_floor_tokens")
    if cap is None or floor is None or cap <= 0:
        return None
    return cap <= floor


@dataclass(frozen=True)
class Observation:
    """Recent runtime metrics, averaged over the decision window. Only truncation_rate is required."""

    truncation_rate: float  # cut by the length threshold / launched
    truncation_noise: float | None = None  # standard error of `truncation_rate`'s window mean (mean_noise)
    goodput: float | None = None  # trained response tokens per second of wall time
    goodput_noise: float | None = None  # relative standard error of `goodput` over the window (goodput_noise)
    partial_rate: float | None = None  # still running at stop / launched (shown, not controlled)
    aborted_token_share: float | None = None  # generated, then thrown away (stale, filtered, discarded)
    length_mean: float | None = None
    length_std: float | None = None
    off_policy_ratio: float | None = None
    entropy: float | None = None
    steps: int | None = None  # runtime step counter (settle rounds)
    cap_at_floor: bool | None = None  # the segment cap sits at its floor (cap_at_floor)

    @property
    def length_spread(self) -> float | None:
        """Coefficient of variation σ/μ of response lengths, when known."""
        if self.length_mean is None or self.length_std is None or self.length_mean <= 0:
            return None
        return self.length_std / self.length_mean


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
    max_aborted_token_share: float = 0.3  # the staleness budget: above it, less over-sampling
    goodput_tolerance: float = 0.05  # relative goodput change that counts as a difference
    reprobe_decisions: int = 10  # settled decisions before over-sampling is probed again
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
            max_aborted_token_share=spec.max_aborted_token_share,
            goodput_tolerance=spec.goodput_tolerance,
            entropy_floor=spec.entropy_floor,
        )

    def truncation_bounds(self, unit: TruncationUnit) -> Bounds:
        return self.truncation_k if unit == "sigma" else self.truncation_tokens


@dataclass(frozen=True)
class TunerState:
    """What the law remembers between decisions."""

    last_change_time: float | None = None
    last_change_step: int | None = None
    direction: int = 0  # truncation loop: +1 correcting a rate above the band, -1 below, 0 idle
    # Over-sampling search: the direction of the move being judged (0: none, settled), the goodput
    # measured before that move (or at the settled point), the direction of the next probe, and the
    # decisions held since the search settled.
    search: int = 0
    goodput_ref: float | None = None
    next_probe: int = 1
    settled_decisions: int = 0


@dataclass(frozen=True)
class TunerDecision:
    """Outcome of one decision. `knobs` equals the current knobs when `changed` is False."""

    knobs: Knobs
    changed: bool
    reason: str  # CamelCase, usable as a Condition/Event reason
    message: str
    state: TunerState


@dataclass(frozen=True)
class _Step:
    """What one loop wants: new knobs (None: hold), why, and the state after it."""

    knobs: Knobs | None
    reason: str
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


def mean_noise(values: Sequence[float]) -> float | None:
    """Standard error of the mean of per-round values (sample standard deviation / √n); None below 2 values.

    One 16-sample round's truncation rate jumps between 0.0 and 0.8, so a window of a few rounds measures
    the rate to ±0.07 or worse, wider than a 15-25 % band's half-width: this says how much.
    """
    if len(values) < 2:
        return None
    return statistics.stdev(values) / math.sqrt(len(values))


def _rate_noise(obs: Observation) -> float:
    noise = obs.truncation_noise
    return noise if noise is not None and math.isfinite(noise) else 0.0


def truncation_margin(cfg: ControllerConfig, noise: float | None) -> float:
    """How far outside the band the window's mean rate must be to start a correction: the hysteresis or,
    when larger, two standard errors of that mean, so a window's noise alone seldom moves the threshold
    (a rate exactly on the band's edge crosses it by chance one window in forty)."""
    if noise is None or not math.isfinite(noise):
        return cfg.hysteresis
    return max(cfg.hysteresis, 2.0 * noise)


def _error_direction(obs: Observation, cfg: ControllerConfig, state: TunerState) -> int:
    """+1 above the band, -1 below, 0 inside or within the margin. Starting a correction, or reversing one
    that overshot, needs the margin; the correction under way goes on until the rate is back within one
    standard error of the band (within the band itself when the noise is not known)."""
    start, go_on = truncation_margin(cfg, obs.truncation_noise), _rate_noise(obs)
    rate = obs.truncation_rate
    if rate > cfg.band_high + (go_on if state.direction == 1 else start):
        return 1
    if rate < cfg.band_low - (go_on if state.direction == -1 else start):
        return -1
    return 0


def _truncation_step(obs: Observation, current: Knobs, cfg: ControllerConfig, state: TunerState) -> _Step | None:
    """The truncation loop: a threshold change when the rate is outside the band; None when the rate
    is in the band (or within the margin), truncation is off, or the threshold is at its bound."""
    unit, trunc = current.truncation_unit, current.truncation
    if unit is None or trunc is None:
        return None
    r = obs.truncation_rate
    direction = _error_direction(obs, cfg, state)
    if direction == 0:
        return None
    tb = cfg.truncation_bounds(unit)
    # Above the band the threshold cuts too many samples: raise it. Below: lower it, unless the cap
    # already sits at its floor, where a lower threshold cuts nothing more.
    if direction == 1:
        at_bound = trunc >= tb.max - KNOB_TOLERANCE
    else:
        at_bound = trunc <= tb.min + KNOB_TOLERANCE or obs.cap_at_floor is True
    if at_bound:
        return None
    edge = cfg.band_high if direction == 1 else cfg.band_low
    new = _moved(trunc, direction, _step_fraction(r, edge, cfg), tb, integer=unit == "tokens")
    side = "above" if direction == 1 else "below"
    # A new threshold changes goodput too: the over-sampling search starts again from a fresh reference.
    return _Step(
        replace(current, truncation=new),
        f"Truncation{side.title()}Band",
        f"truncation rate {r:.3f} {side} band [{cfg.band_low:g}, {cfg.band_high:g}]: "
        f"truncation threshold {trunc:g} -> {new:g} {unit}",
        replace(state, direction=direction, search=0, goodput_ref=None, settled_decisions=0),
    )


def _truncation_summary(obs: Observation, current: Knobs, cfg: ControllerConfig) -> str:
    """Where the truncation loop stands when it wants no change, in words (prefix of the decision's message)."""
    r = obs.truncation_rate
    band = f"[{cfg.band_low:g}, {cfg.band_high:g}]"
    if current.truncation_unit is None or current.truncation is None:
        return f"truncation off (rate {r:.3f})"
    if cfg.band_low <= r <= cfg.band_high:
        return f"truncation rate {r:.3f} inside band {band}"
    side = "above" if r > cfg.band_high else "below"
    if side == "below" and obs.cap_at_floor:
        return (f"truncation rate {r:.3f} below band {band}, segment cap at its floor "
                "(maxResponseLength / (maxStaleness + 1)): a lower threshold cuts nothing more")
    tb = cfg.truncation_bounds(current.truncation_unit)
    at = tb.max if side == "above" else tb.min
    if abs(current.truncation - at) <= KNOB_TOLERANCE:
        return f"truncation rate {r:.3f} {side} band {band}, threshold at its bound {at:g}"
    margin = truncation_margin(cfg, obs.truncation_noise)
    why = " (two standard errors of the window's mean)" if margin > cfg.hysteresis else ""
    return f"truncation rate {r:.3f} {side} band {band} by less than {margin:.3g}{why}"


def goodput_noise(tokens: Sequence[float], seconds: Sequence[float]) -> float | None:
    """Relative standard error of a window's goodput Σtokens / Σseconds, from its steps' figures.

    The ratio estimator's linearised variance: with R = Σt/Σs over n steps and residuals e = t - R·s,
    Var(R) ≈ Σe² / ((n - 1)·n·s̄²). Steps differ a lot on a long-tailed task (one round several times
    another), so a window of a few steps measures goodput to ±20 % or worse: this says how much.
    None with fewer than 2 steps or no time.
    """
    n = len(tokens)
    total_t, total_s = sum(tokens), sum(seconds)
    if n < 2 or total_s <= 0 or total_t <= 0:
        return None
    ratio, mean_s = total_t / total_s, total_s / n
    residual = sum((t - ratio * s) ** 2 for t, s in zip(tokens, seconds, strict=True))
    return math.sqrt(residual / ((n - 1) * n)) / mean_s / ratio


def goodput_margin(cfg: ControllerConfig, noise: float | None) -> float:
    """The relative goodput difference that counts as real: the tolerance or, if larger, twice the standard
    error of the difference of two window goodputs, each as noisy as the current one (√2 · `noise`)."""
    if noise is None or not math.isfinite(noise):
        return cfg.goodput_tolerance
    return max(cfg.goodput_tolerance, 2.0 * math.sqrt(2.0) * noise)


def _over_sampling_limit(obs: Observation, cfg: ControllerConfig) -> tuple[str, str] | None:
    """The safety bound over-sampling crosses now (reason, message), if any."""
    spread = obs.length_spread
    if spread is not None and spread < cfg.min_length_spread:
        return "LowLengthSpread", f"length spread σ/μ {spread:.3f} below {cfg.min_length_spread:g}: over-sampling buys nothing"
    if obs.off_policy_ratio is not None and obs.off_policy_ratio > cfg.max_off_policy_ratio:
        return "OffPolicyLimit", f"off-policy ratio {obs.off_policy_ratio:.3f} above {cfg.max_off_policy_ratio:g}"
    if cfg.entropy_floor is not None and obs.entropy is not None and obs.entropy < cfg.entropy_floor:
        return "LowEntropy", f"entropy {obs.entropy:.3f} below floor {cfg.entropy_floor:g}"
    if obs.aborted_token_share is not None and obs.aborted_token_share > cfg.max_aborted_token_share:
        return (
            "StalenessBudget",
            f"{obs.aborted_token_share:.3f} of generated tokens thrown away (above {cfg.max_aborted_token_share:g})",
        )
    return None


def _over_sampling_step(obs: Observation, current: Knobs, cfg: ControllerConfig, state: TunerState) -> _Step:
    """The over-sampling loop: bounded by the safety limits, else one step of the goodput search."""
    b = cfg.over_sampling
    os_now = current.over_sampling

    def move(direction: int, reason: str, message: str, new_state: TunerState) -> _Step:
        new = _moved(os_now, direction, 1.0, b, integer=False)
        return _Step(replace(current, over_sampling=new), reason, f"{message}: over-sampling {os_now:g} -> {new:g}",
                     new_state)

    def hold(reason: str, message: str, new_state: TunerState = state) -> _Step:
        return _Step(None, reason, message, new_state)

    can_raise = os_now < b.max - KNOB_TOLERANCE
    can_lower = os_now > b.min + KNOB_TOLERANCE
    limit = _over_sampling_limit(obs, cfg)
    if limit is not None:
        reason, message = limit
        reset = replace(state, search=0, goodput_ref=None, next_probe=-1, settled_decisions=0)
        return move(-1, reason, message, reset) if can_lower else hold(reason, f"{message}; over-sampling at its minimum")
    g = obs.goodput
    if g is None or math.isnan(g) or g <= 0:  # 0: no step trained anything in the window
        return hold("NoGoodput", f"goodput {g!r} not measured: over-sampling {os_now:g} kept")
    margin = goodput_margin(cfg, obs.goodput_noise)
    noise = f" (margin {margin:.0%})" if margin > cfg.goodput_tolerance else ""

    def probe(why: str) -> _Step:
        for direction in (state.next_probe, -state.next_probe):
            if (direction == 1 and can_raise) or (direction == -1 and can_lower):
                return move(direction, "GoodputProbe", f"{why}, goodput {g:.1f} tokens/s; probing",
                            replace(state, search=direction, goodput_ref=g, settled_decisions=0))
        return hold("AtBounds", f"over-sampling {os_now:g} cannot move within [{b.min:g}, {b.max:g}]")

    if state.search == 0:
        ref = state.goodput_ref
        if ref is None:
            return probe("no goodput reference")
        if g < ref * (1 - 2 * margin):
            return probe(f"goodput fell from {ref:.1f}{noise}")
        if state.settled_decisions + 1 >= cfg.reprobe_decisions:
            return probe(f"{cfg.reprobe_decisions} decisions since the search settled")
        return hold("GoodputSettled", f"goodput {g:.1f} tokens/s at over-sampling {os_now:g} (searched)",
                    replace(state, settled_decisions=state.settled_decisions + 1))

    ref = state.goodput_ref if state.goodput_ref is not None else 0.0
    gain = (g - ref) / ref if ref > 0 else (math.inf if g > 0 else 0.0)
    d = state.search
    change = f"goodput {ref:.1f} -> {g:.1f} tokens/s ({gain:+.1%}){noise}"
    settle = replace(state, search=0, next_probe=-d, settled_decisions=0)
    if gain > margin:
        if (d == 1 and can_raise) or (d == -1 and can_lower):
            return move(d, "GoodputRising", change, replace(state, goodput_ref=g))
        return hold("GoodputAtBound", f"{change}, over-sampling at its bound", replace(settle, goodput_ref=g))
    if gain < -margin:
        # Worse: go back to where goodput was higher; the next probe tries the other way.
        return move(-d, "GoodputFalling", change, replace(settle, goodput_ref=ref))
    # A tie keeps the higher over-sampling: a fuller pool of groups is what hides the long tail when
    # lengths drift, and the safety bounds above (off-policy share, staleness budget, entropy) cap its
    # cost. The reference keeps the higher figure, so a run of ties cannot ratchet it down on noise.
    best = max(ref, g)
    if d == 1 and can_raise:
        return move(1, "GoodputFlat", f"{change}: more over-sampling costs nothing measurable, going on",
                    replace(state, goodput_ref=best))
    if d == 1:
        return hold("GoodputFlat", f"{change}, over-sampling at its bound", replace(settle, goodput_ref=best))
    return move(1, "GoodputFlat", f"{change}: less over-sampling gains nothing measurable, back",
                replace(state, search=0, goodput_ref=best, next_probe=1, settled_decisions=0))


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
    like Apply; the caller only publishes the result. No decision judges the knobs of the last change
    before the cooldown and the settle rounds have passed.
    """

    def hold(reason: str, message: str, new_state: TunerState = state) -> TunerDecision:
        return TunerDecision(knobs=current, changed=False, reason=reason, message=message, state=new_state)

    if mode == "Off":
        return hold("AutotuneOff", "autotune mode is Off", TunerState(state.last_change_time, state.last_change_step))
    if not 0.0 <= obs.truncation_rate <= 1.0 or math.isnan(obs.truncation_rate):
        return hold("InvalidMetrics", f"truncation rate {obs.truncation_rate!r} is not a share in [0, 1]")
    if mode == "Apply" and in_force is not None and not in_force.same_as(current):
        return hold("AwaitingRuntime", "the runtime has not applied the last knob values yet")

    if state.direction != 0 and _error_direction(obs, cfg, state) != state.direction:
        state = replace(state, direction=0)  # back inside the band or past it: the margin applies again
    step = _truncation_step(obs, current, cfg, state)
    if step is None:
        over = _over_sampling_step(obs, current, cfg, state)
        step = replace(over, message=f"{_truncation_summary(obs, current, cfg)}; {over.message}")
    judged = step.knobs is not None or state.search != 0  # a change, or a verdict on the last change
    if judged and state.last_change_time is not None and now - state.last_change_time < cfg.cooldown_s:
        left = cfg.cooldown_s - (now - state.last_change_time)
        return hold("Cooldown", f"{step.message} after the cooldown ({left:.0f} s left)")
    if (
        judged
        and cfg.settle_rounds
        and obs.steps is not None
        and state.last_change_step is not None
        and obs.steps - state.last_change_step < cfg.settle_rounds
    ):
        done = obs.steps - state.last_change_step
        return hold("Settling", f"{step.message} after {cfg.settle_rounds} rounds on the last knobs ({done} so far)")
    if step.knobs is None or step.knobs.same_as(current):
        return hold(step.reason, step.message, step.state)
    return TunerDecision(
        knobs=step.knobs,
        changed=True,
        reason=step.reason,
        message=step.message,
        state=replace(step.state, last_change_time=now, last_change_step=obs.steps),
    )
