"""The alert-action check of one RLJob, run by the operator's autotune loop (operator/resync.py).

Reads the job's alert conditions from its Prometheus (spec.autotune.prometheus, as the autotuner does),
asks decide.py what to do, then does it: a JSON merge patch of the spec (suspend, rollback), the status
(server-side applied as field manager `rljob-alerts`: the AlertAction condition and `alerts`), Events.
The spec is patched first and at the resourceVersion read: if the user changed the job meanwhile, the
patch is refused (409) and the next check decides again from the new object, since the status that
would mark the action as taken is written only after the patch succeeded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from datetime import datetime
from typing import Any

from pydantic import ValidationError
from rljob.api.spec import API_GROUP, API_VERSION, KIND, RLJobSpec
from rljob.api.status import Condition, RLJobStatus, utcnow
from rljob.common.autotune.prometheus import PrometheusClient, PrometheusError, PrometheusPool
from rljob.common.autotune.queries import job_selector
from rljob.common.kube import ALERTS_FIELD_MANAGER, Kube, collection_path
from rljob.operator.alerts import decide
from rljob.operator.alerts.rules import actionable_rules
from rljob.operator.autotune.timer import prometheus_client_for

log = logging.getLogger(__name__)


async def read_conditions(client: PrometheusClient, name: str, namespace: str, spec: RLJobSpec) -> dict[str, float | None] | None:
    """Each listed alert's value for the job (None: it does not hold); None when the job has no series at all."""
    labels = dict(spec.autotune.prometheus.match_labels)
    rules = actionable_rules()
    present, *results = await asyncio.gather(
        client.query(f"rljob_job_info{job_selector(name, namespace, labels)}"),
        *(client.query(rules[entry.alert].for_job(name, namespace, labels)) for entry in spec.alert_actions),
    )
    if not present:
        return None
    return {
        entry.alert: max((s.value for s in samples), default=None)
        for entry, samples in zip(spec.alert_actions, results, strict=True)
    }


def _condition(status: RLJobStatus, state: decide.ConditionState, generation: int, now: datetime) -> dict[str, Any]:
    """The AlertAction condition on the wire (its transition time moves only when its status does)."""
    old = status.condition(decide.CONDITION)
    return Condition(
        type=decide.CONDITION, status=state.status, reason=state.reason, message=state.message[:2000],
        observed_generation=generation,
        last_transition_time=now if old is None or old.status != state.status else old.last_transition_time,
    ).to_wire()


def _patch_spec(kube: Kube, body: dict[str, Any], patch: dict[str, Any]) -> None:
    meta = body["metadata"]
    kube.request(
        "PATCH",
        f"{collection_path(f'{API_GROUP}/{API_VERSION}', KIND, meta['namespace'])}/{meta['name']}",
        body={"metadata": {"resourceVersion": meta["resourceVersion"]}, "spec": patch},
        query={"fieldManager": ALERTS_FIELD_MANAGER},
        content_type="application/merge-patch+json",
    )


def _read(kube: Kube, namespace: str, name: str, fresh: bool) -> tuple[dict[str, Any], RLJobSpec, RLJobStatus] | None:
    """The RLJob with its spec and status parsed (None: gone, being deleted, or unreadable). `fresh` reads the
    API server itself, past the operator's watch cache."""
    body = Kube.get_rljob(kube, namespace, name) if fresh else kube.get_rljob(namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return None
    try:
        return body, RLJobSpec.model_validate(body.get("spec") or {}), RLJobStatus.model_validate(body.get("status") or {})
    except ValidationError as err:  # the lifecycle handlers report an invalid spec
        log.warning("alert actions %s/%s: spec or status unreadable: %s", namespace, name, err)
        return None


async def check_job(kube: Kube, pool: PrometheusPool, namespace: str, name: str) -> None:
    """Check one RLJob's alert conditions when due, and act on them."""
    kube = dataclasses.replace(kube, field_manager=ALERTS_FIELD_MANAGER)
    read = await asyncio.to_thread(_read, kube, namespace, name, False)
    if read is None or read[2].outcome is not None:
        return
    body, spec, status = read
    if not spec.alert_actions:
        if status.alerts is not None or status.condition(decide.CONDITION) is not None:
            await asyncio.to_thread(kube.apply_rljob_status, namespace, name, {})  # give up what it owned
        return
    if not decide.due(spec, status.alerts, utcnow()):
        return
    # Due by the cache: decide from the object as stored, which holds this checker's last write (the cache
    # may not yet), so an action is never taken twice in one episode. One read per job and interval.
    read = await asyncio.to_thread(_read, kube, namespace, name, True)
    now = utcnow()
    if read is None or read[2].outcome is not None or not decide.due(read[1], read[2].alerts, now):
        return
    body, spec, status = read
    label = f"{namespace}/{name}"
    try:
        client = await prometheus_client_for(spec, namespace, pool)
        readings = await read_conditions(client, name, namespace, spec)
    except PrometheusError as exc:
        decision = decide.unchecked(status.alerts, spec, "PrometheusUnavailable", f"{label}: {exc}", now)
    else:
        rule_for = {alert: rule.for_seconds for alert, rule in actionable_rules().items()}
        decision = decide.decide(label, spec, status.alerts, readings, status.trainer.last_checkpoint, rule_for, now)
    if decision.spec_patch:
        await asyncio.to_thread(_patch_spec, kube, body, decision.spec_patch)
    generation = int(body["metadata"].get("generation") or 0)
    owned = {"alerts": decision.alerts.to_wire(), "conditions": [_condition(status, decision.condition, generation, now)]}
    await asyncio.to_thread(kube.apply_rljob_status, namespace, name, owned)
    old = status.condition(decide.CONDITION)
    if decision.condition.status == "Unknown" and (old is None or old.reason != decision.condition.reason):
        await asyncio.to_thread(kube.post_event, body, "Warning", decision.condition.reason, decision.condition.message)
    for event in decision.events:
        await asyncio.to_thread(kube.post_event, body, event.type, event.reason, event.message)
        log.info("alert actions: %s: %s", event.reason, event.message)
