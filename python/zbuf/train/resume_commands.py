"""The command lines that resume a run, printed where a run stops or a resume is refused: after
an interrupt (``resume with: ...``) and beside a damaged newest checkpoint (the previous one's
``--resume-from``). Whole lines to copy as they are: the run's own options, never
``zbuf train ...``."""

from __future__ import annotations

import shlex
from typing import Callable, Optional

__all__ = ["TORCHRUN", "resume_command", "resume_from_command"]


TORCHRUN = "torchrun <your torchrun options> -m zbuf.cli"
"""The launcher of a resume command under torchrun, whose own options are not known here: the
user puts theirs back."""


def resume_command(argv: list[str], launcher: str = "zbuf",
                   resume_from: Optional[str] = None) -> str:
    """The command line that continues a run started with ``launcher argv...`` (``launcher``
    as written, unquoted): the same options, with ``--resume`` (in place of a
    ``--resume-from``, which would go back to that step), or ``--resume-from resume_from``."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--resume-from":
            skip = True
        elif not arg.startswith("--resume-from=") and arg != "--resume":
            out.append(arg)
    tail = ["--resume-from", resume_from] if resume_from is not None else ["--resume"]
    return f"{launcher} {shlex.join([*out, *tail])}"


def resume_from_command(argv: Optional[list[str]],
                        launcher: str = "zbuf") -> Optional[Callable[[str], str]]:
    """Checkpoint name -> the command that resumes from it (``refusals.checkpoint_refusal``);
    None without the command's arguments (``run`` called from Python)."""
    if not argv:
        return None
    return lambda name: resume_command(argv, launcher, resume_from=name)
