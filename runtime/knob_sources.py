"""Where new knob values come from while a job runs: a file, the RLJob's status, or the runtime itself.

All three implement `KnobSource.poll()` (runtime/knobs.py), called by the runner between rounds.
A source never raises into the training loop: a bad file or an unreachable API server is logged
and the job keeps its current knobs.

- `FileKnobSource`: a JSON/YAML file re-read when it changes (`rljob run` overrides, manual tuning);
- `RLJobStatusKnobSource`: `status.effectiveKnobs` of the job's RLJob (the operator's autotuner in
  mode Apply, or the spec); `status.recommendedKnobs` (mode Recommend) is never applied;
- `LocalAutotuner`: the operator's control law run on the runner's own step records
  (`spec.autotune.local`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel
from rljob.api import knob_limits as limits
from rljob.api.spec import RLJobSpec
from rljob.api.status import EffectiveKnobs
from rljob.common.autotune.controller import (
    ControllerConfig,
    cap_at_floor,
    goodput_noise,
    mean_noise,
    Knobs,
    Observation,
    TunerState,
    decide,
    knobs_in_force,
)
from rljob.runtime.knobs import KnobSource, KnobValues
from rljob.runtime.step_record import StepRecord

log = logging.getLogger(__name__)


class KnobFile(BaseModel):
    """Contents of a knobs file: every field optional, camelCase or snake_case keys."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    over_sampling: float | None = Field(default=None, ge=limits.OVER_SAMPLING_MIN, le=limits.OVER_SAMPLING_MAX)
    truncation_k: float | None = Field(default=None, gt=limits.TRUNCATION_K_MIN_EXCLUSIVE, le=limits.TRUNCATION_K_MAX)
    truncation_max_tokens: int | None = Field(
        default=None, ge=limits.TRUNCATION_TOKENS_MIN, le=limits.TRUNCATION_TOKENS_MAX
    )
    reason: str = ""


class FileKnobSource:
    """Knob values from a JSON or YAML file, re-read whenever its modification time or size changes."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._seen: tuple[int, int] | None = None

    def poll(self) -> KnobValues | None:
        """New values when the file changed since the last poll; None otherwise or when it is invalid."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._seen:
            return None
        self._seen = stamp
        try:
            data = yaml.safe_load(self.path.read_text()) or {}
            knobs = KnobFile.model_validate(data)
        except (OSError, yaml.YAMLError, ValidationError) as err:
            log.error("knobs file %s ignored (fix it and save again): %s", self.path, err)
            return None
        return KnobValues(
            over_sampling=knobs.over_sampling,
            truncation_k=knobs.truncation_k,
            truncation_max_tokens=knobs.truncation_max_tokens,
            source=f"file {self.path}",
            reason=knobs.reason or "knobs file changed",
        )


StatusGetter = Callable[[str, str], "dict[str, Any] | None"]


def kubernetes_status_getter() -> StatusGetter:
    """Fetch an RLJob with the official client (in-cluster service account, else the kubeconfig)."""
    from rljob.common.kube import Kube, load_api_client

    kube = Kube(load_api_client())
    return kube.get_rljob


def values_from_effective_knobs(knobs: EffectiveKnobs, reason: str = "") -> KnobValues:
    """The KnobValues of status.effectiveKnobs (truncation in its unit: sigma → k, tokens → cap)."""
    over = knobs.over_sampling.value if knobs.over_sampling is not None else None
    k: float | None = None
    cap: int | None = None
    t = knobs.truncation
    if t is not None and t.unit == "sigma":
        k = t.value
    elif t is not None and t.unit == "tokens":
        cap = round(t.value)
    reasons = [v.reason for v in (knobs.over_sampling, t) if v is not None and v.reason]
    return KnobValues(
        over_sampling=over, truncation_k=k, truncation_max_tokens=cap, source="status.effectiveKnobs",
        reason=reason or "; ".join(dict.fromkeys(reasons)),
    )


class RLJobStatusKnobSource:
    """Applies `status.effectiveKnobs` of one RLJob; polls the API at most every `min_interval_s`.

    A failed read backs off exponentially (up to `max_backoff_s`) and the job keeps its knobs.
    """

    def __init__(
        self,
        namespace: str,
        name: str,
        getter: StatusGetter | None = None,
        min_interval_s: float = 5.0,
        max_backoff_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.namespace = namespace
        self.name = name
        self.min_interval_s = min_interval_s
        self.max_backoff_s = max_backoff_s
        self._getter = getter
        self._clock = clock
        self._next_poll = 0.0
        self._failures = 0
        self._last: dict[str, Any] | None = None

    @classmethod
    def from_env(cls) -> RLJobStatusKnobSource | None:
        """The source for the RLJob named by RLJOB_NAMESPACE/RLJOB_NAME (set in the operator's trainer pods)."""
        namespace, name = os.environ.get("RLJOB_NAMESPACE"), os.environ.get("RLJOB_NAME")
        if not namespace or not name:
            return None
        return cls(namespace, name)

    def poll(self) -> KnobValues | None:
        """The effective knobs when they changed since the last successful read; None otherwise."""
        now = self._clock()
        if now < self._next_poll:
            return None
        try:
            if self._getter is None:
                self._getter = kubernetes_status_getter()
            job = self._getter(self.namespace, self.name)
        except Exception as err:  # noqa: BLE001 (any API failure: keep training on the current knobs)
            self._failures += 1
            delay = min(self.max_backoff_s, self.min_interval_s * 2 ** min(self._failures, 10))
            self._next_poll = now + delay
            log.warning("cannot read RLJob %s/%s status (retry in %.0f s): %s", self.namespace, self.name, delay, err)
            return None
        self._failures = 0
        self._next_poll = now + self.min_interval_s
        if job is None:
            return None
        wire = (job.get("status") or {}).get("effectiveKnobs") or {}
        # Compare values only: the reason/time of an unchanged value must not re-trigger an apply.
        current = {k: (v or {}).get("value") for k, v in wire.items()} | {
            f"{k}.unit": (v or {}).get("unit") for k, v in wire.items()
        }
        if current == self._last or not any(v is not None for v in current.values()):
            return None
        self._last = current
        try:
            knobs = EffectiveKnobs.model_validate(wire)
        except ValidationError as err:
            log.error("RLJob %s/%s status.effectiveKnobs unreadable: %s", self.namespace, self.name, err)
            return None
        return values_from_effective_knobs(knobs)


@dataclass
class LocalAutotuner:
    """The autotuner's control law on the runner's own step records (`rljob run`, spec.autotune.local).

    The knobs judged are those of the newest record (whatever set them: this tuner, a knobs file or
    the RLJob status), and only records made with those knobs count, so a decision never judges
    knobs by rounds that ran with others. Mode Recommend logs the decision and applies nothing.
    """

    spec: RLJobSpec
    clock: Callable[[], float] = time.time
    _records: list[StepRecord] = field(default_factory=list)
    _state: TunerState = field(default_factory=TunerState)
    _last_decision: float | None = None

    def __post_init__(self) -> None:
        from rljob.common.autotune.tick import truncation_unit

        self.unit = truncation_unit(self.spec)
        self.config = ControllerConfig.from_spec(self.spec.autotune, self.spec.rollout.max_response_length)

    def observe(self, record: StepRecord) -> None:
        """Take one finished step into account (register as a runner step listener)."""
        self._records.append(record)
        # Only the newest window of records is ever read.
        del self._records[: -max(64, self.spec.autotune.settle_rounds + 1)]

    def observation(self, now: float) -> tuple[Observation, Knobs] | None:
        """Averages of the newest records made with the newest record's knobs, within the window, and those
        knobs. Only the unbroken run since the knobs last changed counts: a search that comes back to earlier
        values must not judge them by rounds run long ago, before the lengths drifted (as the operator's
        window starts at the last change)."""
        if not self._records:
            return None
        knobs = knobs_in_force(self._records[-1].knobs, self.unit)
        if knobs is None:
            return None
        same: list[StepRecord] = []
        for r in reversed(self._records):
            k = knobs_in_force(r.knobs, self.unit)
            if k is None or not k.same_as(knobs):
                break
            same.insert(0, r)
        window = [r for r in same if r.time >= now - self.spec.autotune.window_seconds] or same[-1:]
        n = len(window)
        seconds = sum(r.end_to_end_seconds for r in window)
        obs = Observation(
            truncation_rate=sum(r.round.truncation_rate for r in window) / n,
            truncation_noise=mean_noise([r.round.truncation_rate for r in window]),
            # Tokens over seconds of the whole window: one slow step weighs as its seconds, not as 1/n.
            goodput=sum(r.round.trained_tokens for r in window) / seconds if seconds > 0 else None,
            goodput_noise=goodput_noise([r.round.trained_tokens for r in window], [r.end_to_end_seconds for r in window]),
            partial_rate=sum(r.round.partial_rate for r in window) / n,
            aborted_token_share=sum(r.aborted_token_share for r in window) / n,
            length_mean=sum(r.batch.length_mean for r in window) / n,
            length_std=sum(r.batch.length_std for r in window) / n,
            off_policy_ratio=sum(r.batch.off_policy_token_ratio for r in window) / n,
            entropy=sum(r.train.entropy for r in window) / n,
            steps=self._records[-1].step,
            cap_at_floor=cap_at_floor(self._records[-1].knobs),
        )
        return obs, knobs

    def poll(self) -> KnobValues | None:
        """Run the law at most once per interval; values when it changed the knobs (mode Apply)."""
        a = self.spec.autotune
        now = self.clock()
        if a.mode == "Off" or (self._last_decision is not None and now - self._last_decision < a.interval_seconds):
            return None
        seen = self.observation(now)
        if seen is None:
            return None
        obs, knobs = seen
        self._last_decision = now
        decision = decide(obs, knobs, self.config, self._state, now, a.mode)
        self._state = decision.state
        if not decision.changed:
            log.debug("local autotune: %s (%s)", decision.reason, decision.message)
            return None
        if a.mode != "Apply":
            log.info("local autotune recommends (mode %s, not applied): %s", a.mode, decision.message)
            return None
        log.info("local autotune: %s", decision.message)
        t = decision.knobs
        return KnobValues(
            over_sampling=t.over_sampling,
            truncation_k=t.truncation if t.truncation_unit == "sigma" else None,
            truncation_max_tokens=int(t.truncation) if t.truncation_unit == "tokens" and t.truncation else None,
            source="local autotune",
            reason=decision.message,
        )


def knob_sources_for(spec: RLJobSpec, step_listeners: list[Callable[[StepRecord], None]]) -> list[KnobSource]:
    """The knob sources a job's spec and environment ask for; registers the local tuner as a step listener.

    Order matters (later sources win within one round boundary): the RLJob status, then the local
    tuner, then the knobs file, so a manual override always has the last word.
    """
    sources: list[KnobSource] = []
    from_status = RLJobStatusKnobSource.from_env()
    if from_status is not None:
        sources.append(from_status)
    if spec.autotune.local and spec.autotune.mode != "Off":
        tuner = LocalAutotuner(spec)
        step_listeners.append(tuner.observe)
        sources.append(tuner)
    if spec.autotune.knobs_file:
        sources.append(FileKnobSource(spec.autotune.knobs_file))
    return sources

