"""The one engine interface the rollout scheduler talks to, and what the weight transports drive.

Three implementations: the embedded PyTorch engine (in process), the SGLang HTTP client
(production, also used against the project's SGLang-protocol server), and the simulator's
virtual engines. Token ids in, token ids and log-probs out; abort returns partial output.

The weight transports (runtime/weights/) see an engine only through the two protocols at the end
of this module: `TensorTarget` (an engine in the trainer's process takes buckets of named tensors)
and `WeightTargets` (an engine served by remote members, SGLang workers, that take control POSTs and
report the version they serve). The engines never import the transports.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    import torch

    from rljob.runtime.engines.membership import WorkerView

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class GenerateRequest:
    """One generate call: the prompt plus any partial response, and the remaining budget."""

    rid: str
    input_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    top_k: int = -1  # -1 = off (SGLang convention)
    stop: list[str] = field(default_factory=list)  # stop strings: finish once the response text contains one
    # Other requests of the same input_ids are sent alongside (a group's samples starting from their
    # prompt): an engine that routes requests may prefill the prompt once for all of them.
    share_prefill: bool = False


@dataclass
class GenerateResult:
    """What one generate call produced. On abort, the tokens generated so far."""

    rid: str
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: FinishReason
    weight_version: int | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from a shared prefill (SGLang's meta_info.cached_tokens)


@dataclass
class EngineLoad:
    """Requests an engine is working on; both zero means drained."""

    running: int = 0
    waiting: int = 0

    @property
    def total(self) -> int:
        return self.running + self.waiting


@dataclass
class WeightUpdate:
    """New policy weights: a live module or full named tensors (in-process engines; tensors when the
    trainer is sharded and gathered them) and/or a directory on disk (HTTP)."""

    version: int
    module: torch.nn.Module | None = None
    path: str | None = None
    tensors: dict[str, torch.Tensor] | None = None
    # False: the engine keeps the keys and values it holds (interrupted rows resume without a prefill,
    # their earlier tokens' keys and values from the old weights); SGLang's ``flush_cache``.
    flush_cache: bool = True


class EngineError(RuntimeError):
    """An engine could not serve a request; the message names the endpoint and what to do."""


class InvalidRequestError(EngineError):
    """The request itself is unservable (empty prompt, longer than the context); retrying will not help."""


class Engine(abc.ABC):
    """Async inference engine. Implementations must be safe to call from one event loop."""

    name: str = "engine"

    @abc.abstractmethod
    async def start(self) -> None:
        """Load the model / connect, and wait until the engine can generate."""

    @abc.abstractmethod
    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Generate until stop, length or abort. An aborted request returns its partial output."""

    @abc.abstractmethod
    async def abort(self, rid_prefix: str) -> None:
        """Abort every request whose rid starts with rid_prefix."""

    @abc.abstractmethod
    async def abort_all(self) -> None:
        """Abort every running and waiting request (on every worker behind this engine)."""

    @abc.abstractmethod
    async def load(self) -> EngineLoad:
        """Current running and waiting request counts."""

    @abc.abstractmethod
    async def update_weights(self, update: WeightUpdate) -> None:
        """Install new weights and record update.version as the engine's weight version."""

    @abc.abstractmethod
    async def health(self) -> bool:
        """True when the engine can generate."""

    def batch_capacity(self) -> int | None:
        """Requests the engine runs at once (its decode batch); None when it cannot tell. The scheduler's
        `fill_engines` option launches extra groups while fewer requests than this are in flight."""
        return None

    def served_version(self) -> int | None:
        """The weight version new requests are served at, as the engine itself reports it; None
        when the engine cannot tell (or no part of it serves at the moment)."""
        return None

    def needs_catch_up(self) -> bool:
        """No part of the engine serves the current weights, but some part answers at another version
        (restarted, or missed syncs): only a sync of the current weights brings it back. In-process
        engines never restart on their own, so by default never."""
        return False

    def sampling_state(self) -> Any:
        """The state of the engine's sampling RNG, for a checkpoint (None: the engine has none here)."""
        return None

    def load_sampling_state(self, state: Any) -> None:
        """Restore what sampling_state() returned (no-op for engines without a local RNG)."""
        return None

    def ceiling_tokens_per_s(self) -> float | None:
        """Bubble-free ceiling estimate (steady full-batch decode rate), when the engine knows it."""
        return None

    async def close(self) -> None:
        """Release resources (sessions, threads)."""
        return None


# ------------------------------------------------------------------ what the weight transports drive


@dataclass
class MemberSync:
    """Per member outcome of one weight sync, by the members' own served version."""

    updated: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


class TensorTarget(Protocol):
    """An engine in the trainer's process: takes the weights bucket by bucket (the ``tensor`` mode)."""

    name: str

    @property
    def dtype(self) -> torch.dtype:
        """The dtype it serves its weights in (a sync's tensors are copied into that)."""
        ...

    async def load_named_tensors(
        self, tensors: list[tuple[str, torch.Tensor]], version: int | None, flush_cache: bool = True
    ) -> None:
        """Copy one bucket of full named tensors into the served model; ``version`` (with the last
        bucket) becomes the served version; ``flush_cache`` False keeps the engine's cached keys and
        values (WeightUpdate). EngineError when a name or shape does not fit."""
        ...

    def served_version(self) -> int | None:
        """The version of the weights it serves."""
        ...


class WeightTargets(Protocol):
    """An engine served by remote members (SGLang workers, by URL) that a transport updates with
    control POSTs (the ``distributed`` and ``disk`` modes). The member's own report of the version
    it serves is the truth: ``commit`` reads it back and moves the engine's rotation."""

    def syncing(self) -> AbstractAsyncContextManager[None]:
        """Hold the engine's own probing while a sync runs (versions move under it)."""
        ...

    async def refresh_members(self) -> None:
        """Adopt the members discovery reports now and probe every one (reachable, served version)."""
        ...

    def members(self) -> Mapping[str, WorkerView]:
        """Every member the engine knows, by URL, as last probed."""
        ...

    async def member_info(self, url: str) -> dict[str, Any]:
        """A member's server info (``tp_size``, ``dp_size``, ...); EngineError when it does not answer."""
        ...

    async def post(self, urls: Sequence[str], path: str, body: dict[str, Any],
                   timeout: float | None = None) -> dict[str, str | None]:
        """One control POST to each of ``urls`` at once: url -> None (done) or why it failed."""
        ...

    async def commit(self, version: int, replies: Mapping[str, str | None]) -> MemberSync:
        """After a sync: make ``version`` current where members serve it, and say which do."""
        ...


async def post_and_commit(targets: WeightTargets, version: int, path: str, body: dict[str, Any]) -> MemberSync:
    """A sync that is one control POST per member (``/update_weights_from_disk``): every answering
    member (also those out of the rotation: this is how they catch up) gets it, then ``version``
    becomes current where the members serve it."""
    async with targets.syncing():
        await targets.refresh_members()  # a replica added since the last sync gets this version too
        ready = [url for url, member in targets.members().items() if member.reachable]
        replies = await targets.post(ready, path, body)
        return await targets.commit(version, replies)
