"""Budgeted recompute under block frames (``zbuf.compile(model, structure="blocks",
recompute="auto")``): each block call gets a recompute level in the measured room, and each level
in use is one compiled frame.

[Note: block levels]
Under block frames no graph holds the step ([Note: one Dynamo frame per block] in
block_frames.py), so ``recompute="auto"`` cannot plan over the whole graph's regions as
recompute.py does ([Note: budgeted recompute]), nor keep gathered weights per weight as
persist.py does. It plans over the block calls instead, with the same levels and the same
planner, and keeps weights a block at a time:

1. Step 0 runs at level 0, "recompute", the user's checkpointing ([Note: measure first, then
   spend] in zbuf/memory/step.py). Level 0 shares one compiled frame with "keep" or
   "selective": the frame compiles at that level from step 0, and a
   block at level 0 runs it under an eager non-reentrant ``torch.utils.checkpoint``, its gather
   included (``BlockFrames.run``), so the checkpoint keeps the block's inputs and nothing else:
   inside it the frame runs without ``SavedBlock``'s hooks (inner hooks would take every saved
   tensor from the checkpoint's and keep all the activations). Its recompute runs in backward:
   the block gathers again on demand, launching the gather of the block before it when that
   block recomputes too (backward reaches it next; ``BlockPrefetch.run``), and a block whose
   weights are kept for backward hands its forward gather to its recompute (``HeldGather``,
   which the checkpoint's closure holds, so it dies with the graph). The recompute's gathers are
   no use of their own ([Note: reduce once]: ``count_use`` in backward), so each gradient is
   still reduce-scattered once.
   Why: each compiled level is one block compile (about 9 s at qwen3-14b on an H200), and a
   re-plan was to cost at most 20 % of the cold first compile (issue 21; 14.65 s there): with
   three frames the re-plan to "selective" and "keep" compiled two. Shared, a plan of level 0
   and the shared level compiles nothing; the third level keeps its own frame, compiled only if
   a plan uses it.
   Which level shares is chosen by the shared frame's first compile, in its partitioner, where
   the estimate below is read: the level that ``plan_block_levels`` gives the most blocks in
   the room the agreed memory predicts (the frames' memory less their pool;
   ``choose_shared_level`` in block_frames.py), "keep" on a tie or when none fits. The measured re-plan plans the same way in the measured
   room, smaller by step 0's peaks and the fragmentation, so a memory-bound model (qwen3-14b as
   rank 0 of 8 on 80 GiB keeps blocks selective and none whole: with "keep" shared, its re-plan
   compiled a second frame, 7.5 s) shares "selective", and one with room for every block
   kept (qwen3-1.7b on a whole H200) shares "keep". A wrong guess costs one block compile at
   the re-plan, what every re-plan cost before the choice. The cost of sharing "selective":
   a level-0 block's recompute in backward runs the selective frame's whole forward (one
   autograd function to the eager checkpoint, which cannot stop early inside it), the last
   projection too, whose output no backward op reads and which level 0's own frame does not
   recompute (one matmul a block more, counted on the CPU), and its backward recomputes the
   block's elementwise ops from the matmul and attention outputs once more. At qwen3-14b, mb 4,
   seq 4096 that projection is 2.9 TFLOP a block, about 4 ms on an H100: about 75 ms a step
   for the 18 blocks the default leaves at level 0, 2.8 % of it, against the re-plan's one
   compile of 5-8 s. So the default does not share (the parent placement's caller pays that
   recompute under FSDP2 as well: [Note: a block under the caller's checkpoint]).
   This is the user's level 0 only when the user's checkpoint covers the whole block call (the
   built-in decoder's ``apply_activation_checkpointing`` and Hugging Face's
   ``GradientCheckpointingLayer`` do): the shared frame's partitioner checks that every forward
   op that computes (not a view or a detach) lies in one checkpointed region and that no op there
   is saved by the user's policy (a selective checkpoint). Otherwise (``LevelEstimate.whole``
   false) level 0 falls back to a frame of its own, compiled at "recompute" as ``"checkpointed"``
   compiles, for the rest of the run (rank-agreed: the estimate is); the block calls of step 0
   that ran before the first compile's estimate (the first call) ran whole-block checkpointed,
   with the same gradients and no more activations. A block with no checkpointed region (the
   user checkpointed none) has nothing for level 0 to recompute: once the first compile finds
   none, level 0 runs the shared frame as compiled, without the eager checkpoint.
   The frame level 0 runs through (the shared one, else level 0's own) estimates the block's
   levels in its partitioner, which sees the block's joint graph before the level is applied
   (``recompute.level_specs`` on every checkpointed region of the block taken as one region:
   "recompute", "selective" with its matmul and attention outputs kept, "keep"), and what level
   0 saves per call (the shared frame's partition less what its level keeps beyond level 0). Every
   block of the stack runs that frame, so every block has those levels; a frame compiled again
   for other input shapes keeps the larger of each estimate.
2. After the measured step the re-planner's ``grow`` gets the measured room (what gathered
   weights and activations beyond step 0's may share: step 0's activations, at level 0, are in
   the measured peaks). Less the frames' pool (``FramePlan.pool_bytes``, the gathered weights),
   it is the room for kept activations, and ``plan_block_levels`` plans it over one
   ``RegionSpec`` per block, in the order the blocks were first called: ``plan_recompute``
   with ``base_bytes=0`` (the extra bytes of a level are what it keeps beyond level 0, all of it
   live together at the start of backward). Identical specs tie, and ties go to later blocks
   (the first that backward reaches): the last blocks are kept first, then made selective.
   On CUDA the plan has a third choice for the blocks it leaves at level 0: a level above 0,
   with what the block keeps at it waiting in host memory ([Note: offloaded blocks] in
   block_offload.py); such a block runs that level's frame and is named in the order check as
   offloaded.
3. Each level in use is one frame, its own copy of the frame's code object
   (``BlockFrames.frame_of``) whose partitioner applies the level to the whole block
   (``recompute.apply_levels``: "keep" drops the checkpoint tags as ``"none"`` does,
   "selective" saves the matmul and attention outputs), level 0 and the shared level sharing
   one (1). So at most two frames are ever compiled whatever the depth (three after a
   fallback), and a re-plan compiles at most one block frame (the level not shared), never the
   model; a plan of level 0 and the shared level only compiles nothing.
4. At the steady step ``settle`` checks the room again, once: if what the grown plan keeps no
   longer fits beside the pool, it keeps fewer blocks' weights, and if the activations alone do
   not fit, plans the levels again in the smaller room (fewer blocks kept) and keeps no weights.
5. What the levels leave of the room (capped by ``persist_fraction`` of it, as the whole
   graph's keep-set is) keeps gathered weights for backward, a whole block at a time: the last
   blocks forward calls keep their forward gather ([Note: blocks kept for backward] in
   block_prefetch.py), and the pool's budget grows by their bytes. Activations come first:
   a kept activation saves recompute, a kept weight only a collective. Only ``persist=True``
   keeps weights (see ``BlockReplanner._blocks_kept`` for why not by default). This is data,
   not a compile, and every structure mode takes it (``"checkpointed"`` and ``"none"`` have no
   levels to plan, only blocks to keep).

On CUDA the measured peaks include what the kept activations occupy; the CPU stand-in cannot see
activations, so ``activation_peaks`` reports the plan's kept bytes as its projection, as the
whole-graph plans project theirs.

Rank agreement: the plan is a function of the room (rank-agreed by StepMemory), the estimate
(read off a graph of the same shapes on every rank, summed in graph order: [Note: budgeted
recompute]) and the order of the block calls (the program's, checked across ranks in the first
forward: [Note: block order check] in block_prefetch.py). What could still differ is the
estimate itself (a rank whose frame came out of a cache without partitioning; the frame level 0
runs through compiles with AOTAutograd's cache off for this reason). The fallback of 1 is read
off the same estimate, so every rank falls back at the same block call. A rank at another level
would save other weights and re-gather another set of them (and a kept block re-gathers none),
so the first forward after each decision (``grow`` and ``settle``, whether or not it changed
anything: a rank that changed nothing must take part in the check of one that did) is checked
across ranks as the first forward is, each call naming its level and whether its weights are
kept: a difference stops every rank with ``ScheduleMismatchError`` instead of mixing weights.

Limits of the shared frame (1): the first level-0 block that backward reaches (the last block,
or the one before the first selective or kept block) gathers for its recompute on demand, its
gather exposed, as the first block backward reaches always was; a selective or kept block's
backward prefetches nothing for a level-0 block before it. Randomness inside the block (dropout)
is replayed by the checkpoint's ``preserve_rng_state``, untested here (the tested models have
none). The first block call of a run whose checkpoint turns out not to cover the block ran
whole-block checkpointed before the fallback (see 1).

[Note: offloaded under the step's own peak]
The default (``recompute="checkpointed"``) holds no more than the user's checkpointing: a block
kept on the device holds its activations at the step's peak, the start of backward, so it keeps
none. An offloaded block ([Note: offloaded blocks] in block_offload.py) holds device bytes only
on their way, two or three blocks' worth at most (``CopyQueue.in_flight``): in forward from
the first offloaded block's call until the queue's drain (a block after the last one, no later
than the last block: ``BlockOffload.forward_reaches`` makes the compute stream wait there for
the last copies; or the model's output, ``BlockOffload.finish_forward``), in backward from the
last offloaded block's backward on. Where the step peaks elsewhere (the user's fp32 loss
outside the model: 23 GiB at qwen3-14b, mb 4, seq 4096, after the last block's forward and
before its backward), that reserve fits under the peak, and the blocks it carries need no
recompute:

1. The measured step is profiled ([Note: progress points] in zbuf/memory/progress.py): its
   allocated peak between each two forward block calls and each two backward gradient marks,
   rank-agreed, what step 0 left resident added. Level 0's frame is compiled as the user
   checkpointed and estimates the block's levels as under ``auto`` (1 above), with
   AOTAutograd's cache off: a warm start traces the frame's joint graph again, its kernels
   still served by Inductor's cache (tests/test_warm_start.py).
2. ``grow``: the room of the reserve is the profile's peak less the highest segment where the
   reserve may be live (``reserve_ceiling``): the forward's block segments but the last block's,
   and backward's segments after its first (the loss and the start of backward; every one when
   backward has no other, so a model too small for gradient marks offloads nothing). Where the
   reserve also fits beside the last block's segment (to the model's output: its logits, not
   yet the user's fp32 loss), the queue may drain at the output, which gives the link the
   last block's forward and the output projection's to run under ([Note: the copy queue]).
   ``plan_block_levels`` plans every block at level 0 on the device (no room) and the offloaded
   ones in that room, at the level, copy queue and host memory chosen as under ``auto``; the
   offloaded blocks run that level's frame, compiled at the re-plan (one block compile).
3. ``settle``: the steady step is profiled the same way; if its peak rose above the measured
   step's by more than ``1 / SETTLE_TOLERANCE`` (the measured step also compiled; allocator
   noise), every block goes back to level 0, which compiles nothing.

What this fits is the allocated peak, not torch's cache: at qwen3-14b as rank 0 of 8 on an 80
GiB card (the plain user setup) the device peak rose from 69.86 to 74.46 GiB with 9 blocks
offloaded (the allocated peak within the measured step's), and the allocator retried once, in
step 2, never after (benches/results/onepath14.md).

Backward's first segment is left out of the room on the plan's word, not a measurement: the
reserve begins with the last offloaded call's upload, as backward reaches the block
``upload_ahead`` after it, no earlier than the last block's backward (the last block is never
offloaded), and the segment ends at the first 256 MiB of
gradients (the output projection's alone at qwen3-14b as rank 0 of 8). Where it ends later,
the settle measures what the plan did.
A block under its caller's checkpoint is planned the same way, its "selective" frame tagged by
zbuf ([Note: a block under the caller's checkpoint] in block_frames.py). Only on CUDA, as under
``auto``; on the CPU stand-in the profile sees no activations, so the reserve never fits.

[Note: a re-plan's compile pays for itself]
Where the default's plan runs its offloaded blocks at a level whose frame is not compiled yet
(the inside placement's "selective", [Note: a block under the caller's checkpoint] in
block_frames.py for the one that is), the re-plan's step compiles that frame: one block
compile, about what the first step spent beyond its run. ``grow`` takes such a plan only if the
recompute it saves a step (``RecomputePlan.saved_seconds``, modelled) adds up within
``replan_payback_steps`` steps (100 by default) to the first step's time, from the first block
call to the re-plan (the slowest rank's: every rank decides alike); otherwise every block stays
at level 0, as in the first step, nothing compiled, and the offload's record says what was
declined (``declined_for_compile``). What the program does between its first two steps (an
evaluation, a checkpoint) counts as first-step time: the check then errs towards declining,
and the record's ``first_step_s`` shows it. Measured (benches/results/onepath14.md, onepath17b.md):
at qwen3-14b as rank 0 of 8 on 80 GiB, 22 blocks offloaded make the step 0.89x FSDP2's (1.0x at
level 0), about 0.3 s a step, against a first step of 11.6-13.9 s: a compile paid for in about
40 steps. At qwen3-1.7b on one H100, 8 blocks made a step 0.3 % faster than FSDP2's with 21 ms
of copies exposed, and the re-plan's step took 16.7 s where later ones took 0.49 s, its peak
0.6 GiB above FSDP2's; the plan modelled 48.2 ms a step saved against a 12.5 s first step (260
steps), so it is declined: the first step's plan runs on, 1.00x FSDP2's step, its first step
(the final plan's) 0.82x FSDP2's, its peak 1 GiB below it.

What the whole-graph ``auto`` has and this does not: no measured partition of each candidate plan
(the levels' bytes are the estimate's; keeping whole blocks is overestimated, which errs on the
side of memory); ``activation_budget_bytes`` and an explicit ``budget_bytes`` (no measured step)
are refused (options.py).
"""

from __future__ import annotations

import collections
import time
from typing import NamedTuple, Optional

from .. import runtime
from ..host_link import measure_host_link
from ..memory import (PlanPhase, PlanPhases, Replan, StepProfile, agree_extremes,
                      host_share_bytes, pool_budget)
from .block_frames import BlockFrames
from .persist import KeepCandidate
from .recompute import LEVELS, RecomputeStats
from .recompute_plan import NO_COPIES, HostLink, RecomputePlan, plan_block_levels, queue_speed
from .replan import Replanner

__all__ = ["BlockReplanner", "ReserveRoom", "blocks_to_keep", "reserve_ceiling"]


UNBOUNDED = 1 << 62
"""Device bytes no plan runs out of: the room the arenas locked ahead are predicted in ([Note:
arenas locked ahead] in block_offload.py)."""

SETTLE_TOLERANCE = 64
"""The default's steady step may peak above the measured step by 1/64 of it (allocator noise:
the measured step compiled, the steady one did not) before its offloaded blocks go back to
level 0 ([Note: offloaded under the step's own peak])."""


class ReserveRoom(NamedTuple):
    """The measured step's own peak and the room the offloaded blocks' reserve has under it
    ([Note: offloaded under the step's own peak])."""

    peak: int
    blocks: int
    """Live in the forward's block segments but the last block's, and in backward's segments
    after its first (every one if it has no other)."""
    output: int
    """Live through the last block's segment too, to the model's output."""


def reserve_ceiling(profile: StepProfile) -> ReserveRoom:
    """The room the offloaded blocks' reserve has under ``profile``'s peak where it is live."""
    peak = max((*profile.forward, *profile.backward))
    backward = profile.backward[1:] if len(profile.backward) > 1 else profile.backward
    live = max((*profile.forward[1:-1], *backward), default=peak)
    through = max((*profile.forward[1:], *backward), default=peak)
    return ReserveRoom(peak, peak - live, peak - through)


def blocks_to_keep(blocks: int, block_bytes: int, room_bytes: int) -> int:
    """How many of ``blocks`` blocks (``block_bytes`` of gathered weights each) keep their
    weights for backward within ``room_bytes`` ([Note: block levels], 5)."""
    if block_bytes <= 0 or room_bytes <= 0:
        return 0
    return min(blocks, room_bytes // block_bytes)


class BlockReplanner:
    """The re-planner of a model under block frames: what ``zbuf.step_memory.StepMemory`` asks of
    ``replan.Replanner``, for the blocks' recompute levels and the blocks whose weights are kept
    for backward ([Note: block levels])."""

    refuse_if_no_plan_fits = staticmethod(Replanner.refuse_if_no_plan_fits)

    def __init__(self, frames: BlockFrames) -> None:
        self.frames = frames
        self.options = frames.options
        self.plans_from_profile = self.options.recompute == "checkpointed"
        """The default plans its offloaded blocks under the measured step's own peak ([Note:
        offloaded under the step's own peak])."""
        self.ceiling_bytes: Optional[int] = None
        """That peak, the profiled measured step's (producer: ``grow``; consumer: ``settle``)."""
        self.link_bytes_per_second: Optional[float] = None
        """This rank's host link speed as the copy queue counts it (producer:
        ``_rank_host_link``, once: the options' or the first probe that measured one)."""
        self.phases = PlanPhases()
        """Where the plan stands: measured, grown, settled ([Note: one planner interface] in
        zbuf/memory/planner.py)."""
        self.kept: tuple[KeepCandidate, ...] = ()
        """The weights of the blocks kept for backward, for the step's record (``StepMemory``
        reports their bytes and number)."""
        self.plan: Optional[RecomputePlan] = None
        """The levels in force, by first-call order (None: every block at level 0)."""
        self.room_bytes = 0
        """The room for kept activations the plan in force was made in."""
        self.replaced: list[RecomputeStats] = []
        """The levels each re-plan replaced, oldest first (step 0's: every block at level 0),
        for the run's record, which reports them apart from the levels in force."""

    # -- what StepMemory reads ----------------------------------------------------------------

    @property
    def kept_bytes(self) -> int:
        """Pool bytes the blocks kept for backward hold."""
        return sum(c.nbytes for c in self.kept)

    def largest_need(self) -> int:
        """The pool bytes the frames hold at most: two blocks, the parameters outside, and the
        blocks kept for backward."""
        return self.frames.plan.pool_bytes + self.kept_bytes

    def planned_budget(self) -> int:
        """What the frames' gathers may hold (``FramePlan.memory_bytes``)."""
        return self.frames.plan.memory_bytes

    @property
    def kept_activation_bytes(self) -> int:
        """Activation bytes the plan in force keeps on the device beyond level 0 (every
        block's), with what its offloaded blocks hold on their way ([Note: offloaded blocks] in
        block_offload.py)."""
        return 0 if self.plan is None else self.plan.modelled_peak_bytes

    def activation_peaks(self, *, gradients: bool = True) -> dict[str, int]:
        """The plan's projected activations beyond step 0's ([Note: block levels])."""
        kept = self.kept_activation_bytes
        return {"forward": kept, "backward": kept} if kept else {}

    def recompute_stats(self) -> Optional[RecomputeStats]:
        """The levels in force, as the whole graph's schedule records report theirs (None: no
        checkpointed region in the blocks)."""
        estimate = self.frames.estimate
        if estimate is None:
            return None
        blocks = len(self.frames.called)
        chosen = self.plan.levels if self.plan is not None else (0,) * blocks
        return RecomputeStats(
            mode=self.options.recompute, regions=blocks, regions_recomputed=chosen.count(0),
            regions_selective=chosen.count(1), regions_kept=chosen.count(2),
            regions_offloaded=0 if self.plan is None else len(self.plan.offloaded),
            activation_budget_bytes=self.room_bytes,
            requested_activation_budget_bytes=self.room_bytes,
            kept_bytes=blocks * estimate.saved_bytes + (0 if self.plan is None
                                                        else self.plan.kept_bytes),
            forward_flops=blocks * estimate.forward_flops,
            recomputed_flops=sum(estimate.levels[lv].recompute_flops for lv in chosen),
            partitions=len(set(chosen)))

    # -- re-planning --------------------------------------------------------------------------

    def _levels(self, room_bytes: int) -> Optional[RecomputePlan]:
        """The levels in ``room_bytes`` (what the activations beyond level 0 may keep)."""
        estimate = self.frames.estimate
        self.room_bytes = max(0, room_bytes)
        if estimate is None or not self.frames.called:
            return None
        return plan_block_levels(estimate.levels, len(self.frames.called), self.room_bytes,
                                 self._host_link(),
                                 moved_beside_bytes=estimate.moved_beside_level_bytes)

    def _host_link(self) -> Optional[HostLink]:
        """What offloading a block's kept activations costs, on CUDA ([Note: offloaded blocks]
        in block_offload.py): ``_rank_host_link``'s, each field agreed over the ranks (the
        least)."""
        link = self._rank_host_link()
        if link is None:
            return None
        (share, speed, forward_ns, tail_millis), _ = agree_extremes(
            self._group(), self.frames.pool.device,
            smallest=[link.host_bytes, int(link.bytes_per_second),
                      int(link.forward_seconds * 1e9), int(link.tail_forwards * 1e3)])
        return HostLink(speed, forward_ns / 1e9, share, max(1.0, tail_millis / 1e3))

    def _rank_host_link(self) -> Optional[HostLink]:
        """This rank's host link, on CUDA: a copy at the link's speed (measured here once each
        way, unless the options give it: [Note: the measured host link] in zbuf/host_link.py;
        ``queue_speed`` of the two), a
        block's forward as the last forward took it ([Note: the measured block forward] in
        block_clock.py; the cost model's flops before one ran), and half of this rank's share
        of the host's available memory (pinned memory cannot be paged out)."""
        frames = self.frames
        device = frames.pool.device
        estimate = frames.estimate
        if device.type != "cuda" or len(estimate.levels) < 2:  # no level keeps anything
            return None
        opts = self.options
        speed = self.link_bytes_per_second
        if speed is None:
            speed = opts.host_link_bytes_per_second
            if speed is None:
                probe = measure_host_link(device)
                frames.offload.link_probe = probe
                speed = queue_speed(probe.down, probe.up)
            if speed > 0:  # a probe that found no room is not kept: the next plan measures again
                self.link_bytes_per_second = speed
        forward = frames.clock.block_seconds() or estimate.forward_flops / opts.flops_per_second
        tail = frames.clock.tail_forwards() or 1.0  # before a forward ran: the last block alone
        return HostLink(speed, forward, host_share_bytes() // 2, max(1.0, tail))

    def lock_ahead(self, host_reserved_bytes: int = 0) -> None:
        """At the measured step's output, before the plan: start page-locking the host arenas of
        the blocks the default would offload with all the room it could have ([Note: arenas
        locked ahead] in block_offload.py), in half of this rank's host share less
        ``host_reserved_bytes`` (what the rest of the step may still put in host memory), as the
        plan after that step will see it."""
        frames = self.frames
        if (not self.plans_from_profile or not self.options.measuring
                or self.phases.phase != PlanPhase.MEASURING or frames.offload.locked_ahead
                or frames.estimate is None or not frames.called):
            return
        link = self._rank_host_link()
        if link is None:
            return
        if link.bytes_per_second <= 0:  # the probe found no room: the re-plan measures again
            return
        link = link._replace(host_bytes=max(0, link.host_bytes - host_reserved_bytes // 2))
        estimate = frames.estimate
        most = plan_block_levels(estimate.levels, len(frames.called), 0, link,
                                 reserve_room_bytes=UNBOUNDED, tail_room_bytes=UNBOUNDED,
                                 moved_beside_bytes=estimate.moved_beside_level_bytes)
        # A plan that would not pay for its compile in the step so far will not once the step
        # has ended ([Note: a re-plan's compile pays for itself]): it saves no more in less room.
        so_far = time.perf_counter() - frames.started_at
        if (not self._compiles_nothing(most)
                and most.saved_seconds * self.options.replan_payback_steps < so_far):
            return
        frames.offload.lock_ahead(most.offload_block_bytes, len(most.offloaded))

    def _group(self):
        """The blocks' sharding group, which the agreements run over."""
        weights = next(iter(self.frames.called.values())).weights
        return runtime.process_group(weights.specs[0].group_name)

    def _compiles_nothing(self, plan: RecomputePlan) -> bool:
        """Whether every level ``plan`` runs has its frame already."""
        return all(self.frames.has_frame(lv) for lv in set(plan.levels) if lv)

    def _pays_for_its_compile(self, plan: RecomputePlan) -> bool:
        """Whether ``plan`` compiles no frame, or saves within ``replan_payback_steps`` steps
        what the first step took ([Note: a re-plan's compile pays for itself]); a plan declined
        is recorded in the offload's report."""
        frames = self.frames
        if self._compiles_nothing(plan):
            return True
        first_step = time.perf_counter() - frames.started_at
        _, (micros,) = agree_extremes(self._group(), frames.pool.device,
                                      largest=[int(1e6 * first_step)])
        steps = self.options.replan_payback_steps
        if plan.saved_seconds * steps >= micros / 1e6:
            return True
        frames.offload.declined_for_compile = {
            "blocks": len(plan.offloaded), "saved_ms_per_step": 1e3 * plan.saved_seconds,
            "first_step_s": micros / 1e6, "payback_steps": steps,
            # Offloaded and kept on the device alike, by level: which frame it would compile.
            "levels": dict(collections.Counter(LEVELS[lv] for lv in plan.levels if lv))}
        return False

    def _blocks_kept(self, room_bytes: int, weights_room: int) -> int:
        """How many blocks keep their weights: none unless ``persist=True`` asks for them, else
        within ``weights_room`` and the persistence share of the room, as
        ``Replanner.choose_kept`` caps the whole graph's keep-set.

        Opt-in because the default path ran out of memory with them: the weights kept in the
        room measured at step 0 left torch's cache too fragmented for the next step's
        allocation of the user's logits, outside the model (the plain setup at qwen3-14b:
        benches/results/onepath14.md)."""
        if self.options.persist is not True:
            return 0
        cap = min(int(self.options.persist_fraction * room_bytes), weights_room)
        return blocks_to_keep(len(self.frames.called), self.frames.plan.block_bytes, cap)

    def _apply(self, plan: Optional[RecomputePlan], kept_blocks: int,
               before: Optional[RecomputeStats]) -> Optional[Replan]:
        """Make ``plan``'s levels and the last ``kept_blocks`` blocks' weights the frames';
        None when nothing changes. ``before``: the levels in force when the decision began
        (``recompute_stats``), kept in ``replaced`` if the levels change."""
        frames = self.frames
        order = list(frames.called)
        levels = {} if plan is None else {b: lv for b, lv in zip(order, plan.levels) if lv}
        kept = frozenset(order[len(order) - kept_blocks:]) if kept_blocks else frozenset()
        offloaded = (frozenset() if plan is None
                     else frozenset(order[p] for p in plan.offloaded))
        if (levels, kept, offloaded) == (frames.levels, frames.kept, frames.offload.offloaded):
            return None
        if levels != frames.levels and before is not None:
            self.replaced.append(before)
        compiles = any(not frames.has_frame(lv) for lv in set(levels.values()))
        frames.levels, frames.kept = levels, kept
        frames.offload.plan({b: i for i, b in enumerate(order)},
                            NO_COPIES if plan is None else plan.copy_queue,
                            0 if plan is None else plan.offload_block_bytes,
                            None if plan is None else plan.host_link)
        self.plan = plan if levels else None
        self.kept = tuple(
            KeepCandidate(spec.param_id, frames.pool.capacity_for(spec.gathered_nbytes),
                          len(order) - i, spec.pool_id)
            for i, b in enumerate(order) if b in kept for spec in frames.called[b].weights.specs)
        # The kept blocks' buffers are held beside the two blocks live ([Note: blocks kept for
        # backward] in block_prefetch.py).
        pool_budget.set_to(frames.pool,
                           frames.plan.pool_bytes + kept_blocks * frames.plan.block_bytes)
        return Replan(compiles, self.kept_bytes, len(self.kept))

    def _under_own_peak(self, profile: Optional[StepProfile]) -> Optional[RecomputePlan]:
        """The default's plan ([Note: offloaded under the step's own peak]): every block at
        level 0 on the device, the offloaded ones in what ``profile``'s peak leaves where their
        reserve is live."""
        estimate = self.frames.estimate
        self.room_bytes = 0
        if profile is None or estimate is None or not self.frames.called:
            return None
        room = reserve_ceiling(profile)
        self.ceiling_bytes = room.peak
        link = self._host_link()
        if link is None:
            return None
        return plan_block_levels(estimate.levels, len(self.frames.called), 0, link,
                                 reserve_room_bytes=room.blocks, tail_room_bytes=room.output,
                                 moved_beside_bytes=estimate.moved_beside_level_bytes)

    def grow(self, budget_bytes: int, room_bytes: int, world_size: int,
             profile: Optional[StepProfile] = None) -> Optional[Replan]:
        """After the measured step, once: the blocks' levels in ``room_bytes`` less the pool,
        then the blocks kept for backward in what is left ([Note: block levels], 2 and 5);
        the default's offloaded blocks under ``profile``'s peak. None when nothing changes
        (nothing compiled)."""
        if not self.options.measuring or not self.phases.enter(PlanPhase.GROWN):
            return None
        start = time.perf_counter()
        self.frames.prefetch.check_next_forward()  # changed or not: see the Note
        before = self.recompute_stats()
        room = room_bytes - self.frames.plan.pool_bytes
        plan = self._under_own_peak(profile) if self.plans_from_profile else self._levels(room)
        if plan is not None and self.plans_from_profile and not self._pays_for_its_compile(plan):
            plan = None
        spent = 0 if plan is None else plan.kept_bytes
        if plan is not None and not any(plan.levels):
            plan = None
        replan = self._apply(plan, self._blocks_kept(room_bytes, room - spent), before)
        self.frames.offload.planned_in_seconds = time.perf_counter() - start
        return replan

    def settle(self, budget_bytes: int, room_bytes: int, world_size: int,
               profile: Optional[StepProfile] = None) -> Optional[Replan]:
        """At the steady step, once: if what is kept no longer fits the room measured there,
        keep fewer blocks' weights, and if the activations alone do not fit, plan them again in
        it and keep no weights ([Note: block levels], 4); the default's offloaded blocks go
        back to level 0 if the steady step's ``profile`` rose above the measured step's peak."""
        if not self.phases.enter(PlanPhase.SETTLED):
            return None
        self.frames.prefetch.check_next_forward()
        before = self.recompute_stats()
        if self.plans_from_profile:
            rose = (self.plan is not None and self.ceiling_bytes is not None
                    and (profile is None or reserve_ceiling(profile).peak > self.ceiling_bytes
                         + self.ceiling_bytes // SETTLE_TOLERANCE))
            return self._apply(None, 0, before) if rose else None
        room = room_bytes - self.frames.plan.pool_bytes
        activations = self.kept_activation_bytes
        if activations + self.kept_bytes <= room:
            return None
        if activations <= room:
            kept = blocks_to_keep(len(self.frames.kept), self.frames.plan.block_bytes,
                                  room - activations)
            return self._apply(self.plan, kept, before)
        plan = self._levels(room)
        return self._apply(plan if plan is not None and any(plan.levels) else None, 0, before)
