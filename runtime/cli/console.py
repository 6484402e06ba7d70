"""The console every `rljob` command prints on, and the termination message a pod leaves for the operator."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TypeAlias

from rich.console import Console

# argparse's type for the object add_subparsers returns: each command module adds its parser to it.
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

console = Console()


def terminate(message: str, code: int) -> int:
    """Print `message`, leave it as the container's termination message (the operator reads it), return `code`."""
    from rljob.api.status import TERMINATION_MESSAGE_PATH

    console.print(message, soft_wrap=True)
    path = Path(os.environ.get("RLJOB_TERMINATION_MESSAGE_PATH", TERMINATION_MESSAGE_PATH))
    try:
        path.write_text(message)
    except OSError:
        pass  # not in a pod (or not writable there): the exit code says it
    return code
