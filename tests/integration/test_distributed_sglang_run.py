"""Issue 12's end-to-end run: `rljob run --nproc 2` (two gloo trainer ranks under FSDP2, launched by
torch's elastic launcher) against two SGLang-protocol worker processes behind the REAL sglang router,
weights pushed over the `distributed` transport (gloo broadcasts from trainer rank 0), and a SIGKILL of
rank 1 mid-run.

It must show: the group restarts and resumes from the last checkpoint; every step record has both
engines in the rotation, no failed sync, and a balanced ledger; at the end each engine serves the final
weight version by its own API, and its weights are the final checkpoint's (greedy tokens equal to the
exported checkpoint's, and unequal to the initial policy's).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from transformers import AutoModelForCausalLM

from rljob.runtime.export import export_checkpoint
from rljob.runtime.metrics import ledger_imbalance, read_jsonl
from tests.helpers.greedy import greedy_of, greedy_on
from tests.helpers.rewards import use_shorter_is_better
from tests.integration.test_distributed_training import _rank_pid
from tests.integration.test_run_weight_sync import http_pool, use_sglang_pool  # noqa: F401 (fixture)
from tests.integration.test_runner_resume import job_doc

pytestmark = pytest.mark.slow

STEPS = 5


def test_two_ranks_two_engines_router_distributed_transport_survive_a_kill_of_rank_1(
    tmp_path: Path, http_pool: tuple[Path, list[str], str]  # noqa: F811
) -> None:
    model, workers, router = http_pool
    doc = job_doc(model, tmp_path / "ckpt", steps=STEPS, every=1)
    # Five steps must change the policy's greedy continuation, or comparing the engines' with the
    # checkpoint's proves nothing: at 5e-3 the policy hardly moved (entropy 4.088 -> 4.082 of ln 60 = 4.094).
    doc["spec"]["algorithm"]["learningRate"] = 3e-2
    doc["spec"]["evaluation"] = {"everySteps": STEPS, "prompts": 16}
    # A random tiny policy never solves the arithmetic task (all rewards 0, no gradient); rewarding
    # shorter answers gives every group a signal, and the held-out reward the same function to move.
    use_shorter_is_better(doc, tmp_path)
    use_sglang_pool(doc, router, workers)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    log = tmp_path / "run.log"
    cmd = [sys.executable, "-m", "rljob.runtime.cli", "run", str(job), "--nproc", "2", "--max-restarts", "1",
           "--no-live", "--output", str(tmp_path / "out")]
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "COLUMNS": "300", "PYTHONPATH": path})
        try:
            deadline = time.monotonic() + 900
            while not (tmp_path / "ckpt" / "step-00000002").is_dir():
                assert proc.poll() is None, log.read_text()[-6000:]
                assert time.monotonic() < deadline, "no checkpoint of step 2 within 900 s\n" + log.read_text()[-6000:]
                time.sleep(0.5)
            rank1 = _rank_pid(proc.pid, 1)
            assert rank1 is not None, "rank 1 not found among the launcher's children"
            os.kill(rank1, signal.SIGKILL)
            assert proc.wait(timeout=1200) == 0, log.read_text()[-6000:]
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    assert "resumed from" in text, text[-6000:]
    records = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert records[-1]["step"] == STEPS and records[-1]["policy_version"] == STEPS
    for rec in records:
        assert ledger_imbalance(rec) == (0, 0), rec
        assert rec["engines_in_rotation"] == 2 and rec["weight_sync_failures"] == 0, rec
        # A zero gradient only where it is GRPO's: every trained sample as long as the others, so the same
        # reward (the reward is a function of the length) and no advantage (once at lr 3e-2: all at the cap).
        assert rec["grad_norm"] > 0 or rec["length_std"] == 0, ("a step without a gradient", rec)
    # The engines' own API: both serve the final version (the restarted group rebuilt the weight group).
    assert [httpx.get(u + "/model_info", timeout=10).json()["weight_version"] for u in workers] == [str(STEPS)] * 2
    # And the weights behind that version: the final checkpoint's. (Held-out reward after five steps at
    # this rate is a coin with a bias, not a check: it rose 6 times in 7 and fell once, 0.41 -> 0.30.)
    final = export_checkpoint(tmp_path / "ckpt" / f"step-{STEPS:08d}", tmp_path / "final").directory
    expected = asyncio.run(greedy_of(AutoModelForCausalLM.from_pretrained(final)))
    assert expected != asyncio.run(greedy_of(AutoModelForCausalLM.from_pretrained(model))), \
        "five steps must change the greedy continuation, or the comparison below proves nothing"
    assert [asyncio.run(greedy_on(u)) for u in workers] == [expected] * 2
    evals = read_jsonl(tmp_path / "out" / "eval.jsonl")
    assert evals[0]["step"] == 0 and evals[-1]["step"] == STEPS
    print("held-out reward", [(e["step"], e["reward_mean"]) for e in evals])
