"""Scenario and calibration files (pydantic at the boundary), and the derived engine constants."""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

CALIBRATION_FILE = Path(__file__).with_name("calibration.yaml")
SCENARIO_DIR = Path(__file__).with_name("scenarios")


class ScenarioError(ValueError):
    """A scenario or calibration file a user wrote is invalid; the message says what to fix."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class GpuCalibration(_Strict):
    memory_gb: float
    bandwidth_tb_s: float
    t0_ms: float
    tp_overhead_ms: float
    prefill_tflops: float
    train_tflops: float


class ModelCalibration(_Strict):
    params_b: float
    weight_gb: float
    kv_bytes_per_token: int
    kappa_us: float
    weight_sync_s: float


class LengthLaw(_Strict):
    median_tokens: float
    sigma_between: float
    sigma_within: float
    runaway_share: float = 0.0
    prompt_tokens: int = 200
    drift_per_100_steps: float = 0.0


class RewardLaw(_Strict):
    """Binary correctness per sample (calibration.yaml `rewards`): drives the DAPO filter."""

    pass_rate_mean: float = Field(ge=0.0, le=1.0)
    pass_rate_spread: float = Field(1.0, ge=0.0, description="probit spread of prompt pass rates")
    difficulty_correlation: float = Field(0.5, ge=-1.0, le=1.0, description="ρ: longer prompts pass less")
    length_correlation: float = Field(0.5, ge=0.0, le=1.0, description="λ: shorter samples more often correct")


class ValidationSensitivity(_Strict):
    pass_rate_spread: list[float] = Field(default_factory=list)
    sigma_between_share_of_variance: list[float] = Field(default_factory=list)
    # YAML reads the pre-registered `[off]` as [False]: each entry is "dynamic sampling on?".
    filter: list[bool] = Field(default_factory=list)


class ValidationCalibration(_Strict):
    """The published runs validated against, and how (fixed before any comparison)."""

    published_gain_pct: dict[str, float]
    primary_gpu: str
    sensitivity_gpus: list[str] = Field(default_factory=list)
    metric: str
    steps: int
    warmup_steps: int
    seeds: list[int]
    sensitivity: ValidationSensitivity = ValidationSensitivity()


class EngineCalibration(_Strict):
    kv_reserved_gb: float
    admit_fraction: float
    abort_latency_s: float
    max_running_requests: int


class TrainingCalibration(_Strict):
    flops_per_token_factor: float
    mfu: float


class Calibration(_Strict):
    gpus: dict[str, GpuCalibration]
    models: dict[str, ModelCalibration]
    datasets: dict[str, LengthLaw]
    rewards: dict[str, RewardLaw] = Field(default_factory=dict)
    engine: EngineCalibration
    training: TrainingCalibration
    validation: ValidationCalibration | None = None


# ---------------------------------------------------------------------------------- strategies


class SimTruncationSpec(_Strict):
    mode: Literal["none", "sigma", "tokens"] = "none"
    k: float = 2.0
    max_tokens: int | None = None


_REFILL = Field(None, gt=0.0, description="chunked refill: launch ceil(refill_factor × N) groups whenever fewer "
               "than N are viable (slime: 1.0 for the baseline, N′/N for APRIL); None: one per rejection")


class SyncSpec(_Strict):
    """Synchronous baseline. Without partial rollout, what still runs at collection (refills
    launched after rejections) is aborted and discarded, as in slime."""

    kind: Literal["sync"]
    name: str = "sync"
    refill_factor: float | None = _REFILL


class AprilSpec(_Strict):
    kind: Literal["april"]
    name: str = "april"
    over_sampling: float = Field(default=2.0, ge=1.0)  # `default=`: type checkers see it has one
    truncation: SimTruncationSpec = SimTruncationSpec()
    refill_factor: float | None = _REFILL


class TailBatchingSpec(_Strict):
    """RollPacker-style: short rounds over-provision and keep the first finishers; aborted prompts
    (and prompts a length predictor flags as long) are replayed from scratch in long rounds."""

    kind: Literal["tail-batching"]
    name: str = "tail-batching"
    over_sampling: float = Field(1.25, ge=1.0)
    predictor_noise: float | None = Field(0.3, description="σ of the predictor's error on log-difficulty; None: off")
    predicted_long_share: float = Field(0.1, ge=0.0, lt=1.0, description="share of prompts routed to long rounds")


class BoundedStalenessSpec(_Strict):
    """AReaL-style asynchronous rollout: a stream, not rounds. Generation never stops for
    training (the trainer has its own share of the GPUs); a weight update interrupts the requests
    in flight, which resume at once under the new weights; a group may be launched only while
    launched groups ≤ (version + eta + 1)·N, and a group staler than eta versions is regenerated.
    `over_sampling` is not used by the stream (kept so older scenario files load)."""

    kind: Literal["bounded-staleness"]
    name: str = "async-eta"
    eta: int = Field(2, ge=0)
    trainer_gpu_share: float = Field(0.25, gt=0.0, lt=1.0)
    over_sampling: float = Field(1.5, ge=1.0)


class AsyncSpec(_Strict):
    """The runtime's `async` strategy (rollout/strategy.py AsyncStrategy): APRIL's round, then the
    engines keep generating while the trainer trains on GPUs of its own; the weight sync interrupts
    them and the next round resumes every response under the new weights. `max_staleness` of the
    scenario bounds the trained samples (enforced when a group leaves the buffer and at acceptance).
    `trainer_gpu_share`: the trainer's share of the GPUs; None takes the scenario's (which must then
    be disaggregated, `colocated: false`)."""

    kind: Literal["async"]
    name: str = "async"
    over_sampling: float = Field(default=2.0, ge=1.0)
    truncation: SimTruncationSpec = SimTruncationSpec()
    trainer_gpu_share: float | None = Field(None, gt=0.0, lt=1.0)
    train_gpu_seconds_per_step: float | None = Field(None, gt=0.0, description="this strategy's own trainer time × "
                                                     "trainer GPUs per step (a disaggregated trainer need not be as "
                                                     "efficient as a colocated one); None: the scenario's")


class LargeGroupSpec(_Strict):
    """BroRL-style: many samples per prompt (up to 512), synchronous."""

    kind: Literal["large-group"]
    name: str = "large-n"
    samples_per_prompt: int = Field(512, ge=1, le=4096)
    samples_per_round_factor: float = Field(4.0, gt=0.0, description="samples per round ÷ the sync baseline's")


class DraftReuseSpec(_Strict):
    """SPEC-RL-style: the previous epoch's response is a draft; its accepted prefix costs a
    verification (prefill-rate) pass instead of decode steps."""

    kind: Literal["draft-reuse"]
    name: str = "draft-reuse"
    accepted_prefix: float = Field(0.5, ge=0.0, le=1.0, description="mean share of the response accepted")
    epochs_in_run: float = Field(3.0, gt=1.0, description="the run's steps cover the dataset this many times")


StrategySpec = Annotated[
    SyncSpec | AprilSpec | AsyncSpec | TailBatchingSpec | BoundedStalenessSpec | LargeGroupSpec | DraftReuseSpec,
    Field(discriminator="kind"),
]



def _sync_and_april() -> list[StrategySpec]:
    """A scenario's strategies when it names none: the sync baseline and APRIL."""
    return [SyncSpec(kind="sync"), AprilSpec(kind="april")]


class Scenario(_Strict):
    """One simulated cluster and workload, and the strategies to compare on it."""

    name: str
    model: str
    gpu: str
    gpus: int = Field(8, ge=1)
    tensor_parallel: int = Field(2, ge=1)
    mem_fraction: float = Field(0.6, gt=0.0, le=1.0)
    dataset: str
    max_response_length: int = Field(16384, ge=16)
    samples_per_prompt: int = Field(8, ge=1)
    groups_per_engine: int = Field(8, ge=1, description="rollout batch N = this × engines")
    rollout_batch_size: int | None = Field(None, ge=1, description="rollout batch N in groups, the same for every "
                                           "strategy whatever its GPU split; None: groups_per_engine × engines")
    steps: int = Field(12, ge=1)
    warmup_steps: int = Field(2, ge=0, description="first steps left out of the averages (buffer warm-up)")
    max_staleness: int = 2
    colocated: bool = Field(True, description="every strategy trains on the rollout GPUs, in turn; false: the "
                            "trainer has `trainer_gpu_share` of the GPUs to itself for every strategy")
    trainer_gpu_share: float = Field(0.5, gt=0.0, lt=1.0, description="the trainer's GPUs when not colocated")
    max_running_requests: int | None = Field(None, ge=1, description="per engine; None: calibration.yaml's "
                                             "(an engine with a fixed batch size, e.g. the embedded one, sets it)")
    dynamic_sampling: bool = Field(False, description="DAPO filter: drop groups whose rewards all agree "
                                   "(needs the dataset in calibration.yaml `rewards`)")
    token_quantum: int = Field(16, ge=1, description="tokens per simulated token id (KV page size)")
    median_tokens: float | None = Field(None, gt=0.0, description="response-length median, replacing the "
                                        "dataset's (a law fitted to a published setup); None: the dataset's")
    train_gpu_seconds_per_step: float | None = Field(None, gt=0.0, description="trainer time × trainer GPUs per "
                                                     "step, measured or published; None: the FLOP model")
    seed: int = 0
    strategies: list[StrategySpec] = Field(default_factory=_sync_and_april)

    @model_validator(mode="after")
    def _check(self) -> Scenario:
        if self.gpus % self.tensor_parallel:
            raise ValueError(f"gpus ({self.gpus}) must be a multiple of tensor_parallel ({self.tensor_parallel})")
        if self.warmup_steps >= self.steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be below steps ({self.steps})")
        if self.dynamic_sampling and self.dataset not in load_calibration().rewards:
            raise ValueError(f"dynamic_sampling needs a reward model: dataset {self.dataset!r} is not in "
                             f"calibration.yaml `rewards`")
        for spec in self.strategies:
            if isinstance(spec, AsyncSpec) and spec.trainer_gpu_share is None and self.colocated:
                raise ValueError(f"strategy {spec.name!r}: async needs GPUs of its own for the trainer: set its "
                                 "trainer_gpu_share, or colocated: false")
        names = [s.name for s in self.strategies]
        if len(set(names)) != len(names):
            raise ValueError(f"strategy names must be unique, got {names}")
        return self

    @property
    def engines(self) -> int:
        return self.gpus // self.tensor_parallel

    @property
    def batch_size(self) -> int:
        return self.rollout_batch_size or self.groups_per_engine * self.engines


@lru_cache(maxsize=4)
def load_calibration(path: Path = CALIBRATION_FILE) -> Calibration:
    """The calibration file (every constant and its source)."""
    try:
        return Calibration.model_validate(yaml.safe_load(path.read_text()))
    except (OSError, yaml.YAMLError, ValidationError) as err:
        raise ScenarioError(f"calibration file {path} is invalid: {err}") from err


def load_scenario(path: str | Path) -> Scenario:
    """Parse and check a scenario YAML against the calibration's GPU, model and dataset names."""
    p = Path(path)
    if not p.exists():  # a bundled scenario, by file name or by name without `.yaml`
        p = next((c for c in (SCENARIO_DIR / p, SCENARIO_DIR / f"{p}.yaml") if c.exists()), p)
    try:
        raw = yaml.safe_load(p.read_text())
    except OSError as err:
        raise ScenarioError(f"cannot read scenario {p}: {err.strerror}; give a path or a name in {SCENARIO_DIR}") from err
    except yaml.YAMLError as err:
        raise ScenarioError(f"scenario {p} is not valid YAML: {err}") from err
    try:
        scenario = Scenario.model_validate(raw)
    except ValidationError as err:
        raise ScenarioError(f"scenario {p} is invalid:\n{err}") from err
    check_names(scenario)
    return scenario


def check_names(scenario: Scenario) -> None:
    """Every named GPU, model and dataset must exist in the calibration file."""
    cal = load_calibration()
    for field_name, table in (("gpu", cal.gpus), ("model", cal.models), ("dataset", cal.datasets)):
        value = getattr(scenario, field_name)
        if value not in table:
            raise ScenarioError(
                f"scenario {scenario.name}: {field_name} {value!r} is not in {CALIBRATION_FILE.name}; "
                f"use one of {sorted(table)}"
            )


# ------------------------------------------------------------------------------ engine constants


class EngineConstants(BaseModel):
    """Per-engine (one TP group) costs in seconds and tokens, derived from the calibration."""

    fixed_step_s: float  # a = t0 (+ TP overhead) + W/(k·BW)
    per_seq_step_s: float  # κ
    kv_read_s_per_token: float  # kvb/(k·BW), per token of context per step
    prefill_s_per_token: float  # 2P/(k·F_pf)
    kv_capacity_tokens: int  # K_tok
    admit_fraction: float
    max_running_requests: int
    abort_latency_s: float
    weight_sync_s: float


def engine_constants(scenario: Scenario) -> EngineConstants:
    """PM §3.3 constants for one engine of `scenario` (TP k GPUs)."""
    cal = load_calibration()
    gpu, model, eng = cal.gpus[scenario.gpu], cal.models[scenario.model], cal.engine
    k = scenario.tensor_parallel
    bw = k * gpu.bandwidth_tb_s * 1e12
    t0 = gpu.t0_ms * 1e-3 + (gpu.tp_overhead_ms * 1e-3 if k > 1 else 0.0)
    kv_bytes = scenario.mem_fraction * k * gpu.memory_gb * 1e9 - model.weight_gb * 1e9 - eng.kv_reserved_gb * 1e9
    if kv_bytes <= 0:
        raise ScenarioError(
            f"scenario {scenario.name}: {model.weight_gb} GB of weights do not fit in mem_fraction "
            f"{scenario.mem_fraction} of {k}×{gpu.memory_gb} GB; raise mem_fraction or tensor_parallel"
        )
    return EngineConstants(
        fixed_step_s=t0 + model.weight_gb * 1e9 / bw,
        per_seq_step_s=model.kappa_us * 1e-6,
        kv_read_s_per_token=model.kv_bytes_per_token / bw,
        prefill_s_per_token=2 * model.params_b * 1e9 / (k * gpu.prefill_tflops * 1e12),
        kv_capacity_tokens=math.floor(kv_bytes / model.kv_bytes_per_token),
        admit_fraction=eng.admit_fraction,
        max_running_requests=scenario.max_running_requests or eng.max_running_requests,
        abort_latency_s=eng.abort_latency_s,
        weight_sync_s=model.weight_sync_s,
    )


def train_seconds(scenario: Scenario, tokens: int, gpus: int) -> float:
    """Trainer time for one optimizer step over `tokens` (prompt + response) on `gpus` GPUs: the scenario's
    measured GPU-seconds per step spread over `gpus` when it gives them, else the FLOP model."""
    if scenario.train_gpu_seconds_per_step is not None:
        return scenario.train_gpu_seconds_per_step / gpus
    cal = load_calibration()
    flops = cal.training.flops_per_token_factor * cal.models[scenario.model].params_b * 1e9 * tokens
    return flops / (gpus * cal.gpus[scenario.gpu].train_tflops * 1e12 * cal.training.mfu)
