"""A real S3-compatible store as a pod on the real node: SeaweedFS's `weed server -s3` behind a Service.

This is the object store of a cluster without egress (docs/install.md, "Models and checkpoints in the
cluster's object store"): the job's pods reach it by its Service's DNS name, with keys from a Secret,
and requests must be signed with them (the server is started with an identity list). The cached
`weed` binary (tests/cluster/binaries.py) is mounted read-only into the `base-python` image, as the
Prometheus pod's binary is. The bucket is made with `weed shell` inside the pod (the admin path); the
test's files are uploaded from the host through the node's network namespace, with the runtime's own
ObjectStore, as `aws s3 cp --recursive` would from a machine on the cluster network.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import utils

from tests.cluster.binaries import binary_path, ensure_built
from tests.cluster.kube import wait_until
from tests.cluster.realnode import RealCluster
from tests.helpers.object_store import s3_identities

NAME = "seaweedfs"
S3_PORT = 8333
MASTER = "127.0.0.1:9333"  # inside the pod: every SeaweedFS part talks to the others on loopback
# Where the cached binary is mounted (not at its host path: /root is closed to other users).
MOUNT = "/opt/seaweedfs/weed"
# SeaweedFS answers S3 within ~15 s on an idle machine; the shared 2-core box can be much slower.
START_TIMEOUT_S = 240.0


@dataclass(frozen=True)
class StoreKeys:
    """The one identity the store accepts."""

    access_key: str
    secret_key: str

    def env(self) -> dict[str, str]:
        """As the AWS variables (what the runtime's ObjectStore and the credentials Secret carry)."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key}


def manifests(namespace: str, image: str, keys: StoreKeys) -> list[dict[str, Any]]:
    """The identity list (a Secret), the pod and its Service."""
    meta = {"name": NAME, "namespace": namespace}
    config = json.dumps(s3_identities(keys.access_key, keys.secret_key))
    command = [MOUNT, "server", "-dir=/data", "-ip=127.0.0.1", "-ip.bind=0.0.0.0", "-s3", f"-s3.port={S3_PORT}",
               "-s3.config=/etc/seaweedfs/s3.json",
               # Small volumes, a fixed count (see tests/helpers/object_store.py: a disk-sized count
               # left one volume, and every PUT into the bucket's collection failed).
               "-master.volumeSizeLimitMB=64", "-volume.max=16"]
    return [
        {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "stringData": {"s3.json": config}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {**meta, "labels": {"app": NAME}},
         "spec": {
             "automountServiceAccountToken": False,
             "securityContext": {"runAsUser": 65534, "runAsGroup": 65534, "runAsNonRoot": True},
             "containers": [{
                 "name": NAME, "image": image, "imagePullPolicy": "Never", "command": command,
                 "env": [{"name": "HOME", "value": "/data"}],  # `weed shell` keeps its history there
                 "ports": [{"name": "s3", "containerPort": S3_PORT}],
                 # The S3 gateway answers /healthz only once the filer behind it is up.
                 "readinessProbe": {"httpGet": {"path": "/healthz", "port": "s3"}, "periodSeconds": 2},
                 "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "1Gi"}},
                 "volumeMounts": [{"name": "binary", "mountPath": MOUNT, "readOnly": True},
                                  {"name": "config", "mountPath": "/etc/seaweedfs", "readOnly": True},
                                  {"name": "data", "mountPath": "/data"}],
             }],
             "volumes": [{"name": "binary", "hostPath": {"path": str(binary_path("weed")), "type": "File"}},
                         {"name": "config", "secret": {"secretName": NAME}},
                         {"name": "data", "emptyDir": {}}],
         }},
        {"apiVersion": "v1", "kind": "Service", "metadata": meta,
         "spec": {"selector": {"app": NAME}, "ports": [{"name": "s3", "port": S3_PORT, "targetPort": "s3"}]}},
    ]


class SeaweedfsPod:
    """The S3 store of one namespace on the real node."""

    def __init__(self, rc: RealCluster, namespace: str) -> None:
        self.rc, self.namespace = rc, namespace
        self.keys = StoreKeys(secrets.token_hex(8), secrets.token_hex(20))

    @property
    def endpoint(self) -> str:
        """The S3 endpoint the job's pods use: the Service's cluster DNS name."""
        return f"http://{NAME}.{self.namespace}.svc.cluster.local:{S3_PORT}"

    def start(self, buckets: list[str]) -> None:
        """Create the objects, wait for the pod's readiness and make the `buckets`."""
        ensure_built(("weed",))
        objects = manifests(self.namespace, self.rc.images["base-python"], self.keys)
        utils.create_from_yaml(self.rc.cluster.api, yaml_objects=objects, namespace=self.namespace)

        def ready() -> bool:
            pod = self.rc.cluster.core().read_namespaced_pod(NAME, self.namespace)
            return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])

        wait_until(ready, START_TIMEOUT_S, f"SeaweedFS pod {self.namespace}/{NAME} ready", interval=1)
        for bucket in buckets:
            def created(bucket: str = bucket) -> bool:
                # The shell exits 0 after a command error too: success is its own report. Retried: the
                # filer the shell needs may register with the master after the gateway answers.
                out = self.rc.cluster.kubectl(
                    "exec", "-n", self.namespace, NAME, "--", "sh", "-c",
                    f"echo 's3.bucket.create -name {bucket}' | {MOUNT} shell -master={MASTER}", check=False)
                return f"created bucket {bucket}" in out.stdout

            wait_until(created, START_TIMEOUT_S, f"bucket {bucket} created in {NAME}", interval=2)

    def credentials_secret(self, name: str) -> None:
        """A Secret with the store's keys, as model.s3.credentialsSecret / checkpoint.s3 name it."""
        self.rc.cluster.core().create_namespaced_secret(self.namespace, {
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "stringData": self.keys.env()})

    def upload_folder(self, local: Path, uri: str) -> None:
        """Upload the files under `local` to `uri` (s3://bucket/folder)."""
        prefix, _, folder = uri.rstrip("/").rpartition("/")
        self._in_node(f"store({prefix!r}).upload_folder(Path({str(local)!r}), {folder!r})")

    def list_keys(self, uri: str) -> list[str]:
        """Every object key under `uri` (s3://bucket/prefix), relative to it."""
        out = self._in_node(f"print(json.dumps([f + '/' + k for f, ks in store({uri!r}).folders().items() for k in ks]))")
        return list(json.loads(out))

    def _in_node(self, statement: str) -> str:
        """Run `statement` with the runtime's ObjectStore (`store(uri)`) in the node's network namespace,
        through the pod's address (the host resolves no cluster DNS name); its standard output."""
        pod_ip = self.rc.cluster.core().read_namespaced_pod(NAME, self.namespace).status.pod_ip
        code = ("import json; from pathlib import Path; "
                "from rljob.runtime.object_store import ObjectStore, ObjectUri, StoreSettings\n"
                f"def store(uri): return ObjectStore(ObjectUri.parse(uri), StoreSettings(endpoint='http://{pod_ip}:{S3_PORT}'))\n"
                + statement)
        env = {**os.environ, **self.keys.env(), "AWS_REGION": "us-east-1"}
        done = subprocess.run(["nsenter", f"--net={self.rc.node_netns}", "--", sys.executable, "-c", code],
                              env=env, capture_output=True, text=True, timeout=300, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{statement} against {NAME} failed ({done.returncode}):\n{done.stderr[-2000:]}")
        return done.stdout
