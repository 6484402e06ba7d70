"""docs/examples/qwen3-tiny.yaml end to end: builtin tiny Qwen3 built into the cache, chat messages, training,
checkpoint, export to a folder transformers loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from rljob.api import parse_rljob
from rljob.runtime.metrics import read_jsonl
from rljob.runtime.export import export_checkpoint
from rljob.runtime.rollout.sample import Group
from rljob.runtime.runner import JobRunner, RunOptions

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "qwen3-tiny.yaml"


async def test_qwen3_tiny_example_trains_and_exports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLJOB_CACHE", str(tmp_path / "cache"))  # the builtin folder is built here on first use
    monkeypatch.chdir(EXAMPLE.parents[2])  # the example's data paths are relative to the repository root
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["checkpoint"]["dir"] = str(tmp_path / "ckpt")
    job = parse_rljob(doc, str(EXAMPLE))
    runner = JobRunner(job, RunOptions(output_dir=tmp_path / "out", steps=2, resume=False))
    await runner.setup()
    trained: list[Group] = []
    real_step = runner.trainer.train_step

    def spy(groups: list[Group], version: int):  # type: ignore[no-untyped-def]
        trained.extend(groups)
        return real_step(groups, version)

    runner.trainer.train_step = spy  # type: ignore[method-assign]
    assert type(runner.trainer.model).__name__ == "Qwen3ForCausalLM"
    im_end, end_of_text = runner.tokenizer.tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])  # type: ignore[attr-defined]
    assert runner.policy.stop_token_ids == [im_end, end_of_text]
    summary = await runner.run()

    assert summary.steps_run == 2
    records = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2] and all(r["tokens_generated"] > 0 for r in records)
    sample = trained[0].samples[0]
    prompt_text = runner.tokenizer.decode(sample.prompt_ids)
    assert "You are a careful calculator." in prompt_text and "Give the final answer after ####." in prompt_text
    generation_prompt = runner.tokenizer.encode("<|im_start|>assistant\n")
    assert sample.prompt_ids[-len(generation_prompt) :] == generation_prompt
    assert set(sample.metadata) == {"id", "operation"}  # extra row fields reach the sample

    exported = export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(exported.directory)
    ids = torch.tensor([sample.prompt_ids])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, runner.trainer.model.eval()(ids).logits)
