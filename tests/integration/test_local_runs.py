"""Local runs: --fresh never resumes (or prunes for) another run's checkpoints, the default checkpoint
folder is per job, `rljob report` rebuilds a run's plots from its metrics.jsonl (its truncation verdict
against the job's band), and the quickstart file trains with the async strategy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from rljob.api import parse_rljob
from rljob.runtime.checkpoint import step_of
from rljob.runtime.cli import main
from rljob.runtime.metrics import ledger_imbalance, read_jsonl
from rljob.runtime.report import truncation_verdict
from tests.integration.test_runner_resume import job_doc, tiny_policy


def _steps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if step_of(p) is not None)


def test_a_fresh_run_sets_the_old_checkpoints_aside_and_a_resume_picks_its_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    doc = job_doc(tiny_policy(tmp_path / "model"), ckpt, steps=4, every=1)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    run = ["run", str(job), "--no-live", "--output", str(out)]
    assert main(run) == 0
    assert _steps(ckpt) == ["step-00000003", "step-00000004"]  # keep=2

    # The second run is fresh and shorter: its step-1 and step-2 must survive pruning (the old run's step-3 and
    # step-4 would otherwise count as newer) and the old ones must be out of any resume's sight.
    assert main([*run, "--fresh", "--steps", "2"]) == 0
    assert "moved the previous run's checkpoints to" in capsys.readouterr().out
    assert _steps(ckpt) == ["step-00000001", "step-00000002"]
    (aside,) = [p for p in ckpt.iterdir() if p.name.startswith("previous-")]
    assert _steps(aside) == ["step-00000003", "step-00000004"]
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2]

    assert main([*run, "--steps", "3"]) == 0
    assert "resumed from" in (printed := capsys.readouterr().out) and f"{ckpt}/step-00000002" in printed.replace("\n", "")
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]


def test_rljob_report_rebuilds_the_plots_from_metrics_jsonl(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    doc = job_doc(tiny_policy(tmp_path / "model"), tmp_path / "ckpt", steps=2, every=1)
    doc["spec"]["autotune"] = {"truncationBand": {"low": 0.0, "high": 0.99}}  # the job's own band
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    assert main(["run", str(job), "--no-live", "--output", str(out)]) == 0

    def summary() -> dict[str, Any]:
        return dict(json.loads((out / "report" / "summary.json").read_text()))

    def verdict() -> str:
        return str(summary()["truncation_rate_vs_band"])

    assert verdict() == "inside the 0%-99% band"  # the run judged itself against its spec's band
    for path in (out / "report").iterdir():
        path.unlink()
    assert main(["report", str(out)]) == 0
    assert {"reward.png", "summary.json"} <= {p.name for p in (out / "report").iterdir()}
    # Told no band, `rljob report` judges against the default one.
    assert verdict() == truncation_verdict(summary()["mean_truncation_rate"], (0.15, 0.25)) != "inside the 0%-99% band"
    assert main(["report", str(out), "--band", "0.0", "0.99"]) == 0
    assert verdict() == "inside the 0%-99% band"
    assert main(["report", str(tmp_path / "nowhere")]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().out
    assert main(["report", str(out), "--band", "0.3", "0.2"]) == 2
    assert "--band 0.3 0.2: give LOW HIGH with 0 <= LOW < HIGH <= 1" in capsys.readouterr().out


def test_the_default_checkpoint_folder_is_per_job() -> None:
    doc = {"apiVersion": "rljob.io/v1alpha1", "kind": "RLJob", "metadata": {"name": "alpha"},
           "spec": {"model": {"builtin": "tiny-arith"}, "data": {"synthetic": {}}}}
    assert parse_rljob(doc).spec.checkpoint.dir == "runs/alpha/checkpoints"
    doc["metadata"]["name"] = "beta"
    assert parse_rljob(doc).spec.checkpoint.dir == "runs/beta/checkpoints"
    doc["spec"]["checkpoint"] = {"dir": "/mnt/ckpt"}
    assert parse_rljob(doc).spec.checkpoint.dir == "/mnt/ckpt"


QUICKSTART = Path(__file__).resolve().parents[2] / "docs" / "examples" / "quickstart.yaml"


@pytest.mark.slow
def test_the_quickstart_runs_with_the_async_strategy_unchanged_otherwise(tmp_path: Path) -> None:
    """`rljob run docs/examples/quickstart.yaml --strategy async`: the quickstart file as it is (only the
    step count and the folders differ) trains with async rollouts; the engine generates through every
    train step, no trained token is older than its maxStaleness, and the sample ledger closes."""
    from rljob.runtime.tasks.warmup import builtin_policy

    builtin_policy(progress=False)  # the cached warm-up of the builtin policy (minutes on a fresh machine)
    out = tmp_path / "out"
    assert main(["run", str(QUICKSTART), "--strategy", "async", "--steps", "2", "--no-live", "--output", str(out),
                 "--checkpoint-dir", str(tmp_path / "ckpt")]) == 0
    records = read_jsonl(out / "metrics.jsonl")
    assert [(r["step"], r["policy_version"], r["strategy"]) for r in records] == [(1, 1, "async"), (2, 2, "async")]
    eta = yaml.safe_load(QUICKSTART.read_text())["spec"]["rollout"]["partial"]["maxStaleness"]
    for rec in records:
        assert rec["overlap_seconds"] > 0, rec
        assert rec["staleness_max"] <= eta, rec
        assert ledger_imbalance(rec) == (0, 0), rec
    assert records[-1]["eval_reward"] is not None  # the quickstart's held-out evaluation, at the last step
    assert (out / "report" / "summary.json").is_file()
