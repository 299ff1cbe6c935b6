"""Errors kdagen raises on purpose. Each says what was expected and what was found."""

from __future__ import annotations


class KdagenError(Exception):
    """Base class: the CLI prints these as one clean message, never a traceback."""


class SpecError(KdagenError):
    def __init__(self, path: str, key: str, message: str) -> None:
        self.path, self.key = path, key
        super().__init__(f"{path}: {key}: {message}")


class BuildError(KdagenError):
    pass


class NoVariantError(KdagenError):
    """No registered variant fits a call: says what is supported, what was found and
    the command that would build a fitting variant."""


class KdaInputError(ValueError, KdagenError):
    """A bad argument to kda_prefill (ValueError so callers may catch it generically)."""
