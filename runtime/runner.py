"""The step loop of one RLJob: rollout round, train, weight sync, metrics, checkpoint.

`JobRunner` runs the steps; every decision lives in the parts (scheduler, strategy, trainer, truncation
policy), which job_parts.py builds from the spec. The same loop runs in `rljob run` on a laptop and in
the trainer pod of the operator (engine `sglang`). In a multi-rank job it is rank 0, and keeps the other
ranks in step with the orders of ranks.py; each step's measurements go into a `StepRecord`
(step_record.py).

Why about 440 lines: the step is read top to bottom in one place (start and resume, the step, the
weight push with its SIGTERM grace, the step-boundary vote, checkpoints); the parts it calls hold the logic.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any


from rljob.api.spec import RLJob
from rljob.common.progress_reporter import ProgressReporter
from rljob.runtime import job_parts as parts
from rljob.runtime.checkpoint import LoadedCheckpoint, rng_state, set_rng_state
from rljob.runtime.engines.base import Engine
from rljob.runtime.evaluation import EvalPrompt, EvalResult, evaluate_held_out
from rljob.runtime.knobs import KnobSource, apply_knobs, knob_values
from rljob.runtime.ranks import GatheredWeights, Order, OrderSender
from rljob.runtime.rollout.scheduler import RolloutScheduler
from rljob.runtime.rollout.scoring import dynamic_sampling_filter
from rljob.runtime.step_record import StepRecord, step_record
from rljob.runtime.training.distributed import Distributed
from rljob.runtime.weights.transport import SyncReport, WeightTransport

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# After SIGTERM, how long a step's weight push may still take before it is given up: a healthy push ends
# well within it, a push retrying because the engines went away with the trainer (a suspend scales them
# to zero as well) would otherwise hold the step's checkpoint back until torchrun kills the ranks.
STOP_PUSH_GRACE_S = 30.0


@dataclass
class RunOptions:
    """Command-line overrides of the job spec."""

    output_dir: Path
    steps: int | None = None
    strategy: str | None = None
    resume: bool | None = None
    metrics_port: int | None = None


@dataclass
class RunSummary:
    """What the run did, for the CLI's final table."""

    steps_run: int
    first_step: int
    last_step: int
    policy_version: int
    resumed_from: str | None
    wall_seconds: float
    # The newest step only: a run's history is metrics.jsonl on disk (report.py streams it), never a list
    # in rank 0's memory, whose StepRecords carry per-sample lists and would grow for the whole run.
    last_record: StepRecord | None
    metrics_port: int | None
    # SIGTERM stopped the run before its last step (checkpointed): not a success.
    interrupted: bool = False


def status_metrics(rec: StepRecord) -> dict[str, float | int]:
    """The key metrics the trainer reports into the RLJob status."""
    return {
        "truncation_rate": rec.round.truncation_rate,
        "partial_rate": rec.round.partial_rate,
        "goodput_tokens_per_second": rec.goodput_tokens_per_s,
        "aborted_token_share": rec.aborted_token_share,
        "trainer_idle_seconds": rec.trainer_idle_seconds,
        "engine_idle_seconds": rec.engine_idle_seconds,
        "entropy": rec.train.entropy,
        "reward_mean": rec.batch.reward_mean,
        "kl": rec.train.kl,
        "off_policy_token_ratio": rec.batch.off_policy_token_ratio,
        "max_staleness": rec.batch.staleness_max,
        "rollout_tokens_per_second": rec.round.rollout_tokens_per_s,
        "response_length_mean": rec.batch.length_mean,
        "data_rows_skipped": sum(rec.data_rows_skipped.values()),
    }


class JobRunner:
    """Owns the parts of one job and runs its steps: the only process of a single-process job, rank 0
    of a multi-rank one (`distributed`)."""

    def __init__(self, job: RLJob, options: RunOptions, distributed: Distributed | None = None) -> None:
        if distributed is not None and not distributed.is_leader:
            raise ValueError("JobRunner runs on rank 0; ranks 1..N-1 run TrainingRank")
        self.job = job
        self.options = options
        self.distributed = distributed
        self.output_dir = options.output_dir
        self.settings = parts.loop_settings(job, options.steps, options.resume, options.metrics_port)
        self.version = 0
        self.step = 0
        self.scheduler: RolloutScheduler
        self.engines: list[Engine] = []
        self.transport: WeightTransport | None = None
        self.checkpoints = parts.build_checkpoints(job, distributed)
        self.metrics = parts.build_metrics(job, self.output_dir, os.environ)
        self.orders = OrderSender(distributed)
        self.metrics_port: int | None = None
        self.resumed_from: str | None = None
        # Newer checkpoint folders the resume passed over (torn or unloadable), as "name (reason)".
        self.skipped_checkpoints: list[str] = []
        self.knob_sources: list[KnobSource] = []
        # Called with every finished step (the local autotuner observes the runtime's own metrics).
        self.step_listeners: list[Callable[[StepRecord], None]] = []
        # In a trainer pod (RLJOB_STATUS_REPORT=1) progress goes into the RLJob's status.
        self.progress_reporter = ProgressReporter.from_env()
        self.stop_requested = False
        self.stopping = asyncio.Event()  # set with stop_requested, to wake a weight push waiting for engines
        self.eval_prompts: list[EvalPrompt] = []
        self.evals: list[EvalResult] = []  # this run's held-out evaluations, in order
        self.catch_up_syncs = 0  # mid-round syncs of unchanged weights to engines that came back behind
        self._last_step_end: float | None = None  # perf_counter at the previous step's end (wall time)

    # ------------------------------------------------------------------ setup

    async def setup(self, on_status: Callable[[str], None] = lambda _msg: None) -> None:
        """Load the policy, the data, the engines and the trainer; resume from a checkpoint."""
        from rljob.runtime.tasks.reward import GroupReward, RewardInput, build_reward

        job = self.job
        on_status("loading the policy")
        self.policy = parts.open_policy_for_training(job)
        model, self.tokenizer = self.policy.model, self.policy.tokenizer
        # Embedded engines copy the policy now, while its weights are whole (FSDP2 shards them in place).
        self.engines = parts.build_engines(job, model, detokenize=self.tokenizer.decode)
        self.trainer = parts.build_trainer(job, model, self.distributed)
        self.prompts = parts.build_prompts(job, self.tokenizer, model)
        spec = job.spec
        # Loaded here, before any engine starts: a bad reward.function fails the job at once.
        reward = build_reward(spec.reward, spec.rollout.max_response_length)
        decode = self.tokenizer.decode

        async def score_eval(prompts: Sequence[EvalPrompt], outputs: Sequence[list[int]]) -> list[float]:
            return await reward.score([
                RewardInput(prompt=p.text, response=decode(ids), answer=p.answer, metadata=p.metadata,
                            response_length=len(ids))
                for p, ids in zip(prompts, outputs, strict=True)
            ])

        self._score_eval = score_eval
        self.eval_prompts = parts.build_eval_prompts(job, self.prompts)

        on_status("starting the engines")
        await asyncio.gather(*(e.start() for e in self.engines))
        self.transport = parts.build_transport(job, self.engines, self.output_dir, self._write_model_config)
        self.scheduler = parts.build_scheduler(
            job, self.engines, self.prompts, self.policy.stop_token_ids, GroupReward(reward, decode),
            dynamic_sampling_filter if parts.dynamic_sampling_enabled(job) else None,
            strategy=self.options.strategy, recover=self._catch_up,
        )
        await self._start(on_status)

    async def _start(self, on_status: Callable[[str], None]) -> None:
        """Resume (every rank with rank 0), sync the starting weights, open /metrics."""
        resume = self.settings.resume
        self.orders.send(Order("resume", path=str(self.checkpoints.directory) if resume else None))
        if resume:
            rollback = self.job.spec.checkpoint.rollback_to
            if rollback is not None:  # the operator's RollbackToCheckpoint alert action: once per id
                result = self.checkpoints.roll_back(rollback.step, rollback.id)
                log.warning("spec.checkpoint.rollbackTo %s: %s", rollback.id, result.describe(rollback.step))
            on_status("looking for a checkpoint to resume from")
            template = self.trainer.checkpoint_state()
            loaded = self.checkpoints.load(template)
            if loaded is not None:
                assert loaded.leader_state is not None
                self.trainer.load_checkpoint_state(template)
                self._restore(loaded)
                self.resumed_from = self.checkpoints.location(loaded.path)
                self.skipped_checkpoints = [str(s) for s in loaded.skipped]
                self.metrics.checkpoints_skipped.inc(len(loaded.skipped))
        # Resumed or not, the engines get the weights this run starts from: live workers may serve another
        # version (a gang restart before the first checkpoint, or resume: false, while they serve k > 0),
        # and a worker at another version is never in the rotation, so the first round would wait for ever.
        on_status("syncing the weights to the engines")
        await self._sync_weights()
        if self.settings.metrics_port:
            self.metrics_port = self.metrics.serve(self.settings.metrics_host, self.settings.metrics_port)
        self.metrics.set_knobs(knob_values(self.scheduler))

    def _restore(self, loaded: LoadedCheckpoint) -> None:
        """Rank 0's part of a resume: data cursor, buffer, counters, RNG and the engines' generators."""
        state = loaded.leader_state
        assert state is not None
        self.prompts.load_state_dict(state["data"])
        self.scheduler.load_state_dict(state["scheduler"])
        if loaded.rng is not None:
            set_rng_state(loaded.rng)
            for engine, sampling in zip(self.engines, loaded.rng.get("engines", []), strict=False):
                engine.load_sampling_state(sampling)
        self.step = state["step"]
        self.version = state["version"]

    def leader_state(self) -> dict[str, Any]:
        """What only rank 0 has and a restart needs: counters, data cursor, the partial buffer, the spec."""
        return {
            "step": self.step,
            "version": self.version,
            "data": self.prompts.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "job": self.job.to_wire(),
        }

    # ------------------------------------------------------------------ steps

    @property
    def total_steps(self) -> int:
        return self.settings.total_steps

    async def run(self, on_step: Callable[[StepRecord], None] = lambda _r: None) -> RunSummary:
        """Run until `total_steps` steps are done (counting steps before a resume)."""
        started = time.perf_counter()
        first = self.step + 1
        steps_run = 0
        last: StepRecord | None = None
        self._stop_on_sigterm()
        if self.eval_prompts and self.step == 0:
            await self.evaluate()  # the starting point of the learning curve
        while self.step < self.total_steps and not self.stop_requested:
            last = await self.run_step()
            steps_run += 1
            on_step(last)
        interrupted = self.stop_requested and self.step < self.total_steps
        if self.stop_requested:
            log.warning("stopped by SIGTERM after step %d; the checkpoint of that step is written", self.step)
        self.orders.send(Order("stop", interrupted=interrupted))
        if self.progress_reporter is not None:
            self.progress_reporter.flush()
        await self.close()
        return RunSummary(
            steps_run=steps_run,
            first_step=first,
            last_step=self.step,
            policy_version=self.version,
            resumed_from=self.resumed_from,
            wall_seconds=time.perf_counter() - started,
            last_record=last,
            metrics_port=self.metrics_port,
            interrupted=interrupted,
        )

    def poll_knobs(self) -> None:
        """Apply knob changes from every source; called between rounds only."""
        for source in self.knob_sources:
            values = source.poll()
            if values is None:
                continue
            for change in apply_knobs(self.scheduler, values):
                log.info("knob change from %s: %s (%s)", values.source or "source", change, values.reason)

    async def run_step(self) -> StepRecord:
        """One round, one optimizer step, one weight sync; metrics and checkpoint."""
        self.poll_knobs()
        knobs = knob_values(self.scheduler)
        log.info("step %d started: rollout round at policy version %d", self.step + 1, self.version)
        t0 = time.perf_counter()
        result = await self.scheduler.run_round(self.version)
        t1 = time.perf_counter()
        mine = self.orders.hand_out(result.groups, self.version)  # the whole batch in a single process
        # Metrics of the whole batch on every rank (the trainer all-reduces them): recorded here only.
        # Under the async strategy the engines keep generating meanwhile, until the sync below.
        train_metrics = await self.scheduler.generate_during(
            asyncio.to_thread(self.trainer.train_step, mine, self.version))
        t2 = time.perf_counter()
        self.version += 1
        self.step += 1
        sync = await self._sync_weights(stoppable=True)
        t3 = time.perf_counter()
        # The step boundary: SIGTERM on any rank stops the group after this step, checkpointed below.
        self.stop_requested = self.orders.agree_to_stop(self.stop_requested)
        since = t0 if self._last_step_end is None else self._last_step_end
        self._last_step_end = t3
        record = step_record(
            self.step,
            self.version - 1,
            result,
            train_metrics,
            {"rollout": t1 - t0, "train": t2 - t1, "sync": t3 - t2, "wall": t3 - since},
            knobs,
            self._ceiling(),
            sync,
        )
        record.data_rows_skipped = dict(self.prompts.skipped)
        every = self.settings.eval_every
        if self.eval_prompts and (self.step % every == 0 or self.step == self.total_steps):
            evaluation = await self.evaluate()
            record.eval_reward = evaluation.reward_mean if evaluation is not None else None
        self.metrics.record(record)
        for listener in self.step_listeners:
            listener(record)
        if self.step % self.settings.checkpoint_every == 0 or self.step == self.total_steps or self.stop_requested:
            self.save_checkpoint()
        if self.progress_reporter is not None:
            self.progress_reporter.report(step=self.step, policy_version=self.version, metrics=status_metrics(record))
        return record

    async def evaluate(self) -> EvalResult | None:
        """Score the served policy on the held-out prompts (engines idle between rounds)."""
        settings = self.settings
        result = await evaluate_held_out(
            self.engines,
            self.eval_prompts,
            self._score_eval,
            step=self.step,
            policy_version=self.version,
            temperature=settings.eval_temperature,
            max_new_tokens=settings.max_new_tokens,
            stop_token_ids=self.policy.stop_token_ids,
            stop=list(settings.stop),
        )
        if result is not None:
            self.evals.append(result)
            self.metrics.record_eval(result)
            log.info("held-out evaluation at step %d: reward %.3f on %d prompts (%.1f s)",
                     result.step, result.reward_mean, result.prompts, result.seconds)
        return result

    def save_checkpoint(self) -> Path:
        """Write a checkpoint of the current step (every rank writes its part) and tell the RLJob status about it."""
        self.orders.send(Order("checkpoint", step=self.step))
        rng = {**rng_state(), "engines": [e.sampling_state() for e in self.engines]}
        # A stopping trainer keeps the older checkpoints: its successor may be a rollback to one of them.
        path = self.checkpoints.save(self.step, self.trainer.checkpoint_state(), rng, self.leader_state(),
                                     prune=not self.stop_requested)
        if self.progress_reporter is not None:
            self.progress_reporter.report_checkpoint(self.step, self.checkpoints.location(path))
        return path

    def _stop_on_sigterm(self) -> None:
        """Pod termination: finish the step in flight, checkpoint it, exit (nothing generated is lost)."""

        def request_stop() -> None:
            self.stop_requested = True
            self.stopping.set()

        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, request_stop)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests, notebooks)
            pass

    async def _catch_up(self) -> bool:
        """The scheduler's `recover`, called mid-round while no engine can generate: when some engine
        answers at another version (its workers restarted with their start-up weights), push the current
        weights again (they do not change during a round; every rank joins the gather). True if it synced."""
        behind = [e.name for e in self.engines if e.needs_catch_up()]
        if not behind:
            return False
        log.warning("no engine serves weight version %d but %s answer at another version (restarted?): "
                    "pushing the current weights again mid-round", self.version, ", ".join(behind))
        await self.resync_weights()
        return True

    async def resync_weights(self) -> SyncReport:
        """Push the current weights again as the current version, every rank joining the gather (a `sync`
        order): between steps the weights are those of the last sync, so this only catches engines up."""
        self.orders.send(Order("sync"))
        report = await self._sync_weights()
        self.catch_up_syncs += 1
        return report

    async def _sync_weights(self, stoppable: bool = False) -> SyncReport:
        """Push the trainer's weights as ``self.version`` through the job's weight transport; returns
        once at least one engine serves that version (engines that missed it left the rotation).

        In a multi-rank job the transport streams the full weights from the FSDP2 shards, one bucket
        gathered at a time (GatheredWeights: every rank joins each gather, a retry orders another).
        `stoppable` (a step's push): after SIGTERM the push gets STOP_PUSH_GRACE_S more, then is given
        up (the pass the other ranks are in is pulled to its end); the step's checkpoint keeps the
        weights and every start syncs them (the report then names no engine updated)."""
        from rljob.runtime.weights.factory import sync_until_served
        from rljob.runtime.weights.buckets import Bucket, module_buckets

        assert self.transport is not None
        bucket, timeout = self.settings.sync_bucket_bytes, self.settings.sync_timeout_s
        if self.distributed is None:
            def source(dtype: torch.dtype | None) -> Iterator[Bucket]:
                return module_buckets(self.trainer.model, bucket, dtype)

            report = await self._push(sync_until_served(self.transport, self.version, source, timeout), stoppable)
        else:
            gathered = GatheredWeights(self.trainer.backend, bucket, self.orders)
            try:
                report = await self._push(sync_until_served(self.transport, self.version, gathered, timeout), stoppable)
            finally:
                await asyncio.to_thread(gathered.finish_pass)
        for rank, reason in report.failed.items():
            log.error("weight sync of version %d to %s failed: %s", self.version, rank, reason)
        return report

    async def _push(self, push: Coroutine[Any, Any, SyncReport], stoppable: bool) -> SyncReport:
        """Await `push`; when `stoppable`, once SIGTERM came, at most STOP_PUSH_GRACE_S more (see `_sync_weights`)."""
        if not stoppable:
            return await push
        assert self.transport is not None
        pushing = asyncio.ensure_future(push)
        stopping = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait({pushing, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not pushing.done():
                await asyncio.wait({pushing}, timeout=STOP_PUSH_GRACE_S)
        finally:
            stopping.cancel()
            if not pushing.done():
                pushing.cancel()
            await asyncio.gather(pushing, stopping, return_exceptions=True)
        if not pushing.cancelled():
            return pushing.result()  # raises what the push raised
        log.warning("weight version %d not pushed to the engines: stopping on SIGTERM, none served it within %.0f s "
                    "(the step's checkpoint keeps the weights; the next start syncs them)", self.version,
                    STOP_PUSH_GRACE_S)
        return SyncReport(self.version, self.transport.mode, failed={"engines": "not pushed: stopping on SIGTERM"})

    def _write_model_config(self, folder: Path) -> None:
        """Config files beside a disk snapshot, so the engines can load it as a model folder."""
        model: Any = self.trainer.model  # a Hugging Face model (nn.Module's attributes type as Tensor | Module)
        model.config.save_pretrained(folder)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(folder)

    def _ceiling(self) -> float:
        """Sum of the engines' bubble-free decode rates (engines that can estimate it)."""
        return sum(e.ceiling_tokens_per_s() or 0.0 for e in self.engines)

    async def close(self) -> None:
        if self.transport is not None:
            await self.transport.close()
        await asyncio.gather(*(e.close() for e in self.engines), return_exceptions=True)
