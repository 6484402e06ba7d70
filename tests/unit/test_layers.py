"""The layering contract (docs/architecture.md): api < common < (runtime | operator).

A module may import its own package and any package in a layer below it, never one beside or above
it. import-linter cannot check this tree: `operator/` must stay a namespace package (an
`operator/__init__.py` at the repository root would shadow the standard library's `operator` for any
process started there), and import-linter's graph builder skips namespace packages. So the rule is
checked here on the syntax trees, imports inside functions included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Top-level package -> the packages it may import (besides itself).
ALLOWED: dict[str, set[str]] = {
    "api": set(),
    "common": {"api"},
    "runtime": {"api", "common"},
    "operator": {"api", "common"},
}


def _setup_top_level() -> tuple[str, ...]:
    """The folders setup.py maps under `rljob` (the strings in its TOP_LEVEL assignment)."""
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "TOP_LEVEL" for t in node.targets):
            return tuple(
                c.value for c in ast.walk(node.value)
                if isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value.isidentifier()
            )
    raise AssertionError("setup.py has no TOP_LEVEL")


def imported_packages(source: str) -> set[str]:
    """The `rljob.<top>` packages a module's source imports, at any depth of the tree."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module == "rljob":
                names = [f"rljob.{alias.name}" for alias in node.names]
        found.update(name.split(".")[1] for name in names if name.startswith("rljob.") and name.count(".") >= 1)
    return found


def layer_violations(top: str) -> list[str]:
    """`file: imports rljob.X` for every import of a package `top` may not use."""
    allowed = ALLOWED[top] | {top}
    bad: list[str] = []
    for path in sorted((REPO / top).rglob("*.py")):
        for package in sorted(imported_packages(path.read_text()) - allowed):
            bad.append(f"{path.relative_to(REPO)}: imports rljob.{package}")
    return bad


def test_every_top_level_package_has_a_layer() -> None:
    assert set(_setup_top_level()) == set(ALLOWED)


@pytest.mark.parametrize("top", sorted(ALLOWED))
def test_layer_imports_only_what_it_may(top: str) -> None:
    assert layer_violations(top) == []


def test_checker_sees_imports_inside_functions() -> None:
    source = "def f():\n    from rljob.operator.kube import Kube\n    import rljob.runtime.cli\nfrom rljob import api\n"
    assert imported_packages(source) == {"operator", "runtime", "api"}


def test_operator_is_a_namespace_package() -> None:
    """`operator/__init__.py` would shadow the stdlib `operator` in any process started at the root."""
    assert not (REPO / "operator" / "__init__.py").exists()
