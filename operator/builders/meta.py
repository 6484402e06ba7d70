"""Names, labels and owner references shared by every child the operator creates.

Names are deterministic functions of the RLJob name (and pool name), so re-running a reconcile after
a crash finds the same objects instead of creating duplicates.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from rljob.api.spec import API_GROUP, API_VERSION, KIND
from rljob.common.kube import OPERATOR_FIELD_MANAGER
from rljob.common.kube import selector_string as selector_string  # re-exported for the operator's modules

MANAGER = OPERATOR_FIELD_MANAGER

LABEL_JOB = f"{API_GROUP}/job-name"
LABEL_ROLE = f"{API_GROUP}/role"
LABEL_POOL = f"{API_GROUP}/pool"
LABEL_VENDOR = f"{API_GROUP}/vendor"
ANNOTATION_CONFIG_HASH = f"{API_GROUP}/config-hash"

ROLE_INFERENCE = "inference"
ROLE_ROUTER = "router"
ROLE_TRAINER = "trainer"

# A StatefulSet name plus "-<ordinal>" and its controller-revision-hash label value ("<name>-<10 chars>")
# must stay within 63 characters.
MAX_CHILD_NAME = 52


@dataclass(frozen=True)
class JobRef:
    """Identity of the RLJob that owns the children."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> JobRef:
        """Read name, namespace and uid from an RLJob object."""
        meta = body["metadata"]
        return cls(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])


def child_name(job: JobRef, *parts: str) -> str:
    """`<job>-<parts...>`, shortened with a stable hash suffix when it would be too long."""
    full = "-".join((job.name, *parts))
    if len(full) <= MAX_CHILD_NAME:
        return full
    digest = hashlib.sha256(full.encode()).hexdigest()[:8]
    return f"{full[: MAX_CHILD_NAME - 9].rstrip('-')}-{digest}"


def selector_labels(job: JobRef, role: str, pool: str | None = None) -> dict[str, str]:
    """The immutable labels a workload selects its pods by."""
    labels = {LABEL_JOB: job.name, LABEL_ROLE: role}
    if pool is not None:
        labels[LABEL_POOL] = pool
    return labels


def labels(job: JobRef, role: str, pool: str | None = None) -> dict[str, str]:
    """Standard recommended labels plus the rljob selector labels."""
    return {
        "app.kubernetes.io/name": "rljob",
        "app.kubernetes.io/instance": job.name,
        "app.kubernetes.io/component": role,
        "app.kubernetes.io/part-of": "rljob",
        "app.kubernetes.io/managed-by": MANAGER,
        **selector_labels(job, role, pool),
    }


def owner_reference(job: JobRef) -> dict[str, Any]:
    """Controller owner reference: the garbage collector deletes the child with the RLJob."""
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": KIND,
        "name": job.name,
        "uid": job.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def object_meta(job: JobRef, name: str, role: str, pool: str | None = None) -> dict[str, Any]:
    """metadata of a child object."""
    return {
        "name": name,
        "namespace": job.namespace,
        "labels": labels(job, role, pool),
        "ownerReferences": [owner_reference(job)],
    }
