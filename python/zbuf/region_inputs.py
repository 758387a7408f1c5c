"""Parameter access inside a compile region's body reads the weights its caller gathered.

[Note: weights gathered by the caller]
A block compiled once as a nested compile region (compile/regions.py) must not gather inside
its body: the body is traced once for all blocks, and a gather bakes in its parameter's id.
So the caller gathers the block's parameters in the outer graph and hands the full tensors to
the body, which reads them here instead of gathering: while the region is traced, the top of
the stack maps param_id -> the body's input for that parameter. It is pushed and popped only
by code that Dynamo traces (the region body), so at run time, eager or compiled, it is empty
and parameter access gathers as always.

A block frame ([Note: one Dynamo frame per block] in compile/block_frames.py) receives its
gathered weights the same way, on a second stack keyed by the shard itself: its frame is traced
once for every block, so it must not read a parameter id (a guarded constant) before finding its
weight. Two stacks, one per key, so neither lookup pays for the other's.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["gathered_by_caller", "caller_gathered", "gathered_for_shards", "shard_gathered_by_caller",
           "GATHERED_FOR_SHARDS"]

# Process-wide on purpose: only Dynamo's tracing of a region body pushes and pops it (so it is
# empty whenever nothing is being traced), and the traced parameter property of any module must
# see it without an object to reach it through.
_GATHERED_BY_CALLER: list[dict[int, torch.Tensor]] = []

# Process-wide for the same reason: pushed and popped only inside a traced block frame, so empty
# whenever nothing is being traced; public so that the parameter property tests it inline (its
# hot path, eager included). Keyed by shard, not param_id: reading a spec's param_id inside the
# frame would make it a guarded constant of the frame.
GATHERED_FOR_SHARDS: list[dict[torch.Tensor, torch.Tensor]] = []


class _Pushed:
    """``with _Pushed(stack, keys, tensors):`` the mapping ``keys[i] -> tensors[i]`` is the top
    of ``stack`` inside; traced by Dynamo, so it is a plain class, not a generator."""

    def __init__(self, stack: list, keys, tensors) -> None:
        self.stack = stack
        self.mapping = dict(zip(keys, tensors))

    def __enter__(self) -> None:
        self.stack.append(self.mapping)

    def __exit__(self, *exc) -> None:
        self.stack.pop()


def gathered_by_caller(param_ids, tensors) -> _Pushed:
    """``with gathered_by_caller(ids, tensors):`` parameter access inside returns
    ``tensors[i]`` for parameter id ``ids[i]`` instead of gathering (a region body compiled once,
    see [Note: weights gathered by the caller]); for code traced by ``torch.compile`` only."""
    return _Pushed(_GATHERED_BY_CALLER, param_ids, tensors)


def gathered_for_shards(shards, tensors) -> _Pushed:
    """``with gathered_for_shards(shards, tensors):`` parameter access inside returns
    ``tensors[i]`` for the parameter whose shard is ``shards[i]`` (a block frame, [Note: one
    Dynamo frame per block] in compile/block_frames.py); for code traced by ``torch.compile``
    only."""
    return _Pushed(GATHERED_FOR_SHARDS, shards, tensors)


def caller_gathered(param_id: int) -> Optional[torch.Tensor]:
    """The weight the enclosing region's caller gathered for ``param_id``; None outside one."""
    if _GATHERED_BY_CALLER:
        return _GATHERED_BY_CALLER[-1].get(param_id)
    return None


def shard_gathered_by_caller(shard: torch.Tensor) -> Optional[torch.Tensor]:
    """The weight the enclosing block frame's caller gathered for ``shard``; None outside one."""
    if GATHERED_FOR_SHARDS:
        return GATHERED_FOR_SHARDS[-1].get(shard)
    return None
