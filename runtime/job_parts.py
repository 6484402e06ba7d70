"""Building a job's parts from its spec: the runtime's reader of the RLJob spec.

The step loop (runner.py), the training ranks (ranks.py) and the strategy comparison (compare.py) get
their parts and settings from here, so what a spec field means to the runtime is decided in one place.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rljob.api.spec import RLJob
from rljob.runtime.checkpoint import CheckpointManager, checkpoint_store
from rljob.runtime.engines.base import Engine
from rljob.runtime.evaluation import EvalPrompt
from rljob.runtime.metrics import RuntimeMetrics
from rljob.runtime.rollout.sample import Group
from rljob.runtime.rollout.scheduler import GroupScorer, RolloutConfig, RolloutScheduler
from rljob.runtime.rollout.strategy import Strategy, make_strategy
from rljob.runtime.rollout.truncation import TruncationPolicy
from rljob.runtime.training.distributed import Distributed

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from rljob.runtime.tasks.dataset import PromptStream
    from rljob.runtime.trainer import Trainer
    from rljob.runtime.weights.transport import WeightTransport


@dataclass(frozen=True)
class LoopSettings:
    """What the step loop needs of the spec (and of the command line's overrides)."""

    total_steps: int
    checkpoint_every: int
    eval_every: int  # 0: no held-out evaluation
    resume: bool
    metrics_host: str
    metrics_port: int | None  # None or 0: no /metrics endpoint
    sync_bucket_bytes: int
    sync_timeout_s: float
    # Held-out evaluation's sampling: the rollout's, unless evaluation.temperature overrides it.
    eval_temperature: float
    max_new_tokens: int
    stop: tuple[str, ...]


def loop_settings(job: RLJob, steps: int | None, resume: bool | None, metrics_port: int | None) -> LoopSettings:
    """The step loop's settings: the spec's, with the command line's `steps`, `resume` and `metrics_port`."""
    spec = job.spec
    r = spec.rollout
    return LoopSettings(
        total_steps=steps or spec.trainer.steps,
        checkpoint_every=spec.checkpoint.every_steps,
        eval_every=spec.evaluation.every_steps,
        resume=spec.checkpoint.resume if resume is None else resume,
        metrics_host=spec.metrics.host,
        metrics_port=spec.metrics.port if metrics_port is None else metrics_port,
        sync_bucket_bytes=int(r.weight_transport.bucket_megabytes * 2**20),
        sync_timeout_s=r.weight_transport.timeout_seconds,
        eval_temperature=r.temperature if spec.evaluation.temperature is None else spec.evaluation.temperature,
        max_new_tokens=r.max_response_length,
        stop=tuple(r.stop),
    )


def build_checkpoints(job: RLJob, distributed: Distributed | None) -> CheckpointManager:
    """The job's checkpoint folder (every rank writes its part of a checkpoint)."""
    c = job.spec.checkpoint
    # RLJob fills the per-job default (runs/<name>/checkpoints): a folder is always set by now.
    return CheckpointManager(c.dir or f"runs/{job.metadata.name}/checkpoints", keep=c.keep, distributed=distributed,
                             store=checkpoint_store(c))


def metrics_namespace(job: RLJob, environ: Mapping[str, str]) -> str:
    """The namespace the job's metrics carry (`rljob_namespace`, which the autotuner selects on): the
    RLJob object's, RLJOB_NAMESPACE (as the status reporter and the knob source use it), else the job
    file's metadata. A trainer pod's rendered job file need not carry a namespace; its env always does."""
    return environ.get("RLJOB_NAMESPACE") or job.metadata.namespace or ""


def build_metrics(job: RLJob, output_dir: Path, environ: Mapping[str, str]) -> RuntimeMetrics:
    """The job's metrics: Prometheus collectors and metrics.jsonl (spec.metrics.jsonl, else in `output_dir`)."""
    jsonl = Path(job.spec.metrics.jsonl) if job.spec.metrics.jsonl else output_dir / "metrics.jsonl"
    metrics = RuntimeMetrics(job.metadata.name, jsonl, namespace=metrics_namespace(job, environ))
    band = job.spec.autotune.truncation_band
    metrics.set_truncation_band(band.low, band.high)
    return metrics


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
        pack_sequences=spec.trainer.sequence_packing,
    )


def open_policy_for_training(job: RLJob) -> Any:
    """The job's policy (model and tokenizer), with gradient checkpointing when the spec asks for it."""
    from rljob.runtime.models.loading import enable_gradient_checkpointing, torch_dtype
    from rljob.runtime.tasks.policy import open_policy

    policy = open_policy(job.spec.model, dtype=torch_dtype(job.spec.trainer.dtype))
    if job.spec.trainer.gradient_checkpointing:
        enable_gradient_checkpointing(policy.model)
    return policy


def build_engines(job: RLJob, model: PreTrainedModel, detokenize: Callable[[list[int]], str] | None = None,
                  seeded: bool = False, chunked_prefill_tokens: int = 0) -> list[Engine]:
    """The job's rollout engines over `model` (embedded engines copy it; SGLang pools are found).
    `seeded`: sample with the trainer's seed (a strategy comparison gives every strategy the same);
    `chunked_prefill_tokens`: the embedded engines' chunked prefill budget (0: off)."""
    from rljob.runtime.engines.factory import build_engines as engines_for

    seed = job.spec.trainer.seed if seeded else 0
    return engines_for(job.spec.rollout, model, seed=seed, detokenize=detokenize,
                       chunked_prefill_tokens=chunked_prefill_tokens)


def build_transport(job: RLJob, engines: Sequence[Engine], output_dir: Path,
                    write_config: Callable[[Path], None]) -> WeightTransport:
    """The job's weight transport to `engines` (`write_config` writes a disk snapshot's model config)."""
    from rljob.runtime.weights.factory import build_transport as transport_for

    return transport_for(job.spec.rollout, engines, output_dir, write_config)


def build_prompts(job: RLJob, tokenizer: Any, model: Any = None) -> PromptStream:
    """The job's training prompts, rendered with `tokenizer`; with `model`, a prompt that leaves no room for
    rollout.maxResponseLength in its context is skipped (tasks.dataset.prompt_token_budget)."""
    from rljob.runtime.tasks.dataset import PromptStream, prompt_token_budget

    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    budget = prompt_token_budget(context if isinstance(context, int) else None, job.spec.rollout.max_response_length)
    return PromptStream.from_spec(job.spec.data, tokenizer, max_prompt_tokens=budget)


def build_eval_prompts(job: RLJob, prompts: PromptStream) -> list[EvalPrompt]:
    """The held-out prompts, rendered like the training ones; none when evaluation is off."""
    from rljob.runtime.tasks.dataset import held_out_records

    spec = job.spec
    if not spec.evaluation.every_steps:
        return []
    render = prompts.renderer.render
    return [
        EvalPrompt(rendered.ids, row.answer, rendered.text, dict(row.metadata))
        for row in held_out_records(spec.data, spec.evaluation)
        for rendered in [render(row.prompt, row.messages)]
    ]


def build_rollout_strategy(job: RLJob, name: str | None = None) -> Strategy:
    """The rollout strategy of the spec (or the override)."""
    r = job.spec.rollout
    return make_strategy(name or r.strategy, over_sampling=r.partial.over_sampling)


def build_truncation(job: RLJob) -> TruncationPolicy:
    """The partial-rollout truncation policy of the spec."""
    t = job.spec.rollout.partial.truncation
    return TruncationPolicy(mode=t.mode, k=t.k, max_tokens=t.max_tokens, min_samples=t.min_samples)


def rollout_config(job: RLJob, stop_token_ids: list[int]) -> RolloutConfig:
    """The round's settings: batch, sampling, staleness bound, stops and timeouts."""
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
        max_consecutive_rejections=job.spec.algorithm.max_consecutive_rejections,
    )


def build_scheduler(
    job: RLJob,
    engines: Sequence[Engine],
    prompts: PromptStream,
    stop_token_ids: list[int],
    scorer: GroupScorer | None,
    group_filter: Callable[[Group], bool] | None,
    strategy: str | None = None,
    recover: Callable[[], Any] | None = None,
    fill_engines: bool = False,
) -> RolloutScheduler:
    """The job's rollout scheduler over `engines`: strategy (or the `strategy` override), truncation;
    `fill_engines` keeps the engines' batches full to the end of a round (RolloutConfig.fill_engines)."""
    config = rollout_config(job, stop_token_ids)
    config.fill_engines = fill_engines
    return RolloutScheduler(
        engines,
        config,
        build_rollout_strategy(job, strategy),
        # (PromptRecord is frozen, while the rollout's Prompt protocol declares its attributes writable)
        prompts,  # type: ignore[arg-type]
        None,
        truncation=build_truncation(job),
        group_filter=group_filter,
        scorer=scorer,
        recover=recover,
    )


def dynamic_sampling_enabled(job: RLJob) -> bool:
    """Whether the job filters groups whose rewards all agree (DAPO dynamic sampling)."""
    return bool(job.spec.algorithm.effective_dynamic_sampling)


def embedded_engine_count(job: RLJob) -> tuple[int, int]:
    """Embedded engines and their batch size (the strategy comparison scales one engine's ceiling)."""
    e = job.spec.rollout.embedded
    return e.num_engines, e.max_batch_size
