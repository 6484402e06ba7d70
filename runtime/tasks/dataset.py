"""Prompt streams over the synthetic task or a JSONL / Parquet file, with a checkpointable cursor.

The stream walks the records epoch by epoch, each epoch in its own seeded order, and hands
out prompts one by one. `state_dict()` captures the cursor, so a resumed job yields exactly
the prompts the interrupted one would have yielded next.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rljob.api.spec import DataSpec, EvaluationSpec
from rljob.runtime.tasks.prompts import PromptRenderer
from rljob.runtime.tasks.synthetic import ArithChainTask
from rljob.runtime.tasks.tokenizer import TaskTokenizer


@dataclass(frozen=True)
class DataRow:
    """One dataset row: `prompt` text or chat `messages`, the reference answer, and every other field."""

    answer: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)  # extra fields, handed to reward functions


@dataclass(frozen=True)
class PromptRecord:
    """One prompt handed to the rollout scheduler."""

    index: int  # position in the stream, counting across epochs (unique per job)
    source_index: int  # row of the underlying dataset
    epoch: int
    text: str  # the prompt as the model sees it (chat template applied)
    answer: str
    prompt_ids: list[int]
    metadata: dict[str, Any] = field(default_factory=dict)


class DataExhausted(RuntimeError):
    """Raised by next_prompt() once max_epochs epochs have been served."""


def _messages(value: Any, where: str, key: str) -> list[dict[str, Any]]:
    """Validate chat messages: a list of {role, content} with string values."""
    if hasattr(value, "tolist"):  # a Parquet list column arrives as a numpy array
        value = value.tolist()
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: {key!r} must be a non-empty list of {{role, content}} messages")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not isinstance(
            message.get("content"), str
        ):
            raise ValueError(f"{where}: {key}[{i}] must be an object with string 'role' and 'content'")
        out.append({"role": message["role"], "content": message["content"]})
    return out


def row_from_mapping(
    row: Any, where: str, prompt_key: str = "prompt", answer_key: str = "answer", messages_key: str = "messages"
) -> DataRow:
    """A DataRow from one decoded record; `where` (file:line) names it in errors."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be an object, got {type(row).__name__}")
    has_messages = row.get(messages_key) is not None
    if answer_key not in row or not (has_messages or row.get(prompt_key) is not None):
        raise ValueError(
            f"{where} needs {answer_key!r} and {prompt_key!r} or {messages_key!r} "
            "(set data.promptKey / data.messagesKey / data.answerKey if your file uses other names)"
        )
    metadata = {k: v for k, v in row.items() if k not in (prompt_key, answer_key, messages_key)}
    return DataRow(
        answer=str(row[answer_key]),
        prompt=None if has_messages else str(row[prompt_key]),
        messages=_messages(row[messages_key], where, messages_key) if has_messages else None,
        metadata=metadata,
    )


def load_jsonl_records(
    path: str | Path,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    messages_key: str = "messages",
    field_name: str = "data.jsonl",
) -> list[DataRow]:
    """Rows of a JSONL file; a bad line fails with its line number and what is wrong."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{field_name}: file {file} does not exist")
    records: list[DataRow] = []
    with file.open(encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{field_name}: {file}:{line_no} is not valid JSON ({exc.msg})") from None
            records.append(row_from_mapping(row, f"{field_name}: {file}:{line_no}", prompt_key, answer_key, messages_key))
    if not records:
        raise ValueError(f"{field_name}: {file} has no records")
    return records


def load_parquet_records(
    path: str | Path,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    messages_key: str = "messages",
    field_name: str = "data.parquet",
) -> list[DataRow]:
    """Rows of a Parquet file (read with pyarrow); errors name the row."""
    import pyarrow.parquet as pq

    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{field_name}: file {file} does not exist")
    try:
        rows = pq.read_table(file).to_pylist()
    except Exception as exc:  # pyarrow raises its own error types for every kind of bad file
        raise ValueError(f"{field_name}: cannot read {file} as Parquet ({exc})") from None
    if not rows:
        raise ValueError(f"{field_name}: {file} has no records")
    return [row_from_mapping(r, f"{field_name}: {file} row {i}", prompt_key, answer_key, messages_key) for i, r in enumerate(rows)]


def load_file_records(spec: DataSpec, jsonl: str | None, parquet: str | None, prefix: str) -> list[DataRow]:
    """Rows of the jsonl or parquet file named by `prefix`.jsonl / `prefix`.parquet."""
    keys = (spec.prompt_key, spec.answer_key, spec.messages_key)
    if jsonl is not None:
        return load_jsonl_records(jsonl, *keys, field_name=f"{prefix}.jsonl")
    assert parquet is not None
    return load_parquet_records(parquet, *keys, field_name=f"{prefix}.parquet")


def hub_data_file(spec: DataSpec, cache_dir: Path | None = None) -> Path:
    """The local path of data.jsonl / data.parquet inside the data.huggingFace dataset repo, resolved
    offline in the Hugging Face cache (as model.huggingFace is: nothing is downloaded here)."""
    from huggingface_hub import hf_hub_download

    from rljob.runtime.models.source import resolve_offline

    repo, filename, revision = str(spec.hugging_face), str(spec.file), spec.revision
    at, flag = (f" at revision {revision!r}", f" --revision {revision}") if revision else ("", "")

    def missing(cache: Path, error: str) -> str:
        return (
            f"{filename} of dataset {repo!r}{at} is not in the local Hugging Face cache {cache} ({error}). Data is "
            f"never downloaded by the runtime: fetch it first (`hf download --repo-type dataset {repo} {filename}{flag}`) "
            "or point HF_HOME or HF_HUB_CACHE at a cache that holds it"
        )

    return resolve_offline(
        lambda cache: hf_hub_download(repo, filename, repo_type="dataset", revision=revision, cache_dir=cache,
                                      local_files_only=True),
        "data.huggingFace", repo, missing, cache_dir,
    )


def training_records(spec: DataSpec) -> list[DataRow]:
    """Rows of the training file: data.jsonl / data.parquet, a local path or a file of data.huggingFace."""
    if spec.hugging_face is None:
        return load_file_records(spec, spec.jsonl, spec.parquet, "data")
    local = str(hub_data_file(spec))
    if spec.jsonl is not None:
        return load_file_records(spec, local, None, "data")
    return load_file_records(spec, None, local, "data")


def synthetic_records(num_prompts: int, seed: int, start: int = 0) -> list[DataRow]:
    """Rows of arith-chain problems start..start+num_prompts-1."""
    return [DataRow(prompt=p.prompt, answer=p.answer) for p in ArithChainTask(seed=seed).problems(num_prompts, start=start)]


def held_out_records(data: DataSpec, evaluation: EvaluationSpec) -> list[DataRow]:
    """The evaluation set: the first `prompts` rows of evaluation.jsonl/parquet, or the synthetic problems
    right after the training ones (same task and seed, never served for training)."""
    if evaluation.file is not None:
        return load_file_records(data, evaluation.jsonl, evaluation.parquet, "evaluation")[: evaluation.prompts]
    if data.synthetic is None:
        raise ValueError("evaluation.jsonl: required when the training data is a file")
    return synthetic_records(evaluation.prompts, data.synthetic.seed, start=data.synthetic.num_prompts)


class PromptStream:
    """Seeded, epoch-wise, resumable stream of prompts."""

    def __init__(
        self,
        records: Sequence[DataRow | tuple[str, str]],
        tokenizer: TaskTokenizer,
        *,
        shuffle: bool = True,
        seed: int = 0,
        max_epochs: int | None = None,
        system_prompt: str | None = None,
    ) -> None:
        """`records` are DataRows, or (prompt, answer) pairs for plain-text prompts."""
        if not records:
            raise ValueError("a prompt stream needs at least one record")
        self.records = [r if isinstance(r, DataRow) else DataRow(prompt=r[0], answer=r[1]) for r in records]
        self.tokenizer = tokenizer
        self.renderer = PromptRenderer(tokenizer, system_prompt)
        self.shuffle = shuffle
        self.seed = seed
        self.max_epochs = max_epochs
        self.epoch = 0
        self.position = 0  # next position inside the current epoch's order
        self.served = 0
        self._order = self._epoch_order(0)

    @classmethod
    def from_spec(cls, spec: DataSpec, tokenizer: TaskTokenizer, max_epochs: int | None = None) -> PromptStream:
        """The stream a job's `data` section describes."""
        if spec.synthetic is not None:
            records = synthetic_records(spec.synthetic.num_prompts, spec.synthetic.seed)
        else:
            records = training_records(spec)
        return cls(
            records, tokenizer, shuffle=spec.shuffle, seed=spec.seed, max_epochs=max_epochs,
            system_prompt=spec.system_prompt,
        )

    def __len__(self) -> int:
        return len(self.records)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.records)))
        if self.shuffle:
            # Each epoch gets its own order, derived only from (seed, epoch), so a restored
            # cursor recomputes it instead of storing it.
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def next_prompt(self) -> PromptRecord:
        """The next prompt; raises DataExhausted after max_epochs epochs."""
        if self.position >= len(self._order):
            self.epoch += 1
            self.position = 0
            self._order = self._epoch_order(self.epoch)
        if self.max_epochs is not None and self.epoch >= self.max_epochs:
            raise DataExhausted(f"all {self.max_epochs} epoch(s) of {len(self.records)} prompts were served")
        source_index = self._order[self.position]
        row = self.records[source_index]
        rendered = self.renderer.render(row.prompt, row.messages)
        record = PromptRecord(
            index=self.served,
            source_index=source_index,
            epoch=self.epoch,
            text=rendered.text,
            answer=row.answer,
            prompt_ids=rendered.ids,
            metadata=dict(row.metadata),
        )
        self.position += 1
        self.served += 1
        return record

    def state_dict(self) -> dict[str, Any]:
        """The cursor, as plain data."""
        return {"epoch": self.epoch, "position": self.position, "served": self.served, "num_records": len(self.records)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a cursor saved by state_dict() on a stream over the same records and seed."""
        if state["num_records"] != len(self.records):
            raise ValueError(
                f"checkpoint data cursor is for {state['num_records']} prompts but the dataset has "
                f"{len(self.records)}; resume with the same data section or start without resume"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.served = int(state["served"])
        self._order = self._epoch_order(self.epoch)
