"""`rljob export`: a training checkpoint as a Hugging Face model folder that transformers and SGLang load.

A checkpoint holds the policy's weights (torch.distributed.checkpoint, `trainer/`, whatever number of
ranks wrote them) and the job spec it was trained under (`state.pt`); the spec says which
model folder the run started from, which supplies the config, generation config and tokenizer. The
trained weights are written as safetensors next to them, into a temporary sibling renamed into place,
so an interrupted export never leaves a folder that looks complete.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import torch

from rljob.api.spec import RLJob
from rljob.runtime.checkpoint import LEADER_STATE, MARKER, TRAINER_DIR, CheckpointManager, step_of
from rljob.runtime.models.errors import ExportError
from rljob.runtime.models.loading import load_causal_lm
from rljob.runtime.object_store import ObjectStore, ObjectStoreError, ObjectUri, is_object_uri

EXPORT_INFO = "rljob_export.json"


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote."""

    directory: Path
    checkpoint: str  # the folder or s3:// URI exported
    step: int
    policy_version: int
    dtype: str
    hf_tokenizer: bool  # False for the builtin character tokenizer, which only rljob reads


def find_checkpoint(path: Path) -> Path:
    """The checkpoint folder `path` names: a step-N folder, its state.pt, or a checkpoint dir (newest)."""
    if path.is_file() and path.name == LEADER_STATE:
        return path.parent
    if (path / LEADER_STATE).is_file():
        return path
    latest = CheckpointManager(path).latest()
    if latest is None:
        raise ExportError(f"CHECKPOINT: {path} holds no checkpoint (no state.pt, no step-* folder with one)")
    return latest


def fetch_checkpoint(uri: str, into: Path) -> Path:
    """Download the checkpoint an s3:// URI names into `into`: a step-N folder (it must hold its
    completion marker), or under a prefix the newest complete one. The store is reached through the
    AWS environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)."""
    try:
        parsed = ObjectUri.parse(uri, field="CHECKPOINT")
    except ValueError as err:
        raise ExportError(str(err)) from None
    key = PurePosixPath(parsed.prefix)
    try:
        if step_of(Path(key.name)) is not None:
            parent = ObjectUri(parsed.bucket, "" if str(key.parent) == "." else str(key.parent))
            store = ObjectStore(parent)
            manager = CheckpointManager(into, store=store)
            if not store.exists(f"{key.name}/{MARKER}"):
                raise ExportError(f"CHECKPOINT: {uri} has no {MARKER} marker: the upload was torn; export another step")
            return manager.fetch(into / key.name)
        manager = CheckpointManager(into, store=ObjectStore(parsed))
        latest = manager.latest()
        if latest is None:
            raise ExportError(f"CHECKPOINT: {uri} holds no complete checkpoint (no step-* folder with {MARKER})")
        return manager.fetch(latest)
    except ObjectStoreError as err:
        raise ExportError(f"CHECKPOINT: {err}") from None


def _saved_dtype(trainer_dir: Path) -> torch.dtype:
    """The precision the policy was saved in, from the checkpoint's metadata (no tensor is read)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        entries = FileSystemReader(str(trainer_dir)).read_metadata().state_dict_metadata
    except (OSError, ValueError) as exc:
        raise ExportError(f"CHECKPOINT: {trainer_dir} is not a readable torch.distributed.checkpoint: {exc}") from None
    for key, meta in entries.items():
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata):
            return meta.properties.dtype
    raise ExportError(f"CHECKPOINT: {trainer_dir} holds no model weights")


def _load_weights(model: torch.nn.Module, trainer_dir: Path, source: Path, field: str, base: Path) -> None:
    """Fill `model` in place from the checkpoint's (possibly sharded) model state."""
    import torch.distributed.checkpoint as dcp

    state = {"model": model.state_dict()}
    try:
        with warnings.catch_warnings():  # DCP warns that it assumes one process: it is meant
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=trainer_dir, no_dist=True)
    except Exception as exc:  # DCP raises CheckpointException (a RuntimeError subclass varies by version)
        raise ExportError(f"CHECKPOINT: {source} does not match the model of {field} ({base}): {exc}") from None


def _base_model(job: RLJob, model: str | Path | None) -> tuple[Path, str]:
    """(base model folder, the field that named it): `--model` when given, else the job's model source."""
    from rljob.runtime.models.errors import ModelSourceError
    from rljob.runtime.tasks.policy import policy_dir

    if model is not None:
        return Path(model), "--model"
    try:
        return policy_dir(job.spec.model, progress=False)
    except ModelSourceError as exc:
        raise ExportError(
            f"{exc}. The checkpoint's job read its model from there; give the same base model on this machine "
            "with --model DIR (for a cluster checkpoint, a copy of what the trainer pods mounted)"
        ) from None


def export_checkpoint(
    checkpoint: str | Path, target: str | Path, dtype: str | None = None, force: bool = False,
    model: str | Path | None = None,
) -> ExportResult:
    """Write the policy of `checkpoint` (a folder, or an s3:// URI) as a Hugging Face model folder at `target`.

    `dtype` (float32 / bfloat16) defaults to the precision the policy was trained in. `model` is the base
    model folder (config, tokenizer) when the job's own model source does not resolve here: a cluster
    checkpoint names the path the model had inside the trainer pod.
    """
    if isinstance(checkpoint, str) and is_object_uri(checkpoint):
        with tempfile.TemporaryDirectory(prefix="rljob-export-") as scratch:
            return _export(fetch_checkpoint(checkpoint, Path(scratch)), checkpoint, target, dtype, force, model)
    source = find_checkpoint(Path(checkpoint))
    return _export(source, str(source), target, dtype, force, model)


def _export(
    source: Path, origin: str, target: str | Path, dtype: str | None, force: bool, model: str | Path | None
) -> ExportResult:
    """export_checkpoint of the local checkpoint folder `source`, recorded as coming from `origin`."""
    from rljob.runtime.models.loading import torch_dtype
    from rljob.runtime.tasks.tokenizer import HFTokenizer, load_tokenizer

    out = Path(target)
    if out.exists() and any(out.iterdir()) and not force:
        raise ExportError(f"DIR: {out} exists and is not empty; choose another folder or pass --force to replace it")
    state = CheckpointManager.read_leader_state(source)
    trainer_dir = source / TRAINER_DIR
    if "job" not in state or not trainer_dir.is_dir():
        raise ExportError(f"CHECKPOINT: {source} is not an rljob training checkpoint (no job spec or no {TRAINER_DIR}/)")
    job = RLJob.model_validate(state["job"])
    base, field = _base_model(job, model)
    trained = _saved_dtype(trainer_dir)
    # The saved weights are fp32 masters when the job trained in bf16 (both backends keep them):
    # the default output is the precision the job trained in, not the masters' precision.
    out_dtype = torch_dtype(dtype or job.spec.trainer.dtype)
    policy = load_causal_lm(base, field=field, dtype=trained)
    _load_weights(policy, trainer_dir, source, field, base)
    policy.to(out_dtype)  # type: ignore[arg-type]  # transformers' decorated .to: mypy mis-binds it
    policy.config.dtype = out_dtype  # recorded in config.json, read by SGLang's --dtype auto
    tokenizer = load_tokenizer(base)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        policy.save_pretrained(staging)
        tokenizer.save(staging)
        info = {"checkpoint": origin, "step": state.get("step"), "policy_version": state.get("version"),
                "job": job.metadata.name, "base_model": str(base)}
        (staging / EXPORT_INFO).write_text(json.dumps(info, indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    name = str(out_dtype).removeprefix("torch.")
    return ExportResult(out, origin, int(state.get("step", 0)), int(state.get("version", 0)), name, isinstance(tokenizer, HFTokenizer))
