"""``distributed`` mode: SGLang's weight-update group, bucketed broadcasts from trainer rank 0.

Per sync (sglang_protocol.md §8, distributed_training.md):
1. probe every worker and read its ``/get_server_info`` (``tp_size``, ``dp_size``: group_layout.py);
   (re)build the group when its layout changed, a member was restarted (it no longer serves the
   version this transport last gave it) or the previous sync broke the group:
   ``/init_weights_update_group`` on every worker (``rank_offset`` = 1 + the TP sizes before it,
   ``world_size`` = 1 + all of them) while rank 0 forms it here (runtime/weight_group.py: SGLang's layout);
2. ``/pause_generation`` (in place: the round has already aborted and drained everything);
3. per bucket, ``/update_weights_from_distributed`` with names, dtypes and shapes to every member
   while rank 0 broadcasts the tensors (one flattened buffer when every member takes that:
   weight_group.py); the cache is flushed and ``weight_version`` set with the last
   bucket only, so a worker that misses any bucket keeps its old version and leaves the rotation.
   Rank 0 pulls (gathers) and builds bucket k+1 while bucket k is broadcast.
   Over gloo, where rank 0's broadcast proves every worker has started the bucket, the next bucket's
   call goes without waiting for this one's replies (``_ahead_of_replies``); the last one still waits;
4. ``/continue_generation``; every worker's served version decides the rotation (SGLangEngine).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rljob.runtime.engines.base import EngineError, WeightTargets
from rljob.runtime.engines.protocol import (
    Call,
    continue_generation_call,
    destroy_weights_update_group_call,
    init_weights_update_group_call,
    pause_generation_call,
    update_weights_from_distributed_call,
)
from rljob.runtime.weight_group import (
    FLATTENED_BUCKET,
    Backend,
    WeightGroup,
    byte_offsets,
    create_group,
    dtype_name,
    lying_flat,
    open_store,
    takes_flattened_buckets,
)
from rljob.runtime.weights.buckets import Bucket, drain, with_last
from rljob.runtime.weights.group_layout import RankLayout, rank_layout, server_shape
from rljob.runtime.weights.transport import SyncReport, WeightSource, WeightTransport
from rljob.runtime.weights.wire_dtype import as_wire, common_dtype, served_dtype, wire_bytes, wire_dtype_of

log = logging.getLogger(__name__)


@dataclass
class DistributedOptions:
    """Where rank 0 hosts the group and how long its collectives may take."""

    master_address: str | None = None  # None: see address()
    master_port: int = 0  # 0: a free port per rebuild
    backend: Backend = "gloo"
    timeout_s: float = 300.0
    flush_cache: bool = True  # False: the workers keep their KV cache across the update (WeightUpdate)

    def address(self) -> str:
        """The address engines dial to reach rank 0's store: the spec's, the pod's IP (POD_IP, set
        through the downward API), else what this host's name resolves to (a pod's IP too)."""
        if self.master_address or os.environ.get("POD_IP"):
            return self.master_address or os.environ["POD_IP"]
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"


def flatten(bucket: Bucket, dtype: torch.dtype | None, device: torch.device,
            scratch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The bucket's tensors (every name, in order, as the members list them), floating-point ones in
    ``dtype`` (wire_dtype.py), as one uint8 buffer on ``device`` (weight_group.py's flattened bucket),
    and the scratch buffer to flatten the next bucket into; None when that layout would be unaligned
    (sent tensor by tensor then).

    A bucket that already lies flat (a sharded trainer gathers each bucket so: training/fsdp.py) is
    its own buffer, with no copy, and leaves ``scratch`` as it is. Otherwise each tensor is cast and
    moved in one copy into the front of ``scratch`` when that is large enough (a sync flattens its
    buckets into two such buffers in turn, each growing to the largest bucket it takes: no allocation,
    and no page faults, per bucket), else into a new buffer, which becomes the scratch."""
    wire = [wire_dtype_of(t, dtype) for _, t in bucket]
    if (laid := lying_flat([t for _, t in bucket], wire, device)) is not None:
        return laid, scratch
    offsets = byte_offsets(wire, [t.shape for _, t in bucket])
    if offsets is None or not bucket:
        return None
    if scratch is None or scratch.device != device or scratch.numel() < offsets[-1]:
        scratch = torch.empty(offsets[-1], dtype=torch.uint8, device=device)
    buffer = scratch[: offsets[-1]]
    for (_, tensor), wire_dtype, start, end in zip(bucket, wire, offsets, offsets[1:], strict=False):
        buffer[start:end].view(wire_dtype).view(tensor.shape).copy_(tensor.detach())
    return buffer, scratch


@dataclass
class _Prepared:
    """One bucket as rank 0 sends it: the call's lists and the payload."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    nbytes: int
    payload: list[torch.Tensor]
    load_format: str | None
    last: bool


def departed_members(members: Sequence[str], known: set[str]) -> list[str]:
    """Members of the weight-update group that no engine knows any more (discovery dropped them: their
    pod is gone). One such member makes the group useless: a broadcast completes only with every rank."""
    return [u for u in members if u not in known]


def _post(call: Call) -> tuple[str, dict[str, Any]]:
    """(path, body) of a worker POST built by protocol.py, for WeightTargets.post."""
    return call.path, call.body or {}


class DistributedTransport(WeightTransport):
    """Trainer rank 0's side of the weight-update group over every member of ``engines`` (the
    WeightTargets of engines/base.py: SGLang engines, each a set of workers)."""

    mode = "distributed"

    def __init__(self, engines: Sequence[WeightTargets], options: DistributedOptions) -> None:
        self.engines = list(engines)
        self.options = options
        self._group: WeightGroup | None = None
        self._members: list[str] = []  # worker URLs in rank order
        self._layout: RankLayout | None = None  # the group's ranks, as formed
        self._given: dict[str, int | None] = {}  # version each member served after the last sync
        self._wire: torch.dtype | None = None  # the dtype the members serve (None: the trainer's)
        self._flatten = False  # every member takes a bucket as one broadcast (weight_group.py)
        self._generation = itertools.count(1)
        # Group names are registered process-wide by torch: unique per transport, new per rebuild.
        self._token = uuid.uuid4().hex[:8]

    def _owner(self, url: str) -> WeightTargets:
        for engine in self.engines:
            if url in engine.members():
                return engine
        raise KeyError(f"no engine knows SGLang worker {url}")

    def _reachable(self, url: str) -> bool:
        """Whether an engine still knows ``url`` and its last call or probe got an answer."""
        return any(url in e.members() and e.members()[url].reachable for e in self.engines)

    def _needs_rebuild(self, layout: RankLayout) -> bool:
        if self._group is None or layout != self._layout:
            return True
        return any(self._owner(u).members()[u].served_version != self._given.get(u) for u in layout.offsets)

    async def _layout_of(self, candidates: list[str]) -> tuple[RankLayout, dict[str, str]]:
        """The group's layout over the candidates whose server info places them (TP sizes, in order),
        and why each of the others cannot join. Sets the dtype the members serve (wire_dtype.py)."""
        async def shape(url: str) -> tuple[int, torch.dtype | None, bool] | str:
            try:
                info = await self._owner(url).member_info(url)
                release = info.get("version")
                return (server_shape(info).tp_size, served_dtype(info),
                        takes_flattened_buckets(str(release) if release is not None else None))
            except (EngineError, ValueError) as exc:
                return f"cannot join the weight-update group: {exc}"

        shapes = await asyncio.gather(*(shape(u) for u in candidates))
        refused = {u: s for u, s in zip(candidates, shapes, strict=True) if isinstance(s, str)}
        for url, reason in refused.items():
            log.error("SGLang worker %s %s", url, reason)
        placed = [(u, s) for u, s in zip(candidates, shapes, strict=True) if not isinstance(s, str)]
        self._wire = common_dtype(dtype for _, (_, dtype, _) in placed)
        # One broadcast reaches every member: a bucket is flattened only when all of them take it so.
        self._flatten = bool(placed) and all(flat for _, (_, _, flat) in placed)
        return rank_layout([(u, tp) for u, (tp, _, _) in placed]), refused

    async def _rebuild(self, layout: RankLayout, report: SyncReport) -> list[str]:
        """A new group over the layout's workers; returns the members that joined (all or none here)."""
        await self._destroy()
        candidates = list(layout.offsets)
        host = self.options.address()
        name = f"rljob-weights-{self._token}-{next(self._generation)}"
        world = layout.world_size
        timeout = self.options.timeout_s
        store = await asyncio.to_thread(open_store, host, self.options.master_port, world, timeout)
        port = store.port
        rank0 = asyncio.create_task(asyncio.to_thread(create_group, store, name, world, self.options.backend, timeout))
        joins = [
            self._post_one(url, init_weights_update_group_call(
                host, port, layout.offsets[url], world, name, self.options.backend), timeout)
            for url in candidates
        ]
        errors = await asyncio.gather(*joins)
        try:
            self._group = await rank0
        except RuntimeError as exc:
            for url in candidates:
                report.failed.setdefault(url, f"weight-update group {name} not formed: {exc}")
            return []
        failed = {u: e for u, e in zip(candidates, errors, strict=True) if e}
        if failed:  # cannot happen once rank 0 formed the group, but never trust a reply blindly
            report.failed.update(failed)
            await self._destroy()
            return []
        self._members = candidates
        self._layout = layout
        report.group_rebuilt = True
        log.info("weight-update group %s formed: trainer rank 0 + %d engine ranks over %d workers (%s:%d, %s); "
                 "each bucket's call %s", name, world - 1, len(candidates), host, port, self.options.backend,
                 "goes while the workers load the one before" if self._ahead_of_replies() else
                 "waits for the previous bucket's replies")
        return self._members

    async def _post_one(self, url: str, call: Call, timeout: float) -> str | None:
        """One control POST to one member: None when done, else why it failed."""
        return (await self._owner(url).post([url], *_post(call), timeout=timeout))[url]

    async def _destroy(self) -> None:
        if self._group is not None:
            name = self._group.group_name
            for url in self._members:
                if self._reachable(url):
                    await self._post_one(url, destroy_weights_update_group_call(name), 10)
            self._group.close()
            self._group = None
        self._members = []
        self._layout = None

    def _ahead_of_replies(self) -> bool:
        """Whether bucket k+1's call may go before bucket k's replies have come: over gloo, when rank 0
        sends to each member itself (group_layout.py). Rank 0's broadcast completing then shows that every
        member is inside bucket k's update, so bucket k+1's call queues behind it at the member (SGLang
        runs one update at a time, in arrival order) and is built and sent while the members load bucket
        k into their models. Otherwise (a member reached through another, or NCCL, whose root may finish
        a small broadcast before a member has started receiving) each bucket's replies come first."""
        return self.options.backend == "gloo" and self._layout is not None and self._layout.rank0_reaches_every_worker()

    def _payload(self, bucket: Bucket, scratch: torch.Tensor | None
                 ) -> tuple[list[torch.Tensor], str | None, torch.Tensor | None]:
        """What rank 0 broadcasts for one bucket, the load format that tells the members, and the scratch
        buffer for the buckets after it: one flat buffer (the bucket itself when it lies flat, else in
        ``scratch``, whose previous bucket's broadcast has completed) when they all take
        ``flattened_bucket`` and its layout is aligned, else each tensor, both in the wire dtype on the
        group's device."""
        assert self._group is not None
        if self._flatten and (flat := flatten(bucket, self._wire, self._group.device, scratch)) is not None:
            buffer, scratch = flat
            return [buffer], FLATTENED_BUCKET, scratch
        return [as_wire(t.detach(), self._wire).to(self._group.device).contiguous() for _, t in bucket], None, scratch

    def _broadcast(self, payload: list[torch.Tensor]) -> None:
        assert self._group is not None
        self._group.broadcast_all(payload)  # posted together, then waited on, as the members receive them

    async def sync(self, version: int, weights: WeightSource) -> SyncReport:
        """See the module docstring; never raises for a worker's failure."""
        async with contextlib.AsyncExitStack() as stack:
            for engine in self.engines:
                await stack.enter_async_context(engine.syncing())
            return await self._sync(version, weights)

    async def _sync(self, version: int, weights: WeightSource) -> SyncReport:
        started = time.perf_counter()
        report = SyncReport(version=version, mode=self.mode)
        for engine in self.engines:
            await engine.refresh_members()  # replicas added by scaling join the group
        gone = departed_members(self._members, {u for e in self.engines for u in e.members()})
        if gone:
            # Pushing to it would fail (found on the real node: a force-deleted engine pod crashed rank 0
            # here, looking up the departed member); the survivors get a new group below.
            log.warning("weight-update group members %s left discovery; the group is dropped", gone)
            await self._destroy()
        candidates = [u for e in self.engines for u, member in e.members().items() if member.reachable]
        layout, refused = await self._layout_of(candidates)
        members = self._members
        if layout.offsets and self._needs_rebuild(layout):
            members = await self._rebuild(layout, report)
        replies: dict[str, str | None] = {u: refused.get(u, "no weight-update group") for u in candidates}
        if members:
            replies = await self._push(version, weights, members, report)
        else:
            await asyncio.to_thread(lambda: drain(weights(self._wire)))
        for engine in self.engines:
            result = await engine.commit(version, {u: r for u, r in replies.items() if u in engine.members()})
            report.updated += result.updated
            for url, reason in result.failed.items():
                report.failed.setdefault(url, reason)
        for url in self._members:
            if any(url in e.members() for e in self.engines):
                self._given[url] = self._owner(url).members()[url].served_version
        report.seconds = time.perf_counter() - started
        return report

    def _prepare(self, buckets: Iterator[tuple[Bucket, bool]], scratches: list[torch.Tensor | None],
                 index: int) -> _Prepared | None:
        """Pull the next bucket (with a sharded trainer, pulling it runs the gathers) and build what rank
        0 broadcasts for it, flattened into ``scratches[index]`` where it does not lie flat (which then
        holds the buffer the bucket went into); None after the last."""
        item = next(buckets, None)
        if item is None:
            return None
        bucket, last = item
        nbytes = wire_bytes(bucket, self._wire)
        # Taken out of the list, so that one too small for this bucket is freed before a larger one is made.
        scratch, scratches[index] = scratches[index], None
        if scratch is not None and scratch.numel() < nbytes:
            scratch = None
        payload, load_format, scratches[index] = self._payload(bucket, scratch)
        return _Prepared(names=[n for n, _ in bucket], dtypes=[dtype_name(wire_dtype_of(t, self._wire)) for _, t in bucket],
                         shapes=[list(t.shape) for _, t in bucket], nbytes=nbytes, payload=payload,
                         load_format=load_format, last=last)

    async def _push(self, version: int, weights: WeightSource, members: list[str],
                    report: SyncReport) -> dict[str, str | None]:
        replies: dict[str, str | None] = dict.fromkeys(members)
        await self._all(members, *_post(pause_generation_call()))
        # Gathered in the wire dtype where the source gathers (half the bytes of fp32 masters for bf16
        # engines); made in a thread, since making a sharded trainer's source is a collective.
        buckets = with_last(await asyncio.to_thread(weights, self._wire))
        # Each bucket is pulled and its payload built in a thread (with a sharded trainer, pulling it
        # runs the gathers; a trainer that holds the model flattens it), the next one while this one is
        # broadcast (see below), so the gathers and copies overlap the broadcasts and the workers' loads
        # instead of adding to them. Buckets are flattened into two scratch buffers in turn: the one
        # being broadcast and the one being filled (each grows to the largest bucket it takes).
        scratches: list[torch.Tensor | None] = [None, None]
        ahead = asyncio.create_task(asyncio.to_thread(self._prepare, buckets, scratches, 0))
        ahead_of_replies = self._ahead_of_replies()
        unanswered: asyncio.Task[dict[str, str | None]] | None = None  # the previous bucket's replies
        posts: asyncio.Task[dict[str, str | None]] | None = None
        sent: asyncio.Task[None] | None = None
        try:
            for turn in itertools.count():
                if (prepared := await ahead) is None:
                    break
                if prepared.last and unanswered is not None:
                    # The version comes with the last bucket: only to members that took every one before.
                    self._answered(await unanswered, replies)
                    unanswered = None
                call = update_weights_from_distributed_call(
                    prepared.names, prepared.dtypes, prepared.shapes, self._group.group_name if self._group else "",
                    version if prepared.last else None, self.options.flush_cache, prepared.load_format)
                posts = asyncio.create_task(self._all(members, *_post(call)))
                sent = asyncio.create_task(asyncio.to_thread(self._broadcast, prepared.payload))
                try:
                    if unanswered is not None:
                        self._answered(await unanswered, replies)
                        unanswered = None
                finally:
                    # The next bucket is pulled (with a sharded trainer: gathered) and built into the other
                    # scratch buffer while this one is broadcast, and only once the previous one is
                    # answered, by when gloo has let go of its buffer: rank 0 holds two buckets at most.
                    ahead = asyncio.create_task(asyncio.to_thread(self._prepare, buckets, scratches, (turn + 1) % 2))
                try:
                    await sent
                except Exception as exc:
                    raise RuntimeError(f"broadcast from trainer rank 0 failed: {exc}") from exc
                unanswered, posts = posts, None
                if not ahead_of_replies:
                    self._answered(await unanswered, replies)
                    unanswered = None
                report.bytes_sent += prepared.nbytes
                report.broadcasts += len(prepared.payload)
                del prepared
            if unanswered is not None:
                self._answered(await unanswered, replies)
        except RuntimeError as exc:
            log.error("weight sync of version %d over the weight-update group failed: %s; the group is rebuilt "
                      "at the next sync", version, exc)
            # Calls and a broadcast still in flight end before the group goes.
            await asyncio.gather(*(t for t in (sent, posts, unanswered) if t is not None), return_exceptions=True)
            for url in members:
                replies[url] = replies[url] or str(exc)
            with contextlib.suppress(RuntimeError):  # a failed gather: drain below meets it again
                await ahead  # the pull in flight ends before the rest is drained (one generator, one thread)
            await asyncio.to_thread(drain, buckets)
            await self._destroy()
        finally:
            await self._all([u for u in members if self._reachable(u)], *_post(continue_generation_call()))
        return replies

    @staticmethod
    def _answered(errors: dict[str, str | None], replies: dict[str, str | None]) -> None:
        """Record the members that failed a bucket; RuntimeError when any did (the sync stops there)."""
        bad = {u: e for u, e in errors.items() if e}
        if bad:
            replies.update(bad)
            raise RuntimeError(f"{len(bad)} engine ranks failed a bucket")

    async def _all(self, urls: list[str], path: str, body: dict[str, object]) -> dict[str, str | None]:
        # All engines at once: a worker's broadcast completes only when every rank takes part.
        parts = await asyncio.gather(*(
            engine.post([u for u in urls if u in engine.members()], path, body, timeout=self.options.timeout_s)
            for engine in self.engines
        ))
        return {url: reason for part in parts for url, reason in part.items()}

    async def close(self) -> None:
        """Tear the group down on the workers and here."""
        await self._destroy()
