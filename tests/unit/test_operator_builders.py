"""Builders: RLJob spec → child manifests (pure functions)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from rljob.api.load import parse_rljob
from rljob.api.spec import EnvVar, RLJobSpec, S3Spec
from rljob.operator.builders import JobRef, build_children
from rljob.operator.builders.inference import pool_replicas
from rljob.operator.builders.meta import MAX_CHILD_NAME, child_name
from rljob.operator.builders.trainer import runtime_document

JOB = JobRef(name="demo", namespace="team-a", uid="uid-1")


def _spec(**rollout: Any) -> RLJobSpec:
    doc = {
        "model": {"huggingFace": "Qwen/Qwen3-4B", "revision": "main"},
        "data": {"synthetic": {}},
        "rollout": {
            "pools": [
                {"name": "nv", "vendor": "nvidia", "replicas": 2, "tensorParallelSize": 2, "gpusPerReplica": 2},
                {
                    "name": "mi",
                    "vendor": "amd",
                    "replicas": 1,
                    "nodeSelector": {"zone": "b"},
                    "env": [{"name": "SGLANG_USE_AITER", "value": "0"}, {"name": "HSA_NO_SCRATCH_RECLAIM", "value": "0"}],
                    "extraArgs": ["--mem-fraction-static", "0.8"],
                    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "rl", "effect": "NoSchedule"}],
                },
            ],
            **rollout,
        },
        "trainer": {"vendor": "amd", "gpusPerReplica": 8, "replicas": 2},
    }
    return RLJobSpec.model_validate(doc)


def _by(children: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [c for c in children if c["kind"] == kind and c["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)}"
    return matches[0]


def test_children_are_complete_unique_and_owned() -> None:
    children = build_children(JOB, _spec(), active=True)
    keys = [(c["kind"], c["metadata"]["name"]) for c in children]
    assert len(keys) == len(set(keys))
    assert set(keys) == {
        ("ConfigMap", "demo-config"),
        ("ServiceAccount", "demo-trainer"),
        ("Role", "demo-trainer"),
        ("RoleBinding", "demo-trainer"),
        ("PersistentVolumeClaim", "demo-checkpoints"),
        ("Service", "demo-infer-nv"),
        ("PodDisruptionBudget", "demo-infer-nv"),
        ("StatefulSet", "demo-infer-nv"),
        ("Service", "demo-infer-mi"),
        ("PodDisruptionBudget", "demo-infer-mi"),
        ("StatefulSet", "demo-infer-mi"),
        ("Service", "demo-router"),
        ("Deployment", "demo-router"),
        ("Service", "demo-trainer"),
        ("Job", "demo-trainer"),
        ("NetworkPolicy", "demo-inference"),
        ("NetworkPolicy", "demo-router"),
        ("NetworkPolicy", "demo-trainer"),
    }
    for c in children:
        meta = c["metadata"]
        assert meta["namespace"] == "team-a"
        (owner,) = meta["ownerReferences"]
        assert owner == {
            "apiVersion": "rljob.io/v1alpha1",
            "kind": "RLJob",
            "name": "demo",
            "uid": "uid-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
        assert meta["labels"]["rljob.io/job-name"] == "demo"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "rljob-operator"
    # Deterministic: building twice gives identical manifests (idempotent apply).
    assert build_children(JOB, _spec(), active=True) == children


def test_cpu_pool_runs_the_sglang_protocol_server_with_args_it_accepts() -> None:
    """A cpu pool: the runtime image's SGLang-protocol server, no GPU request, no GPU-node affinity.

    The rendered command line is parsed by the real server's own argument parser, so a flag the
    builder adds that the CPU server does not know fails here, not in a crash-looping pod.
    """
    from rljob.runtime.engines.server import build_arg_parser

    spec = RLJobSpec.model_validate({
        "model": {"path": "/models/tiny"},
        "data": {"synthetic": {}},
        "rollout": {"engine": "sglang", "pools": [
            {"name": "cpu", "vendor": "cpu", "replicas": 2, "extraArgs": ["--max-running-requests", "8"]},
        ]},
        "trainer": {"vendor": "cpu", "gpusPerReplica": 0},
    })
    sts = _by(build_children(JOB, spec, active=True), "StatefulSet", "demo-infer-cpu")["spec"]
    pod = sts["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == "rljob/runtime:0.1.0"
    assert container["command"] == ["python", "-m", "rljob.runtime.engines.server"]
    assert not any("gpu" in name for kind in container["resources"].values() for name in kind), "no GPU request"
    assert container["resources"]["requests"] == {"cpu": "1", "memory": "2Gi"}, "never BestEffort"
    assert pod["securityContext"]["runAsUser"] == 1000, "the runtime image's user"
    assert "affinity" not in pod and "tolerations" not in pod
    args = build_arg_parser().parse_args(container["args"])
    assert (args.model_path, args.tp_size, args.host, args.port, args.max_batch_size) == ("/models/tiny", 1, "0.0.0.0", 30000, 8)
    assert "RLJOB_GPU_VENDOR" not in {e["name"] for e in container["env"]}


@pytest.mark.parametrize(
    ("pool", "message"),
    [
        ({"resourceName": "nvidia.com/gpu"}, "cpu pools take none"),
        ({"tensorParallelSize": 2, "gpusPerReplica": 2}, "must be 1 on a cpu pool"),
    ],
)
def test_cpu_pool_rejects_gpu_fields(pool: dict[str, Any], message: str) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=message):
        _spec().rollout.pools[0].model_validate({"name": "c", "vendor": "cpu", **pool})


def test_inference_pools_are_vendor_correct() -> None:
    children = build_children(JOB, _spec(), active=True)
    nv = _by(children, "StatefulSet", "demo-infer-nv")["spec"]
    mi = _by(children, "StatefulSet", "demo-infer-mi")["spec"]
    assert nv["replicas"] == 2 and mi["replicas"] == 1
    nv_pod, mi_pod = nv["template"]["spec"], mi["template"]["spec"]
    nv_c, mi_c = nv_pod["containers"][0], mi_pod["containers"][0]
    assert nv_c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert mi_c["resources"]["limits"]["amd.com/gpu"] == "1"
    assert "rocm" not in nv_c["image"] and nv_c["image"].startswith("lmsysorg/sglang:v")
    assert "rocm" in mi_c["image"]
    assert nv_c["args"][:4] == ["--model-path", "Qwen/Qwen3-4B", "--revision", "main"]
    assert nv_c["args"][nv_c["args"].index("--tp-size") + 1] == "2"
    assert mi_c["args"][-2:] == ["--mem-fraction-static", "0.8"]
    mi_env = {e["name"]: e.get("value") for e in mi_c["env"]}
    assert mi_env["SGLANG_USE_AITER"] == "0" and mi_env["HSA_NO_SCRATCH_RECLAIM"] == "0", "user env overrides"
    assert mi_env["RLJOB_GPU_VENDOR"] == "amd"
    assert {e["name"]: e.get("value") for e in nv_c["env"]}["RLJOB_GPU_VENDOR"] == "nvidia"
    affinity = mi_pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert affinity["nodeSelectorTerms"][0]["matchExpressions"] == [
        {"key": "amd.com/gpu.product-name", "operator": "Exists"}
    ]
    assert mi_pod["nodeSelector"] == {"zone": "b"}
    assert {"key": "amd.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in mi_pod["tolerations"]
    assert {"key": "dedicated", "operator": "Equal", "value": "rl", "effect": "NoSchedule"} in mi_pod["tolerations"]
    assert nv_pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert nv_c["startupProbe"]["httpGet"]["path"] == "/health_generate"
    assert nv_c["startupProbe"]["periodSeconds"] * nv_c["startupProbe"]["failureThreshold"] >= 900
    assert nv_c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert nv_c["livenessProbe"]["httpGet"]["path"] == "/health"
    svc = _by(children, "Service", "demo-infer-nv")["spec"]
    assert svc["clusterIP"] == "None" and svc["selector"] == nv["selector"]["matchLabels"]
    assert nv["serviceName"] == "demo-infer-nv"


# SGLang's /health waits up to SGLANG_HEALTH_CHECK_TIMEOUT (default 20 s) for scheduler output
# (sglang/srt/entrypoints/http_server.py, health_generate); its scheduler watchdog exits after 300 s.
SGLANG_HEALTH_WINDOW_S = 20
SGLANG_WATCHDOG_S = 300


def test_pool_health_is_cheap_and_survives_syncs_and_long_prefills() -> None:
    """Every pool turns off /health's generation (even over the pool's own env), so readiness and
    liveness on /health never wait for a paused or syncing scheduler; startup still generates once."""
    spec = _spec()
    spec.rollout.pools[1].env.append(spec.rollout.pools[1].env[0].model_copy(
        update={"name": "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "value": "true"}))
    spec.rollout.pools.append(spec.rollout.pools[0].model_validate({"name": "c", "vendor": "cpu"}))
    children = build_children(JOB, spec, active=True)
    for pool in ("nv", "mi", "c"):
        container = _by(children, "StatefulSet", f"demo-infer-{pool}")["spec"]["template"]["spec"]["containers"][0]
        env = [e for e in container["env"] if e["name"] == "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"]
        assert env == [{"name": "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "value": "false"}], pool
        startup, ready, live = container["startupProbe"], container["readinessProbe"], container["livenessProbe"]
        assert startup["httpGet"]["path"] == "/health_generate"
        assert startup["timeoutSeconds"] > SGLANG_HEALTH_WINDOW_S  # SGLang's own 503 comes first
        assert ready["httpGet"]["path"] == live["httpGet"]["path"] == "/health"
        assert live["periodSeconds"] * live["failureThreshold"] >= SGLANG_WATCHDOG_S
        assert live["timeoutSeconds"] >= 10 and ready["timeoutSeconds"] >= 5
        assert ready["periodSeconds"] * ready["failureThreshold"] >= 30


def test_trainer_runs_the_rendered_config_with_least_privilege() -> None:
    spec = _spec()
    children = build_children(JOB, spec, active=True)
    gang = _by(children, "Job", "demo-trainer")["spec"]
    pod = gang["template"]["spec"]
    (container,) = pod["containers"]
    # A run-to-completion gang: one Indexed Job, every rank at once, never a rank retried alone.
    assert gang["completionMode"] == "Indexed" and gang["parallelism"] == gang["completions"] == 2
    assert gang["backoffLimit"] == 0 and pod["restartPolicy"] == "Never" and gang["suspend"] is False
    assert gang["successPolicy"] == {"rules": [{"succeededIndexes": "0"}]}, "the leader's success ends the job"
    rules = gang["podFailurePolicy"]["rules"]
    assert rules[0] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    assert rules[1]["action"] == "FailJob" and rules[1]["onExitCodes"]["operator"] == "NotIn"
    assert pod["subdomain"] == "demo-trainer"
    assert container["command"] == [
        "python", "-m", "torch.distributed.run", "--nnodes=2", "--node-rank=$(NODE_RANK)", "--nproc-per-node=8",
        "--master-addr=demo-trainer-0.demo-trainer.team-a.svc", "--master-port=29500",
        "--no-python", "rljob", "run", "/etc/rljob/job.yaml",
    ]
    rank = next(e for e in container["env"] if e["name"] == "NODE_RANK")
    assert rank["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert container["resources"]["limits"] == {"amd.com/gpu": "8"}
    assert pod["serviceAccountName"] == "demo-trainer"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == "demo-checkpoints"
    assert volumes["config"]["configMap"]["name"] == "demo-config"
    # The ConfigMap is a valid RLJob for `rljob run`, wired to the cluster's engines.
    text = _by(children, "ConfigMap", "demo-config")["data"]["job.yaml"]
    job = parse_rljob(yaml.safe_load(text))
    assert job.spec.rollout.engine == "sglang"
    assert job.spec.rollout.sglang.router_url == "http://demo-router.team-a.svc:30000"
    assert job.spec.rollout.sglang.worker_urls == [] and job.spec.rollout.sglang.discovery is not None
    assert job.spec.checkpoint.dir == "/var/lib/rljob/checkpoints"
    assert job.spec.trainer.device == "cuda"
    rules = _by(children, "Role", "demo-trainer")["rules"]
    assert {"apiGroups": ["rljob.io"], "resources": ["rljobs"], "resourceNames": ["demo"], "verbs": ["get"]} in rules
    assert all("*" not in r["verbs"] and "delete" not in r["verbs"] for r in rules)
    binding = _by(children, "RoleBinding", "demo-trainer")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "demo-trainer", "namespace": "team-a"}]


def test_torchrun_waits_for_the_ranks_as_long_as_the_pod_grace_period_allows() -> None:
    """torchrun SIGKILLs its ranks TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (30 by default) after forwarding
    SIGTERM; the ranks finish their step and checkpoint in that time, so it follows the grace period."""
    pod = _by(build_children(JOB, _spec(), active=True), "Job", "demo-trainer")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    grace = pod["terminationGracePeriodSeconds"]
    assert grace >= 300
    assert grace - 30 <= int(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) < grace
    # A job's own value wins (trainer.env), as for every default variable.
    spec = _spec()
    spec.trainer.env = [EnvVar(name="TORCH_ELASTIC_SHUTDOWN_TIMEOUT", value="100")]
    (container,) = _by(build_children(JOB, spec, active=True), "Job", "demo-trainer")["spec"]["template"]["spec"][
        "containers"]
    assert [e["value"] for e in container["env"] if e["name"] == "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == ["100"]


def test_config_change_changes_trainer_pod_template() -> None:
    def config_hash(spec: RLJobSpec) -> str:
        gang = _by(build_children(JOB, spec, active=True), "Job", "demo-trainer")
        return gang["spec"]["template"]["metadata"]["annotations"]["rljob.io/config-hash"]

    assert config_hash(_spec()) == config_hash(_spec())
    assert config_hash(_spec()) != config_hash(_spec(rolloutBatchSize=16))


def test_trainer_template_hash_marks_a_recreate_not_a_suspend() -> None:
    """The Job's template is immutable: a config change means a new Job (the whole gang), suspend does not."""
    def template_hash(spec: RLJobSpec, active: bool = True) -> str:
        return _by(build_children(JOB, spec, active=active), "Job", "demo-trainer")["metadata"]["annotations"][
            "rljob.io/template-hash"
        ]

    assert template_hash(_spec()) == template_hash(_spec(), active=False)
    suspended_spec = _spec()
    suspended_spec.suspend = True
    assert template_hash(_spec()) == template_hash(suspended_spec, active=False), "suspend is not a config change"
    assert template_hash(_spec()) != template_hash(_spec(rolloutBatchSize=16))
    suspended = _by(build_children(JOB, _spec(), active=False), "Job", "demo-trainer")["spec"]
    assert suspended["suspend"] is True


def test_cpu_trainer_runs_one_process_per_pod() -> None:
    spec = _spec()
    spec.trainer.vendor, spec.trainer.gpus_per_replica = "cpu", 0
    (container,) = _by(build_children(JOB, spec, active=True), "Job", "demo-trainer")["spec"]["template"]["spec"]["containers"]
    assert "--nproc-per-node=1" in container["command"]


def test_inactive_job_scales_every_workload_to_zero_and_keeps_the_pvc() -> None:
    children = build_children(JOB, _spec(), active=False)
    workloads = [c for c in children if c["kind"] in ("StatefulSet", "Deployment")]
    assert len(workloads) == 3 and all(w["spec"]["replicas"] == 0 for w in workloads)
    assert _by(children, "Job", "demo-trainer")["spec"]["suspend"] is True
    assert _by(children, "PersistentVolumeClaim", "demo-checkpoints")


def test_a_suspended_job_keeps_its_engines_while_they_still_serve_its_stopping_ranks() -> None:
    """`serving=True` (a trainer pod still finishes its step): the trainer Job is suspended, the engines
    and the router keep their replicas; `serving` changes no pod template, so nothing restarts."""
    serving = build_children(JOB, _spec(), active=False, serving=True)
    active = build_children(JOB, _spec(), active=True)
    assert _by(serving, "Job", "demo-trainer")["spec"]["suspend"] is True
    for kind in ("StatefulSet", "Deployment"):
        kept, up = [c for c in serving if c["kind"] == kind], [c for c in active if c["kind"] == kind]
        assert kept == up and all(c["spec"]["replicas"] > 0 for c in kept)


def test_checkpoint_uri_variants() -> None:
    spec = _spec()
    spec.checkpoint.uri = "pvc://shared-ckpt"
    children = build_children(JOB, spec, active=True)
    assert not [c for c in children if c["kind"] == "PersistentVolumeClaim"]
    pod = _by(children, "Job", "demo-trainer")["spec"]["template"]["spec"]
    assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "shared-ckpt"}} in pod["volumes"]
    spec.checkpoint.uri = "s3://ckpt-bucket/runs/demo"
    spec.trainer.replicas = 2  # each pod stages its own part of a checkpoint
    spec.checkpoint.s3 = S3Spec(endpoint="http://seaweedfs.storage:8333", credentials_secret="s3-keys")
    children = build_children(JOB, spec, active=True)
    assert not [c for c in children if c["kind"] == "PersistentVolumeClaim"]
    container = _by(children, "Job", "demo-trainer")["spec"]["template"]["spec"]["containers"][0]
    assert not [m for m in container["volumeMounts"] if m["name"] == "checkpoints"]
    keys = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if e["name"].startswith("AWS_")}
    assert keys["AWS_ACCESS_KEY_ID"] == {"name": "s3-keys", "key": "AWS_ACCESS_KEY_ID"}
    assert keys["AWS_SECRET_ACCESS_KEY"] == {"name": "s3-keys", "key": "AWS_SECRET_ACCESS_KEY"}
    assert keys["AWS_SESSION_TOKEN"]["optional"] is True
    checkpoint = runtime_document(JOB, spec)["spec"]["checkpoint"]
    # The store URI reaches the runtime as a URI; only the staging folder is a path (the pod's home).
    assert checkpoint["uri"] == "s3://ckpt-bucket/runs/demo"
    assert checkpoint["dir"].startswith("/home/rljob/")
    assert checkpoint["s3"]["endpoint"] == "http://seaweedfs.storage:8333"


@pytest.mark.parametrize(
    ("weights", "total", "expected"),
    [([2, 1], None, [2, 1]), ([2, 1], 6, [4, 2]), ([1, 1], 3, [2, 1]), ([0, 0], 3, [2, 1]), ([3, 1], 0, [0, 0])],
)
def test_scale_subresource_spreads_replicas(weights: list[int], total: int | None, expected: list[int]) -> None:
    spec = _spec(replicas=total)
    for pool, w in zip(spec.rollout.pools, weights, strict=True):
        pool.replicas = w
    counts = pool_replicas(spec.rollout)
    assert list(counts.values()) == expected
    assert total is None or sum(counts.values()) == total


def test_laptop_job_gets_one_default_nvidia_pool() -> None:
    spec = RLJobSpec.model_validate({"model": {"builtin": "tiny-arith"}, "data": {"synthetic": {}}})
    children = build_children(JOB, spec, active=True)
    assert _by(children, "StatefulSet", "demo-infer-default")["spec"]["replicas"] == 1


def test_long_names_are_shortened_deterministically() -> None:
    job = JobRef(name="a" * 40, namespace="ns", uid="u")
    name = child_name(job, "infer", "p" * 40)
    assert len(name) <= MAX_CHILD_NAME and name == child_name(job, "infer", "p" * 40)
    assert name != child_name(job, "infer", "p" * 39 + "q")


def test_pool_tp_must_fit_gpus() -> None:
    with pytest.raises(ValueError, match="tensorParallelSize"):
        _spec().rollout.pools[0].model_validate({"name": "x", "vendor": "nvidia", "tensorParallelSize": 4})


def test_trainer_exposes_the_weight_update_group_to_the_engines() -> None:
    """The distributed transport's store listens on trainer rank 0 (its POD_IP) at masterPort: the pod
    gets its own IP from the downward API and declares the port, and the headless Service names it."""
    children = build_children(JOB, _spec(), active=True)
    job = _by(children, "Job", "demo-trainer")
    container = job["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert {"name": "weight-sync", "containerPort": 29600, "protocol": "TCP"} in container["ports"]
    service = _by(children, "Service", "demo-trainer")
    assert {"name": "weight-sync", "port": 29600, "targetPort": "weight-sync", "protocol": "TCP"} in service["spec"]["ports"]
    disk = _spec(engine="sglang", weightTransport={"mode": "disk"}, sglang={"weightsDir": "/w"})
    ports = _by(build_children(JOB, disk, active=True), "Job", "demo-trainer")["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert "weight-sync" not in {p["name"] for p in ports}
