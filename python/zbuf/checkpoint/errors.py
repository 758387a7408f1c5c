"""Errors of ``zbuf.checkpoint``: each names what is wrong with which checkpoint and what to do."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "LayoutError",
]


class CheckpointError(RuntimeError):
    """Base class of every checkpoint save/load error."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No complete checkpoint at the given path."""


class CheckpointCorruptError(CheckpointError):
    """The checkpoint's files are damaged (truncated, corrupted, missing); nothing was loaded."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint belongs to another model or optimizer; nothing was loaded."""


class LayoutError(CheckpointError, ValueError):
    """The model or optimizer is not something a zbuf checkpoint can describe (bad argument)."""
