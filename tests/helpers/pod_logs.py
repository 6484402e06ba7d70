"""Keep every container log of a namespace while a test runs, for pods that are gone by the time it fails.

A restarted trainer gang replaces its pods (the operator deletes the trainer Job and makes a new one), and
the kubelet deletes a pod's logs with the pod. A rank that crashed in the first gang is then unreadable
when the test's diagnostics run. The recorder follows each container's log from the moment it starts,
into one file per container incarnation, so the diagnostics can print the logs of pods that went.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client as k8s
from kubernetes import watch

# Bytes of a gone pod's log that the diagnostics print (its end: where it stopped, and why).
TAIL_BYTES = 6000


@dataclass
class PodLogRecorder:
    """Follows the logs of every container started in `namespace` into `folder` until `stop()`."""

    core: k8s.CoreV1Api
    namespace: str
    folder: Path
    _followed: set[str] = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        """Watch the namespace's pods in a background thread."""
        self.folder.mkdir(parents=True, exist_ok=True)
        threading.Thread(target=self._watch, name="pod-log-watch", daemon=True).start()

    def stop(self) -> None:
        """Stop watching; the followers end with their streams (a pod deleted, or the namespace)."""
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                # Short server-side timeouts, so that stop() is seen within seconds.
                for event in watch.Watch().stream(self.core.list_namespaced_pod, self.namespace, timeout_seconds=5):
                    self._follow_started(event["object"])
                    if self._stop.is_set():
                        return
            except Exception:  # noqa: BLE001 - a diagnostic aid: the API server restarting must not fail a test
                self._stop.wait(1)

    def _follow_started(self, pod: Any) -> None:
        statuses = list(pod.status.init_container_statuses or []) + list(pod.status.container_statuses or [])
        for status in statuses:
            if status.state.running is None and status.state.terminated is None:
                continue
            key = f"{pod.metadata.name}.{status.name}.{status.restart_count}"
            if key in self._followed:  # only the watch thread reads and writes the set
                continue
            self._followed.add(key)
            threading.Thread(target=self._follow, args=(pod.metadata.name, status.name, key), daemon=True).start()

    def _follow(self, pod: str, container: str, key: str) -> None:
        path = self.folder / f"{key}.log"
        try:
            stream = self.core.read_namespaced_pod_log(pod, self.namespace, container=container, follow=True,
                                                       _preload_content=False)
            with path.open("wb") as out:
                for chunk in stream.stream(4096):
                    out.write(chunk)
                    out.flush()
        except Exception as exc:  # noqa: BLE001 - the pod went before its log could be read: say so
            with path.open("a") as out:
                out.write(f"\n[log follower: {exc!r}]\n")

    def gone_tails(self, present: set[str]) -> dict[str, str]:
        """The end of each recorded log whose pod is not in `present`, by file name."""
        tails = {}
        for path in sorted(self.folder.glob("*.log")):
            if path.name.rsplit(".", 3)[0] not in present:  # <pod>.<container>.<restarts>.log
                data = path.read_bytes()
                tails[path.name] = data[-TAIL_BYTES:].decode(errors="replace")
        return tails
