"""The SGLang HTTP contract as data: request bodies (pydantic), the calls the client makes, and pure
encode/parse functions.

Shared by the SGLang-protocol server (parses requests, encodes replies) and the SGLang client (builds
every request it sends here, and parses replies from real SGLang of several versions as well as from the
project's server). The contract tests (tests/unit/test_sglang_contract.py) check every call built here
against the released SGLang and sglang-router source, so a request that a supported release would refuse
or ignore fails a test. No I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rljob.runtime.engines.base import EngineLoad, FinishReason, GenerateRequest, GenerateResult
from rljob.runtime.engines.capacity import running_capacity


class SamplingParamsBody(BaseModel):
    """``sampling_params`` of ``/generate``; fields the CPU server does not implement are accepted and ignored."""

    model_config = ConfigDict(extra="allow")

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = -1
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    n: int = Field(default=1, ge=1)  # parallel samples of each input (the server expands them; the client sends 1 each)


class GenerateBody(BaseModel):
    """``POST /generate`` body (single or batched input)."""

    model_config = ConfigDict(extra="allow")

    input_ids: list[int] | list[list[int]] | None = None
    text: str | list[str] | None = None
    sampling_params: SamplingParamsBody | list[SamplingParamsBody] = Field(default_factory=SamplingParamsBody)
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    return_text_in_logprobs: bool = False
    stream: bool = False


class AbortBody(BaseModel):
    """``POST /abort_request`` body: prefix ``rid`` ("" = every request) or ``abort_all``."""

    model_config = ConfigDict(extra="allow")

    rid: str | list[str] = ""
    abort_all: bool = False


class UpdateWeightsFromDiskBody(BaseModel):
    """``POST /update_weights_from_disk`` body."""

    model_config = ConfigDict(extra="allow")

    model_path: str
    load_format: str | None = None
    weight_version: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False


class InitWeightsUpdateGroupBody(BaseModel):
    """``POST /init_weights_update_group`` body: join the trainer's weight-update group."""

    model_config = ConfigDict(extra="allow")

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class UpdateWeightsFromDistributedBody(BaseModel):
    """``POST /update_weights_from_distributed`` body: the tensors that follow in broadcasts from rank 0."""

    model_config = ConfigDict(extra="allow")

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None  # 0.5.23: "flattened_bucket" (one broadcast per bucket); 0.5.5.post3 has no such field


class DestroyWeightsUpdateGroupBody(BaseModel):
    """``POST /destroy_weights_update_group`` body."""

    model_config = ConfigDict(extra="allow")

    group_name: str = "weight_update_group"


class UpdateWeightVersionBody(BaseModel):
    """``POST /update_weight_version`` body; like SGLang, aborts everything unless told not to."""

    model_config = ConfigDict(extra="allow")

    new_version: str
    abort_all_requests: bool = True


class PauseBody(BaseModel):
    """``POST /pause_generation`` body (newer SGLang); ``abort`` ends every request before pausing."""

    model_config = ConfigDict(extra="allow")

    mode: Literal["abort", "retract", "in_place"] = "abort"


# ----------------------------------------------------------------------------- client-side requests

# SGLang's uvicorn closes a connection idle for 5 s (srt/environ.py: SGLANG_TIMEOUT_KEEP_ALIVE = EnvInt(5);
# entrypoints/http_server.py passes it as timeout_keep_alive). The CPU server does the same.
KEEP_ALIVE_S = 5.0
# The client forgets a pooled connection after half that. With equal limits it sends on a connection the
# server is closing at that very moment and reads "connection lost": 3 of 60 requests made about 5 s
# apart did against aiohttp's server (a generate is retried; a weight-sync call is not, and its failure
# costs a rebuild of the weight-update group).
CLIENT_KEEPALIVE_EXPIRY_S = KEEP_ALIVE_S / 2

# Worker endpoints every supported release serves the same way.
HEALTH = "/health"  # liveness (a 1-token generation unless SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false)
HEALTH_GENERATE = "/health_generate"  # start-up: 503 until the model is loaded
WEIGHT_VERSION_KEY = "weight_version"  # in the reply of WorkerApi.weight_version_path
SERVER_INFO_KEYS = ("version", "tp_size", "dp_size")  # read from WorkerApi.server_info_path


@dataclass(frozen=True)
class Call:
    """One HTTP request the client sends: method, path (with query) and JSON body (None: no body)."""

    method: str
    path: str
    body: dict[str, Any] | None = None


def _wire(body: BaseModel) -> dict[str, Any]:
    """A request body as sent: only the fields the caller set (so SGLang's own defaults apply to the rest)."""
    return body.model_dump(mode="json", exclude_unset=True, exclude_none=True)


def attempt_rid(rid: str, attempt: int) -> str:
    """The rid of HTTP attempt ``attempt`` (0-based) of one request.

    SGLang 0.5.23 answers a rid it has already seen with 400 "Duplicate request ID detected", and
    0.5.5.post3 runs both copies: a retry after a lost connection must never reuse the rid of an attempt
    the server may have received. The scheduler's rids are already unique per sample attempt
    (``r{round}-g{group}-s{sample}-a{attempt}``), so a suffixed rid never equals another request's.
    """
    return rid if attempt == 0 else f"{rid}-h{attempt}"


def generate_call(request: GenerateRequest, rid: str) -> Call:
    """``POST /generate`` of one request, token in, token out.

    The same body goes to the router and to a worker directly. ``spaces_between_special_tokens`` is
    never sent: sglang-router 0.3.2 re-encodes the sampling parameters through its own type, which drops
    it, so sending it directly would make the two paths detokenize differently. The runtime reads token
    ids, never the text, so SGLang's default (true) changes nothing it uses.
    """
    sampling = SamplingParamsBody(
        max_new_tokens=request.max_new_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        stop_token_ids=request.stop_token_ids,
        skip_special_tokens=False,  # text keeps special tokens, so it matches the ids
        no_stop_trim=True,  # the stop token stays in output_ids
        stop=request.stop or None,  # an empty list is not sent (_wire leaves None out)
    )
    return Call("POST", "/generate", _wire(GenerateBody(input_ids=request.input_ids, sampling_params=sampling,
                                                        return_logprob=True, rid=rid)))


def abort_call(rid: str = "", abort_all: bool = False) -> Call:
    """``POST /abort_request``: an exact rid (SGLang ignores prefixes), or everything with ``abort_all``.

    ``rid`` is always sent, also with ``abort_all``: old servers answer 422 without it."""
    return Call("POST", "/abort_request", _wire(AbortBody(rid=rid, abort_all=abort_all)))


def update_weights_from_disk_call(path: str, version: int) -> Call:
    """``POST /update_weights_from_disk`` of a checkpoint folder, stamping ``version`` on success.

    ``abort_all_requests`` is false: in-flight requests finish on the old weights (their replies carry
    the version they were served at). ``flush_cache`` is not a field in 0.5.5.post3 (it always flushes),
    so it is left to the release's default."""
    return Call("POST", "/update_weights_from_disk",
                _wire(UpdateWeightsFromDiskBody(model_path=path, weight_version=str(version), abort_all_requests=False)))


def init_weights_update_group_call(
    master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
) -> Call:
    """``POST /init_weights_update_group``: join the trainer's weight-update group (docs/weight_sync.md)."""
    return Call("POST", "/init_weights_update_group", _wire(InitWeightsUpdateGroupBody(
        master_address=master_address, master_port=master_port, rank_offset=rank_offset, world_size=world_size,
        group_name=group_name, backend=backend)))


def update_weights_from_distributed_call(
    names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str, version: int | None,
    flush_cache: bool = True, load_format: str | None = None,
) -> Call:
    """``POST /update_weights_from_distributed`` of one bucket; ``version`` on the last bucket only (it
    stamps the version and, unless ``flush_cache`` is False, flushes the cache). ``load_format``
    (``flattened_bucket``: weight_group.py) is sent only when given: a release without the
    field would ignore it and wait for the per-tensor broadcasts."""
    last = version is not None
    return Call("POST", "/update_weights_from_distributed", _wire(UpdateWeightsFromDistributedBody(
        names=names, dtypes=dtypes, shapes=shapes, group_name=group_name, flush_cache=last and flush_cache,
        abort_all_requests=False,
        weight_version=str(version) if last else None, load_format=load_format)))


def destroy_weights_update_group_call(group_name: str) -> Call:
    """``POST /destroy_weights_update_group``."""
    return Call("POST", "/destroy_weights_update_group", _wire(DestroyWeightsUpdateGroupBody(group_name=group_name)))


def pause_generation_call() -> Call:
    """``POST /pause_generation`` in place (KV cache kept). 0.5.5.post3 ignores the body and aborts every
    request instead (their partial output comes back as aborted replies and is resumed)."""
    return Call("POST", "/pause_generation", _wire(PauseBody(mode="in_place")))


def continue_generation_call() -> Call:
    """``POST /continue_generation``."""
    return Call("POST", "/continue_generation", {})


@dataclass(frozen=True)
class WorkerApi:
    """The endpoints of one worker's SGLang release, detected once per worker (detect_worker_api) and
    used for every later probe: 0.5.23 removed ``/get_weight_version`` (``/model_info`` carries the
    version) and ``/get_load`` (``/v1/loads``); 0.5.5.post3 has no ``/model_info`` and no ``/v1/loads``."""

    release: str | None  # SGLang's version string from server info; None when the server does not say
    weight_version_path: str
    server_info_path: str
    load_path: str
    tp_size: int = 1
    dp_size: int = 1
    capacity: int | None = None  # requests it runs at once (capacity.running_capacity); None: not told

    def calls(self) -> list[Call]:
        """Every GET this API makes (the contract tests check each against the release)."""
        return [Call("GET", p) for p in (self.weight_version_path, self.server_info_path, self.load_path)]


    def with_server_info(self, info: dict[str, Any]) -> WorkerApi:
        """This API with the release, parallel sizes and capacity a worker's server info reports."""
        release = info.get("version")
        return replace(self, release=str(release) if release is not None else None,
                       tp_size=int(info.get("tp_size") or 1), dp_size=int(info.get("dp_size") or 1),
                       capacity=running_capacity(info))


MODEL_INFO = "/model_info"  # detection probe: served by releases that deprecated /get_model_info
V1_LOADS = "/v1/loads?include=core"  # detection probe: served by releases newer than 0.5.5.post3


def detect_worker_api(model_info_status: int, loads_status: int) -> WorkerApi:
    """Which endpoints a worker has, from the HTTP status of its ``GET /model_info`` and ``GET /v1/loads``
    probes; the release and sizes come later from its server info (WorkerApi.with_server_info)."""
    current = model_info_status == 200
    return WorkerApi(
        release=None,
        weight_version_path=MODEL_INFO if current else "/get_weight_version",
        server_info_path="/server_info" if current else "/get_server_info",
        load_path=V1_LOADS if loads_status == 200 else "/get_load",
    )


def finish_reason_json(result: GenerateResult, max_new_tokens: int, message: str | None = None) -> dict[str, Any]:
    """SGLang's ``meta_info.finish_reason`` for a finished request."""
    if result.finish_reason == "stop":
        return {"type": "stop", "matched": result.output_ids[-1] if result.output_ids else None}
    if result.finish_reason == "length":
        return {"type": "length", "length": max_new_tokens}
    # SGLang's FINISH_ABORT: "Aborted" unless the abort carried a message.
    return {"type": "abort", "message": message or "Aborted", "status_code": None, "err_type": None}


# ----------------------------------------------------------------------------- client-side parsing


def _finish_type(meta: dict[str, Any]) -> FinishReason:
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind in ("stop", "length", "abort"):
        return kind  # type: ignore[return-value]
    raise ValueError(f"unexpected finish_reason {reason!r}")


def parse_generate_reply(
    reply: dict[str, Any], rid: str, submitted_version: int | None
) -> GenerateResult:
    """Turn one ``/generate`` reply into a GenerateResult, tolerating every SGLang version's gaps.

    New tokens come from ``output_ids``, else from the ids in ``output_token_logprobs``; a reply without
    either (abort before prefill on old servers) has no new tokens. A missing or non-integer
    ``weight_version`` falls back to ``submitted_version``. Raises ValueError on an inconsistent reply.
    """
    meta = reply.get("meta_info") or {}
    triples = meta.get("output_token_logprobs") or []
    ids = reply.get("output_ids")
    if ids is None:
        ids = [int(t[1]) for t in triples]
    logprobs = [float(t[0]) for t in triples]
    if triples and len(triples) != len(ids):
        raise ValueError(f"reply for {rid!r} has {len(ids)} output ids but {len(triples)} log-probs")
    completion = meta.get("completion_tokens")
    if completion is not None and ids and int(completion) != len(ids):
        raise ValueError(f"reply for {rid!r} has {len(ids)} output ids but completion_tokens={completion}")
    version: int | None = submitted_version
    raw_version = meta.get("weight_version")
    if raw_version is not None:
        try:
            version = int(raw_version)
        except (TypeError, ValueError):
            pass
    return GenerateResult(
        rid=str(meta.get("id") or rid),
        output_ids=[int(i) for i in ids],
        output_logprobs=logprobs,
        finish_reason=_finish_type(meta),
        weight_version=version,
        prompt_tokens=int(meta.get("prompt_tokens") or 0),
        cached_tokens=int(meta.get("cached_tokens") or 0),
    )


def _load_of_record(record: dict[str, Any]) -> EngineLoad | None:
    """Load of one flat record, or None when it has no request counts."""
    waiting = int(record.get("num_waiting_reqs") or 0)
    if "num_running_reqs" in record:
        return EngineLoad(running=int(record["num_running_reqs"] or 0), waiting=waiting)
    for key in ("num_total_reqs", "num_reqs"):
        if key in record:
            # Older shapes count every request in the total; waiting ones are a part of it.
            total = int(record[key] or 0)
            return EngineLoad(running=max(0, total - waiting), waiting=min(waiting, total))
    return EngineLoad(running=0, waiting=waiting) if "num_waiting_reqs" in record else None


def parse_load(payload: Any) -> EngineLoad:
    """Sum request counts out of a ``/v1/loads`` or ``/get_load`` reply of any known shape.

    Shapes seen across versions: a flat record; a list of per-data-parallel-rank records; a dict with a
    ``loads`` list (plus an ``aggregate`` that would double count, so per-rank lists win); records using
    ``num_reqs``/``num_total_reqs`` instead of running/waiting. Raises ValueError when no counts are found.
    """
    if isinstance(payload, list):
        parts = [parse_load(item) for item in payload]
        return EngineLoad(running=sum(p.running for p in parts), waiting=sum(p.waiting for p in parts))
    if isinstance(payload, dict):
        for key in ("loads", "dp_loads", "internal_states"):
            if isinstance(payload.get(key), list) and payload[key]:
                return parse_load(payload[key])
        flat = _load_of_record(payload)
        if flat is not None:
            return flat
        for key in ("aggregate", "core", "load"):
            if isinstance(payload.get(key), (dict, list)):
                return parse_load(payload[key])
    raise ValueError(f"no request counts in load reply {str(payload)[:200]!r}")


def error_message(payload: Any, fallback: str) -> str:
    """The message of an SGLang error reply.

    SGLang answers errors OpenAI-style, ``{"object": "error", "message": ..., "code": 400}``; the router
    and older servers nest it as ``{"error": {"message": ...}}`` or send a bare string. ``fallback`` (the
    raw body) is used when none of these shapes matches.
    """
    if isinstance(payload, dict):
        if isinstance(payload.get("message"), str):
            return payload["message"]
        nested = payload.get("error")
        if isinstance(nested, dict) and isinstance(nested.get("message"), str):
            return nested["message"]
        if isinstance(nested, str):
            return nested
        if isinstance(payload.get("detail"), str):  # FastAPI's own validation errors
            return payload["detail"]
    if isinstance(payload, str) and payload:
        return payload
    return fallback
