"""The job's reward: built-in math-answer or a user's Python function, plus DAPO's overlong penalty.

`math-answer` is 1.0 when the final answer matches the reference, else 0.0. The final answer of a
response is, in order of preference: the text after the last `####` (GSM8K style, and the
synthetic task's format), the content of the last `\\boxed{...}`, or the last number in the
text. Both sides are normalised (whitespace, `$`, thousands commas, a trailing period, `12.0` ==
`12`, `+3` == `3`) and compared exactly; when that fails and either side is more than a plain
number, the math-verify package decides mathematical equivalence (`\\frac{1}{2}` == `0.5`,
`x+1` == `1+x`).

Every reward is scored through `JobReward.score`, asynchronously and in batches (one call per
group from the rollout scheduler), so a user function may be sync or async, per item or batched.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rljob.api.spec import OverlongPunishmentSpec, RewardSpec
from rljob.runtime.algorithms.overlong import overlong_penalty
from rljob.runtime.rollout.sample import Group, Sample

RewardFn = Callable[[str, str], float]

_NUMBER = re.compile(r"[-+]?\d(?:[\d,]*\d)?(?:\.\d+)?|[-+]?\.\d+")
_BOXED = "\\boxed{"


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, with nested braces balanced; None when absent or unclosed."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth = 1
    i = start + len(_BOXED)
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def extract_answer(text: str) -> str | None:
    """The final answer written in text, or None when there is none."""
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        return tail.splitlines()[0].strip() if tail else None
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def normalize_answer(answer: str) -> str:
    """Canonical form for exact comparison."""
    text = answer.strip().strip("$").strip().rstrip(".").strip()
    if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", text):
        text = text.replace(",", "")
    if re.fullmatch(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)", text):
        sign = "-" if text.startswith("-") else ""
        whole, _, fraction = text.lstrip("+-").partition(".")
        fraction = fraction.rstrip("0")
        text = (whole.lstrip("0") or "0") + (f".{fraction}" if fraction else "")
        text = sign + text if text != "0" else text
    return text


def math_answer_reward(response_text: str, answer: str) -> float:
    """1.0 when the final answer of response_text equals the reference answer, else 0.0.

    A reference that itself contains `####` or `\\boxed{}` (GSM8K `answer` fields) is reduced to
    its final answer first.
    """
    predicted = extract_answer(response_text)
    if predicted is None:
        return 0.0
    reference = answer
    if "####" in answer or _BOXED in answer:
        reference = extract_answer(answer) or answer
    predicted, reference = normalize_answer(predicted), normalize_answer(reference)
    if predicted == reference:
        return 1.0
    if _PLAIN_NUMBER.fullmatch(predicted) and _PLAIN_NUMBER.fullmatch(reference):
        return 0.0  # two canonical decimals that differ are different numbers: skip sympy
    return 1.0 if equivalent_math(predicted, reference) else 0.0


_PLAIN_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
# Seconds math-verify may spend parsing or comparing one pair (sympy can stall on odd input).
MATH_VERIFY_TIMEOUT_S = 5


def equivalent_math(predicted: str, reference: str) -> bool:
    """Whether two answers are mathematically equal per math-verify (LaTeX or plain expressions)."""
    from math_verify import parse, verify  # imports sympy: only when an answer needs it

    # math-verify enforces its timeouts with SIGALRM, which only the main thread may set; in
    # other threads it runs without one.
    timeout = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"${reference}$", parsing_timeout=timeout)
    target = parse(f"${predicted}$", parsing_timeout=timeout)
    if not gold or not target:
        return False
    return bool(verify(gold, target, timeout_seconds=timeout))


@dataclass(frozen=True)
class RewardInput:
    """What a reward function sees of one sample (docs/rewards.md)."""

    prompt: str  # the prompt text of the data row
    response: str  # the decoded response
    answer: str  # the row's reference answer
    metadata: dict[str, Any] = field(default_factory=dict)  # every other field of the data row
    response_length: int = 0  # response tokens


BatchReward = Callable[[Sequence[RewardInput]], Awaitable[list[float]]]


def sample_reward_inputs(group: Group, samples: Sequence[Sample], decode: Callable[[list[int]], str]) -> list[RewardInput]:
    """The reward inputs of some samples of one group (prompt text from the group, row metadata per sample)."""
    return [
        RewardInput(
            prompt=group.prompt_text,
            response=decode(s.response_ids),
            answer=s.answer,
            metadata=s.metadata,
            response_length=s.response_length,
        )
        for s in samples
    ]


async def _math_answer_batch(items: Sequence[RewardInput]) -> list[float]:
    return [math_answer_reward(item.response, item.answer) for item in items]


@dataclass
class JobReward:
    """The reward of one job: the base reward plus, when configured, DAPO's overlong penalty."""

    base: BatchReward
    overlong: OverlongPunishmentSpec | None = None
    max_response_length: int | None = None

    async def score(self, items: Sequence[RewardInput]) -> list[float]:
        """Rewards of `items`, in order."""
        if not items:
            return []
        values = await self.base(items)
        if self.overlong is None:
            return values
        assert self.max_response_length is not None  # build_reward checks it
        return [
            value + overlong_penalty(
                item.response_length, self.max_response_length, self.overlong.buffer_tokens,
                self.overlong.penalty_factor,
            )
            for value, item in zip(values, items, strict=True)
        ]


@dataclass(frozen=True)
class GroupReward:
    """The job's reward as the rollout scheduler calls it (a `GroupScorer`): some finished samples of
    one group, decoded, rewarded at once."""

    reward: JobReward
    decode: Callable[[list[int]], str]

    async def __call__(self, group: Group, samples: list[Sample]) -> list[float]:
        """Rewards of `samples` (of `group`), in order."""
        return await self.reward.score(sample_reward_inputs(group, samples, self.decode))


def build_reward(spec: RewardSpec, max_response_length: int | None = None) -> JobReward:
    """The job's reward named by the spec; max_response_length is the overlong penalty's cap."""
    if spec.overlong_punishment is not None:
        if max_response_length is None:
            raise ValueError("reward.overlongPunishment needs rollout.maxResponseLength")
        if spec.overlong_punishment.buffer_tokens > max_response_length:
            raise ValueError(
                f"reward.overlongPunishment.bufferTokens ({spec.overlong_punishment.buffer_tokens}) exceeds "
                f"rollout.maxResponseLength ({max_response_length})"
            )
    base: BatchReward
    if spec.type == "math-answer":
        base = _math_answer_batch
    elif spec.type == "python":
        from rljob.runtime.tasks.python_reward import PythonReward

        assert spec.function is not None  # RewardSpec requires it for type python
        base = PythonReward.load(spec.function, batched=spec.batched, timeout_s=spec.timeout_seconds)
    else:
        raise ValueError(f"reward.type {spec.type!r} is not supported; use math-answer or python")
    return JobReward(base=base, overlong=spec.overlong_punishment, max_response_length=max_response_length)
