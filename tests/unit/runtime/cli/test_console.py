"""The termination message a command leaves for the operator (runtime/cli/console.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rljob.runtime.cli.console import terminate


def test_terminate_writes_the_message_and_returns_the_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "termination-log"
    monkeypatch.setenv("RLJOB_TERMINATION_MESSAGE_PATH", str(path))
    assert terminate("RewardCollapse: every group alike", 7) == 7
    assert path.read_text() == "RewardCollapse: every group alike"


def test_terminate_outside_a_pod_still_returns_the_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("RLJOB_TERMINATION_MESSAGE_PATH", str(tmp_path / "no-such-folder" / "termination-log"))
    assert terminate("Interrupted: SIGTERM after step 3", 143) == 143
    assert "SIGTERM after step 3" in capsys.readouterr().out
