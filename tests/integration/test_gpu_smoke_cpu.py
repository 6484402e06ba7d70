"""tests/gpu/smoke.sh, the GPU smoke check, run here on CPU (gloo) and on a CUDA device this machine lacks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ("environment", "tiny qwen3 built", "(b) engine decodes bf16", "(a) FSDP2 trainer set up",
          "(c) log-probs agree, v0", "(a) bf16 FSDP2 step", "(d) weight-update group", "(c) log-probs agree, v1")


def smoke(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(ROOT / "tests/gpu/smoke.sh"), *args], capture_output=True, text=True,
                          timeout=600, env=env, cwd=ROOT)


def results(stdout: str) -> dict[str, str]:
    """check name -> PASS / FAIL / SKIP, from the summary table."""
    rows = re.findall(r"^(.+?)\s+\| (PASS|FAIL|SKIP)\s+\|", stdout, flags=re.MULTILINE)
    return {name.strip(): result for name, result in rows}


def test_every_check_passes_on_cpu() -> None:
    run = smoke("--device", "cpu")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert results(run.stdout) == dict.fromkeys(CHECKS, "PASS"), run.stdout
    assert "ALL PASSED" in run.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the failure below needs none")
def test_a_failed_check_exits_non_zero_and_skips_what_needs_it() -> None:
    run = smoke("--device", "cuda")
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    table = results(run.stdout)
    assert table["environment"] == "FAIL" and set(table.values()) == {"FAIL", "SKIP"}, run.stdout
    assert "torch.cuda.is_available() is False" in run.stdout
