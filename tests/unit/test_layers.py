"""The layering contract (docs/architecture.md): api < common < (runtime | operator), and the
contracts inside the runtime: forbidden imports between its packages and no import cycles.

A module may import its own package and any package in a layer below it, never one beside or above
it. import-linter cannot check this tree: `operator/` must stay a namespace package (an
`operator/__init__.py` at the repository root would shadow the standard library's `operator` for any
process started there), and import-linter's graph builder skips namespace packages. So the rule is
checked here on the syntax trees, imports inside functions included.
"""

from __future__ import annotations

import ast
import graphlib
from collections.abc import Iterator
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


# --- Contracts inside the runtime (import-linter's "forbidden" and "acyclic" contracts, on the ast) ---

RUNTIME = REPO / "runtime"

# runtime package -> the runtime packages it must never import, at any depth or time (type-only too).
FORBIDDEN: dict[str, set[str]] = {
    "rollout": {"training", "weights"},  # a round knows engines and samples, not how weights travel
    "engines": {"weights"},  # transports drive engines through engines/base.py's WeightTargets
    "models": {"tasks"},  # models are below tasks (tasks/policy.py opens them, tasks/warmup.py trains one)
}

def module_name(path: Path) -> str:
    """`rljob.runtime.a.b` for runtime/a/b.py (a package's `__init__.py` is the package)."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["rljob", *parts])


def _type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None) if isinstance(node, ast.If) else None
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, runtime_only: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement of a tree; with runtime_only, not those under `if TYPE_CHECKING:`
    (they never run, so they cannot make a cycle of module loading)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif runtime_only and _type_checking_block(node):
            yield from (n for child in node.orelse for n in _imports(ast.Module([child], []), runtime_only))
        else:
            yield from _imports(node, runtime_only)


def runtime_modules() -> dict[str, Path]:
    """Every module of the runtime by its dotted name."""
    return {module_name(path): path for path in sorted(RUNTIME.rglob("*.py"))}


def module_imports(source: str, modules: set[str], runtime_only: bool) -> set[str]:
    """The runtime modules (of `modules`) a source imports; `from pkg import sub` names the submodule."""
    found: set[str] = set()
    for node in _imports(ast.parse(source), runtime_only):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif node.level == 0 and node.module:
            targets = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                       for alias in node.names]
        else:
            targets = []
        found.update(t for t in targets if t in modules)
    return found


def import_graph(runtime_only: bool) -> dict[str, set[str]]:
    """Runtime module -> the runtime modules it imports (packages' empty `__init__` left out)."""
    modules = runtime_modules()
    names = set(modules)
    packages = {m for m, p in modules.items() if p.name == "__init__.py"}
    return {m: module_imports(p.read_text(), names, runtime_only) - packages - {m}
            for m, p in modules.items() if m not in packages}


def runtime_package(module: str) -> str:
    """`engines` for rljob.runtime.engines.x; a top-level module is its own package (`runner`)."""
    return module.split(".")[2]


def forbidden_imports(graph: dict[str, set[str]]) -> list[str]:
    """`module imports module` for every import a FORBIDDEN contract rules out."""
    return sorted(
        f"{m} imports {t}" for m, targets in graph.items() for t in targets
        if runtime_package(t) in FORBIDDEN.get(runtime_package(m), set())
    )


def cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected sets of more than one module (each holds at least one import cycle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: set[frozenset[str]] = set()

    def visit(v: str) -> None:  # Tarjan's algorithm; the runtime's graph is shallow enough to recurse
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.add(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_runtime_packages_keep_their_forbidden_contracts() -> None:
    assert forbidden_imports(import_graph(runtime_only=False)) == []


def test_runtime_has_no_import_cycles_between_modules() -> None:
    assert cycles(import_graph(runtime_only=True)) == set()


def test_runtime_packages_import_each_other_without_cycles() -> None:
    """Packages (engines, weights, models, tasks, ...) form a DAG, counting type-only imports too."""
    graph = import_graph(runtime_only=False)
    packages: dict[str, set[str]] = {}
    for m, targets in graph.items():
        packages.setdefault(runtime_package(m), set()).update(
            runtime_package(t) for t in targets if runtime_package(t) != runtime_package(m))
    try:
        graphlib.TopologicalSorter(packages).prepare()
    except graphlib.CycleError as err:
        raise AssertionError(f"runtime packages import each other in a cycle: {err.args[1]}") from None


def test_cycle_and_contract_checkers_see_what_they_must() -> None:
    """The checkers on a made-up graph: a cycle through a lazy import, a type-only import skipped."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "from rljob.runtime.engines import base\n"
        "if TYPE_CHECKING:\n    from rljob.runtime.weights.transport import SyncReport\n"
        "def f():\n    import rljob.runtime.weights.tensor\n"
    )
    modules = {"rljob.runtime.engines.base", "rljob.runtime.weights.transport", "rljob.runtime.weights.tensor"}
    assert module_imports(source, modules, runtime_only=True) == {
        "rljob.runtime.engines.base", "rljob.runtime.weights.tensor"}
    assert module_imports(source, modules, runtime_only=False) == modules
    graph = {"rljob.runtime.engines.a": {"rljob.runtime.weights.b"}, "rljob.runtime.weights.b": {"rljob.runtime.engines.a"}}
    assert cycles(graph) == {frozenset(graph)}
    assert forbidden_imports(graph) == ["rljob.runtime.engines.a imports rljob.runtime.weights.b"]
