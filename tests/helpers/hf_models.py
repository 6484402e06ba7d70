"""Tiny random Qwen3 and Llama 3 model folders (locally trained tokenizer, chat template), built once per session.

The weights use a wide initializer range so logits are peaked: greedy decoding then has clear
winners, and comparisons between batched and single-sequence decoding are not decided by float
noise between near-ties.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rljob.runtime.models.tiny import TinyModelRecipe, build_tiny_model

FAMILIES = ("qwen3", "llama")


def recipe_for(family: str) -> TinyModelRecipe:
    """The recipe of the test model of one family."""
    return TinyModelRecipe(family=family, initializer_range=0.3, seed=1)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def tiny_hf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """family -> model folder, for every family in FAMILIES."""
    root = tmp_path_factory.mktemp("tiny-hf-models")
    return {family: build_tiny_model(root / family, recipe_for(family)) for family in FAMILIES}
