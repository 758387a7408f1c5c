"""The ops the compile pass puts in graphs: gather buffer, start, wait, release, reduce, check.

``zbuf::gather_buffer(Tensor(a!) token, Tensor shard, int param_id, SymInt[] shape, str group_name,
                      ScalarType? param_dtype, int pool_id, int keep_role=0) -> Tensor``
    Fresh memory from pool ``pool_id`` ([Note: pool ids] in runtime.py) for ``param_id``'s gather, laid out exactly as ``zbuf::all_gather`` lays it
    out ([Note: shard layout] in param.py): the full tensor, a view of the padded flat block.
    Contents undefined until the wait of the start that fills it. ``keep_role`` (zbuf/kept_weights.py):
    in a training forward (``HOLDS``) the buffer of a weight in the pool's keep-set is held at
    its release; in a backward (``TAKES``) a held buffer is returned, already filled (its start
    skips it) ([Note: weights kept at run time]).
``zbuf::all_gather_start(Tensor(a!) token, Tensor(b!)[] gathered, Tensor[] shards,
                         str group_name) -> ()``
    Issues ONE collective that fills every buffer in ``gathered`` from the matching ``shards``
    (cast to the buffers' dtype, in place: [Note: in-place gathers] in runtime.py), and returns
    without waiting. Buffers that ``gather_buffer`` returned filled (held from forward) are
    left out; when none is left, no collective is issued.
    Coalescing needs no copy-out: ``ProcessGroup.allgather_into_tensor_coalesced`` writes each
    parameter's padded block directly (one NCCL group; on gloo one gather per block instead,
    [Note: no coalesced gathers on gloo] in runtime.py).
``zbuf::all_gather_wait(Tensor(a!) token, Tensor(b!)[] gathered) -> ()``
    Waits for the start that filled ``gathered`` (found by the first buffer's storage, on the
    token: [Note: work in flight lives on the token]).
``zbuf::all_gather_release(Tensor(a!) token, Tensor(b!)[] released, int[] pool_ids,
                           Tensor[] after) -> ()``
    ``zbuf::release`` with the token, of each buffer in turn: returns ``released[i]`` to pool
    ``pool_ids[i]`` right after its last use (or holds it for backward: a kept weight that
    a forward ``gather_buffer`` noted). ``after``: the outputs of every node that reads any
    of them ([Note: release after the readers]). One op for all the buffers released at one
    slot ([Note: one release per slot] in rewrite.py).
``zbuf::hold_released(Tensor(a!) token, Tensor(b!)[] released) -> ()``
    Does nothing; the graph's last zbuf op takes every buffer the graph released ([Note: the
    pool's memory is not Inductor's]).
``zbuf::reduce_scatter_start(Tensor(a!) token, Tensor grad, int param_id, SymInt shard_numel,
                             str group_name, ScalarType? reduce_dtype) -> Tensor``
    The first half of ``zbuf::reduce_scatter`` (``runtime.reduce_scatter_launch``): casts and
    pads ``grad`` and issues the collective without waiting; returns this rank's slice, in the reduce dtype, whose contents
    are valid only after the matching wait. The pass substitutes a start/wait pair for every
    ``zbuf::reduce_scatter`` that autograd put in a graph ([Note: the pool's memory is not Inductor's]
A gathered buffer is a tensor over a pool block, returned by ``gather_buffer``; to Inductor it
is a buffer like any other, dead after its last reader, which is its release. Inductor's wrapper
reuses dead buffers' storage for later tensors (``buf243 = reinterpret_tensor(buf47, ...); del
buf47  # reuse``), so it wrote a norm weight's gradient, or a saved activation, into a block the
pool had taken back and handed to the next gather: on one H200 (world 1, fp32, no collective
involved) eight gradients of layer 0 and the embedding were 55-77 % off eager's,
deterministically (the same with CUDA_LAUNCH_BLOCKING=1; exact under ``aot_eager``, which reuses
nothing), and poisoned releases could not see it: the reuse overwrites the poison. So the
rewrite ends every graph with ``hold_released``, which takes every released buffer as written:
their last use is the graph's end, after which Inductor allocates nothing, so it never reuses
the pool's memory. The tensors' lifetime as Python objects grows to the graph's end; the blocks
went back to the pool at their releases as before (stream-ordered: [Note: release contract] in
pool.py).

[Note: reduce-scatter overlap]).
``zbuf::reduce_scatter_wait(Tensor(a!) token, Tensor(b!) started) -> ()``
    Makes the current stream wait for the start that returned ``started`` and averages it in
    place: the same arithmetic as ``zbuf::reduce_scatter``.
``zbuf::check_schedule(Tensor(a!) token, str group_name, str fingerprint, str collectives,
                       int[] pool_ids, int[] buffer_sizes, int[] buffer_counts, int param_id,
                       str record) -> ()``
    Every run of a compiled graph: checks that every rank runs a graph with the same
    ``fingerprint`` (its input shapes and collective order, described by ``collectives``;
    fingerprint.py, [Note: collective order check]), with the keep-sets of its pools folded in
    (the gathers a kept weight skips: [Note: weights kept at run time] in zbuf/kept_weights.py);
    an empty ``fingerprint`` skips that.
    First run only: grows each pool the graph gathers from so that pool ``pool_ids[i]`` can
    keep ``buffer_counts[i]`` blocks of ``buffer_sizes[i]`` bytes ([Note: pool sizing] in
    schedule.py): after warm-up no gather allocates; registers the graph's schedule ``record``
    (report.py) if its compilation did not (a cache hit), with the records of the model that
    holds ``param_id`` (one of the parameters the graph gathers or reduces: [Note: records live
    with their model] in report.py), which also remember that the first run is done. Doing this
    at run time (not at compile time) keeps it working when Inductor serves the graph from its
    cache and no pass runs.

Why buffers come from their own op: Inductor lowers a mutating custom op only when it is
auto-functionalizable, which rules out returning a list of tensors; a start that *writes into*
buffers made by ``gather_buffer`` (one tensor each) is.

[Note: schedule token]
Every op above mutates one small ``token`` tensor that the pass creates at the top of the graph.
Mutations of one buffer are never reordered, so the token pins the relative order of all zbuf
ops exactly as planned, whatever Inductor's scheduler does with the compute around them (the
fingerprint's collective order then is the executed order). The token carries no data.
It only works if *every* collective is on the chain: an op outside it is placed by data
dependencies alone. The functional ``zbuf::reduce_scatter`` was (on CUDA, Inductor's fusion
choices moved all of a backward's reduce-scatters after all of its releases), so the pass
replaces it with ``zbuf::reduce_scatter_start`` / ``_wait`` and ``check_token_chain`` (rewrite.py)
refuses a graph in which any collective does not mutate the token.

[Note: release after the readers]
Declaring ``t`` mutated does not stop Inductor from running a reader of ``t`` after the release:
it fused a reader (an RMSNorm's weight multiply) with later nodes into one kernel and emitted
that kernel after the release, so the kernel read a buffer the next gather was already reusing
(found with poisoned releases; on CPU the losses drifted, on 2x H200 a memory-capped qwen3-8b
trained visibly slower). The release therefore also takes the outputs of all of ``t``'s readers
as inputs: a true data dependency, which no scheduling or fusion can reorder.

[Note: reduce-scatter overlap]
A synchronous reduce-scatter runs on the compute stream (torch 2.11's ProcessGroupNCCL issues
``async_op=False`` collectives on the current stream), so backward compute stops for every one:
on 2x H200 that was 23 ms of a 483 ms qwen3-1.7b step with nothing else running. The start
issues it on NCCL's stream instead, after the compute that produced the gradient; the wait puts
the compute stream behind it only where the result is needed, which the pass places later
(``thread_reduce_scatters`` in rewrite.py): before the first reader of the gradient, or once the
padded inputs of the reduce-scatters in flight would exceed ``RS_IN_FLIGHT_BYTES`` (rewrite.py;
c10d keeps each input alive until its wait, so this bounds the extra memory).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import torch

from .. import runtime
from ..kept_weights import NEITHER, TAKES
from ..memory import pool_budget
from ..param import unpad_full
from . import report
from .fingerprint import check_across_ranks

__all__ = [
    "gather_buffer",
    "all_gather_start",
    "all_gather_wait",
    "all_gather_release",
    "hold_released",
    "step_in_backward",
    "reduce_scatter_start",
    "reduce_scatter_wait",
    "check_schedule",
    "with_keep_sets",
    "pending",
]

# [Note: work in flight lives on the token]
# A wait finds the work its start issued through the schedule token, the first argument of both
# ops (the ops get nothing but their arguments): a graph run's collectives in flight are kept in
# two dicts that are attributes of its token, keyed by storage pointer:
# ``_zbuf_gathers_in_flight``, first buffer's storage pointer -> the in-flight collective (None
# when it completed at once), made by all_gather_start, popped by all_gather_wait; and
# ``_zbuf_reduce_scatters_in_flight``, the started slice's storage pointer -> its launch, made
# by reduce_scatter_start, popped by reduce_scatter_wait. A start and its wait are always in one
# graph (the rewrite pairs them), so the work lives and dies with the run that issued it: two
# graphs, or two models, never see each other's, and a run that raises between a start and its
# wait leaves nothing behind. Reading a tensor's attribute costs what reading a module global
# did (about 65 ns on the 2-core CPU; ``token.__dict__.get`` costs twice that), and only the
# first start of a run pays for the AttributeError that creates its dict
# (benches/results/op_dispatch_cpu_globals.md).


def pending(token: torch.Tensor) -> int:
    """Gathers and reduce-scatters started on ``token`` and not yet waited for."""
    return sum(len(token.__dict__.get(name, ()))
               for name in ("_zbuf_gathers_in_flight", "_zbuf_reduce_scatters_in_flight"))


# [Note: lean dispatch]
# These ops run once or more per gathered parameter per step, from the compiled graph's Python
# wrapper, so their host cost adds up: on qwen3-1.7b the forward was host-bound. An op made with
# ``torch.library.custom_op`` goes through Python autograd and ADInplaceOrView kernels and a
# ``torch._dynamo.disable`` wrapper on every call even when, as here, it never needs autograd
# (the pass inserts these ops after AOTAutograd, into graphs that run under no_grad). Defined
# with ``torch.library.Library`` and one ``CompositeExplicitAutograd`` Python kernel (a single
# C++ dispatch into Python), with the schemas ``custom_op`` would infer and a fake kernel each,
# the same kernels cost 25-28 us less per call on a 2-core CPU (``benches/op_dispatch_bench.py``,
# results/op_dispatch_cpu.md): a gather's buffer-start-wait-release cycle 88 us instead of 198.
# qwen3-1.7b makes about 1,400 such calls per step.
_LIB = torch.library.Library("zbuf", "FRAGMENT")


def _op(schema: str):
    """Define ``zbuf::<schema>`` with the decorated function as its kernel ([Note: lean dispatch]).

    The fake kernel is registered with ``.register_fake`` on the returned function."""

    def define(fn):
        name = schema.split("(", 1)[0]
        _LIB.define(schema, tags=(torch.Tag.pt2_compliant_tag,))
        _LIB.impl(name, fn, "CompositeExplicitAutograd")

        def register_fake(fake):
            torch.library.register_fake(f"zbuf::{name}", fake, lib=_LIB)
            return fake

        fn.register_fake = register_fake
        return fn

    return define


@_op(
    "gather_buffer(Tensor(a0!) token, Tensor shard, SymInt param_id, SymInt[] shape, "
    "str group_name, ScalarType? param_dtype, SymInt pool_id, int keep_role=0) -> Tensor"
)
def gather_buffer(
    token: torch.Tensor,
    shard: torch.Tensor,
    param_id: int,
    shape: Sequence[int],
    group_name: str,
    param_dtype: Optional[torch.dtype],
    pool_id: int,
    keep_role: int = NEITHER,
) -> torch.Tensor:
    pool = runtime.pool_of(pool_id, shard)
    kept = pool.kept if keep_role else None
    if kept:  # [Note: weights kept at run time] in zbuf/kept_weights.py
        if keep_role == TAKES:
            held = kept.take(param_id)
            if held is not None:
                _mark_filled(token, held)
                return held
        else:
            out = _fresh_buffer(shard, param_id, shape, group_name, param_dtype, pool)
            kept.note_forward_gather(pool, param_id, out)
            return out
    return _fresh_buffer(shard, param_id, shape, group_name, param_dtype, pool)


def _mark_filled(token: torch.Tensor, buf: torch.Tensor) -> None:
    """``buf`` holds its weight already: the start that would fill it skips it."""
    key = buf.untyped_storage().data_ptr()
    try:  # [Note: work in flight lives on the token]
        token._zbuf_filled.add(key)
    except AttributeError:
        token._zbuf_filled = {key}


def _fresh_buffer(shard, param_id, shape, group_name, param_dtype, pool) -> torch.Tensor:
    world = runtime.process_group(group_name).size()
    dtype = param_dtype if param_dtype is not None else shard.dtype
    padded = world * shard.numel()
    if math.prod(shape) > padded:
        raise ValueError(
            f"zbuf::gather_buffer: shape {list(shape)} has more elements than {world} shards of "
            f"{shard.numel()} (param_id {param_id})"
        )
    buf = pool.acquire((padded,), dtype)
    # Counted here, not at the start that fills it: the start names no parameter id ([Note:
    # counts live with their model] in runtime.py), and every buffer's gather starts in its graph.
    runtime.count_gather(param_id, buf.numel() * buf.element_size())
    return unpad_full(buf, shape)


@gather_buffer.register_fake
def _gather_buffer_fake(token, shard, param_id, shape, group_name, param_dtype, pool_id,
                        keep_role=NEITHER):
    return shard.new_empty(shape, dtype=param_dtype if param_dtype is not None else shard.dtype)


@_op(
    "all_gather_start(Tensor(a0!) token, Tensor(a1!)[] gathered, Tensor[] shards, "
    "str group_name) -> ()"
)
def all_gather_start(
    token: torch.Tensor,
    gathered: Sequence[torch.Tensor],
    shards: Sequence[torch.Tensor],
    group_name: str,
) -> None:
    with runtime.label("zbuf::all_gather_start"):
        if len(gathered) != len(shards) or not shards:
            raise ValueError(
                f"zbuf::all_gather_start: {len(gathered)} buffers for {len(shards)} shards"
            )
        pg = runtime.process_group(group_name)
        key = gathered[0].untyped_storage().data_ptr()
        filled = token.__dict__.get("_zbuf_filled")
        if filled:  # buffers held from forward ([Note: weights kept at run time])
            todo = [(g, s) for g, s in zip(gathered, shards)
                    if g.untyped_storage().data_ptr() not in filled]
            filled.difference_update(g.untyped_storage().data_ptr() for g in gathered)
        else:
            todo = list(zip(gathered, shards))
        work = None
        if todo:
            # The padded flat blocks (see ``unpad_full``), through aliases that the collective's
            # work object cannot keep alive ([Note: collective output lifetime] in runtime.py).
            blocks = [runtime.borrowed(g, pg.size() * s.numel()) for g, s in todo]
            # [Note: in-place gathers]
            work = runtime.gather_into(blocks, [s for _, s in todo], pg, async_op=True)
        try:  # [Note: work in flight lives on the token]
            token._zbuf_gathers_in_flight[key] = work
        except AttributeError:
            token._zbuf_gathers_in_flight = {key: work}


@all_gather_start.register_fake
def _all_gather_start_fake(token, gathered, shards, group_name):
    return None


@_op("all_gather_wait(Tensor(a0!) token, Tensor(a1!)[] gathered) -> ()")
def all_gather_wait(token: torch.Tensor, gathered: Sequence[torch.Tensor]) -> None:
    with runtime.label("zbuf::all_gather_wait"):
        try:
            work = token._zbuf_gathers_in_flight.pop(gathered[0].untyped_storage().data_ptr())
        except (AttributeError, KeyError):
            raise RuntimeError(
                "zbuf::all_gather_wait: no gather started on this token owns this buffer (waited "
                "twice, or the graph was rewritten wrongly); this is a zbuf bug"
            ) from None
        if work is not None:
            work.wait()


@all_gather_wait.register_fake
def _all_gather_wait_fake(token, gathered):
    return None


@_op("all_gather_release(Tensor(a0!) token, Tensor(a1!)[] released, SymInt[] pool_ids, "
     "Tensor[] after) -> ()")
def all_gather_release(token: torch.Tensor, released: Sequence[torch.Tensor],
                       pool_ids: Sequence[int], after: Sequence[torch.Tensor]) -> None:
    # `after` is only read by the compiler: [Note: release after the readers].
    for t, pool_id in zip(released, pool_ids, strict=True):
        pool = runtime.pool_of(pool_id, t)
        kept = pool.kept
        if kept and kept.hold_if_kept(t):  # [Note: weights kept at run time]
            continue
        runtime.release_to(pool, t, pool_id)


@all_gather_release.register_fake
def _all_gather_release_fake(token, released, pool_ids, after):
    return None


@_op("hold_released(Tensor(a0!) token, Tensor(a1!)[] released) -> ()")
def hold_released(token: torch.Tensor, released: Sequence[torch.Tensor]) -> None:
    # Only the compiler reads it: [Note: the pool's memory is not Inductor's].
    pass


@hold_released.register_fake
def _hold_released_fake(token, released):
    return None


@_op("step_in_backward(Tensor(a0!) token, Tensor[] grads, SymInt[] param_ids) -> ()")
def step_in_backward(token: torch.Tensor, grads: Sequence[torch.Tensor],
                     param_ids: Sequence[int]) -> None:
    # [Note: optimizer in backward] in zbuf/optimizer_in_backward.py
    with runtime.label("zbuf::step_in_backward"):
        runtime.step_in_backward(grads, param_ids)


@step_in_backward.register_fake
def _step_in_backward_fake(token, grads, param_ids):
    return None


@_op(
    "reduce_scatter_start(Tensor(a0!) token, Tensor grad, SymInt param_id, SymInt shard_numel, "
    "str group_name, ScalarType? reduce_dtype) -> Tensor"
)
def reduce_scatter_start(
    token: torch.Tensor,
    grad: torch.Tensor,
    param_id: int,
    shard_numel: int,
    group_name: str,
    reduce_dtype: Optional[torch.dtype],
) -> torch.Tensor:
    with runtime.label("zbuf::reduce_scatter_start"):
        launch = runtime.reduce_scatter_launch(grad, param_id, shard_numel, group_name, reduce_dtype,
                                            async_op=True)
        key = launch.out.untyped_storage().data_ptr()
        try:  # [Note: work in flight lives on the token]
            token._zbuf_reduce_scatters_in_flight[key] = launch
        except AttributeError:
            token._zbuf_reduce_scatters_in_flight = {key: launch}
        return launch.out


@reduce_scatter_start.register_fake
def _reduce_scatter_start_fake(token, grad, param_id, shard_numel, group_name, reduce_dtype):
    return grad.new_empty((shard_numel,), dtype=reduce_dtype if reduce_dtype is not None else grad.dtype)


@_op("reduce_scatter_wait(Tensor(a0!) token, Tensor(a1!) started) -> ()")
def reduce_scatter_wait(token: torch.Tensor, started: torch.Tensor) -> None:
    with runtime.label("zbuf::reduce_scatter_wait"):
        try:
            launch = token._zbuf_reduce_scatters_in_flight.pop(started.untyped_storage().data_ptr())
        except (AttributeError, KeyError):
            raise RuntimeError(
                "zbuf::reduce_scatter_wait: no reduce-scatter started on this token owns this "
                "tensor (waited twice, or the graph was rewritten wrongly); this is a zbuf bug"
            ) from None
        runtime.reduce_scatter_finish(launch)


@reduce_scatter_wait.register_fake
def _reduce_scatter_wait_fake(token, started):
    return None


def with_keep_sets(like: torch.Tensor, pool_ids: Sequence[int], fingerprint: str,
                   description: str) -> tuple[str, str]:
    """A graph's fingerprint and description with the keep-sets of the pools it gathers from
    folded in: the gathers a kept weight skips are part of its collective order ([Note: weights
    kept at run time] in zbuf/kept_weights.py)."""
    for pool in {id(p): p for p in (runtime.pool_of(i, like) for i in pool_ids)}.values():
        if pool.kept:
            fingerprint, description = pool.kept.fingerprint(fingerprint, description)
    return fingerprint, description


def _grow_pools(token: torch.Tensor, pool_ids: Sequence[int], sizes: Sequence[int],
                counts: Sequence[int]) -> None:
    """[Note: pool sizing] for every pool a graph gathers from (two ids may name one pool)."""
    need: dict[int, tuple[object, int]] = {}
    for pool_id, size, count in zip(pool_ids, sizes, counts):
        pool = runtime.pool_of(pool_id, token)
        capacity = getattr(pool, "capacity_for", lambda n: n)
        _, before = need.get(id(pool), (pool, 0))
        if not before:  # the blocks it holds for kept weights ([Note: weights kept at run time])
            before = pool.kept.capacity_bytes(pool)
        need[id(pool)] = (pool, before + capacity(size) * count)
    for pool, nbytes in need.values():
        pool_budget.raise_to(pool, nbytes)


@_op(
    "check_schedule(Tensor(a0!) token, str group_name, str fingerprint, str collectives, "
    "SymInt[] pool_ids, SymInt[] buffer_sizes, SymInt[] buffer_counts, SymInt param_id, "
    "str record) -> ()"
)
def check_schedule(
    token: torch.Tensor,
    group_name: str,
    fingerprint: str,
    collectives: str,
    pool_ids: Sequence[int],
    buffer_sizes: Sequence[int],
    buffer_counts: Sequence[int],
    param_id: int,
    record: str,
) -> None:
    with runtime.label("zbuf::check_schedule"):
        if fingerprint:  # every run: [Note: collective order check]
            fingerprint, collectives = with_keep_sets(token, pool_ids, fingerprint, collectives)
            check_across_ranks(group_name, fingerprint, collectives)
        key = (group_name, fingerprint, record)
        owner = report.records_of(param_id)
        if owner is not None and key in owner.first_runs:
            return
        _grow_pools(token, pool_ids, buffer_sizes, buffer_counts)
        report.record(record).first_runs.add(key)  # the records of the graph's model


@check_schedule.register_fake
def _check_schedule_fake(token, group_name, fingerprint, collectives, pool_ids, buffer_sizes,
                         buffer_counts, param_id, record):
    return None
