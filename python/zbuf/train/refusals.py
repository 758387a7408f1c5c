"""What ``zbuf train`` / ``zbuf bench`` say when the ranks refuse the input: a checkpoint that
cannot be resumed, a plan that does not fit. Both are the user's input, not a fault of zbuf: one
line naming the problem and the fix in the command's own options, exit status 2.

[Note: a plan that does not fit, on the command line]
``PlanExceedsMemoryError`` words its fix for a ``zbuf.compile`` caller (``recompute='auto'``,
"the micro-batch"). A ``zbuf train`` user changes options, not Python arguments, so the CLI words
it from the error's numbers: what needs how much, what every rank has, and which options give
room, with their values now (``--micro-batch 4096 --steps 4`` on CPU used to end in 83 lines of
Dynamo traceback and exit 1, the refusal buried in the middle). Every rank raises it alike (its
inputs are rank-agreed), so rank 0 says it once.
"""

from __future__ import annotations

from typing import Callable, Optional

from .config import TrainConfig, format_bytes
from .save_resume import way_back

__all__ = ["plan_refusal", "checkpoint_refusal"]


def plan_refusal(cfg: TrainConfig, error) -> str:
    """The line for a ``PlanExceedsMemoryError`` of a run of ``cfg`` (resolved, one run's)."""
    # More room: a larger emulated card, or more GPUs to shard the model's state over (CPU
    # ranks share one host's memory: more of them leave each less, [Note: ranks share the host]
    # in zbuf/compile/budget.py).
    room = ["give each rank more memory (a larger --gpu-memory)"] if cfg.gpu_memory is not None \
        else ["shard over more GPUs"] if cfg.device == "cuda" else []
    if error.short_of == "optimizer":
        fixes = [f"use --optimizer adamw-fused (now {cfg.optimizer})", *room]
    elif error.short_of == "block weights":
        fixes = ["use --compile-structure graph", *room]
    else:
        fixes = [f"lower --micro-batch (now {cfg.micro_batch}) or --seq-len (now {cfg.seq_len})"]
        if cfg.ac in ("off", "selective"):
            fixes.append(f"checkpoint activations with --ac full or --ac auto (now {cfg.ac})")
        fixes.extend(room)
    advice = fixes[0] if len(fixes) == 1 else f"{', '.join(fixes[:-1])}, or {fixes[-1]}"
    card = (f"of --gpu-memory {format_bytes(cfg.gpu_memory)}" if cfg.gpu_memory is not None
            else "of the GPU's free memory" if cfg.device == "cuda" else
            "of its share of the host's free memory")
    return (f"{error.what} needs {format_bytes(error.needs_bytes)} but every rank has "
            f"{format_bytes(error.memory_bytes)} for it ({card}, less the model's state and a "
            f"margin); {advice}")


def checkpoint_refusal(error, resume_from: Optional[Callable[[str], str]] = None) -> str:
    """The line for a ``CheckpointError``: its message, led by the option it concerns. A message
    of ``zbuf.train.save_resume`` already names its option (``--resume: ...``); the checkpoint
    protocol's own concern ``--resume``. ``resume_from``: checkpoint name -> the whole command
    line that resumes from it, for a damaged newest checkpoint's way back (never ``zbuf train
    ...``: a line to copy as it is)."""
    back = getattr(error, "way_back", None)
    if back is not None and resume_from is not None:
        return f"{error.problem}. {way_back(back, resume_from(back))}"
    text = str(error)
    return text if text.startswith("--") else f"--resume: {text}"
