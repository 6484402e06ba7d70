"""The child pods' images from the operator's configuration (the chart's `images` values): registry
prefix, per-role repository/tag/digest, pull secrets; images an RLJob names itself stay as written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from rljob.api.spec import RLJobSpec
from rljob.operator.builders import JobRef, build_children
from rljob.operator.builders.images import IMAGE_DEFAULTS_ENV, ImageDefaults
from rljob.operator.builders.pods import pod_templates
from tests.unit.test_chart import CHART, find, helm, render

__all__ = ["helm"]  # the module-scoped fixture of the chart tests

DIGEST = "sha256:" + "ab" * 32
JOB = JobRef("demo", "ml", "uid-1")


def _spec(**trainer: Any) -> RLJobSpec:
    return RLJobSpec.model_validate({
        "model": {"huggingFace": "Qwen/Qwen2.5-0.5B-Instruct", "storage": {"download": {}}},
        "data": {"synthetic": {}},
        "trainer": {"vendor": "nvidia", **trainer},
        "rollout": {"engine": "sglang", "pools": [{"name": "h100", "vendor": "nvidia"}, {"name": "mi300", "vendor": "amd"},
                              {"name": "cpu", "vendor": "cpu"}],
                    "weightTransport": {"mode": "disk"}, "weightsVolume": {"claim": "pvc://weights"}},
        "pods": {"imagePullSecrets": ["team-cred"]},
    })


def _images(children: list[dict[str, Any]]) -> dict[str, str]:
    """`<workload>/<container>` -> image, init containers included."""
    return {
        f"{c['metadata']['name']}/{k['name']}": k["image"]
        for c in children if c["kind"] in ("StatefulSet", "Deployment", "Job")
        for k in [*c["spec"]["template"]["spec"].get("initContainers", []), *c["spec"]["template"]["spec"]["containers"]]
    }


def test_chart_defaults_are_the_operators_builtin_images() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())["images"]
    assert ImageDefaults.model_validate(values) == ImageDefaults()


def test_chart_values_reach_every_child_pod(helm: Path) -> None:
    sets = ["images.registry=registry.example.com/mirror", "images.pullSecrets={regcred}",
            f"images.sglang.nvidia.digest={DIGEST}", "images.sglang.nvidia.repository=rljob/sglang",
            "images.sglang.nvidia.tag=v0.5.23-cuda"]
    deployment = find(render(helm, sets=sets), "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert container["image"] == "registry.example.com/mirror/rljob/operator:0.1.0"
    assert {"name": "regcred"} in deployment["spec"]["template"]["spec"]["imagePullSecrets"]
    images = ImageDefaults.from_env({IMAGE_DEFAULTS_ENV: env[IMAGE_DEFAULTS_ENV]})
    children = build_children(JOB, _spec(), active=True, images=images)
    assert _images(children) == {
        "demo-infer-h100/model-download": "registry.example.com/mirror/rljob/runtime:0.1.0",
        "demo-infer-h100/sglang": f"registry.example.com/mirror/rljob/sglang:v0.5.23-cuda@{DIGEST}",
        "demo-infer-mi300/model-download": "registry.example.com/mirror/rljob/runtime:0.1.0",
        "demo-infer-mi300/sglang": "registry.example.com/mirror/lmsysorg/sglang:v0.5.23-rocm720-mi30x",
        "demo-infer-cpu/model-download": "registry.example.com/mirror/rljob/runtime:0.1.0",
        "demo-infer-cpu/sglang": "registry.example.com/mirror/rljob/runtime:0.1.0",
        "demo-router/router": "registry.example.com/mirror/rljob/router:0.3.2",
        "demo-trainer/model-download": "registry.example.com/mirror/rljob/runtime:0.1.0",
        "demo-trainer/trainer": "registry.example.com/mirror/rljob/runtime:0.1.0-cuda",
    }
    for pod in pod_templates(children):
        assert pod["imagePullSecrets"] == [{"name": "team-cred"}, {"name": "regcred"}]


def test_an_image_the_job_names_stays_as_written() -> None:
    images = ImageDefaults(registry="registry.example.com/mirror")
    children = build_children(JOB, _spec(image="mine.example.com/trainer:7"), active=True, images=images)
    assert _images(children)["demo-trainer/trainer"] == "mine.example.com/trainer:7"
    # Without a configuration the built-in defaults stand.
    assert _images(build_children(JOB, _spec(), active=True))["demo-trainer/trainer"] == "rljob/runtime:0.1.0-cuda"


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"trainer": {"tpu": {"repository": "x"}}}, "trainer"),
        ({"router": {"repository": "rljob/router", "digest": "md5:1"}}, "router.digest"),
        ({"registry": "Registry Example"}, "registry"),
        ({"regsitry": "x"}, "regsitry"),
    ],
)
def test_invalid_configuration_names_the_field(config: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=IMAGE_DEFAULTS_ENV) as err:
        ImageDefaults.from_env({IMAGE_DEFAULTS_ENV: json.dumps(config)})
    assert field in str(err.value)
