"""The per-parameter record of a sharded parameter, and the flat/padded shard layout.

[Note: shard layout]
A parameter of ``numel`` elements is flattened (row-major) and padded with zeros to
``world * shard_numel`` elements, ``shard_numel = ceil(numel / world)``; rank ``r`` keeps the
contiguous slice ``[r * shard_numel, (r + 1) * shard_numel)``. The all-gather of the shards is
therefore the padded flat tensor, and the full tensor is its first ``numel`` elements viewed as
``shape``. Padding elements stay exactly zero through training: the reduce-scatter gives them zero
gradients, and AdamW (with or without weight decay) maps a zero parameter with zero gradient to
zero. A rank whose whole slice is padding (``numel < world``) holds zeros.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = ["ShardSpec", "shard_numel_for", "local_shard_of", "unpad_full"]


class ShardSpec(NamedTuple):
    """What a sharded parameter is; constant for the life of the module.

    Immutable and made of plain values, so Dynamo reads it as constants while tracing the
    parameter's property, and the custom ops get everything they need as arguments.
    """

    param_id: int
    """Process-unique id: names the parameter in ops, the pool registry and schedule reports."""
    fqn: str
    """First fully qualified name of the parameter in the root module (tied ones have more)."""
    shape: tuple[int, ...]
    """Full (unsharded) shape."""
    numel: int
    """Full element count."""
    shard_numel: int
    """Elements per rank: ``ceil(numel / world_size)`` (see [Note: shard layout])."""
    world_size: int
    """Ranks in the sharding group."""
    rank: int
    """This process's rank within the sharding group."""
    group_name: str
    """``ProcessGroup.group_name``; ops take the name because they cannot take a ProcessGroup."""
    dtype: torch.dtype
    """Dtype of the shard (the optimizer's master copy)."""
    param_dtype: torch.dtype | None
    """Dtype the full tensor is gathered in (the cast happens before the collective); None: ``dtype``."""
    reduce_dtype: torch.dtype | None
    """Dtype of the gradient reduce-scatter; None: the gathered dtype."""
    pool_id: int
    """The gather-buffer pool its gathers draw from and release to ([Note: pool ids] in
    runtime.py)."""

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    @property
    def gathered_dtype(self) -> torch.dtype:
        return self.param_dtype if self.param_dtype is not None else self.dtype

    @property
    def gathered_nbytes(self) -> int:
        """Bytes of one gather's buffer (padded), what the pool hands out for this parameter."""
        return self.padded_numel * self.gathered_dtype.itemsize


def shard_numel_for(numel: int, world_size: int) -> int:
    # A 0-element parameter still gets a 1-element shard: collectives of size 0 are not
    # supported uniformly across backends, and one padding element costs nothing.
    return max(1, math.ceil(numel / world_size))


def local_shard_of(full: torch.Tensor, shard_numel: int, rank: int, *, device=None) -> torch.Tensor:
    """This rank's padded slice of ``full`` as a fresh 1-D tensor (see [Note: shard layout])."""
    flat = full.detach().reshape(-1)
    start = min(rank * shard_numel, flat.numel())
    stop = min(start + shard_numel, flat.numel())
    out = torch.zeros(shard_numel, dtype=full.dtype, device=device if device is not None else full.device)
    if stop > start:
        out[: stop - start].copy_(flat[start:stop])
    return out


def unpad_full(padded: torch.Tensor, shape) -> torch.Tensor:
    """The full tensor inside a padded flat gather: same storage, no copy, and not a view.

    Built with ``set_`` rather than ``view``/slicing: a custom op's output that is a view of a
    tensor created inside the op becomes an autograd "view created in a custom Function", which
    forbids later in-place ops on it (``zbuf::release`` mutates its argument).
    """
    shape = tuple(shape)
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return padded.new_empty(0).set_(padded.untyped_storage(), padded.storage_offset(), shape, tuple(reversed(strides)))
