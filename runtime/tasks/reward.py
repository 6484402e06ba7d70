"""Math-answer reward: 1.0 when the final answer matches the reference exactly, else 0.0.

The final answer of a response is, in order of preference: the text after the last `####`
(GSM8K style, and the synthetic task's format), the content of the last `\\boxed{...}`, or
the last number in the text. Both sides are normalised (whitespace, `$`, thousands commas,
a trailing period, `12.0` == `12`, `+3` == `3`) before the exact comparison.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from rljob.operator.api.spec import RewardSpec

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
    return 1.0 if normalize_answer(predicted) == normalize_answer(reference) else 0.0


def build_reward(spec: RewardSpec) -> RewardFn:
    """The reward function `(response_text, answer) -> float` named by the spec."""
    if spec.type == "math-answer":
        return math_answer_reward
    raise ValueError(f"reward.type {spec.type!r} is not supported; use math-answer")
