"""The record of one training step, as nested parts: the round, the trained batch, the train step, the sync.

Each part is built from what its stage measured (`RoundStats`, `BatchStats`, the trainer's metrics, the
`SyncReport`), taking every field whose name it shares with its source, so a statistic added to a stage
needs one line here, not a copy in a builder. The record is flattened only on export (`StepRecord.flat`):
metrics.jsonl, Prometheus and the report read the flat keys, which are part of the API (the alerts, the
dashboard and the autotuner use them). Field names are unique across parts, so flattening loses nothing.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, TypeVar

from rljob.runtime.batch_stats import BatchStats, summarize_batch

if TYPE_CHECKING:
    from rljob.runtime.rollout.scheduler import RoundResult, RoundStats
    from rljob.runtime.weights.transport import SyncReport

_Part = TypeVar("_Part")


def _taken(part: type[_Part], source: object, **computed: Any) -> _Part:
    """`part` filled from `source`'s attributes of the same name, except the `computed` ones."""
    values = {f.name: computed[f.name] if f.name in computed else getattr(source, f.name) for f in fields(part)}  # type: ignore[arg-type]
    return part(**values)


@dataclass
class RoundPart:
    """The rollout round: throughput, truncation, resumes and the round's ledger."""

    rollout_seconds: float = 0.0  # wall time of the round as the step loop saw it
    # Under async, the engines' generation while the trainer trained, until the sync interrupted it.
    overlap_seconds: float = 0.0
    overlap_tokens: int = 0
    tokens_generated: int = 0
    rollout_tokens_per_s: float = 0.0
    ceiling_tokens_per_s: float = 0.0
    truncation_rate: float = 0.0  # cut by the length threshold / launched (docs/metrics.md)
    partial_rate: float = 0.0  # still running at stop-upon-collection, not cut / launched
    cap_hit_rate: float = 0.0
    launched_samples: int = 0
    partial_samples: int = 0
    resumed_samples: int = 0
    regenerated_samples: int = 0
    resumed_prefix_tokens: int = 0
    fork_off_policy_ratio: float = 0.0
    buffer_groups: int = 0
    surplus_groups: int = 0
    filtered_groups: int = 0
    filtered_tokens: int = 0
    abort_drain_seconds: float = 0.0
    engine_errors: int = 0
    # Ledger (see metrics.ledger_imbalance): where the round's groups and response tokens went.
    new_groups: int = 0
    buffer_groups_before: int = 0
    trained_groups: int = 0
    buffered_groups: int = 0  # pushed to the buffer this round
    discarded_groups: int = 0  # baseline strategies without partial rollout
    regenerated_tokens: int = 0
    discarded_tokens: int = 0
    aborted_tokens: int = 0  # the three above: generated, then thrown away
    trained_tokens: int = 0
    buffer_tokens_before: int = 0
    buffer_tokens_after: int = 0

    @classmethod
    def of(cls, stats: RoundStats, rollout_seconds: float, ceiling_tokens_per_s: float) -> RoundPart:
        """The part of a round's statistics that a step exports."""
        launched = stats.launched_samples
        return _taken(
            cls,
            stats,
            rollout_seconds=rollout_seconds,
            rollout_tokens_per_s=stats.tokens_per_second,
            ceiling_tokens_per_s=ceiling_tokens_per_s,
            cap_hit_rate=stats.cap_hit_samples / launched if launched else 0.0,
            buffer_groups=stats.buffer_groups_after,
        )


@dataclass
class BatchPart:
    """The trained batch: off-policy share, staleness, lengths and reward."""

    off_policy_token_ratio: float = 0.0
    staleness_max: int = 0
    staleness_mean: float = 0.0
    length_mean: float = 0.0
    length_std: float = 0.0
    length_p50: float = 0.0
    length_p99: float = 0.0
    length_max: int = 0
    reward_mean: float = 0.0
    staleness: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, stats: BatchStats) -> BatchPart:
        """The part of the batch statistics that a step exports."""
        return _taken(cls, stats)


@dataclass
class TrainPart:
    """The optimizer step."""

    train_seconds: float = 0.0
    entropy: float = 0.0
    kl: float = 0.0
    clip_fraction: float = 0.0
    loss: float = 0.0
    grad_norm: float = 0.0

    @classmethod
    def of(cls, metrics: Any, train_seconds: float) -> TrainPart:
        """From the trainer's metrics (None or missing values: 0, as on a rank that trained nothing)."""

        def value(name: str) -> float:
            return float(getattr(metrics, name, 0.0) or 0.0)

        return cls(train_seconds=train_seconds, entropy=value("entropy"), kl=value("kl"),
                   clip_fraction=value("clip_frac"), loss=value("loss"), grad_norm=value("grad_norm"))


@dataclass
class SyncPart:
    """The weight sync after the step."""

    sync_seconds: float = 0.0
    weight_sync_failures: int = 0  # engine ranks the step's weight sync did not reach
    engines_in_rotation: int = 0  # engine ranks serving policy_version after the sync
    # The weights' bytes the sync moved to the engines, once however many engines took them (one broadcast
    # reaches every member; the disk transport writes one snapshot): over sync_seconds, the sync's bandwidth.
    sync_bytes: int = 0

    @classmethod
    def of(cls, report: SyncReport | None, sync_seconds: float) -> SyncPart:
        """From the sync's report (None: no sync ran)."""
        if report is None:
            return cls(sync_seconds=sync_seconds)
        return cls(sync_seconds, weight_sync_failures=len(report.failed), engines_in_rotation=len(report.updated),
                   sync_bytes=report.bytes_sent)


@dataclass
class StepRecord:
    """Everything measured in one step (rollout round + train + weight sync)."""

    step: int
    policy_version: int
    strategy: str
    time: float
    round: RoundPart = field(default_factory=RoundPart)
    batch: BatchPart = field(default_factory=BatchPart)
    train: TrainPart = field(default_factory=TrainPart)
    sync: SyncPart = field(default_factory=SyncPart)
    knobs: dict[str, float] = field(default_factory=dict)
    eval_reward: float | None = None  # held-out evaluation after this step, when one ran
    # Data rows skipped since the job began (resumes included), by reason (tasks.dataset.SKIP_REASONS).
    data_rows_skipped: dict[str, int] = field(default_factory=dict)
    # Wall time since the previous step ended (evaluation, checkpoint and knob polling included);
    # 0: not measured, the phases' sum stands in.
    wall_seconds: float = 0.0

    @property
    def step_seconds(self) -> float:
        """The step's wall time: its round, train step and sync."""
        return self.round.rollout_seconds + self.train.train_seconds + self.sync.sync_seconds

    @property
    def end_to_end_seconds(self) -> float:
        """The step's share of the job's wall time: wall_seconds when measured, else step_seconds."""
        return max(self.wall_seconds, self.step_seconds)

    @property
    def goodput_tokens_per_s(self) -> float:
        """Response tokens that reached training per second of the step's end-to-end wall time."""
        wall = self.end_to_end_seconds
        return self.round.trained_tokens / wall if wall > 0 else 0.0

    @property
    def aborted_token_share(self) -> float:
        """Share of the step's generated tokens that were thrown away (RoundPart.aborted_tokens)."""
        generated = self.round.tokens_generated
        return min(1.0, self.round.aborted_tokens / generated) if generated else 0.0

    @property
    def trainer_idle_seconds(self) -> float:
        """Seconds of the step the trainer waited: all but its train step and the weight sync (in
        this loop the trainer waits for the whole rollout round)."""
        return max(0.0, self.end_to_end_seconds - self.train.train_seconds - self.sync.sync_seconds)

    @property
    def engine_idle_seconds(self) -> float:
        """Seconds of the step the engines waited for the trainer: all but the round, the async
        strategy's overlap with the train step (the engines generate then) and the sync (slots idle
        inside a round or the overlap, the tail bubble, show in the ceiling share instead)."""
        busy = self.round.rollout_seconds + self.round.overlap_seconds + self.sync.sync_seconds
        return max(0.0, self.end_to_end_seconds - busy)

    def flat(self) -> dict[str, Any]:
        """The exported form: one flat mapping of every field of every part (metrics.jsonl's keys)."""
        top = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _PARTS}
        parts = [asdict(getattr(self, name)) for name in _PARTS]
        derived = {name: getattr(self, name) for name in _DERIVED}
        return {**top, **derived, **{k: v for part in parts for k, v in part.items()}}

    def to_json(self) -> str:
        """One line of metrics.jsonl."""
        return json.dumps(self.flat(), sort_keys=True)


_PARTS = ("round", "batch", "train", "sync")
_DERIVED = ("step_seconds", "end_to_end_seconds", "goodput_tokens_per_s", "aborted_token_share", "trainer_idle_seconds", "engine_idle_seconds")


def step_record(
    step: int,
    trained_version: int,
    result: RoundResult,
    train_metrics: Any,
    timings: dict[str, float],
    knobs: dict[str, float],
    ceiling: float,
    sync: SyncReport | None,
) -> StepRecord:
    """The record of step `step`, which trained `result`'s groups on `trained_version` and published the
    next version; `timings` holds the seconds of its phases ("rollout", "train", "sync") and, when
    measured, "wall": the time since the previous step ended."""
    return StepRecord(
        step=step,
        policy_version=trained_version + 1,
        strategy=result.stats.strategy,
        time=time.time(),
        round=RoundPart.of(result.stats, timings.get("rollout", 0.0), ceiling),
        batch=BatchPart.of(summarize_batch(result.groups, trained_version)),
        train=TrainPart.of(train_metrics, timings.get("train", 0.0)),
        sync=SyncPart.of(sync, timings.get("sync", 0.0)),
        knobs=knobs,
        wall_seconds=timings.get("wall", 0.0),
    )
