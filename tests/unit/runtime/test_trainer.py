"""The trainer on a real (tiny, randomly initialised) Llama model."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rljob.api.spec import AlgorithmSpec
from rljob.runtime.algorithms.advantages import group_advantages
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
def _response_logp(model: torch.nn.Module, response: str, temperature: float = 1.0) -> list[float]:
    """Naive reference: the full logits of the sequence, log-softmax at the temperature."""
    prompt = TOK.encode_prompt(PROMPT)
    ids = [*prompt, *TOK.encode(response), TOK.eos_token_id]
    logits = model(input_ids=torch.tensor([ids])).logits[0, len(prompt) - 1 : -1] / temperature
    targets = torch.tensor(ids[len(prompt) :])
    return torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1).tolist()


def _sample(
    model: torch.nn.Module,
    index: int,
    response: str,
    reward: float,
    versions: list[int] | None = None,
    temperature: float = 1.0,
) -> Sample:
    ids = [*TOK.encode(response), TOK.eos_token_id]
    logprobs = _response_logp(model, response, temperature)
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


def _group(model: torch.nn.Module, versions: list[int] | None = None, temperature: float = 1.0) -> Group:
    samples = [
        _sample(model, i, GOOD if i % 2 == 0 else BAD, 1.0 if i % 2 == 0 else 0.0, versions, temperature)
        for i in range(4)
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
    # The rewards still form the baseline (advantages are not zero); only the loss is masked.
    assert metrics.loss_tokens == 0 and metrics.zero_advantage_groups == 0 and metrics.optimizer_steps == 0


def test_mask_mode_keeps_the_full_group_baseline() -> None:
    # A typical resumed group: three samples finished in an earlier round (stale), one straggler
    # finished now. Its advantage must come from the whole group's rewards, as in slime's
    # --mask-offpolicy-in-partial-rollout; leaving the stale samples out would make it 0.
    model = _model()
    trainer = Trainer(model, AlgorithmSpec(learning_rate=1e-2, off_policy={"mode": "mask"}), micro_batch_size=4)
    group = _group(model)  # rewards 1, 0, 1, 0
    for sample in group.samples[1:]:
        sample.versions = [0] * sample.response_length
    group.samples[0].versions = [1] * group.samples[0].response_length
    good_before = sum(_response_logp(model, GOOD))
    metrics = trainer.train_step([group], policy_version=1)
    expected_advantage = group_advantages(group.rewards())[0]
    assert expected_advantage > 0.8
    # grpo aggregation, one sequence in the loss, ratio 1: pg_loss = -A of the straggler.
    assert metrics.pg_loss == pytest.approx(-expected_advantage, rel=1e-6)
    assert metrics.loss_tokens == group.samples[0].response_length and metrics.zero_advantage_groups == 0
    assert sum(_response_logp(model, GOOD)) > good_before


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
    assert Trainer(model, AlgorithmSpec(), micro_batch_size=4).reference is None
    trainer = Trainer(model, AlgorithmSpec(learning_rate=1e-2, kl_coef=0.1), micro_batch_size=4)
    assert trainer.reference is not None
    group = _group(model)
    first = trainer.train_step([group], policy_version=0)
    second = trainer.train_step([group], policy_version=0)
    assert first.kl == pytest.approx(0.0, abs=1e-8) and second.kl > 0


def test_mini_batches_move_the_ratio_and_activate_the_clip() -> None:
    model = _model()
    spec = AlgorithmSpec(learning_rate=5e-2, clip_low=0.01, ppo_mini_batches=4)
    trainer = Trainer(model, spec, micro_batch_size=2)
    metrics = trainer.train_step([_group(model), _group(model)], policy_version=0)
    assert metrics.optimizer_steps == 4 and [u.mini_batch for u in metrics.updates] == [0, 1, 2, 3]
    assert [u.samples for u in metrics.updates] == [2, 2, 2, 2]
    # First update: the weights are π_old, so the ratio is exactly 1 and nothing is clipped.
    first = metrics.updates[0]
    assert first.ratio_min == 1.0 and first.ratio_max == 1.0 and first.clip_frac == 0.0 and first.approx_kl == 0.0
    # Later updates see the moved policy against the same π_old: the ratio leaves 1 and the clip acts.
    for later in metrics.updates[1:]:
        assert later.ratio_min != 1.0 or later.ratio_max != 1.0
    assert max(u.clip_frac for u in metrics.updates[1:]) > 0
    assert metrics.approx_kl > 0 and metrics.clip_frac > 0


def test_old_policy_is_the_step_start_policy_across_epochs() -> None:
    # One mini-batch, two epochs: the second pass over the same samples measures the ratio
    # against the step-start log-probs, which a recomputation per update would reset to 1.
    model = _model()
    trainer = Trainer(model, AlgorithmSpec(learning_rate=2e-2, ppo_epochs=2), micro_batch_size=4)
    metrics = trainer.train_step([_group(model)], policy_version=0)
    assert [(u.epoch, u.mini_batch) for u in metrics.updates] == [(0, 0), (1, 0)]
    assert metrics.updates[0].ratio_min == 1.0 == metrics.updates[0].ratio_max
    assert metrics.updates[1].approx_kl > 0
    assert metrics.tokens == 2 * (len(GOOD) + 1) + 2 * (len(BAD) + 1)  # counted once, not per epoch


def test_tis_weighs_rollout_against_the_step_start_policy_with_mini_batches() -> None:
    # Rollout log-probs equal the step-start policy: every TIS weight is 1 in every update, even
    # though the PPO ratio moves (TIS corrects rollout vs π_old, not π vs π_old).
    model = _model()
    spec = AlgorithmSpec(learning_rate=5e-2, ppo_mini_batches=2, off_policy={"mode": "tis"})
    metrics = Trainer(model, spec, micro_batch_size=2).train_step([_group(model), _group(model)], policy_version=0)
    assert metrics.optimizer_steps == 2 and metrics.updates[1].approx_kl > 0
    assert metrics.tis_weight_mean == pytest.approx(1.0, abs=1e-5)


def test_log_probs_are_taken_at_the_rollout_temperature() -> None:
    model = _model()
    temperature = 0.6
    group = _group(model, temperature=temperature)  # the engine's log-probs at T = 0.6
    spec = AlgorithmSpec(off_policy={"mode": "tis", "tis_clip": 100.0})  # no truncation of w
    at_t = Trainer(copy.deepcopy(model), spec, micro_batch_size=4, temperature=temperature).train_step(
        [group], policy_version=0
    )
    # The trainer's π_old at T reproduces the rollout log-probs: w = exp(old - rollout) = 1.
    assert at_t.tis_weight_mean == pytest.approx(1.0, abs=1e-5)
    at_one = Trainer(copy.deepcopy(model), spec, micro_batch_size=4, temperature=1.0).train_step(
        [group], policy_version=0
    )
    assert abs(at_one.tis_weight_mean - 1.0) > 1e-2
    # Entropy is that of softmax(logits / T): a lower temperature gives a sharper distribution.
    assert at_t.entropy < at_one.entropy


def test_learning_rate_schedule_is_applied_per_step() -> None:
    model = _model()
    spec = AlgorithmSpec(learning_rate=1e-3, lr_schedule={"warmup_steps": 2, "decay": "cosine", "min_lr_ratio": 0.1})
    trainer = Trainer(model, spec, micro_batch_size=4, total_steps=4)
    group = _group(model)
    rates = [trainer.train_step([group], policy_version=v).learning_rate for v in range(4)]
    assert rates == [trainer.learning_rate(s) for s in range(4)]
    assert rates[0] == pytest.approx(5e-4) and rates[1] == pytest.approx(1e-3)
    assert rates[2] == pytest.approx(1e-3) and rates[3] == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert trainer.optimizer.param_groups[0]["lr"] == rates[3]
    with pytest.raises(ValueError, match="trainer.steps"):
        Trainer(_model(), spec, micro_batch_size=4)


def test_state_dict_round_trip_restores_model_and_optimizer() -> None:
    model = _model()
    trainer = Trainer(model, AlgorithmSpec(learning_rate=1e-2), micro_batch_size=4)
    group = _group(model)
    trainer.train_step([group], policy_version=0)
    saved = copy.deepcopy(trainer.checkpoint_state())
    trainer.train_step([group], policy_version=1)
    expected = _params(model)

    restored = Trainer(_model(seed=1), AlgorithmSpec(learning_rate=1e-2), micro_batch_size=4)
    restored.load_checkpoint_state(saved)
    restored.train_step([group], policy_version=1)
    assert restored.steps_done == 2
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(expected, restored.model.parameters()))


def test_unfinished_samples_are_refused() -> None:
    model = _model()
    group = _group(model)
    group.samples[1].status = SampleStatus.ABORTED
    with pytest.raises(ValueError, match="g0/1 with status aborted"):
        Trainer(model, AlgorithmSpec(), micro_batch_size=4).train_step([group], policy_version=0)


def _mixed_group(model: torch.nn.Module) -> Group:
    """One long answer and short ones: packed, the short ones share rows."""
    answers = ["003 001 002 004 005 #### 1", "1", "#### 3", "2", "003 #### 3", "7"]
    samples = [_sample(model, i, text, float(i % 2)) for i, text in enumerate(answers)]
    return Group(group_id="g0", prompt_text=PROMPT, samples=samples)


def test_packed_rows_give_each_sample_its_own_log_probs() -> None:
    # Several samples in one row, each counting positions from 0: the model must mask them from each
    # other. Without position ids the later samples would attend to the earlier ones (and be rotated
    # as if they came after them), and their log-probs would differ from a forward of each alone.
    model = _model()
    group = _mixed_group(model)
    trainer = Trainer(model, AlgorithmSpec(), micro_batch_size=8)
    assert trainer.pack_sequences
    items, _ = trainer._items([group], policy_version=0)
    (mb,) = trainer._micro_batches(items)
    assert mb.input_ids.shape[0] < len(items)  # fewer rows than samples: really packed
    with torch.no_grad():
        logp, _ = trainer._token_stats(model, mb)
    for row, item in enumerate(mb.items):
        sample = next(s for s in group.samples if [*s.prompt_ids, *s.response_ids] == item.input_ids)
        expected = _response_logp(model, TOK.decode(sample.response_ids[:-1]))
        assert logp[row, : item.response_length].tolist() == pytest.approx(expected, abs=1e-5)
        assert bool((logp[row, item.response_length :] == 0).all())


def test_packing_does_not_change_the_update() -> None:
    # The same two steps, packed and one sample per row: the same losses and the same weights.
    runs = []
    for packed in (True, False):
        model = _model()
        trainer = Trainer(model, AlgorithmSpec(learning_rate=1e-2, ppo_mini_batches=2), micro_batch_size=2,
                          pack_sequences=packed)
        group = _mixed_group(model)
        metrics = [trainer.train_step([group], policy_version=0) for _ in range(2)]
        runs.append(([(m.loss, m.entropy, m.tokens) for m in metrics], _params(model)))
    (packed_metrics, packed_params), (padded_metrics, padded_params) = runs
    for (loss, entropy, tokens), (loss_p, entropy_p, tokens_p) in zip(packed_metrics, padded_metrics):
        assert tokens == tokens_p
        assert loss == pytest.approx(loss_p, rel=1e-4, abs=1e-6)
        assert entropy == pytest.approx(entropy_p, rel=1e-5)
    for a, b in zip(packed_params, padded_params):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_model_that_is_not_hugging_face_is_not_packed() -> None:
    class Plain(torch.nn.Module):  # returns .logits, takes no position ids
        def __init__(self) -> None:
            super().__init__()
            self.inner = _model()

        def forward(self, input_ids: torch.Tensor) -> object:
            return self.inner(input_ids=input_ids)

    plain = Plain()
    trainer = Trainer(plain, AlgorithmSpec(), micro_batch_size=4)
    assert not trainer.pack_sequences
    metrics = trainer.train_step([_mixed_group(plain.inner)], policy_version=0)
    assert metrics.tis_weight_mean == pytest.approx(1.0, abs=1e-5)
