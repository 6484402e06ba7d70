"""Locate the cached localkube, kwok, helm, promtool, prometheus and weed binaries, building them once.

`localkube.sh` owns the versions and the cache layout; this module only asks it for paths, so the
two can never disagree.
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

LOCALKUBE_SH = Path(__file__).with_name("localkube.sh")
BINARIES = ("localkube", "kwokstages", "kwok", "helm", "promtool", "prometheus")
# A cold build on 2 cores takes tens of minutes; past this something is wrong.
BUILD_TIMEOUT_S = 60 * 60

log = logging.getLogger(__name__)


class BinariesUnavailable(RuntimeError):
    """A binary could not be built; the message says which and how to investigate."""


def binary_path(name: str) -> Path:
    """Return the cache path of `name` (one of BINARIES, or any name `localkube.sh path` knows); the file may not exist yet."""
    out = subprocess.run(
        [str(LOCALKUBE_SH), "path", name],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    )
    return Path(out.stdout.strip())


def missing_binaries(names: Sequence[str] = BINARIES) -> list[str]:
    """Those of `names` that are not in the cache."""
    return [name for name in names if not os.access(binary_path(name), os.X_OK)]


def ensure_built(names: Sequence[str] = BINARIES) -> None:
    """Make sure `names` are cached, running `localkube.sh build` (slow when cold) if not.

    Raises BinariesUnavailable, naming what could not be built, when the build fails.
    """
    missing = missing_binaries(names)
    if not missing:
        return
    log.warning(
        "cluster binaries not cached (%s): running %s build once; this takes many minutes cold",
        ", ".join(missing),
        LOCALKUBE_SH,
    )
    proc = subprocess.run(
        [str(LOCALKUBE_SH), "build"],
        check=False,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )
    still_missing = missing_binaries(names)
    if proc.returncode != 0 or still_missing:
        # Lines starting with a tab are GNU time's resource report, not the reason.
        reason = [
            line
            for line in (proc.stdout + proc.stderr).splitlines()
            if not line.startswith("\t")
        ]
        tail = "\n".join(reason[-30:])
        raise BinariesUnavailable(
            f"could not build {', '.join(still_missing) or 'the cluster binaries'} "
            f"(`{LOCALKUBE_SH} build` exited {proc.returncode}); run it by hand to see why, "
            f"or set RLJOB_SKIP_CLUSTER=1 to skip cluster tests.\n{tail}"
        )
