"""The whole runtime loop on a tiny real model: metrics, checkpoints, and a restart that loses or
duplicates no buffered sample."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from transformers import LlamaConfig, LlamaForCausalLM

from rljob.api import parse_rljob
from rljob.runtime.metrics import read_jsonl
from rljob.runtime.rollout.sample import Group
from rljob.runtime.runner import JobRunner, RunOptions
from rljob.runtime.tasks.tokenizer import CharTokenizer


def tiny_policy(directory: Path) -> Path:
    """A random 2-layer Llama over the task's character vocabulary, saved with its tokenizer."""
    tokenizer = CharTokenizer()
    config = LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save(directory)
    return directory


def job_doc(model: Path, ckpt: Path, steps: int, every: int) -> dict:
    return {
        "apiVersion": "rljob.io/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "resume-test"},
        "spec": {
            "model": {"path": str(model)},
            "data": {"synthetic": {"numPrompts": 256, "seed": 3}},
            "algorithm": {"name": "grpo", "learningRate": 1e-3, "offPolicy": {"mode": "tis"}},
            "rollout": {
                "strategy": "april", "rolloutBatchSize": 3, "samplesPerPrompt": 2, "maxResponseLength": 40,
                "partial": {"overSampling": 2.0, "maxStaleness": 3},
                "embedded": {"maxBatchSize": 16},
            },
            "trainer": {"steps": steps, "microBatchSize": 8},
            "checkpoint": {"dir": str(ckpt), "everySteps": every},
        },
    }


def spy_on_training(runner: JobRunner) -> list[Group]:
    """Record every group the trainer receives (the real train_step still runs)."""
    trained: list[Group] = []
    real = runner.trainer.train_step

    def train_step(groups: list[Group], version: int):  # type: ignore[no-untyped-def]
        trained.extend(groups)
        return real(groups, version)

    runner.trainer.train_step = train_step  # type: ignore[method-assign]
    return trained


def snapshot(groups) -> dict[str, list[tuple[int, tuple[int, ...], tuple[int, ...]]]]:  # type: ignore[no-untyped-def]
    return {g.group_id: [(s.index, tuple(s.response_ids), tuple(s.versions)) for s in g.samples] for g in groups}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return tiny_policy(tmp_path / "model")


async def test_restart_resumes_buffer_without_loss_or_duplication(tmp_path: Path, model_dir: Path):
    job = parse_rljob(job_doc(model_dir, tmp_path / "ckpt", steps=4, every=2))
    first = JobRunner(job, RunOptions(output_dir=tmp_path / "out"))
    await first.setup()
    trained_first = spy_on_training(first)
    for _ in range(2):
        await first.run_step()
    buffered_at_checkpoint = snapshot(first.scheduler.buffer)
    cursor_at_checkpoint = first.prompts.state_dict()
    assert buffered_at_checkpoint, "APRIL left nothing in the buffer: the test would prove nothing"
    await first.run_step()  # step 3 is never checkpointed: the process "crashes" after it
    await first.close()

    second = JobRunner(job, RunOptions(output_dir=tmp_path / "out"))
    await second.setup()
    assert second.step == 2 and second.version == 2
    assert second.resumed_from and second.resumed_from.endswith("step-00000002")
    assert snapshot(second.scheduler.buffer) == buffered_at_checkpoint
    assert second.prompts.state_dict() == cursor_at_checkpoint
    trained_second = spy_on_training(second)
    await second.run_step()
    await second.run_step()
    await second.close()

    ids_before = [g.group_id for g in trained_first[: 2 * 3]]  # steps 1-2 (before the checkpoint)
    ids_after = [g.group_id for g in trained_second]
    assert len(set(ids_before + ids_after)) == len(ids_before) + len(ids_after), "a group was trained twice"
    remaining = {g.group_id for g in second.scheduler.buffer}
    for gid, samples in buffered_at_checkpoint.items():
        assert gid in ids_after or gid in remaining, f"buffered group {gid} was lost across the restart"
        if gid in ids_after:
            group = next(g for g in trained_second if g.group_id == gid)
            for (index, ids, versions), sample in zip(samples, group.samples):
                if sample.regenerations == 0:  # resumed, not regenerated: the old tokens are a prefix
                    assert tuple(sample.response_ids[: len(ids)]) == ids
                    assert tuple(sample.versions[: len(versions)]) == versions


async def test_a_torn_newest_checkpoint_resumes_from_the_one_before(tmp_path: Path, model_dir: Path):
    """A node crash tore the newest checkpoint (its state.pt cut short): the restart loads the one before,
    says so in the log, the runner and the metrics, and trains on; it no longer crashes on every restart."""
    job = parse_rljob(job_doc(model_dir, tmp_path / "ckpt", steps=4, every=1))
    first = JobRunner(job, RunOptions(output_dir=tmp_path / "out"))
    await first.setup()
    for _ in range(3):
        await first.run_step()
    await first.close()
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000002", "step-00000003"]  # keep=2
    state = ckpt / "step-00000003" / "state.pt"
    state.write_bytes(state.read_bytes()[:100])

    second = JobRunner(job, RunOptions(output_dir=tmp_path / "out"))
    await second.setup()
    assert second.step == 2 and second.version == 2
    assert second.resumed_from and second.resumed_from.endswith("step-00000002")
    assert len(second.skipped_checkpoints) == 1, second.skipped_checkpoints
    assert second.skipped_checkpoints[0].startswith("step-00000003 (failed to load")
    assert second.metrics.registry.get_sample_value("rljob_checkpoints_skipped_total") == 1.0
    await second.run_step()  # step 3 again, its checkpoint written over the torn one
    await second.run_step()
    await second.close()
    assert second.step == 4
    third = JobRunner(job, RunOptions(output_dir=tmp_path / "out"))
    await third.setup()
    assert third.resumed_from and third.resumed_from.endswith("step-00000004") and third.skipped_checkpoints == []
    await third.close()


async def test_a_rollback_resumes_from_the_chosen_older_checkpoint_once(tmp_path: Path, model_dir: Path):
    """spec.checkpoint.rollbackTo (the operator's RollbackToCheckpoint alert action): the next start resumes
    from the newest checkpoint at or before the step, with the spec's (lowered) learning rate, and sets the
    newer steps aside; a later start with the same rollback resumes from the new run's own checkpoints."""
    doc = job_doc(model_dir, tmp_path / "ckpt", steps=6, every=1)
    doc["spec"]["checkpoint"]["keep"] = 3
    first = JobRunner(parse_rljob(doc), RunOptions(output_dir=tmp_path / "out"))
    await first.setup()
    for _ in range(4):
        await first.run_step()
    await first.close()
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000002", "step-00000003", "step-00000004"]

    doc["spec"]["checkpoint"]["rollbackTo"] = {"step": 2, "id": "entropycollapse-1"}
    doc["spec"]["algorithm"]["learningRate"] = 1e-4
    rolled = parse_rljob(doc)
    second = JobRunner(rolled, RunOptions(output_dir=tmp_path / "out"))
    await second.setup()
    assert second.step == 2 and second.resumed_from and second.resumed_from.endswith("step-00000002")
    aside = ckpt / "rolled-back-entropycollapse-1"
    assert sorted(p.name for p in aside.iterdir()) == ["step-00000003", "step-00000004"]
    record = await second.run_step()
    # The optimizer state came from the checkpoint (learning rate 1e-3); the step trains with the spec's.
    assert record.step == 3 and [g["lr"] for g in second.trainer.optimizer.param_groups] == pytest.approx([1e-4])
    await second.close()

    third = JobRunner(rolled, RunOptions(output_dir=tmp_path / "out"))  # e.g. a crash after the rollback
    await third.setup()
    assert third.step == 3 and third.resumed_from and third.resumed_from.endswith("step-00000003")
    assert sorted(p.name for p in aside.iterdir()) == ["step-00000003", "step-00000004"]
    await third.close()


async def test_metrics_jsonl_and_prometheus(tmp_path: Path, model_dir: Path):
    import httpx

    job = parse_rljob(job_doc(model_dir, tmp_path / "ckpt", steps=2, every=1))
    runner = JobRunner(job, RunOptions(output_dir=tmp_path / "out", metrics_port=0))
    job.spec.metrics.port = 0
    await runner.setup()
    port = runner.metrics.serve("127.0.0.1", 0)
    await runner.run()
    records = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert records[-1]["policy_version"] == 2
    assert all(r["tokens_generated"] > 0 and r["rollout_tokens_per_s"] > 0 for r in records)
    assert set(records[-1]["knobs"]) >= {"over_sampling", "max_staleness"}
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    for name in ("rljob_rollout_tokens_per_second", "rljob_truncation_rate", "rljob_off_policy_token_ratio",
                 "rljob_policy_version 2.0", "rljob_buffer_groups", 'rljob_knob{knob="over_sampling"} 2.0',
                 "rljob_sample_staleness_versions_bucket"):
        assert name in text, name
    assert len(list((tmp_path / "ckpt").glob("step-*"))) == 2  # keep=2


async def test_held_out_evaluation_curve(tmp_path: Path, model_dir: Path):
    import httpx

    from rljob.runtime.report import read_history, write_report
    from rljob.runtime.tasks.synthetic import ArithChainTask

    doc = job_doc(model_dir, tmp_path / "ckpt", steps=3, every=3)
    doc["spec"]["evaluation"] = {"everySteps": 2, "prompts": 8}
    runner = JobRunner(parse_rljob(doc), RunOptions(output_dir=tmp_path / "out"))
    await runner.setup()
    # Held out: the synthetic problems right after the 256 training ones.
    held_out = ArithChainTask(seed=3).problems(8, start=256)
    assert [p.answer for p in runner.eval_prompts] == [p.answer for p in held_out]
    port = runner.metrics.serve("127.0.0.1", 0)
    await runner.run()
    evals = read_jsonl(tmp_path / "out" / "eval.jsonl")
    assert [(e["step"], e["policy_version"], e["prompts"]) for e in evals] == [(0, 0, 8), (2, 2, 8), (3, 3, 8)]
    assert all(0.0 <= e["reward_mean"] <= 1.0 and e["length_mean"] > 0 for e in evals)
    records = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert [r["eval_reward"] for r in records] == [None, evals[1]["reward_mean"], evals[2]["reward_mean"]]
    assert f"rljob_eval_reward_mean {evals[-1]['reward_mean']}" in httpx.get(f"http://127.0.0.1:{port}/metrics").text
    write_report(tmp_path / "report", read_history(tmp_path / "out" / "metrics.jsonl"), None, evals)
    summary = (tmp_path / "report" / "summary.json").read_text()
    assert '"eval_reward_first_step": 0' in summary and '"eval_reward_last_step": 3' in summary


def test_cli_run_then_resume(tmp_path: Path, model_dir: Path):
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job_doc(model_dir, tmp_path / "ckpt", steps=2, every=1)))
    cmd = [sys.executable, "-m", "rljob.runtime.cli", "run", str(job_file), "--output", str(tmp_path / "out"),
           "--no-live"]
    env = {**os.environ, "COLUMNS": "300"}  # rich wraps at 80 columns when not on a terminal
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "step 2:" in first.stdout
    report = tmp_path / "out" / "report"
    for plot in ("reward.png", "throughput.png", "truncation_rate.png", "off_policy_ratio.png",
                 "length_distribution.png"):
        assert (report / plot).stat().st_size > 1000, plot
    second = subprocess.run([*cmd, "--steps", "3"], capture_output=True, text=True, timeout=600, env=env)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resumed from" in second.stdout and "at step 2" in second.stdout
    assert "step 3:" in second.stdout and "step 1:" not in second.stdout


def test_cli_sigterm_before_the_last_step_exits_interrupted_never_zero(tmp_path: Path, model_dir: Path):
    """A drain (SIGTERM) checkpoints and exits 75 with an Interrupted termination message: it used to
    exit 0, which the operator read as the trainer having finished."""
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job_doc(model_dir, tmp_path / "ckpt", steps=50, every=10)))
    message = tmp_path / "termination-log"
    cmd = [sys.executable, "-m", "rljob.runtime.cli", "run", str(job_file), "--output", str(tmp_path / "out"),
           "--no-live"]
    env = {**os.environ, "COLUMNS": "300", "PYTHONUNBUFFERED": "1", "RLJOB_TERMINATION_MESSAGE_PATH": str(message)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step 1:"):
            proc.send_signal(signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=600)
    output = "".join(lines) + rest
    assert proc.returncode == 75, output
    text = message.read_text()
    assert text.startswith("Interrupted: SIGTERM after step "), text
    step = int(text.split("after step ")[1].split(";")[0])
    assert 1 <= step < 50 and any(p.name.endswith(f"{step:08d}") for p in (tmp_path / "ckpt").iterdir()), output
