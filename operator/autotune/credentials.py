"""Which Prometheus the autotuner may call for a job, and with which token (pure; timer.py does the I/O).

The chart's token (RLJOB_PROMETHEUS_BEARER_TOKEN_FILE, possibly the operator's own service-account
token) belongs to the chart's Prometheus (RLJOB_PROMETHEUS_ADDRESS) and is sent nowhere else. A job
that names another address gets no chart credential: the address must be on the chart's allow-list
(RLJOB_PROMETHEUS_ALLOWED_ADDRESSES, comma-separated URL prefixes or ``scheme://host:*``; empty:
none), and the only token
sent there is the one in the job's own Secret (spec.autotune.prometheus.bearerTokenSecretRef, a key
in the job's namespace). Admission has already refused link-local and metadata addresses and
fragments (api/validation.py credential_target_problem).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from rljob.api.spec import AutotunePrometheusSpec, SecretKeyRef
from rljob.common.autotune.prometheus import PrometheusError


class PrometheusNotAllowed(PrometheusError):
    """The job names a Prometheus the operator may not call (no default, or not on the allow-list)."""

    kind = "unavailable"


@dataclass(frozen=True)
class PrometheusSettings:
    """The operator's Prometheus settings (from the chart, through the environment)."""

    address: str | None = None
    token_file: str | None = None
    allowed: tuple[str, ...] = ()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> PrometheusSettings:
        """RLJOB_PROMETHEUS_ADDRESS, RLJOB_PROMETHEUS_BEARER_TOKEN_FILE, RLJOB_PROMETHEUS_ALLOWED_ADDRESSES."""
        allowed = tuple(a.strip() for a in environ.get("RLJOB_PROMETHEUS_ALLOWED_ADDRESSES", "").split(",") if a.strip())
        return cls(environ.get("RLJOB_PROMETHEUS_ADDRESS") or None, environ.get("RLJOB_PROMETHEUS_BEARER_TOKEN_FILE") or None,
                   allowed)


@dataclass(frozen=True)
class PrometheusTarget:
    """Where to send the job's queries and whose token goes with them (at most one of the two)."""

    address: str
    chart_token: bool = False  # the chart's token file (only ever for the chart's own address)
    secret: SecretKeyRef | None = None  # the job's own Secret


def _same(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


def _matches(address: str, entry: str) -> bool:
    if entry.endswith(":*"):  # any port of that scheme and host (a test Prometheus on a free port)
        head, sep, rest = address.partition(entry[:-1])
        port = rest.split("/", 1)[0]
        return not head and bool(sep) and port.isdigit()
    return _same(address, entry) or address.startswith(entry.rstrip("/") + "/")


def on_allow_list(address: str, allowed: tuple[str, ...]) -> bool:
    """``address`` is an entry, or under one (the entry followed by ``/``), or has the scheme and host of
    an entry ``scheme://host:*``: a match never ends mid-host."""
    return any(_matches(address, entry) for entry in allowed)


def prometheus_target(spec: AutotunePrometheusSpec, settings: PrometheusSettings) -> PrometheusTarget:
    """The target for one job; PrometheusNotAllowed with a fixed message naming the field otherwise."""
    if spec.address is None or (settings.address is not None and _same(spec.address, settings.address)):
        if settings.address is None:
            raise PrometheusNotAllowed(
                "no Prometheus address: set spec.autotune.prometheus.address or the chart value autotune.prometheus.address"
            )
        if spec.bearer_token_secret_ref is not None:
            return PrometheusTarget(settings.address, secret=spec.bearer_token_secret_ref)
        return PrometheusTarget(settings.address, chart_token=settings.token_file is not None)
    if not on_allow_list(spec.address, settings.allowed):
        raise PrometheusNotAllowed(
            f"spec.autotune.prometheus.address {spec.address} is not on the operator's allow-list (chart value "
            "autotune.prometheus.allowedAddresses); leave it unset to use the chart's Prometheus"
        )
    return PrometheusTarget(spec.address, secret=spec.bearer_token_secret_ref)
