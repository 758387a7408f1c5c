"""zbuf: ZeRO-3 training for torch.compile.

The public surface:

- ``GatherBufferPool`` / ``PoolStats`` / ``default_pool``: the Rust gather-buffer pool.
- ``shard`` / ``full_state_dict`` / ``load_full_state_dict`` / ``clip_grad_norm_``: the ZeRO-3
  parameter model.
- ``compile`` (callable: ``zbuf.compile(model, budget_bytes=None, prefetch=True, persist=True,
  optimizer=None)``), ``schedule_report``, ``ScheduleMismatchError``: the ``torch.compile``
  backend ``"zbuf"``, with the whole training step under one measured memory budget
  (``zbuf.step_memory``; ``zbuf.memory``: the pool and torch's allocator on one device).
- ``save_checkpoint`` / ``load_checkpoint`` / ``checkpoint_path`` / ``list_checkpoints`` /
  ``latest_checkpoint``: sharded, atomic checkpoints through DCP (``zbuf.checkpoint``).
- ``models``: the built-in Qwen3-shaped decoder presets.
"""

import os as _os

import torch as _torch

# [Note: no record_stream on pool memory]
# An async NCCL collective makes c10d call ``record_stream`` on its tensors unless
# TORCH_NCCL_AVOID_RECORD_STREAMS is on; the caching allocator then holds the cast shards (and
# any allocator-backed output) until the comm stream passes that point: blocks freed late, reused
# late, the churn the pool exists to avoid. With it, c10d stashes the tensors in its Work until
# ``wait()``. Pool buffers never need record_stream (release events order their reuse). torch
# 2.11 makes it the default (and warns when it is set), so it is set only for older torch, where
# ProcessGroupNCCL reads it when a group is created: every group created after ``import zbuf``.
# An explicit setting by the user wins.
if tuple(int(x) for x in _torch.__version__.split(".")[:2]) < (2, 11):
    _os.environ.setdefault("TORCH_NCCL_AVOID_RECORD_STREAMS", "1")

# zbuf.compile and zbuf.shard are callable modules: zbuf.shard(model) and zbuf.shard.<helper>
# both work.
from . import compile, models, shard  # noqa: A004
from .checkpoint import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
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
    UnverifiableReleaseError,
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
    "UnverifiableReleaseError",
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
    "checkpoint_path",
    "list_checkpoints",
    "latest_checkpoint",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "models",
]
