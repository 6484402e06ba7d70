"""Tokenizers, the long-tailed synthetic task, the math-answer reward and the resumable prompt stream."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rljob.api.spec import DataSpec, RewardSpec
from rljob.runtime.tasks.dataset import DataExhausted, DataRow, PromptStream, SkippedRow, load_jsonl_records
from rljob.runtime.tasks.reward import RewardInput, build_reward, extract_answer, math_answer_reward, normalize_answer
from rljob.runtime.tasks.synthetic import ArithChainTask, solve
from rljob.runtime.tasks.tokenizer import CharTokenizer, HFTokenizer, TaskTokenizer, load_tokenizer

# ---------------------------------------------------------------------------------------------- tokenizer


def test_char_tokenizer_round_trip_and_special_ids(tmp_path: Path) -> None:
    tok = CharTokenizer()
    text = "23%7=016 009 002 #### 2\n"
    ids = tok.encode(text)
    assert len(ids) == len(text) and min(ids) >= 3 and max(ids) < tok.vocab_size
    assert tok.decode([tok.bos_token_id, *ids, tok.eos_token_id, tok.pad_token_id]) == text
    assert tok.encode_prompt("1%2=")[0] == tok.bos_token_id
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    tok.save(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert isinstance(loaded, CharTokenizer) and loaded.encode(text) == ids
    assert isinstance(loaded, TaskTokenizer)


def test_char_tokenizer_rejects_unknown_characters_clearly() -> None:
    with pytest.raises(ValueError, match="not in the built-in tokenizer's alphabet"):
        CharTokenizer().encode("½")


def test_hugging_face_tokenizer_goes_through_the_same_protocol(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    chars = "0123456789%=# "
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{c: i + 4 for i, c in enumerate(chars)}}
    backend = Tokenizer(BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()  # characters join without spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    fast.save_pretrained(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer) and isinstance(tok, TaskTokenizer)
    assert tok.eos_token_id == 2 and tok.pad_token_id == 0 and tok.vocab_size == len(vocab)
    ids = tok.encode("12%5=")
    assert ids == [vocab[c] for c in "12%5="]
    assert tok.decode([*ids, tok.eos_token_id]) == "12%5="


def test_missing_tokenizer_fails_with_a_clear_message(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no usable tokenizer"):
        load_tokenizer(tmp_path)


# ---------------------------------------------------------------------------------------------- task


def test_arith_chain_is_deterministic_and_self_consistent() -> None:
    task = ArithChainTask(seed=3)
    assert task.problems(20) == ArithChainTask(seed=3).problems(20)
    assert task.problems(20) != ArithChainTask(seed=4).problems(20)
    assert task.problem(7) == task.problems(3, start=6)[1]
    for problem in task.problems(200):
        n, d = (int(x) for x in problem.prompt.rstrip("=").split("%"))
        assert problem.answer == str(n % d) and problem.steps == n // d >= 1
        assert math_answer_reward(problem.solution, problem.answer) == 1.0


def test_arith_chain_solution_format() -> None:
    assert solve(23, 7) == "016-7 009-7 002 #### 2"
    assert solve(14, 7) == "007-7 000 #### 0"
    assert solve(5, 7) == "#### 5"


def test_arith_chain_response_lengths_have_a_long_tail() -> None:
    tok = CharTokenizer()
    task = ArithChainTask(seed=0)
    lengths = sorted(len(tok.encode(p.solution)) + 1 for p in task.problems(3000))
    p50 = lengths[len(lengths) // 2]
    p99 = lengths[int(len(lengths) * 0.99)]
    assert p99 / p50 >= 3, (p50, p99)
    assert lengths[0] <= 12 and p99 >= 150 and lengths[-1] <= 256


def test_arith_chain_rejects_values_that_do_not_fit_three_digits() -> None:
    with pytest.raises(ValueError, match="three digits"):
        ArithChainTask(max_steps=60, max_divisor=23)


# ---------------------------------------------------------------------------------------------- reward


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("016 009 002 #### 2", "2"),
        ("work #### 1,234\nmore", "1,234"),
        ("so the answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("first \\boxed{3} then \\boxed{4}", "4"),
        ("I got 3 apples and 4.5 pears, total 7.", "7"),
        ("no digits here", None),
        ("#### ", None),
    ],
)
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    ("raw", "normal"),
    [(" 1,234 ", "1234"), ("12.0", "12"), ("$5.", "5"), ("+3", "3"), ("007", "7"), ("-0.50", "-0.5"), ("x", "x")],
)
def test_normalize_answer(raw: str, normal: str) -> None:
    assert normalize_answer(raw) == normal


async def test_math_answer_reward_matches_final_answers() -> None:
    assert math_answer_reward("016 009 002 #### 2", "2") == 1.0
    assert math_answer_reward("016 009 003 #### 3", "2") == 0.0
    assert math_answer_reward("The total is \\boxed{1,000}", "1000.0") == 1.0
    assert math_answer_reward("Natalia sold 72 clips", "She sold 48 + 24 = 72 clips.\n#### 72") == 1.0
    assert math_answer_reward("", "2") == 0.0
    assert await build_reward(RewardSpec()).score([RewardInput(prompt="", response="#### 2", answer="2")]) == [1.0]


# ---------------------------------------------------------------------------------------------- dataset


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_stream_resumes_exactly_from_its_cursor() -> None:
    spec = DataSpec(synthetic={"num_prompts": 10, "seed": 1}, seed=5)
    stream = PromptStream.from_spec(spec, CharTokenizer())
    for _ in range(13):  # into the second epoch
        stream.next_prompt()
    saved = json.loads(json.dumps(stream.state_dict()))  # checkpoints store plain data
    expected = [stream.next_prompt() for _ in range(15)]
    resumed = PromptStream.from_spec(spec, CharTokenizer())
    resumed.load_state_dict(saved)
    assert [resumed.next_prompt() for _ in range(15)] == expected


def test_stream_epochs_cover_every_record_in_a_new_order() -> None:
    stream = PromptStream([(f"{i}%3=", str(i % 3)) for i in range(20)], CharTokenizer(), seed=0)
    first = [stream.next_prompt() for _ in range(20)]
    second = [stream.next_prompt() for _ in range(20)]
    assert sorted(r.source_index for r in first) == list(range(20)) == sorted(r.source_index for r in second)
    assert [r.source_index for r in first] != [r.source_index for r in second]
    assert {r.epoch for r in second} == {1} and second[-1].index == 39
    assert first[0].prompt_ids == CharTokenizer().encode_prompt(first[0].text)
    unshuffled = PromptStream([("1%2=", "1"), ("2%2=", "0")], CharTokenizer(), shuffle=False, max_epochs=1)
    assert [unshuffled.next_prompt().source_index for _ in range(2)] == [0, 1]
    with pytest.raises(DataExhausted):
        unshuffled.next_prompt()


def test_stream_refuses_a_cursor_from_another_dataset() -> None:
    stream = PromptStream([("1%2=", "1")] * 3, CharTokenizer())
    state = stream.state_dict()
    with pytest.raises(ValueError, match="3 prompts but the dataset has 2"):
        PromptStream([("1%2=", "1")] * 2, CharTokenizer()).load_state_dict(state)


def test_jsonl_records_with_custom_keys(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [{"question": "1%2=", "solution": 1}, {"question": "9%4=", "solution": "1"}])
    assert load_jsonl_records(path, "question", "solution") == [DataRow(prompt="1%2=", answer="1"), DataRow(prompt="9%4=", answer="1")]
    stream = PromptStream.from_spec(DataSpec(jsonl=str(path), prompt_key="question", answer_key="solution"), CharTokenizer())
    assert {stream.next_prompt().text for _ in range(2)} == {"1%2=", "9%4="}


def test_bad_jsonl_lines_are_skipped_and_reported_with_their_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1", "answer": "1"}\n{"prompt": "2"}\n{not json\n{"prompt": "3", "answer": "3"}\n')
    skipped: list[SkippedRow] = []
    rows = load_jsonl_records(bad, on_skip=skipped.append)
    assert [r.prompt for r in rows] == ["1", "3"]
    assert [(s.reason, s.where.rsplit(":", 1)[-1]) for s in skipped] == [("unreadable", "2"), ("unreadable", "3")]
    assert re.search(r"bad.jsonl:2 needs 'answer' and 'prompt' or 'messages'", skipped[0].message)
    assert re.search(r"bad.jsonl:3 is not valid JSON", skipped[1].message)


def test_a_file_with_no_usable_row_is_an_error_naming_the_first_problem(tmp_path: Path) -> None:
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"broken.jsonl has no usable records; first problem: .*broken.jsonl:1 is not valid JSON"):
        load_jsonl_records(broken, on_skip=lambda _row: None)
    with pytest.raises(ValueError, match="does not exist"):
        load_jsonl_records(tmp_path / "missing.jsonl")


class _FailingTemplate(CharTokenizer):
    """A chat tokenizer whose template fails on one row, as a user's Jinja template can."""

    has_chat_template = True

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        if "boom" in messages[-1]["content"]:
            raise ValueError("template error: unexpected content")
        return messages[-1]["content"]


def test_stream_skips_unrenderable_and_over_long_rows_counts_them_and_never_replays_them(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "1%2=", "answer": "1"},
        {"prompt": "boom", "answer": "0"},
        {"prompt": "9" * 40, "answer": "9"},
        {"prompt": "9%4=", "answer": "1"},
    ])
    skipped: list[SkippedRow] = []
    spec = DataSpec(jsonl=str(path), shuffle=False)
    stream = PromptStream.from_spec(spec, _FailingTemplate(), max_prompt_tokens=10, on_skip=skipped.append)
    assert stream.next_prompt().text == "1%2="
    assert stream.next_prompt().text == "9%4="  # rows 2 and 3 skipped on the way
    assert [(s.reason, s.where.rsplit(":", 1)[-1]) for s in skipped] == [("unrenderable", "2"), ("too_long", "3")]
    assert "40 tokens, more than the 10" in skipped[1].message
    assert stream.skipped == {"unrenderable": 1, "too_long": 1}
    # A resumed stream carries the counts and starts past the bad rows: the next epoch serves row 1 again.
    resumed = PromptStream.from_spec(spec, _FailingTemplate(), max_prompt_tokens=10, on_skip=skipped.append)
    resumed.load_state_dict(stream.state_dict())
    assert resumed.skipped == stream.skipped and resumed.next_prompt().text == "1%2="
    assert len(skipped) == 2


def test_stream_counts_rows_skipped_while_reading_and_fails_when_nothing_is_servable(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "boom", "answer": "0"}\n{"prompt": 1}\n')
    stream = PromptStream.from_spec(DataSpec(jsonl=str(path)), _FailingTemplate(), on_skip=lambda _row: None)
    assert stream.skipped == {"unreadable": 1}
    with pytest.raises(ValueError, match=r"every one of the 1 rows was skipped \(last: .*cannot render the prompt"):
        stream.next_prompt()


# ---------------------------------------------------------------------------------------------- policy


def test_load_policy_from_a_local_checkpoint(tmp_path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rljob.api.spec import ModelSpec
    from rljob.runtime.tasks.policy import load_policy

    tok = CharTokenizer()
    config = LlamaConfig(
        vocab_size=tok.vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
    )
    saved = LlamaForCausalLM(config)
    saved.save_pretrained(tmp_path)
    tok.save(tmp_path)
    model, loaded_tok = load_policy(ModelSpec(path=str(tmp_path)))
    assert isinstance(loaded_tok, CharTokenizer)
    assert all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), model.state_dict().values()))


def test_load_policy_errors_say_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rljob.api.spec import ModelSpec
    from rljob.runtime.tasks.policy import load_policy

    with pytest.raises(ValueError, match=r"model.path: .* \(no config.json\)"):
        load_policy(ModelSpec(path=str(tmp_path)))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ValueError, match="set spec.model.path to a local model folder"):
        load_policy(ModelSpec(hugging_face="Qwen/Qwen3-4B"))


@pytest.mark.slow
def test_builtin_policy_samples_a_mid_reward() -> None:
    """Warms the built-in policy up (or loads it from the cache) and samples it at temperature 1."""
    from rljob.api.spec import ModelSpec
    from rljob.runtime.tasks.policy import load_policy
    from rljob.runtime.tasks.warmup import DEFAULT_RECIPE, sampled_reward

    model, tok = load_policy(ModelSpec(builtin="tiny-arith"), progress=False)
    problems = DEFAULT_RECIPE.task(seed=4242).problems(128)
    reward = sampled_reward(model, tok, problems, temperature=1.0)
    assert 0.15 <= reward <= 0.7, reward
