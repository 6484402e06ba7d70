"""Where the pods of a job find its model, data and shared weights: volumes, mounts and download steps.

Pure: an RLJob spec in, pod fragments out. The same fragments go into every pod that needs them, so
the inference and trainer pods see the model at the same path, and the runtime config the trainer
reads is rewritten to those paths (`runtime_paths`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rljob.api.spec import PVC_URI_PREFIX, DataSpec, HubDownloadSpec, HubStorageSpec, ModelS3Spec, ModelSpec, RLJobSpec, S3Spec
from rljob.operator.builders.pods import hardened_container_security, scratch_mount
from rljob.operator.builders.vendor import TRAINER_IMAGES

MODEL_DIR = "/var/lib/rljob/model"
HF_CACHE_DIR = "/var/lib/rljob/hf-cache"
DATA_ROOT = "/var/lib/rljob/data"
# data.huggingFace downloaded without a cache claim: the dataset repo's files, in an emptyDir.
DATA_HUB_DIR = "/var/lib/rljob/data-hub"
DATA_HUB_VOLUME = "data-hub"
DATA_DOWNLOAD_CONTAINER = "data-download"
WEIGHTS_DIR = "/var/lib/rljob/weights"
MODEL_VOLUME = "model"
HF_CACHE_VOLUME = "hf-cache"
WEIGHTS_VOLUME = "weights"
DOWNLOAD_CONTAINER = "model-download"
# model.uri: the download step mounts the model's emptyDir here and copies the folder into its `model`
# subfolder (written beside, then renamed into place); the main containers mount that subfolder at MODEL_DIR.
OBJECT_FETCH_DIR = "/var/lib/rljob/model-fetch"
OBJECT_FETCH_SUBDIR = "model"
# The keys an s3.credentialsSecret holds, passed under the same names (the AWS SDKs' and obstore's).
S3_SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
S3_OPTIONAL_SECRET_KEYS = ("AWS_SESSION_TOKEN",)


@dataclass(frozen=True)
class PvcRef:
    """`pvc://<claim>[/<path>]` split into the claim and the path inside it ("" for its root)."""

    claim: str
    path: str = ""

    @classmethod
    def parse(cls, uri: str) -> PvcRef:
        """Split a pvc:// URI (the spec's pattern has already checked its form)."""
        claim, _, path = uri.removeprefix(PVC_URI_PREFIX).partition("/")
        return cls(claim=claim, path=path.strip("/"))


def is_pvc(uri: str | None) -> bool:
    """True for a `pvc://` URI."""
    return uri is not None and uri.startswith(PVC_URI_PREFIX)


@dataclass
class PodStorage:
    """Volumes, main-container mounts, init containers and env one pod needs for its files."""

    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    init_containers: list[dict[str, Any]] = field(default_factory=list)
    env: list[dict[str, Any]] = field(default_factory=list)

    def add(self, other: PodStorage) -> PodStorage:
        """Both fragments in one. A volume both name (the Hugging Face cache of a model and of its
        data) appears once, writable if either needs it so; an identical mount or env entry once."""
        volumes = {v["name"]: v for v in self.volumes}
        for v in other.volumes:
            mine = volumes.get(v["name"])
            if mine is None:
                volumes[v["name"]] = v
            elif "persistentVolumeClaim" in mine and not v.get("persistentVolumeClaim", {}).get("readOnly", True):
                volumes[v["name"]] = v
        return PodStorage(
            volumes=list(volumes.values()),
            mounts=self.mounts + [m for m in other.mounts if m not in self.mounts],
            init_containers=self.init_containers + other.init_containers,
            env=self.env + [e for e in other.env if e not in self.env],
        )


def _claim_volume(name: str, claim: str, read_only: bool) -> dict[str, Any]:
    return {"name": name, "persistentVolumeClaim": {"claimName": claim, "readOnly": read_only}}


def _mount(name: str, path: str, sub_path: str = "", read_only: bool = True) -> dict[str, Any]:
    mount: dict[str, Any] = {"name": name, "mountPath": path, "readOnly": read_only}
    if sub_path:
        mount["subPath"] = sub_path
    return mount


def model_path_in_pods(model: ModelSpec) -> str:
    """What the pods load: a mounted folder, or the hub id resolved in a mounted cache (or by SGLang itself)."""
    if is_pvc(model.path) or model.uri is not None:
        return MODEL_DIR
    if model.hugging_face and model.storage and model.storage.download and not model.storage.hugging_face_cache:
        return MODEL_DIR
    return str(model.hugging_face or model.path or model.builtin)


@dataclass(frozen=True)
class HubRepo:
    """What one download step fetches: a repo of the Hub and where its files go."""

    repo_id: str
    revision: str | None
    repo_type: str  # "model" or "dataset"
    files: tuple[str, ...]  # positional file names (all of the repo when empty)
    local_volume: str  # the emptyDir when no cache claim holds the files
    local_dir: str
    container: str


def _download_container(repo: HubRepo, download: HubDownloadSpec, cache: PvcRef | None) -> dict[str, Any]:
    """Init container: `hf download <id>` into the cache claim or an emptyDir, token from a Secret."""
    target = ["--cache-dir", HF_CACHE_DIR] if cache else ["--local-dir", repo.local_dir]
    args = ["download", repo.repo_id, *repo.files]
    if repo.repo_type != "model":  # the CLI's default
        args += ["--repo-type", repo.repo_type]
    args += target
    if repo.revision:
        args += ["--revision", repo.revision]
    if not repo.files:  # the CLI ignores --include when files are named (a dataset's one file)
        for pattern in download.include:
            args += ["--include", pattern]
    env: list[dict[str, Any]] = [{"name": "HF_HOME", "value": "/tmp/hf-home"}, {"name": "HOME", "value": "/tmp"}]
    if download.token_secret_ref is not None:
        ref = download.token_secret_ref
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    if cache:
        mount = _mount(HF_CACHE_VOLUME, HF_CACHE_DIR, cache.path, False)
    else:
        mount = _mount(repo.local_volume, repo.local_dir, "", False)
    return {
        "name": repo.container,
        "image": download.image or TRAINER_IMAGES["cpu"],
        "command": ["hf"],
        "args": args,
        "env": env,
        "securityContext": hardened_container_security(),
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
        "volumeMounts": [mount, scratch_mount()],
    }


def _hub_storage(repo: HubRepo, storage: HubStorageSpec) -> PodStorage:
    """Volumes, mounts, env and download step of a Hub repo: its cache claim (read-only in the main
    container, writable at pod level only for a download into it), or an emptyDir it is downloaded into."""
    result = PodStorage()
    cache = PvcRef.parse(storage.hugging_face_cache) if storage.hugging_face_cache else None
    if cache is not None:
        result.volumes.append(_claim_volume(HF_CACHE_VOLUME, cache.claim, read_only=storage.download is None))
        result.mounts.append(_mount(HF_CACHE_VOLUME, HF_CACHE_DIR, cache.path))
        result.env += [{"name": "HF_HUB_CACHE", "value": HF_CACHE_DIR}, {"name": "HF_HUB_OFFLINE", "value": "1"}]
    elif storage.download is not None:
        result.volumes.append({"name": repo.local_volume, "emptyDir": {"sizeLimit": storage.download.size_limit}})
        result.mounts.append(_mount(repo.local_volume, repo.local_dir))
    if storage.download is not None:
        result.init_containers.append(_download_container(repo, storage.download, cache))
    return result


def s3_credentials_env(s3: S3Spec | None) -> list[dict[str, Any]]:
    """The object store's keys from `s3.credentialsSecret` (checkpoint.s3 or model.s3), as the standard
    AWS variables; none without a Secret (the pod's own environment then, e.g. a workload identity)."""
    if s3 is None or s3.credentials_secret is None:
        return []
    def ref(key: str, optional: bool) -> dict[str, Any]:
        selector = {"name": s3.credentials_secret, "key": key, **({"optional": True} if optional else {})}
        return {"name": key, "valueFrom": {"secretKeyRef": selector}}
    return [ref(k, False) for k in S3_SECRET_KEYS] + [ref(k, True) for k in S3_OPTIONAL_SECRET_KEYS]


def _object_model_storage(model: ModelSpec) -> PodStorage:
    """model.uri: an init container copies the folder from the object store into an emptyDir (the
    download image's rljob runtime, obstore), which the main container mounts read-only at MODEL_DIR."""
    assert model.uri is not None
    s3 = model.s3
    args = [model.uri, f"{OBJECT_FETCH_DIR}/{OBJECT_FETCH_SUBDIR}"]
    if s3 is not None and s3.endpoint:
        args += ["--endpoint", s3.endpoint]
    if s3 is not None and s3.region:
        args += ["--region", s3.region]
    download = {
        "name": DOWNLOAD_CONTAINER,
        "image": TRAINER_IMAGES["cpu"],
        "command": ["python", "-m", "rljob.runtime.models.object_source"],
        "args": args,
        "env": [{"name": "HOME", "value": "/tmp"}, *s3_credentials_env(s3)],
        "securityContext": hardened_container_security(),
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
        "volumeMounts": [_mount(MODEL_VOLUME, OBJECT_FETCH_DIR, read_only=False), scratch_mount()],
    }
    size = s3.size_limit if s3 is not None else ModelS3Spec().size_limit
    return PodStorage(
        volumes=[{"name": MODEL_VOLUME, "emptyDir": {"sizeLimit": size}}],
        mounts=[_mount(MODEL_VOLUME, MODEL_DIR, OBJECT_FETCH_SUBDIR)],
        init_containers=[download],
    )


def model_storage(spec: RLJobSpec) -> PodStorage:
    """Model volumes of an inference or trainer pod (read-only in the main container)."""
    model = spec.model
    if model.uri is not None:
        return _object_model_storage(model)
    if is_pvc(model.path):
        ref = PvcRef.parse(str(model.path))
        return PodStorage(
            volumes=[_claim_volume(MODEL_VOLUME, ref.claim, read_only=True)],
            mounts=[_mount(MODEL_VOLUME, MODEL_DIR, ref.path)],
        )
    if model.hugging_face is None or model.storage is None:
        return PodStorage()
    repo = HubRepo(model.hugging_face, model.revision, "model", (), MODEL_VOLUME, MODEL_DIR, DOWNLOAD_CONTAINER)
    return _hub_storage(repo, model.storage)


def _data_uris(spec: RLJobSpec) -> list[str]:
    files = (spec.data.jsonl, spec.data.parquet, spec.evaluation.jsonl, spec.evaluation.parquet)
    return [f for f in files if f is not None and is_pvc(f)]


def data_volume_name(claim: str) -> str:
    """Volume name of a data claim (claims are DNS subdomains; volume names must be DNS labels)."""
    return "data-" + claim.replace(".", "-")


def data_path_in_pods(uri: str) -> str:
    """Where the trainer reads a pvc:// data file."""
    ref = PvcRef.parse(uri)
    return f"{DATA_ROOT}/{ref.claim}/{ref.path}"


def data_hub_downloaded(data: DataSpec) -> bool:
    """data.huggingFace downloaded into an emptyDir (no cache claim): the trainer reads a plain file."""
    storage = data.storage
    return data.hugging_face is not None and storage is not None and storage.download is not None \
        and storage.hugging_face_cache is None


def data_storage(spec: RLJobSpec) -> PodStorage:
    """Read-only mounts of every claim the data and evaluation files live on, and the Hugging Face
    dataset of data.huggingFace (cache claim or download step) (trainer pods)."""
    claims = sorted({PvcRef.parse(uri).claim for uri in _data_uris(spec)})
    result = PodStorage(
        volumes=[_claim_volume(data_volume_name(c), c, read_only=True) for c in claims],
        mounts=[_mount(data_volume_name(c), f"{DATA_ROOT}/{c}") for c in claims],
    )
    data = spec.data
    if data.hugging_face is None or data.storage is None:
        return result
    repo = HubRepo(data.hugging_face, data.revision, "dataset", (str(data.file),), DATA_HUB_VOLUME, DATA_HUB_DIR,
                   DATA_DOWNLOAD_CONTAINER)
    return result.add(_hub_storage(repo, data.storage))


def weights_storage(spec: RLJobSpec, writable: bool) -> PodStorage:
    """The shared weights claim: writable for the trainer, read-only for the engines; none when unset."""
    volume = spec.rollout.weights_volume
    if volume is None:
        return PodStorage()
    ref = PvcRef.parse(volume.claim)
    return PodStorage(
        volumes=[_claim_volume(WEIGHTS_VOLUME, ref.claim, read_only=not writable)],
        mounts=[_mount(WEIGHTS_VOLUME, WEIGHTS_DIR, ref.path, read_only=not writable)],
    )


def runtime_paths(spec: RLJobSpec, wire: dict[str, Any]) -> None:
    """Rewrite the trainer's config (`spec.to_wire()`, in place) to the paths its pod mounts."""
    if model_path_in_pods(spec.model) == MODEL_DIR:
        wire["model"] = {"path": MODEL_DIR}
    else:
        wire["model"].pop("storage", None)
    data = wire["data"]
    data.pop("storage", None)
    if data_hub_downloaded(spec.data):
        # The download step put the repo's file at a plain path: the runtime reads that file.
        key = "jsonl" if spec.data.jsonl is not None else "parquet"
        data[key] = f"{DATA_HUB_DIR}/{spec.data.file}"
        data.pop("huggingFace")
        data.pop("revision", None)
    for section in ("data", "evaluation"):
        for key in ("jsonl", "parquet"):
            value = wire.get(section, {}).get(key)
            if is_pvc(value):
                wire[section][key] = data_path_in_pods(value)
    if spec.rollout.weights_volume is not None:
        wire["rollout"].setdefault("sglang", {})["weightsDir"] = WEIGHTS_DIR
    # Operator-only: the runtime never reads it, and it must not move the config hash.
    wire["rollout"].pop("weightsVolume", None)
