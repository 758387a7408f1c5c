"""Parameter access inside a compile region's body reads the weights its caller gathered.

[Note: weights gathered by the caller]
A block compiled once as a nested compile region (compile/regions.py) must not gather inside
its body: the body is traced once for all blocks, and a gather bakes in its parameter's id.
So the caller gathers the block's parameters in the outer graph and hands the full tensors to
the body, which reads them here instead of gathering: while the region is traced, the top of
the stack maps param_id -> the body's input for that parameter. It is pushed and popped only
by code that Dynamo traces (the region body), so at run time, eager or compiled, it is empty
and parameter access gathers as always.
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


class gathered_by_caller:
    """``with gathered_by_caller(ids, tensors):`` parameter access inside returns
    ``tensors[i]`` for parameter id ``ids[i]`` instead of gathering (see [Note: weights gathered
    by the caller]); for code traced by ``torch.compile`` only."""

    def __init__(self, param_ids, tensors) -> None:
        self.mapping = dict(zip(param_ids, tensors))

    def __enter__(self) -> None:
        _GATHERED_BY_CALLER.append(self.mapping)

    def __exit__(self, *exc) -> None:
        _GATHERED_BY_CALLER.pop()


def caller_gathered(param_id: int) -> Optional[torch.Tensor]:
    """The weight the enclosing region's caller gathered for ``param_id``; None outside one."""
    if _GATHERED_BY_CALLER:
        return _GATHERED_BY_CALLER[-1].get(param_id)
    return None


# Process-wide for the same reason as ``_GATHERED_BY_CALLER``: pushed and popped only inside a
# traced block frame, so empty whenever nothing is being traced; public so that the parameter
# property tests it inline (its hot path, eager included).
GATHERED_FOR_SHARDS: list[dict[torch.Tensor, torch.Tensor]] = []


class gathered_for_shards:
    """``with gathered_for_shards(shards, tensors):`` parameter access inside returns
    ``tensors[i]`` for the parameter whose shard is ``shards[i]`` (see [Note: weights gathered by
    the caller]); for code traced by ``torch.compile`` only."""

    def __init__(self, shards, tensors) -> None:
        self.mapping = dict(zip(shards, tensors))

    def __enter__(self) -> None:
        GATHERED_FOR_SHARDS.append(self.mapping)

    def __exit__(self, *exc) -> None:
        GATHERED_FOR_SHARDS.pop()


def shard_gathered_by_caller(shard: torch.Tensor) -> Optional[torch.Tensor]:
    """The weight the enclosing block frame's caller gathered for ``shard``; None outside one."""
    if GATHERED_FOR_SHARDS:
        return GATHERED_FOR_SHARDS[-1].get(shard)
    return None
