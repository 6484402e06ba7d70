"""A simulated run's records: one `SimStepRecord` per trained step and a strategy's `SimStrategyResult`,
with the derived figures the report prints. Shared by every loop shape (sim/runner.py's rounds and
tail batching, sim/async_stream.py's stream)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SimStepRecord:
    """One training step of a simulated run (tokens are real tokens, not quanta)."""

    step: int
    round_kind: str
    rollout_s: float  # seconds the engines had work: collection, plus the overlap with training (async)
    train_s: float
    sync_s: float
    step_s: float
    tokens_generated: int
    trained_tokens: int
    off_policy_tokens: int
    fork_off_policy_ratio: float
    resumed_prefix_tokens: int
    wasted_tokens: int  # filtered, discarded at collection, restarted or regenerated
    buffered_groups: int
    draft_tokens: int = 0  # accepted draft tokens (verified, not generated): not in tokens_generated
    discarded_tokens: int = 0  # running or surplus at collection, dropped (strategies without partials)
    dropped_groups: int = 0  # rejected by the DAPO filter
    trained_groups: int = 0
    distinct_prompts: int = 0  # prompts behind the trained groups (large-N splits one prompt)
    tail_share: float = 0.0  # share of the round's time after 90 % of its finished requests were done
    longest_over_median: float = 0.0  # longest ÷ median length of the requests finished in the round
    max_staleness: int = 0  # largest version gap of a trained sample
    buffer_tokens: int = 0  # response tokens in the partial buffer after the step (the round's ledger)
    overlap_tokens: int = 0  # of tokens_generated, those generated while the trainer trained (async)
    multi_version_samples: int = 0  # trained samples whose tokens come from more than one policy version

    @property
    def tokens_per_s(self) -> float:
        """This round's APRIL-fork `tokens_throughput`: generated tokens ÷ rollout time."""
        return self.tokens_generated / self.rollout_s if self.rollout_s else 0.0


@dataclass
class SimStrategyResult:
    """A strategy's run on a scenario, with the figures the report prints."""

    name: str
    kind: str
    engines: int
    gpus: int
    rollout_gpus: int
    ceiling_tokens_per_s: float  # bubble-free ceiling of the rollout engines
    records: list[SimStepRecord]
    warmup: int
    busy_seconds: float = 0.0
    retractions: int = 0
    prefill_tokens: int = 0
    draft_tokens: int = 0
    overlapped: bool = False  # rollout runs during training (async): time is wall time
    resumed_requests: int = 0  # async stream: interrupted by weight updates, resumed at once

    @property
    def measured(self) -> list[SimStepRecord]:
        return self.records[self.warmup:]

    def _sum(self, attr: str) -> float:
        return float(sum(getattr(r, attr) for r in self.measured))

    @property
    def rollout_seconds(self) -> float:
        return self._sum("step_s") if self.overlapped else self._sum("rollout_s")

    @property
    def rollout_throughput(self) -> float:
        """Rollout tokens per second (APRIL's metric: every generated token, aborted, filtered and
        discarded calls included; accepted draft tokens excluded), as a ratio of sums."""
        return self._sum("tokens_generated") / self.rollout_seconds if self.rollout_seconds else 0.0

    @property
    def mean_round_throughput(self) -> float:
        """Mean of the per-round `tokens_throughput` the APRIL fork logs (the pre-registered metric)."""
        if self.overlapped or not self.measured:
            return self.rollout_throughput
        return sum(r.tokens_per_s for r in self.measured) / len(self.measured)

    @property
    def trained_rollout_throughput(self) -> float:
        """Trained response tokens per second of rollout: the honest rollout metric."""
        return self._sum("trained_tokens") / self.rollout_seconds if self.rollout_seconds else 0.0

    @property
    def tail_share(self) -> float:
        """Mean share of round time spent on the last 10 % of requests (sync's tail)."""
        return self._sum("tail_share") / len(self.measured) if self.measured else 0.0

    @property
    def longest_over_median(self) -> float:
        return self._sum("longest_over_median") / len(self.measured) if self.measured else 0.0

    @property
    def ceiling_share(self) -> float:
        return self.rollout_throughput / self.ceiling_tokens_per_s if self.ceiling_tokens_per_s else 0.0

    @property
    def bubble_share(self) -> float:
        """Share of the bubble-free ceiling's token rate not achieved during rollout."""
        return max(0.0, 1.0 - self.ceiling_share)

    @property
    def off_policy_share(self) -> float:
        trained = self._sum("trained_tokens")
        return self._sum("off_policy_tokens") / trained if trained else 0.0

    @property
    def step_seconds(self) -> float:
        return self._sum("step_s") / len(self.measured) if self.measured else 0.0

    @property
    def trained_throughput(self) -> float:
        """Trained response tokens per wall-clock second (end to end)."""
        total = self._sum("step_s")
        return self._sum("trained_tokens") / total if total else 0.0

    @property
    def wasted_share(self) -> float:
        generated = self._sum("tokens_generated")
        return self._sum("wasted_tokens") / generated if generated else 0.0

    def summary(self) -> dict[str, float | int | str]:
        return {
            "strategy": self.name, "kind": self.kind, "gpus": self.gpus, "rollout_gpus": self.rollout_gpus,
            "engines": self.engines, "rollout_tokens_per_s": round(self.rollout_throughput, 1),
            "rollout_tokens_per_s_per_gpu": round(self.rollout_throughput / self.rollout_gpus, 1),
            "ceiling_tokens_per_s": round(self.ceiling_tokens_per_s, 1),
            "ceiling_share": round(self.ceiling_share, 4), "bubble_share": round(self.bubble_share, 4),
            "off_policy_share": round(self.off_policy_share, 4),
            "fork_off_policy_ratio": round(sum(r.fork_off_policy_ratio for r in self.measured)
                                           / max(1, len(self.measured)), 4),
            "step_seconds": round(self.step_seconds, 2),
            "trained_tokens_per_s": round(self.trained_throughput, 1),
            "wasted_share": round(self.wasted_share, 4), "kv_retractions": self.retractions,
            "prefill_tokens": self.prefill_tokens, "draft_tokens": self.draft_tokens,
            "mean_round_tokens_per_s": round(self.mean_round_throughput, 1),
            "trained_rollout_tokens_per_s": round(self.trained_rollout_throughput, 1),
            "dropped_groups": int(self._sum("dropped_groups")),
            "discarded_tokens": int(self._sum("discarded_tokens")),
            "tail_share_last_10pct": round(self.tail_share, 4),
            "longest_over_median": round(self.longest_over_median, 2),
            "max_staleness": max((r.max_staleness for r in self.measured), default=0),
            "resumed_requests": self.resumed_requests,
            "overlap_token_share": round(self._sum("overlap_tokens") / max(1.0, self._sum("tokens_generated")), 4),
            "multi_version_samples": int(self._sum("multi_version_samples")),
        }
