"""The clipped policy-gradient loss with off-policy handling, as pure functions on tensors.

All per-token tensors have shape [batch, response_tokens] and are aligned with the response
(right-padded; `response_mask` marks real tokens).

Loss aggregation (documented choice):
- `dapo` uses the token-level mean over every loss token of the whole step (DAPO paper): long
  responses weigh in proportion to their length, so a long wrong chain is not diluted.
- `grpo` uses the per-sequence mean, then the mean over sequences (GRPO paper): every response
  counts equally whatever its length.
Both take an explicit `denominator` (tokens resp. sequences of the whole step) so gradient
accumulation over micro-batches gives exactly the full-batch loss.

Off-policy modes (tokens whose policy version is older than the current one are "stale"):
- `keep`: every response token is in the loss; the old log-probs are the trainer's own
  recomputation at the start of the step, so the ratio starts at 1 (APRIL paper default) and
  moves from the second PPO mini-batch on.
- `mask`: stale tokens get loss-mask 0 (slime's --mask-offpolicy-in-partial-rollout). Every
  sample's reward still enters the group baseline (the trainer computes advantages over the whole
  group), so a resumed group's fresh straggler keeps a real advantage.
- `tis`: each token's loss is multiplied by w = min(exp(logp_old_train - logp_rollout), C),
  with no gradient through w (truncated importance sampling against the behaviour policy).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

import torch

from rljob.api.spec import AlgorithmSpec

Aggregation = Literal["token_mean", "seq_mean_token_mean"]
OffPolicyMode = Literal["keep", "mask", "tis"]


@dataclass(frozen=True)
class LossConfig:
    """Everything the loss needs from the algorithm spec."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    aggregation: Aggregation = "seq_mean_token_mean"
    off_policy_mode: OffPolicyMode = "keep"
    tis_clip: float = 2.0
    kl_coef: float = 0.0
    entropy_coef: float = 0.0

    @classmethod
    def from_spec(cls, spec: AlgorithmSpec) -> LossConfig:
        return cls(
            clip_low=spec.clip_low,
            clip_high=spec.effective_clip_high,
            aggregation="token_mean" if spec.name == "dapo" else "seq_mean_token_mean",
            off_policy_mode=spec.off_policy.mode,
            tis_clip=spec.off_policy.tis_clip,
            kl_coef=spec.kl_coef,
            entropy_coef=spec.entropy_coef,
        )


def loss_mask(response_mask: torch.Tensor, stale_mask: torch.Tensor, mode: OffPolicyMode) -> torch.Tensor:
    """Float mask of the tokens that enter the loss: all response tokens, minus stale ones under `mask`."""
    mask = response_mask.to(torch.float32)
    if mode == "mask":
        mask = mask * (~stale_mask.bool()).to(torch.float32)
    return mask


def tis_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, clip: float) -> torch.Tensor:
    """Truncated importance weight min(exp(logp_old_train - logp_rollout), C), detached."""
    return torch.exp(old_logp - rollout_logp).clamp(max=clip).detach()


def clipped_pg_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO loss max(-A·r, -A·clip(r, 1-ε_low, 1+ε_high)) and where the clipped branch won.

    With clip_high > clip_low (DAPO clip-higher) a token with positive advantage can raise its
    probability further before the clip stops it, which keeps exploration (entropy) alive.
    """
    adv = advantages if advantages.dim() == logp.dim() else advantages.unsqueeze(-1)
    ratio = torch.exp(logp - old_logp)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(π‖π_ref): exp(ref - logp) - (ref - logp) - 1 (≥ 0, unbiased)."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1.0


def aggregate(values: torch.Tensor, mask: torch.Tensor, aggregation: Aggregation, denominator: float | None = None) -> torch.Tensor:
    """Masked mean of per-token values: over tokens, or per sequence then over sequences.

    denominator: total loss tokens (token_mean) or total sequences with at least one loss token
    (seq_mean_token_mean) of the whole step; defaults to this batch's own count.
    """
    masked = values * mask
    if aggregation == "token_mean":
        total = float(mask.sum().item()) if denominator is None else denominator
        return masked.sum() / max(total, 1.0)
    per_seq_tokens = mask.sum(-1)
    per_seq = masked.sum(-1) / per_seq_tokens.clamp(min=1.0)
    total = float((per_seq_tokens > 0).sum().item()) if denominator is None else denominator
    return per_seq.sum() / max(total, 1.0)


def loss_denominator(mask: torch.Tensor, aggregation: Aggregation) -> float:
    """This batch's contribution to the step's denominator (see aggregate)."""
    if aggregation == "token_mean":
        return float(mask.sum().item())
    return float((mask.sum(-1) > 0).sum().item())


@dataclass
class LossStats:
    """Sums over tokens, so micro-batch results add up; ratios come from `summary()`."""

    response_tokens: float = 0.0
    loss_tokens: float = 0.0
    masked_tokens: float = 0.0
    stale_tokens: float = 0.0
    clipped_tokens: float = 0.0
    approx_kl_sum: float = 0.0
    entropy_sum: float = 0.0
    ref_kl_sum: float = 0.0
    tis_weight_sum: float = 0.0
    tis_clipped_tokens: float = 0.0
    pg_loss: float = 0.0
    kl_loss: float = 0.0
    entropy_loss: float = 0.0
    loss: float = 0.0

    def __add__(self, other: LossStats) -> LossStats:
        return LossStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def summary(self) -> dict[str, float]:
        """Per-token means: clip fraction and approx KL over loss tokens; entropy, TIS, masking over response tokens."""
        loss_tokens = max(self.loss_tokens, 1.0)
        response_tokens = max(self.response_tokens, 1.0)
        return {
            "loss": self.loss,
            "pg_loss": self.pg_loss,
            "kl": self.ref_kl_sum / loss_tokens,
            "entropy": self.entropy_sum / response_tokens,
            "clip_frac": self.clipped_tokens / loss_tokens,
            "approx_kl": self.approx_kl_sum / loss_tokens,
            "tis_weight_mean": self.tis_weight_sum / response_tokens,
            "tis_clip_frac": self.tis_clipped_tokens / response_tokens,
            "masked_token_share": self.masked_tokens / response_tokens,
            "off_policy_token_ratio": self.stale_tokens / response_tokens,
        }


def policy_loss(
    *,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    stale_mask: torch.Tensor,
    config: LossConfig,
    entropy: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    denominator: float | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Total loss = pg (off-policy mode applied) + kl_coef·KL_k3 - entropy_coef·entropy, and its stats.

    `old_logp` is the trainer's recomputation at the start of the step (no grad); `rollout_logp`
    is what the engine reported while sampling. Both must be detached.
    """
    mask = loss_mask(response_mask, stale_mask, config.off_policy_mode)
    pg, clipped = clipped_pg_loss(logp, old_logp, advantages, config.clip_low, config.clip_high)
    response = response_mask.to(torch.float32)
    stats = LossStats(
        response_tokens=float(response.sum().item()),
        loss_tokens=float(mask.sum().item()),
        masked_tokens=float((response - mask).sum().item()),
        stale_tokens=float((response * stale_mask.to(torch.float32)).sum().item()),
        clipped_tokens=float((clipped.to(torch.float32) * mask).sum().item()),
        approx_kl_sum=float((0.5 * (logp - old_logp).detach() ** 2 * mask).sum().item()),
    )
    if config.off_policy_mode == "tis":
        weights = tis_weights(old_logp, rollout_logp, config.tis_clip)
        pg = pg * weights
        stats.tis_weight_sum = float((weights * response).sum().item())
        stats.tis_clipped_tokens = float(((weights >= config.tis_clip).to(torch.float32) * response).sum().item())
    pg_term = aggregate(pg, mask, config.aggregation, denominator)
    total = pg_term
    stats.pg_loss = float(pg_term.item())
    if entropy is not None:
        stats.entropy_sum = float((entropy.detach() * response).sum().item())
        if config.entropy_coef > 0:
            entropy_term = aggregate(entropy, mask, config.aggregation, denominator)
            stats.entropy_loss = float(entropy_term.item())
            total = total - config.entropy_coef * entropy_term
    if ref_logp is not None:
        kl = k3_kl(logp, ref_logp)
        stats.ref_kl_sum = float((kl.detach() * mask).sum().item())
        if config.kl_coef > 0:
            kl_term = aggregate(kl, mask, config.aggregation, denominator)
            stats.kl_loss = float(kl_term.item())
            total = total + config.kl_coef * kl_term
    stats.loss = float(total.item())
    return total, stats
