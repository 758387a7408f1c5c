"""``ConfigError``: the one exception of a bad ``zbuf train`` / ``zbuf bench`` option, and
``print_error``: how the command says it.

A module of its own so that every module that checks options (config, options, hf, resources)
imports it without importing the others, and so that the command refuses a bad option without
importing torch (which takes seconds)."""

from __future__ import annotations

__all__ = ["ConfigError", "print_error"]


class ConfigError(ValueError):
    """A user option that cannot work; the message says which and how to fix it."""


def print_error(command: str, message: str) -> None:
    """``zbuf <command>: error: <message>`` on stderr, unwrapped and without markup parsing (a
    message may hold paths and brackets)."""
    from rich.console import Console
    from rich.text import Text

    Console(stderr=True, soft_wrap=True).print(
        Text.assemble((f"zbuf {command}: error: ", "bold red"), str(message)))
