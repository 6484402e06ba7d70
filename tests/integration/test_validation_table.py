"""Every validation rule of the RLJob API, as a table, against the real API server and against pydantic.

Each invalid RLJob is created in the local control plane (the generated CRD, installed as the chart
does) and must be refused with HTTP 422 naming the field; the same document through
`parse_rljob` (what `rljob validate` and `rljob run` use) must fail naming the same field. The
valid examples shipped in docs/ and the chart pass both. Immutability needs an old object, so it is
checked against the API server only.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from rljob.api.load import RLJobConfigError, parse_rljob
from rljob.api.spec import cluster_problems
from rljob.operator import crdgen

from tests.cluster.kube import wait_until

GROUP, VERSION, PLURAL = "rljob.io", "v1alpha1", "rljobs"
REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted([*REPO.glob("docs/examples/*.yaml"), *REPO.glob("charts/rljob-operator/examples/*.yaml")])


def base() -> dict[str, Any]:
    """A valid RLJob touching every part the table mutates."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "RLJob",
        "metadata": {"name": "table"},
        "spec": {
            "model": {"huggingFace": "Qwen/Qwen3-0.6B", "storage": {"huggingFaceCache": "pvc://hf-cache"}},
            "data": {"synthetic": {"numPrompts": 64}},
            "rollout": {
                "rolloutBatchSize": 4,
                "pools": [
                    {"name": "nv", "vendor": "nvidia", "replicas": 1, "gpusPerReplica": 2, "tensorParallelSize": 2,
                     "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]},
                ],
            },
            "trainer": {"vendor": "cpu", "gpusPerReplica": 0, "env": [{"name": "HF_HOME", "value": "/cache"}]},
            "autotune": {"mode": "Recommend", "prometheus": {"address": "http://prometheus.monitoring:9090"}},
        },
    }


_STEP = re.compile(r"([A-Za-z]+)(?:\[(\d+)\])?")


def set_path(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """`doc` with `a.b[0].c` set to `value` (intermediate objects created)."""
    out = copy.deepcopy(doc)
    node: Any = out
    steps = [_STEP.fullmatch(p) for p in path.split(".")]
    for i, m in enumerate(steps):
        assert m is not None, path
        key, index = m.group(1), m.group(2)
        last = i == len(steps) - 1
        if index is None:
            if last:
                node[key] = value
            else:
                node = node.setdefault(key, {})
        else:
            item = node[key][int(index)]
            if last:
                node[key][int(index)] = value
            else:
                node = item
    return out


LONG_IMAGE = "registry.example.com/" + "a" * 600
# (case id, path, invalid value, substrings the rejection must contain: the field named)
INVALID: list[tuple[str, str, Any, tuple[str, ...]]] = [
    # bounds
    ("batch-zero", "spec.rollout.rolloutBatchSize", 0, ("rollout.rolloutBatchSize",)),
    ("batch-huge", "spec.rollout.rolloutBatchSize", 10**9, ("rollout.rolloutBatchSize",)),
    ("oversampling-huge", "spec.rollout.partial.overSampling", 100.0, ("rollout.partial.overSampling",)),
    ("top-p-above-one", "spec.rollout.topP", 1.5, ("rollout.topP",)),
    ("trainer-replicas-huge", "spec.trainer.replicas", 100_000, ("trainer.replicas",)),
    ("backoff-negative", "spec.backoffLimit", -1, ("backoffLimit",)),
    ("pool-replicas-huge", "spec.rollout.pools[0].replicas", 10**6, ("rollout.pools[0].replicas",)),
    ("learning-rate-huge", "spec.algorithm.learningRate", 5.0, ("algorithm.learningRate",)),
    ("seed-negative", "spec.data.synthetic.seed", -1, ("data.synthetic.seed",)),
    ("response-length-huge", "spec.rollout.maxResponseLength", 10**7, ("rollout.maxResponseLength",)),
    ("deadline-zero", "spec.activeDeadlineSeconds", 0, ("activeDeadlineSeconds",)),
    ("prometheus-timeout-huge", "spec.autotune.prometheus.timeoutSeconds", 600.0, ("autotune.prometheus.timeoutSeconds",)),
    # formats
    ("image-garbage", "spec.trainer.image", "Not A/Valid Image!", ("trainer.image",)),
    ("image-bad-digest", "spec.rollout.pools[0].image", "lmsysorg/sglang:v0.5@sha256:xyz", ("rollout.pools[0].image",)),
    ("image-too-long", "spec.rollout.router.image", LONG_IMAGE, ("rollout.router.image",)),
    ("pool-name-uppercase", "spec.rollout.pools[0].name", "Bad_Name", ("rollout.pools[0].name",)),
    ("node-selector-bad-key", "spec.trainer.nodeSelector", {"bad key!": "x"}, ("trainer.nodeSelector",)),
    ("node-selector-bad-value", "spec.rollout.pools[0].nodeSelector", {"gpu": "two words"}, ("rollout.pools[0].nodeSelector",)),
    ("storage-size-not-quantity", "spec.checkpoint.storageSize", "ten gigs", ("checkpoint.storageSize",)),
    ("storage-size-negative", "spec.checkpoint.storageSize", "-10Gi", ("checkpoint.storageSize",)),
    ("storage-class-not-dns", "spec.checkpoint.storageClassName", "Fast_SSD", ("checkpoint.storageClassName",)),
    ("pvc-claim-not-dns", "spec.checkpoint.uri", "pvc://Bad_Claim", ("checkpoint.uri",)),
    # The runtime writes only a claim or an object store: anything else used to become a path in the pod.
    ("checkpoint-uri-relative", "spec.checkpoint.uri", "runs/ckpt", ("checkpoint.uri",)),
    ("checkpoint-uri-s3-one-slash", "spec.checkpoint.uri", "s3:/bucket/x", ("checkpoint.uri",)),
    ("checkpoint-uri-other-scheme", "spec.checkpoint.uri", "gs://bucket/x", ("checkpoint.uri",)),
    ("checkpoint-s3-endpoint-no-scheme", "spec.checkpoint", {"uri": "s3://ckpt/x", "s3": {"endpoint": "minio:9000"}},
     ("checkpoint.s3.endpoint",)),
    ("prometheus-no-scheme", "spec.autotune.prometheus.address", "prometheus:9090", ("autotune.prometheus.address",)),
    # alert actions: a rollback only on a collapse, a learning rate only for it and never above the spec's
    ("alert-unknown", "spec.alertActions", [{"alert": "RLJobSomethingElse"}], ("alertActions[0].alert",)),
    ("alert-rollback-on-waste", "spec.alertActions", [{"alert": "RLJobTokenWasteHigh", "action": "RollbackToCheckpoint"}],
     ("alertActions[0]", "RollbackToCheckpoint")),
    ("alert-learning-rate-on-notify", "spec.alertActions", [{"alert": "RLJobEntropyCollapse", "learningRate": 1e-6}],
     ("alertActions[0]", "learningRate")),
    ("alert-learning-rate-above-spec", "spec.alertActions",
     [{"alert": "RLJobRewardCollapse", "action": "RollbackToCheckpoint", "learningRate": 1e-3}],
     ("alertActions", "learningRate")),
    ("alert-listed-twice", "spec.alertActions", [{"alert": "RLJobEntropyCollapse"}, {"alert": "RLJobEntropyCollapse"}],
     ("alertActions",)),
    ("alert-for-negative", "spec.alertActions", [{"alert": "RLJobEntropyCollapse", "forSeconds": -1}],
     ("alertActions[0].forSeconds",)),
    ("rollback-id-not-dns", "spec.checkpoint.rollbackTo", {"step": 5, "id": "Bad_Id"}, ("checkpoint.rollbackTo.id",)),
    ("worker-url-garbage", "spec.rollout.sglang.workerUrls", ["not a url"], ("rollout.sglang.workerUrls[0]",)),
    ("env-name-bad", "spec.trainer.env[0].name", "1 BAD NAME", ("trainer.env[0].name",)),
    ("resource-name-no-domain", "spec.rollout.pools[0].resourceName", "gpu", ("rollout.pools[0].resourceName",)),
    ("secret-name-not-dns", "spec.autotune.prometheus.bearerTokenSecretRef", {"name": "Bad_Secret", "key": "token"},
     ("autotune.prometheus.bearerTokenSecretRef.name",)),
    ("toleration-key-bad", "spec.rollout.pools[0].tolerations[0].key", "bad key", ("rollout.pools[0].tolerations[0].key",)),
    # tolerations Kubernetes itself would refuse on every child pod
    ("toleration-exists-with-value", "spec.rollout.pools[0].tolerations[0]",
     {"key": "nvidia.com/gpu", "operator": "Exists", "value": "true"},
     ("rollout.pools[0].tolerations[0]", "value must be empty when operator is Exists")),
    ("toleration-empty-key-equal", "spec.rollout.pools[0].tolerations[0]", {"operator": "Equal", "value": "x"},
     ("rollout.pools[0].tolerations[0]", "operator must be Exists when key is empty")),
    ("toleration-empty-key-default-operator", "spec.trainer.tolerations", [{"effect": "NoSchedule"}],
     ("trainer.tolerations[0]", "operator must be Exists when key is empty")),
    ("toleration-seconds-without-noexecute", "spec.rollout.pools[0].tolerations[0]",
     {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 30},
     ("rollout.pools[0].tolerations[0]", "tolerationSeconds applies only to effect NoExecute")),
    ("toleration-effect-unknown", "spec.rollout.pools[0].tolerations[0].effect", "NoRun",
     ("rollout.pools[0].tolerations[0].effect",)),
    ("hf-id-garbage", "spec.model.huggingFace", "not a / hub id", ("model.huggingFace",)),
    # model.uri: a folder in an object store, nothing the runtime cannot fetch
    ("model-uri-bucket-only", "spec.model", {"uri": "s3://models"}, ("model.uri", "s3://BUCKET/FOLDER")),
    ("model-uri-other-scheme", "spec.model", {"uri": "gs://models/tiny"}, ("model.uri", "s3://BUCKET/FOLDER")),
    ("model-uri-and-hub-id", "spec.model.uri", "s3://models/tiny", ("model", "exactly one of builtin, path, huggingFace, uri")),
    ("model-s3-without-uri", "spec.model", {"path": "pvc://models/tiny", "s3": {"endpoint": "http://minio:9000"}},
     ("model.s3 applies to model.uri",)),
    ("model-s3-endpoint-no-scheme", "spec.model", {"uri": "s3://models/tiny", "s3": {"endpoint": "minio:9000"}},
     ("model.s3.endpoint",)),
    ("hf-dataset-id-garbage", "spec.data", {"huggingFace": "not a / hub id", "jsonl": "train.jsonl"},
     ("data.huggingFace",)),
    ("pod-uid-too-big", "spec.pods.securityContext.runAsUser", 2**31, ("pods.securityContext.runAsUser",)),
    ("pod-gid-negative", "spec.pods.securityContext.runAsGroup", -1, ("pods.securityContext.runAsGroup",)),
    ("pod-fs-group-negative", "spec.pods.securityContext.fsGroup", -1, ("pods.securityContext.fsGroup",)),
    ("job-name-too-long", "metadata.name", "j" * 41, ("metadata.name",)),
    ("job-name-underscore", "metadata.name", "my_job", ("metadata.name",)),
    # cross-field
    ("gpu-vendor-zero-gpus", "spec.trainer.vendor", "nvidia", ("trainer.gpusPerReplica",)),
    ("tp-does-not-divide", "spec.rollout.pools[0].gpusPerReplica", 3, ("rollout.pools[0]", "tensorParallelSize")),
    ("one-sample-per-group", "spec.rollout.samplesPerPrompt", 1, ("rollout.samplesPerPrompt",)),
    ("autotune-oversampling-below-runtime", "spec.autotune.overSampling", {"min": 0.5, "max": 2, "maxStep": 0.5},
     ("autotune.overSampling.min",)),
    ("autotune-k-zero", "spec.autotune.truncationK", {"min": 0, "max": 2, "maxStep": 0.5}, ("autotune.truncationK.min",)),
    ("autotune-tokens-zero", "spec.autotune.truncationTokens", {"min": 0, "max": 64, "maxStep": 8},
     ("autotune.truncationTokens.min",)),
    ("autotune-oversampling-above-runtime", "spec.autotune.overSampling", {"min": 1, "max": 64, "maxStep": 0.5},
     ("autotune.overSampling.max",)),
    ("extra-args-owned-tp", "spec.rollout.pools[0].extraArgs", ["--tp", "4"], ("rollout.pools[0].extraArgs",)),
    ("extra-args-owned-port", "spec.rollout.pools[0].extraArgs", ["--port=31000"], ("rollout.pools[0].extraArgs",)),
    ("pod-uid-root", "spec.pods.securityContext.runAsUser", 0, ("pods.securityContext.runAsUser", "runAsNonRoot")),
    ("pod-gid-root", "spec.pods.securityContext.runAsGroup", 0, ("pods.securityContext.runAsGroup", "root group")),
    ("pod-fs-group-root", "spec.pods.securityContext.fsGroup", 0, ("pods.securityContext.fsGroup", "root group")),
    ("extra-args-owned-api-key", "spec.rollout.pools[0].extraArgs", ["--api-key", "mine"], ("rollout.pools[0].extraArgs",)),
    ("hf-dataset-no-file", "spec.data", {"huggingFace": "openai/gsm8k", "synthetic": {}}, ("data.huggingFace",)),
    ("hf-dataset-file-absolute", "spec.data", {"huggingFace": "openai/gsm8k", "jsonl": "/data/train.jsonl"},
     ("data.jsonl",)),
    ("hf-dataset-file-on-claim", "spec.data", {"huggingFace": "openai/gsm8k", "parquet": "pvc://d/train.parquet"},
     ("data.parquet",)),
    ("data-storage-without-hub", "spec.data", {"jsonl": "train.jsonl", "storage": {"download": {}}}, ("data.storage",)),
    ("data-revision-without-hub", "spec.data", {"jsonl": "train.jsonl", "revision": "main"}, ("data.revision",)),
    ("data-cache-not-the-models", "spec", {
        "model": {"huggingFace": "Qwen/Qwen3-0.6B", "storage": {"huggingFaceCache": "pvc://models"}},
        "data": {"huggingFace": "openai/gsm8k", "jsonl": "train.jsonl", "storage": {"huggingFaceCache": "pvc://sets"}},
        "rollout": {"rolloutBatchSize": 4}}, ("data.storage.huggingFaceCache",)),
    ("resource-name-other-vendor", "spec.rollout.pools[0].resourceName", "amd.com/gpu", ("rollout.pools[0]", "resourceName")),
    ("gpus-beyond-tp", "spec.rollout.pools[0].gpusPerReplica", 4,
     ("rollout.pools[0]", "gpusPerReplica must equal tensorParallelSize")),
    ("extra-args-data-parallel", "spec.rollout.pools[0].extraArgs", ["--dp-size", "2"],
     ("rollout.pools[0].extraArgs", "data parallelism")),
    # sizes (CEL cost bounds)
    ("extra-args-too-many", "spec.rollout.pools[0].extraArgs", [f"--x{i}" for i in range(65)], ("rollout.pools[0].extraArgs",)),
    ("node-selector-too-many", "spec.trainer.nodeSelector", {f"k{i}": "v" for i in range(65)}, ("trainer.nodeSelector",)),
    ("stop-strings-too-many", "spec.rollout.stop", ["x"] * 17, ("rollout.stop",)),
]


def invalid_doc(path: str, value: Any) -> dict[str, Any]:
    return set_path(base(), path, value)


NV_POOL = {"name": "nv", "vendor": "nvidia", "gpusPerReplica": 2, "tensorParallelSize": 2}
AMD_POOL = {"name": "mi", "vendor": "amd"}
CPU_POOL = {"name": "cpu", "vendor": "cpu"}
GPU_TRAINER = {"vendor": "nvidia", "gpusPerReplica": 1}


def weight_sync_doc(pools: list[dict[str, Any]], trainer: dict[str, Any], transport: dict[str, Any],
                    **rollout: Any) -> dict[str, Any]:
    """The base document with sglang engines, these pools and this trainer and weight transport."""
    doc = base()
    doc["spec"]["rollout"] = {"engine": "sglang", "rolloutBatchSize": 4, "pools": pools,
                              "weightTransport": transport, **rollout}
    doc["spec"]["trainer"] = trainer
    return doc


# Combinations only a cluster cannot run (CLUSTER_RULES): `rljob run` takes them, the API server and
# `rljob validate --cluster` refuse them. (case id, document, field named)
CLUSTER_INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("nccl-amd-pool-nvidia-trainer", weight_sync_doc([NV_POOL, AMD_POOL], GPU_TRAINER, {}),
     "rollout.weightTransport.mode"),
    ("nccl-explicit-cpu-pool", weight_sync_doc([CPU_POOL], GPU_TRAINER, {"mode": "distributed", "backend": "nccl"}),
     "rollout.weightTransport.mode"),
    ("nccl-default-pool-amd-trainer", weight_sync_doc([], {"vendor": "amd", "gpusPerReplica": 1}, {}),
     "rollout.weightTransport.mode"),
    ("disk-without-shared-folder", weight_sync_doc([NV_POOL, AMD_POOL], GPU_TRAINER, {"mode": "disk"}),
     "rollout.weightTransport.mode"),
]
# Hub ids no pod could resolve, and a checkpoint claim that cannot serve its pods: refused (naming the
# field) by `rljob validate --cluster` and the API server alike. (case id, document, field named)
HUB_OFFLINE = {"huggingFace": "Qwen/Qwen3-0.6B"}
HUB_DATA_OFFLINE = {"huggingFace": "openai/gsm8k", "jsonl": "main/train.jsonl"}
CLUSTER_REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("hub-model-no-cache-no-download", set_path(base(), "spec.model", HUB_OFFLINE), "model.huggingFace"),
    ("hub-model-empty-storage", set_path(base(), "spec.model", {**HUB_OFFLINE, "storage": {}}), "model.huggingFace"),
    ("hub-data-no-cache-no-download", set_path(base(), "spec.data", HUB_DATA_OFFLINE), "data.huggingFace"),
    ("checkpoint-rwo-two-trainers", set_path(base(), "spec.trainer.replicas", 2), "checkpoint.accessMode"),
]
CLUSTER_ACCEPTED: list[tuple[str, dict[str, Any]]] = [
    ("hub-model-download", set_path(base(), "spec.model", {**HUB_OFFLINE, "storage": {"download": {}}})),
    # A cluster without egress: the weights come from its own object store.
    ("model-from-object-store", set_path(base(), "spec.model", {
        "uri": "s3://models/qwen3-0.6b", "s3": {"endpoint": "http://seaweedfs.storage:8333", "credentialsSecret": "s3-keys"}})),
    ("hub-data-cache", set_path(base(), "spec.data", {**HUB_DATA_OFFLINE, "storage": {"huggingFaceCache": "pvc://hf-cache"}})),
    ("checkpoint-rwx-two-trainers", set_path(set_path(base(), "spec.trainer.replicas", 2), "spec.checkpoint",
                                             {"accessMode": "ReadWriteMany"})),
    ("checkpoint-own-claim-two-trainers", set_path(set_path(base(), "spec.trainer.replicas", 2), "spec.checkpoint",
                                                   {"uri": "pvc://shared-checkpoints"})),
]
# ...and what they accept: a transport every pool can take.
CLUSTER_VALID: list[tuple[str, dict[str, Any]]] = [
    ("disk-mixed-vendors", weight_sync_doc([NV_POOL, AMD_POOL], GPU_TRAINER, {"mode": "disk"},
                                           weightsVolume={"claim": "pvc://weights"})),
    ("gloo-mixed-vendors", weight_sync_doc([NV_POOL, AMD_POOL, CPU_POOL], GPU_TRAINER, {"backend": "gloo"})),
    ("nccl-one-vendor", weight_sync_doc([NV_POOL], GPU_TRAINER, {"mode": "distributed", "backend": "nccl"})),
    ("nccl-amd-only", weight_sync_doc([AMD_POOL], {"vendor": "amd", "gpusPerReplica": 1}, {})),
    ("cpu-trainer-gloo-by-default", weight_sync_doc([NV_POOL, AMD_POOL], {"vendor": "cpu", "gpusPerReplica": 0}, {})),
]


@pytest.mark.parametrize(("case", "doc", "field"), CLUSTER_INVALID, ids=[c[0] for c in CLUSTER_INVALID])
def test_validate_cluster_refuses_a_transport_some_pool_cannot_take(case: str, doc: dict[str, Any], field: str) -> None:
    spec = parse_rljob(copy.deepcopy(doc), "job.yaml").spec  # a laptop run accepts it
    problems = cluster_problems(spec)
    assert [p.split(":")[0] for p in problems] == [f"spec.{field}"], (case, problems)
    assert "; set rollout." in problems[0], problems  # and says what to do


@pytest.mark.parametrize(("case", "doc"), CLUSTER_VALID, ids=[c[0] for c in CLUSTER_VALID])
def test_validate_cluster_accepts_a_transport_every_pool_can_take(case: str, doc: dict[str, Any]) -> None:
    assert cluster_problems(parse_rljob(copy.deepcopy(doc), "job.yaml").spec) == [], case


@pytest.mark.parametrize(("case", "doc", "field"), CLUSTER_REFUSED, ids=[c[0] for c in CLUSTER_REFUSED])
def test_validate_cluster_refuses_what_no_pod_can_use(case: str, doc: dict[str, Any], field: str) -> None:
    spec = parse_rljob(copy.deepcopy(doc), "job.yaml").spec  # a laptop run accepts it
    assert [p.split(":")[0] for p in cluster_problems(spec)] == [f"spec.{field}"], case


@pytest.mark.parametrize(("case", "doc"), CLUSTER_ACCEPTED, ids=[c[0] for c in CLUSTER_ACCEPTED])
def test_validate_cluster_accepts_what_the_pods_can_use(case: str, doc: dict[str, Any]) -> None:
    assert cluster_problems(parse_rljob(copy.deepcopy(doc), "job.yaml").spec) == [], case


@pytest.mark.parametrize(("case", "path", "value", "fields"), INVALID, ids=[c[0] for c in INVALID])
def test_pydantic_rejects_naming_the_field(case: str, path: str, value: Any, fields: tuple[str, ...]) -> None:
    with pytest.raises(RLJobConfigError) as info:
        parse_rljob(invalid_doc(path, value), "job.yaml")
    for field in fields:
        assert field in str(info.value), (case, field, str(info.value))


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_shipped_examples_are_valid_for_pydantic(example: Path) -> None:
    parse_rljob(yaml.safe_load(example.read_text()), str(example))


def test_base_document_is_valid_for_pydantic() -> None:
    parse_rljob(base())


# ------------------------------------------------------------------------------------------------
# the real API server


@pytest.fixture(scope="module")
def api(kube_cluster: Any) -> Iterator[k8s.CustomObjectsApi]:
    """The generated CRD installed by server-side apply, as the chart does; the API server must accept
    it (a CRD whose CEL rules exceed the cost budget is refused here)."""
    applied = kube_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crdgen.CRD_PATH), check=False)
    assert applied.returncode == 0, f"the API server refused the CRD:\n{applied.stderr}"
    ext = k8s.ApiextensionsV1Api(kube_cluster.api)

    def established() -> bool:
        conds = ext.read_custom_resource_definition("rljobs.rljob.io").status.conditions or []
        return any(c.type == "Established" and c.status == "True" for c in conds)

    wait_until(established, 120, "RLJob CRD established")
    yield k8s.CustomObjectsApi(kube_cluster.api)


@pytest.fixture(scope="module")
def table_namespace(kube_cluster: Any) -> Iterator[str]:
    name = kube_cluster.create_namespace("validation")
    yield name
    kube_cluster.delete_namespace(name)


def create(api: k8s.CustomObjectsApi, namespace: str, doc: dict[str, Any]) -> dict[str, Any]:
    return api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, doc, field_validation="Strict")


@pytest.mark.cluster
@pytest.mark.parametrize(("case", "path", "value", "fields"), INVALID, ids=[c[0] for c in INVALID])
def test_api_server_rejects_naming_the_field(
    api: k8s.CustomObjectsApi, table_namespace: str, case: str, path: str, value: Any, fields: tuple[str, ...]
) -> None:
    doc = invalid_doc(path, value)
    with pytest.raises(ApiException) as info:
        create(api, table_namespace, doc)
    assert info.value.status == 422, (case, info.value.body)
    for field in fields:
        assert field in info.value.body, (case, field, info.value.body)


@pytest.mark.cluster
def test_api_server_accepts_the_base_and_the_shipped_examples(api: k8s.CustomObjectsApi, table_namespace: str) -> None:
    """Cluster examples are accepted; local-only ones (`rljob validate --cluster` names their problem,
    e.g. a builtin model with the default GPU pool) are refused by the CRD's cluster rules, naming the field."""
    created = create(api, table_namespace, base())
    assert created["spec"]["checkpoint"]["accessMode"] == "ReadWriteOnce"  # defaults still filled in
    local_only = 0
    for example in EXAMPLES:
        doc = yaml.safe_load(example.read_text())
        doc["metadata"].pop("namespace", None)
        problems = cluster_problems(parse_rljob(copy.deepcopy(doc), str(example)).spec)
        if not problems:
            create(api, table_namespace, doc)
            continue
        local_only += 1
        with pytest.raises(ApiException) as info:
            create(api, table_namespace, doc)
        assert info.value.status == 422, (example.name, info.value.body)
        for problem in problems:
            assert problem.split(":")[0].removeprefix("spec.") in info.value.body, (example.name, problem)
    assert local_only < len(EXAMPLES), "no cluster example was created"


# (case id, checkpoint at creation, merge patch of spec.checkpoint, field named)
IMMUTABLE: list[tuple[str, dict[str, Any], dict[str, Any], str]] = [
    ("uri-added", {}, {"uri": "pvc://existing"}, "checkpoint.uri"),
    ("uri-changed", {"uri": "pvc://one"}, {"uri": "pvc://two"}, "checkpoint.uri"),
    ("uri-removed", {"uri": "pvc://one"}, {"uri": None}, "checkpoint.uri"),
    ("storage-class-added", {}, {"storageClassName": "fast"}, "checkpoint.storageClassName"),
    ("storage-class-changed", {"storageClassName": "fast"}, {"storageClassName": "slow"}, "checkpoint.storageClassName"),
    ("storage-class-removed", {"storageClassName": "fast"}, {"storageClassName": None}, "checkpoint.storageClassName"),
    ("access-mode-changed", {}, {"accessMode": "ReadWriteMany"}, "checkpoint.accessMode"),
]


@pytest.mark.cluster
@pytest.mark.parametrize(("case", "initial", "patch", "field"), IMMUTABLE, ids=[c[0] for c in IMMUTABLE])
def test_api_server_keeps_checkpoint_location_immutable(
    api: k8s.CustomObjectsApi, table_namespace: str, case: str, initial: dict[str, Any], patch: dict[str, Any], field: str
) -> None:
    doc = base()
    doc["metadata"]["name"] = f"imm-{case}"
    doc["spec"]["checkpoint"] = initial
    create(api, table_namespace, doc)
    with pytest.raises(ApiException) as info:
        api.patch_namespaced_custom_object(
            GROUP, VERSION, table_namespace, PLURAL, doc["metadata"]["name"], {"spec": {"checkpoint": patch}}
        )
    assert info.value.status == 422 and field in info.value.body and "immutable" in info.value.body, info.value.body
    # The rest of the checkpoint section stays mutable.
    changed = api.patch_namespaced_custom_object(
        GROUP, VERSION, table_namespace, PLURAL, doc["metadata"]["name"], {"spec": {"checkpoint": {"everySteps": 7}}}
    )
    assert changed["spec"]["checkpoint"]["everySteps"] == 7


@pytest.mark.cluster
def test_api_server_applies_the_weight_transport_cluster_rules(api: k8s.CustomObjectsApi, table_namespace: str) -> None:
    """The CRD's CEL twin of `cluster_problems`' transport rules: the same documents refused (naming the
    field) and accepted."""
    check_cluster_rules(api, table_namespace, CLUSTER_INVALID, CLUSTER_VALID)


def check_cluster_rules(api: k8s.CustomObjectsApi, namespace: str, refused: list[tuple[str, dict[str, Any], str]],
                        accepted: list[tuple[str, dict[str, Any]]]) -> None:
    """Create each document: the `refused` ones must fail with 422 naming their field, the `accepted` ones pass."""
    for case, doc, field in refused:
        doc = copy.deepcopy(doc)
        doc["metadata"]["name"] = case[:40].rstrip("-")
        with pytest.raises(ApiException) as info:
            create(api, namespace, doc)
        assert info.value.status == 422 and field in info.value.body, (case, info.value.body)
    for case, doc in accepted:
        doc = copy.deepcopy(doc)
        doc["metadata"]["name"] = case[:40].rstrip("-")
        create(api, namespace, doc)


@pytest.mark.cluster
def test_api_server_applies_the_hub_and_claim_cluster_rules(api: k8s.CustomObjectsApi, table_namespace: str) -> None:
    """The CRD's CEL twins of `cluster_problems`' Hub and claim rules: the same documents refused (naming
    the field) and accepted."""
    check_cluster_rules(api, table_namespace, CLUSTER_REFUSED, CLUSTER_ACCEPTED)
