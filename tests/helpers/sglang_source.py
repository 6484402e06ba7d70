"""What a released SGLang accepts, read from its own source with ``ast`` (nothing of it is imported).

SGLang's server modules import CUDA kernels, torch and dozens of packages, so the contract tests parse
the released files instead (tests/helpers/releases.py fetches them):

- HTTP routes: the ``@app.get/post/api_route`` decorators of ``srt/entrypoints/http_server.py`` and of
  the routers it includes (``app.include_router``);
- request bodies: the handler's body parameter (``obj: X`` or ``obj: Annotated[X, Body()]``) names a
  class of ``srt/managers/io_struct.py``, whose fields (with its bases') are the accepted keys;
- sampling parameters: ``SamplingParams`` of ``srt/sampling/sampling_params.py`` (``__init__``
  arguments in 0.5.5, struct fields in 0.5.23);
- server flags: every ``add_argument("--flag", ...)`` of ``srt/server_args.py`` and ``srt/arg_groups``,
  and the fields declared ``A[T, ...]`` / ``A[T, Arg(...)]`` from which 0.5.23 generates its flags
  (``--field-name``, or ``Arg(cli_name=..., aliases=[...])``, none when ``no_cli=True``);
- ``ServerArgs`` fields (which ``/get_server_info`` spreads into its reply).
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path
from tests.helpers import python_ast

FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef
_ROUTE_METHODS = {"get": "GET", "post": "POST", "put": "PUT", "delete": "DELETE", "head": "HEAD"}


@dataclass(frozen=True)
class Route:
    """One HTTP route: its methods and the function that handles it."""

    path: str
    methods: frozenset[str]
    handler: FunctionNode


def _parse(path: Path) -> ast.Module:
    return python_ast.parse(path.read_text(), filename=str(path))


def _literal_path(node: ast.expr) -> str | None:
    """A route path: a string, or ``os.environ.get("VAR", "/default")`` (its default)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Call) and len(node.args) == 2:
        return _literal_path(node.args[1])
    return None


def _route_of(decorator: ast.expr) -> tuple[str, frozenset[str]] | None:
    if not (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute) and decorator.args):
        return None
    path = _literal_path(decorator.args[0])
    name = decorator.func.attr
    if path is None:
        return None
    if name in _ROUTE_METHODS:
        return path, frozenset({_ROUTE_METHODS[name]})
    if name == "api_route":
        methods = next((kw.value for kw in decorator.keywords if kw.arg == "methods"), None)
        if isinstance(methods, ast.List):
            return path, frozenset(str(ast.literal_eval(m)) for m in methods.elts)
        return path, frozenset({"GET"})
    return None


def _routes_in(module: ast.Module) -> list[Route]:
    routes = []
    for node in ast.walk(module):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for decorator in node.decorator_list:
                found = _route_of(decorator)
                if found is not None:
                    routes.append(Route(found[0], found[1], node))
    return routes


def _annotation_class(annotation: ast.expr | None) -> str | None:
    """``X`` of ``obj: X`` or ``obj: Annotated[X, Body()]``."""
    if isinstance(annotation, ast.Name):
        return annotation.id
    if isinstance(annotation, ast.Subscript) and isinstance(annotation.slice, ast.Tuple):
        return _annotation_class(annotation.slice.elts[0])
    return None


class SGLangSource:
    """The parts of one unpacked SGLang release the contract tests need."""

    def __init__(self, root: Path) -> None:
        self.root = root / "sglang"
        if not (self.root / "srt" / "entrypoints" / "http_server.py").exists():
            raise FileNotFoundError(f"{root} is not an unpacked sglang wheel (no sglang/srt/entrypoints/http_server.py)")

    def _module_file(self, dotted: str) -> Path:
        return self.root.parent / (dotted.replace(".", "/") + ".py")

    @functools.cached_property
    def routes(self) -> dict[str, Route]:
        """path -> route (methods merged over every handler of the path)."""
        server = _parse(self.root / "srt" / "entrypoints" / "http_server.py")
        modules = [server]
        imported = {
            alias.asname or alias.name: node.module
            for node in ast.walk(server)
            if isinstance(node, ast.ImportFrom) and node.module
            for alias in node.names
        }
        for node in ast.walk(server):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "include_router" and node.args and isinstance(node.args[0], ast.Name)):
                module = imported.get(node.args[0].id)
                if module is not None and self._module_file(module).exists():
                    modules.append(_parse(self._module_file(module)))
        merged: dict[str, Route] = {}
        for module in modules:
            for route in _routes_in(module):
                known = merged.get(route.path)
                merged[route.path] = Route(route.path, route.methods | (known.methods if known else frozenset()),
                                           known.handler if known else route.handler)
        return merged

    @functools.cached_property
    def _io_classes(self) -> dict[str, ast.ClassDef]:
        module = _parse(self.root / "srt" / "managers" / "io_struct.py")
        return {node.name: node for node in module.body if isinstance(node, ast.ClassDef)}

    def class_fields(self, name: str) -> set[str]:
        """Fields of an ``io_struct`` class, its ``io_struct`` bases' included."""
        node = self._io_classes[name]
        fields = {stmt.target.id for stmt in node.body
                  if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)}
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in self._io_classes:
                fields |= self.class_fields(base.id)
        return fields

    def body_class(self, path: str) -> str | None:
        """The ``io_struct`` class the handler of ``path`` parses its JSON body into; None: it reads none."""
        handler = self.routes[path].handler
        for arg in handler.args.args:
            name = _annotation_class(arg.annotation)
            if name in self._io_classes:
                return name
        return None

    def reply_keys(self, path: str) -> set[str]:
        """String keys of every dict literal in the handler of ``path`` (what its reply can carry)."""
        return {key.value for node in ast.walk(self.routes[path].handler) if isinstance(node, ast.Dict)
                for key in node.keys if isinstance(key, ast.Constant) and isinstance(key.value, str)}

    @functools.cached_property
    def sampling_params(self) -> set[str]:
        """The keys ``sampling_params`` accepts."""
        module = _parse(self.root / "srt" / "sampling" / "sampling_params.py")
        cls = next(n for n in module.body if isinstance(n, ast.ClassDef) and n.name == "SamplingParams")
        init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        if init is not None:
            return {a.arg for a in init.args.args + init.args.kwonlyargs} - {"self"}
        return {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}

    def _server_arg_modules(self) -> list[ast.Module]:
        files = [self.root / "srt" / "server_args.py", *sorted((self.root / "srt" / "arg_groups").rglob("*.py"))]
        return [_parse(f) for f in files if f.exists()]

    @functools.cached_property
    def server_flags(self) -> set[str]:
        """Every option string ``sglang.launch_server`` accepts (exact spellings, no prefix expansion)."""
        flags: set[str] = set()
        for module in self._server_arg_modules():
            for node in ast.walk(module):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
                    flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
                if isinstance(node, ast.ClassDef):
                    for stmt in node.body:
                        flags |= _declared_flags(stmt)
        return flags

    @functools.cached_property
    def server_args_fields(self) -> set[str]:
        """``ServerArgs`` fields: its own (0.5.5) and those of the ``arg_groups/fields`` namespaces (0.5.23)."""
        fields: set[str] = set()
        for module in self._server_arg_modules():
            for node in ast.walk(module):
                if isinstance(node, ast.ClassDef) and (node.name == "ServerArgs" or "_NS_PATH" in ast.unparse(node)):
                    fields |= {s.target.id for s in node.body
                               if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
        return fields


def _declared_flags(stmt: ast.stmt) -> set[str]:
    """The flags of a field declared ``name: A[T, "help"]`` or ``name: A[T, Arg(...)]`` (0.5.23's
    ``add_cli_args_from_dataclass``); nothing for any other statement."""
    if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
            and isinstance(stmt.annotation, ast.Subscript) and isinstance(stmt.annotation.value, ast.Name)
            and stmt.annotation.value.id == "A" and isinstance(stmt.annotation.slice, ast.Tuple)):
        return set()
    meta = stmt.annotation.slice.elts[1]
    name = "--" + stmt.target.id.replace("_", "-")
    if isinstance(meta, ast.Call):
        keywords = {kw.arg: kw.value for kw in meta.keywords}
        if isinstance(keywords.get("no_cli"), ast.Constant) and keywords["no_cli"].value is True:
            return set()
        if "cli_name" in keywords:
            name = str(ast.literal_eval(keywords["cli_name"]))
        aliases = keywords.get("aliases")
        return {name, *(str(a) for a in (ast.literal_eval(aliases) if aliases is not None else []))}
    return {name}
