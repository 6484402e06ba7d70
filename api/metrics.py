"""The metric-name contract: every series the runtime exports, and every PromQL the autotuner and the
alert rules write, starts with this prefix."""

METRIC_PREFIX = "rljob_"
