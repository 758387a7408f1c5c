"""Gradient clipping for sharded models: the norm is over the whole model, across ranks.

``torch.nn.utils.clip_grad_norm_`` on a sharded model's parameters would clip by the norm of this
rank's shards only (every rank a different factor, so the replicas drift apart). Here each rank
sums its shards' squared norms (padding is zero, see [Note: shard layout] in param.py), one all-reduce gives
the global value, and every rank scales by the same factor, with torch's formula.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from .shard_state import ShardingError, root_of

__all__ = ["clip_grad_norm_"]


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of a ``zbuf.shard``-ed ``model`` in place; returns the total norm.

    Collective over the sharding group: every rank must call it. Same semantics as
    ``torch.nn.utils.clip_grad_norm_`` on the unsharded model (``norm_type`` 2, any p > 0, or inf).
    """
    root = root_of(model)
    if root is None:
        raise ShardingError(
            "clip_grad_norm_ takes the module passed to zbuf.shard (its root); for an unsharded "
            "model use torch.nn.utils.clip_grad_norm_"
        )
    if root.steps_in_backward:
        raise ShardingError(
            "clip_grad_norm_: this model's optimizer steps in backward (zbuf.compile(..., "
            "optimizer_in_backward=True)), which uses each gradient as it arrives and leaves none "
            "to clip; compile without optimizer_in_backward to clip gradients")
    max_norm, norm_type = float(max_norm), float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"norm_type must be positive (or inf), got {norm_type}")
    grads = [p.grad for p in root.shards.values() if p.grad is not None]
    device = root.device
    if math.isinf(norm_type):
        local = torch.stack([g.abs().max().float() for g in grads]).max() if grads else torch.zeros((), device=device)
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=root.group)
        total = local
    else:
        local = (torch.stack([g.float().norm(norm_type) ** norm_type for g in grads]).sum()
                 if grads else torch.zeros((), device=device))
        dist.all_reduce(local, group=root.group)
        total = local ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total
