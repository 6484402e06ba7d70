"""One rollout round: top up, generate, harvest, stop upon collection, abort, drain, buffer.

The same code drives every engine (embedded, SGLang over HTTP, the simulator's virtual
engines), every strategy (strategy.py) and every rollout workflow (workflow.py). The scheduler owns
concurrency, stopping, aborting and buffering; what to launch next and where a harvested group goes
are pure decisions (decisions.py), the round's state is one `RoundState` (round.py), the engines'
load and health are the `EnginePool` (engine_pool.py). Invariant: every generated token ends up
either in a returned group or in the partial buffer, except groups rejected by the dynamic-sampling
filter (counted as filtered), responses over the staleness bound (regenerated) and, for strategies
that keep no partials, groups still running or surplus at collection (discarded); see the ledger
in docs/architecture.md#the-round-ledger.

Why one module of about 500 lines: what is left here is the I/O of one round over one `RoundState`
(launch, harvest, abort and drain, and `generate_during`, the async strategy's overlap with training),
every part reading and writing the same in-flight tasks; the decisions, the state, the staleness
bound, scoring, the per-sample workflow and the engines' health already live in their own modules,
and splitting the rest would pass the round's task table between modules.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

from rljob.runtime.engines.base import Engine, EngineError, InvalidRequestError
from rljob.runtime.rollout.buffer import PartialBuffer
from rljob.runtime.rollout.decisions import (
    Harvest,
    Launch,
    Outcome,
    ahead_launches,
    chunk_launches,
    classify,
    fill_launches,
    next_launch,
)
from rljob.runtime.rollout.engine_pool import EnginePool, EngineWaitTimeout, Recover, StaleEnginesError
from rljob.runtime.rollout.round import (
    RewardCollapse,
    RolloutConfig,
    RoundProgress,
    RoundResult,
    RoundState,
    RoundStats,
)
from rljob.runtime.rollout.sample import Group, Sample, SampleStatus
from rljob.runtime.rollout.scoring import GroupFilter, GroupScorer, GroupScoring, ScoreFn
from rljob.runtime.rollout.staleness import over_bound
from rljob.runtime.rollout.strategy import Strategy
from rljob.runtime.rollout.truncation import TruncationPolicy
from rljob.runtime.rollout.workflow import RolloutWorkflow, Segment, SegmentEnd, SingleTurnWorkflow

log = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = [  # the names callers import from here, wherever they are defined
    "EngineWaitTimeout", "GroupFilter", "GroupScorer", "Prompt", "PromptSource", "Recover", "RolloutConfig",
    "RolloutScheduler", "RoundProgress", "RoundResult", "RoundStats", "ScoreFn", "StaleEnginesError",
]


class Prompt(Protocol):
    """What the scheduler reads of a prompt (runtime.tasks.dataset.PromptRecord has it)."""

    index: int
    text: str
    answer: str
    prompt_ids: list[int]


class PromptSource(Protocol):
    """Anything that hands out prompts in order (the dataset stream)."""

    def next_prompt(self) -> Prompt: ...


def new_group(prompt: Prompt, group_id: str, samples_per_prompt: int) -> Group:
    """A fresh group of `samples_per_prompt` empty samples of `prompt`."""
    samples = [
        Sample(group_id=group_id, index=i, prompt_ids=list(prompt.prompt_ids), answer=prompt.answer,
               metadata=dict(getattr(prompt, "metadata", {})))
        for i in range(samples_per_prompt)
    ]
    return Group(group_id=group_id, prompt_text=prompt.text, samples=samples, prompt_index=prompt.index)


class RolloutScheduler:
    """Runs rounds against a set of engines with a pluggable strategy and rollout workflow."""

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
        workflow: RolloutWorkflow | None = None,
    ) -> None:
        """`score` rewards one sample synchronously; `scorer`, when given, replaces it and rewards
        a group's finished samples at once (the job's reward: async, batched, user code).
        `group_filter` keeps or rejects a finished group (DAPO). `recover` is called while no engine
        can generate (the runner's catch-up weight sync). `workflow` generates one segment of one
        sample (default: SingleTurnWorkflow)."""
        self.pool = EnginePool(engines, recover)
        self.scoring = GroupScoring(score=score, scorer=scorer, keep=group_filter)
        self.rejections_in_a_row = 0  # groups the filter rejected since it last accepted one (any round)
        self.config = config
        self.strategy = strategy
        self.prompts = prompts
        self.truncation = truncation or TruncationPolicy()
        self.workflow: RolloutWorkflow = workflow or SingleTurnWorkflow()
        self.clock = clock
        self.buffer = PartialBuffer()
        self.progress = RoundProgress()
        self._round = 0
        self._group_counter = 0
        # The round whose groups keep generating while the trainer trains (Strategy.overlaps_training):
        # returned by run_round, closed by generate_during.
        self._open: RoundState | None = None

    @property
    def engines(self) -> list[Engine]:
        """The engines the rounds run on."""
        return self.pool.engines

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
        """Restore what `state_dict` saved."""
        self.buffer.load_state_dict(state["buffer"])
        self.truncation.load_state_dict(state["truncation"])
        self._round = state["round"]
        self._group_counter = state["group_counter"]

    # ------------------------------------------------------------------ round

    async def run_round(self, policy_version: int) -> RoundResult:
        """Collect `batch_size` groups generated (at least partly) by `policy_version`.

        Under a strategy that overlaps training, the groups still in flight keep generating after this
        returns; `generate_during` must follow (its end closes the round's statistics).
        """
        if self._open is not None:
            raise RuntimeError("run_round: the previous round still generates; await generate_during first")
        cfg = self.config
        self._round += 1
        self.pool.new_round()
        cap = self.segment_cap()
        stats = RoundStats(
            round_index=self._round, policy_version=policy_version, strategy=self.strategy.name, segment_cap=cap,
            over_sampling=getattr(self.strategy, "over_sampling", 1.0), buffer_groups_before=len(self.buffer),
            buffer_tokens_before=self.buffer.token_count(),
        )
        state = RoundState(index=self._round, policy_version=policy_version, stats=stats,
                           target=self.strategy.launch_target(cfg.batch_size), segment_cap=cap)
        self.progress = RoundProgress(round_index=self._round, target=cfg.batch_size, phase="generating")
        start = self.clock()
        try:
            await self._collect(state)
        except BaseException:
            # A fatal error (a request no engine can serve, reward collapse, cancellation) ends the
            # round: the other groups must not keep generating, nor die later with an exception
            # nobody retrieves (logged from a finalizer, at a random point of another test or run).
            await self._cancel_in_flight(state)
            raise
        if self.strategy.overlaps_training:
            stats.rollout_seconds = self.clock() - start
            self._open = state
            self._update_progress(state)  # the batch's last harvest moved groups out of flight
            self.progress.phase = "generating ahead"
        else:
            await self._close_round(state)
            stats.rollout_seconds = self.clock() - start
        return RoundResult(groups=sorted(state.accepted, key=lambda g: g.prompt_index), stats=stats)

    async def generate_during(self, training: Awaitable[T]) -> T:
        """Await `training`; meanwhile, under a strategy that overlaps training, keep the engines generating.

        The groups of the last round still in flight run on under the weights they started with, and
        more are launched (decisions.ahead_launches); finished ones are harvested as in the round (the
        batch being full, they are surplus, kept for the next round). When `training` is done, every
        request is interrupted (abort, drain) and its group buffered, so the weight sync that follows
        lands on idle engines and the next round resumes each response under the new weights.
        Without an open round this only awaits `training`.
        """
        state, self._open = self._open, None
        future = asyncio.ensure_future(training)
        if state is None:
            return await future
        start = self.clock()
        tokens_before = state.stats.tokens_generated
        try:
            while not future.done():
                self._launch_ahead(state)
                self._update_progress(state)
                harvest = asyncio.ensure_future(state.finished.get())
                await asyncio.wait({future, harvest}, return_when=asyncio.FIRST_COMPLETED)
                if not harvest.done():
                    harvest.cancel()
                    await asyncio.gather(harvest, return_exceptions=True)
                    continue
                done = [harvest.result()]
                while not state.finished.empty():
                    done.append(state.finished.get_nowait())
                for task in sorted(done, key=lambda t: state.tasks[t][0].prompt_index):
                    self._harvest(state, task)
        except BaseException:
            await self._cancel_in_flight(state)
            await asyncio.gather(future, return_exceptions=True)  # a thread cannot be cancelled: let it end
            raise
        state.stats.overlap_seconds = self.clock() - start
        await self._close_round(state)
        state.stats.overlap_tokens = state.stats.tokens_generated - tokens_before
        return future.result()

    def _launch_ahead(self, state: RoundState) -> None:
        """Top up while the trainer trains, on engines that need no waiting: retries first, then groups
        the segment cap cut (continued now: nothing waits for them before the sync), then buffered groups
        and fresh prompts, all without the cap."""
        done_ahead = sum(1 for g in state.cut if g.finished)
        target = self.strategy.ahead_target(self.config.batch_size)
        for _ in range(ahead_launches(len(state.tasks), done_ahead, target)):
            engine_idx = self.pool.pick_now()
            if engine_idx is None:
                return  # no engine in the rotation: the round after the sync waits for one, with its deadline
            unfinished = next((g for g in state.cut if not g.finished), None)
            if state.retry:
                group = state.retry.pop(0)
            elif unfinished is not None:
                state.cut.remove(unfinished)
                group = unfinished
            else:
                group = self._next_group(state)
            self._launch(state, group, engine_idx, capped=False)

    async def _close_round(self, state: RoundState) -> None:
        """Abort and drain what still runs, buffer it, close the ledger."""
        if state.tasks:
            self.progress.phase = "aborting"
            state.cut.extend(await self._abort_and_drain(state))
        self._end_round(state)
        self._update_progress(state)
        self.progress.phase = "done"

    async def _collect(self, state: RoundState) -> None:
        """Launch and harvest groups until the batch is full."""
        batch_size = self.config.batch_size
        await self._top_up(state)
        self._fill(state)
        while len(state.accepted) < batch_size:
            self._update_progress(state)
            done = [await state.finished.get()]
            while not state.finished.empty():
                done.append(state.finished.get_nowait())
            for task in sorted(done, key=lambda t: state.tasks[t][0].prompt_index):
                self._harvest(state, task)
            if len(state.accepted) < batch_size:
                await self._top_up(state)
                self._fill(state)

    @staticmethod
    async def _cancel_in_flight(state: RoundState) -> None:
        """Cancel every running group of a failed round and retrieve each outcome."""
        tasks = list(state.tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _fill(self, state: RoundState) -> None:
        """With `fill_engines`, under a strategy that keeps partials: launch buffered groups, else fresh
        prompts, onto every engine whose free batch slots hold a whole group (decisions.fill_launches).

        Only while the round collects: while the trainer trains, `_launch_ahead` bounds the work done
        ahead (groups finished ahead wait for the next step and age), and filling past that bound only
        generated groups that went stale (measured: twice the tokens, no more trained per second)."""
        cfg = self.config
        if not (cfg.fill_engines and self.strategy.keeps_partials):
            return
        for idx, engine in enumerate(self.engines):
            if idx in self.pool.unhealthy or idx in self.pool.lagging:
                continue
            for _ in range(fill_launches(engine.batch_capacity(), self.pool.requests[idx], cfg.samples_per_prompt)):
                self._launch(state, self._next_group(state), idx)

    async def _top_up(self, state: RoundState) -> None:
        """Launch what the launch decisions ask for (decisions.next_launch / chunk_launches)."""
        cfg = self.config
        chunk = self.strategy.refill_groups(cfg.batch_size)
        if chunk is not None:
            for _ in range(chunk_launches(state.counts(cfg.batch_size, len(self.buffer)), chunk)):
                group = state.retry.pop(0) if state.retry else self._next_group(state)
                self._launch(state, group, await self._pick_engine())
            return
        while (launch := next_launch(state.counts(cfg.batch_size, len(self.buffer)))) is not None:
            engine_idx = await self._pick_engine()
            if launch is Launch.RETRY:
                self._launch(state, state.retry.pop(0), engine_idx)
            elif launch is Launch.CONTINUE_CUT:
                self._launch(state, state.cut.pop(0), engine_idx, capped=False)
            else:
                self._launch(state, self._next_group(state), engine_idx)

    def _launch(self, state: RoundState, group: Group, engine_idx: int, capped: bool = True) -> None:
        cap = state.segment_cap if capped else None
        task = asyncio.ensure_future(self._run_group(state, group, engine_idx, cap))
        task.add_done_callback(state.finished.put_nowait)
        state.tasks[task] = (group, engine_idx)
        self.pool.assigned[engine_idx] += 1
        self.pool.requests[engine_idx] += sum(1 for s in group.samples if not s.status.finished)
        self.progress.launched_groups += 1

    def _harvest(self, state: RoundState, task: asyncio.Task[bool]) -> None:
        """Send a group whose task returned where `decisions.classify` says."""
        group, engine_idx = state.tasks.pop(task)
        self.pool.assigned[engine_idx] -= 1
        engine_failed = task.result()  # re-raises programming errors, not engine errors
        # The bound is asked only of finished groups, the filter (user code) only of those within it.
        over = group.finished and self._over_bound(group, state.policy_version)
        kept = not group.finished or over or self.scoring.kept(group)
        outcome = classify(Harvest(finished=group.finished, engine_failed=engine_failed, over_bound=over, kept=kept),
                           len(state.accepted), self.config.batch_size)
        stats = state.stats
        if outcome is Outcome.RETRY:
            state.retry.append(group)
        elif outcome is Outcome.CUT:
            state.cut.append(group)
        elif outcome is Outcome.REGENERATE:
            self._regenerate_at_acceptance(state, group, engine_idx)
            state.retry.append(group)  # its fresh samples keep their tokens; the reset ones start over
        elif outcome is Outcome.FILTERED:
            stats.filtered_groups += 1
            stats.filtered_tokens += sum(s.response_length for s in group.samples)
            self._count_rejection(group)
        elif outcome is Outcome.ACCEPTED:
            self.rejections_in_a_row = 0
            state.accepted.append(group)
        else:
            stats.surplus_groups += 1
            state.cut.append(group)

    def _count_rejection(self, group: Group) -> None:
        """One more group rejected by the filter; past the bound the round stops instead of sampling for ever."""
        self.rejections_in_a_row += 1
        if self.rejections_in_a_row >= self.config.max_consecutive_rejections:
            rewards = sorted({r for s in group.samples if (r := s.reward) is not None})
            raise RewardCollapse(
                f"the dynamic-sampling filter rejected {self.rejections_in_a_row} groups in a row (the last one's "
                f"rewards: {rewards}): every group scores alike, so no batch can fill. Check the reward function "
                "and the data's answers, or raise algorithm.maxConsecutiveRejections"
            )

    def _end_round(self, state: RoundState) -> None:
        """Discard (strategies without partials) or buffer what is left; close the ledger."""
        stats = state.stats
        if not self.strategy.keeps_partials and state.cut:
            # A baseline without partial rollout (slime without --partial-rollout) aborts, awaits
            # and drops what is still running or surplus: counted, never buffered nor trained.
            stats.discarded_groups += len(state.cut)
            stats.discarded_tokens += sum(s.response_length for g in state.cut for s in g.samples)
            state.cut.clear()
        state.cut.extend(state.retry)  # engine failures after collection: nothing lost, resumed next round
        state.retry.clear()
        for group in sorted(state.cut, key=lambda g: g.prompt_index):
            partial = [s for s in group.samples if s.last_round == self._round and not s.status.finished]
            stats.partial_samples += len(partial)
            stats.unfinished_keys.update((s.group_id, s.index) for s in partial)
            self.buffer.push(group)
        stats.buffered_groups = len(state.cut)
        stats.buffer_groups_after = len(self.buffer)
        stats.buffer_tokens_after = self.buffer.token_count()
        stats.trained_groups = len(state.accepted)
        stats.trained_tokens = sum(s.response_length for g in state.accepted for s in g.samples)

    # ------------------------------------------------------------------ pieces

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
        return max(cap, self.segment_cap_floor())

    def segment_cap_floor(self) -> int:
        """The least segment cap: max_response_length / (max_staleness + 1), rounded up."""
        return math.ceil(self.config.max_response_length / (self.config.max_staleness + 1))

    def _over_bound(self, group: Group, policy_version: int) -> bool:
        return any(over_bound(s.versions, policy_version, self.config.max_staleness) for s in group.samples)

    def _regenerate(self, group: Group, stats: RoundStats, policy_version: int) -> int:
        """Reset the samples over the staleness bound (staleness.py); returns how many."""
        over = [s for s in group.samples if over_bound(s.versions, policy_version, self.config.max_staleness)]
        for sample in over:
            stats.regenerated_tokens += sample.response_length
            sample.reset()
        stats.regenerated_samples += len(over)
        return len(over)

    def _regenerate_at_acceptance(self, state: RoundState, group: Group, engine_idx: int) -> None:
        """Staleness bound at acceptance: an engine that missed weight syncs stamps this round's
        tokens with its old version; such tokens must never be trained. The engine is left out of
        this round's rotation (its weights cannot change before the next sync)."""
        count = self._regenerate(group, state.stats, state.policy_version)
        state.stats.stale_at_acceptance_samples += count
        self.pool.served_over_stale(engine_idx, state.policy_version, self.config.max_staleness)
        log.warning(
            "engine %s served weights more than maxStaleness=%d versions behind %d: %d samples of %s regenerated",
            self.engines[engine_idx].name, self.config.max_staleness, state.policy_version, count, group.group_id,
        )

    def _next_group(self, state: RoundState) -> Group:
        """Oldest buffered group first (staleness bound applied), else a fresh prompt."""
        group = self.buffer.pop_oldest()
        if group is not None:
            self._regenerate(group, state.stats, state.policy_version)
            return group
        prompt = self.prompts.next_prompt()
        state.stats.new_groups += 1
        self._group_counter += 1
        return new_group(prompt, f"g{self._group_counter}", self.config.samples_per_prompt)

    async def _run_group(self, state: RoundState, group: Group, engine_idx: int, cap: int | None) -> bool:
        """Run the group's samples concurrently on one engine; True if the engine failed."""
        failed = await asyncio.gather(*(self._run_sample(state, s, engine_idx, cap) for s in group.samples))
        # Rewards once per group (batched reward functions need the group). Not while aborting:
        # a group that will be buffered must not hold up the drain (slow judges, APRIL pitfall 5);
        # its finished samples are rewarded when the group comes back.
        if not state.aborting.is_set():
            await self.scoring.reward(group)
        return any(failed)

    async def _run_sample(self, state: RoundState, sample: Sample, engine_idx: int, cap: int | None) -> bool:
        """Generate one segment of a sample with the workflow; returns True if the engine failed."""
        if sample.status.finished:
            return False
        try:
            return await self._generate_segment(state, sample, engine_idx, cap)
        finally:
            self.pool.requests[engine_idx] -= 1  # counted at launch (_launch): the slot is free again

    async def _generate_segment(self, state: RoundState, sample: Sample, engine_idx: int, cap: int | None) -> bool:
        """One segment of an unfinished sample (_run_sample)."""
        cfg, stats = self.config, state.stats
        budget = cfg.max_response_length - sample.response_length
        if budget <= 0:  # resumed exactly at the cap: finished without a request, still rewarded
            sample.status = SampleStatus.TRUNCATED
            return False
        if state.aborting.is_set():
            return False
        sample.segments += 1
        if sample.last_round != self._round:
            stats.launched_samples += 1
        sample.last_round = self._round
        if sample.response_length:
            stats.resumed_samples += 1
            stats.resumed_prefix_tokens += sample.response_length
            stats.fork_off_policy_tokens += sample.response_length
        segment = Segment(
            engine=self.engines[engine_idx], rid=f"r{self._round}.{sample.group_id}.s{sample.index}.{sample.segments}.",
            max_new_tokens=min(budget, cap) if cap is not None else budget, policy_version=state.policy_version,
            sampling=cfg.sampling(), aborting=state.aborting,
            group_prompt=sample.prompt_ids if not sample.response_length and cfg.samples_per_prompt > 1 else None,
        )
        try:
            result = await self.workflow.generate(sample, segment)
        except InvalidRequestError as err:
            # No engine can serve it (e.g. prompt + maxResponseLength beyond the model's context):
            # retrying would loop forever, so stop with the engine's message.
            raise InvalidRequestError(f"{err} (check spec.rollout.maxResponseLength against the model)") from None
        except EngineError as err:
            # The sample keeps everything it had; the group is relaunched on a healthy engine.
            log.warning("engine %s failed on %s: %s", segment.engine.name, segment.rid, err)
            stats.engine_errors += 1
            self.pool.failed(engine_idx)
            return True
        stats.tokens_generated += result.generated
        self.progress.tokens += result.generated
        self._end_segment(sample, result.end, stats)
        return False

    def _end_segment(self, sample: Sample, end: SegmentEnd, stats: RoundStats) -> None:
        """The sample's status after a segment, from why it ended."""
        if end is SegmentEnd.STOP:
            sample.status = SampleStatus.COMPLETED
        elif end is SegmentEnd.LENGTH and sample.response_length >= self.config.max_response_length:
            sample.status = SampleStatus.TRUNCATED
            stats.cap_hit_samples += 1
        elif end is SegmentEnd.LENGTH:
            sample.status = SampleStatus.ABORTED  # cut by the segment cap
            stats.segment_cut_samples += 1
            stats.cut_keys.add((sample.group_id, sample.index))
            return
        else:
            sample.status = SampleStatus.ABORTED
            return
        self.truncation.observe(sample.response_length)

    async def _pick_engine(self) -> int:
        cfg = self.config

        def waiting() -> None:
            self.progress.phase = "waiting for engines"

        return await self.pool.pick(cfg.max_staleness, cfg.engine_wait_timeout_s, cfg.engine_retry_max_s, waiting)

    async def _abort_and_drain(self, state: RoundState) -> list[Group]:
        """Abort everything on every engine, wait until every call returned, return the groups."""
        cfg = self.config
        state.aborting.set()
        t0 = self.clock()
        pending = set(state.tasks)
        deadline = t0 + cfg.drain_timeout_s
        while pending:
            await self.pool.abort_all()
            _, pending = await asyncio.wait(pending, timeout=cfg.reabort_interval_s)
            if pending and self.clock() > deadline:
                # Cancelling loses only the in-progress segment; earlier tokens stay in the sample.
                log.error("%d groups still running %.0fs after abort; cancelling", len(pending), cfg.drain_timeout_s)
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                break
        await self.pool.verify_drained()
        state.stats.abort_drain_seconds = self.clock() - t0
        groups = []
        for task, (group, engine_idx) in state.tasks.items():
            self.pool.assigned[engine_idx] -= 1
            if not task.cancelled():
                task.result()
            if group.finished:
                state.stats.surplus_groups += 1
            groups.append(group)
        state.tasks.clear()
        return groups

    def _update_progress(self, state: RoundState) -> None:
        self.progress.accepted = len(state.accepted)
        self.progress.in_flight_groups = len(state.tasks)
        self.progress.buffer_groups = len(self.buffer)
