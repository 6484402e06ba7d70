"""Pure decisions: which of a job's pods wait on something that will not fix itself, and why.

A job whose pods cannot pull their image, cannot be scheduled, wait on a claim that never binds or
crash before they were ever Ready would otherwise sit in `Starting` with nothing said. Each blocked
pod becomes a PodWait (pod, container, reason, message) from its own status and the status of the
job's claims; compute_status turns them into the `PodsBlocked` condition and a Warning Event naming
the pod, on the first resync that sees them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rljob.operator.exit_message import exit_reason

# Container waiting reasons of an image that cannot be pulled (kubelet's names).
IMAGE_PULL_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"})
# Waiting reasons of a container whose config cannot be made (a missing Secret/ConfigMap key).
CONFIG_REASONS = frozenset({"CreateContainerConfigError", "CreateContainerError"})

REASON_IMAGE_PULL = "ImagePullBackOff"
REASON_UNSCHEDULABLE = "Unschedulable"
REASON_UNBOUND_CLAIM = "UnboundClaim"
REASON_CRASH_LOOP = "CrashLoopBackOff"
REASON_CONFIG = "ContainerConfigError"
# Longest message kept per pod (the scheduler's can list every node).
MAX_MESSAGE = 300


@dataclass(frozen=True)
class PodWait:
    """One pod that waits on something outside itself: `reason` is one of the REASON_* constants."""

    pod: str
    reason: str
    message: str
    container: str | None = None

    def describe(self) -> str:
        """`pod NAME[/container]: REASON: message`, as the condition and the Event say it."""
        return f"{self.key}: {self.message}"

    @property
    def key(self) -> str:
        """`pod NAME[/container]: REASON`: what an Event is posted once for (the message may vary)."""
        where = f"{self.pod}/{self.container}" if self.container else self.pod
        return f"pod {where}: {self.reason}"


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 3] + "..."


def _is_ready(status: dict[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def _claim_names(pod: dict[str, Any]) -> list[str]:
    volumes = (pod.get("spec") or {}).get("volumes") or []
    return [v["persistentVolumeClaim"]["claimName"] for v in volumes if v.get("persistentVolumeClaim")]


def _unscheduled(status: dict[str, Any]) -> dict[str, Any] | None:
    """The scheduler's PodScheduled=False/Unschedulable condition of a pod still Pending (a stale one on a
    pod that runs since is no wait)."""
    if status.get("phase") not in (None, "Pending"):
        return None
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False" and cond.get("reason") == "Unschedulable":
            return cond
    return None


def _container_wait(name: str, cs: dict[str, Any], ready: bool) -> PodWait | None:
    waiting = (cs.get("state") or {}).get("waiting") or {}
    reason = waiting.get("reason") or ""
    message = _short(waiting.get("message") or "")
    if reason in IMAGE_PULL_REASONS:
        image = cs.get("image") or "its image"
        return PodWait(name, REASON_IMAGE_PULL, f"cannot pull {image} ({reason}){': ' + message if message else ''}", cs.get("name"))
    if reason in CONFIG_REASONS:
        return PodWait(name, REASON_CONFIG, message or reason, cs.get("name"))
    if reason == "CrashLoopBackOff" and not ready:
        last = ((cs.get("lastState") or {}).get("terminated")) or {}
        said = _short(exit_reason(last.get("message") or ""))
        code = last.get("exitCode")
        detail = f"exit code {code}" if code is not None else "crashed"
        return PodWait(
            name, REASON_CRASH_LOOP,
            f"restarted {cs.get('restartCount', 0)} times before it was ever Ready ({detail}){': ' + said if said else ''}",
            cs.get("name"),
        )
    return None


def pod_wait(pod: dict[str, Any], claims: Mapping[str, dict[str, Any]]) -> PodWait | None:
    """Why this pod waits on something that will not resolve by itself, or None.

    `claims` maps claim names of the pod's namespace to their PersistentVolumeClaim objects, as far as
    they are known (a claim missing from it is judged by the scheduler's message alone). A pod being
    deleted, finished, or Ready once (a crash loop after Ready is the failure policy's business) is
    not waiting.
    """
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("phase") in ("Succeeded", "Failed"):
        return None
    name = meta.get("name", "")
    for claim in _claim_names(pod):
        obj = claims.get(claim)
        phase = ((obj or {}).get("status") or {}).get("phase")
        if obj is not None and phase in ("Pending", "Lost") and not (obj.get("spec") or {}).get("volumeName"):
            # A WaitForFirstConsumer claim is Pending until the scheduler picks a node: only blocked
            # once the scheduler itself says it cannot place the pod.
            if phase == "Lost" or _unscheduled(status) is not None:
                return PodWait(name, REASON_UNBOUND_CLAIM, f"PersistentVolumeClaim {claim} is {phase} (not bound to a volume)")
    unscheduled = _unscheduled(status)
    if unscheduled is not None:
        message = _short(unscheduled.get("message") or "no node fits")
        if "persistentvolumeclaim" in message.lower() or "persistent volume" in message.lower():
            return PodWait(name, REASON_UNBOUND_CLAIM, message)
        return PodWait(name, REASON_UNSCHEDULABLE, message)
    ready = _is_ready(status)
    for cs in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        found = _container_wait(name, cs, ready)
        if found is not None:
            return found
    return None


def pod_waits(pods: Iterable[dict[str, Any]], claims: Iterable[dict[str, Any]]) -> list[PodWait]:
    """Every blocked pod of a job, sorted by pod name (a stable condition message across resyncs)."""
    by_name = {c["metadata"]["name"]: c for c in claims}
    found = [w for p in pods if (w := pod_wait(p, by_name)) is not None]
    return sorted(found, key=lambda w: w.pod)


def waits_message(waits: list[PodWait]) -> str:
    """The PodsBlocked condition's message: every blocked pod, one clause each."""
    return "; ".join(w.describe() for w in waits)
