"""The layering contract: api < common < (runtime | operator), checked by import-linter.

The contract itself lives in pyproject.toml ([tool.importlinter]); this test makes a broken layer
fail the suite instead of waiting for someone to run `lint-imports`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def _setup_top_level() -> tuple[str, ...]:
    """The folders setup.py maps under `rljob` (the string tuple in its TOP_LEVEL assignment)."""
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "TOP_LEVEL" for t in node.targets):
            return tuple(c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value.isidentifier())
    raise AssertionError("setup.py has no TOP_LEVEL")


def test_layers_contract_is_kept() -> None:
    done = subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 kept, 0 broken" in done.stdout, done.stdout


def test_contract_covers_every_top_level_package() -> None:
    """A new top-level folder must be placed in a layer, or the contract silently ignores it."""
    import tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    layered = {name for layer in config["contracts"][0]["layers"] for name in layer.split(" | ")}
    packaged = {f"rljob.{top}" for top in _setup_top_level()}
    assert set(config["root_packages"]) == layered == packaged
