"""`make images` for real: build an image from images/, push it to a registry, write the chart values.

A private-registry install (docs/install.md, "Private registry, no egress") runs
`make images REGISTRY=...` where there is egress and installs the chart with the values it writes.
Here the registry is a real one, Debian's `docker-registry` (the CNCF distribution registry) on
loopback over plain HTTP (`--insecure`). The build is images/operator.Dockerfile, unchanged, with
buildah, FROM the test cluster's `base-python` image given as `--build-arg PYTHON_IMAGE=...` (as a
mirror of `python:3.11.13-slim-bookworm` would be: this machine cannot reach Docker Hub). The
registry then serves the image under the operator's default repository and tag, its manifest's digest
is the one the chart values carry, and its configuration is the Dockerfile's (user, entrypoint).
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from rljob.operator.builders.images import ImageDefaults
from rljob.operator.builders.vendor import RLJOB_VERSION
from tests.cluster import images
from tests.cluster.binaries import BinariesUnavailable, binary_path, ensure_built
from tests.helpers.processes import free_port, spawn, stop, wait_http

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json")


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[str]:
    """A distribution registry on 127.0.0.1 storing in tmp_path; its host:port."""
    try:
        ensure_built(("registry",))
    except BinariesUnavailable as err:
        pytest.fail(str(err))
    port = free_port()
    config = tmp_path / "registry.yml"
    config.write_text(yaml.safe_dump({
        "version": 0.1, "log": {"level": "info"},
        "storage": {"filesystem": {"rootdirectory": str(tmp_path / "storage")}},
        "http": {"addr": f"127.0.0.1:{port}"},
    }))
    log = tmp_path / "registry.log"
    proc = spawn([str(binary_path("registry")), "serve", str(config)], log)
    try:
        wait_http(f"http://127.0.0.1:{port}/v2/", 60, proc, log)
        yield f"127.0.0.1:{port}"
    finally:
        stop([proc])


def _get(url: str, accept: str | None = None) -> tuple[bytes, dict[str, str]]:
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.read(), dict(response.headers)


def test_make_images_pushes_the_operator_image_and_writes_values_with_its_digest(registry: str, tmp_path: Path) -> None:
    base = images.build("base-python")  # cached; the same base the real node's images use
    out = tmp_path / "dist"
    args = f"--only operator --insecure --build-arg PYTHON_IMAGE=oci-archive:{base.archive}"
    done = subprocess.run(["make", "--no-print-directory", "images", f"REGISTRY={registry}/ml",
                           f"IMAGES_OUT={out}", f"IMAGES_ARGS={args}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=1800, check=False,
                          # This machine has no OCI runtime for buildah's RUN steps (the node images
                          # build the same way: tests/cluster/images.py); a build machine's default works.
                          env={**os.environ, "BUILDAH_ISOLATION": "chroot"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]

    values = yaml.safe_load((out / "images-values.yaml").read_text())
    assert values["image"]["repository"] == "rljob/operator" and values["images"]["registry"] == f"{registry}/ml"
    digest = values["image"]["digest"]
    assert digest.startswith("sha256:"), values["image"]
    ImageDefaults.model_validate(values["images"])  # what the operator reads from the chart

    # The registry serves that manifest under the default tag, with the digest the values name.
    manifest, headers = _get(f"http://{registry}/v2/ml/rljob/operator/manifests/{RLJOB_VERSION}", MANIFEST_TYPES)
    assert headers["Docker-Content-Digest"] == digest
    by_digest, _ = _get(f"http://{registry}/v2/ml/rljob/operator/manifests/{digest}", MANIFEST_TYPES)
    assert by_digest == manifest
    # ... and it is the Dockerfile's image: its non-root user and the operator's entrypoint.
    config_digest = json.loads(manifest)["config"]["digest"]
    config, _ = _get(f"http://{registry}/v2/ml/rljob/operator/blobs/{config_digest}")
    container = json.loads(config)["config"]
    assert container["User"] == "65532:65532", container
    assert "rljob.operator" in " ".join(container.get("Entrypoint") or container.get("Cmd") or []), container
