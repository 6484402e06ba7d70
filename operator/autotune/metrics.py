"""Operator metrics of the autotuner: knob values per job, adjustments, decisions and read failures."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge
from rljob.common.autotune.controller import Knobs
from rljob.common.autotune.tick import TickResult

JOB_LABELS = ("namespace", "rljob")


class AutotuneMetrics:
    """Collectors on one registry (the operator's, by default the process-wide one it serves)."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.registry = registry
        self.effective_knob = Gauge(
            "rljob_effective_knob", "Knob value the autotuner set for the runtime (mode Apply).",
            (*JOB_LABELS, "knob"), registry=registry,
        )
        self.recommended_knob = Gauge(
            "rljob_recommended_knob", "Knob value the autotuner recommends (mode Recommend; not applied).",
            (*JOB_LABELS, "knob"), registry=registry,
        )
        self.adjustments = Counter(
            "rljob_autotune_adjustments", "Knob changes decided by the autotuner.",
            (*JOB_LABELS, "knob", "mode"), registry=registry,
        )
        self.decisions = Counter(
            "rljob_autotune_decisions", "Autotuner decisions by reason (changes and holds).",
            (*JOB_LABELS, "reason"), registry=registry,
        )
        self.failures = Counter(
            "rljob_autotune_failures", "Prometheus reads that failed or found no data.",
            (*JOB_LABELS, "reason"), registry=registry,
        )

    def observe(self, namespace: str, name: str, mode: str, previous: Knobs, result: TickResult) -> None:
        """Record one tick's outcome."""
        if result.failure is not None:
            self.failures.labels(namespace, name, result.failure).inc()
            return
        d = result.decision
        if d is None:
            return
        self.decisions.labels(namespace, name, d.reason).inc()
        gauge = self.effective_knob if mode == "Apply" else self.recommended_knob
        values = {"over_sampling": d.knobs.over_sampling}
        if d.knobs.truncation is not None:
            values["truncation_k" if d.knobs.truncation_unit == "sigma" else "segment_cap_tokens"] = d.knobs.truncation
        for knob, value in values.items():
            gauge.labels(namespace, name, knob).set(value)
        if d.changed:
            if d.knobs.over_sampling != previous.over_sampling:
                self.adjustments.labels(namespace, name, "over_sampling", mode).inc()
            if d.knobs.truncation != previous.truncation:
                self.adjustments.labels(namespace, name, "truncation", mode).inc()

    def forget(self, namespace: str, name: str) -> None:
        """Drop the series of a deleted job."""
        for collector in (self.effective_knob, self.recommended_knob, self.adjustments, self.decisions, self.failures):
            for labels in list(collector._metrics):
                if labels[:2] == (namespace, name):
                    collector.remove(*labels)
