"""Eager mode: gathered weights that autograd saves are re-gathered in backward instead of kept.

[Note: eager re-gather]
In eager mode a gathered weight would otherwise stay alive from its forward use until its
backward (``F.linear`` saves the weight, as a transposed view, for the input gradient), so the
whole model's full weights would be resident at the end of the forward. While the root sharded
module's forward runs, ``saved_tensors_hooks`` intercept every tensor autograd saves: if it is a
live gathered weight, or a view of one (checked by storage, which covers ``_base`` chains), the
pack hook stores a recipe instead (the shard and its spec plus the view's size, stride and offset)
and the gathered buffer returns to the pool as soon as the forward drops it. The unpack hook, run
by backward, gathers again (under ``no_grad``: the re-gather must not reduce-scatter) and rebuilds
the same view. So the forward holds about one layer's gathered weights at a time and the backward
too (an unpacked weight lives until its backward node finishes).

Only tensors registered by ``track`` (the eager parameter accessor) are replaced; a cast copy of a
gathered weight is a different storage and is saved as usual. Non-reentrant activation
checkpointing installs its own hooks inside checkpointed regions (the innermost hooks win): there
nothing is saved and the recompute gathers again, which composes. Under ``torch.compile`` the
hooks are not installed (the compile pass decides what backward re-gathers).

The root's forward pre-hook (``enter_root_forward``) installs them, and starts a new
``reduce_once`` generation when it is the outermost forward; its forward post-hook
(``exit_root_forward``) removes them.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from torch import nn

from . import reduce_once
from .eager_ops import EagerAllGather
from .param import ShardSpec
from .shard_state import ShardingError, root_of

__all__ = ["track", "regather_hooks", "live_tracked", "enter_root_forward", "exit_root_forward"]


class _Live(NamedTuple):
    tensor_ref: weakref.ref
    shard: torch.nn.Parameter
    spec: ShardSpec


class _Recipe(NamedTuple):
    shard: torch.nn.Parameter
    spec: ShardSpec
    size: torch.Size
    stride: tuple[int, ...]
    offset: int  # storage offset relative to the gathered tensor's own


# storage data pointer -> the live gathered tensor on that storage. A storage pointer cannot be
# shared by two live gathers; the entry is dropped when the gathered tensor object dies.
_LIVE: dict[int, _Live] = {}


def live_tracked() -> int:
    """Gathered tensors currently registered (tests check that this drains)."""
    return len(_LIVE)


def _forget(key: int, ref: weakref.ref) -> None:
    entry = _LIVE.get(key)
    if entry is not None and entry.tensor_ref is ref:
        del _LIVE[key]


def track(gathered: torch.Tensor, shard: torch.nn.Parameter, spec: ShardSpec) -> None:
    """Register an eagerly gathered tensor so saving it for backward stores a recipe instead."""
    if gathered.numel() == 0:
        return
    key = gathered.untyped_storage().data_ptr()
    ref = weakref.ref(gathered, lambda r, key=key: _forget(key, r))
    _LIVE[key] = _Live(ref, shard, spec)


def _pack(t: torch.Tensor):
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.device.type == "meta":
        return t
    entry = _LIVE.get(t.untyped_storage().data_ptr())
    if entry is None:
        return t
    gathered = entry.tensor_ref()
    if gathered is None or gathered.dtype != t.dtype:
        return t
    return _Recipe(
        entry.shard, entry.spec, t.size(), t.stride(), t.storage_offset() - gathered.storage_offset()
    )


def _unpack(saved):
    if not isinstance(saved, _Recipe):
        return saved
    with torch.no_grad():  # the re-gather is not a use: no count, no reduce-scatter, not tracked
        full = EagerAllGather.apply(saved.shard, saved.spec, None)
    return full.as_strided(saved.size, saved.stride, full.storage_offset() + saved.offset)


def regather_hooks() -> torch.autograd.graph.saved_tensors_hooks:
    """A fresh context manager installing the pack/unpack pair of [Note: eager re-gather]."""
    return torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)


def _check_unchanged(module: nn.Module) -> None:
    """Every parameter under the root is still one of its shards (eager forwards only)."""
    shards = root_of(module).shard_ids
    late = [
        f"{prefix}.{name}" if prefix else name
        for prefix, sub in module.named_modules()
        for name, p in sub._parameters.items()
        if p is not None and id(p) not in shards
    ]
    if late:
        raise ShardingError(
            f"parameters {late} were added or replaced after zbuf.shard: they are not sharded, "
            f"so every rank would train its own copy with unsynchronised gradients. Build the "
            f"whole model (adapters, new heads) before calling zbuf.shard"
        )


def enter_root_forward(module: nn.Module, args) -> None:
    """The sharded root's forward pre-hook: [Note: eager re-gather] (eager forwards only)."""
    if torch.compiler.is_compiling():
        return
    _check_unchanged(module)
    stack = root_of(module).hook_stack
    if not stack:
        reduce_once.new_forward()
    ctx = regather_hooks()
    ctx.__enter__()
    stack.append(ctx)


def exit_root_forward(module: nn.Module, args, output) -> None:
    """The sharded root's forward post-hook (``always_call``): undoes ``enter_root_forward``."""
    if torch.compiler.is_compiling():
        return
    stack = root_of(module).hook_stack
    if stack:
        stack.pop().__exit__(None, None, None)
