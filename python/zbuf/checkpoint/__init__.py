"""``zbuf.checkpoint``: sharded, atomic, verified checkpoints of zbuf models and optimizers (DCP).

- ``protocol.py``: ``save_checkpoint`` / ``load_checkpoint`` and the rank agreement around them
  ([Note: validate, then load]);
- ``layout.py``: how a sharded model and its optimizer map onto a DCP state dict and back
  ([Note: checkpoint layout]);
- ``files.py``: checkpoint directories on disk ([Note: atomic checkpoint commit], [Note:
  checkpoint integrity]), ``checkpoint_path``, ``list_checkpoints``, ``latest_checkpoint``;
- ``errors.py``: the errors, each naming what is wrong and what to do.

When a training loop saves and resumes (``zbuf train --save-every/--resume``) is
``zbuf.train.save_resume``.
"""

from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    LayoutError,
)
from .files import checkpoint_path, latest_checkpoint, list_checkpoints, prune
from .protocol import (
    FORMAT_VERSION,
    CheckpointInfo,
    load_checkpoint,
    read_checkpoint_info,
    resolve_checkpoint,
    save_checkpoint,
)

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "resolve_checkpoint",
    "read_checkpoint_info",
    "checkpoint_path",
    "latest_checkpoint",
    "list_checkpoints",
    "prune",
    "CheckpointInfo",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "LayoutError",
    "FORMAT_VERSION",
]
