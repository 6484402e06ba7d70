"""Prompt streams over the synthetic task or a JSONL / Parquet file, with a checkpointable cursor.

The stream walks the records epoch by epoch, each epoch in its own seeded order, and hands
out prompts one by one. `state_dict()` captures the cursor, so a resumed job yields exactly
the prompts the interrupted one would have yielded next.

Bad rows never end a job: a line that is not JSON or lacks the keys is skipped when the file is
read, and a row whose chat template fails or whose prompt leaves no room for a response in the
model's context is skipped when it is drawn. Each skip is logged with its file and line and
counted by reason (`SKIP_REASONS`); the counts travel in the cursor, so a resumed job neither
replays a bad row nor forgets it. Only a file with no usable row at all is an error.
"""

from __future__ import annotations

import json
import logging
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rljob.api.spec import DataSpec, EvaluationSpec
from rljob.runtime.tasks.prompts import PromptRenderer
from rljob.runtime.tasks.synthetic import ArithChainTask
from rljob.runtime.tasks.tokenizer import TaskTokenizer

log = logging.getLogger(__name__)

# Why a row was skipped: the metric label `reason` and the key of PromptStream.skipped.
SKIP_REASONS = ("unreadable", "unrenderable", "too_long")

@dataclass(frozen=True)
class DataRow:
    """One dataset row: `prompt` text or chat `messages`, the reference answer, and every other field."""

    answer: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)  # extra fields, handed to reward functions
    where: str = field(default="", compare=False)  # file:line (or row), for the log line when it is skipped


@dataclass(frozen=True)
class SkippedRow:
    """A row that was not served, where it is, and why."""

    where: str
    reason: str  # one of SKIP_REASONS
    message: str


# Called with every skipped row (the default logs it).
OnSkip = Callable[[SkippedRow], None]


def log_skip(row: SkippedRow) -> None:
    """The default OnSkip: one warning naming the row and what is wrong with it."""
    log.warning("skipping a data row (%s): %s", row.reason, row.message)


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
        where=where,
    )


def _usable(rows: list[DataRow], skipped: list[SkippedRow], file: Path, field_name: str, on_skip: OnSkip) -> list[DataRow]:
    """The rows, after reporting the skipped ones; a file with no usable row is an error naming the first problem."""
    for row in skipped:
        on_skip(row)
    if not rows:
        first = f"; first problem: {skipped[0].message}" if skipped else ""
        raise ValueError(f"{field_name}: {file} has no usable records{first}")
    return rows


def load_jsonl_records(
    path: str | Path,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    messages_key: str = "messages",
    field_name: str = "data.jsonl",
    on_skip: OnSkip = log_skip,
) -> list[DataRow]:
    """Rows of a JSONL file; a bad line is skipped and reported to `on_skip` with its line number."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{field_name}: file {file} does not exist")
    records: list[DataRow] = []
    skipped: list[SkippedRow] = []
    with file.open(encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{field_name}: {file}:{line_no}"
            try:
                records.append(row_from_mapping(json.loads(line), where, prompt_key, answer_key, messages_key))
            except json.JSONDecodeError as exc:
                skipped.append(SkippedRow(where, "unreadable", f"{where} is not valid JSON ({exc.msg})"))
            except ValueError as exc:
                skipped.append(SkippedRow(where, "unreadable", str(exc)))
    return _usable(records, skipped, file, field_name, on_skip)


def load_parquet_records(
    path: str | Path,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    messages_key: str = "messages",
    field_name: str = "data.parquet",
    on_skip: OnSkip = log_skip,
) -> list[DataRow]:
    """Rows of a Parquet file (read with pyarrow); a bad row is skipped and reported to `on_skip`."""
    import pyarrow.parquet as pq

    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{field_name}: file {file} does not exist")
    try:
        rows = pq.read_table(file).to_pylist()
    except Exception as exc:  # pyarrow raises its own error types for every kind of bad file
        raise ValueError(f"{field_name}: cannot read {file} as Parquet ({exc})") from None
    records: list[DataRow] = []
    skipped: list[SkippedRow] = []
    for i, r in enumerate(rows):
        where = f"{field_name}: {file} row {i}"
        try:
            records.append(row_from_mapping(r, where, prompt_key, answer_key, messages_key))
        except ValueError as exc:
            skipped.append(SkippedRow(where, "unreadable", str(exc)))
    return _usable(records, skipped, file, field_name, on_skip)


def load_file_records(
    spec: DataSpec, jsonl: str | None, parquet: str | None, prefix: str, on_skip: OnSkip = log_skip
) -> list[DataRow]:
    """Rows of the jsonl or parquet file named by `prefix`.jsonl / `prefix`.parquet."""
    keys = (spec.prompt_key, spec.answer_key, spec.messages_key)
    if jsonl is not None:
        return load_jsonl_records(jsonl, *keys, field_name=f"{prefix}.jsonl", on_skip=on_skip)
    assert parquet is not None
    return load_parquet_records(parquet, *keys, field_name=f"{prefix}.parquet", on_skip=on_skip)


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


def training_records(spec: DataSpec, on_skip: OnSkip = log_skip) -> list[DataRow]:
    """Rows of the training file: data.jsonl / data.parquet, a local path or a file of data.huggingFace."""
    if spec.hugging_face is None:
        return load_file_records(spec, spec.jsonl, spec.parquet, "data", on_skip)
    local = str(hub_data_file(spec))
    if spec.jsonl is not None:
        return load_file_records(spec, local, None, "data", on_skip)
    return load_file_records(spec, None, local, "data", on_skip)


def synthetic_records(num_prompts: int, seed: int, start: int = 0) -> list[DataRow]:
    """Rows of arith-chain problems start..start+num_prompts-1."""
    return [DataRow(prompt=p.prompt, answer=p.answer) for p in ArithChainTask(seed=seed).problems(num_prompts, start=start)]


def held_out_records(data: DataSpec, evaluation: EvaluationSpec, on_skip: OnSkip = log_skip) -> list[DataRow]:
    """The evaluation set: the first `prompts` rows of evaluation.jsonl/parquet, or the synthetic problems
    right after the training ones (same task and seed, never served for training)."""
    if evaluation.file is not None:
        return load_file_records(data, evaluation.jsonl, evaluation.parquet, "evaluation", on_skip)[: evaluation.prompts]
    if data.synthetic is None:
        raise ValueError("evaluation.jsonl: required when the training data is a file")
    return synthetic_records(evaluation.prompts, data.synthetic.seed, start=data.synthetic.num_prompts)


@dataclass(frozen=True)
class RenderedRow:
    """A row as the model sees it: the prompt text (chat template applied) and its ids."""

    text: str
    ids: list[int]


def prompt_token_budget(context: int | None, max_response_length: int) -> int | None:
    """The longest prompt that leaves room for `max_response_length` tokens in a `context`-token
    window (None when the context is unknown); a row over it is skipped, never sent to an engine
    that would refuse it on every resume."""
    if context is None:
        return None
    # One token of slack: SGLang 0.5.5.post3 refuses prompt + max_new_tokens == context (docs/sglang_releases.md).
    budget = context - max_response_length - 1
    if budget <= 0:
        raise ValueError(
            f"rollout.maxResponseLength: {max_response_length} tokens leave no room for a prompt in the model's "
            f"context of {context}; lower it"
        )
    return budget


def render_row(
    row: DataRow, renderer: PromptRenderer, max_prompt_tokens: int | None
) -> RenderedRow | SkippedRow:
    """The row rendered for the model, or why it cannot be served: its chat template fails, or its
    prompt leaves no room for a response in the model's context (`max_prompt_tokens`)."""
    try:
        rendered = renderer.render(row.prompt, row.messages)
    except Exception as exc:  # a chat template is user code (Jinja): any error means this row cannot render
        return SkippedRow(row.where, "unrenderable", f"{row.where}: cannot render the prompt ({exc})")
    if max_prompt_tokens is not None and len(rendered.ids) > max_prompt_tokens:
        return SkippedRow(
            row.where, "too_long",
            f"{row.where}: the prompt has {len(rendered.ids)} tokens, more than the {max_prompt_tokens} that leave "
            "room for rollout.maxResponseLength in the model's context",
        )
    return RenderedRow(rendered.text, rendered.ids)


class PromptStream:
    """Seeded, epoch-wise, resumable stream of prompts that skips (and counts) rows it cannot serve."""

    def __init__(
        self,
        records: Sequence[DataRow | tuple[str, str]],
        tokenizer: TaskTokenizer,
        *,
        shuffle: bool = True,
        seed: int = 0,
        max_epochs: int | None = None,
        system_prompt: str | None = None,
        max_prompt_tokens: int | None = None,
        load_skips: int = 0,
        on_skip: OnSkip = log_skip,
    ) -> None:
        """`records` are DataRows, or (prompt, answer) pairs for plain-text prompts. `max_prompt_tokens`
        bounds a servable prompt; `load_skips` counts the rows the file reader already skipped."""
        if not records:
            raise ValueError("a prompt stream needs at least one record")
        self.records = [r if isinstance(r, DataRow) else DataRow(prompt=r[0], answer=r[1]) for r in records]
        self.tokenizer = tokenizer
        self.renderer = PromptRenderer(tokenizer, system_prompt)
        self.shuffle = shuffle
        self.seed = seed
        self.max_epochs = max_epochs
        self.max_prompt_tokens = max_prompt_tokens
        self.on_skip = on_skip
        self.epoch = 0
        self.position = 0  # next position inside the current epoch's order
        self.served = 0
        self.skipped: Counter[str] = Counter({"unreadable": load_skips} if load_skips else {})
        self._skipped_in_a_row = 0
        self._order = self._epoch_order(0)

    @classmethod
    def from_spec(
        cls, spec: DataSpec, tokenizer: TaskTokenizer, max_epochs: int | None = None,
        max_prompt_tokens: int | None = None, on_skip: OnSkip = log_skip,
    ) -> PromptStream:
        """The stream a job's `data` section describes."""
        load_skips: list[SkippedRow] = []

        def skipped_on_load(row: SkippedRow) -> None:
            load_skips.append(row)
            on_skip(row)

        if spec.synthetic is not None:
            records = synthetic_records(spec.synthetic.num_prompts, spec.synthetic.seed)
        else:
            records = training_records(spec, skipped_on_load)
        return cls(
            records, tokenizer, shuffle=spec.shuffle, seed=spec.seed, max_epochs=max_epochs,
            system_prompt=spec.system_prompt, max_prompt_tokens=max_prompt_tokens, load_skips=len(load_skips),
            on_skip=on_skip,
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
        """The next servable prompt; raises DataExhausted after max_epochs epochs, and ValueError when
        every row has been skipped (the data has nothing this model can be served)."""
        while True:
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            if self.max_epochs is not None and self.epoch >= self.max_epochs:
                raise DataExhausted(f"all {self.max_epochs} epoch(s) of {len(self.records)} prompts were served")
            source_index = self._order[self.position]
            row = self.records[source_index]
            # The cursor moves past the row before anything else: a resume never replays a bad row.
            self.position += 1
            rendered = render_row(row, self.renderer, self.max_prompt_tokens)
            if isinstance(rendered, RenderedRow):
                break
            self._skip(rendered)
        self._skipped_in_a_row = 0
        record = PromptRecord(
            index=self.served,
            source_index=source_index,
            epoch=self.epoch,
            text=rendered.text,
            answer=row.answer,
            prompt_ids=rendered.ids,
            metadata=dict(row.metadata),
        )
        self.served += 1
        return record

    def _skip(self, row: SkippedRow) -> None:
        self.skipped[row.reason] += 1
        self._skipped_in_a_row += 1
        self.on_skip(row)
        if self._skipped_in_a_row >= len(self.records):
            raise ValueError(
                f"data: every one of the {len(self.records)} rows was skipped (last: {row.message}); "
                "fix the data, the model's chat template or rollout.maxResponseLength"
            )

    def state_dict(self) -> dict[str, Any]:
        """The cursor and the skip counts, as plain data."""
        return {
            "epoch": self.epoch, "position": self.position, "served": self.served, "num_records": len(self.records),
            "skipped": dict(self.skipped),
        }

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
        # Checkpoints from before skip counting carry none; this process's load-time count stands then.
        if "skipped" in state:
            self.skipped = Counter({k: int(v) for k, v in state["skipped"].items()})
        self._order = self._epoch_order(self.epoch)
