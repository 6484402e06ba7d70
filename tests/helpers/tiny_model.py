"""A tiny random-init causal LM for engine tests: real Hugging Face classes, token ids in and out.

The initializer range is wider than a trained model's so that logits are peaked: greedy decoding then
has clear winners and batched-vs-single comparisons are not decided by float noise between near-ties.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

TINY_VOCAB = 128


def tiny_config(vocab_size: int = TINY_VOCAB, hidden_size: int = 64, layers: int = 2) -> Qwen2Config:
    """A 2-layer Qwen2 config (grouped-query attention: 4 heads, 2 KV heads)."""
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.5,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )


def build_tiny_model(seed: int = 0, **config_overrides: int) -> Qwen2ForCausalLM:
    """A freshly initialised tiny model; the same seed gives the same weights."""
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(tiny_config(**config_overrides))
    return model.eval()


def save_tiny_model(directory: Path, seed: int = 0) -> Path:
    """Save a tiny model with ``save_pretrained`` (safetensors) into ``directory``; returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    build_tiny_model(seed).save_pretrained(directory)
    return directory
