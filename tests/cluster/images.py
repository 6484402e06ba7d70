"""Container images for the real node, built without a registry and cached by a hash of their inputs.

Images are built with buildah (Debian package) into a storage of our own under the cache, then saved
as OCI archives that `localkube up --real-node-image ARCHIVE` (or `RealNode.import_image`) loads into
the node's containerd. Nothing is pulled from or pushed to a registry:

- `pause`: the sandbox image, the `pause` binary from tests/cluster/pause, `FROM scratch`;
- `busybox`: Debian's static busybox with its applet links, `FROM scratch`;
- `base-python`: a `debootstrap --variant=minbase` Debian bookworm with Python 3.11 and venv (what the
  Dockerfiles' `python:3.11.13-slim-bookworm` provides), the host's CA bundle (package access goes
  through a proxy with its own CA) and pip configuration;
- `operator`: images/operator.Dockerfile, unchanged, `FROM base-python`;
- `router`: images/router.Dockerfile (the sglang-router package), unchanged, `FROM base-python`;
- `runtime-cuda` (on demand only, never by the tests: about 6 GB): images/runtime-cuda.Dockerfile,
  unchanged, with PyTorch from PyPI, whose torch wheels are the CUDA build; it proves the Dockerfile
  builds and its CUDA smoke check passes (measured: 882 s, a 3.1 GB archive, ~20 GB of transient disk),
  not that it runs on a GPU (there is none here). Its ROCm
  sibling cannot be built here: the ROCm wheels are only on download.pytorch.org, which this machine
  cannot reach;
- `runtime-thin`: the final stage of images/runtime.Dockerfile, unchanged except that the virtualenv
  (`COPY --from=build /opt/rljob`) is mounted read-only from an installed one at run time instead of
  being built (torch is gigabytes); `RUNTIME_UNCOVERED` lists the lines this leaves untested.

Usage: `python -m tests.cluster.images build [NAME ...]` prints `NAME ARCHIVE REF` lines;
`python -m tests.cluster.images ref NAME` prints the reference without building.
Environment: RLJOB_CACHE (default ~/.cache/rljob).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import fnmatch
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LOCALKUBE_SH = Path(__file__).with_name("localkube.sh")
CACHE = Path(os.environ.get("RLJOB_CACHE", Path.home() / ".cache" / "rljob"))
IMAGES = CACHE / "images"
STORAGE = CACHE / "buildah"
RUNROOT = Path("/run/rljob-buildah")
# Bump when a recipe below changes in a way its inputs do not show.
RECIPE_VERSION = "1"

DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
BASE_PACKAGES = ("python3", "python3-venv", "python-is-python3", "ca-certificates")
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
HOST_PIP_CONF = Path("/etc/pip.conf")

# images/runtime.Dockerfile lines the real-node tests do not exercise: the whole `build` stage (the
# virtualenv, torch and requirements installs, the package install and its smoke check) and the
# final stage's copy of that virtualenv, which the tests replace by mounting an installed virtualenv.
RUNTIME_UNCOVERED = "build stage (FROM ... AS build through `rljob --help`) and `COPY --from=build /opt/rljob /opt/rljob`"

NAMES = ("pause", "busybox", "base-python", "operator", "router", "runtime-thin")
# Built only when named (`build runtime-cuda`): too big for the tests, which have no GPU to run it on.
ON_DEMAND = ("runtime-cuda",)
# Images built from a Dockerfile of images/ as it is, on base-python.
DOCKERFILE_IMAGES = {"operator": "operator.Dockerfile", "router": "router.Dockerfile",
                     "runtime-cuda": "runtime-cuda.Dockerfile"}
# Build arguments beyond PYTHON_IMAGE. PyPI's torch wheels for Linux x86_64 are the CUDA build.
BUILD_ARGS = {"runtime-cuda": {"TORCH_INDEX_URL": "https://pypi.org/simple"}}


class ImageBuildError(RuntimeError):
    """An image could not be built; the message carries the failing command's output tail."""


@dataclass(frozen=True)
class Image:
    name: str
    key: str

    @property
    def ref(self) -> str:
        return f"localhost/rljob/{self.name}:{self.key}"

    @property
    def archive(self) -> Path:
        return IMAGES / f"{self.name}-{self.key}.oci.tar"


def _sha(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for p in parts:
        data = p.encode() if isinstance(p, str) else p
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:16]


def _file_sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else "absent"


def _run(cmd: list[str], timeout: float = 3600, **kw) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False, **kw)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise ImageBuildError(f"{' '.join(cmd[:6])} ... exited {proc.returncode}:\n{tail}")
    return proc.stdout


def _buildah(*args: str, timeout: float = 3600) -> str:
    return _run(
        ["buildah", "--root", str(STORAGE / "root"), "--runroot", str(RUNROOT), "--storage-driver", "overlay", *args],
        timeout=timeout,
    )


def binary(name: str) -> Path:
    """Path of a cached binary (`localkube.sh path NAME`), built when missing."""
    path = Path(_run([str(LOCALKUBE_SH), "path", name], timeout=30).strip())
    if not path.exists():
        _run([str(LOCALKUBE_SH), "build"])
    return path


def ensure_tools() -> None:
    """buildah and debootstrap come from Debian; install them once (needs root and the mirror)."""
    if shutil.which("buildah") and shutil.which("debootstrap"):
        return
    cmd = ["apt-get", "install", "-y", "-qq", "-o", "DPkg::Lock::Timeout=300", "--no-install-recommends", "buildah", "debootstrap"]
    if subprocess.run(cmd, capture_output=True, check=False).returncode != 0:
        _run(["apt-get", "update", "-qq"])
        _run(cmd)


@contextlib.contextmanager
def _lock() -> Iterator[None]:
    """One image build at a time per cache (two test runs, or a test run and a developer)."""
    IMAGES.mkdir(parents=True, exist_ok=True)
    with open(IMAGES / ".build.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------------------------
# keys


def _dockerignore(path: Path) -> list[str]:
    return [
        line.strip()
        for line in path.read_text().splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]


def _ignored(rel: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes; a directory covers its files."""
    parts = rel.split("/")
    candidates = [rel] + ["/".join(parts[:i]) for i in range(1, len(parts))]
    result = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.rstrip("/")
        for cand in candidates:
            if fnmatch.fnmatchcase(cand, pat) or (pat.startswith("**/") and any(
                fnmatch.fnmatchcase(seg, pat[3:]) for seg in cand.split("/")
            )):
                result = not negate
                break
    return result


def context_files(dockerfile: Path) -> list[str]:
    """Repository files the Dockerfile's own .dockerignore lets into its build context."""
    patterns = _dockerignore(dockerfile.with_name(dockerfile.name + ".dockerignore"))
    tracked = _run(["git", "-C", str(REPO), "ls-files", "--cached", "--others", "--exclude-standard"], timeout=60)
    return sorted(p for p in tracked.splitlines() if (REPO / p).is_file() and not _ignored(p, patterns))


def _context_key(dockerfile_text: str, files: list[str]) -> str:
    parts: list[bytes | str] = [dockerfile_text]
    for rel in files:
        parts += [rel, (REPO / rel).read_bytes()]
    return _sha(*parts)


def image(name: str) -> Image:
    """The image `name` with its cache key (computed from its inputs; nothing is built)."""
    if name == "pause":
        return Image(name, _sha(RECIPE_VERSION, "pause", _file_sha(binary("pause"))))
    if name == "busybox":
        return Image(name, _sha(RECIPE_VERSION, "busybox", _file_sha(binary("busybox"))))
    if name == "base-python":
        return Image(name, _sha(RECIPE_VERSION, DEBIAN_SUITE, DEBIAN_MIRROR, *BASE_PACKAGES,
                                _file_sha(HOST_CA_BUNDLE), _file_sha(HOST_PIP_CONF)))
    if name in DOCKERFILE_IMAGES:
        df = REPO / "images" / DOCKERFILE_IMAGES[name]
        args = sorted(BUILD_ARGS.get(name, {}).items())
        return Image(name, _sha(RECIPE_VERSION, image("base-python").key, *(f"{k}={v}" for k, v in args),
                                _context_key(df.read_text(), context_files(df))))
    if name == "runtime-thin":
        df = REPO / "images" / "runtime.Dockerfile"
        return Image(name, _sha(RECIPE_VERSION, image("base-python").key, thin_runtime_dockerfile()))
    raise KeyError(f"unknown image {name!r} (one of {', '.join(NAMES + ON_DEMAND)})")


def thin_runtime_dockerfile() -> str:
    """images/runtime.Dockerfile without its build stage; the virtualenv is mounted at /opt/rljob instead.

    The global ARGs and every line of the final stage are kept verbatim, except the COPY of the
    build stage's virtualenv, which becomes the mount point.
    """
    lines = (REPO / "images" / "runtime.Dockerfile").read_text().splitlines()
    froms = [i for i, line in enumerate(lines) if line.startswith("FROM ")]
    head = [line for line in lines[: froms[0]] if line.startswith("ARG ")]
    final = lines[froms[-1]:]
    copy = "COPY --from=build /opt/rljob /opt/rljob"
    if copy not in final:
        raise ImageBuildError(f"images/runtime.Dockerfile changed: {copy!r} not found in its final stage")
    # The mounted virtualenv's interpreter lives at the host's own path (for pyenv, under /root), so
    # uid 1000 must be able to traverse /root to reach it; nothing of /root is readable.
    mount_point = "RUN install -d /opt/rljob && chmod o+x /root  # mount point of the installed virtualenv"
    final = [mount_point if line == copy else line for line in final]
    return "\n".join(head + final) + "\n"


# ---------------------------------------------------------------------------------------------
# builds


def _has_image(ref: str) -> bool:
    out = _buildah("images", "--json", timeout=120)
    names = {n for img in json.loads(out or "[]") for n in (img.get("names") or [])}
    return ref in names


def _save(img: Image) -> None:
    tmp = img.archive.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    _buildah("push", "--quiet", img.ref, f"oci-archive:{tmp}:{img.ref}", timeout=1200)
    tmp.rename(img.archive)


def _ensure_in_storage(img: Image) -> None:
    """Make `img` usable as a FROM in buildah's storage (from its archive when needed)."""
    if not _has_image(img.ref):
        _buildah("pull", "--quiet", f"oci-archive:{img.archive}", timeout=1200)
        if not _has_image(img.ref):
            _buildah("tag", _buildah("images", "-q", "--filter", "dangling=true").split()[0], img.ref)


def _from_rootfs(img: Image, rootfs: Path, config: list[str]) -> None:
    """Commit a folder as the whole filesystem of a new image `FROM scratch`."""
    ctr = _buildah("from", "--quiet", "scratch").strip()
    try:
        mnt = Path(_buildah("mount", ctr).strip())
        _run(["cp", "-a", f"{rootfs}/.", str(mnt)])
        _buildah("umount", ctr)
        if config:
            _buildah("config", *config, ctr)
        _buildah("commit", "--quiet", "--rm", ctr, img.ref, timeout=1800)
    except BaseException:
        subprocess.run(["buildah", "--root", str(STORAGE / "root"), "--runroot", str(RUNROOT), "rm", ctr],
                       capture_output=True, check=False)
        raise


def _build_pause(img: Image, work: Path) -> None:
    root = work / "rootfs"
    root.mkdir()
    shutil.copy2(binary("pause"), root / "pause")
    _from_rootfs(img, root, ["--entrypoint", '["/pause"]', "--user", "65535:65535"])


def _build_busybox(img: Image, work: Path) -> None:
    root = work / "rootfs"
    for d in ("bin", "etc", "tmp"):
        (root / d).mkdir(parents=True)
    (root / "tmp").chmod(0o1777)
    bb = binary("busybox")
    shutil.copy2(bb, root / "bin" / "busybox")
    for applet in _run([str(bb), "--list"]).split():
        if applet != "busybox":
            (root / "bin" / applet).symlink_to("busybox")
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n")
    (root / "etc" / "group").write_text("root:x:0:\nnogroup:x:65534:\n")
    _from_rootfs(img, root, ["--env", "PATH=/bin", "--cmd", '["/bin/sh"]'])


def _build_base_python(img: Image, work: Path) -> None:
    root = work / "rootfs"
    _run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", DEBIAN_SUITE, str(root), DEBIAN_MIRROR],
         timeout=1800)
    # Package access goes through a proxy with its own CA: builds FROM this image must trust it.
    if HOST_CA_BUNDLE.exists():
        shutil.copy2(HOST_CA_BUNDLE, root / "etc/ssl/certs/ca-certificates.crt")
    if HOST_PIP_CONF.exists():
        shutil.copy2(HOST_PIP_CONF, root / "etc/pip.conf")
    # A Python under /root (pyenv) is mounted into runtime pods that run as non-root users.
    (root / "root").chmod(0o755)
    for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for p in (root / junk).glob("*"):
            if p.is_file():
                p.unlink()
    _from_rootfs(img, root, ["--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                             "--env", "LANG=C.UTF-8", "--cmd", '["python3"]'])


def _bud(img: Image, dockerfile_text: str, files: list[str], work: Path,
         build_args: dict[str, str] | None = None) -> None:
    base = image("base-python")
    _ensure_in_storage(base)
    ctx = work / "context"
    ctx.mkdir()
    for rel in files:
        dst = ctx / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, dst)
    (work / "Dockerfile").write_text(dockerfile_text)
    _buildah(
        "bud", "--quiet", "--isolation", "chroot", "--network", "host", "--pull-never",
        "--layers=false", "--format", "docker",
        "--build-arg", f"PYTHON_IMAGE={base.ref}",
        *(a for k, v in sorted((build_args or {}).items()) for a in ("--build-arg", f"{k}={v}")),
        "-f", str(work / "Dockerfile"), "-t", img.ref, str(ctx),
        timeout=3600,
    )


def _build(img: Image, work: Path) -> None:
    if img.name == "pause":
        _build_pause(img, work)
    elif img.name == "busybox":
        _build_busybox(img, work)
    elif img.name == "base-python":
        _build_base_python(img, work)
    elif img.name in DOCKERFILE_IMAGES:
        df = REPO / "images" / DOCKERFILE_IMAGES[img.name]
        _bud(img, df.read_text(), context_files(df), work, BUILD_ARGS.get(img.name))
    elif img.name == "runtime-thin":
        _bud(img, thin_runtime_dockerfile(), [], work)
    else:
        raise KeyError(img.name)


def build(name: str) -> Image:
    """Build `name` unless its archive is cached; return it (archive present)."""
    img = image(name)
    if img.archive.exists():
        return img
    ensure_tools()
    with _lock():
        if img.archive.exists():
            return img
        STORAGE.mkdir(parents=True, exist_ok=True)
        RUNROOT.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f"rljob-image-{name}-") as tmp:
            _build(img, Path(tmp))
        _save(img)
        if name != "base-python":
            # Keep the storage small: the archive is the cache. The base stays, as every FROM's.
            subprocess.run(["buildah", "--root", str(STORAGE / "root"), "--runroot", str(RUNROOT), "rmi", img.ref],
                           capture_output=True, check=False)
        print(f"built image {img.ref} in {time.monotonic() - started:.0f} s -> {img.archive}", file=sys.stderr)
    return img


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.cluster.images")
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help=f"build (or reuse) images; prints NAME ARCHIVE REF (default: {' '.join(NAMES)}; "
                                     f"on demand: {' '.join(ON_DEMAND)})")
    b.add_argument("names", nargs="*", default=list(NAMES))
    r = sub.add_parser("ref", help="print an image's reference")
    r.add_argument("name")
    args = parser.parse_args(argv)
    if args.cmd == "ref":
        print(image(args.name).ref)
        return 0
    for name in args.names:
        img = build(name)
        print(name, img.archive, img.ref)
    return 0


if __name__ == "__main__":
    sys.exit(main())
