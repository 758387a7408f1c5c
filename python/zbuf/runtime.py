"""The run-time side of zbuf's collectives: pools, op counts, debug flags, process groups, and
the helpers that launch, finish and release gathers and reduce-scatters.

Everything here runs when an op actually executes (never while tracing): the custom ops of
``ops.py`` (``zbuf::all_gather``, ``zbuf::reduce_scatter``, ``zbuf::release`` and the eager
autograd function) and the graph ops of ``compile/collectives.py`` (start, wait, release) are thin
shells around these helpers, so eager and compiled runs move bytes the same way.

- the op counts' registry ([Note: counts live with their model]): ``count_into``,
  ``count_gather``, ``count_reduce_scatter``;
- ``POISON_RELEASES``: [Note: poisoned releases];
- the pool registry ([Note: pool ids]): ``pool_id_of``, ``pool_of``, ``known_pools``;
- ``process_group``: the one lookup of a group by name, with the error that names the fix;
- ``gather_into`` ([Note: in-place gathers]), ``reduce_scatter_launch`` /
  ``reduce_scatter_finish``, ``release_buffer``, ``borrowed``, ``label``.

[Note: collectives on gloo]
torch 2.11's gloo backend implements ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` on
CPU tensors (checked), so CPU runs take the same code path as NCCL. gloo has no ``ReduceOp.AVG``,
so the average is a ``SUM`` followed by a division by the world size, on every backend alike: the
result is the same sum-then-divide an unsharded reference computes for a mean over equal batch
slices (to float rounding). For reduce dtypes narrower than fp32 the division happens *before*
the sum, so the sum cannot overflow. One exception: [Note: no coalesced gathers on gloo].

[Note: no coalesced gathers on gloo]
torch 2.11's ``ProcessGroupGloo::runLoop`` stores the name of the op it just finished in
``pgStatus_->lastCompletedWorkName`` after releasing its work lock, and a group has two such
worker threads. When two async collectives finish at once, both threads assign that
``std::string``; a name longer than 15 characters lives on the heap, and the racing assignments
free the old buffer twice. ``allgather_into_tensor_coalesced`` runs as ``ALLGATHER_COALESCED``
(19 characters); zbuf's plain gathers (``ALLGATHER``) and reduce-scatters (gloo runs them as
``ALLREDUCE``) have short names, which never leave the string's inline buffer. With coalesced
gathers in flight beside other collectives, about one CPU training run in three of 300 steps on
two busy cores died: a segfault in malloc on a gloo worker thread, or with glibc's tcache off,
"double free or corruption (fasttop)" in ``runLoop`` on a chunk holding "ALLGATHER_COALESCED".
So on gloo a coalesced gather is one ``all_gather_into_tensor`` per
block, waited together (``_Works``); NCCL keeps its coalesced launch.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import weakref
from collections.abc import Sequence
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch.profiler import record_function

from .errors import DoubleReleaseError, ForeignBufferError
from .pool import default_pool

__all__ = [
    "in_backward",
    "count_into",
    "count_gather",
    "count_reduce_scatter",
    "POISON_RELEASES",
    "DEFAULT_POOL",
    "pool_id_of",
    "pool_of",
    "release_to",
    "known_pools",
    "process_group",
    "label",
    "borrowed",
    "gather_into",
    "ReduceScatterLaunch",
    "reduce_scatter_launch",
    "reduce_scatter_finish",
    "release_buffer",
    "step_into",
    "step_in_backward",
]

# [Note: counts live with their model]
# What zbuf's ops did is counted per sharded root (``ShardedRoot.counters``, read with
# ``zbuf.shard.op_counts(model)``), so two models in one process keep their own counts (``zbuf
# bench`` builds its engines in one process; the train loop records a step's collective bytes).
# Ops get nothing but their arguments, so they reach the counts through the parameter id every
# gather and reduce-scatter carries: ``_COUNTS``, parameter id -> the counter of the root that
# sharded it, filed by ``count_into`` when ``zbuf.shard`` attaches the root and held weakly (an
# entry dies with its root's counter). An op on an id that no live root sharded (a direct call of
# ``zbuf::all_gather`` on a plain tensor) counts nowhere. Releases name only their pool, which
# counts them itself (``PoolStats.releases``).
_COUNTS: dict[int, weakref.ReferenceType] = {}


def count_into(param_ids, counts) -> None:
    """Count the gathers and reduce-scatters of ``param_ids`` into ``counts`` (a
    ``collections.Counter``) for as long as it lives."""
    ids = tuple(param_ids)
    ref = weakref.ref(counts, lambda _ref: [_COUNTS.pop(i, None) for i in ids])
    for param_id in ids:
        _COUNTS[param_id] = ref


# The lookup is written out in both counting functions: a shared helper was one Python call more
# per op, 150-260 ns per count more than a module-global counter instead of 90-190 (one process,
# interleaved: benches/results/op_dispatch_cpu_counts.md).


def count_gather(param_id: int, nbytes: int) -> None:
    """One gather of ``param_id`` into a buffer of ``nbytes`` (padded)."""
    ref = _COUNTS.get(param_id)
    if ref is not None and (counts := ref()) is not None:
        counts["all_gather"] += 1
        counts["all_gather_bytes"] += nbytes


def count_reduce_scatter(param_id: int, nbytes: int) -> None:
    """One reduce-scatter of ``param_id``'s gradient, ``nbytes`` of padded input."""
    ref = _COUNTS.get(param_id)
    if ref is not None and (counts := ref()) is not None:
        counts["reduce_scatter"] += 1
        counts["reduce_scatter_bytes"] += nbytes

# The optimizers that step shards in backward ([Note: optimizer in backward] in
# zbuf/optimizer_in_backward.py), by parameter id, held weakly like the counts: an entry lives as
# long as its ``BackwardStep``.
_BACKWARD_STEPS: dict[int, weakref.ReferenceType] = {}


def step_into(param_ids, stepper) -> None:
    """Have ``stepper`` (a ``BackwardStep``) update ``param_ids`` in backward while it lives."""
    ids = tuple(param_ids)
    ref = weakref.ref(stepper, lambda _ref: [_BACKWARD_STEPS.pop(i, None) for i in ids])
    for param_id in ids:
        _BACKWARD_STEPS[param_id] = ref


def step_in_backward(grads: Sequence[torch.Tensor], param_ids: Sequence[int]) -> None:
    """Update the shards ``param_ids`` with ``grads`` through the optimizer stepping them."""
    ref = _BACKWARD_STEPS.get(param_ids[0]) if param_ids else None
    stepper = ref() if ref is not None else None
    if stepper is None:
        raise RuntimeError(
            f"zbuf::step_in_backward: no optimizer steps parameter {param_ids[0]} in backward "
            f"(the BackwardStep of zbuf.compile(..., optimizer_in_backward=True) is gone); "
            f"keep the compiled model alive while it trains")
    stepper.step(list(grads), list(param_ids))


# [Note: poisoned releases]
# A debugging aid (and what the compile tests run under): when set, every released gathered
# buffer is filled with NaN before it returns to its pool. A reader that runs after the release
# (a scheduling bug: [Note: release after the readers] in compile/collectives.py) then produces
# NaN at once instead of plausible, slowly diverging numbers from a buffer that the next gather
# may already be overwriting. Costs one fill per release; off by default. Environment:
# ZBUF_POISON_RELEASES=1.
POISON_RELEASES: bool = os.environ.get("ZBUF_POISON_RELEASES", "") == "1"

DEFAULT_POOL = -1
"""The pool id that names the process-wide default pool of the tensor's device
(``zbuf.pool.default_pool``): what a direct call of ``zbuf::all_gather`` or ``zbuf::release``
gets when it names no pool."""

# [Note: pool ids]
# A gathered buffer comes from one pool and must go back to that pool. Ops cannot take a pool
# object, so every op that takes or returns a buffer carries the pool's id (``ShardSpec.pool_id``,
# from ``pool_id_of`` when ``zbuf.shard`` runs): a release goes straight to its own pool, and a
# compiled graph knows every pool it gathers from, so its first run sizes each of them
# ([Note: pool sizing] in compile/schedule.py). Ids count up in registration order, so ranks that
# shard the same modules with the same pools (SPMD) agree on them, as they do on parameter ids.
# Only the real op implementations consult the registry, at run time; fake implementations
# never do (ops.py: they need nothing but their arguments).
# The registry holds pools weakly: a pool lives as long as what uses it (a sharded model's root,
# an engine), not as long as the process (``zbuf bench`` builds one pool per engine).
_POOLS: dict[int, weakref.ReferenceType] = {}
_pool_ids = itertools.count()


def pool_id_of(pool) -> int:
    """The id that names ``pool`` in op arguments (registered on first use: ``zbuf.shard``)."""
    for pool_id, ref in list(_POOLS.items()):  # a dying pool's callback may pop meanwhile
        if ref() is pool:
            return pool_id
    pool_id = next(_pool_ids)
    _POOLS[pool_id] = weakref.ref(pool, lambda _ref, pool_id=pool_id: _POOLS.pop(pool_id, None))
    return pool_id


def pool_of(pool_id: int, like: torch.Tensor):
    """The pool ``pool_id`` names (``DEFAULT_POOL``: the default pool of ``like``'s device).

    Takes a tensor, not its device: building a ``torch.device`` costs more than the lookup, and
    only the default pool needs one."""
    ref = _POOLS.get(pool_id)
    pool = ref() if ref is not None else None
    if pool is not None:
        return pool
    if pool_id == DEFAULT_POOL:
        return default_pool(like.device)
    raise ValueError(
        f"zbuf: no live gather-buffer pool has id {pool_id} in this process; pool ids come from "
        f"zbuf.shard (ShardSpec.pool_id) or zbuf.runtime.pool_id_of(pool), and -1 names the "
        f"device's default pool"
    )


def known_pools() -> list:
    """Every live pool that has an id (``faults`` trims them when a run fails)."""
    return [pool for ref in list(_POOLS.values()) if (pool := ref()) is not None]


_resolve_process_group = dist.distributed_c10d._resolve_process_group


def process_group(group_name: str) -> dist.ProcessGroup:
    """The live process group named ``group_name`` (``ProcessGroup.group_name``), or an error that
    says the group is gone and what to do."""
    try:
        return _resolve_process_group(group_name)
    except RuntimeError:
        raise RuntimeError(
            f"zbuf: process group '{group_name}' that this parameter is sharded over has been "
            f"destroyed (or never existed in this process); collectives of a sharded model need "
            f"its group alive: destroy the process group only after the last forward/backward"
        ) from None


def borrowed(buf: torch.Tensor, numel: Optional[int] = None) -> torch.Tensor:
    """A view of ``buf``'s memory that does not keep ``buf``'s storage alive: ``buf``'s shape,
    or with ``numel`` the flat run of ``numel`` elements from ``buf``'s first one (a gather
    buffer is the unpadded view of its padded flat block).

    [Note: collective output lifetime]
    A c10d work object keeps references to its tensors and is destroyed on the backend's own
    thread some time after ``wait()`` (gloo's worker; NCCL's watchdog, which polls). Were the
    pool tensor among them, its storage could die there: the pool block would come back
    whenever that thread lets go (eager gathers would overlap in the pool, blocks return in a
    timing-dependent order) and the buffer's DLPack deleter would run on the backend's thread.
    So every collective, eager or compiled, writes through a non-owning alias. This is safe because the
    gather is waited before its buffer is read or released (gloo has finished; under NCCL the
    current stream waits for the collective), and a released block is reused only after its
    release event on the stream, so nothing touches the memory through the alias after the
    block goes back.
    """
    storage = buf.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), buf.device,
                                                          storage.nbytes())
    if numel is None:
        return buf.new_empty(0).set_(alias, buf.storage_offset(), buf.shape, buf.stride())
    return buf.new_empty(0).set_(alias, buf.storage_offset(), (numel,), (1,))


_profiler_enabled = torch.autograd._profiler_enabled
_NO_LABEL = contextlib.nullcontext()  # reentrant and stateless: one serves every unlabelled op


def label(name: str):
    # record_function costs tens of microseconds even with no profiler running; label only then.
    return record_function(name) if _profiler_enabled() else _NO_LABEL


class _Works(NamedTuple):
    """Collectives issued together and waited together ([Note: no coalesced gathers on gloo])."""

    works: list

    def wait(self) -> None:
        for work in self.works:
            work.wait()


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
    if dist.get_backend(pg) == "gloo":  # [Note: no coalesced gathers on gloo]
        works = [dist.all_gather_into_tensor(b, src, group=pg, async_op=async_op)
                 for b, src in zip(blocks, srcs)]
        return _Works(works) if async_op else None
    work = pg.allgather_into_tensor_coalesced(blocks, srcs)
    if async_op:
        return work
    work.wait()
    return None


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


def _padded_copy(flat: torch.Tensor, dtype: torch.dtype, padded: int) -> torch.Tensor:
    """``flat`` copied (cast to ``dtype``) into the first elements of a new tensor of ``padded``,
    zeros after.

    [Note: the gradient's cast]
    A bf16 gradient reduced in fp32 (FSDP2's ``reduce_dtype``, the plain setup's) is cast at
    its full size, every weight every step. ``Tensor.to`` and ``copy_`` cast through
    TensorIterator's dynamically casting kernel (``unrolled_elementwise_kernel``), which does not
    vectorise: one qwen3-14b block's eleven gradients took 1.04 ms on an H100 (1.9 TB/s), 61 ms
    of a 2.76 s step. ``_foreach_copy_`` casts the same bytes through the multi-tensor kernel,
    which does: 0.79 ms (2.5 TB/s), bit for bit the same values (benches/grad_cast_probe.py,
    benches/results/grad_cast_probe.md). The padding is written once, not zeroed under the
    copy."""
    inp = torch.empty(padded, dtype=dtype, device=flat.device)
    torch._foreach_copy_([inp[: flat.numel()]], [flat])
    if flat.numel() < padded:
        inp[flat.numel():].zero_()
    return inp


def reduce_scatter_launch(grad, param_id, shard_numel, group_name, reduce_dtype, *,
                          async_op: bool) -> ReduceScatterLaunch:
    """Cast, pad and issue the reduce-scatter of ``grad`` (the first half of ``zbuf::reduce_scatter``)."""
    pg = process_group(group_name)
    world = pg.size()
    rdtype = reduce_dtype if reduce_dtype is not None else grad.dtype
    if not rdtype.is_floating_point:
        raise ValueError(
            f"zbuf::reduce_scatter: reduce_dtype must be a floating-point dtype or None, got "
            f"{reduce_dtype} (param_id {param_id})"
        )
    flat = grad.reshape(-1)
    padded = world * shard_numel
    if flat.numel() > padded:
        raise ValueError(
            f"zbuf::reduce_scatter: gradient of {flat.numel()} elements does not fit {world} "
            f"shards of {shard_numel} (param_id {param_id})"
        )
    if flat.dtype != rdtype or flat.numel() < padded:
        inp = _padded_copy(flat, rdtype, padded)
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
    count_reduce_scatter(param_id, inp.numel() * inp.element_size())
    return ReduceScatterLaunch(out, work if async_op else None, 1 if pre_divide else world)


def reduce_scatter_finish(launch: ReduceScatterLaunch) -> torch.Tensor:
    """Wait for ``launch`` (device-side: the current stream waits) and average in place."""
    if launch.work is not None:
        launch.work.wait()
    if launch.divide_by != 1:
        launch.out.div_(launch.divide_by)
    return launch.out


def release_buffer(t: torch.Tensor, pool_id: int) -> None:
    """Hand a gathered buffer back to its pool now (the body of ``zbuf::release``)."""
    release_to(pool_of(pool_id, t), t, pool_id)


def release_to(pool, t: torch.Tensor, pool_id: int) -> None:
    """``release_buffer`` with its pool already looked up (``pool_of(pool_id, t)``): the graph's
    ``zbuf::all_gather_release`` reads the pool's keep-set first and looks it up once."""
    with label("zbuf::release"):
        if POISON_RELEASES and t.is_floating_point():
            t.fill_(float("nan"))
        try:
            pool.release(t)
        except (ForeignBufferError, DoubleReleaseError):
            raise ValueError(
                f"zbuf::release: this tensor is not a live buffer of the pool it names (pool id "
                f"{pool_id}); only the output of zbuf::all_gather can be released, only once, and "
                f"to the pool it came from (ShardSpec.pool_id)"
            ) from None


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread. An optimizer step there is the
    optimizer in backward ([Note: optimizer in backward] in optimizer_in_backward.py), part of
    the backward phase, not a phase of its own; a gather there is a checkpoint's recompute
    ([Note: reduce once] in reduce_once.py)."""
    return torch._C._current_graph_task_id() != -1
