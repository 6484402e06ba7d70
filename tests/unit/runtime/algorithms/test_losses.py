"""The policy loss, off-policy modes and advantages, checked against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from rljob.api.spec import AlgorithmSpec
from rljob.runtime.algorithms.advantages import dynamic_sampling_keep, group_advantages
from rljob.runtime.algorithms.losses import (
    LossConfig,
    aggregate,
    clipped_pg_loss,
    k3_kl,
    loss_denominator,
    loss_mask,
    policy_loss,
    tis_weights,
)

LOG = math.log


def _on_policy_batch() -> dict[str, torch.Tensor]:
    """Two sequences: 3 tokens (A=+1) and 1 token (A=-2); sequence 0's first two tokens are stale."""
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, 0.0, 0.0]], requires_grad=True)
    return {
        "logp": logp,
        "old_logp": logp.detach().clone(),
        "rollout_logp": torch.tensor([[-1.0 - LOG(3.0), -2.0 - LOG(0.5), -0.5], [-0.7, 0.0, 0.0]]),
        "advantages": torch.tensor([1.0, -2.0]),
        "response_mask": torch.tensor([[1, 1, 1], [1, 0, 0]]),
        "stale_mask": torch.tensor([[True, True, False], [False, False, False]]),
    }


def _config(mode: str, aggregation: str = "token_mean", **kwargs: float) -> LossConfig:
    return LossConfig(off_policy_mode=mode, aggregation=aggregation, **kwargs)  # type: ignore[arg-type]


def test_keep_mode_trains_every_token_with_ratio_one() -> None:
    batch = _on_policy_batch()
    loss, stats = policy_loss(**batch, config=_config("keep"))
    # ratio = 1 everywhere: token losses -1, -1, -1 and +2 over 4 tokens.
    assert loss.item() == pytest.approx((-1 - 1 - 1 + 2) / 4)
    loss.backward()
    expected_grad = torch.tensor([[-0.25, -0.25, -0.25], [0.5, 0.0, 0.0]])
    assert torch.allclose(batch["logp"].grad, expected_grad)
    assert stats.loss_tokens == 4 and stats.masked_tokens == 0
    assert stats.summary()["off_policy_token_ratio"] == pytest.approx(2 / 4)
    assert stats.summary()["clip_frac"] == 0.0


def test_mask_mode_drops_stale_tokens_from_the_loss() -> None:
    batch = _on_policy_batch()
    loss, stats = policy_loss(**batch, config=_config("mask"))
    # Only sequence 0's last token (-1) and sequence 1's token (+2) remain.
    assert loss.item() == pytest.approx((-1 + 2) / 2)
    loss.backward()
    expected_grad = torch.tensor([[0.0, 0.0, -0.5], [1.0, 0.0, 0.0]])
    assert torch.allclose(batch["logp"].grad, expected_grad)
    assert stats.loss_tokens == 2 and stats.masked_tokens == 2
    assert stats.summary()["masked_token_share"] == pytest.approx(0.5)


def test_tis_mode_weights_tokens_by_truncated_ratio_without_gradient_through_it() -> None:
    batch = _on_policy_batch()
    loss, stats = policy_loss(**batch, config=_config("tis", tis_clip=2.0))
    # w = min(exp(old - rollout), 2): 3 -> 2, 0.5, 1; and 1 for sequence 1.
    weights = [2.0, 0.5, 1.0, 1.0]
    token_losses = [-1.0, -1.0, -1.0, 2.0]
    assert loss.item() == pytest.approx(sum(w * t for w, t in zip(weights, token_losses)) / 4)
    loss.backward()
    # d/dlogp of w·(-A·exp(logp-old)) at ratio 1 is w·(-A): w is a constant.
    expected_grad = torch.tensor([[-0.5, -0.125, -0.25], [0.5, 0.0, 0.0]])
    assert torch.allclose(batch["logp"].grad, expected_grad)
    assert stats.summary()["tis_weight_mean"] == pytest.approx(sum(weights) / 4)
    assert stats.summary()["tis_clip_frac"] == pytest.approx(1 / 4)


def test_tis_weights_are_detached_and_truncated() -> None:
    old = torch.tensor([0.0, 0.0], requires_grad=True)
    rollout = torch.tensor([-LOG(5.0), LOG(4.0)])
    weights = tis_weights(old, rollout, clip=2.0)
    assert torch.allclose(weights, torch.tensor([2.0, 0.25]))
    assert not weights.requires_grad


def test_modes_differ_only_where_specified() -> None:
    losses = {mode: policy_loss(**_on_policy_batch(), config=_config(mode))[0].item() for mode in ("keep", "mask", "tis")}
    assert losses == {"keep": pytest.approx(-0.25), "mask": pytest.approx(0.5), "tis": pytest.approx(-0.375)}


def test_loss_mask_ignores_staleness_outside_mask_mode() -> None:
    response = torch.tensor([[1, 1, 0]])
    stale = torch.tensor([[True, False, False]])
    assert loss_mask(response, stale, "keep").tolist() == [[1.0, 1.0, 0.0]]
    assert loss_mask(response, stale, "tis").tolist() == [[1.0, 1.0, 0.0]]
    assert loss_mask(response, stale, "mask").tolist() == [[0.0, 1.0, 0.0]]


def test_clip_higher_is_asymmetric() -> None:
    logp = torch.log(torch.tensor([[1.25, 0.7, 0.75]]))
    old = torch.zeros_like(logp)
    positive = torch.tensor([1.0])
    symmetric, clipped_sym = clipped_pg_loss(logp, old, positive, clip_low=0.2, clip_high=0.2)
    higher, clipped_high = clipped_pg_loss(logp, old, positive, clip_low=0.2, clip_high=0.28)
    # ratio 1.25 with A>0: clipped at 1.2 symmetrically, free below 1.28 with clip-higher.
    assert symmetric[0, 0].item() == pytest.approx(-1.2) and clipped_sym[0, 0]
    assert higher[0, 0].item() == pytest.approx(-1.25) and not clipped_high[0, 0]
    # Ratios below 1 with A>0 are never clipped (the min picks the unclipped, smaller objective).
    assert higher[0, 1].item() == pytest.approx(-0.7) and not clipped_high[0, 1]
    negative = torch.tensor([-1.0])
    low, clipped_low = clipped_pg_loss(logp, old, negative, clip_low=0.2, clip_high=0.28)
    # ratio 0.7 with A<0: the lower clip 0.8 binds (loss 0.8, clipped); 0.75 also below 0.8.
    assert low[0, 1].item() == pytest.approx(0.8) and clipped_low[0, 1]
    assert low[0, 0].item() == pytest.approx(1.25) and not clipped_low[0, 0]


def test_token_mean_and_sequence_mean_aggregations() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0], [10.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert aggregate(values, mask, "token_mean").item() == pytest.approx(16 / 4)
    assert aggregate(values, mask, "seq_mean_token_mean").item() == pytest.approx((2 + 10) / 2)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_micro_batches_with_global_denominator_add_up_to_the_full_batch(aggregation: str) -> None:
    batch = _on_policy_batch()
    config = _config("keep", aggregation=aggregation)
    full, _ = policy_loss(**batch, config=config)
    denominator = loss_denominator(batch["response_mask"].float(), config.aggregation)
    parts = [
        policy_loss(**{k: v[i : i + 1] for k, v in batch.items()}, config=config, denominator=denominator)[0]
        for i in range(2)
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item())


def test_k3_kl_and_its_coefficient() -> None:
    logp = torch.tensor([[0.0, LOG(0.5)]])
    ref = torch.tensor([[0.0, 0.0]])
    kl = k3_kl(logp, ref)
    # delta = ref - logp = log 2: exp(log 2) - log 2 - 1 = 1 - log 2.
    assert torch.allclose(kl, torch.tensor([[0.0, 1.0 - LOG(2.0)]]))
    batch = {
        "logp": logp,
        "old_logp": logp.clone(),
        "rollout_logp": logp.clone(),
        "advantages": torch.tensor([0.0]),
        "response_mask": torch.ones(1, 2),
        "stale_mask": torch.zeros(1, 2, dtype=torch.bool),
    }
    loss, stats = policy_loss(**batch, config=_config("keep", kl_coef=0.5), ref_logp=ref)
    assert loss.item() == pytest.approx(0.5 * (1.0 - LOG(2.0)) / 2)
    assert stats.summary()["kl"] == pytest.approx((1.0 - LOG(2.0)) / 2)


def test_entropy_bonus_lowers_the_loss() -> None:
    batch = _on_policy_batch()
    entropy = torch.tensor([[1.0, 1.0, 1.0], [1.0, 5.0, 5.0]])
    base, _ = policy_loss(**batch, config=_config("keep"))
    bonus, stats = policy_loss(**batch, config=_config("keep", entropy_coef=0.1), entropy=entropy)
    assert bonus.item() == pytest.approx(base.item() - 0.1 * 1.0)
    assert stats.summary()["entropy"] == pytest.approx(1.0)  # padding positions are ignored


def test_loss_config_from_spec_picks_clip_higher_and_aggregation() -> None:
    dapo = LossConfig.from_spec(AlgorithmSpec(name="dapo"))
    grpo = LossConfig.from_spec(AlgorithmSpec(name="grpo", off_policy={"mode": "tis", "tis_clip": 3.0}))
    assert (dapo.clip_low, dapo.clip_high, dapo.aggregation) == (0.2, 0.28, "token_mean")
    assert (grpo.clip_high, grpo.aggregation, grpo.off_policy_mode, grpo.tis_clip) == (0.2, "seq_mean_token_mean", "tis", 3.0)


def test_group_advantages_normalise_with_unbiased_std() -> None:
    advantages = group_advantages([1.0, 0.0, 0.0, 0.0])
    # mean 0.25, unbiased std sqrt((0.5625 + 3·0.0625) / 3) = 0.5.
    assert advantages == pytest.approx([1.5, -0.5, -0.5, -0.5], rel=1e-5)
    assert sum(advantages) == pytest.approx(0.0, abs=1e-9)
    assert group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
    assert group_advantages([1.0]) == [0.0]


def test_excluded_samples_leave_group_statistics() -> None:
    advantages = group_advantages([1.0, 0.0, 1.0, 0.0], include=[True, True, False, True])
    # Statistics over [1, 0, 0]: mean 1/3, std sqrt((4/9 + 1/9 + 1/9) / 2) = sqrt(1/3).
    std = math.sqrt(1 / 3)
    assert advantages == pytest.approx([(2 / 3) / std, -(1 / 3) / std, 0.0, -(1 / 3) / std], rel=1e-5)


def test_dynamic_sampling_keeps_only_groups_with_disagreeing_rewards() -> None:
    assert dynamic_sampling_keep([0.0, 1.0, 0.0])
    assert not dynamic_sampling_keep([1.0, 1.0, 1.0])
    assert not dynamic_sampling_keep([0.0, 0.0])
    assert not dynamic_sampling_keep([])


def test_clipped_tokens_get_no_gradient_in_the_clipped_direction() -> None:
    # PPO: for A > 0 the objective stops rewarding r beyond 1 + ε_high, for A < 0 below 1 - ε_low;
    # on the other side of 1 the unclipped branch wins and the gradient stays.
    eps_low, eps_high = 0.2, 0.28
    ratios = torch.tensor([1.5, 1.1, 0.5, 0.5, 0.9, 1.5])
    advantages = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0])
    old_logp = torch.full((6,), -1.0)
    logp = (old_logp + ratios.log()).requires_grad_(True)
    loss, clipped = clipped_pg_loss(logp, old_logp, advantages, eps_low, eps_high)
    loss.sum().backward()
    assert clipped.tolist() == [True, False, False, True, False, False]
    grad = logp.grad
    assert grad is not None
    assert grad[0] == 0.0 and grad[3] == 0.0  # clipped: no push further in the clipped direction
    # d(-A·r)/d logp = -A·r where the unclipped branch wins (inside the band or on the far side).
    for i in (1, 2, 4, 5):
        assert float(grad[i]) == pytest.approx(float(-advantages[i] * ratios[i]), rel=1e-6)


def _three_version_response(current: list[float], advantage: float) -> dict[str, torch.Tensor]:
    """One async response whose three tokens were generated by versions 0, 1 and 2 (interrupted twice by
    a weight sync), trained at policy version 2 in a later PPO mini-batch (so π ≠ π_prox).

    Behaviour probabilities (the engines' log-probs, each of its own version): 0.5, 0.2, 0.4.
    Proximal probabilities (π_prox: the trainer's recomputation at the step's start): 0.25, 0.6, 0.4.
    """
    from rljob.runtime.rollout.staleness import stale_flags

    return {
        "logp": torch.tensor([[LOG(p) for p in current]], requires_grad=True),
        "old_logp": torch.tensor([[LOG(0.25), LOG(0.6), LOG(0.4)]]),
        "rollout_logp": torch.tensor([[LOG(0.5), LOG(0.2), LOG(0.4)]]),
        "advantages": torch.tensor([advantage]),
        "response_mask": torch.tensor([[1, 1, 1]]),
        "stale_mask": torch.tensor([stale_flags([0, 1, 2], 2)]),
    }


def test_decoupled_objective_on_a_response_of_three_versions() -> None:
    # The async strategy's correction (docs/algorithm.md#asynchronous-rollouts): PPO's clip against π_prox,
    # times the truncated behaviour weight w = min(π_prox / π_behav, C), per token, each token's π_behav
    # from the version that generated it.
    batch = _three_version_response([0.3, 0.6, 0.44], advantage=1.0)
    assert batch["stale_mask"].tolist() == [[True, True, False]]
    loss, stats = policy_loss(**batch, config=_config("tis", aggregation="seq_mean_token_mean", tis_clip=2.0,
                                                      clip_low=0.2, clip_high=0.28))
    # w = [0.25/0.5, min(0.6/0.2, 2), 0.4/0.4] = [0.5, 2, 1]; r = π/π_prox = [1.2, 1.0, 1.1], all inside
    # [0.8, 1.28]: token losses -A·r·w = [-0.6, -2.0, -1.1], mean over the sequence's 3 tokens.
    assert loss.item() == pytest.approx((-0.6 - 2.0 - 1.1) / 3)
    loss.backward()
    # d/dlogp of -A·w·exp(logp - log π_prox) = -A·w·r, over 3 tokens.
    assert torch.allclose(batch["logp"].grad, torch.tensor([[-0.6 / 3, -2.0 / 3, -1.1 / 3]]))
    assert stats.summary()["tis_weight_mean"] == pytest.approx((0.5 + 2 + 1) / 3)
    assert stats.summary()["tis_clip_frac"] == pytest.approx(1 / 3)
    assert stats.summary()["off_policy_token_ratio"] == pytest.approx(2 / 3)


def test_decoupled_objective_clips_against_the_proximal_policy_not_the_behaviour_one() -> None:
    # Token 0: r = 0.45/0.25 = 1.8 > 1.28 with A > 0: the clipped branch -A·1.28·w wins, no gradient,
    # although against the behaviour policy (0.45/0.5 = 0.9) it would be inside the clip range.
    batch = _three_version_response([0.45, 0.6, 0.4], advantage=1.0)
    loss, _ = policy_loss(**batch, config=_config("tis", aggregation="seq_mean_token_mean", tis_clip=2.0,
                                                  clip_low=0.2, clip_high=0.28))
    assert loss.item() == pytest.approx((-1.28 * 0.5 - 1.0 * 2.0 - 1.0 * 1.0) / 3)
    loss.backward()
    assert torch.allclose(batch["logp"].grad, torch.tensor([[0.0, -2.0 / 3, -1.0 / 3]]))
    # A < 0 and r = 0.15/0.25 = 0.6 < 0.8 on token 0: the clipped branch (-A·0.8) wins, no gradient.
    batch = _three_version_response([0.15, 0.6, 0.4], advantage=-1.0)
    loss, _ = policy_loss(**batch, config=_config("tis", aggregation="seq_mean_token_mean", tis_clip=2.0,
                                                  clip_low=0.2, clip_high=0.28))
    assert loss.item() == pytest.approx((0.8 * 0.5 + 1.0 * 2.0 + 1.0 * 1.0) / 3)
    loss.backward()
    assert torch.allclose(batch["logp"].grad, torch.tensor([[0.0, 2.0 / 3, 1.0 / 3]]))
