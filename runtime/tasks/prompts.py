"""Turn a data row (prompt text or chat messages, optional system prompt) into the model's prompt ids.

Chat models are trained on their chat template; a raw prompt without the template's role markers
and generation prompt is out of distribution, so whenever the tokenizer has a template it is used,
for `prompt` text too (as one user message). The template is rendered to text and then tokenized
without extra special tokens, as SGLang's chat endpoint does: the template already writes BOS where
the family wants one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rljob.runtime.tasks.tokenizer import TaskTokenizer

Message = dict[str, Any]


@dataclass(frozen=True)
class RenderedPrompt:
    """A prompt as the engine sees it: ids, and the text they decode from (for logs and rewards)."""

    text: str
    ids: list[int]


def chat_messages(prompt: str | None, messages: list[Message] | None, system_prompt: str | None) -> list[Message]:
    """The conversation of a row: its messages, or its prompt as one user turn, after the system prompt.

    A row that brings its own system message keeps it: the job-wide system prompt is a default.
    """
    if messages is None:
        if prompt is None:
            raise ValueError("a data row needs prompt text or messages")
        messages = [{"role": "user", "content": prompt}]
    if system_prompt is not None and not (messages and messages[0].get("role") == "system"):
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return messages


class PromptRenderer:
    """Renders rows for one tokenizer; see the module docstring for when the chat template applies."""

    def __init__(self, tokenizer: TaskTokenizer, system_prompt: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.chat = bool(getattr(tokenizer, "has_chat_template", False))

    def render(self, prompt: str | None = None, messages: list[Message] | None = None) -> RenderedPrompt:
        """Prompt ids for a row with `prompt` text or `messages`."""
        if self.chat:
            text = self.tokenizer.apply_chat_template(chat_messages(prompt, messages, self.system_prompt))  # type: ignore[attr-defined]
            return RenderedPrompt(text=text, ids=self.tokenizer.encode(text))
        if messages is not None:
            raise ValueError(
                "data rows have chat messages but the model's tokenizer has no chat template; give rows `prompt` "
                "text, or use a model whose tokenizer_config.json (or chat_template.jinja) has a chat template"
            )
        if prompt is None:
            raise ValueError("a data row needs prompt text or messages")
        text = prompt if self.system_prompt is None else f"{self.system_prompt}\n\n{prompt}"
        return RenderedPrompt(text=text, ids=self.tokenizer.encode_prompt(text))
