"""The one engine interface the rollout scheduler talks to.

Three implementations: the embedded PyTorch engine (in process), the SGLang HTTP client
(production, also used against the project's SGLang-protocol server), and the simulator's
virtual engines. Token ids in, token ids and log-probs out; abort returns partial output.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

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


@dataclass
class GenerateResult:
    """What one generate call produced. On abort, the tokens generated so far."""

    rid: str
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: FinishReason
    weight_version: int | None = None
    prompt_tokens: int = 0


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
