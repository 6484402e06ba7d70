"""Lint of the Dockerfiles in images/ (no Docker engine here: they are parsed with dockerfile-parse).

Every image: base images pinned by a tag that is not `latest`, a non-root USER in the final stage,
no secret-looking ENV/ARG, every COPY source present in the repository and let through by the
Dockerfile's own .dockerignore, OCI labels, EXPOSE and HEALTHCHECK. Also: the image tags agree with
the operator's defaults, and the operator image's pinned requirements cover everything it imports.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from dockerfile_parse import DockerfileParser

from rljob.operator.builders.vendor import PROFILES, ROUTER_IMAGE, RUNTIME_IMAGE, SGLANG_ROUTER_VERSION, TRAINER_IMAGES

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "images"
DOCKERFILES = sorted(IMAGES.glob("*.Dockerfile"))
EXPECTED = {
    "operator.Dockerfile",
    "runtime.Dockerfile",
    "runtime-cuda.Dockerfile",
    "runtime-rocm.Dockerfile",
    "router.Dockerfile",
    "sglang-cuda.Dockerfile",
    "sglang-rocm.Dockerfile",
}
SECRET_NAME = re.compile(r"SECRET|TOKEN|PASSW|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY|CREDENTIAL", re.IGNORECASE)
OCI_LABELS = {"title", "description", "version", "licenses", "source"}


def parse(path: Path) -> DockerfileParser:
    """The Dockerfile with ARG defaults substituted (as `docker build` without --build-arg)."""
    return DockerfileParser(path=str(path), env_replace=True)


def stages(df: DockerfileParser) -> list[list[dict]]:
    """Instructions grouped by build stage (a FROM starts one)."""
    result: list[list[dict]] = []
    for instruction in df.structure:
        if instruction["instruction"] == "FROM":
            result.append([])
        if result:
            result[-1].append(instruction)
    return result


def stage_names(df: DockerfileParser) -> set[str]:
    names = set()
    for instruction in df.structure:
        if instruction["instruction"] == "FROM":
            parts = instruction["value"].split()
            if len(parts) == 3 and parts[1].lower() == "as":
                names.add(parts[2])
    return names


def image_tag(reference: str) -> str | None:
    """The tag of an image reference (None when untagged); a registry port is not a tag."""
    name = reference.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return last.split(":", 1)[1] if ":" in last else None


def copy_sources(instruction: dict) -> list[str]:
    """Context paths of a COPY/ADD (empty for `--from=` copies, which read another stage)."""
    words = shlex.split(instruction["value"])
    if any(w.startswith("--from") for w in words):
        return []
    args = [w for w in words if not w.startswith("--")]
    return args[:-1]


def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule: the last matching pattern wins; `!` re-includes; a directory covers its files."""
    result = False
    candidates = [path.rstrip("/")]
    parts = candidates[0].split("/")
    candidates += ["/".join(parts[:i]) for i in range(1, len(parts))]
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw[1:] if negate else raw
        pattern = pattern.rstrip("/")
        if any(fnmatch.fnmatch(c, pattern) for c in candidates):
            result = not negate
    return result


def dockerignore(dockerfile: Path) -> list[str]:
    ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
    assert ignore.exists(), f"{ignore.name} missing: without it the whole repository (.venv, caches) is the build context"
    return [
        line.strip()
        for line in ignore.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def test_all_images_have_a_dockerfile() -> None:
    assert EXPECTED <= {p.name for p in DOCKERFILES}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_base_images_are_pinned(dockerfile: Path) -> None:
    df = parse(dockerfile)
    internal = stage_names(df)
    for reference in df.parent_images:
        if reference in internal:
            continue
        assert "$" not in reference, f"{dockerfile.name}: base image {reference!r} depends on an ARG without default"
        tag = image_tag(reference)
        assert tag, f"{dockerfile.name}: base image {reference!r} has no tag"
        assert tag != "latest", f"{dockerfile.name}: base image {reference!r} uses latest"
        assert re.search(r"\d", tag), f"{dockerfile.name}: tag {tag!r} names no version"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_final_stage_runs_as_non_root(dockerfile: Path) -> None:
    final = stages(parse(dockerfile))[-1]
    users = [i["value"].strip() for i in final if i["instruction"] == "USER"]
    assert users, f"{dockerfile.name}: no USER in the final stage (it would run as root)"
    user = users[-1].split(":", 1)[0]
    assert user not in {"root", "0"}, f"{dockerfile.name}: final USER is {users[-1]}"
    assert user.isdigit(), f"{dockerfile.name}: USER {user} should be numeric so runAsNonRoot can verify it"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_no_secrets_in_env_or_args(dockerfile: Path) -> None:
    for instruction in parse(dockerfile).structure:
        if instruction["instruction"] in {"ENV", "ARG"}:
            for name in re.findall(r"(?:^|\s)([A-Za-z_][A-Za-z0-9_]*)(?==|\s|$)", instruction["value"]):
                assert not SECRET_NAME.search(name), f"{dockerfile.name}:{instruction['startline'] + 1}: {name}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copy_sources_exist_and_are_in_the_build_context(dockerfile: Path) -> None:
    patterns = dockerignore(dockerfile)
    for instruction in parse(dockerfile).structure:
        if instruction["instruction"] not in {"COPY", "ADD"}:
            continue
        for source in copy_sources(instruction):
            assert not source.startswith(("http://", "https://")), f"{dockerfile.name}: remote ADD {source}"
            assert list(ROOT.glob(source.rstrip("/"))), f"{dockerfile.name}: COPY source {source} not in the repository"
            assert not ignored(source, patterns), f"{dockerfile.name}: COPY source {source} is excluded by its .dockerignore"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_labels_ports_and_healthcheck(dockerfile: Path) -> None:
    df = parse(dockerfile)
    labels = {k.removeprefix("org.opencontainers.image.") for k in df.labels}
    assert OCI_LABELS <= labels, f"{dockerfile.name}: missing OCI labels {sorted(OCI_LABELS - labels)}"
    final = stages(df)[-1]
    kinds = {i["instruction"] for i in final}
    assert "EXPOSE" in kinds and "HEALTHCHECK" in kinds, dockerfile.name
    health = next(i["value"] for i in final if i["instruction"] == "HEALTHCHECK")
    ports = " ".join(i["value"] for i in final if i["instruction"] == "EXPOSE").split()
    assert any(p in health for p in ports) or "SGLANG_PORT" in health, f"{dockerfile.name}: HEALTHCHECK probes no exposed port"


def test_ignore_rules_follow_docker_semantics() -> None:
    patterns = ["*", "!operator/", "**/__pycache__"]
    assert ignored(".venv/bin/python", patterns)
    assert not ignored("operator/handlers.py", patterns)
    assert not ignored("operator/", patterns)
    assert ignored("README.md", patterns)


def test_image_tags_agree_with_the_operator_defaults() -> None:
    bases = {p.name: parse(p).parent_images[-1] for p in DOCKERFILES}
    assert bases["sglang-cuda.Dockerfile"] == PROFILES["nvidia"].sglang_image
    assert bases["sglang-rocm.Dockerfile"] == PROFILES["amd"].sglang_image
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert version is not None
    assert RUNTIME_IMAGE == f"rljob/runtime:{version.group(1)}"
    chart = yaml.safe_load((ROOT / "charts/rljob-operator/Chart.yaml").read_text())
    assert chart["appVersion"] == version.group(1), "chart appVersion is the operator image tag"
    for name in ("operator.Dockerfile", "runtime.Dockerfile", "runtime-cuda.Dockerfile", "runtime-rocm.Dockerfile"):
        assert parse(IMAGES / name).labels["org.opencontainers.image.version"] == version.group(1)


# Which Dockerfile builds each trainer image, and the torch attribute its build asserts.
TRAINER_DOCKERFILES = {"cpu": ("runtime.Dockerfile", None), "nvidia": ("runtime-cuda.Dockerfile", "torch.version.cuda"),
                       "amd": ("runtime-rocm.Dockerfile", "torch.version.hip")}


@pytest.mark.parametrize("vendor", sorted(TRAINER_DOCKERFILES))
def test_each_trainer_vendor_has_its_own_image_with_the_right_torch(vendor: str) -> None:
    name, check = TRAINER_DOCKERFILES[vendor]
    df = parse(IMAGES / name)
    tag = TRAINER_IMAGES[vendor].rsplit(":", 1)[1]
    assert f"-t {TRAINER_IMAGES[vendor]} " in (IMAGES / name).read_text(), f"{name}: its build line names another tag"
    assert tag.startswith(df.labels["org.opencontainers.image.version"])
    build_stage = stages(df)[0]
    (index,) = [i["value"].split("=", 1)[1] for i in build_stage if i["instruction"] == "ARG" and i["value"].startswith("TORCH_INDEX_URL=")]
    build = " ".join(i["value"] for i in build_stage if i["instruction"] == "RUN")
    if check is None:
        assert index.endswith("/cpu")
    else:
        assert not index.endswith("/cpu") and check in build, f"{name}: the build must fail on a wheel without {check}"


def test_router_image_is_the_sglang_router_package_not_the_cuda_sglang_image() -> None:
    df = parse(IMAGES / "router.Dockerfile")
    assert "sglang" not in " ".join(df.parent_images), "the router must not build on an SGLang (CUDA) image"
    assert pinned(IMAGES / "router-requirements.txt")["sglang-router"] == SGLANG_ROUTER_VERSION
    assert ROUTER_IMAGE == f"rljob/router:{SGLANG_ROUTER_VERSION}"
    assert df.labels["org.opencontainers.image.version"] == SGLANG_ROUTER_VERSION
    assert "torch" not in pinned(IMAGES / "router-requirements.txt")


def pinned(requirements: Path) -> dict[str, str]:
    """name (normalised) → exact version; fails on anything but `name==version` lines."""
    pins = {}
    for line in requirements.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)==([A-Za-z0-9_.+-]+)", line.strip())
        assert match, f"{requirements.name}: {line!r} is not pinned exactly"
        pins[re.sub(r"[-_.]+", "-", match.group(1)).lower()] = match.group(2)
    return pins


def test_requirements_are_pinned_and_torch_stays_out_of_the_operator() -> None:
    operator = pinned(IMAGES / "operator-requirements.txt")
    runtime = pinned(IMAGES / "runtime-requirements.txt")
    assert "torch" not in operator and "torch" not in runtime  # runtime: installed from the accelerator's index
    assert {"kopf", "kubernetes", "pydantic", "prometheus-client"} <= set(operator)
    assert {"transformers", "safetensors", "kubernetes", "pydantic"} <= set(runtime)


IMPORTED_DISTRIBUTIONS = """
import importlib.metadata as md, json, sys
import rljob.operator.__main__, rljob.operator.handlers
dists = md.packages_distributions()
tops = {m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names)
print(json.dumps(sorted({d for t in tops for d in dists.get(t, [])})))
"""


def test_operator_requirements_cover_everything_the_operator_imports() -> None:
    out = subprocess.run(
        [sys.executable, "-c", IMPORTED_DISTRIBUTIONS], capture_output=True, text=True, timeout=120, check=True
    )
    imported = {re.sub(r"[-_.]+", "-", d).lower() for d in json.loads(out.stdout)} - {"rljob", "setuptools", "pip"}
    missing = imported - set(pinned(IMAGES / "operator-requirements.txt"))
    assert not missing, f"the operator imports {sorted(missing)}: add them to images/operator-requirements.txt"


def test_the_checks_catch_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("ARG BASE=python\nFROM ${BASE}\nENV HF_TOKEN=abc\nUSER root\n")
    df = parse(bad)
    assert image_tag(df.parent_images[0]) is None
    assert image_tag("registry.local:5000/python") is None and image_tag("python:latest") == "latest"
    assert [i["value"] for i in stages(df)[-1] if i["instruction"] == "USER"] == ["root"]
    env = next(i["value"] for i in df.structure if i["instruction"] == "ENV")
    assert SECRET_NAME.search(env)
