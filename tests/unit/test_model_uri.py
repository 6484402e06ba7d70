"""model.uri: s3://bucket/folder: what admission accepts, and the download step every model pod gets.

The download itself runs against a real store in tests/integration/test_model_object_store.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from rljob.api.spec import ModelSpec, RLJobSpec, cluster_problems
from rljob.operator.builders import JobRef, build_children
from rljob.operator.builders.images import ImageDefaults, ImageRef, apply_image_defaults
from rljob.operator.builders.pods import pod_templates
from rljob.operator.builders.storage import DOWNLOAD_CONTAINER, MODEL_DIR
from rljob.operator.builders.trainer import runtime_document
from rljob.runtime.models.object_source import local_copy_dir

EXAMPLE = Path(__file__).resolve().parents[2] / "charts/rljob-operator/examples/cpu-only.yaml"
JOB = JobRef(name="tiny", namespace="team-a", uid="uid-1")
URI = "s3://models/tiny/v1"


@pytest.mark.parametrize("uri", [URI, "s3://my.models/tiny", "s3://models//tiny/"])
def test_admission_accepts_a_folder_in_a_bucket(uri: str) -> None:
    assert ModelSpec(uri=uri, s3={"endpoint": "http://seaweedfs.storage:8333"}).uri == uri


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"uri": "s3://models"}, r"model\.uri must be s3://BUCKET/FOLDER"),  # the bucket alone: no folder
        ({"uri": "s3://models/"}, r"model\.uri must be s3://BUCKET/FOLDER"),
        ({"uri": "/srv/models/tiny"}, r"model\.uri must be s3://BUCKET/FOLDER.*goes in model\.path"),
        ({"uri": "gs://models/tiny"}, r"model\.uri must be s3://BUCKET/FOLDER"),
        ({"uri": "s3://Models/tiny"}, r"model\.uri must be s3://BUCKET/FOLDER"),
        ({"uri": "s3://models/a/../tiny"}, r"\nuri\n[\s\S]*'\.\.' segment"),
        ({"uri": URI, "path": "/srv/tiny"}, "exactly one of builtin, path, huggingFace, uri"),
        ({"path": "/srv/tiny", "s3": {"endpoint": "http://minio:9000"}}, r"model\.s3 applies to model\.uri"),
        ({"uri": URI, "s3": {"endpoint": "minio:9000"}}, r"s3\.endpoint"),
    ],
)
def test_admission_refuses_what_cannot_be_fetched_naming_the_field(model: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ModelSpec.model_validate(model)


def _children(model: dict[str, Any]) -> list[dict[str, Any]]:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["model"] = model
    return build_children(JOB, RLJobSpec.model_validate(doc["spec"]), active=True)


def test_every_model_pod_downloads_the_folder_before_it_starts() -> None:
    model = {"uri": URI, "s3": {"endpoint": "http://seaweedfs.storage:8333", "region": "eu-1",
                                "credentialsSecret": "s3-keys", "sizeLimit": "3Gi"}}
    children = _children(model)
    pods = pod_templates(children)
    model_pods = [p for p in pods if any(c["name"] in ("trainer", "sglang") for c in p["containers"])]
    assert len(model_pods) == 2, "the trainer and the cpu pool load the model"
    for pod in model_pods:
        (download,) = [c for c in pod["initContainers"] if c["name"] == DOWNLOAD_CONTAINER]
        assert download["command"] == ["python", "-m", "rljob.runtime.models.object_source"]
        assert download["args"][0] == URI
        assert download["args"][2:] == ["--endpoint", "http://seaweedfs.storage:8333", "--region", "eu-1"]
        keys = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in download["env"] if "valueFrom" in e}
        assert keys["AWS_ACCESS_KEY_ID"] == {"name": "s3-keys", "key": "AWS_ACCESS_KEY_ID"}
        assert keys["AWS_SECRET_ACCESS_KEY"] == {"name": "s3-keys", "key": "AWS_SECRET_ACCESS_KEY"}
        assert keys["AWS_SESSION_TOKEN"]["optional"] is True
        (volume,) = [v for v in pod["volumes"] if v["name"] == "model"]
        assert volume == {"name": "model", "emptyDir": {"sizeLimit": "3Gi"}}
        # The step writes args[1] inside its mount of the volume; the main container sees that subfolder.
        (fetch_mount,) = [m for m in download["volumeMounts"] if m["name"] == "model"]
        assert not fetch_mount["readOnly"]
        sub = Path(download["args"][1]).relative_to(fetch_mount["mountPath"])
        main = next(c for c in pod["containers"] if c["name"] in ("trainer", "sglang"))
        (model_mount,) = [m for m in main["volumeMounts"] if m["name"] == "model"]
        assert model_mount == {"name": "model", "mountPath": MODEL_DIR, "readOnly": True, "subPath": str(sub)}
        assert not [e for e in main.get("env", []) if e["name"].startswith("AWS_")], "the keys stay in the step"
    inference = next(c for p in model_pods for c in p["containers"] if c["name"] == "sglang")
    assert inference["args"][inference["args"].index("--model-path") + 1] == MODEL_DIR
    spec = RLJobSpec.model_validate({**yaml.safe_load(EXAMPLE.read_text())["spec"], "model": model})
    assert runtime_document(JOB, spec)["spec"]["model"] == {"path": MODEL_DIR}


def test_the_download_step_takes_the_configured_download_image() -> None:
    children = _children({"uri": URI})
    images = ImageDefaults(registry="registry.example.com", download=ImageRef(repository="mirror/runtime", tag="7"))
    for pod in pod_templates(apply_image_defaults(children, images)):
        for download in [c for c in pod.get("initContainers", []) if c["name"] == DOWNLOAD_CONTAINER]:
            assert download["image"] == "registry.example.com/mirror/runtime:7"
            assert "--endpoint" not in download["args"]  # unset: AWS_ENDPOINT_URL from the pod's environment


def test_the_spec_s_own_mounts_reach_the_download_step_as_they_reach_the_main_container() -> None:
    # An internal store's CA bundle, mounted once in spec.pods, is needed by the step that downloads.
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["model"] = {"uri": URI, "s3": {"endpoint": "https://s3.internal:443"}}
    doc["spec"]["pods"] = {"volumes": [{"name": "ca", "configMap": {"name": "corp-ca"}}],
                           "volumeMounts": [{"name": "ca", "mountPath": "/etc/ssl/corp", "readOnly": True}]}
    ca = {"name": "ca", "mountPath": "/etc/ssl/corp", "readOnly": True}
    pods = pod_templates(build_children(JOB, RLJobSpec.model_validate(doc["spec"]), active=True))
    downloads = [c for p in pods for c in p.get("initContainers", []) if c["name"] == DOWNLOAD_CONTAINER]
    assert len(downloads) == 2, "the trainer's and the cpu pool's"
    for container in downloads + [c for p in pods for c in p["containers"] if c["name"] in ("trainer", "sglang")]:
        assert ca in container["volumeMounts"], container["name"]


def test_rljob_run_keeps_one_copy_per_folder_in_the_cache(tmp_path: Path) -> None:
    assert local_copy_dir("s3://models//tiny/v1/", tmp_path) == tmp_path / "models" / "s3" / "models" / "tiny" / "v1"


def test_the_nvidia_examples_object_store_alternative_is_a_valid_cluster_job() -> None:
    """nvidia-only.yaml shows model.uri and checkpoint.uri in comments; uncommented they must pass."""
    path = EXAMPLE.with_name("nvidia-only.yaml")
    lines = path.read_text().splitlines()
    doc = yaml.safe_load("\n".join(lines))
    for section in ("model", "checkpoint"):
        start = lines.index(f"  {section}:")
        block = []
        for line in lines[start + 1:]:
            if not line.startswith("    "):
                break
            if line.startswith("    #   "):
                block.append(line.removeprefix("    #   "))
        assert block, f"no commented alternative under {section}"
        alternative = yaml.safe_load("\n".join(block))
        assert str(alternative["uri"]).startswith("s3://")
        doc["spec"][section] = alternative if section == "model" else {**doc["spec"][section], **alternative}
    assert cluster_problems(RLJobSpec.model_validate(doc["spec"])) == []
