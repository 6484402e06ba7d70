"""`rljob validate`'s data check: read a job's data as the runtime will, and say which rows it would skip.

The runtime never ends a job on a bad row (tasks.dataset skips and counts it); this check shows the
author those rows before a cluster spends GPU hours on them. Reading parses every row; rendering with
the model's tokenizer (chat template, context budget) covers the first `limit` rows, or all of them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from rljob.api.spec import RLJob
from rljob.runtime.models.errors import ModelSourceError
from rljob.runtime.tasks.dataset import (
    DataRow,
    SkippedRow,
    held_out_records,
    prompt_token_budget,
    render_row,
    synthetic_records,
    training_records,
)
from rljob.runtime.tasks.prompts import PromptRenderer
from rljob.runtime.tasks.tokenizer import TaskTokenizer


@dataclass
class DataCheck:
    """What the check found: rows read, rows rendered, the rows the runtime would skip, and notes."""

    rows_read: int = 0
    rows_rendered: int = 0
    skipped: list[SkippedRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def by_reason(self) -> dict[str, int]:
        """Skipped rows counted by reason."""
        return dict(Counter(row.reason for row in self.skipped))


def _tokenizer_and_context(job: RLJob) -> tuple[TaskTokenizer, int | None]:
    """The job's tokenizer and context length, without building or downloading a model."""
    from rljob.runtime.models.loading import read_config
    from rljob.runtime.models.source import resolve_model_dir
    from rljob.runtime.tasks.policy import ensure_tiny_architecture, object_model_dir
    from rljob.runtime.tasks.tokenizer import CharTokenizer, load_tokenizer
    from rljob.runtime.tasks.warmup import BUILTIN_NAME, DEFAULT_RECIPE

    model = job.spec.model
    if model.builtin == BUILTIN_NAME:
        return CharTokenizer(), DEFAULT_RECIPE.max_positions
    if model.uri is not None:
        directory = object_model_dir(model, weights=False)  # the config and the tokenizer, never the weights
    else:
        directory = ensure_tiny_architecture(model.builtin) if model.builtin else resolve_model_dir(model)[0]
    context = getattr(read_config(Path(directory)), "max_position_embeddings", None)
    return load_tokenizer(directory), context if isinstance(context, int) else None


def check_data(job: RLJob, limit: int | None) -> DataCheck:
    """Read the job's training (and held-out) data and render the first `limit` rows (None: all).
    A file that cannot be read at all raises ValueError naming the field, as the runtime would."""
    spec = job.spec
    report = DataCheck()
    if spec.data.synthetic is not None:
        rows: list[DataRow] = synthetic_records(spec.data.synthetic.num_prompts, spec.data.synthetic.seed)
    else:
        rows = training_records(spec.data, report.skipped.append)
    report.rows_read = len(rows) + len(report.skipped)
    if spec.evaluation.file is not None:
        held_out_records(spec.data, spec.evaluation, report.skipped.append)
    try:
        tokenizer, context = _tokenizer_and_context(job)
    except ModelSourceError as exc:
        report.notes.append(f"prompts were not rendered: the model is not on this machine ({exc})")
        return report
    budget = prompt_token_budget(context, spec.rollout.max_response_length)
    renderer = PromptRenderer(tokenizer, spec.data.system_prompt)
    for row in rows[:limit]:
        rendered = render_row(row, renderer, budget)
        if isinstance(rendered, SkippedRow):
            report.skipped.append(rendered)
        report.rows_rendered += 1
    if limit is not None and len(rows) > limit:
        report.notes.append(f"rendered the first {limit} of {len(rows)} rows; pass --data all to render every row")
    return report
