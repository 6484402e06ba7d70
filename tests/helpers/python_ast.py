"""``ast.parse`` that a garbage-collector finalizer cannot break.

CPython 3.11 keeps the AST builder's recursion depth in interpreter-wide state: when the collector
runs mid-parse and a finalizer formats a traceback (3.11's tracebacks parse the failing line to
place the carets), the nested parse overwrites that depth and the outer one fails with
``SystemError: AST constructor recursion depth mismatch`` (python/cpython#106905, fixed in 3.12).
Large files such as SGLang's modules give the collector plenty of chances.
"""

from __future__ import annotations

import ast
import gc


def parse(source: str, filename: str = "<unknown>") -> ast.Module:
    """``ast.parse(source)`` with the collector paused so no finalizer runs inside it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(source, filename=filename)
    finally:
        if was_enabled:
            gc.enable()
