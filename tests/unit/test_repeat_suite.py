"""tests/repeat_suite.py: real pytest runs of a tiny selection, their junit XML read back into the table."""

from __future__ import annotations

import json
from pathlib import Path

from tests.repeat_suite import cpu_stress, main

SELECTION = '''
import pytest

def test_passes():
    assert True

def test_fails():
    assert False

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass
'''


def test_two_runs_are_tabulated_per_test(tmp_path: Path) -> None:
    selection = tmp_path / "test_tiny.py"
    selection.write_text(SELECTION)
    out = tmp_path / "out"
    assert main(["--runs", "2", "--out", str(out), "--label", "tiny", "--", str(selection), "-q"]) == 1  # a test failed
    summary = json.loads((out / "summary.json").read_text())
    assert [r["returncode"] for r in summary["runs"]] == [1, 1]
    counts = {t["test"].rsplit("::", 1)[1]: (t["passed"], t["failed"], t["skipped"]) for t in summary["tests"]}
    assert counts == {"test_passes": (2, 0, 0), "test_fails": (0, 2, 0), "test_skipped": (0, 0, 2)}
    assert summary["tests"][0]["test"].endswith("test_fails")  # failures first
    markdown = (out / "summary.md").read_text()
    assert "| 0 | 2 | 0 |" in markdown and "run 2: exit 1" in markdown
    assert sorted(p.name for p in out.glob("run-*.xml")) == ["run-1.xml", "run-2.xml"]


def test_the_stress_processes_run_during_the_block_and_stop_after_it() -> None:
    with cpu_stress(2) as workers:
        assert len(workers) == 2 and all(w.is_alive() for w in workers)
    assert not any(w.is_alive() for w in workers)
