"""Build the engines a job's rollout spec asks for."""

from __future__ import annotations

import copy

from transformers import PreTrainedModel

from rljob.operator.api.spec import RolloutSpec
from rljob.runtime.engines.base import Engine


def build_engines(spec: RolloutSpec, model: PreTrainedModel, seed: int = 0) -> list[Engine]:
    """Embedded engines get their own copy of the policy (a weight sync must really copy weights);
    `sglang` gives one client for the router and workers of the spec."""
    if spec.engine == "embedded":
        from rljob.runtime.engines.embedded import EmbeddedEngine

        e = spec.embedded
        return [
            EmbeddedEngine(copy.deepcopy(model), max_batch_size=e.max_batch_size, seed=seed + i, device=e.device)
            for i in range(e.num_engines)
        ]
    from rljob.runtime.engines.sglang_client import SGLangEngine

    return [SGLangEngine.from_spec(spec.sglang)]
