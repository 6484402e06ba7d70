"""The `rljob` parser and entry point (runtime/cli/entry.py) and `python -m rljob.runtime.cli`, the command
line each --nproc rank runs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rljob.runtime.cli import build_parser, main
from rljob.runtime.cli.build_model import build_command
from rljob.runtime.cli.export_checkpoint import export_command
from rljob.runtime.cli.rebuild_report import report_command
from rljob.runtime.cli.run_job import run_command
from rljob.runtime.cli.validate_job import validate_command
from rljob.runtime.sim.cli import run_simulate


@pytest.mark.parametrize(("argv", "func"), [
    (["run", "job.yaml"], run_command),
    (["report", "runs/x"], report_command),
    (["validate", "job.yaml"], validate_command),
    (["export", "ckpt", "out"], export_command),
    (["model", "build", "tiny-qwen3", "out"], build_command),
    (["simulate", "scenario.yaml"], run_simulate),
])
def test_each_command_runs_its_own_module(argv: list[str], func: object) -> None:
    assert build_parser().parse_args(argv).func is func


def test_python_dash_m_is_the_same_command_line() -> None:
    """torchrun starts every rank as `python -m rljob.runtime.cli ...` (cli/launch.py)."""
    done = subprocess.run([sys.executable, "-m", "rljob.runtime.cli", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == build_parser().format_help().split()  # wrapping aside


def test_a_missing_run_folder_is_exit_2_naming_metrics_jsonl(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path / "nowhere")]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().out
