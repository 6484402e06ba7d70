"""The autotuner tick for every RLJob, run by the operator's resync loop (operator/resync.py).

Not a kopf timer: kopf adds a finalizer to every object a timer runs on. The loop ticks every
TICK_S seconds and `tick.due` decides from the job's spec.autotune.intervalSeconds (and the failure
backoff) whether this tick reads Prometheus. A failure never raises out of the tick: it becomes the
AutotuneActive condition, an Event and a later retry. The status is server-side applied as field
manager `rljob-autotuner`, with only the fields the autotuner owns.

Operator settings (environment, set by the chart):
- RLJOB_PROMETHEUS_ADDRESS: default Prometheus URL when spec.autotune.prometheus.address is unset;
- RLJOB_PROMETHEUS_BEARER_TOKEN_FILE: default bearer token file (e.g. a projected service account token),
  sent to RLJOB_PROMETHEUS_ADDRESS only;
- RLJOB_PROMETHEUS_ALLOWED_ADDRESSES: the addresses a job may name instead (credentials.py);
- RLJOB_AUTOTUNE_TICK_SECONDS: the timer's tick (default 5);
- RLJOB_AUTOTUNE_CONCURRENCY: jobs autotuned at once (default 16). Each job's tick runs on its own
  (operator/resync.py), so one job's unreachable Prometheus, which can take its whole timeout (up to
  60 s) to fail, holds one of these slots and never delays another job's decision.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
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
from rljob.operator.autotune.credentials import PrometheusSettings, prometheus_target
from rljob.operator.autotune.metrics import AutotuneMetrics
from rljob.common.autotune.prometheus import (
    PrometheusClient,
    PrometheusError,
    PrometheusPool,
    PrometheusUnavailable,
)
from rljob.common.autotune.queries import read_observation
from rljob.common.kube import AUTOTUNER_FIELD_MANAGER, Kube, shared_kube

log = logging.getLogger(__name__)

TICK_S = float(os.environ.get("RLJOB_AUTOTUNE_TICK_SECONDS", "5"))
AUTOTUNE_CONCURRENCY = int(os.environ.get("RLJOB_AUTOTUNE_CONCURRENCY", "16"))
METRICS = AutotuneMetrics()


def _read_secret_key(namespace: str, name: str, key: str) -> str:
    secret = shared_kube().request("GET", f"/api/v1/namespaces/{namespace}/secrets/{name}")
    data = (secret.get("data") or {}).get(key)
    if data is None:
        raise KeyError(f"Secret {namespace}/{name} has no key {key!r}")
    return base64.b64decode(data).decode().strip()


async def prometheus_client_for(spec: RLJobSpec, namespace: str, pool: PrometheusPool) -> PrometheusClient:
    """A client for the job's Prometheus on the shared pool, with the token credentials.prometheus_target
    allows: the job's own Secret's, the chart's (for the chart's address only), or none."""
    p = spec.autotune.prometheus
    settings = PrometheusSettings.from_env()
    target = prometheus_target(p, settings)
    token: str | None = None
    if target.secret is not None:
        ref = target.secret
        try:
            token = await asyncio.to_thread(_read_secret_key, namespace, ref.name, ref.key)
        except Exception as exc:
            # The reason's class only: an API error body is the API server's text, not ours to show.
            raise PrometheusUnavailable(f"cannot read bearer token from Secret {ref.name}/{ref.key}: "
                                        f"{type(exc).__name__}") from exc
    elif target.chart_token and settings.token_file is not None:
        token = Path(settings.token_file).read_text().strip()
    return pool.client(target.address, timeout_s=p.timeout_seconds, bearer_token=token)


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


async def autotune_job(kube: Kube, pool: PrometheusPool, namespace: str, name: str) -> None:
    """Run the autotuner for one RLJob and write its status and Events.

    `kube` is the operator's (cache-backed) client; the status is written as the autotuner's field
    manager. `pool` holds the pooled Prometheus connections shared by all jobs.
    """
    kube = dataclasses.replace(kube, field_manager=AUTOTUNER_FIELD_MANAGER)
    body = await asyncio.to_thread(kube.get_rljob, namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return
    status_wire = body.get("status") or {}
    try:
        job_spec = RLJobSpec.model_validate(body.get("spec") or {})
        job_status = RLJobStatus.model_validate(status_wire)
    except ValidationError as err:  # the lifecycle handlers report an invalid spec; nothing to tune
        log.warning("autotune %s/%s: spec or status unreadable: %s", namespace, name, err)
        return
    if job_status.outcome is not None:
        return  # finished jobs are not tuned
    previous = tick.current_knobs(job_spec, job_status)
    generation = int(body["metadata"].get("generation") or 0)
    result = await run_tick(name, namespace, job_spec, job_status, generation, utcnow(), pool)
    if result.patch:
        merged = RLJobStatus.model_validate(tick.merge_patch(status_wire, result.patch))
        await asyncio.to_thread(kube.apply_rljob_status, namespace, name, tick.autotuner_status(merged))
    for event in result.events:
        await asyncio.to_thread(kube.post_event, body, event.type, event.reason, event.message)
    METRICS.observe(namespace, name, job_spec.autotune.mode, previous, result)
    if result.decision is not None:
        log.info("autotune %s/%s: %s (%s)", namespace, name, result.decision.reason, result.decision.message)
    elif result.failure is not None:
        log.warning("autotune %s/%s: %s", namespace, name, result.failure)


@kopf.on.delete(API_GROUP, API_VERSION, "rljobs", id="autotune-forget", optional=True)
async def autotune_forget(name: str, namespace: str, **_: Any) -> None:
    """Drop the metrics of a deleted job."""
    METRICS.forget(namespace, name)
