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
    """The checkpoint's files are damaged (truncated, corrupted, missing); nothing was loaded.

    ``problem``: what is wrong, without the advice of the message (a caller words its own);
    ``way_back``: the name of the run's previous complete checkpoint (``step_00000003``) when
    ``zbuf train --resume`` refused its newest one, for the command that resumes from it; None
    otherwise."""

    def __init__(self, message: str, *, problem: str | None = None,
                 way_back: str | None = None) -> None:
        super().__init__(message)
        self.problem = problem if problem is not None else message
        self.way_back = way_back


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint belongs to another model or optimizer; nothing was loaded."""


class LayoutError(CheckpointError, ValueError):
    """The model or optimizer is not something a zbuf checkpoint can describe (bad argument)."""
