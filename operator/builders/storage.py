"""Where the pods of a job find its model, data and shared weights: volumes, mounts and download steps.

Pure: an RLJob spec in, pod fragments out. The same fragments go into every pod that needs them, so
the inference and trainer pods see the model at the same path, and the runtime config the trainer
reads is rewritten to those paths (`runtime_paths`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rljob.api.spec import PVC_URI_PREFIX, HubDownloadSpec, ModelSpec, RLJobSpec
from rljob.operator.builders.pods import hardened_container_security, scratch_mount
from rljob.operator.builders.vendor import TRAINER_IMAGES

MODEL_DIR = "/var/lib/rljob/model"
HF_CACHE_DIR = "/var/lib/rljob/hf-cache"
DATA_ROOT = "/var/lib/rljob/data"
WEIGHTS_DIR = "/var/lib/rljob/weights"
MODEL_VOLUME = "model"
HF_CACHE_VOLUME = "hf-cache"
WEIGHTS_VOLUME = "weights"
DOWNLOAD_CONTAINER = "model-download"


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
        """Both fragments in one (volumes of the same name appear once)."""
        names = {v["name"] for v in self.volumes}
        return PodStorage(
            volumes=self.volumes + [v for v in other.volumes if v["name"] not in names],
            mounts=self.mounts + other.mounts,
            init_containers=self.init_containers + other.init_containers,
            env=self.env + other.env,
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
    if is_pvc(model.path):
        return MODEL_DIR
    if model.hugging_face and model.storage and model.storage.download and not model.storage.hugging_face_cache:
        return MODEL_DIR
    return str(model.hugging_face or model.path or model.builtin)


def _download_container(model: ModelSpec, download: HubDownloadSpec, cache: PvcRef | None) -> dict[str, Any]:
    """Init container: `hf download <id>` into the cache claim or the model emptyDir, token from a Secret."""
    target = ["--cache-dir", HF_CACHE_DIR] if cache else ["--local-dir", MODEL_DIR]
    args = ["download", str(model.hugging_face), *target]
    if model.revision:
        args += ["--revision", model.revision]
    for pattern in download.include:
        args += ["--include", pattern]
    env: list[dict[str, Any]] = [{"name": "HF_HOME", "value": "/tmp/hf-home"}, {"name": "HOME", "value": "/tmp"}]
    if download.token_secret_ref is not None:
        ref = download.token_secret_ref
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    mount = _mount(HF_CACHE_VOLUME, HF_CACHE_DIR, cache.path, False) if cache else _mount(MODEL_VOLUME, MODEL_DIR, "", False)
    return {
        "name": DOWNLOAD_CONTAINER,
        "image": download.image or TRAINER_IMAGES["cpu"],
        "command": ["hf"],
        "args": args,
        "env": env,
        "securityContext": hardened_container_security(),
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
        "volumeMounts": [mount, scratch_mount()],
    }


def model_storage(spec: RLJobSpec) -> PodStorage:
    """Model volumes of an inference or trainer pod (read-only in the main container)."""
    model = spec.model
    if is_pvc(model.path):
        ref = PvcRef.parse(str(model.path))
        return PodStorage(
            volumes=[_claim_volume(MODEL_VOLUME, ref.claim, read_only=True)],
            mounts=[_mount(MODEL_VOLUME, MODEL_DIR, ref.path)],
        )
    storage = model.storage
    if model.hugging_face is None or storage is None:
        return PodStorage()
    result = PodStorage()
    cache = PvcRef.parse(storage.hugging_face_cache) if storage.hugging_face_cache else None
    if cache is not None:
        ref = cache
        # The download step (if any) writes the cache; the claim is then mounted writable at pod level
        # and read-only in the main container.
        result.volumes.append(_claim_volume(HF_CACHE_VOLUME, ref.claim, read_only=storage.download is None))
        result.mounts.append(_mount(HF_CACHE_VOLUME, HF_CACHE_DIR, ref.path))
        result.env += [{"name": "HF_HUB_CACHE", "value": HF_CACHE_DIR}, {"name": "HF_HUB_OFFLINE", "value": "1"}]
    elif storage.download is not None:
        result.volumes.append({"name": MODEL_VOLUME, "emptyDir": {"sizeLimit": storage.download.size_limit}})
        result.mounts.append(_mount(MODEL_VOLUME, MODEL_DIR))
    if storage.download is not None:
        result.init_containers.append(_download_container(model, storage.download, cache))
    return result


def _data_uris(spec: RLJobSpec) -> list[str]:
    files = (spec.data.jsonl, spec.data.parquet, spec.evaluation.jsonl, spec.evaluation.parquet)
    return [f for f in files if is_pvc(f)]


def data_volume_name(claim: str) -> str:
    """Volume name of a data claim (claims are DNS subdomains; volume names must be DNS labels)."""
    return "data-" + claim.replace(".", "-")


def data_path_in_pods(uri: str) -> str:
    """Where the trainer reads a pvc:// data file."""
    ref = PvcRef.parse(uri)
    return f"{DATA_ROOT}/{ref.claim}/{ref.path}"


def data_storage(spec: RLJobSpec) -> PodStorage:
    """Read-only mounts of every claim the data and evaluation files live on (trainer pods)."""
    claims = sorted({PvcRef.parse(uri).claim for uri in _data_uris(spec)})
    return PodStorage(
        volumes=[_claim_volume(data_volume_name(c), c, read_only=True) for c in claims],
        mounts=[_mount(data_volume_name(c), f"{DATA_ROOT}/{c}") for c in claims],
    )


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
    for section in ("data", "evaluation"):
        for key in ("jsonl", "parquet"):
            value = wire.get(section, {}).get(key)
            if is_pvc(value):
                wire[section][key] = data_path_in_pods(value)
    if spec.rollout.weights_volume is not None:
        wire["rollout"].setdefault("sglang", {})["weightsDir"] = WEIGHTS_DIR
    # Operator-only: the runtime never reads it, and it must not move the config hash.
    wire["rollout"].pop("weightsVolume", None)
