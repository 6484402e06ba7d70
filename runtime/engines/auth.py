"""Engine API-key authentication, as SGLang enforces it, for the CPU server and the client.

SGLang (``--api-key``) checks every HTTP request for ``Authorization: Bearer <key>`` and answers
401 ``{"error": "Unauthorized"}`` without it, except:

- ``OPTIONS`` requests (CORS preflight);
- paths starting with ``/health``, ``/ready`` or ``/metrics``, so kubelet probes and Prometheus need no
  secret (0.5.23: ``decide_request_auth`` in ``sglang/srt/utils/auth.py``; 0.5.5.post3 exempts
  ``/health`` and ``/metrics`` in ``add_api_key_middleware`` of ``sglang/srt/utils/common.py``).

The key is compared in constant time, as 0.5.23 does. tests/unit/test_sglang_auth_contract.py reads
both released sources and checks these rules against them.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web
from aiohttp.typedefs import Middleware

from rljob.api.engine_auth import ENGINE_API_KEY_ENV

# Path prefixes SGLang serves without a key (0.5.23's set; it includes 0.5.5.post3's).
EXEMPT_PREFIXES = ("/health", "/ready", "/metrics")
UNAUTHORIZED_STATUS = 401
UNAUTHORIZED_BODY = {"error": "Unauthorized"}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def request_allowed(method: str, path: str, authorization: str | None, api_key: str | None) -> bool:
    """Whether SGLang with ``--api-key api_key`` (None: no key) lets this request through."""
    if api_key is None or method == "OPTIONS" or path.startswith(EXEMPT_PREFIXES):
        return True
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), api_key.encode())


def api_key_middleware(api_key: str) -> Middleware:
    """aiohttp middleware refusing requests without the key (401, SGLang's body)."""

    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not request_allowed(request.method, request.path, request.headers.get("Authorization"), api_key):
            return web.json_response(UNAUTHORIZED_BODY, status=UNAUTHORIZED_STATUS)
        return await handler(request)

    return authenticate


def bearer_headers(api_key: str | None) -> dict[str, str]:
    """Headers a client sends to engines and the router: the bearer token, or none without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def router_worker_body(url: str, api_key: str | None) -> dict[str, str]:
    """The router's ``POST /workers`` body for one worker. The router sends its own ``--api-key`` only to
    workers it was given at start; a worker added later gets the key it is added with (sglang-router
    0.3.2 warns "Adding worker ... without API key while router has API key configured" otherwise)."""
    return {"url": url, **({"api_key": api_key} if api_key else {})}


def api_key_from_env(environ: Mapping[str, str] = os.environ) -> str | None:
    """The job's engine key as the operator passes it to pods (unset or empty: engines run without one)."""
    return environ.get(ENGINE_API_KEY_ENV) or None
