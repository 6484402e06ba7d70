"""Builders: what the child pods of an RLJob can see and how they run (issue 14: storage, images,
discovery, pod hygiene). Pure functions: spec in, manifests out."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from rljob.api.load import RLJobConfigError, parse_rljob
from rljob.api.spec import RLJobSpec, cluster_problems
from rljob.operator.builders import JobRef, build_children
from rljob.operator.builders.storage import DATA_HUB_DIR, DATA_ROOT, HF_CACHE_DIR, MODEL_DIR, WEIGHTS_DIR, PvcRef
from rljob.operator.builders.vendor import (
    PROFILES,
    ROUTER_IMAGE,
    ROUTER_UID,
    RUNTIME_UID,
    SGLANG_UID,
    TRAINER_IMAGES,
)

JOB = JobRef(name="demo", namespace="team-a", uid="uid-1")


def _spec(**overrides: Any) -> RLJobSpec:
    doc: dict[str, Any] = {
        "model": {"huggingFace": "Qwen/Qwen3-4B", "revision": "main"},
        "data": {"synthetic": {}},
        "rollout": {
            "pools": [
                {"name": "nv", "vendor": "nvidia", "replicas": 2, "tensorParallelSize": 2, "gpusPerReplica": 2},
                {"name": "mi", "vendor": "amd", "replicas": 1},
            ]
        },
        "trainer": {"vendor": "nvidia", "gpusPerReplica": 1},
    }
    for key, value in overrides.items():
        merge = isinstance(value, dict) and key != "model"  # a model names exactly one source
        doc[key] = {**doc.get(key, {}), **value} if merge else value
    return RLJobSpec.model_validate(doc)


def _by(children: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (match,) = [c for c in children if c["kind"] == kind and c["metadata"]["name"] == name]
    return match


def _pod(children: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    """The pod template of a workload; the trainer's is a Job whatever `kind` the caller names."""
    return _by(children, "Job" if name.endswith("-trainer") else kind, name)["spec"]["template"]["spec"]


def _pods(children: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every child pod template by workload name."""
    return {
        c["metadata"]["name"]: c["spec"]["template"]["spec"]
        for c in children
        if c["kind"] in ("StatefulSet", "Deployment", "Job")
    }


def _mounts(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}


def _volumes(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in pod["volumes"]}


def _config(children: list[dict[str, Any]]) -> dict[str, Any]:
    return yaml.safe_load(_by(children, "ConfigMap", "demo-config")["data"]["job.yaml"])


# ------------------------------------------------------------------ storage


def test_model_folder_on_a_claim_is_mounted_read_only_where_sglang_and_the_trainer_look() -> None:
    children = build_children(JOB, _spec(model={"path": "pvc://models/qwen3/4b"}), active=True)
    for name in ("demo-infer-nv", "demo-infer-mi", "demo-trainer"):
        pod = _pod(children, "StatefulSet", name)
        assert _volumes(pod)["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
        assert _mounts(pod)[MODEL_DIR] == {"name": "model", "mountPath": MODEL_DIR, "readOnly": True, "subPath": "qwen3/4b"}
    args = _pod(children, "StatefulSet", "demo-infer-nv")["containers"][0]["args"]
    assert args[:2] == ["--model-path", MODEL_DIR]
    # The trainer resolves the same folder: its config names the mount, and is still a valid RLJob.
    config = _config(children)
    assert config["spec"]["model"] == {"path": MODEL_DIR}
    parse_rljob(config)


def test_hugging_face_cache_claim_runs_the_pods_offline_on_the_hub_id() -> None:
    spec = _spec(model={"huggingFace": "Qwen/Qwen3-4B", "revision": "main", "storage": {"huggingFaceCache": "pvc://hf"}})
    children = build_children(JOB, spec, active=True)
    for name in ("demo-infer-nv", "demo-trainer"):
        pod = _pod(children, "StatefulSet", name)
        assert _volumes(pod)["hf-cache"]["persistentVolumeClaim"] == {"claimName": "hf", "readOnly": True}
        assert _mounts(pod)[HF_CACHE_DIR]["readOnly"] is True
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        assert env["HF_HUB_CACHE"] == HF_CACHE_DIR and env["HF_HUB_OFFLINE"] == "1"
        assert "initContainers" not in pod
    args = _pod(children, "StatefulSet", "demo-infer-nv")["containers"][0]["args"]
    assert args[:4] == ["--model-path", "Qwen/Qwen3-4B", "--revision", "main"]
    assert _config(children)["spec"]["model"] == {"huggingFace": "Qwen/Qwen3-4B", "revision": "main"}


def test_download_step_fetches_the_model_with_the_token_from_a_secret() -> None:
    download = {"tokenSecretRef": {"name": "hf", "key": "token"}, "sizeLimit": "20Gi", "include": ["*.json", "*.safetensors"]}
    children = build_children(JOB, _spec(model={"huggingFace": "Qwen/Qwen3-4B", "revision": "main", "storage": {"download": download}}), active=True)
    for name in ("demo-infer-mi", "demo-trainer"):
        pod = _pod(children, "StatefulSet", name)
        (init,) = pod["initContainers"]
        assert init["command"] == ["hf"]
        assert init["args"] == [
            "download", "Qwen/Qwen3-4B", "--local-dir", MODEL_DIR, "--revision", "main",
            "--include", "*.json", "--include", "*.safetensors",
        ]
        token = next(e for e in init["env"] if e["name"] == "HF_TOKEN")
        assert token == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
        assert {"name": "model", "mountPath": MODEL_DIR, "readOnly": False} in init["volumeMounts"]
        assert _volumes(pod)["model"] == {"name": "model", "emptyDir": {"sizeLimit": "20Gi"}}
        assert _mounts(pod)[MODEL_DIR]["readOnly"] is True, "the main container only reads the download"
        assert init["securityContext"]["readOnlyRootFilesystem"] is True
    assert _pod(children, "StatefulSet", "demo-infer-nv")["containers"][0]["args"][:3] == ["--model-path", MODEL_DIR, "--tp-size"]


def test_download_into_a_cache_claim_writes_it_in_the_init_step_only() -> None:
    storage = {"huggingFaceCache": "pvc://hf/hub", "download": {}}
    pod = _pod(build_children(JOB, _spec(model={"huggingFace": "Qwen/Qwen3-4B", "storage": storage}), active=True), "StatefulSet", "demo-infer-nv")
    (init,) = pod["initContainers"]
    assert init["args"][:4] == ["download", "Qwen/Qwen3-4B", "--cache-dir", HF_CACHE_DIR]
    assert "HF_TOKEN" not in {e["name"] for e in init["env"]}
    assert {"name": "hf-cache", "mountPath": HF_CACHE_DIR, "readOnly": False, "subPath": "hub"} in init["volumeMounts"]
    assert _volumes(pod)["hf-cache"]["persistentVolumeClaim"]["readOnly"] is False
    assert _mounts(pod)[HF_CACHE_DIR]["readOnly"] is True


def test_data_files_on_claims_are_mounted_into_the_trainer_and_rewritten() -> None:
    spec = _spec(
        data={"jsonl": "pvc://datasets/gsm8k/train.jsonl", "synthetic": None},
        evaluation={"everySteps": 5, "parquet": "pvc://eval.sets/gsm8k/test.parquet"},
    )
    children = build_children(JOB, spec, active=True)
    pod = _pod(children, "Job", "demo-trainer")
    volumes = _volumes(pod)
    assert volumes["data-datasets"]["persistentVolumeClaim"] == {"claimName": "datasets", "readOnly": True}
    assert volumes["data-eval-sets"]["persistentVolumeClaim"] == {"claimName": "eval.sets", "readOnly": True}
    assert _mounts(pod)[f"{DATA_ROOT}/datasets"]["readOnly"] is True
    config = _config(children)["spec"]
    assert config["data"]["jsonl"] == f"{DATA_ROOT}/datasets/gsm8k/train.jsonl"
    assert config["evaluation"]["parquet"] == f"{DATA_ROOT}/eval.sets/gsm8k/test.parquet"
    # Inference pods never read the data.
    assert not any(v["name"].startswith("data-") for v in _pod(children, "StatefulSet", "demo-infer-nv")["volumes"])


GSM8K = {"huggingFace": "openai/gsm8k", "revision": "main", "parquet": "main/train-00000-of-00001.parquet",
         "synthetic": None}


def test_download_step_fetches_the_dataset_file_into_the_trainer_with_the_token_from_a_secret() -> None:
    download = {"tokenSecretRef": {"name": "hf", "key": "token"}, "sizeLimit": "2Gi", "include": ["*.json"]}
    children = build_children(JOB, _spec(data={**GSM8K, "storage": {"download": download}}), active=True)
    pod = _pod(children, "Job", "demo-trainer")
    (init,) = pod["initContainers"]
    assert init["name"] == "data-download" and init["command"] == ["hf"]
    assert init["args"] == ["download", "openai/gsm8k", "main/train-00000-of-00001.parquet", "--repo-type", "dataset",
                            "--local-dir", DATA_HUB_DIR, "--revision", "main"]
    token = next(e for e in init["env"] if e["name"] == "HF_TOKEN")
    assert token == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    assert {"name": "data-hub", "mountPath": DATA_HUB_DIR, "readOnly": False} in init["volumeMounts"]
    assert _volumes(pod)["data-hub"] == {"name": "data-hub", "emptyDir": {"sizeLimit": "2Gi"}}
    assert _mounts(pod)[DATA_HUB_DIR]["readOnly"] is True, "the trainer only reads the download"
    # The runtime reads the downloaded file; its config is still a valid RLJob.
    config = _config(children)
    assert config["spec"]["data"]["parquet"] == f"{DATA_HUB_DIR}/main/train-00000-of-00001.parquet"
    assert not {"huggingFace", "revision", "storage"} & set(config["spec"]["data"])
    parse_rljob(config)
    # Inference pods never read the data.
    assert "initContainers" not in _pod(children, "StatefulSet", "demo-infer-nv")


def test_dataset_in_the_models_cache_claim_shares_one_volume_and_runs_offline() -> None:
    cache = "pvc://hf/hub"
    spec = _spec(
        model={"huggingFace": "Qwen/Qwen3-4B", "storage": {"huggingFaceCache": cache}},
        data={**GSM8K, "storage": {"huggingFaceCache": cache, "download": {}}},
    )
    children = build_children(JOB, spec, active=True)
    trainer = _pod(children, "Job", "demo-trainer")
    assert [v["name"] for v in trainer["volumes"]].count("hf-cache") == 1
    # The data download writes the cache, so the pod's volume is writable; the trainer still only reads it.
    assert _volumes(trainer)["hf-cache"]["persistentVolumeClaim"] == {"claimName": "hf", "readOnly": False}
    assert [m["mountPath"] for m in trainer["containers"][0]["volumeMounts"]].count(HF_CACHE_DIR) == 1
    assert _mounts(trainer)[HF_CACHE_DIR]["readOnly"] is True
    names = [e["name"] for e in trainer["containers"][0]["env"]]
    assert names.count("HF_HUB_CACHE") == 1 and names.count("HF_HUB_OFFLINE") == 1
    (init,) = trainer["initContainers"]
    assert init["name"] == "data-download"
    assert init["args"][:6] == ["download", "openai/gsm8k", "main/train-00000-of-00001.parquet", "--repo-type",
                                "dataset", "--cache-dir"]
    # The engines read the model from the same claim, read-only, and download nothing.
    engine = _pod(children, "StatefulSet", "demo-infer-nv")
    assert _volumes(engine)["hf-cache"]["persistentVolumeClaim"]["readOnly"] is True and "initContainers" not in engine
    # The runtime resolves the dataset file in that cache (HF_HUB_CACHE), offline.
    data = _config(children)["spec"]["data"]
    assert (data["huggingFace"], data["revision"], data["parquet"]) == (
        "openai/gsm8k", "main", "main/train-00000-of-00001.parquet")
    assert "storage" not in data


@pytest.mark.parametrize(("data", "message"), [
    ({"huggingFace": "openai/gsm8k", "synthetic": {}}, "data.huggingFace names a dataset repo"),
    ({"huggingFace": "openai/gsm8k", "jsonl": "/data/train.jsonl"}, "data.jsonl is a path inside the data.huggingFace"),
    ({"huggingFace": "openai/gsm8k", "parquet": "pvc://d/x.parquet"}, "data.parquet is a path inside"),
    ({"jsonl": "train.jsonl", "storage": {"download": {}}}, "data.storage applies to data.huggingFace"),
    ({"jsonl": "train.jsonl", "revision": "main"}, "data.revision applies to data.huggingFace"),
])
def test_dataset_sources_that_cannot_work_are_refused_naming_the_field(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RLJobSpec.model_validate({"model": {"huggingFace": "Qwen/Qwen3-4B"}, "data": data})


def test_model_and_data_caches_must_be_one_claim() -> None:
    with pytest.raises(ValueError, match="data.storage.huggingFaceCache must be model.storage.huggingFaceCache"):
        RLJobSpec.model_validate({
            "model": {"huggingFace": "Qwen/Qwen3-4B", "storage": {"huggingFaceCache": "pvc://models"}},
            "data": {**GSM8K, "storage": {"huggingFaceCache": "pvc://datasets"}},
        })


def test_weights_volume_is_shared_writable_by_the_trainer_and_read_only_by_the_engines() -> None:
    children = build_children(JOB, _spec(rollout={"weightsVolume": {"claim": "pvc://rl-weights/demo"}}), active=True)
    trainer = _pod(children, "Job", "demo-trainer")
    engine = _pod(children, "StatefulSet", "demo-infer-nv")
    assert _mounts(trainer)[WEIGHTS_DIR] == {"name": "weights", "mountPath": WEIGHTS_DIR, "readOnly": False, "subPath": "demo"}
    assert _mounts(engine)[WEIGHTS_DIR]["readOnly"] is True
    assert _volumes(engine)["weights"]["persistentVolumeClaim"] == {"claimName": "rl-weights", "readOnly": True}
    assert _config(children)["spec"]["rollout"]["sglang"]["weightsDir"] == WEIGHTS_DIR


def test_pvc_uris_split_into_claim_and_path() -> None:
    assert PvcRef.parse("pvc://models") == PvcRef("models", "")
    assert PvcRef.parse("pvc://models/a/b/") == PvcRef("models", "a/b")


@pytest.mark.parametrize(
    ("model", "pools", "field"),
    [
        ({"builtin": "tiny-arith"}, None, "spec.model.builtin"),
        ({"builtin": "tiny-arith"}, [{"name": "a", "vendor": "amd"}], "spec.model.builtin"),
        ({"path": "/models/qwen"}, [{"name": "n", "vendor": "nvidia"}], "spec.model.path"),
    ],
)
def test_cluster_rejects_models_gpu_pools_cannot_load(model: dict[str, Any], pools: Any, field: str) -> None:
    rollout = {"pools": pools} if pools else {}
    spec = RLJobSpec.model_validate({"model": model, "data": {"synthetic": {}}, "rollout": rollout})
    (problem,) = cluster_problems(spec)
    assert problem.startswith(field + ":")


def test_cluster_accepts_models_the_pods_can_see() -> None:
    for model in ({"path": "pvc://models/qwen"}, {"huggingFace": "Qwen/Qwen3-4B", "storage": {"download": {}}},
                  {"huggingFace": "Qwen/Qwen3-4B", "storage": {"huggingFaceCache": "pvc://hf-cache"}}):
        spec = RLJobSpec.model_validate({"model": model, "data": {"synthetic": {}}})
        assert cluster_problems(spec) == []
    # A Hub id alone: every pod would resolve it offline in an empty cache.
    alone = RLJobSpec.model_validate({"model": {"huggingFace": "Qwen/Qwen3-4B"}, "data": {"synthetic": {}}})
    assert [p.split(":")[0] for p in cluster_problems(alone)] == ["spec.model.huggingFace"]


def test_model_storage_needs_a_hub_id() -> None:
    with pytest.raises(ValueError, match="model.storage applies to model.huggingFace"):
        RLJobSpec.model_validate(
            {"model": {"path": "pvc://m", "storage": {"download": {}}}, "data": {"synthetic": {}}}
        )


# ------------------------------------------------------------------ images


@pytest.mark.parametrize("vendor", ["nvidia", "amd", "cpu"])
def test_trainer_image_follows_the_vendor(vendor: str) -> None:
    gpus = 0 if vendor == "cpu" else 1
    pod = _pod(build_children(JOB, _spec(trainer={"vendor": vendor, "gpusPerReplica": gpus}), active=True), "Job", "demo-trainer")
    image = pod["containers"][0]["image"]
    assert image == TRAINER_IMAGES[vendor]
    assert len(set(TRAINER_IMAGES.values())) == 3, "one image per vendor"
    assert image.endswith({"nvidia": "-cuda", "amd": "-rocm", "cpu": ".0"}[vendor])


def test_router_runs_the_small_router_image_not_the_cuda_sglang_one() -> None:
    pod = _pod(build_children(JOB, _spec(), active=True), "Deployment", "demo-router")
    image = pod["containers"][0]["image"]
    assert image == ROUTER_IMAGE and image != PROFILES["nvidia"].sglang_image
    assert "nvidia.com/gpu" not in str(pod["containers"][0]["resources"])


# ------------------------------------------------------------------ discovery


def _trainer_and_router(spec: RLJobSpec) -> tuple[str, dict[str, Any], dict[str, Any]]:
    children = build_children(JOB, spec, active=True)
    trainer = _by(children, "Job", "demo-trainer")["spec"]["template"]
    router = _by(children, "Deployment", "demo-router")["spec"]["template"]
    config = _by(children, "ConfigMap", "demo-config")["data"]["job.yaml"]
    return config, trainer, router


SCALED_POOLS = [
    {"name": "nv", "vendor": "nvidia", "replicas": 3, "tensorParallelSize": 2, "gpusPerReplica": 2},
    {"name": "mi", "vendor": "amd", "replicas": 4},
]


@pytest.mark.parametrize("scale", [{"replicas": 7}, {"pools": SCALED_POOLS}], ids=["scale-subresource", "pool-replicas"])
def test_scaling_changes_neither_the_trainer_config_nor_the_router(scale: dict[str, Any]) -> None:
    before = _trainer_and_router(_spec())
    after = _trainer_and_router(_spec(rollout=scale))
    assert after == before


def test_router_starts_empty_with_no_discovery_of_its_own_and_no_api_access() -> None:
    """The runtime alone adds workers (once they serve the current weights): the router gets no worker
    URLs, no --service-discovery, and no ServiceAccount, Role or token to watch pods with."""
    children = build_children(JOB, _spec(), active=True)
    pod = _pod(children, "Deployment", "demo-router")
    args = pod["containers"][0]["args"]
    assert not [a for a in args if a in ("--worker-urls", "--service-discovery", "--selector", "--prefill", "--decode")]
    assert args[args.index("--port") + 1] == "30000"
    assert "serviceAccountName" not in pod and pod["automountServiceAccountToken"] is False
    assert not [c for c in children if c["kind"] in ("ServiceAccount", "Role", "RoleBinding")
                and c["metadata"]["name"] == "demo-router"]
    # Empty, its /readiness is 503: Ready must follow /liveness, or the runtime could never reach it to fill it.
    container = pod["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/liveness"


def test_trainer_discovers_workers_through_the_api_and_may_list_pods() -> None:
    children = build_children(JOB, _spec(), active=True)
    sglang = parse_rljob(_config(children)).spec.rollout.sglang
    assert sglang.worker_urls == []
    assert sglang.discovery is not None
    assert sglang.discovery.selector == {"rljob.io/job-name": "demo", "rljob.io/role": "inference"}
    assert sglang.discovery.namespace == "team-a" and sglang.discovery.port == 30000
    rules = _by(children, "Role", "demo-trainer")["rules"]
    assert {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]} in rules


# ------------------------------------------------------------------ pod hygiene


def test_every_child_pod_is_hardened() -> None:
    children = build_children(JOB, _spec(), active=True)
    pods = _pods(children)
    assert set(pods) == {"demo-infer-nv", "demo-infer-mi", "demo-router", "demo-trainer"}
    for name, pod in pods.items():
        ctx = pod["securityContext"]
        assert ctx["runAsNonRoot"] is True and isinstance(ctx["runAsUser"], int) and ctx["runAsUser"] > 0, name
        assert ctx["fsGroup"] == 1000, name
        assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}, name
        writable = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
        for container in pod["containers"] + pod.get("initContainers", []):
            sec = container["securityContext"]
            assert sec["readOnlyRootFilesystem"] is True and sec["allowPrivilegeEscalation"] is False, name
            assert sec["capabilities"] == {"drop": ["ALL"]}, name
            assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"], f"{name}: no writable /tmp"
        assert "tmp" in writable
    assert {"name": "home", "mountPath": "/home/rljob"} in pods["demo-trainer"]["containers"][0]["volumeMounts"]
    sglang_env = {e["name"]: e["value"] for e in pods["demo-infer-nv"]["containers"][0]["env"] if "value" in e}
    assert sglang_env["HOME"].startswith("/tmp/") and sglang_env["TRITON_CACHE_DIR"].startswith("/tmp/")


def test_inference_and_router_pods_request_cpu_and_memory_with_defaults_and_overrides() -> None:
    spec = _spec(
        rollout={
            "pools": [
                {"name": "nv", "vendor": "nvidia", "gpusPerReplica": 2, "tensorParallelSize": 2, "shmSize": "4Gi",
                 "resources": {"requests": {"cpu": "8", "memory": "64Gi"}, "limits": {"memory": "128Gi"}}},
                {"name": "mi", "vendor": "amd"},
            ],
            "router": {"resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "4Gi"}}},
        }
    )
    children = build_children(JOB, spec, active=True)
    nv = _pod(children, "StatefulSet", "demo-infer-nv")
    mi = _pod(children, "StatefulSet", "demo-infer-mi")
    assert nv["containers"][0]["resources"] == {
        "requests": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "2"},
        "limits": {"memory": "128Gi", "nvidia.com/gpu": "2"},
    }
    assert mi["containers"][0]["resources"] == {
        "requests": {"cpu": "4", "memory": "32Gi", "amd.com/gpu": "1"},
        "limits": {"memory": "96Gi", "amd.com/gpu": "1"},
    }
    assert _volumes(nv)["shm"] == {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "4Gi"}}
    assert _volumes(mi)["shm"]["emptyDir"]["sizeLimit"] == "16Gi"
    router = _pod(children, "Deployment", "demo-router")["containers"][0]
    assert router["resources"] == {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "4Gi"}}
    default_router = _pod(build_children(JOB, _spec(), active=True), "Deployment", "demo-router")["containers"][0]
    assert default_router["resources"]["requests"] == {"cpu": "500m", "memory": "512Mi"}
    assert _volumes(_pod(children, "Job", "demo-trainer"))["shm"]["emptyDir"]["sizeLimit"] == "16Gi"


def test_env_can_come_from_secrets_and_config_maps() -> None:
    token = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    level = {"name": "LOG_LEVEL", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "level", "optional": True}}}
    spec = _spec(
        rollout={"pools": [{"name": "nv", "vendor": "nvidia", "env": [token]}]},
        trainer={"env": [level, {"name": "PLAIN", "value": "1"}]},
    )
    children = build_children(JOB, spec, active=True)
    assert token in _pod(children, "StatefulSet", "demo-infer-nv")["containers"][0]["env"]
    trainer_env = _pod(children, "Job", "demo-trainer")["containers"][0]["env"]
    assert level in trainer_env and {"name": "PLAIN", "value": "1"} in trainer_env
    for bad, message in (
        ({"name": "X", "value": "v", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}, "exclusive"),
        ({"name": "X", "valueFrom": {}}, "exactly one of secretKeyRef, configMapKeyRef"),
    ):
        with pytest.raises(ValueError, match=message):
            _spec(trainer={"env": [bad]})


def test_pull_secrets_priority_scheduler_and_extra_volumes_reach_every_pod() -> None:
    extra_volume = {"name": "certs", "secret": {"secretName": "ca"}}
    extra_mount = {"name": "certs", "mountPath": "/etc/ssl/custom", "readOnly": True}
    spec = _spec(
        pods={
            "imagePullSecrets": ["regcred"], "priorityClassName": "rl-high", "schedulerName": "volcano",
            "securityContext": {"fsGroup": 2000}, "volumes": [extra_volume], "volumeMounts": [extra_mount],
        }
    )
    for name, pod in _pods(build_children(JOB, spec, active=True)).items():
        assert pod["imagePullSecrets"] == [{"name": "regcred"}], name
        assert pod["priorityClassName"] == "rl-high" and pod["schedulerName"] == "volcano", name
        assert pod["securityContext"]["fsGroup"] == 2000, name
        assert extra_volume in pod["volumes"] and extra_mount in pod["containers"][0]["volumeMounts"], name
    # Operator-only knobs stay out of the trainer's config: changing them does not roll the trainer.
    assert "pods" not in _config(build_children(JOB, spec, active=True))["spec"]


def test_pods_run_as_the_images_users_unless_the_spec_names_others() -> None:
    image_uids = {"demo-infer-nv": SGLANG_UID, "demo-infer-mi": SGLANG_UID, "demo-router": ROUTER_UID,
                  "demo-trainer": RUNTIME_UID}
    for name, pod in _pods(build_children(JOB, _spec(), active=True)).items():
        ctx = pod["securityContext"]
        assert (ctx["runAsUser"], ctx["runAsGroup"], ctx["fsGroup"]) == (image_uids[name], image_uids[name], 1000), name
    spec = _spec(pods={"securityContext": {"runAsUser": 1000680000, "runAsGroup": 1000680001, "fsGroup": 1000680000}})
    for name, pod in _pods(build_children(JOB, spec, active=True)).items():
        ctx = pod["securityContext"]
        assert (ctx["runAsUser"], ctx["runAsGroup"], ctx["fsGroup"]) == (1000680000, 1000680001, 1000680000), name
        assert ctx["runAsNonRoot"] is True, name
    only_uid = _pods(build_children(JOB, _spec(pods={"securityContext": {"runAsUser": 4242}}), active=True))
    assert {(p["securityContext"]["runAsUser"], p["securityContext"]["runAsGroup"]) for p in only_uid.values()} == {
        (4242, 4242)}


@pytest.mark.parametrize(("ids", "field", "message"), [
    ({"runAsUser": 0}, "pods.securityContext.runAsUser", "runAsNonRoot"),
    ({"runAsUser": -1}, "pods.securityContext.runAsUser", "greater than or equal to 0"),
    ({"runAsGroup": 2**31}, "pods.securityContext.runAsGroup", "less than or equal to"),
    ({"fsGroup": -5}, "pods.securityContext.fsGroup", "greater than or equal to 0"),
    ({"runAsGroup": 0}, "pods.securityContext.runAsGroup", "root group"),
    ({"fsGroup": 0}, "pods.securityContext.fsGroup", "root group"),
])
def test_pod_ids_out_of_bounds_or_root_are_refused_naming_the_field(ids: dict, field: str, message: str) -> None:
    doc = {"apiVersion": "rljob.io/v1alpha1", "kind": "RLJob", "metadata": {"name": "demo"},
           "spec": {"model": {"huggingFace": "Qwen/Qwen3-4B"}, "data": {"synthetic": {}}, "pods": {"securityContext": ids}}}
    with pytest.raises(RLJobConfigError) as info:
        parse_rljob(doc, "job.yaml")
    assert field in str(info.value) and message in str(info.value), str(info.value)


def test_every_pool_gets_a_disruption_budget() -> None:
    spec = _spec(rollout={"pools": [{"name": "nv", "vendor": "nvidia", "maxUnavailable": 0}, {"name": "mi", "vendor": "amd"}]})
    children = build_children(JOB, spec, active=True)
    for pool, allowed in (("nv", 0), ("mi", 1)):
        pdb = _by(children, "PodDisruptionBudget", f"demo-infer-{pool}")
        sts = _by(children, "StatefulSet", f"demo-infer-{pool}")
        assert pdb["apiVersion"] == "policy/v1"
        assert pdb["spec"]["selector"] == sts["spec"]["selector"]
        assert pdb["spec"]["maxUnavailable"] == allowed
        assert pdb["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
