"""Preemption of a 2-rank job under torchrun's launcher (real gloo, the tiny Llama): SIGTERM to the
launcher, as the kubelet sends it to torchrun (process 1 of a trainer pod), once a step is observed to
have started. torchrun forwards it to both ranks; neither may die where it stands. The group finishes the
step in flight, checkpoints it, exits Interrupted, and the next run resumes there: no step lost, none
repeated (issue 26, item 2)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from rljob.runtime.metrics import read_jsonl
from tests.integration.test_runner_resume import job_doc, tiny_policy

STEPS = 5


def _command(job: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "rljob.runtime.cli", "--log-level", "INFO", "run", str(job), "--nproc", "2",
            "--no-live", "--output", str(out)]


def _environment(tmp_path: Path, message: Path) -> dict[str, str]:
    # No empty PYTHONPATH entry: it would put the working directory (the repo, whose operator/ shadows the
    # stdlib's) on the path. The shutdown timeout is torchrun's wait for the ranks after forwarding SIGTERM
    # (30 s by default); the operator sets it from the pod's grace period, the test to a generous 600 s
    # on a shared machine.
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "COLUMNS": "300", "PYTHONUNBUFFERED": "1", "PYTHONPATH": path,
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "600", "RLJOB_TERMINATION_MESSAGE_PATH": str(message)}


def test_sigterm_mid_step_on_two_ranks_checkpoints_that_step_and_resumes_without_loss_or_repeat(
        tmp_path: Path) -> None:
    model = tiny_policy(tmp_path / "model")
    ckpt = tmp_path / "ckpt"
    doc = job_doc(model, ckpt, steps=STEPS, every=100)  # no periodic checkpoint: only SIGTERM's and the last
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    out = tmp_path / "out"
    message = tmp_path / "termination-log"
    env = _environment(tmp_path, message)

    proc = subprocess.Popen(_command(job, out), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "step 2 started" in line:  # rank 0's log line: step 1 is done, step 2's round is running
                proc.send_signal(signal.SIGTERM)
                break
        rest, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    first = "".join(lines) + rest
    assert any("step 2 started" in line for line in lines), first
    assert proc.returncode == 75, first
    # Both ranks got the forwarded SIGTERM; rank 1 noted it instead of dying.
    assert "rank 1: SIGTERM" in first, first
    text = message.read_text()
    assert text.startswith("Interrupted: SIGTERM after step "), text
    stopped = int(text.split("after step ")[1].split(";")[0])
    # The step in flight (2) was finished and checkpointed, not dropped; the run did not go to its end.
    assert 2 <= stopped < STEPS, first
    steps_written = sorted(int(p.name.split("-")[1]) for p in ckpt.iterdir() if p.name.startswith("step-"))
    assert steps_written == [stopped], (steps_written, first)
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == list(range(1, stopped + 1)), first

    second = subprocess.run(_command(job, out), capture_output=True, text=True, timeout=900, env=env)
    output = second.stdout + second.stderr
    assert second.returncode == 0, output
    assert f"at step {stopped}" in output.split("resumed from", 1)[1], output
    records = read_jsonl(out / "metrics.jsonl")
    # Every step exactly once across the two runs, each trained against the policy before it.
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), records
    assert [r["policy_version"] for r in records] == list(range(1, STEPS + 1)), records
