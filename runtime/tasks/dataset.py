"""Prompt streams over the synthetic task or a JSONL file, with a checkpointable cursor.

The stream walks the records epoch by epoch, each epoch in its own seeded order, and hands
out prompts one by one. `state_dict()` captures the cursor, so a resumed job yields exactly
the prompts the interrupted one would have yielded next.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rljob.operator.api.spec import DataSpec, EvaluationSpec
from rljob.runtime.tasks.synthetic import ArithChainTask
from rljob.runtime.tasks.tokenizer import TaskTokenizer


@dataclass(frozen=True)
class PromptRecord:
    """One prompt handed to the rollout scheduler."""

    index: int  # position in the stream, counting across epochs (unique per job)
    source_index: int  # row of the underlying dataset
    epoch: int
    text: str
    answer: str
    prompt_ids: list[int]


class DataExhausted(RuntimeError):
    """Raised by next_prompt() once max_epochs epochs have been served."""


def load_jsonl_records(path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer") -> list[tuple[str, str]]:
    """(prompt, answer) pairs of a JSONL file; a bad line fails with its line number and what is wrong."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"data.jsonl: file {file} does not exist")
    records: list[tuple[str, str]] = []
    with file.open(encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"data.jsonl: {file}:{line_no} is not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict) or prompt_key not in row or answer_key not in row:
                raise ValueError(
                    f"data.jsonl: {file}:{line_no} needs keys {prompt_key!r} and {answer_key!r} "
                    "(set data.promptKey / data.answerKey if your file uses other names)"
                )
            records.append((str(row[prompt_key]), str(row[answer_key])))
    if not records:
        raise ValueError(f"data.jsonl: {file} has no records")
    return records


def synthetic_records(num_prompts: int, seed: int, start: int = 0) -> list[tuple[str, str]]:
    """(prompt, answer) pairs of arith-chain problems start..start+num_prompts-1."""
    return [(p.prompt, p.answer) for p in ArithChainTask(seed=seed).problems(num_prompts, start=start)]


def held_out_records(data: DataSpec, evaluation: EvaluationSpec) -> list[tuple[str, str]]:
    """The evaluation set: the first `prompts` records of evaluation.jsonl, or the synthetic problems
    right after the training ones (same task and seed, never served for training)."""
    if evaluation.jsonl is not None:
        return load_jsonl_records(evaluation.jsonl, data.prompt_key, data.answer_key)[: evaluation.prompts]
    if data.synthetic is None:
        raise ValueError("evaluation.jsonl: required when the training data is data.jsonl")
    return synthetic_records(evaluation.prompts, data.synthetic.seed, start=data.synthetic.num_prompts)


class PromptStream:
    """Seeded, epoch-wise, resumable stream of prompts."""

    def __init__(
        self,
        records: list[tuple[str, str]],
        tokenizer: TaskTokenizer,
        *,
        shuffle: bool = True,
        seed: int = 0,
        max_epochs: int | None = None,
    ) -> None:
        if not records:
            raise ValueError("a prompt stream needs at least one record")
        self.records = records
        self.tokenizer = tokenizer
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
            assert spec.jsonl is not None  # DataSpec guarantees exactly one source
            records = load_jsonl_records(spec.jsonl, spec.prompt_key, spec.answer_key)
        return cls(records, tokenizer, shuffle=spec.shuffle, seed=spec.seed, max_epochs=max_epochs)

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
        text, answer = self.records[source_index]
        record = PromptRecord(
            index=self.served,
            source_index=source_index,
            epoch=self.epoch,
            text=text,
            answer=answer,
            prompt_ids=self.tokenizer.encode_prompt(text),
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
