"""``ConfigError``: the one exception of a bad ``zbuf train`` / ``zbuf bench`` option.

A module of its own so that every module that checks options (config, options, hf, resources)
imports it without importing the others."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A user option that cannot work; the message says which and how to fix it."""
