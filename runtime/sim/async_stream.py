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

from rljob.runtime.rollout.sample import Group, Sample, SampleStatus
from rljob.runtime.rollout.scheduler import new_group
from rljob.runtime.rollout.staleness import over_bound
from rljob.runtime.rollout.workflow import Segment, SegmentEnd, SingleTurnWorkflow
from rljob.runtime.sim.build import SimRun
from rljob.runtime.sim.records import SimStepRecord
from rljob.runtime.sim.scenario import BoundedStalenessSpec


@dataclass
class StreamCounters:
    """Work done since the last trained step (units of the token quantum)."""

    generated: int = 0
    wasted: int = 0
    dropped_groups: int = 0
    resumed_requests: int = 0  # interrupted by a weight update and re-posted at once
    regenerated_groups: int = 0


class _Stream:
    """The producer, the group tasks and the trainer of one stream run, sharing its admission state."""

    def __init__(self, sim: SimRun) -> None:
        spec = sim.spec
        assert isinstance(spec, BoundedStalenessSpec)
        self.sim = sim
        self.cfg = sim.scheduler.config
        self.eta = spec.eta
        self.scoring = sim.scheduler.scoring  # the runtime's reward and DAPO filter
        self.workflow = SingleTurnWorkflow()  # the runtime's; an interrupted request resumes from its resume point
        self.sampling = self.cfg.sampling()
        self.never_aborting = asyncio.Event()  # the stream never aborts: a weight update interrupts, then it resumes
        self.cond = asyncio.Condition()
        self.ready: deque[Group] = deque()
        self.assigned = [0] * len(sim.engines)
        self.tasks: set[asyncio.Task[None]] = set()
        self.counters = StreamCounters()
        self.version = 0
        self.viable = 0
        self.groups = 0

    async def run_sample(self, sample: Sample, group: Group, engine_idx: int) -> None:
        """Generate `sample` to its end, resuming at once whenever a weight update interrupts it."""
        status = SampleStatus.TRUNCATED  # unless a stop ends it before the response cap
        while (budget := self.cfg.max_response_length - sample.response_length) > 0:
            sample.segments += 1
            segment = Segment(engine=self.sim.engines[engine_idx],
                              rid=f"a.{sample.group_id}.s{sample.index}.{sample.segments}.", max_new_tokens=budget,
                              policy_version=self.version, sampling=self.sampling, aborting=self.never_aborting)
            result = await self.workflow.generate(sample, segment)
            self.counters.generated += result.generated
            if result.end is SegmentEnd.STOP:
                status = SampleStatus.COMPLETED
            if result.end is not SegmentEnd.ABORT:
                break
            self.counters.resumed_requests += 1  # interrupted by a weight update: continue at once
        sample.status = status
        await self.scoring.reward(group)  # rewards this sample as it finishes (the finish times are statistics)

    async def run_group(self, group: Group, engine_idx: int) -> None:
        """Generate a group; then it is ready for the trainer, or filtered (its admission slot freed)."""
        try:
            await asyncio.gather(*(self.run_sample(s, group, engine_idx) for s in group.samples))
        finally:
            self.assigned[engine_idx] -= 1
        async with self.cond:
            if not self.scoring.kept(group):
                self.counters.dropped_groups += 1
                self.counters.wasted += sum(s.response_length for s in group.samples)
                self.viable -= 1  # a rejected group frees its admission slot
            else:
                self.ready.append(group)
            self.cond.notify_all()

    def launch(self, group: Group) -> None:
        """Run `group` on the least-loaded engine."""
        idx = min(range(len(self.sim.engines)), key=lambda i: self.assigned[i])
        self.assigned[idx] += 1
        task = asyncio.ensure_future(self.run_group(group, idx))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def producer(self) -> None:
        """Launch fresh groups while the admission rule allows."""
        n = self.cfg.batch_size
        while True:
            async with self.cond:
                await self.cond.wait_for(lambda: self.viable < (self.version + self.eta + 1) * n)
                self.viable += 1
            self.groups += 1
            prompt = self.sim.scheduler.prompts.next_prompt()
            self.launch(new_group(prompt, f"g{self.groups}", self.cfg.samples_per_prompt))

    async def take_batch(self, version: int) -> list[Group]:
        """The first N ready groups within the staleness bound; the others are regenerated."""
        batch: list[Group] = []
        while len(batch) < self.cfg.batch_size:
            async with self.cond:
                await self.cond.wait_for(lambda: bool(self.ready))
                group = self.ready.popleft()
            if any(over_bound(s.versions, version, self.eta) for s in group.samples):
                self.counters.wasted += sum(s.response_length for s in group.samples)
                self.counters.regenerated_groups += 1
                for s in group.samples:
                    s.reset()
                self.launch(group)  # same prompt, regenerated under the current weights
                continue
            batch.append(group)
        return batch

    async def train_step(self, step: int, started: float) -> float:
        """Take a batch, train, sync the weights, record the step; returns when it ended."""
        sim, q, version = self.sim, self.sim.q, self.version
        batch = await self.take_batch(version)
        train_s = sim.train_seconds(batch)
        await asyncio.sleep(train_s)
        sync_s = await sim.sync_weights(version + 1)
        async with self.cond:
            self.version = version + 1
            self.cond.notify_all()
        now = asyncio.get_running_loop().time()
        trained = sum(s.response_length for g in batch for s in g.samples)
        # Versions never decrease within a sample here (one engine set, one sync at a time): bisect.
        off = sum(bisect.bisect_left(s.versions, version) for g in batch for s in g.samples)
        c = self.counters
        sim.records.append(SimStepRecord(
            step=step, round_kind="stream", rollout_s=now - started, train_s=train_s, sync_s=sync_s,
            step_s=now - started, tokens_generated=c.generated * q, trained_tokens=trained * q,
            off_policy_tokens=off * q, fork_off_policy_ratio=0.0,
            resumed_prefix_tokens=0, wasted_tokens=c.wasted * q, buffered_groups=len(self.ready),
            dropped_groups=c.dropped_groups, trained_groups=len(batch),
            distinct_prompts=len({g.prompt_index for g in batch}),
            max_staleness=max(s.staleness(version) for g in batch for s in g.samples),
        ))
        sim.stream_resumed += c.resumed_requests
        self.counters = StreamCounters()
        return now


async def run_stream(sim: SimRun) -> None:
    """Run `scenario.steps` trained steps of the stream; append one SimStepRecord per step."""
    stream = _Stream(sim)
    production = asyncio.ensure_future(stream.producer())
    last = asyncio.get_running_loop().time()
    try:
        for step in range(sim.scenario.steps):
            last = await stream.train_step(step, last)
    finally:
        production.cancel()
        for task in list(stream.tasks):
            task.cancel()
        await asyncio.gather(production, *stream.tasks, return_exceptions=True)
