"""The rank protocol of a multi-rank job (torchrun, `rljob run --nproc N`; docs/distributed.md).

- rank 0 runs `JobRunner` (runner.py): the rollout scheduler, the engines, the buffer, evaluation,
  status, metrics and the checkpoint's scheduler state. Each step it hands every rank its share of the
  accepted groups (balanced by tokens, `OrderSender.hand_out`) and trains its own share;
- ranks 1..N-1 run `TrainingRank`: they train the groups rank 0 sends them and join every
  collective (FSDP2, the weight gather of a sync, the checkpoint), and do nothing else.

Rank 0's `Order`s keep the ranks in step: resume, train, sync, checkpoint, stop. Every order after
which rank 0 pushes weights (resume, train, sync) has every rank join the gather of the full weights.

SIGTERM (a pod deleted, drained, preempted; torchrun forwards it to every local rank) stops no rank
where it stands: every rank only notes it, and after each train step's weight sync all ranks vote
(`Distributed.any_rank`). When any rank was told to stop, rank 0 checkpoints that step (a checkpoint
order) and sends stop, so the group exits together with no step lost (docs/distributed.md).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from rljob.api.spec import RLJob
from rljob.runtime.checkpoint import rng_state, set_rng_state
from rljob.runtime.job_parts import build_checkpoints, build_trainer, loop_settings, open_policy_for_training
from rljob.runtime.metrics import serve_readiness
from rljob.runtime.rollout.sample import Group
from rljob.runtime.training.backend import TrainingBackend
from rljob.runtime.training.balance import balance_by_tokens
from rljob.runtime.training.distributed import Distributed
from rljob.runtime.weights.buckets import Bucket, CountedBuckets, drain

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@dataclass
class Order:
    """Rank 0's instruction to the other ranks, scattered on the control group (one per rank)."""

    # resume: load `path` (if any) and join the start's weight sync; train: train `groups`, join the sync;
    # sync: join a catch-up sync of the unchanged weights (mid-round); checkpoint; stop.
    kind: Literal["resume", "train", "sync", "checkpoint", "stop"]
    version: int = 0  # train: the policy version the groups were generated against
    step: int = 0  # checkpoint: the step being saved
    groups: list[Group] = field(default_factory=list)  # train: this rank's share
    # resume: the checkpoint directory, whose newest loadable complete checkpoint every rank loads
    # together (CheckpointManager.load); None: start fresh.
    path: str | None = None
    # stop: the group stops before its last step (SIGTERM on some rank), so every rank exits Interrupted.
    interrupted: bool = False


def group_tokens(group: Group) -> int:
    """Prompt plus response tokens of a group: the work it costs a trainer rank."""
    return sum(len(s.prompt_ids) + s.response_length for s in group.samples)


@dataclass
class OrderSender:
    """Rank 0's side of the protocol; sends nothing in a single-process job (`distributed` None)."""

    distributed: Distributed | None

    def send(self, order: Order, shares: list[list[Group]] | None = None) -> None:
        """Send `order` to ranks 1..N-1 (with shares[r] as rank r's groups)."""
        if self.distributed is None:
            return
        world = self.distributed.world_size
        self.distributed.scatter([replace(order, groups=shares[r] if shares else []) for r in range(world)])

    def agree_to_stop(self, stop_requested: bool) -> bool:
        """The step boundary's vote: whether any rank (rank 0 included) got SIGTERM. Every rank votes
        after the weight sync of a train order (TrainingRank.run)."""
        if self.distributed is None:
            return stop_requested
        return self.distributed.any_rank(stop_requested)

    def hand_out(self, groups: list[Group], version: int) -> list[Group]:
        """Send every other rank its token-balanced share of the round's groups; returns rank 0's."""
        if self.distributed is None:
            return groups
        indices = balance_by_tokens([group_tokens(g) for g in groups], self.distributed.world_size)
        shares = [[groups[i] for i in share] for share in indices]
        self.send(Order("train", version=version), shares)
        return shares[0]


class _Pass:
    """One gather pass, safe to pull from two threads: the transport's, and `finish_pass` pulling what
    an abandoned push left of it."""

    def __init__(self, buckets: Iterator[Bucket]) -> None:
        self._buckets = buckets
        self._lock = threading.Lock()

    def __iter__(self) -> Iterator[Bucket]:
        return self

    def __next__(self) -> Bucket:
        with self._lock:
            return next(self._buckets)

    @property
    def remaining(self) -> int | None:
        """The planned buckets not pulled yet (weights/buckets.py's with_last then needs no bucket
        of look-ahead, which a transport would hold beside the one it sends); None when unplanned."""
        return self._buckets.remaining if isinstance(self._buckets, CountedBuckets) else None


@dataclass
class GatheredWeights:
    """Rank 0's weight source in a multi-rank job (a WeightSource: weights/transport.py): each call
    streams the full weights from the FSDP2 shards, one bucket gathered at a time, so rank 0 never
    holds the whole model. Every rank takes part in each gather: the first call of a sync is joined
    through the order that preceded it (resume, train, sync), each later call (a retried sync) sends
    a `sync` order first so the other ranks gather again."""

    backend: TrainingBackend
    bucket_bytes: int
    orders: OrderSender
    calls: int = 0
    current: _Pass | None = None

    def __call__(self, dtype: torch.dtype | None = None) -> Iterator[Bucket]:
        """The buckets of one pass, floating-point tensors gathered in ``dtype`` (None: the trainer's)
        (a collective: pull it to its end)."""
        if self.calls:
            self.orders.send(Order("sync"))
        self.calls += 1
        self.current = _Pass(self.backend.iter_full_weights(self.bucket_bytes, dtype))
        return self.current

    def finish_pass(self) -> None:
        """Complete the pass the other ranks are in, so none is left in a gather: run it when no
        transport took it (a sync that failed before asking for the weights), or pull what is left
        of it when the push was given up mid-way (SIGTERM); a no-op once the pass was pulled to its end."""
        drain(self.current if self.current is not None else self())


class TrainingRank:
    """Ranks 1..N-1 of a multi-rank job: train the groups rank 0 hands out and join every collective
    (FSDP2's, the weight gather of a sync, the checkpoint). No engines, data, metrics or status."""

    def __init__(self, job: RLJob, distributed: Distributed) -> None:
        if distributed.is_leader:
            raise ValueError("rank 0 runs JobRunner, not TrainingRank")
        self.job = job
        self.distributed = distributed
        settings = loop_settings(job, steps=None, resume=None, metrics_port=None)
        self.sync_bucket_bytes = settings.sync_bucket_bytes  # rank 0's (GatheredWeights): the same buckets
        self.checkpoints = build_checkpoints(job, distributed)
        self.trainer = build_trainer(job, open_policy_for_training(job).model, distributed)
        self.steps_trained = 0
        self.stop_requested = False  # SIGTERM noted; rank 0 decides when to stop (at the step boundary)
        # The stop order said the group stopped before its last step (a SIGTERM): exit Interrupted.
        self.interrupted = False
        self.checkpointed_step = 0  # the step of the newest checkpoint this rank wrote its part of
        # Once its part is built, the pod's probe may pass: without an answer, the pods of ranks 1..N-1
        # never turned Ready and the job never left Starting (found on the real node).
        self.probe_port = (serve_readiness(settings.metrics_host, settings.metrics_port)
                           if settings.metrics_port and distributed.env.answers_pod_probe else None)

    def run(self) -> int:
        """Follow rank 0's orders until it says stop; returns the steps trained here."""
        self._note_sigterm()
        while True:
            order: Order = self.distributed.scatter()
            if order.kind == "resume":
                if order.path is not None:
                    self._load_checkpoint()
                self._join_weight_sync()  # every start syncs, resumed or not
            elif order.kind == "sync":
                self._join_weight_sync()
            elif order.kind == "train":
                self.trainer.train_step(order.groups, order.version)
                self.steps_trained += 1
                self._join_weight_sync()
                self.distributed.any_rank(self.stop_requested)  # rank 0 reads the vote and orders the rest
            elif order.kind == "checkpoint":
                self.checkpoints.save(order.step, self.trainer.checkpoint_state(), rng_state())
                self.checkpointed_step = order.step
            elif order.kind == "stop":
                self.interrupted = order.interrupted
                return self.steps_trained

    def _note_sigterm(self) -> None:
        """SIGTERM notes a stop instead of killing this rank: dying at once would fail rank 0's next
        collective and lose the step in flight. Only the main thread may set a handler (tests run ranks
        in threads of their own, which keep the default)."""
        if threading.current_thread() is not threading.main_thread():
            return

        def note(_signum: int, _frame: object) -> None:
            if not self.stop_requested:
                log.warning("rank %d: SIGTERM; finishing the step in flight, then rank 0 checkpoints it and "
                            "stops the group", self.distributed.rank)
            self.stop_requested = True

        signal.signal(signal.SIGTERM, note)

    def _load_checkpoint(self) -> None:
        template = self.trainer.checkpoint_state()
        loaded = self.checkpoints.load(template)  # collective: rank 0 picks, all must load it
        if loaded is not None:
            self.trainer.load_checkpoint_state(template)
            if loaded.rng is not None:
                set_rng_state(loaded.rng)

    def _join_weight_sync(self) -> None:
        for _ in self.trainer.backend.iter_full_weights(self.sync_bucket_bytes):
            pass  # the gathers run; the buckets go to rank 0 only
