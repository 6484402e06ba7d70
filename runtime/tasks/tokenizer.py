"""Tokenizers behind one small protocol: the built-in character tokenizer and a Hugging Face adapter.

Everything in the runtime (prompt streams, engines, reward decoding, the trainer) talks to a
`TaskTokenizer`, so the synthetic task and a real dataset with a local Hugging Face tokenizer go
through the same code path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CHAR_TOKENIZER_FILE = "char_tokenizer.json"

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)

# Digits, the arithmetic operators and the punctuation the synthetic task writes, plus lowercase
# letters so short instructions ("sum", "mod") can be spelled.
DEFAULT_ALPHABET = "0123456789+-*/%=#.,:;()[]{}\\ \n?abcdefghijklmnopqrstuvwxyz"


@runtime_checkable
class TaskTokenizer(Protocol):
    """What the runtime needs from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_id(self) -> int: ...

    @property
    def pad_token_id(self) -> int: ...

    def encode(self, text: str) -> list[int]:
        """Token ids of text, without special tokens."""
        ...

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a prompt as the model expects it at the start of a sequence (BOS when it has one)."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text of ids, special tokens dropped."""
        ...

    def save(self, directory: str | Path) -> None:
        """Write the tokenizer files into directory (next to a save_pretrained model)."""
        ...


class CharTokenizer:
    """One token per character over a fixed alphabet; ids 0..2 are PAD, BOS, EOS."""

    def __init__(self, alphabet: str = DEFAULT_ALPHABET) -> None:
        if len(set(alphabet)) != len(alphabet):
            raise ValueError("tokenizer alphabet has repeated characters")
        self.alphabet = alphabet
        self._id_of = {ch: i + len(SPECIAL_TOKENS) for i, ch in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(SPECIAL_TOKENS) + len(self.alphabet)

    @property
    def pad_token_id(self) -> int:
        return 0

    @property
    def bos_token_id(self) -> int:
        return 1

    @property
    def eos_token_id(self) -> int:
        return 2

    def encode(self, text: str) -> list[int]:
        try:
            return [self._id_of[ch] for ch in text]
        except KeyError as exc:
            raise ValueError(
                f"character {exc.args[0]!r} is not in the built-in tokenizer's alphabet; "
                "use a model with its own tokenizer (model.path) for free text"
            ) from None

    def encode_prompt(self, text: str) -> list[int]:
        return [self.bos_token_id, *self.encode(text)]

    def decode(self, ids: list[int]) -> str:
        first = len(SPECIAL_TOKENS)
        return "".join(self.alphabet[i - first] for i in ids if first <= i < self.vocab_size)

    def save(self, directory: str | Path) -> None:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        payload = {"type": "char", "alphabet": self.alphabet, "special_tokens": list(SPECIAL_TOKENS)}
        (path / CHAR_TOKENIZER_FILE).write_text(json.dumps(payload, indent=2))

    @classmethod
    def load(cls, directory: str | Path) -> CharTokenizer:
        payload = json.loads((Path(directory) / CHAR_TOKENIZER_FILE).read_text())
        return cls(alphabet=payload["alphabet"])


class HFTokenizer:
    """Adapter from a `transformers` tokenizer to `TaskTokenizer`."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError("the Hugging Face tokenizer has no eos_token_id; set eos_token in tokenizer_config.json")
        self.tokenizer = tokenizer

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def eos_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def pad_token_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad) if pad is not None else self.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_prompt(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    @property
    def has_chat_template(self) -> bool:
        """True when the tokenizer carries a chat template (tokenizer_config.json or chat_template.jinja)."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        """The conversation rendered by the chat template, ending with the assistant's generation prompt."""
        return str(self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def save(self, directory: str | Path) -> None:
        self.tokenizer.save_pretrained(str(directory))


def load_tokenizer(directory: str | Path) -> TaskTokenizer:
    """Load the tokenizer saved in directory: the char tokenizer if its file is there, else AutoTokenizer."""
    path = Path(directory)
    if (path / CHAR_TOKENIZER_FILE).exists():
        return CharTokenizer.load(path)
    from transformers import AutoTokenizer

    try:
        return HFTokenizer(AutoTokenizer.from_pretrained(str(path)))
    except (OSError, ValueError) as exc:
        raise ValueError(f"no usable tokenizer in {path}: {exc}. Put the tokenizer files next to the model.") from exc
