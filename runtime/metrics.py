"""Runtime metrics: one StepRecord (runtime/step_record.py) per training step, exported to Prometheus and JSON lines.

Metric names are part of the API: the alerts, the dashboard and the autotuner read them.
Each RuntimeMetrics owns its registry (no process-global state), so tests and the benchmark can
run several jobs in one process.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from rljob.api.metrics import METRIC_PREFIX
from rljob.runtime.evaluation import EvalResult
from rljob.runtime.step_record import StepRecord

# What first sets a measured gauge: a training step, or a held-out evaluation.
SetBy = Literal["step", "eval"]


def ledger_imbalance(rec: StepRecord | dict[str, Any]) -> tuple[int, int]:
    """(groups, tokens) that the step's ledger fails to account for; (0, 0) when it closes.

    Groups: every group that entered the round (from the buffer or a fresh prompt) was trained,
    buffered again, filtered (``filtered_groups``, dynamic sampling) or discarded (baselines).
    Regenerated samples stay in their groups: their thrown-away responses close the token ledger as
    ``regenerated_tokens``. Tokens: what the buffer held plus what the round generated was
    trained, is in the buffer, or was regenerated, filtered or discarded (by a baseline).
    """
    r = rec if isinstance(rec, dict) else rec.flat()
    groups_in = r["buffer_groups_before"] + r["new_groups"]
    groups_out = r["trained_groups"] + r["buffered_groups"] + r["filtered_groups"] + r["discarded_groups"]
    tokens_in = r["buffer_tokens_before"] + r["tokens_generated"]
    tokens_out = (r["trained_tokens"] + r["buffer_tokens_after"] + r["regenerated_tokens"]
                  + r["filtered_tokens"] + r["discarded_tokens"])
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
        # An unlabelled gauge reads 0 from its creation. For a measurement that reading is a lie:
        # before the first step Prometheus, the autotuner and the alerts would see a truncation rate,
        # an entropy and a reward of 0. Such gauges join the registry when first set (_export).
        self._unexported: dict[SetBy, list[Gauge]] = {"step": [], "eval": []}
        self._declare_rollout(job_name, namespace)
        self._declare_training()
        self._declare_counters()

    def _gauge(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(METRIC_PREFIX + name, doc, labels, registry=self.registry)

    def _measured(self, name: str, doc: str, *, set_by: SetBy = "step") -> Gauge:
        gauge = Gauge(METRIC_PREFIX + name, doc, registry=None)
        self._unexported[set_by].append(gauge)
        return gauge

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(METRIC_PREFIX + name, doc, registry=self.registry)

    def _declare_rollout(self, job_name: str, namespace: str) -> None:
        """The job's identity and the rollout's gauges: throughput, the signals of docs/metrics.md, buffer."""
        # rljob_namespace, not namespace: a Kubernetes scrape adds the pod's own `namespace` target label.
        self._gauge("job_info", "Static information about the running job.", ("rljob", "rljob_namespace")).labels(
            job_name, namespace
        ).set(1)
        self.tokens_per_s = self._measured("rollout_tokens_per_second", "Rollout tokens generated per second, last round.")
        self.ceiling = self._measured(
            "rollout_ceiling_tokens_per_second", "Bubble-free ceiling estimate: full-batch decode rate of the engines."
        )
        # One meaning each (docs/metrics.md): cut by the length threshold, apart from still running at stop.
        self.truncation_rate = self._measured(
            "truncation_rate", "Share of launched samples cut by the length threshold (segment cap), last round."
        )
        self.partial_rate = self._measured(
            "partial_rate", "Share of launched samples still running when the round stopped upon collection (not cut)."
        )
        self.goodput = self._measured(
            "goodput_tokens_per_second", "Response tokens that reached training per second of wall time, last step."
        )
        self.aborted_share = self._measured(
            "aborted_token_share", "Share of the last step's generated tokens thrown away (staleness, filter, discard)."
        )
        self.trainer_idle = self._measured("trainer_idle_seconds", "Seconds of the last step the trainer waited for rollout.")
        self.engine_idle = self._measured("engine_idle_seconds", "Seconds of the last step the engines waited for the trainer.")
        self.cap_hit_rate = self._measured("cap_hit_rate", "Share of launched samples that hit max response length.")
        self.off_policy = self._measured("off_policy_token_ratio", "Trained tokens generated by an older policy version.")
        self.fork_off_policy = self._measured("fork_off_policy_ratio", "APRIL-fork off-policy ratio (paper comparison).")
        self.buffer = self._measured("buffer_groups", "Groups waiting in the partial-rollout buffer.")
        self.length = self._gauge("response_length_tokens", "Response length of trained samples.", ("stat",))

    def _declare_training(self) -> None:
        """The trained batch's and the loop's gauges: reward, entropy, losses, phases, knobs, versions."""
        self.reward = self._measured("reward_mean", "Mean reward of the trained batch.")
        self.eval_reward = self._measured(
            "eval_reward_mean", "Mean reward on the held-out evaluation set, last evaluation.", set_by="eval"
        )
        self.entropy = self._measured("policy_entropy", "Mean token entropy of the policy on the trained batch.")
        self.kl = self._measured("kl", "Approximate KL between the new and the rollout policy.")
        self.clip = self._measured("clip_fraction", "Share of tokens whose ratio was clipped.")
        self.loss = self._measured("loss", "Training loss of the last step.")
        self.phase_seconds = self._gauge("phase_seconds", "Duration of the last step's phases.", ("phase",))
        self.version = self._measured("policy_version", "Current policy version (weight syncs so far).")
        self.knob = self._gauge("knob", "Value of a partial-rollout knob in force.", ("knob",))
        self.truncation_band = self._gauge(
            "truncation_band", "Edges of the job's healthy truncation-rate band (spec.autotune.truncationBand).",
            ("edge",),
        )
        self.drain = self._measured("abort_drain_seconds", "Time from abort to drained engines, last round.")
        self.last_step = self._measured("last_step_timestamp_seconds", "Unix time of the last completed step.")

    def _declare_counters(self) -> None:
        """The counters (rate() them) and the staleness histogram."""
        self.steps = self._counter("steps", "Training steps completed.")
        self.tokens = self._counter("rollout_tokens", "Rollout tokens generated, aborted calls included.")
        self.resumed = self._counter("partial_samples_resumed", "Samples resumed from a partial response.")
        self.regenerated = self._counter("regenerated_samples", "Samples regenerated because of the staleness bound.")
        self.filtered_groups = self._counter("filtered_groups", "Groups filtered by dynamic sampling (DAPO: rewards all equal).")
        self.filtered_tokens = self._counter("filtered_tokens", "Response tokens of the filtered groups.")
        self.engine_errors = self._counter("engine_errors", "Generate calls that failed on an engine.")
        self.checkpoints_skipped = self._counter(
            "checkpoints_skipped", "Newer checkpoints a resume passed over: torn (no completion marker) or unloadable."
        )
        self.data_skipped = self._gauge(
            "data_rows_skipped", "Data rows skipped since the job began (resumes included): unreadable, "
            "unrenderable or too long for the context.", ("reason",)
        )
        self.sync_failures = self._counter("weight_sync_failures", "Weight updates that failed on an engine.")
        self.in_rotation = self._measured("engines_in_rotation", "Engine ranks serving the current policy version.")
        self.sync_bytes = self._measured(
            "weight_sync_bytes", "Bytes of weights the last step's sync moved to the engines, once however many "
            "engines took them (over rljob_phase_seconds{phase=\"sync\"}: the sync's bandwidth)."
        )
        self.new_groups = self._counter("new_groups", "Groups started from fresh prompts.")
        self.trained_groups = self._counter("trained_groups", "Groups trained on.")
        self.buffered_groups = self._counter("buffered_groups", "Groups pushed to the partial buffer at the end of a round.")
        self.trained_tokens = self._counter(
            "trained_tokens", "Response tokens that reached training (rate(): end-to-end goodput)."
        )
        self.aborted_tokens = self._counter(
            "aborted_tokens", "Response tokens generated, then thrown away: regenerated, filtered or discarded."
        )
        self.regenerated_tokens = self._counter(
            "regenerated_tokens", "Response tokens thrown away because they were older than maxStaleness."
        )
        self.staleness = Histogram(
            METRIC_PREFIX + "sample_staleness_versions",
            "Policy versions between the trainer and a trained sample's oldest token.",
            buckets=(0, 1, 2, 3, 4, 6, 8, 16),
            registry=self.registry,
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

    def set_truncation_band(self, low: float, high: float) -> None:
        """Export the spec's truncation band, so the alerts compare the rate with this job's own band."""
        self.truncation_band.labels("low").set(low)
        self.truncation_band.labels("high").set(high)

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
        r = rec.flat()
        with self._lock:
            self.tokens_per_s.set(r["rollout_tokens_per_s"])
            self.ceiling.set(r["ceiling_tokens_per_s"])
            self.truncation_rate.set(r["truncation_rate"])
            self.partial_rate.set(r["partial_rate"])
            self.goodput.set(r["goodput_tokens_per_s"])
            self.aborted_share.set(r["aborted_token_share"])
            self.trainer_idle.set(r["trainer_idle_seconds"])
            self.engine_idle.set(r["engine_idle_seconds"])
            self.cap_hit_rate.set(r["cap_hit_rate"])
            self.off_policy.set(r["off_policy_token_ratio"])
            self.fork_off_policy.set(r["fork_off_policy_ratio"])
            self.buffer.set(r["buffer_groups"])
            for stat in ("mean", "std", "p50", "p99", "max"):
                self.length.labels(stat).set(r[f"length_{stat}"])
            self.reward.set(r["reward_mean"])
            self.entropy.set(r["entropy"])
            self.kl.set(r["kl"])
            self.clip.set(r["clip_fraction"])
            self.loss.set(r["loss"])
            for phase in ("step", "rollout", "train", "sync"):
                self.phase_seconds.labels(phase).set(r[f"{phase}_seconds"])
            self.phase_seconds.labels("wall").set(r["end_to_end_seconds"])  # the idle signals' denominator
            self.version.set(r["policy_version"])
            self.set_knobs(r["knobs"])
            self.drain.set(r["abort_drain_seconds"])
            self.last_step.set(r["time"])
            self.steps.inc()
            self.tokens.inc(r["tokens_generated"])
            self.resumed.inc(r["resumed_samples"])
            self.regenerated.inc(r["regenerated_samples"])
            self.filtered_groups.inc(r["filtered_groups"])
            self.filtered_tokens.inc(r["filtered_tokens"])
            self.engine_errors.inc(r["engine_errors"])
            self.sync_failures.inc(r["weight_sync_failures"])
            for reason, rows in r["data_rows_skipped"].items():
                self.data_skipped.labels(reason).set(rows)
            self.in_rotation.set(r["engines_in_rotation"])
            self.sync_bytes.set(r["sync_bytes"])
            self.new_groups.inc(r["new_groups"])
            self.trained_groups.inc(r["trained_groups"])
            self.buffered_groups.inc(r["buffered_groups"])
            self.regenerated_tokens.inc(r["regenerated_tokens"])
            self.trained_tokens.inc(r["trained_tokens"])
            self.aborted_tokens.inc(r["aborted_tokens"])
            for s in r["staleness"]:
                self.staleness.observe(s)
            self._export("step")
            if self.jsonl_path is not None:
                self.jsonl_path.parent.mkdir(parents=True, exist_ok=True)
                with self.jsonl_path.open("a") as f:
                    f.write(rec.to_json() + "\n")


# metrics.jsonl keys of the round ledger before issue 28 gave each outcome one word
# (docs/architecture.md#the-round-ledger); an older run's records are read under today's names.
LEGACY_KEYS = {"dropped_groups": "filtered_groups", "wasted_tokens": "filtered_tokens",
               "discarded_stale_tokens": "regenerated_tokens"}


def current_names(record: dict[str, Any]) -> dict[str, Any]:
    """A metrics.jsonl record with an older run's ledger keys under their current names (order kept)."""
    return {LEGACY_KEYS.get(key, key): value for key, value in record.items()}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Read a metrics.jsonl file back (report, tests), older runs' ledger keys under their current names."""
    return [current_names(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
