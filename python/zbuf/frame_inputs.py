"""Parameter access inside a block frame reads the weights its caller gathered.

[Note: weights gathered by the caller]
A block frame ([Note: one Dynamo frame per block] in compile/block_frames.py) is traced once for
every block of a stack, so it must not gather inside: a gather bakes in its parameter's id, a
guarded constant of the frame. zbuf's runtime gathers the block's weights outside the frame and
hands the full tensors in; parameter access inside reads them here, keyed by the shard itself,
before it reads the parameter's spec. The stack is pushed and popped only by code that Dynamo
traces (the frame's body), so at run time, eager or compiled, it is empty and parameter access
gathers as always.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["gathered_for_shards", "shard_gathered_by_caller", "GATHERED_FOR_SHARDS"]

# Process-wide on purpose: pushed and popped only inside a traced block frame, so empty whenever
# nothing is being traced, and the traced parameter property of any module must see it without an
# object to reach it through; public so that the property tests it inline (its hot path, eager
# included).
GATHERED_FOR_SHARDS: list[dict[torch.Tensor, torch.Tensor]] = []


class _Pushed:
    """``with _Pushed(shards, tensors):`` the mapping ``shards[i] -> tensors[i]`` is the top of
    the stack inside; traced by Dynamo, so it is a plain class, not a generator."""

    def __init__(self, shards, tensors) -> None:
        self.mapping = dict(zip(shards, tensors))

    def __enter__(self) -> None:
        GATHERED_FOR_SHARDS.append(self.mapping)

    def __exit__(self, *exc) -> None:
        GATHERED_FOR_SHARDS.pop()


def gathered_for_shards(shards, tensors) -> _Pushed:
    """``with gathered_for_shards(shards, tensors):`` parameter access inside returns
    ``tensors[i]`` for the parameter whose shard is ``shards[i]``; for code traced by
    ``torch.compile`` only."""
    return _Pushed(shards, tensors)


def shard_gathered_by_caller(shard: torch.Tensor) -> Optional[torch.Tensor]:
    """The weight the enclosing block frame's caller gathered for ``shard``; None outside one."""
    if GATHERED_FOR_SHARDS:
        return GATHERED_FOR_SHARDS[-1].get(shard)
    return None
