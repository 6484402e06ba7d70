"""Errors a user can cause with a model source or an export; light to import (the CLI catches them)."""

from __future__ import annotations


class ModelSourceError(ValueError):
    """A job's model cannot be found or used; the message names the field and what to do."""


class ExportError(ValueError):
    """A checkpoint or an export target cannot be used; the message says what to do."""
