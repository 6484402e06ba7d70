"""`make images` (images/build_images.py) in plan mode: every Dockerfile built once, pushed to the
registry or saved as an archive, and chart values the operator accepts for exactly those images."""

from __future__ import annotations

import shlex
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from rljob.operator.builders.images import ImageDefaults
from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def _tool() -> ModuleType:
    return load_script(ROOT / "images/build_images.py")


def _plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[list[list[str]], dict]:
    assert _tool().main(["--plan", "--out", "/tmp/out", *args]) == 0
    text = capsys.readouterr().out
    lines = text.split("\nimage:", 1)
    cmds = [shlex.split(line) for line in lines[0].splitlines()]
    return cmds, yaml.safe_load("image:" + lines[1])


@pytest.mark.parametrize("tool", ["buildah", "docker"])
def test_plan_builds_every_dockerfile_and_pushes_it(capsys: pytest.CaptureFixture[str], tool: str) -> None:
    cmds, values = _plan(capsys, "--registry", "registry.example.com/ml/", "--tool", tool)
    builds = [c for c in cmds if c[1] in ("bud", "build")]
    files = sorted(c[c.index("-f") + 1] for c in builds)
    assert files == sorted(f"images/{p.name}" for p in (ROOT / "images").glob("*.Dockerfile"))
    refs = [c[c.index("-t") + 1] for c in builds]
    assert all(r.startswith("registry.example.com/ml/rljob/") for r in refs), refs
    pushes = [c for c in cmds if c[1] == "push"]
    assert [p[-1].removeprefix("docker://") for p in pushes] == refs
    # The values name the same images, and the operator accepts them.
    images = ImageDefaults.model_validate(values["images"])
    main, _ = images.replacements()
    assert set(main.values()) | {f"registry.example.com/ml/{values['image']['repository']}:0.1.0"} == set(refs)
    assert images.sglang["nvidia"].reference(images.registry) == "registry.example.com/ml/rljob/sglang:v0.5.23-cuda"


def test_without_a_registry_archives_are_saved(capsys: pytest.CaptureFixture[str]) -> None:
    cmds, values = _plan(capsys, "--tool", "buildah")
    saves = [c for c in cmds if c[1] == "push"]
    assert saves and all(c[-1].startswith("oci-archive:/tmp/out/") for c in saves)
    assert values["images"]["registry"] == ""


def test_chart_values_cover_every_image_value() -> None:
    chart = yaml.safe_load((ROOT / "charts/rljob-operator/values.yaml").read_text())
    values = _tool().chart_values("r.example.com", {"images.router": "sha256:" + "0" * 64})
    assert set(values["images"]) == set(chart["images"]) - {"pullSecrets"}
    assert values["images"]["router"]["digest"] == "sha256:" + "0" * 64


def test_only_build_args_and_insecure_reach_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    base = "PYTHON_IMAGE=registry.example.com/mirror/python:3.11.13-slim-bookworm"
    cmds, values = _plan(capsys, "--registry", "127.0.0.1:5000/ml", "--tool", "buildah", "--only", "operator", "router",
                         "--build-arg", base, "--insecure")
    builds = [c for c in cmds if c[1] == "bud"]
    assert [c[c.index("-f") + 1] for c in builds] == ["images/operator.Dockerfile", "images/router.Dockerfile"]
    assert all(c[c.index("--build-arg") + 1] == base for c in builds)
    pushes = [c for c in cmds if c[1] == "push"]
    assert len(pushes) == 2 and all("--tls-verify=false" in p for p in pushes)
    # The values still name every image (the others must be in the registry already).
    assert values["images"]["sglang"]["nvidia"]["repository"] == "rljob/sglang"


def test_a_build_arg_without_a_value_is_refused_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _tool().main(["--plan", "--build-arg", "PYTHON_IMAGE"])
    assert "--build-arg 'PYTHON_IMAGE': write KEY=VALUE" in capsys.readouterr().err
