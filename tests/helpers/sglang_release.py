"""SGLang's own released code, read at test time: the wheel of a release, downloaded once into
``${RLJOB_CACHE:-~/.cache/rljob}/sglang/`` and never copied into the repository.

``pip download --no-deps`` fetches exactly one wheel (no dependencies, nothing installed); a file
lock makes concurrent test processes download it once, and a finished wheel is moved into place in
one rename, so a download cut short never looks cached.
"""

from __future__ import annotations

import ast
import builtins
import fcntl
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# The release the operator's SGLang image pins, and the newest release the project targets.
PINNED = "0.5.5.post3"
NEWEST = "0.5.23"
DOWNLOAD_TIMEOUT_S = 900


class ReleaseUnavailable(RuntimeError):
    """The wheel of a release could not be fetched; the message says what pip answered."""


def cache_dir() -> Path:
    """Where SGLang wheels are kept: ``$RLJOB_CACHE/sglang``, else ``~/.cache/rljob/sglang``."""
    return Path(os.environ.get("RLJOB_CACHE") or Path.home() / ".cache" / "rljob") / "sglang"


def _cached(directory: Path, version: str) -> Path | None:
    wheels = sorted(directory.glob(f"sglang-{version}-*.whl"))
    return wheels[0] if wheels else None


def sglang_wheel(version: str) -> Path:
    """The wheel of ``sglang==version``, downloaded on first use; ReleaseUnavailable when pip cannot."""
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        wheel = _cached(directory, version)
        if wheel is not None:
            return wheel
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            proc = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
                 "-q", "-d", tmp, f"sglang=={version}"],
                capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S, check=False,
            )
            fetched = _cached(Path(tmp), version)
            if proc.returncode != 0 or fetched is None:
                raise ReleaseUnavailable(
                    f"pip could not download the wheel of sglang=={version} (exit {proc.returncode}); the test reads "
                    f"SGLang's own code from it, so it needs PyPI once (cached in {directory}):\n"
                    f"{(proc.stdout + proc.stderr)[-2000:]}"
                )
            fetched.rename(directory / fetched.name)
        return directory / fetched.name


def read_source(version: str, path: str) -> str:
    """The text of ``path`` (e.g. ``sglang/srt/utils/common.py``) inside the wheel of ``version``."""
    with zipfile.ZipFile(sglang_wheel(version)) as wheel:
        return wheel.read(path).decode()


def function_source(version: str, path: str, name: str) -> str:
    """The source of the top-level function ``name`` of ``path`` in the release, as written there."""
    source = read_source(version, path)
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            segment = ast.get_source_segment(source, node)
            assert segment is not None
            return segment
    raise LookupError(f"sglang {version}: no function {name} in {path}")


def free_names(function: str) -> set[str]:
    """Names a function's body reads from its module's globals (those it neither binds nor imports)."""
    tree = ast.parse(function)
    bound = {a.arg for node in ast.walk(tree) if isinstance(node, ast.arguments)
             for a in (*node.posonlyargs, *node.args, *node.kwonlyargs)}
    bound |= {alias.asname or alias.name.split(".")[0] for node in ast.walk(tree)
              if isinstance(node, ast.Import | ast.ImportFrom) for alias in node.names}
    bound |= {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}
    bound |= {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    read = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    return read - bound - set(dir(builtins))
