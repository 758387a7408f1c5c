"""``zbuf.compile(model, structure="blocks")``: one Dynamo frame per repeated block, shared by
identical blocks, with the cross-block schedule carried by zbuf's runtime.

[Note: one Dynamo frame per block]
Compiled as one graph (``structure="graph"``), a model of N identical blocks is traced by
Dynamo as one frame, and AOTAutograd and Inductor do every block's work again, so the first
step's compile grows with N (benches/results/compile_time_14b.md). FSDP2 and torchtitan compile
each block's ``forward`` on its own: Dynamo's cache lives on the code object, identical blocks
pass the same guards, and the frame is traced, differentiated and lowered once whatever N is.

``structure="blocks"`` does the same for a zbuf model. Every block of a repeated stack
(``block_stacks.repeated_blocks``) gets a per-class subclass whose ``__call__`` runs the block
through one compiled function, ``BlockFrames.frame`` (``torch.compile`` of ``_frame_body``):

1. zbuf's runtime gathers the block's weights from the pool, the next block's launched one block
   ahead, and re-gathers them for backward ([Note: two blocks live] in block_prefetch.py;
   [Note: block gathers] in block_gather.py);
2. the frame receives the full weights as inputs and parameter access inside it reads them,
   keyed by shard parameter ([Note: weights gathered by the caller] in zbuf/frame_inputs.py), so
   no parameter id is a constant of the frame's graph and Dynamo guards on none: the second block
   passes the first block's guards (same class, same attribute values, tensors of the same
   shapes), and N blocks compile one graph;
3. the frame's backward returns the weights' gradients, which the runtime reduce-scatters once
   per parameter per step ([Note: reduce once] in zbuf/reduce_once.py).

The rest of the model (embedding, final norm, head, loss) runs eager, each parameter gathered on
access as eager zbuf does ([Note: eager re-gather]); at 14B the loss is one opaque chunked
operator and the rest are three small ops, what torchtitan also leaves to eager.

Blocks share the frame only while they pass its guards: a per-layer value that the block's
code reads (a layer index it branches on, a Hugging Face KV cache, which each layer updates at
its own index) makes each block a frame of its own, as it would under FSDP2's per-block compile
(training runs with ``use_cache=False``; the engines' Hugging Face decoder passes it). After
Dynamo's recompile limit (8 per code object) further variants run eager.

Each ``BlockFrames`` compiles its own copy of ``_frame_body``'s code object: Dynamo keeps its
cache and its recompile budget on the code object, so two models (or a bench's engines) in one
process neither share guards nor spend each other's recompiles.

Recompute modes: ``"checkpointed"`` runs the model's own checkpointing as written (the
built-in decoder's and Hugging Face's ``checkpoint`` are inside the block's ``__call__``, so inside
the frame, where AOTAutograd recomputes them); ``"none"`` keeps every region's activations (the
frame's partitioner drops the checkpoint tags, as ``recompute.apply_levels``' "keep" does).
``"auto"`` gives each block call a level ("recompute", "selective" or "keep") in the room the
measured step leaves: "recompute" shares one frame with "keep" or "selective" (the frame of that
level, run under an eager checkpoint at level 0; the level its first compile predicts the plan
will use most) when the block's checkpointing covers its whole call, and the other level in use
is one more copy of the frame ([Note: block levels] in block_replan.py).

[Note: a block under the caller's checkpoint]
A user who checkpoints in the parent's loop (``checkpoint(block, x, ...)`` around each block call)
calls the block frame from inside a non-reentrant checkpoint (a checkpoint the repeated block
applies itself is inside its frame: one in its ``forward``, and
``apply_activation_checkpointing``'s, whose wrappers are the repeated blocks), whose saved-tensor
hooks drop what the block saves and recompute the block in backward. The frames' own hooks
(``SavedBlock``, [Note: two blocks live] in block_prefetch.py) would replace the checkpoint's, the
innermost hooks being the ones autograd calls: every activation of every block was kept (qwen3-14b
as rank 0 of 8 ran out of memory in step 0's forward). So a block called while a caller's hooks are
the innermost ones (``regather.callers_hooks_active``; the root's own eager re-gather hooks, around
every forward of a sharded model, are not a caller's) runs as level 0 under the frames' own
checkpoint does: no hooks of its own, the caller's own what the frame saves; its recompute (in
backward, under the checkpoint's recompute hooks) gathers again, prefetching the block before it
when that one ran under the caller's hooks too (two blocks live, as in forward), or takes its
forward gather when the re-planner keeps the block's weights for backward. Caller's hooks that are
not a checkpoint (``save_on_cpu``) then receive the gathered weights as well: correct, at the bytes
they move.

The default (``recompute="checkpointed"``) plans such blocks as its own ([Note: offloaded under the
step's own peak] in block_replan.py). Their frame has no checkpointed region of its own; level 0
is the caller's recompute, which keeps the block's inputs only, and the frame's first compile,
which sees the first block call run under a caller's hooks, estimates the block as one region of
every forward op, all three levels. That frame is compiled at "selective": its ops tagged as the
user's checkpoint inside the block would tag them (``_checkpoint_whole``) before ``apply_levels``
keeps the matmul and attention outputs, and its backward recomputes the rest from them. Level 0
and "selective" share it (``_frame_level``); "keep" (the block's partition with nothing
recomputed) is a frame of its own, compiled at the re-plan that chooses it. Why "selective" and
not "keep": the caller's checkpoint runs the block's whole forward again in backward whatever the
frame saves, so a level-0 block pays for the shared frame only with its backward's recompute of
the elementwise ops (norms, rotary, the MLP's gate), and saves less in that recompute (not yet
measured on a GPU); while the plan offloads blocks at "selective" where it is memory-bound (22
blocks at qwen3-14b as rank 0 of 8), whose frame, compiled at the re-plan, made that step
8.3-10.1 s against a 2.7-2.8 s step on an H100 (with "keep" shared). At qwen3-14b as rank 0 of 8
the inside placement's "selective" saves 1.71 GB a block and the block at "keep" 3.39 GB
(benches/results/onepath14.md), so the copy queue may carry twice the blocks over the same link
(on the CPU the two placements' level estimates, offloaded blocks and bytes moved are the same:
tests/test_block_offload.py). At qwen3-14b on an
H100 that plan ran out of memory in step 2, torch's cache free in pieces, and completed once zbuf
ran torch's allocator with expandable segments ([Note: torch's allocator grows in place] in
zbuf/memory/shared.py): 22 blocks offloaded at "selective", 0.871x FSDP2's step. A block the plan
runs at "keep" or "selective" (offloaded) runs its frame under the frames' own hooks, which,
innermost, take everything it saves from the caller's: the caller's checkpoint keeps nothing of
the call and never recomputes it (tests/test_block_offload.py counts the blocks
run in backward). The cost is the model's: where the caller's region holds more than the block
call, its recompute, started by what the rest saved, runs the block's forward again (the block's
own backward still reads its own saves); under ``save_on_cpu`` level 0 recomputes nothing, so the
plan's saving is notional there (the bytes still leave the device).

Measured on CPU (benches/results/compile_structure_cpu.md; tiny blocks, aot_eager, one rank):
the first step's CPU time is 4.3 / 4.8 / 5.1 s at 2 / 8 / 16 blocks (FSDP2's per-block compile
4.5 / 5.0 / 4.9; the whole graph with blocks compiled once 8.6 / 13.8 / 21.0), one Dynamo frame
at every depth, and the same step time as the whole graph.

What the whole-graph plan gives and this structure does not (yet):
- the gather schedule is fixed (one block ahead, released after the block), not planned
  per weight within a budget; ``FramePlan`` checks it against the rank-agreed memory instead
  (and turns prefetch off when two blocks do not fit);
- weights are kept for backward a whole block at a time (the last blocks, [Note: blocks kept
  for backward] in block_prefetch.py), not per weight ranked by communication saved per
  byte; budgeted recompute per block, not per region of the whole graph, on the levels'
  estimates (not measured partitions);
- reduce-scatters are issued synchronously by the frame's backward node (``ReduceOnce``), so
  they do not overlap the next block's backward compute on a GPU;
- the order of block calls is checked across ranks in the first forward only ([Note: block
  order check] in block_prefetch.py), not on every run; the gathers outside the blocks are
  eager zbuf's, unchecked as there;
- gathers are grouped by block only: a block's are one coalesced collective on NCCL (one per
  parameter on gloo, [Note: no coalesced gathers on gloo] in runtime.py), never split or merged
  across blocks by size as the planner's coalescing does;
- nothing outside the blocks is compiled.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import time
import types
import warnings
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
from torch import nn
from torch._inductor.custom_graph_pass import CustomPartitionerFn
from torch.utils.checkpoint import CheckpointPolicy
from torch.utils.checkpoint import checkpoint as eager_checkpoint

from ..memory import pool_budget
from ..param import ShardSpec
from ..regather import callers_hooks_active
from ..frame_inputs import gathered_for_shards
from ..runtime import in_backward
from ..shard import roots
from .block_clock import BlockClock
from .block_gather import BlockWeights
from .block_offload import BlockOffload
from .block_prefetch import BlockPrefetch, FrameSlot, HeldGather
from .budget import PlanExceedsMemoryError, graph_memory
from .dynamo_settings import traced_as_zbuf
from .options import CompileOptions
from .recompute import (LEVELS, Region, apply_levels, find_regions, forward_nodes, level_specs,
                        measure_partition)
from .recompute_plan import RegionLevel, plan_block_levels
from .block_stacks import base_class, frame_class, repeated_blocks

__all__ = ["BlockFrames", "FramePlan", "LevelEstimate", "install_block_frames", "block_frames_of",
           "frame_slot_of", "NoRepeatedBlocksError"]

SHARED = -1
"""``BlockFrames``' key of the frame that level 0 shares under ``recompute="auto"``."""

_FRAMES_KEY = "_zbuf_block_frames"
"""On the model ``install_block_frames`` was given: its ``BlockFrames``."""
_SLOT_KEY = "_zbuf_frame_slot"
"""On each block: ``(FrameSlot, BlockFrames)``."""


class NoRepeatedBlocksError(ValueError):
    """``structure="blocks"`` on a model with no repeated stack of sharded blocks."""


def _frame_body(block: nn.Module, weights: tuple, args: tuple, kwargs: dict) -> Any:
    """What every block frame runs, traced by Dynamo: the block's own ``__call__`` (hooks, its
    checkpointing, ``forward``) with parameter access reading ``weights`` (``BlockWeights``
    order: ``named_parameters``, each shard once)."""
    shards = tuple(p for _, p in block.named_parameters())
    with gathered_for_shards(shards, weights):
        return base_class(block).__call__(block, *args, **kwargs)


def _frame_call(self, *args, **kwargs):
    if torch.compiler.is_compiling():
        # The caller is compiled itself (the model compiled whole around its frames): trace the
        # block as it was, parameter access gathering.
        return base_class(self).__call__(self, *args, **kwargs)
    slot, frames = self.__dict__[_SLOT_KEY]
    return frames.run(slot, self, args, kwargs)


class LevelEstimate(NamedTuple):
    """A block's recompute levels read off its frame's joint graph ([Note: block levels] in
    block_replan.py)."""

    levels: tuple[RegionLevel, ...]
    """``recompute.LEVELS`` order: the block as one region (``recompute.level_specs``)."""
    saved_bytes: int
    """Activation bytes the level-0 frame saves for backward per block call
    (``RecomputeStats.kept_bytes`` of its partition)."""
    forward_flops: float
    """Matmul and attention FLOPs of the block's forward (its partition's)."""
    whole: bool = False
    """The block's checkpointing covers its whole frame (every forward op but views and
    detaches inside one checkpointed region): level 0 can run the shared frame under an eager
    checkpoint ([Note: block levels], 1)."""
    level: int = LEVELS.index("keep")
    """The level the estimating frame was compiled at (the shared frame's chosen by
    ``choose_shared_level``)."""

    @property
    def moved_beside_level_bytes(self) -> int:
        """What an offloaded call moves beside its level's ``extra_bytes``: level 0's own saves
        (a selective policy's outputs; [Note: offloaded blocks] in block_offload.py), none
        where the checkpoint covers the whole block, whose level 0 saves its inputs only (the
        shared frame's ``saved_bytes`` is another level's partition less that level's
        estimate)."""
        return 0 if self.whole else self.saved_bytes


def choose_shared_level(levels: Sequence[RegionLevel], blocks: int,
                        room_bytes: int) -> int:
    """The level that level 0 shares its frame with ([Note: block levels], 1): of "selective"
    and "keep", the one that the plan of ``blocks`` blocks with ``levels`` in ``room_bytes`` (the
    room predicted from the agreed memory) gives the most blocks, "keep" on a tie or when it
    gives none, so that the measured re-plan, which plans the same way in the measured room,
    finds its level compiled."""
    keep = LEVELS.index("keep")
    if len(levels) <= keep:
        return keep
    chosen = collections.Counter(lv for lv in plan_block_levels(tuple(levels), blocks,
                                                                room_bytes).levels if lv)
    return max(chosen, key=lambda lv: (chosen[lv], lv)) if chosen else keep


def _block_region(graph: torch.fx.Graph, forward: set) -> Optional[Region]:
    """Every checkpointed region of a block's joint graph as one region: a block takes one
    level, whatever its checkpointing is made of."""
    regions = find_regions(graph, forward)
    if not regions:
        return None
    return Region("block", regions[0].position, tuple(n for r in regions for n in r.names))


def _whole_block(graph: torch.fx.Graph, forward: set) -> Optional[Region]:
    """Every forward op of a block's joint graph as one region: the block as its caller's
    checkpoint recomputes it ([Note: a block under the caller's checkpoint])."""
    ops = {n for n in graph.nodes if n.op == "call_function" and n in forward}
    names = tuple(n.name for n in graph.nodes if n in ops)
    return Region("block", 0, names) if names else None


def _checkpoint_whole(graph: torch.fx.Graph, region: Region) -> None:
    """Tag a caller-checkpointed block's ops as the user's checkpoint inside the block would
    (``PREFER_RECOMPUTE``, one ``ac_graph_id``), so that ``apply_levels`` can make its
    "selective" frame ([Note: a block under the caller's checkpoint]); a recomputed random op
    replays its RNG state as under the user's own checkpoint ([Note: cacheable recompute of
    seeded ops] in backend.py)."""
    by_name = {n.name: n for n in graph.nodes}
    for name in region.names:
        by_name[name].meta.update(recompute=CheckpointPolicy.PREFER_RECOMPUTE, ac_graph_id=0)


_NO_COMPUTE = frozenset({"view", "_unsafe_view", "reshape", "detach", "alias", "t", "transpose",
                         "permute", "expand", "unsqueeze", "squeeze", "slice", "select",
                         "getitem", "split", "split_with_sizes", "as_strided"})
"""Ops (by name) that compute nothing: outside the checkpointed region they do not stop the
region from covering the whole frame (``_covers_whole_frame``)."""


def _covers_whole_frame(graph: torch.fx.Graph, forward: set, region: Region) -> bool:
    """Is every forward op of the block that computes something (not a view, a detach, an
    item of a multi-output op) inside one checkpointed region, none of it saved by the user's
    policy (a selective checkpoint)? Then the user's checkpoint wraps the whole block call, as
    the built-in decoder's ``apply_activation_checkpointing`` and Hugging Face's
    ``GradientCheckpointingLayer`` do, and recomputing the whole block is what the user's
    checkpointing recomputes."""
    if len({n.meta.get("ac_graph_id") for n in graph.nodes
            if n.op == "call_function" and n in forward and "ac_graph_id" in n.meta}) != 1:
        return False
    inside = set(region.names)
    for n in graph.nodes:
        if n.op != "call_function" or n not in forward:
            continue
        if n.name in inside:
            if n.meta.get("recompute") in (CheckpointPolicy.MUST_SAVE,
                                           CheckpointPolicy.PREFER_SAVE):
                return False  # a selective policy: the user's level 0 saves this, the keep
            continue  # frame's checkpoint would recompute it
        target = getattr(n.target, "__name__", str(n.target)).split(".")[0]
        if target not in _NO_COMPUTE:
            return False
    return True


class FramePartitioner(CustomPartitionerFn):
    """The frames' partitioner: the min-cut partitioner, with every checkpointed region kept under
    ``recompute="none"``, or, under ``recompute="auto"``, the block retagged for its ``level``
    (``recompute.apply_levels`` either way, as for the whole graph); the level-0 frame also
    estimates the block's levels into ``estimates``. Plain data only: Inductor deep-copies its
    config, this included, to key its cache."""

    def __init__(self, recompute: str, level: Optional[int] = 0,
                 estimates: Optional[list[LevelEstimate]] = None,
                 options: Optional[CompileOptions] = None,
                 predicted: tuple[int, int] = (0, 0), callers: bool = False) -> None:
        self.recompute = recompute
        self.level = level
        """The level the block is retagged for; None: the shared frame's first compile, which
        chooses it (``choose_shared_level``) from the estimate and ``predicted``."""
        self.predicted = predicted
        """(blocks, room bytes): what the choice of an unset ``level`` plans over."""
        self.estimates = estimates
        """Where the estimate goes (producer: ``__call__``; consumer: the backend that made
        this partitioner, once its compile returns)."""
        self.options = options
        self.callers = callers
        """The block runs under its caller's checkpoint: with no checkpointed region of its own,
        it is estimated as one region, tagged by zbuf at "selective" ([Note: a block under the
        caller's checkpoint])."""

    def __call__(self, gm: torch.fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        kwargs.setdefault("compiler", "inductor")
        forward = forward_nodes(gm.graph, kwargs["num_fwd_outputs"])
        if self.recompute == "none":
            regions = find_regions(gm.graph, forward)
            apply_levels(gm.graph, regions, (LEVELS.index("keep"),) * len(regions))
            return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        region = _block_region(gm.graph, forward)
        callers = region is None and self.callers
        if callers:
            region = _whole_block(gm.graph, forward)
        specs = None
        whole = False
        level = LEVELS.index("keep") if self.level is None else self.level
        if region is not None:
            if self.estimates is not None:
                specs = level_specs(gm.graph, forward, [region], self.options)
                whole = callers or _covers_whole_frame(gm.graph, forward, region)
                if self.level is None:
                    level = choose_shared_level(specs[0].levels, *self.predicted)
            if callers and level == LEVELS.index("selective"):
                _checkpoint_whole(gm.graph, region)
            apply_levels(gm.graph, [region], (level,))
        names = {n.name for n in forward if n.op == "call_function"}
        fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        if specs is not None:
            stats = measure_partition("auto", names, fw, bw, self.options)
            # The level-0 bytes: what this partition saves less what its level keeps beyond
            # level 0 (the shared frame estimates for level 0 too: [Note: block levels], 1).
            levels = specs[0].levels
            # Under the caller's checkpoint level 0 holds the block's inputs only.
            saved = 0 if callers else max(
                0, stats.kept_bytes - levels[min(level, len(levels) - 1)].extra_bytes)
            self.estimates.append(LevelEstimate(specs[0].levels, saved, stats.forward_flops,
                                                whole, level))
        return fw, bw

    def uuid(self) -> str:
        return (f"zbuf-frame-partitioner:v8:{self.recompute}:{self.level}:{self.predicted}:"
                f"{self.callers}")


class FramePlan(NamedTuple):
    """The gathered bytes block frames hold at once, checked against the rank-agreed memory
    ([Note: two blocks live] in block_prefetch.py)."""

    block_bytes: int
    """Pool bytes of the largest block's weights (block capacities of its buffers)."""
    outer_bytes: int
    """Pool bytes of every parameter outside the stacks, gathered one at a time on access: their
    sum bounds what is live outside the blocks."""
    memory_bytes: int
    """What the gathers may hold: ``budget_bytes``, else the agreed free memory less the
    gradients and the margin (``budget.graph_memory``)."""
    prefetch: bool
    """One block ahead (two blocks live): asked for and fits ``memory_bytes``."""
    blocks: int
    """Blocks in the repeated stacks: a step's calls of the frames."""
    requested_bytes: int
    """What the caller asked the gathers to hold: ``memory_bytes`` unless an explicit budget was
    below one block's weights, which plans with those instead, as the whole graph's planner
    raises a budget below its floor (``schedule.Schedule.budget_bytes``)."""

    @property
    def live_bytes(self) -> int:
        """The most gathered bytes live at once under this plan."""
        return max((2 if self.prefetch else 1) * self.block_bytes, self.outer_bytes)

    @property
    def pool_bytes(self) -> int:
        """The pool's budget: the blocks' live bytes with the outer parameters' buffers cached
        beside them. The pool serves a request from the smallest idle block that fits, so on
        the first step a block's small weight can take the embedding's idle buffer; with that
        buffer counted, no gather of a step allocates outside the pool."""
        return (2 if self.prefetch else 1) * self.block_bytes + self.outer_bytes


def plan_frames(stacks_weights: Sequence[BlockWeights], outer: Sequence[ShardSpec],
                options: CompileOptions, pool) -> FramePlan:
    """The frames' plan; ``PlanExceedsMemoryError`` when one block's weights do not fit the agreed
    memory (an explicit ``budget_bytes`` is raised to them instead: the caller chose it).
    Every input is rank-invariant (shapes, options, the agreed memory): every rank plans alike."""
    block = max(sum(pool.capacity_for(s.gathered_nbytes) for s in w.specs) for w in stacks_weights)
    outer_bytes = sum(pool.capacity_for(s.gathered_nbytes) for s in outer)
    need = block + outer_bytes
    if options.budget_bytes is not None:
        requested = options.budget_bytes
        memory = max(requested, need)
    else:
        memory = requested = graph_memory(options, pool.device, options.gradient_bytes)
    if need > memory:
        raise PlanExceedsMemoryError(
            f"zbuf: structure='blocks' needs {need / 2**20:.1f} MiB of gathered weights "
            f"(one block's and the parameters outside the blocks) but every rank agreed on "
            f"{memory / 2**20:.1f} MiB; shard over more ranks, or use structure='graph', whose "
            f"planner can release each weight inside a block",
            what="one block's gathered weights", needs_bytes=need, memory_bytes=memory,
            short_of="block weights")
    return FramePlan(block, outer_bytes, memory,
                     options.prefetch and 2 * block + outer_bytes <= memory, len(stacks_weights),
                     requested)


class BlockFrames:
    """The compiled frames and the runtime schedule of one model's blocks ([Note: one Dynamo
    frame per block]): one frame per recompute level in use, "recompute" and "keep" sharing
    one under ``recompute="auto"`` ([Note: block levels] in block_replan.py), level 0's alone
    until a re-plan gives blocks another."""

    def __init__(self, options: CompileOptions, plan: FramePlan, reducer, pool, *,
                 fullgraph: bool, dynamic: Optional[bool], check_order: bool = False) -> None:
        self.options = options
        self.plan = plan
        self.pool = pool
        """The blocks' gather-buffer pool (its budget: ``plan.pool_bytes`` and the weights kept
        for backward)."""
        self.fullgraph = fullgraph
        self.dynamic = dynamic
        self.prefetch = BlockPrefetch(reducer, prefetch=plan.prefetch, check_order=check_order)
        self.graphs_compiled = 0
        """Graphs Dynamo handed this model's frame backends (one per distinct block frame and
        level)."""
        self._compiled_levels: set[int] = set()
        """Frame levels whose backend Dynamo handed a graph (producer: ``_backend``; consumer:
        ``run``, which warns once when a block ran through a frame that compiled none)."""
        self._warned_eager = False
        self.estimate: Optional[LevelEstimate] = None
        """``recompute="auto"``: the block's levels (producer: the level-0 frame's partitioner,
        the largest over its compiles; consumer: the re-planner, after the measured step)."""
        self.called: dict[int, FrameSlot] = {}
        """id(block) -> its slot, in the order of the blocks' first calls (producer: ``run``;
        consumer: the re-planner, whose plan favours later blocks)."""
        self._by_weights: dict[int, int] = {}
        """id(BlockWeights) -> id(block) (producer: ``run``; consumer: ``run``, which finds the
        block before a checkpointed one)."""
        self.levels: dict[int, int] = {}
        """id(block) -> its level when not 0 (producer: the re-planner; consumer: ``run``)."""
        self.kept: frozenset[int] = frozenset()
        """id(block) of the blocks whose forward gather is kept for backward ([Note: blocks
        kept for backward] in block_prefetch.py; producer: the re-planner; consumer:
        ``run``)."""
        self.offload = BlockOffload(pool.device)
        """The block calls whose kept activations wait in host memory ([Note: offloaded blocks]
        in block_offload.py; its plan's producer: the re-planner; consumer: ``run``)."""
        self._caller_checkpointed: dict[int, HeldGather] = {}
        """id(block) -> its forward's gather when kept, of each block whose last forward ran
        under the caller's saved-tensor hooks ([Note: a block under the caller's checkpoint];
        producer: that forward; consumer: the block's recompute, which takes it out)."""
        self.started_at: Optional[float] = None
        """When the first block call began (``time.perf_counter``; producer: ``run``; consumer:
        the re-planner, which reads the first step's time off it: [Note: a re-plan's compile
        pays for itself] in block_replan.py)."""
        self.clock = BlockClock(pool.device)
        """When each block's forward began on the device ([Note: the measured block forward] in
        block_clock.py; producer: ``run``; consumer: the re-planner's host link)."""
        self.forward_observers: list[Callable[[], None]] = []
        """Called as each block's forward begins, outside backward (producer: whoever wants the
        step's progress points, [Note: progress points] in zbuf/memory/progress.py; consumer:
        ``run``)."""
        self.finish_observers: list[Callable[[], None]] = []
        """Called at the model's output, after the frames' own bookkeeping (producer: the
        re-planner, [Note: arenas locked ahead] in block_offload.py; consumer:
        ``finish_forward``)."""
        self._frames: dict[int, Callable] = {}
        """Level (``SHARED`` for the shared frame) -> its compiled frame, each compiled on first
        use (producer and consumer: ``frame_of``)."""
        self.shared: Optional[bool] = True if options.recompute == "auto" else None
        """``recompute="auto"``: level 0 runs the shared frame under an eager checkpoint, so
        level 0 and ``shared_level`` share one compiled frame ([Note: block levels], 1). True
        until the estimate shows a block whose checkpointing does not cover its whole frame,
        then False for good (level 0 gets a frame of its own); None under the other modes."""
        self.callers_checkpoint = False
        """The first block call ran under its caller's checkpoint, and the default plans such
        blocks as their own: level 0 the caller's recompute, through the frame compiled at
        "selective" (producer: ``run``, before the first compile; consumers: ``_backend``,
        ``_frame_level``; [Note: a block under the caller's checkpoint])."""
        self.shared_level: Optional[int] = None
        """The level the shared frame is compiled at, "selective" or "keep": chosen by its first
        compile (producer: ``_backend``, from the estimate; consumer: ``_frame_level``); None
        before."""
        self.frame = self.frame_of(self._frame_level(0))
        """``frame(block, weights, args, kwargs)``: the compiled body level 0 runs through (the
        ``recompute`` mode's own; under ``auto``, the shared frame), shared by every block at
        that level."""

    def _frame_level(self, level: int) -> int:
        """The key of the frame ``level`` runs through: ``SHARED`` for level 0 while the frame
        is shared, and for the level it was compiled at (also after level 0 left it)."""
        if (level == 0 and self.shared) or level == self.shared_level:
            return SHARED
        if self.callers_checkpoint and level == LEVELS.index("selective"):
            return 0  # the caller-checkpointed frame is compiled at "selective": see the Note
        return level

    def _compiled_level(self, key: int) -> Optional[int]:
        """The level the frame ``key`` (``_frame_level``'s) is compiled at; None for the shared
        frame until its first compile chooses."""
        if key == SHARED:
            return self.shared_level
        if key == 0 and self.callers_checkpoint:
            return LEVELS.index("selective")  # [Note: a block under the caller's checkpoint]
        return key

    def frame_of(self, level: int) -> Callable:
        """The compiled body of ``level``: its own copy of ``_frame_body``'s code object, so its
        own Dynamo cache (see the Note), compiled by its first block call."""
        frame = self._frames.get(level)
        if frame is None:
            body = types.FunctionType(_frame_body.__code__.replace(), _frame_body.__globals__,
                                      "_frame_body")
            frame = traced_as_zbuf(torch.compile(body, backend=functools.partial(self._backend,
                                                                                 level),
                                                 fullgraph=self.fullgraph, dynamic=self.dynamic))
            self._frames[level] = frame
        return frame

    def schedule(self) -> dict[str, Any]:
        """The runtime schedule as a run record holds it (JSON values): what the frames gather
        and hold, under the names the whole graph's schedule records use for the same things
        (``budget_bytes``, ``peak_live_gathered_bytes``, ``live_gathered_profile``), the levels
        in force and the blocks kept for backward, by the blocks' first-call order.

        The profile is the plan's, per block call, forward then backward: the block's weights,
        the next block's gathered ahead ([Note: two blocks live] in block_prefetch.py), and
        the blocks kept for backward, held from their forward call to their backward one (the
        parameters outside the blocks, gathered one at a time, are ``outer_bytes``)."""
        plan = self.plan
        kept = [b in self.kept for b in self.called]
        n, block = len(kept), plan.block_bytes
        ahead = block if plan.prefetch else 0
        forward = [block * (sum(kept[:i]) + 1) + (ahead if i + 1 < n else 0) for i in range(n)]
        # backward: a kept block's weights are there already; another gathers again, and the
        # block before it is gathered ahead unless it is kept
        backward = [block * (sum(kept[:j + 1]) + (not kept[j]))
                    + (ahead if j > 0 and not kept[j - 1] else 0) for j in reversed(range(n))]
        profile = forward + backward
        return {"structure": "blocks", "blocks": n, "block_bytes": block,
                "outer_bytes": plan.outer_bytes, "budget_bytes": plan.memory_bytes,
                "requested_budget_bytes": plan.requested_bytes, "prefetch": plan.prefetch,
                "peak_live_gathered_bytes": max(profile + [plan.outer_bytes]),
                "live_gathered_profile": profile,
                "pool_bytes": plan.pool_bytes + sum(kept) * block,  # as BlockReplanner sets it
                "frames_compiled": self.graphs_compiled,
                "recompute": self.options.recompute,
                # Levels are recompute="auto"'s choice; otherwise every block recomputes what
                # the model's own checkpointing says (or, under "none", nothing).
                "levels": ([LEVELS[self.levels.get(b, 0)] for b in self.called]
                           if self.options.recompute != "none" else None),
                "kept_for_backward": kept,
                "activation_offload": self.offload.report(),
                # The last forward's, against the offload's planned_block_forward_ms (step 0's).
                "measured_block_forward_ms": (None if (seconds := self.clock.block_seconds())
                                              is None else 1e3 * seconds)}

    def has_frame(self, level: int) -> bool:
        """Whether ``level``'s frame exists (was asked for), compiled or about to be."""
        return self._frame_level(level) in self._frames

    def run(self, slot: FrameSlot, block: nn.Module, args: tuple, kwargs: dict) -> Any:
        """Run ``block`` through the frame of its level, its weights gathered by the prefetch."""
        if not in_backward():
            self.clock.block_started()
            for observer in self.forward_observers:
                observer()
            if not self.called:
                self.started_at = time.perf_counter()
                self.callers_checkpoint = (self.options.recompute == "checkpointed"
                                           and callers_hooks_active())
        self.called.setdefault(id(block), slot)
        self._by_weights.setdefault(id(slot.weights), id(block))
        level = self.levels.get(id(block), 0)
        hold = id(block) in self.kept
        offloaded = id(block) in self.offload.offloaded
        # What a re-plan may make differ enters the block order check ([Note: block levels]).
        label = ", ".join(([f"at level {LEVELS[level]}"] if self.options.recompute != "none"
                           else []) + (["its weights kept for backward"] if hold else [])
                          + (["its activations offloaded"] if offloaded else []))
        frame_level = self._frame_level(level)
        out = self._run(slot, block, level, self.frame_of(frame_level), label, hold, args, kwargs)
        if frame_level not in self._compiled_levels and not self._warned_eager:
            self._warned_eager = True
            warnings.warn(
                f"zbuf.compile(structure='blocks'): Dynamo compiled no graph for the frame of "
                f"{type(block).__name__} (a graph break inside the block), so every block runs "
                f"eager: correct, but slow; fullgraph=True makes the break an error that names "
                f"it", stacklevel=2)
        return out

    def _run(self, slot: FrameSlot, block: nn.Module, level: int, frame: Callable, label: str,
             hold: bool, args: tuple, kwargs: dict) -> Any:
        offload = self.offload
        offloading = bool(offload.offloaded)
        backward = in_backward()
        if offloading:
            if backward:
                offload.reached_block(id(block))  # a recompute: this block's backward begins
            else:
                offload.forward_reaches(id(block))
        if callers_hooks_active() and (level == 0 or backward):
            return self._run_under_callers_hooks(slot, block, frame, label, hold, args, kwargs)
        if level != 0 or not self.shared:
            return self.prefetch.run(
                slot, frame, block, args, kwargs, label=label, hold=hold,
                activations=(offload.start(id(block), args, kwargs)
                             if offloading and not backward else None),
                reached=functools.partial(offload.reached_block, id(block)) if offloading else None)
        # Level 0 under a shared frame ([Note: block levels], 1): the block's run, its gather
        # included, under a non-reentrant checkpoint, which keeps the block's inputs only; its
        # recompute in backward gathers again, prefetching the block before it when that one
        # recomputes too.
        previous = self._block_before(slot)
        ahead = (previous is not None and not self.levels.get(previous, 0)
                 and previous not in self.kept)
        held = HeldGather()

        def body(*a, **k):
            return self.prefetch.run(slot, frame, block, a, k, label=label, hold=hold,
                                     checkpointed=held, prefetch_previous=ahead)

        return eager_checkpoint(body, *args, use_reentrant=False, **kwargs)

    def finish_forward(self) -> None:
        self.clock.forward_finished()  # the model's output, before any wait for the copies
        self.prefetch.finish_forward()
        self.offload.finish_forward()
        for observer in self.finish_observers:
            observer()

    def _block_before(self, slot: FrameSlot) -> Optional[int]:
        """id of the block called before ``slot``'s in its stack, once it ran; else None."""
        return self._by_weights.get(id(slot.previous)) if slot.previous is not None else None

    def _run_under_callers_hooks(self, slot: FrameSlot, block: nn.Module, frame: Callable,
                                 label: str, hold: bool, args: tuple, kwargs: dict) -> Any:
        """[Note: a block under the caller's checkpoint]"""
        if not in_backward():
            held = HeldGather()
            self._caller_checkpointed[id(block)] = held
            return self.prefetch.run(slot, frame, block, args, kwargs, label=label, hold=hold,
                                     checkpointed=held)
        held = self._caller_checkpointed.pop(id(block), None)
        # The block before it recomputes next when it ran under the caller's hooks too.
        previous = self._block_before(slot)
        ahead = previous in self._caller_checkpointed and previous not in self.kept
        return self.prefetch.run(slot, frame, block, args, kwargs, label=label, hold=hold,
                                 checkpointed=held or HeldGather(), prefetch_previous=ahead)

    def _estimated(self, estimate: LevelEstimate) -> None:
        """Keep the largest of each level's bytes and seconds over the level-0 frame's compiles
        (one per input shape): every call of a block is planned as its hungriest. An estimate
        whose checkpointing does not cover the whole block ends the shared frame."""
        if self.estimate is not None:
            old = self.estimate
            estimate = LevelEstimate(
                tuple(RegionLevel(a.name, max(a.extra_bytes, b.extra_bytes),
                                  max(a.recompute_seconds, b.recompute_seconds),
                                  max(a.recompute_flops, b.recompute_flops))
                      for a, b in zip(old.levels, estimate.levels)),
                max(old.saved_bytes, estimate.saved_bytes),
                max(old.forward_flops, estimate.forward_flops), old.whole and estimate.whole,
                old.level)
        self.estimate = estimate
        if self.shared and not estimate.whole:
            # The user's checkpointing covers part of the block only: recomputing the whole
            # block would not be level 0. Level 0 falls back to a frame of its own, for good,
            # from the next block call (the estimate is rank-agreed, so every rank falls back
            # at the same call).
            self.shared = False
            self.frame = self.frame_of(0)

    def _partitioner(self, key: int,
                     estimates: Optional[list[LevelEstimate]]) -> FramePartitioner:
        """The partitioner of the frame ``key``; ``estimates``: where it puts the block's level
        estimate, None for none."""
        fixed = self._compiled_level(key)  # None: this compile chooses
        predicted = ((self.plan.blocks, self.plan.memory_bytes - self.plan.pool_bytes)
                     if fixed is None else (0, 0))
        return FramePartitioner(self.options.recompute, fixed, estimates, self.options,
                                predicted, self.callers_checkpoint)

    def _backend(self, level: int, gm: torch.fx.GraphModule, example_inputs: list):
        self.graphs_compiled += 1
        self._compiled_levels.add(level)
        recompute = self.options.recompute
        # The frame level 0 runs through estimates the levels: level 0's own, or the shared
        # frame ([Note: block levels], 1), whose first compile also chooses its level.
        estimates = recompute != "none" and level == self._frame_level(0)
        found: list[LevelEstimate] = []
        partitioner = self._partitioner(level, found if estimates else None)
        from torch._functorch import config as functorch_config

        from .backend import compile_inner

        # The level estimate reads the joint graph, which a hit in AOTAutograd's cache skips.
        no_cache = (functorch_config.patch(enable_autograd_cache=False) if estimates
                    else contextlib.nullcontext())
        with no_cache:
            compiled = compile_inner(gm, example_inputs, self.options.inner, partitioner)
        for estimate in found:  # AOTAutograd partitions while the backend compiles
            if level == SHARED and self.shared_level is None:
                self.shared_level = estimate.level  # its first compile chose it
            self._estimated(estimate)
        if estimates and not found and level == SHARED and self.shared_level is None:
            # No checkpointed region in the block: level 0 recomputes nothing, so it runs the
            # frame as compiled, without the eager checkpoint, for good (rank-agreed: every
            # rank's graph has the same regions).
            self.shared, self.shared_level = False, 0
        return compiled


def install_block_frames(model: nn.Module, options: CompileOptions, *, fullgraph: bool = False,
                         dynamic: Optional[bool] = None) -> BlockFrames:
    """Run every block of ``model``'s repeated stacks as one shared compiled frame, in place
    ([Note: one Dynamo frame per block]); the model's own forward stays eager. Sets the pool's
    budget to the plan's live bytes. Every rank must call it alike."""
    found = roots(model)
    if not found:
        raise ValueError("zbuf.compile(structure='blocks') needs a model sharded with zbuf.shard "
                         "(the frames' runtime gathers its shards); call zbuf.shard(model) first")
    root = found[0]
    if _FRAMES_KEY in model.__dict__:
        return model.__dict__[_FRAMES_KEY]
    stacks = repeated_blocks(model)
    if not stacks:
        raise NoRepeatedBlocksError(
            f"zbuf.compile(structure='blocks') found no repeated blocks in "
            f"{type(model).__name__} (an nn.ModuleList of two or more sharded modules of one "
            f"class); use structure='graph' for this model")
    specs_by_shard = {id(root.shards[pid]): spec for pid, spec in root.specs.items()}
    weights = [[BlockWeights.of(b, specs_by_shard) for b in stack] for stack in stacks]
    in_blocks = {id(p) for stack in weights for w in stack for p in w.shards}
    outer = [spec for pid, spec in root.specs.items() if id(root.shards[pid]) not in in_blocks]
    plan = plan_frames([w for stack in weights for w in stack], outer, options, root.pool)
    # The order check ends with the model's first forward: a container with no forward of its
    # own (its blocks called by the user's code) would never end it.
    check_order = options.check_fingerprint and type(model).forward is not nn.Module.forward
    frames = BlockFrames(options, plan, root.reduce_once, root.pool, fullgraph=fullgraph,
                         dynamic=dynamic, check_order=check_order)
    for stack, stack_weights in zip(stacks, weights):
        for i, block in enumerate(stack):
            slot = FrameSlot(stack_weights[i],
                             stack_weights[i + 1] if i + 1 < len(stack) else None,
                             stack_weights[i - 1] if i > 0 else None)
            block.__dict__[_SLOT_KEY] = (slot, frames)
            block.__class__ = frame_class(type(block), _frame_call)
    pool_budget.set_to(root.pool, plan.pool_bytes)
    model.__dict__[_FRAMES_KEY] = frames
    # Nothing gathered ahead outlives the forward ([Note: two blocks live]).
    model.register_forward_hook(lambda _m, _a, _o: frames.finish_forward(), always_call=True)
    return frames


def block_frames_of(model: nn.Module) -> Optional[BlockFrames]:
    """The ``BlockFrames`` that ``zbuf.compile(model, structure="blocks")`` installed, or None."""
    return model.__dict__.get(_FRAMES_KEY)


def frame_slot_of(block: nn.Module) -> Optional[FrameSlot]:
    """Where ``block`` sits among the frames (its weights, its neighbours'), or None when it does
    not run as a block frame."""
    found = block.__dict__.get(_SLOT_KEY)
    return found[0] if found is not None else None
