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

One ``Regather`` per sharded root (``ShardedRoot.regather``) holds its live gathered tensors and
the hook contexts of its forwards in flight; the root's forward hooks (``shard.py``) enter and
exit it.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from .eager_ops import EagerAllGather
from .param import ShardSpec

__all__ = ["Regather", "callers_hooks_active"]


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


def _forget(live: dict, key: int, ref: weakref.ref) -> None:
    entry = live.get(key)
    if entry is not None and entry.tensor_ref is ref:
        del live[key]


def _unpack(saved):
    if not isinstance(saved, _Recipe):
        return saved
    with torch.no_grad():  # the re-gather is not a use: no count, no reduce-scatter, not tracked
        full = EagerAllGather.apply(saved.shard, saved.spec, None, None)
    return full.as_strided(saved.size, saved.stride, full.storage_offset() + saved.offset)


class Regather:
    """[Note: eager re-gather] for the parameters of one sharded root."""

    def __init__(self) -> None:
        self._live: dict[int, _Live] = {}
        """storage data pointer -> the live gathered tensor on that storage. A storage pointer
        cannot be shared by two live gathers; the entry is dropped when the gathered tensor
        object dies."""
        self._hook_stack: list[torch.autograd.graph.saved_tensors_hooks] = []
        """Saved-tensor-hook contexts entered by nested root forwards (producer:
        ``enter_forward``, consumer: ``exit_forward``)."""

    def live_tracked(self) -> int:
        """Gathered tensors currently registered (tests check that this drains)."""
        return len(self._live)

    def in_forward(self) -> bool:
        """Whether a forward of the root is running (its hooks are installed)."""
        return bool(self._hook_stack)

    def track(self, gathered: torch.Tensor, shard: torch.nn.Parameter, spec: ShardSpec) -> None:
        """Register an eagerly gathered tensor so saving it for backward stores a recipe instead."""
        if gathered.numel() == 0:
            return
        key = gathered.untyped_storage().data_ptr()
        live = self._live
        ref = weakref.ref(gathered, lambda r, key=key: _forget(live, key, r))
        live[key] = _Live(ref, shard, spec)

    def _pack(self, t: torch.Tensor):
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.device.type == "meta":
            return t
        entry = self._live.get(t.untyped_storage().data_ptr())
        if entry is None:
            return t
        gathered = entry.tensor_ref()
        if gathered is None or gathered.dtype != t.dtype:
            return t
        return _Recipe(
            entry.shard, entry.spec, t.size(), t.stride(), t.storage_offset() - gathered.storage_offset()
        )

    def enter_forward(self) -> None:
        """A root forward starts: install a fresh pack/unpack pair."""
        ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        ctx.__enter__()
        self._hook_stack.append(ctx)

    def exit_forward(self) -> None:
        """A root forward ended (also by an exception): remove its pair."""
        if self._hook_stack:
            self._hook_stack.pop().__exit__(None, None, None)


def callers_hooks_active() -> bool:
    """Whether the innermost saved-tensor hooks are a caller's (a non-reentrant checkpoint, its
    recompute, ``save_on_cpu``), not a root's eager re-gather: those stay in force for whatever
    runs inside them ([Note: a block under the caller's checkpoint] in
    compile/block_frames.py)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return hooks is not None and not isinstance(getattr(hooks[0], "__self__", None), Regather)

