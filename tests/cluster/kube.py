"""Start, stop and talk to the local control plane (`localkube.sh up --foreground`)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import ssl
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from tests.cluster.binaries import LOCALKUBE_SH, binary_path

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 120.0
# A real node stops its components, then kills its pods and removes their cgroups and state.
STOP_GRACE_REAL_NODE_S = 90.0
T = TypeVar("T")


class ClusterStartError(RuntimeError):
    """The control plane did not become ready; the message carries the supervisor's log tail."""


def wait_until(
    check: Callable[[], T | None], timeout: float, what: str, interval: float = 0.25
) -> T:
    """Poll `check` until it returns a truthy value and return it; raise TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


@dataclass
class KubeCluster:
    """A running localkube control plane: where it is and how to reach it."""

    state_dir: Path
    kubeconfig: Path
    server: str
    version: str
    process: subprocess.Popen[bytes]
    # The supervisor's ready file (server, kubeconfig, version; realNode, containerdSocket).
    info: dict = field(default_factory=dict)
    _api: k8s.ApiClient | None = field(default=None, repr=False)

    @property
    def api(self) -> k8s.ApiClient:
        """An admin (system:masters) API client, created once."""
        if self._api is None:
            self._api = k8s_config.new_client_from_config(
                config_file=str(self.kubeconfig)
            )
        return self._api

    def core(self) -> k8s.CoreV1Api:
        """CoreV1 API as cluster admin."""
        return k8s.CoreV1Api(self.api)

    def apps(self) -> k8s.AppsV1Api:
        """AppsV1 API as cluster admin."""
        return k8s.AppsV1Api(self.api)

    def http(self, token: str | None = None) -> httpx.Client:
        """A raw HTTPS client for the API server: admin client certificate, or `token` when given."""
        pki = self.state_dir / "pki"
        tls = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        headers: dict[str, str] = {}
        if token is None:
            tls.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
        else:
            headers["Authorization"] = f"Bearer {token}"
        return httpx.Client(
            base_url=self.server, verify=tls, headers=headers, timeout=10
        )

    def kubectl(
        self, *args: str, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run the upstream kubectl linked into localkube against this cluster."""
        return subprocess.run(
            [
                str(binary_path("localkube")),
                "kubectl",
                f"--kubeconfig={self.kubeconfig}",
                *args,
            ],
            check=check,
            capture_output=True,
            text=True,
            timeout=60,
        )

    def create_namespace(self, prefix: str = "t") -> str:
        """Create a uniquely named namespace and wait until pods can be admitted in it."""
        name = f"{prefix[:40].rstrip('-')}-{uuid.uuid4().hex[:6]}"
        core = self.core()
        core.create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name=name)))
        # The ServiceAccount admission plugin rejects pods until the controller-manager has
        # created the namespace's `default` ServiceAccount.
        wait_until(
            lambda: any(
                sa.metadata.name == "default"
                for sa in core.list_namespaced_service_account(name).items
            ),
            30,
            f"ServiceAccount default in namespace {name}",
        )
        return name

    def stop(self, grace: float = 20.0) -> None:
        """Stop the control plane (see stop_cluster)."""
        stop_cluster(self.process, self.state_dir, grace)

    def delete_namespace(self, name: str) -> None:
        """Delete a namespace without waiting for its finalization."""
        self.core().delete_namespace(name)


def _log_tail(path: Path, lines: int = 40) -> str:
    if not path.exists():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def start_cluster(
    state_dir: Path, extra_args: tuple[str, ...] = (), ready_timeout: float = READY_TIMEOUT_S
) -> KubeCluster:
    """Run `localkube.sh up --foreground` in its own process group and wait until it is ready.

    With `--real-node` the wait does not count the time spent queueing for the machine's real-node
    lock (another test run's real node), which the supervisor flags with a file in `state_dir`.
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    log_path = state_dir.parent / f"{state_dir.name}.log"
    env = {**os.environ, "LOCALKUBE_DIR": str(state_dir)}
    with log_path.open("wb") as out:
        proc = subprocess.Popen(
            # --exit-with-parent: a killed test run must not leave the plane running.
            [
                str(LOCALKUBE_SH),
                "up",
                "--foreground",
                "--exit-with-parent",
                *extra_args,
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    ready = state_dir / "ready"
    waiting = state_dir / "waiting-for-real-node-lock"
    try:
        deadline = time.monotonic() + ready_timeout
        queued = False
        while not ready.exists() and proc.poll() is None:
            if waiting.exists():
                # Queued behind another run's real node: the supervisor waits (with its own
                # timeout), and the startup budget begins once it holds the lock.
                if not queued:
                    log.warning("waiting for another real node on this machine to stop: %s",
                                waiting.read_text(errors="replace").strip())
                queued = True
                deadline = time.monotonic() + ready_timeout
            elif time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {ready_timeout:.0f} s waiting for localkube ready file")
            time.sleep(0.25)
        if proc.poll() is not None:
            raise ClusterStartError(
                f"localkube exited with {proc.returncode}:\n{_log_tail(log_path)}"
            )
        info = json.loads(ready.read_text())
        cluster = KubeCluster(
            state_dir=state_dir,
            kubeconfig=Path(info["kubeconfig"]),
            server=info["server"],
            version=info["version"],
            process=proc,
            info=info,
        )
        with cluster.http() as http:
            wait_until(lambda: _readyz(http), 30, "/readyz")
    except (TimeoutError, ClusterStartError) as exc:
        stop_cluster(proc, state_dir, STOP_GRACE_REAL_NODE_S if "--real-node" in extra_args else 20.0)
        raise ClusterStartError(
            f"{exc}\nsupervisor log {log_path}:\n{_log_tail(log_path)}\ncomponent logs: {state_dir / 'logs'}"
        ) from exc
    log.info("localkube %s ready at %s", cluster.version, cluster.server)
    return cluster


def _readyz(http: httpx.Client) -> bool:
    try:
        return http.get("/readyz").text == "ok"
    except httpx.HTTPError:
        return False


def stop_cluster(
    proc: subprocess.Popen[bytes], state_dir: Path, grace: float = 20.0
) -> None:
    """SIGTERM the supervisor's process group, SIGKILL it after `grace`, and drop etcd's tmpfs data."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            log.warning(
                "localkube did not stop within %.0f s; killing its process group", grace
            )
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        except ProcessLookupError:
            pass
    # The supervisor deletes etcd's data itself on a clean stop; this covers a killed or failed one.
    etcd_dir_file = state_dir / "etcd-dir"
    if etcd_dir_file.exists():
        shutil.rmtree(etcd_dir_file.read_text().strip(), ignore_errors=True)
