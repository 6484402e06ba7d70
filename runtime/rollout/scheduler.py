"""One rollout round: top up, generate, harvest, stop upon collection, abort, drain, buffer.

The same code drives every engine (embedded, SGLang over HTTP, the simulator's virtual
engines) and every strategy (strategy.py). Invariant: every generated token ends up either in a
returned group or in the partial buffer, except groups rejected by the dynamic-sampling filter
(counted as wasted) and, for strategies that keep no partials, groups still running or surplus
at collection (counted as discarded).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rljob.runtime.engines.base import Engine, EngineError, GenerateRequest, InvalidRequestError
from rljob.runtime.rollout.buffer import PartialBuffer
from rljob.runtime.rollout.sample import Group, Sample, SampleStatus
from rljob.runtime.rollout.strategy import Strategy
from rljob.runtime.rollout.truncation import TruncationPolicy

log = logging.getLogger(__name__)


class Prompt(Protocol):
    """What the scheduler reads of a prompt (runtime.tasks.dataset.PromptRecord has it)."""

    index: int
    text: str
    answer: str
    prompt_ids: list[int]


class PromptSource(Protocol):
    """Anything that hands out prompts in order (the dataset stream)."""

    def next_prompt(self) -> Prompt: ...


ScoreFn = Callable[[Sample], float]
# Rewards of some finished samples of one group, in their order; may call user code (async, batched).
GroupScorer = Callable[[Group, list[Sample]], Awaitable[list[float]]]
GroupFilter = Callable[[Group], bool]


class StaleEnginesError(RuntimeError):
    """Every usable engine serves weights older than the staleness bound allows this round."""


class EngineWaitTimeout(EngineError):
    """No engine could generate for longer than the round may wait (``rollout.engineWaitTimeoutSeconds``).

    An EngineError, so the job exits with the engine-error status: in a trainer pod the gang restart then
    resumes it from its last checkpoint, where a wait without a deadline would report Running for ever.
    """


# Called while no engine can generate; may bring one back (a catch-up weight sync) and says whether it did.
Recover = Callable[[], Awaitable[bool]]


@dataclass
class RolloutConfig:
    """Per-round sampling settings (the knobs that may change between rounds live in Strategy
    and TruncationPolicy)."""

    batch_size: int
    samples_per_prompt: int
    max_response_length: int
    temperature: float = 1.0
    top_p: float = 1.0
    max_staleness: int = 2
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings
    drain_timeout_s: float = 30.0
    reabort_interval_s: float = 3.0
    # While no engine can generate, probe again with backoff from 0.5 s up to this: the SGLang client
    # re-probes workers outside the rotation at most every 8 s too, so a worker back is seen within it.
    engine_retry_max_s: float = 8.0
    engine_wait_timeout_s: float = 300.0  # then EngineWaitTimeout (rollout.engineWaitTimeoutSeconds)


@dataclass
class RoundProgress:
    """Live view of the running round, read by the CLI's progress display."""

    round_index: int = 0
    accepted: int = 0
    target: int = 0
    in_flight_groups: int = 0
    launched_groups: int = 0
    tokens: int = 0
    buffer_groups: int = 0
    phase: str = "idle"


@dataclass
class RoundStats:
    """What happened in one round (rollout side; trained-batch statistics are in batch_stats)."""

    round_index: int
    policy_version: int
    strategy: str
    rollout_seconds: float = 0.0
    tokens_generated: int = 0  # every generate call, aborted ones included
    launched_samples: int = 0  # distinct samples that got a generate call this round
    partial_samples: int = 0  # launched samples that ended the round unfinished
    truncated_keys: set[tuple[str, int]] = field(default_factory=set, repr=False)  # cut or partial
    segment_cut_samples: int = 0  # partial because of the segment cap
    cap_hit_samples: int = 0  # finished with `length` at max_response_length
    resumed_samples: int = 0  # launched with a non-empty partial response
    regenerated_samples: int = 0  # thrown back to their prompt by the staleness bound
    stale_at_acceptance_samples: int = 0  # of those, caught when their group was about to be accepted
    discarded_stale_tokens: int = 0  # their responses, dropped so they are never trained stale
    resumed_prefix_tokens: int = 0  # re-prefilled partial tokens (hidden cost of resuming)
    fork_off_policy_tokens: int = 0  # APRIL-fork counter: previous-segment tokens of resumed samples
    dropped_groups: int = 0  # rejected by dynamic sampling
    wasted_tokens: int = 0
    discarded_groups: int = 0  # unfinished or surplus at collection, dropped (keeps_partials False)
    discarded_tokens: int = 0  # their response tokens: generated, never trained
    trained_tokens: int = 0  # response tokens of the returned groups (any round's)
    surplus_groups: int = 0  # finished but not needed: buffered
    buffered_groups: int = 0  # pushed to the buffer at the end of the round
    buffer_groups_after: int = 0
    # Ledger (docs/weight_sync.md#ledger): groups and response tokens that entered the round, and
    # where they went. buffer_groups_before + new_groups = trained + buffered + filtered (dropped) +
    # discarded; buffer_tokens_before + tokens_generated = trained_tokens + buffer_tokens_after +
    # discarded_stale_tokens + wasted_tokens + discarded_tokens.
    new_groups: int = 0  # fresh prompts started this round
    buffer_groups_before: int = 0
    buffer_tokens_before: int = 0
    buffer_tokens_after: int = 0
    trained_groups: int = 0
    abort_drain_seconds: float = 0.0
    engine_errors: int = 0
    segment_cap: int | None = None
    over_sampling: float = 1.0

    @property
    def tokens_per_second(self) -> float:
        """Every generated token (aborted, filtered and discarded ones included) per second of
        rollout: APRIL's `tokens_throughput`, the paper's metric."""
        return self.tokens_generated / self.rollout_seconds if self.rollout_seconds > 0 else 0.0

    @property
    def trained_tokens_per_second(self) -> float:
        """Response tokens of the returned groups per second of rollout: the honest metric, which
        counts no filtered, discarded or still-buffered work. A single round may return more
        tokens than it generated (resumed partials); summed over rounds it cannot."""
        return self.trained_tokens / self.rollout_seconds if self.rollout_seconds > 0 else 0.0

    @property
    def truncation_rate(self) -> float:
        """Share of launched samples the round truncated: ended partial, or cut by the segment cap
        (even if the round then let the sample finish, see backpressure in run_round)."""
        return len(self.truncated_keys) / self.launched_samples if self.launched_samples else 0.0

    @property
    def fork_off_policy_ratio(self) -> float:
        """The APRIL fork's off-policy ratio, for comparison with the paper."""
        total = self.tokens_generated + self.fork_off_policy_tokens
        return self.fork_off_policy_tokens / total if total else 0.0


@dataclass
class RoundResult:
    """Exactly `batch_size` accepted groups, in prompt order, and the round's statistics."""

    groups: list[Group]
    stats: RoundStats


class RolloutScheduler:
    """Runs rounds against a set of engines with a pluggable strategy."""

    def __init__(
        self,
        engines: Sequence[Engine],
        config: RolloutConfig,
        strategy: Strategy,
        prompts: PromptSource,
        score: ScoreFn | None,
        truncation: TruncationPolicy | None = None,
        group_filter: GroupFilter | None = None,
        clock: Callable[[], float] = time.perf_counter,
        scorer: GroupScorer | None = None,
        recover: Recover | None = None,
    ) -> None:
        """`score` rewards one sample synchronously; `scorer`, when given, replaces it and rewards
        a group's finished samples at once (the job's reward: async, batched, user code). `recover`
        is called while no engine can generate (the runner's catch-up weight sync)."""
        if not engines:
            raise ValueError("the rollout scheduler needs at least one engine")
        if score is None and scorer is None:
            raise ValueError("the rollout scheduler needs a score function or a scorer")
        self.engines = list(engines)
        self.config = config
        self.strategy = strategy
        self.prompts = prompts
        self.score = score
        self.scorer = scorer
        self.truncation = truncation or TruncationPolicy()
        self.group_filter = group_filter
        self.clock = clock
        self.recover = recover
        self.buffer = PartialBuffer()
        self.progress = RoundProgress()
        self._round = 0
        self._group_counter = 0
        self._assigned = [0] * len(self.engines)  # groups in flight per engine
        self._unhealthy: set[int] = set()
        self._lagging: set[int] = set()  # engines that served over-stale weights this round

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Buffer, truncation statistics and counters: everything a restart needs."""
        return {
            "buffer": self.buffer.state_dict(),
            "truncation": self.truncation.state_dict(),
            "round": self._round,
            "group_counter": self._group_counter,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer.load_state_dict(state["buffer"])
        self.truncation.load_state_dict(state["truncation"])
        self._round = state["round"]
        self._group_counter = state["group_counter"]

    # ------------------------------------------------------------------ round

    async def run_round(self, policy_version: int) -> RoundResult:
        """Collect `batch_size` groups generated (at least partly) by `policy_version`."""
        cfg = self.config
        self._round += 1
        self._lagging.clear()  # weights were synced since: every engine gets a new chance
        stats = RoundStats(
            round_index=self._round,
            policy_version=policy_version,
            strategy=self.strategy.name,
            segment_cap=self.segment_cap(),
            over_sampling=getattr(self.strategy, "over_sampling", 1.0),
            buffer_groups_before=len(self.buffer),
            buffer_tokens_before=self._buffer_tokens(),
        )
        target = self.strategy.launch_target(cfg.batch_size)
        self.progress = RoundProgress(round_index=self._round, target=cfg.batch_size, phase="generating")
        start = self.clock()
        aborting = asyncio.Event()
        tasks: dict[asyncio.Task[bool], tuple[Group, int]] = {}
        accepted: list[Group] = []
        to_buffer: list[Group] = []  # segment-cut, surplus and in-flight-at-abort groups
        retry: list[Group] = []  # engine failed, or over-stale at acceptance: relaunched at once elsewhere

        # Finished group tasks arrive on a queue: waiting on it is O(1) per group, where
        # asyncio.wait over every task in flight would be O(in-flight) per wake-up.
        finished: asyncio.Queue[asyncio.Task[bool]] = asyncio.Queue()

        def launch(group: Group, engine_idx: int, capped: bool = True) -> None:
            cap = stats.segment_cap if capped else None
            task = asyncio.ensure_future(self._run_group(group, engine_idx, policy_version, cap, stats, aborting))
            task.add_done_callback(finished.put_nowait)
            tasks[task] = (group, engine_idx)
            self._assigned[engine_idx] += 1
            self.progress.launched_groups += 1

        refill = self.strategy.refill_groups(cfg.batch_size)

        def fresh_or_retry() -> Group:
            return retry.pop(0) if retry else self._next_group(policy_version, stats)

        async def top_up() -> None:
            if refill is not None:
                await top_up_in_chunks(refill)
                return
            # Groups cut by the segment cap count against the launch target. When the target is
            # spent and fewer than N groups can still finish, fresh prompts replace the cut ones
            # (that is what truncation is for) — unless the buffer with this round's cuts already
            # holds a round's worth: then the round continues its own cut groups without the cap,
            # so a cap set far too low can neither grow the buffer without bound nor stall the
            # round (backpressure).
            while len(accepted) + len(tasks) < cfg.batch_size or len(accepted) + len(tasks) + len(to_buffer) < target:
                engine_idx = await self._pick_engine(stats)
                over_target = len(accepted) + len(tasks) + len(to_buffer) >= target
                if retry:
                    launch(retry.pop(0), engine_idx)
                elif to_buffer and over_target and len(self.buffer) + len(to_buffer) >= target:
                    launch(to_buffer.pop(0), engine_idx, capped=False)
                else:
                    launch(self._next_group(policy_version, stats), engine_idx)

        async def top_up_in_chunks(k: int) -> None:
            # slime's loop: the first top-up launches the whole launch target; afterwards, whenever
            # rejections leave fewer than N groups viable, launch another K at once (a baseline
            # with K = N thus over-samples too, and discards what is left at collection).
            if not tasks and not accepted and not to_buffer:
                for _ in range(target):
                    launch(fresh_or_retry(), await self._pick_engine(stats))
            while len(accepted) + len(tasks) < cfg.batch_size:
                for _ in range(max(1, k)):
                    launch(fresh_or_retry(), await self._pick_engine(stats))

        await top_up()
        while len(accepted) < cfg.batch_size:
            self._update_progress(accepted, tasks, stats)
            done = [await finished.get()]
            while not finished.empty():
                done.append(finished.get_nowait())
            for task in sorted(done, key=lambda t: tasks[t][0].prompt_index):
                group, engine_idx = tasks.pop(task)
                self._assigned[engine_idx] -= 1
                engine_failed = task.result()  # re-raises programming errors, not engine errors
                if not group.finished:
                    # An engine failure is retried now on a healthy engine; a segment cut waits
                    # for the next round, or truncation would not shorten this one.
                    (retry if engine_failed else to_buffer).append(group)
                elif self._regenerate_over_stale(group, policy_version, stats, engine_idx):
                    retry.append(group)  # its fresh samples keep their tokens; the reset ones start over
                elif self.group_filter is not None and not self.group_filter(group):
                    stats.dropped_groups += 1
                    stats.wasted_tokens += sum(s.response_length for s in group.samples)
                elif len(accepted) < cfg.batch_size:
                    accepted.append(group)
                else:
                    stats.surplus_groups += 1
                    to_buffer.append(group)
            if len(accepted) < cfg.batch_size:
                await top_up()

        if tasks:
            self.progress.phase = "aborting"
            to_buffer.extend(await self._abort_and_drain(tasks, aborting, stats))
        if not self.strategy.keeps_partials and to_buffer:
            # A baseline without partial rollout (slime without --partial-rollout) aborts, awaits
            # and drops what is still running or surplus: counted, never buffered nor trained.
            stats.discarded_groups += len(to_buffer)
            stats.discarded_tokens += sum(s.response_length for g in to_buffer for s in g.samples)
            to_buffer.clear()
        for group in retry:  # engine failures after collection: nothing lost, resumed next round
            to_buffer.append(group)
        for group in sorted(to_buffer, key=lambda g: g.prompt_index):
            partial = [s for s in group.samples if s.last_round == self._round and not s.status.finished]
            stats.partial_samples += len(partial)
            stats.truncated_keys.update((s.group_id, s.index) for s in partial)
            self.buffer.push(group)
        stats.buffered_groups = len(to_buffer)
        stats.buffer_groups_after = len(self.buffer)
        stats.buffer_tokens_after = self._buffer_tokens()
        stats.trained_groups = len(accepted)
        stats.rollout_seconds = self.clock() - start
        stats.trained_tokens = sum(s.response_length for g in accepted for s in g.samples)
        self._update_progress(accepted, tasks, stats)
        self.progress.phase = "done"
        return RoundResult(groups=sorted(accepted, key=lambda g: g.prompt_index), stats=stats)

    # ------------------------------------------------------------------ pieces

    def _buffer_tokens(self) -> int:
        return sum(s.response_length for g in self.buffer for s in g.samples)

    def segment_cap(self) -> int | None:
        """This round's cap on new tokens per sample, or None.

        Never below max_response_length / (max_staleness + 1): with a smaller cap the longest
        samples would need more rounds than the staleness bound allows, be regenerated again
        and again, and never finish.
        """
        if not self.strategy.truncates:
            return None
        cap = self.truncation.threshold()
        if cap is None:
            return None
        floor = math.ceil(self.config.max_response_length / (self.config.max_staleness + 1))
        return max(cap, floor)

    def _regenerate_over_stale(self, group: Group, policy_version: int, stats: RoundStats, engine_idx: int) -> bool:
        """Staleness bound at acceptance: reset the samples with tokens older than maxStaleness.

        The bound is applied when a group leaves the buffer too, but an engine that missed weight
        syncs stamps this round's tokens with its old version; such tokens must never be trained.
        The engine is left out of this round's rotation (its weights cannot change before the next
        sync). Returns True when the group has to be generated again.
        """
        over = [s for s in group.samples if s.staleness(policy_version) > self.config.max_staleness]
        if not over:
            return False
        for sample in over:
            stats.discarded_stale_tokens += sample.response_length
            sample.reset()
        stats.regenerated_samples += len(over)
        stats.stale_at_acceptance_samples += len(over)
        # An engine that manages its workers' rotation (SGLang) has dropped the stale worker by now
        # if it still serves a current version; only a whole engine behind leaves this round.
        served = self.engines[engine_idx].served_version()
        if served is None or policy_version - served > self.config.max_staleness:
            self._lagging.add(engine_idx)
        log.warning(
            "engine %s served weights more than maxStaleness=%d versions behind %d: %d samples of %s regenerated",
            self.engines[engine_idx].name, self.config.max_staleness, policy_version, len(over), group.group_id,
        )
        return True

    def _next_group(self, policy_version: int, stats: RoundStats) -> Group:
        """Oldest buffered group first (staleness bound applied), else a fresh prompt."""
        group = self.buffer.pop_oldest()
        if group is not None:
            for s in group.samples:
                if s.staleness(policy_version) > self.config.max_staleness:
                    stats.discarded_stale_tokens += s.response_length
                    s.reset()
                    stats.regenerated_samples += 1
            return group
        prompt = self.prompts.next_prompt()
        stats.new_groups += 1
        self._group_counter += 1
        gid = f"g{self._group_counter}"
        samples = [
            Sample(
                group_id=gid,
                index=i,
                prompt_ids=list(prompt.prompt_ids),
                answer=prompt.answer,
                metadata=dict(getattr(prompt, "metadata", {})),
            )
            for i in range(self.config.samples_per_prompt)
        ]
        return Group(group_id=gid, prompt_text=prompt.text, samples=samples, prompt_index=prompt.index)

    async def _run_group(
        self,
        group: Group,
        engine_idx: int,
        version: int,
        cap: int | None,
        stats: RoundStats,
        aborting: asyncio.Event,
    ) -> bool:
        """Run the group's samples concurrently on one engine; True if the engine failed."""
        failed = await asyncio.gather(
            *(self._run_sample(s, engine_idx, version, cap, stats, aborting) for s in group.samples)
        )
        # Rewards once per group (batched reward functions need the group). Not while aborting:
        # a group that will be buffered must not hold up the drain (slow judges, APRIL pitfall 5);
        # its finished samples are rewarded when the group comes back.
        if not aborting.is_set():
            await self._reward(group)
        return any(failed)

    async def _reward(self, group: Group) -> None:
        """Reward the finished, not yet rewarded samples of `group`."""
        pending = [s for s in group.samples if s.status.finished and s.reward is None]
        if not pending:
            return
        if self.scorer is not None:
            rewards = await self.scorer(group, pending)
        else:
            assert self.score is not None  # __init__ requires one of the two
            rewards = [self.score(s) for s in pending]
        for sample, reward in zip(pending, rewards, strict=True):
            sample.reward = float(reward)

    async def _run_sample(
        self,
        sample: Sample,
        engine_idx: int,
        version: int,
        cap: int | None,
        stats: RoundStats,
        aborting: asyncio.Event,
    ) -> bool:
        """Generate one segment of a sample; returns True if the engine failed."""
        cfg = self.config
        if sample.status.finished:
            return False
        budget = cfg.max_response_length - sample.response_length
        if budget <= 0:  # resumed exactly at the cap: finished without a request, still rewarded
            sample.status = SampleStatus.TRUNCATED
            return False
        if aborting.is_set():
            return False
        max_new = min(budget, cap) if cap is not None else budget
        sample.segments += 1
        if sample.last_round != self._round:
            stats.launched_samples += 1
        sample.last_round = self._round
        if sample.response_length:
            stats.resumed_samples += 1
            stats.resumed_prefix_tokens += sample.response_length
            stats.fork_off_policy_tokens += sample.response_length
        request = GenerateRequest(
            rid=f"r{self._round}.{sample.group_id}.s{sample.index}.{sample.segments}.",
            input_ids=sample.prompt_ids + sample.response_ids,
            max_new_tokens=max_new,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            stop_token_ids=list(cfg.stop_token_ids),
            stop=list(cfg.stop),
        )
        try:
            result = await self.engines[engine_idx].generate(request)
        except InvalidRequestError as err:
            # No engine can serve it (e.g. prompt + maxResponseLength beyond the model's context):
            # retrying would loop forever, so stop with the engine's message.
            raise InvalidRequestError(f"{err} (check spec.rollout.maxResponseLength against the model)") from None
        except EngineError as err:
            # The sample keeps everything it had; the group is relaunched on a healthy engine.
            log.warning("engine %s failed on %s: %s", self.engines[engine_idx].name, request.rid, err)
            stats.engine_errors += 1
            self._unhealthy.add(engine_idx)
            return True
        produced_by = result.weight_version if result.weight_version is not None else version
        sample.append(result.output_ids, result.output_logprobs, produced_by)
        stats.tokens_generated += len(result.output_ids)
        self.progress.tokens += len(result.output_ids)
        if result.finish_reason == "stop":
            sample.status = SampleStatus.COMPLETED
        elif result.finish_reason == "length" and sample.response_length >= cfg.max_response_length:
            sample.status = SampleStatus.TRUNCATED
            stats.cap_hit_samples += 1
        elif result.finish_reason == "length":
            sample.status = SampleStatus.ABORTED  # cut by the segment cap
            stats.segment_cut_samples += 1
            stats.truncated_keys.add((sample.group_id, sample.index))
            return False
        else:
            sample.status = SampleStatus.ABORTED
            return False
        self.truncation.observe(sample.response_length)
        return False

    async def _pick_engine(self, stats: RoundStats) -> int:
        """Least-loaded healthy engine. While none is, ask `recover` to bring one back (a catch-up sync:
        engines that only serve older weights cannot come back otherwise mid-round), else wait with
        backoff; EngineWaitTimeout once `engine_wait_timeout_s` has passed without one."""
        delay = 0.5
        deadline = time.monotonic() + self.config.engine_wait_timeout_s
        while True:
            for idx in sorted(self._unhealthy):
                if await self._probe(idx):
                    log.info("engine %s is healthy again", self.engines[idx].name)
                    self._unhealthy.discard(idx)
            healthy = [i for i in range(len(self.engines)) if i not in self._unhealthy and i not in self._lagging]
            if healthy:
                return min(healthy, key=lambda i: self._assigned[i])
            if self.recover is not None and await self.recover():
                self._lagging.clear()  # every engine that answers holds the current weights again
                continue
            if not self._unhealthy:
                raise StaleEnginesError(
                    f"every engine serves weights more than rollout.partial.maxStaleness="
                    f"{self.config.max_staleness} versions old; check the weight sync to the engines"
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineWaitTimeout(
                    f"no engine could generate for {self.config.engine_wait_timeout_s:.0f} s "
                    f"(rollout.engineWaitTimeoutSeconds; engines: {', '.join(e.name for e in self.engines)}): "
                    "check that the inference pods run and answer /health, that the router answers, and the "
                    "weight sync errors above; the job stops so that its restart resumes from the last checkpoint"
                )
            log.error("no healthy engine; retrying in %.1fs, giving up in %.0fs (check the inference workers)",
                      min(delay, left), left)
            self.progress.phase = "waiting for engines"
            await asyncio.sleep(min(delay, left))
            delay = min(delay * 2, self.config.engine_retry_max_s)

    async def _probe(self, idx: int) -> bool:
        try:
            return await self.engines[idx].health()
        except EngineError:
            return False

    async def _abort_and_drain(
        self,
        tasks: dict[asyncio.Task[bool], tuple[Group, int]],
        aborting: asyncio.Event,
        stats: RoundStats,
    ) -> list[Group]:
        """Abort everything on every engine, wait until every call returned, return the groups."""
        cfg = self.config
        aborting.set()
        t0 = self.clock()
        pending = set(tasks)
        deadline = t0 + cfg.drain_timeout_s
        while pending:
            await self._abort_all_engines()
            _, pending = await asyncio.wait(pending, timeout=cfg.reabort_interval_s)
            if pending and self.clock() > deadline:
                # Cancelling loses only the in-progress segment; earlier tokens stay in the sample.
                log.error("%d groups still running %.0fs after abort; cancelling", len(pending), cfg.drain_timeout_s)
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                break
        await self._verify_drained()
        stats.abort_drain_seconds = self.clock() - t0
        groups = []
        for task, (group, engine_idx) in tasks.items():
            self._assigned[engine_idx] -= 1
            if not task.cancelled():
                task.result()
            if group.finished:
                stats.surplus_groups += 1
            groups.append(group)
        tasks.clear()
        return groups

    async def _abort_all_engines(self) -> None:
        results = await asyncio.gather(*(e.abort_all() for e in self.engines), return_exceptions=True)
        for engine, res in zip(self.engines, results):
            if isinstance(res, Exception):  # a dead worker must not stop the others' abort
                log.warning("abort on %s failed: %s", engine.name, res)

    async def _verify_drained(self) -> None:
        """Engines must be idle before training or a weight update touches their memory."""
        for idx, engine in enumerate(self.engines):
            if idx in self._unhealthy:
                continue
            try:
                load = await engine.load()
            except EngineError as err:
                log.warning("cannot read load of %s: %s", engine.name, err)
                continue
            if load.total:
                log.warning("%s still reports %d requests after abort; aborting again", engine.name, load.total)
                await engine.abort_all()

    def _update_progress(self, accepted: list[Group], tasks: dict, stats: RoundStats) -> None:
        self.progress.accepted = len(accepted)
        self.progress.in_flight_groups = len(tasks)
        self.progress.buffer_groups = len(self.buffer)
