"""The job's policy from its `model` section: a builtin (tiny-arith, warmed up by tasks/warmup.py;
tiny-qwen3 / tiny-llama random architectures), a local Hugging Face folder (`model.path`), a hub
id resolved in the local HF cache (`model.huggingFace`) or an object store folder copied into the
rljob cache (`model.uri`).

Opening lives in tasks, not in models/, because the tiny-arith builtin is trained on a task (its
warm-up needs the arith-chain task and the character tokenizer): models/ stays below tasks/.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rljob.api.spec import ModelSpec
from rljob.runtime.tasks.tokenizer import TaskTokenizer, load_tokenizer
from rljob.runtime.tasks.warmup import BUILTIN_NAME, cache_root, ensure_builtin_arith

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


TINY_ARCHITECTURES = {"tiny-qwen3": "qwen3", "tiny-llama": "llama"}


def tiny_architecture_dir(name: str) -> Path:
    """Cache folder of builtin tiny-qwen3 / tiny-llama (random weights, locally trained tokenizer)."""
    from rljob.runtime.models.tiny import TinyModelRecipe

    recipe = TinyModelRecipe(family=TINY_ARCHITECTURES[name])  # type: ignore[arg-type]
    return cache_root() / "models" / f"{name}-{recipe.fingerprint()}"


def ensure_tiny_architecture(name: str) -> Path:
    """The cached tiny-qwen3 / tiny-llama folder, built on first use (a few seconds, nothing downloaded)."""
    from rljob.runtime.models.tiny import RECIPE_FILE, TinyModelRecipe, build_tiny_model

    directory = tiny_architecture_dir(name)
    if not (directory / RECIPE_FILE).exists():
        log.info("building the tiny random %s model folder at %s (once)", name, directory)
        build_tiny_model(directory, TinyModelRecipe(family=TINY_ARCHITECTURES[name]))  # type: ignore[arg-type]
    return directory


@dataclass
class Policy:
    """A job's policy: the model, its tokenizer, the folder they came from and the tokens that end a response."""

    model: PreTrainedModel
    tokenizer: TaskTokenizer
    directory: Path
    stop_token_ids: list[int]


def policy_dir(spec: ModelSpec, progress: bool = True) -> tuple[Path, str]:
    """(model folder, spec field it came from) for any model source; builtins are built on first use."""
    from rljob.runtime.models.source import resolve_model_dir

    if spec.builtin == BUILTIN_NAME:
        return ensure_builtin_arith(progress=progress), "spec.model.builtin"
    if spec.builtin is not None:
        return ensure_tiny_architecture(spec.builtin), "spec.model.builtin"
    if spec.uri is not None:
        return object_model_dir(spec), "spec.model.uri"
    return resolve_model_dir(spec)


def object_model_dir(spec: ModelSpec, weights: bool = True) -> Path:
    """The copy of `model.uri` (an object store folder) in the rljob cache, fetched or refreshed first;
    `weights` False: its config and tokenizer files only (what `rljob validate` reads)."""
    from rljob.runtime.models.errors import ModelSourceError
    from rljob.runtime.models.object_source import fetch_model, local_copy_dir, store_settings

    if spec.uri is None:
        raise ModelSourceError("spec.model.uri is not set")
    return fetch_model(spec.uri, local_copy_dir(spec.uri, cache_root(), weights), store_settings(spec.s3), weights)


def open_policy(
    spec: ModelSpec, progress: bool = True, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> Policy:
    """Model (in `dtype` on `device`), tokenizer and stop tokens of a job's `model` section.

    `model.path` is a local folder; `model.huggingFace` is resolved offline in the Hugging Face cache;
    `model.uri` is copied from its object store into the rljob cache (again only when it changed);
    errors name the field and say what to do.
    """
    from rljob.runtime.models.loading import load_causal_lm, stop_token_ids

    directory, field = policy_dir(spec, progress)
    model = load_causal_lm(directory, field=field, dtype=dtype, device=device)
    tokenizer = load_tokenizer(directory)
    return Policy(model, tokenizer, directory, stop_token_ids(model, tokenizer.eos_token_id))


def load_policy(spec: ModelSpec, progress: bool = True, device: str = "cpu") -> tuple[PreTrainedModel, TaskTokenizer]:
    """Model and tokenizer for a job's `model` section (see open_policy)."""
    policy = open_policy(spec, progress=progress, device=device)
    return policy.model, policy.tokenizer
