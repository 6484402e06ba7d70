"""RLJob spec: the one set of models shared by `rljob run`, the operator and the CRD generator.

This module depends on pydantic only, so the runtime can import it without kopf or the
kubernetes client. Field names are camelCase on the wire (Kubernetes convention) and
snake_case in Python. Unknown fields are errors everywhere: a typo must never be ignored.
"""

from __future__ import annotations

import re

from typing import Annotated, Any, Final, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationInfo, field_validator, model_validator
from pydantic.alias_generators import to_camel

from rljob.api import knob_limits as limits
from rljob.api.validation import (
    DNS1035_LABEL_PATTERN,
    DNS1123_SUBDOMAIN_PATTERN,
    MAX_LIST,
    MAX_MAP,
    PATH_MAX,
    Arg,
    Flag,
    DNS1123Label,
    DNS1123Subdomain,
    EnvVarName,
    FORBIDDEN_HOST_PATTERN,
    FRAGMENT_MESSAGE,
    FORBIDDEN_HOST_MESSAGE,
    FilePath,
    HttpUrl,
    ImageRef,
    LabelKey,
    LabelValue,
    Quantity,
    ResourceName,
    Text,
    cel_has,
    credential_target_problem,
    immutable_optional,
    label_map,
    rule,
)

API_GROUP = "rljob.io"
API_VERSION = "v1alpha1"
KIND: Final = "RLJob"
# Child names are built from the job name (Services must be DNS-1035 labels; StatefulSet pod names
# plus the controller-revision-hash label must fit in 63 characters).
MAX_JOB_NAME = 40


# Largest counts the spec admits (steps, prompts, replicas): far above any real job, below overflow.
MAX_COUNT = 10_000_000
# Seeds are passed to numpy and torch, which take 32-bit unsigned seeds.
MAX_SEED = 2**32 - 1
# Timeouts and durations in seconds: a day, except the job deadline.
DAY_S = 86_400
# GPUs one replica may ask for on one node.
MAX_GPUS_PER_REPLICA = 64
# Hugging Face Hub id: <namespace>/<name> or a bare <name>.
HF_ID_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?(/[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?)?$"
# A Hugging Face Hub repo id (`org/name` or `name`), of a model or a dataset.
HubId = Annotated[str, StringConstraints(pattern=HF_ID_PATTERN, max_length=256)]
# Algorithms whose advantage is normalised within a prompt group: one sample per group has none.
GROUP_NORMALISED_ALGORITHMS = ("grpo", "dapo")
# SGLang server flags the operator sets itself (model, parallelism, address, metrics, the job's engine
# key): a second copy in extraArgs would silently override or contradict them. An admin key would make
# SGLang refuse the job's key on the weight-update endpoints (0.5.23 sglang/srt/utils/auth.py).
OPERATOR_OWNED_SGLANG_FLAGS = (
    "--model-path", "--model", "--revision", "--tp", "--tp-size", "--tensor-parallel-size",
    "--host", "--port", "--enable-metrics", "--api-key", "--admin-api-key",
)
# Flags are letters and dashes only: the same text is a Python and a CEL (RE2) pattern.
_OWNED_FLAG_RE = "^(" + "|".join(OPERATOR_OWNED_SGLANG_FLAGS) + ")(=.*)?$"
# SGLang's data parallelism inside one server (--dp-size; --dp is its argparse prefix). Its schedulers
# take no rank in the weight-update group (model_runner.init_weights_update_group: rank = rank_offset
# + tp_rank), so the distributed transport cannot reach them, and a replica's GPUs are exactly its TP
# ranks (gpusPerReplica = tensorParallelSize), so there are none left for them: a pool scales with replicas.
DATA_PARALLEL_SGLANG_FLAGS = ("--dp", "--dp-size", "--data-parallel-size")
_DP_FLAG_RE = "^(" + "|".join(DATA_PARALLEL_SGLANG_FLAGS) + ")(=.*)?$"
_GPUS_ARE_TP = (
    "gpusPerReplica must equal tensorParallelSize on a GPU pool: every GPU of a replica is one tensor-parallel "
    "rank of its SGLang server (more throughput: more replicas, not --dp-size)"
)
_NO_DATA_PARALLEL = (
    "extraArgs must not set SGLang's data parallelism (" + ", ".join(DATA_PARALLEL_SGLANG_FLAGS) + "): the "
    "weight-update group has no ranks for data-parallel schedulers and a replica's GPUs are its tensor-parallel "
    "ranks; scale the pool's replicas instead"
)


def cel(*rules_and_messages: str) -> dict[str, Any]:
    """CRD validation rules for a model or field: pairs of (CEL rule, message), as JSON-schema extra."""
    pairs = zip(rules_and_messages[::2], rules_and_messages[1::2], strict=True)
    return {"x-kubernetes-validations": [{"rule": rule, "message": message} for rule, message in pairs]}


# A field that cannot change once the RLJob exists (CEL transition rule).
IMMUTABLE = cel("self == oldSelf", "field is immutable")
# A list of objects keyed by their `name` (merged per item by server-side apply, names unique).
LIST_MAP_BY_NAME: dict[str, Any] = {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]}
# `pvc://<claim>[/<path inside the claim>]`: a file tree on a PersistentVolumeClaim of the job's namespace.
PVC_URI_PREFIX = "pvc://"
PVC_URI_PATTERN = r"^pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/.*)?$"
S3_URI_PREFIX = "s3://"
# An s3:// URI: a bucket (S3's naming rules: 3-63 lowercase letters, digits, '.', '-') and a key prefix.
S3_URI_PATTERN = r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/\S*)?$"
# model.uri: an s3:// URI that names a folder (a key prefix) inside the bucket, not the bucket itself.
S3_FOLDER_URI_PATTERN = r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]/+[^/\s]\S*$"
# A pvc:// URI: the claim (a DNS-1123 subdomain) and a path inside it.
PvcUri = Annotated[str, StringConstraints(pattern=PVC_URI_PATTERN, max_length=6 + 253 + PATH_MAX)]
# GPU vendors of inference pools: their SGLang pods load a Hugging Face model folder they must see.
GPU_VENDORS = ("nvidia", "amd")
# Vendors of inference pools; `cpu` pools run rljob's SGLang-protocol server. One type for spec and status.
PoolVendor = Literal["nvidia", "amd", "cpu"]
# The vendor of the one pool a job without `rollout.pools` gets (operator/builders/inference.py).
DEFAULT_POOL_VENDOR: Final = "nvidia"


class ApiModel(BaseModel):
    """Base of every RLJob model: camelCase aliases, unknown fields rejected."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=True,
    )

    def to_wire(self) -> dict[str, Any]:
        """Serialise with camelCase keys and without unset optional fields."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


# ----------------------------------------------------------------------------------------------
# model, data, reward

class SecretKeyRef(ApiModel):
    """A key of a Secret in the RLJob's namespace."""

    name: DNS1123Subdomain
    key: str = Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")


class HubDownloadSpec(ApiModel):
    """A download step on a cluster: an init container runs the Hugging Face CLI (`hf download`)."""

    token_secret_ref: SecretKeyRef | None = Field(
        default=None, description="Secret key holding a Hugging Face token (HF_TOKEN) for gated or private repos."
    )
    image: ImageRef | None = Field(
        default=None, description="Image with the `hf` CLI (huggingface_hub); default: the CPU runtime image."
    )
    size_limit: Quantity = Field(
        default="100Gi",
        description="Size limit of the emptyDir the files are downloaded into (unless a cache claim holds them).",
    )
    include: list[Annotated[str, StringConstraints(min_length=1, max_length=1024)]] = Field(
        default_factory=list, max_length=MAX_LIST, description="Glob patterns of the files to fetch (--include)."
    )


class HubStorageSpec(ApiModel):
    """How the pods of a cluster job see a Hugging Face Hub repo: model.huggingFace or data.huggingFace
    (operator only).

    A folder or file on a claim needs none of this: write `model.path: pvc://<claim>/<folder>` or
    `data.jsonl: pvc://<claim>/<file>`.
    """

    hugging_face_cache: PvcUri | None = Field(
        default=None,
        description="pvc://<claim>[/<dir>]: a Hugging Face hub cache (HF_HUB_CACHE layout) mounted read-only into "
        "the pods that read the repo (inference and trainer pods for a model, trainer pods for data), which then "
        "run offline.",
    )
    download: HubDownloadSpec | None = Field(
        default=None,
        description="Download the repo in an init container of those pods: into huggingFaceCache when set "
        "(mounted writable for that step only), else into an emptyDir.",
    )


_ONE_MODEL_SOURCE = "exactly one of builtin, path, huggingFace, uri must be set"
_MODEL_S3_NEEDS_URI = "model.s3 applies to model.uri: s3://BUCKET/FOLDER"
_MODEL_URI_FORM = (
    "model.uri must be s3://BUCKET/FOLDER (a bucket of 3-63 lowercase letters, digits, '.', '-' and the folder "
    "holding the model's config.json, weights and tokenizer); a local folder or a claim goes in model.path"
)


class S3Spec(ApiModel):
    """How to reach the S3-compatible object store (AWS S3, MinIO, SeaweedFS, Ceph RGW...) of an s3:// uri:
    checkpoint.s3 or model.s3."""

    endpoint: str | None = Field(
        default=None,
        max_length=2048,
        pattern=r"^https?://[^\s/]+(/\S*)?$",
        description="S3 API base URL, e.g. http://minio.storage:9000 for MinIO or SeaweedFS; unset: "
        "AWS_ENDPOINT_URL from the environment, else AWS S3 itself.",
    )
    region: str | None = Field(
        default=None, min_length=1, max_length=63, pattern=r"^[a-z0-9-]+$",
        description="Region the requests are signed for; unset: AWS_REGION, else us-east-1.",
    )
    credentials_secret: DNS1123Subdomain | None = Field(
        default=None,
        description="On a cluster: a Secret in the RLJob's namespace with keys AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY (AWS_SESSION_TOKEN optional), passed to the containers that use the store (the "
        "trainer for checkpoints, the model-download step for a model). Unset: the pod's own environment (e.g. a "
        "workload identity).",
    )


class ModelS3Spec(S3Spec):
    """How to reach the object store of an s3:// model.uri, and how much room its download gets on a cluster."""

    size_limit: Quantity = Field(
        default="100Gi",
        description="On a cluster: size limit of the emptyDir each pod that loads the model downloads it into.",
    )


class ModelSpec(ApiModel):
    """Where the policy comes from. Exactly one source must be set."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            "[has(self.builtin), has(self.path), has(self.huggingFace), has(self.uri)].filter(x, x).size() == 1",
            _ONE_MODEL_SOURCE,
            "!has(self.storage) || has(self.huggingFace)",
            "model.storage applies to model.huggingFace (a model folder on a claim is model.path: pvc://<claim>/<dir>)",
            "!has(self.s3) || has(self.uri)",
            _MODEL_S3_NEEDS_URI,
        )
    )

    builtin: Literal["tiny-arith", "tiny-qwen3", "tiny-llama"] | None = Field(
        default=None,
        description="tiny-arith: a tiny policy the project trains itself on CPU (supervised warm-up, cached on "
        "disk); tiny-qwen3 / tiny-llama: a tiny randomly initialised Qwen3 / Llama 3 architecture with a locally "
        "trained tokenizer and chat template, built into the cache on first use.",
    )
    path: FilePath | None = Field(
        default=None,
        description="Hugging Face model folder (config.json, safetensors, tokenizer): a local path, or on a cluster "
        "pvc://<claim>/<folder>, mounted read-only into the inference and trainer pods.",
    )
    hugging_face: HubId | None = Field(
        default=None,
        description="Hugging Face Hub id, for example Qwen/Qwen3-4B. The runtime resolves it offline in the local "
        "Hugging Face cache (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub); SGLang pods load it.",
    )
    revision: str | None = Field(default=None, max_length=256, description="Hub revision (branch, tag or commit) of huggingFace.")
    storage: HubStorageSpec | None = Field(
        default=None, description="On a cluster: where the pods find model.huggingFace (cache claim or download)."
    )
    uri: str | None = Field(
        default=None,
        min_length=1,
        max_length=2048,
        description="s3://<bucket>/<folder>: a Hugging Face model folder in an S3-compatible object store (see "
        "model.s3), for clusters without egress. On a cluster an init container of every pod that loads the model "
        "downloads it into an emptyDir; `rljob run` downloads it into $RLJOB_CACHE/models/s3/<bucket>/<folder> "
        "(again only when the objects changed).",
        json_schema_extra=cel(f"self.matches(r'{S3_FOLDER_URI_PATTERN}')", _MODEL_URI_FORM),
    )
    s3: ModelS3Spec | None = Field(default=None, description="Object store settings of an s3:// model.uri.")

    @model_validator(mode="after")
    def _exactly_one_source(self) -> ModelSpec:
        sources = [s for s in (self.builtin, self.path, self.hugging_face, self.uri) if s]
        if len(sources) != 1:
            raise ValueError(_ONE_MODEL_SOURCE)
        if self.storage is not None and self.hugging_face is None:
            raise ValueError(
                "model.storage applies to model.huggingFace (a model folder on a claim is model.path: pvc://<claim>/<dir>)"
            )
        if self.s3 is not None and self.uri is None:
            raise ValueError(_MODEL_S3_NEEDS_URI)
        return self

    @field_validator("uri")
    @classmethod
    def _object_folder_uri(cls, uri: str | None) -> str | None:
        if uri is not None and not re.match(S3_FOLDER_URI_PATTERN, uri):
            raise ValueError(f"{uri!r}: {_MODEL_URI_FORM}")
        if uri is not None and any(part in (".", "..") for part in uri.split("/")[3:]):
            raise ValueError(f"{uri!r} has a '.' or '..' segment; object keys are not paths")
        return uri


class SyntheticDataSpec(ApiModel):
    """Procedurally generated verifiable prompts whose answer length has a long tail."""

    task: Literal["arith-chain"] = "arith-chain"
    num_prompts: int = Field(default=4096, gt=0, le=MAX_COUNT)
    seed: int = Field(default=0, ge=0, le=MAX_SEED)


_HUB_DATA_NEEDS_FILE = "data.huggingFace names a dataset repo: set data.jsonl or data.parquet to the file inside it"
_HUB_FILE_IN_REPO = (
    "data.{key} is a path inside the data.huggingFace dataset repo when huggingFace is set (no leading / or pvc://)"
)
_DATA_STORAGE_NEEDS_HUB = "data.storage applies to data.huggingFace (a file on a claim is data.jsonl: pvc://<claim>/<file>)"
_DATA_REVISION_NEEDS_HUB = "data.revision applies to data.huggingFace"


class DataSpec(ApiModel):
    """Prompt source: the synthetic task, or a JSONL / Parquet file of rows with `prompt` text or chat
    `messages`, an `answer`, and any extra fields (kept on the sample for the reward function)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                rule("[has(self.synthetic), has(self.jsonl), has(self.parquet)].filter(x, x).size() == 1",
                     "exactly one of synthetic, jsonl, parquet must be set"),
                rule("!has(self.huggingFace) || has(self.jsonl) || has(self.parquet)", _HUB_DATA_NEEDS_FILE,
                     ".huggingFace"),
                rule("!has(self.huggingFace) || !has(self.jsonl) || !(self.jsonl.startsWith('/') "
                     f"|| self.jsonl.startsWith('{PVC_URI_PREFIX}'))", _HUB_FILE_IN_REPO.format(key="jsonl"), ".jsonl"),
                rule("!has(self.huggingFace) || !has(self.parquet) || !(self.parquet.startsWith('/') "
                     f"|| self.parquet.startsWith('{PVC_URI_PREFIX}'))", _HUB_FILE_IN_REPO.format(key="parquet"),
                     ".parquet"),
                rule("!has(self.storage) || has(self.huggingFace)", _DATA_STORAGE_NEEDS_HUB, ".storage"),
                rule("!has(self.revision) || has(self.huggingFace)", _DATA_REVISION_NEEDS_HUB, ".revision"),
            ]
        }
    )

    synthetic: SyntheticDataSpec | None = None
    jsonl: FilePath | None = Field(
        default=None,
        description="Path of a JSONL file, one row per line; on a cluster also pvc://<claim>/<file>; with "
        "huggingFace, the file's path inside that dataset repo.",
    )
    parquet: FilePath | None = Field(
        default=None,
        description="Path of a Parquet file, one row per record; on a cluster also pvc://<claim>/<file>; with "
        "huggingFace, the file's path inside that dataset repo.",
    )
    hugging_face: HubId | None = Field(
        default=None,
        description="Hugging Face Hub dataset id (for example openai/gsm8k) holding the jsonl or parquet file. The "
        "runtime resolves it offline in the local Hugging Face cache, as model.huggingFace; on a cluster "
        "data.storage says how the trainer pods get it.",
    )
    revision: str | None = Field(
        default=None, max_length=256, description="Hub revision (branch, tag or commit) of data.huggingFace."
    )
    storage: HubStorageSpec | None = Field(
        default=None, description="On a cluster: where the trainer pods find data.huggingFace (cache claim or download)."
    )
    prompt_key: str = Field(default="prompt", min_length=1, max_length=256, description="Column holding the prompt text.")
    messages_key: str = Field(
        default="messages",
        min_length=1,
        max_length=256,
        description="Column holding chat messages ([{role, content}]), used when present.",
    )
    answer_key: str = Field(default="answer", min_length=1, max_length=256)
    system_prompt: Text | None = Field(
        default=None, description="System message put before each prompt (rows with their own system message keep it)."
    )
    shuffle: bool = True
    seed: int = Field(default=0, ge=0, le=MAX_SEED)

    @model_validator(mode="after")
    def _exactly_one_source(self) -> DataSpec:
        if sum(x is not None for x in (self.synthetic, self.jsonl, self.parquet)) != 1:
            raise ValueError("exactly one of synthetic, jsonl, parquet must be set")
        if self.hugging_face is None:
            if self.storage is not None:
                raise ValueError(_DATA_STORAGE_NEEDS_HUB)
            if self.revision is not None:
                raise ValueError(_DATA_REVISION_NEEDS_HUB)
            return self
        if self.file is None:
            raise ValueError(_HUB_DATA_NEEDS_FILE)
        key = "jsonl" if self.jsonl is not None else "parquet"
        if self.file.startswith(("/", PVC_URI_PREFIX)):
            raise ValueError(_HUB_FILE_IN_REPO.format(key=key))
        return self

    @property
    def file(self) -> str | None:
        """The data file (jsonl or parquet), None for synthetic data."""
        return self.jsonl or self.parquet


class OverlongPunishmentSpec(ApiModel):
    """DAPO soft overlong punishment: a length penalty over the last bufferTokens of the response cap.

    With cap L = rollout.maxResponseLength and buffer B, a response of length n gets
    0 for n <= L - B, (L - B - n) / B * penaltyFactor inside the buffer, and -penaltyFactor
    beyond L (DAPO, arXiv 2503.14476, eq. 13). The penalty is added to the reward.
    """

    buffer_tokens: int = Field(
        gt=0, le=limits.MAX_RESPONSE_TOKENS, description="Length of the punishment interval before the response cap."
    )
    penalty_factor: float = Field(default=1.0, gt=0, le=1000, description="Penalty at the cap (the slope's end point).")


class RewardSpec(ApiModel):
    """Reward function.

    `math-answer`: 1 when the final answer equals the reference (exactly, or mathematically equivalent
    per the math-verify package: `\\frac{1}{2}` = `0.5`), else 0. `python`: a user function,
    `function: "module:callable"`, importable by the runtime (see docs/rewards.md).
    """

    model_config = ConfigDict(
        json_schema_extra=cel("self.type != 'python' || has(self.function)", "function is required when type is python")
    )

    type: Literal["math-answer", "python"] = "math-answer"
    function: str | None = Field(
        default=None,
        max_length=512,
        pattern=r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_.]*$",
        description="type python: the reward callable as module:callable (sync or async).",
    )
    batched: bool = Field(
        default=False,
        description="type python: call the function once per group with a list of inputs (returns a list).",
    )
    timeout_seconds: float = Field(
        default=60.0, gt=0, le=DAY_S, description="type python: a call that takes longer fails the job with an error."
    )
    overlong_punishment: OverlongPunishmentSpec | None = Field(
        default=None, description="DAPO soft overlong punishment added to the reward; unset: off."
    )

    @model_validator(mode="after")
    def _python_needs_function(self) -> RewardSpec:
        if self.type == "python" and self.function is None:
            raise ValueError("function is required when type is python (module:callable)")
        return self


# ----------------------------------------------------------------------------------------------
# algorithm


class OffPolicySpec(ApiModel):
    """What the loss does with tokens generated by an older policy version."""

    mode: Literal["keep", "mask", "tis"] = Field(
        default="keep",
        description="keep: train as on-policy; mask: drop stale tokens from the loss; "
        "tis: truncated importance sampling against the rollout log-probs.",
    )
    tis_clip: float = Field(default=2.0, gt=0, le=1000, description="Upper clip C of the TIS weight.")


class LrScheduleSpec(ApiModel):
    """Learning-rate schedule over the training steps (rollout rounds): linear warm-up, then constant
    or cosine decay to minLrRatio x learningRate at trainer.steps."""

    warmup_steps: int = Field(default=0, ge=0, le=MAX_COUNT, description="Steps of linear warm-up from 0 to learningRate.")
    decay: Literal["constant", "cosine"] = Field(default="constant", description="Shape after the warm-up.")
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1, description="cosine: final learning rate / learningRate.")


class AlgorithmSpec(ApiModel):
    """Policy-gradient algorithm and optimiser."""

    name: Literal["grpo", "dapo"] = Field(default="grpo", json_schema_extra=IMMUTABLE)
    learning_rate: float = Field(default=1e-5, gt=0, le=1)
    weight_decay: float = Field(default=0.0, ge=0, le=10)
    clip_low: float = Field(default=0.2, gt=0, le=10, description="PPO clip epsilon (lower side).")
    clip_high: float | None = Field(
        default=None, gt=0, le=10, description="Upper clip epsilon; DAPO clip-higher. Defaults to clipLow for grpo, 0.28 for dapo."
    )
    kl_coef: float = Field(default=0.0, ge=0, le=1000)
    entropy_coef: float = Field(default=0.0, ge=0, le=1000)
    max_grad_norm: float = Field(default=1.0, gt=0, le=1e6)
    dynamic_sampling: bool | None = Field(
        default=None, description="DAPO filter: drop groups whose rewards all agree. Defaults to true for dapo."
    )
    max_consecutive_rejections: int = Field(
        default=256,
        ge=1,
        le=MAX_COUNT,
        description="Groups the dynamic-sampling filter may reject in a row (across rounds) before the job stops "
        "with RewardCollapse: every group scoring alike (a reward always 0, or always 1) would otherwise make a "
        "round sample for ever.",
    )
    off_policy: OffPolicySpec = Field(default_factory=OffPolicySpec)
    ppo_mini_batches: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="Optimizer steps per rollout batch: the batch is split into this many mini-batches. "
        "With more than one (or ppoEpochs > 1) the PPO ratio against the batch-start policy moves and the "
        "clip acts.",
    )
    ppo_epochs: int = Field(default=1, ge=1, le=64, description="Passes over each rollout batch.")
    lr_schedule: LrScheduleSpec = Field(default_factory=LrScheduleSpec)

    @property
    def effective_clip_high(self) -> float:
        """Upper clip: explicit value, else DAPO's clip-higher default, else symmetric."""
        if self.clip_high is not None:
            return self.clip_high
        return 0.28 if self.name == "dapo" else self.clip_low

    @property
    def effective_dynamic_sampling(self) -> bool:
        """Dynamic sampling: explicit value, else on for DAPO only."""
        return self.dynamic_sampling if self.dynamic_sampling is not None else self.name == "dapo"


# ----------------------------------------------------------------------------------------------
# rollout


class TruncationSpec(ApiModel):
    """Length truncation (second APRIL knob): cut long samples at a segment cap and buffer them."""

    model_config = ConfigDict(
        json_schema_extra=cel("self.mode != 'tokens' || has(self.maxTokens)", "maxTokens is required when mode is tokens")
    )

    mode: Literal["none", "sigma", "tokens"] = Field(
        default="none", description="sigma: cut at mean + k*std of the round's lengths; tokens: absolute cap."
    )
    k: float = Field(
        default=2.0,
        gt=limits.TRUNCATION_K_MIN_EXCLUSIVE,
        le=limits.TRUNCATION_K_MAX,
        description="Threshold multiplier for mode sigma.",
    )
    max_tokens: int | None = Field(
        default=None,
        ge=limits.TRUNCATION_TOKENS_MIN,
        le=limits.TRUNCATION_TOKENS_MAX,
        description="Segment cap for mode tokens.",
    )
    min_samples: int = Field(
        default=8, ge=2, le=MAX_COUNT, description="Finished samples needed in a round before the sigma threshold applies."
    )

    @model_validator(mode="after")
    def _tokens_needs_cap(self) -> TruncationSpec:
        if self.mode == "tokens" and self.max_tokens is None:
            raise ValueError("maxTokens is required when mode is tokens")
        return self


class PartialRolloutSpec(ApiModel):
    """APRIL knobs: over-sampling, staleness bound, truncation."""

    over_sampling: float = Field(
        default=2.0, ge=limits.OVER_SAMPLING_MIN, le=limits.OVER_SAMPLING_MAX, description="Groups launched per round / rolloutBatchSize.")
    max_staleness: int = Field(
        default=2, ge=0, le=1000, description="Samples whose oldest token is more versions old than this are regenerated."
    )
    truncation: TruncationSpec = Field(default_factory=TruncationSpec)


class EmbeddedEngineSpec(ApiModel):
    """The in-process PyTorch engine (CPU default)."""

    num_engines: int = Field(default=1, ge=1, le=64)
    max_batch_size: int = Field(default=64, ge=1, le=65536, description="Sequences decoded together per step.")
    device: str = Field(default="cpu", min_length=1, max_length=64)
    dtype: Literal["float32", "bfloat16"] = Field(default="float32", description="Precision of the served weights.")


class PodDiscoverySpec(ApiModel):
    """SGLang workers found through the Kubernetes API: the ready pods matching a label selector."""

    namespace: DNS1123Label
    selector: dict[LabelKey, LabelValue] = Field(
        min_length=1, max_length=MAX_MAP, description="Labels every worker pod carries."
    )
    port: int = Field(default=30000, ge=1, le=65535, description="Port of the SGLang HTTP API on each pod.")


class SGLangSpec(ApiModel):
    """External SGLang workers, reached through the sglang router for generation."""

    router_url: HttpUrl | None = Field(default=None, description="sglang router base URL used for /generate.")
    worker_urls: list[HttpUrl] = Field(
        default_factory=list, max_length=1024, description="Worker base URLs (aborts, weight updates)."
    )
    request_timeout_seconds: float = Field(default=600.0, gt=0, le=DAY_S)
    max_retries: int = Field(default=5, ge=0, le=100)
    drain_timeout_seconds: float = Field(default=30.0, gt=0, le=DAY_S)
    weights_dir: FilePath | None = Field(
        default=None, description="Shared directory the trainer writes weights to for /update_weights_from_disk."
    )
    discovery: PodDiscoverySpec | None = Field(
        default=None,
        description="Find the workers by listing pods (the operator sets it): scaling a pool then changes no config.",
    )


class WeightTransportSpec(ApiModel):
    """How new weights reach the engines after every step (docs/weight_sync.md)."""

    mode: Literal["distributed", "disk", "tensor"] | None = Field(
        default=None,
        description="distributed: one process group between trainer rank 0 and every engine rank, weights in "
        "bucketed broadcasts (/update_weights_from_distributed); disk: snapshots in diskDir that both sides mount "
        "(/update_weights_from_disk); tensor: in process (embedded engine). Default: distributed for engine sglang, "
        "tensor for engine embedded.",
    )
    bucket_megabytes: float = Field(default=256.0, gt=0, le=65536, description="Size of one broadcast bucket (distributed).")
    backend: Literal["gloo", "nccl"] | None = Field(
        default=None, description="Collective backend of the weight-update group (distributed); default: nccl on GPUs, gloo on CPU."
    )
    master_address: str | None = Field(
        default=None,
        max_length=253,
        description="Address the engines reach trainer rank 0 on for the weight-update group (distributed); "
        "default: the trainer pod's IP (POD_IP), else the address the trainer's host name resolves to.",
    )
    master_port: int = Field(default=29600, ge=0, le=65535, description="Port of the weight-update group's store; 0: any free port.")
    timeout_seconds: float = Field(default=300.0, gt=0, le=86_400, description="Most one sync may take before it counts as failed.")
    disk_dir: str | None = Field(
        default=None,
        max_length=4096,
        description="Folder both the trainer and the inference pods mount (disk); default: rollout.sglang.weightsDir, "
        "else <output>/weights.",
    )
    keep_last: int = Field(default=2, ge=1, le=1000, description="Snapshots kept in diskDir (disk); older ones are deleted.")
    flush_cache: bool = Field(
        default=True,
        description="Flush the engines' KV (radix) cache with each weight update (SGLang's flush_cache; distributed "
        "and tensor). false keeps it: samples interrupted at the sync resume without prefilling their prompt and "
        "partial response again, their earlier tokens' keys and values still those of the old weights "
        "(docs/weight_sync.md#keeping-the-cache). The disk mode always flushes.",
    )


_TOLERATION_EXISTS_VALUE = "tolerations[].value must be empty when operator is Exists (Kubernetes refuses the pod)"
_TOLERATION_EMPTY_KEY = (
    "tolerations[].operator must be Exists when key is empty (an empty key matches every taint; Kubernetes refuses "
    "Equal, which is the default operator)"
)
_TOLERATION_SECONDS = "tolerations[].tolerationSeconds applies only to effect NoExecute (Kubernetes refuses the pod)"


class Toleration(ApiModel):
    """A Kubernetes toleration, checked as Kubernetes checks a pod's (an invalid one would fail every child pod)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                rule("!(has(self.operator) && self.operator == 'Exists' && has(self.value) && self.value != '')",
                     _TOLERATION_EXISTS_VALUE, ".value"),
                rule("(has(self.key) && self.key != '') || (has(self.operator) && self.operator == 'Exists')",
                     _TOLERATION_EMPTY_KEY, ".operator"),
                rule("!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
                     _TOLERATION_SECONDS, ".tolerationSeconds"),
            ]
        }
    )

    key: LabelKey | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: LabelValue | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(
        default=None, ge=0, le=10 * 365 * DAY_S,
        description="With effect NoExecute: seconds the pod stays bound after the taint appears (unset: forever).",
    )

    @model_validator(mode="after")
    def _as_kubernetes(self) -> Toleration:
        if self.operator == "Exists" and self.value:
            raise ValueError(_TOLERATION_EXISTS_VALUE)
        if not self.key and self.operator != "Exists":
            raise ValueError(_TOLERATION_EMPTY_KEY)
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError(_TOLERATION_SECONDS)
        return self


class KeyRef(ApiModel):
    """A key of a Secret or ConfigMap in the RLJob's namespace (env[].valueFrom)."""

    name: DNS1123Subdomain
    key: str = Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")
    optional: bool | None = Field(default=None, description="Start the container even if the key is missing.")


class EnvVarSource(ApiModel):
    """Where an environment variable's value comes from. Exactly one source must be set."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            "[has(self.secretKeyRef), has(self.configMapKeyRef)].filter(x, x).size() == 1",
            "exactly one of secretKeyRef, configMapKeyRef must be set",
        )
    )

    secret_key_ref: KeyRef | None = None
    config_map_key_ref: KeyRef | None = None

    @model_validator(mode="after")
    def _exactly_one_source(self) -> EnvVarSource:
        if (self.secret_key_ref is None) == (self.config_map_key_ref is None):
            raise ValueError("exactly one of secretKeyRef, configMapKeyRef must be set")
        return self


class EnvVar(ApiModel):
    """An environment variable: a value, or (on a cluster) a key of a Secret or ConfigMap."""

    model_config = ConfigDict(
        json_schema_extra=cel("self.value == '' || !has(self.valueFrom)", "value and valueFrom are exclusive")
    )

    name: EnvVarName
    value: str = Field(default="", max_length=32768)
    value_from: EnvVarSource | None = Field(
        default=None, description="secretKeyRef or configMapKeyRef (for example HF_TOKEN from a Secret)."
    )

    @model_validator(mode="after")
    def _one_value(self) -> EnvVar:
        if self.value and self.value_from is not None:
            raise ValueError("value and valueFrom are exclusive")
        return self


class ResourceQuantities(ApiModel):
    """CPU and memory quantities of a container."""

    cpu: Quantity | None = None
    memory: Quantity | None = None


class ComputeResources(ApiModel):
    """CPU and memory requests and limits (GPUs come from gpusPerReplica)."""

    requests: ResourceQuantities = Field(default_factory=ResourceQuantities)
    limits: ResourceQuantities = Field(default_factory=ResourceQuantities)


def _router_resources() -> ComputeResources:
    return ComputeResources(
        requests=ResourceQuantities(cpu="500m", memory="512Mi"), limits=ResourceQuantities(memory="2Gi")
    )


class InferencePoolSpec(ApiModel):
    """One pool of SGLang inference replicas on one vendor (operator only).

    `cpu` pools run rljob's own SGLang-protocol server (the runtime image, no GPU): the same HTTP API
    as SGLang, for clusters and test beds without accelerators.
    """

    model_config = ConfigDict(
        json_schema_extra=cel(
            "self.vendor == 'cpu' || self.gpusPerReplica == self.tensorParallelSize",
            _GPUS_ARE_TP,
            "self.vendor != 'cpu' || self.tensorParallelSize == 1",
            "tensorParallelSize must be 1 on a cpu pool (its server decodes on one CPU engine; --tp-size there is for tests of the weight-update group)",
            "!has(self.resourceName) || (self.vendor != 'cpu' && self.resourceName.startsWith(self.vendor + '.com/'))",
            "resourceName must belong to the pool's vendor (nvidia.com/... or amd.com/...); cpu pools take none",
        )
    )

    name: str = Field(min_length=1, max_length=40, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    vendor: PoolVendor
    resource_name: ResourceName | None = Field(
        default=None, description="GPU resource; defaults to nvidia.com/gpu or amd.com/gpu by vendor."
    )
    gpus_per_replica: int = Field(default=1, ge=1, le=MAX_GPUS_PER_REPLICA)
    tensor_parallel_size: int = Field(default=1, ge=1, le=MAX_GPUS_PER_REPLICA)
    replicas: int = Field(default=1, ge=0, le=10_000)
    node_selector: dict[LabelKey, LabelValue] = label_map()
    tolerations: list[Toleration] = Field(default_factory=list, max_length=MAX_LIST)
    image: ImageRef | None = None
    extra_args: list[Flag] = Field(
        default_factory=list,
        max_length=MAX_LIST,
        description="Extra SGLang server flags; the operator's own (" + ", ".join(OPERATOR_OWNED_SGLANG_FLAGS)
        + ") are rejected.",
        json_schema_extra=cel(
            f"self.all(a, !a.matches(r'{_OWNED_FLAG_RE}'))",
            "extraArgs must not set a flag the operator sets (" + ", ".join(OPERATOR_OWNED_SGLANG_FLAGS) + ")",
            f"self.all(a, !a.matches(r'{_DP_FLAG_RE}'))",
            _NO_DATA_PARALLEL,
        ),
    )
    env: list[EnvVar] = Field(default_factory=list, max_length=MAX_LIST, json_schema_extra=LIST_MAP_BY_NAME)
    command: list[Arg] | None = Field(
        default=None,
        max_length=MAX_LIST,
        description="Server command; defaults to python3 -m sglang.launch_server (model, tp, host and port are appended).",
    )
    resources: ComputeResources | None = Field(
        default=None,
        description="CPU and memory of each server container. Default: GPU pools request 4 CPUs and 32Gi with a "
        "96Gi memory limit; cpu pools request 1 CPU and 2Gi with an 8Gi limit.",
    )
    shm_size: Quantity = Field(
        default="16Gi", description="Size limit of /dev/shm (counts against the memory limit)."
    )
    max_unavailable: int = Field(
        default=1, ge=0, le=10_000, description="PodDisruptionBudget: replicas a voluntary disruption (drain) may take at once."
    )

    @model_validator(mode="after")
    def _tp_fits_gpus(self) -> InferencePoolSpec:
        if self.vendor != "cpu" and self.gpus_per_replica != self.tensor_parallel_size:
            raise ValueError(_GPUS_ARE_TP)
        if self.resource_name is not None and (
            self.vendor == "cpu" or not self.resource_name.startswith(f"{self.vendor}.com/")
        ):
            raise ValueError("resourceName must belong to the pool's vendor (nvidia.com/... or amd.com/...); cpu pools take none")
        if self.vendor == "cpu" and self.tensor_parallel_size != 1:
            raise ValueError("tensorParallelSize must be 1 on a cpu pool (its server decodes on one CPU engine; --tp-size there is for tests of the weight-update group)")
        return self

    @field_validator("extra_args")
    @classmethod
    def _no_owned_flags(cls, args: list[str]) -> list[str]:
        owned = [a for a in args if re.match(_OWNED_FLAG_RE, a)]
        if owned:
            raise ValueError(
                f"extraArgs must not set a flag the operator sets ({', '.join(OPERATOR_OWNED_SGLANG_FLAGS)}): {owned}"
            )
        if any(re.match(_DP_FLAG_RE, a) for a in args):
            raise ValueError(_NO_DATA_PARALLEL)
        return args


class RouterSpec(ApiModel):
    """The sglang router in front of all pools (operator only)."""

    image: ImageRef | None = Field(
        default=None, description="Router image; default: the rljob router image (images/router.Dockerfile)."
    )
    # Exactly sglang-router 0.3.2's `--policy` choices but `manual` (it needs a routing key per request,
    # which the runtime does not send); tests/unit/test_sglang_contract.py parses each with the router.
    policy: Literal["cache_aware", "round_robin", "random", "power_of_two"] = Field(
        default="cache_aware", description="sglang-router load-balancing policy (its --policy)."
    )
    resources: ComputeResources = Field(default_factory=_router_resources, description="CPU and memory of the router.")


class WeightsVolumeSpec(ApiModel):
    """A claim the trainer writes weight versions to and the SGLang pods read them from (operator only)."""

    claim: PvcUri = Field(
        description="pvc://<claim>[/<dir>], a ReadWriteMany claim: writable in the trainer pods, read-only in the "
        "inference pods; the operator points rollout.sglang.weightsDir at it.",
    )


class RolloutSpec(ApiModel):
    """How rollouts are generated and scheduled."""

    engine: Literal["embedded", "sglang"] = "embedded"
    strategy: Literal["sync", "april", "async"] = Field(
        default="april",
        description="sync: wait for every group; april: over-sample, stop upon collection, resume the rest next "
        "step; async: APRIL whose engines keep generating while the trainer trains (interrupted by the weight "
        "sync, resumed under the new weights; partial.maxStaleness bounds every trained token's age).",
    )
    rollout_batch_size: int = Field(default=8, gt=0, le=1_000_000, description="Prompt groups trained per step (N).")
    samples_per_prompt: int = Field(
        default=4,
        ge=1,
        le=1024,
        description="Samples per group (G); at least 2 for group-normalised algorithms (grpo, dapo).",
        json_schema_extra=IMMUTABLE,
    )
    max_response_length: int = Field(
        default=256, gt=0, le=limits.MAX_RESPONSE_TOKENS, description="Hard cap on response tokens."
    )
    stop: list[Annotated[str, StringConstraints(min_length=1, max_length=256)]] = Field(
        default_factory=list,
        max_length=16,
        description="Stop strings: a response ends once its text contains one (kept in the response). The model's "
        "stop token ids (tokenizer EOS and every eos_token_id of generation_config.json) always apply.",
    )
    temperature: float = Field(default=1.0, gt=0, le=10)
    top_p: float = Field(default=1.0, gt=0, le=1)
    partial: PartialRolloutSpec = Field(default_factory=PartialRolloutSpec)
    embedded: EmbeddedEngineSpec = Field(default_factory=EmbeddedEngineSpec)
    sglang: SGLangSpec = Field(default_factory=SGLangSpec)
    pools: list[InferencePoolSpec] = Field(
        default_factory=list,
        max_length=16,
        description="SGLang inference pools (operator only); empty means one NVIDIA pool named default.",
        json_schema_extra=LIST_MAP_BY_NAME,
    )
    router: RouterSpec = Field(default_factory=RouterSpec)
    weight_transport: WeightTransportSpec = Field(default_factory=WeightTransportSpec)
    replicas: int | None = Field(
        default=None,
        ge=0,
        le=100_000,
        description="Total inference replicas (the /scale subresource). When set, it is spread over the pools "
        "in proportion to their replicas; when unset each pool runs its own replicas.",
    )
    startup_budget_seconds: int = Field(
        default=900, ge=30, le=DAY_S, description="Time an SGLang pod may take to load weights before it is restarted."
    )
    engine_wait_timeout_seconds: float = Field(
        default=300.0,
        gt=0,
        le=DAY_S,
        description="Most a rollout round waits while no engine can generate (every worker down, or out of the "
        "rotation after a catch-up weight sync failed); then the trainer exits with an error so the job's restart "
        "resumes it from its last checkpoint.",
    )
    weights_volume: WeightsVolumeSpec | None = Field(
        default=None,
        description="On a cluster: the volume shared by the trainer and the engines for disk weight updates.",
    )

    @model_validator(mode="after")
    def _transport_fits_engine(self) -> RolloutSpec:
        mode = self.weight_transport.mode
        if mode == "tensor" and self.engine != "embedded":
            raise ValueError(
                "rollout.weightTransport.mode: tensor needs engines in the trainer's process (rollout.engine: embedded); "
                "use distributed or disk for engine sglang"
            )
        if mode in ("distributed", "disk") and self.engine == "embedded":
            raise ValueError(
                f"rollout.weightTransport.mode: {mode} sends weights to HTTP engines (rollout.engine: sglang); "
                "the embedded engine takes tensor"
            )
        return self

    @property
    def transport_mode(self) -> Literal["distributed", "disk", "tensor"]:
        """The weight transport in force: the spec's, else the engine's default."""
        if self.weight_transport.mode is not None:
            return self.weight_transport.mode
        return "tensor" if self.engine == "embedded" else "distributed"


# ----------------------------------------------------------------------------------------------
# trainer, checkpoint, metrics


class TrainerSpec(ApiModel):
    """Training loop and, on a cluster, the trainer pods."""

    steps: int = Field(default=20, gt=0, le=MAX_COUNT, description="Optimizer steps (one per rollout round).")
    micro_batch_size: int = Field(
        default=16,
        gt=0,
        le=65536,
        description="Rows per forward/backward pass. A row holds one sample, or with sequencePacking as many "
        "samples as fit in the length of the step's longest one.",
    )
    sequence_packing: bool = Field(
        default=True,
        description="Pack several samples into one row, each kept apart from the others by its own position "
        "ids (a block-diagonal causal mask), so that short answers cost no padding. Off: one right-padded "
        "sample per row. The mask holds rows x length^2 booleans per pass (1 GiB per row at 32k tokens).",
    )
    logprob_chunk_tokens: int = Field(
        default=1024,
        gt=0,
        le=limits.MAX_RESPONSE_TOKENS,
        description="Response tokens whose logits are materialised at once when computing log-probs and "
        "entropy (memory is chunk x vocabulary floats, recomputed in the backward pass).",
    )
    device: str = Field(default="cpu", min_length=1, max_length=64)
    dtype: Literal["float32", "bfloat16"] = Field(
        default="float32",
        description="Precision of the model's parameters. bfloat16 keeps fp32 master weights and fp32 AdamW state.",
    )
    gradient_checkpointing: bool = Field(
        default=False, description="Recompute decoder-layer activations in backward (less memory, ~1.3x compute)."
    )
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    replicas: int = Field(default=1, ge=1, le=1024)
    image: ImageRef | None = None
    vendor: Literal["nvidia", "amd", "cpu"] = Field(default="nvidia", description="GPU vendor; nvidia and amd need gpusPerReplica > 0.")
    gpus_per_replica: int = Field(default=1, ge=0, le=MAX_GPUS_PER_REPLICA)
    node_selector: dict[LabelKey, LabelValue] = label_map()
    tolerations: list[Toleration] = Field(default_factory=list, max_length=MAX_LIST)
    env: list[EnvVar] = Field(default_factory=list, max_length=MAX_LIST, json_schema_extra=LIST_MAP_BY_NAME)
    shm_size: Quantity = Field(default="16Gi", description="On a cluster: size limit of /dev/shm.")


class CheckpointSpec(ApiModel):
    """Checkpoints hold model, optimizer, data cursor, RNG and the partial-rollout buffer."""

    dir: FilePath | None = Field(
        default=None,
        description="Local directory (or mounted volume). Default: runs/<job name>/checkpoints, one folder per job.",
    )
    every_steps: int = Field(default=5, ge=1, le=MAX_COUNT)
    keep: int = Field(default=2, ge=1, le=1000, description="Most recent checkpoints kept.")
    resume: bool = Field(default=True, description="Resume from the newest checkpoint in dir when one exists.")
    uri: str | None = Field(
        default=None,
        min_length=1,
        max_length=2048,
        description="pvc://<claim> (on a cluster: mounts an existing claim) or s3://<bucket>/<prefix> (an "
        "S3-compatible object store, see checkpoint.s3; `dir` then stages each checkpoint before upload). "
        "Unset: on a cluster the operator creates a PVC. Cannot be added, removed or changed.",
        json_schema_extra=cel(
            f"!self.startsWith('pvc://') || (self.size() <= 259 && self.substring(6).matches(r'{DNS1123_SUBDOMAIN_PATTERN}'))",
            "the claim of a pvc:// uri must be a DNS-1123 subdomain (lowercase alphanumerics, '-', '.')",
            f"self.startsWith('pvc://') || self.matches(r'{S3_URI_PATTERN}')",
            "must be pvc://CLAIM or s3://BUCKET/PREFIX (a bucket of 3-63 lowercase letters, digits, '.', '-'); "
            "the runtime cannot write other schemes or paths",
        ),
    )
    s3: S3Spec | None = Field(default=None, description="Object store settings of an s3:// uri.")
    rollback_to: CheckpointRollback | None = Field(
        default=None,
        description="Roll back to an older checkpoint on the next start (set by the RollbackToCheckpoint alert action).",
    )
    storage_size: Quantity = Field(default="10Gi", description="On a cluster: size of the checkpoint PVC (a quantity).")
    storage_class_name: DNS1123Subdomain | None = Field(
        default=None, description="On a cluster: storage class of the PVC; cannot change."
    )
    access_mode: Literal["ReadWriteOnce", "ReadWriteMany"] = Field(
        default="ReadWriteOnce",
        description="On a cluster: access mode of the checkpoint PVC (ReadWriteMany for trainers on several nodes); "
        "cannot change.",
    )

    @field_validator("uri")
    @classmethod
    def _writable_uri(cls, uri: str | None) -> str | None:
        if uri is None:
            return uri
        if uri.startswith(PVC_URI_PREFIX):
            if not re.match(DNS1123_SUBDOMAIN_PATTERN, uri[len(PVC_URI_PREFIX):]):
                raise ValueError("the claim of a pvc:// uri must be a DNS-1123 subdomain (lowercase alphanumerics, '-', '.')")
        elif not re.match(S3_URI_PATTERN, uri):
            raise ValueError(
                f"{uri!r} must be pvc://CLAIM or s3://BUCKET/PREFIX (a bucket of 3-63 lowercase letters, digits, "
                "'.', '-'); the runtime cannot write other schemes or paths (a local folder goes in checkpoint.dir)"
            )
        return uri

    @model_validator(mode="after")
    def _s3_needs_s3_uri(self) -> CheckpointSpec:
        if self.s3 is not None and not (self.uri or "").startswith(S3_URI_PREFIX):
            raise ValueError("checkpoint.s3 is set but checkpoint.uri is not an s3:// URI; set uri: s3://BUCKET/PREFIX")
        return self


class CheckpointRollback(ApiModel):
    """Resume once from an older checkpoint (the operator's RollbackToCheckpoint alert action sets it)."""

    step: int = Field(
        ge=0, le=MAX_COUNT,
        description="Resume from the newest complete checkpoint at or before this step; the newer ones are set aside "
        "(moved to <dir>/rolled-back-<id>/, deleted from an object store).",
    )
    id: str = Field(
        min_length=1, max_length=63, pattern=DNS1035_LABEL_PATTERN,
        description="Names this rollback: the runtime applies it once (a marker rollback-<id> in the checkpoint "
        "folder or store), so later restarts resume from the newest checkpoint again.",
    )


class MetricsSpec(ApiModel):
    """Prometheus endpoint and JSON-lines log of the runtime."""

    port: int = Field(default=0, ge=0, le=65535, description="Prometheus /metrics port; 0 disables it.")
    host: str = Field(default="127.0.0.1", min_length=1, max_length=253)
    jsonl: FilePath | None = Field(default=None, description="JSON-lines file; defaults to <output>/metrics.jsonl.")


# ----------------------------------------------------------------------------------------------
# autotune


# The labels that tie a series to its job (rljob_job_info{rljob=<name>,rljob_namespace=<namespace>}): the
# operator sets them, so matchLabels may not, or one job could read another's series.
RESERVED_SELECTOR_LABELS = ("rljob", "rljob_namespace")
_RESERVED_LABELS = (
    "matchLabels cannot set rljob or rljob_namespace: the autotuner sets them to the job's own name and namespace"
)


class AutotunePrometheusSpec(ApiModel):
    """Where the operator's autotuner reads the runtime metrics."""

    address: HttpUrl | None = Field(
        default=None,
        description="Prometheus base URL, e.g. http://prometheus.monitoring:9090. Unset: the operator's "
        "default (chart value autotune.prometheus.address, env RLJOB_PROMETHEUS_ADDRESS). Another address must "
        "be on the chart's allow-list (autotune.prometheus.allowedAddresses) and gets only this job's own token "
        "(bearerTokenSecretRef), never the chart's; link-local and cloud-metadata addresses and #fragments are refused.",
        json_schema_extra=cel(
            "!self.contains('#')", f"address {FRAGMENT_MESSAGE}",
            f"!self.matches(r'{FORBIDDEN_HOST_PATTERN}')", f"address {FORBIDDEN_HOST_MESSAGE}",
        ),
    )
    bearer_token_secret_ref: SecretKeyRef | None = Field(
        default=None, description="Secret key holding a bearer token sent as Authorization: Bearer."
    )
    timeout_seconds: float = Field(default=5.0, gt=0, le=60, description="Timeout of one instant query.")
    match_labels: dict[Annotated[str, StringConstraints(max_length=128, pattern=r"^[a-zA-Z_][a-zA-Z0-9_]*$")], Text] = Field(
        default_factory=dict,
        max_length=16,
        description="Extra label matchers for this job's series, added to rljob=<name> and "
        "rljob_namespace=<namespace> (those two are reserved).",
        json_schema_extra=cel(
            " && ".join(f"!('{label}' in self)" for label in RESERVED_SELECTOR_LABELS), _RESERVED_LABELS
        ),
    )

    @field_validator("match_labels")
    @classmethod
    def _not_reserved(cls, labels: dict[str, str]) -> dict[str, str]:
        if any(label in labels for label in RESERVED_SELECTOR_LABELS):
            raise ValueError(_RESERVED_LABELS)
        return labels

    @field_validator("address")
    @classmethod
    def _safe_address(cls, url: str | None) -> str | None:
        problem = credential_target_problem(url) if url is not None else None
        if problem:
            raise ValueError(f"address {problem}")
        return url


class KnobBounds(ApiModel):
    """Range and largest single change of one tuned knob."""

    model_config = ConfigDict(json_schema_extra=cel("self.min <= self.max", "min must not exceed max"))

    min: float = Field(ge=0, le=limits.TRUNCATION_TOKENS_MAX)
    max: float = Field(ge=0, le=limits.TRUNCATION_TOKENS_MAX)
    max_step: float = Field(gt=0, le=limits.TRUNCATION_TOKENS_MAX, description="Largest change in one adjustment.")

    @model_validator(mode="after")
    def _ordered(self) -> KnobBounds:
        if self.min > self.max:
            raise ValueError("min must not exceed max")
        return self


# The tuned knobs' bounds lie inside what the runtime accepts (api/knob_limits.py): a bound outside
# would let the autotuner write a value the runtime clamps, and the loop would never see its effect.


class OverSamplingBounds(KnobBounds):
    """Bounds of the over-sampling ratio."""

    min: float = Field(ge=limits.OVER_SAMPLING_MIN, le=limits.OVER_SAMPLING_MAX)
    max: float = Field(ge=limits.OVER_SAMPLING_MIN, le=limits.OVER_SAMPLING_MAX)
    max_step: float = Field(gt=0, le=limits.OVER_SAMPLING_MAX, description="Largest change in one adjustment.")


class TruncationKBounds(KnobBounds):
    """Bounds of the sigma multiplier k."""

    min: float = Field(gt=limits.TRUNCATION_K_MIN_EXCLUSIVE, le=limits.TRUNCATION_K_MAX)
    max: float = Field(gt=limits.TRUNCATION_K_MIN_EXCLUSIVE, le=limits.TRUNCATION_K_MAX)
    max_step: float = Field(gt=0, le=limits.TRUNCATION_K_MAX, description="Largest change in one adjustment.")


class TruncationTokensBounds(KnobBounds):
    """Bounds of the segment cap in tokens."""

    min: float = Field(ge=limits.TRUNCATION_TOKENS_MIN, le=limits.TRUNCATION_TOKENS_MAX)
    max: float = Field(ge=limits.TRUNCATION_TOKENS_MIN, le=limits.TRUNCATION_TOKENS_MAX)


class TruncationBand(ApiModel):
    """Healthy range of the truncation rate (share of launched samples the length threshold cuts; samples
    still running at stop-upon-collection are the partial rate, not in it: docs/metrics.md)."""

    model_config = ConfigDict(json_schema_extra=cel("self.low < self.high", "low must be below high"))

    low: float = Field(default=0.15, ge=0, le=1)
    high: float = Field(default=0.25, ge=0, le=1)

    @model_validator(mode="after")
    def _ordered(self) -> TruncationBand:
        if self.low >= self.high:
            raise ValueError("low must be below high")
        return self


class AutotuneSpec(ApiModel):
    """Closed-loop tuning of over-sampling and the truncation threshold (see docs/autotune.md).

    The spec is never rewritten: tuned values go to status.effectiveKnobs (Apply) or
    status.recommendedKnobs (Recommend), and the runtime applies effectiveKnobs at a round boundary.
    """

    mode: Literal["Off", "Recommend", "Apply"] = "Off"
    prometheus: AutotunePrometheusSpec = Field(default_factory=AutotunePrometheusSpec)
    interval_seconds: int = Field(default=30, ge=1, le=3600, description="Time between two decisions.")
    window_seconds: int = Field(
        default=60, ge=1, le=3600, description="Metrics are averaged over this window before deciding."
    )
    cooldown_seconds: int = Field(
        default=120, ge=0, le=86400, description="Least time between two changes (should exceed windowSeconds)."
    )
    settle_rounds: int = Field(
        default=2, ge=0, le=100, description="Rounds that must complete under new knobs before the next change."
    )
    truncation_band: TruncationBand = Field(default_factory=TruncationBand)
    hysteresis: float = Field(
        default=0.03, ge=0, le=0.5, description="Margin outside the band before tuning starts; it stops inside the band."
    )
    over_sampling: OverSamplingBounds = Field(
        default_factory=lambda: OverSamplingBounds(min=1.0, max=4.0, max_step=0.5)
    )
    truncation_k: TruncationKBounds = Field(
        default_factory=lambda: TruncationKBounds(min=0.5, max=6.0, max_step=0.5),
        description="Bounds of k (truncation mode sigma).",
    )
    truncation_tokens: TruncationTokensBounds = Field(
        default_factory=lambda: TruncationTokensBounds(min=8, max=limits.TRUNCATION_TOKENS_MAX, max_step=64),
        description="Bounds of the segment cap in tokens (truncation mode tokens); capped by maxResponseLength.",
    )
    min_length_spread: float = Field(
        default=0.1, ge=0, le=100, description="Below this σ/μ of response lengths over-sampling buys nothing and is lowered."
    )
    max_off_policy_ratio: float = Field(
        default=0.8, ge=0, le=1, description="Over-sampling is lowered while the off-policy token ratio is above."
    )
    max_aborted_token_share: float = Field(
        default=0.3, ge=0, le=1,
        description="Staleness budget: over-sampling is lowered while a larger share of generated tokens is thrown "
        "away (regenerated over maxStaleness, filtered, discarded).",
    )
    entropy_floor: float | None = Field(
        default=None, ge=0, le=100, description="Over-sampling is lowered while the policy entropy is below (unset: no floor)."
    )
    goodput_tolerance: float = Field(
        default=0.05, gt=0, le=1,
        description="Smallest relative goodput change the over-sampling search counts as a difference (its hysteresis); "
        "a noisier goodput widens it to twice the standard error of the difference (docs/autotune.md).",
    )
    local: bool = Field(default=False, description="rljob run: tune from the runtime's own step metrics.")
    knobs_file: FilePath | None = Field(
        default=None, description="rljob run: JSON/YAML file of knob overrides, re-read when it changes."
    )


# ----------------------------------------------------------------------------------------------
# alert actions


# The chart's alerts a job can act on (charts/rljob-operator/files/rljob-alerts.rules.yaml): runtime alerts
# about the job's own training, whose condition the operator checks with the chart rule's own expression.
ActionableAlert = Literal[
    "RLJobTruncationRateHigh", "RLJobTokenWasteHigh", "RLJobEngineIdleHigh", "RLJobEntropyCollapse",
    "RLJobRewardCollapse", "RLJobStalenessOverBudget",
]
ACTIONABLE_ALERTS: tuple[str, ...] = get_args(ActionableAlert)
# A rollback undoes training that went wrong: the policy collapsed. Other conditions are about the rollout's
# efficiency, which an older policy does not fix.
ROLLBACK_ALERTS = ("RLJobEntropyCollapse", "RLJobRewardCollapse")
_ROLLBACK_ALERTS_CEL = "[" + ", ".join(f"'{a}'" for a in ROLLBACK_ALERTS) + "]"
AlertAction = Literal["Notify", "Suspend", "RollbackToCheckpoint"]
_ROLLBACK_ONLY_ON_COLLAPSE = (
    "action RollbackToCheckpoint is for " + " and ".join(ROLLBACK_ALERTS) + " only: an older checkpoint does not fix "
    "the rollout's efficiency; use Notify or Suspend"
)
_LR_ONLY_ON_ROLLBACK = "learningRate is for action RollbackToCheckpoint only (the learning rate the resumed run trains with)"
_LR_NOT_LOWER = "learningRate must not exceed algorithm.learningRate: a rollback resumes with a lower learning rate"


class AlertActionSpec(ApiModel):
    """What the operator does while one of the job's alert conditions holds (docs/alerts.md#alerts-that-act)."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            f"!has(self.action) || self.action != 'RollbackToCheckpoint' || self.alert in {_ROLLBACK_ALERTS_CEL}",
            _ROLLBACK_ONLY_ON_COLLAPSE,
            "!has(self.learningRate) || (has(self.action) && self.action == 'RollbackToCheckpoint')",
            _LR_ONLY_ON_ROLLBACK,
        )
    )

    alert: ActionableAlert = Field(
        description="The chart alert whose condition (its expression, for this job's series) the operator checks."
    )
    action: AlertAction = Field(
        default="Notify",
        description="Notify: an Event and the AlertAction condition. Suspend: also sets spec.suspend. "
        "RollbackToCheckpoint (entropy or reward collapse): also resumes from the newest checkpoint taken before the "
        "condition began (spec.checkpoint.rollbackTo), with learningRate if given.",
    )
    for_seconds: int | None = Field(
        default=None, ge=0, le=DAY_S,
        description="How long the condition must hold before the action; unset: the chart rule's `for`.",
    )
    learning_rate: float | None = Field(
        default=None, gt=0, le=1,
        description="RollbackToCheckpoint: the learning rate the resumed run trains with (written to "
        "algorithm.learningRate); unset: unchanged.",
    )

    @model_validator(mode="after")
    def _action_fits(self) -> AlertActionSpec:
        if self.action == "RollbackToCheckpoint" and self.alert not in ROLLBACK_ALERTS:
            raise ValueError(f"action: {_ROLLBACK_ONLY_ON_COLLAPSE}")
        if self.learning_rate is not None and self.action != "RollbackToCheckpoint":
            raise ValueError(f"learningRate: {_LR_ONLY_ON_ROLLBACK}")
        return self


_HELD_OUT_REQUIRED = (
    "evaluation.jsonl or evaluation.parquet is required when evaluation is on and the training data is a file"
)


class EvaluationSpec(ApiModel):
    """Periodic evaluation on held-out prompts.

    Training-batch reward is a poor learning curve under partial rollouts: a round's batch mixes fresh
    groups that finished early (short, easy) with resumed ones (long, hard), so its reward moves with
    the length mix. A fixed held-out set sampled the same way every time is the curve to watch.
    """

    every_steps: int = Field(
        default=0, ge=0, le=MAX_COUNT, description="Evaluate before the first step, every N steps and after the last; 0: off."
    )
    prompts: int = Field(
        default=128, gt=0, le=100_000,
        description="Held-out prompts per evaluation: synthetic problems after the training ones, or the first "
        "records of evaluation.jsonl.",
    )
    jsonl: FilePath | None = Field(
        default=None,
        description="Held-out JSONL file (rows like data's; on a cluster also pvc://<claim>/<file>); required when "
        "the training data is a file.",
    )
    parquet: FilePath | None = Field(default=None, description="Held-out Parquet file, instead of jsonl.")
    temperature: float | None = Field(default=None, ge=0, le=10, description="Sampling temperature; default rollout.temperature.")

    @property
    def file(self) -> str | None:
        """The held-out file (jsonl or parquet), if any."""
        return self.jsonl or self.parquet


class ExtraVolume(ApiModel):
    """A Kubernetes Volume object, passed through as written: the API server validates it in the pods."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})

    name: DNS1123Label


class VolumeMount(ApiModel):
    """A mount of one of spec.pods.volumes into the main container."""

    name: DNS1123Label
    mount_path: str = Field(min_length=1, max_length=PATH_MAX, pattern=r"^/")
    read_only: bool = False
    sub_path: FilePath | None = None


MAX_ID = 2**31 - 1  # Kubernetes' bound on uids and gids (int64 in the API, 32-bit signed on Linux)
_ROOT_UID = "runAsUser 0 is root: every child pod runs with runAsNonRoot: true; choose a uid of 1 or more"
# Group 0 owns root's files (/etc/shadow on many images, host paths): a pod in it reads and writes them.
_ROOT_GID = "{field} 0 is the root group: it grants root's group access to files and volumes; choose a gid of 1 or more"


class PodSecuritySpec(ApiModel):
    """Who the child pods run as (pod securityContext). Unset ids keep each image's own user (runtime
    1000, SGLang 10001, router 65532); a cluster whose policy assigns uid ranges (OpenShift's
    restricted SCC, a PodSecurity admission with fixed ranges) sets them here."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                rule("!has(self.runAsUser) || self.runAsUser != 0", _ROOT_UID, ".runAsUser"),
                rule("!has(self.runAsGroup) || self.runAsGroup != 0", _ROOT_GID.format(field="runAsGroup"), ".runAsGroup"),
                rule("!has(self.fsGroup) || self.fsGroup != 0", _ROOT_GID.format(field="fsGroup"), ".fsGroup"),
            ]
        }
    )

    run_as_user: int | None = Field(
        default=None, ge=0, le=MAX_ID, description="uid of every container (default: the image's own non-root user)."
    )
    run_as_group: int | None = Field(
        default=None, ge=0, le=MAX_ID, description="Primary gid of every container (default: the uid's value)."
    )
    fs_group: int = Field(
        default=1000, ge=0, le=MAX_ID, description="Group that owns mounted volumes, so the non-root containers can write them."
    )

    @field_validator("run_as_user")
    @classmethod
    def _not_root(cls, uid: int | None) -> int | None:
        if uid == 0:
            raise ValueError(_ROOT_UID)
        return uid

    @field_validator("run_as_group", "fs_group")
    @classmethod
    def _not_root_group(cls, gid: int | None, info: ValidationInfo) -> int | None:
        if gid == 0:
            raise ValueError(_ROOT_GID.format(field=to_camel(info.field_name or "")))
        return gid


class PodPolicySpec(ApiModel):
    """What every pod the operator creates (inference, router, trainer) gets (operator only)."""

    image_pull_secrets: list[DNS1123Subdomain] = Field(
        default_factory=list, max_length=MAX_LIST, description="Secrets (docker-registry) to pull the images with."
    )
    priority_class_name: DNS1123Subdomain | None = None
    scheduler_name: DNS1123Subdomain | None = Field(default=None, description="For example a gang scheduler (volcano, kai).")
    security_context: PodSecuritySpec = Field(
        default_factory=lambda: PodSecuritySpec(),
        description="Users and groups of every child pod (runAsNonRoot stays true: uid 0 is refused).",
    )
    volumes: list[ExtraVolume] = Field(
        default_factory=list, max_length=MAX_LIST, description="Extra pod volumes (Kubernetes Volume objects)."
    )
    volume_mounts: list[VolumeMount] = Field(
        default_factory=list, max_length=MAX_LIST,
        description="Mounts of those volumes into every container of every pod, the download steps (init "
        "containers) included, so a CA bundle or proxy settings mounted here reach a model download too."
    )


_BACKOFF_ORDER = "interruptionBackoffMaxSeconds must be at least interruptionBackoffSeconds"


class FailurePolicySpec(ApiModel):
    """How interruptions of the trainer group (eviction, preemption, node shutdown, SIGTERM) are handled.

    Failures (a non-zero exit) are bounded by `spec.backoffLimit`; interruptions are not failures, but a
    job preempted in a loop must not restart forever nor at once each time: they are capped and back off.
    """

    model_config = ConfigDict(
        json_schema_extra=cel(
            "!has(self.interruptionBackoffSeconds) || !has(self.interruptionBackoffMaxSeconds) "
            "|| self.interruptionBackoffMaxSeconds >= self.interruptionBackoffSeconds",
            _BACKOFF_ORDER,
        )
    )

    max_interruptions: int = Field(
        default=20,
        ge=0,
        le=10000,
        description="Trainer group restarts after interruptions allowed before the job fails (InterruptionLimitExceeded).",
    )
    interruption_backoff_seconds: int = Field(
        default=10,
        ge=0,
        le=86400,
        description="Wait before the group restarts after its first interruption; doubles with each further one.",
    )
    interruption_backoff_max_seconds: int = Field(
        default=600, ge=0, le=86400, description="The longest wait before a restart after an interruption."
    )

    @model_validator(mode="after")
    def _ordered(self) -> FailurePolicySpec:
        if self.interruption_backoff_max_seconds < self.interruption_backoff_seconds:
            raise ValueError(_BACKOFF_ORDER)
        return self

    def interruption_delay(self, interruptions: int) -> int:
        """Seconds before the group restarts after its `interruptions`-th interruption (1-based): capped doubling."""
        if interruptions < 1 or self.interruption_backoff_seconds == 0:
            return 0
        return min(self.interruption_backoff_max_seconds, self.interruption_backoff_seconds * 2 ** min(interruptions - 1, 30))


_BUILTIN_ON_GPU = (
    "model.builtin cannot run on GPU inference pools: their SGLang pods load a Hugging Face model; use "
    "model.huggingFace or model.path: pvc://<claim>/<folder>"
)
_LOCAL_PATH_ON_GPU = (
    "model.path must be pvc://<claim>/<folder> on GPU inference pools: their pods cannot see a local folder"
)
# Both rules hold for cluster objects only (the CRD); `rljob run` keeps local models. Pools default
# to one NVIDIA pool when none is listed.
_GPU_POOLS = "(!has(self.rollout.pools) || size(self.rollout.pools) == 0 || self.rollout.pools.exists(p, p.vendor in {vendors}))".format(
    vendors=list(GPU_VENDORS)
)
# The weight-update group of `distributed` is ONE communicator: with NCCL (the default whenever the
# trainer has GPUs; RCCL on ROCm) every engine rank must run the trainer's vendor and collective
# library. NVIDIA's NCCL and AMD's RCCL do not talk to each other, and the CPU server joins gloo only.
_MIXED_VENDOR_NCCL = (
    "the distributed weight transport over nccl (rollout.weightTransport.mode, .backend) puts every inference pool in one "
    "communicator with the trainer, so every pool's vendor must be trainer.vendor (NCCL and AMD's RCCL do not "
    "interoperate; cpu pools join gloo only); set rollout.weightTransport.mode: disk with rollout.weightsVolume "
    "(a ReadWriteMany claim every pod mounts), or run every pool on the trainer's vendor"
)
_DISK_NEEDS_SHARED_FOLDER = (
    "rollout.weightTransport.mode disk needs a folder the trainer and the inference pods both mount; set "
    "rollout.weightsVolume (a ReadWriteMany claim), or rollout.weightTransport.diskDir on a volume of pods.volumes"
)
_TRAINER_VENDOR = f"({cel_has('self.trainer.vendor')} ? self.trainer.vendor : 'nvidia')"
_DISTRIBUTED = (
    f"({cel_has('self.rollout.weightTransport.mode')} ? self.rollout.weightTransport.mode == 'distributed' "
    f": ({cel_has('self.rollout.engine')} && self.rollout.engine == 'sglang'))"
)
_NCCL = (
    f"({cel_has('self.rollout.weightTransport.backend')} ? self.rollout.weightTransport.backend == 'nccl' "
    f": {_TRAINER_VENDOR} != 'cpu')"
)
_ONE_VENDOR = (
    f"((!has(self.rollout.pools) || size(self.rollout.pools) == 0) ? {_TRAINER_VENDOR} == '{DEFAULT_POOL_VENDOR}' "
    f": self.rollout.pools.all(p, p.vendor == {_TRAINER_VENDOR}))"
)
# ----------------------------------------------------------------------------------------------
# cluster rules: Hugging Face ids the pods must resolve, claims their pods must be able to share

_HUB_OFFLINE = (
    "{key}.huggingFace on a cluster needs {key}.storage.huggingFaceCache (a claim holding the Hugging Face cache) "
    "or {key}.storage.download (fetch it in an init container): the pods resolve the id offline, in a cache "
    "that starts empty"
)
_RWO_CHECKPOINT = (
    "checkpoint.accessMode ReadWriteOnce cannot serve trainer.replicas > 1: every trainer pod mounts the "
    "checkpoint claim, and the pods of a gang run on different nodes; set checkpoint.accessMode: ReadWriteMany "
    "(a storage class that offers it) or checkpoint.uri: pvc://<a ReadWriteMany claim>"
)
_MULTI_TRAINER = f"({cel_has('self.trainer.replicas')} && self.trainer.replicas > 1)"
HUB_CLUSTER_RULES = [
    rule(
        f"!({cel_has(f'self.{key}.huggingFace')}) || ({cel_has(f'self.{key}.storage.huggingFaceCache')}) "
        f"|| ({cel_has(f'self.{key}.storage.download')})",
        _HUB_OFFLINE.format(key=key),
        f".{key}.huggingFace",
    )
    for key in ("model", "data")
]
ACCESS_CLUSTER_RULES = [
    rule(
        f"({cel_has('self.checkpoint.uri')}) || !{_MULTI_TRAINER} "
        f"|| ({cel_has('self.checkpoint.accessMode')} && self.checkpoint.accessMode != 'ReadWriteOnce')",
        _RWO_CHECKPOINT,
        ".checkpoint.accessMode",
    ),
]


def _hub_problems(spec: RLJobSpec) -> list[str]:
    """HUB_CLUSTER_RULES: a Hub id no pod could resolve (no cache claim, no download)."""
    problems = []
    for key, source in (("model", spec.model), ("data", spec.data)):
        storage = source.storage
        if source.hugging_face and (storage is None or (storage.hugging_face_cache is None and storage.download is None)):
            problems.append(f"spec.{key}.huggingFace: {_HUB_OFFLINE.format(key=key)}")
    return problems


def _claim_access_problems(spec: RLJobSpec) -> list[str]:
    """ACCESS_CLUSTER_RULES: the operator's checkpoint claim cannot serve every trainer pod."""
    if spec.checkpoint.uri is None and spec.trainer.replicas > 1 and spec.checkpoint.access_mode == "ReadWriteOnce":
        return [f"spec.checkpoint.accessMode: {_RWO_CHECKPOINT}"]
    return []


CLUSTER_RULES = [
    *HUB_CLUSTER_RULES,
    *ACCESS_CLUSTER_RULES,
    {"rule": f"!has(self.model.builtin) || !{_GPU_POOLS}", "message": _BUILTIN_ON_GPU, "fieldPath": ".model.builtin"},
    {
        "rule": f"!has(self.model.path) || self.model.path.startsWith('{PVC_URI_PREFIX}') || !{_GPU_POOLS}",
        "message": _LOCAL_PATH_ON_GPU,
        "fieldPath": ".model.path",
    },
    rule(f"!{_DISTRIBUTED} || !{_NCCL} || {_ONE_VENDOR}", _MIXED_VENDOR_NCCL, ".rollout.weightTransport.mode"),
    rule(
        f"!({cel_has('self.rollout.weightTransport.mode')}) || self.rollout.weightTransport.mode != 'disk' "
        f"|| has(self.rollout.weightsVolume) || ({cel_has('self.rollout.weightTransport.diskDir')}) "
        f"|| ({cel_has('self.rollout.sglang.weightsDir')})",
        _DISK_NEEDS_SHARED_FOLDER,
        ".rollout.weightTransport.mode",
    ),
]


def nccl_outsiders(spec: RLJobSpec) -> list[tuple[str, str]]:
    """(pool name, vendor) of the inference pools that cannot join the trainer's NCCL weight-update group.

    Empty unless the transport is `distributed` over NCCL (the backend's default whenever the trainer
    runs on GPUs, as `runtime/weights/factory.py` picks it).
    """
    rollout = spec.rollout
    backend = rollout.weight_transport.backend or ("gloo" if spec.trainer.vendor == "cpu" else "nccl")
    if rollout.transport_mode != "distributed" or backend != "nccl":
        return []
    pools: list[tuple[str, PoolVendor]] = [(p.name, p.vendor) for p in rollout.pools] or [("default", DEFAULT_POOL_VENDOR)]
    return [(name, vendor) for name, vendor in pools if vendor != spec.trainer.vendor]


def cluster_problems(spec: RLJobSpec) -> list[str]:
    """Why a cluster cannot run this spec (the CRD's CLUSTER_RULES, for `rljob validate --cluster`)."""
    gpu_pools = not spec.rollout.pools or any(p.vendor in GPU_VENDORS for p in spec.rollout.pools)
    problems = [*_hub_problems(spec), *_claim_access_problems(spec)]
    if gpu_pools and spec.model.builtin:
        problems.append(f"spec.model.builtin: {_BUILTIN_ON_GPU}")
    if gpu_pools and spec.model.path and not spec.model.path.startswith(PVC_URI_PREFIX):
        problems.append(f"spec.model.path: {_LOCAL_PATH_ON_GPU}")
    outsiders = nccl_outsiders(spec)
    if outsiders:
        pools = ", ".join(f"{name} ({vendor})" for name, vendor in outsiders)
        problems.append(
            f"spec.rollout.weightTransport.mode: {_MIXED_VENDOR_NCCL} (trainer.vendor {spec.trainer.vendor}; "
            f"other pools: {pools})"
        )
    rollout = spec.rollout
    shared = rollout.weights_volume or rollout.weight_transport.disk_dir or rollout.sglang.weights_dir
    if rollout.weight_transport.mode == "disk" and not shared:
        problems.append(f"spec.rollout.weightTransport.mode: {_DISK_NEEDS_SHARED_FOLDER}")
    return problems


_GPU_VENDOR_NEEDS_GPUS = "trainer.gpusPerReplica must be at least 1 when trainer.vendor is nvidia or amd (use vendor cpu)"
_GROUP_NEEDS_SAMPLES = (
    "rollout.samplesPerPrompt must be at least 2 for group-normalised algorithms (grpo, dapo): "
    "one sample per group has no advantage"
)
_ONE_HUB_CACHE = (
    "data.storage.huggingFaceCache must be model.storage.huggingFaceCache when both are set: a trainer pod mounts "
    "one Hugging Face cache (HF_HUB_CACHE)"
)
_GROUP_ALGOS = "[" + ", ".join(f"'{a}'" for a in GROUP_NORMALISED_ALGORITHMS) + "]"


# Rules on the whole spec (cross-field, and transition rules comparing with the stored object).
# Guards with has() because CEL sees the object after defaulting, but must compile for any shape.
SPEC_RULES: list[dict[str, Any]] = [
    rule(
        "!has(self.evaluation) || !has(self.evaluation.everySteps) || self.evaluation.everySteps == 0 "
        "|| has(self.data.synthetic) || has(self.evaluation.jsonl) || has(self.evaluation.parquet)",
        _HELD_OUT_REQUIRED,
        ".evaluation",
    ),
    rule(
        f"!({cel_has('self.trainer.gpusPerReplica')}) || self.trainer.gpusPerReplica > 0 "
        f"|| ({cel_has('self.trainer.vendor')} && self.trainer.vendor == 'cpu')",
        _GPU_VENDOR_NEEDS_GPUS,
        ".trainer.gpusPerReplica",
    ),
    rule(
        f"!({cel_has('self.rollout.samplesPerPrompt')}) || self.rollout.samplesPerPrompt >= 2 "
        f"|| ({cel_has('self.algorithm.name')} && !(self.algorithm.name in {_GROUP_ALGOS}))",
        _GROUP_NEEDS_SAMPLES,
        ".rollout.samplesPerPrompt",
    ),
    rule(
        f"!({cel_has('self.model.storage.huggingFaceCache')}) || !({cel_has('self.data.storage.huggingFaceCache')}) "
        "|| self.model.storage.huggingFaceCache == self.data.storage.huggingFaceCache",
        _ONE_HUB_CACHE,
        ".data.storage.huggingFaceCache",
    ),
    rule(
        "!has(self.alertActions) || self.alertActions.all(a, !has(a.learningRate) || a.learningRate <= "
        f"({cel_has('self.algorithm.learningRate')} ? self.algorithm.learningRate : {AlgorithmSpec().learning_rate}))",
        _LR_NOT_LOWER,
        ".alertActions",
    ),
    *(
        rule(expr, f"spec.{path} is immutable: it cannot be added, removed or changed once the RLJob exists", f".{path}")
        for expr, path in (
            immutable_optional("checkpoint.uri"),
            immutable_optional("checkpoint.storageClassName"),
            immutable_optional("checkpoint.accessMode"),
        )
    ),
]


class RLJobSpec(ApiModel):
    """Everything one RL job needs; the same spec runs locally and on a cluster."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": SPEC_RULES})  # type: ignore[dict-item]

    model: ModelSpec = Field(json_schema_extra=IMMUTABLE)
    data: DataSpec = Field(json_schema_extra=IMMUTABLE)
    reward: RewardSpec = Field(default_factory=RewardSpec)
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    metrics: MetricsSpec = Field(default_factory=MetricsSpec)
    autotune: AutotuneSpec = Field(default_factory=AutotuneSpec)
    evaluation: EvaluationSpec = Field(default_factory=EvaluationSpec)
    pods: PodPolicySpec = Field(default_factory=PodPolicySpec)
    suspend: bool = False
    active_deadline_seconds: int | None = Field(default=None, gt=0, le=2**31 - 1)
    backoff_limit: int = Field(default=3, ge=0, le=1000)
    failure_policy: FailurePolicySpec = Field(default_factory=FailurePolicySpec)
    alert_actions: list[AlertActionSpec] = Field(
        default_factory=list,
        max_length=len(ACTIONABLE_ALERTS),
        description="What the operator does when the job's own alert conditions hold, checked against "
        "spec.autotune.prometheus every autotune.intervalSeconds (docs/alerts.md#alerts-that-act). One entry per alert.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["alert"]},
    )

    @field_validator("alert_actions")
    @classmethod
    def _one_per_alert(cls, actions: list[AlertActionSpec]) -> list[AlertActionSpec]:
        seen: set[str] = set()
        for index, entry in enumerate(actions):
            if entry.alert in seen:
                raise ValueError(f"[{index}].alert: {entry.alert} is listed twice; one entry per alert")
            seen.add(entry.alert)
        return actions

    @model_validator(mode="after")
    def _rollback_rate_lower(self) -> RLJobSpec:
        for index, entry in enumerate(self.alert_actions):
            if entry.learning_rate is not None and entry.learning_rate > self.algorithm.learning_rate:
                raise ValueError(f"alertActions[{index}].learningRate: {_LR_NOT_LOWER}")
        return self

    @model_validator(mode="after")
    def _held_out_set(self) -> RLJobSpec:
        if self.evaluation.every_steps and self.data.synthetic is None and self.evaluation.file is None:
            raise ValueError(_HELD_OUT_REQUIRED)
        t = self.trainer
        if t.vendor != "cpu" and t.gpus_per_replica == 0:
            raise ValueError(_GPU_VENDOR_NEEDS_GPUS)
        if self.algorithm.name in GROUP_NORMALISED_ALGORITHMS and self.rollout.samples_per_prompt < 2:
            raise ValueError(_GROUP_NEEDS_SAMPLES)
        caches = {s.hugging_face_cache for s in (self.model.storage, self.data.storage) if s and s.hugging_face_cache}
        if len(caches) > 1:
            raise ValueError(_ONE_HUB_CACHE)
        return self


class ObjectMeta(ApiModel):
    """The subset of Kubernetes metadata the runtime reads; the API server owns the rest."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    name: str = Field(
        min_length=1,
        max_length=MAX_JOB_NAME,
        pattern=DNS1035_LABEL_PATTERN,
        description="A DNS-1035 label: the operator derives Service and StatefulSet names from it.",
    )
    namespace: DNS1123Label | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class RLJob(ApiModel):
    """A whole RLJob document. `status` is owned by the operator and ignored by `rljob run`."""

    # (an f-string is a str to mypy, not the literal it equals)
    api_version: Literal["rljob.io/v1alpha1"] = Field(default=f"{API_GROUP}/{API_VERSION}", alias="apiVersion")  # type: ignore[arg-type]
    kind: Literal["RLJob"] = KIND
    metadata: ObjectMeta
    spec: RLJobSpec
    status: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _checkpoint_dir_per_job(self) -> RLJob:
        # A shared default folder let one job resume another's checkpoints; each job gets its own.
        if self.spec.checkpoint.dir is None:
            self.spec.checkpoint.dir = f"runs/{self.metadata.name}/checkpoints"
        return self
