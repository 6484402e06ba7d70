"""Where a job's model lives on disk: `model.path` as given, or `model.huggingFace` in the local HF cache.

Nothing is downloaded: this runtime must behave the same on an air-gapped box, in CI and in a trainer
pod, so a hub id is resolved offline in the Hugging Face cache (populate it beforehand with
`hf download <id>` or mount a volume holding it). The cache is found the way `huggingface_hub` finds it
(`HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`), read from the environment at
call time so a job started with another `HF_HOME` sees its own cache.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

from rljob.api.spec import PVC_URI_PREFIX, ModelSpec
from rljob.runtime.models.errors import ModelSourceError

__all__ = ["ModelSourceError", "hub_cache_dir", "resolve_hub_model", "resolve_model_dir", "resolve_offline"]


def hub_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """The Hugging Face hub cache directory that `env` (default: this process's environment) selects."""
    env = os.environ if env is None else env
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    home = Path(env["HF_HOME"]).expanduser() if env.get("HF_HOME") else Path.home() / ".cache" / "huggingface"
    return home / "hub"


def resolve_offline(fetch: Callable[[str], str], field: str, repo_id: str, missing: Callable[[Path, str], str],
                    cache_dir: Path | None = None) -> Path:
    """`fetch(cache)`: a huggingface_hub call with local_files_only=True in the cache (`cache_dir`, else
    the environment's). Its errors become a ModelSourceError naming `field`: an invalid hub id, or
    `missing(cache, error name)` when the cache lacks what was asked for."""
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache = cache_dir or hub_cache_dir()
    try:
        return Path(fetch(str(cache)))
    except HFValidationError as exc:
        raise ModelSourceError(f"{field}: {repo_id!r} is not a valid hub id ({exc})") from None
    except (LocalEntryNotFoundError, FileNotFoundError, OSError) as exc:
        raise ModelSourceError(f"{field}: {missing(cache, type(exc).__name__)}") from None


def resolve_hub_model(repo_id: str, revision: str | None = None, cache_dir: Path | None = None) -> Path:
    """The snapshot folder of `repo_id` at `revision` (branch, tag or commit; default main) in the cache.

    Raises ModelSourceError naming `spec.model.huggingFace` and the cache searched when it is absent.
    """
    from huggingface_hub import snapshot_download

    at = f" at revision {revision!r}" if revision else ""

    def missing(cache: Path, error: str) -> str:
        return (
            f"{repo_id!r}{at} is not in the local Hugging Face cache {cache} ({error}). Models are never downloaded "
            f"by the runtime: fetch it first (`hf download {repo_id}`{' --revision ' + revision if revision else ''}), "
            "point HF_HOME or HF_HUB_CACHE at a cache that holds it, or set spec.model.path to a local model folder"
        )

    return resolve_offline(
        lambda cache: snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True),
        "spec.model.huggingFace", repo_id, missing, cache_dir,
    )


def resolve_model_dir(spec: ModelSpec, cache_dir: Path | None = None) -> tuple[Path, str]:
    """(model folder, the spec field it came from) for a `path` or `huggingFace` model spec."""
    if spec.path is not None:
        if spec.path.startswith(PVC_URI_PREFIX):
            raise ModelSourceError(
                f"spec.model.path: {spec.path} names a claim, which only the operator can mount; `rljob run` needs "
                "a local folder (on a cluster the trainer's config points at the mounted folder instead)"
            )
        directory = Path(spec.path).expanduser()
        if not directory.is_dir():
            raise ModelSourceError(
                f"spec.model.path: {directory} does not exist; point it at a folder written by save_pretrained "
                "(config.json, weights, tokenizer)"
            )
        return directory, "spec.model.path"
    if spec.hugging_face is not None:
        return resolve_hub_model(spec.hugging_face, spec.revision, cache_dir), "spec.model.huggingFace"
    raise ModelSourceError("spec.model: builtin models and model.uri are no local folders; use load_policy for them")
