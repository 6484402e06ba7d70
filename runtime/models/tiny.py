"""Tiny random Qwen3 and Llama 3 model folders with a locally trained tokenizer and a chat template.

Nothing can be downloaded here, yet the runtime must be exercised on the real architectures people
post-train (grouped-query attention, Qwen3's q/k-norm and explicit head_dim, Llama 3's rope scaling,
chat templates, several stop tokens). These folders are exactly what `save_pretrained` writes for such
models, only small: a byte-level BPE tokenizer trained by the `tokenizers` library on a generated
arithmetic corpus (digits split one per token, as Qwen's and Llama 3's tokenizers do), the family's
special tokens and a chat template in the family's format, a `generation_config.json` whose
`eos_token_id` lists both the end-of-turn and the end-of-text token, and random weights.

They back `model.builtin: tiny-qwen3` / `tiny-llama` (built into the rljob cache on first use, see
policy.py), the `rljob model build` command and the architecture tests.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

Family = Literal["qwen3", "llama"]
RECIPE_FILE = "tiny_recipe.json"
BUILD_FORMAT = 1  # bump when the builder changes in a way the recipe fields do not capture

# ChatML, the format of Qwen2/2.5/3 chat models (written here, not copied from a model card).
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# Llama 3's header/eot format.
LLAMA3_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)


@dataclass(frozen=True)
class FamilyTokens:
    """Special tokens of one model family and which of them play which role."""

    specials: tuple[str, ...]
    eos: str  # the tokenizer's eos_token: the end of an assistant turn
    pad: str
    bos: str | None
    end_of_text: str  # also a stop token in generation_config.json
    template: str


FAMILIES: dict[str, FamilyTokens] = {
    "qwen3": FamilyTokens(
        specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        eos="<|im_end|>",
        pad="<|endoftext|>",
        bos=None,
        end_of_text="<|endoftext|>",
        template=CHATML_TEMPLATE,
    ),
    "llama": FamilyTokens(
        specials=("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        eos="<|eot_id|>",
        pad="<|end_of_text|>",
        bos="<|begin_of_text|>",
        end_of_text="<|end_of_text|>",
        template=LLAMA3_TEMPLATE,
    ),
}


@dataclass(frozen=True)
class TinyModelRecipe:
    """Everything that determines a tiny model folder; its fingerprint names the cached copy."""

    family: Family = "qwen3"
    vocab_size: int = 384  # 256 byte symbols + specials + merges
    hidden_size: int = 64
    intermediate_size: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2  # grouped-query attention
    head_dim: int = 32  # Qwen3 sets head_dim explicitly (not hidden/heads); the engine must honour it
    max_positions: int = 2048
    initializer_range: float = 0.02
    corpus_lines: int = 2000
    seed: int = 0

    def fingerprint(self) -> str:
        """Short hash of the recipe and builder format."""
        payload = json.dumps({"recipe": asdict(self), "format": BUILD_FORMAT}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


def arithmetic_corpus(lines: int, seed: int) -> list[str]:
    """Deterministic training text for the tokenizer: small word problems and their answers."""
    rng = random.Random(seed)
    words = ["What is", "Compute", "Find", "Solve", "The answer is", "so the result is", "Answer:", "####"]
    out = []
    for _ in range(lines):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice(["+", "-", "*"])
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        out.append(f"{rng.choice(words[:4])} {a} {op} {b}? {rng.choice(words[4:])} {value}.")
    return out


def train_tokenizer(recipe: TinyModelRecipe) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of `recipe.vocab_size` tokens with the family's specials and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    family = FAMILIES[recipe.family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.vocab_size,
        special_tokens=list(family.specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(arithmetic_corpus(recipe.corpus_lines, recipe.seed), trainer)
    if family.bos is not None:  # Llama prepends BOS to plain encodings; its chat template writes BOS itself
        bos_id = tok.token_to_id(family.bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{family.bos} $A", pair=f"{family.bos} $A $B", special_tokens=[(family.bos, bos_id)]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=family.eos, pad_token=family.pad, bos_token=family.bos
    )
    fast.chat_template = family.template
    return fast


def tiny_config(recipe: TinyModelRecipe, tokenizer: PreTrainedTokenizerFast) -> PretrainedConfig:
    """The model config of the recipe's family, sized for the tokenizer."""
    family = FAMILIES[recipe.family]
    common: dict[str, Any] = dict(  # keyword arguments of both configs
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.layers,
        num_attention_heads=recipe.heads,
        num_key_value_heads=recipe.kv_heads,
        head_dim=recipe.head_dim,
        max_position_embeddings=recipe.max_positions,
        initializer_range=recipe.initializer_range,
        eos_token_id=tokenizer.convert_tokens_to_ids(family.eos),
        pad_token_id=tokenizer.convert_tokens_to_ids(family.pad),
        bos_token_id=tokenizer.convert_tokens_to_ids(family.bos) if family.bos else None,
    )
    if recipe.family == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(**common, tie_word_embeddings=True, rms_norm_eps=1e-6)
    from transformers import LlamaConfig

    # Llama 3.1's frequency-dependent rope scaling, scaled down to the tiny context.
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": recipe.max_positions // 8,
    }
    return LlamaConfig(**common, tie_word_embeddings=False, rope_parameters=rope)


def build_tiny_model(directory: str | Path, recipe: TinyModelRecipe = TinyModelRecipe()) -> Path:
    """Write the recipe's model folder (safetensors, config, generation config, tokenizer) into directory.

    Written into a temporary sibling and renamed, so a concurrent or interrupted build never leaves a
    half folder behind.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    target = Path(directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    family = FAMILIES[recipe.family]
    tokenizer = train_tokenizer(recipe)
    config = tiny_config(recipe, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.convert_tokens_to_ids(family.eos), tokenizer.convert_tokens_to_ids(family.end_of_text)],
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=config.bos_token_id,
    )
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / RECIPE_FILE).write_text(json.dumps(asdict(recipe), indent=2))
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
