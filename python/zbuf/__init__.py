"""zbuf: ZeRO-3 training for torch.compile.

The public surface:

- ``GatherBufferPool`` / ``PoolStats`` / ``default_pool``: the Rust gather-buffer pool.
- ``shard`` / ``full_state_dict`` / ``load_full_state_dict`` / ``clip_grad_norm_``: the ZeRO-3
  parameter model.
- ``compile`` (callable: ``zbuf.compile(model, budget_bytes=None, prefetch=True, persist=True)``),
  ``schedule_report``, ``ScheduleMismatchError``: the ``torch.compile`` backend ``"zbuf"``.
- ``save_checkpoint`` / ``load_checkpoint``: sharded, atomic checkpoints through DCP.
- ``models``: the built-in Qwen3-shaped decoder presets.
"""

# zbuf.compile and zbuf.shard are callable modules: zbuf.shard(model) and zbuf.shard.<helper>
# both work.
from . import compile, models, shard  # noqa: A004
from .checkpoint import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    load_checkpoint,
    save_checkpoint,
)
from .clip import clip_grad_norm_
from .compile import ScheduleMismatchError, schedule_report
from .errors import (
    DoubleReleaseError,
    ForeignBufferError,
    InvalidDeviceError,
    InvalidRequestError,
    NoCudaDriverError,
    PoolBackendError,
    PoolError,
    PoolOutOfMemoryError,
    UnsupportedDtypeError,
)
from .pool import GatherBufferPool, PoolStats, default_pool
from .shard import ShardingError
from .state_dict import full_state_dict, load_full_state_dict

__version__ = "0.1.0"

__all__ = [
    "GatherBufferPool",
    "PoolStats",
    "default_pool",
    "PoolError",
    "ForeignBufferError",
    "DoubleReleaseError",
    "PoolOutOfMemoryError",
    "NoCudaDriverError",
    "InvalidDeviceError",
    "InvalidRequestError",
    "UnsupportedDtypeError",
    "PoolBackendError",
    "shard",
    "ShardingError",
    "full_state_dict",
    "load_full_state_dict",
    "clip_grad_norm_",
    "compile",
    "schedule_report",
    "ScheduleMismatchError",
    "save_checkpoint",
    "load_checkpoint",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "models",
]
