"""What the operator costs at scale: N RLJobs applied at once on a local control plane with fake nodes.

    python benchmarks/operator_scale.py --nodes 1000 --jobs 10 100 1000   # writes docs/benchmarks/operator_scale.*

A private control plane (etcd, kube-apiserver, controllers, scheduler; tests/cluster) gets `--nodes`
kwok nodes (40 % NVIDIA, 30 % AMD, 30 % CPU, 8 GPUs per GPU node). Stated simplification: the
benchmark's nodes are played by a second kwok process whose node leases last `--node-lease-seconds`
(default 240 s, renewed every quarter of that: about 17 Lease updates/s for 1,000 nodes instead of the
100/s of localkube's 40 s leases, which alone load a 2-core API server); the controller manager's
120 s grace period still sees every node alive, and the run reports how many stayed Ready. For each job count the operator
(`python -m rljob.operator -n bench-N`) runs as its own process; the RLJobs (two pools on both GPU
vendors, a CPU trainer, a pre-bound checkpoint volume) are created from a thread pool at once.
Each job count runs two variants, one after the other on the same control plane:

- `operator`: the operator applies the children, as in production;
- `floor`: no operator; a bare client applies the same children with the same concurrency (8 jobs at
  a time, 8 requests per job, workloads after what they use) and nothing else: no cache, status,
  Events or kopf. Its apply -> children is what this machine's API server and controllers allow, the
  floor under the operator's number.

Reported per run:

- apply -> all children created (18 per job), apply -> phase Running (kwok makes pods Ready at once): p50, p99;
- the operator's CPU seconds and RSS (from /proc) at the end of the ramp and at steady state;
- API requests per second per job at steady state, two ways: the reconcile's own requests
  (`rljob_operator_api_requests_total`, the operator's client-side counter), and the requests the API
  server counted (`apiserver_request_total`) with the operator running minus the same rate after it
  stopped, leaving out watches and the fake nodes' own Lease and Node traffic, which is the noise
  that hid the operator's share before (so kopf's own requests count too, and kwok's not).

Timestamps come from watches started before the first apply, on this machine's clock.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# Appended, not prepended: the repository's `operator/` folder must not shadow the standard library's.
sys.path.append(str(REPO))

from machine_info import describe, load_average  # noqa: E402

from tests.cluster.kube import KubeCluster, start_cluster  # noqa: E402
from tests.helpers.trainer_pods import TRAINER_NODE_SELECTOR, SimulatedTrainerKubelet  # noqa: E402

GROUP, VERSION, PLURAL = "rljob.io", "v1alpha1", "rljobs"
MANAGED = "app.kubernetes.io/managed-by=rljob-operator"
TICKS = os.sysconf("SC_CLK_TCK")


def rljob(name: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "RLJob",
        "metadata": {"name": name},
        "spec": {
            "model": {"huggingFace": "Qwen/Qwen3-0.6B"},
            "data": {"synthetic": {"numPrompts": 64}},
            "rollout": {
                "rolloutBatchSize": 4,
                "pools": [
                    # 2 NVIDIA + 1 AMD GPU per job: 1,000 jobs fit on 1,000 nodes (3,200 + 2,400 GPUs).
                    {"name": "nv", "vendor": "nvidia", "replicas": 1, "gpusPerReplica": 2, "tensorParallelSize": 2},
                    {"name": "mi", "vendor": "amd", "replicas": 1, "gpusPerReplica": 1},
                ],
            },
            # kwok completes a Job's pods at once: the trainer pods stay unscheduled and
            # SimulatedTrainerKubelet keeps them Running, as in the cluster tests.
            "trainer": {"vendor": "cpu", "gpusPerReplica": 0, "nodeSelector": TRAINER_NODE_SELECTOR},
        },
    }


def children_per_job() -> int:
    """How many children the operator builds for `rljob(...)` (what "all children created" waits for)."""
    from rljob.api.spec import RLJobSpec
    from rljob.operator.builders import JobRef, build_children

    body = rljob("probe")
    ref = JobRef(name="probe", namespace="bench", uid="u")
    return len(build_children(ref, RLJobSpec.model_validate(body["spec"]), active=True))


CHILDREN_PER_JOB = children_per_job()


def proc_usage(pid: int) -> tuple[float, float]:
    """(CPU seconds user+system, RSS MiB) of a process and its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / TICKS
    rss_kib = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("VmRSS"))
    return cpu, rss_kib / 1024


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return round(ordered[k], 3)


# The children's kinds, as the watcher streams them (apiVersion, kind).
CHILD_KINDS = (
    ("batch/v1", "Job"), ("policy/v1", "PodDisruptionBudget"), ("apps/v1", "StatefulSet"), ("apps/v1", "Deployment"),
    ("v1", "Service"), ("v1", "ConfigMap"), ("v1", "ServiceAccount"), ("v1", "PersistentVolumeClaim"),
    ("rbac.authorization.k8s.io/v1", "Role"), ("rbac.authorization.k8s.io/v1", "RoleBinding"),
)


class Watcher:
    """First-seen times of every managed child and of each RLJob reaching phase Running.

    Raw watch streams (one per kind, JSON lines read with httpx, nothing decoded but each event's JSON):
    the kubernetes client's typed watches, which build a model object per event, took a third of a
    core at 1,000 jobs and fell minutes behind the API server, so they measured themselves. A stream
    that ends resumes from the last resourceVersion it saw (bookmarks included): restarting from
    nothing made the server send every existing object again each minute, a load of its own that at
    1,000 jobs kept the streams from ever catching up.
    """

    def __init__(self, cluster: KubeCluster, namespace: str) -> None:
        from rljob.common.kube import collection_path

        self.cluster = cluster
        self.namespace = namespace
        self.created: dict[str, dict[str, float]] = {}  # job -> child key -> time
        self.running: dict[str, float] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        paths = [(kind, collection_path(v, kind, namespace), MANAGED) for v, kind in CHILD_KINDS]
        paths.append(("RLJob", f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}", ""))
        self.threads = [threading.Thread(target=self._retrying, args=p, daemon=True) for p in paths]
        self.versions: dict[str, str] = {}  # path -> last resourceVersion seen (each path: one thread)

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def _retrying(self, kind: str, path: str, selector: str) -> None:
        """Restart a watch that ended or failed (a loaded API server answers 504 or ends the stream) from
        the last resourceVersion seen; after a 410 Gone, from nothing (the server then sends every
        existing object again; first-seen times are kept)."""
        while not self.stop.is_set():
            try:
                self._watch(kind, path, selector)
            except Exception:  # noqa: BLE001 (any stream failure: start over)
                time.sleep(0.5)

    def _watch(self, kind: str, path: str, selector: str) -> None:
        import httpx

        params = {"watch": "1", "allowWatchBookmarks": "true", "timeoutSeconds": "300"}
        if selector:
            params["labelSelector"] = selector
        if path in self.versions:
            params["resourceVersion"] = self.versions[path]
        with self.cluster.http() as http, http.stream(
            "GET", path, params=params, timeout=httpx.Timeout(10.0, read=330.0)
        ) as response:
            if response.status_code == 410:
                self.versions.pop(path, None)
                return
            response.raise_for_status()
            for line in response.iter_lines():
                if self.stop.is_set():
                    return
                if not line:
                    continue
                event = json.loads(line)
                obj = event.get("object") or {}
                if event.get("type") == "ERROR":
                    if obj.get("code") == 410:  # too old: start over with the current state
                        self.versions.pop(path, None)
                    return
                rv = (obj.get("metadata") or {}).get("resourceVersion")
                if rv:
                    self.versions[path] = rv
                if event.get("type") != "BOOKMARK":
                    self._seen(kind, obj)

    def _seen(self, kind: str, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        now = time.time()
        with self.lock:
            if kind == "RLJob":
                if (obj.get("status") or {}).get("phase") == "Running":
                    self.running.setdefault(meta["name"], now)
                return
            job = (meta.get("labels") or {}).get("rljob.io/job-name")
            if job:
                self.created.setdefault(job, {}).setdefault(f"{kind}/{meta['name']}", now)

    def all_created(self, job: str) -> float | None:
        with self.lock:
            seen = self.created.get(job, {})
            return max(seen.values()) if len(seen) >= CHILDREN_PER_JOB else None


@contextmanager
def progress(label: str, total: int) -> Iterator[Callable[[int], None]]:
    """A rich progress bar on stderr; yields `update(done)`."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as bar:
        task = bar.add_task(label, total=total)
        yield lambda done: bar.update(task, completed=done)


# The fake nodes' heartbeats (kwok) and the controllers' view of them: not the operator's load.
NODE_TRAFFIC = ('resource="leases"', 'resource="nodes"')


def apiserver_requests(cluster: KubeCluster) -> float:
    """Requests the API server served so far, watches and node heartbeat traffic excluded."""
    with cluster.http() as http:
        text = http.get("/metrics").text
    total = 0.0
    for line in text.splitlines():
        if (
            line.startswith("apiserver_request_total{")
            and 'verb="WATCH"' not in line
            and not any(t in line for t in NODE_TRAFFIC)
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


def start_node_kwok(cluster: KubeCluster, lease_s: int, log_path: Path) -> subprocess.Popen[bytes]:
    """A kwok process playing the benchmark's nodes (annotation kwok.x-k8s.io/node=bench) with longer leases."""
    kwok = subprocess.run(
        [str(REPO / "tests" / "cluster" / "localkube.sh"), "path", "kwok"], check=True, capture_output=True, text=True
    ).stdout.strip()
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [kwok, f"--kubeconfig={cluster.kubeconfig}", f"--config={cluster.state_dir / 'kwok-stages.yaml'}",
             "--manage-all-nodes=false", f"--manage-nodes-with-annotation-selector={BENCH_NODE_ANNOTATION}",
             "--cidr=10.248.0.0/16", "--node-ip=127.0.0.1", f"--node-lease-duration-seconds={lease_s}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )


def phases(cluster: KubeCluster, namespace: str) -> dict[str, int]:
    """How many RLJobs of the namespace are in each phase now."""
    from kubernetes import client as k8s

    items = k8s.CustomObjectsApi(cluster.api).list_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, _request_timeout=300
    )["items"]
    counts: dict[str, int] = {}
    for item in items:
        phase = (item.get("status") or {}).get("phase") or "none"
        counts[phase] = counts.get(phase, 0) + 1
    return dict(sorted(counts.items()))


def pods_hit_by_node_not_ready(cluster: KubeCluster, namespace: str) -> int:
    """Pods the node controller marked not ready because their fake node missed its heartbeats (the
    `NodeNotReady` Events): kwok never makes such a pod Ready again, so its job stays Degraded."""
    events = cluster.core().list_namespaced_event(
        namespace, field_selector="reason=NodeNotReady", _request_timeout=300
    ).items
    return len({e.involved_object.name for e in events})


def best_effort(what: str, read: Callable[[], Any]) -> Any:
    """A figure read after the ramp, or None when the API server cannot answer it: an overloaded one
    (1,000 jobs on 2 cores) drops long lists, and one lost figure must not lose the whole run's."""
    try:
        return read()
    except Exception as err:  # noqa: BLE001 (any client or server failure)
        print(f"could not read {what}: {err}", file=sys.stderr, flush=True)
        return None


def nodes_ready(cluster: KubeCluster) -> int:
    nodes = cluster.core().list_node(_request_timeout=120).items
    return sum(any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or []) for n in nodes)


def operator_requests_by_verb(metrics_port: int) -> dict[str, float]:
    """The reconcile's own requests so far (`rljob_operator_api_requests_total`), by HTTP verb."""
    import httpx

    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    pattern = r'^rljob_operator_api_requests_total\{verb="([^"]*)"\} (\S+)$'
    return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, text, re.M)}


def operator_requests(metrics_port: int) -> float:
    return sum(operator_requests_by_verb(metrics_port).values())


NODE_LABELS = {
    "nv": {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
           "nvidia.com/gpu.count": "8", "rljob.io/accelerator": "nvidia"},
    "amd": {"amd.com/gpu.present": "true", "amd.com/gpu.product-name": "AMD_Instinct_MI300X_OAM",
            "amd.com/gpu.family": "AI", "rljob.io/accelerator": "amd"},
    "cpu": {},
}
GPU_RESOURCE = {"nv": "nvidia.com/gpu", "amd": "amd.com/gpu"}
BENCH_NODE_ANNOTATION = "kwok.x-k8s.io/node=bench"


def add_fake_nodes(cluster: KubeCluster, counts: dict[str, int]) -> float:
    """Create kwok nodes (as tests/cluster/localkube/nodes.go shapes them) up to `counts` per pool; wait
    until all are Ready. Returns the seconds it took. (localkube's own start-up wait checks each node
    with one GET inside one second, which 1,000 nodes cannot pass on a loaded machine.)"""
    core = cluster.core()
    start = time.time()
    existing = {n.metadata.name for n in core.list_node().items}

    def create(name: str, pool: str) -> None:
        capacity = {"cpu": "64", "memory": "1Ti", "pods": "110"}
        if pool in GPU_RESOURCE:
            capacity[GPU_RESOURCE[pool]] = "8"
        labels = {"type": "kwok", "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                  "kubernetes.io/arch": "amd64", **NODE_LABELS[pool]}
        core.create_node({"apiVersion": "v1", "kind": "Node",
                          "metadata": {"name": name, "labels": labels, "annotations": {"kwok.x-k8s.io/node": "bench"}},
                          "status": {"capacity": capacity, "allocatable": capacity}})

    wanted = [(f"{pool}-{i}", pool) for pool, n in counts.items() for i in range(n)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda item: create(*item), [w for w in wanted if w[0] not in existing]))
    total = sum(counts.values())
    while nodes_ready(cluster) < total:
        time.sleep(5)
    return time.time() - start


def create_volumes(cluster: KubeCluster, namespace: str, jobs: list[str]) -> None:
    core = cluster.core()
    for job in jobs:
        core.create_persistent_volume({
            "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"{namespace}-{job}"},
            "spec": {"capacity": {"storage": "10Gi"}, "accessModes": ["ReadWriteOnce"],
                     "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": f"/tmp/rljob-bench/{job}"},
                     "claimRef": {"namespace": namespace, "name": f"{job}-checkpoints"}},
        })


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_namespace_gone(cluster: KubeCluster, namespace: str, timeout_s: float) -> float:
    """Delete a namespace and wait until it is gone (its objects' deletion would load the next run)."""
    from kubernetes.client.rest import ApiException

    start = time.time()
    cluster.delete_namespace(namespace)
    while time.time() - start < timeout_s:
        try:
            cluster.core().read_namespace(namespace)
        except ApiException as err:
            if err.status == 404:
                break
        time.sleep(2.0)
    return time.time() - start


class BareApplier:
    """The floor variant: apply each job's children as the operator does, with nothing else around it.

    `jobs` jobs at a time (kopf's workers), `per_job` requests at a time within a job, workloads after
    the objects they use; one server-side apply per child and no read before it.
    """

    def __init__(self, cluster: KubeCluster, jobs: int = 8, per_job: int = 8) -> None:
        from rljob.common.kube import Kube, load_api_client

        self.kube = Kube(load_api_client(pool_maxsize=jobs * per_job))
        self.jobs = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="job")
        self.requests = ThreadPoolExecutor(max_workers=jobs * per_job, thread_name_prefix="apply")
        self.per_job = per_job
        self.futures: list[Any] = []

    def submit(self, body: dict[str, Any]) -> None:
        """Queue one created RLJob (its stored body, uid included)."""
        self.futures.append(self.jobs.submit(self._apply_job, body))

    def _apply_job(self, body: dict[str, Any]) -> None:
        from rljob.api.spec import RLJobSpec
        from rljob.common.kube import collection_path
        from rljob.operator.builders import JobRef, build_children

        children = build_children(JobRef.from_body(body), RLJobSpec.model_validate(body["spec"]), active=True)
        workloads = ("StatefulSet", "Deployment", "Job")

        def apply(obj: dict[str, Any]) -> None:
            meta = obj["metadata"]
            self.kube.request(
                "PATCH", f"{collection_path(obj['apiVersion'], obj['kind'], meta['namespace'])}/{meta['name']}",
                body=obj, query={"fieldManager": "bench-floor", "force": "true"},
                content_type="application/apply-patch+yaml",
            )

        for wave in ([c for c in children if c["kind"] not in workloads], [c for c in children if c["kind"] in workloads]):
            # `per_job` at a time, as the operator's APPLY_CONCURRENCY
            for i in range(0, len(wave), self.per_job):
                list(self.requests.map(apply, wave[i : i + self.per_job]))

    def close(self) -> None:
        for future in self.futures:
            future.result()
        self.jobs.shutdown()
        self.requests.shutdown()


def start_operator(cluster: KubeCluster, namespace: str, resync_s: float, log_path: Path) -> tuple[subprocess.Popen[bytes], int]:
    """`python -m rljob.operator` for one namespace, waited for until its liveness answers; (process, metrics port)."""
    import httpx

    metrics_port, liveness_port = free_port(), free_port()
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    with log_path.open("wb") as log:
        op = subprocess.Popen(
            [sys.executable, "-m", "rljob.operator", "-n", namespace, "--metrics-port", str(metrics_port),
             "--metrics-addr", "127.0.0.1", "--liveness", f"http://127.0.0.1:{liveness_port}/healthz",
             "--resync-seconds", str(resync_s)],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd="/", start_new_session=True,
        )
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{liveness_port}/healthz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or op.poll() is not None:
            raise RuntimeError(f"operator did not start; see {log_path}")
        time.sleep(0.5)
    # kopf's RLJob watch is up once it has logged its first probe; give it a moment, then measure from idle.
    time.sleep(3.0)
    return op, metrics_port


def stop_operator(op: subprocess.Popen[bytes]) -> None:
    op.send_signal(signal.SIGTERM)
    try:
        op.wait(timeout=30)
    except subprocess.TimeoutExpired:  # kopf waits for running handlers; the baseline needs it gone
        os.killpg(op.pid, signal.SIGKILL)
        op.wait(timeout=30)


def run_one(
    cluster: KubeCluster, variant: str, n_jobs: int, steady_s: float, resync_s: float, timeout_s: float, log_dir: Path,
    drain: bool = True,
) -> dict[str, Any]:
    """One variant (`operator` or `floor`) with `n_jobs` RLJobs applied at once; its figures as a dict.

    `drain`: delete the run's namespace and wait until it is gone, so the next run starts on a quiet
    control plane (minutes: the namespace controller's pace, not the object count); the last run skips it."""
    namespace = cluster.create_namespace(f"bench-{variant}-{n_jobs}")
    jobs = [f"j{i:04d}" for i in range(n_jobs)]
    create_volumes(cluster, namespace, jobs)
    # Through the baseline window too: its one LIST a second is in both request rates and cancels out.
    kubelet = SimulatedTrainerKubelet(cluster.core(), namespace, interval=1.0).__enter__()
    op: subprocess.Popen[bytes] | None = None
    bare = BareApplier(cluster) if variant == "floor" else None
    try:
        if variant == "operator":
            op, metrics_port = start_operator(cluster, namespace, resync_s, log_dir / f"operator-{n_jobs}.log")
            idle_cpu, idle_rss = proc_usage(op.pid)
            idle_requests = operator_requests_by_verb(metrics_port)
        watcher = Watcher(cluster, namespace)
        watcher.start()
        time.sleep(1.0)  # watches established before the first apply
        from kubernetes import client as k8s

        custom = k8s.CustomObjectsApi(cluster.api)
        applied: dict[str, float] = {}

        def apply(job: str) -> None:
            start = time.time()
            body = custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, rljob(job))
            applied[job] = start
            if bare is not None:
                bare.submit(body)

        ramp_start = time.time()
        with ThreadPoolExecutor(max_workers=16) as pool:
            list(pool.map(apply, jobs))
        deadline = time.monotonic() + timeout_s
        with progress(f"{variant}, {n_jobs} jobs", n_jobs) as bar:
            while time.monotonic() < deadline:
                done = len(watcher.running) if op is not None else sum(watcher.all_created(j) is not None for j in jobs)
                bar(done)
                if done >= n_jobs:
                    break
                time.sleep(1.0)
        ramp_s = time.time() - ramp_start
        to_children = [t - applied[j] for j in jobs if (t := watcher.all_created(j)) is not None]
        result: dict[str, Any] = {
            "variant": variant,
            "jobs": n_jobs,
            "created": len(applied),
            "all_children_created": len(to_children),
            "apply_to_children_s": {"p50": percentile(to_children, 50), "p99": percentile(to_children, 99)},
            "ramp_s": round(ramp_s, 1),
            "pods_hit_by_node_not_ready": best_effort("NodeNotReady events", lambda: pods_hit_by_node_not_ready(cluster, namespace)),
        }
        if op is None:
            watcher.stop.set()
            return result | {"nodes_ready_end": best_effort("nodes", lambda: nodes_ready(cluster)), "load_average_end": load_average()}
        ramp_cpu, ramp_rss = proc_usage(op.pid)
        ramp_requests = {
            verb: round((count - idle_requests.get(verb, 0.0)) / n_jobs, 1)
            for verb, count in sorted(operator_requests_by_verb(metrics_port).items())
        }
        to_ready = [watcher.running[j] - applied[j] for j in jobs if j in watcher.running]

        # Steady state: every job Running, nothing changing; the resync timer keeps working.
        api_before, op_before, cpu_before, t0 = apiserver_requests(cluster), operator_requests(metrics_port), proc_usage(op.pid)[0], time.time()
        time.sleep(steady_s)
        api_after, op_after, (cpu_after, steady_rss), t1 = (
            apiserver_requests(cluster), operator_requests(metrics_port), proc_usage(op.pid), time.time()
        )
        with_operator = (api_after - api_before) / (t1 - t0)
        watcher.stop.set()
        stop_operator(op)
        base_before, b0 = apiserver_requests(cluster), time.time()
        time.sleep(steady_s)
        baseline = (apiserver_requests(cluster) - base_before) / (time.time() - b0)
        return result | {
            "running": len(to_ready),
            "phases_end": best_effort("phases", lambda: phases(cluster, namespace)),
            "apply_to_running_s": {"p50": percentile(to_ready, 50), "p99": percentile(to_ready, 99)},
            "operator_idle": {"rss_mib": round(idle_rss, 1), "cpu_s": round(idle_cpu, 2)},
            "operator_after_ramp": {"rss_mib": round(ramp_rss, 1), "cpu_s": round(ramp_cpu - idle_cpu, 2)},
            # What starting one job cost the reconcile, by verb (kopf's own patches not included).
            "ramp_requests_per_job": ramp_requests,
            "steady": {
                "seconds": round(t1 - t0, 1),
                "rss_mib": round(steady_rss, 1),
                "cpu_share": round((cpu_after - cpu_before) / (t1 - t0), 4),
                "reconcile_requests_per_s_per_job": round((op_after - op_before) / (t1 - t0) / n_jobs, 4),
                "apiserver_requests_per_s_with_operator": round(with_operator, 2),
                "apiserver_requests_per_s_without_operator": round(baseline, 2),
                "operator_requests_per_s_per_job": round((with_operator - baseline) / n_jobs, 4),
            },
            "resync_seconds": resync_s,
            "nodes_ready_end": best_effort("nodes", lambda: nodes_ready(cluster)),
            "load_average_end": load_average(),
        }
    finally:
        if op is not None and op.poll() is None:
            os.killpg(op.pid, signal.SIGKILL)
        if bare is not None:
            bare.close()
        kubelet.__exit__(None, None, None)
        if drain:
            print(f"namespace {namespace} deleted in {wait_namespace_gone(cluster, namespace, 900):.0f} s", flush=True)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [r for r in result["runs"] if r["variant"] == "operator"]
    floor = [r for r in result["runs"] if r["variant"] == "floor"]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 4))
    for runs, name, style in ((ops, "operator", "-"), (floor, "floor (bare client)", ":")):
        n = [r["jobs"] for r in runs]
        a.plot(n, [r["apply_to_children_s"]["p50"] for r in runs], "o" + style, label=f"{name}: apply → children p50")
        a.plot(n, [r["apply_to_children_s"]["p99"] for r in runs], "s" + style, label=f"{name}: apply → children p99")
    n = [r["jobs"] for r in ops]
    a.plot(n, [r["apply_to_running_s"]["p50"] for r in ops], "^-", label="operator: apply → Running p50")
    a.axhline(1.0, color="grey", lw=0.8, ls="--", label="goal: children p50 1 s")
    a.set(xscale="log", yscale="log", xlabel="RLJobs applied at once", ylabel="seconds", title="latency")
    a.legend(fontsize=6)
    b.plot(n, [r["steady"]["rss_mib"] for r in ops], "o-", label="RSS steady (MiB)")
    b.plot(n, [r["operator_after_ramp"]["cpu_s"] for r in ops], "s-", label="CPU s during ramp")
    b.set(xscale="log", xlabel="RLJobs", title="operator resources")
    b.legend(fontsize=7)
    c.plot(n, [r["steady"]["operator_requests_per_s_per_job"] for r in ops], "o-", label="all (API server delta)")
    c.plot(n, [r["steady"]["reconcile_requests_per_s_per_job"] for r in ops], "s-", label="reconcile only")
    c.set(xscale="log", xlabel="RLJobs", ylabel="requests / s / job", title="steady-state API load")
    c.legend(fontsize=7)
    fig.suptitle(f"rljob operator, {result['nodes']['total']} kwok nodes — {result['machine']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1000, help="kwok nodes (40%% NVIDIA, 30%% AMD, 30%% CPU)")
    parser.add_argument("--jobs", type=int, nargs="+", default=[10, 100], help="job counts, one run each")
    parser.add_argument(
        "--variants", nargs="+", choices=["operator", "floor"], default=["operator", "floor"],
        help="operator: the operator applies the children; floor: a bare client applies them (the machine's floor)",
    )
    parser.add_argument("--steady-seconds", type=float, default=60.0, help="steady-state measurement window")
    parser.add_argument("--resync-seconds", type=float, default=10.0, help="the operator's resync period")
    parser.add_argument("--timeout", type=float, default=600.0, help="most seconds to wait for all jobs Running")
    parser.add_argument(
        "--node-lease-seconds", type=int, default=240, help="lease duration of the benchmark's kwok nodes"
    )
    parser.add_argument(
        "--combine", type=Path, nargs="+", metavar="JSON",
        help="run nothing: merge the runs of these earlier results (same nodes) into --out/--name",
    )
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks")
    parser.add_argument("--name", default="operator_scale", help="stem of the JSON and PNG written to --out")
    args = parser.parse_args()
    if args.combine:
        return combine(args.combine, args.out, args.name)
    # SIGTERM (timeout, kill) still stops the control plane and the operator: run the finally blocks.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    nv, amd = int(args.nodes * 0.4), int(args.nodes * 0.3)
    cpu = args.nodes - nv - amd
    state = Path(tempfile.mkdtemp(prefix="rljob-bench-"))
    cluster = start_cluster(state / "plane")  # localkube's few default nodes; the rest are added below
    node_kwok: subprocess.Popen[bytes] | None = None
    try:
        os.environ["KUBECONFIG"] = str(cluster.kubeconfig)
        node_kwok = start_node_kwok(cluster, args.node_lease_seconds, state / "kwok-bench.log")
        print(f"adding kwok nodes up to {nv} NVIDIA, {amd} AMD, {cpu} CPU", flush=True)
        nodes_s = add_fake_nodes(cluster, {"nv": nv, "amd": amd, "cpu": cpu})
        print(f"{args.nodes} nodes Ready after {nodes_s:.0f} s", flush=True)
        crd = REPO / "crds" / "rljob.io_rljobs.yaml"
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd))
        cluster.kubectl("wait", "--for=condition=Established", "crd/rljobs.rljob.io", "--timeout=60s")
        # A fresh CRD answers 429 "storage is (re)initializing" for a while: wait until lists succeed.
        for _ in range(120):
            if cluster.kubectl("get", "rljobs", "-A", check=False).returncode == 0:
                break
            time.sleep(0.5)
        time.sleep(2.0)
        runs = []
        plan = [(n, variant) for n in args.jobs for variant in args.variants]
        for i, (n, variant) in enumerate(plan):
            print(f"--- {variant}: {n} jobs on {args.nodes} nodes", flush=True)
            last = i == len(plan) - 1
            runs.append(run_one(cluster, variant, n, args.steady_seconds, args.resync_seconds, args.timeout, state, drain=not last))
            print(json.dumps(runs[-1], indent=1), flush=True)
    finally:
        if node_kwok is not None:
            os.killpg(node_kwok.pid, signal.SIGTERM)
            node_kwok.wait(timeout=30)
        cluster.stop()
    result = {
        "benchmark": "operator_scale",
        "machine": describe(),
        "nodes": {"total": args.nodes, "nvidia": nv, "amd": amd, "cpu": cpu, "lease_seconds": args.node_lease_seconds},
        "kubernetes": cluster.version,
        "runs": runs,
    }
    write(result, args.out, args.name)
    return 0


def print_table(runs: list[dict[str, Any]]) -> None:
    print(f"\n{'variant':>8} {'jobs':>5} {'children':>8} {'p50':>7} {'p99':>7} {'Running':>7} {'p50':>7} {'p99':>7} "
          f"{'RSS MiB':>8} {'CPU share':>9} {'req/s/job':>9} {'reconcile':>9}")
    for r in runs:
        s = r.get("steady") or {}
        running = r.get("apply_to_running_s") or {}
        cells = [r.get("running", "-"), running.get("p50", "-"), running.get("p99", "-"), s.get("rss_mib", "-"),
                 s.get("cpu_share", "-"), s.get("operator_requests_per_s_per_job", "-"), s.get("reconcile_requests_per_s_per_job", "-")]
        print(f"{r['variant']:>8} {r['jobs']:>5} {r['all_children_created']:>8} {r['apply_to_children_s']['p50']!s:>7} "
              f"{r['apply_to_children_s']['p99']!s:>7} {cells[0]!s:>7} {cells[1]!s:>7} {cells[2]!s:>7} {cells[3]!s:>8} "
              f"{cells[4]!s:>9} {cells[5]!s:>9} {cells[6]!s:>9}")


def write(result: dict[str, Any], out: Path, name: str) -> None:
    """Print the table, write `<name>.json` and `<name>.png` into `out`."""
    print_table(result["runs"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / f"{name}.png")
    print(f"wrote {out / name}.json and .png")


def combine(paths: list[Path], out: Path, name: str) -> int:
    """Merge the runs of earlier invocations on the same node set into one JSON and plot (a 1,000-job run
    is an invocation of its own: about half an hour on a 2-core machine)."""
    results = [json.loads(p.read_text()) for p in paths]
    if len({json.dumps(r["nodes"], sort_keys=True) for r in results}) != 1:
        print("cannot combine runs on different node sets", file=sys.stderr)
        return 2
    runs = sorted((run for r in results for run in r["runs"]), key=lambda run: (run["jobs"], run["variant"] != "operator"))
    merged = {**results[0], "runs": runs, "combined_from": [p.name for p in paths]}
    write(merged, out, name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
