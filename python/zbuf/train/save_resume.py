"""When a training loop saves and resumes: the logic behind ``zbuf train --checkpoint-dir D
--save-every N --resume``, kept here so that a loop needs two calls.

::

    policy = SaveResumePolicy(directory=D, save_every=N, resume=True)
    start = policy.resume_step(model, optimizer)         # 0, or the step of the latest checkpoint
    for step in range(start, total_steps):
        train_one_step(step)
        policy.after_step(step + 1, model, optimizer)    # saves when step + 1 is a multiple of N

[Note: checkpoint step numbering]
A checkpoint's ``step`` is the number of optimizer steps completed, which is also the index of the
next step to run. zbuf's training data is a pure function of the step index
(``zbuf.train.data``), so ``range(resume_step, total)`` replays exactly what the uninterrupted run
would have done, and the resumed run's parameters and optimizer state are bit-identical to it
(``tests/test_checkpoint.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .. import checkpoint as ckpt
from ..checkpoint import layout

__all__ = ["SaveResumePolicy"]


@dataclass(frozen=True)
class SaveResumePolicy:
    """Where and how often a training loop checkpoints. Validated on construction."""

    directory: Optional[str] = None
    """Root of the ``step_<N>`` checkpoints; None: no checkpoints (the other fields must be unset)."""
    save_every: Optional[int] = None
    """Save after every this many completed steps; None: never save (resume only)."""
    resume: bool = False
    """Start from the latest complete checkpoint under ``directory`` if there is one (a fresh
    start otherwise, so the same command line serves the first run and every restart)."""
    keep_last: int = 2
    """Complete checkpoints kept; older ones are deleted after each save (two, so that a
    checkpoint that turns out damaged still has a predecessor)."""

    def __post_init__(self) -> None:
        if self.directory is None:
            if self.save_every is not None or self.resume:
                raise ValueError("--save-every and --resume need --checkpoint-dir DIR: where checkpoints go")
        elif not isinstance(self.directory, (str, Path)) or not str(self.directory):
            raise ValueError(f"checkpoint directory must be a path, got {self.directory!r}")
        if self.save_every is not None and (
            isinstance(self.save_every, bool) or not isinstance(self.save_every, int) or self.save_every < 1
        ):
            raise ValueError(f"save_every must be a positive int (steps), got {self.save_every!r}")
        if not isinstance(self.resume, bool):
            raise ValueError(f"resume must be a bool, got {self.resume!r}")
        if isinstance(self.keep_last, bool) or not isinstance(self.keep_last, int) or self.keep_last < 1:
            raise ValueError(f"keep_last must be an int >= 1, got {self.keep_last!r}")

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def resume_step(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> int:
        """Load the latest checkpoint if ``resume`` and one exists; the step to continue from.

        Collective over the model's sharding group (rank 0 looks, every rank follows).
        """
        if not (self.enabled and self.resume):
            return 0
        group = _group_of(model)
        box = [ckpt.latest_checkpoint(self.directory) is not None if dist.get_rank(group) == 0 else None]
        dist.broadcast_object_list(box, group_src=0, group=group)
        if not box[0]:
            return 0
        return ckpt.load_checkpoint(self.directory, model, optimizer).step

    def after_step(self, steps_done: int, model: nn.Module,
                   optimizer: Optional[torch.optim.Optimizer]) -> Optional[Path]:
        """Save if ``steps_done`` is a multiple of ``save_every``; returns the checkpoint path.

        Collective over the model's sharding group when it saves (every rank calls it every step).
        """
        if not self.enabled or self.save_every is None or steps_done % self.save_every:
            return None
        path = ckpt.save_checkpoint(ckpt.checkpoint_path(self.directory, steps_done), model, optimizer,
                                    step=steps_done)
        group = _group_of(model)
        if dist.get_rank(group) == 0:
            ckpt.prune(self.directory, keep_last=self.keep_last)
        return path


def _group_of(model: nn.Module) -> dist.ProcessGroup:
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        model = model._orig_mod
    return layout.inventory(model).group  # raises the save/load message for unsharded models
