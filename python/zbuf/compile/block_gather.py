"""One block's weights gathered together, launched ahead of their use: the run-time unit of block
frames (compile/block_frames.py, [Note: one Dynamo frame per block]).

[Note: block gathers]
A block run as its own compiled frame receives its full weights as inputs. zbuf's runtime gathers
them before the frame runs, all of the block's parameters at once: ``launch_block_gather``
acquires one pool buffer per parameter and issues the collectives asynchronously
(``runtime.gather_into`` with ``async_op=True``: on NCCL the collective stream, on gloo its
worker threads), so the gathers of the next block can be in flight while this one computes.
``InFlightGather.wait`` is the one synchronisation point; the full tensors are unpadded views of
the pool buffers (``full_weights``) ([Note: collective output lifetime] in runtime.py: the collectives write through
non-owning aliases, so a buffer returns to its pool when the last view of it dies, never on the
backend's thread).

``FrameGather`` puts the block's gather into autograd the way ``EagerAllGather`` does for one
parameter ([Note: eager fast path] in eager_ops.py): each weight's use is counted with the root's
``ReduceOnce`` and its gradient goes through ``contribute``, so a parameter gathered at several
sites of one forward is still reduce-scattered once per step ([Note: reduce once]). One autograd
node per block: the frame's backward returns all of the block's weight gradients together.

The re-gathers for backward are block_prefetch.py's.

[Note: the gather stream]
On CUDA a block's gather runs on its pool's ``gather_stream``, not on the stream that computes
(FSDP2's all-gather streams, for the same reasons). The copy-in (each shard cast into its slot:
[Note: in-place gathers] in runtime.py) is a kernel, 8.2 ms a step at qwen3-14b as rank 0 of
8, that would otherwise queue between the compute stream's kernels; and a collective that runs
its own copies on the issuing stream (torch's fake process group copies the shard into every
rank's chunk: 6195 copies, 40.4 ms a step on the compute stream there, where FSDP2's ran on
its all-gather stream beside the compute, benches/results/onepath14.md) would add them to
the step. NCCL runs the collective on its own stream either way. Ordering: the gather stream
first waits for the current stream (the optimizer wrote the shards there) and, through the
pool's ``acquire(stream=...)``, for each buffer's last release; ``InFlightGather.wait`` makes the
current stream wait for the gather's event after the collective's own wait (on NCCL the current
stream waits for NCCL's stream; the fake group's and gloo's works are done at once). A gather
dropped unwaited makes the current stream wait before its buffers go back to the pool, so that
their release, on the current stream, comes after the gather's writes. On the host there is one
stream, and the gather runs where it is issued.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import nn

from ..param import ShardSpec, unpad_full
from ..runtime import borrowed, count_gather, gather_into, pool_of, process_group
from ..shard_state import ShardingError

__all__ = ["BlockWeights", "InFlightGather", "launch_block_gather", "FrameGather"]


class BlockWeights(NamedTuple):
    """A block's sharded parameters in frame order: ``named_parameters`` order, each shard once
    (tied names share one). The frame body receives its gathered weights in this order and maps
    them back to the shards in the same one (compile/block_frames.py)."""

    shards: tuple[nn.Parameter, ...]
    specs: tuple[ShardSpec, ...]
    gathered_nbytes: int
    """Bytes of the block's padded gather buffers (what one block's weights hold of the pool)."""

    @classmethod
    def of(cls, block: nn.Module, specs_by_shard: dict[int, ShardSpec]) -> "BlockWeights":
        """``specs_by_shard``: id(shard parameter) -> its spec, for the model's root."""
        shards, specs = [], []
        for name, p in block.named_parameters():
            spec = specs_by_shard.get(id(p))
            if spec is None:
                raise ShardingError(
                    f"parameter '{name}' of block {type(block).__name__} is not a zbuf shard of "
                    f"the model; shard the whole model with zbuf.shard before compiling it")
            shards.append(p)
            specs.append(spec)
        if len({s.group_name for s in specs}) > 1 or len({s.pool_id for s in specs}) > 1:
            raise ShardingError(f"block {type(block).__name__} holds shards of several zbuf.shard "
                                f"calls; a block's weights are gathered together from one group")
        return cls(tuple(shards), tuple(specs), sum(s.gathered_nbytes for s in specs))


class InFlightGather:
    """The gathers of one block, launched together by ``launch_block_gather`` and waited once."""

    __slots__ = ("weights", "buffers", "_work", "_written")

    def __init__(self, weights: BlockWeights, buffers: tuple[torch.Tensor, ...], work,
                 written: Optional[torch.cuda.Event]) -> None:
        self.weights = weights
        self.buffers = buffers
        """The padded, flat pool buffers, one per parameter (producer: ``launch_block_gather``;
        consumers: ``wait``'s full views, which keep them alive)."""
        self._work = work
        """The collectives (producer: ``launch_block_gather``; consumer: ``wait``, which drops
        it); None once waited, or when nothing was in flight (one rank)."""
        self._written = written
        """Where the pool's gather stream stood once the copy-in and the collective's issue
        were queued (producer: ``launch_block_gather``; consumer: ``wait``, or the drop of an
        unwaited gather: [Note: the gather stream]); None once waited, and on the host."""

    def wait(self) -> None:
        """Wait for the collectives (on CUDA: the current stream waits); once."""
        if self._work is not None:
            work, self._work = self._work, None
            work.wait()
        self._wait_written()

    def _wait_written(self) -> None:
        if self._written is not None:
            written, self._written = self._written, None
            torch.cuda.current_stream(self.buffers[0].device).wait_event(written)

    def __del__(self) -> None:
        self._wait_written()  # before the buffers go back to the pool: [Note: the gather stream]

    def full_weights(self) -> tuple[torch.Tensor, ...]:
        """The full weights, unpadded views of the buffers (after ``wait``)."""
        return tuple(unpad_full(b, s.shape) for b, s in zip(self.buffers, self.weights.specs))


def launch_block_gather(weights: BlockWeights) -> InFlightGather:
    """Acquire the block's buffers from its pool and issue its gathers asynchronously
    ([Note: block gathers]). Collective: every rank must launch the same blocks in the same
    order."""
    specs, shards = weights.specs, weights.shards
    pg = process_group(specs[0].group_name)
    world = pg.size()
    pool = pool_of(specs[0].pool_id, shards[0])
    stream = pool.gather_stream  # [Note: the gather stream]
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(stream.device))
    buffers = tuple(
        pool.acquire((world * s.shard_numel,),
                     s.param_dtype if s.param_dtype is not None else s.dtype, stream)
        for s in specs)
    blocks = [borrowed(b) for b in buffers] if world > 1 else list(buffers)
    with torch.cuda.stream(stream):  # None: no stream to enter
        work = gather_into(blocks, [p.detach() for p in shards], pg, async_op=True)
        written = stream.record_event() if stream is not None else None
    for buf, spec in zip(buffers, specs):
        count_gather(spec.param_id, buf.numel() * buf.element_size())
    return InFlightGather(weights, buffers, work, written)


class FrameGather(torch.autograd.Function):
    """A block's gathered weights as autograd sees them: ``apply(gather, reducer, generations,
    *shards)`` waits for ``gather`` and returns its full weights; backward hands each weight's
    gradient to ``reducer.contribute`` ([Note: block gathers])."""

    @staticmethod
    def forward(ctx, gather: InFlightGather, reducer, generations: tuple[Optional[int], ...],
                *shards):
        # reducer: the root's reduce_once.ReduceOnce; generations: from its count_use per shard,
        # None for a use not counted (frozen, or under no_grad). The shards are kept for the
        # reducer's end-of-backward flush, which writes their .grad.
        ctx.specs, ctx.reducer, ctx.generations, ctx.shards = (gather.weights.specs, reducer,
                                                               generations, shards)
        ctx.set_materialize_grads(False)  # a weight the block did not use gets no gradient
        gather.wait()
        return gather.full_weights()

    @staticmethod
    def backward(ctx, *grads):
        out = []
        for i, (grad, shard, spec, gen) in enumerate(zip(grads, ctx.shards, ctx.specs,
                                                         ctx.generations)):
            if grad is None or not ctx.needs_input_grad[3 + i]:
                out.append(None)
            else:
                out.append(ctx.reducer.contribute(grad, shard, spec, gen))
        return (None, None, None, *out)
