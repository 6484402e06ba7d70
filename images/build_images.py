"""Build every rljob image and push it to a registry, or save it as an archive: `make images`.

    python images/build_images.py --registry registry.example.com/ml           # build, push
    python images/build_images.py --out dist/images                           # build, save OCI archives
    python images/build_images.py --registry registry.example.com/ml --plan   # print the commands only

Tags follow the operator's defaults (operator/builders/vendor.py), so the chart's `images` values need
only the registry prefix. After a push the digests the registry reports are written into
`<out>/images-values.yaml` (the chart's `image` and `images` values: `helm install -f` it), so every
node pulls exactly what was built (buildah reports them; with docker the values carry tags only). The SGLang pools get the hardened `rljob/sglang` images (non-root
user, writable caches) instead of the upstream ones. Builds need the base images (python, the upstream
SGLang images) and the package indexes: run this where there is egress, then push into the private
registry the nodes use. The tool is buildah (rootless builds, no daemon) when present, else docker.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rljob.operator.builders.images import ImageDefaults, ImageRef
from rljob.operator.builders.vendor import RLJOB_VERSION, SGLANG_ROCM_SUFFIX, SGLANG_ROUTER_VERSION, SGLANG_VERSION

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Image:
    """One image to build: its Dockerfile, repository and tag, and the chart value it fills."""

    dockerfile: str
    repository: str
    tag: str
    value: str  # dotted path in the chart's values: `image`, `images.trainer.cpu`, ...

    def ref(self, registry: str) -> str:
        """The reference it is tagged and pushed as."""
        return ImageRef(repository=self.repository, tag=self.tag).reference(registry)

    @property
    def archive(self) -> str:
        """File name of its saved archive."""
        return f"{self.repository.replace('/', '-')}-{self.tag}.tar"


# The runtime's CPU image is also the cpu pools' server and the download step's image.
IMAGES: tuple[Image, ...] = (
    Image("operator.Dockerfile", "rljob/operator", RLJOB_VERSION, "image"),
    Image("runtime.Dockerfile", "rljob/runtime", RLJOB_VERSION, "images.trainer.cpu"),
    Image("runtime-cuda.Dockerfile", "rljob/runtime", f"{RLJOB_VERSION}-cuda", "images.trainer.nvidia"),
    Image("runtime-rocm.Dockerfile", "rljob/runtime", f"{RLJOB_VERSION}-rocm", "images.trainer.amd"),
    Image("router.Dockerfile", "rljob/router", SGLANG_ROUTER_VERSION, "images.router"),
    Image("sglang-cuda.Dockerfile", "rljob/sglang", f"{SGLANG_VERSION}-cuda", "images.sglang.nvidia"),
    Image("sglang-rocm.Dockerfile", "rljob/sglang", f"{SGLANG_VERSION}-{SGLANG_ROCM_SUFFIX}", "images.sglang.amd"),
)
# Values that reuse a built image.
ALIASES = {"images.download": "images.trainer.cpu"}


def commands(tool: str, image: Image, registry: str, out: Path) -> list[list[str]]:
    """The build and the push (with a registry) or the save (without one) of one image."""
    ref = image.ref(registry)
    build = [tool, "bud" if tool == "buildah" else "build", "-f", f"images/{image.dockerfile}", "-t", ref, "."]
    if tool == "buildah":
        build[2:2] = ["--layers"]
    if registry:
        digest_file = str(out / f"{image.archive}.digest")
        push = ([tool, "push", "--digestfile", digest_file, ref, f"docker://{ref}"] if tool == "buildah"
                else [tool, "push", ref])
        return [build, push]
    save = ([tool, "push", ref, f"oci-archive:{out / image.archive}:{ref}"] if tool == "buildah"
            else [tool, "save", "-o", str(out / image.archive), ref])
    return [build, save]


def chart_values(registry: str, digests: dict[str, str]) -> dict[str, Any]:
    """The chart's `image` and `images` values for these images (digests where known)."""
    values: dict[str, Any] = {"image": {}, "images": {"registry": registry, "trainer": {}, "sglang": {}}}
    by_value = {i.value: i for i in IMAGES}
    for path, image in [*by_value.items(), *((a, by_value[t]) for a, t in ALIASES.items())]:
        entry = {"repository": image.repository, "tag": image.tag, "digest": digests.get(image.value, "")}
        *parents, leaf = path.split(".")
        node = values
        for part in parents:
            node = node[part]
        node[leaf] = entry
    values["image"].pop("tag")  # the operator's tag is the chart's appVersion
    ImageDefaults.model_validate(values["images"])  # what the operator will read must validate
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--registry", default="", help="push to this registry prefix (empty: save archives)")
    parser.add_argument("--out", type=Path, default=ROOT / "dist" / "images", help="archives, digests, values")
    parser.add_argument("--tool", choices=("buildah", "docker"), help="default: buildah when installed, else docker")
    parser.add_argument("--plan", action="store_true", help="print the commands and the values; build nothing")
    args = parser.parse_args(argv)
    tool = args.tool or ("buildah" if shutil.which("buildah") else "docker")
    registry = args.registry.rstrip("/")
    steps = [(image, cmd) for image in IMAGES for cmd in commands(tool, image, registry, args.out)]
    if args.plan:
        for _, cmd in steps:
            print(shlex.join(cmd))
        print(yaml.safe_dump(chart_values(registry, {}), sort_keys=False), end="")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for _, cmd in steps:
        print("+", shlex.join(cmd), flush=True)
        subprocess.run(cmd, cwd=ROOT, check=True)
    digests: dict[str, str] = {}
    for image in IMAGES:
        digest_file = args.out / f"{image.archive}.digest"
        if registry and digest_file.exists():
            digests[image.value] = digest_file.read_text().strip()
    values_file = args.out / "images-values.yaml"
    values_file.write_text(yaml.safe_dump(chart_values(registry, digests), sort_keys=False))
    print(f"chart values: {values_file} (helm install ... -f {values_file})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
