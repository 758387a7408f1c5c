"""The custom ops that move ZeRO-3 parameters and gradients, as ``torch.ops.zbuf.*``.

The op set is deliberately small; the compile pass (``zbuf.compile``) schedules these and may add
its own start/wait split on top. Every op is registered with ``torch.library.custom_op`` and has a
fake implementation that needs nothing but its arguments (no registry lookup: fake tensors have
no pool, group or data behind them), so Dynamo and AOTAutograd trace them without running a
collective.

``zbuf::all_gather(Tensor shard, int param_id, SymInt[] shape, str group_name,
                   ScalarType? param_dtype, ScalarType? reduce_dtype, int pool_id=-1) -> Tensor``
    The full parameter, fresh memory from the gather-buffer pool ``pool_id`` ([Note: pool ids] in
    runtime.py; -1: the device's default pool), never a view of ``shard``, contiguous, dtype
    ``param_dtype`` (or the shard's). The shard is cast to ``param_dtype`` before
    the collective, so low-precision bytes travel. Synchronous: when it returns the data is there.
    Autograd: backward is ``zbuf::reduce_scatter`` of the output's gradient into a gradient for the
    shard (which autograd's AccumulateGrad adds to ``shard.grad``, so micro-batches accumulate).
    ``reduce_dtype`` is only carried for that backward. ``group_name`` is
    ``ProcessGroup.group_name`` (ops cannot take a ProcessGroup).

``zbuf::reduce_scatter(Tensor grad, int param_id, SymInt shard_numel, str group_name,
                       ScalarType? reduce_dtype, ScalarType out_dtype) -> Tensor``
    ``grad`` (any shape; ``numel`` elements) flattened, cast to ``reduce_dtype``, zero-padded to
    ``world * shard_numel``, summed across ranks and divided by the world size (an average), this
    rank's ``shard_numel`` slice returned as a fresh 1-D ``out_dtype`` tensor. Not differentiable.

``zbuf::release(Tensor(a!) t, int pool_id=-1) -> ()``
    Hands a gathered buffer back to its pool (the ``pool_id`` it was gathered from) now, before
    the tensor object dies. ``t`` must not be read afterwards. Declared as mutating ``t`` so that Inductor keeps it (an op that mutates
    nothing and returns nothing is dead code to Inductor). Without an explicit release a gathered
    buffer returns to the pool when its last reference dies, which is what eager mode relies on.
    For eager code and post-grad graph passes (``zbuf.compile`` inserts its releases there): in
    user code that Dynamo traces, functionalization drops a release of a graph intermediate (the
    mutation is unobservable), so the buffer then returns when the compiled code frees it.

Every op checks its arguments (1-D contiguous shard of ``ceil(numel / world)`` elements,
floating dtypes, a live process group) and raises ``ValueError``/``RuntimeError`` naming the
parameter id and the fix.

The op bodies are thin: pools, op counts ([Note: counts live with their model]), the debug
flags, the process-group lookup and the collective helpers they share with the graph ops of
``compile/collectives.py`` live in ``runtime.py``.

[Note: tied parameters]
A parameter reachable under several names (tied embeddings) is one shard ``nn.Parameter``. Each
access gathers (so the full tensor lives only as long as that use site needs it), and the
gradient contributions of all use sites are summed at full size, then reduce-scattered once:
one collective per parameter per forward, not per use, and the unsharded reference's arithmetic
(autograd sums the full gradient). Eager: ``EagerAllGather`` (``eager_ops.py``) counts its uses and its backward
holds contributions in an accumulator until the last one arrives ([Note: reduce once] in
``reduce_once.py``, which also covers micro-batches, checkpoint recompute, dropped forwards, and
the memory trade: the padded accumulator lives from the first contribution to the last).
Compiled with ``backend="zbuf"``: the backward graph has one ``zbuf::reduce_scatter`` per use of
the same ``param_id`` and a pass sums their inputs into one ([Note: merging reduce-scatters] in
``compile/tied.py``). The op's own autograd formula below stays one reduce-scatter per use, so
stock backends (``torch.compile(backend="aot_eager" / "inductor")`` without the zbuf passes) and
direct calls of ``torch.ops.zbuf.all_gather`` keep that (exact, one more collective per use).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import torch

from .param import unpad_full
from .runtime import (
    DEFAULT_POOL,
    borrowed,
    count_gather,
    gather_into,
    label,
    pool_of,
    process_group,
    reduce_scatter_finish,
    reduce_scatter_launch,
    release_buffer,
)

__all__ = [
    "all_gather",
    "all_gather_impl",
    "reduce_scatter",
    "reduce_scatter_impl",
    "release",
]


def _check_gather_args(shard: torch.Tensor, shape, world: int, param_id: int, param_dtype) -> None:
    numel = math.prod(shape)
    expected = max(1, -(-numel // world))
    if shard.dim() != 1:
        raise ValueError(
            f"zbuf::all_gather: the shard must be 1-D (a flat zbuf shard), got shape "
            f"{list(shard.shape)} (param_id {param_id})"
        )
    if not shard.is_contiguous():
        raise ValueError(
            f"zbuf::all_gather: the shard must be contiguous (param_id {param_id}); pass the "
            f"shard parameter itself, not a strided view of it"
        )
    if shard.numel() != expected:
        raise ValueError(
            f"zbuf::all_gather: shape {list(shape)} does not belong to this shard: over {world} "
            f"ranks its shards have ceil({numel} / {world}) = {expected} elements, this one has "
            f"{shard.numel()} (param_id {param_id})"
        )
    if param_dtype is not None and not param_dtype.is_floating_point:
        raise ValueError(
            f"zbuf::all_gather: param_dtype must be a floating-point dtype or None, got {param_dtype}"
        )


def all_gather_impl(shard, param_id, shape, group_name, param_dtype, pool_id) -> torch.Tensor:
    """The body of ``zbuf::all_gather`` (also run directly by [Note: eager fast path] in eager_ops.py)."""
    with label("zbuf::all_gather"):
        pg = process_group(group_name)
        world = pg.size()
        _check_gather_args(shard, shape, world, param_id, param_dtype)
        dtype = param_dtype if param_dtype is not None else shard.dtype
        padded = world * shard.numel()
        buf = pool_of(pool_id, shard).acquire((padded,), dtype)
        gather_into([borrowed(buf) if world > 1 else buf], [shard.detach()], pg, async_op=False)
        count_gather(param_id, buf.numel() * buf.element_size())
        return unpad_full(buf, shape)


@torch.library.custom_op("zbuf::all_gather", mutates_args=())
def all_gather(
    shard: torch.Tensor,
    param_id: int,
    shape: Sequence[int],
    group_name: str,
    param_dtype: Optional[torch.dtype],
    reduce_dtype: Optional[torch.dtype],
    pool_id: int = DEFAULT_POOL,
) -> torch.Tensor:
    return all_gather_impl(shard, param_id, shape, group_name, param_dtype, pool_id)


@all_gather.register_fake
def _all_gather_fake(shard, param_id, shape, group_name, param_dtype, reduce_dtype, pool_id=DEFAULT_POOL):
    return shard.new_empty(shape, dtype=param_dtype if param_dtype is not None else shard.dtype)


def _all_gather_setup_context(ctx, inputs, output):
    shard, param_id, _shape, group_name, _param_dtype, reduce_dtype, _pool_id = inputs
    ctx.param_id = param_id
    ctx.shard_numel = shard.numel()
    ctx.shard_dtype = shard.dtype
    ctx.group_name = group_name
    ctx.reduce_dtype = reduce_dtype


def _all_gather_backward(ctx, grad):
    grad_shard = torch.ops.zbuf.reduce_scatter(
        grad, ctx.param_id, ctx.shard_numel, ctx.group_name, ctx.reduce_dtype, ctx.shard_dtype
    )
    return grad_shard, None, None, None, None, None, None


all_gather.register_autograd(_all_gather_backward, setup_context=_all_gather_setup_context)


def reduce_scatter_impl(grad, param_id, shard_numel, group_name, reduce_dtype, out_dtype) -> torch.Tensor:
    """The body of ``zbuf::reduce_scatter`` (also run directly by [Note: eager fast path] in eager_ops.py)."""
    with label("zbuf::reduce_scatter"):
        launch = reduce_scatter_launch(grad, param_id, shard_numel, group_name, reduce_dtype,
                                       async_op=False)
        return reduce_scatter_finish(launch).to(out_dtype)


@torch.library.custom_op("zbuf::reduce_scatter", mutates_args=())
def reduce_scatter(
    grad: torch.Tensor,
    param_id: int,
    shard_numel: int,
    group_name: str,
    reduce_dtype: Optional[torch.dtype],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return reduce_scatter_impl(grad, param_id, shard_numel, group_name, reduce_dtype, out_dtype)


@reduce_scatter.register_fake
def _reduce_scatter_fake(grad, param_id, shard_numel, group_name, reduce_dtype, out_dtype):
    return grad.new_empty((shard_numel,), dtype=out_dtype)


@torch.library.custom_op("zbuf::release", mutates_args=("t",))
def release(t: torch.Tensor, pool_id: int = DEFAULT_POOL) -> None:
    release_buffer(t, pool_id)


@release.register_fake
def _release_fake(t, pool_id=DEFAULT_POOL):
    return None
