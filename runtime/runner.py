"""The training loop of one RLJob: rollout round, train, weight sync, metrics, checkpoint.

`JobRunner` wires the parts together; every decision lives in the parts (scheduler, strategy,
trainer, truncation policy). The same loop runs in `rljob run` on a laptop and in the trainer pod
of the operator (engine `sglang`).

A multi-rank job (torchrun, `rljob run --nproc N`; docs/distributed.md) splits the roles:

- rank 0 runs `JobRunner`: the rollout scheduler, the engines, the buffer, evaluation, status,
  metrics and the checkpoint's scheduler state. Each step it hands every rank its share of the
  accepted groups (balanced by tokens) and trains its own share;
- ranks 1..N-1 run `TrainingRank`: they train the groups rank 0 sends them and join every
  collective (FSDP2, the weight gather of a sync, the checkpoint), and do nothing else.

Rank 0's `Order`s keep the ranks in step: resume, train, sync, checkpoint, stop. Every order after
which rank 0 pushes weights (resume, train, sync) has every rank join the gather of the full weights.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from rljob.api.spec import RLJob
from rljob.common.status_reporter import StatusReporter
from rljob.runtime.batch_stats import summarize_batch
from rljob.runtime.checkpoint import CheckpointManager, LoadedCheckpoint, checkpoint_store, rng_state, set_rng_state
from rljob.runtime.engines.base import Engine
from rljob.runtime.evaluation import EvalPrompt, EvalResult, evaluate_held_out
from rljob.runtime.knobs import KnobSource, apply_knobs
from rljob.runtime.metrics import RuntimeMetrics, StepRecord, serve_readiness
from rljob.runtime.rollout.sample import Group
from rljob.runtime.rollout.scheduler import RolloutConfig, RolloutScheduler, RoundResult
from rljob.runtime.rollout.scoring import dynamic_sampling_filter
from rljob.runtime.rollout.strategy import Strategy, make_strategy
from rljob.runtime.rollout.truncation import TruncationPolicy
from rljob.runtime.training.balance import balance_by_tokens
from rljob.runtime.training.distributed import Distributed
from rljob.runtime.weights.transport import SyncReport, WeightTransport

if TYPE_CHECKING:
    from rljob.runtime.trainer import Trainer

log = logging.getLogger(__name__)

# Full weights gathered from the FSDP2 shards for a sync, at most this much at a time per bucket.
SYNC_BUCKET_BYTES = 64 << 20


@dataclass
class Order:
    """Rank 0's instruction to the other ranks, scattered on the control group (one per rank)."""

    # resume: load `path` (if any) and join the start's weight sync; train: train `groups`, join the sync;
    # sync: join a catch-up sync of the unchanged weights (mid-round); checkpoint; stop.
    kind: Literal["resume", "train", "sync", "checkpoint", "stop"]
    version: int = 0  # train: the policy version the groups were generated against
    step: int = 0  # checkpoint: the step being saved
    groups: list[Group] = field(default_factory=list)  # train: this rank's share
    # resume: the checkpoint directory, whose newest loadable complete checkpoint every rank loads
    # together (CheckpointManager.load); None: start fresh.
    path: str | None = None


def group_tokens(group: Group) -> int:
    """Prompt plus response tokens of a group: the work it costs a trainer rank."""
    return sum(len(s.prompt_ids) + s.response_length for s in group.samples)


def build_trainer(job: RLJob, model: torch.nn.Module, distributed: Distributed | None) -> Trainer:
    """The job's trainer over `model` (sharded in place under FSDP2 when `distributed`)."""
    from rljob.runtime.trainer import Trainer

    spec = job.spec
    return Trainer(
        model,
        spec.algorithm,
        spec.trainer.micro_batch_size,
        distributed.device(spec.trainer.device) if distributed is not None else spec.trainer.device,
        temperature=spec.rollout.temperature,  # log-probs of the distribution the engines sample
        total_steps=spec.trainer.steps,
        logprob_chunk_tokens=spec.trainer.logprob_chunk_tokens,
        seed=spec.trainer.seed,
        distributed=distributed,
    )


def open_policy_for_training(job: RLJob) -> Any:
    """The job's policy (model and tokenizer), with gradient checkpointing when the spec asks for it."""
    from rljob.runtime.models.loading import enable_gradient_checkpointing, torch_dtype
    from rljob.runtime.tasks.policy import open_policy

    policy = open_policy(job.spec.model, dtype=torch_dtype(job.spec.trainer.dtype))
    if job.spec.trainer.gradient_checkpointing:
        enable_gradient_checkpointing(policy.model)
    return policy


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


def build_strategy(job: RLJob, name: str | None = None) -> Strategy:
    """The rollout strategy of the spec (or the override)."""
    r = job.spec.rollout
    return make_strategy(name or r.strategy, over_sampling=r.partial.over_sampling)


def build_truncation(job: RLJob) -> TruncationPolicy:
    t = job.spec.rollout.partial.truncation
    return TruncationPolicy(mode=t.mode, k=t.k, max_tokens=t.max_tokens, min_samples=t.min_samples)


def rollout_config(job: RLJob, stop_token_ids: list[int]) -> RolloutConfig:
    r = job.spec.rollout
    return RolloutConfig(
        batch_size=r.rollout_batch_size,
        samples_per_prompt=r.samples_per_prompt,
        max_response_length=r.max_response_length,
        temperature=r.temperature,
        top_p=r.top_p,
        max_staleness=r.partial.max_staleness,
        stop_token_ids=stop_token_ids,
        stop=list(r.stop),
        drain_timeout_s=r.sglang.drain_timeout_seconds,
        engine_wait_timeout_s=r.engine_wait_timeout_seconds,
    )


def current_knobs(scheduler: RolloutScheduler) -> dict[str, float]:
    """The partial-rollout knob values in force (exported with every step)."""
    knobs = {
        "over_sampling": float(getattr(scheduler.strategy, "over_sampling", 1.0)),
        "max_staleness": float(scheduler.config.max_staleness),
        "truncation_k": float(scheduler.truncation.k) if scheduler.truncation.mode == "sigma" else 0.0,
    }
    knobs["segment_cap_tokens"] = float(scheduler.segment_cap() or 0)
    return knobs


def status_metrics(rec: StepRecord) -> dict[str, float | int]:
    """The key metrics the trainer reports into the RLJob status."""
    return {
        "truncation_rate": rec.truncation_rate,
        "entropy": rec.entropy,
        "reward_mean": rec.reward_mean,
        "kl": rec.kl,
        "off_policy_token_ratio": rec.off_policy_token_ratio,
        "max_staleness": rec.staleness_max,
        "rollout_tokens_per_second": rec.rollout_tokens_per_s,
        "response_length_mean": rec.length_mean,
    }


def metrics_namespace(job: RLJob, environ: Mapping[str, str]) -> str:
    """The namespace the job's metrics carry (`rljob_namespace`, which the autotuner selects on): the
    RLJob object's, RLJOB_NAMESPACE (as the status reporter and the knob source use it), else the job
    file's metadata. A trainer pod's rendered job file need not carry a namespace; its env always does."""
    return environ.get("RLJOB_NAMESPACE") or job.metadata.namespace or ""


def step_record(
    step: int,
    trained_version: int,
    result: RoundResult,
    train_metrics: Any,
    timings: dict[str, float],
    knobs: dict[str, float],
    ceiling: float,
    sync: SyncReport | None,
) -> StepRecord:
    """Combine round, batch and training statistics into one record (pure)."""
    rs = result.stats
    bs = summarize_batch(result.groups, trained_version)
    tm = (lambda name: float(getattr(train_metrics, name, 0.0) or 0.0)) if train_metrics is not None else (lambda _: 0.0)
    return StepRecord(
        step=step,
        policy_version=trained_version + 1,
        strategy=rs.strategy,
        time=time.time(),
        step_seconds=sum(timings.values()),
        rollout_seconds=timings.get("rollout", 0.0),
        train_seconds=timings.get("train", 0.0),
        sync_seconds=timings.get("sync", 0.0),
        tokens_generated=rs.tokens_generated,
        rollout_tokens_per_s=rs.tokens_per_second,
        ceiling_tokens_per_s=ceiling,
        truncation_rate=rs.truncation_rate,
        cap_hit_rate=rs.cap_hit_samples / rs.launched_samples if rs.launched_samples else 0.0,
        launched_samples=rs.launched_samples,
        partial_samples=rs.partial_samples,
        resumed_samples=rs.resumed_samples,
        regenerated_samples=rs.regenerated_samples,
        resumed_prefix_tokens=rs.resumed_prefix_tokens,
        off_policy_token_ratio=bs.off_policy_token_ratio,
        fork_off_policy_ratio=rs.fork_off_policy_ratio,
        staleness_max=bs.staleness_max,
        staleness_mean=bs.staleness_mean,
        buffer_groups=rs.buffer_groups_after,
        surplus_groups=rs.surplus_groups,
        dropped_groups=rs.dropped_groups,
        wasted_tokens=rs.wasted_tokens,
        abort_drain_seconds=rs.abort_drain_seconds,
        engine_errors=rs.engine_errors,
        weight_sync_failures=len(sync.failed) if sync is not None else 0,
        engines_in_rotation=len(sync.updated) if sync is not None else 0,
        new_groups=rs.new_groups,
        buffer_groups_before=rs.buffer_groups_before,
        trained_groups=rs.trained_groups,
        buffered_groups=rs.buffered_groups,
        discarded_groups=rs.discarded_groups,
        discarded_stale_tokens=rs.discarded_stale_tokens,
        discarded_tokens=rs.discarded_tokens,
        trained_tokens=rs.trained_tokens,
        buffer_tokens_before=rs.buffer_tokens_before,
        buffer_tokens_after=rs.buffer_tokens_after,
        length_mean=bs.length_mean,
        length_std=bs.length_std,
        length_p50=bs.length_p50,
        length_p99=bs.length_p99,
        length_max=bs.length_max,
        reward_mean=bs.reward_mean,
        entropy=tm("entropy"),
        kl=tm("kl"),
        clip_fraction=tm("clip_frac"),
        loss=tm("loss"),
        grad_norm=tm("grad_norm"),
        knobs=knobs,
        staleness=bs.staleness,
        lengths=bs.lengths,
    )


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
        self.spec = job.spec
        self.version = 0
        self.step = 0
        self.scheduler: RolloutScheduler
        self.engines: list[Engine] = []
        self.transport: WeightTransport | None = None
        self.checkpoints = CheckpointManager(self.spec.checkpoint.dir, keep=self.spec.checkpoint.keep,
                                             distributed=distributed, store=checkpoint_store(self.spec.checkpoint))
        jsonl = Path(self.spec.metrics.jsonl) if self.spec.metrics.jsonl else self.output_dir / "metrics.jsonl"
        self.metrics = RuntimeMetrics(job.metadata.name, jsonl, namespace=metrics_namespace(job, os.environ))
        self.metrics_port: int | None = None
        self.resumed_from: str | None = None
        # Newer checkpoint folders the resume passed over (torn or unloadable), as "name (reason)".
        self.skipped_checkpoints: list[str] = []
        self.knob_sources: list[KnobSource] = []
        # Called with every finished step (the local autotuner observes the runtime's own metrics).
        self.step_listeners: list[Callable[[StepRecord], None]] = []
        # In a trainer pod (RLJOB_STATUS_REPORT=1) progress goes into the RLJob's status.
        self.status_reporter = StatusReporter.from_env()
        self.stop_requested = False
        self.eval_prompts: list[EvalPrompt] = []
        self.evals: list[EvalResult] = []  # this run's held-out evaluations, in order
        self.catch_up_syncs = 0  # mid-round syncs of unchanged weights to engines that came back behind

    # ------------------------------------------------------------------ setup

    async def setup(self, on_status: Callable[[str], None] = lambda _msg: None) -> None:
        """Load the policy, the data, the engines and the trainer; resume from a checkpoint."""
        from rljob.runtime.engines.factory import build_engines
        from rljob.runtime.tasks.dataset import PromptStream, held_out_records
        from rljob.runtime.tasks.reward import GroupReward, RewardInput, build_reward

        spec = self.spec
        on_status("loading the policy")
        self.policy = open_policy_for_training(self.job)
        model, self.tokenizer = self.policy.model, self.policy.tokenizer
        # Embedded engines copy the policy now, while its weights are whole (FSDP2 shards them in place).
        self.engines = build_engines(spec.rollout, model, detokenize=self.tokenizer.decode)
        self.trainer = build_trainer(self.job, model, self.distributed)
        self.prompts = PromptStream.from_spec(spec.data, self.tokenizer)
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
        if spec.evaluation.every_steps:
            render = self.prompts.renderer.render
            self.eval_prompts = [
                EvalPrompt(rendered.ids, row.answer, rendered.text, dict(row.metadata))
                for row in held_out_records(spec.data, spec.evaluation)
                for rendered in [render(row.prompt, row.messages)]
            ]

        on_status("starting the engines")
        await asyncio.gather(*(e.start() for e in self.engines))
        from rljob.runtime.weights.factory import build_transport

        self.transport = build_transport(spec.rollout, self.engines, self.output_dir, self._write_model_config)
        self.scheduler = RolloutScheduler(
            self.engines,
            rollout_config(self.job, self.policy.stop_token_ids),
            build_strategy(self.job, self.options.strategy),
            self.prompts,
            None,
            truncation=build_truncation(self.job),
            group_filter=dynamic_sampling_filter if spec.algorithm.effective_dynamic_sampling else None,
            scorer=GroupReward(reward, decode),
            recover=self._catch_up,
        )
        resume = spec.checkpoint.resume if self.options.resume is None else self.options.resume
        self._order(Order("resume", path=str(self.checkpoints.directory) if resume else None))
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
        port = self.options.metrics_port if self.options.metrics_port is not None else spec.metrics.port
        if port:
            self.metrics_port = self.metrics.serve(spec.metrics.host, port)
        self.metrics.set_knobs(current_knobs(self.scheduler))

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

    def _order(self, order: Order, shares: list[list[Group]] | None = None) -> None:
        """Send `order` to ranks 1..N-1 (with shares[r] as rank r's groups); nothing in a single process."""
        if self.distributed is None:
            return
        world = self.distributed.world_size
        self.distributed.scatter([
            Order(order.kind, order.version, order.step, shares[r] if shares else [], order.path) for r in range(world)
        ])

    def _hand_out(self, groups: list[Group]) -> list[Group]:
        """Send every other rank its token-balanced share of the round's groups; returns rank 0's."""
        if self.distributed is None:
            return groups
        indices = balance_by_tokens([group_tokens(g) for g in groups], self.distributed.world_size)
        shares = [[groups[i] for i in share] for share in indices]
        self._order(Order("train", version=self.version), shares)
        return shares[0]

    # ------------------------------------------------------------------ steps

    @property
    def total_steps(self) -> int:
        return self.options.steps or self.spec.trainer.steps

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
        self._order(Order("stop"))
        if self.status_reporter is not None:
            self.status_reporter.flush()
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
        knobs = current_knobs(self.scheduler)
        t0 = time.perf_counter()
        result = await self.scheduler.run_round(self.version)
        t1 = time.perf_counter()
        mine = self._hand_out(result.groups)  # the whole batch in a single process
        # Metrics of the whole batch on every rank (the trainer all-reduces them): recorded here only.
        train_metrics = await asyncio.to_thread(self.trainer.train_step, mine, self.version)
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
        every = self.spec.evaluation.every_steps
        if self.eval_prompts and (self.step % every == 0 or self.step == self.total_steps):
            result = await self.evaluate()
            record.eval_reward = result.reward_mean if result is not None else None
        self.metrics.record(record)
        for listener in self.step_listeners:
            listener(record)
        if self.step % self.spec.checkpoint.every_steps == 0 or self.step == self.total_steps or self.stop_requested:
            self.save_checkpoint()
        if self.status_reporter is not None:
            self.status_reporter.report(step=self.step, policy_version=self.version, metrics=status_metrics(record))
        return record

    async def evaluate(self) -> EvalResult | None:
        """Score the served policy on the held-out prompts (engines idle between rounds)."""
        r = self.spec.rollout
        temperature = self.spec.evaluation.temperature
        result = await evaluate_held_out(
            self.engines,
            self.eval_prompts,
            self._score_eval,
            step=self.step,
            policy_version=self.version,
            temperature=r.temperature if temperature is None else temperature,
            max_new_tokens=r.max_response_length,
            stop_token_ids=self.policy.stop_token_ids,
            stop=list(self.spec.rollout.stop),
        )
        if result is not None:
            self.evals.append(result)
            self.metrics.record_eval(result)
            log.info("held-out evaluation at step %d: reward %.3f on %d prompts (%.1f s)",
                     result.step, result.reward_mean, result.prompts, result.seconds)
        return result

    def save_checkpoint(self) -> Path:
        """Write a checkpoint of the current step (every rank writes its part) and tell the RLJob status about it."""
        self._order(Order("checkpoint", step=self.step))
        rng = {**rng_state(), "engines": [e.sampling_state() for e in self.engines]}
        path = self.checkpoints.save(self.step, self.trainer.checkpoint_state(), rng, self.leader_state())
        if self.status_reporter is not None:
            self.status_reporter.report_checkpoint(self.step, self.checkpoints.location(path))
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
        self._order(Order("sync"))
        report = await self._sync_weights()
        self.catch_up_syncs += 1
        return report

    async def _sync_weights(self) -> SyncReport:
        """Push the trainer's weights as ``self.version`` through the job's weight transport; returns
        once at least one engine serves that version (engines that missed it left the rotation).

        In a multi-rank job the full weights are gathered from the FSDP2 shards first, once (every rank
        joins: TrainingRank gathers right after its train step, after a resume order and on a sync order),
        so a retried sync resends them without another collective."""
        from rljob.runtime.weights.buckets import Bucket, module_buckets, named_buckets
        from rljob.runtime.weights.factory import sync_until_served

        assert self.transport is not None
        t = self.spec.rollout.weight_transport
        bucket = int(t.bucket_megabytes * 2**20)
        source: Callable[[], Iterator[Bucket]]
        if self.distributed is None:
            source = lambda: module_buckets(self.trainer.model, bucket)  # noqa: E731
        else:
            full = await asyncio.to_thread(self._full_weights)
            source = lambda: named_buckets(full.items(), bucket)  # noqa: E731
        report = await sync_until_served(self.transport, self.version, source, t.timeout_seconds)
        for rank, reason in report.failed.items():
            log.error("weight sync of version %d to %s failed: %s", self.version, rank, reason)
        return report

    def _write_model_config(self, folder: Path) -> None:
        """Config files beside a disk snapshot, so the engines can load it as a model folder."""
        model = self.trainer.model
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


class TrainingRank:
    """Ranks 1..N-1 of a multi-rank job: train the groups rank 0 hands out and join every collective
    (FSDP2's, the weight gather of a sync, the checkpoint). No engines, data, metrics or status."""

    def __init__(self, job: RLJob, distributed: Distributed) -> None:
        if distributed.is_leader:
            raise ValueError("rank 0 runs JobRunner, not TrainingRank")
        self.job = job
        self.distributed = distributed
        spec = job.spec
        self.checkpoints = CheckpointManager(spec.checkpoint.dir, keep=spec.checkpoint.keep, distributed=distributed)
        self.trainer = build_trainer(job, open_policy_for_training(job).model, distributed)
        self.steps_trained = 0
        # Once its part is built, the pod's probe may pass: without an answer, the pods of ranks 1..N-1
        # never turned Ready and the job never left Starting (found on the real node).
        self.probe_port = (serve_readiness(spec.metrics.host, spec.metrics.port)
                           if spec.metrics.port and distributed.env.answers_pod_probe else None)

    def run(self) -> int:
        """Follow rank 0's orders until it says stop; returns the steps trained here."""
        while True:
            order: Order = self.distributed.scatter()
            if order.kind == "resume":
                if order.path is not None:
                    template = self.trainer.checkpoint_state()
                    loaded = self.checkpoints.load(template)  # collective: rank 0 picks, all must load it
                    if loaded is not None:
                        self.trainer.load_checkpoint_state(template)
                        if loaded.rng is not None:
                            set_rng_state(loaded.rng)
                self._join_weight_sync()  # every start syncs, resumed or not
            elif order.kind == "sync":
                self._join_weight_sync()
            elif order.kind == "train":
                self.trainer.train_step(order.groups, order.version)
                self.steps_trained += 1
                self._join_weight_sync()
            elif order.kind == "checkpoint":
                self.checkpoints.save(order.step, self.trainer.checkpoint_state(), rng_state())
            elif order.kind == "stop":
                return self.steps_trained

    def _join_weight_sync(self) -> None:
        for _ in self.trainer.backend.iter_full_weights(SYNC_BUCKET_BYTES):
            pass  # the gathers run; the buckets go to rank 0 only


async def compare_strategies(
    runner: JobRunner,
    rounds: int,
    strategies: tuple[str, ...] = ("sync", "april"),
    warmup_rounds: int = 1,
    on_round: Callable[[str, int, RoundResult], None] = lambda _s, _i, _r: None,
) -> dict[str, Any]:
    """Rollout-only comparison of strategies on the runner's current policy (see compare.py)."""
    from rljob.runtime.compare import comparison_table, compare_rollouts, measure_ceiling
    from rljob.runtime.engines.factory import build_engines
    from rljob.runtime.tasks.dataset import PromptStream

    spec = runner.spec
    model = runner.trainer.model
    engines: list[Engine] = []
    schedulers = {}
    for name in strategies:
        engine_set = build_engines(spec.rollout, model, seed=spec.trainer.seed, detokenize=runner.tokenizer.decode)
        engines += engine_set
        schedulers[name] = RolloutScheduler(
            engine_set,
            rollout_config(runner.job, runner.policy.stop_token_ids),
            build_strategy(runner.job, name),
            PromptStream.from_spec(spec.data, runner.tokenizer),
            runner.scheduler.scoring.score,
            truncation=build_truncation(runner.job),
            group_filter=runner.scheduler.scoring.keep,
            scorer=runner.scheduler.scoring.scorer,
        )
    ceiling_engine = build_engines(spec.rollout, model, seed=spec.trainer.seed)[0]
    engines.append(ceiling_engine)
    await asyncio.gather(*(e.start() for e in engines))
    try:
        results = await compare_rollouts(
            schedulers, rounds, warmup_rounds=warmup_rounds, on_round=on_round, weights=model
        )
        first = runner.prompts.records[0]
        prompt_ids = runner.prompts.renderer.render(first.prompt, first.messages).ids
        # One engine measured, scaled by the engine count: engines share nothing but the CPU.
        ceiling = spec.rollout.embedded.num_engines * await measure_ceiling(
            ceiling_engine,
            batch=spec.rollout.embedded.max_batch_size,
            tokens=max(8, spec.rollout.max_response_length // 2),
            prompt_ids=prompt_ids,
        )
    finally:
        await asyncio.gather(*(e.close() for e in engines), return_exceptions=True)
    rows = comparison_table(results, ceiling)
    return {
        "rounds": rounds,
        "warmup_rounds": warmup_rounds,
        "ceiling_tokens_per_s": ceiling,
        "rows": rows,
        "results": {name: asdict(r) for name, r in results.items()},
    }
