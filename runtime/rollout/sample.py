"""Samples and groups: the unit the scheduler launches, buffers, resumes and trains on."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from rljob.runtime.rollout.staleness import sample_staleness


class SampleStatus(str, enum.Enum):
    """Where a sample stands. ABORTED samples are resumed; COMPLETED/TRUNCATED are final."""

    PENDING = "pending"  # never generated (fresh, or regenerated after the staleness bound)
    ABORTED = "aborted"  # partial response kept, to be resumed
    COMPLETED = "completed"  # finished with a stop token
    TRUNCATED = "truncated"  # hit the hard response cap

    @property
    def finished(self) -> bool:
        return self in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)


@dataclass
class Sample:
    """One response to one prompt, possibly generated over several segments and policy versions.

    `versions[i]` is the policy version that generated `response_ids[i]`, so off-policy share and
    staleness are exact. `logprobs[i]` is the rollout (behaviour-policy) log-prob of that token.
    """

    group_id: str
    index: int
    prompt_ids: list[int]
    answer: str
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    status: SampleStatus = SampleStatus.PENDING
    reward: float | None = None
    segments: int = 0  # generate calls made for this sample
    last_round: int = -1  # round of the latest generate call (truncation rate, debugging)
    regenerations: int = 0  # times the staleness bound threw the response away
    metadata: dict[str, Any] = field(default_factory=dict)  # the data row's extra fields, for reward functions

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    def staleness(self, current_version: int) -> int:
        """Versions between the current policy and the oldest token, 0 when empty (staleness.py)."""
        return sample_staleness(self.versions, current_version)

    def append(self, ids: list[int], logprobs: list[float], version: int) -> None:
        """Add one segment's tokens, stamped with the version that produced them."""
        if len(ids) != len(logprobs):
            raise ValueError(f"sample {self.group_id}/{self.index}: {len(ids)} ids but {len(logprobs)} logprobs")
        self.response_ids.extend(ids)
        self.logprobs.extend(logprobs)
        self.versions.extend([version] * len(ids))

    def reset(self) -> None:
        """Drop the response (staleness bound): the sample starts again from its prompt."""
        self.response_ids.clear()
        self.logprobs.clear()
        self.versions.clear()
        self.status = SampleStatus.PENDING
        self.reward = None
        self.regenerations += 1

    def to_state(self) -> dict[str, Any]:
        """Plain-data form for checkpoints."""
        return {
            "group_id": self.group_id,
            "index": self.index,
            "prompt_ids": list(self.prompt_ids),
            "answer": self.answer,
            "response_ids": list(self.response_ids),
            "logprobs": list(self.logprobs),
            "versions": list(self.versions),
            "status": self.status.value,
            "reward": self.reward,
            "segments": self.segments,
            "last_round": self.last_round,
            "regenerations": self.regenerations,
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Sample:
        return cls(**{**state, "status": SampleStatus(state["status"])})


@dataclass
class Group:
    """G samples of one prompt: trained, buffered, filtered or discarded as a whole, never split."""

    group_id: str
    prompt_text: str
    samples: list[Sample]
    prompt_index: int = -1  # position in the data stream, for ordering and debugging

    @property
    def finished(self) -> bool:
        return all(s.status.finished for s in self.samples)

    def rewards(self) -> list[float]:
        return [s.reward if s.reward is not None else 0.0 for s in self.samples]

    def to_state(self) -> dict[str, Any]:
        return {
            "group_id": self.group_id,
            "prompt_text": self.prompt_text,
            "prompt_index": self.prompt_index,
            "samples": [s.to_state() for s in self.samples],
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Group:
        return cls(
            group_id=state["group_id"],
            prompt_text=state["prompt_text"],
            prompt_index=state["prompt_index"],
            samples=[Sample.from_state(s) for s in state["samples"]],
        )
