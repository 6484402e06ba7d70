"""Read an RLJob YAML file into the shared models, with one clear error per problem."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rljob.api.spec import RLJob


class RLJobConfigError(ValueError):
    """A user-caused problem in an RLJob document; the message names the field path."""


def _field_path(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts[-1] = f"{parts[-1]}[{item}]" if parts else f"[{item}]"
        elif isinstance(item, str) and not item.startswith(("function-", "literal[", "union[")):
            parts.append(item)
    return ".".join(parts) or "<document>"


def format_validation_error(err: ValidationError, source: str) -> str:
    """Turn a pydantic error into lines of `source: field.path: message`."""
    lines = []
    for e in err.errors():
        path = _field_path(tuple(e["loc"]))
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field (check spelling and indentation)"
        lines.append(f"{source}: {path}: {msg}")
    return "\n".join(lines)


def parse_rljob(document: Any, source: str = "<rljob>") -> RLJob:
    """Validate a parsed YAML/JSON document as an RLJob."""
    if not isinstance(document, dict):
        raise RLJobConfigError(f"{source}: expected a mapping with apiVersion, kind, metadata, spec")
    try:
        return RLJob.model_validate(document)
    except ValidationError as err:
        raise RLJobConfigError(format_validation_error(err, source)) from None


def load_rljob(path: str | Path) -> RLJob:
    """Load and validate an RLJob YAML file; raises RLJobConfigError naming the field on bad input."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as err:
        raise RLJobConfigError(f"{p}: cannot read file ({err.strerror})") from None
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise RLJobConfigError(f"{p}: not valid YAML: {err}") from None
    return parse_rljob(document, str(p))
