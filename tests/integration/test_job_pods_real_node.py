"""A job's pods on the real node, as the operator's builders render them: processes really start.

kwok marks every pod Running, so nothing there shows that a rendered container can start, load its
model and pass its probes. Here the builder's cpu inference pool (StatefulSet + headless Service) is
applied to the real node's cluster with two changes only: the image becomes `runtime-thin` (the
runtime image's final stage) and the test run's installed virtualenv and a tiny model are mounted
read-only (`mounted_runtime()`; what that leaves untested is `RUNTIME_UNCOVERED` in
tests/cluster/images.py). The pods must pass the builder's own startup, readiness and liveness probes,
and serve `/generate` at the stable per-pod URL the trainer is given (`worker_urls`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s

from rljob.api.spec import RLJobSpec
from rljob.operator.builders import JobRef, build_children
from rljob.operator.builders.inference import worker_urls
from tests.cluster.kube import wait_until
from tests.cluster.realnode import RealCluster, mounted_runtime
from tests.helpers.tiny_model import save_tiny_model

pytestmark = [pytest.mark.realnode, pytest.mark.cluster, pytest.mark.slow]

MODEL_DIR = "/models/tiny"


def _cpu_pool_children(namespace: str, replicas: int) -> tuple[JobRef, RLJobSpec, list[dict[str, Any]]]:
    job = JobRef(name="pods", namespace=namespace, uid="00000000-0000-0000-0000-000000000001")
    spec = RLJobSpec.model_validate({
        "model": {"path": MODEL_DIR},
        "data": {"synthetic": {}},
        "rollout": {
            "engine": "sglang",
            "pools": [{"name": "cpu", "vendor": "cpu", "replicas": replicas, "extraArgs": ["--torch-threads", "1"]}],
        },
        "trainer": {"vendor": "cpu", "gpusPerReplica": 0},
    })
    wanted = [c for c in build_children(job, spec, active=True)
              if c["kind"] in ("StatefulSet", "Service") and c["metadata"]["name"] == "pods-infer-cpu"]
    assert {c["kind"] for c in wanted} == {"StatefulSet", "Service"}
    return job, spec, wanted


def _run_on_real_node(pod_spec: dict[str, Any], image: str, model: Path) -> None:
    """The two test-bed changes: the locally built image, and the runtime plus model mounted."""
    volumes, mounts = mounted_runtime()
    volumes.append({"name": "model", "hostPath": {"path": str(model), "type": "Directory"}})
    mounts.append({"name": "model", "mountPath": MODEL_DIR, "readOnly": True})
    container = pod_spec["containers"][0]
    container.update(image=image, imagePullPolicy="Never")
    container["volumeMounts"] = [*container.get("volumeMounts", []), *mounts]
    pod_spec["volumes"] = [*pod_spec.get("volumes", []), *volumes]


def test_cpu_pool_pods_pass_their_probes_and_serve(real_cluster: RealCluster, real_namespace: str,
                                                   tmp_path: Path) -> None:
    rc, ns = real_cluster, real_namespace
    image = rc.load_image("runtime-thin")
    model = save_tiny_model(tmp_path / "tiny")
    for file in model.iterdir():  # safetensors writes 0600; the server runs as uid 1000
        file.chmod(0o644)
    job, spec, children = _cpu_pool_children(ns, replicas=2)
    for child in children:
        child["metadata"].pop("ownerReferences", None)  # no RLJob object owns them here
        if child["kind"] == "StatefulSet":
            _run_on_real_node(child["spec"]["template"]["spec"], image, model)
    apps, core = k8s.AppsV1Api(rc.cluster.api), rc.cluster.core()
    for child in children:
        if child["kind"] == "Service":
            core.create_namespaced_service(ns, child)
        else:
            apps.create_namespaced_stateful_set(ns, child)

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

    # Every URL the trainer is given answers /generate, from inside the cluster (DNS of the headless
    # Service, pod network): token ids in, the requested number of token ids out.
    urls = worker_urls(job, spec.rollout)
    assert len(urls) == 2
    for url in urls:
        body = json.dumps({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}})
        script = (
            "import json,sys,urllib.request as u;"
            f"r=u.urlopen(u.Request({url + '/generate'!r},data=sys.argv[1].encode(),"
            "headers={'Content-Type':'application/json'}),timeout=60);print(r.read().decode())"
        )
        out = rc.cluster.kubectl("exec", "-n", ns, "pods-infer-cpu-0", "--", "python", "-c", script, body).stdout
        reply = json.loads(out)
        assert len(reply["output_ids"]) == 4, reply
        assert all(0 <= t < 128 for t in reply["output_ids"])
        assert reply["meta_info"]["finish_reason"]["type"] == "length"
