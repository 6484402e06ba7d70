"""A small simulator scenario the simulator's unit tests share (4 H100s, short responses, a few steps)."""

from __future__ import annotations

from rljob.runtime.sim.scenario import Scenario

SMALL = dict(name="small", model="qwen3-4b", gpu="h100", gpus=4, tensor_parallel=1, mem_fraction=0.85,
             dataset="deepscaler", max_response_length=8192, samples_per_prompt=4, groups_per_engine=2,
             steps=6, warmup_steps=1)


def small_scenario(**update: object) -> Scenario:
    """The small scenario with `update` applied (validated, so a bad override fails as a user's would)."""
    return Scenario.model_validate({**SMALL, **update})
