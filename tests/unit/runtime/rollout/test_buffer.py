"""The partial-rollout buffer: whole groups, oldest first, nothing dropped, and a checkpoint round trip."""

from __future__ import annotations

import pytest

from rljob.runtime.rollout.buffer import PartialBuffer
from rljob.runtime.rollout.sample import Group, Sample, SampleStatus


def group(group_id: str, responses: list[int], prompt_index: int = 0) -> Group:
    samples = []
    for i, tokens in enumerate(responses):
        s = Sample(group_id, i, prompt_ids=[1, 2], answer="42")
        s.append(list(range(tokens)), [-0.1] * tokens, 1)
        samples.append(s)
    return Group(group_id, f"prompt of {group_id}", samples, prompt_index=prompt_index)


def test_groups_come_out_oldest_first_and_whole():
    buffer = PartialBuffer()
    assert buffer.pop_oldest() is None and len(buffer) == 0
    for gid in ("a", "b", "c"):
        buffer.push(group(gid, [3, 0]))
    assert [g.group_id for g in buffer] == ["a", "b", "c"]
    first = buffer.pop_oldest()
    assert first is not None and first.group_id == "a" and len(first.samples) == 2
    buffer.push(first)  # resumed and unfinished again: it goes to the back, behind the older b and c
    assert [g.group_id for g in buffer] == ["b", "c", "a"]
    popped = [buffer.pop_oldest() for _ in range(3)]
    assert [g.group_id for g in popped if g is not None] == ["b", "c", "a"]
    assert buffer.pop_oldest() is None


def test_a_group_is_buffered_at_most_once():
    buffer = PartialBuffer()
    buffer.push(group("a", [1]))
    with pytest.raises(ValueError, match="group a is already buffered"):
        buffer.push(group("a", [2]))
    assert len(buffer) == 1


def test_sample_and_token_counts_cover_every_buffered_response():
    buffer = PartialBuffer()
    buffer.push(group("a", [3, 0, 5]))
    buffer.push(group("b", [7]))
    assert buffer.sample_count() == 4 and buffer.token_count() == 15


def test_a_checkpoint_restores_the_same_groups_in_the_same_order():
    buffer = PartialBuffer()
    a = group("a", [3, 1], prompt_index=4)
    a.samples[0].status, a.samples[0].reward = SampleStatus.COMPLETED, 1.0  # a surplus group's finished sample
    a.samples[1].status = SampleStatus.ABORTED
    buffer.push(a)
    buffer.push(group("b", [2], prompt_index=9))
    restored = PartialBuffer()
    restored.load_state_dict(buffer.state_dict())
    assert [(g.group_id, g.prompt_index) for g in restored] == [("a", 4), ("b", 9)]
    back = restored.pop_oldest()
    assert back is not None and back is not a
    assert [s.response_ids for s in back.samples] == [[0, 1, 2], [0]]
    assert [s.status for s in back.samples] == [SampleStatus.COMPLETED, SampleStatus.ABORTED]
    assert back.samples[0].reward == 1.0 and back.samples[0].versions == [1, 1, 1]
    assert restored.token_count() == 2
