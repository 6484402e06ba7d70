"""Pure building and parsing of SGLang requests and replies of several versions (no I/O)."""

from __future__ import annotations

import pytest

from rljob.runtime.engines.base import EngineLoad
from rljob.runtime.engines.protocol import parse_generate_reply, parse_load, update_weights_from_distributed_call


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        ({"num_running_reqs": 2, "num_waiting_reqs": 1}, EngineLoad(2, 1)),
        ([{"num_running_reqs": 1, "num_waiting_reqs": 0}, {"num_running_reqs": 3, "num_waiting_reqs": 2}], EngineLoad(4, 2)),
        # Per-rank list wins over the aggregate (which would double count).
        ({"loads": [{"num_running_reqs": 1, "num_waiting_reqs": 1}], "aggregate": {"num_running_reqs": 1,
          "num_waiting_reqs": 1}}, EngineLoad(1, 1)),
        # Old /get_load: num_reqs is the total, waiting included.
        ([{"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 1, "num_tokens": 10}], EngineLoad(4, 1)),
        ({"num_total_reqs": 3}, EngineLoad(3, 0)),
        ({"aggregate": {"num_running_reqs": 0, "num_waiting_reqs": 4}}, EngineLoad(0, 4)),
    ],
)
def test_parse_load_accepts_every_known_shape(payload: object, expected: EngineLoad) -> None:
    assert parse_load(payload) == expected


def test_parse_load_rejects_replies_without_counts() -> None:
    with pytest.raises(ValueError, match="no request counts"):
        parse_load({"timestamp": 1.0})


def test_parse_generate_reply_prefers_output_ids_and_reads_logprob_triples() -> None:
    reply = {"output_ids": [7, 8], "meta_info": {"id": "r", "finish_reason": {"type": "stop", "matched": 8},
             "output_token_logprobs": [[-0.5, 7, None], [-0.25, 8, None]], "completion_tokens": 2,
             "prompt_tokens": 3, "weight_version": "12"}}
    res = parse_generate_reply(reply, "r", submitted_version=11)
    assert (res.output_ids, res.output_logprobs, res.finish_reason) == ([7, 8], [-0.5, -0.25], "stop")
    assert (res.weight_version, res.prompt_tokens) == (12, 3)


def test_parse_generate_reply_tolerates_old_abort_replies() -> None:
    # Abort before prefill on old servers: no ids, no log-probs, no weight_version.
    reply = {"text": "", "meta_info": {"id": "r", "finish_reason": {"type": "abort", "message": "Abort before prefill"}}}
    res = parse_generate_reply(reply, "r", submitted_version=4)
    assert (res.output_ids, res.output_logprobs, res.finish_reason, res.weight_version) == ([], [], "abort", 4)
    # Ids only inside the triples (servers without output_ids); a non-integer version falls back too.
    reply = {"meta_info": {"finish_reason": {"type": "length", "length": 1},
             "output_token_logprobs": [[-1.0, 3, None]], "weight_version": "default"}}
    res = parse_generate_reply(reply, "r", submitted_version=4)
    assert (res.output_ids, res.weight_version, res.rid) == ([3], 4, "r")


def test_parse_generate_reply_rejects_inconsistent_counts() -> None:
    reply = {"output_ids": [1, 2], "meta_info": {"finish_reason": {"type": "length"},
             "output_token_logprobs": [[-1.0, 1, None]]}}
    with pytest.raises(ValueError, match="2 output ids but 1 log-probs"):
        parse_generate_reply(reply, "r", None)


def test_only_the_last_bucket_flushes_and_only_when_the_job_lets_it() -> None:
    """SGLang flushes its radix cache on an update with ``flush_cache`` true: the last bucket (the one that
    stamps the version) asks for it, unless ``weightTransport.flushCache`` is false (interrupted samples
    then resume from the cache)."""
    def flush(version: int | None, flush_cache: bool = True) -> object:
        call = update_weights_from_distributed_call(["w"], ["bfloat16"], [[2]], "g", version, flush_cache)
        return (call.body or {})["flush_cache"]

    assert (flush(None), flush(3)) == (False, True)
    assert (flush(None, False), flush(3, False)) == (False, False)
