"""Build every rljob image and push it to a registry, or save it as an archive: `make images`.

    python images/build_images.py --registry registry.example.com/ml           # build, push
    python images/build_images.py --out dist/images                           # build, save OCI archives
    python images/build_images.py --registry registry.example.com/ml --plan   # print the commands only
    python images/build_images.py --registry registry.example.com/ml --only operator router \
        --build-arg PYTHON_IMAGE=registry.example.com/mirror/python:3.11.13-slim-bookworm

Tags follow the operator's defaults (operator/builders/vendor.py), so the chart's `images` values need
only the registry prefix. After a push the digests the registry reports are written into
`<out>/images-values.yaml` (the chart's `image` and `images` values: `helm install -f` it), so every
node pulls exactly what was built (buildah reports them; with docker the values carry tags only). The SGLang pools get the hardened `rljob/sglang` images (non-root
user, writable caches) instead of the upstream ones. Builds need the base images (python, the upstream
SGLang images) and the package indexes: run this where there is egress, then push into the private
registry the nodes use; where the bases come from your own mirror, name them with `--build-arg`
(`PYTHON_IMAGE`, `SGLANG_IMAGE`; `TORCH_INDEX_URL` for the wheels). The tool is buildah (rootless
builds, no daemon) when present, else docker.
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
    def name(self) -> str:
        """What `--only` calls it: the Dockerfile's name without `.Dockerfile` (operator, runtime-cuda, ...)."""
        return self.dockerfile.removesuffix(".Dockerfile")

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


@dataclass(frozen=True)
class BuildOptions:
    """What every build and push of one invocation shares."""

    tool: str  # buildah or docker
    registry: str  # prefix to push to; empty: save archives
    out: Path
    build_args: tuple[str, ...] = ()  # KEY=VALUE, given to every build
    insecure: bool = False  # the registry speaks plain HTTP or has a certificate the host does not trust


def commands(image: Image, opts: BuildOptions) -> list[list[str]]:
    """The build and the push (with a registry) or the save (without one) of one image."""
    tool, registry, out = opts.tool, opts.registry, opts.out
    ref = image.ref(registry)
    build = [tool, "bud" if tool == "buildah" else "build", "-f", f"images/{image.dockerfile}", "-t", ref, "."]
    build[2:2] = [*(["--layers"] if tool == "buildah" else []), *(a for arg in opts.build_args for a in ("--build-arg", arg))]
    if registry:
        digest_file = str(out / f"{image.archive}.digest")
        # docker trusts an insecure registry through its daemon's configuration, not a flag.
        tls = ["--tls-verify=false"] if opts.insecure and tool == "buildah" else []
        push = ([tool, "push", *tls, "--digestfile", digest_file, ref, f"docker://{ref}"] if tool == "buildah"
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
    names = [i.name for i in IMAGES]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--registry", default="", help="push to this registry prefix (empty: save archives)")
    parser.add_argument("--out", type=Path, default=ROOT / "dist" / "images", help="archives, digests, values")
    parser.add_argument("--tool", choices=("buildah", "docker"), help="default: buildah when installed, else docker")
    parser.add_argument("--only", nargs="+", choices=names, metavar="NAME",
                        help=f"build these images only (default: all): {', '.join(names)}; the values still "
                        "name every image, so the others must already be in the registry")
    parser.add_argument("--build-arg", action="append", default=[], metavar="KEY=VALUE", dest="build_args",
                        help="given to every build, e.g. PYTHON_IMAGE=<your mirror of python:3.11.13-slim-bookworm>")
    parser.add_argument("--insecure", action="store_true",
                        help="push over plain HTTP or without verifying the registry's certificate (buildah)")
    parser.add_argument("--plan", action="store_true", help="print the commands and the values; build nothing")
    args = parser.parse_args(argv)
    for arg in args.build_args:
        if "=" not in arg:
            parser.error(f"--build-arg {arg!r}: write KEY=VALUE")
    opts = BuildOptions(tool=args.tool or ("buildah" if shutil.which("buildah") else "docker"),
                        registry=args.registry.rstrip("/"), out=args.out, build_args=tuple(args.build_args),
                        insecure=args.insecure)
    chosen = [i for i in IMAGES if args.only is None or i.name in args.only]
    steps = [cmd for image in chosen for cmd in commands(image, opts)]
    if args.plan:
        for cmd in steps:
            print(shlex.join(cmd))
        print(yaml.safe_dump(chart_values(opts.registry, {}), sort_keys=False), end="")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for cmd in steps:
        print("+", shlex.join(cmd), flush=True)
        subprocess.run(cmd, cwd=ROOT, check=True)
    digests: dict[str, str] = {}
    for image in chosen:
        digest_file = args.out / f"{image.archive}.digest"
        if opts.registry and digest_file.exists():
            digests[image.value] = digest_file.read_text().strip()
    values_file = args.out / "images-values.yaml"
    values_file.write_text(yaml.safe_dump(chart_values(opts.registry, digests), sort_keys=False))
    print(f"chart values: {values_file} (helm install ... -f {values_file})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
