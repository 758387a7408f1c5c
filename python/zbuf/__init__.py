"""zbuf: ZeRO-3 training for torch.compile.

The public surface:

- ``GatherBufferPool`` / ``PoolStats`` / ``default_pool``: the Rust gather-buffer pool.
- ``shard`` / ``full_state_dict`` / ``load_full_state_dict`` / ``clip_grad_norm_``: the ZeRO-3
  parameter model.
- ``compile`` (callable: ``zbuf.compile(model, budget_bytes=None, prefetch=True, persist=None,
  inner="inductor", recompute="checkpointed", optimizer=None)``), ``schedule_report``,
  ``ScheduleMismatchError``: the ``torch.compile`` backend ``"zbuf"``, with the whole training step
  under one measured memory budget (``zbuf.memory``: the step's memory, the pool and torch's
  allocator on one device, the only writer of the pool's budget).
- ``save_checkpoint`` / ``load_checkpoint`` / ``checkpoint_path`` / ``list_checkpoints`` /
  ``latest_checkpoint``: sharded, atomic checkpoints through DCP (``zbuf.checkpoint``).
- ``models``: the built-in Qwen3-shaped decoder presets.

[Note: lazy import]
``import zbuf`` in a process that has not imported torch yet imports neither torch nor any zbuf
module but ``zbuf.errors`` (the Rust extension's exception classes, which need no torch), so the
``zbuf`` command parses its options and answers ``zbuf --help`` without the
seconds torch takes to import. zbuf loads itself the moment torch has been imported (a one-shot
import hook, ``_LoadAfterTorch``), or at once when torch was imported before zbuf, and any
public name used before that loads it too. So every process that uses zbuf has loaded all of it,
and the torch modules it needs, as soon as torch is there: before ``init_process_group`` can be
called. That is what an eager ``import zbuf`` gave, in every import order, and what the rule
"import zbuf before init_process_group" relies on. ``tests/test_cli_options.py`` checks that
``zbuf --help`` does not import torch; ``test_import_order`` there checks the rest.
"""

from __future__ import annotations

import importlib as _importlib
import importlib.abc  # noqa: F401 - _importlib.abc, _importlib.util below
import importlib.util  # noqa: F401
import os as _os
import sys as _sys
from typing import TYPE_CHECKING as _TYPE_CHECKING


def _torch_version() -> tuple[int, int]:
    """(major, minor) of the installed torch, from its metadata (importing it costs seconds);
    (0, 0) when torch is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        text = version("torch")
    except PackageNotFoundError:  # torch on sys.path without metadata (a source tree), or none
        if _importlib.util.find_spec("torch") is None:
            return (0, 0)
        import torch

        text = torch.__version__
    return tuple(int(x) for x in text.split("+")[0].split(".")[:2])  # type: ignore[return-value]


# [Note: no record_stream on pool memory]
# An async NCCL collective makes c10d call ``record_stream`` on its tensors unless
# TORCH_NCCL_AVOID_RECORD_STREAMS is on; the caching allocator then holds the cast shards (and
# any allocator-backed output) until the comm stream passes that point: blocks freed late, reused
# late, the churn the pool exists to avoid. With it, c10d stashes the tensors in its Work until
# ``wait()``. Pool buffers never need record_stream (release events order their reuse). torch
# 2.11 makes it the default (and warns when it is set), so it is set only for older torch, where
# ProcessGroupNCCL reads it when a group is created: every group created after ``import zbuf``.
# An explicit setting by the user wins.
if (0, 0) < _torch_version() < (2, 11):
    _os.environ.setdefault("TORCH_NCCL_AVOID_RECORD_STREAMS", "1")

__version__ = "0.1.0"

# The exceptions: every name of zbuf.errors, bound at once (the Rust extension's classes; its
# import takes under a millisecond and no torch: [Note: lazy import]).
from . import errors as _errors  # noqa: E402
from .errors import *  # noqa: E402, F403

# Every other public name -> the zbuf module that defines it. ``shard``, ``compile`` and ``models`` are
# modules themselves (``zbuf.shard`` and ``zbuf.compile`` are callable modules: ``zbuf.shard(model)``
# and ``zbuf.shard.<helper>`` both work).
_SUBMODULES = ("shard", "compile", "models")
_NAMES = {
    "GatherBufferPool": "pool",
    "PoolStats": "pool",
    "default_pool": "pool",
    "ShardingError": "shard",
    "full_state_dict": "state_dict",
    "load_full_state_dict": "state_dict",
    "clip_grad_norm_": "clip",
    "schedule_report": "compile",
    "ScheduleMismatchError": "compile",
    "save_checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint",
    "checkpoint_path": "checkpoint",
    "list_checkpoints": "checkpoint",
    "latest_checkpoint": "checkpoint",
    "CheckpointError": "checkpoint",
    "CheckpointNotFoundError": "checkpoint",
    "CheckpointCorruptError": "checkpoint",
    "CheckpointMismatchError": "checkpoint",
}

__all__ = [*_NAMES, *_errors.__all__, *_SUBMODULES]


# [Note: import before init_process_group]
# ``torch.distributed.nn.functional`` binds ``group=group.WORLD`` as default arguments when it is
# first imported; imported after ``init_process_group``, that pins the default group for the rest
# of the process, and a gloo group alive at interpreter exit can kill the process with SIGABRT
# after its work succeeded ([Note: a model does not keep its group alive] in shard_state.py). torch
# imports it through ``torch._dynamo``, ``torch.distributed.fsdp`` and
# ``torch.distributed.checkpoint``, all of which zbuf uses: ``_load`` imports them first, so a
# script that imports zbuf before ``init_process_group`` (the README's one rule) binds nothing,
# in either import order ([Note: lazy import]). Loaded after init, zbuf says so once.
def _load() -> None:
    """Import the torch modules that bind the default group, then every zbuf module behind a
    public name ([Note: lazy import], [Note: import before init_process_group])."""
    import torch.distributed as dist

    late = (dist.is_available() and dist.is_initialized()
            and "torch.distributed.nn.functional" not in _sys.modules)
    import torch._dynamo  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.nn.functional  # noqa: F401

    if late:
        import warnings

        warnings.warn(
            "zbuf was imported after torch.distributed.init_process_group(): the torch modules it "
            "imports now hold the default process group for good, so gloo's worker threads outlive "
            "destroy_process_group() and a rank can die with SIGABRT at exit. Import zbuf before "
            "init_process_group",
            RuntimeWarning,
            stacklevel=3,
        )
    for module in (*_SUBMODULES, *sorted(set(_NAMES.values()))):
        _importlib.import_module(f"{__name__}.{module}")


class _LoadAfterTorch(_importlib.abc.MetaPathFinder, _importlib.abc.Loader):
    """Finds nothing itself: when ``torch`` is first imported, it wraps torch's own loader so
    that zbuf loads right after torch's ``__init__`` has run, then steps aside ([Note: lazy
    import])."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch":
            return None
        _sys.meta_path.remove(self)  # one shot; also keeps the lookup below from finding us
        spec = _importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            self._torch_loader = spec.loader
            spec.loader = self
        return spec

    def create_module(self, spec):
        return self._torch_loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__spec__.loader = module.__loader__ = self._torch_loader  # torch's, from now on
        self._torch_loader.exec_module(module)
        try:
            _load()
        except Exception:  # noqa: BLE001 - torch imported fine; zbuf's error shows at first use
            pass


if "torch" in _sys.modules:
    _load()
else:
    _sys.meta_path.insert(0, _LoadAfterTorch())


def __getattr__(name: str):
    """First use of a public name: import its module ([Note: lazy import])."""
    if name in _SUBMODULES:
        return _importlib.import_module(f"{__name__}.{name}")  # also binds it on this package
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if _TYPE_CHECKING:  # what the names are, for type checkers and editors
    from . import compile, models, shard  # noqa: A004, F401
    from .checkpoint import (  # noqa: F401
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
    from .clip import clip_grad_norm_  # noqa: F401
    from .compile import ScheduleMismatchError, schedule_report  # noqa: F401
    from .pool import GatherBufferPool, PoolStats, default_pool  # noqa: F401
    from .shard import ShardingError  # noqa: F401
    from .state_dict import full_state_dict, load_full_state_dict  # noqa: F401
