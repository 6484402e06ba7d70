"""`rljob validate` opens the data: rows the runtime would skip are listed with their line and reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rljob.api import parse_rljob
from rljob.runtime.cli import main
from rljob.runtime.tasks.data_check import check_data


def _job(tmp_path: Path, rows: list[str], max_response: int = 300) -> dict:
    data = tmp_path / "train.jsonl"
    data.write_text("".join(line + "\n" for line in rows))
    return {
        "apiVersion": "rljob.io/v1alpha1", "kind": "RLJob", "metadata": {"name": "data-check"},
        "spec": {
            "model": {"builtin": "tiny-arith"},  # character tokenizer, 320-token context: nothing to build
            "data": {"jsonl": str(data), "shuffle": False},
            "rollout": {"maxResponseLength": max_response},
        },
    }


ROWS = [
    json.dumps({"prompt": "1%2=", "answer": "1"}),
    "{broken",
    json.dumps({"prompt": "9" * 40, "answer": "9"}),
    json.dumps({"prompt": "3%2=", "answer": "1"}),
]


def test_check_data_finds_the_unreadable_and_the_over_long_row(tmp_path: Path) -> None:
    found = check_data(parse_rljob(_job(tmp_path, ROWS)), limit=None)
    assert (found.rows_read, found.rows_rendered) == (4, 3)
    assert found.by_reason == {"unreadable": 1, "too_long": 1}
    assert [row.where.rsplit(":", 1)[-1] for row in found.skipped] == ["2", "3"]
    # A shorter response budget leaves room for the long prompt: only the broken line remains.
    assert check_data(parse_rljob(_job(tmp_path, ROWS, max_response=200)), limit=None).by_reason == {"unreadable": 1}


def test_the_sample_renders_only_its_rows_and_says_so(tmp_path: Path) -> None:
    found = check_data(parse_rljob(_job(tmp_path, ROWS)), limit=1)
    assert found.rows_rendered == 1 and found.by_reason == {"unreadable": 1}
    assert "first 1 of 3 rows" in found.notes[0]


def test_validate_lists_skipped_rows_and_strict_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_job(tmp_path, ROWS)))
    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "2 data rows the runtime would skip" in out and "too_long" in out and "not valid JSON" in out
    assert main(["validate", "--strict", str(path)]) == 1
    assert main(["validate", "--data", "none", "--strict", str(path)]) == 0


def test_validate_refuses_data_with_no_usable_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_job(tmp_path, ["{broken"])))
    assert main(["validate", str(path)]) == 2
    assert "no usable records; first problem" in capsys.readouterr().out
