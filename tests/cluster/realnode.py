"""The real node of the local cluster: start a control plane with one, load images, run pods.

`start_real_cluster()` runs `localkube.sh up --real-node` (see docs/development.md, "The real node"):
a kubelet, containerd, kube-proxy, CoreDNS and kube-router (enforcing NetworkPolicies) in a network
and mount namespace of their own, beside
kwok's fake nodes. There is one real node per machine; a second test run on the same machine waits
for the first one's node to stop (machine-wide lock), it does not break it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client as k8s

from tests.cluster import images
from tests.cluster.binaries import binary_path
from tests.cluster.kube import STOP_GRACE_REAL_NODE_S, KubeCluster, start_cluster, wait_until

REAL_NODE_BINARIES = ("nodekube", "cni-plugins", "coredns", "kube-router", "pause", "containerd", "runc", "busybox")
NODE_ROOT = Path("/var/lib/rljob-real-node")
CGROUP_NAME = "rljob-real-node"
# Images every real-node test session loads at start (more with RealCluster.load_image).
DEFAULT_IMAGES = ("busybox", "base-python", "operator")
# The real node's startup budget once it holds the machine's lock: images, containerd, kubelet.
READY_TIMEOUT_S = 420.0


@dataclass
class RealCluster:
    """A control plane with one real node (`node`) and kwok's fake GPU nodes."""

    cluster: KubeCluster
    node: str
    containerd_socket: Path
    node_netns: Path  # the node's network namespace (/proc/<pid>/ns/net)
    images: dict[str, str] = field(default_factory=dict)  # image name -> reference in containerd

    def ctr(self, *args: str, timeout: float = 600) -> str:
        ctr = binary_path("containerd") / "ctr"
        out = subprocess.run(
            [str(ctr), "--address", str(self.containerd_socket), "-n", "k8s.io", *args],
            capture_output=True, text=True, timeout=timeout, check=True,
        )
        return out.stdout

    def in_node_network(self, *command: str) -> str:
        """Run `command` in the node's network namespace and return its output: `iptables-save -t filter`
        and `ipset save` show what kube-router programmed for the NetworkPolicies."""
        out = subprocess.run(["nsenter", f"--net={self.node_netns}", "--", *command],
                             capture_output=True, text=True, timeout=60, check=True)
        return out.stdout

    def load_image(self, name: str) -> str:
        """Build (cached) and import an image from tests/cluster/images.py; return its reference."""
        if name not in self.images:
            img = images.build(name)
            self.ctr("images", "import", str(img.archive))
            self.images[name] = img.ref
        return self.images[name]

    def run_pod(self, namespace: str, name: str, containers: list[dict[str, Any]],
                labels: dict[str, str] | None = None, **spec: Any) -> None:
        """Create a bare pod on the real node (no restarts unless `restartPolicy` says otherwise)."""
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": labels or {}},
            "spec": {"nodeName": self.node, "restartPolicy": "Never", "containers": containers, **spec},
        }
        self.cluster.core().create_namespaced_pod(namespace, body)

    def wait_phase(self, namespace: str, name: str, phases: set[str], timeout: float = 120) -> k8s.V1Pod:
        core = self.cluster.core()

        def check() -> k8s.V1Pod | None:
            pod = core.read_namespaced_pod(name, namespace)
            return pod if pod.status.phase in phases else None

        try:
            return wait_until(check, timeout, f"pod {namespace}/{name} in {sorted(phases)}", interval=0.5)
        except TimeoutError as exc:
            pod = core.read_namespaced_pod(name, namespace)
            raise TimeoutError(f"{exc}; status: {pod.status}") from exc

    def logs(self, namespace: str, name: str, container: str | None = None) -> str:
        args = ["logs", "-n", namespace, name] + ([f"-c={container}"] if container else [])
        return self.cluster.kubectl(*args).stdout

    def stop(self) -> None:
        self.cluster.stop(grace=STOP_GRACE_REAL_NODE_S)


def mounted_runtime() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Volumes and mounts that give a `runtime-thin` container this test run's installed runtime.

    All read-only hostPath mounts at the host's own paths: the virtualenv (also at /opt/rljob, the
    image's PATH entry), its base interpreter (the venv's `bin/python` links there) and the repository
    (the editable install maps `rljob.*` to its folders). See RUNTIME_UNCOVERED in tests/cluster/images.py.
    """
    repo, venv = Path(__file__).resolve().parents[2], Path(sys.prefix)
    paths = {"repo": repo, "venv-opt": venv, "python": Path(sys.base_prefix)}
    targets = {"repo": str(repo), "venv-opt": "/opt/rljob", "python": str(sys.base_prefix)}
    if not venv.is_relative_to(repo):  # a venv inside the repository comes with the repository's mount
        paths["venv"], targets["venv"] = venv, str(venv)
    volumes = [{"name": f"rt-{k}", "hostPath": {"path": str(v), "type": "Directory"}} for k, v in paths.items()]
    mounts = [{"name": f"rt-{k}", "mountPath": targets[k], "readOnly": True} for k in paths]
    return volumes, mounts


def start_real_cluster(state_dir: Path, image_names: tuple[str, ...] = DEFAULT_IMAGES,
                       extra_args: tuple[str, ...] = ()) -> RealCluster:
    """A control plane plus the real node, with `image_names` built (cached) and imported.

    The fake nodes are GPU nodes with their usual NoSchedule taints and no fake CPU node, so pods
    without GPU requests land on the real node.
    """
    built = [images.build(n) for n in image_names]  # before the lock: builds may take minutes
    cluster = start_cluster(
        state_dir,
        ("--real-node", "--real-node-images", ",".join(image_names),
         "--nvidia-nodes", "1", "--amd-nodes", "1", "--cpu-nodes", "0", "--taint-gpu-nodes", *extra_args),
        ready_timeout=READY_TIMEOUT_S,
    )
    return RealCluster(
        cluster=cluster,
        node=cluster.info["realNode"],
        containerd_socket=Path(cluster.info["containerdSocket"]),
        node_netns=Path(cluster.info["nodeNetns"]),
        images={img.name: img.ref for img in built},
    )


def leftovers() -> list[str]:
    """What a stopped real node must not leave behind: its cgroups, processes and per-run state."""
    found = []
    for hierarchy in Path("/sys/fs/cgroup").iterdir():
        if (hierarchy / CGROUP_NAME).exists():
            found.append(str(hierarchy / CGROUP_NAME))
    for d in ("run", "kubelet", "log", "cni"):
        if (NODE_ROOT / d).exists():
            found.append(str(NODE_ROOT / d))
    return found


def wait_clean(timeout: float = 30) -> list[str]:
    """Leftovers still present after `timeout` seconds (empty when the teardown was clean)."""
    deadline = time.monotonic() + timeout
    while (left := leftovers()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def can_run_real_node() -> str | None:
    """Why this machine cannot run the real node, or None."""
    if os.geteuid() != 0:
        return "the real node needs root (network and mount namespaces, cgroups)"
    if not Path("/sys/fs/cgroup").exists():
        return "no cgroup filesystem"
    return None
