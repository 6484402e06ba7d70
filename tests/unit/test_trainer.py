"""The trainer on a real (tiny, randomly initialised) Llama model."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rljob.operator.api.spec import AlgorithmSpec
from rljob.runtime.rollout.sample import Group, Sample, SampleStatus
from rljob.runtime.tasks.tokenizer import CharTokenizer
from rljob.runtime.trainer import Trainer

TOK = CharTokenizer()
PROMPT = "5%2="
GOOD = "003 001 #### 1"
BAD = "003 #### 3"


def _model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=TOK.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


@torch.no_grad()
def _response_logp(model: torch.nn.Module, response: str) -> list[float]:
    prompt = TOK.encode_prompt(PROMPT)
    ids = [*prompt, *TOK.encode(response), TOK.eos_token_id]
    logits = model(input_ids=torch.tensor([ids])).logits[0, len(prompt) - 1 : -1]
    targets = torch.tensor(ids[len(prompt) :])
    return torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1).tolist()


def _sample(model: torch.nn.Module, index: int, response: str, reward: float, versions: list[int] | None = None) -> Sample:
    ids = [*TOK.encode(response), TOK.eos_token_id]
    logprobs = _response_logp(model, response)
    return Sample(
        group_id="g0",
        index=index,
        prompt_ids=TOK.encode_prompt(PROMPT),
        answer="1",
        response_ids=ids,
        logprobs=logprobs,
        versions=versions if versions is not None else [0] * len(ids),
        status=SampleStatus.COMPLETED,
        reward=reward,
    )


def _group(model: torch.nn.Module, versions: list[int] | None = None) -> Group:
    samples = [
        _sample(model, i, GOOD if i % 2 == 0 else BAD, 1.0 if i % 2 == 0 else 0.0, versions) for i in range(4)
    ]
    return Group(group_id="g0", prompt_text=PROMPT, samples=samples)


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["keep", "mask", "tis"])
def test_positive_advantage_raises_the_rewarded_answer(mode: str) -> None:
    model = _model()
    spec = AlgorithmSpec(learning_rate=3e-3, off_policy={"mode": mode})
    trainer = Trainer(model, spec, micro_batch_size=2)
    group = _group(model)  # rollout log-probs from the initial policy, version 0
    good_before, bad_before = sum(_response_logp(model, GOOD)), sum(_response_logp(model, BAD))
    for _ in range(5):
        metrics = trainer.train_step([group], policy_version=0)
    assert sum(_response_logp(model, GOOD)) > good_before + 1.0
    assert sum(_response_logp(model, BAD)) < bad_before - 1.0
    assert metrics.samples == 4 and metrics.groups == 1 and metrics.reward_mean == 0.5
    assert metrics.tokens == 2 * (len(GOOD) + 1) + 2 * (len(BAD) + 1)
    assert metrics.off_policy_token_ratio == 0.0 and metrics.masked_token_share == 0.0
    assert metrics.grad_norm > 0 and metrics.entropy > 0 and math.isfinite(metrics.loss)
    if mode == "tis":
        # Rollout log-probs came from the initial weights; after training, w moves away from 1.
        assert metrics.tis_weight_mean != pytest.approx(1.0, abs=1e-4)


def test_first_step_tis_weights_are_one_when_rollout_matches_trainer() -> None:
    model = _model()
    trainer = Trainer(model, AlgorithmSpec(off_policy={"mode": "tis"}), micro_batch_size=4)
    metrics = trainer.train_step([_group(model)], policy_version=0)
    assert metrics.tis_weight_mean == pytest.approx(1.0, abs=1e-4)
    assert metrics.clip_frac == 0.0 and metrics.approx_kl == pytest.approx(0.0, abs=1e-10)


def test_mask_mode_does_not_train_on_fully_stale_groups() -> None:
    model = _model()
    trainer = Trainer(model, AlgorithmSpec(learning_rate=1e-2, off_policy={"mode": "mask"}), micro_batch_size=4)
    before = _params(model)
    metrics = trainer.train_step([_group(model)], policy_version=3)  # every token has version 0 < 3
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert metrics.masked_token_share == 1.0 and metrics.off_policy_token_ratio == 1.0
    assert metrics.loss_tokens == 0 and metrics.zero_advantage_groups == 1


def test_keep_mode_trains_on_stale_tokens_and_reports_their_share() -> None:
    model = _model()
    trainer = Trainer(model, AlgorithmSpec(learning_rate=1e-2), micro_batch_size=4)
    before = _params(model)
    group = _group(model)
    for sample in group.samples:  # first two tokens of every sample came from version 1
        sample.versions = [1, 1] + [2] * (sample.response_length - 2)
    metrics = trainer.train_step([group], policy_version=2)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert metrics.off_policy_token_ratio == pytest.approx(8 / metrics.tokens)
    assert metrics.masked_token_share == 0.0


@pytest.mark.parametrize("name", ["grpo", "dapo"])
def test_micro_batching_does_not_change_the_gradient(name: str) -> None:
    # Adam's first step is ~lr·sign(g), which amplifies float noise; the accumulated gradient's
    # norm and the loss are the exact check that micro-batches are normalised globally.
    results = []
    for micro in (1, 3, 8):
        model = _model()
        trainer = Trainer(model, AlgorithmSpec(name=name), micro_batch_size=micro)
        groups = [_group(model), _group(model)]
        groups[1].samples[0].reward = 0.0  # different advantages in the second group
        metrics = trainer.train_step(groups, policy_version=0)
        results.append((metrics.loss, metrics.grad_norm))
    for loss, grad_norm in results[1:]:
        assert loss == pytest.approx(results[0][0], rel=1e-5, abs=1e-7)
        assert grad_norm == pytest.approx(results[0][1], rel=1e-4)


def test_kl_reference_model_only_with_kl_coef() -> None:
    model = _model()
    assert Trainer(model, AlgorithmSpec(), micro_batch_size=4).ref_model is None
    trainer = Trainer(model, AlgorithmSpec(learning_rate=1e-2, kl_coef=0.1), micro_batch_size=4)
    assert trainer.ref_model is not None
    group = _group(model)
    first = trainer.train_step([group], policy_version=0)
    second = trainer.train_step([group], policy_version=0)
    assert first.kl == pytest.approx(0.0, abs=1e-8) and second.kl > 0


def test_mini_batches_move_the_ratio_and_activate_the_clip() -> None:
    model = _model()
    trainer = Trainer(model, AlgorithmSpec(learning_rate=5e-2, clip_low=0.01), micro_batch_size=2, num_mini_batches=2)
    metrics = trainer.train_step([_group(model), _group(model)], policy_version=0)
    assert metrics.optimizer_steps == 2
    assert metrics.approx_kl > 0 and metrics.clip_frac > 0


def test_state_dict_round_trip_restores_model_and_optimizer() -> None:
    model = _model()
    trainer = Trainer(model, AlgorithmSpec(learning_rate=1e-2), micro_batch_size=4)
    group = _group(model)
    trainer.train_step([group], policy_version=0)
    saved = copy.deepcopy(trainer.state_dict())
    trainer.train_step([group], policy_version=1)
    expected = _params(model)

    restored = Trainer(_model(seed=1), AlgorithmSpec(learning_rate=1e-2), micro_batch_size=4)
    restored.load_state_dict(saved)
    restored.train_step([group], policy_version=1)
    assert restored.steps_done == 2
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(expected, restored.model.parameters()))


def test_unfinished_samples_are_refused() -> None:
    model = _model()
    group = _group(model)
    group.samples[1].status = SampleStatus.ABORTED
    with pytest.raises(ValueError, match="g0/1 with status aborted"):
        Trainer(model, AlgorithmSpec(), micro_batch_size=4).train_step([group], policy_version=0)
