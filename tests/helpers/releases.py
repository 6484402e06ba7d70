"""Released SGLang and sglang-router packages, fetched once with ``pip download --no-deps`` and unpacked.

The contract tests read SGLang's own released source at test time (never a copy in this repository):
the wheels are downloaded into ``${RLJOB_CACHE:-~/.cache/rljob}/wheels/`` and unpacked next to them,
once per release, under a file lock so concurrent test runs share one download. The supported
releases follow the operator's image pins (operator/builders/vendor.py; docs/sglang_releases.md).

Without network and without a cached copy the tests fail with the command to run by hand; set
``RLJOB_SKIP_SGLANG_CONTRACT=1`` to skip them instead (for example on an offline machine).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest
from filelock import FileLock

from rljob.operator.builders.vendor import SGLANG_PREVIOUS_VERSION, SGLANG_ROUTER_VERSION, SGLANG_VERSION

# The releases the project supports: the previous image pin and the default image's (the newest release).
SGLANG_RELEASES = tuple(v.removeprefix("v") for v in (SGLANG_PREVIOUS_VERSION, SGLANG_VERSION))
# sglang-router: the router image's pin, which is also the newest release on PyPI.
ROUTER_RELEASES = (SGLANG_ROUTER_VERSION,)
# The same wheels on every machine: 0.5.23 ships only CPython 3.11 manylinux_2_34 wheels, 0.5.5.post3 a pure
# one, sglang-router an abi3 manylinux_2_17 one (pip does not widen a --platform to older manylinux tags).
_PLATFORM = ("--platform", "manylinux_2_34_x86_64", "--platform", "manylinux_2_17_x86_64", "--python-version", "3.11",
             "--implementation", "cp", "--only-binary=:all:")
DOWNLOAD_TIMEOUT_S = 900


class ReleaseUnavailable(RuntimeError):
    """A release could not be downloaded; the message says how to fetch it by hand."""


def cache_root() -> Path:
    """``$RLJOB_CACHE/wheels``, else ``~/.cache/rljob/wheels``."""
    return Path(os.environ.get("RLJOB_CACHE") or Path.home() / ".cache" / "rljob") / "wheels"


def release_dir(package: str, version: str) -> Path:
    """The unpacked wheel of ``package==version`` (its top-level packages are directories in it).

    Downloads and unpacks on first use; later calls, in this or another process, reuse the cache.
    Raises ReleaseUnavailable when pip cannot fetch it.
    """
    root = cache_root()
    target = root / f"{package}-{version}"
    if (target / ".complete").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(root / ".download.lock"):
        if (target / ".complete").exists():  # another process finished it while we waited
            return target
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
                   *_PLATFORM, "-d", tmp, f"{package}=={version}"]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S, check=False)
            wheels = list(Path(tmp).glob("*.whl"))
            if proc.returncode != 0 or len(wheels) != 1:
                raise ReleaseUnavailable(
                    f"could not download {package}=={version} (`{' '.join(cmd)}` exited {proc.returncode}): "
                    f"{proc.stderr.strip()[-800:]}\nFetch it with network access once, or set "
                    "RLJOB_SKIP_SGLANG_CONTRACT=1 to skip the SGLang contract tests."
                )
            unpacked = Path(tmp) / "unpacked"
            with zipfile.ZipFile(wheels[0]) as wheel:
                wheel.extractall(unpacked)
            (unpacked / ".complete").write_text(wheels[0].name + "\n")
            shutil.rmtree(target, ignore_errors=True)  # a half-written copy from a killed run
            unpacked.rename(target)
    return target


def release_or_skip(package: str, version: str) -> Path:
    """release_dir, or a skip when ``RLJOB_SKIP_SGLANG_CONTRACT=1`` (offline machines)."""
    if os.environ.get("RLJOB_SKIP_SGLANG_CONTRACT") == "1":
        pytest.skip("RLJOB_SKIP_SGLANG_CONTRACT=1")
    return release_dir(package, version)
