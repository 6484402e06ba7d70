"""The step loop of one RLJob: rollout round, train, weight sync, metrics, checkpoint.

`JobRunner` runs the steps; every decision lives in the parts (scheduler, strategy, trainer, truncation
policy), which job_parts.py builds from the spec. The same loop runs in `rljob run` on a laptop and in
the trainer pod of the operator (engine `sglang`). In a multi-rank job it is rank 0, and keeps the other
ranks in step with the orders of ranks.py; each step's measurements go into a `StepRecord`
(step_record.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rljob.api.spec import RLJob
from rljob.common.progress_reporter import ProgressReporter
from rljob.runtime import job_parts as parts
from rljob.runtime.checkpoint import LoadedCheckpoint, rng_state, set_rng_state
from rljob.runtime.engines.base import Engine
from rljob.runtime.evaluation import EvalPrompt, EvalResult, evaluate_held_out
from rljob.runtime.knobs import KnobSource, apply_knobs, knob_values
from rljob.runtime.ranks import SYNC_BUCKET_BYTES, Order, OrderSender
from rljob.runtime.rollout.scheduler import RolloutScheduler
from rljob.runtime.rollout.scoring import dynamic_sampling_filter
from rljob.runtime.step_record import StepRecord, step_record
from rljob.runtime.training.distributed import Distributed
from rljob.runtime.weights.transport import SyncReport, WeightTransport

log = logging.getLogger(__name__)


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
    records: list[StepRecord]
    metrics_port: int | None
    # SIGTERM stopped the run before its last step (checkpointed): not a success.
    interrupted: bool = False


def status_metrics(rec: StepRecord) -> dict[str, float | int]:
    """The key metrics the trainer reports into the RLJob status."""
    return {
        "truncation_rate": rec.round.truncation_rate,
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
        self.eval_prompts: list[EvalPrompt] = []
        self.evals: list[EvalResult] = []  # this run's held-out evaluations, in order
        self.catch_up_syncs = 0  # mid-round syncs of unchanged weights to engines that came back behind

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
        records = []
        self._stop_on_sigterm()
        if self.eval_prompts and self.step == 0:
            await self.evaluate()  # the starting point of the learning curve
        while self.step < self.total_steps and not self.stop_requested:
            records.append(await self.run_step())
            on_step(records[-1])
        if self.stop_requested:
            log.warning("stopped by SIGTERM after step %d; the checkpoint of that step is written", self.step)
        self.orders.send(Order("stop"))
        if self.progress_reporter is not None:
            self.progress_reporter.flush()
        await self.close()
        return RunSummary(
            steps_run=len(records),
            first_step=first,
            last_step=self.step,
            policy_version=self.version,
            resumed_from=self.resumed_from,
            wall_seconds=time.perf_counter() - started,
            records=records,
            metrics_port=self.metrics_port,
            interrupted=self.stop_requested and self.step < self.total_steps,
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
        sync = await self._sync_weights()
        t3 = time.perf_counter()
        record = step_record(
            self.step,
            self.version - 1,
            result,
            train_metrics,
            {"rollout": t1 - t0, "train": t2 - t1, "sync": t3 - t2},
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
        path = self.checkpoints.save(self.step, self.trainer.checkpoint_state(), rng, self.leader_state())
        if self.progress_reporter is not None:
            self.progress_reporter.report_checkpoint(self.step, self.checkpoints.location(path))
        return path

    def _stop_on_sigterm(self) -> None:
        """Pod termination: finish the step in flight, checkpoint it, exit (nothing generated is lost)."""

        def request_stop() -> None:
            self.stop_requested = True

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

    async def _sync_weights(self) -> SyncReport:
        """Push the trainer's weights as ``self.version`` through the job's weight transport; returns
        once at least one engine serves that version (engines that missed it left the rotation).

        In a multi-rank job the full weights are gathered from the FSDP2 shards first, once (every rank
        joins: TrainingRank gathers right after its train step, after a resume order and on a sync order),
        so a retried sync resends them without another collective."""
        from rljob.runtime.weights.factory import sync_until_served
        from rljob.runtime.weights.buckets import Bucket, module_buckets, named_buckets

        assert self.transport is not None
        bucket = self.settings.sync_bucket_bytes
        source: Callable[[], Iterator[Bucket]]
        if self.distributed is None:
            source = lambda: module_buckets(self.trainer.model, bucket)  # noqa: E731
        else:
            full = await asyncio.to_thread(self._full_weights)
            source = lambda: named_buckets(full.items(), bucket)  # noqa: E731
        report = await sync_until_served(self.transport, self.version, source, self.settings.sync_timeout_s)
        for rank, reason in report.failed.items():
            log.error("weight sync of version %d to %s failed: %s", self.version, rank, reason)
        return report

    def _write_model_config(self, folder: Path) -> None:
        """Config files beside a disk snapshot, so the engines can load it as a model folder."""
        model: Any = self.trainer.model  # a Hugging Face model (nn.Module's attributes type as Tensor | Module)
        model.config.save_pretrained(folder)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(folder)

    def _full_weights(self) -> dict[str, torch.Tensor]:
        return {n: t for bucket in self.trainer.backend.iter_full_weights(SYNC_BUCKET_BYTES) for n, t in bucket}

    def _ceiling(self) -> float:
        """Sum of the engines' bubble-free decode rates (engines that can estimate it)."""
        return sum(e.ceiling_tokens_per_s() or 0.0 for e in self.engines)

    async def close(self) -> None:
        if self.transport is not None:
            await self.transport.close()
        await asyncio.gather(*(e.close() for e in self.engines), return_exceptions=True)
