"""The `rljob` parser and entry point (runtime/cli/entry.py) and `python -m rljob.runtime.cli`, the command
line each --nproc rank runs."""

from __future__ import annotations

import os
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


def test_only_a_rank_of_a_multi_rank_run_is_a_rank_process(monkeypatch: pytest.MonkeyPatch) -> None:
    from rljob.runtime.cli.run_job import is_rank_process

    run, report = build_parser().parse_args(["run", "job.yaml"]), build_parser().parse_args(["report", "runs/x"])
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert not is_rank_process(run)  # one process, or the launcher of --nproc N
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not is_rank_process(run)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name, value in {"RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    assert is_rank_process(run) and not is_rank_process(report)
    monkeypatch.setenv("RANK", "not-a-number")
    assert not is_rank_process(run)  # run_command itself reports the bad variable


def test_a_rank_process_ends_with_its_code_and_its_buffered_output() -> None:
    """os._exit skips the teardown and so the flush at exit: end_rank_process flushes first (stdout to a
    pipe is block-buffered, so without it the line below would be lost)."""
    code = ("import logging, sys; from rljob.runtime.cli.run_job import end_rank_process; "
            "logging.basicConfig(stream=sys.stderr); print('step 5: done'); logging.warning('rank 1 stops'); "
            "end_rank_process(75)")
    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=buffered)
    assert done.returncode == 75 and done.stdout == "step 5: done\n" and "rank 1 stops" in done.stderr, done
