"""One RL training step on a batch of finished groups: advantages, clipped loss, AdamW.

The rollout loop calls `Trainer.train_step(groups, policy_version)` once per round, where
`policy_version` is the version of the weights the engines hold now (the trainer's current
weights). Tokens whose per-token version is older are off-policy; the algorithm spec decides
whether they are kept, masked, or importance-corrected (see algorithms/losses.py).

Sequences are right-padded, so causal attention never looks at padding and no attention mask
or position ids are needed. The model runs in eval mode (no dropout) so that the log-probs the
loss sees are exactly the ones the old-policy pass computed.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from rljob.operator.api.spec import AlgorithmSpec
from rljob.runtime.algorithms.advantages import group_advantages
from rljob.runtime.algorithms.losses import LossConfig, LossStats, loss_denominator, loss_mask, policy_loss
from rljob.runtime.models.loading import is_checkpointing
from rljob.runtime.models.precision import build_optimizer
from rljob.runtime.rollout.sample import Group, Sample

log = logging.getLogger(__name__)


@dataclass
class TrainMetrics:
    """What one train_step did; ratios are per response token unless named otherwise."""

    policy_version: int
    loss: float
    pg_loss: float
    entropy: float
    kl: float
    approx_kl: float
    clip_frac: float
    grad_norm: float
    tokens: int
    loss_tokens: int
    samples: int
    groups: int
    off_policy_token_ratio: float
    masked_token_share: float
    tis_weight_mean: float
    tis_clip_frac: float
    reward_mean: float
    zero_advantage_groups: int
    optimizer_steps: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _TrainItem:
    """One sample flattened for the trainer."""

    input_ids: list[int]
    prompt_length: int
    rollout_logp: list[float]
    stale: list[bool]
    advantage: float

    @property
    def response_length(self) -> int:
        return len(self.input_ids) - self.prompt_length


@dataclass
class _MicroBatch:
    input_ids: torch.Tensor  # [B, T] prompt + response, right-padded
    positions: torch.Tensor  # [B, R] index of the logit predicting each response token
    targets: torch.Tensor  # [B, R] response token ids
    response_mask: torch.Tensor  # [B, R]
    stale_mask: torch.Tensor  # [B, R]
    rollout_logp: torch.Tensor  # [B, R]
    advantages: torch.Tensor  # [B]
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None


def _check_group(group: Group) -> None:
    for sample in group.samples:
        if not sample.status.finished or sample.reward is None:
            raise ValueError(
                f"train_step got sample {sample.group_id}/{sample.index} with status {sample.status.value} "
                f"and reward {sample.reward}; only finished, rewarded groups can be trained"
            )
        if len(sample.logprobs) != sample.response_length or len(sample.versions) != sample.response_length:
            raise ValueError(
                f"sample {sample.group_id}/{sample.index} has {sample.response_length} response tokens but "
                f"{len(sample.logprobs)} log-probs and {len(sample.versions)} versions"
            )


def _fully_stale(sample: Sample, policy_version: int) -> bool:
    return sample.response_length > 0 and all(v < policy_version for v in sample.versions)


class Trainer:
    """GRPO/DAPO trainer for a Hugging Face causal LM (anything returning `.logits`)."""

    def __init__(
        self,
        model: nn.Module,
        spec: AlgorithmSpec,
        micro_batch_size: int = 16,
        device: str | torch.device = "cpu",
        num_mini_batches: int = 1,
    ) -> None:
        """num_mini_batches > 1 splits each step's samples into that many optimizer updates
        (PPO-style); the old log-probs stay fixed at the step start, so ratios then move and the
        clip becomes active. With 1 the old log-probs equal the current ones (ratio 1)."""
        if micro_batch_size < 1 or num_mini_batches < 1:
            raise ValueError("micro_batch_size and num_mini_batches must be >= 1")
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.spec = spec
        self.config = LossConfig.from_spec(spec)
        self.micro_batch_size = micro_batch_size
        self.num_mini_batches = num_mini_batches
        # bf16 parameters get fp32 master weights and fp32 AdamW state (models/precision.py).
        self.optimizer = build_optimizer(self.model, spec.learning_rate, spec.weight_decay)
        self.ref_model: nn.Module | None = None
        if spec.kl_coef > 0:
            self.ref_model = copy.deepcopy(self.model).eval()
            self.ref_model.requires_grad_(False)
        self.steps_done = 0

    # ------------------------------------------------------------------------------------------
    # batch construction

    def _items(self, groups: list[Group], policy_version: int) -> tuple[list[_TrainItem], int]:
        items: list[_TrainItem] = []
        zero_groups = 0
        masking = self.config.off_policy_mode == "mask"
        for group in groups:
            _check_group(group)
            include = [not (masking and _fully_stale(s, policy_version)) for s in group.samples]
            advantages = group_advantages(group.rewards(), include)
            zero_groups += all(a == 0.0 for a in advantages)
            for sample, advantage in zip(group.samples, advantages):
                if sample.response_length == 0:
                    continue  # nothing to train on; its reward still counted in the group statistics
                items.append(
                    _TrainItem(
                        input_ids=[*sample.prompt_ids, *sample.response_ids],
                        prompt_length=len(sample.prompt_ids),
                        rollout_logp=list(sample.logprobs),
                        stale=[v < policy_version for v in sample.versions],
                        advantage=advantage,
                    )
                )
        return items, zero_groups

    def _collate(self, items: list[_TrainItem]) -> _MicroBatch:
        batch = len(items)
        seq_len = max(len(it.input_ids) for it in items)
        resp_len = max(it.response_length for it in items)
        input_ids = torch.zeros(batch, seq_len, dtype=torch.long)
        positions = torch.zeros(batch, resp_len, dtype=torch.long)
        targets = torch.zeros(batch, resp_len, dtype=torch.long)
        response_mask = torch.zeros(batch, resp_len)
        stale_mask = torch.zeros(batch, resp_len, dtype=torch.bool)
        rollout_logp = torch.zeros(batch, resp_len)
        for row, it in enumerate(items):
            n, p = it.response_length, it.prompt_length
            input_ids[row, : len(it.input_ids)] = torch.tensor(it.input_ids)
            # The logit at position t predicts token t+1.
            positions[row, :n] = torch.arange(p - 1, p - 1 + n)
            targets[row, :n] = torch.tensor(it.input_ids[p:])
            response_mask[row, :n] = 1.0
            stale_mask[row, :n] = torch.tensor(it.stale)
            rollout_logp[row, :n] = torch.tensor(it.rollout_logp)
        dev = self.device
        return _MicroBatch(
            input_ids=input_ids.to(dev),
            positions=positions.to(dev),
            targets=targets.to(dev),
            response_mask=response_mask.to(dev),
            stale_mask=stale_mask.to(dev),
            rollout_logp=rollout_logp.to(dev),
            advantages=torch.tensor([it.advantage for it in items], device=dev),
        )

    def _micro_batches(self, items: list[_TrainItem]) -> list[_MicroBatch]:
        # Similar lengths together: the long tail would otherwise pad every micro-batch.
        ordered = sorted(items, key=lambda it: len(it.input_ids))
        size = self.micro_batch_size
        return [self._collate(ordered[i : i + size]) for i in range(0, len(ordered), size)]

    # ------------------------------------------------------------------------------------------
    # forward passes

    def _response_logits(self, model: nn.Module, mb: _MicroBatch) -> torch.Tensor:
        logits = model(input_ids=mb.input_ids).logits  # [B, T, V]
        index = mb.positions.unsqueeze(-1).expand(-1, -1, logits.size(-1))
        return torch.gather(logits, 1, index).float()  # [B, R, V]

    @staticmethod
    def _token_logp(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = torch.gather(logp_all, -1, targets.unsqueeze(-1)).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logp, entropy

    @torch.no_grad()
    def _fill_reference_logps(self, micro_batches: list[_MicroBatch]) -> None:
        for mb in micro_batches:
            if self.num_mini_batches > 1:
                mb.old_logp = self._token_logp(self._response_logits(self.model, mb), mb.targets)[0]
            if self.ref_model is not None:
                mb.ref_logp = self._token_logp(self._response_logits(self.ref_model, mb), mb.targets)[0]

    # ------------------------------------------------------------------------------------------
    # the step

    def train_step(self, groups: list[Group], policy_version: int) -> TrainMetrics:
        """Train once on finished groups whose tokens carry per-token policy versions."""
        start = time.perf_counter()
        items, zero_groups = self._items(groups, policy_version)
        rewards = [r for g in groups for r in g.rewards()]
        # No dropout: old and current log-probs must agree at ratio 1. Transformers checkpoints layers only
        # in train mode, which equals eval mode for the dropout-free models checkpointing accepts.
        self.model.train(is_checkpointing(self.model))
        micro_batches = self._micro_batches(items) if items else []
        self._fill_reference_logps(micro_batches)

        stats = LossStats()
        grad_norms: list[float] = []
        chunks = max(1, min(self.num_mini_batches, len(micro_batches)))
        per_chunk = -(-len(micro_batches) // chunks) if micro_batches else 0
        for c in range(chunks):
            mini = micro_batches[c * per_chunk : (c + 1) * per_chunk]
            if not mini:
                continue
            denominator = sum(
                loss_denominator(loss_mask(mb.response_mask, mb.stale_mask, self.config.off_policy_mode), self.config.aggregation)
                for mb in mini
            )
            trainable = denominator > 0
            self.optimizer.zero_grad(set_to_none=True)
            for mb in mini:
                with torch.set_grad_enabled(trainable):
                    logits = self._response_logits(self.model, mb)
                    logp, entropy = self._token_logp(logits, mb.targets)
                    # One update per step: the old policy IS the current one, so its log-probs are
                    # this pass's values without grad (saves a forward pass over the batch).
                    old_logp = mb.old_logp if mb.old_logp is not None else logp.detach()
                    loss, mb_stats = policy_loss(
                        logp=logp,
                        old_logp=old_logp,
                        rollout_logp=mb.rollout_logp,
                        advantages=mb.advantages,
                        response_mask=mb.response_mask,
                        stale_mask=mb.stale_mask,
                        config=self.config,
                        entropy=entropy if self.config.entropy_coef > 0 else entropy.detach(),
                        ref_logp=mb.ref_logp,
                        denominator=denominator,
                    )
                    if trainable:
                        loss.backward()
                stats = stats + mb_stats
            if not trainable:
                continue  # every token masked: AdamW must not decay the weights or coast on momentum
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.max_grad_norm)
            grad_norms.append(float(norm))
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_done += 1

        summary = stats.summary()
        # pg_loss/loss are sums of globally-normalised parts: average over the optimizer updates.
        updates = max(len(grad_norms), 1)
        metrics = TrainMetrics(
            policy_version=policy_version,
            loss=summary["loss"] / updates,
            pg_loss=summary["pg_loss"] / updates,
            entropy=summary["entropy"],
            kl=summary["kl"],
            approx_kl=summary["approx_kl"],
            clip_frac=summary["clip_frac"],
            grad_norm=sum(grad_norms) / updates,
            tokens=int(stats.response_tokens),
            loss_tokens=int(stats.loss_tokens),
            samples=len(items),
            groups=len(groups),
            off_policy_token_ratio=summary["off_policy_token_ratio"],
            masked_token_share=summary["masked_token_share"],
            tis_weight_mean=summary["tis_weight_mean"] if self.config.off_policy_mode == "tis" else 1.0,
            tis_clip_frac=summary["tis_clip_frac"],
            reward_mean=sum(rewards) / len(rewards) if rewards else 0.0,
            zero_advantage_groups=zero_groups,
            optimizer_steps=len(grad_norms),
            seconds=time.perf_counter() - start,
        )
        log.debug("train step %d: %s", self.steps_done, metrics)
        return metrics

    # ------------------------------------------------------------------------------------------
    # checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, step counter and, with KL, the reference model."""
        state: dict[str, Any] = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "steps_done": self.steps_done,
        }
        if self.ref_model is not None:
            state["ref_model"] = self.ref_model.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict() saved."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps_done = int(state["steps_done"])
        if self.ref_model is not None and "ref_model" in state:
            self.ref_model.load_state_dict(state["ref_model"])
