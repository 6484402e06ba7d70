"""Every metric name the runtime and the operator export, introspected from their registries.

The alert rules, the dashboard and the autotuner's PromQL may only use these names; tests check
that (tests/unit/test_alerts.py, tests/unit/test_dashboard.py). `python -m
tests.helpers.metric_names` prints them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

# Series names a metric family of each type produces (prometheus-client exposition).
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "gauge": ("",),
    "info": ("_info",),
}


def registry_series_names(registry: CollectorRegistry) -> set[str]:
    """Names of the series the collectors of `registry` expose, labelled children or not."""
    names: set[str] = set()
    for family in registry.collect():
        names.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",)))
    return names


def runtime_metric_names() -> set[str]:
    """Series names of the runtime (RuntimeMetrics), after one step and one evaluation: the measured
    gauges join the registry only once set."""
    from rljob.runtime.evaluation import EvalResult
    from rljob.runtime.metrics import RuntimeMetrics
    from rljob.runtime.step_record import StepRecord

    metrics = RuntimeMetrics("introspection")
    metrics.record(StepRecord(step=1, policy_version=1, strategy="april", time=0.0))
    metrics.record_eval(EvalResult(step=1, policy_version=1, reward_mean=0.0, length_mean=0.0, prompts=1, seconds=0.0))
    return registry_series_names(metrics.registry)


def operator_metric_names() -> set[str]:
    """Series names of the operator: its lifecycle metrics and the autotuner's."""
    import rljob.operator.metrics  # noqa: F401 (registers the lifecycle metrics on REGISTRY)
    from prometheus_client import REGISTRY
    from rljob.operator.autotune.metrics import AutotuneMetrics

    ours = registry_series_names(AutotuneMetrics(CollectorRegistry()).registry)
    return ours | {n for n in registry_series_names(REGISTRY) if n.startswith("rljob_")}


if __name__ == "__main__":
    for name in sorted(runtime_metric_names() | operator_metric_names()):
        print(name)
