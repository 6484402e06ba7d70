"""data.huggingFace: the training file of a Hub dataset, resolved offline in a Hugging Face cache.

The cache is built on disk in the layout huggingface_hub writes (datasets--<org>--<name>/refs and
snapshots), so the real `hf_hub_download(local_files_only=True)` resolves it, as in a trainer pod
whose cache claim (or download step) holds the dataset.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rljob.api.spec import DataSpec
from rljob.runtime.tasks.dataset import PromptStream, hub_data_file, training_records
from rljob.runtime.tasks.tokenizer import CharTokenizer

COMMIT = "0123456789abcdef0123456789abcdef01234567"
ROWS = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(5)]


def _cache(root: Path, repo: str, filename: str, revision: str = "main") -> Path:
    folder = root / f"datasets--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / revision).write_text(COMMIT)
    target = folder / "snapshots" / COMMIT / filename
    target.parent.mkdir(parents=True)
    target.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return target


def _spec(**fields: object) -> DataSpec:
    return DataSpec.model_validate({"huggingFace": "acme/sums", "jsonl": "data/train.jsonl", **fields})


def test_the_file_of_a_cached_dataset_is_read_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = _cache(tmp_path, "acme/sums", "data/train.jsonl", revision="v1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # what the trainer pod's env says
    spec = _spec(revision="v1")
    assert Path(hub_data_file(spec)) == target
    records = training_records(spec)
    assert [(r.prompt, r.answer) for r in records] == [(r["prompt"], r["answer"]) for r in ROWS]
    assert len(PromptStream.from_spec(spec, CharTokenizer())) == len(ROWS)


def test_a_dataset_missing_from_the_cache_names_the_field_and_the_command(tmp_path: Path) -> None:
    _cache(tmp_path, "acme/sums", "data/other.jsonl")
    with pytest.raises(ValueError) as info:
        hub_data_file(_spec(revision="v2"), cache_dir=tmp_path)
    message = str(info.value)
    assert message.startswith("data.huggingFace: data/train.jsonl of dataset 'acme/sums' at revision 'v2'")
    assert str(tmp_path) in message
    assert "hf download --repo-type dataset acme/sums data/train.jsonl --revision v2" in message
