"""Contract tests against the released SGLang and sglang-router (no GPU, nothing of SGLang imported).

For every supported release (tests/helpers/releases.py: the default image's and the previous pin) the
requests the project really builds (runtime/engines/protocol.py, used by the client and the weight
transports) and the flags the operator really emits (operator/builders/inference.py, router.py) are
checked against that release's own source: routes, request dataclasses, sampling parameters,
ServerArgs flags, and the router's own argument parser. A drift on either side fails here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import typing
from typing import Any

import pytest

from rljob.api.spec import RLJobSpec, RouterSpec
from rljob.operator.builders.engine_key import engine_key_args
from rljob.operator.builders.inference import effective_pools, pool_container
from rljob.operator.builders.meta import JobRef
from rljob.operator.builders.router import router_args
from rljob.runtime.engines.base import GenerateRequest
from rljob.runtime.engines.protocol import (
    CLIENT_KEEPALIVE_EXPIRY_S,
    HEALTH,
    HEALTH_GENERATE,
    KEEP_ALIVE_S,
    MODEL_INFO,
    SERVER_INFO_KEYS,
    V1_LOADS,
    WEIGHT_VERSION_KEY,
    Call,
    WorkerApi,
    abort_call,
    attempt_rid,
    continue_generation_call,
    destroy_weights_update_group_call,
    detect_worker_api,
    generate_call,
    init_weights_update_group_call,
    pause_generation_call,
    update_weights_from_disk_call,
    update_weights_from_distributed_call,
)
from rljob.runtime.engines.sglang_client import SGLangClientConfig, SGLangEngine
from rljob.runtime.weight_group import FLATTENED_BUCKET, takes_flattened_buckets
from tests.helpers.releases import ROUTER_RELEASES, SGLANG_RELEASES, release_or_skip
from tests.helpers.sglang_source import SGLangSource

# Handlers that read no body in a release, and why the project may still call them (reference §13).
BODY_IGNORED = {
    ("0.5.5.post3", "/pause_generation"): "ignores the body: always aborts every request, then pauses",
    ("0.5.5.post3", "/continue_generation"): "takes no body",
}

REQUEST = GenerateRequest(rid="r3-g1-s2-a0", input_ids=[1, 2, 3], max_new_tokens=7, temperature=0.7, top_p=0.9,
                          top_k=20, stop_token_ids=[2], stop=["</answer>"])


@pytest.fixture(scope="module", params=SGLANG_RELEASES)
def release(request: pytest.FixtureRequest) -> tuple[str, SGLangSource]:
    version = str(request.param)
    return version, SGLangSource(release_or_skip("sglang", version))


def _api_of(source: SGLangSource) -> WorkerApi:
    """The API the client detects on a worker of this release: its probes answer 200 exactly where the
    release has the route."""
    def status(path: str) -> int:
        return 200 if path.split("?")[0] in source.routes else 404

    return detect_worker_api(status(MODEL_INFO), status(V1_LOADS))


def _worker_calls(api: WorkerApi) -> list[Call]:
    """Every request the runtime sends a worker, built by the same functions the client and the weight
    transports call."""
    return [
        generate_call(REQUEST, attempt_rid(REQUEST.rid, 0)),
        generate_call(GenerateRequest(rid="r0-g0-s0-a0", input_ids=[5], max_new_tokens=1), "r0-g0-s0-a0-h1"),
        abort_call("r3-g1-s2-a0"),
        abort_call(abort_all=True),
        update_weights_from_disk_call("/weights/v3", 3),
        init_weights_update_group_call("10.0.0.1", 29600, 1, 3, "rljob-weights-0", "nccl"),
        update_weights_from_distributed_call(["w"], ["bfloat16"], [[2, 2]], "rljob-weights-0", None),
        update_weights_from_distributed_call(["w"], ["bfloat16"], [[2, 2]], "rljob-weights-0", 3),
        destroy_weights_update_group_call("rljob-weights-0"),
        pause_generation_call(),
        continue_generation_call(),
        Call("GET", HEALTH),
        Call("GET", HEALTH_GENERATE),
        *api.calls(),
    ]


def test_every_route_the_client_calls_exists(release: tuple[str, SGLangSource]) -> None:
    version, source = release
    api = _api_of(source)
    missing = []
    for call in _worker_calls(api):
        route = source.routes.get(call.path.split("?")[0])
        if route is None or call.method not in route.methods:
            missing.append(f"{call.method} {call.path}")
    assert not missing, f"sglang {version} serves none of {missing}"


def test_the_detected_api_follows_the_release() -> None:
    """The two supported releases differ exactly where the client must switch endpoints."""
    apis = {v: _api_of(SGLangSource(release_or_skip("sglang", v))) for v in SGLANG_RELEASES}
    assert apis["0.5.5.post3"].weight_version_path == "/get_weight_version"
    assert apis["0.5.5.post3"].load_path == "/get_load"
    assert apis["0.5.23"].weight_version_path == "/model_info"  # /get_weight_version is gone
    assert apis["0.5.23"].load_path == V1_LOADS


def test_every_body_field_exists(release: tuple[str, SGLangSource]) -> None:
    version, source = release
    problems = []
    for call in _worker_calls(_api_of(source)):
        if call.body is None:
            continue
        cls = source.body_class(call.path)
        if cls is None:
            if (version, call.path) not in BODY_IGNORED:
                problems.append(f"{call.path}: the handler reads no body, yet the project sends {sorted(call.body)}")
            continue
        unknown = set(call.body) - source.class_fields(cls)
        if unknown:
            problems.append(f"{call.path}: {sorted(unknown)} are not fields of {cls}")
    assert not problems, f"sglang {version}: " + "; ".join(problems)


def test_a_flattened_bucket_goes_only_to_releases_that_receive_one(release: tuple[str, SGLangSource]) -> None:
    """``load_format`` is sent only to releases whose request has the field and whose receiver reads
    ``flattened_bucket`` as one broadcast (weight_group.py); an older one would drop the field and wait
    for per-tensor broadcasts that never come."""
    version, source = release
    call = update_weights_from_distributed_call(["w"], ["bfloat16"], [[2, 2]], "g", 3, load_format=FLATTENED_BUCKET)
    cls = source.body_class(call.path)
    assert cls is not None
    takes = "load_format" in source.class_fields(cls) and any(
        f'load_format == "{FLATTENED_BUCKET}"' in path.read_text() and "def receive_weights_from_distributed" in path.read_text()
        for path in (source.root / "srt/model_executor").rglob("*.py"))
    assert takes_flattened_buckets(version) is takes, f"sglang {version}"


def test_every_sampling_parameter_exists(release: tuple[str, SGLangSource]) -> None:
    version, source = release
    sent = generate_call(REQUEST, REQUEST.rid).body
    assert sent is not None
    unknown = set(sent["sampling_params"]) - source.sampling_params
    assert not unknown, f"sglang {version}'s SamplingParams has no {sorted(unknown)}"
    # The router path drops it (sglang-router 0.3.2), so the direct path must not depend on it either.
    assert "spaces_between_special_tokens" not in sent["sampling_params"]


def test_the_version_and_server_info_keys_the_client_reads_exist(release: tuple[str, SGLangSource]) -> None:
    version, source = release
    api = _api_of(source)
    assert WEIGHT_VERSION_KEY in source.reply_keys(api.weight_version_path), f"sglang {version}"
    info_keys = source.reply_keys(api.server_info_path) | source.server_args_fields
    assert not set(SERVER_INFO_KEYS) - info_keys, f"sglang {version}'s server info lacks {set(SERVER_INFO_KEYS) - info_keys}"


def _gpu_spec() -> RLJobSpec:
    return RLJobSpec.model_validate({
        "model": {"huggingFace": "Qwen/Qwen3-4B", "revision": "main"},
        "data": {"synthetic": {}},
        "rollout": {"engine": "sglang", "pools": [
            {"name": "nv", "vendor": "nvidia", "replicas": 1, "tensorParallelSize": 2, "gpusPerReplica": 2},
            {"name": "mi", "vendor": "amd", "replicas": 1},
        ]},
    })


def test_every_server_flag_and_env_the_operator_emits_exists(release: tuple[str, SGLangSource]) -> None:
    version, source = release
    spec = _gpu_spec()
    environ = (source.root / "srt" / "environ.py").read_text()
    for pool in effective_pools(spec.rollout):
        container = pool_container(JobRef("j", "ns", "uid"), spec, pool)
        flags = {a.split("=")[0] for a in container["args"] if a.startswith("--")}
        assert not flags - source.server_flags, (
            f"pool {pool.name}: sglang {version}'s launch_server has no option {sorted(flags - source.server_flags)} "
            "(argparse would expand a prefix or exit)")
        sglang_env = {e["name"] for e in container["env"] if e["name"].startswith("SGLANG_")}
        assert all(f'"{name}"' in environ or f"{name} " in environ for name in sglang_env), (
            f"pool {pool.name}: sglang {version} reads none of {sorted(sglang_env)}")


def release_keep_alive(version: str, source: SGLangSource) -> set[int]:
    """The seconds the release's uvicorn keeps an idle connection open (timeout_keep_alive)."""
    server = (source.root / "srt" / "entrypoints" / "http_server.py").read_text()
    passed = set(re.findall(r"timeout_keep_alive[\"']?\s*[=:]\s*([\w.()]+)", server))
    assert passed, f"sglang {version}: http_server.py passes no timeout_keep_alive"
    seconds = set()
    for value in passed:
        if value.isdigit():
            seconds.add(int(value))
        else:  # envs.SGLANG_TIMEOUT_KEEP_ALIVE.get(): the default srt/environ.py gives it
            name = value.split(".")[1]
            environ = (source.root / "srt" / "environ.py").read_text()
            found = re.search(rf"^\s*{name}\s*=\s*EnvInt\((\d+)\)", environ, re.M)
            assert found is not None, f"sglang {version}: no EnvInt default for {name}"
            seconds.add(int(found.group(1)))
    return seconds


def test_the_cpu_server_closes_idle_connections_when_the_release_does(release: tuple[str, SGLangSource]) -> None:
    """A client's pooled connection (the router's) must age as against SGLang: its uvicorn's keep-alive."""
    version, source = release
    seconds = release_keep_alive(version, source)
    assert seconds == {KEEP_ALIVE_S}, f"sglang {version} keeps idle connections {seconds} s, the CPU server {KEEP_ALIVE_S} s"


async def test_the_client_forgets_a_pooled_connection_before_the_release_closes_it(
        release: tuple[str, SGLangSource]) -> None:
    """With equal limits the client sends on a connection the server is closing ("connection lost"):
    its pool must drop idle connections well before the release's keep-alive ends."""
    version, source = release
    seconds = min(release_keep_alive(version, source))
    assert CLIENT_KEEPALIVE_EXPIRY_S <= seconds / 2, (
        f"the client keeps idle connections {CLIENT_KEEPALIVE_EXPIRY_S} s, sglang {version} closes them at {seconds} s")
    engine = SGLangEngine(SGLangClientConfig(worker_urls=["http://127.0.0.1:9"]))
    try:  # the engine's own pool uses it (aiohttp's connector holds the keep-alive)
        connector = engine._caller._pool().connector
        assert connector is not None and connector._keepalive_timeout == CLIENT_KEEPALIVE_EXPIRY_S  # type: ignore[attr-defined]
    finally:
        await engine.close()


def _typed_api(source: SGLangSource) -> Any:
    """0.5.23's ``sglang/api/v1/api_types.py`` (msgspec only), loaded by path without the sglang package."""
    path = source.root / "api" / "v1" / "api_types.py"
    if not path.exists():
        pytest.skip("this release has no typed API (sglang/api/v1/api_types.py)")
    pytest.importorskip("msgspec")
    spec = importlib.util.spec_from_file_location(f"sglang_api_types_{id(source)}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generate_body_passes_the_typed_api(release: tuple[str, SGLangSource]) -> None:
    """0.5.23's own schema of /generate (unknown sampling keys rejected) accepts the client's body."""
    _, source = release
    types = _typed_api(source)
    body = generate_call(REQUEST, REQUEST.rid).body
    parsed = types.GenerateRequest.from_json_value(body)
    assert parsed.rid == REQUEST.rid and list(parsed.input_ids) == REQUEST.input_ids
    sampling = parsed.sampling_params
    assert (sampling.max_new_tokens, sampling.no_stop_trim, sampling.skip_special_tokens) == (7, True, False)
    with pytest.raises(types.JsonContractError):  # the check can fail: an unknown key is refused
        types.GenerateRequest.from_json_value({**body, "sampling_params": {**body["sampling_params"], "bogus": 1}})


# ----------------------------------------------------------------------------- the router


def _parse_router(version: str, arg_lists: list[list[str]]) -> list[dict[str, Any] | None]:
    """The released router's own ``parse_router_args`` on each of ``arg_lists`` (None: it exits, as the
    router process would), in one child process whose ``sglang_router`` is the downloaded release, not
    whatever the environment has installed."""
    root = release_or_skip("sglang-router", version)
    code = ("import contextlib, dataclasses, io, json, sys\n"
            "import sglang_router\n"
            "from sglang_router.launch_router import parse_router_args\n"
            "assert sglang_router.__file__.startswith(sys.argv[1]), sglang_router.__file__\n"
            "out = []\n"
            "for args in json.loads(sys.argv[2]):\n"
            "    try:\n"
            "        with contextlib.redirect_stderr(io.StringIO()):\n"
            "            out.append(dataclasses.asdict(parse_router_args(args)))\n"
            "    except SystemExit:\n"
            "        out.append(None)\n"
            "print(json.dumps(out, default=str))\n")
    proc = subprocess.run([sys.executable, "-c", code, str(root), json.dumps(arg_lists)], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(root)}, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return list(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("version", ROUTER_RELEASES)
def test_the_router_accepts_the_operators_flags_as_an_rl_job_needs_them(version: str) -> None:
    spec = RLJobSpec.model_validate({"model": {"huggingFace": "x/y"}, "data": {"synthetic": {}},
                                     "rollout": {"sglang": {"requestTimeoutSeconds": 1200}}})
    args = [*router_args(spec), *engine_key_args()]  # as router_deployment passes them
    [parsed] = _parse_router(version, [args])
    assert parsed is not None, f"sglang-router {version} refuses {args}"
    # The key reaches the router as the env reference the kubelet expands (no key in the pod spec).
    assert parsed["api_key"] == "$(RLJOB_ENGINE_API_KEY)"
    # The runtime owns membership: no health checks, no circuit breaker, no same-rid retries ...
    assert parsed["disable_health_check"] and parsed["disable_circuit_breaker"] and parsed["disable_retries"]
    # ... it starts empty, and it never cuts a /generate the runtime still waits for.
    assert parsed["worker_urls"] == [] and not parsed["service_discovery"]
    assert parsed["request_timeout_secs"] > 1200
    assert parsed["worker_startup_timeout_secs"] == spec.rollout.startup_budget_seconds


@pytest.mark.parametrize("version", ROUTER_RELEASES)
def test_every_policy_the_spec_allows_is_a_router_choice(version: str) -> None:
    policies = typing.get_args(RouterSpec.model_fields["policy"].annotation)
    specs = [RLJobSpec.model_validate({"model": {"huggingFace": "x/y"}, "data": {"synthetic": {}},
                                       "rollout": {"router": {"policy": p}}}) for p in policies]
    # The last one checks that the check can fail: a policy the router does not know makes it exit.
    *parsed, unknown = _parse_router(version, [router_args(s) for s in specs] + [["--policy", "consistent_hashing"]])
    assert [p["policy"] if p else None for p in parsed] == list(policies)
    assert unknown is None
