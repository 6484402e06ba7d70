"""Thin Kubernetes API access for the operator and the runtime: server-side apply, list, delete, status apply, Events.

Raw REST paths on the official client's ApiClient (auth, TLS and kubeconfig handling come from it);
objects stay plain dicts, exactly as the builders produce them.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from kubernetes import client, config
from rljob.api.spec import API_GROUP, API_VERSION, KIND

log = logging.getLogger(__name__)

RLJOB_PLURAL = "rljobs"

# Server-side-apply field managers (also the Event source), one per writer of an RLJob's status: each
# applies only the fields it owns, so none of them can overwrite another's (api/status.py lists them).
OPERATOR_FIELD_MANAGER = "rljob-operator"
AUTOTUNER_FIELD_MANAGER = "rljob-autotuner"
ALERTS_FIELD_MANAGER = "rljob-alerts"
TRAINER_FIELD_MANAGER = "rljob-trainer"

# apiVersion/kind → plural, for every kind the operator touches (no discovery round-trips).
PLURALS: dict[tuple[str, str], str] = {
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("v1", "Service"): "services",
    ("v1", "PersistentVolumeClaim"): "persistentvolumeclaims",
    ("v1", "Pod"): "pods",
    ("v1", "Event"): "events",
    ("v1", "Secret"): "secrets",
    ("apps/v1", "StatefulSet"): "statefulsets",
    ("apps/v1", "Deployment"): "deployments",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("batch/v1", "Job"): "jobs",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    (f"{API_GROUP}/{API_VERSION}", KIND): RLJOB_PLURAL,
}


class KubeError(RuntimeError):
    """A non-2xx answer from the API server."""

    def __init__(self, status: int, body: dict[str, Any] | str) -> None:
        self.status = status
        self.body = body
        message = body.get("message", body) if isinstance(body, dict) else body
        super().__init__(f"HTTP {status}: {message}")


class NotOwned(KubeError):
    """An object of a child's name exists and is not controlled by the owner the caller applies for.

    Server-side apply with force would take it over (and deleting the owner would then garbage-collect
    it), so the caller refuses instead; the message names the object and its actual controller."""

    def __init__(self, obj: dict[str, Any], owner_uid: str) -> None:
        meta = obj.get("metadata") or {}
        controller = controller_of(obj)
        by = f"{controller['kind']} {controller['name']} (uid {controller['uid']})" if controller else "nothing"
        super().__init__(409, {
            "reason": "NotOwned",
            "message": f"{obj.get('kind', 'object')} {meta.get('name')} already exists and is controlled by {by}, "
                       f"not by uid {owner_uid}; it is left as it is (rename or delete it to let the job proceed)",
        })


def controller_of(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The object's controller owner reference, if any."""
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return next((r for r in refs if r.get("controller")), None)


def check_controlled_by(obj: dict[str, Any] | None, owner_uid: str) -> None:
    """Raise NotOwned unless ``obj`` is absent or controlled by ``owner_uid``."""
    if obj is None:
        return
    controller = controller_of(obj)
    if controller is None or controller.get("uid") != owner_uid:
        raise NotOwned(obj, owner_uid)


def selector_string(selector: dict[str, str]) -> str:
    """A label selector in its string form (`k=v,k2=v2`)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector.items()))


def collection_path(api_version: str, kind: str, namespace: str) -> str:
    """REST path of a namespaced collection."""
    plural = PLURALS[(api_version, kind)]
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{prefix}/namespaces/{namespace}/{plural}"


def load_api_client(pool_maxsize: int | None = None) -> client.ApiClient:
    """In-cluster service account credentials, else the kubeconfig (KUBECONFIG or ~/.kube/config).

    `pool_maxsize`: HTTPS connections kept open (the client's default is 5 per CPU); a caller with
    more concurrent threads needs as many, or each extra request pays a new TLS handshake.
    """
    cfg = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=cfg)
    except config.ConfigException:
        # The client reads KUBECONFIG once, at import time; read it now so a later change counts.
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"), client_configuration=cfg)
    if pool_maxsize is not None:
        cfg.connection_pool_maxsize = pool_maxsize
    return client.ApiClient(cfg)


@dataclass
class Kube:
    """The API calls the operator and the runtime make, as one field manager."""

    api: client.ApiClient
    field_manager: str = OPERATOR_FIELD_MANAGER
    # Called with the method of every request sent (a caller's request counter; common knows no metrics).
    on_request: Callable[[str], None] | None = None

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: dict[str, str] | None = None,
        content_type: str = "application/json",
        timeout: float = 30.0,
    ) -> dict[str, Any]:
        """One REST call; returns the decoded JSON answer or raises KubeError.

        `timeout` (seconds) bounds connecting and each read; a caller on a deadline (leader
        election) passes one well inside it.
        """
        if self.on_request is not None:
            self.on_request(method)
        headers = {"Accept": "application/json", "Content-Type": content_type}
        _, url, headers, payload, _ = self.api.param_serialize(
            method=method,
            resource_path=path,
            query_params=list((query or {}).items()),
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self.api.call_api(method, url, header_params=headers, body=payload, _request_timeout=timeout)
        data = response.read()
        text = data.decode() if isinstance(data, bytes) else (data or "")
        try:
            decoded: Any = json.loads(text) if text else {}
        except json.JSONDecodeError:
            decoded = text
        if response.status >= 400:
            raise KubeError(response.status, decoded)
        return decoded if isinstance(decoded, dict) else {}

    def apply(self, obj: dict[str, Any], owner_uid: str | None = None) -> str:
        """Server-side apply one object as the operator's field manager.

        Returns "created", "configured" or "unchanged" (the resourceVersion did not move). With
        ``owner_uid``, an existing object not controlled by that owner is never touched: NotOwned.
        """
        return self.apply_object(obj, owner_uid)[0]

    def apply_object(self, obj: dict[str, Any], owner_uid: str | None = None) -> tuple[str, dict[str, Any]]:
        """`apply`, also returning the object as the API server stored it."""
        meta = obj["metadata"]
        current = self.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        if owner_uid is not None:
            if current is None:  # a read cache holds only the owner's children: ask the API server itself
                current = Kube.get(self, obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
            check_controlled_by(current, owner_uid)
        before = current["metadata"]["resourceVersion"] if current is not None else None
        stored = self.request(
            "PATCH",
            f"{collection_path(obj['apiVersion'], obj['kind'], meta['namespace'])}/{meta['name']}",
            body=obj,
            query={"fieldManager": self.field_manager, "force": "true"},
            content_type="application/apply-patch+yaml",
        )
        if before is None:
            return "created", stored
        return ("unchanged" if before == stored["metadata"]["resourceVersion"] else "configured"), stored

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Create one object (POST); KubeError 409 when one of its name exists. For objects never updated
        afterwards (the engine-key Secret), so the operator needs no patch on them."""
        meta = obj["metadata"]
        return self.request("POST", collection_path(obj["apiVersion"], obj["kind"], meta["namespace"]), body=obj,
                            query={"fieldManager": self.field_manager})

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """One object, or None when it does not exist."""
        try:
            return self.request("GET", f"{collection_path(api_version, kind, namespace)}/{name}")
        except KubeError as err:
            if err.status == 404:
                return None
            raise

    def list(self, api_version: str, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        """Objects of one kind matching a label selector."""
        path = collection_path(api_version, kind, namespace)
        return self.request("GET", path, query={"labelSelector": selector}).get("items", [])

    def delete(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        uid: str | None = None,
        propagation: str = "Background",
    ) -> bool:
        """Delete one object; False when it was already gone.

        With `uid`, only that incarnation is deleted: a newer object of the same name is kept (False).
        `propagation="Foreground"` keeps the object (with a deletionTimestamp) until its dependents are gone.
        """
        path = f"{collection_path(api_version, kind, namespace)}/{name}"
        body: dict[str, Any] = {"propagationPolicy": propagation}
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            self.request("DELETE", path, body=body)
        except KubeError as err:
            if err.status == 404 or (uid and err.status == 409):
                return False
            raise
        return True

    def get_rljob(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The RLJob, or None when it no longer exists."""
        try:
            return self.request("GET", f"{collection_path(f'{API_GROUP}/{API_VERSION}', KIND, namespace)}/{name}")
        except KubeError as err:
            if err.status == 404:
                return None
            raise

    def apply_rljob_status(self, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply of the status subresource as this field manager.

        `status` is everything this manager owns: fields it owned before and leaves out are removed
        (unless another manager owns them too); fields of other managers are never touched.
        """
        path = f"{collection_path(f'{API_GROUP}/{API_VERSION}', KIND, namespace)}/{name}/status"
        body = {
            "apiVersion": f"{API_GROUP}/{API_VERSION}",
            "kind": KIND,
            "metadata": {"name": name, "namespace": namespace},
            "status": status,
        }
        return self.request(
            "PATCH",
            path,
            body=body,
            query={"fieldManager": self.field_manager, "force": "true"},
            content_type="application/apply-patch+yaml",
        )

    def post_event(self, job: dict[str, Any], type_: str, reason: str, message: str) -> None:
        """Record a core/v1 Event on the RLJob (best effort: an Event must never fail a reconcile)."""
        meta = job["metadata"]
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": job.get("apiVersion", f"{API_GROUP}/{API_VERSION}"),
                "kind": KIND,
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta["uid"],
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": self.field_manager},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self.request("POST", collection_path("v1", "Event", meta["namespace"]), body=event)
        except (KubeError, OSError) as err:
            log.warning("could not post Event %s on %s/%s: %s", reason, meta["namespace"], meta["name"], err)


_shared: Kube | None = None
_shared_lock = threading.Lock()


def shared_kube() -> Kube:
    """One Kube per process (the ApiClient holds a connection pool)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = Kube(load_api_client())
        return _shared
