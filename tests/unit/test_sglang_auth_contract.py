"""The engine API key behaves as SGLang's own ``--api-key`` does, read from the released sources.

- 0.5.23: ``sglang/srt/utils/auth.py`` has no heavy imports, so its pure ``decide_request_auth`` is loaded
  by path from the downloaded wheel and asked about every request the runtime sends, and about the
  probe and metrics paths, next to ``runtime/engines/auth.py``'s ``request_allowed``;
- 0.5.5.post3: ``add_api_key_middleware`` in ``sglang/srt/utils/common.py`` (which imports torch) is
  parsed: the path prefixes it exempts and the status it refuses with.

Both releases have the ``--api-key`` flag the operator passes (test_sglang_contract checks every flag of
the pool container against the release's parser).
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from types import ModuleType

import pytest

from rljob.runtime.engines.auth import EXEMPT_PREFIXES, UNAUTHORIZED_BODY, UNAUTHORIZED_STATUS, request_allowed
from rljob.runtime.engines.protocol import detect_worker_api
from tests.helpers.releases import release_or_skip
from tests.helpers.sglang_source import SGLangSource
from tests.unit.test_sglang_contract import _worker_calls

KEY = "k-123"
HEADERS = (None, f"Bearer {KEY}", f"bearer {KEY}", "Bearer wrong", KEY, f"Basic {KEY}", "Bearer ")
# Paths the kubelet and Prometheus use without a key, and look-alikes that must still need one.
OPEN_PATHS = ("/health", "/health_generate", "/ready", "/metrics")


def _auth_module() -> ModuleType:
    root = release_or_skip("sglang", "0.5.23")
    path = root / "sglang" / "srt" / "utils" / "auth.py"
    spec = importlib.util.spec_from_file_location("sglang_released_auth", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through sys.modules
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def _runtime_paths() -> set[tuple[str, str]]:
    """(method, path) of every request the runtime sends a worker of either API."""
    apis = [detect_worker_api(200, 200), detect_worker_api(404, 404)]
    return {(call.method, call.path.split("?")[0]) for api in apis for call in _worker_calls(api)}


def test_the_key_is_required_exactly_where_sglang_0_5_23_requires_it() -> None:
    auth = _auth_module()
    requests = _runtime_paths() | {("GET", p) for p in OPEN_PATHS} | {
        ("POST", "/update_weights_from_disk"), ("POST", "/init_weights_update_group"), ("POST", "/abort_request"),
        ("OPTIONS", "/generate"), ("GET", "/healthz"), ("GET", "/get_server_info"), ("POST", "/metricsx"),
    }
    refused = set()
    for method, path in sorted(requests):
        for header in HEADERS:
            # With only --api-key set, NORMAL and ADMIN_OPTIONAL routes both require it (weight updates,
            # aborts and pauses are ADMIN_OPTIONAL in 0.5.23).
            for level in (auth.AuthLevel.NORMAL, auth.AuthLevel.ADMIN_OPTIONAL):
                theirs = auth.decide_request_auth(method=method, path=path, authorization_header=header,
                                                  api_key=KEY, admin_api_key=None, auth_level=level)
                ours = request_allowed(method, path, header, KEY)
                assert ours == theirs.allowed, (method, path, header, level)
                if not theirs.allowed:
                    assert theirs.error_status_code == UNAUTHORIZED_STATUS
                    refused.add(path)
    # The check can fail: the control endpoints an attacker would call are refused without the key.
    assert {"/update_weights_from_disk", "/init_weights_update_group", "/abort_request", "/generate"} <= refused
    assert not refused & set(OPEN_PATHS)


def _middleware(root_source: str) -> ast.FunctionDef:
    module = ast.parse(root_source)
    return next(n for n in ast.walk(module) if isinstance(n, ast.FunctionDef) and n.name == "add_api_key_middleware")


def test_the_open_paths_and_the_refusal_match_sglang_0_5_5() -> None:
    root = release_or_skip("sglang", "0.5.5.post3")
    source = (root / "sglang" / "srt" / "utils" / "common.py").read_text()
    middleware = _middleware(source)
    prefixes = {
        node.args[0].value for node in ast.walk(middleware)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "startswith"
        and node.args and isinstance(node.args[0], ast.Constant)
    }
    assert prefixes == {"/health", "/metrics"}, prefixes
    # Ours exempts 0.5.23's /ready as well (0.5.5.post3 has no /ready route: SGLangSource routes say so).
    assert set(EXEMPT_PREFIXES) - prefixes == {"/ready"}
    assert "/ready" not in SGLangSource(root).routes
    statuses = {kw.value.value for node in ast.walk(middleware) if isinstance(node, ast.Call)
                for kw in node.keywords if kw.arg == "status_code" and isinstance(kw.value, ast.Constant)}
    assert statuses == {UNAUTHORIZED_STATUS}
    bodies = [ast.literal_eval(kw.value) for node in ast.walk(middleware) if isinstance(node, ast.Call)
              for kw in node.keywords if kw.arg == "content" and isinstance(kw.value, ast.Dict)]
    assert bodies == [UNAUTHORIZED_BODY]


@pytest.mark.parametrize("version", ["0.5.5.post3", "0.5.23"])
def test_both_releases_have_the_api_key_flag(version: str) -> None:
    assert "--api-key" in SGLangSource(release_or_skip("sglang", version)).server_flags
