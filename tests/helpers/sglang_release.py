"""SGLang's own released code, read at test time from the release's wheel (tests/helpers/releases.py
downloads and unpacks it once into the shared cache); nothing of it is copied into the repository.
"""

from __future__ import annotations

import ast
import builtins

from tests.helpers.releases import SGLANG_RELEASES, release_dir
from tests.helpers import python_ast

# The previous image pin and the default image's release (operator/builders/vendor.py).
PINNED, NEWEST = SGLANG_RELEASES


def read_source(version: str, path: str) -> str:
    """The text of ``path`` (e.g. ``sglang/srt/utils/common.py``) in the released package of ``version``."""
    return (release_dir("sglang", version) / path).read_text()


def function_source(version: str, path: str, name: str) -> str:
    """The source of the top-level function ``name`` of ``path`` in the release, as written there."""
    source = read_source(version, path)
    for node in python_ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            segment = ast.get_source_segment(source, node)
            assert segment is not None
            return segment
    raise LookupError(f"sglang {version}: no function {name} in {path}")


def free_names(function: str) -> set[str]:
    """Names a function's body reads from its module's globals (those it neither binds nor imports)."""
    tree = python_ast.parse(function)
    bound = {a.arg for node in ast.walk(tree) if isinstance(node, ast.arguments)
             for a in (*node.posonlyargs, *node.args, *node.kwonlyargs)}
    bound |= {alias.asname or alias.name.split(".")[0] for node in ast.walk(tree)
              if isinstance(node, ast.Import | ast.ImportFrom) for alias in node.names}
    bound |= {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}
    bound |= {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    read = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    return read - bound - set(dir(builtins))
