"""The custom ops that move ZeRO-3 parameters and gradients, as ``torch.ops.zbuf.*``.

The op set is deliberately small; the compile pass (``zbuf.compile``) schedules these and may add
its own start/wait split on top. Every op is registered with ``torch.library.custom_op`` and has a
fake implementation that needs nothing but its arguments (no registry lookup: see TORCH-NOTES), so
Dynamo and AOTAutograd trace them without running a collective.

``zbuf::all_gather(Tensor shard, int param_id, SymInt[] shape, str group_name,
                   ScalarType? param_dtype, ScalarType? reduce_dtype) -> Tensor``
    The full parameter, fresh memory from the gather-buffer pool (never a view of ``shard``),
    contiguous, dtype ``param_dtype`` (or the shard's). The shard is cast to ``param_dtype`` before
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

``zbuf::release(Tensor(a!) t) -> ()``
    Hands a gathered buffer back to its pool now, before the tensor object dies. ``t`` must not be
    read afterwards. Declared as mutating ``t`` so that Inductor keeps it (an op that mutates
    nothing and returns nothing is dead code to Inductor). Without an explicit release a gathered
    buffer returns to the pool when its last reference dies, which is what eager mode relies on.
    For eager code and post-grad graph passes (``zbuf.compile`` inserts its releases there): in
    user code that Dynamo traces, functionalization drops a release of a graph intermediate (the
    mutation is unobservable), so the buffer then returns when the compiled code frees it.

Every op checks its arguments (1-D contiguous shard of ``ceil(numel / world)`` elements,
floating dtypes, a live process group) and raises ``ValueError``/``RuntimeError`` naming the
parameter id and the fix.

[Note: collectives on gloo]
torch 2.11's gloo backend implements ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` on
CPU tensors (checked), so CPU runs take the same code path as NCCL. gloo has no ``ReduceOp.AVG``,
so the average is a ``SUM`` followed by a division by the world size, on every backend alike: the
result is the same sum-then-divide an unsharded reference computes for a mean over equal batch
slices (to float rounding). For reduce dtypes narrower than fp32 the division happens *before*
the sum, so the sum cannot overflow.

[Note: tied parameters]
A parameter reachable under several names (tied embeddings) is one shard ``nn.Parameter``. Each
access gathers (so the full tensor lives only as long as that use site needs it), and the
gradient contributions of all use sites are summed at full size, then reduce-scattered once:
one collective per parameter per forward, not per use, and the unsharded reference's arithmetic
(autograd sums the full gradient). Eager: ``EagerAllGather`` counts its uses and its backward
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

import collections
import contextlib
import math
import os
from collections.abc import Sequence
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch.profiler import record_function

from . import reduce_once
from .errors import DoubleReleaseError, ForeignBufferError
from .param import unpad_full

__all__ = [
    "all_gather",
    "all_gather_impl",
    "reduce_scatter",
    "reduce_scatter_impl",
    "EagerAllGather",
    "release",
    "counters",
    "register_pool",
    "unregister_pool",
    "pool_for",
]

counters: collections.Counter = collections.Counter()
"""Real (non-fake) op executions in this process: ``all_gather``, ``reduce_scatter``, ``release``,
and the bytes each moved (``all_gather_bytes``: gathered buffer bytes; ``reduce_scatter_bytes``:
bytes of the padded reduce input); eager gradient contributions held for a later reduction
(``grad_accumulate``) and reductions made at the end of a backward (``reduce_scatter_flush``, also
counted in ``reduce_scatter``), see [Note: reduce once]. Tests and reports read it; nothing else
depends on it."""

# [Note: poisoned releases]
# A debugging aid (and what the compile tests run under): when set, every released gathered
# buffer is filled with NaN before it returns to its pool. A reader that runs after the release
# (a scheduling bug: [Note: release after the readers] in compile/collectives.py) then produces
# NaN at once instead of plausible, slowly diverging numbers from a buffer that the next gather
# may already be overwriting. Costs one fill per release; off by default. Environment:
# ZBUF_POISON_RELEASES=1.
POISON_RELEASES: bool = os.environ.get("ZBUF_POISON_RELEASES", "") == "1"

# param_id -> the pool its gathers draw from. Only the real implementations consult it, at run
# time; fake implementations never do (see the module docstring).
_POOL_BY_PARAM: dict[int, object] = {}
# Every pool any registered parameter uses, so release() can find a buffer's owner.
_KNOWN_POOLS: list[object] = []


def register_pool(param_id: int, pool) -> None:
    """Route ``param_id``'s gathers to ``pool`` (``zbuf.shard`` calls this for every parameter)."""
    _POOL_BY_PARAM[param_id] = pool
    if not any(p is pool for p in _KNOWN_POOLS):
        _KNOWN_POOLS.append(pool)


def unregister_pool(param_id: int) -> None:
    """Forget ``param_id`` (its shard parameter died)."""
    _POOL_BY_PARAM.pop(param_id, None)


def pool_for(param_id: int, device: torch.device):
    pool = _POOL_BY_PARAM.get(param_id)
    if pool is None:
        from .pool import default_pool

        pool = default_pool(device)
        register_pool(param_id, pool)
    return pool


def _borrowed(buf: torch.Tensor) -> torch.Tensor:
    """A view of ``buf``'s memory that does not keep ``buf``'s storage alive.

    [Note: collective output lifetime]
    A c10d work object keeps references to its output tensors and is destroyed on the backend's
    own thread some time after ``wait()`` (gloo's worker; NCCL's watchdog, which polls). If the
    collective wrote into the pool tensor itself, the pool block would come back whenever that
    thread lets go: eager gathers would overlap in the pool and blocks return in a
    timing-dependent order. The collective therefore writes through a non-owning alias. This is
    safe because the gather is synchronous (gloo has finished; under NCCL the current stream waits
    for the collective before the op returns) and a released block is reused only after its
    release event on the stream, so nothing touches the memory through the alias after the
    block goes back.
    """
    storage = torch._C._construct_storage_from_data_pointer(buf.data_ptr(), buf.device, buf.nbytes)
    return buf.new_empty(0).set_(storage, 0, buf.shape, buf.stride())


def _group(group_name: str) -> dist.ProcessGroup:
    try:
        return dist.distributed_c10d._resolve_process_group(group_name)
    except RuntimeError:
        raise RuntimeError(
            f"zbuf: process group '{group_name}' that this parameter is sharded over has been "
            f"destroyed (or never existed in this process); collectives of a sharded model need "
            f"its group alive: destroy the process group only after the last forward/backward"
        ) from None


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


def label(name: str):
    # record_function costs tens of microseconds even with no profiler running; label only then.
    return record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


def gather_into(blocks: Sequence[torch.Tensor], shards: Sequence[torch.Tensor],
                pg: dist.ProcessGroup, *, async_op: bool) -> Optional[dist.Work]:
    """Fill each padded flat block with every rank's copy of the matching shard, cast to the
    block's dtype (bf16 on the wire), in one collective. Returns the collective's work when
    ``async_op`` and it runs (None otherwise: done, or one rank).

    [Note: in-place gathers]
    When the gather casts (fp32 master shards, bf16 compute), each shard is cast straight into
    this rank's slot of its block and the collective gathers in place (the input is the output's
    slot at ``rank * shard_numel``, which NCCL and gloo both allow). A separate cast copy per
    shard would cost an allocation, and an async collective would keep it alive until the wait:
    ``1 / world`` of the gathered bytes more in flight. The casts of several blocks are one
    ``_foreach_copy_``. Without a cast the shards themselves are the inputs (parameters, which
    no compiled graph reuses: [Note: async inputs are zbuf's own]). [Note: collectives on gloo]:
    the same calls on every backend.
    """
    flat = [s.reshape(-1) for s in shards]
    world = pg.size()
    if world == 1:
        torch._foreach_copy_(blocks, flat)
        return None
    if all(s.dtype == b.dtype for s, b in zip(flat, blocks)):
        srcs = flat
    else:
        rank = pg.rank()
        srcs = [b.narrow(0, rank * s.numel(), s.numel()) for b, s in zip(blocks, flat)]
        torch._foreach_copy_(srcs, flat)
    if len(blocks) == 1:
        return dist.all_gather_into_tensor(blocks[0], srcs[0], group=pg, async_op=async_op)
    work = pg.allgather_into_tensor_coalesced(blocks, srcs)
    if async_op:
        return work
    work.wait()
    return None


def all_gather_impl(shard, param_id, shape, group_name, param_dtype) -> torch.Tensor:
    """The body of ``zbuf::all_gather`` (also run directly by the eager fast path)."""
    with label("zbuf::all_gather"):
        pg = _group(group_name)
        world = pg.size()
        _check_gather_args(shard, shape, world, param_id, param_dtype)
        dtype = param_dtype if param_dtype is not None else shard.dtype
        padded = world * shard.numel()
        buf = pool_for(param_id, shard.device).acquire((padded,), dtype)
        gather_into([_borrowed(buf) if world > 1 else buf], [shard.detach()], pg, async_op=False)
        counters["all_gather"] += 1
        counters["all_gather_bytes"] += buf.numel() * buf.element_size()
        return unpad_full(buf, shape)


@torch.library.custom_op("zbuf::all_gather", mutates_args=())
def all_gather(
    shard: torch.Tensor,
    param_id: int,
    shape: Sequence[int],
    group_name: str,
    param_dtype: Optional[torch.dtype],
    reduce_dtype: Optional[torch.dtype],
) -> torch.Tensor:
    return all_gather_impl(shard, param_id, shape, group_name, param_dtype)


@all_gather.register_fake
def _all_gather_fake(shard, param_id, shape, group_name, param_dtype, reduce_dtype):
    return shard.new_empty(shape, dtype=param_dtype if param_dtype is not None else shard.dtype)


def _all_gather_setup_context(ctx, inputs, output):
    shard, param_id, _shape, group_name, _param_dtype, reduce_dtype = inputs
    ctx.param_id = param_id
    ctx.shard_numel = shard.numel()
    ctx.shard_dtype = shard.dtype
    ctx.group_name = group_name
    ctx.reduce_dtype = reduce_dtype


def _all_gather_backward(ctx, grad):
    grad_shard = torch.ops.zbuf.reduce_scatter(
        grad, ctx.param_id, ctx.shard_numel, ctx.group_name, ctx.reduce_dtype, ctx.shard_dtype
    )
    return grad_shard, None, None, None, None, None


all_gather.register_autograd(_all_gather_backward, setup_context=_all_gather_setup_context)


# [Note: async inputs are zbuf's own]
# An async collective reads its input after the op that issued it has returned. In a compiled
# graph the input may be a graph buffer (an fp32 gradient that needs no cast or padding), and
# Inductor's generated code hands a dead buffer's memory to a later kernel ("reuse") the moment
# its last use returns: no allocator call, so neither record_stream nor c10d's stashing can see
# it, and the kernel overwrites the gradient while NCCL (or gloo's thread) still reads it. So an
# async reduce-scatter always reads a tensor zbuf made (a clone when nothing else copied it).
# test_compile_dist.py checks this with every async collective deferred to its wait: without
# the clone, first-step gradients were off by a factor of ~4; on 2x H200 the CUDA compile test
# drifted by 1e-3 in the loss.


class ReduceScatterLaunch(NamedTuple):
    """A reduce-scatter issued by ``reduce_scatter_launch``, finished by ``reduce_scatter_finish``."""

    out: torch.Tensor
    """This rank's summed slice in the reduce dtype; valid once ``work`` completed."""
    work: Optional[dist.Work]
    """The in-flight collective (None: already complete). It also holds the padded input alive
    until ``wait`` (c10d stashes the tensors of async collectives instead of record_stream)."""
    divide_by: int
    """Divisor still to apply to ``out`` (1 when the input was divided before the sum)."""


def reduce_scatter_launch(grad, param_id, shard_numel, group_name, reduce_dtype, *,
                          async_op: bool) -> ReduceScatterLaunch:
    """Cast, pad and issue the reduce-scatter of ``grad`` (the first half of ``zbuf::reduce_scatter``)."""
    pg = _group(group_name)
    world = pg.size()
    rdtype = reduce_dtype if reduce_dtype is not None else grad.dtype
    if not rdtype.is_floating_point:
        raise ValueError(
            f"zbuf::reduce_scatter: reduce_dtype must be a floating-point dtype or None, got "
            f"{reduce_dtype} (param_id {param_id})"
        )
    flat = grad.reshape(-1).to(rdtype)
    padded = world * shard_numel
    if flat.numel() > padded:
        raise ValueError(
            f"zbuf::reduce_scatter: gradient of {flat.numel()} elements does not fit {world} "
            f"shards of {shard_numel} (param_id {param_id})"
        )
    if flat.numel() < padded:
        inp = flat.new_zeros(padded)
        inp[: flat.numel()].copy_(flat)
    else:
        inp = flat.contiguous()
    # [Note: collectives on gloo]: divide before a narrow sum, after a wide one.
    pre_divide = world > 1 and rdtype.itemsize < 4
    if pre_divide:
        inp = inp / world
    if async_op and world > 1 and inp.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr():
        inp = inp.clone()  # [Note: async inputs are zbuf's own]
    out = inp.new_empty(shard_numel)
    work = None
    if world == 1:
        out.copy_(inp)
    else:
        work = dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.SUM, group=pg, async_op=async_op)
    counters["reduce_scatter"] += 1
    counters["reduce_scatter_bytes"] += inp.numel() * inp.element_size()
    return ReduceScatterLaunch(out, work if async_op else None, 1 if pre_divide else world)


def reduce_scatter_finish(launch: ReduceScatterLaunch) -> torch.Tensor:
    """Wait for ``launch`` (device-side: the current stream waits) and average in place."""
    if launch.work is not None:
        launch.work.wait()
    if launch.divide_by != 1:
        launch.out.div_(launch.divide_by)
    return launch.out


def reduce_scatter_impl(grad, param_id, shard_numel, group_name, reduce_dtype, out_dtype) -> torch.Tensor:
    """The body of ``zbuf::reduce_scatter`` (also run directly by the eager fast path)."""
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


class EagerAllGather(torch.autograd.Function):
    """``zbuf::all_gather`` with its autograd formula, minus the dispatcher (eager only).

    [Note: eager fast path]
    A ``torch.library`` custom op costs a few hundred microseconds of Python per call in eager
    mode (argument normalisation, the generated autograd wrapper, a redispatch); parameter
    access pays it for every weight, forward and re-gather. Outside tracing the accessor calls
    this Function instead: the same ``all_gather_impl`` / ``reduce_scatter_impl`` bodies, so eager
    and compiled runs compute the same thing, and the parity tests run both.
    """

    @staticmethod
    def forward(ctx, shard, spec, generation):
        # generation: from reduce_once.count_use, None when this use is not counted ([Note:
        # reduce once]). The shard is kept for an end-of-backward flush, which writes its .grad.
        ctx.spec, ctx.generation, ctx.shard = spec, generation, shard
        return all_gather_impl(shard, spec.param_id, spec.shape, spec.group_name, spec.param_dtype)

    @staticmethod
    def backward(ctx, grad):
        with label("zbuf::reduce_once"):
            return reduce_once.contribute(grad, ctx.shard, ctx.spec, ctx.generation), None, None


@torch.library.custom_op("zbuf::release", mutates_args=("t",))
def release(t: torch.Tensor) -> None:
    release_buffer(t)


def release_buffer(t: torch.Tensor) -> None:
    """The body of ``zbuf::release``, for callers already inside an op."""
    with label("zbuf::release"):
        # Release straight away and skip the pools that do not hold `t`: asking `owns` first
        # would look the buffer up twice on every release.
        if POISON_RELEASES and t.is_floating_point():
            t.fill_(float("nan"))
        for pool in _KNOWN_POOLS:
            try:
                pool.release(t)
            except (ForeignBufferError, DoubleReleaseError):
                continue
            counters["release"] += 1
            return
        raise ValueError(
            "zbuf::release: this tensor is not a live buffer of any zbuf pool; only the output of "
            "zbuf::all_gather can be released, and only once"
        )


@release.register_fake
def _release_fake(t):
    return None
