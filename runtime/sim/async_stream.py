"""AReaL-style bounded-staleness rollout: a stream of groups, not rounds.

The rollout GPUs never stop for training. A producer keeps launching groups while

    viable launched groups ≤ (trainer version + η + 1) · N

(AReaL's admission rule; rejected groups free their slot), so generation runs at most η versions
ahead of the trainer; η = 0 degenerates to synchronous rollout. The trainer, on its own share of
the GPUs, takes the first N finished, accepted groups, trains, and pushes the new weights to every
engine. The update interrupts the requests in flight; each one is re-posted at once with its
prefix (the engine re-prefills it) and continues under the new weights, so a sample's tokens carry
the versions that produced them. A group whose oldest token is more than η versions older than
the trainer when it is taken is regenerated from its prompt (its tokens are wasted), so no trained
sample exceeds the bound.
"""

from __future__ import annotations

import asyncio
import bisect
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rljob.runtime.engines.base import GenerateRequest
from rljob.runtime.rollout.sample import Group, Sample, SampleStatus
from rljob.runtime.sim.scenario import BoundedStalenessSpec, train_seconds

if TYPE_CHECKING:
    from rljob.runtime.sim.runner import _Sim


@dataclass
class StreamCounters:
    """Work done since the last trained step (units of the token quantum)."""

    generated: int = 0
    wasted: int = 0
    dropped_groups: int = 0
    resumed_requests: int = 0  # interrupted by a weight update and re-posted at once
    regenerated_groups: int = 0


async def run_stream(sim: _Sim) -> None:
    """Run `scenario.steps` trained steps of the stream; append one StepRecord per step."""
    from rljob.runtime.sim.runner import StepRecord, _batch_tokens, _sync_weights

    spec = sim.spec
    assert isinstance(spec, BoundedStalenessSpec)
    loop = asyncio.get_running_loop()
    cfg = sim.scheduler.config
    n, eta, q = cfg.batch_size, spec.eta, sim.q
    group_filter = sim.scheduler.group_filter
    cond = asyncio.Condition()
    ready: deque[Group] = deque()
    assigned = [0] * len(sim.engines)
    tasks: set[asyncio.Task[None]] = set()
    counters = StreamCounters()
    state = {"version": 0, "viable": 0, "groups": 0}

    async def run_sample(sample: Sample, engine_idx: int) -> None:
        engine = sim.engines[engine_idx]
        while True:
            budget = cfg.max_response_length - sample.response_length
            if budget <= 0:
                sample.status = SampleStatus.TRUNCATED
                break
            sample.segments += 1
            result = await engine.generate(GenerateRequest(
                rid=f"a.{sample.group_id}.s{sample.index}.{sample.segments}.",
                input_ids=sample.prompt_ids + sample.response_ids, max_new_tokens=budget,
            ))
            version = result.weight_version if result.weight_version is not None else state["version"]
            sample.append(result.output_ids, result.output_logprobs, version)
            counters.generated += len(result.output_ids)
            if result.finish_reason == "stop":
                sample.status = SampleStatus.COMPLETED
                break
            if result.finish_reason == "length":
                sample.status = SampleStatus.TRUNCATED
                break
            counters.resumed_requests += 1  # interrupted by a weight update: continue at once
        sample.reward = sim.scheduler.score(sample)

    async def run_group(group: Group, engine_idx: int) -> None:
        try:
            await asyncio.gather(*(run_sample(s, engine_idx) for s in group.samples))
        finally:
            assigned[engine_idx] -= 1
        async with cond:
            if group_filter is not None and not group_filter(group):
                counters.dropped_groups += 1
                counters.wasted += sum(s.response_length for s in group.samples)
                state["viable"] -= 1  # a rejected group frees its admission slot
            else:
                ready.append(group)
            cond.notify_all()

    def launch(group: Group) -> None:
        idx = min(range(len(sim.engines)), key=lambda i: assigned[i])
        assigned[idx] += 1
        task = asyncio.ensure_future(run_group(group, idx))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def fresh_group() -> Group:
        prompt = sim.scheduler.prompts.next_prompt()
        state["groups"] += 1
        gid = f"g{state['groups']}"
        samples = [Sample(group_id=gid, index=i, prompt_ids=list(prompt.prompt_ids), answer=prompt.answer)
                   for i in range(cfg.samples_per_prompt)]
        return Group(group_id=gid, prompt_text=prompt.text, samples=samples, prompt_index=prompt.index)

    async def producer() -> None:
        while True:
            async with cond:
                await cond.wait_for(lambda: state["viable"] < (state["version"] + eta + 1) * n)
                state["viable"] += 1
            launch(fresh_group())

    async def take_batch(version: int) -> list[Group]:
        batch: list[Group] = []
        while len(batch) < n:
            async with cond:
                await cond.wait_for(lambda: bool(ready))
                group = ready.popleft()
            if max(s.staleness(version) for s in group.samples) > eta:
                counters.wasted += sum(s.response_length for s in group.samples)
                counters.regenerated_groups += 1
                for s in group.samples:
                    s.reset()
                launch(group)  # same prompt, regenerated under the current weights
                continue
            batch.append(group)
        return batch

    production = asyncio.ensure_future(producer())
    last = loop.time()
    try:
        for step in range(sim.scenario.steps):
            version = state["version"]
            batch = await take_batch(version)
            train_s = train_seconds(sim.scenario, _batch_tokens(sim, batch), sim.train_gpus)
            await asyncio.sleep(train_s)
            sync_s = await _sync_weights(sim, version + 1)
            async with cond:
                state["version"] = version + 1
                cond.notify_all()
            now = loop.time()
            trained = sum(s.response_length for g in batch for s in g.samples)
            off = sum(bisect.bisect_left(s.versions, version) for g in batch for s in g.samples)
            sim.records.append(StepRecord(
                step=step, round_kind="stream", rollout_s=now - last, train_s=train_s, sync_s=sync_s,
                step_s=now - last, tokens_generated=counters.generated * q, trained_tokens=trained * q,
                off_policy_tokens=off * q, fork_off_policy_ratio=0.0,
                resumed_prefix_tokens=0, wasted_tokens=counters.wasted * q, buffered_groups=len(ready),
                dropped_groups=counters.dropped_groups, trained_groups=len(batch),
                distinct_prompts=len({g.prompt_index for g in batch}),
                max_staleness=max(s.staleness(version) for g in batch for s in g.samples),
            ))
            sim.stream_resumed += counters.resumed_requests
            counters = StreamCounters()
            last = now
    finally:
        production.cancel()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(production, *tasks, return_exceptions=True)
