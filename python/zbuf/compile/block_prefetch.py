"""The cross-block schedule of block frames: each block's weights gathered before it runs, the
next block's gathered one block ahead, released after the block, re-gathered for its backward
with the block before it prefetched then.

[Note: two blocks live]
Under block frames (compile/block_frames.py, [Note: one Dynamo frame per block]) no graph holds
the whole step, so the schedule the planner derives from the graph elsewhere is fixed here, the
one FSDP2 runs:

- Forward, block i of a stack (``BlockPrefetch.run``): its gather was launched when block i-1
  ran (or is launched now, for the first block or when the blocks run out of order); block
  i+1's gather is launched now, asynchronously, before block i computes; block i's weights are
  waited, handed to its frame, and released when the frame returns (the last view dies: the
  frame's autograd saves no gathered weight, see below).
- Backward: autograd saves the gathered weights that the frame's backward needs; the frame's
  saved-tensor hooks (``SavedBlock.pack``) store a recipe (parameter index, view geometry) in
  their place, as [Note: eager re-gather] does for one weight. When the frame's backward unpacks
  them (all at once, when it starts: AOTAutograd's backward reads every saved tensor first),
  ``SavedBlock.unpack`` gathers the whole block again and launches the gather of the block that
  ran before it in forward (the next one backward reaches). Under a checkpoint inside the block
  the recompute reads the same re-gathered weights.

A block's re-gather is one launch of the weights its frame saved (all of them for a transformer
block; a bias, which no gradient reads, is left out), in parameter order.

So at most two blocks' gathered weights are live at any time, forward and backward: the block
computing and the one in flight. Blocks of one stack have one structure, so two blocks are
``2 * max(BlockWeights.gathered_nbytes)``, what ``FramePlan`` (compile/block_frames.py) checks
against the rank-agreed memory before the first step, and without room for it the plan turns
prefetch off (one block live). Parameters outside the stacks (embedding, final norm, head) are
gathered one at a time by parameter access, as eager zbuf does, never while a block's weights are
live in forward.

Rank consistency: the launches depend only on the order the blocks are called in and the order
backward reaches them, which the program fixes (the same model and inputs' shapes on every
rank): every rank issues the same gathers in the same order. A gather launched for a block that
does not come next (a block skipped, or called out of stack order) is waited and dropped at the
next block's call, and that block gathers on demand, or at the end of the model's forward
(``finish_forward``): the order still depends on the program only.

[Note: block order check]
The launches are a function of the sequence of block calls (and of ``prefetch``, rank-agreed),
so that sequence is what ranks must agree on; rank-dependent control flow that calls blocks in
another order would pair one rank's gathers of a block with another rank's of a different block
of the same shapes, silently mixing weights. During the model's first forward, before each block
call launches anything, the ranks compare the calls so far (``compile/fingerprint.py``'s check:
one 8-byte all-gather per block call, and the descriptions only on a mismatch), and a mismatch
raises ``ScheduleMismatchError`` on every rank naming the first call that differs. Under
``recompute="auto"`` each call also names the recompute level of its frame, and a block whose
weights are kept for backward says so; the first forward after each re-plan decision is checked
too (``check_next_forward``, [Note: block levels] in compile/block_replan.py): a block at
another level saves other weights, and a kept one re-gathers none, so their backward gathers
differ. Other forwards
are not checked (a check per block call would stop the host at every block on NCCL); the
whole-graph structure checks every run of its graphs instead. Off with
``check_fingerprint=False``.

[Note: blocks kept for backward]
With room to spare after the measured step (compile/block_replan.py), the last blocks that
forward calls, the first that backward reaches, keep their forward gather for backward, as
FSDP2's ``reshard_after_forward=False`` does per block: their ``SavedBlock`` holds the forward's
``InFlightGather`` and hands it to the backward's unpacks, which issue no collective. Each kept
block holds its weights from its forward to its backward on top of the two blocks live, which
the pool's budget grows by. A forward whose backward never comes (the graph dropped) drops the
buffers with the graph. Several forwards before one backward (accumulated micro-batches) hold
one copy per forward; what the budget does not cover the pool serves outside it (counted as
misses), never failing.

A block called inside a backward (an eager checkpoint around the block, recomputing it) gathers
on demand with no hooks of its own: the checkpoint's hooks own what it saves. When the checkpoint
is the frames' own (level 0 under ``recompute="auto"``, [Note: block levels] in
compile/block_replan.py), the forward installs no hooks either, and the recompute launches the
gather of the block before it when that one recomputes too (the next block backward reaches),
or uses its forward gather when the block's weights are kept for backward (``HeldGather``).
"""

from __future__ import annotations

import json
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import nn

from .block_gather import BlockWeights, FrameGather, InFlightGather, launch_block_gather
from .block_offload import OffloadedCall, OffloadedTensor
from ..runtime import in_backward
from .fingerprint import check_across_ranks, fingerprint_of

__all__ = ["BlockPrefetch", "SavedBlock", "FrameSlot", "HeldGather"]


class FrameSlot(NamedTuple):
    """Where a block sits in its stack: what ``BlockPrefetch.run`` needs of it."""

    weights: BlockWeights
    next: Optional[BlockWeights]
    """The weights of the block after it in its stack (None for the last): prefetched while it
    runs."""
    previous: Optional[BlockWeights]
    """The weights of the block before it (None for the first): prefetched when its backward
    starts."""


class HeldGather:
    """A checkpointed block call's forward gather, kept for its recompute ([Note: blocks kept for
    backward]): it lives in the checkpoint's closure, so it dies with the autograd graph."""

    __slots__ = ("gather",)

    def __init__(self) -> None:
        self.gather: Optional[InFlightGather] = None


class _SavedWeight(NamedTuple):
    """What a frame's autograd saves in place of a gathered weight (or a view of one)."""

    block: "SavedBlock"
    index: int
    """Which of the block's parameters (``BlockWeights`` order)."""
    size: torch.Size
    stride: tuple[int, ...]
    offset: int
    """Storage offset relative to the buffer's own."""


class SavedBlock:
    """One block call's gathered weights as its frame's autograd saved them ([Note: two blocks
    live]): re-gathered when the frame's backward unpacks them, with the block called before it
    prefetched then."""

    __slots__ = ("weights", "previous", "prefetch", "_buffer_index", "_packed", "_unpacks_left",
                 "_regather", "_saved", "_position", "_held", "activations", "reached")

    def __init__(self, weights: BlockWeights, forward_gather: InFlightGather,
                 previous: Optional["SavedBlock"], prefetch: bool, *, hold: bool = False,
                 activations: Optional[OffloadedCall] = None,
                 reached: Optional[Callable[[], None]] = None) -> None:
        self.weights = weights
        self.activations = activations
        """Where the call's other saved tensors go when the call is offloaded ([Note: offloaded
        blocks] in block_offload.py); None: they stay where autograd keeps them."""
        self.reached = reached
        """Called when the call's backward first unpacks a weight: the offloaded calls before it
        start their uploads (None when no call is offloaded)."""
        self.previous = previous
        """The block called just before this one in the same forward (its stack predecessor),
        or None: its re-gather is launched when this block's backward starts (producer: the
        forward; consumer: ``unpack``, which drops it)."""
        self.prefetch = prefetch
        self._buffer_index = {b.untyped_storage().data_ptr(): (i, b.storage_offset(), b.dtype)
                              for i, b in enumerate(forward_gather.buffers)}
        """Storage of each forward buffer -> (parameter index, its offset, dtype); ints only, so
        the forward's buffers are not kept alive (producer: ``__init__``; consumer: ``pack``)."""
        self._packed = 0
        """Weights (and views of them) saved by the frame (producer: ``pack``)."""
        self._unpacks_left = 0
        """Of those, not yet unpacked by the current backward (consumer: ``unpack``)."""
        self._regather: Optional[InFlightGather] = None
        """The backward's gather of this block: launched by the first ``unpack`` of it, or
        prefetched by the ``unpack`` of the block after it; dropped once every saved weight
        was unpacked, so the views handed to backward are its only holders."""
        self._saved: set[int] = set()
        """Indices of the parameters the frame saved (producer: ``pack``, in forward; consumer:
        ``_launch``, in backward, which re-gathers those only)."""
        self._position: dict[int, int] = {}
        """Parameter index -> its buffer in the re-gather (producer: ``_launch``)."""
        self._held: Optional[InFlightGather] = forward_gather if hold else None
        """The forward's gather, kept for backward ([Note: blocks kept for backward]): its
        buffers stay out of the pool (producer: ``__init__``; consumer: ``_launch``, which makes
        it the backward's gather, no collective issued)."""

    def pack(self, t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.device.type == "meta":
            return t
        found = self._buffer_index.get(t.untyped_storage().data_ptr())
        if found is None:
            return t if self.activations is None else self.activations.pack(t)
        if found[2] != t.dtype:
            return t
        index, base_offset, _ = found
        self._saved.add(index)
        self._packed += 1
        self._unpacks_left += 1
        return _SavedWeight(self, index, t.size(), t.stride(), t.storage_offset() - base_offset)

    def _launch(self) -> None:
        """Re-gather the parameters the frame saved (all of a block's, unless its backward reads
        fewer: a bias is not saved), in parameter order: the program's, so every rank's."""
        if self._regather is not None:
            return
        if self._held is not None:
            self._regather, self._held = self._held, None
            self._position = {index: index for index in range(len(self.weights.specs))}
            return
        saved = sorted(self._saved)
        weights = self.weights
        if len(saved) < len(weights.specs):
            specs = tuple(weights.specs[i] for i in saved)
            weights = BlockWeights(tuple(weights.shards[i] for i in saved), specs,
                                   sum(s.gathered_nbytes for s in specs))
        self._position = {index: k for k, index in enumerate(saved)}
        self._regather = launch_block_gather(weights)

    def buffer_for_backward(self, index: int) -> torch.Tensor:
        """The re-gathered padded buffer of parameter ``index`` (launches this block's gather if
        it was not prefetched, and prefetches the previous block's)."""
        if self.reached is not None and self._unpacks_left == self._packed:
            self.reached()
        self._launch()
        gather = self._regather
        previous = self.previous
        if self.prefetch and previous is not None and previous._unpacks_left:
            previous._launch()
        gather.wait()
        buffer = gather.buffers[self._position[index]]
        self._unpacks_left -= 1
        if self._unpacks_left <= 0:
            # Every saved weight is unpacked; a second backward (retain_graph) gathers again.
            self._unpacks_left = self._packed
            self._regather = None
            self.previous = None
        return buffer

    @staticmethod
    def unpack(saved: Any) -> Any:
        if isinstance(saved, OffloadedTensor):
            return OffloadedCall.unpack(saved)
        if not isinstance(saved, _SavedWeight):
            return saved
        buffer = saved.block.buffer_for_backward(saved.index)
        return buffer.as_strided(saved.size, saved.stride, buffer.storage_offset() + saved.offset)


class BlockPrefetch:
    """The gathers of one model's block frames ([Note: two blocks live]); ``run`` calls a block's
    frame with its weights."""

    def __init__(self, reducer, *, prefetch: bool, check_order: bool = False) -> None:
        self.reducer = reducer
        """The root's ``ReduceOnce`` ([Note: reduce once]): every frame's gradients go through
        it."""
        self.prefetch = prefetch
        """Launch the next block's gathers (forward) and the previous block's (backward) one block
        ahead; False: one block's weights live at a time (``FramePlan``)."""
        self._ahead: Optional[InFlightGather] = None
        """The gather launched one block ahead (producer: ``run`` of the block before; consumer:
        ``run`` of the next block, which uses it if it is the block it was launched for and
        drops it otherwise)."""
        self._last_saved: Optional[SavedBlock] = None
        """The latest block call's saved weights (producer and consumer: ``run``, which links the
        next block's to it when that block is its stack successor)."""
        self.check_order = check_order
        self._checked_calls: Optional[list[str]] = [] if check_order else None
        """The first forward's block calls so far, checked across ranks before each ([Note:
        block order check]); None once that forward ended, or with the check off (producer:
        ``run``, and ``check_next_forward``, which starts it again; consumer: ``finish_forward``,
        which ends the check)."""

    def check_next_forward(self) -> None:
        """Check the next forward's block calls across ranks too (after a re-plan decision:
        [Note: block levels] in compile/block_replan.py); nothing with the check off."""
        if self.check_order:
            self._checked_calls = []

    def finish_forward(self) -> None:
        """The model's forward ended: a gather still launched ahead (the last block called was
        not its stack's last) is finished and dropped, so nothing is held past the forward."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.wait()
        self._last_saved = None
        self._checked_calls = None

    def _check_call(self, weights: BlockWeights, label: str) -> None:
        """[Note: block order check]"""
        self._checked_calls.append(" ".join(filter(None, (f"the block of {weights.specs[0].fqn}",
                                                          label))))
        description = json.dumps({"inputs": [], "collectives": self._checked_calls})
        check_across_ranks(weights.specs[0].group_name, fingerprint_of(description), description)

    def run(self, slot: FrameSlot, frame: Callable, block: nn.Module, args: tuple,
            kwargs: dict, *, label: str = "", hold: bool = False,
            checkpointed: Optional[HeldGather] = None, prefetch_previous: bool = False,
            activations: Optional[OffloadedCall] = None,
            reached: Optional[Callable[[], None]] = None) -> Any:
        """Gather ``block``'s weights (prefetched if launched one block ahead), launch the next
        block's, and run ``frame(block, weights, args, kwargs)`` with autograd saving recipes
        instead of the weights. ``label``: what else of the call the ranks check (its frame's
        recompute level, its weights kept). ``hold``: keep the forward's gather for the block's
        backward instead of gathering again ([Note: blocks kept for backward]).
        ``checkpointed``: the call runs under an eager checkpoint ([Note: block levels] in
        compile/block_replan.py): no saved-tensor hooks of its own (the checkpoint's own keep
        nothing but the block's inputs), the forward's gather kept there when ``hold``, and in
        the recompute (backward) the block before it prefetched when ``prefetch_previous`` (it
        recomputes next). ``activations`` and ``reached``: ``SavedBlock``'s, for an offloaded
        call and for every call while any is ([Note: offloaded blocks] in block_offload.py)."""
        weights = slot.weights
        backward = in_backward()
        if self._checked_calls is not None and not backward:
            self._check_call(weights, label)
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.weights is not weights:
            ahead.wait()  # launched for a block that did not come next: finish it, drop it
            ahead = None
        if backward and checkpointed is not None and checkpointed.gather is not None:
            # The recompute of a block whose weights are kept: its forward's gather, not one
            # launched ahead.
            gather, checkpointed.gather = checkpointed.gather, None
            if ahead is not None:
                ahead.wait()
                ahead = None
        else:
            gather = ahead if ahead is not None else launch_block_gather(weights)
        if self.prefetch and not backward and slot.next is not None:
            self._ahead = launch_block_gather(slot.next)
        if (self.prefetch and backward and prefetch_previous and checkpointed is not None
                and slot.previous is not None):
            self._ahead = launch_block_gather(slot.previous)
        recorded = torch.is_grad_enabled()
        reducer = self.reducer
        generations = tuple(
            reducer.count_use(spec) if recorded and shard.requires_grad else None
            for shard, spec in zip(weights.shards, weights.specs))
        full = FrameGather.apply(gather, reducer, generations, *weights.shards)
        if not recorded or backward:
            return frame(block, full, args, kwargs)
        if checkpointed is not None:
            # The checkpoint's hooks own what the frame saves; the next block links to none.
            self._last_saved = None
            if hold:
                checkpointed.gather = gather
            del gather, ahead
            return frame(block, full, args, kwargs)
        previous = self._last_saved
        if previous is None or previous.weights is not slot.previous:
            previous = None
        saved = SavedBlock(weights, gather, previous, self.prefetch, hold=hold,
                           activations=activations, reached=reached)
        self._last_saved = saved
        del gather, ahead
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, SavedBlock.unpack):
            return frame(block, full, args, kwargs)
