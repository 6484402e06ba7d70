"""RLJob status: written by the operator (lifecycle), the trainer (progress) and the autotuner (knobs).

Pydantic only, like spec.py, so the runtime's status reporter can build its apply body without kopf.
Every writer server-side applies the status subresource as its own field manager with only the fields
it owns, so writers never overwrite each other (`conditions` is a list-map keyed by `type`: each
manager owns its own condition types):
- operator (`rljob-operator`): phase, its conditions, observedGeneration, start/completion time,
  rollout, trainer.ready/desired/summary, restarts, outcome, effectiveKnobs entries whose source is `spec`;
- trainer (`rljob-trainer`): trainer.step, trainer.policyVersion, trainer.lastCheckpoint,
  trainer.lastReportTime, metrics;
- autotuner (`rljob-autotuner`): the AutotuneActive condition, autotune, recommendedKnobs,
  effectiveKnobs entries whose source is `autotune`.
- alert-action checker (`rljob-alerts`): the AlertAction condition and `alerts`.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, PlainSerializer

from rljob.api.spec import ApiModel, PoolVendor

Phase = Literal["Pending", "Starting", "Running", "Degraded", "Suspended", "Complete", "Failed"]
# Condition types the operator owns; other writers (the autotuner) own their own types.
CONDITION_TYPES: tuple[str, ...] = (
    "ChildrenApplied", "RolloutReady", "TrainerReady", "Ready", "Progressing", "Degraded", "Suspended", "Complete",
    "Failed", "NodeUnreachable", "PodsBlocked",
)

# The runtime's exit code when SIGTERM stopped it before the last step (EX_TEMPFAIL: retry later), and
# the prefix of the termination message it writes then: the operator restarts the trainer group
# without counting it against backoffLimit, and never reads it as success.
EXIT_INTERRUPTED = 75
INTERRUPTED_REASON = "Interrupted"
TERMINATION_MESSAGE_PATH = "/dev/termination-log"
# The prefix of the termination message when the dynamic-sampling filter rejected
# algorithm.maxConsecutiveRejections groups in a row: a restart would collapse again, so the operator
# fails the job at once (condition reason RewardCollapse) instead of spending backoffLimit on it.
EXIT_REWARD_COLLAPSE = 76
REWARD_COLLAPSE_REASON = "RewardCollapse"


def rfc3339(value: datetime) -> str:
    """metav1.Time text of a datetime."""
    return value.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# metav1.Time on the wire: RFC 3339, UTC, second precision.
Timestamp = Annotated[datetime, PlainSerializer(rfc3339, return_type=str, when_used="json")]


def utcnow() -> datetime:
    """Current time in UTC at second precision (Kubernetes metav1.Time precision)."""
    return datetime.now(timezone.utc).replace(microsecond=0)


class StatusModel(ApiModel):
    """Base of status models."""

    # Status is written by several parties and read back from the API server: tolerate keys
    # added by newer writers instead of failing the operator.
    model_config = ConfigDict(extra="ignore")


class Condition(StatusModel):
    """A metav1.Condition: lastTransitionTime changes only when status flips."""

    type: str = Field(min_length=1, max_length=316, pattern=r"^[A-Za-z][A-Za-z0-9]*$")
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(min_length=1, max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    message: str = Field(default="", max_length=32768)
    observed_generation: int = Field(default=0, ge=0)
    last_transition_time: Timestamp


class PoolStatus(StatusModel):
    """Replicas of one inference pool."""

    name: str
    vendor: PoolVendor
    desired: int = 0
    ready: int = 0


class RolloutStatus(StatusModel):
    """Inference side; `ready` and `selector` back the /scale subresource."""

    desired: int = 0
    ready: int = 0
    router_ready: bool = False
    selector: str = Field(default="", description="Label selector of the inference pods (/scale).")
    summary: str = Field(default="0/0", description="ready/desired, for printing.")
    pools: list[PoolStatus] = Field(default_factory=list, max_length=16)


class CheckpointRef(StatusModel):
    """The newest checkpoint the trainer wrote."""

    step: int = Field(ge=0)
    uri: str
    time: Timestamp | None = None


class TrainerStatus(StatusModel):
    """Trainer group: readiness (operator) and progress (runtime)."""

    desired: int = 0
    ready: int = 0
    summary: str = Field(default="0/0", description="ready/desired, for printing.")
    step: int | None = Field(default=None, ge=0)
    policy_version: int | None = Field(default=None, ge=0)
    last_checkpoint: CheckpointRef | None = None
    last_report_time: Timestamp | None = None


class RestartStatus(StatusModel):
    """Failure handling bookkeeping: what was counted, so a failure is never counted twice."""

    trainer: int = Field(default=0, ge=0, description="Trainer group restarts after failures (bounded by spec.backoffLimit).")
    interrupted: int = Field(
        default=0,
        ge=0,
        description="Trainer group restarts after disruptions (eviction, preemption, node shutdown, SIGTERM); "
        "not counted against spec.backoffLimit.",
    )
    rollout: int = Field(default=0, ge=0, description="Inference replicas lost and replaced.")
    last_trainer_restart_time: Timestamp | None = None
    trainer_start_not_before: Timestamp | None = Field(
        default=None,
        description="After an interruption: the new trainer group is not created before this time "
        "(spec.failurePolicy's capped exponential backoff).",
    )
    handled_failures: list[str] = Field(
        default_factory=list,
        # A bound for the schema only: keys are pruned to pods that still exist, far below it.
        max_length=1024,
        description="Keys `<role>/<pod uid>/<restart count>` of failures already acted on, kept while the pod "
        "can still be seen (trainer: pods of the current trainer Job; inference: pods that exist or were just lost).",
    )


class Outcome(StatusModel):
    """Terminal result of the job; once set it never changes."""

    result: Literal["Complete", "Failed"]
    reason: str = Field(min_length=1)
    message: str = ""
    time: Timestamp


class KnobValue(StatusModel):
    """Effective value of one partial-rollout knob and why it has that value."""

    value: float
    unit: str = Field(default="", description="ratio, sigma or tokens.")
    source: Literal["spec", "autotune"] = "spec"
    reason: str = ""
    query: str = Field(default="", description="PromQL the autotuner decided from.")
    time: Timestamp | None = None


class EffectiveKnobs(StatusModel):
    """Knob values the runtime applies at the next round boundary; the spec is never rewritten."""

    over_sampling: KnobValue | None = None
    truncation: KnobValue | None = Field(default=None, description="Absent when truncation is off.")


class AutotuneStatus(StatusModel):
    """The autotuner's own bookkeeping: what it last did and why (cooldown and backoff survive restarts)."""

    mode: Literal["Off", "Recommend", "Apply"] = "Off"
    last_decision_time: Timestamp | None = None
    last_decision: str = Field(default="", description="Reason of the last decision, changed or not.")
    last_change_time: Timestamp | None = None
    last_change_step: int | None = Field(default=None, ge=0, description="Runtime step counter at the last change.")
    direction: int = Field(default=0, ge=-1, le=1, description="Error being corrected: 1 above band, -1 below.")
    search: int = Field(
        default=0, ge=-1, le=1, description="Over-sampling search: direction of the move being judged (0: settled)."
    )
    goodput_ref: float | None = Field(
        default=None, ge=0, description="Goodput (tokens/s) before the move being judged, or at the settled point."
    )
    next_probe: int = Field(default=1, ge=-1, le=1, description="Direction of the next over-sampling probe.")
    settled_decisions: int = Field(default=0, ge=0, description="Decisions since the over-sampling search settled.")
    adjustments: int = Field(default=0, ge=0)
    consecutive_failures: int = Field(default=0, ge=0, description="Failed Prometheus reads in a row (backoff).")
    next_attempt_time: Timestamp | None = None


class AlertState(StatusModel):
    """One alert condition of spec.alertActions that held at the last check (cleared ones are dropped)."""

    alert: str
    since: Timestamp = Field(description="The first check at which the condition held (its episode's start).")
    value: float | None = Field(default=None, description="The alert expression's value at the last check.")
    checkpoint_before: CheckpointRef | None = Field(
        default=None, description="The job's newest checkpoint when the condition began (a rollback's target)."
    )
    action: str | None = Field(default=None, description="The action taken once the condition held forSeconds.")
    acted_time: Timestamp | None = None


class AlertsStatus(StatusModel):
    """The alert-action checker's bookkeeping (field manager rljob-alerts)."""

    last_check_time: Timestamp | None = None
    holding: list[AlertState] = Field(default_factory=list, max_length=16)

    def state(self, alert: str) -> AlertState | None:
        """The state of one alert, if its condition held at the last check."""
        return next((a for a in self.holding if a.alert == alert), None)


class JobMetrics(StatusModel):
    """Key runtime metrics reported by the trainer."""

    truncation_rate: float | None = Field(
        default=None, description="Share of launched samples cut by the length threshold (docs/metrics.md)."
    )
    partial_rate: float | None = Field(
        default=None, description="Share of launched samples still running when the round stopped upon collection."
    )
    goodput_tokens_per_second: float | None = Field(
        default=None, description="Response tokens that reached training per second of wall time, last step."
    )
    aborted_token_share: float | None = Field(
        default=None, description="Share of generated tokens thrown away (staleness, filter, discard), last step."
    )
    trainer_idle_seconds: float | None = Field(default=None, description="Seconds the trainer waited, last step.")
    engine_idle_seconds: float | None = Field(
        default=None, description="Seconds the engines waited for the trainer, last step."
    )
    entropy: float | None = None
    reward_mean: float | None = None
    kl: float | None = None
    off_policy_token_ratio: float | None = None
    max_staleness: int | None = None
    rollout_tokens_per_second: float | None = None
    response_length_mean: float | None = None
    data_rows_skipped: int | None = Field(
        default=None, ge=0, description="Data rows skipped so far: unreadable, unrenderable or too long for the context."
    )
    last_updated_time: Timestamp | None = None


class RLJobStatus(StatusModel):
    """The whole status subresource."""

    phase: Phase = "Pending"
    observed_generation: int = Field(default=0, ge=0)
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=16,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    start_time: Timestamp | None = None
    completion_time: Timestamp | None = None
    rollout: RolloutStatus = Field(default_factory=RolloutStatus)
    trainer: TrainerStatus = Field(default_factory=TrainerStatus)
    restarts: RestartStatus = Field(default_factory=RestartStatus)
    outcome: Outcome | None = None
    effective_knobs: EffectiveKnobs = Field(default_factory=EffectiveKnobs)
    recommended_knobs: EffectiveKnobs | None = Field(
        default=None, description="Autotune mode Recommend: values the autotuner would set; never applied."
    )
    autotune: AutotuneStatus | None = None
    alerts: AlertsStatus | None = None
    metrics: JobMetrics = Field(default_factory=JobMetrics)

    def condition(self, type_: str) -> Condition | None:
        """The condition of this type, if present."""
        return next((c for c in self.conditions if c.type == type_), None)

    def is_true(self, type_: str) -> bool:
        """Whether the condition of this type is present with status True."""
        c = self.condition(type_)
        return c is not None and c.status == "True"
