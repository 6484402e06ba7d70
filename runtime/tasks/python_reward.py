"""A user's reward function, `reward.function: "module:callable"`, called safely.

The callable receives a `RewardInput` (prompt, response, answer, metadata, response_length) and
returns a number; with `reward.batched` it receives a list of them (one group) and returns a list.
It may be a plain function (run in a worker thread, so a slow one does not stall generation) or a
coroutine function (awaited on the event loop). Every call is bounded by `reward.timeoutSeconds`.

Whatever goes wrong (the import, an exception inside, a hang, a return value that is not a finite
number) ends in one `RewardFunctionError` that names the function and says what happened. A sync
function that hangs cannot be killed from Python: its thread is abandoned and the job stops with
the error.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # reward.py loads this module for `reward.type: python`; the input type is needed for annotations only.
    from rljob.runtime.tasks.reward import RewardInput


class RewardFunctionError(RuntimeError):
    """The user's reward function could not be loaded, raised, hung, or returned something unusable."""


def load_callable(reference: str) -> Callable[..., Any]:
    """Import `module:attribute[.attribute...]`; errors name reward.function and the missing part."""
    module_name, sep, attribute = reference.partition(":")
    if not sep or not module_name or not attribute:
        raise RewardFunctionError(f"reward.function {reference!r} must look like module:callable")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # an import runs user code: anything can go wrong in it
        raise RewardFunctionError(
            f"reward.function {reference!r}: cannot import module {module_name!r} ({type(exc).__name__}: {exc}); "
            "is it on PYTHONPATH?"
        ) from exc
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise RewardFunctionError(f"reward.function {reference!r}: {module_name} has no attribute {attribute!r}") from None
    if not callable(target):
        raise RewardFunctionError(f"reward.function {reference!r} is a {type(target).__name__}, not a callable")
    return target


def _as_reward(reference: str, value: Any) -> float:
    # bool is an int subclass and a fine 0/1 reward; strings and None are not numbers.
    if not isinstance(value, int | float) or not math.isfinite(float(value)):
        raise RewardFunctionError(
            f"reward.function {reference!r} returned {value!r} ({type(value).__name__}); expected a finite number"
        )
    return float(value)


@dataclass
class PythonReward:
    """Calls one user function with the batching and timeout of the spec."""

    reference: str
    function: Callable[..., Any]
    batched: bool = False
    timeout_s: float = 60.0

    @classmethod
    def load(cls, reference: str, *, batched: bool = False, timeout_s: float = 60.0) -> PythonReward:
        """Import the function now, so a bad reference fails the job at start-up, not mid-run."""
        return cls(reference=reference, function=load_callable(reference), batched=batched, timeout_s=timeout_s)

    async def __call__(self, items: Sequence[RewardInput]) -> list[float]:
        """Rewards of `items` in order: one batched call, or one call per item concurrently."""
        if self.batched:
            values = await self._call(list(items))
            if not isinstance(values, list | tuple) or len(values) != len(items):
                raise RewardFunctionError(
                    f"reward.function {self.reference!r} (batched) got {len(items)} inputs and returned "
                    f"{values!r:.200}; expected a list of {len(items)} numbers"
                )
            return [_as_reward(self.reference, v) for v in values]
        values = await asyncio.gather(*(self._call(item) for item in items))
        return [_as_reward(self.reference, v) for v in values]

    async def _call(self, argument: RewardInput | list[RewardInput]) -> Any:
        deadline = asyncio.timeout(self.timeout_s)
        try:
            async with deadline:
                if inspect.iscoroutinefunction(self.function):
                    return await self.function(argument)
                value = await asyncio.to_thread(self.function, argument)
                if inspect.isawaitable(value):  # a plain function returning a coroutine
                    value = await value
                return value
        except TimeoutError as exc:
            if not deadline.expired():  # the function's own TimeoutError, not our deadline
                raise RewardFunctionError(f"reward.function {self.reference!r} raised TimeoutError: {exc}") from exc
            raise RewardFunctionError(
                f"reward.function {self.reference!r} did not return within reward.timeoutSeconds={self.timeout_s:g}"
            ) from None
        except Exception as exc:
            raise RewardFunctionError(
                f"reward.function {self.reference!r} raised {type(exc).__name__}: {exc}"
            ) from exc
