"""`rljob export`: a training checkpoint becomes a Hugging Face folder that transformers loads to the same logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rljob.api.spec import AlgorithmSpec, RLJob
from rljob.runtime.checkpoint import CheckpointManager, rng_state
from rljob.runtime.cli import main
from rljob.runtime.models.errors import ExportError
from rljob.runtime.export import export_checkpoint
from rljob.runtime.models.loading import load_causal_lm
from rljob.runtime.trainer import Trainer

IDS = torch.tensor([[1, 20, 30, 40, 50, 60, 70], [5, 6, 7, 8, 9, 10, 11]])


def _trained_checkpoint(folder: Path, directory: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A checkpoint as the runner writes it, of a policy whose weights moved away from the folder's."""
    job = RLJob.model_validate(
        {"metadata": {"name": "export-test"}, "spec": {"model": {"path": str(folder)}, "data": {"jsonl": "unused.jsonl"}}}
    )
    model = load_causal_lm(folder, dtype=dtype)
    trainer = Trainer(model, AlgorithmSpec())
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator).to(p.dtype))
    CheckpointManager(directory).save(7, trainer.checkpoint_state(), rng_state(), {"step": 7, "version": 7, "job": job.to_wire()})
    return model


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_export_round_trips_to_the_same_logits(tiny_hf_models: dict[str, Path], tmp_path: Path, family: str) -> None:
    folder = tiny_hf_models[family]
    trained = _trained_checkpoint(folder, tmp_path / "ckpt")
    result = export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    assert (result.step, result.policy_version, result.dtype, result.hf_tokenizer) == (7, 7, "float32", True)
    assert (tmp_path / "hf" / "model.safetensors").is_file() and (tmp_path / "hf" / "generation_config.json").is_file()

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        # Same fp32 weights and the same kernels: the logits are bit-identical, not merely close.
        assert torch.equal(loaded(IDS).logits, trained(IDS).logits)
        assert not torch.equal(loaded(IDS).logits, load_causal_lm(folder)(IDS).logits)  # the trained weights, not the base
    original, exported = AutoTokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert exported.chat_template == original.chat_template
    assert exported.encode("What is 12 + 3?") == original.encode("What is 12 + 3?")


def test_export_cli_in_bfloat16_and_refuses_a_non_empty_target(tiny_hf_models: dict[str, Path], tmp_path: Path) -> None:
    trained = _trained_checkpoint(tiny_hf_models["qwen3"], tmp_path / "ckpt")
    step_dir = tmp_path / "ckpt" / "step-00000007"
    assert main(["export", str(step_dir), str(tmp_path / "hf"), "--dtype", "bfloat16"]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.dtype == torch.bfloat16
    expected = {k: v.to(torch.bfloat16) for k, v in trained.state_dict().items()}
    assert all(torch.equal(v, expected[k]) for k, v in loaded.state_dict().items())
    with pytest.raises(ExportError, match="DIR: .* exists and is not empty"):
        export_checkpoint(step_dir, tmp_path / "hf")
    assert main(["export", str(tmp_path / "nothing-here"), str(tmp_path / "x")]) == 2


def test_a_cluster_checkpoint_exports_with_model_naming_the_base_folder(
    tiny_hf_models: dict[str, Path], tmp_path: Path
) -> None:
    """A trainer pod's checkpoint names the model's path inside the pod; --model supplies it here."""
    folder = tiny_hf_models["llama"]
    pod_view = tmp_path / "var" / "lib" / "rljob" / "model"  # the pod's path: absent on this machine
    pod_view.parent.mkdir(parents=True)
    pod_view.symlink_to(folder)
    trained = _trained_checkpoint(pod_view, tmp_path / "ckpt")
    pod_view.unlink()
    with pytest.raises(ExportError, match="with --model DIR"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--model", str(folder)]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, trained(IDS).logits)
