"""Load a Hugging Face causal LM folder for training or serving: one code path for trainer and engine.

Only architectures whose attention the embedded engine's slot KV cache is known to drive are
accepted (Qwen2/2.5, Qwen3, Llama 3): the engine hands the model's own forward a cache object and
a 4D mask, which works for any decoder whose every layer is full (global) attention and writes one
key/value column per token. Sliding-window or hybrid layers (Gemma 2/3, Qwen3-Next) need another
cache layout, so they fail here with a clear message instead of generating garbage later.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from rljob.runtime.models.source import ModelSourceError

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
DTypeName = Literal["float32", "bfloat16"]
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def torch_dtype(name: DTypeName | str) -> torch.dtype:
    """torch dtype of a spec dtype name."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not one of {sorted(DTYPES)}") from None


def check_architecture(config: PretrainedConfig, field: str = "spec.model.path") -> None:
    """Raise ModelSourceError naming `field` unless the engine and trainer support this architecture."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelSourceError(
            f"{field}: model type {model_type!r} is not supported; supported causal LMs: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (Qwen2/2.5, Qwen3, Llama 3 families)"
        )
    layer_types = getattr(config, "layer_types", None) or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other or getattr(config, "use_sliding_window", False):
        raise ModelSourceError(
            f"{field}: layers of type {other or ['sliding_attention']} are not supported by the embedded engine's "
            "KV cache; use a checkpoint whose layers are all full attention (use_sliding_window: false)"
        )


def read_config(directory: Path, field: str = "spec.model.path") -> PretrainedConfig:
    """The model config of a folder, checked; errors name `field`."""
    from transformers import AutoConfig

    if not (directory / "config.json").is_file():
        raise ModelSourceError(
            f"{field}: {directory} is not a Hugging Face model folder (no config.json); point it at a folder "
            "written by save_pretrained"
        )
    try:
        config = AutoConfig.from_pretrained(str(directory))
    except (OSError, ValueError, KeyError) as exc:
        raise ModelSourceError(f"{field}: cannot read {directory / 'config.json'}: {exc}") from None
    check_architecture(config, field)
    return config


def load_causal_lm(
    directory: str | Path,
    *,
    field: str = "spec.model.path",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> PreTrainedModel:
    """The model of a save_pretrained folder in `dtype` on `device`, in eval mode (no dropout).

    SDPA attention is requested: it is the implementation whose 4D-mask path the engine relies on.
    """
    from transformers import AutoModelForCausalLM

    path = Path(directory)
    read_config(path, field)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa")
    except (OSError, ValueError) as exc:
        raise ModelSourceError(f"{field}: cannot load the model weights of {path}: {exc}") from None
    return model.to(device).eval()  # type: ignore[arg-type]  # transformers' decorated .to: mypy mis-binds it


def stop_token_ids(model: PreTrainedModel, tokenizer_eos: int | None) -> list[int]:
    """Every id that ends a response: the tokenizer's EOS and each `eos_token_id` of the generation config.

    Chat models end a turn with a token the tokenizer does not call EOS (Qwen's `<|im_end|>`,
    Llama 3's `<|eot_id|>`), listed only in generation_config.json; missing it lets responses run on.
    """
    ids: list[int] = []

    def add(value: int | list[int] | None) -> None:
        for v in [value] if isinstance(value, int) else (value or []):
            if int(v) not in ids:
                ids.append(int(v))

    add(tokenizer_eos)
    generation = getattr(model, "generation_config", None)
    add(getattr(generation, "eos_token_id", None))
    if not ids:
        add(getattr(model.config, "eos_token_id", None))
    return ids


def enable_gradient_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each decoder layer's activations in backward instead of storing them.

    Transformers checkpoints a layer only in training mode, so the trainer runs checkpointed models
    in train mode; that equals eval mode only without dropout, hence the dropout check here (the PPO
    ratio needs the old and new log-probs of identical forwards).
    """
    dropouts = {
        name: float(getattr(model.config, name))
        for name in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop")
        if getattr(model.config, name, 0.0)
    }
    if dropouts:
        raise ModelSourceError(
            f"spec.trainer.gradientCheckpointing: the model has dropout {dropouts}; RL training needs it at 0 "
            "(set it in config.json)"
        )
    # Non-reentrant checkpointing: works with inputs that need no grad and with keyword arguments.
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:  # transformers >= 5 (gradient_checkpointing_enable is its deprecated alias)
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False


def is_checkpointing(model: torch.nn.Module) -> bool:
    """True when activation (gradient) checkpointing is on for a Hugging Face model."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # transformers >= 5, then < 5
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False
