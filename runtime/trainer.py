"""One RL training step on a batch of finished groups: advantages, PPO mini-batches, clipped loss, AdamW.

The rollout loop calls `Trainer.train_step(groups, policy_version)` once per round, where
`policy_version` is the version of the weights the engines hold now (the trainer's current
weights). Tokens whose per-token version is older are off-policy; the algorithm spec decides
whether they are kept, masked, or importance-corrected (see algorithms/losses.py).

PPO as published: the round's samples are split into `ppoMiniBatches` mini-batches (a seeded
shuffle, so no mini-batch is all short or all long answers) and each is one optimizer update,
repeated for `ppoEpochs` passes. The old-policy log-probs are those of the weights at the start of
the step, computed once before the first update, so from the second update on the ratio
π/π_old moves and the clip (clipLow/clipHigh) acts. The first mini-batch's own forward pass is the
old policy, so its ratio is exactly 1 and no extra pass is spent on it.

Log-probs are taken at the rollout temperature (softmax(logits / T)), the distribution the
engines sampled from, and only over response positions, in chunks (algorithms/logprobs.py): the
float32 [batch, length, vocab] tensor is never built.

Samples are packed several to a row (training/packing.py), each with its own position ids, from which
a Hugging Face model masks attention per sample: the long tail of answer lengths costs no padding.
Rows are right-padded, so causal attention never looks at padding. A model that is not a Hugging Face
causal LM gets one sample per row and no position ids. The model runs in eval mode (no dropout) so that
the log-probs the loss sees are exactly the ones the old-policy pass computed.

Across ranks (training/backend.py, FSDP2): each rank trains the groups rank 0 handed it. Every
count that normalises or reports the step (loss denominators, samples, rewards, loss statistics,
ratios) is all-reduced, so N ranks take the update one process would take on the whole batch, and
the returned metrics are those of the whole batch on every rank. Mini-batch m of the step is the
union of every rank's local mini-batch m (the same count everywhere), and ranks with fewer
micro-batches run zero-weight padding passes, because every FSDP2 forward and backward is a
collective that all ranks must join.

Why one module of about 550 lines: it is one algorithm step, and its parts (collation into
micro-batches, the old-policy pass, the mini-batch loop, the all-reduced statistics) share the step's
items and normalisers; the losses, log-probs, advantages and the distributed backend already live
apart (algorithms/, training/).
"""

from __future__ import annotations

import copy
import logging
import random
import time
from dataclasses import asdict, astuple, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from rljob.api.spec import AlgorithmSpec
from rljob.runtime.algorithms.advantages import group_advantages
from rljob.runtime.algorithms.logprobs import chunked_logprobs, logprobs_from_logits
from rljob.runtime.algorithms.losses import LossConfig, LossStats, loss_denominator, loss_mask, policy_loss
from rljob.runtime.algorithms.lr_schedule import lr_multiplier
from rljob.runtime.models.loading import is_checkpointing
from rljob.runtime.rollout.sample import Group
from rljob.runtime.rollout.staleness import stale_flags
from rljob.runtime.training.backend import ReferenceModel, TrainingBackend, build_backend, build_reference
from rljob.runtime.training.packing import micro_batch_rows

if TYPE_CHECKING:
    from rljob.runtime.training.distributed import Distributed

log = logging.getLogger(__name__)


@dataclass
class UpdateStats:
    """One optimizer update of a step: which mini-batch, and how far the policy had moved from π_old."""

    epoch: int
    mini_batch: int
    samples: int
    loss_tokens: int
    ratio_min: float  # over loss tokens; exactly 1.0 for the step's first update
    ratio_max: float
    clip_frac: float
    approx_kl: float
    grad_norm: float


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
    learning_rate: float = 0.0
    updates: list[UpdateStats] = field(default_factory=list)

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
    old_logp: torch.Tensor | None = None  # π_old of the step, filled before (or by) the first update
    ref_logp: torch.Tensor | None = None

    @property
    def response_length(self) -> int:
        return len(self.input_ids) - self.prompt_length


@dataclass
class _MicroBatch:
    """Rows of token ids (several samples each when packed) and per-sample [B, R] response tensors."""

    input_ids: torch.Tensor  # [rows, T] samples back to back, each row right-padded
    position_ids: torch.Tensor | None  # [rows, T] each sample's own positions; None: one sample per row
    positions: torch.Tensor  # [B, R] index, in the flattened [rows * T] grid, of the logit predicting each response token
    targets: torch.Tensor  # [B, R] response token ids
    response_mask: torch.Tensor  # [B, R]
    stale_mask: torch.Tensor  # [B, R]
    rollout_logp: torch.Tensor  # [B, R]
    advantages: torch.Tensor  # [B]
    items: list[_TrainItem]
    old_logp: torch.Tensor | None = None  # [B, R]; None while π_old is still this pass's own value
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


def _separable_head(model: nn.Module) -> tuple[nn.Linear | None, nn.Module | None]:
    """(output projection, decoder body) of a Hugging Face causal LM whose logits are exactly
    head(body(ids).last_hidden_state), or (None, None) when the model does more (logit scaling or
    soft-capping) or exposes neither; such a model is run whole (Trainer._token_stats)."""
    get_head = getattr(model, "get_output_embeddings", None)
    get_body = getattr(model, "get_decoder", None)
    if not callable(get_head) or not callable(get_body):
        return None, None
    config = getattr(model, "config", None)
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None) not in (None, 1, 1.0):
        return None, None
    head, body = get_head(), get_body()
    if not isinstance(head, nn.Linear) or body is None or body is model:
        return None, None
    return head, body


def _masks_packed_rows(model: nn.Module) -> bool:
    """Whether `model` builds its attention mask from position ids, so packed samples stay apart: a
    Hugging Face model does (a block-diagonal causal mask, or varlen flash-attention), anything else
    is not assumed to."""
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


class Trainer:
    """GRPO/DAPO trainer with PPO mini-batches for a Hugging Face causal LM (or anything returning `.logits`)."""

    def __init__(
        self,
        model: nn.Module,
        spec: AlgorithmSpec,
        micro_batch_size: int = 16,
        device: str | torch.device = "cpu",
        num_mini_batches: int | None = None,
        *,
        temperature: float = 1.0,
        total_steps: int | None = None,
        logprob_chunk_tokens: int = 1024,
        seed: int = 0,
        distributed: Distributed | None = None,
        pack_sequences: bool = True,
    ) -> None:
        """num_mini_batches overrides spec.ppoMiniBatches (optimizer updates per step and epoch);
        temperature is the rollout temperature the log-probs are taken at; total_steps is the run's
        length, needed by a cosine learning-rate decay; `distributed` (a multi-rank job) trains this
        rank's shard under FSDP2 instead of the whole model in this process; `pack_sequences` puts
        several samples in a row (only for a Hugging Face model, which masks attention by position ids)."""
        mini_batches = spec.ppo_mini_batches if num_mini_batches is None else num_mini_batches
        if micro_batch_size < 1 or mini_batches < 1:
            raise ValueError("micro_batch_size and num_mini_batches must be >= 1")
        if temperature <= 0:
            raise ValueError(f"rollout.temperature must be > 0 for training, got {temperature}")
        if spec.lr_schedule.decay == "cosine" and not total_steps:
            raise ValueError("algorithm.lrSchedule.decay cosine needs trainer.steps (total_steps)")
        self.device = torch.device(device)
        # The frozen reference is copied before the policy moves or is sharded, and is then sharded the
        # same way (a multi-rank job): no rank holds a whole second model.
        self.reference: ReferenceModel | None = None
        if spec.kl_coef > 0:
            self.reference = build_reference(copy.deepcopy(model), self.device, distributed)
        model = model.to(self.device)
        self.spec = spec
        self.config = LossConfig.from_spec(spec)
        self.micro_batch_size = micro_batch_size
        self.num_mini_batches = mini_batches
        self.epochs = spec.ppo_epochs
        self.temperature = temperature
        self.total_steps = total_steps
        self.logprob_chunk_tokens = logprob_chunk_tokens
        self.seed = seed
        self.pack_sequences = pack_sequences and _masks_packed_rows(model)
        if pack_sequences and not self.pack_sequences:
            log.info("%s is not a Hugging Face model: one sample per row, no sequence packing", type(model).__name__)
        self.backend: TrainingBackend = build_backend(model, spec.learning_rate, spec.weight_decay, distributed)
        self.model = self.backend.model
        self.optimizer = self.backend.optimizer
        self.steps_done = 0

    def learning_rate(self, step: int) -> float:
        """The rate of 0-based training step `step` under algorithm.lrSchedule."""
        sched = self.spec.lr_schedule
        return self.spec.learning_rate * lr_multiplier(
            step,
            total_steps=self.total_steps,
            warmup_steps=sched.warmup_steps,
            decay=sched.decay,
            min_ratio=sched.min_lr_ratio,
        )

    # ------------------------------------------------------------------------------------------
    # batch construction

    def _items(self, groups: list[Group], policy_version: int) -> tuple[list[_TrainItem], int]:
        items: list[_TrainItem] = []
        zero_groups = 0
        for group in groups:
            _check_group(group)
            # Every sample's reward is in the baseline, under mask mode too (as slime's
            # --mask-offpolicy-in-partial-rollout): a resumed group whose other samples finished
            # rounds ago still gives its fresh straggler a real advantage; only the loss of stale
            # tokens is masked (losses.loss_mask).
            advantages = group_advantages(group.rewards())
            zero_groups += all(a == 0.0 for a in advantages)
            for sample, advantage in zip(group.samples, advantages):
                if sample.response_length == 0:
                    continue  # nothing to train on; its reward still counted in the group statistics
                items.append(
                    _TrainItem(
                        input_ids=[*sample.prompt_ids, *sample.response_ids],
                        prompt_length=len(sample.prompt_ids),
                        rollout_logp=list(sample.logprobs),
                        stale=stale_flags(sample.versions, policy_version),
                        advantage=advantage,
                    )
                )
        return items, zero_groups

    def _collate(self, rows: list[list[_TrainItem]]) -> _MicroBatch:
        """One micro-batch: `rows` of samples laid back to back, each row right-padded to the longest."""
        items = [it for members in rows for it in members]
        batch = len(items)
        width = max(sum(len(it.input_ids) for it in members) for members in rows)
        resp_len = max(it.response_length for it in items)
        input_ids = torch.zeros(len(rows), width, dtype=torch.long)
        position_ids = torch.zeros(len(rows), width, dtype=torch.long) if self.pack_sequences else None
        # Where each sample starts in the flattened [rows * width] grid.
        starts: list[int] = []
        for r, members in enumerate(rows):
            at = 0
            for it in members:
                n = len(it.input_ids)
                starts.append(r * width + at)
                input_ids[r, at : at + n] = torch.tensor(it.input_ids)
                if position_ids is not None:
                    position_ids[r, at : at + n] = torch.arange(n)  # each sample counts from 0
                at += n
            if position_ids is not None and at < width:
                # The padding goes on counting from the row's last sample: it forms no sample of its own
                # and, coming after it, is never attended to.
                last = len(members[-1].input_ids)
                position_ids[r, at:] = torch.arange(last, last + width - at)
        positions = torch.zeros(batch, resp_len, dtype=torch.long)
        targets = torch.zeros(batch, resp_len, dtype=torch.long)
        response_mask = torch.zeros(batch, resp_len)
        stale_mask = torch.zeros(batch, resp_len, dtype=torch.bool)
        rollout_logp = torch.zeros(batch, resp_len)
        have_old = all(it.old_logp is not None for it in items)
        have_ref = all(it.ref_logp is not None for it in items)
        # In the dtype the log-probs were computed in (float64 models keep every digit).
        old_logp = torch.zeros(batch, resp_len, dtype=items[0].old_logp.dtype) if have_old else None  # type: ignore[union-attr]
        ref_logp = torch.zeros(batch, resp_len, dtype=items[0].ref_logp.dtype) if have_ref else None  # type: ignore[union-attr]
        for b, (it, start) in enumerate(zip(items, starts)):
            n, p = it.response_length, it.prompt_length
            # The logit at position t predicts token t+1.
            positions[b, :n] = torch.arange(start + p - 1, start + p - 1 + n)
            targets[b, :n] = torch.tensor(it.input_ids[p:])
            response_mask[b, :n] = 1.0
            stale_mask[b, :n] = torch.tensor(it.stale)
            rollout_logp[b, :n] = torch.tensor(it.rollout_logp)
            if old_logp is not None:
                old_logp[b, :n] = it.old_logp  # type: ignore[assignment]  # have_old: all are set
            if ref_logp is not None:
                ref_logp[b, :n] = it.ref_logp  # type: ignore[assignment]  # have_ref: all are set
        dev = self.device
        return _MicroBatch(
            input_ids=input_ids.to(dev),
            position_ids=position_ids.to(dev) if position_ids is not None else None,
            positions=positions.to(dev),
            targets=targets.to(dev),
            response_mask=response_mask.to(dev),
            stale_mask=stale_mask.to(dev),
            rollout_logp=rollout_logp.to(dev),
            advantages=torch.tensor([it.advantage for it in items], device=dev),
            items=items,
            old_logp=old_logp.to(dev) if old_logp is not None else None,
            ref_logp=ref_logp.to(dev) if ref_logp is not None else None,
        )

    def _micro_batches(self, items: list[_TrainItem]) -> list[_MicroBatch]:
        """`items` in micro-batches of `micro_batch_size` rows (packed or one sample each:
        packing.micro_batch_rows), padded with zero-weight batches to the most any rank has (collective)."""
        layout = micro_batch_rows([len(it.input_ids) for it in items], self.micro_batch_size, self.pack_sequences)
        batches = [self._collate([[items[i] for i in row] for row in rows]) for rows in layout]
        most = int(self.backend.all_reduce([len(batches)], "max")[0])
        return batches + [self._padding_batch() for _ in range(most - len(batches))]

    def _padding_batch(self) -> _MicroBatch:
        """A two-token batch for a rank with fewer micro-batches than the others: its forward and a
        zero-weighted backward join the collectives and change nothing. Recognised by its empty
        `items`; never part of a loss denominator or a statistic."""
        dev = self.device
        return _MicroBatch(
            input_ids=torch.zeros(1, 2, dtype=torch.long, device=dev),
            position_ids=None,
            positions=torch.zeros(1, 1, dtype=torch.long, device=dev),
            targets=torch.zeros(1, 1, dtype=torch.long, device=dev),
            response_mask=torch.ones(1, 1, device=dev),  # one position, so the forward reaches every weight
            stale_mask=torch.zeros(1, 1, dtype=torch.bool, device=dev),
            rollout_logp=torch.zeros(1, 1, device=dev),
            advantages=torch.zeros(1, device=dev),
            items=[],
        )

    def _mini_batches(self, items: list[_TrainItem], epoch: int, count: int) -> list[list[_TrainItem]]:
        """This epoch's split of this rank's samples into `count` optimizer updates (seeded shuffle);
        with fewer samples than `count` the last ones are empty (other ranks fill them)."""
        order = list(range(len(items)))
        random.Random(f"{self.seed}:{self.steps_done}:{epoch}").shuffle(order)
        # Near-equal sizes: the first len % count mini-batches get one sample more.
        base, extra = divmod(len(items), count)
        minis, at = [], 0
        for m in range(count):
            size = base + (1 if m < extra else 0)
            minis.append([items[i] for i in order[at : at + size]])
            at += size
        return minis

    # ------------------------------------------------------------------------------------------
    # forward passes

    def _token_stats(self, model: nn.Module, mb: _MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-prob, entropy) [B, R] of the response tokens at the rollout temperature; 0 on padding."""
        mask = mb.response_mask.bool()
        targets = mb.targets[mask]
        at = mb.positions[mask]  # [N]: response positions only, in the flattened grid
        inputs: dict[str, Any] = {"input_ids": mb.input_ids}
        if mb.position_ids is not None:
            # A Hugging Face model reads packed samples from the position ids only without a KV cache
            # (which it would otherwise open, in eval mode, and then mask causally across samples).
            inputs.update(position_ids=mb.position_ids, use_cache=False)
        head, body = _separable_head(model)
        if head is not None and body is not None:
            hidden = body(**inputs).last_hidden_state  # [rows, T, H]
            response_hidden = hidden.flatten(0, 1)[at]  # [N, H]
            logp, entropy = chunked_logprobs(
                response_hidden,
                head.weight,
                targets,
                bias=head.bias,
                temperature=self.temperature,
                chunk_tokens=self.logprob_chunk_tokens,
            )
        else:  # a model whose head cannot be separated: its own logits, reduced in chunks
            logits = model(**inputs).logits
            logp, entropy = logprobs_from_logits(
                logits.flatten(0, 1)[at], targets, temperature=self.temperature,
                chunk_tokens=self.logprob_chunk_tokens,
            )
        zeros = torch.zeros(mask.shape, dtype=logp.dtype, device=logp.device)
        return zeros.masked_scatter(mask, logp), zeros.masked_scatter(mask, entropy)

    @torch.no_grad()
    def _fill_logps(self, items: list[_TrainItem], *, old: bool) -> None:
        """Old-policy (and reference-model) log-probs of `items`, before any update of the step."""
        for mb in self._micro_batches(items):
            lengths = [it.response_length for it in mb.items]
            if old:
                logp = self.backend.forward(self._token_stats, mb)[0]
                for row, (it, n) in enumerate(zip(mb.items, lengths)):
                    it.old_logp = logp[row, :n].cpu()
            if self.reference is not None:  # a padding batch too: a sharded reference's forward is collective
                ref = self.reference.forward(self._token_stats, mb)[0]
                for row, (it, n) in enumerate(zip(mb.items, lengths)):
                    it.ref_logp = ref[row, :n].cpu()

    # ------------------------------------------------------------------------------------------
    # the step

    def train_step(self, groups: list[Group], policy_version: int) -> TrainMetrics:
        """Train on finished groups whose tokens carry per-token policy versions: ppoEpochs passes of
        ppoMiniBatches optimizer updates, all against the log-probs of the step-start policy."""
        start = time.perf_counter()
        items, zero_groups = self._items(groups, policy_version)
        rewards = [r for g in groups for r in g.rewards()]
        # The whole step's counts (this rank holds only its share of the groups).
        totals = self.backend.all_reduce([len(items), len(groups), zero_groups, sum(rewards), len(rewards)])
        n_items, n_groups, zero_groups, n_rewards = (int(totals[i]) for i in (0, 1, 2, 4))
        reward_sum = totals[3]
        # No dropout: old and current log-probs must agree at ratio 1. Transformers checkpoints layers only
        # in train mode, which equals eval mode for the dropout-free models checkpointing accepts.
        self.model.train(is_checkpointing(self.model))
        lr = self.learning_rate(self.steps_done)
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = lr

        count = max(1, min(self.num_mini_batches, n_items))
        schedule = [self._mini_batches(items, epoch, count) for epoch in range(self.epochs)] if n_items else []
        # π_old for every sample the first update does not see, computed before that update; the
        # first update's own forward pass provides the rest (same weights, ratio exactly 1).
        first = {id(it) for it in schedule[0][0]} if schedule else set()
        later = [it for it in items if id(it) not in first]
        if schedule:
            self._fill_logps(later, old=True)
        if self.reference is not None and schedule:
            self._fill_logps([it for it in items if id(it) in first], old=False)

        # Token statistics (entropy, counts, off-policy shares) are those of the first pass, where
        # every sample is seen once; loss, clip and KL figures cover every update.
        stats = LossStats()
        all_stats = LossStats()
        updates: list[UpdateStats] = []
        for epoch, minis in enumerate(schedule):
            for index, mini in enumerate(minis):
                update = self._update(mini, epoch, index)
                if update is not None:
                    all_stats = all_stats + update[0]
                    if epoch == 0:
                        stats = stats + update[0]
                    updates.append(update[1])
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_done += 1

        summary = stats.summary()
        trained = [u for u in updates if u.grad_norm >= 0]
        n_updates = max(len(trained), 1)
        loss_tokens = max(sum(u.loss_tokens for u in updates), 1)
        metrics = TrainMetrics(
            policy_version=policy_version,
            # pg_loss/loss are sums of per-update, globally-normalised parts: mean over updates.
            loss=all_stats.loss / max(len(updates), 1),
            pg_loss=all_stats.pg_loss / max(len(updates), 1),
            entropy=summary["entropy"],
            kl=summary["kl"],
            # Over every update: how far the policy moved from π_old and how often the clip acted.
            approx_kl=sum(u.approx_kl * u.loss_tokens for u in updates) / loss_tokens,
            clip_frac=sum(u.clip_frac * u.loss_tokens for u in updates) / loss_tokens,
            grad_norm=sum(u.grad_norm for u in trained) / n_updates,
            tokens=int(stats.response_tokens),
            loss_tokens=int(stats.loss_tokens),
            samples=n_items,
            groups=n_groups,
            off_policy_token_ratio=summary["off_policy_token_ratio"],
            masked_token_share=summary["masked_token_share"],
            tis_weight_mean=summary["tis_weight_mean"] if self.config.off_policy_mode == "tis" else 1.0,
            tis_clip_frac=summary["tis_clip_frac"],
            reward_mean=reward_sum / n_rewards if n_rewards else 0.0,
            zero_advantage_groups=zero_groups,
            optimizer_steps=len(trained),
            seconds=time.perf_counter() - start,
            learning_rate=lr,
            updates=updates,
        )
        log.debug("train step %d: %s", self.steps_done, metrics)
        return metrics

    def _update(self, mini: list[_TrainItem], epoch: int, index: int) -> tuple[LossStats, UpdateStats] | None:
        """One optimizer update on one mini-batch (gradient accumulated over its micro-batches).

        Returns None for a mini-batch empty on every rank; an all-masked one is not stepped (grad_norm
        -1): AdamW must not decay the weights or coast on momentum without a gradient. The loss
        denominator, the statistics and the ratio range are those of the mini-batch over all ranks.
        """
        micro_batches = self._micro_batches(mini)
        if not micro_batches:
            return None
        mode, aggregation = self.config.off_policy_mode, self.config.aggregation
        local_denominator = sum(
            loss_denominator(loss_mask(mb.response_mask, mb.stale_mask, mode), aggregation)
            for mb in micro_batches if mb.items
        )
        denominator = self.backend.all_reduce([local_denominator])[0]
        trainable = denominator > 0
        self.optimizer.zero_grad(set_to_none=True)
        stats = LossStats()
        ratio_min, ratio_max = float("inf"), float("-inf")
        for mb in micro_batches:
            if not mb.items:  # padding: join the collectives of the forward and backward, add nothing
                with torch.set_grad_enabled(trainable):
                    logp, entropy = self.backend.forward(self._token_stats, mb)
                    if trainable:
                        ((logp.sum() + entropy.sum()) * 0.0).backward()
                continue
            with torch.set_grad_enabled(trainable):
                logp, entropy = self.backend.forward(self._token_stats, mb)
                old_logp = mb.old_logp
                if old_logp is None:
                    # The step's first update: these weights ARE π_old. Keep the values for the
                    # later epochs and for TIS, which weighs rollout against π_old.
                    old_logp = logp.detach()
                    for row, it in enumerate(mb.items):
                        it.old_logp = old_logp[row, : it.response_length].cpu()
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
            in_loss = loss_mask(mb.response_mask, mb.stale_mask, mode).bool()
            if bool(in_loss.any()):
                ratio = torch.exp(logp.detach() - old_logp)[in_loss]
                ratio_min, ratio_max = min(ratio_min, float(ratio.min())), max(ratio_max, float(ratio.max()))
            stats = stats + mb_stats
        grad_norm = -1.0
        if trainable:
            grad_norm = self.backend.clip_grad_norm(self.spec.max_grad_norm)
            self.optimizer.step()
        *sums, samples = self.backend.all_reduce([*astuple(stats), len(mini)])
        stats = LossStats(*sums)
        neg_min, ratio_max = self.backend.all_reduce([-ratio_min, ratio_max], "max")
        ratio_min = -neg_min
        summary = stats.summary()
        no_tokens = ratio_min == float("inf")
        return stats, UpdateStats(
            epoch=epoch,
            mini_batch=index,
            samples=int(samples),
            loss_tokens=int(stats.loss_tokens),
            ratio_min=1.0 if no_tokens else ratio_min,
            ratio_max=1.0 if no_tokens else ratio_max,
            clip_frac=summary["clip_frac"],
            approx_kl=summary["approx_kl"],
            grad_norm=grad_norm,
        )

    # ------------------------------------------------------------------------------------------
    # checkpoints

    def checkpoint_state(self) -> dict[str, Any]:
        """Model and optimizer (this rank's shards under FSDP2), step counter and, with KL, the
        reference model, laid out for torch.distributed.checkpoint (runtime/checkpoint.py); also the
        template a load fills in place."""
        state: dict[str, Any] = {**self.backend.checkpoint_state(), "steps_done": torch.tensor(self.steps_done)}
        if self.reference is not None:
            state["ref_model"] = self.reference.model.state_dict()
        return state

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Restore what checkpoint_state() saved (after torch.distributed.checkpoint filled it)."""
        self.backend.load_checkpoint_state(state)
        self.steps_done = int(state["steps_done"])
        if self.reference is not None and "ref_model" in state:
            self.reference.model.load_state_dict(state["ref_model"])
