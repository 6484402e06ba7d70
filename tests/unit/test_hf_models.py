"""Real Hugging Face architectures (tiny random Qwen3 and Llama 3 folders): loading, engine, prompts, stop tokens."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rljob.api.spec import DataSpec, ModelSpec
from rljob.runtime.engines.base import GenerateRequest, InvalidRequestError
from rljob.runtime.engines.embedded import EmbeddedEngine
from rljob.runtime.models.loading import load_causal_lm, stop_token_ids
from rljob.runtime.models.source import ModelSourceError, resolve_model_dir
from rljob.runtime.tasks.dataset import PromptStream
from rljob.runtime.tasks.policy import open_policy
from rljob.runtime.tasks.prompts import PromptRenderer
from rljob.runtime.tasks.tokenizer import HFTokenizer, load_tokenizer
from tests.helpers.hf_models import FAMILIES

# Prompts of different lengths and budgets: sequences join and leave the running batch at different steps.
PROMPTS = [[5, 6, 7, 8], [30, 31], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [100], [77, 78, 79]]
BUDGETS = [24, 17, 30, 9, 21]


def _reference_greedy(model: torch.nn.Module, prompt: list[int], budget: int, stop: list[int]) -> list[int]:
    """transformers' own greedy generate, one unpadded sequence at a time."""
    out = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), do_sample=False,
        max_new_tokens=budget, eos_token_id=stop, pad_token_id=stop[0],
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", FAMILIES)
async def test_engine_greedy_decoding_matches_transformers_generate(tiny_hf_models: dict[str, Path], family: str) -> None:
    # float64: batched and single-sequence forwards reduce in different orders, and in float32 that
    # rounding could flip a near-tie argmax; in float64 only a cache or position fault changes a token.
    model = load_causal_lm(tiny_hf_models[family], dtype=torch.float64)
    stop = stop_token_ids(model, load_tokenizer(tiny_hf_models[family]).eos_token_id)
    expected = [_reference_greedy(model, p, n, stop) for p, n in zip(PROMPTS, BUDGETS, strict=True)]
    engine = EmbeddedEngine(model, max_batch_size=3, dtype=torch.float64)  # fewer slots than requests: waves
    try:
        results = await asyncio.gather(
            *(
                engine.generate(GenerateRequest(f"r{i}", p, n, temperature=0.0, stop_token_ids=stop))
                for i, (p, n) in enumerate(zip(PROMPTS, BUDGETS, strict=True))
            )
        )
    finally:
        await engine.close()
    assert [r.output_ids for r in results] == expected
    assert engine.stats.prefill_steps >= 2


@pytest.mark.parametrize("family", FAMILIES)
def test_stop_tokens_include_every_generation_config_eos(tiny_hf_models: dict[str, Path], family: str) -> None:
    folder = tiny_hf_models[family]
    policy = open_policy(ModelSpec(path=str(folder)))
    tok = AutoTokenizer.from_pretrained(folder)
    end_of_turn, end_of_text = {"qwen3": ("<|im_end|>", "<|endoftext|>"), "llama": ("<|eot_id|>", "<|end_of_text|>")}[family]
    assert policy.stop_token_ids == tok.convert_tokens_to_ids([end_of_turn, end_of_text])
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == policy.stop_token_ids


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_template_renders_messages_prompts_and_system_prompt(tiny_hf_models: dict[str, Path], family: str) -> None:
    folder = tiny_hf_models[family]
    hf = AutoTokenizer.from_pretrained(folder)
    renderer = PromptRenderer(load_tokenizer(folder), system_prompt="Answer with a number.")
    user = {"role": "user", "content": "What is 3 + 4?"}
    system = {"role": "system", "content": "Answer with a number."}

    expected_text = hf.apply_chat_template([system, user], tokenize=False, add_generation_prompt=True)
    from_messages = renderer.render(messages=[user])
    assert from_messages.text == expected_text
    assert from_messages.ids == hf.encode(expected_text, add_special_tokens=False)
    assert renderer.render(prompt="What is 3 + 4?") == from_messages  # prompt text is one user turn
    # The template writes BOS itself (Llama); encoding the text must not add a second one.
    assert from_messages.ids.count(hf.bos_token_id) == (1 if hf.bos_token_id is not None else 0)
    own_system = {"role": "system", "content": "Be terse."}
    rendered = renderer.render(messages=[own_system, user])
    assert "Be terse." in rendered.text and "Answer with a number." not in rendered.text
    assert rendered.text.endswith({"qwen3": "<|im_start|>assistant\n", "llama": "<|end_header_id|>\n\n"}[family])


def test_messages_without_a_chat_template_are_an_error(tiny_hf_models: dict[str, Path]) -> None:
    hf = AutoTokenizer.from_pretrained(tiny_hf_models["qwen3"])
    hf.chat_template = None
    renderer = PromptRenderer(HFTokenizer(hf))
    assert renderer.render(prompt="1 + 1?").ids == hf.encode("1 + 1?")
    with pytest.raises(ValueError, match="no chat template"):
        renderer.render(messages=[{"role": "user", "content": "1 + 1?"}])


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_data_rows_with_messages_and_extra_fields(tiny_hf_models: dict[str, Path], tmp_path: Path, fmt: str) -> None:
    rows = [
        {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "answer": "4", "level": 1, "source": "a"},
        {"prompt": "What is 5 - 3?", "answer": "2", "level": 2, "source": "b"},
    ]
    path = tmp_path / f"train.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        # A Parquet file has one schema: every row has every column, null where unused.
        columns = {k for r in rows for k in r}
        pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in sorted(columns)} for r in rows]), path)
    tokenizer = load_tokenizer(tiny_hf_models["qwen3"])
    spec = DataSpec(**{fmt: str(path)}, shuffle=False, system_prompt="Be brief.")
    stream = PromptStream.from_spec(spec, tokenizer, max_epochs=1)
    first, second = stream.next_prompt(), stream.next_prompt()
    renderer = PromptRenderer(tokenizer, "Be brief.")
    assert first.prompt_ids == renderer.render(prompt="What is 2 + 2?").ids
    assert second.prompt_ids == renderer.render(prompt="What is 5 - 3?").ids
    assert (first.answer, second.answer) == ("4", "2")
    assert first.metadata == {"level": 1, "source": "a"} and second.metadata == {"level": 2, "source": "b"}


def test_bad_rows_name_the_file_and_row(tmp_path: Path) -> None:
    from rljob.runtime.tasks.dataset import load_jsonl_records

    path = tmp_path / "bad.jsonl"
    path.write_text('{"answer": "1", "messages": [{"role": "user"}]}\n')
    with pytest.raises(ValueError, match=r"no usable records; first problem: data.jsonl: .*bad.jsonl:1: messages\[0\] must be an object with string"):
        load_jsonl_records(path)


# ------------------------------------------------------------------------------------------ model sources


def _fill_hub_cache(cache: Path, repo_id: str, folder: Path, commit: str, branch: str = "main") -> Path:
    """Lay `folder` out as huggingface_hub's cache does: snapshots/<commit>/ plus refs/<branch>."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in folder.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / branch).write_text(commit)
    return snapshot


def test_hugging_face_id_resolves_offline_in_the_cache(
    tiny_hf_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "hf-home" / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = _fill_hub_cache(cache, "tiny/qwen3", tiny_hf_models["qwen3"], commit, branch="v1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    assert resolve_model_dir(ModelSpec(hugging_face="tiny/qwen3", revision="v1")) == (snapshot, "spec.model.huggingFace")
    assert resolve_model_dir(ModelSpec(hugging_face="tiny/qwen3", revision=commit))[0] == snapshot
    policy = open_policy(ModelSpec(hugging_face="tiny/qwen3", revision="v1"))
    assert type(policy.model).__name__ == "Qwen3ForCausalLM"


def test_missing_models_name_the_field_and_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(ModelSourceError, match=r"spec.model.huggingFace: 'Qwen/Qwen3-4B' .*not in the local Hugging Face cache .*empty-cache"):
        open_policy(ModelSpec(hugging_face="Qwen/Qwen3-4B"))
    with pytest.raises(ModelSourceError, match=r"spec.model.path: .*nowhere does not exist"):
        open_policy(ModelSpec(path=str(tmp_path / "nowhere")))
    with pytest.raises(ModelSourceError, match=r"spec.model.path: .*\(no config.json\)"):
        open_policy(ModelSpec(path=str(tmp_path)))
    with pytest.raises(ModelSourceError, match=r"spec.model.path: pvc://models/q names a claim, which only the operator"):
        open_policy(ModelSpec(path="pvc://models/q"))


def test_unsupported_architecture_is_an_error_naming_the_field(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64)).save_pretrained(tmp_path)
    with pytest.raises(ModelSourceError, match=r"spec.model.path: model type 'gpt2' is not supported"):
        load_causal_lm(tmp_path)


def test_loaded_folder_equals_what_transformers_loads(tiny_hf_models: dict[str, Path]) -> None:
    ours = load_causal_lm(tiny_hf_models["llama"])
    theirs = AutoModelForCausalLM.from_pretrained(tiny_hf_models["llama"])
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    assert all(torch.equal(a, theirs.state_dict()[k]) for k, a in ours.state_dict().items())


async def test_stop_strings_end_a_response_where_the_text_first_contains_one(tiny_hf_models: dict[str, Path]) -> None:
    folder = tiny_hf_models["qwen3"]
    model, tokenizer = load_causal_lm(folder), load_tokenizer(folder)
    engine = EmbeddedEngine(model, max_batch_size=2, detokenize=tokenizer.decode)
    plain = EmbeddedEngine(model, max_batch_size=2)
    try:
        free = await plain.generate(GenerateRequest("free", PROMPTS[0], 40, temperature=0.0))
        text = tokenizer.decode(free.output_ids)
        # Cut the greedy continuation after its 10th token: the stop string is its text there.
        stop = tokenizer.decode(free.output_ids[8:10]).strip() or tokenizer.decode(free.output_ids[:10])
        first = min(n for n in range(1, len(free.output_ids) + 1) if stop in tokenizer.decode(free.output_ids[:n]))
        stopped = await engine.generate(GenerateRequest("stopped", PROMPTS[0], 40, temperature=0.0, stop=[stop]))
        with pytest.raises(InvalidRequestError, match="no tokenizer"):
            await plain.generate(GenerateRequest("no-tok", PROMPTS[0], 5, stop=[stop]))
    finally:
        await engine.close()
        await plain.close()
    assert stop in text
    assert stopped.finish_reason == "stop"
    assert stopped.output_ids == free.output_ids[:first]  # ends on the token completing the stop string


def test_stop_string_detection_looks_past_tokens_that_decode_to_nothing() -> None:
    from rljob.runtime.engines.embedded import _Sequence

    pieces = {1: "ab", 2: "", 3: "c", 4: "d"}  # 2 plays a special token: no text

    def detokenize(ids: list[int]) -> str:
        return "".join(pieces[i] for i in ids)

    seq = _Sequence(GenerateRequest("s", [9], 10, stop=["abc"]), future=None)  # type: ignore[arg-type]
    for token in (1, 2, 2, 2):
        seq.take(token, 0.0, detokenize)
        assert seq.finish_reason is None
    seq.take(3, 0.0, detokenize)  # "ab" + "" * 3 + "c": the stop string spans five tokens
    assert seq.finish_reason == "stop" and seq.output_ids == [1, 2, 2, 2, 3]


def test_data_spec_takes_exactly_one_source_and_held_out_parquet(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pydantic import ValidationError

    from rljob.api.spec import EvaluationSpec
    from rljob.runtime.tasks.dataset import held_out_records

    with pytest.raises(ValidationError, match="exactly one of synthetic, jsonl, parquet must be set"):
        DataSpec(jsonl="a.jsonl", parquet="a.parquet")
    path = tmp_path / "held-out.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": f"{i} + 1?", "answer": str(i + 1)} for i in range(5)]), path)
    rows = held_out_records(DataSpec(jsonl="train.jsonl"), EvaluationSpec(every_steps=1, prompts=3, parquet=str(path)))
    assert [(r.prompt, r.answer) for r in rows] == [("0 + 1?", "1"), ("1 + 1?", "2"), ("2 + 1?", "3")]
