"""Pure decisions about pods stuck Terminating on an unreachable node (no I/O: reconcile observes and acts).

A pod is deleted by its kubelet: the API server removes it once the kubelet confirms its containers
stopped. On a node whose kubelet is gone (powered off, partitioned) that never happens, so the pod stays
Terminating forever; a trainer Job deleted for a gang restart (Foreground) then waits for it forever,
and the job sits in `Recreating`. Force-deleting such a pod is only safe once someone asserts the node
is really down (its containers may still run and write the checkpoint volume): Kubernetes' signal for
that is the `node.kubernetes.io/out-of-service` taint (non-graceful node shutdown), which an
administrator or a node-health controller sets. So:
- a pod that has been deleting for `stuck_after_s` while its node is not Ready is *stuck*: the job gets
  the `NodeUnreachable` condition and an Event naming the pod and the node;
- it is force-deleted (grace period 0, preconditioned on its uid) only when the node carries the
  out-of-service taint.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

OUT_OF_SERVICE_TAINT = "node.kubernetes.io/out-of-service"
# How long a pod may be deleting on a node that is not Ready before the job reports it (RLJOB_STUCK_TERMINATING_SECONDS).
STUCK_AFTER_S = float(os.environ.get("RLJOB_STUCK_TERMINATING_SECONDS", "60"))


@dataclass(frozen=True)
class NodeObs:
    """What the decision needs from a Node: its Ready condition's status and the out-of-service taint."""

    name: str
    ready: str  # "True", "False", "Unknown" (also when the node never reported), "Missing" (no such Node)
    out_of_service: bool = False


@dataclass(frozen=True)
class TerminatingPod:
    """A job's pod with a deletionTimestamp, bound to a node."""

    name: str
    uid: str
    node: str
    deletion_requested: datetime  # the deletionTimestamp less the grace period


@dataclass(frozen=True)
class StuckPod:
    """A pod stuck Terminating on a node that is not Ready; `force_delete` once the node is out of service."""

    pod: TerminatingPod
    node: NodeObs

    @property
    def force_delete(self) -> bool:
        """Whether the pod may be force-deleted: only on a node tainted out-of-service."""
        return self.node.out_of_service

    def describe(self) -> str:
        """Names the pod, the node and what happens next (condition message and Event)."""
        state = "missing" if self.node.ready == "Missing" else f"Ready={self.node.ready}"
        since = self.pod.deletion_requested.strftime("%Y-%m-%dT%H:%M:%SZ")
        then = (
            f"node carries {OUT_OF_SERVICE_TAINT}: force-deleting the pod"
            if self.force_delete
            else f"it is force-deleted once the node carries the {OUT_OF_SERVICE_TAINT} taint"
        )
        return f"pod {self.pod.name} on node {self.pod.node} ({state}) has been terminating since {since}; {then}"


def node_observation(name: str, node: dict[str, Any] | None) -> NodeObs:
    """Reduce a Node object (None: it does not exist) to its readiness and the out-of-service taint."""
    if node is None:
        return NodeObs(name, "Missing")
    conditions = (node.get("status") or {}).get("conditions") or []
    ready = next((c.get("status", "Unknown") for c in conditions if c.get("type") == "Ready"), "Unknown")
    taints = (node.get("spec") or {}).get("taints") or []
    return NodeObs(name, ready, any(t.get("key") == OUT_OF_SERVICE_TAINT for t in taints))


def deletion_deadline(meta: dict[str, Any]) -> datetime | None:
    """When a pod's grace period ends (its deletionTimestamp, an RFC 3339 string or a typed client's
    datetime); None while nobody deletes it."""
    stamp = meta.get("deletionTimestamp")
    if not stamp:
        return None
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")) if isinstance(stamp, str) else stamp


def deletion_requested(meta: dict[str, Any]) -> datetime | None:
    """When a pod's deletion was asked for: its deletionTimestamp is that moment plus the grace period."""
    at = deletion_deadline(meta)
    return None if at is None else at - timedelta(seconds=int(meta.get("deletionGracePeriodSeconds") or 0))


def terminating_pod(pod: dict[str, Any]) -> TerminatingPod | None:
    """The pod as a TerminatingPod when it is being deleted on a node; None otherwise (an unbound pod is
    removed by the API server at once and cannot get stuck)."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    requested, node = deletion_requested(meta), spec.get("nodeName")
    if requested is None or not node:
        return None
    return TerminatingPod(meta.get("name", ""), meta.get("uid", ""), node, requested)


def overdue(pods: list[TerminatingPod], now: datetime, stuck_after_s: float = STUCK_AFTER_S) -> list[TerminatingPod]:
    """The pods whose deletion was asked for `stuck_after_s` or more ago (only their nodes are read)."""
    return [p for p in pods if (now - p.deletion_requested).total_seconds() >= stuck_after_s]


def stuck_pods(
    pods: list[TerminatingPod], nodes: dict[str, NodeObs], now: datetime, stuck_after_s: float = STUCK_AFTER_S
) -> list[StuckPod]:
    """The pods deleting for `stuck_after_s` or more on a node that is not Ready (a Ready node's kubelet
    finishes the deletion itself, however long the grace period), by pod name. A pod whose node was not
    read (`nodes` lacks it) is not judged."""
    stuck = [
        StuckPod(pod, nodes[pod.node])
        for pod in overdue(pods, now, stuck_after_s)
        if pod.node in nodes and nodes[pod.node].ready != "True"
    ]
    return sorted(stuck, key=lambda s: s.pod.name)
