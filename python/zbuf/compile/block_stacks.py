"""The repeated stacks of a model: the blocks that block frames run, one class swap per block class.

A repeated stack is an ``nn.ModuleList`` of two or more modules of one class that hold zbuf
shards (a decoder's layers); ``zbuf.compile`` picks the block structure for a model that has one
([Note: one path] in compiled_model.py), and block_frames.py runs each block of it through the
stack's shared frame by swapping the block's class for a subclass whose ``__call__`` is the
frame's.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from ..shard import is_sharded

__all__ = ["repeated_blocks", "frame_class", "base_class"]

_BASE = "_zbuf_frame_base"
_SUBCLASS = "_zbuf_frame_class"


def base_class(block: nn.Module) -> type:
    """The block's own class: the one ``frame_class`` derived its class from, if it did."""
    return getattr(type(block), _BASE, type(block))


def repeated_blocks(model: nn.Module) -> list[list[nn.Module]]:
    """The repeated stacks of ``model``: every ``nn.ModuleList`` of at least two modules of one
    class holding zbuf shards, outermost first (a stack inside a block of another is left to the
    outer one)."""
    stacks: list[list[nn.Module]] = []
    inside: set[int] = set()
    for m in model.modules():
        if id(m) in inside or not isinstance(m, nn.ModuleList) or len(m) < 2:
            continue
        if len({base_class(b) for b in m}) == 1 and all(is_sharded(b) for b in m):
            stacks.append(list(m))
            inside.update(id(x) for b in m for x in b.modules())
    return stacks


def frame_class(cls: type, call: Callable) -> type:
    """The subclass of block class ``cls`` whose ``__call__`` is ``call``, with ``cls`` as its
    base (``base_class``): one per class, so that Dynamo sees one type for every block of a stack,
    kept on ``cls`` itself and read from its own ``__dict__`` (a subclass of ``cls`` gets its
    own)."""
    sub = cls.__dict__.get(_SUBCLASS)
    if sub is None:
        sub = type(cls.__name__, (cls,), {"__call__": call, _BASE: cls,
                                          "__module__": cls.__module__, "__doc__": cls.__doc__})
        type.__setattr__(cls, _SUBCLASS, sub)
    return sub
