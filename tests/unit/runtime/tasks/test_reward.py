"""The job's reward: math-answer with math-verify equivalence, user Python functions, overlong penalty."""

from __future__ import annotations

import json
import textwrap
import threading
from pathlib import Path

import pytest

from rljob.api.spec import DataSpec, RewardSpec
from rljob.runtime.rollout.sample import Group, Sample, SampleStatus
from rljob.runtime.tasks.dataset import PromptStream
from rljob.runtime.tasks.python_reward import RewardFunctionError
from rljob.runtime.tasks.reward import RewardInput, build_reward, math_answer_reward, sample_reward_inputs
from rljob.runtime.tasks.tokenizer import CharTokenizer

HANG = threading.Event()  # released by the hang test's cleanup, so the abandoned thread ends


def _module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, source: str) -> str:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def _inputs() -> list[RewardInput]:
    return [
        RewardInput(prompt="1+1=", response="#### 2", answer="2", metadata={"weight": 3}, response_length=4),
        RewardInput(prompt="1+1=", response="#### 5", answer="2", metadata={"weight": 3}, response_length=4),
    ]


@pytest.mark.parametrize(
    ("response", "answer", "reward"),
    [
        ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("#### 0.5", "\\frac{1}{2}", 1.0),
        ("#### 1/2", "0.5", 1.0),
        ("\\boxed{x+1}", "1+x", 1.0),
        ("\\boxed{\\frac{1}{3}}", "0.5", 0.0),
        ("#### 7", "2", 0.0),
        ("#### 2.0", "2", 1.0),
    ],
)
def test_math_answer_accepts_equivalent_answers(response: str, answer: str, reward: float) -> None:
    assert math_answer_reward(response, answer) == reward


async def test_builtin_reward_with_overlong_punishment() -> None:
    reward = build_reward(RewardSpec(overlong_punishment={"buffer_tokens": 4}), max_response_length=8)
    items = [
        RewardInput(prompt="", response="#### 2", answer="2", response_length=n) for n in (4, 6, 8)
    ]
    assert await reward.score(items) == [1.0, 0.5, 0.0]  # 1 + (4 - n) / 4 inside the buffer
    with pytest.raises(ValueError, match="bufferTokens"):
        build_reward(RewardSpec(overlong_punishment={"buffer_tokens": 9}), max_response_length=8)


async def test_python_reward_sync_per_item_sees_metadata(tmp_path, monkeypatch) -> None:
    name = _module(tmp_path, monkeypatch, "reward_sync_item", """
        def score(item):
            return item.metadata["weight"] * float(item.response.endswith(item.answer))
    """)
    reward = build_reward(RewardSpec(type="python", function=f"{name}:score"))
    assert await reward.score(_inputs()) == [3.0, 0.0]


async def test_python_reward_async_batched(tmp_path, monkeypatch) -> None:
    name = _module(tmp_path, monkeypatch, "reward_async_batch", """
        import asyncio
        CALLS = []

        class Judge:
            async def score(self, items):
                CALLS.append(len(items))
                await asyncio.sleep(0)
                return [len(i.response) for i in items]

        judge = Judge()
    """)
    reward = build_reward(RewardSpec(type="python", function=f"{name}:judge.score", batched=True))
    assert await reward.score(_inputs()) == [6.0, 6.0]
    import importlib

    assert importlib.import_module(name).CALLS == [2]  # one call for the whole batch


async def test_python_reward_that_raises_names_the_function(tmp_path, monkeypatch) -> None:
    name = _module(tmp_path, monkeypatch, "reward_raises", """
        def score(item):
            raise KeyError("difficulty")
    """)
    reward = build_reward(RewardSpec(type="python", function=f"{name}:score"))
    with pytest.raises(RewardFunctionError, match=r"reward\.function 'reward_raises:score' raised KeyError: 'difficulty'"):
        await reward.score(_inputs())


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_python_reward_that_hangs_times_out(tmp_path, monkeypatch, kind: str) -> None:
    name = _module(tmp_path, monkeypatch, f"reward_hangs_{kind}", """
        import asyncio
        from tests.unit.runtime.tasks.test_reward import HANG

        def sync_score(item):
            HANG.wait()  # never set while the reward waits: a hung judge
            return 1.0

        async def async_score(item):
            await asyncio.Event().wait()
    """)
    reward = build_reward(RewardSpec(type="python", function=f"{name}:{kind}_score", timeout_seconds=0.2))
    try:
        with pytest.raises(RewardFunctionError, match=rf"'{name}:{kind}_score' did not return within reward.timeoutSeconds=0.2"):
            await reward.score(_inputs())
    finally:
        HANG.set()


async def test_python_reward_bad_references_and_returns(tmp_path, monkeypatch) -> None:
    name = _module(tmp_path, monkeypatch, "reward_bad", """
        NOT_CALLABLE = 3

        def text(item):
            return "1.0"

        def short(items):
            return [1.0]
    """)
    with pytest.raises(RewardFunctionError, match="cannot import module 'no_such_reward_module'"):
        build_reward(RewardSpec(type="python", function="no_such_reward_module:score"))
    with pytest.raises(RewardFunctionError, match="has no attribute 'missing'"):
        build_reward(RewardSpec(type="python", function=f"{name}:missing"))
    with pytest.raises(RewardFunctionError, match="not a callable"):
        build_reward(RewardSpec(type="python", function=f"{name}:NOT_CALLABLE"))
    with pytest.raises(RewardFunctionError, match="returned '1.0' \\(str\\); expected a finite number"):
        await build_reward(RewardSpec(type="python", function=f"{name}:text")).score(_inputs())
    with pytest.raises(RewardFunctionError, match="expected a list of 2 numbers"):
        await build_reward(RewardSpec(type="python", function=f"{name}:short", batched=True)).score(_inputs())


def test_python_reward_spec_needs_a_function() -> None:
    with pytest.raises(ValueError, match="function is required"):
        RewardSpec(type="python")
    with pytest.raises(ValueError, match="function"):
        RewardSpec(type="python", function="no colon")


async def test_extra_jsonl_fields_reach_the_reward_function(tmp_path, monkeypatch) -> None:
    rows = [{"prompt": "1%2=", "answer": "1", "difficulty": 7, "source": "unit"}]
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    tok = CharTokenizer()
    record = PromptStream.from_spec(DataSpec(jsonl=str(data)), tok).next_prompt()
    assert record.metadata == {"difficulty": 7, "source": "unit"}
    name = _module(tmp_path, monkeypatch, "reward_metadata", """
        def score(item):
            return float(item.metadata["difficulty"]) + (item.prompt == "1%2=")
    """)
    reward = build_reward(RewardSpec(type="python", function=f"{name}:score"))
    sample = Sample(group_id="g1", index=0, prompt_ids=record.prompt_ids, answer=record.answer,
                    response_ids=tok.encode("#### 1"), logprobs=[0.0] * 6, versions=[0] * 6,
                    status=SampleStatus.COMPLETED, metadata=record.metadata)
    group = Group(group_id="g1", prompt_text=record.text, samples=[sample])
    assert await reward.score(sample_reward_inputs(group, [sample], tok.decode)) == [8.0]
    assert Group.from_state(group.to_state()).samples[0].metadata == record.metadata  # survives checkpoints
