"""The per-job engine API key: SGLang's rule as runtime/engines/auth.py applies it, the client's header
and router body, how the operator's children receive the key (never in clear), and the ownership
check that keeps the operator from adopting an object it does not control."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from rljob.api.engine_auth import ENGINE_API_KEY_ENV, ENGINE_API_KEY_SECRET_KEY
from rljob.api.spec import RLJobSpec
from rljob.common.kube import NotOwned, check_controlled_by
from rljob.operator.builders import JobRef, build_children
from rljob.operator.builders.engine_key import engine_key_secret, engine_key_secret_name, new_engine_key
from rljob.operator.builders.meta import owner_reference
from rljob.runtime.engines.auth import api_key_from_env, bearer_headers, request_allowed, router_worker_body

JOB = JobRef(name="demo", namespace="team-a", uid="uid-1")
KEY = "s3cr3t"


@pytest.mark.parametrize(("method", "path", "header", "allowed"), [
    ("POST", "/update_weights_from_disk", None, False),
    ("POST", "/update_weights_from_disk", "Bearer s3cr3t", True),
    ("POST", "/update_weights_from_disk", "bearer s3cr3t", True),  # the scheme is case-insensitive (0.5.23)
    ("POST", "/init_weights_update_group", "Bearer wrong", False),
    ("POST", "/abort_request", "s3cr3t", False),  # no scheme
    ("POST", "/abort_request", "Basic s3cr3t", False),
    ("POST", "/generate", "Bearer s3cr3t ", False),  # the token must match exactly
    ("GET", "/health", None, True),
    ("GET", "/health_generate", None, True),
    ("GET", "/ready", None, True),
    ("GET", "/metrics", None, True),
    ("OPTIONS", "/generate", None, True),
    ("GET", "/get_server_info", None, False),
])
def test_sglang_key_rule(method: str, path: str, header: str | None, allowed: bool) -> None:
    assert request_allowed(method, path, header, KEY) is allowed


def test_without_a_key_everything_is_open_and_the_client_sends_nothing() -> None:
    assert request_allowed("POST", "/update_weights_from_disk", None, None)
    assert bearer_headers(None) == {} and bearer_headers(KEY) == {"Authorization": f"Bearer {KEY}"}
    assert router_worker_body("http://w:30000", None) == {"url": "http://w:30000"}
    assert router_worker_body("http://w:30000", KEY) == {"url": "http://w:30000", "api_key": KEY}
    assert api_key_from_env({ENGINE_API_KEY_ENV: KEY}) == KEY
    assert api_key_from_env({ENGINE_API_KEY_ENV: ""}) is None and api_key_from_env({}) is None


def test_keys_are_random_and_long() -> None:
    keys = {new_engine_key() for _ in range(500)}
    assert len(keys) == 500 and all(len(k) == 64 for k in keys)  # 32 random bytes, hex
    # Never an option to an argument parser: base64url keys began with "-" one time in 64, and the
    # engine and the router then exited on `--api-key` with no value (run 21).
    assert all(set(k) <= set("0123456789abcdef") for k in keys)


def test_the_secret_is_owned_by_the_job_and_holds_the_key() -> None:
    secret = engine_key_secret(JOB, KEY)
    assert secret["metadata"]["name"] == engine_key_secret_name(JOB)
    assert secret["metadata"]["ownerReferences"] == [owner_reference(JOB)]
    assert base64.b64decode(secret["data"][ENGINE_API_KEY_SECRET_KEY]).decode() == KEY


def _cpu_spec() -> RLJobSpec:
    return RLJobSpec.model_validate({
        "model": {"huggingFace": "x/y"}, "data": {"synthetic": {}},
        "rollout": {"pools": [{"name": "nv", "vendor": "nvidia"}, {"name": "c", "vendor": "cpu"}]},
    })


def _pod_specs(children: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["metadata"]["name"]: c["spec"]["template"]["spec"] for c in children
            if c["kind"] in ("StatefulSet", "Deployment", "Job")}


def test_every_engine_caller_and_server_reads_the_key_from_the_secret_and_no_spec_holds_it() -> None:
    children = build_children(JOB, _cpu_spec(), active=True)
    wanted = {"name": ENGINE_API_KEY_ENV, "valueFrom": {"secretKeyRef": {
        "name": engine_key_secret_name(JOB), "key": ENGINE_API_KEY_SECRET_KEY}}}
    pods = _pod_specs(children)
    assert set(pods) == {"demo-infer-nv", "demo-infer-c", "demo-router", "demo-trainer"}
    for name, pod in pods.items():
        [container] = pod["containers"]
        assert wanted in container["env"], name
        if name != "demo-trainer":  # servers: SGLang's flag, from the env reference the kubelet expands
            args = container["args"]
            assert args[args.index("--api-key") + 1] == f"$({ENGINE_API_KEY_ENV})", name
            # Neither SGLang nor the router needs the Kubernetes API: no token to steal from them.
            assert pod["automountServiceAccountToken"] is False, name
    # The key itself is made at reconcile time, never by the builders: no child carries a Secret.
    assert not [c for c in children if c["kind"] == "Secret"]
    assert KEY not in json.dumps(children)


def _owned_by(uid: str | None) -> dict[str, Any]:
    refs = [] if uid is None else [{"apiVersion": "rljob.io/v1alpha1", "kind": "RLJob", "name": "demo", "uid": uid,
                                    "controller": True}]
    return {"kind": "ConfigMap", "metadata": {"name": "demo-config", "ownerReferences": refs}}


def test_only_objects_this_job_controls_are_applied_over() -> None:
    check_controlled_by(None, "uid-1")  # absent: created
    check_controlled_by(_owned_by("uid-1"), "uid-1")
    for foreign in (_owned_by(None), _owned_by("uid-other")):
        with pytest.raises(NotOwned) as caught:
            check_controlled_by(foreign, "uid-1")
        assert caught.value.status == 409 and "ConfigMap demo-config" in str(caught.value)
    # An owner reference that is not the controller does not make the object ours.
    shared = _owned_by("uid-1")
    shared["metadata"]["ownerReferences"][0]["controller"] = False
    with pytest.raises(NotOwned):
        check_controlled_by(shared, "uid-1")
