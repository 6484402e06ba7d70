"""A stand-in kubelet for trainer pods on the kwok test bed.

kwok's pod stages complete every pod a Job owns at once (exit 0), which would end every RLJob the
moment its trainer Job starts. So the trainer pods of cluster tests get a node selector no node
matches (TRAINER_NODE_SELECTOR): they stay unscheduled, and this thread plays their kubelet through
the pod status subresource, as the kwok stages do for other pods. Tests then end pods the way a
kubelet would report it: `succeed`, `fail` (exit code and termination message), `shut_down` (node
graceful shutdown: DisruptionTarget, then Failed).
"""

from __future__ import annotations

import threading
from datetime import datetime, timezone
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

# spec.trainer.nodeSelector for cluster tests: no node carries this label.
TRAINER_NODE_SELECTOR = {"rljob.test/trainer-node": "simulated"}
TRAINER_SELECTOR = "rljob.io/role=trainer"


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _container(pod: k8s.V1Pod, state: dict[str, Any], ready: bool) -> dict[str, Any]:
    container = pod.spec.containers[0]
    return {"name": container.name, "image": container.image, "imageID": "", "ready": ready,
            "restartCount": 0, "started": ready, "state": state}


class SimulatedTrainerKubelet:
    """Marks new trainer pods of one namespace Running and Ready; ends them on request."""

    def __init__(self, core: k8s.CoreV1Api, namespace: str, interval: float = 0.2) -> None:
        self.core = core
        self.namespace = namespace
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"trainer-kubelet-{namespace}", daemon=True)

    def __enter__(self) -> SimulatedTrainerKubelet:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def pods(self, job: str) -> list[k8s.V1Pod]:
        """Live trainer pods of one RLJob (not being deleted), by completion index."""
        items = self.core.list_namespaced_pod(self.namespace, label_selector=f"{TRAINER_SELECTOR},rljob.io/job-name={job}").items
        live = [p for p in items if p.metadata.deletion_timestamp is None]
        return sorted(live, key=lambda p: int(p.metadata.labels.get("batch.kubernetes.io/job-completion-index", "0")))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                pods = self.core.list_namespaced_pod(self.namespace, label_selector=TRAINER_SELECTOR).items
            except (ApiException, OSError):
                continue
            for pod in pods:
                if pod.status.phase == "Pending" and pod.metadata.deletion_timestamp is None:
                    self._patch(pod, "Running", {"running": {"startedAt": _now()}}, ready=True)

    def _patch(self, pod: k8s.V1Pod, phase: str, state: dict[str, Any], ready: bool,
               conditions: list[dict[str, Any]] | None = None) -> None:
        status = "True" if ready else "False"
        conds = [{"type": t, "status": status, "lastTransitionTime": _now()} for t in ("Ready", "ContainersReady")]
        body = {"status": {"phase": phase, "conditions": conds + (conditions or []),
                           "containerStatuses": [_container(pod, state, ready)]}}
        try:
            self.core.patch_namespaced_pod_status(pod.metadata.name, self.namespace, body)
        except ApiException as exc:
            if exc.status not in (404, 409, 422):  # gone, or already terminal
                raise

    def _terminate(self, pod: k8s.V1Pod, phase: str, code: int, message: str = "",
                   conditions: list[dict[str, Any]] | None = None) -> None:
        terminated = {"exitCode": code, "reason": "Completed" if code == 0 else "Error", "message": message,
                      "startedAt": _now(), "finishedAt": _now()}
        self._patch(pod, phase, {"terminated": terminated}, ready=False, conditions=conditions)

    def succeed(self, pod: k8s.V1Pod) -> None:
        """The container exited 0."""
        self._terminate(pod, "Succeeded", 0)

    def fail(self, pod: k8s.V1Pod, code: int = 1, message: str = "") -> None:
        """The container exited `code`, leaving `message` in its termination log."""
        self._terminate(pod, "Failed", code, message)

    def shut_down(self, pod: k8s.V1Pod, message: str = "") -> None:
        """Node graceful shutdown as the kubelet reports it: DisruptionTarget, then the pod Failed."""
        disruption = {"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet",
                      "message": "Pod was terminated in response to imminent node shutdown.", "lastTransitionTime": _now()}
        self._terminate(pod, "Failed", 1, message, conditions=[disruption])
