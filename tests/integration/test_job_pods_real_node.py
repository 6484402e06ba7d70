"""A job's pods on the real node, as the operator's builders render them: processes really start.

kwok marks every pod Running, so nothing there shows that a rendered container can start, load its
model and pass its probes. Here the builder's cpu inference pool (StatefulSet, headless Service, PDB)
is applied unchanged to the real node's cluster, with everything a user would set in the spec:
the model on a PersistentVolumeClaim (`model.path: pvc://models/tiny`, a hostPath PV bound to it),
the pods' hardening as built (non-root, read-only root filesystem, seccomp, fsGroup), and, through
`spec.pods.volumes`, the test run's installed virtualenv mounted read-only into the `runtime-thin`
image (the runtime image's final stage; what that leaves untested is `RUNTIME_UNCOVERED` in
tests/cluster/images.py). The pods must pass the builder's own startup, readiness and liveness probes,
and serve `/generate` at the URLs the runtime's discovery finds for them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s

from rljob.api.spec import RLJobSpec
from rljob.operator.builders import JobRef, build_children
from rljob.operator.builders.engine_key import engine_key_secret, new_engine_key
from rljob.runtime.engines.discovery import worker_urls
from tests.cluster.kube import wait_until
from tests.cluster.realnode import RealCluster, mounted_runtime
from tests.helpers.tiny_model import save_tiny_model

pytestmark = [pytest.mark.realnode, pytest.mark.cluster, pytest.mark.slow]

KINDS = ("StatefulSet", "Service", "PodDisruptionBudget")


def _cpu_pool_children(namespace: str, image: str, replicas: int) -> tuple[RLJobSpec, list[dict[str, Any]]]:
    """The pool's children as the operator builds them for a cpu-vendor job with its model on a claim."""
    job = JobRef(name="pods", namespace=namespace, uid="00000000-0000-0000-0000-000000000001")
    volumes, mounts = mounted_runtime()
    spec = RLJobSpec.model_validate({
        "model": {"path": "pvc://models/tiny"},
        "data": {"synthetic": {}},
        "rollout": {
            "engine": "sglang",
            "pools": [{
                "name": "cpu", "vendor": "cpu", "replicas": replicas, "image": image,
                "extraArgs": ["--torch-threads", "1"],
                # Two pods on a 2-core node: small requests; the limit leaves room for torch.
                "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "3Gi"}},
            }],
        },
        "trainer": {"vendor": "cpu", "gpusPerReplica": 0},
        "pods": {"volumes": volumes, "volumeMounts": mounts},
    })
    wanted = [c for c in build_children(job, spec, active=True)
              if c["kind"] in KINDS and c["metadata"]["name"] == "pods-infer-cpu"]
    assert sorted(c["kind"] for c in wanted) == sorted(KINDS)
    # The pods read the job's engine key from its Secret (the operator's reconcile creates it).
    wanted.insert(0, engine_key_secret(job, new_engine_key()))
    for child in wanted:
        child["metadata"].pop("ownerReferences", None)  # no RLJob object owns them here
    return spec, wanted


def read_only_claim(rc: RealCluster, namespace: str, claim: str, folder: Path) -> None:
    """PVC `claim` bound to a hostPath PV whose root is `folder` (what a storage class would provide)."""
    core = rc.cluster.core()
    pv = f"{claim}-{namespace}"[:63]
    core.create_persistent_volume({
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"], "storageClassName": "",
                 "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": str(folder), "type": "Directory"},
                 "claimRef": {"namespace": namespace, "name": claim}},
    })
    core.create_namespaced_persistent_volume_claim(namespace, {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim},
        "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": pv,
                 "resources": {"requests": {"storage": "1Gi"}}},
    })


def test_cpu_pool_pods_pass_their_probes_and_serve(real_cluster: RealCluster, real_namespace: str,
                                                   tmp_path: Path) -> None:
    rc, ns = real_cluster, real_namespace
    image = rc.load_image("runtime-thin")
    model = save_tiny_model(tmp_path / "volume" / "tiny")
    for file in model.iterdir():  # safetensors writes 0600; the server runs as uid 1000
        file.chmod(0o644)
    read_only_claim(rc, ns, "models", model.parent)  # its root holds tiny/
    spec, children = _cpu_pool_children(ns, image, replicas=2)
    apps, core = k8s.AppsV1Api(rc.cluster.api), rc.cluster.core()
    for child in children:
        if child["kind"] == "Secret":
            core.create_namespaced_secret(ns, child)
        elif child["kind"] == "Service":
            core.create_namespaced_service(ns, child)
        elif child["kind"] == "StatefulSet":
            apps.create_namespaced_stateful_set(ns, child)
        else:
            k8s.PolicyV1Api(rc.cluster.api).create_namespaced_pod_disruption_budget(ns, child)

    def all_ready() -> bool:
        sts = apps.read_namespaced_stateful_set("pods-infer-cpu", ns)
        return (sts.status.ready_replicas or 0) == 2

    try:
        # The pods' own startup budget bounds the wait: importing torch from a hostPath under load is slow.
        budget = spec.rollout.startup_budget_seconds + 60
        wait_until(all_ready, budget, "both cpu pool pods Ready (the builder's startup and readiness probes)", interval=2)
    except TimeoutError:
        print(rc.cluster.kubectl("describe", "pods", "-n", ns, check=False).stdout[-4000:])
        for i in range(2):
            print(rc.cluster.kubectl("logs", "-n", ns, f"pods-infer-cpu-{i}", "--tail=30", check=False).stdout)
        raise

    pods = core.list_namespaced_pod(ns, label_selector="rljob.io/pool=cpu").items
    assert len(pods) == 2
    for pod in pods:
        assert pod.spec.node_name == rc.node, "a cpu pool pod must land on the real node"
        status = pod.status.container_statuses[0]
        assert status.ready and status.restart_count == 0, f"{pod.metadata.name}: {status}"
        assert pod.spec.security_context.run_as_non_root is True
        assert pod.spec.containers[0].security_context.read_only_root_filesystem is True

    # Every URL the runtime's discovery finds answers /generate from inside the cluster (DNS of the
    # headless Service, pod network): token ids in, the requested number of token ids out.
    listed = core.api_client.sanitize_for_serialization(core.list_namespaced_pod(ns, label_selector="rljob.io/pool=cpu"))
    urls = worker_urls(listed["items"], ns, 30000)
    assert len(urls) == 2 and all(".pods-infer-cpu." in u for u in urls), urls
    for url in urls:
        body = json.dumps({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}})
        # One call with the job's engine key (the pod's RLJOB_ENGINE_API_KEY), one without: prints the status
        # code, then the reply.
        script = (
            "import os,sys,urllib.request as u,urllib.error as e\n"
            "h={'Content-Type':'application/json'}\n"
            "if sys.argv[2]=='key': h['Authorization']='Bearer '+os.environ['RLJOB_ENGINE_API_KEY']\n"
            f"try: r=u.urlopen(u.Request({url + '/generate'!r},data=sys.argv[1].encode(),headers=h),timeout=60)\n"
            "except e.HTTPError as x: print(x.code)\n"
            "else: print(r.status); print(r.read().decode())"
        )

        def generate(auth: str) -> list[str]:
            return rc.cluster.kubectl("exec", "-n", ns, "pods-infer-cpu-0", "--", "python", "-c", script, body,
                                      auth).stdout.splitlines()

        assert generate("none") == ["401"], "without the key the server refuses the call, as SGLang does"
        status, out = generate("key")
        assert status == "200", status
        reply = json.loads(out)
        assert len(reply["output_ids"]) == 4, reply
        assert all(0 <= t < 128 for t in reply["output_ids"])
        assert reply["meta_info"]["finish_reason"]["type"] == "length"
