"""The eager fast path of ``zbuf::all_gather``: the op's autograd formula without the dispatcher.

[Note: eager fast path]
A ``torch.library`` custom op costs a few hundred microseconds of Python per call in eager
mode (argument normalisation, the generated autograd wrapper, a redispatch); parameter
access pays it for every weight, forward and re-gather. Outside tracing the accessor calls
``EagerAllGather`` instead: the same ``all_gather_impl`` / ``reduce_scatter_impl`` bodies (``ops.py``),
so eager and compiled runs compute the same thing, and the parity tests run both. Its backward
goes through ``reduce_once`` ([Note: reduce once]), which the custom op's formula does not.
"""

from __future__ import annotations

import torch

from .ops import all_gather_impl
from .runtime import label

__all__ = ["EagerAllGather"]


class EagerAllGather(torch.autograd.Function):
    """``zbuf::all_gather`` with its autograd formula, minus the dispatcher (eager only): see
    [Note: eager fast path]."""

    @staticmethod
    def forward(ctx, shard, spec, reducer, generation):
        # reducer: the root's reduce_once.ReduceOnce (None only under no_grad: no backward);
        # generation: from its count_use, None when this use is not counted ([Note: reduce
        # once]). The shard is kept for an end-of-backward flush, which writes its .grad.
        ctx.spec, ctx.reducer, ctx.generation, ctx.shard = spec, reducer, generation, shard
        return all_gather_impl(shard, spec.param_id, spec.shape, spec.group_name, spec.param_dtype,
                               spec.pool_id)

    @staticmethod
    def backward(ctx, grad):
        with label("zbuf::reduce_once"):
            return ctx.reducer.contribute(grad, ctx.shard, ctx.spec, ctx.generation), None, None, None
