"""The kopf timer that runs the autotuner for every RLJob.

kopf fixes a timer's interval when it is registered, so the timer ticks every TICK_S seconds and
`tick.due` decides from the job's spec.autotune.intervalSeconds (and the failure backoff) whether
this tick reads Prometheus. A failure never raises out of the handler: it becomes the
AutotuneActive condition, an Event and a later retry.

Operator settings (environment, set by the chart):
- RLJOB_PROMETHEUS_ADDRESS: default Prometheus URL when spec.autotune.prometheus.address is unset;
- RLJOB_PROMETHEUS_BEARER_TOKEN_FILE: default bearer token file (e.g. a projected service account token);
- RLJOB_AUTOTUNE_TICK_SECONDS: the timer's tick (default 5).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
from datetime import datetime
from pathlib import Path
from typing import Any

import kopf
from pydantic import ValidationError
from rljob.api.spec import API_GROUP, API_VERSION, RLJobSpec
from rljob.api.status import RLJobStatus, utcnow
from rljob.common.autotune import tick
from rljob.operator.autotune.metrics import AutotuneMetrics
from rljob.common.autotune.prometheus import (
    PrometheusClient,
    PrometheusError,
    PrometheusPool,
    PrometheusUnavailable,
)
from rljob.common.autotune.queries import read_observation

log = logging.getLogger(__name__)

TICK_S = float(os.environ.get("RLJOB_AUTOTUNE_TICK_SECONDS", "5"))
METRICS = AutotuneMetrics()


class PrometheusNotConfigured(PrometheusError):
    """Neither the spec nor the operator names a Prometheus."""

    kind = "unavailable"


def _read_secret_key(namespace: str, name: str, key: str) -> str:
    from rljob.common.kube import shared_kube

    secret = shared_kube().request("GET", f"/api/v1/namespaces/{namespace}/secrets/{name}")
    data = (secret.get("data") or {}).get(key)
    if data is None:
        raise KeyError(f"Secret {namespace}/{name} has no key {key!r}")
    return base64.b64decode(data).decode().strip()


async def prometheus_client_for(spec: RLJobSpec, namespace: str, pool: PrometheusPool) -> PrometheusClient:
    """A client for the job's Prometheus on the shared pool: address and token from the spec, else the
    operator's settings."""
    p = spec.autotune.prometheus
    address = p.address or os.environ.get("RLJOB_PROMETHEUS_ADDRESS")
    if not address:
        raise PrometheusNotConfigured(
            "no Prometheus address: set spec.autotune.prometheus.address or the chart value autotune.prometheus.address"
        )
    token: str | None = None
    if p.bearer_token_secret_ref is not None:
        ref = p.bearer_token_secret_ref
        try:
            token = await asyncio.to_thread(_read_secret_key, namespace, ref.name, ref.key)
        except Exception as exc:
            raise PrometheusUnavailable(f"cannot read bearer token from Secret {ref.name}/{ref.key}: {exc}") from exc
    elif token_file := os.environ.get("RLJOB_PROMETHEUS_BEARER_TOKEN_FILE"):
        token = Path(token_file).read_text().strip()
    return pool.client(address, timeout_s=p.timeout_seconds, bearer_token=token)


async def run_tick(
    name: str,
    namespace: str,
    spec: RLJobSpec,
    status: RLJobStatus,
    generation: int,
    now: datetime,
    pool: PrometheusPool,
) -> tick.TickResult:
    """One tick with its Prometheus I/O; never raises for Prometheus failures."""
    if spec.autotune.mode == "Off" or not tick.due(spec, status, now):
        return tick.on_mode(spec, status, generation, now)
    try:
        client = await prometheus_client_for(spec, namespace, pool)
        reading = await read_observation(
            client, tick.queries_for(name, namespace, spec, status, now), tick.persisted_step(status)
        )
    except PrometheusError as exc:
        return tick.on_failure(spec, status, exc, generation, now)
    return tick.on_reading(name, spec, status, reading, generation, now)


@kopf.on.startup()
async def open_prometheus_pool(memo: kopf.Memo, **_: Any) -> None:
    """One pooled Prometheus HTTP client per operator, in kopf's event loop."""
    memo.prometheus_pool = PrometheusPool()


@kopf.on.cleanup()
async def close_prometheus_pool(memo: kopf.Memo, **_: Any) -> None:
    """Close the pooled connections at shutdown."""
    pool = getattr(memo, "prometheus_pool", None)
    if pool is not None:
        await pool.aclose()


@kopf.timer(API_GROUP, API_VERSION, "rljobs", id="autotune", interval=TICK_S, initial_delay=TICK_S, retries=3, backoff=TICK_S)
async def autotune_timer(
    name: str,
    namespace: str,
    spec: Any,
    status: Any,
    meta: Any,
    body: Any,
    patch: kopf.Patch,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    """Run the autotuner for one RLJob and write its status and Events."""
    try:
        job_spec = RLJobSpec.model_validate(dict(spec))
        job_status = RLJobStatus.model_validate(dict(status or {}))
    except ValidationError as err:  # the lifecycle handlers report an invalid spec; nothing to tune
        log.warning("autotune %s/%s: spec or status unreadable: %s", namespace, name, err)
        return
    if job_status.outcome is not None:
        return  # finished jobs are not tuned
    previous = tick.current_knobs(job_spec, job_status)
    pool: PrometheusPool = memo.prometheus_pool
    result = await run_tick(name, namespace, job_spec, job_status, int(meta.get("generation") or 0), utcnow(), pool)
    for key, value in result.patch.items():
        patch.status[key] = value
    for event in result.events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)
    METRICS.observe(namespace, name, job_spec.autotune.mode, previous, result)
    if result.decision is not None:
        log.info("autotune %s/%s: %s (%s)", namespace, name, result.decision.reason, result.decision.message)
    elif result.failure is not None:
        log.warning("autotune %s/%s: %s", namespace, name, result.failure)


@kopf.on.delete(API_GROUP, API_VERSION, "rljobs", id="autotune-forget", optional=True)
async def autotune_forget(name: str, namespace: str, **_: Any) -> None:
    """Drop the metrics of a deleted job."""
    METRICS.forget(namespace, name)
