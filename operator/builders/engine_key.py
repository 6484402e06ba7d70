"""The job's engine API key: its Secret, and how the engines, the router and the trainer receive it.

The key itself is random and made once per RLJob by reconcile (ensure_engine_key); the builders here
never see it: pods read it from the Secret into ``RLJOB_ENGINE_API_KEY``, and the servers take it as
``--api-key $(RLJOB_ENGINE_API_KEY)``, a reference the kubelet expands when it starts the container.
So the key is in no pod spec, and a reader of pods, Deployments or StatefulSets never learns it.
"""

from __future__ import annotations

import base64
import secrets
from typing import Any

from rljob.api.engine_auth import ENGINE_API_KEY_ENV, ENGINE_API_KEY_SECRET_KEY
from rljob.operator.builders.meta import ROLE_INFERENCE, JobRef, child_name, object_meta

# 32 random bytes, URL-safe: 256 bits, as long as SGLang's own generated keys.
KEY_BYTES = 32


def engine_key_secret_name(job: JobRef) -> str:
    """Name of the Secret holding the job's engine key."""
    return child_name(job, "engine-key")


def new_engine_key() -> str:
    """A fresh random key (never derived from anything a user could see), in hex: it reaches the engines'
    and the router's command lines as the value of `--api-key`, and a base64url key starting with "-"
    (1 in 64) reads there as an option, so the container exits on a usage error (clean-clone run 21)."""
    return secrets.token_hex(KEY_BYTES)


def engine_key_secret(job: JobRef, key: str) -> dict[str, Any]:
    """The Secret, owned by the RLJob (deleted with it), holding ``key``."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": object_meta(job, engine_key_secret_name(job), ROLE_INFERENCE),
        "type": "Opaque",
        "data": {ENGINE_API_KEY_SECRET_KEY: base64.b64encode(key.encode()).decode()},
    }


def engine_key_env(job: JobRef) -> dict[str, Any]:
    """The container env entry reading the key from the job's Secret."""
    return {
        "name": ENGINE_API_KEY_ENV,
        "valueFrom": {"secretKeyRef": {"name": engine_key_secret_name(job), "key": ENGINE_API_KEY_SECRET_KEY}},
    }


def engine_key_args() -> list[str]:
    """``--api-key`` for SGLang, the CPU server and the sglang router, as an env reference (no key in the spec)."""
    return ["--api-key", f"$({ENGINE_API_KEY_ENV})"]
