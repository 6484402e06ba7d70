"""The SGLang HTTP contract as data: request bodies (pydantic) and pure encode/parse functions.

Shared by the SGLang-protocol server (encodes replies) and the SGLang client (parses replies from real
SGLang of several versions as well as from the project's server). No I/O here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rljob.runtime.engines.base import EngineLoad, FinishReason, GenerateResult


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
