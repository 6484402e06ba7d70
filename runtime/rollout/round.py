"""The round's data: its settings, its live progress, its statistics (the ledger), its result, and the
state one running round keeps (RoundState)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from rljob.runtime.rollout.decisions import RoundCounts
from rljob.runtime.rollout.sample import Group
from rljob.runtime.rollout.workflow import Sampling


@dataclass
class RolloutConfig:
    """Per-round sampling settings (the knobs that may change between rounds live in Strategy
    and TruncationPolicy)."""

    batch_size: int
    samples_per_prompt: int
    max_response_length: int
    temperature: float = 1.0
    top_p: float = 1.0
    max_staleness: int = 2
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings
    drain_timeout_s: float = 30.0
    reabort_interval_s: float = 3.0
    # While no engine can generate, probe again with backoff from 0.5 s up to this: the SGLang client
    # re-probes workers outside the rotation at most every 8 s too, so a worker back is seen within it.
    engine_retry_max_s: float = 8.0
    engine_wait_timeout_s: float = 300.0  # then EngineWaitTimeout (rollout.engineWaitTimeoutSeconds)
    max_consecutive_rejections: int = 256  # then RewardCollapse (algorithm.maxConsecutiveRejections)
    # Strategies that keep partials: launch extra groups whenever an engine has a group's worth of free
    # batch slots (decisions.fill_launches), so the batch stays full to the end of the round.
    fill_engines: bool = False

    def sampling(self) -> Sampling:
        """The sampling settings every segment of the round uses."""
        return Sampling(temperature=self.temperature, top_p=self.top_p, stop_token_ids=list(self.stop_token_ids),
                        stop=list(self.stop))


@dataclass
class RoundProgress:
    """Live view of the running round, read by the CLI's progress display."""

    round_index: int = 0
    accepted: int = 0
    target: int = 0
    in_flight_groups: int = 0
    launched_groups: int = 0
    tokens: int = 0
    buffer_groups: int = 0
    phase: str = "idle"


@dataclass
class RoundStats:
    """What happened in one round (rollout side; trained-batch statistics are in batch_stats)."""

    round_index: int
    policy_version: int
    strategy: str
    rollout_seconds: float = 0.0  # collection: from the round's start until the batch was full
    # Generation while the trainer trained (Strategy.overlaps_training), until the weight sync interrupted it.
    overlap_seconds: float = 0.0
    overlap_tokens: int = 0  # of tokens_generated, those generated in that overlap
    tokens_generated: int = 0  # every generate call, aborted ones included
    launched_samples: int = 0  # distinct samples that got a generate call this round
    partial_samples: int = 0  # launched samples that ended the round unfinished (cut or still running)
    # Two different reasons a sample ends a round unfinished (docs/metrics.md): the length threshold
    # cut it (the segment cap, mean + k·σ), or it was still running when the round stopped upon
    # collection. The first is the truncation rate the band is about; the second, the partial rate,
    # grows with over-sampling. A sample cut by the cap counts as cut even if it was running at stop.
    cut_keys: set[tuple[str, int]] = field(default_factory=set, repr=False)
    unfinished_keys: set[tuple[str, int]] = field(default_factory=set, repr=False)  # unfinished at the end
    segment_cut_samples: int = 0  # partial because of the segment cap
    cap_hit_samples: int = 0  # finished with `length` at max_response_length
    resumed_samples: int = 0  # launched with a non-empty partial response
    regenerated_samples: int = 0  # ledger "regenerated": over the staleness bound, back to their prompt
    stale_at_acceptance_samples: int = 0  # of those, caught when their group was about to be accepted
    regenerated_tokens: int = 0  # their responses, thrown away, never trained
    resumed_prefix_tokens: int = 0  # re-prefilled partial tokens (hidden cost of resuming)
    fork_off_policy_tokens: int = 0  # APRIL-fork counter: previous-segment tokens of resumed samples
    filtered_groups: int = 0  # ledger "filtered": rejected by dynamic sampling (DAPO)
    filtered_tokens: int = 0  # the response tokens of those groups
    discarded_groups: int = 0  # ledger "discarded": unfinished or surplus at collection (keeps_partials False)
    discarded_tokens: int = 0  # their response tokens: generated, never trained
    trained_tokens: int = 0  # response tokens of the returned groups (any round's)
    surplus_groups: int = 0  # finished but not needed: buffered
    buffered_groups: int = 0  # pushed to the buffer at the end of the round
    buffer_groups_after: int = 0
    # Ledger (docs/architecture.md#the-round-ledger: one word per outcome, which its fields and the
    # exported metrics are named after): groups and response tokens that entered the round, and where they went.
    # buffer_groups_before + new_groups = trained + buffered + filtered + discarded;
    # buffer_tokens_before + tokens_generated = trained_tokens + buffer_tokens_after +
    # regenerated_tokens + filtered_tokens + discarded_tokens.
    new_groups: int = 0  # fresh prompts started this round
    buffer_groups_before: int = 0
    buffer_tokens_before: int = 0
    buffer_tokens_after: int = 0
    trained_groups: int = 0
    abort_drain_seconds: float = 0.0
    engine_errors: int = 0
    segment_cap: int | None = None
    over_sampling: float = 1.0

    @property
    def generating_seconds(self) -> float:
        """Seconds the engines had work this round: collection plus the overlap with training."""
        return self.rollout_seconds + self.overlap_seconds

    @property
    def tokens_per_second(self) -> float:
        """Every generated token (aborted, filtered and discarded ones included) per second of
        generation: APRIL's `tokens_throughput`, the paper's metric."""
        seconds = self.generating_seconds
        return self.tokens_generated / seconds if seconds > 0 else 0.0

    @property
    def trained_tokens_per_second(self) -> float:
        """Response tokens of the returned groups per second of generation: the honest metric, which
        counts no filtered, discarded or still-buffered work. A single round may return more
        tokens than it generated (resumed partials); summed over rounds it cannot."""
        seconds = self.generating_seconds
        return self.trained_tokens / seconds if seconds > 0 else 0.0

    @property
    def truncation_rate(self) -> float:
        """Share of launched samples the length threshold (segment cap) cut, even if the round then
        let the sample finish (see CONTINUE_CUT in decisions.py)."""
        return len(self.cut_keys) / self.launched_samples if self.launched_samples else 0.0

    @property
    def partial_rate(self) -> float:
        """Share of launched samples still unfinished when the round stopped upon collection, not
        counting those the threshold cut (they are in truncation_rate): the cost of over-sampling."""
        partial = self.unfinished_keys - self.cut_keys
        return len(partial) / self.launched_samples if self.launched_samples else 0.0

    @property
    def aborted_tokens(self) -> int:
        """Response tokens generated and then thrown away, never trained: over the staleness bound
        (regenerated), rejected by the filter (dynamic sampling), or dropped at collection by a
        strategy that keeps no partials."""
        return self.regenerated_tokens + self.filtered_tokens + self.discarded_tokens

    @property
    def fork_off_policy_ratio(self) -> float:
        """The APRIL fork's off-policy ratio, for comparison with the paper."""
        total = self.tokens_generated + self.fork_off_policy_tokens
        return self.fork_off_policy_tokens / total if total else 0.0


class RewardCollapse(RuntimeError):
    """The group filter rejected `max_consecutive_rejections` groups in a row: every group scores alike
    (a reward that is always 0, or always 1), so no batch can ever fill."""


@dataclass
class RoundResult:
    """Exactly `batch_size` accepted groups, in prompt order, and the round's statistics."""

    groups: list[Group]
    stats: RoundStats


@dataclass
class RoundState:
    """Everything one running round holds; the scheduler's methods share it instead of closures.

    Every group launched this round is in exactly one of `tasks` (in flight), `accepted`, `cut`
    (bound for the buffer) or `retry` (relaunched at once), or was filtered or discarded (counted
    in `stats`).
    """

    index: int  # the round's number
    policy_version: int
    stats: RoundStats
    target: int  # Strategy.launch_target
    segment_cap: int | None
    aborting: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: dict[asyncio.Task[bool], tuple[Group, int]] = field(default_factory=dict)  # -> (group, engine)
    # Finished group tasks arrive on a queue: waiting on it is O(1) per group, where asyncio.wait over
    # every task in flight would be O(in-flight) per wake-up.
    finished: asyncio.Queue[asyncio.Task[bool]] = field(default_factory=asyncio.Queue)
    accepted: list[Group] = field(default_factory=list)
    cut: list[Group] = field(default_factory=list)  # segment-cut, surplus and in-flight-at-abort groups
    retry: list[Group] = field(default_factory=list)  # engine failed, or over the bound at acceptance

    def counts(self, batch_size: int, buffered: int) -> RoundCounts:
        """The counts the launch decisions read (decisions.py)."""
        return RoundCounts(
            batch_size=batch_size, target=self.target, accepted=len(self.accepted), in_flight=len(self.tasks),
            cut=len(self.cut), retry=len(self.retry), buffered=buffered,
        )
