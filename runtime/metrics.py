"""Runtime metrics: one StepRecord per training step, exported to Prometheus and JSON lines.

Metric names are part of the API: the alerts, the dashboard and the autotuner read them.
Each RuntimeMetrics owns its registry (no process-global state), so tests and the benchmark can
run several jobs in one process.
"""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from rljob.api.metrics import METRIC_PREFIX
from rljob.runtime.evaluation import EvalResult

# What first sets a measured gauge: a training step, or a held-out evaluation.
SetBy = Literal["step", "eval"]



@dataclass
class StepRecord:
    """Everything measured in one step (rollout round + train + weight sync)."""

    step: int
    policy_version: int
    strategy: str
    time: float
    step_seconds: float = 0.0
    rollout_seconds: float = 0.0
    train_seconds: float = 0.0
    sync_seconds: float = 0.0
    tokens_generated: int = 0
    rollout_tokens_per_s: float = 0.0
    ceiling_tokens_per_s: float = 0.0
    truncation_rate: float = 0.0
    cap_hit_rate: float = 0.0
    launched_samples: int = 0
    partial_samples: int = 0
    resumed_samples: int = 0
    regenerated_samples: int = 0
    resumed_prefix_tokens: int = 0
    off_policy_token_ratio: float = 0.0
    fork_off_policy_ratio: float = 0.0
    staleness_max: int = 0
    staleness_mean: float = 0.0
    buffer_groups: int = 0
    surplus_groups: int = 0
    dropped_groups: int = 0
    wasted_tokens: int = 0
    abort_drain_seconds: float = 0.0
    engine_errors: int = 0
    weight_sync_failures: int = 0  # engine ranks the step's weight sync did not reach
    # Data rows skipped since the job began (resumes included), by reason (tasks.dataset.SKIP_REASONS).
    data_rows_skipped: dict[str, int] = field(default_factory=dict)
    engines_in_rotation: int = 0  # engine ranks serving policy_version after the sync
    # Ledger (see ledger_imbalance): where the round's groups and response tokens went.
    new_groups: int = 0
    buffer_groups_before: int = 0
    trained_groups: int = 0
    buffered_groups: int = 0  # pushed to the buffer this round
    discarded_groups: int = 0  # baseline strategies without partial rollout
    discarded_stale_tokens: int = 0
    discarded_tokens: int = 0
    trained_tokens: int = 0
    buffer_tokens_before: int = 0
    buffer_tokens_after: int = 0
    length_mean: float = 0.0
    length_std: float = 0.0
    length_p50: float = 0.0
    length_p99: float = 0.0
    length_max: int = 0
    reward_mean: float = 0.0
    eval_reward: float | None = None  # held-out evaluation after this step, when one ran
    entropy: float = 0.0
    kl: float = 0.0
    clip_fraction: float = 0.0
    loss: float = 0.0
    grad_norm: float = 0.0
    knobs: dict[str, float] = field(default_factory=dict)
    staleness: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def ledger_imbalance(rec: StepRecord | dict[str, Any]) -> tuple[int, int]:
    """(groups, tokens) that the step's ledger fails to account for; (0, 0) when it closes.

    Groups: every group that entered the round (from the buffer or a fresh prompt) was trained,
    buffered again, filtered (``dropped_groups``, dynamic sampling) or discarded (baselines).
    Regenerated samples stay in their groups: their thrown-away responses close the token ledger as
    ``discarded_stale_tokens``. Tokens: what the buffer held plus what the round generated was
    trained, is in the buffer, or was discarded (stale, filtered or by a baseline).
    """
    r = rec if isinstance(rec, dict) else asdict(rec)
    groups_in = r["buffer_groups_before"] + r["new_groups"]
    groups_out = r["trained_groups"] + r["buffered_groups"] + r["dropped_groups"] + r["discarded_groups"]
    tokens_in = r["buffer_tokens_before"] + r["tokens_generated"]
    tokens_out = (r["trained_tokens"] + r["buffer_tokens_after"] + r["discarded_stale_tokens"]
                  + r["wasted_tokens"] + r["discarded_tokens"])
    return groups_in - groups_out, tokens_in - tokens_out


def serve_readiness(host: str, port: int) -> int:
    """An empty /metrics endpoint in a background thread (a training rank's answer to its pod's probe,
    which runs no metrics of its own: rank 0 reports the job's); returns the bound port."""
    server, _ = start_http_server(port, addr=host, registry=CollectorRegistry())
    return int(server.server_port)


class RuntimeMetrics:
    """Prometheus collectors for the runtime, plus the JSON-lines log."""

    def __init__(self, job_name: str, jsonl_path: Path | None = None, namespace: str = "") -> None:
        self.registry = CollectorRegistry()
        self.jsonl_path = jsonl_path
        self._lock = threading.Lock()
        r = self.registry
        p = METRIC_PREFIX

        # An unlabelled gauge reads 0 from its creation. For a measurement that reading is a lie:
        # before the first step Prometheus, the autotuner and the alerts would see a truncation rate,
        # an entropy and a reward of 0. Such gauges join the registry when first set (_export).
        self._unexported: dict[SetBy, list[Gauge]] = {"step": [], "eval": []}

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(p + name, doc, labels, registry=r)

        def measured(name: str, doc: str, *, set_by: SetBy = "step") -> Gauge:
            g = Gauge(p + name, doc, registry=None)
            self._unexported[set_by].append(g)
            return g

        def counter(name: str, doc: str) -> Counter:
            return Counter(p + name, doc, registry=r)

        # rljob_namespace, not namespace: a Kubernetes scrape adds the pod's own `namespace` target label.
        gauge("job_info", "Static information about the running job.", ("rljob", "rljob_namespace")).labels(
            job_name, namespace
        ).set(1)
        self.tokens_per_s = measured("rollout_tokens_per_second", "Rollout tokens generated per second, last round.")
        self.ceiling = measured(
            "rollout_ceiling_tokens_per_second", "Bubble-free ceiling estimate: full-batch decode rate of the engines."
        )
        self.truncation_rate = measured("truncation_rate", "Share of launched samples that ended the round partial.")
        self.cap_hit_rate = measured("cap_hit_rate", "Share of launched samples that hit max response length.")
        self.off_policy = measured("off_policy_token_ratio", "Trained tokens generated by an older policy version.")
        self.fork_off_policy = measured("fork_off_policy_ratio", "APRIL-fork off-policy ratio (paper comparison).")
        self.buffer = measured("buffer_groups", "Groups waiting in the partial-rollout buffer.")
        self.length = gauge("response_length_tokens", "Response length of trained samples.", ("stat",))
        self.reward = measured("reward_mean", "Mean reward of the trained batch.")
        self.eval_reward = measured(
            "eval_reward_mean", "Mean reward on the held-out evaluation set, last evaluation.", set_by="eval"
        )
        self.entropy = measured("policy_entropy", "Mean token entropy of the policy on the trained batch.")
        self.kl = measured("kl", "Approximate KL between the new and the rollout policy.")
        self.clip = measured("clip_fraction", "Share of tokens whose ratio was clipped.")
        self.loss = measured("loss", "Training loss of the last step.")
        self.phase_seconds = gauge("phase_seconds", "Duration of the last step's phases.", ("phase",))
        self.version = measured("policy_version", "Current policy version (weight syncs so far).")
        self.knob = gauge("knob", "Value of a partial-rollout knob in force.", ("knob",))
        self.drain = measured("abort_drain_seconds", "Time from abort to drained engines, last round.")
        self.last_step = measured("last_step_timestamp_seconds", "Unix time of the last completed step.")
        self.steps = counter("steps", "Training steps completed.")
        self.tokens = counter("rollout_tokens", "Rollout tokens generated, aborted calls included.")
        self.resumed = counter("partial_samples_resumed", "Samples resumed from a partial response.")
        self.regenerated = counter("regenerated_samples", "Samples regenerated because of the staleness bound.")
        self.dropped = counter("dropped_groups", "Groups dropped by dynamic sampling.")
        self.wasted = counter("wasted_tokens", "Tokens of dropped groups.")
        self.engine_errors = counter("engine_errors", "Generate calls that failed on an engine.")
        self.checkpoints_skipped = counter(
            "checkpoints_skipped", "Newer checkpoints a resume passed over: torn (no completion marker) or unloadable."
        )
        self.data_skipped = gauge(
            "data_rows_skipped", "Data rows skipped since the job began (resumes included): unreadable, "
            "unrenderable or too long for the context.", ("reason",)
        )
        self.sync_failures = counter("weight_sync_failures", "Weight updates that failed on an engine.")
        self.in_rotation = measured("engines_in_rotation", "Engine ranks serving the current policy version.")
        self.new_groups = counter("new_groups", "Groups started from fresh prompts.")
        self.trained_groups = counter("trained_groups", "Groups trained on.")
        self.buffered_groups = counter("buffered_groups", "Groups pushed to the partial buffer at the end of a round.")
        self.discarded_stale = counter(
            "discarded_stale_tokens", "Response tokens thrown away because they were older than maxStaleness."
        )
        self.staleness = Histogram(
            p + "sample_staleness_versions",
            "Policy versions between the trainer and a trained sample's oldest token.",
            buckets=(0, 1, 2, 3, 4, 6, 8, 16),
            registry=r,
        )

    def serve(self, host: str, port: int) -> int:
        """Start the /metrics endpoint in a background thread; returns the bound port."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port

    def _export(self, set_by: SetBy) -> None:
        """Register the measured gauges that `set_by` ("step" or "eval") has just set for the first time."""
        for g in self._unexported[set_by]:
            self.registry.register(g)
        self._unexported[set_by] = []

    def set_knobs(self, knobs: dict[str, float]) -> None:
        for name, value in knobs.items():
            self.knob.labels(name).set(value)

    @property
    def eval_jsonl_path(self) -> Path | None:
        """Evaluation results, one JSON line each, beside the step records."""
        return self.jsonl_path.with_name("eval.jsonl") if self.jsonl_path is not None else None

    def record_eval(self, result: EvalResult) -> None:
        """Publish one held-out evaluation (the initial one has no step record)."""
        with self._lock:
            self.eval_reward.set(result.reward_mean)
            self._export("eval")
            if self.eval_jsonl_path is not None:
                self.eval_jsonl_path.parent.mkdir(parents=True, exist_ok=True)
                with self.eval_jsonl_path.open("a") as f:
                    f.write(json.dumps(result.to_dict(), sort_keys=True) + "\n")

    def record(self, rec: StepRecord) -> None:
        """Publish one step to Prometheus and append it to the JSON-lines file."""
        with self._lock:
            self.tokens_per_s.set(rec.rollout_tokens_per_s)
            self.ceiling.set(rec.ceiling_tokens_per_s)
            self.truncation_rate.set(rec.truncation_rate)
            self.cap_hit_rate.set(rec.cap_hit_rate)
            self.off_policy.set(rec.off_policy_token_ratio)
            self.fork_off_policy.set(rec.fork_off_policy_ratio)
            self.buffer.set(rec.buffer_groups)
            for stat in ("mean", "std", "p50", "p99", "max"):
                self.length.labels(stat).set(getattr(rec, f"length_{stat}"))
            self.reward.set(rec.reward_mean)
            self.entropy.set(rec.entropy)
            self.kl.set(rec.kl)
            self.clip.set(rec.clip_fraction)
            self.loss.set(rec.loss)
            for phase in ("step", "rollout", "train", "sync"):
                self.phase_seconds.labels(phase).set(getattr(rec, f"{phase}_seconds"))
            self.version.set(rec.policy_version)
            self.set_knobs(rec.knobs)
            self.drain.set(rec.abort_drain_seconds)
            self.last_step.set(rec.time)
            self.steps.inc()
            self.tokens.inc(rec.tokens_generated)
            self.resumed.inc(rec.resumed_samples)
            self.regenerated.inc(rec.regenerated_samples)
            self.dropped.inc(rec.dropped_groups)
            self.wasted.inc(rec.wasted_tokens)
            self.engine_errors.inc(rec.engine_errors)
            self.sync_failures.inc(rec.weight_sync_failures)
            for reason, rows in rec.data_rows_skipped.items():
                self.data_skipped.labels(reason).set(rows)
            self.in_rotation.set(rec.engines_in_rotation)
            self.new_groups.inc(rec.new_groups)
            self.trained_groups.inc(rec.trained_groups)
            self.buffered_groups.inc(rec.buffered_groups)
            self.discarded_stale.inc(rec.discarded_stale_tokens)
            for s in rec.staleness:
                self.staleness.observe(s)
            self._export("step")
            if self.jsonl_path is not None:
                self.jsonl_path.parent.mkdir(parents=True, exist_ok=True)
                with self.jsonl_path.open("a") as f:
                    f.write(rec.to_json() + "\n")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Read a metrics.jsonl file back (report, tests)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
