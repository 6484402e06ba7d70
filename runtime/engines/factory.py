"""Build the engines a job's rollout spec asks for."""

from __future__ import annotations

import copy
from collections.abc import Callable

from transformers import PreTrainedModel

from rljob.api.spec import RolloutSpec
from rljob.runtime.engines.base import Engine


def build_engines(
    spec: RolloutSpec, model: PreTrainedModel, seed: int = 0, detokenize: Callable[[list[int]], str] | None = None,
    chunked_prefill_tokens: int = 0,
) -> list[Engine]:
    """Embedded engines get their own copy of the policy (a weight sync must really copy weights);
    `sglang` gives one client for the router and workers of the spec. `detokenize` lets embedded
    engines honour stop strings; `chunked_prefill_tokens` is their chunked prefill budget (0: off)."""
    if spec.engine == "embedded":
        from rljob.runtime.engines.embedded import EmbeddedEngine

        from rljob.runtime.models.loading import torch_dtype

        e = spec.embedded
        dtype = torch_dtype(e.dtype)
        return [
            EmbeddedEngine(
                copy.deepcopy(model).to(dtype), max_batch_size=e.max_batch_size, seed=seed + i, device=e.device,
                dtype=dtype, detokenize=detokenize, chunked_prefill_tokens=chunked_prefill_tokens,
            )
            for i in range(e.num_engines)
        ]
    from rljob.runtime.engines.auth import api_key_from_env
    from rljob.runtime.engines.discovery import PodWorkerDiscovery
    from rljob.runtime.engines.sglang_client import SGLangClientConfig, SGLangEngine

    s = spec.sglang
    config = SGLangClientConfig(
        worker_urls=list(s.worker_urls),
        router_url=s.router_url,
        discover=PodWorkerDiscovery(s.discovery) if s.discovery is not None else None,
        retries=s.max_retries,
        drain_timeout_s=s.drain_timeout_seconds,
        generate_timeout_s=s.request_timeout_seconds,
        api_key=api_key_from_env(),
    )
    return [SGLangEngine(config)]
