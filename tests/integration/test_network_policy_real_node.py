"""The operator's NetworkPolicies, enforced on the real node by kube-router, isolate a running RLJob.

One cpu-vendor RLJob (the job of test_rljob_real_node.py) runs with the operator's policies and a
monitoring namespace of its own. Once it has trained a step (the weight-update group formed, the router
serving its worker), the same TCP probe, a Python script, dials the job's inference HTTP port, its
router, trainer rank 0's rendezvous port, rank 0's weight-group store and rank 0's metrics port:

- from trainer rank 1 (`kubectl exec` in the job's own pod): every port opens, the positive control that
  shows the probe, the addresses and the ports are right, so a closed port below means the policies;
- from a pod in another namespace wearing the job's own trainer labels, and from a pod of another job in
  the job's namespace: every connection is refused or times out;
- from a pod in the monitoring namespace: only the metrics ports (SGLang's is its HTTP port) open.

The probes start only once kube-router has programmed each target pod's firewall chain (read from
the node's filter table), and the job must still train to Complete with the policies on.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from rljob.operator.builders.inference import SGLANG_PORT
from rljob.operator.builders.trainer import METRICS_PORT, RENDEZVOUS_PORT
from tests.cluster.kube import wait_until
from tests.cluster.realnode import RealCluster
from tests.helpers.real_node_rljob import NAME, RealNodeJob, real_node_job

pytestmark = [pytest.mark.realnode, pytest.mark.cluster, pytest.mark.slow]

# Enough steps that the job is still running while the probes run after step 1 (a step takes ~4 s here).
STEPS = 16
STORE_PORT = 29600  # rollout.weightTransport.masterPort's default: trainer rank 0's weight-group store
INDEX = "batch.kubernetes.io/job-completion-index"
CONNECT_TIMEOUT_S = 4
# argv: name=ip:port ...; prints {name: "open" | "refused" | "timeout" | other error}, all dialled at once.
PROBE = f"""
import json, socket, sys
from concurrent.futures import ThreadPoolExecutor
def dial(target):
    name, addr = target.split("=")
    host, port = addr.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout={CONNECT_TIMEOUT_S}).close()
        return name, "open"
    except ConnectionRefusedError:
        return name, "refused"
    except (socket.timeout, TimeoutError):
        return name, "timeout"
    except OSError as exc:
        return name, type(exc).__name__ + ": " + str(exc)
with ThreadPoolExecutor(len(sys.argv) - 1) as pool:
    print(json.dumps(dict(pool.map(dial, sys.argv[1:]))))
"""


def _pods(rc: RealCluster, ns: str, selector: str) -> list[Any]:
    return rc.cluster.core().list_namespaced_pod(ns, label_selector=selector).items


def _running_ip(rc: RealCluster, ns: str, selector: str, index: str | None = None) -> tuple[str, str]:
    """(name, IP) of the Running pod matching `selector` (and completion `index`); AssertionError if none."""
    pods = [p for p in _pods(rc, ns, selector) if p.status.phase == "Running" and p.status.pod_ip
            and (index is None or (p.metadata.annotations or {}).get(INDEX) == index)]
    assert len(pods) == 1, f"{selector} (index {index}): {[p.metadata.name for p in pods]}"
    return pods[0].metadata.name, pods[0].status.pod_ip


def _programmed(rc: RealCluster, ips: list[str]) -> bool:
    """Whether kube-router has hooked a pod firewall chain for every one of `ips` into its FORWARD chain."""
    rules = [line for line in rc.in_node_network("iptables-save", "-t", "filter").splitlines() if "KUBE-POD-FW-" in line]
    return all(any(f"-d {ip}/32" in line for line in rules) for ip in ips)


def _in_source_set(rc: RealCluster, ip: str) -> bool:
    """Whether kube-router has put `ip` into one of its policies' source sets (a peer it admits)."""
    entries = (line.split() for line in rc.in_node_network("ipset", "save").splitlines())
    return any(e[:1] == ["add"] and e[1].startswith("KUBE-SRC-") and e[2] == ip for e in entries if len(e) > 2)


def _prober(rc: RealCluster, ns: str, name: str, labels: dict[str, str]) -> str:
    """A pod that idles until the test runs the probe in it; its IP once it runs."""
    rc.run_pod(ns, name, [{"name": "probe", "image": rc.images["base-python"], "imagePullPolicy": "Never",
                           "command": ["python3", "-c", "import time; time.sleep(3600)"]}],
               labels=labels, automountServiceAccountToken=False, terminationGracePeriodSeconds=0)
    return str(rc.wait_phase(ns, name, {"Running"}, timeout=180).status.pod_ip)


def _probe(rc: RealCluster, ns: str, pod: str, targets: list[str], container: str | None = None) -> dict[str, str]:
    """Run PROBE in `pod` (`kubectl exec`): {target name: open | refused | timeout | error}."""
    where = ["-c", container] if container else []
    out = rc.cluster.kubectl("exec", "-n", ns, pod, *where, "--", "python3", "-c", PROBE, *targets).stdout
    result = json.loads(out.strip().splitlines()[-1])
    print(f"from {ns}/{pod}:", result)
    return result


def _step(job: RealNodeJob) -> int:
    status = job.status()
    assert status.get("phase") not in ("Failed", "Complete"), f"the job ended before the probes: {status}"
    return int(status.get("trainer", {}).get("step") or 0)


def test_outsiders_cannot_reach_a_jobs_ports_and_the_job_completes(
        real_cluster: RealCluster, real_namespace: str, tmp_path: Path) -> None:
    rc, ns = real_cluster, real_namespace
    outside, monitoring = rc.cluster.create_namespace("np-outside"), rc.cluster.create_namespace("np-monitoring")
    with real_node_job(rc, ns, tmp_path, monitoring_namespace=monitoring) as job:
        try:
            job.create(STEPS)
            expected = sorted(f"networkpolicy.networking.k8s.io/{NAME}-{r}" for r in ("inference", "router", "trainer"))
            wait_until(lambda: sorted(rc.cluster.kubectl("get", "networkpolicies", "-n", ns, "-o", "name").stdout.split())
                       == expected, 120, "the operator's three NetworkPolicies", interval=1)
            wait_until(lambda: _step(job) >= 1, 1200, "RLJob e2e trained a step", interval=2)

            job_sel = f"rljob.io/job-name={NAME}"
            _, engine = _running_ip(rc, ns, f"{job_sel},rljob.io/role=inference")
            _, router = _running_ip(rc, ns, f"{job_sel},rljob.io/role=router")
            _, rank0 = _running_ip(rc, ns, f"{job_sel},rljob.io/role=trainer", index="0")
            rank1_pod, _ = _running_ip(rc, ns, f"{job_sel},rljob.io/role=trainer", index="1")
            targets = [f"inference={engine}:{SGLANG_PORT}", f"router={router}:{SGLANG_PORT}",
                       f"rendezvous={rank0}:{RENDEZVOUS_PORT}", f"weight-group-store={rank0}:{STORE_PORT}",
                       f"trainer-metrics={rank0}:{METRICS_PORT}"]
            wait_until(lambda: _programmed(rc, [engine, router, rank0]), 120,
                       "kube-router's firewall chains for the job's pods", interval=1)

            # Outsiders: the job's own labels in another namespace; another job's trainer in this one.
            _prober(rc, outside, "impostor", {"rljob.io/job-name": NAME, "rljob.io/role": "trainer"})
            _prober(rc, ns, "other-job", {"rljob.io/job-name": "other", "rljob.io/role": "trainer"})
            scraper_ip = _prober(rc, monitoring, "scraper", {"app": "prometheus"})
            # The positive control, from the job's own trainer rank 1 while the job runs.
            inside = _probe(rc, ns, rank1_pod, targets, container="trainer")
            assert inside == {t.split("=")[0]: "open" for t in targets}, inside
            for where, name in ((outside, "impostor"), (ns, "other-job")):
                seen = _probe(rc, where, name, targets)
                assert set(seen) == set(inside)
                assert all(result in ("refused", "timeout") for result in seen.values()), (name, seen)
            # The monitoring namespace's pod, once kube-router admits it as a source: the metrics ports only.
            wait_until(lambda: _in_source_set(rc, scraper_ip), 120, "the scraper in kube-router's source sets", interval=1)
            scraper = _probe(rc, monitoring, "scraper", targets)
            assert {k for k, v in scraper.items() if v == "open"} == {"inference", "trainer-metrics"}, scraper
            assert all(v in ("open", "refused", "timeout") for v in scraper.values()), scraper

            job.assert_completes()
            assert job.status()["trainer"]["step"] == STEPS
        finally:
            sys.stdout.flush()
            rc.cluster.delete_namespace(outside)
            rc.cluster.delete_namespace(monitoring)
